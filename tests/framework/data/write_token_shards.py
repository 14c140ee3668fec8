#!/usr/bin/env python3
"""Writes token shards the way their reference writers do, for the tests.

- llm.c: dev/data/data_common.py's write_datafile: a header of 256 int32
  (magic, version, token count), then the tokens; "gpt-2" is magic 20240520,
  version 1, uint16; "llama-3" is magic 20240801, version 7, uint32.
- Megatron-LM: megatron/core/datasets/indexed_dataset.py's _IndexWriter:
  b"MMIDIDX\\x00\\x00", <Q version 1, <B dtype code, <Q sequence count,
  <Q document count, int32 lengths, int64 byte pointers, int64 document
  indices; the .bin holds the sequences back to back.

usage: write_token_shards.py OUT_DIR SEED

Writes into OUT_DIR:
  llmc_000.bin, llmc_001.bin   gpt-2 layout, 3 documents each
  llama3_000.bin               llama-3 layout (uint32 ids above 65535)
  mega_text_document.{bin,idx} Megatron, int32, one sequence per document
  mega16.{bin,idx}             Megatron, uint16, 2 sequences per document
and, for each .bin, NAME.expected: the tokens as little-endian int64, and
NAME.docs: the token index of each document start, as int64.
"""
import os
import struct
import sys

import numpy as np

GPT2 = {"magic": 20240520, "version": 1, "dtype": np.uint16}
LLAMA3 = {"magic": 20240801, "version": 7, "dtype": np.uint32}
DTYPE_CODE = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.uint16: 8}


def write_llmc(path, docs, info):
    toks = np.concatenate(docs).astype(info["dtype"])
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = info["magic"], info["version"], len(toks)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(toks.tobytes())
    starts = [0]  # an llm.c shard carries no document index: one document
    return toks, starts


def write_megatron(prefix, docs, dtype, seqs_per_doc=1):
    sequences, doc_idx = [], [0]
    for d in docs:
        parts = np.array_split(d, seqs_per_doc)
        sequences.extend(parts)
        doc_idx.append(len(sequences))
    lengths = [len(s) for s in sequences]
    itemsize = np.dtype(dtype).itemsize
    pointers, at = [], 0
    for n in lengths:
        pointers.append(at)
        at += n * itemsize
    with open(prefix + ".bin", "wb") as f:
        for s in sequences:
            f.write(np.asarray(s, dtype=dtype).tobytes(order="C"))
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", DTYPE_CODE[dtype]))
        f.write(struct.pack("<Q", len(sequences)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(np.array(lengths, dtype=np.int32).tobytes(order="C"))
        f.write(np.array(pointers, dtype=np.int64).tobytes(order="C"))
        f.write(np.array(doc_idx, dtype=np.int64).tobytes(order="C"))
    toks = np.concatenate(docs).astype(dtype)
    starts = list(np.cumsum([0] + [len(d) for d in docs[:-1]]))
    return toks, starts


def main():
    out, seed = sys.argv[1], int(sys.argv[2])
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(seed)

    def docs(n, vocab, lo=20, hi=90):
        return [rng.integers(0, vocab, size=int(rng.integers(lo, hi))) for _ in range(n)]

    written = {
        "llmc_000.bin": write_llmc(os.path.join(out, "llmc_000.bin"), docs(3, 50257), GPT2),
        "llmc_001.bin": write_llmc(os.path.join(out, "llmc_001.bin"), docs(3, 50257), GPT2),
        "llama3_000.bin": write_llmc(os.path.join(out, "llama3_000.bin"), docs(2, 128256), LLAMA3),
        "mega_text_document.bin": write_megatron(os.path.join(out, "mega_text_document"),
                                                 docs(7, 32000), np.int32),
        "mega16.bin": write_megatron(os.path.join(out, "mega16"), docs(5, 50257), np.uint16, 2),
    }
    for name, (toks, starts) in written.items():
        stem = os.path.join(out, name[:-4])
        toks.astype("<i8").tofile(stem + ".expected")
        np.array(starts, dtype="<i8").tofile(stem + ".docs")


if __name__ == "__main__":
    main()
