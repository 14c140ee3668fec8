// train: thin entry point. args -> config -> (launcher | runtime -> Trainer) -> exit code.
//
//   train --config configs/default.yaml [--set key.path=value]... [--nproc N]
//
// Exit status: 0 done; 2 usage or config error; 75 stopped by a signal after
// its final save (resume me); anything else: a failure (message on stderr).
// The work is framework::train::train_main (framework/train/train_main.h).
#include "comm/exit_now.h"
#include "comm/fork_server.h"
#include "framework/train/train_main.h"

#include <cstdio>
#include <cstdlib>
#include <iostream>

int main(int argc, char** argv) {
  // Under the test suite only (SHARDKIT_TEST_SERVE): a fork server of this
  // binary, loaded once, whose forks return here (comm/fork_server.h).
  comm::serve_forks_if_asked(argc, argv);
  const int status = framework::train::train_main(argc, argv, {});
  // Everything of the run (checkpoints, metrics, TensorBoard files, the
  // launcher's ranks) has ended inside train_main; what is left at exit is
  // LibTorch's static destructors (comm/exit_now.h).
  comm::exit_now(status);
}
