#include "comm/self_launch.h"

#include "comm/exit_now.h"
#include "comm/launch_env.h"
#include "comm/local_launcher.h"
#include "comm/runtime.h"

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <stdexcept>

namespace comm {

int self_launching_main(int argc, char** argv, const std::string& name,
                        const std::function<int(const std::string& dir)>& run_rank,
                        int default_nproc) {
  int nproc = default_nproc;
  std::string dir;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--nproc" && i + 1 < argc) {
      nproc = std::atoi(argv[++i]);
    } else if (arg == "--dir" && i + 1 < argc) {
      dir = argv[++i];
    } else {
      std::cerr << "usage: " << name << " [--nproc N] [--dir DIR]\n";
      return 2;
    }
  }
  try {
    if (detect_launch_env(process_env()).source != LaunchSource::kSingleProcess) {
      if (dir.empty()) throw std::invalid_argument("--dir is required when started by a launcher");
      exit_now(run_rank(dir));
    }
    if (nproc < 1) throw std::invalid_argument("--nproc must be at least 1");
    // The ranks to be, forked before anything else: they skip the load.
    if (auto rank_argv = fork_rank_templates(nproc)) {
      std::vector<char*> pointers;
      for (std::string& arg : *rank_argv) pointers.push_back(arg.data());
      pointers.push_back(nullptr);
      return self_launching_main(static_cast<int>(rank_argv->size()), pointers.data(), name, run_rank,
                                 default_nproc);
    }
    // Not a rank yet: start `nproc` ranks of this program and wait for them.
    const bool own_dir = dir.empty();
    if (own_dir) {
      std::string tmpl = (std::filesystem::temp_directory_path() / (name + ".XXXXXX")).string();
      if (mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed: " + tmpl);
      dir = tmpl;
    }
    LocalLaunchOptions launch;
    launch.nproc = nproc;
    launch.argv = {std::filesystem::read_symlink("/proc/self/exe").string(), "--dir", dir};
    // The launcher serves the job's c10d store itself; the ranks connect to it.
    launch.store_server = host_tcp_store;
    const int rc = run_local_launcher(launch);
    if (own_dir && rc == 0) std::filesystem::remove_all(dir);
    return rc;
  } catch (const std::exception& e) {
    std::cerr << name << ": " << e.what() << std::endl;
    return 1;
  }
}

}  // namespace comm
