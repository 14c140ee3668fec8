#pragma once
// Python's pickle, as far as the interop formats need it: one restricted
// reader and one writer, used by DCP's .metadata (dcp_metadata.cpp), DCP's
// per-item torch.save archives and the torch.save files that ckpt imports
// and exports. Internal (not installed), torch-free.
//
// Reading is a restricted interpreter, never Python's: it executes nothing.
// Each kind of file is a PickleDialect (the opcodes and globals it may hold,
// and what the refusal says) plus a PickleVm subclass that gives REDUCE,
// BUILD, NEWOBJ and BINPERSID their meaning for that file; any other opcode
// or global is an error naming the source, the pickle offset and the opcode
// or global. Values live in an arena and refer to each other by index, so a
// hostile pickle can build neither deep recursion nor reference cycles that
// matter: nothing is traversed or freed recursively.
//
// torch.save's data.pkl (a dict of tensors, or one tensor) is read and
// written here too: the writer produces what Python's torch.save (protocol
// 2) writes for contiguous tensors, using only what
// torch.load(weights_only=True) accepts: GLOBAL torch._utils._rebuild_tensor_v2,
// torch.<T>Storage and collections.OrderedDict, with storages as persistent
// ids ('storage', torch.<T>Storage, key, 'cpu', numel) whose bytes are the
// zip member `<archive>/data/<key>`.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "checkpoint/format/types.h"

namespace checkpoint {

// ------------------------------------------------------------------ reading

enum class PyKind {
  kNone, kBool, kInt, kFloat, kStr, kBytes, kTuple, kList, kDict, kGlobal, kObject, kStorage, kTensor
};
const char* py_kind_name(PyKind kind);

struct PyValue {
  explicit PyValue(PyKind k) : kind(k) {}
  PyKind kind;
  int64_t i = 0;              // bool, int; storage, tensor: an index the dialect keeps
  double f = 0;               // float
  std::string s;              // str, bytes; "module.name" of a global; an object's class
  std::vector<size_t> items;  // tuple, list; dict keys and values interleaved
  size_t args = 0;            // object: its constructor arguments (a tuple)
  std::optional<size_t> state;  // object: what BUILD gave it
};

// What one kind of file may hold.
struct PickleDialect {
  const char* opcodes;                          // the opcodes it may use (STOP aside)
  bool (*allowed_global)(const std::string&);   // "module.name"
  const char* global_refusal;  // after "pickle global 'g' is not allowed; "
  const char* opcode_refusal;  // after "unsupported pickle opcode 0x5d[ (EMPTY_LIST)]; "
  bool name_opcodes;           // name the refused opcode (pickletools' name)
};

class PickleVm {
 public:
  virtual ~PickleVm() = default;

  // Runs to STOP; returns the result's index.
  size_t run();
  const PyValue& at(size_t i) const { return arena_[i]; }
  // Throws FormatError "<source>: <what> (pickle offset N)", N the current opcode's.
  [[noreturn]] void fail(const std::string& what) const;

 protected:
  // `data` and `source` must outlive the VM.
  PickleVm(const uint8_t* data, size_t size, const std::string& source, const PickleDialect& dialect);

  // The opcodes whose meaning depends on the file; each pops its operands
  // and pushes its result. NEWOBJ and BINPERSID refuse unless overridden.
  virtual void reduce() = 0;
  virtual void build() = 0;
  virtual void new_object();
  virtual void persistent_id();

  size_t push(PyValue v);
  void push_ref(size_t i) { stack_.push_back(i); }
  void push_seq(PyKind kind, std::vector<size_t> items);
  size_t top() const;
  size_t pop();
  PyValue& mutable_at(size_t i) { return arena_[i]; }
  [[noreturn]] void refuse_opcode(uint8_t op) const;

 private:
  void step(uint8_t op);
  const uint8_t* read(uint64_t k);
  uint8_t u8() { return *read(1); }
  uint64_t le(size_t k);
  int64_t long1();
  std::string line();
  void protocol();
  void binfloat();
  void global();
  void stack_global();
  void dict();
  void push_int(PyKind kind, int64_t i);
  void push_text(PyKind kind, uint64_t len);
  void push_global(const std::string& g);
  void count_items(size_t n);
  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  std::vector<size_t> pop_n(size_t k);
  std::vector<size_t> pop_to_mark();
  void get(uint64_t key);
  const std::string& str(size_t i, const char* what) const;
  void append(const std::vector<size_t>& items);
  void set_items(const std::vector<size_t>& kv);

  const uint8_t* p_;
  size_t n_;
  const std::string& source_;
  const PickleDialect& dialect_;
  size_t pos_ = 0;
  size_t op_at_ = 0;
  std::vector<PyValue> arena_;
  std::vector<size_t> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint32_t, size_t> memo_;
  size_t items_ = 0;
};

// ------------------------------------------------------------------ writing

// Protocol 2, no memo: PROTO 2 on construction, STOP on finish().
class PickleWriter {
 public:
  // How an int outside int32 is written: LONG1 of the fewest bytes (as
  // Python does), or LONG1 of 8 bytes (DCP's .metadata as shardkit has
  // always written it; Python reads both).
  enum class Longs { kMinimal, kEightBytes };
  explicit PickleWriter(Longs longs = Longs::kMinimal);

  void op(uint8_t o) { out_.push_back(o); }
  void global(const std::string& module, const std::string& name);  // GLOBAL
  void str(const std::string& s);                                   // BINUNICODE
  void integer(int64_t v);       // BININT1, BININT2, BININT or LONG1
  void real(double v);           // BINFLOAT
  void boolean(bool v);          // NEWTRUE, NEWFALSE
  void none();                   // NONE
  void int_tuple(const std::vector<int64_t>& v);       // as Python writes a tuple of ints
  void new_object(const std::string& module, const std::string& cls);  // cls() by NEWOBJ
  std::vector<uint8_t> finish();  // STOP; the pickle

 private:
  Longs longs_;
  std::vector<uint8_t> out_;
};

// ------------------------------------------------------- torch.save tensors

// One entry of the dict: a tensor viewing a storage.
struct PickledTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<int64_t> stride;   // contiguous (row-major) after parsing
  int64_t storage_offset = 0;    // in elements
  std::string storage_key;       // the member <archive>/data/<key>
  uint64_t storage_numel = 0;    // elements in the storage
};

// The storage class torch.save names for `dtype` ("FloatStorage", ...).
const char* storage_type_name(DType dtype);

// Parses `data.pkl` of a torch.save file holding a dict (or OrderedDict) of
// tensors. Checks every tensor is contiguous and lies within its storage.
// Throws FormatError naming `source` and, where it applies, the opcode and its
// offset, the global, or the dict entry.
std::vector<PickledTensor> parse_tensor_dict_pickle(const uint8_t* data, size_t size,
                                                    const std::string& source);

// Parses `data.pkl` of a torch.save file holding one tensor (what DCP writes
// for each tensor chunk); the result is named `name`. Same checks and errors
// as parse_tensor_dict_pickle.
PickledTensor parse_tensor_pickle(const uint8_t* data, size_t size, const std::string& source,
                                  const std::string& name);

// Pickles a plain dict name -> tensor as torch.save does, in the given order.
// `stride` and `storage_offset` of each entry are ignored: tensors are written
// contiguous at offset 0 of their own storage of storage_numel elements.
std::vector<uint8_t> write_tensor_dict_pickle(const std::vector<PickledTensor>& tensors);

// Pickles one tensor as torch.save(tensor) does (a DCP chunk's data.pkl).
std::vector<uint8_t> write_tensor_pickle(const PickledTensor& tensor);

// Contiguous (row-major) strides of `shape`, as torch computes them (a dim of
// size 0 counts as 1).
std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape);

}  // namespace checkpoint
