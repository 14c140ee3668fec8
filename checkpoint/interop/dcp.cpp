#include "checkpoint/interop/dcp.h"

#include <thread_pool/thread_pool.hpp>

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <cstring>
#include <map>
#include <optional>
#include <unordered_map>

#include "checkpoint/codec/chunk_writer.h"
#include "checkpoint/format/byte_order.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/interop/torch_pickle.h"
#include "checkpoint/interop/zip_archive.h"
#include "checkpoint/plan/resharding.h"

namespace checkpoint {

namespace {

constexpr uint64_t kMaxDcpMetadataBytes = uint64_t{1} << 30;
constexpr uint64_t kMaxItemPickleBytes = uint64_t{64} << 20;
constexpr size_t kMaxValues = size_t{1} << 26;  // arena bound against pickle bombs
constexpr size_t kMaxItems = size_t{1} << 26;   // tuple, list and dict entries, all values together

// ------------------------------------------------------------ the pickle VM

enum class V { kNone, kBool, kInt, kFloat, kStr, kBytes, kTuple, kList, kDict, kGlobal, kObject };

const char* v_name(V k) {
  switch (k) {
    case V::kNone: return "None";
    case V::kBool: return "bool";
    case V::kInt: return "int";
    case V::kFloat: return "float";
    case V::kStr: return "str";
    case V::kBytes: return "bytes";
    case V::kTuple: return "tuple";
    case V::kList: return "list";
    case V::kDict: return "dict";
    case V::kGlobal: return "global";
    case V::kObject: return "object";
  }
  return "?";
}

// A value in the arena; values refer to each other by index, so nothing is
// traversed or freed recursively whatever the pickle builds.
struct Val {
  explicit Val(V k) : kind(k) {}
  V kind;
  int64_t i = 0;
  double f = 0;
  std::string s;              // str, bytes; "module.name" of a global; an object's class
  std::vector<size_t> items;  // tuple, list; dict keys and values interleaved
  size_t args = 0;            // object: its constructor arguments (a tuple)
  std::optional<size_t> state;  // object: what BUILD gave it
};

// The globals a DCP .metadata may name.
const char* const kMetadataModule = "torch.distributed.checkpoint.metadata";
bool allowed_global(const std::string& g) {
  static const char* const kAllowed[] = {
      "torch.distributed.checkpoint.metadata.Metadata",
      "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
      "torch.distributed.checkpoint.metadata.TensorProperties",
      "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
      "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
      "torch.distributed.checkpoint.metadata.MetadataIndex",
      "torch.distributed.checkpoint.metadata.StorageMeta",
      "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
      "torch.distributed._shard.sharded_tensor.metadata.TensorProperties",
      "torch.distributed._shard.sharded_tensor.metadata.MEM_FORMAT_ENCODING",
      "torch.distributed.checkpoint.filesystem._StorageInfo",
      "torch.Size",
      "torch.serialization._get_layout",
      "collections.OrderedDict",
      "pathlib.PosixPath",
      "pathlib._local.PosixPath",
      "pathlib.WindowsPath",
      "pathlib._local.WindowsPath",
      "pathlib.PurePosixPath",
  };
  for (const char* a : kAllowed) {
    if (g == a) return true;
  }
  // torch.<dtype>: checked when the dtype is interpreted.
  static const char* const kDtypes[] = {
      "float32", "float", "float64", "double", "float16", "half", "bfloat16", "int64", "long",
      "int32", "int", "int16", "short", "int8", "uint8", "bool", "complex64", "complex128",
      "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "uint16", "uint32",
      "uint64"};
  for (const char* d : kDtypes) {
    if (g == std::string("torch.") + d) return true;
  }
  return false;
}

std::optional<DType> dtype_of_global(const std::string& g) {
  static const std::map<std::string, DType> kMap = {
      {"torch.float32", DType::kFloat32}, {"torch.float", DType::kFloat32},
      {"torch.float64", DType::kFloat64}, {"torch.double", DType::kFloat64},
      {"torch.float16", DType::kFloat16}, {"torch.half", DType::kFloat16},
      {"torch.bfloat16", DType::kBFloat16}, {"torch.int64", DType::kInt64},
      {"torch.long", DType::kInt64},     {"torch.int32", DType::kInt32},
      {"torch.int", DType::kInt32},      {"torch.int16", DType::kInt16},
      {"torch.short", DType::kInt16},    {"torch.int8", DType::kInt8},
      {"torch.uint8", DType::kUInt8},    {"torch.bool", DType::kBool}};
  auto it = kMap.find(g);
  if (it == kMap.end()) return std::nullopt;
  return it->second;
}

class Vm {
 public:
  Vm(const uint8_t* data, size_t size, const std::string& source)
      : p_(data), n_(size), source_(source) {}

  size_t run() {
    while (true) {
      if (pos_ >= n_) fail("pickle ends without STOP");
      op_at_ = pos_;
      const uint8_t op = p_[pos_++];
      if (op == '.') {
        const size_t result = pop();
        if (pos_ != n_) fail("trailing bytes after STOP");
        return result;
      }
      step(op);
    }
  }

  const Val& at(size_t i) const { return arena_[i]; }

  [[noreturn]] void fail(const std::string& what) const {
    throw FormatError(source_ + ": " + what + " (pickle offset " + std::to_string(op_at_) + ")");
  }

 private:
  void step(uint8_t op) {
    switch (op) {
      case 0x80: {  // PROTO
        const uint8_t v = u8();
        if (v < 2 || v > 5) fail("unsupported pickle protocol " + std::to_string(v));
        return;
      }
      case 0x95: read(8); return;  // FRAME: a hint only
      case '(': marks_.push_back(stack_.size()); return;
      case '}': push(Val(V::kDict)); return;
      case ')': push(Val(V::kTuple)); return;
      case ']': push(Val(V::kList)); return;
      case 0x8f: push(Val(V::kList)); return;  // EMPTY_SET: a list will do
      case 'N': push(Val(V::kNone)); return;
      case 0x88: push_int(V::kBool, 1); return;
      case 0x89: push_int(V::kBool, 0); return;
      case 'K': push_int(V::kInt, u8()); return;
      case 'M': push_int(V::kInt, static_cast<int64_t>(le(2))); return;
      case 'J': push_int(V::kInt, static_cast<int32_t>(le(4))); return;
      case 0x8a: push_int(V::kInt, long1()); return;
      case 'G': {  // BINFLOAT: big-endian IEEE double
        const uint8_t* b = read(8);
        uint64_t bits = 0;
        for (int k = 0; k < 8; ++k) bits = bits << 8 | b[k];
        Val v(V::kFloat);
        std::memcpy(&v.f, &bits, 8);
        push(std::move(v));
        return;
      }
      case 'X': push_text(V::kStr, le(4)); return;
      case 0x8c: push_text(V::kStr, u8()); return;
      case 0x8d: push_text(V::kStr, le(8)); return;
      case 'C': push_text(V::kBytes, u8()); return;
      case 'B': push_text(V::kBytes, le(4)); return;
      case 'c': {  // GLOBAL module\nname\n
        const std::string module = line();
        const std::string name = line();
        push_global(module + "." + name);
        return;
      }
      case 0x93: {  // STACK_GLOBAL
        const size_t name = pop();
        const size_t module = pop();
        push_global(str(module, "STACK_GLOBAL module") + "." + str(name, "STACK_GLOBAL name"));
        return;
      }
      case 't': push_seq(V::kTuple, pop_to_mark()); return;
      case 0x85: push_seq(V::kTuple, pop_n(1)); return;
      case 0x86: push_seq(V::kTuple, pop_n(2)); return;
      case 0x87: push_seq(V::kTuple, pop_n(3)); return;
      case 'l': push_seq(V::kList, pop_to_mark()); return;
      case 0x91: push_seq(V::kList, pop_to_mark()); return;  // FROZENSET
      case 'd': {
        std::vector<size_t> kv = pop_to_mark();
        if (kv.size() % 2 != 0) fail("DICT with an odd number of items");
        push_seq(V::kDict, std::move(kv));
        return;
      }
      case 'a': append(pop_n(1)); return;
      case 'e': append(pop_to_mark()); return;
      case 0x90: append(pop_to_mark()); return;  // ADDITEMS
      case 's': set_items(pop_n(2)); return;
      case 'u': set_items(pop_to_mark()); return;
      case 0x81: {  // NEWOBJ cls args
        const size_t args = pop();
        const size_t cls = pop();
        construct(cls, args, "NEWOBJ");
        return;
      }
      case 'R': {  // REDUCE callable args
        const size_t args = pop();
        const size_t callable = pop();
        construct(callable, args, "REDUCE");
        return;
      }
      case 'b': {  // BUILD obj state
        const size_t state = pop();
        Val& obj = arena_[top()];
        if (obj.kind == V::kDict && at(state).kind == V::kDict) return;  // OrderedDict state
        if (obj.kind != V::kObject) fail(std::string("BUILD on a ") + v_name(obj.kind));
        if (obj.state) fail("BUILD twice on one " + obj.s);
        obj.state = state;
        return;
      }
      case '0': pop(); return;  // POP
      case 'q': memo_[u8()] = top(); return;
      case 'r': memo_[static_cast<uint32_t>(le(4))] = top(); return;
      case 0x94: memo_[static_cast<uint32_t>(memo_.size())] = top(); return;  // MEMOIZE
      case 'h': get(u8()); return;
      case 'j': get(le(4)); return;
      default: {
        char buf[64];
        std::snprintf(buf, sizeof buf, "unsupported pickle opcode 0x%02x", op);
        fail(std::string(buf) + "; a DCP .metadata does not use it");
      }
    }
  }

  // ---- input
  const uint8_t* read(uint64_t k) {
    if (n_ - pos_ < k) fail("pickle truncated");
    const uint8_t* at = p_ + pos_;
    pos_ += static_cast<size_t>(k);
    return at;
  }
  uint8_t u8() { return *read(1); }
  uint64_t le(size_t k) { return load_le(read(k), k); }
  int64_t long1() {
    const size_t k = u8();
    if (k > 8) fail("integer too large (LONG1 of " + std::to_string(k) + " bytes)");
    if (k == 0) return 0;
    uint64_t v = le(k);
    if (k < 8 && (v >> (8 * k - 1)) & 1) v |= ~uint64_t{0} << (8 * k);
    return static_cast<int64_t>(v);
  }
  std::string line() {
    size_t end = pos_;
    while (end < n_ && end - pos_ < 256 && p_[end] != '\n') ++end;
    if (end >= n_ || p_[end] != '\n') fail("bad GLOBAL operand");
    std::string s(reinterpret_cast<const char*>(p_ + pos_), end - pos_);
    pos_ = end + 1;
    return s;
  }

  // ---- stack
  size_t push(Val v) {
    if (arena_.size() >= kMaxValues) fail("too many pickle values");
    arena_.push_back(std::move(v));
    stack_.push_back(arena_.size() - 1);
    return arena_.size() - 1;
  }
  void push_int(V kind, int64_t i) {
    Val v(kind);
    v.i = i;
    push(std::move(v));
  }
  void push_text(V kind, uint64_t len) {
    Val v(kind);
    const uint8_t* b = read(len);
    v.s.assign(reinterpret_cast<const char*>(b), static_cast<size_t>(len));
    push(std::move(v));
  }
  void count_items(size_t n) {
    items_ += n;
    if (items_ > kMaxItems) fail("too many pickle container entries");
  }
  void push_seq(V kind, std::vector<size_t> items) {
    count_items(items.size());
    Val v(kind);
    v.items = std::move(items);
    push(std::move(v));
  }
  void push_global(const std::string& g) {
    if (!allowed_global(g)) {
      fail("pickle global '" + g + "' is not allowed; a DCP .metadata names only " +
           std::string(kMetadataModule) + " classes, torch.Size, torch dtypes and paths");
    }
    Val v(V::kGlobal);
    v.s = g;
    push(std::move(v));
  }
  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  size_t top() const {
    if (stack_.size() <= floor()) fail("pickle stack underflow");
    return stack_.back();
  }
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
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<size_t> out(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return out;
  }
  void get(uint64_t key) {
    auto it = memo_.find(static_cast<uint32_t>(key));
    if (it == memo_.end()) fail("pickle memo key " + std::to_string(key) + " not set");
    stack_.push_back(it->second);
  }
  const std::string& str(size_t i, const char* what) const {
    if (at(i).kind != V::kStr) fail(std::string(what) + " is a " + v_name(at(i).kind) + ", not a str");
    return at(i).s;
  }
  void append(const std::vector<size_t>& items) {
    Val& list = arena_[top()];
    if (list.kind != V::kList) fail(std::string("APPEND to a ") + v_name(list.kind));
    count_items(items.size());
    list.items.insert(list.items.end(), items.begin(), items.end());
  }
  void set_items(const std::vector<size_t>& kv) {
    if (kv.size() % 2 != 0) fail("SETITEMS with an odd number of items");
    Val& dict = arena_[top()];
    if (dict.kind != V::kDict) fail(std::string("SETITEM on a ") + v_name(dict.kind));
    count_items(kv.size());
    dict.items.insert(dict.items.end(), kv.begin(), kv.end());
  }

  // NEWOBJ / REDUCE: nothing is called. torch.Size(t) becomes the tuple t,
  // OrderedDict() an empty dict; everything else an object of that class.
  void construct(size_t callable, size_t args, const char* op) {
    if (at(callable).kind != V::kGlobal) {
      fail(std::string(op) + " of a " + v_name(at(callable).kind) + ", not a class");
    }
    if (at(args).kind != V::kTuple) fail(std::string(op) + " arguments are not a tuple");
    const std::string& g = at(callable).s;
    if (g == "torch.Size") {
      const std::vector<size_t>& a = at(args).items;
      if (a.size() != 1 || (at(a[0]).kind != V::kTuple && at(a[0]).kind != V::kList)) {
        fail("torch.Size takes one tuple");
      }
      push_seq(V::kTuple, at(a[0]).items);
      return;
    }
    if (g == "collections.OrderedDict") {
      if (!at(args).items.empty()) fail("OrderedDict called with arguments");
      push(Val(V::kDict));
      return;
    }
    Val v(V::kObject);
    v.s = g;
    v.args = args;
    push(std::move(v));
  }

  const uint8_t* p_;
  size_t n_;
  const std::string& source_;
  size_t pos_ = 0;
  size_t op_at_ = 0;
  std::vector<Val> arena_;
  std::vector<size_t> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint32_t, size_t> memo_;
  size_t items_ = 0;
};

// ------------------------------------------------------- interpretation

class Reader {
 public:
  Reader(const Vm& vm, const std::string& source) : vm_(vm), source_(source) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw FormatError(source_ + ": " + what);
  }

  const Val& expect(size_t i, V kind, const std::string& what) const {
    if (vm_.at(i).kind != kind) {
      fail(what + " is a " + v_name(vm_.at(i).kind) + ", expected a " + v_name(kind));
    }
    return vm_.at(i);
  }
  // The object's BUILD state as a dict (a missing state: an empty dict).
  std::map<std::string, size_t> fields(size_t obj, const std::string& cls, const std::string& what) const {
    const Val& o = expect(obj, V::kObject, what);
    if (o.s != std::string(kMetadataModule) + "." + cls &&
        o.s != "torch.distributed.checkpoint.filesystem." + cls) {
      fail(what + " is a " + o.s + ", expected " + cls);
    }
    std::map<std::string, size_t> out;
    if (!o.state) return out;
    const Val& st = expect(*o.state, V::kDict, what + " state");
    for (size_t k = 0; k + 1 < st.items.size(); k += 2) {
      out[expect(st.items[k], V::kStr, what + " field name").s] = st.items[k + 1];
    }
    return out;
  }
  size_t field(const std::map<std::string, size_t>& f, const std::string& name,
               const std::string& what) const {
    auto it = f.find(name);
    if (it == f.end()) fail(what + " has no field '" + name + "'");
    return it->second;
  }
  std::vector<int64_t> ints(size_t i, const std::string& what) const {
    const Val& t = vm_.at(i);
    if (t.kind != V::kTuple && t.kind != V::kList) fail(what + " is not a tuple of ints");
    if (t.items.size() > kMaxNdim) fail(what + " has more than " + std::to_string(kMaxNdim) + " dims");
    std::vector<int64_t> out;
    for (size_t e : t.items) out.push_back(expect(e, V::kInt, what).i);
    return out;
  }
  int64_t non_negative(size_t i, const std::string& what) const {
    const int64_t v = expect(i, V::kInt, what).i;
    if (v < 0) fail(what + " is negative (" + std::to_string(v) + ")");
    return v;
  }

  DType dtype_of(size_t properties, const std::string& what) const {
    const Val& o = expect(properties, V::kObject, what);
    if (o.s.size() < std::strlen("TensorProperties") ||
        o.s.compare(o.s.size() - std::strlen("TensorProperties"), std::string::npos,
                    "TensorProperties") != 0) {
      fail(what + " is a " + o.s + ", expected TensorProperties");
    }
    if (!o.state) fail(what + " has no state");
    size_t dtype = 0;
    const Val& st = vm_.at(*o.state);
    if (st.kind == V::kTuple) {  // torch >= 2.2: (dtype, layout, requires_grad, memory_format, pin_memory)
      if (st.items.empty()) fail(what + " state is an empty tuple");
      dtype = st.items[0];
    } else if (st.kind == V::kDict) {  // older: the dataclass's __dict__
      const auto f = fields_of_dict(st, what);
      dtype = field(f, "dtype", what);
    } else {
      fail(what + " state is a " + v_name(st.kind));
    }
    const std::string& g = expect(dtype, V::kGlobal, what + " dtype").s;
    const std::optional<DType> d = dtype_of_global(g);
    if (!d) fail(what + ": dtype " + g + " is not supported");
    return *d;
  }
  std::map<std::string, size_t> fields_of_dict(const Val& st, const std::string& what) const {
    std::map<std::string, size_t> out;
    for (size_t k = 0; k + 1 < st.items.size(); k += 2) {
      out[expect(st.items[k], V::kStr, what + " field name").s] = st.items[k + 1];
    }
    return out;
  }

  DcpLocation location(size_t info, const std::string& what) const {
    const auto f = fields(info, "_StorageInfo", what);
    DcpLocation loc;
    loc.file = expect(field(f, "relative_path", what), V::kStr, what + " relative_path").s;
    if (!is_safe_file_name(loc.file)) {
      fail(what + ": data file name '" + loc.file + "' is not a plain file name");
    }
    loc.offset = static_cast<uint64_t>(non_negative(field(f, "offset", what), what + " offset"));
    loc.length = static_cast<uint64_t>(non_negative(field(f, "length", what), what + " length"));
    if (auto t = f.find("transform_descriptors"); t != f.end() && vm_.at(t->second).kind != V::kNone &&
                                                  !vm_.at(t->second).items.empty()) {
      fail(what + " uses DCP stream transforms (transform_descriptors, e.g. zstd); save without "
                  "them (no _extensions) to read it here");
    }
    return loc;
  }

  // No two chunks overlap. A sweep along the dim on which the chunks have
  // the most distinct offsets: each chunk is compared only with those still
  // open there (one or two for the usual one-dim shardings), so a
  // checkpoint of many thousands of ranks checks in O(n log n).
  void check_disjoint(const std::vector<DcpChunk>& chunks, const std::string& what) const {
    if (chunks.size() < 2 || chunks[0].box.ndim() == 0) {
      if (chunks.size() > 1) fail(what + ": a 0-d tensor with " + std::to_string(chunks.size()) + " chunks");
      return;
    }
    size_t dim = 0;
    size_t best = 0;
    for (size_t d = 0; d < chunks[0].box.ndim(); ++d) {
      std::vector<int64_t> offsets;
      for (const DcpChunk& c : chunks) offsets.push_back(c.box.offsets[d]);
      std::sort(offsets.begin(), offsets.end());
      const size_t distinct = static_cast<size_t>(std::unique(offsets.begin(), offsets.end()) - offsets.begin());
      if (distinct > best) {
        best = distinct;
        dim = d;
      }
    }
    std::vector<size_t> order(chunks.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return chunks[a].box.offsets[dim] < chunks[b].box.offsets[dim];
    });
    std::vector<size_t> open;
    for (size_t i : order) {
      const int64_t start = chunks[i].box.offsets[dim];
      open.erase(std::remove_if(open.begin(), open.end(),
                                [&](size_t o) {
                                  return chunks[o].box.offsets[dim] + chunks[o].box.sizes[dim] <= start;
                                }),
                 open.end());
      for (size_t o : open) {
        if (intersect(chunks[o].box, chunks[i].box)) {
          fail(what + ": chunks " + box_to_string(chunks[o].box) + " and " +
               box_to_string(chunks[i].box) + " overlap");
        }
      }
      if (!chunks[i].box.is_empty()) open.push_back(i);
    }
  }

  DcpMetadata interpret(size_t root) const {
    const auto meta = fields(root, "Metadata", "the pickled object");
    DcpMetadata out;
    if (auto v = meta.find("version"); v != meta.end() && vm_.at(v->second).kind == V::kStr) {
      out.version = vm_.at(v->second).s;
    }
    // storage_data: (fqn, offsets) -> where; bytes items have no offset.
    std::map<std::pair<std::string, std::vector<int64_t>>, DcpLocation> tensor_locs;
    std::map<std::string, DcpLocation> bytes_locs;
    const Val& storage = expect(field(meta, "storage_data", "Metadata"), V::kDict, "storage_data");
    for (size_t k = 0; k + 1 < storage.items.size(); k += 2) {
      const auto idx = fields(storage.items[k], "MetadataIndex", "a storage_data key");
      const std::string fqn = expect(field(idx, "fqn", "MetadataIndex"), V::kStr, "MetadataIndex fqn").s;
      const std::string what = "storage_data['" + fqn + "']";
      const DcpLocation loc = location(storage.items[k + 1], what);
      auto off = idx.find("offset");
      if (off == idx.end() || vm_.at(off->second).kind == V::kNone) {
        bytes_locs[fqn] = loc;
      } else {
        tensor_locs[{fqn, ints(off->second, what + " offset")}] = loc;
      }
    }
    const Val& items =
        expect(field(meta, "state_dict_metadata", "Metadata"), V::kDict, "state_dict_metadata");
    for (size_t k = 0; k + 1 < items.items.size(); k += 2) {
      const std::string fqn = expect(items.items[k], V::kStr, "a state_dict_metadata key").s;
      const std::string what = "item '" + fqn + "'";
      const Val& value = expect(items.items[k + 1], V::kObject, what);
      if (value.s == std::string(kMetadataModule) + ".BytesStorageMetadata") {
        auto it = bytes_locs.find(fqn);
        if (it == bytes_locs.end()) fail(what + " has no storage_data entry");
        out.bytes.push_back({fqn, it->second});
        continue;
      }
      const auto f = fields(items.items[k + 1], "TensorStorageMetadata", what);
      DcpTensorItem t;
      t.fqn = fqn;
      t.dtype = dtype_of(field(f, "properties", what), what + " properties");
      t.shape = ints(field(f, "size", what), what + " size");
      if (!checked_numel(t.shape)) fail(what + " has an invalid size " + shape_to_string(t.shape));
      const Val& chunks = expect(field(f, "chunks", what), V::kList, what + " chunks");
      uint64_t covered = 0;
      for (size_t c : chunks.items) {
        const auto cf = fields(c, "ChunkStorageMetadata", what + " chunk");
        DcpChunk chunk;
        chunk.box.offsets = ints(field(cf, "offsets", what + " chunk"), what + " chunk offsets");
        chunk.box.sizes = ints(field(cf, "sizes", what + " chunk"), what + " chunk sizes");
        bool inside = chunk.box.offsets.size() == t.shape.size() &&
                      chunk.box.sizes.size() == t.shape.size();
        for (size_t d = 0; inside && d < t.shape.size(); ++d) {
          inside = chunk.box.offsets[d] >= 0 && chunk.box.sizes[d] >= 0 &&
                   chunk.box.offsets[d] <= t.shape[d] &&
                   chunk.box.sizes[d] <= t.shape[d] - chunk.box.offsets[d];
        }
        if (!inside) {
          fail(what + ": chunk " + box_to_string(chunk.box) + " lies outside its shape " +
               shape_to_string(t.shape));
        }
        auto loc = tensor_locs.find({fqn, chunk.box.offsets});
        if (loc == tensor_locs.end()) {
          fail(what + ": chunk " + box_to_string(chunk.box) + " has no storage_data entry");
        }
        chunk.location = loc->second;
        covered += static_cast<uint64_t>(chunk.box.numel());
        t.chunks.push_back(std::move(chunk));
      }
      check_disjoint(t.chunks, what);
      if (covered != *checked_numel(t.shape)) {
        fail(what + ": its chunks cover " + std::to_string(covered) + " of " +
             std::to_string(*checked_numel(t.shape)) + " elements");
      }
      out.tensors.push_back(std::move(t));
    }
    return out;
  }

 private:
  const Vm& vm_;
  const std::string& source_;
};

// One item's archive as a file of its own, for the zip reader: reads of
// "item" at [0, length) are reads of `file` at [offset, offset + length).
class ArchiveView : public Storage {
 public:
  ArchiveView(Storage& base, std::string file, uint64_t offset, uint64_t length)
      : base_(base), file_(std::move(file)), offset_(offset), length_(length) {}
  void read_at(const std::string&, uint64_t offset, void* dst, size_t n) override {
    if (offset > length_ || n > length_ - offset) {
      throw FormatError(file_ + ": the archive at offset " + std::to_string(offset_) +
                        " reaches past its recorded length " + std::to_string(length_));
    }
    base_.read_at(file_, offset_ + offset, dst, n);
  }
  uint64_t file_size(const std::string&) override { return length_; }
  FileInfo stat(const std::string&) override { return {FileType::kFile, length_, 0}; }
  std::unique_ptr<WritableFile> create_file(const std::string&) override { refuse(); }
  void make_dirs(const std::string&) override { refuse(); }
  void rename(const std::string&, const std::string&) override { refuse(); }
  void sync_dir(const std::string&) override { refuse(); }
  std::vector<std::string> list_dir(const std::string&) override { refuse(); }
  void remove_all(const std::string&) override { refuse(); }

 private:
  [[noreturn]] static void refuse() { throw std::logic_error("ArchiveView is read-only"); }
  Storage& base_;
  std::string file_;
  uint64_t offset_;
  uint64_t length_;
};


// ------------------------------------------------------------- the writer

class PickleOut {
 public:
  void op(uint8_t o) { out_.push_back(o); }
  void global(const std::string& module, const std::string& name) {
    op('c');
    out_.insert(out_.end(), module.begin(), module.end());
    out_.push_back('\n');
    out_.insert(out_.end(), name.begin(), name.end());
    out_.push_back('\n');
  }
  void str(const std::string& s) {
    op('X');
    append_le(out_, s.size(), 4);
    out_.insert(out_.end(), s.begin(), s.end());
  }
  void integer(int64_t v) {
    if (v >= 0 && v <= 0xFF) {
      op('K');
      append_le(out_, static_cast<uint64_t>(v), 1);
    } else if (v >= 0 && v <= 0xFFFF) {
      op('M');
      append_le(out_, static_cast<uint64_t>(v), 2);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      op('J');
      append_le(out_, static_cast<uint64_t>(v), 4);
    } else {
      op(0x8a);
      op(8);
      append_le(out_, static_cast<uint64_t>(v), 8);
    }
  }
  void size(const std::vector<int64_t>& dims) {  // torch.Size((d0, d1, ...))
    global("torch", "Size");
    op('(');
    for (int64_t d : dims) integer(d);
    op('t');
    op(0x85);  // TUPLE1
    op('R');
  }
  void new_object(const std::string& module, const std::string& cls) {
    global(module, cls);
    op(')');
    op(0x81);  // NEWOBJ
  }
  std::vector<uint8_t>& bytes() { return out_; }

 private:
  std::vector<uint8_t> out_;
};

const char* torch_dtype_name(DType d) {
  switch (d) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt64: return "int64";
    case DType::kInt32: return "int32";
    case DType::kInt16: return "int16";
    case DType::kInt8: return "int8";
    case DType::kUInt8: return "uint8";
    case DType::kBool: return "bool";
  }
  return "float32";
}

void put_storage_info(PickleOut& p, const DcpLocation& loc) {
  p.new_object("torch.distributed.checkpoint.filesystem", "_StorageInfo");
  p.op('}');
  p.op('(');
  p.str("relative_path");
  p.str(loc.file);
  p.str("offset");
  p.integer(static_cast<int64_t>(loc.offset));
  p.str("length");
  p.integer(static_cast<int64_t>(loc.length));
  p.op('u');
  p.op('b');
}

}  // namespace

bool is_dcp_checkpoint(Storage& storage, const std::string& dir) {
  const std::string path = join_path(dir, ".metadata");
  if (storage.stat(path).type != FileType::kFile || storage.file_size(path) < 2) return false;
  uint8_t head[2];
  storage.read_at(path, 0, head, 2);
  return head[0] == 0x80 && head[1] >= 2 && head[1] <= 5;
}

DcpMetadata parse_dcp_metadata(const uint8_t* data, size_t size, const std::string& source) {
  Vm vm(data, size, source);
  const size_t root = vm.run();
  return Reader(vm, source).interpret(root);
}

DcpMetadata read_dcp_metadata(Storage& storage, const std::string& dir) {
  const std::string path = join_path(dir, ".metadata");
  const std::vector<uint8_t> bytes = storage.read_file(path, kMaxDcpMetadataBytes);
  return parse_dcp_metadata(bytes.data(), bytes.size(), path);
}

std::vector<uint8_t> write_dcp_metadata(const DcpMetadata& meta) {
  PickleOut p;
  const std::string m = kMetadataModule;
  p.op(0x80);
  p.op(2);
  p.new_object(m, "Metadata");
  p.op('}');
  p.op('(');
  p.str("state_dict_metadata");
  p.op('}');
  for (const DcpTensorItem& t : meta.tensors) {
    p.str(t.fqn);
    p.new_object(m, "TensorStorageMetadata");
    p.op('}');
    p.op('(');
    p.str("properties");
    p.new_object(m, "TensorProperties");
    p.op('(');  // (dtype, layout, requires_grad, memory_format, pin_memory)
    p.global("torch", torch_dtype_name(t.dtype));
    p.global("torch.serialization", "_get_layout");
    p.str("torch.strided");
    p.op(0x85);
    p.op('R');
    p.op(0x89);
    p.global(m, "_MEM_FORMAT_ENCODING");
    p.integer(0);
    p.op(0x85);
    p.op('R');
    p.op(0x89);
    p.op('t');
    p.op('b');
    p.str("size");
    p.size(t.shape);
    p.str("chunks");
    p.op(']');
    for (const DcpChunk& c : t.chunks) {
      p.new_object(m, "ChunkStorageMetadata");
      p.op('}');
      p.op('(');
      p.str("offsets");
      p.size(c.box.offsets);
      p.str("sizes");
      p.size(c.box.sizes);
      p.op('u');
      p.op('b');
      p.op('a');
    }
    p.op('u');
    p.op('b');
    p.op('s');
  }
  for (const DcpBytesItem& b : meta.bytes) {
    p.str(b.fqn);
    p.new_object(m, "BytesStorageMetadata");
    p.op('s');
  }
  p.str("planner_data");
  p.op('}');
  auto path_of = [&](const std::string& fqn) {
    p.str(fqn);
    if (fqn.rfind("model.", 0) == 0) {
      p.str("model");
      p.str(fqn.substr(6));
      p.op(0x86);
    } else {
      p.str(fqn);
      p.op(0x85);
    }
    p.op('s');
  };
  for (const DcpTensorItem& t : meta.tensors) path_of(t.fqn);
  for (const DcpBytesItem& b : meta.bytes) path_of(b.fqn);
  p.str("storage_data");
  p.op('}');
  for (const DcpTensorItem& t : meta.tensors) {
    for (size_t k = 0; k < t.chunks.size(); ++k) {
      p.new_object(m, "MetadataIndex");
      p.op('}');
      p.op('(');
      p.str("fqn");
      p.str(t.fqn);
      p.str("index");
      p.integer(static_cast<int64_t>(k));
      p.str("offset");
      p.size(t.chunks[k].box.offsets);
      p.op('u');
      p.op('b');
      put_storage_info(p, t.chunks[k].location);
      p.op('s');
    }
  }
  for (const DcpBytesItem& b : meta.bytes) {
    p.new_object(m, "MetadataIndex");
    p.op('}');
    p.op('(');
    p.str("fqn");
    p.str(b.fqn);
    p.str("index");
    p.op('N');
    p.op('u');
    p.op('b');
    put_storage_info(p, b.location);
    p.op('s');
  }
  p.str("storage_meta");
  p.op('N');
  p.op('u');
  p.op('b');
  p.op('.');
  return std::move(p.bytes());
}

uint64_t dcp_chunk_data_offset(Storage& storage, const std::string& dir, const DcpTensorItem& item,
                               const DcpChunk& chunk) {
  const std::string file = join_path(dir, chunk.location.file);
  const std::string where = file + " (item '" + item.fqn + "', chunk " + box_to_string(chunk.box) +
                            ", archive at offset " + std::to_string(chunk.location.offset) + ")";
  const uint64_t file_bytes = storage.file_size(file);
  if (chunk.location.offset > file_bytes || chunk.location.length > file_bytes - chunk.location.offset) {
    throw FormatError(where + ": the archive of " + std::to_string(chunk.location.length) +
                      " bytes reaches past the end of the file (" + std::to_string(file_bytes) +
                      " bytes): truncated?");
  }
  ArchiveView view(storage, file, chunk.location.offset, chunk.location.length);
  const std::vector<ZipMember> members = [&] {
    try {
      return read_zip_directory(view, "item");
    } catch (const FormatError& e) {
      throw FormatError(where + ": not a torch.save archive: " + e.what());
    }
  }();
  const ZipMember* pickle = nullptr;
  std::map<std::string, const ZipMember*> by_name;
  for (const ZipMember& m : members) {
    by_name[m.name] = &m;
    const size_t slash = m.name.find('/');
    if (slash != std::string::npos && m.name.substr(slash) == "/data.pkl") pickle = &m;
  }
  if (pickle == nullptr) throw FormatError(where + ": archive without <name>/data.pkl");
  const std::string prefix = pickle->name.substr(0, pickle->name.size() - std::strlen("data.pkl"));
  if (pickle->size > kMaxItemPickleBytes) throw FormatError(where + ": data.pkl is too large");
  std::vector<uint8_t> pkl(pickle->size);
  view.read_at("item", zip_member_data_offset(view, "item", *pickle), pkl.data(), pkl.size());
  if (crc32_update(0, pkl.data(), pkl.size()) != pickle->crc32) {
    throw FormatError(where + ": CRC-32 mismatch in data.pkl");
  }
  const PickledTensor t = parse_tensor_pickle(pkl.data(), pkl.size(), where + ": data.pkl", item.fqn);
  if (t.dtype != item.dtype) {
    throw FormatError(where + ": the archive holds " + dtype_name(t.dtype) + ", the metadata says " +
                      dtype_name(item.dtype));
  }
  if (t.shape != chunk.box.sizes) {
    throw FormatError(where + ": the archive holds a tensor of shape " + shape_to_string(t.shape) +
                      ", the chunk is " + shape_to_string(chunk.box.sizes));
  }
  auto member = by_name.find(prefix + "data/" + t.storage_key);
  if (member == by_name.end()) {
    throw FormatError(where + ": storage member '" + prefix + "data/" + t.storage_key + "' is missing");
  }
  const uint64_t esize = element_size(t.dtype);
  if (member->second->size != t.storage_numel * esize) {
    throw FormatError(where + ": storage member has " + std::to_string(member->second->size) +
                      " bytes, its pickle says " + std::to_string(t.storage_numel * esize));
  }
  return chunk.location.offset + zip_member_data_offset(view, "item", *member->second) +
         static_cast<uint64_t>(t.storage_offset) * esize;
}

std::string dcp_to_shardkit_name(const std::string& fqn, const std::vector<DcpRename>& renames) {
  auto starts_with = [](const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; };
  std::string key = fqn;
  for (const auto& [from, to] : renames) {
    if (starts_with(key, from)) {
      key = to + key.substr(from.size());
      break;
    }
  }
  if (starts_with(key, "model.")) return key;
  for (const char* optim : {"optim.state.", "optimizer.state."}) {
    if (starts_with(key, optim)) return "optim." + key.substr(std::strlen(optim));
  }
  for (const char* other : {"optim.", "optimizer.", "lr_scheduler.", "dataloader.", "train_state.",
                            "extra."}) {
    if (starts_with(key, other)) return "";
  }
  return "model." + key;
}


DcpImportStats import_dcp_checkpoint(const std::string& src, const std::string& step_dir,
                                     const DcpImportOptions& options) {
  std::shared_ptr<Storage> storage = options.storage ? options.storage : posix_storage();
  const DcpMetadata meta = read_dcp_metadata(*storage, src);
  if (storage->exists(step_dir)) {
    throw IoError(step_dir + ": exists; import-dcp writes a new checkpoint directory");
  }
  DcpImportStats stats;
  int64_t train_step = -1;
  int64_t max_optim_step = -1;
  struct Planned {
    const DcpTensorItem* item;
    std::string name;
    bool step;  // an AdamW step: an 8-byte integer item
  };
  std::vector<Planned> planned;
  std::map<std::string, std::string> seen;
  auto scalar = [&](const DcpTensorItem& item) {
    if (!checked_numel(item.shape) || *checked_numel(item.shape) != 1) {
      throw FormatError(src + ": item '" + item.fqn + "' is not a single number");
    }
    uint8_t raw[8] = {};
    read_dcp_box(*storage, src, item, full_box(item.shape), raw);
    switch (item.dtype) {
      case DType::kFloat32: {
        float f;
        std::memcpy(&f, raw, 4);
        return static_cast<int64_t>(f);
      }
      case DType::kFloat64: {
        double d;
        std::memcpy(&d, raw, 8);
        return static_cast<int64_t>(d);
      }
      case DType::kInt64: return static_cast<int64_t>(load_le(raw, 8));
      case DType::kInt32: return static_cast<int64_t>(static_cast<int32_t>(load_le(raw, 4)));
      default: throw FormatError(src + ": item '" + item.fqn + "' is not a step count");
    }
  };
  for (const DcpTensorItem& item : meta.tensors) {
    if (item.fqn == "train_state.step") {
      train_step = scalar(item);
      continue;
    }
    const std::string name = dcp_to_shardkit_name(item.fqn, options.renames);
    if (name.empty()) {
      stats.ignored.push_back(item.fqn);
      continue;
    }
    if (!seen.emplace(name, item.fqn).second) {
      throw FormatError(src + ": DCP keys '" + seen[name] + "' and '" + item.fqn +
                        "' both map to '" + name + "'");
    }
    const bool is_step = name.rfind("optim.", 0) == 0 && name.size() > 5 &&
                         name.compare(name.size() - 5, 5, ".step") == 0;
    planned.push_back({&item, name, is_step});
  }
  for (const DcpBytesItem& b : meta.bytes) stats.ignored.push_back(b.fqn);
  if (planned.empty()) throw FormatError(src + ": nothing to import: no model or optimizer tensors");

  storage->make_dirs_durable(step_dir);
  const std::string data_file = "rank_0.data";
  try {
    thread_pool::ThreadPool pool(static_cast<size_t>(std::max(1, options.io_threads)));
    std::unique_ptr<WritableFile> file = storage->create_file(join_path(step_dir, data_file));
    ChunkWriter::Options wo;
    wo.max_batches_in_flight = 2 * pool.num_threads();
    ChunkWriter writer(*file, &pool, wo);
    CheckpointMeta out;
    out.world_size = 1;
    out.layout = "imported from PyTorch DCP";
    out.created_unix_s = static_cast<int64_t>(std::time(nullptr));
    out.info["imported_from"] = "pytorch-dcp";
    out.info["source"] = src;
    std::vector<std::pair<size_t, Box>> chunk_of;  // per chunk added: (item, box)
    auto add_bytes_item = [&](const std::string& name, int64_t v) {
      auto buf = std::make_shared<std::vector<uint8_t>>(8);
      store_le(buf->data(), static_cast<uint64_t>(v), 8);
      ItemMeta item;
      item.name = name;
      item.kind = ItemKind::kBytes;
      item.dtype = DType::kUInt8;
      item.global_shape = {8};
      out.items.push_back(std::move(item));
      writer.add_chunk(buf->data(), 8, 1, {}, buf);
      chunk_of.emplace_back(out.items.size() - 1, full_box({8}));
      stats.bytes += 8;
    };
    for (const Planned& p : planned) {
      const DcpTensorItem& item = *p.item;
      if (p.step) {
        const int64_t v = scalar(item);
        max_optim_step = std::max(max_optim_step, v);
        add_bytes_item(p.name, v);
        ++stats.tensors;
        continue;
      }
      ItemMeta meta_item;
      meta_item.name = p.name;
      meta_item.dtype = item.dtype;
      meta_item.global_shape = item.shape;
      out.items.push_back(std::move(meta_item));
      const size_t index = out.items.size() - 1;
      const size_t esize = element_size(item.dtype);
      for (const DcpChunk& c : item.chunks) {
        const int64_t rows = c.box.ndim() == 0 ? 1 : c.box.sizes[0];
        const uint64_t row_bytes = rows == 0 ? 0 : static_cast<uint64_t>(c.box.numel()) / rows * esize;
        const int64_t per = static_cast<int64_t>(std::max<uint64_t>(
            1, row_bytes == 0 ? 1 : std::min<uint64_t>(rows, options.slab_bytes / row_bytes)));
        for (int64_t r0 = 0; r0 < std::max<int64_t>(rows, 1); r0 += per) {
          Box slab = c.box;
          if (slab.ndim() > 0) {
            slab.offsets[0] = c.box.offsets[0] + r0;
            slab.sizes[0] = std::min(per, rows - r0);
          }
          auto buf = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(slab.numel()) * esize);
          if (!slab.is_empty()) read_dcp_box(*storage, src, item, slab, buf->data());
          writer.add_chunk(buf->data(), buf->size(), esize, {}, buf);
          chunk_of.emplace_back(index, slab);
          stats.bytes += buf->size();
          if (rows == 0) break;
        }
      }
      ++stats.tensors;
    }
    stats.step = train_step >= 0 ? train_step : std::max<int64_t>(0, max_optim_step);
    out.step = stats.step;
    add_bytes_item("train.step", stats.step);
    std::vector<ChunkMeta> chunks = writer.finish();
    file->sync();
    file->close();
    for (size_t k = 0; k < chunks.size(); ++k) {
      chunks[k].box = chunk_of[k].second;
      chunks[k].file = data_file;
      chunks[k].writer_rank = 0;
      out.items[chunk_of[k].first].chunks.push_back(std::move(chunks[k]));
    }
    storage->sync_dir(step_dir);
    storage->write_file_atomic(join_path(step_dir, kMetadataFileName), encode_metadata(out));
  } catch (...) {
    storage->remove_all(step_dir);
    throw;
  }
  return stats;
}

void read_dcp_box(Storage& storage, const std::string& dir, const DcpTensorItem& item,
                  const Box& box, uint8_t* dst) {
  bool inside = box.ndim() == item.shape.size() && box.offsets.size() == box.ndim();
  for (size_t d = 0; inside && d < box.ndim(); ++d) {
    inside = box.offsets[d] >= 0 && box.sizes[d] >= 0 && box.offsets[d] <= item.shape[d] &&
             box.sizes[d] <= item.shape[d] - box.offsets[d];
  }
  if (!inside) {
    throw FormatError(join_path(dir, ".metadata") + ": box " + box_to_string(box) +
                      " lies outside item '" + item.fqn + "' of shape " + shape_to_string(item.shape));
  }
  if (box.is_empty()) return;
  for (const DcpChunk& c : item.chunks) {
    const std::optional<Box> overlap = intersect(c.box, box);
    if (!overlap) continue;
    const uint64_t data = dcp_chunk_data_offset(storage, dir, item, c);
    const std::string file = join_path(dir, c.location.file);
    for (const ByteRange& r : overlap_byte_ranges(c.box, box, *overlap, element_size(item.dtype))) {
      storage.read_at(file, data + r.src_offset, dst + r.dst_offset, r.length);
    }
  }
}

std::string dcp_model_name(const std::string& fqn) {
  static const char* const kNotModel[] = {"optim.",      "optimizer.",   "lr_scheduler.",
                                          "dataloader.", "train_state.", "extra."};
  if (fqn.rfind("model.", 0) == 0) return fqn.substr(6);
  for (const char* p : kNotModel) {
    if (fqn.rfind(p, 0) == 0) return "";
  }
  return fqn;
}

}  // namespace checkpoint
