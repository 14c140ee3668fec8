// test_fork BINARY [ARGS...]: runs a test binary as if exec'd with ARGS, by
// asking the binary's fork server (fork_server.h) for a fork, and exits as the
// test did. It starts the server when none answers, and execs BINARY itself
// when none can start or SHARDKIT_TEST_FORKSERVER=0. ctest runs every
// test of a test binary through it (tests/CMakeLists.txt: the binaries'
// CROSSCOMPILING_EMULATOR). No LibTorch here: that is the point.
#include "comm/fork_protocol.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace {

namespace fp = comm::fork_protocol;

[[noreturn]] void exec_directly(char** argv) {
  execv(argv[1], argv + 1);
  std::fprintf(stderr, "test_fork: cannot run %s: %s\n", argv[1], std::strerror(errno));
  _exit(127);
}

// One server per build of the binary: the socket's name hashes its real path,
// inode, size and modification time (FNV-1a), so a rebuilt binary gets a
// server of its own and the old one idles out.
std::string socket_path(const char* binary) {
  char real[PATH_MAX];
  struct stat st {};
  if (realpath(binary, real) == nullptr || stat(real, &st) != 0) return "";
  const std::string key = std::string(real) + "|" + std::to_string(st.st_ino) + "|" + std::to_string(st.st_size) +
                          "|" + std::to_string(st.st_mtim.tv_sec) + "." + std::to_string(st.st_mtim.tv_nsec);
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : key) h = (h ^ c) * 1099511628211ull;
  char name[96];
  std::snprintf(name, sizeof name, "/tmp/shardkit-test-fork-%u-%016llx.sock", static_cast<unsigned>(getuid()),
                static_cast<unsigned long long>(h));
  return name;
}

int connect_to(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) return fd;
  close(fd);
  return -1;
}

// Starts a server of `binary` on `path`, outside this process's tree (ctest
// kills a timed-out test's descendants), and waits until it listens or gave up.
void start_server(const char* binary, const std::string& path) {
  int ready[2];
  if (pipe(ready) != 0) return;
  const pid_t pid = fork();
  if (pid == 0) {
    close(ready[0]);
    setsid();
    if (fork() != 0) _exit(0);
    const int null = open("/dev/null", O_RDWR);
    for (int i = 0; i < 3; ++i) dup2(null, i);
    setenv("SHARDKIT_TEST_SERVE", path.c_str(), 1);
    setenv("SHARDKIT_TEST_READY_FD", std::to_string(ready[1]).c_str(), 1);
    execl(binary, binary, static_cast<char*>(nullptr));
    _exit(127);
  }
  close(ready[1]);
  if (pid > 0) waitpid(pid, nullptr, 0);
  // Until the end of the stream: a stale errno must not keep this loop going.
  for (char byte;;) {
    const ssize_t n = read(ready[0], &byte, 1);
    if (n == 0 || (n < 0 && errno != EINTR)) break;
  }
  close(ready[0]);
}

bool send_request(int conn, int argc, char** argv) {
  std::string payload;
  char cwd[PATH_MAX];
  if (getcwd(cwd, sizeof cwd) == nullptr) return false;
  payload.append(cwd).push_back('\0');
  payload.append(argv[1]).push_back('\0');  // the test's argv[0]: the binary
  for (int i = 2; i < argc; ++i) payload.append(argv[i]).push_back('\0');
  uint32_t envc = 0;
  for (char** e = environ; *e != nullptr; ++e, ++envc) payload.append(*e).push_back('\0');
  const mode_t mask = umask(0);
  umask(mask);
  fp::Header header{fp::kMagic, static_cast<uint32_t>(mask), static_cast<uint32_t>(argc - 1), envc, payload.size()};
  int fds[3] = {0, 1, 2};
  iovec iov{&header, sizeof header};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof fds)];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof fds);
  std::memcpy(CMSG_DATA(c), fds, sizeof fds);
  if (sendmsg(conn, &msg, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof header)) return false;
  const char* p = payload.data();
  size_t left = payload.size();
  while (left > 0) {
    const ssize_t n = send(conn, p, left, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    left -= static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: test_fork BINARY [ARGS...]\n");
    return 2;
  }
  const char* off = std::getenv("SHARDKIT_TEST_FORKSERVER");
  if (off != nullptr && std::string(off) == "0") exec_directly(argv);
  const std::string path = socket_path(argv[1]);
  if (path.empty()) exec_directly(argv);
  int conn = connect_to(path);
  if (conn < 0) {
    start_server(argv[1], path);
    conn = connect_to(path);
  }
  if (conn < 0) exec_directly(argv);  // no server: the test runs all the same
  if (!send_request(conn, argc, argv)) {
    close(conn);
    exec_directly(argv);  // nothing ran: a server on its way out closed on us
  }
  // recv_exactly: false at the end of the stream.
  auto recv_exactly = [conn](void* out, size_t size) {
    char* p = static_cast<char*>(out);
    size_t got = 0;
    while (got < size) {
      const ssize_t n = recv(conn, p + got, size - got, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      got += static_cast<size_t>(n);
    }
    return true;
  };
  uint32_t started = 0;
  if (!recv_exactly(&started, sizeof started) || started != fp::kMagic) {
    close(conn);
    exec_directly(argv);  // nothing ran
  }
  int32_t status = 0;
  if (!recv_exactly(&status, sizeof status)) {
    std::fprintf(stderr, "test_fork: the fork server of %s closed without the test's status\n", argv[1]);
    return 1;
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) {
    // Die the same way, so that ctest reports what it would have (no core).
    const int sig = WTERMSIG(status);
    rlimit none{0, 0};
    setrlimit(RLIMIT_CORE, &none);
    signal(sig, SIG_DFL);
    raise(sig);
    return 128 + sig;
  }
  return 1;
}
