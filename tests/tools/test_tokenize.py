#!/usr/bin/python3
"""tokenize against SentencePiece's own spm_encode, then the walk a user takes.

1. Parity: SentencePiece models (BPE and unigram) trained here with Debian's
   spm_train on a corpus of several languages, emoji, code and runs of
   whitespace; `tokenize` writes llm.c and Megatron shards of the corpus as
   JSONL; every document's ids must equal spm_encode's (100%).
2. Bad input: a JSONL line without "text" exits 2 naming the file and line.
3. The walk: tokenize text files; train configs/llama_tiny.yaml on the shards
   with async checkpoints on 2 ranks; kill it (SIGKILL) after a commit;
   resume; generate from the result; export to Hugging Face; generate from
   that directory: the same ids and text.
4. One text file, tokenized without --eval-fraction, trains with
   llama_tiny's data.eval_fraction: the file is one document, so its last
   tokens are held out (whole documents would leave nothing to train on).

Never skipped: spm_train and spm_encode come with Debian's sentencepiece,
which scripts/bootstrap.sh installs; numpy with python3-torch.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

PIECES = [
    "The quick brown fox jumps over the lazy dog.",
    "Grüße aus München: Straße, Äpfel und Öl.",
    "Voilà l'été, où l'on mange des crêpes à Noël.",
    "你好，世界！今天的天气很好。",
    "こんにちは、世界。カタカナとひらがな。",
    "Привет, мир! Как дела?",
    "مرحبا بالعالم",
    "emoji 👋🏽 🎉🎉 ❤️ 👨‍👩‍👧",
    "def square(x):\treturn x ** 2  # squares   it",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "spaces    between\t\twords   and  tabs",
    "numbers 3.14159 2026-11-25 1,000,000 0x7FFF",
    "https://example.org/path?query=value&x=1",
]


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def parent_of(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def read_llmc(path):
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(1024), dtype="<i4")
        assert header[0] == 20240520 and header[1] == 1, header[:3]
        return np.frombuffer(f.read(), dtype="<u2")[: header[2]].astype(np.int64)


def read_megatron(prefix):
    idx = open(prefix + ".idx", "rb").read()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    code = idx[17]
    seqs, docs = (int(v) for v in np.frombuffer(idx[18:34], dtype="<u8"))
    lengths = np.frombuffer(idx[34:34 + 4 * seqs], dtype="<i4")
    dtype = {8: "<u2", 4: "<i4"}[code]
    tokens = np.fromfile(prefix + ".bin", dtype=dtype).astype(np.int64)
    out, at = [], 0
    for n in lengths:
        out.append(list(tokens[at:at + n]))
        at += n
    assert docs == seqs + 1
    return out


def parity(build, work, docs):
    corpus = os.path.join(work, "corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        f.write("\n".join(docs) + "\n")
    jsonl = os.path.join(work, "docs.jsonl")
    with open(jsonl, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d, "id": len(d)}, ensure_ascii=False) + "\n")
    total = 0
    for kind in ("bpe", "unigram"):
        prefix = os.path.join(work, "spm_" + kind)
        r = run(["spm_train", f"--input={corpus}", f"--model_prefix={prefix}", "--vocab_size=400",
                 f"--model_type={kind}", "--character_coverage=1.0", "--byte_fallback=true",
                 "--minloglevel=2"])
        if r.returncode != 0:
            fail("spm_train: " + r.stderr[-2000:])
        model = prefix + ".model"
        ref = run(["spm_encode", f"--model={model}", "--output_format=id"], input=open(corpus, encoding="utf-8").read())
        if ref.returncode != 0:
            fail("spm_encode: " + ref.stderr)
        want = [[int(x) for x in line.split()] for line in ref.stdout.splitlines()]
        assert len(want) == len(docs), (len(want), len(docs))
        eos = 2  # spm_train's default </s>
        for fmt in ("llmc", "megatron"):
            out = os.path.join(work, f"out_{kind}_{fmt}")
            r = run([build + "/tokenize", "--tokenizer", model, "--out", out, "--format", fmt, jsonl])
            if r.returncode != 0:
                fail(f"tokenize {kind} {fmt}: {r.stdout}{r.stderr}")
            if fmt == "llmc":
                stream = list(read_llmc(os.path.join(out, "train_000000.bin")))
                got, cur = [], []
                for t in stream:
                    if t == eos:
                        got.append(cur)
                        cur = []
                    else:
                        cur.append(int(t))
                assert not cur, "tokens after the last end-of-text"
            else:
                got = [[int(t) for t in d[:-1]] for d in read_megatron(os.path.join(out, "train_text_document"))]
            if len(got) != len(want):
                fail(f"{kind} {fmt}: {len(got)} documents, spm_encode gave {len(want)}")
            same = sum(g == w for g, w in zip(got, want))
            for i, (g, w) in enumerate(zip(got, want)):
                if g != w:
                    fail(f"{kind} {fmt}: document {i} {docs[i]!r}: ours {g}, spm_encode {w}")
            n = sum(len(w) for w in want)
            total += n
            print(f"{kind} {fmt}: {same}/{len(want)} documents, {n} tokens identical to spm_encode (100%)")
    return total


def bad_input(build, work):
    bad = os.path.join(work, "bad.jsonl")
    with open(bad, "w") as f:
        f.write('{"text": "fine"}\n{"title": "no text here"}\n')
    r = run([build + "/tokenize", "--tokenizer", "bytes", "--out", os.path.join(work, "bad_out"), bad])
    if r.returncode != 2 or f"tokenize: {bad}:2: no string field \"text\"" not in r.stderr:
        fail(f"bad JSONL: status {r.returncode}, stderr {r.stderr!r}")
    print("bad JSONL: exit 2 naming the file and line")


def walk(build, source, work):
    model = os.path.join(work, "spm_bpe.model")
    texts = [os.path.join(source, "README.md")] + sorted(
        os.path.join(source, "docs", f) for f in os.listdir(os.path.join(source, "docs")) if f.endswith(".md"))
    shards = os.path.join(work, "shards")
    r = run([build + "/tokenize", "--tokenizer", model, "--out", shards, "--eval-fraction", "0.2"] + texts)
    if r.returncode != 0:
        fail("tokenize: " + r.stdout + r.stderr)
    print(r.stdout.strip())
    rundir = os.path.join(work, "run")
    cmd = [build + "/train", "--nproc", "2", "--config", os.path.join(source, "configs", "llama_tiny.yaml"),
           "--set", "run.dir=" + rundir, "--set", "model.vocab_size=400", "--set", "data.kind=tokens",
           "--set", f"data.path={shards}/train_*.bin", "--set", f"data.eval_path={shards}/val_*.bin",
           "--set", "train.steps=40", "--set", "train.log_every=5", "--set", "train.eval_every=20",
           "--set", "checkpoint.interval=10"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    for line in p.stdout:
        seen.append(line)
        if "checkpoint step 10 (async) committed" in line:
            # The whole job dies at once, as in a crash: the launcher and its
            # ranks (each in its own process group; left alone, they would
            # save and exit holding the run directory's lock meanwhile).
            ranks = [int(d) for d in os.listdir("/proc") if d.isdigit() and parent_of(int(d)) == p.pid]
            os.killpg(p.pid, signal.SIGKILL)
            for r in ranks:
                try:
                    os.kill(r, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            deadline = time.time() + 30
            while time.time() < deadline and any(parent_of(r) != -1 and not zombie(r) for r in ranks):
                time.sleep(0.05)
            time.sleep(0.5)  # a zombie's files close with its last thread
            break
    p.wait()
    if not any("committed" in line for line in seen):
        fail("the first run never committed a checkpoint: " + "".join(seen[-20:]))
    print(f"killed the run with SIGKILL after: {seen[-1].strip()}")
    r = run(cmd)
    if r.returncode != 0 or "resumed from" not in r.stdout + r.stderr or "finished at step 40" not in r.stdout:
        fail("resume: " + (r.stdout + r.stderr)[-3000:])
    print([line for line in r.stdout.splitlines() if "resumed from" in line][0])
    ckpt = os.path.join(rundir, "checkpoints", "step_40")
    gen = [build + "/generate", "--tokenizer", model, "--prompt", "The checkpoint", "--max-new-tokens", "16", "--ids"]
    a = run(gen + ["--checkpoint", ckpt])
    if a.returncode != 0:
        fail("generate: " + a.stdout + a.stderr)
    r = run([build + "/ckpt", "export", ckpt, "--format", "hf", "--out", os.path.join(work, "hf"), "--tokenizer", model])
    if r.returncode != 0:
        fail("export: " + r.stdout + r.stderr)
    b = run(gen + ["--checkpoint", os.path.join(work, "hf")])
    if b.returncode != 0:
        fail("generate from the export: " + b.stdout + b.stderr)
    ids_a = json.loads(a.stdout.strip().splitlines()[-1])
    ids_b = json.loads(b.stdout.strip().splitlines()[-1])
    if len(ids_a["ids"]) != 16 or ids_a != ids_b or a.stdout != b.stdout:
        fail(f"generate differs: checkpoint {a.stdout!r}, export {b.stdout!r}")
    print("generate (checkpoint and its Hugging Face export): " + a.stdout.splitlines()[0])
    if open(os.path.join(work, "hf", "tokenizer.model"), "rb").read() != open(model, "rb").read():
        fail("the Hugging Face export does not carry the SentencePiece model given as --tokenizer")


def one_file_then_train(build, source, work):
    """tokenize one file, then train: data.eval_fraction holds out its tail."""
    shards = os.path.join(work, "one_file")
    r = run([build + "/tokenize", "--tokenizer", "bytes", "--out", shards, os.path.join(source, "README.md")])
    if r.returncode != 0:
        fail("tokenize one file: " + r.stdout + r.stderr)
    r = run([build + "/train", "--config", os.path.join(source, "configs", "llama_tiny.yaml"),
             "--set", "run.dir=" + os.path.join(work, "one_file_run"), "--set", "model.vocab_size=256",
             "--set", "data.kind=tokens", "--set", "data.path=" + shards, "--set", "train.steps=2",
             "--set", "train.eval_every=2", "--set", "checkpoint.interval=0"])
    if r.returncode != 0 or "tokens held out" not in r.stdout or "eval step 2 | val_loss" not in r.stdout:
        fail("train on one tokenized file with data.eval_fraction: " + (r.stdout + r.stderr)[-3000:])
    banner = [line for line in r.stdout.splitlines() if "held out" in line][0]
    print("one file tokenized, then trained: " + banner[banner.index("last "):banner.index("; seq_len")])


def text_with_sentencepiece(build, source, work):
    """data.kind text with data.tokenizer a .model: train runs it through tokenize."""
    model = os.path.join(work, "spm_bpe.model")
    r = run([build + "/train", "--config", os.path.join(source, "configs", "llama_tiny.yaml"),
             "--set", "run.dir=" + os.path.join(work, "text_run"), "--set", "model.vocab_size=400",
             "--set", "data.kind=text", "--set", "data.path=" + os.path.join(source, "README.md"),
             "--set", "data.tokenizer=" + model, "--set", "train.steps=2", "--set", "train.log_every=1",
             "--set", "train.sample_every=2", "--set", "train.sample_prompt=The", "--set", "train.sample_tokens=4"])
    if r.returncode != 0 or "tokens of sentencepiece" not in r.stdout or "sample step 2 | The" not in r.stdout:
        fail("data.kind text with a SentencePiece data.tokenizer: " + (r.stdout + r.stderr)[-3000:])
    print("data.kind text with data.tokenizer " + os.path.basename(model) + ": trained 2 steps and sampled")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--source", required=True)
    args = ap.parse_args()
    for tool in ("spm_train", "spm_encode"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            fail(f"{tool} not found: install Debian's sentencepiece (scripts/bootstrap.sh does)")
    docs = [f"{p} ({i})" if i % 3 else p for i in range(4) for p in PIECES]
    with tempfile.TemporaryDirectory(prefix="shardkit_tokenize_") as work:
        parity(os.path.abspath(args.build), work, docs)
        bad_input(os.path.abspath(args.build), work)
        walk(os.path.abspath(args.build), os.path.abspath(args.source), work)
        one_file_then_train(os.path.abspath(args.build), os.path.abspath(args.source), work)
        text_with_sentencepiece(os.path.abspath(args.build), os.path.abspath(args.source), work)
    print("OK")


if __name__ == "__main__":
    main()
