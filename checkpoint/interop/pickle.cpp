#include "checkpoint/interop/pickle.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <set>

#include "checkpoint/format/byte_order.h"
#include "checkpoint/format/metadata.h"

namespace checkpoint {

namespace {

constexpr size_t kMaxValues = size_t{1} << 26;  // arena bound against pickle bombs
constexpr size_t kMaxItems = size_t{1} << 26;   // tuple, list and dict entries, all values together

// Opcodes (pickletools names) that the writer and the tensor dialect name.
constexpr uint8_t kProto = 0x80, kMark = '(', kEmptyDict = '}', kEmptyTuple = ')';
constexpr uint8_t kNewFalse = 0x89, kBinInt = 'J', kBinInt1 = 'K', kBinInt2 = 'M', kLong1 = 0x8a;
constexpr uint8_t kBinUnicode = 'X', kGlobal = 'c', kBinPersId = 'Q', kReduce = 'R';
constexpr uint8_t kTuple = 't', kTuple1 = 0x85, kTuple2 = 0x86, kTuple3 = 0x87;
constexpr uint8_t kSetItem = 's', kSetItems = 'u', kNewObj = 0x81;

// Names of opcodes, for the refusal of a dialect that names them.
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

}  // namespace

const char* py_kind_name(PyKind kind) {
  switch (kind) {
    case PyKind::kNone: return "None";
    case PyKind::kBool: return "bool";
    case PyKind::kInt: return "int";
    case PyKind::kFloat: return "float";
    case PyKind::kStr: return "str";
    case PyKind::kBytes: return "bytes";
    case PyKind::kTuple: return "tuple";
    case PyKind::kList: return "list";
    case PyKind::kDict: return "dict";
    case PyKind::kGlobal: return "global";
    case PyKind::kObject: return "object";
    case PyKind::kStorage: return "storage";
    case PyKind::kTensor: return "tensor";
  }
  return "?";
}

// ------------------------------------------------------------ the reader VM

PickleVm::PickleVm(const uint8_t* data, size_t size, const std::string& source,
                   const PickleDialect& dialect)
    : p_(data), n_(size), source_(source), dialect_(dialect) {}

size_t PickleVm::run() {
  while (true) {
    if (pos_ >= n_) fail("pickle ends without STOP");
    op_at_ = pos_;
    const uint8_t op = p_[pos_++];
    if (op == '.') {
      const size_t result = pop();
      if (pos_ != n_) fail("trailing bytes after STOP");
      return result;
    }
    if (op == 0 || std::strchr(dialect_.opcodes, op) == nullptr) refuse_opcode(op);
    step(op);
  }
}

void PickleVm::fail(const std::string& what) const {
  throw FormatError(source_ + ": " + what + " (pickle offset " + std::to_string(op_at_) + ")");
}

void PickleVm::refuse_opcode(uint8_t op) const {
  char buf[64];
  if (dialect_.name_opcodes) {
    std::snprintf(buf, sizeof buf, "unsupported pickle opcode 0x%02x (%s)", op, opcode_name(op));
  } else {
    std::snprintf(buf, sizeof buf, "unsupported pickle opcode 0x%02x", op);
  }
  fail(std::string(buf) + "; " + dialect_.opcode_refusal);
}

void PickleVm::new_object() { refuse_opcode(kNewObj); }
void PickleVm::persistent_id() { refuse_opcode(kBinPersId); }

// The opcode table: every opcode either dialect may use.
void PickleVm::step(uint8_t op) {
  switch (op) {
    case 0x80: protocol(); return;  // PROTO
    case 0x95: read(8); return;     // FRAME: a hint only
    case '(': marks_.push_back(stack_.size()); return;
    case '}': push(PyValue(PyKind::kDict)); return;
    case ')': push(PyValue(PyKind::kTuple)); return;
    case ']': push(PyValue(PyKind::kList)); return;
    case 0x8f: push(PyValue(PyKind::kList)); return;  // EMPTY_SET: a list will do
    case 'N': push(PyValue(PyKind::kNone)); return;
    case 0x88: push_int(PyKind::kBool, 1); return;
    case 0x89: push_int(PyKind::kBool, 0); return;
    case 'K': push_int(PyKind::kInt, u8()); return;
    case 'M': push_int(PyKind::kInt, static_cast<int64_t>(le(2))); return;
    case 'J': push_int(PyKind::kInt, static_cast<int32_t>(le(4))); return;
    case 0x8a: push_int(PyKind::kInt, long1()); return;
    case 'G': binfloat(); return;
    case 'X': push_text(PyKind::kStr, le(4)); return;
    case 0x8c: push_text(PyKind::kStr, u8()); return;
    case 0x8d: push_text(PyKind::kStr, le(8)); return;
    case 'C': push_text(PyKind::kBytes, u8()); return;
    case 'B': push_text(PyKind::kBytes, le(4)); return;
    case 'c': global(); return;
    case 0x93: stack_global(); return;
    case 't': push_seq(PyKind::kTuple, pop_to_mark()); return;
    case 0x85: push_seq(PyKind::kTuple, pop_n(1)); return;
    case 0x86: push_seq(PyKind::kTuple, pop_n(2)); return;
    case 0x87: push_seq(PyKind::kTuple, pop_n(3)); return;
    case 'l': push_seq(PyKind::kList, pop_to_mark()); return;
    case 0x91: push_seq(PyKind::kList, pop_to_mark()); return;  // FROZENSET
    case 'd': dict(); return;
    case 'a': append(pop_n(1)); return;
    case 'e': append(pop_to_mark()); return;
    case 0x90: append(pop_to_mark()); return;  // ADDITEMS
    case 's': set_items(pop_n(2)); return;
    case 'u': set_items(pop_to_mark()); return;
    case 0x81: new_object(); return;
    case 'R': reduce(); return;
    case 'b': build(); return;
    case 'Q': persistent_id(); return;
    case '0': pop(); return;  // POP
    case 'q': memo_[u8()] = top(); return;
    case 'r': memo_[static_cast<uint32_t>(le(4))] = top(); return;
    case 0x94: memo_[static_cast<uint32_t>(memo_.size())] = top(); return;  // MEMOIZE
    case 'h': get(u8()); return;
    case 'j': get(le(4)); return;
    default: refuse_opcode(op);
  }
}

// ---- input

const uint8_t* PickleVm::read(uint64_t k) {
  if (n_ - pos_ < k) fail("pickle truncated");
  const uint8_t* at = p_ + pos_;
  pos_ += static_cast<size_t>(k);
  return at;
}

uint64_t PickleVm::le(size_t k) { return load_le(read(k), k); }

int64_t PickleVm::long1() {
  const size_t k = u8();
  if (k > 8) fail("integer too large (LONG1 of " + std::to_string(k) + " bytes)");
  if (k == 0) return 0;
  uint64_t v = le(k);
  if (k < 8 && (v >> (8 * k - 1)) & 1) v |= ~uint64_t{0} << (8 * k);  // sign-extend
  return static_cast<int64_t>(v);
}

std::string PickleVm::line() {
  size_t end = pos_;
  while (end < n_ && end - pos_ < 256 && p_[end] != '\n') ++end;
  if (end >= n_ || p_[end] != '\n') fail("bad GLOBAL operand");
  std::string s(reinterpret_cast<const char*>(p_ + pos_), end - pos_);
  pos_ = end + 1;
  return s;
}

void PickleVm::protocol() {
  const uint8_t v = u8();
  if (v < 2 || v > 5) fail("unsupported pickle protocol " + std::to_string(v));
}

void PickleVm::binfloat() {  // big-endian IEEE double
  const uint8_t* b = read(8);
  uint64_t bits = 0;
  for (int k = 0; k < 8; ++k) bits = bits << 8 | b[k];
  PyValue v(PyKind::kFloat);
  std::memcpy(&v.f, &bits, 8);
  push(std::move(v));
}

void PickleVm::global() {  // GLOBAL module\nname\n
  const std::string module = line();
  const std::string name = line();
  push_global(module + "." + name);
}

void PickleVm::stack_global() {
  const size_t name = pop();
  const size_t module = pop();
  push_global(str(module, "STACK_GLOBAL module") + "." + str(name, "STACK_GLOBAL name"));
}

void PickleVm::dict() {
  std::vector<size_t> kv = pop_to_mark();
  if (kv.size() % 2 != 0) fail("DICT with an odd number of items");
  push_seq(PyKind::kDict, std::move(kv));
}

// ---- stack

size_t PickleVm::push(PyValue v) {
  if (arena_.size() >= kMaxValues) fail("too many pickle values");
  arena_.push_back(std::move(v));
  stack_.push_back(arena_.size() - 1);
  return arena_.size() - 1;
}

void PickleVm::push_int(PyKind kind, int64_t i) {
  PyValue v(kind);
  v.i = i;
  push(std::move(v));
}

void PickleVm::push_text(PyKind kind, uint64_t len) {
  PyValue v(kind);
  const uint8_t* b = read(len);
  v.s.assign(reinterpret_cast<const char*>(b), static_cast<size_t>(len));
  push(std::move(v));
}

void PickleVm::count_items(size_t n) {
  items_ += n;
  if (items_ > kMaxItems) fail("too many pickle container entries");
}

void PickleVm::push_seq(PyKind kind, std::vector<size_t> items) {
  count_items(items.size());
  PyValue v(kind);
  v.items = std::move(items);
  push(std::move(v));
}

void PickleVm::push_global(const std::string& g) {
  if (!dialect_.allowed_global(g)) {
    fail("pickle global '" + g + "' is not allowed; " + dialect_.global_refusal);
  }
  PyValue v(PyKind::kGlobal);
  v.s = g;
  push(std::move(v));
}

size_t PickleVm::top() const {
  if (stack_.size() <= floor()) fail("pickle stack underflow");
  return stack_.back();
}

size_t PickleVm::pop() {
  const size_t v = top();
  stack_.pop_back();
  return v;
}

std::vector<size_t> PickleVm::pop_n(size_t k) {
  if (stack_.size() - floor() < k) fail("pickle stack underflow");
  std::vector<size_t> out(stack_.end() - static_cast<std::ptrdiff_t>(k), stack_.end());
  stack_.resize(stack_.size() - k);
  return out;
}

std::vector<size_t> PickleVm::pop_to_mark() {
  if (marks_.empty()) fail("pickle MARK missing");
  const size_t m = marks_.back();
  marks_.pop_back();
  std::vector<size_t> out(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
  stack_.resize(m);
  return out;
}

void PickleVm::get(uint64_t key) {
  auto it = memo_.find(static_cast<uint32_t>(key));
  if (it == memo_.end()) fail("pickle memo key " + std::to_string(key) + " not set");
  stack_.push_back(it->second);
}

const std::string& PickleVm::str(size_t i, const char* what) const {
  if (at(i).kind != PyKind::kStr) {
    fail(std::string(what) + " is a " + py_kind_name(at(i).kind) + ", not a str");
  }
  return at(i).s;
}

void PickleVm::append(const std::vector<size_t>& items) {
  PyValue& list = arena_[top()];
  if (list.kind != PyKind::kList) fail(std::string("APPEND to a ") + py_kind_name(list.kind));
  count_items(items.size());
  list.items.insert(list.items.end(), items.begin(), items.end());
}

void PickleVm::set_items(const std::vector<size_t>& kv) {
  if (kv.size() % 2 != 0) fail("SETITEMS with an odd number of items");
  PyValue& dict = arena_[top()];
  if (dict.kind != PyKind::kDict) fail(std::string("SETITEM on a ") + py_kind_name(dict.kind));
  count_items(kv.size());
  dict.items.insert(dict.items.end(), kv.begin(), kv.end());
}

// ------------------------------------------------------------- the writer

PickleWriter::PickleWriter(Longs longs) : longs_(longs) {
  op(kProto);
  op(2);
}

void PickleWriter::global(const std::string& module, const std::string& name) {
  op(kGlobal);
  out_.insert(out_.end(), module.begin(), module.end());
  out_.push_back('\n');
  out_.insert(out_.end(), name.begin(), name.end());
  out_.push_back('\n');
}

void PickleWriter::str(const std::string& s) {
  op(kBinUnicode);
  append_le(out_, s.size(), 4);
  out_.insert(out_.end(), s.begin(), s.end());
}

void PickleWriter::integer(int64_t v) {
  if (v >= 0 && v <= 0xFF) {
    op(kBinInt1);
    append_le(out_, static_cast<uint64_t>(v), 1);
  } else if (v >= 0 && v <= 0xFFFF) {
    op(kBinInt2);
    append_le(out_, static_cast<uint64_t>(v), 2);
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    op(kBinInt);
    append_le(out_, static_cast<uint64_t>(v), 4);
  } else {
    // Minimal two's complement, little-endian (the sign bit of the top byte
    // must match the sign).
    int bytes = 8;
    while (longs_ == Longs::kMinimal && bytes > 1) {
      const int64_t top = v >> (8 * (bytes - 1) - 1);  // top byte plus the bit below it
      if (top != 0 && top != -1) break;
      --bytes;
    }
    op(kLong1);
    append_le(out_, static_cast<uint64_t>(bytes), 1);
    append_le(out_, static_cast<uint64_t>(v), bytes);
  }
}

void PickleWriter::real(double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  op('G');
  for (int k = 7; k >= 0; --k) out_.push_back(static_cast<uint8_t>(bits >> (8 * k)));
}

void PickleWriter::boolean(bool v) { op(v ? 0x88 : kNewFalse); }

void PickleWriter::none() { op('N'); }

void PickleWriter::int_tuple(const std::vector<int64_t>& v) {
  if (v.size() > 3) op(kMark);
  for (int64_t x : v) integer(x);
  static const uint8_t kSmall[] = {kEmptyTuple, kTuple1, kTuple2, kTuple3};
  op(v.size() > 3 ? kTuple : kSmall[v.size()]);
}

void PickleWriter::new_object(const std::string& module, const std::string& cls) {
  global(module, cls);
  op(kEmptyTuple);
  op(kNewObj);
}

std::vector<uint8_t> PickleWriter::finish() {
  op('.');
  return std::move(out_);
}

// ------------------------------------------------------- torch.save tensors

namespace {

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

bool tensor_global(const std::string& g) {
  return g == kRebuildTensor || g == kRebuildParameter || g == kOrderedDict ||
         find_storage_type(g) != nullptr;
}

// torch.save's data.pkl: dicts, OrderedDicts with their `_metadata` state,
// tensors and parameters, storages.
const PickleDialect kTensorDialect = {
    "\x80\x95(})N\x88\x89KMJ\x8aX\x8c" "ct\x85\x86\x87QRbsuqrhj",
    tensor_global,
    "only tensors, storages and OrderedDict can be read",
    "only dicts of tensors as torch.save writes them can be read",
    true,
};

class TensorVm : public PickleVm {
 public:
  TensorVm(const uint8_t* data, size_t size, const std::string& source)
      : PickleVm(data, size, source, kTensorDialect) {}

  // The tensor (or storage) a value stands for.
  const PickledTensor& tensor(const PyValue& v) const { return tensors_[static_cast<size_t>(v.i)]; }

 private:
  const PyValue& expect(size_t i, PyKind kind, const char* what) const {
    if (at(i).kind != kind) {
      fail(std::string(what) + ": expected " + py_kind_name(kind) + ", got " + py_kind_name(at(i).kind));
    }
    return at(i);
  }

  void push_tensor(PyKind kind, PickledTensor t) {
    PyValue v(kind);
    v.i = static_cast<int64_t>(tensors_.size());
    tensors_.push_back(std::move(t));
    push(std::move(v));
  }

  // ('storage', torch.<T>Storage, key, location, numel)
  void persistent_id() override {
    const PyValue& pid = expect(pop(), PyKind::kTuple, "persistent id");
    if (pid.items.size() != 5) fail("persistent id is not a 5-tuple ('storage', type, key, location, numel)");
    if (expect(pid.items[0], PyKind::kStr, "persistent id").s != "storage") {
      fail("persistent id is not a storage");
    }
    const StorageType* type = find_storage_type(expect(pid.items[1], PyKind::kGlobal, "storage type").s);
    if (type == nullptr) fail("storage type '" + at(pid.items[1]).s + "' is not a storage class");
    const int64_t numel = expect(pid.items[4], PyKind::kInt, "storage numel").i;
    if (numel < 0 || static_cast<uint64_t>(numel) > kMaxItemBytes / element_size(type->dtype)) {
      fail("storage size " + std::to_string(numel) + " out of range");
    }
    PickledTensor t;
    t.dtype = type->dtype;
    t.storage_key = expect(pid.items[2], PyKind::kStr, "storage key").s;
    expect(pid.items[3], PyKind::kStr, "storage location");
    t.storage_numel = static_cast<uint64_t>(numel);
    push_tensor(PyKind::kStorage, std::move(t));
  }

  // Bounded before copying: a memoized tuple of N ints passed to K tensors
  // would otherwise cost K * N copies from a pickle of N + K bytes.
  std::vector<int64_t> int_tuple(size_t i, const char* what) const {
    const std::vector<size_t>& items = expect(i, PyKind::kTuple, what).items;
    if (items.size() > kMaxNdim) {
      fail(std::string(what) + " has " + std::to_string(items.size()) + " dims, more than " +
           std::to_string(kMaxNdim));
    }
    std::vector<int64_t> out;
    for (size_t e : items) out.push_back(expect(e, PyKind::kInt, what).i);
    return out;
  }

  void reduce() override {
    const std::vector<size_t> args = expect(pop(), PyKind::kTuple, "REDUCE arguments").items;
    const std::string callable = expect(pop(), PyKind::kGlobal, "REDUCE callable").s;
    if (callable == kOrderedDict) {
      if (!args.empty()) fail("OrderedDict called with arguments");
      push(PyValue(PyKind::kDict));
    } else if (callable == kRebuildTensor) {
      rebuild_tensor(args);
    } else if (callable == kRebuildParameter) {
      // (data, requires_grad, backward_hooks): the tensor itself is all we need.
      if (args.size() != 3) fail("_rebuild_parameter takes 3 arguments");
      expect(args[0], PyKind::kTensor, "parameter data");
      push_ref(args[0]);
    } else {
      fail("'" + callable + "' cannot be called");
    }
  }

  // (storage, storage_offset, size, stride, requires_grad, backward_hooks[, metadata])
  void rebuild_tensor(const std::vector<size_t>& args) {
    if (args.size() != 6 && args.size() != 7) fail("_rebuild_tensor_v2 takes 6 or 7 arguments");
    PickledTensor t = tensor(expect(args[0], PyKind::kStorage, "tensor storage"));
    t.storage_offset = expect(args[1], PyKind::kInt, "storage offset").i;
    t.shape = int_tuple(args[2], "tensor size");
    t.stride = int_tuple(args[3], "tensor stride");
    push_tensor(PyKind::kTensor, std::move(t));
  }

  // OrderedDict state (state_dict()'s `_metadata` attribute): accepted, ignored.
  void build() override {
    expect(pop(), PyKind::kDict, "BUILD state");
    expect(top(), PyKind::kDict, "BUILD target");
  }

  std::vector<PickledTensor> tensors_;
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

void put_tensor(PickleWriter& w, const PickledTensor& t) {
  w.global("torch._utils", "_rebuild_tensor_v2");
  w.op(kMark);
  w.op(kMark);  // the persistent id
  w.str("storage");
  w.global("torch", storage_type_name(t.dtype));
  w.str(t.storage_key);
  w.str("cpu");
  w.integer(static_cast<int64_t>(t.storage_numel));
  w.op(kTuple);
  w.op(kBinPersId);
  w.integer(0);
  w.int_tuple(t.shape);
  w.int_tuple(contiguous_strides(t.shape));
  w.op(kNewFalse);
  w.global("collections", "OrderedDict");
  w.op(kEmptyTuple);
  w.op(kReduce);
  w.op(kTuple);
  w.op(kReduce);
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
  TensorVm vm(data, size, source);
  const PyValue& root = vm.at(vm.run());
  if (root.kind != PyKind::kDict) {
    throw FormatError(source + ": holds a " + std::string(py_kind_name(root.kind)) +
                      ", not a dict of tensors");
  }
  std::vector<PickledTensor> out;
  std::set<std::string> seen;
  for (size_t i = 0; i + 1 < root.items.size(); i += 2) {
    const PyValue& key = vm.at(root.items[i]);
    const PyValue& value = vm.at(root.items[i + 1]);
    if (key.kind != PyKind::kStr) {
      throw FormatError(source + ": dict key is a " + std::string(py_kind_name(key.kind)) +
                        ", not a str");
    }
    if (value.kind != PyKind::kTensor) {
      throw FormatError(source + ": entry '" + key.s + "' is a " + py_kind_name(value.kind) +
                        ", not a tensor; only a flat dict of tensors can be read");
    }
    if (!seen.insert(key.s).second) throw FormatError(source + ": duplicate entry '" + key.s + "'");
    PickledTensor t = vm.tensor(value);
    t.name = key.s;
    check_tensor(t, source);
    out.push_back(std::move(t));
  }
  return out;
}

PickledTensor parse_tensor_pickle(const uint8_t* data, size_t size, const std::string& source,
                                  const std::string& name) {
  TensorVm vm(data, size, source);
  const PyValue& root = vm.at(vm.run());
  if (root.kind != PyKind::kTensor) {
    throw FormatError(source + ": holds a " + std::string(py_kind_name(root.kind)) +
                      ", not a tensor");
  }
  PickledTensor t = vm.tensor(root);
  t.name = name;
  check_tensor(t, source);
  return t;
}

std::vector<uint8_t> write_tensor_pickle(const PickledTensor& tensor) {
  PickleWriter w;
  put_tensor(w, tensor);
  return w.finish();
}

std::vector<uint8_t> write_tensor_dict_pickle(const std::vector<PickledTensor>& tensors) {
  PickleWriter w;
  w.op(kEmptyDict);
  for (size_t begin = 0; begin < tensors.size(); begin += kSetItemsBatch) {
    const size_t end = std::min(tensors.size(), begin + kSetItemsBatch);
    if (end - begin > 1) w.op(kMark);
    for (size_t i = begin; i < end; ++i) {
      w.str(tensors[i].name);
      put_tensor(w, tensors[i]);
    }
    w.op(end - begin > 1 ? kSetItems : kSetItem);
  }
  return w.finish();
}

}  // namespace checkpoint
