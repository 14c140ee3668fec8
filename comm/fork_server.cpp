#include "comm/fork_server.h"

#include "comm/fd_passing.h"
#include "comm/fork_protocol.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

namespace comm {
namespace {

namespace fp = fork_protocol;

int g_sigchld_pipe[2] = {-1, -1};

void on_sigchld(int) {
  const int saved = errno;
  const char byte = 0;
  [[maybe_unused]] const ssize_t n = write(g_sigchld_pipe[1], &byte, 1);
  errno = saved;
}

bool read_all(int fd, char* data, size_t n) {
  while (n > 0) {
    const ssize_t got = read(fd, data, n);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    data += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

struct Request {
  fp::Header header{};
  int fds[3] = {-1, -1, -1};
  std::vector<char> payload;
};

// The request on a freshly accepted connection; false when it is malformed.
bool read_request(int conn, Request& req) {
  std::vector<int> fds;
  const bool whole = recv_with_fds(conn, &req.header, sizeof req.header, 3, fds);
  if (fds.size() == 3) {
    for (int i = 0; i < 3; ++i) req.fds[i] = fds[static_cast<size_t>(i)];
  } else {
    for (int fd : fds) close(fd);
  }
  if (!whole) return false;
  if (req.header.magic != fp::kMagic || req.fds[0] < 0 || req.header.payload_bytes > (64u << 20)) return false;
  req.payload.resize(req.header.payload_bytes);
  return read_all(conn, req.payload.data(), req.payload.size());
}

void close_request_fds(Request& req) {
  for (int& fd : req.fds) {
    if (fd >= 0) close(fd);
    fd = -1;
  }
}

// In the forked test: becomes the process the client would have exec'd.
// Returns false (and the test exits 127) when the request does not parse.
bool become_test(Request& req, int& argc, char**& argv) {
  // Every descriptor the server held but the three streams received.
  std::vector<int> open_fds;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.') open_fds.push_back(std::atoi(e->d_name));
    }
    closedir(d);
  }
  for (int i = 0; i < 3; ++i) {
    if (dup2(req.fds[i], i) < 0) return false;
  }
  for (int fd : open_fds) {
    if (fd > 2) close(fd);
  }
  signal(SIGCHLD, SIG_DFL);
  signal(SIGPIPE, SIG_DFL);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  // Its own process group, which the server kills when the client goes away;
  // and it dies with the server.
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  umask(static_cast<mode_t>(req.header.umask));

  // The strings live until exit: argv and environ point into them.
  static std::vector<std::string> strings;
  const char* p = req.payload.data();
  const char* end = p + req.payload.size();
  auto next = [&](std::string& out) {
    const void* nul = std::memchr(p, '\0', static_cast<size_t>(end - p));
    if (nul == nullptr) return false;
    out.assign(p, static_cast<const char*>(nul));
    p = static_cast<const char*>(nul) + 1;
    return true;
  };
  std::string cwd;
  if (!next(cwd) || chdir(cwd.c_str()) != 0) return false;
  strings.resize(req.header.argc + req.header.envc);
  for (auto& s : strings) {
    if (!next(s)) return false;
  }
  static std::vector<char*> new_argv;
  for (uint32_t i = 0; i < req.header.argc; ++i) new_argv.push_back(strings[i].data());
  new_argv.push_back(nullptr);
  clearenv();
  for (uint32_t i = 0; i < req.header.envc; ++i) putenv(strings[req.header.argc + i].data());
  argc = static_cast<int>(req.header.argc);
  argv = new_argv.data();
  return true;
}

int listen_on(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path) return -1;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  unlink(path.c_str());  // a dead server's; the lock says no live one has it
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || listen(fd, 64) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

bool can_connect(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), std::min(path.size() + 1, sizeof addr.sun_path - 1));
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const bool ok = fd >= 0 && connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  if (fd >= 0) close(fd);
  return ok;
}

// SHARDKIT_TEST_READY_FD: the pipe the client that started this server
// reads to its end; closed once clients can connect (or never will).
void say_ready(int ready_fd) {
  if (ready_fd >= 0) close(ready_fd);
}

// The server's loop; returns only in a forked test (true) or never.
bool serve(const std::string& path, int ready_fd, int& argc, char**& argv) {
  chdir("/");  // holds no test's directory (nor a mount below one)
  const int lock = open((path + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (lock < 0) _exit(3);
  if (flock(lock, LOCK_EX | LOCK_NB) != 0) {
    // Another server of this binary is starting or running: the client may
    // connect once it listens.
    for (int i = 0; i < 600 && !can_connect(path); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    _exit(0);
  }
  const int listener = listen_on(path);
  if (listener < 0) _exit(3);
  if (pipe2(g_sigchld_pipe, O_NONBLOCK | O_CLOEXEC) != 0) _exit(3);
  struct sigaction sa {};
  sa.sa_handler = on_sigchld;
  sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGCHLD, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
  say_ready(ready_fd);

  struct Test {
    int conn;
    bool client_gone = false;
  };
  std::map<pid_t, Test> tests;
  auto last_busy = std::chrono::steady_clock::now();
  for (;;) {
    std::vector<pollfd> fds{{listener, POLLIN, 0}, {g_sigchld_pipe[0], POLLIN, 0}};
    std::vector<pid_t> watched;
    for (const auto& [pid, t] : tests) {
      if (t.client_gone) continue;
      fds.push_back({t.conn, POLLRDHUP, 0});
      watched.push_back(pid);
    }
    const int n = poll(fds.data(), fds.size(), 1000);
    if (n < 0 && errno != EINTR) _exit(3);
    if (fds[1].revents & POLLIN) {
      char drain[64];
      while (read(g_sigchld_pipe[0], drain, sizeof drain) > 0) {
      }
    }
    // Tests that ended: their status to their client.
    for (;;) {
      int status = 0;
      const pid_t pid = waitpid(-1, &status, WNOHANG);
      if (pid <= 0) break;
      auto it = tests.find(pid);
      if (it == tests.end()) continue;
      if (!it->second.client_gone) {
        const int32_t s = status;
        [[maybe_unused]] const ssize_t w = send(it->second.conn, &s, sizeof s, MSG_NOSIGNAL);
      }
      close(it->second.conn);
      tests.erase(it);
      last_busy = std::chrono::steady_clock::now();
    }
    // A client that went away (ctest's timeout kill): its test and what the
    // test started go too.
    for (size_t i = 2; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR))) continue;
      auto it = tests.find(watched[i - 2]);
      if (it == tests.end()) continue;
      it->second.client_gone = true;
      kill(-it->first, SIGKILL);
      kill(it->first, SIGKILL);
    }
    if (fds[0].revents & POLLIN) {
      const int conn = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
      if (conn >= 0) {
        Request req;
        if (!read_request(conn, req)) {
          close_request_fds(req);
          close(conn);
          continue;
        }
        const pid_t pid = fork();
        if (pid == 0) {
          if (!become_test(req, argc, argv)) _exit(127);
          return true;
        }
        close_request_fds(req);
        if (pid < 0) {
          close(conn);
          continue;
        }
        const uint32_t started = fp::kMagic;
        [[maybe_unused]] const ssize_t w = send(conn, &started, sizeof started, MSG_NOSIGNAL);
        tests[pid] = Test{conn};
        last_busy = std::chrono::steady_clock::now();
      }
    }
    if (tests.empty() &&
        std::chrono::steady_clock::now() - last_busy > std::chrono::seconds(fp::kIdleSeconds)) {
      unlink(path.c_str());
      _exit(0);
    }
  }
}

}  // namespace

void serve_forks_if_asked(int& argc, char**& argv) {
  const char* serve_path = std::getenv("SHARDKIT_TEST_SERVE");
  if (serve_path == nullptr) return;
  const std::string path = serve_path;
  const char* ready = std::getenv("SHARDKIT_TEST_READY_FD");
  const int ready_fd = ready != nullptr ? std::atoi(ready) : -1;
  unsetenv("SHARDKIT_TEST_SERVE");
  unsetenv("SHARDKIT_TEST_READY_FD");
  if (serve(path, ready_fd, argc, argv)) return;
  _exit(3);
}

}  // namespace comm
