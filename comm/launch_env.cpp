#include "comm/launch_env.h"
#include "comm/local_launcher.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cerrno>
#include <cstring>
#include <string>
#include <ctime>
#include <limits>
#include <random>
#include <stdexcept>

#include <sys/socket.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

namespace comm {
namespace {

constexpr int kDefaultMasterPort = 29500;
// Under SLURM without a port: kSlurmPortBase + the job id's last four digits.
constexpr int kSlurmPortBase = 15000;
constexpr const char* kDefaultMasterAddr = "127.0.0.1";

[[noreturn]] void throw_bad_value(const std::string& name,
                                  const std::string& value,
                                  const std::string& why) {
  throw std::invalid_argument("launch environment: " + name + "=\"" + value +
                              "\" " + why);
}

// Decimal digits only: no sign, no spaces, no suffix, no overflow.
int parse_non_negative(const std::string& name, const std::string& value) {
  if (value.empty()) throw_bad_value(name, value, "is empty");
  long long result = 0;
  for (char c : value) {
    if (c < '0' || c > '9') {
      throw_bad_value(name, value, "is not a non-negative integer");
    }
    result = result * 10 + (c - '0');
    if (result > std::numeric_limits<int>::max()) {
      throw_bad_value(name, value, "is out of range");
    }
  }
  return static_cast<int>(result);
}

// Reads a required integer variable; `name` must be set.
int read_int(const EnvLookup& env, const std::string& name) {
  std::optional<std::string> value = env(name);
  if (!value) {
    throw std::invalid_argument("launch environment: " + name +
                                " is not set (needed with the others of its "
                                "launcher)");
  }
  return parse_non_negative(name, *value);
}

// At least 1: a count of ranks or nodes.
int parse_positive(const std::string& name, const std::string& value) {
  int result = parse_non_negative(name, value);
  if (result < 1) throw_bad_value(name, value, "must be at least 1");
  return result;
}

// A value and where it came from, for error messages: the variable that
// held it, or how it was derived ("RANK/LOCAL_WORLD_SIZE").
struct Sourced {
  int value = 0;
  std::string source;
  std::string text() const { return source + "=" + std::to_string(value); }
};

Sourced read_sourced(const EnvLookup& env, const std::string& name) {
  return {read_int(env, name), name};
}

// Set: the variable, parsed as a count (>= 1). Unset: `fallback`.
Sourced read_count_or(const EnvLookup& env, const std::string& name,
                      Sourced fallback) {
  std::optional<std::string> value = env(name);
  return value ? Sourced{parse_positive(name, *value), name} : fallback;
}

// Set: the variable, parsed as an index (>= 0). Unset: `fallback`.
Sourced read_index_or(const EnvLookup& env, const std::string& name,
                      Sourced fallback) {
  std::optional<std::string> value = env(name);
  return value ? Sourced{parse_non_negative(name, *value), name} : fallback;
}

[[noreturn]] void throw_bad(const Sourced& v, const std::string& why) {
  throw_bad_value(v.source, std::to_string(v.value), why);
}

// `numerator` / `denominator`, which must divide.
Sourced quotient(const Sourced& numerator, const Sourced& denominator,
                 const std::string& why_needed) {
  if (numerator.value % denominator.value != 0) {
    throw_bad(numerator, "is not a multiple of " + denominator.text() + " (" +
                             why_needed + ")");
  }
  return {numerator.value / denominator.value,
          numerator.source + "/" + denominator.source};
}

struct Placement {
  Sourced rank;
  Sourced world_size;
  Sourced local_rank;
  Sourced local_world_size;
  Sourced node;
  Sourced nodes;
};

// Before anything is derived from them (they are divided by).
void check_rank(const Placement& p) {
  if (p.world_size.value < 1) throw_bad(p.world_size, "must be at least 1");
  if (p.rank.value >= p.world_size.value) {
    throw_bad(p.rank, "must be less than " + p.world_size.text());
  }
}

// `exact`: every node holds local_world_size ranks (torchrun). Otherwise
// the last nodes may hold fewer (SLURM's --ntasks below nodes x
// --ntasks-per-node).
void check_nodes(const Placement& p, bool exact) {
  if (p.nodes.value > p.world_size.value) {
    throw_bad(p.nodes, "must not exceed " + p.world_size.text());
  }
  if (p.local_rank.value >= p.local_world_size.value) {
    throw_bad(p.local_rank, "must be less than " + p.local_world_size.text());
  }
  // Before the node check: a node derived from the rank is then in range.
  const long long capacity =
      static_cast<long long>(p.local_world_size.value) * p.nodes.value;
  const std::string layout =
      p.nodes.text() + " x " + p.local_world_size.text() + " ranks";
  if (exact && capacity != p.world_size.value) {
    throw_bad(p.world_size, "is not " + layout);
  }
  if (capacity < p.world_size.value) {
    throw_bad(p.world_size, "is more than " + layout);
  }
  if (p.node.value >= p.nodes.value) {
    throw_bad(p.node, "must be less than " + p.nodes.text());
  }
}

void apply(const Placement& p, LaunchEnv& result) {
  result.rank = p.rank.value;
  result.world_size = p.world_size.value;
  result.local_rank = p.local_rank.value;
  result.local_world_size = p.local_world_size.value;
  result.node = p.node.value;
  result.nodes = p.nodes.value;
}

// A port per SLURM job, as PyTorch Lightning's SLURMEnvironment derives it:
// rank 0 serves its store there, and a fixed default would make two jobs
// whose rank 0 share a node take the same port. Job ids are unique among the
// cluster's jobs; ids that share their last four digits (a multiple of 10000
// apart) still collide, and need MASTER_PORT.
// Only the last four digits are parsed: an id may exceed an int.
int slurm_job_port(const std::string& job_id) {
  if (job_id.empty() || job_id.find_first_not_of("0123456789") != std::string::npos) {
    throw_bad_value("SLURM_JOB_ID", job_id,
                    "is not a job id (decimal digits), so no port can be "
                    "derived from it; set MASTER_PORT or dist.master_port");
  }
  const size_t digits = std::min<size_t>(job_id.size(), 4);
  return kSlurmPortBase +
         parse_non_negative("SLURM_JOB_ID", job_id.substr(job_id.size() - digits));
}

// MASTER_PORT, else dist.master_port, else (SLURM only) the job's own port,
// else the default; sets master_port and master_port_source.
void resolve_port(const EnvLookup& env, int config_master_port,
                  LaunchEnv& result) {
  if (std::optional<std::string> value = env("MASTER_PORT")) {
    int port = parse_non_negative("MASTER_PORT", *value);
    if (port < 1 || port > 65535) {
      throw_bad_value("MASTER_PORT", *value, "is not a TCP port (1..65535)");
    }
    result.master_port = port;
    result.master_port_source = "MASTER_PORT";
    return;
  }
  if (config_master_port > 65535) {
    throw std::invalid_argument("dist.master_port=" +
                                std::to_string(config_master_port) +
                                " is not a TCP port (1..65535)");
  }
  if (config_master_port > 0) {
    result.master_port = config_master_port;
    result.master_port_source = "dist.master_port";
    return;
  }
  // torchrun always sets MASTER_PORT; under `srun torchrun` SLURM_JOB_ID
  // describes the allocation, not this process's rendezvous.
  if (result.source == LaunchSource::kSlurm) {
    if (std::optional<std::string> job_id = env("SLURM_JOB_ID")) {
      result.master_port = slurm_job_port(*job_id);
      result.master_port_source = "SLURM_JOB_ID=" + *job_id;
      return;
    }
  }
  result.master_port = kDefaultMasterPort;
  result.master_port_source.clear();
}

std::optional<std::string> non_empty(std::optional<std::string> value) {
  if (value && value->empty()) return std::nullopt;
  return value;
}

// The first host of a SLURM node list when it is a plain host name;
// nullopt for a bracketed range such as "node[01-04]" (expanding those is
// scontrol's job, not ours).
std::optional<std::string> first_plain_host(const std::string& nodelist) {
  std::string first = nodelist.substr(0, nodelist.find(','));
  if (first.empty() || first.find_first_of("[]") != std::string::npos) {
    return std::nullopt;
  }
  return first;
}

// torchrun's node layout: see the header. Without LOCAL_WORLD_SIZE, one node.
// The rank and the world size from the launcher's two variables, checked.
Placement read_rank_and_world(const EnvLookup& env, const std::string& rank_var,
                              const std::string& world_var) {
  Placement p;
  p.rank = read_sourced(env, rank_var);
  p.world_size = read_sourced(env, world_var);
  check_rank(p);
  return p;
}

void read_torchrun_nodes(const EnvLookup& env, Placement& p) {
  if (std::optional<std::string> per_node = env("LOCAL_WORLD_SIZE")) {
    p.local_world_size = {parse_positive("LOCAL_WORLD_SIZE", *per_node),
                          "LOCAL_WORLD_SIZE"};
    if (std::optional<std::string> nodes = env("GROUP_WORLD_SIZE")) {
      p.nodes = {parse_positive("GROUP_WORLD_SIZE", *nodes), "GROUP_WORLD_SIZE"};
    } else {
      p.nodes = quotient(p.world_size, p.local_world_size,
                         "GROUP_WORLD_SIZE is not set");
    }
    p.node = read_index_or(env, "GROUP_RANK",
                           {p.rank.value / p.local_world_size.value,
                            "RANK/LOCAL_WORLD_SIZE"});
  } else {
    p.local_world_size = {p.world_size.value, "WORLD_SIZE"};
    p.nodes = {1, "nodes"};
    p.node = {0, "node"};
  }
  p.local_rank = read_index_or(env, "LOCAL_RANK",
                               {p.rank.value % p.local_world_size.value,
                                "RANK%LOCAL_WORLD_SIZE"});
}

LaunchEnv detect_torchrun(const EnvLookup& env,
                          const std::string& config_master_addr) {
  LaunchEnv result;
  result.source = LaunchSource::kTorchrun;
  Placement p = read_rank_and_world(env, "RANK", "WORLD_SIZE");
  read_torchrun_nodes(env, p);
  check_nodes(p, /*exact=*/true);
  apply(p, result);
  if (std::optional<std::string> addr = non_empty(env("MASTER_ADDR"))) {
    result.master_addr = *addr;
  } else if (!config_master_addr.empty()) {
    result.master_addr = config_master_addr;
  }
  return result;
}

std::string slurm_master_addr(const EnvLookup& env,
                              const std::string& config_master_addr) {
  if (std::optional<std::string> addr = non_empty(env("MASTER_ADDR"))) {
    return *addr;
  }
  if (!config_master_addr.empty()) return config_master_addr;
  for (const char* name : {"SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
    std::optional<std::string> nodelist = non_empty(env(name));
    if (!nodelist) continue;
    if (std::optional<std::string> host = first_plain_host(*nodelist)) {
      return *host;
    }
    throw_bad_value(name, *nodelist,
                    "is a host range, not a plain host name; set MASTER_ADDR "
                    "(e.g. MASTER_ADDR=$(scontrol show hostnames \"$" +
                        std::string(name) +
                        "\" | head -n1)) or dist.master_addr in the config");
  }
  throw std::invalid_argument(
      "launch environment: SLURM launch without a master address; set "
      "MASTER_ADDR or dist.master_addr in the config (neither "
      "SLURM_JOB_NODELIST nor SLURM_NODELIST is set)");
}

// SLURM_NTASKS_PER_NODE when it is a plain number; otherwise (unset, or a
// list such as "2(x3),1") SLURM_NTASKS / SLURM_NNODES, which must divide.
Sourced slurm_local_world_size(const EnvLookup& env, const Placement& p) {
  std::optional<std::string> per_node = non_empty(env("SLURM_NTASKS_PER_NODE"));
  if (per_node && per_node->find_first_not_of("0123456789") == std::string::npos) {
    // A maximum: `srun -n 2 --ntasks-per-node=4` runs 2 ranks on one node.
    return {std::min(parse_positive("SLURM_NTASKS_PER_NODE", *per_node),
                     p.world_size.value),
            "SLURM_NTASKS_PER_NODE"};
  }
  const std::string why =
      per_node ? "SLURM_NTASKS_PER_NODE=\"" + *per_node +
                     "\" is not a plain number; every node must run as many ranks"
               : "SLURM_NTASKS_PER_NODE is not set; every node must run as many ranks";
  return quotient(p.world_size, p.nodes, why);
}

LaunchEnv detect_slurm(const EnvLookup& env,
                       const std::string& config_master_addr) {
  LaunchEnv result;
  result.source = LaunchSource::kSlurm;
  Placement p = read_rank_and_world(env, "SLURM_PROCID", "SLURM_NTASKS");
  p.nodes = read_count_or(env, "SLURM_NNODES", {1, "SLURM_NNODES (unset)"});
  p.local_world_size = slurm_local_world_size(env, p);
  p.node = read_index_or(env, "SLURM_NODEID",
                         {p.rank.value / p.local_world_size.value,
                          "SLURM_PROCID/" + p.local_world_size.source});
  p.local_rank = read_index_or(env, "SLURM_LOCALID", {0, "SLURM_LOCALID"});
  check_nodes(p, /*exact=*/false);
  apply(p, result);
  result.master_addr = slurm_master_addr(env, config_master_addr);
  return result;
}

bool read_store_hosted(const EnvLookup& env) {
  std::optional<std::string> value = env(kStoreHostedVar);
  if (!value || *value == "0") return false;
  if (*value == "1") return true;
  throw_bad_value(kStoreHostedVar, *value, "is not 0 or 1");
}

// torchrun names every job (--rdzv-id, a fresh uuid under --standalone).
std::string read_job_id(const EnvLookup& env) {
  for (const char* name : {kJobIdVar, "TORCHELASTIC_RUN_ID"}) {
    if (std::optional<std::string> id = non_empty(env(name))) return *id;
  }
  return "";
}

}  // namespace

std::string new_job_id() {
  std::random_device entropy;
  const uint64_t id = (static_cast<uint64_t>(entropy()) << 32) ^ entropy();
  char text[17];
  std::snprintf(text, sizeof text, "%016" PRIx64, id);
  return text;
}

namespace {
// CLOCK_BOOTTIME seconds at a standby's activation; 0: not an activated standby.
double g_activated_at_s = 0;
// A rank forked from a template (fork_rank_templates): g_activated_at_s is
// its activation.
bool g_forked_rank = false;

double boottime_s() {
  timespec now{};
  if (::clock_gettime(CLOCK_BOOTTIME, &now) != 0) return 0;
  return static_cast<double>(now.tv_sec) + now.tv_nsec / 1e9;
}
}  // namespace

bool activated_standby() { return g_activated_at_s > 0 && !g_forked_rank; }

bool forked_rank() { return g_forked_rank; }

namespace detail {
void mark_forked_rank_activated() {
  g_activated_at_s = boottime_s();
  g_forked_rank = true;
}
}  // namespace detail

bool wait_if_standby() {
  const char* fd_text = std::getenv(kStandbyFdVar);
  if (fd_text == nullptr) return false;
  const int fd = std::atoi(fd_text);
#ifdef __linux__
  // Shown by ps and top while it waits; the program's own name once active.
  char name[17] = {0};
  ::prctl(PR_GET_NAME, name);
  ::prctl(PR_SET_NAME, "standby-rank");
#endif
  std::string message;
  char buffer[4096];
  while (message.size() < 2 || message.compare(message.size() - 2, 2, std::string("\0\0", 2)) != 0) {
    const ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) ::_exit(0);  // the launcher needs no standby any more
    message.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  g_activated_at_s = boottime_s();
  ::unsetenv(kStandbyFdVar);
  message.pop_back();  // the closing NUL: entries "NAME=VALUE\0" remain
  // Over the room the launcher left in the environment block, so that tools
  // reading /proc/<pid>/environ (ps e, a test finding rank 1) see the rank's
  // variables. The room's entry itself becomes the first variable.
  if (char* room = std::getenv(kStandbyEnvVar); room != nullptr) {
    char* entry = room - std::strlen(kStandbyEnvVar) - 1;
    const size_t size = std::strlen(entry);
    if (message.size() <= size) {
      std::memcpy(entry, message.data(), message.size());
      std::memset(entry + message.size(), 0, size - message.size());
    }
  }
  ::unsetenv(kStandbyEnvVar);
  for (size_t at = 0; at < message.size();) {
    const size_t end = message.find('\0', at);
    const std::string var = message.substr(at, end - at);
    at = end + 1;
    const size_t eq = var.find('=');
    if (eq == std::string::npos || eq == 0) continue;
    ::setenv(var.substr(0, eq).c_str(), var.c_str() + eq + 1, 1);
  }
#ifdef __linux__
  ::prctl(PR_SET_NAME, name);
#endif
  return true;
}

double process_age_s() {
  if (g_activated_at_s > 0) return std::max(0.0, boottime_s() - g_activated_at_s);
  std::FILE* f = std::fopen("/proc/self/stat", "r");
  if (f == nullptr) return 0;
  char text[1024];
  const size_t n = std::fread(text, 1, sizeof text - 1, f);
  std::fclose(f);
  text[n] = '\0';
  // Field 22, starttime; fields count from after the command's ")", which
  // may itself hold spaces and parentheses.
  const char* at = std::strrchr(text, ')');
  if (at == nullptr) return 0;
  unsigned long long start_ticks = 0;
  if (std::sscanf(at + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d %llu",
                  &start_ticks) != 1) {
    return 0;
  }
  timespec now{};
  const long ticks_per_s = ::sysconf(_SC_CLK_TCK);
  if (ticks_per_s <= 0 || ::clock_gettime(CLOCK_BOOTTIME, &now) != 0) return 0;
  const double age = static_cast<double>(now.tv_sec) + now.tv_nsec / 1e9 -
                     static_cast<double>(start_ticks) / static_cast<double>(ticks_per_s);
  return std::max(0.0, age);
}

bool started_by_local_launcher() { return std::getenv(kLaunchedVar) != nullptr; }

EnvLookup process_env() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  };
}

LaunchEnv detect_launch_env(const EnvLookup& env,
                            const std::string& config_master_addr,
                            int config_master_port) {
  if (config_master_port < 0) {
    throw std::invalid_argument("dist.master_port=" +
                                std::to_string(config_master_port) +
                                " must not be negative");
  }
  LaunchEnv result;
  // torchrun wins: under `srun torchrun ...` both sets are present and the
  // torchrun ones describe this process.
  if (env("RANK") || env("WORLD_SIZE")) {
    result = detect_torchrun(env, config_master_addr);
  } else if (env("SLURM_PROCID")) {
    result = detect_slurm(env, config_master_addr);
  } else {
    result.source = LaunchSource::kSingleProcess;
    if (std::optional<std::string> addr = non_empty(env("MASTER_ADDR"))) {
      result.master_addr = *addr;
    } else if (!config_master_addr.empty()) {
      result.master_addr = config_master_addr;
    } else {
      result.master_addr = kDefaultMasterAddr;
    }
  }
  resolve_port(env, config_master_port, result);
  result.store_hosted = read_store_hosted(env);
  // torchrun 2.x with c10d rendezvous: the agent's TCPStore, shared by every
  // round of the job (Python compares the value with str(True)).
  if (std::optional<std::string> agent = env("TORCHELASTIC_USE_AGENT_STORE"); agent && *agent == "True") {
    result.agent_store = true;
    result.store_hosted = true;
  }
  if (std::optional<std::string> restarts = non_empty(env("TORCHELASTIC_RESTART_COUNT"))) {
    result.restart_count = parse_non_negative("TORCHELASTIC_RESTART_COUNT", *restarts);
  }
  result.job_id = read_job_id(env);
  return result;
}

std::string to_string(LaunchSource s) {
  switch (s) {
    case LaunchSource::kSingleProcess:
      return "single";
    case LaunchSource::kTorchrun:
      return "torchrun";
    case LaunchSource::kSlurm:
      return "slurm";
  }
  return "unknown";
}

}  // namespace comm
