#pragma once
// The main() of a program that is its own launcher, as the examples are:
//
//   int main(int argc, char** argv) {
//     return comm::self_launching_main(argc, argv, "my_tool", run_rank);
//   }
//
// Arguments: [--nproc N] [--dir DIR]. Started by torchrun, SLURM or a
// launcher (a rank environment is set), it runs run_rank(DIR) and ends the
// process with its status through exit_now() (comm/exit_now.h: no static
// destructors, which cost most in ranks forked from a loaded launcher); a
// rank's process exists for run_rank alone. DIR is required then. Started
// alone, it runs N copies of this executable
// (default `default_nproc`) as local ranks with run_local_launcher, each
// given "--dir DIR" (a fresh directory under /tmp, removed after a
// successful run, when no --dir is given), serving their store itself, and
// returns the job's exit status. Bad arguments print a usage line and
// return 2; an exception prints "<name>: <what>" and returns 1.
#include <functional>
#include <string>

namespace comm {

int self_launching_main(int argc, char** argv, const std::string& name,
                        const std::function<int(const std::string& dir)>& run_rank,
                        int default_nproc = 2);

}  // namespace comm
