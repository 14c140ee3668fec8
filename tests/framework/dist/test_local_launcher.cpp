#include "framework/dist/local_launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>

namespace framework::dist {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

bool wait_for_files(const std::vector<fs::path>& paths, double timeout_s) {
  auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  while (Clock::now() < deadline) {
    bool all = true;
    for (const fs::path& p : paths) all = all && fs::exists(p);
    if (all) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

bool process_is_gone(pid_t pid) { return kill(pid, 0) != 0 && errno == ESRCH; }

struct LaunchOutcome {
  int exit_code = -1;
  std::string out;
  std::string err;
  double seconds = 0;
};

// Runs the launcher in a forked child whose stdout and stderr are files, so
// the test sees exactly what a user's terminal would, and signals sent to it
// do not touch the test process.
class LauncherProcess {
 public:
  LauncherProcess(const LocalLaunchOptions& options, const fs::path& dir)
      : out_path_(dir / "launcher.out"), err_path_(dir / "launcher.err") {
    start_ = Clock::now();
    std::fflush(nullptr);  // else the child would flush our buffered output
    pid_ = fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) run_child(options);
  }

  pid_t pid() const { return pid_; }

  LaunchOutcome wait(double timeout_s = 60) {
    LaunchOutcome outcome;
    auto deadline = start_ + std::chrono::duration<double>(timeout_s);
    int status = 0;
    while (waitpid(pid_, &status, WNOHANG) == 0) {
      if (Clock::now() > deadline) {
        kill(pid_, SIGKILL);
        waitpid(pid_, &status, 0);
        ADD_FAILURE() << "launcher did not return within " << timeout_s << "s";
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    outcome.seconds =
        std::chrono::duration<double>(Clock::now() - start_).count();
    outcome.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    outcome.out = read_text(out_path_);
    outcome.err = read_text(err_path_);
    return outcome;
  }

 private:
  [[noreturn]] void run_child(const LocalLaunchOptions& options) {
    int out = open(out_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int err = open(err_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (out < 0 || err < 0) _exit(200);
    dup2(out, 1);
    dup2(err, 2);
    close(out);
    close(err);
    int code = 201;
    try {
      code = run_local_launcher(options);
    } catch (const std::exception& e) {
      std::string text = std::string("exception: ") + e.what() + "\n";
      ssize_t ignored = write(2, text.data(), text.size());
      (void)ignored;
    }
    _exit(code);
  }

  fs::path out_path_;
  fs::path err_path_;
  Clock::time_point start_;
  pid_t pid_ = -1;
};

class LocalLauncherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern =
        (fs::temp_directory_path() / "shardkit-launch-XXXXXX").string();
    ASSERT_NE(mkdtemp(pattern.data()), nullptr) << std::strerror(errno);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Ranks run `/bin/sh -c script sh DIR`: the script sees the scratch
  // directory as $1.
  LocalLaunchOptions shell_ranks(int nproc, const std::string& script) const {
    LocalLaunchOptions options;
    options.nproc = nproc;
    options.argv = {"/bin/sh", "-c", script, "sh", dir_.string()};
    options.stop_grace_s = 5;
    return options;
  }

  LaunchOutcome launch(const LocalLaunchOptions& options) {
    return LauncherProcess(options, dir_).wait();
  }

  fs::path dir_;
};

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST_F(LocalLauncherTest, AllRanksExitingZeroReturnsZeroWithPrefixedOutput) {
  LaunchOutcome r = launch(shell_ranks(
      3, "echo \"hello from $RANK\"; echo \"oops from $RANK\" >&2; "
         "printf 'no newline'"));
  EXPECT_EQ(r.exit_code, 0) << r.err;
  for (int k = 0; k < 3; ++k) {
    std::string prefix = "[rank " + std::to_string(k) + "] ";
    EXPECT_TRUE(contains(r.out, prefix + "hello from " + std::to_string(k) +
                                    "\n"))
        << r.out;
    EXPECT_TRUE(contains(r.out, prefix + "no newline\n")) << r.out;
    EXPECT_TRUE(contains(r.err, prefix + "oops from " + std::to_string(k) +
                                    "\n"))
        << r.err;
  }
  EXPECT_FALSE(contains(r.out, "oops")) << r.out;
  EXPECT_FALSE(contains(r.err, "hello")) << r.err;
  EXPECT_FALSE(contains(r.err, "launcher:")) << r.err;
}

TEST_F(LocalLauncherTest, OutputIsForwardedUnprefixedWhenAskedTo) {
  LocalLaunchOptions options = shell_ranks(1, "echo plain");
  options.prefix_output = false;
  LaunchOutcome r = launch(options);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.out, "plain\n");
}

TEST_F(LocalLauncherTest, EachRankSeesItsOwnRankAndTheSharedRendezvous) {
  LaunchOutcome r = launch(shell_ranks(
      4, "echo \"env $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE "
         "$MASTER_ADDR $MASTER_PORT $SHARDKIT_LAUNCHED\""));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::istringstream lines(r.out);
  std::string line;
  std::set<int> ranks;
  std::set<int> ports;
  while (std::getline(lines, line)) {
    std::istringstream words(line);
    std::string tag, prefix_rank, env;
    int rank, world, local_rank, local_world, port, launched;
    std::string addr;
    words >> tag >> prefix_rank >> env >> rank >> world >> local_rank >>
        local_world >> addr >> port >> launched;
    ASSERT_FALSE(words.fail()) << line;
    EXPECT_EQ(prefix_rank, std::to_string(rank) + "]");
    EXPECT_EQ(world, 4);
    EXPECT_EQ(local_rank, rank);
    EXPECT_EQ(local_world, 4);
    EXPECT_EQ(addr, "127.0.0.1");
    EXPECT_EQ(launched, 1);
    ranks.insert(rank);
    ports.insert(port);
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2, 3}));
  ASSERT_EQ(ports.size(), 1u);
  EXPECT_GT(*ports.begin(), 0);
}

TEST_F(LocalLauncherTest, GivenMasterPortIsPassedThrough) {
  LocalLaunchOptions options = shell_ranks(2, "echo \"port $MASTER_PORT\"");
  options.master_port = 34567;
  LaunchOutcome r = launch(options);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_TRUE(contains(r.out, "[rank 0] port 34567\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "[rank 1] port 34567\n")) << r.out;
}

// Ranks other than 1 publish their pid and sleep; rank 1 waits for them, then
// fails with `exit_command`.
std::string one_rank_fails_script(const std::string& exit_command) {
  return "if [ \"$RANK\" = 1 ]; then "
         "  while [ ! -e \"$1/pid.0\" ] || [ ! -e \"$1/pid.2\" ]; do "
         "    sleep 0.05; done; " +
         exit_command +
         "; fi; "
         "echo $$ > \"$1/tmp.$RANK\"; mv \"$1/tmp.$RANK\" \"$1/pid.$RANK\"; "
         "exec sleep 60";
}

TEST_F(LocalLauncherTest, FailingRankStopsTheOthersAndItsStatusIsReturned) {
  LaunchOutcome r = launch(shell_ranks(3, one_rank_fails_script("exit 3")));
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_LT(r.seconds, 20);
  EXPECT_TRUE(contains(r.err, "launcher: rank 1 exited with status 3\n"))
      << r.err;
  for (int k : {0, 2}) {
    pid_t pid = std::atoi(read_text(dir_ / ("pid." + std::to_string(k))).c_str());
    ASSERT_GT(pid, 0);
    EXPECT_TRUE(process_is_gone(pid)) << "rank " << k << " pid " << pid;
  }
}

TEST_F(LocalLauncherTest, RankKilledBySignalReturns128PlusSignalAndNamesIt) {
  LaunchOutcome r =
      launch(shell_ranks(3, one_rank_fails_script("kill -KILL $$")));
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << r.err;
  EXPECT_LT(r.seconds, 20);
  EXPECT_TRUE(
      contains(r.err, "launcher: rank 1 killed by signal 9 (SIGKILL)\n"))
      << r.err;
}

TEST_F(LocalLauncherTest, RankIgnoringSigtermIsKilledAfterTheGracePeriod) {
  LocalLaunchOptions options = shell_ranks(
      2,
      "if [ \"$RANK\" = 0 ]; then "
      "  while [ ! -e \"$1/pid.1\" ]; do sleep 0.05; done; exit 3; fi; "
      "trap '' TERM; echo $$ > \"$1/tmp\"; mv \"$1/tmp\" \"$1/pid.1\"; "
      "while :; do sleep 1; done");
  options.stop_grace_s = 1;
  LaunchOutcome r = launch(options);
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_GE(r.seconds, 1.0);
  EXPECT_LT(r.seconds, 20);
  pid_t pid = std::atoi(read_text(dir_ / "pid.1").c_str());
  ASSERT_GT(pid, 0);
  EXPECT_TRUE(process_is_gone(pid));
}

// Every rank traps `sig`, leaves a marker and exits 0; the launcher gets
// `sig` once all ranks are up.
LaunchOutcome signal_launcher_and_wait(const LocalLaunchOptions& options,
                                       const fs::path& dir, int sig,
                                       int nproc) {
  LauncherProcess launcher(options, dir);
  std::vector<fs::path> ready;
  for (int k = 0; k < nproc; ++k) {
    ready.push_back(dir / ("ready." + std::to_string(k)));
  }
  EXPECT_TRUE(wait_for_files(ready, 20)) << "ranks did not start";
  kill(launcher.pid(), sig);
  return launcher.wait();
}

std::string trap_script(const std::string& sig_name) {
  return "trap 'echo got > \"$1/got.$RANK\"; exit 0' " + sig_name +
         "; touch \"$1/ready.$RANK\"; while :; do sleep 1; done";
}

TEST_F(LocalLauncherTest, SigtermToTheLauncherReachesEveryRank) {
  LaunchOutcome r = signal_launcher_and_wait(
      shell_ranks(3, trap_script("TERM")), dir_, SIGTERM, 3);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_LT(r.seconds, 20);
  for (int k = 0; k < 3; ++k) {
    EXPECT_TRUE(fs::exists(dir_ / ("got." + std::to_string(k))))
        << "rank " << k;
  }
  EXPECT_FALSE(contains(r.err, "launcher: rank")) << r.err;
}

TEST_F(LocalLauncherTest, SigintToTheLauncherReachesEveryRank) {
  LaunchOutcome r = signal_launcher_and_wait(shell_ranks(2, trap_script("INT")),
                                             dir_, SIGINT, 2);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  for (int k = 0; k < 2; ++k) {
    EXPECT_TRUE(fs::exists(dir_ / ("got." + std::to_string(k))))
        << "rank " << k;
  }
}

TEST_F(LocalLauncherTest, RankDyingOfForwardedSignalIsReportedAsFailure) {
  // No trap: the default action of SIGTERM ends the shell.
  LaunchOutcome r = signal_launcher_and_wait(
      shell_ranks(1, "touch \"$1/ready.$RANK\"; while :; do sleep 1; done"),
      dir_, SIGTERM, 1);
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.err;
  EXPECT_TRUE(
      contains(r.err, "launcher: rank 0 killed by signal 15 (SIGTERM)\n"))
      << r.err;
}

TEST_F(LocalLauncherTest, MissingProgramFailsWith127AndSaysWhy) {
  LocalLaunchOptions options;
  options.nproc = 2;
  options.argv = {"/nonexistent/shardkit-no-such-program", "--flag"};
  LaunchOutcome r = launch(options);
  EXPECT_EQ(r.exit_code, 127) << r.err;
  EXPECT_TRUE(contains(r.err,
                       "launcher: cannot run "
                       "/nonexistent/shardkit-no-such-program: No such file "
                       "or directory"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "exited with status 127")) << r.err;
}

// The fds a child of this process would inherit: those without FD_CLOEXEC
// (the test runner may pass some down to us; they are not the launcher's).
std::set<int> inheritable_fds() {
  std::set<int> fds;
  for (const auto& entry : fs::directory_iterator("/proc/self/fd")) {
    int fd = std::atoi(entry.path().filename().c_str());
    int flags = fcntl(fd, F_GETFD);
    if (flags >= 0 && (flags & FD_CLOEXEC) == 0) fds.insert(fd);
  }
  return fds;
}

TEST_F(LocalLauncherTest, RanksInheritNoLauncherFileDescriptors) {
  // The shell opens nothing for this script, so its fds are 0..2 plus
  // whatever the launcher's caller let its children inherit.
  LaunchOutcome r = launch(shell_ranks(2, "ls /proc/$$/fd"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::set<int> expected = inheritable_fds();
  expected.insert({0, 1, 2});
  for (int k = 0; k < 2; ++k) {
    std::istringstream lines(r.out);
    std::string prefix = "[rank " + std::to_string(k) + "] ";
    std::string line;
    std::set<int> seen;
    while (std::getline(lines, line)) {
      if (line.rfind(prefix, 0) == 0) {
        seen.insert(std::atoi(line.c_str() + prefix.size()));
      }
    }
    EXPECT_EQ(seen, expected) << r.out;
  }
}

TEST(LocalLauncher, PreviousSignalHandlersAreRestoredAfterwards) {
  struct sigaction custom {};
  custom.sa_handler = SIG_IGN;
  sigemptyset(&custom.sa_mask);
  struct sigaction saved {};
  ASSERT_EQ(sigaction(SIGTERM, &custom, &saved), 0);
  LocalLaunchOptions options;
  options.nproc = 2;
  options.argv = {"true"};
  EXPECT_EQ(run_local_launcher(options), 0);
  struct sigaction now {};
  sigaction(SIGTERM, nullptr, &now);
  EXPECT_EQ(now.sa_handler, SIG_IGN);
  sigaction(SIGTERM, &saved, nullptr);
}

TEST(LocalLauncher, InvalidOptionsAreRejectedBeforeAnythingStarts) {
  LocalLaunchOptions options;
  options.nproc = 0;
  options.argv = {"true"};
  EXPECT_THROW(run_local_launcher(options), std::invalid_argument);
  options.nproc = 1;
  options.argv = {};
  EXPECT_THROW(run_local_launcher(options), std::invalid_argument);
}

TEST(LocalLauncher, PickedPortIsFreeToBind) {
  int port = pick_free_port("127.0.0.1");
  ASSERT_GT(port, 0);
  ASSERT_LE(port, 65535);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0)
      << std::strerror(errno);
  close(fd);
}

TEST(LocalLauncher, UnresolvableAddressIsAnErrorNamingIt) {
  try {
    pick_free_port("no-such-host.invalid");
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_TRUE(contains(e.what(), "no-such-host.invalid")) << e.what();
  }
}

}  // namespace
}  // namespace framework::dist
