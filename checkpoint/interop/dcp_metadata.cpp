// DCP's .metadata: the pickled torch.distributed.checkpoint.metadata.Metadata,
// read by the restricted pickle VM (pickle.h) with the DCP dialect and
// interpreted into DcpMetadata; and written back (write_dcp_metadata).
#include <algorithm>
#include <cstring>
#include <map>
#include <optional>

#include "checkpoint/format/metadata.h"
#include "checkpoint/interop/dcp.h"
#include "checkpoint/interop/pickle.h"
#include "checkpoint/interop/streaming.h"
#include "checkpoint/plan/resharding.h"

namespace checkpoint {

namespace {

constexpr uint64_t kMaxDcpMetadataBytes = uint64_t{1} << 30;
const char* const kMetadataModule = "torch.distributed.checkpoint.metadata";

// ------------------------------------------------------------ the dialect

// The globals a DCP .metadata may name.
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

const PickleDialect kDcpDialect = {
    "\x80\x95(})]\x8fN\x88\x89KMJ\x8aGX\x8c\x8d" "CBc\x93t\x85\x86\x87l\x91" "dae\x90su\x81Rb0qr\x94hj",
    allowed_global,
    "a DCP .metadata names only torch.distributed.checkpoint.metadata classes, torch.Size, "
    "torch dtypes and paths",
    "a DCP .metadata does not use it",
    false,
};

// NEWOBJ / REDUCE call nothing: torch.Size(t) becomes the tuple t,
// OrderedDict() an empty dict; everything else an object of that class,
// whose BUILD state is kept.
class DcpVm : public PickleVm {
 public:
  DcpVm(const uint8_t* data, size_t size, const std::string& source)
      : PickleVm(data, size, source, kDcpDialect) {}

 private:
  void new_object() override {  // NEWOBJ cls args
    const size_t args = pop();
    const size_t cls = pop();
    construct(cls, args, "NEWOBJ");
  }
  void reduce() override {  // REDUCE callable args
    const size_t args = pop();
    const size_t callable = pop();
    construct(callable, args, "REDUCE");
  }
  void build() override {  // BUILD obj state
    const size_t state = pop();
    PyValue& obj = mutable_at(top());
    if (obj.kind == PyKind::kDict && at(state).kind == PyKind::kDict) return;  // OrderedDict state
    if (obj.kind != PyKind::kObject) fail(std::string("BUILD on a ") + py_kind_name(obj.kind));
    if (obj.state) fail("BUILD twice on one " + obj.s);
    obj.state = state;
  }

  void construct(size_t callable, size_t args, const char* op) {
    if (at(callable).kind != PyKind::kGlobal) {
      fail(std::string(op) + " of a " + py_kind_name(at(callable).kind) + ", not a class");
    }
    if (at(args).kind != PyKind::kTuple) fail(std::string(op) + " arguments are not a tuple");
    const std::string& g = at(callable).s;
    if (g == "torch.Size") {
      const std::vector<size_t>& a = at(args).items;
      if (a.size() != 1 || (at(a[0]).kind != PyKind::kTuple && at(a[0]).kind != PyKind::kList)) {
        fail("torch.Size takes one tuple");
      }
      push_seq(PyKind::kTuple, at(a[0]).items);
      return;
    }
    if (g == "collections.OrderedDict") {
      if (!at(args).items.empty()) fail("OrderedDict called with arguments");
      push(PyValue(PyKind::kDict));
      return;
    }
    PyValue v(PyKind::kObject);
    v.s = g;
    v.args = args;
    push(std::move(v));
  }
};

// ------------------------------------------------------- interpretation

using Fields = std::map<std::string, size_t>;
// storage_data: (fqn, offsets) -> where; bytes items have no offset.
struct StorageIndex {
  std::map<std::pair<std::string, std::vector<int64_t>>, DcpLocation> tensors;
  std::map<std::string, DcpLocation> bytes;
};

class Reader {
 public:
  Reader(const PickleVm& vm, const std::string& source) : vm_(vm), source_(source) {}

  DcpMetadata interpret(size_t root) const {
    const Fields meta = fields(root, "Metadata", "the pickled object");
    DcpMetadata out;
    if (auto v = meta.find("version"); v != meta.end() && vm_.at(v->second).kind == PyKind::kStr) {
      out.version = vm_.at(v->second).s;
    }
    const StorageIndex where = storage_index(field(meta, "storage_data", "Metadata"));
    const PyValue& items =
        expect(field(meta, "state_dict_metadata", "Metadata"), PyKind::kDict, "state_dict_metadata");
    for (size_t k = 0; k + 1 < items.items.size(); k += 2) {
      const std::string fqn = expect(items.items[k], PyKind::kStr, "a state_dict_metadata key").s;
      const std::string what = "item '" + fqn + "'";
      const PyValue& value = expect(items.items[k + 1], PyKind::kObject, what);
      if (value.s == std::string(kMetadataModule) + ".BytesStorageMetadata") {
        auto it = where.bytes.find(fqn);
        if (it == where.bytes.end()) fail(what + " has no storage_data entry");
        out.bytes.push_back({fqn, it->second});
      } else {
        out.tensors.push_back(tensor_item(fqn, items.items[k + 1], where));
      }
    }
    return out;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const { throw FormatError(source_ + ": " + what); }

  const PyValue& expect(size_t i, PyKind kind, const std::string& what) const {
    if (vm_.at(i).kind != kind) {
      fail(what + " is a " + py_kind_name(vm_.at(i).kind) + ", expected a " + py_kind_name(kind));
    }
    return vm_.at(i);
  }
  Fields fields_of_dict(const PyValue& st, const std::string& what) const {
    Fields out;
    for (size_t k = 0; k + 1 < st.items.size(); k += 2) {
      out[expect(st.items[k], PyKind::kStr, what + " field name").s] = st.items[k + 1];
    }
    return out;
  }
  // The object's BUILD state as a dict (a missing state: an empty dict).
  Fields fields(size_t obj, const std::string& cls, const std::string& what) const {
    const PyValue& o = expect(obj, PyKind::kObject, what);
    if (o.s != std::string(kMetadataModule) + "." + cls &&
        o.s != "torch.distributed.checkpoint.filesystem." + cls) {
      fail(what + " is a " + o.s + ", expected " + cls);
    }
    if (!o.state) return {};
    return fields_of_dict(expect(*o.state, PyKind::kDict, what + " state"), what);
  }
  size_t field(const Fields& f, const std::string& name, const std::string& what) const {
    auto it = f.find(name);
    if (it == f.end()) fail(what + " has no field '" + name + "'");
    return it->second;
  }
  std::vector<int64_t> ints(size_t i, const std::string& what) const {
    const PyValue& t = vm_.at(i);
    if (t.kind != PyKind::kTuple && t.kind != PyKind::kList) fail(what + " is not a tuple of ints");
    if (t.items.size() > kMaxNdim) fail(what + " has more than " + std::to_string(kMaxNdim) + " dims");
    std::vector<int64_t> out;
    for (size_t e : t.items) out.push_back(expect(e, PyKind::kInt, what).i);
    return out;
  }
  int64_t non_negative(size_t i, const std::string& what) const {
    const int64_t v = expect(i, PyKind::kInt, what).i;
    if (v < 0) fail(what + " is negative (" + std::to_string(v) + ")");
    return v;
  }

  DType dtype_of(size_t properties, const std::string& what) const {
    const PyValue& o = expect(properties, PyKind::kObject, what);
    if (o.s.size() < std::strlen("TensorProperties") ||
        o.s.compare(o.s.size() - std::strlen("TensorProperties"), std::string::npos,
                    "TensorProperties") != 0) {
      fail(what + " is a " + o.s + ", expected TensorProperties");
    }
    if (!o.state) fail(what + " has no state");
    size_t dtype = 0;
    const PyValue& st = vm_.at(*o.state);
    if (st.kind == PyKind::kTuple) {  // torch >= 2.2: (dtype, layout, requires_grad, memory_format, pin_memory)
      if (st.items.empty()) fail(what + " state is an empty tuple");
      dtype = st.items[0];
    } else if (st.kind == PyKind::kDict) {  // older: the dataclass's __dict__
      dtype = field(fields_of_dict(st, what), "dtype", what);
    } else {
      fail(what + " state is a " + py_kind_name(st.kind));
    }
    const std::string& g = expect(dtype, PyKind::kGlobal, what + " dtype").s;
    const std::optional<DType> d = dtype_of_global(g);
    if (!d) fail(what + ": dtype " + g + " is not supported");
    return *d;
  }

  DcpLocation location(size_t info, const std::string& what) const {
    const Fields f = fields(info, "_StorageInfo", what);
    DcpLocation loc;
    loc.file = expect(field(f, "relative_path", what), PyKind::kStr, what + " relative_path").s;
    if (!is_safe_file_name(loc.file)) {
      fail(what + ": data file name '" + loc.file + "' is not a plain file name");
    }
    loc.offset = static_cast<uint64_t>(non_negative(field(f, "offset", what), what + " offset"));
    loc.length = static_cast<uint64_t>(non_negative(field(f, "length", what), what + " length"));
    if (auto t = f.find("transform_descriptors");
        t != f.end() && vm_.at(t->second).kind != PyKind::kNone && !vm_.at(t->second).items.empty()) {
      fail(what + " uses DCP stream transforms (transform_descriptors, e.g. zstd); save without "
                  "them (no _extensions) to read it here");
    }
    return loc;
  }

  StorageIndex storage_index(size_t storage_data) const {
    StorageIndex out;
    const PyValue& storage = expect(storage_data, PyKind::kDict, "storage_data");
    for (size_t k = 0; k + 1 < storage.items.size(); k += 2) {
      const Fields idx = fields(storage.items[k], "MetadataIndex", "a storage_data key");
      const std::string fqn = expect(field(idx, "fqn", "MetadataIndex"), PyKind::kStr, "MetadataIndex fqn").s;
      const std::string what = "storage_data['" + fqn + "']";
      const DcpLocation loc = location(storage.items[k + 1], what);
      auto off = idx.find("offset");
      if (off == idx.end() || vm_.at(off->second).kind == PyKind::kNone) {
        out.bytes[fqn] = loc;
      } else {
        out.tensors[{fqn, ints(off->second, what + " offset")}] = loc;
      }
    }
    return out;
  }

  DcpTensorItem tensor_item(const std::string& fqn, size_t value, const StorageIndex& where) const {
    const std::string what = "item '" + fqn + "'";
    const Fields f = fields(value, "TensorStorageMetadata", what);
    DcpTensorItem t;
    t.fqn = fqn;
    t.dtype = dtype_of(field(f, "properties", what), what + " properties");
    t.shape = ints(field(f, "size", what), what + " size");
    if (!checked_numel(t.shape)) fail(what + " has an invalid size " + shape_to_string(t.shape));
    const PyValue& chunks = expect(field(f, "chunks", what), PyKind::kList, what + " chunks");
    uint64_t covered = 0;
    for (size_t c : chunks.items) {
      t.chunks.push_back(chunk(t, c, where));
      covered += static_cast<uint64_t>(t.chunks.back().box.numel());
    }
    check_disjoint(t.chunks, what);
    if (covered != *checked_numel(t.shape)) {
      fail(what + ": its chunks cover " + std::to_string(covered) + " of " +
           std::to_string(*checked_numel(t.shape)) + " elements");
    }
    return t;
  }

  // One ChunkStorageMetadata of `t`: inside t's shape, with its storage entry.
  DcpChunk chunk(const DcpTensorItem& t, size_t c, const StorageIndex& where) const {
    const std::string what = "item '" + t.fqn + "'";
    const Fields cf = fields(c, "ChunkStorageMetadata", what + " chunk");
    DcpChunk chunk;
    chunk.box.offsets = ints(field(cf, "offsets", what + " chunk"), what + " chunk offsets");
    chunk.box.sizes = ints(field(cf, "sizes", what + " chunk"), what + " chunk sizes");
    if (!box_within_shape(chunk.box, t.shape)) {
      fail(what + ": chunk " + box_to_string(chunk.box) + " lies outside its shape " +
           shape_to_string(t.shape));
    }
    auto loc = where.tensors.find({t.fqn, chunk.box.offsets});
    if (loc == where.tensors.end()) {
      fail(what + ": chunk " + box_to_string(chunk.box) + " has no storage_data entry");
    }
    chunk.location = loc->second;
    return chunk;
  }

  // The dim on which the chunks have the most distinct offsets.
  static size_t sweep_dim(const std::vector<DcpChunk>& chunks) {
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
    return dim;
  }

  // No two chunks overlap. A sweep along sweep_dim: each chunk is compared
  // only with those still open there (one or two for the usual one-dim
  // shardings), so a checkpoint of many thousands of ranks checks in
  // O(n log n).
  void check_disjoint(const std::vector<DcpChunk>& chunks, const std::string& what) const {
    if (chunks.size() < 2 || chunks[0].box.ndim() == 0) {
      if (chunks.size() > 1) fail(what + ": a 0-d tensor with " + std::to_string(chunks.size()) + " chunks");
      return;
    }
    const size_t dim = sweep_dim(chunks);
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

  const PickleVm& vm_;
  const std::string& source_;
};

// ------------------------------------------------------------- the writer

// cls() with a dict state: NEWOBJ, EMPTY_DICT, MARK; the caller writes the
// key/value pairs and end_state() the SETITEMS and BUILD.
void begin_state(PickleWriter& p, const std::string& module, const std::string& cls) {
  p.new_object(module, cls);
  p.op('}');
  p.op('(');
}
void end_state(PickleWriter& p) {
  p.op('u');
  p.op('b');
}

void put_size(PickleWriter& p, const std::vector<int64_t>& dims) {  // torch.Size((d0, d1, ...))
  p.global("torch", "Size");
  p.op('(');
  for (int64_t d : dims) p.integer(d);
  p.op('t');
  p.op(0x85);  // TUPLE1
  p.op('R');
}

void put_storage_info(PickleWriter& p, const DcpLocation& loc) {
  begin_state(p, "torch.distributed.checkpoint.filesystem", "_StorageInfo");
  p.str("relative_path");
  p.str(loc.file);
  p.str("offset");
  p.integer(static_cast<int64_t>(loc.offset));
  p.str("length");
  p.integer(static_cast<int64_t>(loc.length));
  end_state(p);
}

// TensorProperties' 5-tuple state: (dtype, layout, requires_grad, memory_format, pin_memory).
void put_tensor_properties(PickleWriter& p, DType dtype) {
  const std::string m = kMetadataModule;
  p.new_object(m, "TensorProperties");
  p.op('(');
  p.global("torch", dtype_name(dtype));
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
}

void put_tensor_metadata(PickleWriter& p, const DcpTensorItem& t) {
  const std::string m = kMetadataModule;
  begin_state(p, m, "TensorStorageMetadata");
  p.str("properties");
  put_tensor_properties(p, t.dtype);
  p.str("size");
  put_size(p, t.shape);
  p.str("chunks");
  p.op(']');
  for (const DcpChunk& c : t.chunks) {
    begin_state(p, m, "ChunkStorageMetadata");
    p.str("offsets");
    put_size(p, c.box.offsets);
    p.str("sizes");
    put_size(p, c.box.sizes);
    end_state(p);
    p.op('a');
  }
  end_state(p);
}

// Each key's path: "model.<fqn>" -> ("model", "<fqn>"), else (key,).
void put_planner_path(PickleWriter& p, const std::string& fqn) {
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
}

// MetadataIndex(fqn, index[, offset]) -> _StorageInfo; `offsets` null for a bytes item.
void put_storage_entry(PickleWriter& p, const std::string& fqn, std::optional<size_t> index,
                       const std::vector<int64_t>* offsets, const DcpLocation& loc) {
  begin_state(p, kMetadataModule, "MetadataIndex");
  p.str("fqn");
  p.str(fqn);
  p.str("index");
  if (index) {
    p.integer(static_cast<int64_t>(*index));
  } else {
    p.none();
  }
  if (offsets != nullptr) {
    p.str("offset");
    put_size(p, *offsets);
  }
  end_state(p);
  put_storage_info(p, loc);
  p.op('s');
}

}  // namespace

DcpMetadata parse_dcp_metadata(const uint8_t* data, size_t size, const std::string& source) {
  DcpVm vm(data, size, source);
  const size_t root = vm.run();
  return Reader(vm, source).interpret(root);
}

DcpMetadata read_dcp_metadata(Storage& storage, const std::string& dir) {
  const std::string path = join_path(dir, ".metadata");
  const std::vector<uint8_t> bytes = storage.read_file(path, kMaxDcpMetadataBytes);
  return parse_dcp_metadata(bytes.data(), bytes.size(), path);
}

std::vector<uint8_t> write_dcp_metadata(const DcpMetadata& meta) {
  PickleWriter p(PickleWriter::Longs::kEightBytes);
  begin_state(p, kMetadataModule, "Metadata");
  p.str("state_dict_metadata");
  p.op('}');
  for (const DcpTensorItem& t : meta.tensors) {
    p.str(t.fqn);
    put_tensor_metadata(p, t);
    p.op('s');
  }
  for (const DcpBytesItem& b : meta.bytes) {
    p.str(b.fqn);
    p.new_object(kMetadataModule, "BytesStorageMetadata");
    p.op('s');
  }
  p.str("planner_data");
  p.op('}');
  for (const DcpTensorItem& t : meta.tensors) put_planner_path(p, t.fqn);
  for (const DcpBytesItem& b : meta.bytes) put_planner_path(p, b.fqn);
  p.str("storage_data");
  p.op('}');
  for (const DcpTensorItem& t : meta.tensors) {
    for (size_t k = 0; k < t.chunks.size(); ++k) {
      put_storage_entry(p, t.fqn, k, &t.chunks[k].box.offsets, t.chunks[k].location);
    }
  }
  for (const DcpBytesItem& b : meta.bytes) put_storage_entry(p, b.fqn, std::nullopt, nullptr, b.location);
  p.str("storage_meta");
  p.none();
  end_state(p);
  return p.finish();
}

}  // namespace checkpoint
