#!/usr/bin/env bash
# Regenerates the seed corpora of fuzz_token_shard and fuzz_sft_jsonl
# (fuzz/corpus/<target>/): token shards written by our `tokenize` (llm.c and
# Megatron formats, the bytes tokenizer and the learnt_split tokenizer of
# tests/tools/data/bpe_fixture.json), packed the way fuzz_token_shard.cpp
# reads its input, and instruction JSONL records in both of data.kind sft's
# shapes (docs/finetune.md), behind fuzz_sft_jsonl.cpp's selector byte.
#
#   fuzz/make_data_seeds.sh [TOKENIZE=build/tokenize]
set -euo pipefail
cd "$(dirname "$0")/.."
tokenize=${1:-build/tokenize}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 - "$work/bpe.json" <<'PY'
import json, sys
fixture = json.load(open("tests/tools/data/bpe_fixture.json"))
json.dump(fixture["tokenizers"]["learnt_split"], open(sys.argv[1], "w"))
PY
cat >"$work/docs.jsonl" <<'TXT'
{"text": "The quick brown fox jumps over the lazy dog."}
{"text": "Sharded checkpoints: every rank writes its own shards."}
{"text": "caf\u00e9 na\u00efve 123 'll\n\nend"}
TXT
shard=fuzz/corpus/fuzz_token_shard
sft=fuzz/corpus/fuzz_sft_jsonl
# (overwrites its seeds; regression_* inputs, kept from findings, stay)
mkdir -p "$shard" "$sft"
for tok in bytes "$work/bpe.json"; do
  name=$([ "$tok" = bytes ] && echo bytes || echo bpe)
  "$tokenize" --tokenizer "$tok" --out "$work/llmc_$name" --format llmc --threads 1 "$work/docs.jsonl" >/dev/null 2>&1
  "$tokenize" --tokenizer "$tok" --out "$work/meg_$name" --format megatron --threads 1 "$work/docs.jsonl" >/dev/null 2>&1
  # byte 0 even: an llm.c .bin; odd: the .idx's length (4 bytes LE), the .idx, the .bin.
  { printf '\x00'; cat "$work/llmc_$name/train_000000.bin"; } >"$shard/llmc_$name"
  python3 - "$work/meg_$name/train_text_document" "$shard/megatron_$name" <<'PY'
import struct, sys
prefix, out = sys.argv[1], sys.argv[2]
idx = open(prefix + ".idx", "rb").read()
binary = open(prefix + ".bin", "rb").read()
open(out, "wb").write(b"\x01" + struct.pack("<I", len(idx)) + idx + binary)
PY
done
# byte 0: bits 0-5 seq_len - 1, bit 6 packed, bit 7 the bytes tokenizer.
records='{"prompt": "What is 2 + 2?", "completion": " 4"}
{"prompt": "Name a colour.", "completion": " Blue, like the sky."}

{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  What is the time?\n"}, {"role": "assistant", "content": "It is late."}]}
{"messages": [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Because the sun set."}, {"role": "tool", "content": "{}"}, {"role": "ipython", "content": "x"}]}'
{ printf '\x5f'; printf '%s\n' "$records"; } >"$sft/mixed_packed_64"
{ printf '\x0f'; printf '%s\n' "$records"; } >"$sft/mixed_unpacked_16"
{ printf '\xc7'; printf '%s\n' "$records" | head -2; } >"$sft/prompt_completion_bytes_8"
{ printf '\x7f'; printf '%s\n' "$records" | tail -2; } >"$sft/messages_packed_64"
echo "make_data_seeds: $(ls "$shard" | wc -l) token shard seeds, $(ls "$sft" | wc -l) sft seeds"
