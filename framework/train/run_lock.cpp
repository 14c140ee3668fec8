#include "framework/train/run_lock.h"

#include "checkpoint/tiers/local_tier.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>

namespace framework::train {

namespace {

std::string read_holder(int fd) {
  char buf[256] = {};
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  std::string text = n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  return text;
}

std::string describe_holder(const std::string& holder) {
  const size_t space = holder.find(' ');
  if (holder.empty() || space == std::string::npos) return "a process that left no pid";
  return "pid " + holder.substr(0, space) + " on " + holder.substr(space + 1);
}

std::string host_name() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) return "unknown host";
  return host;
}

}  // namespace

std::unique_ptr<RunDirLock> RunDirLock::acquire(const std::string& run_dir,
                                                const std::string& key) {
  namespace fs = std::filesystem;
  std::vector<std::string> made_dirs;
  for (fs::path p = fs::absolute(run_dir).lexically_normal(); !p.empty() && !fs::exists(p);
       p = p.parent_path()) {
    made_dirs.push_back(p.string());
    if (p == p.parent_path()) break;
  }
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  if (ec) throw std::runtime_error("cannot create " + key + " " + run_dir + ": " + ec.message());
  const std::string path = (fs::path(run_dir) / ".lock").string();
  const bool made_file = !fs::exists(path);
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw std::runtime_error("cannot open " + path + ": " + std::strerror(errno) +
                             " (is " + key + " writable?)");
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    const std::string holder = read_holder(fd);
    ::close(fd);
    if (err == EWOULDBLOCK) {
      throw RunDirBusy(key + " " + run_dir + " is in use by another job (" +
                       describe_holder(holder) + "); wait for it to end, or set another " + key);
    }
    throw std::runtime_error("cannot lock " + path + ": " + std::strerror(err));
  }
  const std::string me = std::to_string(::getpid()) + " " + host_name() + "\n";
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, me.data(), me.size(), 0) < 0) {
    // The lock holds without the note; a second job just names no pid.
  }
  return std::unique_ptr<RunDirLock>(new RunDirLock(fd, path, std::move(made_dirs), made_file));
}

RunDirLock::~RunDirLock() { ::close(fd_); }

void RunDirLock::share_with_children() {
  const int flags = ::fcntl(fd_, F_GETFD);
  if (flags >= 0) ::fcntl(fd_, F_SETFD, flags & ~FD_CLOEXEC);
}

std::vector<std::unique_ptr<RunDirLock>> lock_job_dirs(const std::string& run_dir,
                                                        const std::string& checkpoint_dir) {
  namespace fs = std::filesystem;
  std::vector<std::unique_ptr<RunDirLock>> locks;
  locks.push_back(RunDirLock::acquire(run_dir, "run.dir"));
  if (!checkpoint_dir.empty()) {
    const fs::path run = fs::absolute(run_dir).lexically_normal();
    const fs::path ckpt = fs::absolute(checkpoint_dir).lexically_normal();
    const auto rel = ckpt.lexically_relative(run);
    const bool inside_run_dir = !rel.empty() && *rel.begin() != "..";
    if (!inside_run_dir) {
      try {
        locks.push_back(RunDirLock::acquire(checkpoint_dir, "checkpoint.dir"));
      } catch (...) {
        locks.front()->remove_if_unused();  // leave nothing behind
        throw;
      }
    }
  }
  return locks;
}

void RunDirLock::remove_if_unused() {
  if (made_file_) ::unlink(path_.c_str());
  for (const std::string& dir : made_dirs_) {
    if (::rmdir(dir.c_str()) != 0) break;  // not empty: something else is there now
  }
}

std::vector<std::unique_ptr<RunDirLock>> lock_local_tier_dirs(const std::string& pattern,
                                                               const std::vector<int>& nodes) {
  std::vector<std::unique_ptr<RunDirLock>> locks;
  if (pattern.empty()) return locks;
  try {
    for (int node : nodes) {
      locks.push_back(RunDirLock::acquire(checkpoint::local_tier_dir(pattern, node), "checkpoint.local.dir"));
    }
  } catch (...) {
    for (auto& lock : locks) lock->remove_if_unused();  // leave nothing behind
    throw;
  }
  return locks;
}

}  // namespace framework::train
