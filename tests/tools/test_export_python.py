#!/usr/bin/env python3
"""Python side of test_interop (tests/checkpoint/test_interop.cpp).

Runs with a Python that has torch (Debian's python3-torch at /usr/bin/python3);
the C++ test skips, saying so, when there is none.

  test_export_python.py check-export EXPECTED_DIR KIND:FILE...
      EXPECTED_DIR/manifest.json maps tensor name -> {"dtype": "F32"|..., "shape": [...],
      "file": "<n>.bin"}, the raw little-endian bytes the C++ test wrote from its
      own tensors. KIND is torch, safetensors (dtypes kept) or torch-bf16,
      safetensors-bf16 (exported with --dtype bf16: float tensors are expected as
      torch's own .to(torch.bfloat16) of the originals). torch files are loaded
      with torch.load(f, weights_only=True); safetensors files are parsed here
      with struct + json + torch.frombuffer. Every tensor must match bit for bit.

  test_export_python.py write-torch-saves OUT_DIR
      Writes torch.save files the C++ side imports: plain.pt (a plain dict of
      every dtype, a 0-d, an empty and a storage-offset view), ordered.pt (a
      module's state_dict(): an OrderedDict with _metadata), single.pt (a
      one-entry dict), params.pt (nn.Parameters), noncontig.pt (a transposed
      tensor, which must be refused), and OUT_DIR/expected/<file>/manifest.json
      with the raw bytes of every tensor.
"""
import collections
import json
import os
import struct
import sys

import torch

DTYPES = {
    torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
BY_NAME = {v: k for k, v in DTYPES.items()}
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def raw_bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def from_raw(data, dtype, shape):
    if len(data) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


def load_expected(expected_dir):
    with open(os.path.join(expected_dir, "manifest.json")) as f:
        manifest = json.load(f)
    out = {}
    for name, entry in manifest.items():
        with open(os.path.join(expected_dir, entry["file"]), "rb") as f:
            out[name] = from_raw(f.read(), BY_NAME[entry["dtype"]], entry["shape"])
    return out


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    assert n % 8 == 0, f"header length {n} is not a multiple of 8"
    header = json.loads(data[8:8 + n])
    assert header["__metadata__"]["format"] == "pt", header["__metadata__"]
    body = data[8 + n:]
    out, end = {}, 0
    for name, e in header.items():
        if name == "__metadata__":
            continue
        begin, stop = e["data_offsets"]
        assert 0 <= begin <= stop <= len(body), (name, e)
        out[name] = from_raw(body[begin:stop], BY_NAME[e["dtype"]], e["shape"])
        end = max(end, stop)
    assert end == len(body), f"{len(body) - end} trailing bytes"
    return out


def check_export(expected_dir, specs):
    expected = load_expected(expected_dir)
    failures = []
    for spec in specs:
        kind, path = spec.split(":", 1)
        if kind.startswith("torch"):
            got = torch.load(path, weights_only=True)
            if type(got) is not dict:
                failures.append(f"{path}: torch.load gave {type(got)}, not dict")
                continue
        else:
            got = read_safetensors(path)
        if sorted(got) != sorted(expected):
            failures.append(f"{path}: names {sorted(got)} != {sorted(expected)}")
            continue
        for name, want in expected.items():
            if kind.endswith("-bf16") and want.dtype in FLOATS:
                want = want.to(torch.bfloat16)
            t = got[name]
            if t.dtype != want.dtype or list(t.shape) != list(want.shape):
                failures.append(f"{path}: {name}: {t.dtype} {list(t.shape)}, "
                                f"expected {want.dtype} {list(want.shape)}")
            elif kind.endswith("-bf16") and t.is_floating_point():
                # A NaN matches any NaN: torch's own conversion gives 0xFFFF
                # (vectorized) or 0x7FC0 (scalar); export writes 0x7FC0.
                same = (t.view(torch.int16) == want.view(torch.int16)) | (t.isnan() & want.isnan())
                if not bool(same.all()):
                    failures.append(f"{path}: {name}: values differ")
            elif raw_bytes(t) != raw_bytes(want):
                failures.append(f"{path}: {name}: values differ")
        print(f"checked {path} ({kind}): {len(expected)} tensors")
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


def write_expected(out_dir, file_name, tensors):
    d = os.path.join(out_dir, "expected", file_name)
    os.makedirs(d, exist_ok=True)
    manifest = {}
    for i, (name, t) in enumerate(tensors.items()):
        manifest[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "file": f"{i}.bin"}
        with open(os.path.join(d, f"{i}.bin"), "wb") as f:
            f.write(raw_bytes(t))
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def write_torch_saves(out_dir):
    torch.manual_seed(7)
    os.makedirs(out_dir, exist_ok=True)
    base = torch.arange(12, dtype=torch.float32).reshape(4, 3) * 0.5
    plain = {
        "w": torch.randn(5, 3),
        "b16": torch.randn(7).to(torch.bfloat16),
        "h": torch.randn(2, 2).half(),
        "d64": torch.randn(3, dtype=torch.float64),
        "i64": torch.arange(6).reshape(2, 3) * -3,
        "i32": torch.arange(4, dtype=torch.int32),
        "i16": torch.arange(4, dtype=torch.int16),
        "i8": torch.arange(-2, 2, dtype=torch.int8),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "base": base,
        "offset_view": base[1:],  # shares base's storage at offset 3
    }
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    files = {
        "plain.pt": plain,
        "ordered.pt": module.state_dict(),
        "single.pt": {"only": torch.randn(3, 2)},
        "params.pt": dict(module.named_parameters()),
    }
    for name, obj in files.items():
        torch.save(obj, os.path.join(out_dir, name))
        write_expected(out_dir, name, collections.OrderedDict(obj))
    assert isinstance(files["ordered.pt"], collections.OrderedDict)
    torch.save({"t": torch.randn(3, 4).t()}, os.path.join(out_dir, "noncontig.pt"))
    print(f"wrote {len(files) + 1} files to {out_dir}")
    return 0


def main(argv):
    if len(argv) >= 3 and argv[1] == "check-export":
        return check_export(argv[2], argv[3:])
    if len(argv) == 3 and argv[1] == "write-torch-saves":
        return write_torch_saves(argv[2])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
