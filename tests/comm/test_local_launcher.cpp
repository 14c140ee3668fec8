#include "comm/local_launcher.h"

#include "comm/launch_env.h"

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
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>

namespace comm {
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

// A store server as far as the launcher can tell: a listening TCP socket on
// 127.0.0.1 that stays open while the object lives (the c10d one needs
// LibTorch; this binary is torch-free).
class ListeningSocket : public StoreServer {
 public:
  // `inheritable`: without close-on-exec, as c10d 1.13 opens its sockets.
  explicit ListeningSocket(int port, bool inheritable = false) {
    fd_ = socket(AF_INET, SOCK_STREAM | (inheritable ? 0 : SOCK_CLOEXEC), 0);
    if (fd_ < 0) throw std::runtime_error(std::string("socket: ") + std::strerror(errno));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    socklen_t len = sizeof addr;
    if (bind(fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0 || listen(fd_, 16) != 0 ||
        getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      int err = errno;
      close(fd_);
      throw std::runtime_error("cannot listen on 127.0.0.1:" + std::to_string(port) + ": " +
                               std::strerror(err));
    }
    port_ = ntohs(addr.sin_port);
  }
  ~ListeningSocket() override { close(fd_); }
  int port() const override { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// Serves on any free port whatever port is asked for, and leaves
// "<port asked> <port served> <job id>" in dir/server.txt for the test.
StoreServerFactory recording_server(const fs::path& dir) {
  return [dir](const std::string&, int port, const std::string& job_id) {
    auto server = std::make_unique<ListeningSocket>(0);
    std::ofstream(dir / "server.tmp") << port << " " << server->port() << " " << job_id << "\n";
    fs::rename(dir / "server.tmp", dir / "server.txt");
    return server;
  };
}

struct ServerRecord {
  int asked_port = -1;
  int port = -1;
  std::string job_id;
};

ServerRecord read_server_record(const fs::path& dir) {
  ServerRecord record;
  std::istringstream(read_text(dir / "server.txt")) >> record.asked_port >> record.port >>
      record.job_id;
  return record;
}

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
    options.store_server = recording_server(dir_);
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
         "$MASTER_ADDR $MASTER_PORT $SHARDKIT_LAUNCHED $SHARDKIT_STORE_HOSTED "
         "$SHARDKIT_JOB_ID\""));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const ServerRecord server = read_server_record(dir_);
  EXPECT_EQ(server.asked_port, 0);
  EXPECT_EQ(server.job_id.size(), 16u) << server.job_id;
  std::istringstream lines(r.out);
  std::string line;
  std::set<int> ranks;
  std::set<int> ports;
  while (std::getline(lines, line)) {
    std::istringstream words(line);
    std::string tag, prefix_rank, env;
    int rank, world, local_rank, local_world, port, launched, hosted;
    std::string addr, job_id;
    words >> tag >> prefix_rank >> env >> rank >> world >> local_rank >>
        local_world >> addr >> port >> launched >> hosted >> job_id;
    ASSERT_FALSE(words.fail()) << line;
    EXPECT_EQ(hosted, 1);
    EXPECT_EQ(job_id, server.job_id);
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
  EXPECT_EQ(ports, (std::set<int>{server.port}));
}

// The node variables each rank of `options` saw, by rank: what
// detect_launch_env makes of them.
std::map<int, LaunchEnv> node_layout_seen(const LaunchOutcome& r) {
  std::map<int, LaunchEnv> seen;
  std::istringstream lines(r.out);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream words(line);
    std::string tag, prefix_rank;
    std::map<std::string, std::string> vars;
    words >> tag >> prefix_rank;
    for (const char* name :
         {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"}) {
      words >> vars[name];
    }
    EXPECT_FALSE(words.fail()) << line;
    EXPECT_EQ(prefix_rank, vars["RANK"] + "]") << line;
    LaunchEnv env = detect_launch_env([&](const std::string& name) -> std::optional<std::string> {
      auto it = vars.find(name);
      if (it == vars.end()) return std::nullopt;
      return it->second;
    });
    seen[env.rank] = env;
  }
  return seen;
}

constexpr const char* kPrintNodeVars =
    "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $GROUP_WORLD_SIZE\"";

TEST_F(LocalLauncherTest, TwoSimulatedNodesGiveEachRankItsNodeAndLocalRank) {
  LocalLaunchOptions options = shell_ranks(4, kPrintNodeVars);
  options.nodes = 2;
  LaunchOutcome r = launch(options);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::map<int, LaunchEnv> seen = node_layout_seen(r);
  ASSERT_EQ(seen.size(), 4u) << r.out;
  for (const auto& [rank, env] : seen) {
    EXPECT_EQ(env.world_size, 4);
    EXPECT_EQ(env.local_rank, rank % 2) << "rank " << rank;
    EXPECT_EQ(env.local_world_size, 2);
    EXPECT_EQ(env.node, rank / 2) << "rank " << rank;
    EXPECT_EQ(env.nodes, 2);
  }
}

TEST_F(LocalLauncherTest, OneNodeIsTheDefaultAndHoldsEveryRank) {
  LaunchOutcome r = launch(shell_ranks(3, kPrintNodeVars));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::map<int, LaunchEnv> seen = node_layout_seen(r);
  ASSERT_EQ(seen.size(), 3u) << r.out;
  for (const auto& [rank, env] : seen) {
    EXPECT_EQ(env.local_rank, rank);
    EXPECT_EQ(env.local_world_size, 3);
    EXPECT_EQ(env.node, 0);
    EXPECT_EQ(env.nodes, 1);
  }
}

TEST_F(LocalLauncherTest, NprocThatIsNotAMultipleOfNodesIsRejectedBeforeAnythingStarts) {
  for (int nodes : {2, 0, -1}) {
    LocalLaunchOptions options = shell_ranks(3, "touch \"$1/started.$RANK\"");
    options.nodes = nodes;
    try {
      run_local_launcher(options);
      ADD_FAILURE() << "expected an error for nodes=" << nodes;
    } catch (const std::invalid_argument& e) {
      EXPECT_TRUE(contains(e.what(), "nodes=" + std::to_string(nodes))) << e.what();
      EXPECT_TRUE(contains(e.what(), "nproc=3")) << e.what();
    }
  }
  EXPECT_FALSE(fs::exists(dir_ / "server.txt"));
  EXPECT_FALSE(fs::exists(dir_ / "started.0"));
}

TEST(ArgvWithoutNproc, DropsEveryLauncherFlagInBothFormsAndKeepsTheRest) {
  std::vector<std::string> args{"train",  "--config", "c.yaml",  "--nproc",  "4",
                                "--nodes", "2",       "--nproc-per-node",   "2",
                                "--nproc=4", "--nodes=2", "--nproc-per-node=2",
                                "--set",  "run.nodes=3", "--print-config"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  std::vector<std::string> kept =
      argv_without_nproc(static_cast<int>(argv.size()), argv.data());
  ASSERT_FALSE(kept.empty());
  EXPECT_EQ(kept[0], fs::read_symlink("/proc/self/exe").string());
  EXPECT_EQ(std::vector<std::string>(kept.begin() + 1, kept.end()),
            (std::vector<std::string>{"--config", "c.yaml", "--set", "run.nodes=3",
                                      "--print-config"}));
}

TEST(ArgvWithoutNproc, DropsMaxRestartsInBothForms) {
  std::vector<std::string> args{"train", "--max-restarts", "3", "--config", "c.yaml",
                                "--max-restarts=2", "--nproc", "2", "--set", "a=1"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  std::vector<std::string> kept = argv_without_nproc(static_cast<int>(argv.size()), argv.data());
  EXPECT_EQ(std::vector<std::string>(kept.begin() + 1, kept.end()),
            (std::vector<std::string>{"--config", "c.yaml", "--set", "a=1"}));
}

// Each rank appends "<attempt> <job id> <port>" to $1/starts.<rank>.
const char* kRecordStart =
    "echo \"$TORCHELASTIC_RESTART_COUNT $SHARDKIT_JOB_ID $MASTER_PORT\" >> \"$1/starts.$RANK\"; ";

std::vector<std::string> read_lines(const fs::path& path) {
  std::vector<std::string> lines;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

size_t count_of(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

TEST_F(LocalLauncherTest, AFailedGroupStartsAgainWithTheNextAttemptTheSameJobAndStore) {
  // Attempt 0: rank 1 fails once rank 0 is up; attempt 1: both succeed.
  LocalLaunchOptions options = shell_ranks(
      2, std::string(kRecordStart) +
             "if [ \"$RANK\" = 1 ] && [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then "
             "  while [ ! -e \"$1/starts.0\" ]; do sleep 0.05; done; exit 3; fi; "
             "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then exec sleep 60; fi; "
             "echo \"done $TORCHELASTIC_RESTART_COUNT\"");
  options.max_restarts = 2;
  LaunchOutcome r = launch(options);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_LT(r.seconds, 20);
  EXPECT_TRUE(contains(r.err, "launcher: rank 1 exited with status 3; restarting the group (restart 1 of 2)\n"))
      << r.err;
  EXPECT_EQ(count_of(r.err, "restarting"), 1u) << r.err;
  EXPECT_TRUE(contains(r.out, "[rank 0] done 1\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "[rank 1] done 1\n")) << r.out;
  const ServerRecord server = read_server_record(dir_);
  const std::string same_job = server.job_id + " " + std::to_string(server.port);
  for (int k : {0, 1}) {
    EXPECT_EQ(read_lines(dir_ / ("starts." + std::to_string(k))),
              (std::vector<std::string>{"0 " + same_job, "1 " + same_job}))
        << "rank " << k;
  }
}

// A shell standby: records itself, then reads its rank's variables from the
// launcher's socket (NUL-separated entries, until the launcher closes it)
// and exports them, as comm::wait_if_standby does in train. bash: dash
// redirects only fds 0-9.
const char* kShellStandby =
    "if [ -n \"$SHARDKIT_STANDBY_FD\" ]; then "
    "  echo \"$$ rank=$RANK\" >> \"$1/standbys\"; "
    "  eval \"$(tr '\\0' '\\n' <&$SHARDKIT_STANDBY_FD | grep = | sed 's/^/export /')\"; "
    "  echo $$ > \"$1/activated.$RANK.$TORCHELASTIC_RESTART_COUNT\"; "
    "fi; ";

size_t line_count(const fs::path& path) {
  std::ifstream in(path);
  size_t n = 0;
  for (std::string line; std::getline(in, line);) ++n;
  return n;
}

// With standbys, each restart activates the processes the launcher started
// ahead of it (loaded, without rank variables), which then run as the
// ranks of the new attempt with the same job, store and attempt numbers.
TEST_F(LocalLauncherTest, RestartsActivateTheStandbysStartedAheadOfThem) {
  LocalLaunchOptions options = shell_ranks(
      2, std::string(kShellStandby) + kRecordStart +
             "if [ \"$RANK\" = 1 ] && [ \"$TORCHELASTIC_RESTART_COUNT\" -lt 2 ]; then "
             "  while [ \"$(cat \"$1/standbys\" 2>/dev/null | wc -l)\" -lt "
             "$((2 * TORCHELASTIC_RESTART_COUNT + 2)) ]; do sleep 0.05; done; kill -KILL $$; fi; "
             "if [ \"$TORCHELASTIC_RESTART_COUNT\" -lt 2 ]; then exec sleep 60; fi; "
             "echo \"done $TORCHELASTIC_RESTART_COUNT\"");
  options.argv[0] = "/bin/bash";
  options.max_restarts = 2;
  options.standby = true;
  options.standby_delay_s = 0.2;
  LaunchOutcome r = launch(options);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_LT(r.seconds, 30);
  EXPECT_EQ(count_of(r.err, "restarting"), 2u) << r.err;
  EXPECT_TRUE(contains(r.out, "[rank 0] done 2\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "[rank 1] done 2\n")) << r.out;
  // Two standbys per restart (none after the last), each without a rank.
  const std::vector<std::string> standbys = read_lines(dir_ / "standbys");
  ASSERT_EQ(standbys.size(), 4u) << r.err;
  std::set<std::string> standby_pids;
  for (const std::string& line : standbys) {
    EXPECT_NE(line.find(" rank="), std::string::npos) << line;
    EXPECT_EQ(line.substr(line.find(" rank=")), " rank=") << "a standby had a rank: " << line;
    standby_pids.insert(line.substr(0, line.find(' ')));
  }
  // Each attempt after the first ran on activated standbys, one per rank.
  for (int attempt : {1, 2}) {
    for (int rank : {0, 1}) {
      const auto pid = read_lines(dir_ / ("activated." + std::to_string(rank) + "." + std::to_string(attempt)));
      ASSERT_EQ(pid.size(), 1u) << "rank " << rank << " attempt " << attempt << " was not a standby\n" << r.err;
      EXPECT_EQ(standby_pids.erase(pid[0]), 1u) << pid[0];
    }
  }
  const ServerRecord server = read_server_record(dir_);
  const std::string same_job = server.job_id + " " + std::to_string(server.port);
  for (int k : {0, 1}) {
    EXPECT_EQ(read_lines(dir_ / ("starts." + std::to_string(k))),
              (std::vector<std::string>{"0 " + same_job, "1 " + same_job, "2 " + same_job}))
        << "rank " << k;
  }
}

// A standby that dies before it is needed is reported, and the restart
// starts its rank afresh; standbys nobody needed are killed at the end.
TEST_F(LocalLauncherTest, ADeadStandbyIsReplacedByAFreshRankAndUnusedStandbysDoNotOutliveTheJob) {
  LocalLaunchOptions options = shell_ranks(
      2, std::string(kShellStandby) + kRecordStart +
             "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 1 ]; then "
             "  while [ \"$(cat \"$1/standbys\" 2>/dev/null | wc -l)\" -lt 2 ]; do sleep 0.05; done; "
             "  kill -KILL $(tail -n 1 \"$1/standbys\" | cut -d' ' -f1); sleep 0.5; exit 5; fi; "
             "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then exec sleep 60; fi; "
             "if [ \"$RANK\" = 0 ]; then "
             "  while [ \"$(cat \"$1/standbys\" 2>/dev/null | wc -l)\" -lt 4 ]; do sleep 0.05; done; fi; "
             "echo \"done $TORCHELASTIC_RESTART_COUNT\"");
  options.argv[0] = "/bin/bash";
  options.max_restarts = 2;
  options.standby = true;
  options.standby_delay_s = 0.2;
  LaunchOutcome r = launch(options);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const std::vector<std::string> standbys = read_lines(dir_ / "standbys");
  ASSERT_EQ(standbys.size(), 4u) << r.err;
  EXPECT_TRUE(contains(r.err, "was killed by signal 9 (SIGKILL) before it was needed; a restart starts rank"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "launcher: rank 1 exited with status 5; restarting the group (restart 1 of 2)"))
      << r.err;
  // One of attempt 1's ranks was the surviving standby, the other started
  // afresh (no activation record).
  int activated = 0;
  for (int rank : {0, 1}) activated += fs::exists(dir_ / ("activated." + std::to_string(rank) + ".1")) ? 1 : 0;
  EXPECT_EQ(activated, 1);
  EXPECT_EQ(line_count(dir_ / "starts.0"), 2u);
  EXPECT_EQ(line_count(dir_ / "starts.1"), 2u);
  // Attempt 1's standbys were never needed: gone with the job.
  for (size_t i = 2; i < 4; ++i) {
    const pid_t pid = std::atoi(standbys[i].c_str());
    EXPECT_NE(::kill(pid, 0), 0) << "standby " << pid << " outlived the launcher";
  }
}

TEST_F(LocalLauncherTest, ExhaustedRestartsReturnTheLastFailuresStatus) {
  LocalLaunchOptions options = shell_ranks(
      2, std::string(kRecordStart) +
             "if [ \"$RANK\" = 1 ]; then while [ \"$(wc -l 2>/dev/null < \"$1/starts.0\" || echo 0)\" -lt "
             "$((TORCHELASTIC_RESTART_COUNT + 1)) ]; do sleep 0.05; done; kill -KILL $$; fi; exec sleep 60");
  options.max_restarts = 2;
  LaunchOutcome r = launch(options);
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << r.err;
  EXPECT_LT(r.seconds, 30);
  EXPECT_TRUE(contains(r.err, "launcher: rank 1 killed by signal 9 (SIGKILL); restarting the group (restart 1 of 2)\n"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "launcher: rank 1 killed by signal 9 (SIGKILL); restarting the group (restart 2 of 2)\n"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "launcher: rank 1 killed by signal 9 (SIGKILL)\n")) << r.err;
  EXPECT_EQ(count_of(r.err, "restarting"), 2u) << r.err;
  EXPECT_EQ(read_lines(dir_ / "starts.1").size(), 3u);
}

TEST_F(LocalLauncherTest, WithoutMaxRestartsAFailedGroupIsNotRestarted) {
  LaunchOutcome r = launch(shell_ranks(2, std::string(kRecordStart) +
                                              "if [ \"$RANK\" = 1 ]; then exit 4; fi; exec sleep 60"));
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_TRUE(contains(r.err, "launcher: rank 1 exited with status 4\n")) << r.err;
  EXPECT_EQ(read_lines(dir_ / "starts.1").size(), 1u);
}

TEST_F(LocalLauncherTest, APreemptionStopOrAUsageErrorIsNotRestarted) {
  for (int code : {kExitResumable, kExitUsage}) {
    fs::remove(dir_ / "starts.1");
    LocalLaunchOptions options = shell_ranks(
        2, std::string(kRecordStart) + "if [ \"$RANK\" = 1 ]; then exit " + std::to_string(code) +
               "; fi; exec sleep 60");
    options.max_restarts = 3;
    LaunchOutcome r = launch(options);
    EXPECT_EQ(r.exit_code, code) << r.err;
    EXPECT_FALSE(contains(r.err, "restarting")) << r.err;
    EXPECT_EQ(read_lines(dir_ / "starts.1").size(), 1u) << "status " << code;
  }
}

TEST_F(LocalLauncherTest, RanksReachTheStoreServerWhichIsUpBeforeAnyRankStarts) {
  // bash, for its /dev/tcp: a rank that cannot connect exits 1.
  LaunchOutcome r = launch(shell_ranks(
      3, "test -e \"$1/server.txt\" || exit 2; "
         "exec bash -c 'exec 3<>/dev/tcp/$MASTER_ADDR/$MASTER_PORT && echo connected'"));
  EXPECT_EQ(r.exit_code, 0) << r.err;
  for (int k = 0; k < 3; ++k) {
    EXPECT_TRUE(contains(r.out, "[rank " + std::to_string(k) + "] connected\n")) << r.out;
  }
}

TEST_F(LocalLauncherTest, EachLaunchIsANewJob) {
  const std::string script = "echo \"$SHARDKIT_JOB_ID\"";
  LaunchOutcome first = launch(shell_ranks(1, script));
  LaunchOutcome second = launch(shell_ranks(1, script));
  ASSERT_EQ(first.exit_code, 0) << first.err;
  ASSERT_EQ(second.exit_code, 0) << second.err;
  EXPECT_NE(first.out, second.out);
}

TEST_F(LocalLauncherTest, RanksGetTheServersPortWhateverPortWasAsked) {
  LocalLaunchOptions options = shell_ranks(2, "echo \"port $MASTER_PORT\"");
  options.master_port = 34567;
  LaunchOutcome r = launch(options);
  EXPECT_EQ(r.exit_code, 0);
  const ServerRecord server = read_server_record(dir_);
  EXPECT_EQ(server.asked_port, 34567);
  const std::string port = std::to_string(server.port);
  EXPECT_TRUE(contains(r.out, "[rank 0] port " + port + "\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "[rank 1] port " + port + "\n")) << r.out;
}

TEST_F(LocalLauncherTest, StoreServerThatCannotStartStopsTheLaunchBeforeAnyRank) {
  LocalLaunchOptions options = shell_ranks(2, "touch \"$1/started.$RANK\"");
  options.store_server = [](const std::string&, int, const std::string&)
      -> std::unique_ptr<StoreServer> { throw std::runtime_error("port 29500 is taken"); };
  LaunchOutcome r = launch(options);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(contains(r.err, "port 29500 is taken")) << r.err;
  EXPECT_FALSE(fs::exists(dir_ / "started.0"));
  EXPECT_FALSE(fs::exists(dir_ / "started.1"));
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
  options.store_server = recording_server(dir_);
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

TEST_F(LocalLauncherTest, RanksDoNotInheritTheStoreServersSockets) {
  LocalLaunchOptions options = shell_ranks(2, "ls /proc/$$/fd");
  options.store_server = [](const std::string&, int, const std::string&) {
    return std::make_unique<ListeningSocket>(0, /*inheritable=*/true);
  };
  LaunchOutcome r = launch(options);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::set<int> expected = inheritable_fds();
  expected.insert({0, 1, 2});
  for (int k = 0; k < 2; ++k) {
    std::istringstream lines(r.out);
    std::string prefix = "[rank " + std::to_string(k) + "] ";
    std::string line;
    std::set<int> seen;
    while (std::getline(lines, line)) {
      if (line.rfind(prefix, 0) == 0) seen.insert(std::atoi(line.c_str() + prefix.size()));
    }
    EXPECT_EQ(seen, expected) << r.out;
  }
}

TEST_F(LocalLauncherTest, PreviousSignalHandlersAreRestoredAfterwards) {
  struct sigaction custom {};
  custom.sa_handler = SIG_IGN;
  sigemptyset(&custom.sa_mask);
  struct sigaction saved {};
  ASSERT_EQ(sigaction(SIGTERM, &custom, &saved), 0);
  LocalLaunchOptions options = shell_ranks(2, "true");
  EXPECT_EQ(run_local_launcher(options), 0);
  struct sigaction now {};
  sigaction(SIGTERM, nullptr, &now);
  EXPECT_EQ(now.sa_handler, SIG_IGN);
  sigaction(SIGTERM, &saved, nullptr);
}

TEST_F(LocalLauncherTest, InvalidOptionsAreRejectedBeforeAnythingStarts) {
  const LocalLaunchOptions valid = shell_ranks(1, "true");
  LocalLaunchOptions options = valid;
  options.nproc = 0;
  EXPECT_THROW(run_local_launcher(options), std::invalid_argument);
  options = valid;
  options.argv = {};
  EXPECT_THROW(run_local_launcher(options), std::invalid_argument);
  options = valid;
  options.master_port = 65536;
  EXPECT_THROW(run_local_launcher(options), std::invalid_argument);
  options = valid;
  options.store_server = nullptr;
  try {
    run_local_launcher(options);
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_TRUE(contains(e.what(), "store_server")) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir_ / "server.txt"));
}

}  // namespace
}  // namespace comm
