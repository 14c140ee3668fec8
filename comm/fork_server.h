#pragma once
// A test binary's fork server (docs/building.md, "CI time").
//
// Every test is a process of its own (one ctest test per TEST), and a process
// that loads LibTorch spends about 0.6 s of CPU in LibTorch's static
// initialisation before main, about 560 times per leg. ctest runs each test
// through tests/support/test_fork.cpp (the test binaries' CROSSCOMPILING_EMULATOR),
// which asks a server, this binary started once with SHARDKIT_TEST_SERVE set,
// to fork a copy of itself as it was when main began: LibTorch already loaded,
// no test run yet. fork copies only the calling thread; the one other thread
// at main is OpenBLAS's pool, which OpenBLAS's own pthread_atfork handler
// stops before a fork and starts again on first use. The copy takes the client's argv, environment,
// working directory, umask and standard streams, runs main as an exec'd test
// would, and its wait status goes back to the client, which exits with it.
// Each test still has a fresh process of its own.
//
// The same server runs in train, ckpt and generate (their main calls
// serve_forks_if_asked first): the tests that run them as commands and
// neither signal them nor look for their processes (TrainCli's, the bad
// configs of ConfigRobustness) go through test_fork too, so that each such
// command skips LibTorch's load as a test does. Outside the test suite
// nothing sets SHARDKIT_TEST_SERVE and the call returns at once.
//
// The server lives while it has tests or was used within the last
// kIdleSeconds, and kills a test's process group when its client goes away
// (ctest's timeout kill). SHARDKIT_TEST_FORKSERVER=0 makes the client exec the
// binary directly.

namespace comm {

// When SHARDKIT_TEST_SERVE names a socket path: serves forks on it and
// returns only in a forked test, with argc/argv replaced by the client's
// (the process then runs main's test code). Otherwise returns at once.
void serve_forks_if_asked(int& argc, char**& argv);

}  // namespace comm
