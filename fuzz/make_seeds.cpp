// Writes the seed corpus: valid inputs for each fuzz target, built with the
// library's own encoders (fuzz/corpus/<target>/seed_*). Run:
//   build-fuzz/make_fuzz_seeds fuzz/corpus
#include <cmath>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoint/format/checksum.h"
#include "checkpoint/codec/chunk_reader.h"
#include "checkpoint/codec/chunk_writer.h"
#include "checkpoint/format/metadata.h"
#include "block_input.h"

namespace fs = std::filesystem;

namespace {

void write(const fs::path& p, const std::vector<uint8_t>& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

checkpoint::ChunkMeta chunk_of(const checkpoint::EncodedChunk& e, checkpoint::Box box,
                               const std::string& file, uint64_t offset,
                               const std::vector<std::string>& chain, int32_t rank) {
  checkpoint::ChunkMeta c;
  c.box = std::move(box);
  c.file = file;
  c.offset = offset;
  c.length = e.stored.size();
  c.logical_bytes = e.logical_bytes;
  c.transforms = chain;
  c.checksum = e.checksum;
  c.writer_rank = rank;
  c.blocks = e.blocks;
  return c;
}

std::vector<uint8_t> floats(size_t n, float scale) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = scale * std::sin(static_cast<float>(i) * 0.37f);
  std::vector<uint8_t> out(n * 4);
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

void metadata_seeds(const fs::path& dir) {
  fs::create_directories(dir);
  const std::vector<std::vector<std::string>> chains = {{}, {"zstd/1"}, {"bytegroup/1", "zstd/1"}};
  int n = 0;
  for (const auto& chain : chains) {
    checkpoint::CheckpointMeta meta;
    meta.step = 40;
    meta.world_size = 2;
    meta.layout = "fsdp replicate=1 shard=2";
    meta.created_unix_s = 1760000000;
    meta.info = {{"mode", "async"}, {"torch", "1.13.1"}};
    // w [4, 8] float32 in two row chunks from two ranks, 2 blocks each.
    checkpoint::ItemMeta w;
    w.name = "model.w";
    w.global_shape = {4, 8};
    for (int r = 0; r < 2; ++r) {
      auto bytes = floats(16, 1.0f + static_cast<float>(r));
      auto e = checkpoint::encode_chunk(bytes.data(), bytes.size(), 4, chain, 3, 32, nullptr);
      w.chunks.push_back(chunk_of(e, checkpoint::Box{{2 * r, 0}, {2, 8}}, "rank_" + std::to_string(r) + ".data",
                                  0, chain, r));
    }
    checkpoint::ItemMeta b;
    b.name = "rng.cpu";
    b.kind = checkpoint::ItemKind::kBytes;
    b.dtype = checkpoint::DType::kUInt8;
    b.global_shape = {5};
    std::vector<uint8_t> raw = {1, 2, 3, 4, 5};
    auto e = checkpoint::encode_chunk(raw.data(), raw.size(), 1, {}, 3, 1 << 20, nullptr);
    b.chunks.push_back(chunk_of(e, checkpoint::Box{{0}, {5}}, "rank_1.data", w.chunks[1].length, {}, 1));
    checkpoint::ItemMeta empty;
    empty.name = "model.empty";
    empty.global_shape = {0, 3};
    meta.items = {w, b, empty};
    write(dir / ("seed_" + std::to_string(n++)), checkpoint::encode_metadata(meta));
    write(dir / ("seed_" + std::to_string(n++)), checkpoint::encode_metadata(meta, 1));
  }
  checkpoint::CheckpointMeta bare;
  write(dir / ("seed_" + std::to_string(n++)), checkpoint::encode_metadata(bare));
}

void block_seeds(const fs::path& dir) {
  fs::create_directories(dir);
  int n = 0;
  for (uint8_t code = 0; code < fuzz::kChainCount; ++code) {
    for (uint64_t block_size : {uint64_t{256}, uint64_t{96}}) {
      const auto chain = fuzz::chain_for(code);
      auto bytes = floats(64, 0.5f);  // 256 logical bytes
      auto e = checkpoint::encode_chunk(bytes.data(), bytes.size(), 4, chain, 3, block_size, nullptr);
      if (e.blocks.size() > 4) continue;
      std::vector<uint8_t> in = {code, 1 /* float32 */, static_cast<uint8_t>(e.blocks.size() - 1)};
      for (const auto& b : e.blocks) {
        checkpoint::append_le(in, b.stored_length, 2);
        checkpoint::append_le(in, b.logical_length, 2);
        checkpoint::append_le(in, b.checksum, 8);
      }
      checkpoint::append_le(in, e.checksum, 8);
      in.insert(in.end(), e.stored.begin(), e.stored.end());
      write(dir / ("seed_" + std::to_string(n++)), in);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_fuzz_seeds CORPUS_DIR\n");
    return 2;
  }
  const fs::path root = argv[1];
  metadata_seeds(root / "fuzz_metadata");
  block_seeds(root / "fuzz_block_decoder");
  return 0;
}
