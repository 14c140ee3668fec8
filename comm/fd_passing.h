#pragma once
// Receiving bytes with file descriptors attached (SCM_RIGHTS) over a Unix
// stream socket: the fork server's requests (fork_server.cpp) and a rank
// template's activation (local_launcher.cpp). Torch-free.
#include <cstddef>
#include <vector>

namespace comm {

// Reads exactly `size` bytes into `data` from `sock`, collecting the fds
// that arrive with them (close-on-exec, at most `max_fds`; appended to
// `fds`, which the caller then owns). False on EOF or an error before
// `size` bytes (any fds received are still in `fds`).
bool recv_with_fds(int sock, void* data, size_t size, size_t max_fds, std::vector<int>& fds);

}  // namespace comm
