#pragma once
// Ends the process with `status` once its run is over: flushes std::cout,
// std::cerr and every stdio stream, then _Exit, without static destructors.
// LibTorch's take about 0.25 s at every exit, and in a process forked from
// one that loaded LibTorch (a rank of train --nproc, a fork-served command
// or test) far more: they write to pages shared with the parent, and each
// write copies a page and flushes the other cores' TLBs (a fork-served
// generate: 0.37 s with them, 0.05 s without; 64 forked ranks of
// tests/checkpoint/many_ranks: 31 s, 10 s).
// REQUIRES: nothing is left to do but return from main (files closed,
// threads joined or disposable).
#include <cstdio>
#include <cstdlib>
#include <iostream>

namespace comm {

[[noreturn]] inline void exit_now(int status) {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  std::_Exit(status);
}

}  // namespace comm
