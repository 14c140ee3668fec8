#!/usr/bin/env python3
"""Tests of scripts/check-docs (registered in tests/docs/CMakeLists.txt).

  test_check_docs.py --check-docs SCRIPT --train TRAIN --ckpt CKPT --build-dir DIR

  - the repository's own README.md and docs/ pass (the real check);
  - a small tree written here, with one of each problem the checker exists
    to catch (a missing file, a missing anchor, a config key the schema lacks,
    a binary that is not built, a missing script, a ckpt subcommand and a
    flag that do not exist), fails with one line per problem naming the file
    and line, and passes once they are fixed.

The script runs through its own #!/usr/bin/python3 line, as a user runs it.
"""
import os
import subprocess
import sys
import tempfile
import unittest

ARGS = {}
SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GOOD_README = """\
# Demo

## First steps

See [the guide](docs/guide.md#a-section-with-code-and-punctuation) and [below](#first-steps).
Run `build/train --nproc 2 --config configs/default.yaml --set train.steps=5`.
"""

GOOD_GUIDE = """\
# Guide

## A section with `code`, and punctuation!

`checkpoint.mode` picks the mode; `checkpoint.compression` is a section.
The item `model.blocks.0.attn.qkv.weight` and the file `train.cpp` are not keys.

```
$ build/ckpt verify runs/x/checkpoints/step_10 --json
$ scripts/plot-run runs/x
```
![a picture](../README.md)
"""

BAD_README = GOOD_README + """
A [missing page](docs/nothere.md) and a [missing anchor](docs/guide.md#no-such-heading).
Set `train.stepz` or `--set checkpoint.intervl=5`.
Run `build/no_such_binary` and `scripts/no-such-script`.
"""

BAD_GUIDE = GOOD_GUIDE + """
```
$ build/ckpt frobnicate runs/x
$ build/ckpt list --no-such-flag runs/x
$ build/train --no-such-flag
```
"""

EXPECTED = [
    ("README.md:", "docs/nothere.md does not exist"),
    ("README.md:", "no heading #no-such-heading in docs/guide.md"),
    ("README.md:", "config key train.stepz is not in the schema"),
    ("README.md:", "config key checkpoint.intervl is not in the schema"),
    ("README.md:", "build/no_such_binary is not built"),
    ("README.md:", "scripts/no-such-script does not exist"),
    ("docs/guide.md:", "ckpt frobnicate: not a subcommand of ckpt"),
    ("docs/guide.md:", "ckpt list --no-such-flag: not a flag"),
    ("docs/guide.md:", "train --no-such-flag: not a flag"),
]


def run_check(root):
    return subprocess.run(
        [ARGS["check_docs"], "--root", root, "--train", ARGS["train"], "--ckpt", ARGS["ckpt"],
         "--build-dir", ARGS["build_dir"]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=300)


def write_tree(root, readme, guide):
    os.makedirs(os.path.join(root, "docs"), exist_ok=True)
    os.makedirs(os.path.join(root, "scripts"), exist_ok=True)
    with open(os.path.join(root, "README.md"), "w") as f:
        f.write(readme)
    with open(os.path.join(root, "docs", "guide.md"), "w") as f:
        f.write(guide)
    with open(os.path.join(root, "scripts", "plot-run"), "w") as f:
        f.write("#!/bin/sh\n")


class CheckDocs(unittest.TestCase):
    def test_the_repository_docs_resolve(self):
        out = run_check(SOURCE_DIR)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("resolve", out.stdout)

    def test_each_kind_of_problem_is_reported_with_file_and_line(self):
        with tempfile.TemporaryDirectory() as root:
            write_tree(root, GOOD_README, GOOD_GUIDE)
            out = run_check(root)
            self.assertEqual(out.returncode, 0, out.stdout + out.stderr)

            write_tree(root, BAD_README, BAD_GUIDE)
            out = run_check(root)
            self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
            lines = out.stdout.splitlines()
            for where, what in EXPECTED:
                hits = [l for l in lines if l.startswith(where) and what in l]
                self.assertEqual(len(hits), 1, f"expected one line {where}...{what} in:\n{out.stdout}")
            self.assertEqual(len(lines), len(EXPECTED), out.stdout)
            self.assertIn(f"{len(EXPECTED)} problem(s)", out.stderr)
            self.assertNotIn("Traceback", out.stderr)

    def test_a_train_that_cannot_run_is_one_error(self):
        with tempfile.TemporaryDirectory() as root:
            write_tree(root, GOOD_README, GOOD_GUIDE)
            out = subprocess.run([ARGS["check_docs"], "--root", root, "--train", os.path.join(root, "nope"),
                                  "--ckpt", ARGS["ckpt"]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 universal_newlines=True, timeout=60)
            self.assertEqual(out.returncode, 2, out.stderr)
            self.assertIn("check-docs:", out.stderr)
            self.assertNotIn("Traceback", out.stderr)


def main():
    argv = sys.argv[1:]
    for flag in ("--check-docs", "--train", "--ckpt", "--build-dir"):
        if flag not in argv:
            sys.exit(f"test_check_docs.py: {flag} is required")
        i = argv.index(flag)
        ARGS[flag[2:].replace("-", "_")] = argv[i + 1]
        del argv[i:i + 2]
    unittest.main(argv=[sys.argv[0]] + argv, verbosity=2)


if __name__ == "__main__":
    main()
