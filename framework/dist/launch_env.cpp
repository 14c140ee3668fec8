#include "framework/dist/launch_env.h"

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <stdexcept>

namespace framework::dist {
namespace {

constexpr int kDefaultMasterPort = 29500;
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

int read_int_or(const EnvLookup& env, const std::string& name, int fallback) {
  std::optional<std::string> value = env(name);
  return value ? parse_non_negative(name, *value) : fallback;
}

struct Placement {
  int rank;
  int world_size;
  int local_rank;
};

void check_placement(const Placement& p, const std::string& rank_var,
                     const std::string& world_var,
                     const std::string& local_var) {
  if (p.world_size < 1) {
    throw_bad_value(world_var, std::to_string(p.world_size),
                    "must be at least 1");
  }
  if (p.rank >= p.world_size) {
    throw_bad_value(rank_var, std::to_string(p.rank),
                    "must be less than " + world_var + "=" +
                        std::to_string(p.world_size));
  }
  if (p.local_rank >= p.world_size) {
    throw_bad_value(local_var, std::to_string(p.local_rank),
                    "must be less than " + world_var + "=" +
                        std::to_string(p.world_size));
  }
}

int resolve_port(const EnvLookup& env, int config_master_port) {
  if (std::optional<std::string> value = env("MASTER_PORT")) {
    int port = parse_non_negative("MASTER_PORT", *value);
    if (port < 1 || port > 65535) {
      throw_bad_value("MASTER_PORT", *value, "is not a TCP port (1..65535)");
    }
    return port;
  }
  if (config_master_port > 65535) {
    throw std::invalid_argument("dist.master_port=" +
                                std::to_string(config_master_port) +
                                " is not a TCP port (1..65535)");
  }
  return config_master_port > 0 ? config_master_port : kDefaultMasterPort;
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

LaunchEnv detect_torchrun(const EnvLookup& env,
                          const std::string& config_master_addr) {
  LaunchEnv result;
  result.source = LaunchSource::kTorchrun;
  Placement p{read_int(env, "RANK"), read_int(env, "WORLD_SIZE"), 0};
  p.local_rank = read_int_or(env, "LOCAL_RANK", p.rank);
  check_placement(p, "RANK", "WORLD_SIZE", "LOCAL_RANK");
  result.rank = p.rank;
  result.world_size = p.world_size;
  result.local_rank = p.local_rank;
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

LaunchEnv detect_slurm(const EnvLookup& env,
                       const std::string& config_master_addr) {
  LaunchEnv result;
  result.source = LaunchSource::kSlurm;
  Placement p{read_int(env, "SLURM_PROCID"), read_int(env, "SLURM_NTASKS"),
              0};
  p.local_rank = read_int_or(env, "SLURM_LOCALID", 0);
  check_placement(p, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID");
  result.rank = p.rank;
  result.world_size = p.world_size;
  result.local_rank = p.local_rank;
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
  result.master_port = resolve_port(env, config_master_port);
  result.store_hosted = read_store_hosted(env);
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

}  // namespace framework::dist
