#include "checkpoint/interop/torch_pickle.h"

#include <cstdio>
#include <set>
#include <unordered_map>

#include "checkpoint/format/byte_order.h"
#include "checkpoint/format/metadata.h"

namespace checkpoint {

namespace {

// Opcodes (pickletools names).
constexpr uint8_t kProto = 0x80, kFrame = 0x95, kStop = '.', kMark = '(';
constexpr uint8_t kEmptyDict = '}', kEmptyTuple = ')', kNone = 'N';
constexpr uint8_t kNewTrue = 0x88, kNewFalse = 0x89;
constexpr uint8_t kBinInt = 'J', kBinInt1 = 'K', kBinInt2 = 'M', kLong1 = 0x8a;
constexpr uint8_t kBinUnicode = 'X', kShortBinUnicode = 0x8c;
constexpr uint8_t kGlobal = 'c', kBinPersId = 'Q', kReduce = 'R', kBuild = 'b';
constexpr uint8_t kTuple = 't', kTuple1 = 0x85, kTuple2 = 0x86, kTuple3 = 0x87;
constexpr uint8_t kSetItem = 's', kSetItems = 'u';
constexpr uint8_t kBinPut = 'q', kLongBinPut = 'r', kBinGet = 'h', kLongBinGet = 'j';

constexpr const char* kRebuildTensor = "torch._utils._rebuild_tensor_v2";
constexpr const char* kRebuildParameter = "torch._utils._rebuild_parameter";
constexpr const char* kOrderedDict = "collections.OrderedDict";
constexpr size_t kSetItemsBatch = 1000;  // as Python's pickler batches

struct StorageType {
  DType dtype;
  const char* name;
};
constexpr StorageType kStorageTypes[] = {
    {DType::kFloat32, "FloatStorage"}, {DType::kFloat64, "DoubleStorage"},
    {DType::kFloat16, "HalfStorage"},  {DType::kBFloat16, "BFloat16Storage"},
    {DType::kInt64, "LongStorage"},    {DType::kInt32, "IntStorage"},
    {DType::kInt16, "ShortStorage"},   {DType::kInt8, "CharStorage"},
    {DType::kUInt8, "ByteStorage"},    {DType::kBool, "BoolStorage"},
};

const StorageType* find_storage_type(const std::string& global) {
  for (const auto& t : kStorageTypes) {
    if (global == std::string("torch.") + t.name) return &t;
  }
  return nullptr;
}

// Names of opcodes this reader refuses, for the message.
const char* opcode_name(uint8_t op) {
  static const std::unordered_map<uint8_t, const char*> names = {
      {'0', "POP"}, {'1', "POP_MARK"}, {'2', "DUP"}, {'F', "FLOAT"}, {'I', "INT"},
      {'L', "LONG"}, {'P', "PERSID"}, {'S', "STRING"}, {'T', "BINSTRING"}, {'U', "SHORT_BINSTRING"},
      {'V', "UNICODE"}, {'G', "BINFLOAT"}, {'B', "BINBYTES"}, {'C', "SHORT_BINBYTES"},
      {']', "EMPTY_LIST"}, {'a', "APPEND"}, {'e', "APPENDS"}, {'l', "LIST"}, {'d', "DICT"},
      {'g', "GET"}, {'p', "PUT"}, {'i', "INST"}, {'o', "OBJ"}, {0x81, "NEWOBJ"},
      {0x82, "EXT1"}, {0x83, "EXT2"}, {0x84, "EXT4"}, {0x8b, "LONG4"}, {0x8d, "BINUNICODE8"},
      {0x8e, "BINBYTES8"}, {0x8f, "EMPTY_SET"}, {0x90, "ADDITEMS"}, {0x91, "FROZENSET"},
      {0x92, "NEWOBJ_EX"}, {0x93, "STACK_GLOBAL"}, {0x94, "MEMOIZE"}, {0x96, "BYTEARRAY8"},
      {0x97, "NEXT_BUFFER"}, {0x98, "READONLY_BUFFER"}};
  auto it = names.find(op);
  return it == names.end() ? "unknown" : it->second;
}

enum class Kind { kNone, kBool, kInt, kStr, kTuple, kDict, kGlobal, kStorage, kTensor };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kNone: return "None";
    case Kind::kBool: return "bool";
    case Kind::kInt: return "int";
    case Kind::kStr: return "str";
    case Kind::kTuple: return "tuple";
    case Kind::kDict: return "dict";
    case Kind::kGlobal: return "global";
    case Kind::kStorage: return "storage";
    case Kind::kTensor: return "tensor";
  }
  return "?";
}

// A value. Values live in an arena and refer to each other by index, so a
// hostile pickle can build neither deep recursion nor reference cycles that
// matter: nothing here is traversed recursively or freed recursively.
struct Obj {
  explicit Obj(Kind k) : kind(k) {}
  Kind kind;
  int64_t i = 0;               // bool, int
  std::string s;               // str; "module.name" of a global
  std::vector<size_t> items;   // tuple elements; dict keys and values interleaved
  PickledTensor tensor;        // tensor; storage (dtype, storage_key, storage_numel)
};

class Unpickler {
 public:
  Unpickler(const uint8_t* data, size_t size, const std::string& source)
      : p_(data), n_(size), source_(source) {}

  // Runs to STOP; returns the result.
  size_t run() {
    while (true) {
      if (pos_ >= n_) fail("pickle ends without STOP");
      op_at_ = pos_;
      const uint8_t op = p_[pos_++];
      if (op == kStop) {
        const size_t result = pop();
        if (pos_ != n_) fail("trailing bytes after STOP");
        return result;
      }
      step(op);
    }
  }

  const Obj& obj(size_t i) const { return arena_[i]; }

  [[noreturn]] void fail(const std::string& what) const {
    throw FormatError(source_ + ": " + what + " (pickle offset " + std::to_string(op_at_) + ")");
  }

 private:
  void step(uint8_t op) {
    switch (op) {
      case kProto: {
        const uint8_t v = read_u8();
        if (v < 2 || v > 5) fail("unsupported pickle protocol " + std::to_string(v));
        return;
      }
      case kFrame: read(8); return;
      case kMark: marks_.push_back(stack_.size()); return;
      case kEmptyDict: push(Obj{Kind::kDict}); return;
      case kEmptyTuple: push(Obj{Kind::kTuple}); return;
      case kNone: push(Obj{Kind::kNone}); return;
      case kNewTrue: push_int(Kind::kBool, 1); return;
      case kNewFalse: push_int(Kind::kBool, 0); return;
      case kBinInt1: push_int(Kind::kInt, read_u8()); return;
      case kBinInt2: push_int(Kind::kInt, static_cast<int64_t>(read_le(2))); return;
      case kBinInt: push_int(Kind::kInt, static_cast<int32_t>(read_le(4))); return;
      case kLong1: push_int(Kind::kInt, read_long1()); return;
      case kBinUnicode: push_str(read_le(4)); return;
      case kShortBinUnicode: push_str(read_u8()); return;
      case kGlobal: global(); return;
      case kTuple: push_tuple(pop_to_mark()); return;
      case kTuple1: push_tuple(pop_n(1)); return;
      case kTuple2: push_tuple(pop_n(2)); return;
      case kTuple3: push_tuple(pop_n(3)); return;
      case kBinPersId: persistent_id(); return;
      case kReduce: reduce(); return;
      case kBuild: build(); return;
      case kSetItem: set_items(pop_n(2)); return;
      case kSetItems: set_items(pop_to_mark()); return;
      case kBinPut: memo_[static_cast<uint32_t>(read_u8())] = top(); return;
      case kLongBinPut: memo_[static_cast<uint32_t>(read_le(4))] = top(); return;
      case kBinGet: get(read_u8()); return;
      case kLongBinGet: get(read_le(4)); return;
      default: {
        char buf[64];
        std::snprintf(buf, sizeof buf, "unsupported pickle opcode 0x%02x (%s)", op, opcode_name(op));
        fail(std::string(buf) + "; only dicts of tensors as torch.save writes them can be read");
      }
    }
  }

  // ---- input
  const uint8_t* read(size_t k) {
    if (n_ - pos_ < k) fail("pickle truncated");
    const uint8_t* at = p_ + pos_;
    pos_ += k;
    return at;
  }
  uint8_t read_u8() { return *read(1); }
  uint64_t read_le(size_t k) { return load_le(read(k), k); }
  int64_t read_long1() {
    const size_t k = read_u8();
    if (k > 8) fail("integer too large (LONG1 of " + std::to_string(k) + " bytes)");
    if (k == 0) return 0;
    uint64_t v = read_le(k);
    if (k < 8 && (v >> (8 * k - 1)) & 1) v |= ~uint64_t{0} << (8 * k);  // sign-extend
    return static_cast<int64_t>(v);
  }

  // ---- stack
  size_t push(Obj o) {
    arena_.push_back(std::move(o));
    stack_.push_back(arena_.size() - 1);
    return arena_.size() - 1;
  }
  void push_int(Kind kind, int64_t v) {
    Obj o{kind};
    o.i = v;
    push(std::move(o));
  }
  void push_str(uint64_t len) {
    Obj o{Kind::kStr};
    const uint8_t* b = read(len);
    o.s.assign(reinterpret_cast<const char*>(b), len);
    push(std::move(o));
  }
  void push_tuple(std::vector<size_t> items) {
    Obj o{Kind::kTuple};
    o.items = std::move(items);
    push(std::move(o));
  }
  size_t top() const {
    if (stack_.size() <= floor()) fail("pickle stack underflow");
    return stack_.back();
  }
  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  size_t pop() {
    const size_t v = top();
    stack_.pop_back();
    return v;
  }
  std::vector<size_t> pop_n(size_t k) {
    if (stack_.size() - floor() < k) fail("pickle stack underflow");
    std::vector<size_t> out(stack_.end() - static_cast<std::ptrdiff_t>(k), stack_.end());
    stack_.resize(stack_.size() - k);
    return out;
  }
  std::vector<size_t> pop_to_mark() {
    if (marks_.empty()) fail("pickle MARK missing");
    const size_t at = marks_.back();
    marks_.pop_back();
    std::vector<size_t> out(stack_.begin() + static_cast<std::ptrdiff_t>(at), stack_.end());
    stack_.resize(at);
    return out;
  }
  void get(uint64_t key) {
    auto it = memo_.find(static_cast<uint32_t>(key));
    if (it == memo_.end()) fail("pickle memo key " + std::to_string(key) + " not set");
    stack_.push_back(it->second);
  }

  // ---- objects
  void global() {
    std::string module = read_line();
    std::string name = read_line();
    const std::string full = module + "." + name;
    if (full != kRebuildTensor && full != kRebuildParameter && full != kOrderedDict &&
        find_storage_type(full) == nullptr) {
      fail("pickle global '" + full + "' is not allowed; only tensors, storages and OrderedDict "
           "can be read");
    }
    Obj o{Kind::kGlobal};
    o.s = full;
    push(std::move(o));
  }
  std::string read_line() {
    size_t end = pos_;
    while (end < n_ && end - pos_ < 256 && p_[end] != '\n') ++end;
    if (end >= n_ || p_[end] != '\n') fail("bad GLOBAL operand");
    std::string s(reinterpret_cast<const char*>(p_ + pos_), end - pos_);
    pos_ = end + 1;
    return s;
  }

  const Obj& expect(size_t i, Kind kind, const char* what) const {
    if (arena_[i].kind != kind) {
      fail(std::string(what) + ": expected " + kind_name(kind) + ", got " +
           kind_name(arena_[i].kind));
    }
    return arena_[i];
  }

  // ('storage', torch.<T>Storage, key, location, numel)
  void persistent_id() {
    const Obj& pid = expect(pop(), Kind::kTuple, "persistent id");
    if (pid.items.size() != 5) fail("persistent id is not a 5-tuple ('storage', type, key, location, numel)");
    if (expect(pid.items[0], Kind::kStr, "persistent id").s != "storage") {
      fail("persistent id is not a storage");
    }
    const StorageType* type = find_storage_type(expect(pid.items[1], Kind::kGlobal, "storage type").s);
    if (type == nullptr) fail("storage type '" + arena_[pid.items[1]].s + "' is not a storage class");
    const int64_t numel = expect(pid.items[4], Kind::kInt, "storage numel").i;
    if (numel < 0 || static_cast<uint64_t>(numel) > kMaxItemBytes / element_size(type->dtype)) {
      fail("storage size " + std::to_string(numel) + " out of range");
    }
    Obj o{Kind::kStorage};
    o.tensor.dtype = type->dtype;
    o.tensor.storage_key = expect(pid.items[2], Kind::kStr, "storage key").s;
    expect(pid.items[3], Kind::kStr, "storage location");
    o.tensor.storage_numel = static_cast<uint64_t>(numel);
    push(std::move(o));
  }

  std::vector<int64_t> int_tuple(size_t i, const char* what) const {
    std::vector<int64_t> out;
    for (size_t e : expect(i, Kind::kTuple, what).items) out.push_back(expect(e, Kind::kInt, what).i);
    return out;
  }

  void reduce() {
    const std::vector<size_t> args = expect(pop(), Kind::kTuple, "REDUCE arguments").items;
    const std::string callable = expect(pop(), Kind::kGlobal, "REDUCE callable").s;
    if (callable == kOrderedDict) {
      if (!args.empty()) fail("OrderedDict called with arguments");
      push(Obj{Kind::kDict});
    } else if (callable == kRebuildTensor) {
      // (storage, storage_offset, size, stride, requires_grad, backward_hooks[, metadata])
      if (args.size() != 6 && args.size() != 7) fail("_rebuild_tensor_v2 takes 6 or 7 arguments");
      Obj o{Kind::kTensor};
      o.tensor = expect(args[0], Kind::kStorage, "tensor storage").tensor;
      o.tensor.storage_offset = expect(args[1], Kind::kInt, "storage offset").i;
      o.tensor.shape = int_tuple(args[2], "tensor size");
      o.tensor.stride = int_tuple(args[3], "tensor stride");
      push(std::move(o));
    } else if (callable == kRebuildParameter) {
      // (data, requires_grad, backward_hooks): the tensor itself is all we need.
      if (args.size() != 3) fail("_rebuild_parameter takes 3 arguments");
      expect(args[0], Kind::kTensor, "parameter data");
      stack_.push_back(args[0]);
    } else {
      fail("'" + callable + "' cannot be called");
    }
  }

  // OrderedDict state (state_dict()'s `_metadata` attribute): accepted, ignored.
  void build() {
    expect(pop(), Kind::kDict, "BUILD state");
    expect(top(), Kind::kDict, "BUILD target");
  }

  void set_items(const std::vector<size_t>& kv) {
    if (kv.size() % 2 != 0) fail("SETITEMS with an odd number of items");
    Obj& dict = arena_[top()];
    if (dict.kind != Kind::kDict) fail(std::string("SETITEM on a ") + kind_name(dict.kind));
    dict.items.insert(dict.items.end(), kv.begin(), kv.end());
  }

  const uint8_t* p_;
  size_t n_;
  const std::string& source_;
  size_t pos_ = 0;
  size_t op_at_ = 0;
  std::vector<Obj> arena_;
  std::vector<size_t> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint32_t, size_t> memo_;
};

// Contiguity and bounds of one parsed tensor; fills its stride canonically.
void check_tensor(PickledTensor& t, const std::string& source) {
  auto bad = [&](const std::string& what) {
    return FormatError(source + ": tensor '" + t.name + "' " + what);
  };
  if (t.shape.size() > kMaxNdim) throw bad("has too many dims");
  if (t.stride.size() != t.shape.size()) throw bad("has strides of a different rank than its size");
  const std::optional<uint64_t> numel = checked_numel(t.shape);
  if (!numel) throw bad("has an invalid size " + shape_to_string(t.shape));
  const std::vector<int64_t> expected = contiguous_strides(t.shape);
  for (size_t d = 0; d < t.shape.size(); ++d) {
    if (t.shape[d] > 1 && t.stride[d] != expected[d] && *numel > 0) {
      throw bad("is not contiguous (stride " + shape_to_string(t.stride) + " for size " +
                shape_to_string(t.shape) + "); save tensor.contiguous() instead");
    }
  }
  t.stride = expected;
  if (t.storage_offset < 0) throw bad("has a negative storage offset");
  if (*numel > 0 && (static_cast<uint64_t>(t.storage_offset) > t.storage_numel ||
                     *numel > t.storage_numel - static_cast<uint64_t>(t.storage_offset))) {
    throw bad("lies outside its storage ('" + t.storage_key + "', " +
              std::to_string(t.storage_numel) + " elements)");
  }
}

// ---- writer

void put_op(std::vector<uint8_t>& out, uint8_t op) { out.push_back(op); }
void put_str(std::vector<uint8_t>& out, const std::string& s) {
  put_op(out, kBinUnicode);
  append_le(out, s.size(), 4);
  out.insert(out.end(), s.begin(), s.end());
}
void put_global(std::vector<uint8_t>& out, const std::string& module, const std::string& name) {
  put_op(out, kGlobal);
  out.insert(out.end(), module.begin(), module.end());
  out.push_back('\n');
  out.insert(out.end(), name.begin(), name.end());
  out.push_back('\n');
}
// As Python's pickler writes a non-negative int at protocol 2.
void put_int(std::vector<uint8_t>& out, int64_t v) {
  if (v >= 0 && v <= 0xFF) {
    put_op(out, kBinInt1);
    append_le(out, static_cast<uint64_t>(v), 1);
  } else if (v >= 0 && v <= 0xFFFF) {
    put_op(out, kBinInt2);
    append_le(out, static_cast<uint64_t>(v), 2);
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    put_op(out, kBinInt);
    append_le(out, static_cast<uint64_t>(v), 4);
  } else {
    // Minimal two's complement, little-endian (the sign bit of the top byte
    // must match the sign).
    int bytes = 8;
    while (bytes > 1) {
      const int64_t top = v >> (8 * (bytes - 1) - 1);  // top byte plus the bit below it
      if (top != 0 && top != -1) break;
      --bytes;
    }
    put_op(out, kLong1);
    append_le(out, static_cast<uint64_t>(bytes), 1);
    append_le(out, static_cast<uint64_t>(v), bytes);
  }
}
void put_int_tuple(std::vector<uint8_t>& out, const std::vector<int64_t>& v) {
  if (v.size() > 3) put_op(out, kMark);
  for (int64_t x : v) put_int(out, x);
  static const uint8_t kSmall[] = {kEmptyTuple, kTuple1, kTuple2, kTuple3};
  put_op(out, v.size() > 3 ? kTuple : kSmall[v.size()]);
}

void put_tensor(std::vector<uint8_t>& out, const PickledTensor& t) {
  put_global(out, "torch._utils", "_rebuild_tensor_v2");
  put_op(out, kMark);
  put_op(out, kMark);  // the persistent id
  put_str(out, "storage");
  put_global(out, "torch", storage_type_name(t.dtype));
  put_str(out, t.storage_key);
  put_str(out, "cpu");
  put_int(out, static_cast<int64_t>(t.storage_numel));
  put_op(out, kTuple);
  put_op(out, kBinPersId);
  put_int(out, 0);
  put_int_tuple(out, t.shape);
  put_int_tuple(out, contiguous_strides(t.shape));
  put_op(out, kNewFalse);
  put_global(out, "collections", "OrderedDict");
  put_op(out, kEmptyTuple);
  put_op(out, kReduce);
  put_op(out, kTuple);
  put_op(out, kReduce);
}

}  // namespace

const char* storage_type_name(DType dtype) {
  for (const auto& t : kStorageTypes) {
    if (t.dtype == dtype) return t.name;
  }
  return "UnknownStorage";
}

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> stride(shape.size());
  int64_t s = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    stride[d] = s;
    s *= std::max<int64_t>(shape[d], 1);
  }
  return stride;
}

std::vector<PickledTensor> parse_tensor_dict_pickle(const uint8_t* data, size_t size,
                                                    const std::string& source) {
  Unpickler u(data, size, source);
  const Obj& root = u.obj(u.run());
  if (root.kind != Kind::kDict) {
    throw FormatError(source + ": holds a " + std::string(kind_name(root.kind)) +
                      ", not a dict of tensors");
  }
  std::vector<PickledTensor> out;
  std::set<std::string> seen;
  for (size_t i = 0; i + 1 < root.items.size(); i += 2) {
    const Obj& key = u.obj(root.items[i]);
    const Obj& value = u.obj(root.items[i + 1]);
    if (key.kind != Kind::kStr) {
      throw FormatError(source + ": dict key is a " + std::string(kind_name(key.kind)) +
                        ", not a str");
    }
    if (value.kind != Kind::kTensor) {
      throw FormatError(source + ": entry '" + key.s + "' is a " + kind_name(value.kind) +
                        ", not a tensor; only a flat dict of tensors can be read");
    }
    if (!seen.insert(key.s).second) throw FormatError(source + ": duplicate entry '" + key.s + "'");
    PickledTensor t = value.tensor;
    t.name = key.s;
    check_tensor(t, source);
    out.push_back(std::move(t));
  }
  return out;
}

PickledTensor parse_tensor_pickle(const uint8_t* data, size_t size, const std::string& source,
                                  const std::string& name) {
  Unpickler u(data, size, source);
  const Obj& root = u.obj(u.run());
  if (root.kind != Kind::kTensor) {
    throw FormatError(source + ": holds a " + std::string(kind_name(root.kind)) +
                      ", not a tensor");
  }
  PickledTensor t = root.tensor;
  t.name = name;
  check_tensor(t, source);
  return t;
}

std::vector<uint8_t> write_tensor_pickle(const PickledTensor& tensor) {
  std::vector<uint8_t> out;
  put_op(out, kProto);
  append_le(out, 2, 1);
  put_tensor(out, tensor);
  put_op(out, kStop);
  return out;
}

std::vector<uint8_t> write_tensor_dict_pickle(const std::vector<PickledTensor>& tensors) {
  std::vector<uint8_t> out;
  put_op(out, kProto);
  append_le(out, 2, 1);
  put_op(out, kEmptyDict);
  for (size_t begin = 0; begin < tensors.size(); begin += kSetItemsBatch) {
    const size_t end = std::min(tensors.size(), begin + kSetItemsBatch);
    if (end - begin > 1) put_op(out, kMark);
    for (size_t i = begin; i < end; ++i) {
      put_str(out, tensors[i].name);
      put_tensor(out, tensors[i]);
    }
    put_op(out, end - begin > 1 ? kSetItems : kSetItem);
  }
  put_op(out, kStop);
  return out;
}

}  // namespace checkpoint
