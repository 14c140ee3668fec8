// train: thin entry point. args -> config -> (launcher | runtime -> Trainer) -> exit code.
//
//   train --config configs/default.yaml [--set key.path=value]... [--nproc N]
//
// Exit status: 0 done; 2 usage or config error; 75 stopped by a signal after
// its final save (resume me); anything else: a failure (message on stderr).
// The work is framework::train::train_main (framework/train/train_main.h).
#include "framework/train/train_main.h"

int main(int argc, char** argv) { return framework::train::train_main(argc, argv, {}); }
