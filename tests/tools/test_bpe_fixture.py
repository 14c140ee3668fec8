#!/usr/bin/python3
"""tokenizer.json on both legs, without node: the recorded fixture.

tests/tools/data/bpe_fixture.json holds two small byte-level BPE
tokenizer.json files learnt from the parity corpus (one with Llama 3's Split
regex and ignore_merges, one with GPT-2's ByteLevel regex and
add_prefix_space) and the ids Tokenizers.js gives for every document of that
corpus (several languages, emoji, code, whitespace, seeded random strings,
special tokens in text). tools.TokenizerJsonMatchesJavaScript checks, where
node runs, that the file is still what Tokenizers.js gives (and rewrites it
with --write-fixture). Here `tokenize --encode` must give the same ids: the
check that runs on the Debian 13 leg too, whose PCRE2 (10.45, newer Unicode
tables) differs from Debian 12's (10.42). Never skipped.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--source", required=True)
    args = ap.parse_args()
    tokenize = os.path.join(os.path.abspath(args.build), "tokenize")
    fx = json.load(open(os.path.join(args.source, "tests", "tools", "data", "bpe_fixture.json"), encoding="utf-8"))
    with tempfile.TemporaryDirectory(prefix="shardkit_bpe_fixture_") as work:
        for name, tok in fx["tokenizers"].items():
            path = os.path.join(work, name + ".json")
            json.dump(tok, open(path, "w", encoding="utf-8"), ensure_ascii=False)
            n = 0
            for doc, want in zip(fx["documents"], fx["ids"][name]):
                r = subprocess.run([tokenize, "--tokenizer", path, "--encode"], input=doc.encode(),
                                   capture_output=True)
                got = json.loads(r.stdout) if r.returncode == 0 else r.stderr.decode()
                if got != want:
                    print(f"FAIL: {name}: {doc!r}: ours {got}, Tokenizers.js {want}")
                    sys.exit(1)
                n += len(want)
            print(f"{name}: {len(fx['documents'])}/{len(fx['documents'])} documents, {n} ids identical to the "
                  "recorded Tokenizers.js ids (100%)")
    print("OK")


if __name__ == "__main__":
    main()
