#pragma once
// The `train` command as a function: parses the command line, loads the
// config, and either starts the local launcher (--nproc N, which re-executes
// this same program once per rank) or runs this process's rank. train.cpp's
// main is one call to it; a program that wants to plug something into every
// rank's Trainer (a storage, callbacks) calls it with its own hooks, e.g. the
// reliability tests' train_faults.
//
// Returns the exit status: 0 done; 2 usage or config error; 75
// (kExitPreempted) stopped by a signal after its final save; else a failure,
// its message on stderr.
#include "framework/train/trainer.h"

namespace framework::train {

int train_main(int argc, char** argv, const TrainerHooks& hooks);

}  // namespace framework::train
