#include "checkpoint/agreement.h"

#include <algorithm>

namespace checkpoint {

using comm::Bytes;

Bytes tagged_ok(Bytes payload) {
  payload.insert(payload.begin(), uint8_t{1});
  return payload;
}

Bytes tagged_error(const std::string& message) {
  Bytes b(1 + message.size());
  b[0] = 0;
  std::copy(message.begin(), message.end(), b.begin() + 1);
  return b;
}

Bytes tagged_result(const std::string& error, const std::string& payload) {
  if (!error.empty()) return tagged_error(error);
  return tagged_ok(Bytes(payload.begin(), payload.end()));
}

bool tagged_succeeded(const Bytes& message) { return !message.empty() && message[0] == 1; }

std::string tagged_text(const Bytes& message) {
  if (message.empty()) return "";
  return std::string(message.begin() + 1, message.end());
}

std::string describe_rank_failures(const std::vector<Bytes>& messages) {
  std::string all;
  for (size_t r = 0; r < messages.size(); ++r) {
    if (tagged_succeeded(messages[r])) continue;
    all += (all.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + ": " +
           (messages[r].empty() ? std::string("no reply") : tagged_text(messages[r]));
  }
  return all;
}

}  // namespace checkpoint
