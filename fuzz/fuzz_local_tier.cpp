// libFuzzer target: the local tier's records (checkpoint/tiers/local_tier.h).
// .local.json and .partner.json lie on node-local disks that outlive jobs,
// and resume reads them (inventory_local_tier); the inventory and candidate
// lists go between ranks as the same JSON. The first byte picks the reader:
//   0 decode_local_record   1 decode_partner_record
//   2 decode_inventory, then choose_resume_tiers over it (twice: as one
//     node and as two)      3 decode_candidates
// Whatever it does not accept must end in FormatError; what it accepts must
// encode and decode back to the same text; never a crash or a sanitizer
// report.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "checkpoint/format/metadata.h"
#include "checkpoint/tiers/local_tier.h"

namespace {

void same(const std::string& a, const std::string& b) {
  if (a != b) std::abort();  // a record that does not survive its own round trip
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  using namespace checkpoint;
  try {
    switch (data[0] % 4) {
      case 0: {
        const std::string once = encode_local_record(decode_local_record(text, "f"));
        same(encode_local_record(decode_local_record(once, "g")), once);
        break;
      }
      case 1: {
        const std::string once = encode_partner_record(decode_partner_record(text, "f"));
        same(encode_partner_record(decode_partner_record(once, "g")), once);
        break;
      }
      case 2: {
        const NodeInventory inv = decode_inventory(text);
        const std::string once = encode_inventory(inv);
        same(encode_inventory(decode_inventory(once)), once);
        NodeInventory other = inv;
        other.node = inv.node + 1;
        for (const std::vector<NodeInventory>& nodes : {std::vector<NodeInventory>{inv},
                                                        std::vector<NodeInventory>{inv, other}}) {
          const TierChoice choice = choose_resume_tiers(nodes, {});
          const std::string listed = encode_candidates(choice.candidates);
          same(encode_candidates(decode_candidates(listed)), listed);
        }
        break;
      }
      default: {
        const std::string once = encode_candidates(decode_candidates(text));
        same(encode_candidates(decode_candidates(once)), once);
        break;
      }
    }
  } catch (const FormatError&) {
  }
  return 0;
}
