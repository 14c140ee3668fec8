#include "comm/local_launcher.h"

#include "comm/fd_passing.h"
#include "comm/launch_env.h"

#include <filesystem>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

extern char** environ;

namespace comm {
namespace {

using Clock = std::chrono::steady_clock;

// A line longer than this is forwarded in pieces rather than buffered forever.
constexpr size_t kMaxPendingLine = 64 * 1024;
// After the last rank is reaped, how long to wait for EOF on its pipes (a
// daemonised grandchild may hold them open forever).
constexpr std::chrono::milliseconds kDrainAfterExit{1000};
// Fallback tick: waitpid() is polled even if a SIGCHLD wake-up were lost.
constexpr int kPollTickMs = 200;
constexpr double kMaxGraceS = 365.0 * 24 * 3600;

std::string errno_text(int err) { return std::strerror(err); }

[[noreturn]] void throw_errno(const std::string& what) {
  throw std::runtime_error("launcher: " + what + ": " + errno_text(errno));
}

void write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;  // Nowhere left to report a broken stdout/stderr.
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
}

void write_all(int fd, const std::string& text) {
  write_all(fd, text.data(), text.size());
}

std::string signal_name(int sig) {
  switch (sig) {
    case SIGHUP: return "SIGHUP";
    case SIGINT: return "SIGINT";
    case SIGQUIT: return "SIGQUIT";
    case SIGILL: return "SIGILL";
    case SIGTRAP: return "SIGTRAP";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGKILL: return "SIGKILL";
    case SIGUSR1: return "SIGUSR1";
    case SIGSEGV: return "SIGSEGV";
    case SIGUSR2: return "SIGUSR2";
    case SIGPIPE: return "SIGPIPE";
    case SIGALRM: return "SIGALRM";
    case SIGTERM: return "SIGTERM";
    case SIGXCPU: return "SIGXCPU";
    case SIGXFSZ: return "SIGXFSZ";
    case SIGSYS: return "SIGSYS";
    default: {
      const char* text = strsignal(sig);
      return text != nullptr ? text : "unknown signal";
    }
  }
}

// ---------------------------------------------------------------------------
// Signals. The handlers only write the signal number into a non-blocking
// self-pipe; the poll loop does the real work.

volatile sig_atomic_t g_signal_pipe_write = -1;

extern "C" void note_signal(int sig) {
  int saved_errno = errno;
  unsigned char byte = static_cast<unsigned char>(sig);
  if (g_signal_pipe_write >= 0) {
    ssize_t ignored = ::write(g_signal_pipe_write, &byte, 1);
    (void)ignored;  // Pipe full: a wake-up is already pending.
  }
  errno = saved_errno;
}

constexpr int kHandledSignals[] = {SIGINT, SIGTERM, SIGCHLD};

void set_cloexec_nonblock(int fd, bool nonblock) {
  int fd_flags = fcntl(fd, F_GETFD);
  fcntl(fd, F_SETFD, fd_flags | FD_CLOEXEC);
  if (nonblock) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

// A close-on-exec pipe whose ends are both >= 3, so dup2() onto 0..2 in the
// child never clobbers another pipe end even if the launcher's own standard
// fds were closed.
void make_pipe(int fds[2]) {
  if (pipe2(fds, O_CLOEXEC) != 0) throw_errno("pipe2");
  for (int i = 0; i < 2; ++i) {
    if (fds[i] < 3) {
      int moved = fcntl(fds[i], F_DUPFD_CLOEXEC, 3);
      if (moved < 0) throw_errno("fcntl(F_DUPFD_CLOEXEC)");
      ::close(fds[i]);
      fds[i] = moved;
    }
  }
}

// Installs the handlers for the launcher's lifetime and restores the previous
// ones (and closes the self-pipe) on destruction, also on exceptions.
class SignalRedirect {
 public:
  SignalRedirect() {
    if (g_signal_pipe_write >= 0) {
      throw std::logic_error("run_local_launcher: already running");
    }
    make_pipe(pipe_);
    set_cloexec_nonblock(pipe_[0], true);
    set_cloexec_nonblock(pipe_[1], true);
    g_signal_pipe_write = pipe_[1];
    struct sigaction action {};
    action.sa_handler = note_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    for (size_t i = 0; i < std::size(kHandledSignals); ++i) {
      sigaction(kHandledSignals[i], &action, &previous_[i]);
    }
  }
  ~SignalRedirect() {
    for (size_t i = 0; i < std::size(kHandledSignals); ++i) {
      sigaction(kHandledSignals[i], &previous_[i], nullptr);
    }
    g_signal_pipe_write = -1;
    ::close(pipe_[0]);
    ::close(pipe_[1]);
  }
  SignalRedirect(const SignalRedirect&) = delete;
  SignalRedirect& operator=(const SignalRedirect&) = delete;

  int read_fd() const { return pipe_[0]; }
  // For the child between fork and exec: put the caller's dispositions back
  // (exec then resets caught ones to default and keeps ignored ones ignored,
  // as if the launcher were not there).
  void restore_in_child() const {
    for (size_t i = 0; i < std::size(kHandledSignals); ++i) {
      sigaction(kHandledSignals[i], &previous_[i], nullptr);
    }
  }

 private:
  int pipe_[2] = {-1, -1};
  struct sigaction previous_[std::size(kHandledSignals)] {};
};

// ---------------------------------------------------------------------------
// Ranks.

struct OutputStream {
  int fd = -1;       // read end of the rank's pipe; -1 after EOF
  int target = 1;    // launcher fd the lines go to
  std::string pending;
};

struct Rank {
  int index = 0;
  pid_t pid = -1;
  bool running = false;
  OutputStream out;
  OutputStream err;
};

// Everything the child needs, prepared before fork() so the child only makes
// async-signal-safe calls (the caller may have other threads).
struct ExecPlan {
  std::vector<std::string> argv_storage;
  std::vector<char*> argv;
  std::vector<std::string> env_storage;
  std::vector<char*> envp;
  std::string exec_error_prefix;
  std::vector<int> inherited_fds;  // ascending, all >= 3
  long open_max = 0;               // for close_other_fds without close_range
  int standby_fd = -1;             // a standby's socket: inherited across exec
};

// The fds >= 3 that a child of this process would inherit now.
std::vector<int> inheritable_fds() {
  std::vector<int> fds;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    const int fd = std::atoi(entry.path().filename().c_str());
    const int flags = fcntl(fd, F_GETFD);
    if (fd >= 3 && flags >= 0 && (flags & FD_CLOEXEC) == 0) fds.push_back(fd);
  }
  std::sort(fds.begin(), fds.end());
  return fds;
}

// In the child: closes fds lo..hi. Async-signal-safe.
void close_fd_range(unsigned lo, unsigned hi, long open_max) {
  if (lo > hi) return;
#ifdef SYS_close_range
  if (syscall(SYS_close_range, lo, hi, 0) == 0) return;
#endif
  for (unsigned long fd = lo; fd <= hi && fd < static_cast<unsigned long>(open_max); ++fd) {
    ::close(static_cast<int>(fd));
  }
}

// In the child, after the dup2()s: closes every fd >= 3 except `keep`
// (ascending). Async-signal-safe: reads the prepared vector only.
void close_other_fds(const std::vector<int>& keep, long open_max) {
  unsigned next = 3;
  for (int fd : keep) {
    close_fd_range(next, static_cast<unsigned>(fd) - 1, open_max);
    next = static_cast<unsigned>(fd) + 1;
  }
  close_fd_range(next, ~0U, open_max);
}

// ---------------------------------------------------------------------------
// Rank templates (fork_rank_templates in local_launcher.h).

struct RankTemplate {
  pid_t pid = -1;
  int control_fd = -1;  // the launcher's end of the template's socket
};
// Forked by fork_rank_templates(), taken by the next launcher's first attempt.
std::vector<RankTemplate> g_templates;

// What an activation sends: this header (with the fds as SCM_RIGHTS), then
// `payload` bytes: `fds` target fd numbers (int32 each), then NUL-ended
// strings: argc, the argv, envc, the environment.
struct TemplateHeader {
  uint32_t magic = 0x524b5431;  // "RKT1"
  uint32_t fds = 0;
  uint64_t payload = 0;
};
// SCM_RIGHTS carries at most this many fds (SCM_MAX_FD).
constexpr size_t kMaxTemplateFds = 250;

void stop_templates() noexcept {
  for (RankTemplate& t : g_templates) {
    ::close(t.control_fd);  // it reads EOF and exits 0
    kill(t.pid, SIGKILL);   // at once, whatever it was doing
    waitpid(t.pid, nullptr, 0);
  }
  g_templates.clear();
}

// The block /proc/self/environ reads (env_start and env_end of
// /proc/self/stat, fields 50 and 51); {nullptr, 0} if unknown.
std::pair<char*, size_t> environ_block() {
  std::FILE* f = std::fopen("/proc/self/stat", "r");
  if (f == nullptr) return {nullptr, 0};
  std::string text(4096, '\0');
  const size_t n = std::fread(text.data(), 1, text.size() - 1, f);
  std::fclose(f);
  text.resize(n);
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return {nullptr, 0};
  // Fields after the command: the state is field 3.
  std::vector<std::string> fields;
  size_t at = close + 2;
  while (at < text.size()) {
    size_t end = text.find_first_of(" \n", at);
    if (end == std::string::npos) end = text.size();
    fields.push_back(text.substr(at, end - at));
    at = end + 1;
  }
  if (fields.size() < 49) return {nullptr, 0};
  const unsigned long long start = std::strtoull(fields[50 - 3].c_str(), nullptr, 10);
  const unsigned long long end = std::strtoull(fields[51 - 3].c_str(), nullptr, 10);
  if (start == 0 || end <= start) return {nullptr, 0};
  return {reinterpret_cast<char*>(start), static_cast<size_t>(end - start)};
}

// In an activated template, once nothing refers to the old environment any
// more: writes `vars` (the rank's first) over the block the launcher was
// started with, each one that fits, so that tools reading
// /proc/<pid>/environ (ps e, a test looking for RANK=1) see the rank.
void show_environment(const std::vector<std::string>& vars) {
  const auto [block, size] = environ_block();
  if (block == nullptr) return;
  size_t used = 0;
  for (const std::string& var : vars) {
    if (used + var.size() + 1 > size) continue;
    std::memcpy(block + used, var.c_str(), var.size() + 1);
    used += var.size() + 1;
  }
  std::memset(block + used, 0, size - used);
}

// A template's life: wait on `fd` for the activation, then become the rank it
// describes and return its argv. Exits 0 on EOF (not needed, or the launcher
// died).
std::vector<std::string> wait_as_template(int fd, pid_t launcher) {
#ifdef __linux__
  prctl(PR_SET_PDEATHSIG, SIGHUP);
  if (getppid() != launcher) _exit(0);
  char name[17] = {0};
  prctl(PR_GET_NAME, name);
  prctl(PR_SET_NAME, "rank-template");
#else
  (void)launcher;
#endif
  TemplateHeader header;
  std::vector<int> received;
  if (!recv_with_fds(fd, &header, sizeof header, kMaxTemplateFds, received)) _exit(0);
  std::string payload(header.payload, '\0');
  if (header.magic != TemplateHeader{}.magic || header.fds != received.size() ||
      !recv_with_fds(fd, payload.data(), payload.size(), 0, received) || payload.size() < header.fds * sizeof(int32_t)) {
    _exit(0);
  }
  std::vector<int> targets(header.fds);
  for (size_t i = 0; i < targets.size(); ++i) {
    int32_t target = 0;
    std::memcpy(&target, payload.data() + i * sizeof target, sizeof target);
    targets[i] = target;
  }
  std::vector<std::string> strings;
  for (size_t at = header.fds * sizeof(int32_t); at < payload.size();) {
    const size_t end = payload.find('\0', at);
    if (end == std::string::npos) _exit(0);
    strings.push_back(payload.substr(at, end - at));
    at = end + 1;
  }
  const size_t argc = strings.empty() ? 0 : std::strtoul(strings[0].c_str(), nullptr, 10);
  if (argc == 0 || strings.size() < argc + 2) _exit(0);
  std::vector<std::string> argv(strings.begin() + 1, strings.begin() + 1 + static_cast<long>(argc));
  const size_t envc = std::strtoul(strings[argc + 1].c_str(), nullptr, 10);
  if (strings.size() != argc + 2 + envc) _exit(0);
  std::vector<std::string> env(strings.begin() + 2 + static_cast<long>(argc), strings.end());

  // A process group of its own, as an exec'd rank's; the launcher waits for
  // this before it signals the rank's group.
  setpgid(0, 0);
  const char ack = 1;
  if (::send(fd, &ack, 1, MSG_NOSIGNAL) != 1) _exit(0);
  ::close(fd);
  // The fds at their numbers: first all above every target, then into place.
  int above = 3;
  for (int target : targets) above = std::max(above, target + 1);
  for (int& got : received) {
    const int moved = fcntl(got, F_DUPFD_CLOEXEC, above);
    if (moved < 0) _exit(127);
    ::close(got);
    got = moved;
  }
  std::vector<int> keep;
  for (size_t i = 0; i < targets.size(); ++i) {
    if (dup2(received[i], targets[i]) < 0) _exit(127);
    if (targets[i] >= 3) keep.push_back(targets[i]);
  }
  std::sort(keep.begin(), keep.end());
  close_other_fds(keep, sysconf(_SC_OPEN_MAX));
  // The rank's environment, all of it and nothing of the template's.
  clearenv();
  for (const std::string& var : env) {
    const size_t eq = var.find('=');
    if (eq == std::string::npos || eq == 0) continue;
    ::setenv(var.substr(0, eq).c_str(), var.c_str() + eq + 1, 1);
  }
  show_environment(env);
#ifdef __linux__
  prctl(PR_SET_NAME, name);
#endif
  detail::mark_forked_rank_activated();
  return argv;
}

// Where the ranks find the job's store, which the launcher serves.
struct JobRendezvous {
  int port = 0;
  std::string job_id;
  int attempt = 0;  // TORCHELASTIC_RESTART_COUNT: 0, then one more per restart
};

// What an exec'd rank (or an activated standby) gets on top of the
// launcher's environment.
std::vector<std::pair<std::string, std::string>> rank_vars(const LocalLaunchOptions& options, int rank,
                                                           const JobRendezvous& job) {
  // Simulated nodes: consecutive ranks share a node, as under torchrun.
  const int per_node = options.nproc / options.nodes;
  return {
      {"RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(options.nproc)},
      {"LOCAL_RANK", std::to_string(rank % per_node)},
      {"LOCAL_WORLD_SIZE", std::to_string(per_node)},
      {"GROUP_RANK", std::to_string(rank / per_node)},
      {"GROUP_WORLD_SIZE", std::to_string(options.nodes)},
      {"MASTER_ADDR", options.master_addr},
      {"MASTER_PORT", std::to_string(job.port)},
      {kStoreHostedVar, "1"},
      {kJobIdVar, job.job_id},
      {kLaunchedVar, "1"},
      // torchrun's name, so that a rank reads it as under torchrun: the
      // store prefix of its attempt (runtime.cpp), "restart i" in its banner.
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(job.attempt)},
  };
}

// An exec plan with the launcher's environment, less the variables `vars`
// and `left_out` name, plus `vars`.
ExecPlan make_plan(const LocalLaunchOptions& options, const std::vector<std::pair<std::string, std::string>>& vars,
                   const std::vector<int>& inherited_fds, const std::vector<std::string>& left_out = {}) {
  ExecPlan plan;
  plan.inherited_fds = inherited_fds;
  plan.open_max = sysconf(_SC_OPEN_MAX);
  plan.argv_storage = options.argv;
  for (std::string& arg : plan.argv_storage) plan.argv.push_back(arg.data());
  plan.argv.push_back(nullptr);
  for (char** entry = environ; entry != nullptr && *entry != nullptr;
       ++entry) {
    std::string var(*entry);
    std::string name = var.substr(0, var.find('='));
    bool overridden = std::any_of(
        vars.begin(), vars.end(),
        [&](const auto& kv) { return kv.first == name; });
    overridden = overridden || std::find(left_out.begin(), left_out.end(), name) != left_out.end();
    if (!overridden) plan.env_storage.push_back(var);
  }
  for (const auto& [name, value] : vars) {
    plan.env_storage.push_back(name + "=" + value);
  }
  for (std::string& var : plan.env_storage) plan.envp.push_back(var.data());
  plan.envp.push_back(nullptr);
  plan.exec_error_prefix = "launcher: cannot run " + options.argv[0] + ": ";
  return plan;
}

ExecPlan make_exec_plan(const LocalLaunchOptions& options, int rank,
                        const JobRendezvous& job,
                        const std::vector<int>& inherited_fds) {
  return make_plan(options, rank_vars(options, rank, job), inherited_fds);
}

// A standby's plan: no rank variables (they come at its activation), the
// socket it waits on, and room for the rank's variables.
ExecPlan make_standby_plan(const LocalLaunchOptions& options, const JobRendezvous& job, int control_fd,
                           std::vector<int> inherited_fds) {
  // The rank variables are left out altogether: a standby is no rank yet.
  std::vector<std::string> rank_names;
  for (const auto& var : rank_vars(options, 0, job)) rank_names.push_back(var.first);
  inherited_fds.push_back(control_fd);
  std::sort(inherited_fds.begin(), inherited_fds.end());
  ExecPlan plan = make_plan(options, {{kStandbyFdVar, std::to_string(control_fd)},
                                      {kStandbyEnvVar, std::string(kStandbyEnvRoom, ' ')}},
                            inherited_fds, rank_names);
  plan.standby_fd = control_fd;
  return plan;
}

// Runs in the forked child; never returns.
[[noreturn]] void exec_rank(const ExecPlan& plan, const SignalRedirect& signals,
                            const sigset_t& caller_mask, pid_t launcher_pid,
                            int stdin_fd, int out_fd, int err_fd) {
  signals.restore_in_child();
  sigprocmask(SIG_SETMASK, &caller_mask, nullptr);
  setpgid(0, 0);
#ifdef __linux__
  // The ranks are not in the terminal's process group (see run()), so make
  // sure they hear about a launcher that died without forwarding anything.
  // SIGHUP, not SIGTERM: Linux sends it again each time a dying launcher
  // thread hands its children to the next one, and a second SIGTERM tells
  // train to stop at once; train takes any number of SIGHUPs as one stop.
  prctl(PR_SET_PDEATHSIG, SIGHUP);
  if (getppid() != launcher_pid) _exit(1);
#else
  (void)launcher_pid;
#endif
  dup2(stdin_fd, 0);
  dup2(out_fd, 1);
  dup2(err_fd, 2);
  close_other_fds(plan.inherited_fds, plan.open_max);
  if (plan.standby_fd >= 0) fcntl(plan.standby_fd, F_SETFD, 0);
  execvpe(plan.argv[0], plan.argv.data(), plan.envp.data());
  int err = errno;
  write_all(2, plan.exec_error_prefix.data(), plan.exec_error_prefix.size());
  const char* text = strerror(err);
  write_all(2, text, strlen(text));
  write_all(2, "\n", 1);
  _exit(127);
}

// ---------------------------------------------------------------------------

class LocalLauncher {
 public:
  explicit LocalLauncher(const LocalLaunchOptions& options)
      : options_(options) {}
  ~LocalLauncher() { kill_and_reap_all(); }
  LocalLauncher(const LocalLauncher&) = delete;
  LocalLauncher& operator=(const LocalLauncher&) = delete;

  int run();

 private:
  void start_ranks(const JobRendezvous& job);
  void start_rank(int index, const JobRendezvous& job, int stdin_fd);
  bool activate_template(int index, const JobRendezvous& job, int stdin_fd);
  // fork + exec of `plan` with stdin `stdin_fd` and fresh output pipes.
  void spawn(const ExecPlan& plan, int stdin_fd, const std::string& what, pid_t& pid, int& out_fd,
             int& err_fd);
  void maybe_start_standbys(const JobRendezvous& job);
  void start_standbys(const JobRendezvous& job);
  bool activate_standby(size_t index, const JobRendezvous& job);
  void reap_standbys();
  void stop_standbys() noexcept;
  void handle_signal_bytes();
  void signal_running(int sig);
  void begin_stop();
  void reap_exited();
  void record_exit(Rank& rank, int status);
  void record_failure(Rank& rank, int code, const std::string& what);
  void run_attempt(const JobRendezvous& job);
  void read_stream(Rank& rank, OutputStream& stream);
  void drain(Rank& rank);
  void forward_lines(const Rank& rank, OutputStream& stream, bool eof);
  bool any_running() const;
  bool any_stream_open() const;
  int poll_timeout_ms() const;
  void poll_and_forward();
  bool finished();
  void kill_and_reap_all() noexcept;

  const LocalLaunchOptions& options_;
  // What the caller lets children inherit; ranks get these and 0..2, and
  // nothing the launcher (or its store server) opened.
  std::vector<int> inherited_fds_;
  // Declared before ranks_, so destroyed after them: it serves the ranks'
  // store until the last one is reaped (also when run() throws).
  std::unique_ptr<StoreServer> store_server_;
  std::optional<SignalRedirect> signals_;
  sigset_t caller_mask_{};
  std::vector<Rank> ranks_;
  std::optional<int> first_failure_;  // the return value once a rank failed
  std::optional<Clock::time_point> kill_deadline_;  // SIGKILL at this time
  bool killed_ = false;
  std::optional<Clock::time_point> drain_deadline_;
  // Restarts (max_restarts): the attempt under way, whether its group is to
  // start again once every rank has exited, and whether the launcher was
  // asked to stop (SIGINT/SIGTERM), which rules out any restart.
  int attempt_ = 0;
  bool restart_pending_ = false;
  bool stop_requested_ = false;
  // Standbys (options_.standby): one per rank, for the next attempt.
  struct Standby {
    pid_t pid = -1;
    bool alive = false;
    int control_fd = -1;  // the launcher's end of the standby's socket
    OutputStream out;
    OutputStream err;
  };
  std::vector<Standby> standbys_;
  bool standbys_failed_ = false;  // could not start them: not tried again
  Clock::time_point attempt_started_{};
};

void LocalLauncher::start_ranks(const JobRendezvous& job) {
  int stdin_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (stdin_fd < 0) throw_errno("open /dev/null");
  ranks_.reserve(static_cast<size_t>(options_.nproc));
  try {
    for (int i = 0; i < options_.nproc; ++i) {
      if (!activate_standby(static_cast<size_t>(i), job)) start_rank(i, job, stdin_fd);
    }
  } catch (...) {
    ::close(stdin_fd);
    stop_standbys();
    throw;
  }
  ::close(stdin_fd);
  stop_standbys();   // those not activated (their rank started afresh)
  stop_templates();  // more than the ranks
}

void LocalLauncher::spawn(const ExecPlan& plan, int stdin_fd, const std::string& what, pid_t& pid,
                          int& out_fd, int& err_fd) {
  int out_pipe[2];
  int err_pipe[2];
  make_pipe(out_pipe);
  try {
    make_pipe(err_pipe);
  } catch (...) {
    ::close(out_pipe[0]);
    ::close(out_pipe[1]);
    throw;
  }
  // Block the handled signals across fork() so the child cannot run our
  // handler (and write into our self-pipe) before it has restored its own.
  sigset_t block;
  sigemptyset(&block);
  for (int sig : kHandledSignals) sigaddset(&block, sig);
  sigprocmask(SIG_BLOCK, &block, nullptr);
  pid_t launcher_pid = getpid();
  pid = fork();
  if (pid == 0) {
    exec_rank(plan, *signals_, caller_mask_, launcher_pid, stdin_fd,
              out_pipe[1], err_pipe[1]);
  }
  int fork_errno = errno;
  if (pid > 0) setpgid(pid, pid);  // also here: no race with signal_running
  sigprocmask(SIG_SETMASK, &caller_mask_, nullptr);
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  if (pid < 0) {
    ::close(out_pipe[0]);
    ::close(err_pipe[0]);
    errno = fork_errno;
    throw_errno("fork for " + what);
  }
  out_fd = out_pipe[0];
  err_fd = err_pipe[0];
  set_cloexec_nonblock(out_fd, true);
  set_cloexec_nonblock(err_fd, true);
}

// Makes a rank template (fork_rank_templates) rank `index`: sends it the
// exec plan's argv and environment (the rank's variables first), stdin, fresh
// output pipes and the inherited fds, and waits until it has its own process
// group. False when there is none left, or it failed (it is then reaped):
// start the rank by exec.
bool LocalLauncher::activate_template(int index, const JobRendezvous& job, int stdin_fd) {
  if (g_templates.empty() || job.attempt != 0) return false;
  const RankTemplate t = g_templates.front();
  g_templates.erase(g_templates.begin());
  const auto give_up = [&]() {
    ::close(t.control_fd);
    kill(t.pid, SIGKILL);
    waitpid(t.pid, nullptr, 0);
    return false;
  };
  if (inherited_fds_.size() + 3 > kMaxTemplateFds) return give_up();
  int out_pipe[2];
  int err_pipe[2];
  try {
    make_pipe(out_pipe);
  } catch (...) {
    return give_up();
  }
  try {
    make_pipe(err_pipe);
  } catch (...) {
    ::close(out_pipe[0]);
    ::close(out_pipe[1]);
    return give_up();
  }
  std::vector<int> fds{stdin_fd, out_pipe[1], err_pipe[1]};
  std::vector<int32_t> targets{0, 1, 2};
  for (int fd : inherited_fds_) {
    fds.push_back(fd);
    targets.push_back(fd);
  }
  const auto vars = rank_vars(options_, index, job);
  const ExecPlan plan = make_plan(options_, vars, inherited_fds_);
  std::string payload(reinterpret_cast<const char*>(targets.data()), targets.size() * sizeof(int32_t));
  const auto add = [&](const std::string& text) {
    payload += text;
    payload.push_back('\0');
  };
  add(std::to_string(options_.argv.size()));
  for (const std::string& arg : options_.argv) add(arg);
  add(std::to_string(plan.env_storage.size()));
  // The rank's variables first (make_plan puts them last): what fits of the
  // environment in /proc/<pid>/environ starts with them.
  const size_t first_var = plan.env_storage.size() - vars.size();
  for (size_t i = first_var; i < plan.env_storage.size(); ++i) add(plan.env_storage[i]);
  for (size_t i = 0; i < first_var; ++i) add(plan.env_storage[i]);

  TemplateHeader header;
  header.fds = static_cast<uint32_t>(fds.size());
  header.payload = payload.size();
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxTemplateFds)] = {};
  iovec iov{&header, sizeof header};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
  std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  ssize_t n;
  do {
    n = ::sendmsg(t.control_fd, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  bool ok = n == static_cast<ssize_t>(sizeof header);
  for (size_t sent = 0; ok && sent < payload.size();) {
    const ssize_t m = ::send(t.control_fd, payload.data() + sent, payload.size() - sent, MSG_NOSIGNAL);
    if (m < 0 && errno == EINTR) continue;
    ok = m > 0;
    if (ok) sent += static_cast<size_t>(m);
  }
  // An idle template answers at once; one that does not in 10 s is given up.
  char ack = 0;
  while (ok) {
    pollfd wait{t.control_fd, POLLIN, 0};
    const int ready = ::poll(&wait, 1, 10000);
    if (ready < 0 && errno == EINTR) continue;
    const ssize_t m = ready > 0 ? ::recv(t.control_fd, &ack, 1, MSG_DONTWAIT) : 0;
    if (m < 0 && errno == EINTR) continue;
    ok = m == 1;
    break;
  }
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  if (!ok) {
    ::close(out_pipe[0]);
    ::close(err_pipe[0]);
    return give_up();
  }
  ::close(t.control_fd);
  Rank rank;
  rank.index = index;
  rank.pid = t.pid;
  rank.running = true;
  rank.out.fd = out_pipe[0];
  rank.err.fd = err_pipe[0];
  set_cloexec_nonblock(rank.out.fd, true);
  set_cloexec_nonblock(rank.err.fd, true);
  rank.out.target = 1;
  rank.err.target = 2;
  ranks_.push_back(std::move(rank));
  return true;
}

void LocalLauncher::start_rank(int index, const JobRendezvous& job, int stdin_fd) {
  if (activate_template(index, job, stdin_fd)) return;
  ExecPlan plan = make_exec_plan(options_, index, job, inherited_fds_);
  Rank rank;
  rank.index = index;
  spawn(plan, stdin_fd, "rank " + std::to_string(index), rank.pid, rank.out.fd, rank.err.fd);
  rank.running = true;
  rank.out.target = 1;
  rank.err.target = 2;
  ranks_.push_back(std::move(rank));
}

// Standbys for the next attempt, once this one has run standby_delay_s (its
// ranks' own start-up goes first), while a restart is still possible.
void LocalLauncher::maybe_start_standbys(const JobRendezvous& job) {
  if (!options_.standby || standbys_failed_ || !standbys_.empty() || first_failure_ || stop_requested_ ||
      attempt_ >= options_.max_restarts) {
    return;
  }
  if (Clock::now() - attempt_started_ < std::chrono::duration<double>(options_.standby_delay_s)) return;
  try {
    start_standbys(job);
  } catch (const std::exception& e) {
    stop_standbys();
    standbys_failed_ = true;
    write_all(2, std::string(e.what()) + "; restarts start the ranks afresh\n");
  }
}

void LocalLauncher::start_standbys(const JobRendezvous& job) {
  int stdin_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (stdin_fd < 0) throw_errno("open /dev/null");
  try {
    for (int i = 0; i < options_.nproc; ++i) {
      int pair[2];
      if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) throw_errno("socketpair for a standby");
      for (int& fd : pair) {
        if (fd < 3) {  // never clobbered by the child's dup2 onto 0..2
          const int moved = fcntl(fd, F_DUPFD_CLOEXEC, 3);
          ::close(fd);
          fd = moved;
        }
      }
      Standby standby;
      standby.control_fd = pair[0];
      try {
        const ExecPlan plan = make_standby_plan(options_, job, pair[1], inherited_fds_);
        spawn(plan, stdin_fd, "the standby of rank " + std::to_string(i), standby.pid, standby.out.fd,
              standby.err.fd);
      } catch (...) {
        ::close(pair[0]);
        ::close(pair[1]);
        throw;
      }
      ::close(pair[1]);
      standby.alive = true;
      standby.out.target = 1;
      standby.err.target = 2;
      standbys_.push_back(std::move(standby));
    }
  } catch (...) {
    ::close(stdin_fd);
    throw;
  }
  ::close(stdin_fd);
}

// Sends the standby of rank `index` its rank's variables; it becomes that
// rank. False when there is none (or it died): start the rank afresh.
bool LocalLauncher::activate_standby(size_t index, const JobRendezvous& job) {
  if (index >= standbys_.size() || !standbys_[index].alive) return false;
  Standby& standby = standbys_[index];
  std::string message;
  for (const auto& [name, value] : rank_vars(options_, static_cast<int>(index), job)) {
    message += name + "=" + value;
    message.push_back('\0');
  }
  message.push_back('\0');
  size_t sent = 0;
  while (sent < message.size()) {
    const ssize_t n = ::send(standby.control_fd, message.data() + sent, message.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;  // it died: stop_standbys() reaps it
    sent += static_cast<size_t>(n);
  }
  ::close(standby.control_fd);
  standby.control_fd = -1;
  standby.alive = false;
  Rank rank;
  rank.index = static_cast<int>(index);
  rank.pid = standby.pid;
  rank.running = true;
  rank.out = standby.out;
  rank.err = standby.err;
  standby.out.fd = -1;
  standby.err.fd = -1;
  standby.pid = -1;
  ranks_.push_back(std::move(rank));
  return true;
}

// A standby that exited before it was needed: its output is forwarded under
// its rank's prefix, with a line saying so; the next restart starts that
// rank afresh.
void LocalLauncher::reap_standbys() {
  for (size_t i = 0; i < standbys_.size(); ++i) {
    Standby& standby = standbys_[i];
    if (!standby.alive) continue;
    int status = 0;
    if (waitpid(standby.pid, &status, WNOHANG) != standby.pid) continue;
    standby.alive = false;
    standby.pid = -1;
    Rank shown;
    shown.index = static_cast<int>(i);
    for (OutputStream* stream : {&standby.out, &standby.err}) {
      for (int reads = 0; reads < 64 && stream->fd >= 0; ++reads) read_stream(shown, *stream);
    }
    const std::string how = WIFSIGNALED(status)
                                ? "was killed by signal " + std::to_string(WTERMSIG(status)) + " (" +
                                      signal_name(WTERMSIG(status)) + ")"
                                : "exited with status " + std::to_string(WEXITSTATUS(status));
    write_all(2, "launcher: the standby of rank " + std::to_string(i) + " " + how +
                     " before it was needed; a restart starts rank " + std::to_string(i) + " afresh\n");
  }
}

void LocalLauncher::stop_standbys() noexcept {
  for (Standby& standby : standbys_) {
    if (standby.pid > 0) {
      kill(-standby.pid, SIGKILL);
      kill(standby.pid, SIGKILL);
      waitpid(standby.pid, nullptr, 0);
    }
    for (int* fd : {&standby.control_fd, &standby.out.fd, &standby.err.fd}) {
      if (*fd >= 0) ::close(*fd);
      *fd = -1;
    }
  }
  standbys_.clear();
}

// Each rank leads its own process group, so a signal sent to the group also
// reaches whatever the rank started (a shell script's children, data loader
// processes).
void LocalLauncher::signal_running(int sig) {
  for (const Rank& rank : ranks_) {
    if (!rank.running) continue;
    if (kill(-rank.pid, sig) != 0) kill(rank.pid, sig);
  }
}

void LocalLauncher::begin_stop() {
  if (!kill_deadline_) {
    // Clamped so that an absurd grace period cannot overflow the clock.
    double grace_s = std::min(options_.stop_grace_s, kMaxGraceS);
    kill_deadline_ =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(grace_s));
  }
}

void LocalLauncher::handle_signal_bytes() {
  unsigned char bytes[64];
  ssize_t n;
  while ((n = ::read(signals_->read_fd(), bytes, sizeof bytes)) > 0) {
    for (ssize_t i = 0; i < n; ++i) {
      int sig = bytes[i];
      if (sig == SIGINT || sig == SIGTERM) {
        stop_requested_ = true;
        if (restart_pending_) {
          restart_pending_ = false;
          write_all(2, "launcher: " + signal_name(sig) +
                           " received; the group will not be restarted\n");
        }
        signal_running(sig);
        begin_stop();
      }
      // SIGCHLD only wakes the loop; reap_exited() does the work.
    }
  }
}

void LocalLauncher::record_exit(Rank& rank, int status) {
  rank.running = false;
  if (WIFEXITED(status) && WEXITSTATUS(status) != 0) {
    const int code = WEXITSTATUS(status);
    record_failure(rank, code,
                   code == kExitResumable
                       ? "stopped after its final save (status 75)"
                       : "exited with status " + std::to_string(code));
  } else if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    record_failure(rank, 128 + sig,
                   "killed by signal " + std::to_string(sig) + " (" + signal_name(sig) + ")");
  }
}

// The first failure of an attempt decides it: its line on stderr, the
// others stopped, and whether the group starts again (max_restarts).
void LocalLauncher::record_failure(Rank& rank, int code, const std::string& what) {
  if (first_failure_) return;
  first_failure_ = code;
  drain(rank);  // its last words come before our verdict
  // A preemption stop saved and a usage error would only repeat: neither
  // restarts, nor does a group the launcher was told to stop.
  restart_pending_ = attempt_ < options_.max_restarts && code != kExitResumable &&
                     code != kExitUsage && !stop_requested_;
  std::string message = "launcher: rank " + std::to_string(rank.index) + " " + what;
  if (restart_pending_) {
    message += "; restarting the group (restart " + std::to_string(attempt_ + 1) + " of " +
               std::to_string(options_.max_restarts) + ")";
  } else if (code == kExitResumable) {
    message += "; run the same command to resume";
  }
  write_all(2, message + "\n");
  signal_running(SIGTERM);
  begin_stop();
}

void LocalLauncher::reap_exited() {
  for (Rank& rank : ranks_) {
    if (!rank.running) continue;
    int status = 0;
    pid_t got = waitpid(rank.pid, &status, WNOHANG);
    if (got == rank.pid) {
      record_exit(rank, status);
    } else if (got < 0 && errno == ECHILD) {
      // Someone else reaped it (a SIGCHLD handler of the caller?); treat as
      // a failure we cannot describe better.
      rank.running = false;
      record_failure(rank, 1, "vanished (reaped elsewhere)");
    }
  }
}

void LocalLauncher::forward_lines(const Rank& rank, OutputStream& stream,
                                  bool eof) {
  const std::string prefix =
      options_.prefix_output ? "[rank " + std::to_string(rank.index) + "] "
                             : std::string();
  std::string chunk;
  size_t start = 0;
  while (true) {
    size_t newline = stream.pending.find('\n', start);
    if (newline == std::string::npos) break;
    chunk += prefix;
    chunk.append(stream.pending, start, newline + 1 - start);
    start = newline + 1;
  }
  stream.pending.erase(0, start);
  if (!stream.pending.empty() &&
      (eof || stream.pending.size() >= kMaxPendingLine)) {
    chunk += prefix + stream.pending + "\n";
    stream.pending.clear();
  }
  if (!chunk.empty()) write_all(stream.target, chunk);
}

void LocalLauncher::read_stream(Rank& rank, OutputStream& stream) {
  char buffer[64 * 1024];
  ssize_t n = ::read(stream.fd, buffer, sizeof buffer);
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
  if (n <= 0) {  // EOF (or an error we cannot do better with)
    forward_lines(rank, stream, true);
    ::close(stream.fd);
    stream.fd = -1;
    return;
  }
  stream.pending.append(buffer, static_cast<size_t>(n));
  forward_lines(rank, stream, false);
}

// Forwards what is already in a rank's pipes without blocking.
void LocalLauncher::drain(Rank& rank) {
  for (OutputStream* stream : {&rank.out, &rank.err}) {
    for (int i = 0; i < 64 && stream->fd >= 0; ++i) {
      size_t before = stream->pending.size();
      int fd = stream->fd;
      read_stream(rank, *stream);
      if (stream->fd == fd && stream->pending.size() == before) break;
    }
  }
}

bool LocalLauncher::any_running() const {
  return std::any_of(ranks_.begin(), ranks_.end(),
                     [](const Rank& r) { return r.running; });
}

bool LocalLauncher::any_stream_open() const {
  return std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& r) {
    return r.out.fd >= 0 || r.err.fd >= 0;
  });
}

int LocalLauncher::poll_timeout_ms() const {
  std::optional<Clock::time_point> next = drain_deadline_;
  if (kill_deadline_ && !killed_ && (!next || *kill_deadline_ < *next)) {
    next = kill_deadline_;
  }
  if (!next) return kPollTickMs;
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                  *next - Clock::now()).count() + 1;
  return static_cast<int>(std::clamp<long long>(left, 0, kPollTickMs));
}

void check_options(const LocalLaunchOptions& options) {
  if (options.nproc < 1) {
    throw std::invalid_argument("launcher: nproc=" +
                                std::to_string(options.nproc) +
                                " must be at least 1");
  }
  if (options.nodes < 1 || options.nproc % options.nodes != 0) {
    throw std::invalid_argument("launcher: nodes=" + std::to_string(options.nodes) +
                                " must be at least 1 and divide nproc=" +
                                std::to_string(options.nproc));
  }
  if (options.argv.empty() || options.argv[0].empty()) {
    throw std::invalid_argument("launcher: no program to run (argv is empty)");
  }
  if (!options.store_server) {
    throw std::invalid_argument(
        "launcher: no store server (LocalLaunchOptions::store_server; "
        "comm::host_tcp_store serves c10d's TCPStore)");
  }
  if (options.master_port < 0 || options.master_port > 65535) {
    throw std::invalid_argument("launcher: master_port=" +
                                std::to_string(options.master_port) +
                                " is not 0 or a TCP port");
  }
  if (options.max_restarts < 0) {
    throw std::invalid_argument("launcher: max_restarts=" +
                                std::to_string(options.max_restarts) +
                                " must not be negative");
  }
  if (!(options.stop_grace_s >= 0)) {
    throw std::invalid_argument("launcher: stop_grace_s=" +
                                std::to_string(options.stop_grace_s) +
                                " must not be negative");
  }
}

// One round: wait (bounded by the next deadline) for output or a signal,
// then forward what arrived.
void LocalLauncher::poll_and_forward() {
  std::vector<pollfd> fds;
  std::vector<std::pair<Rank*, OutputStream*>> owners;
  fds.push_back({signals_->read_fd(), POLLIN, 0});
  owners.push_back({nullptr, nullptr});
  for (Rank& rank : ranks_) {
    for (OutputStream* stream : {&rank.out, &rank.err}) {
      if (stream->fd < 0) continue;
      fds.push_back({stream->fd, POLLIN, 0});
      owners.push_back({&rank, stream});
    }
  }
  if (poll(fds.data(), fds.size(), poll_timeout_ms()) < 0) {
    if (errno == EINTR) return;
    throw_errno("poll");
  }
  if (fds[0].revents != 0) handle_signal_bytes();
  for (size_t i = 1; i < fds.size(); ++i) {
    if (fds[i].revents != 0) read_stream(*owners[i].first, *owners[i].second);
  }
}

// True once every rank is reaped and its output forwarded (or given up on:
// a daemonised grandchild may hold a pipe open forever).
bool LocalLauncher::finished() {
  if (any_running()) return false;
  if (!any_stream_open()) return true;
  if (!drain_deadline_) drain_deadline_ = Clock::now() + kDrainAfterExit;
  if (Clock::now() < *drain_deadline_) return false;
  for (Rank& rank : ranks_) {
    for (OutputStream* stream : {&rank.out, &rank.err}) {
      if (stream->fd < 0) continue;
      forward_lines(rank, *stream, true);
      ::close(stream->fd);
      stream->fd = -1;
    }
  }
  return true;
}

int LocalLauncher::run() {
  check_options(options_);
  // The port is bound here and stays bound for the whole job: choosing a
  // "free" port for rank 0 to bind later let a parallel job take it first.
  // Taken before the store server opens anything: c10d (1.13) opens its
  // sockets inheritable, and its threads accept the ranks' connections while
  // later ranks are still being forked.
  inherited_fds_ = inheritable_fds();
  JobRendezvous job;
  job.job_id = new_job_id();
  {
    // The server's threads inherit this mask, so the signals we handle reach
    // the main thread's poll loop and never interrupt the server.
    sigset_t block;
    sigset_t previous;
    sigemptyset(&block);
    for (int sig : kHandledSignals) sigaddset(&block, sig);
    pthread_sigmask(SIG_BLOCK, &block, &previous);
    try {
      store_server_ = options_.store_server(options_.master_addr,
                                            options_.master_port, job.job_id);
    } catch (...) {
      pthread_sigmask(SIG_SETMASK, &previous, nullptr);
      throw;
    }
    pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  }
  job.port = store_server_->port();
  // What the caller buffered must not interleave oddly with the ranks' lines.
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);

  // Process groups: every rank leads its own group, outside the terminal's
  // foreground group. A terminal Ctrl-C therefore reaches only the launcher,
  // which forwards it exactly once to every rank's group (ranks in our group
  // would see it twice: once from the tty, once from us). The cost is that
  // the tty no longer reaches ranks directly, so each rank gets
  // PR_SET_PDEATHSIG=SIGHUP in case the launcher dies without forwarding,
  // and its stdin is /dev/null (a background group reading the tty would be
  // stopped by SIGTTIN).
  signals_.emplace();
  sigprocmask(SIG_SETMASK, nullptr, &caller_mask_);
  // The store server stays up across restarts: a new attempt needs no new
  // port, and its ranks' keys go under their attempt's prefix
  // (TORCHELASTIC_RESTART_COUNT), apart from the dead attempt's.
  for (;; ++attempt_) {
    job.attempt = attempt_;
    run_attempt(job);
    if (!restart_pending_) break;
    // Every rank of the failed attempt is reaped: start afresh.
    ranks_.clear();
    first_failure_.reset();
    kill_deadline_.reset();
    killed_ = false;
    drain_deadline_.reset();
    restart_pending_ = false;
  }
  stop_standbys();
  signals_.reset();
  return first_failure_.value_or(0);
}

// Starts every rank and waits until all have exited and their output is
// forwarded; first_failure_ (and restart_pending_) say how it ended.
void LocalLauncher::run_attempt(const JobRendezvous& job) {
  attempt_started_ = Clock::now();
  start_ranks(job);
  while (true) {
    reap_exited();
    reap_standbys();
    maybe_start_standbys(job);
    if (finished()) break;
    if (kill_deadline_ && !killed_ && Clock::now() >= *kill_deadline_) {
      signal_running(SIGKILL);
      killed_ = true;
    }
    poll_and_forward();
  }
}

// Only reached with ranks still running when run() threw: do not leave
// orphans behind.
void LocalLauncher::kill_and_reap_all() noexcept {
  stop_standbys();
  stop_templates();
  for (Rank& rank : ranks_) {
    if (rank.running) {
      kill(-rank.pid, SIGKILL);
      kill(rank.pid, SIGKILL);
      waitpid(rank.pid, nullptr, 0);
      rank.running = false;
    }
    for (OutputStream* stream : {&rank.out, &rank.err}) {
      if (stream->fd >= 0) ::close(stream->fd);
      stream->fd = -1;
    }
  }
}

}  // namespace

int run_local_launcher(const LocalLaunchOptions& options) {
  LocalLauncher launcher(options);
  return launcher.run();
}

std::optional<std::vector<std::string>> fork_rank_templates(int count) {
  if (count <= 0 || !g_templates.empty()) return std::nullopt;
  if (const char* off = std::getenv("SHARDKIT_FORK_RANKS"); off != nullptr && std::string(off) == "0") {
    return std::nullopt;
  }
  count = std::min(count, kMaxRankTemplates);
  const pid_t launcher = getpid();
  // Nothing buffered may be written twice.
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  for (int i = 0; i < count; ++i) {
    int pair[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) break;
    const pid_t pid = fork();
    if (pid < 0) {
      ::close(pair[0]);
      ::close(pair[1]);
      break;
    }
    if (pid == 0) {
      ::close(pair[0]);
      for (const RankTemplate& t : g_templates) ::close(t.control_fd);
      g_templates.clear();
      return wait_as_template(pair[1], launcher);
    }
    ::close(pair[1]);
    g_templates.push_back({pid, pair[0]});
  }
  return std::nullopt;
}

std::vector<std::string> argv_without_nproc(int argc, char** argv) {
  std::vector<std::string> out{std::filesystem::read_symlink("/proc/self/exe").string()};
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    // The launcher's own flags, each with one value.
    if (a == "--nproc" || a == "--nodes" || a == "--nproc-per-node" || a == "--max-restarts") {
      ++i;
      continue;
    }
    if (a.rfind("--nproc=", 0) == 0 || a.rfind("--nodes=", 0) == 0 ||
        a.rfind("--nproc-per-node=", 0) == 0 || a.rfind("--max-restarts=", 0) == 0) {
      continue;
    }
    out.push_back(std::move(a));
  }
  return out;
}

}  // namespace comm
