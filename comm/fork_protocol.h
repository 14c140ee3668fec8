#pragma once
// The request test_fork.cpp sends a test binary's fork server (fork_server.h),
// over a Unix stream socket:
//  - one sendmsg of a Header, carrying the client's stdin, stdout and stderr
//    as SCM_RIGHTS;
//  - header.payload_bytes bytes: the working directory, then header.argc
//    arguments (argv[0] first), then header.envc "NAME=value" entries, each
//    NUL-terminated.
// The answers: kMagic as a uint32 once the test is forked, then the test's
// wait status as an int32 once it has exited. A connection closed before the
// first means that nothing ran (a server that was idling out): the client
// runs the test itself.
#include <cstdint>

namespace comm::fork_protocol {

constexpr uint32_t kMagic = 0x53464b31;  // "SFK1"
constexpr int kIdleSeconds = 45;

struct Header {
  uint32_t magic;
  uint32_t umask;
  uint32_t argc;
  uint32_t envc;
  uint64_t payload_bytes;
};

}  // namespace comm::fork_protocol
