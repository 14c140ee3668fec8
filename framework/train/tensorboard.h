#pragma once
// TensorBoard event files (metrics.tensorboard): scalars in TensorBoard's own
// format, which TensorBoard, torch.utils.tensorboard's readers and
// tf.data.TFRecordDataset read. A file is a sequence of TFRecords (length,
// masked CRC-32C of the length, data, masked CRC-32C of the data), each
// holding one serialized tensorflow.Event protobuf (event.proto,
// summary.proto):
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3;
//             Summary summary = 5; SessionLog session_log = 6; }
//   Summary { repeated Value value = 1; }
//   Value   { string tag = 1; float simple_value = 2; }
//   SessionLog { SessionStatus status = 1; }   // START = 1
// The few fields are encoded here (varints, fixed64, fixed32): linking
// libprotobuf and generating code from TensorFlow's .proto files for five
// fields would cost more build than it saves; Debian 12 packages no CRC-32C
// library (zlib's crc32 is the IEEE polynomial). tests/tools/
// test_tensorboard.py reads our files with python3-protobuf and
// python3-crc32c.
//
// A resumed run writes a file of its own that opens with SessionLog START at
// its first step: TensorBoard then drops what earlier files logged at that
// step and after (steps the crashed run took past its last checkpoint), as
// torch.utils.tensorboard's SummaryWriter(purge_step) does.
//
// Thread safety: one thread.
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace framework::train {

// CRC-32C (Castagnoli) of `n` bytes, and TFRecord's mask of it.
uint32_t crc32c(const void* data, size_t n);
uint32_t masked_crc32c(const void* data, size_t n);

// One TFRecord around `data`.
std::string tf_record(const std::string& data);

class TensorBoardWriter {
 public:
  // Creates `dir` and a new file in it, events.out.tfevents.<unix time>.
  // <host>.<pid>.shardkit (the time past every earlier file's there, so
  // that name order is the order written), opening with the file_version event ("brain.
  // Event:2"); `first_step` > 1 (a resumed run) adds SessionLog START at it.
  // Throws std::runtime_error naming the file when it cannot be created.
  TensorBoardWriter(const std::string& dir, int64_t first_step);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One event at `step` holding these (tag, value) scalars, written and
  // flushed. A failed write (a full disk) is reported once on stderr and
  // ends the file's writing; training goes on.
  void scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values);

  const std::string& path() const { return path_; }

 private:
  void write_event(const std::string& event);

  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace framework::train
