#include "reliability/process.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace reliability {

namespace {

void sleep_seconds(double s) { std::this_thread::sleep_for(std::chrono::duration<double>(s)); }

}  // namespace

double monotonic_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int decode_wait_status(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

Process::Process(const std::vector<std::string>& argv, const EnvVars& env,
                 const std::string& output_path) {
  // Everything the child needs is prepared before fork (no allocation after).
  std::vector<std::string> env_storage;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string var(*e);
    std::string name = var.substr(0, var.find('='));
    bool overridden = false;
    for (const auto& kv : env) overridden = overridden || kv.first == name;
    if (!overridden) env_storage.push_back(var);
  }
  for (const auto& [k, v] : env) env_storage.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& s : env_storage) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_storage = argv;
  std::vector<char*> args;
  for (auto& s : argv_storage) args.push_back(s.data());
  args.push_back(nullptr);

  const int out_fd = ::open(output_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (out_fd < 0) throw std::runtime_error("cannot open " + output_path + ": " + std::strerror(errno));
  const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  const pid_t parent = getpid();
  start_s_ = monotonic_s();
  pid_ = fork();
  if (pid_ == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(126);
    dup2(null_fd, 0);
    dup2(out_fd, 1);
    dup2(out_fd, 2);
    execve(args[0], args.data(), envp.data());
    const char* msg = "reliability: exec failed\n";
    ssize_t ignored = ::write(2, msg, std::strlen(msg));
    (void)ignored;
    _exit(127);
  }
  const int fork_errno = errno;
  ::close(out_fd);
  if (null_fd >= 0) ::close(null_fd);
  if (pid_ < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(fork_errno));
}

Process::~Process() {
  if (!status_) {
    kill_tree();
    int st = 0;
    waitpid(pid_, &st, 0);
  }
}

std::optional<int> Process::poll() {
  if (status_) return status_;
  int st = 0;
  const pid_t r = waitpid(pid_, &st, WNOHANG);
  if (r == pid_) status_ = decode_wait_status(st);
  return status_;
}

int Process::wait_for(double timeout_s, bool* timed_out) {
  if (timed_out != nullptr) *timed_out = false;
  const double deadline = monotonic_s() + timeout_s;
  while (!poll()) {
    if (monotonic_s() > deadline) {
      if (timed_out != nullptr) *timed_out = true;
      kill_tree();
      int st = 0;
      waitpid(pid_, &st, 0);
      status_ = decode_wait_status(st);
      break;
    }
    sleep_seconds(0.01);
  }
  return *status_;
}

void Process::kill_tree() {
  if (status_) return;
  const std::vector<pid_t> kids = child_pids(pid_);
  ::kill(pid_, SIGSTOP);  // no new children while we collect them
  for (pid_t k : child_pids(pid_)) ::kill(k, SIGKILL);
  for (pid_t k : kids) ::kill(k, SIGKILL);
  ::kill(pid_, SIGKILL);
}

void Process::signal(int sig) {
  if (!status_) ::kill(pid_, sig);
}

double Process::seconds_since_start() const { return monotonic_s() - start_s_; }

std::vector<pid_t> child_pids(pid_t parent) {
  std::vector<pid_t> out;
  DIR* d = opendir("/proc");
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    char* end = nullptr;
    const long pid = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0') continue;
    std::ifstream stat("/proc/" + std::string(e->d_name) + "/stat");
    std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    // pid (comm) state ppid ...; comm may contain spaces and parentheses.
    const size_t close = text.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(text.substr(close + 1));
    std::string state;
    long ppid = 0;
    rest >> state >> ppid;
    if (ppid == parent) out.push_back(static_cast<pid_t>(pid));
  }
  closedir(d);
  return out;
}

int rank_of(pid_t pid) {
  std::ifstream env("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
  std::string var;
  while (std::getline(env, var, '\0')) {
    if (var.rfind("RANK=", 0) == 0) return std::atoi(var.c_str() + 5);
  }
  return -1;
}

pid_t wait_for_rank_pid(pid_t launcher, int rank, double timeout_s) {
  const double deadline = monotonic_s() + timeout_s;
  do {
    for (pid_t p : child_pids(launcher)) {
      // Between fork and exec the child still has the launcher's environment.
      if (rank_of(p) == rank) return p;
    }
    sleep_seconds(0.005);
  } while (monotonic_s() < deadline);
  return -1;
}

bool process_alive(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return false;
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')');
  if (close == std::string::npos || close + 2 >= text.size()) return false;
  return text[close + 2] != 'Z' && text[close + 2] != 'X';
}

int wait_gone_or_kill(const std::vector<pid_t>& pids, double timeout_s) {
  const double deadline = monotonic_s() + timeout_s;
  for (;;) {
    bool any = false;
    for (pid_t p : pids) any = any || process_alive(p);
    if (!any) return 0;
    if (monotonic_s() > deadline) break;
    sleep_seconds(0.02);
  }
  int killed = 0;
  for (pid_t p : pids) {
    if (process_alive(p) && ::kill(p, SIGKILL) == 0) ++killed;
  }
  for (int i = 0; i < 200; ++i) {
    bool any = false;
    for (pid_t p : pids) any = any || process_alive(p);
    if (!any) break;
    sleep_seconds(0.01);
  }
  return killed;
}

RunResult run_process(const std::vector<std::string>& argv, const EnvVars& env, double timeout_s,
                      const std::string& output_path) {
  RunResult r;
  {
    std::ofstream truncate(output_path, std::ios::trunc);
  }
  Process p(argv, env, output_path);
  r.exit_code = p.wait_for(timeout_s, &r.timed_out);
  r.seconds = p.seconds_since_start();
  r.output = read_text_file(output_path);
  return r;
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

}  // namespace reliability
