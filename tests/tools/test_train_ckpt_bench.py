#!/usr/bin/env python3
"""Tests of bench/train_ckpt_bench.py (registered in tests/tools/CMakeLists.txt).

  test_train_ckpt_bench.py --train TRAIN

Runs the benchmark as a user does (its own #!/usr/bin/python3 line) on the CPU
with a small Llama, through the real `train`, and checks what it reports:
every mode ran and committed its save at the chosen step, the iteration
windows hold the right steps, the ratios are finite and positive, the
parameter count matches the one `train` prints, and a failing `train` is an
error that names the command.
"""
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import unittest

TRAIN = None
SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(SOURCE_DIR, "bench", "train_ckpt_bench.py")
SMALL = ["--vocab", "64", "--seq-len", "32", "--d-model", "64", "--n-layers", "2", "--n-heads", "4",
         "--n-kv-heads", "2", "--d-ff", "176", "--batch", "2"]


class TrainCkptBench(unittest.TestCase):
    def run_bench(self, workdir, *extra):
        return subprocess.run([BENCH, "--train", TRAIN, "--device", "cpu", "--workdir", workdir] + SMALL
                              + list(extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              universal_newlines=True, timeout=600)

    def test_every_mode_saves_at_the_interval_and_is_compared_step_for_step(self):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "r.json")
            p = self.run_bench(d, "--interval", "5", "--steps", "9", "--json", out,
                               "--modes", "none,async,overlap,overlap-chunked")
            self.assertEqual(p.returncode, 0, p.stdout)
            with open(out) as f:
                r = json.load(f)
            self.assertEqual((r["steps"], r["interval"], r["tokens_per_step"]), (9, 5, 64))
            self.assertEqual(sorted(r["modes"]), ["async", "overlap", "overlap-chunked"])
            for mode, m in r["modes"].items():
                self.assertTrue(m["committed"], mode)
                self.assertGreater(m["bytes"], 0, mode)
                self.assertGreaterEqual(m["blocking_s"], 0, mode)
                self.assertEqual(m["around_save_iterations"], 4, mode)  # 6..9
                self.assertEqual(m["before_save_iterations"], 3, mode)  # 3..5
                for key in ("save_iteration_over_none", "around_save_over_none", "before_save_over_none"):
                    self.assertTrue(math.isfinite(m[key]) and m[key] > 0, (mode, key, m[key]))
            self.assertIn(r["target_met"], (True, False))
            self.assertGreater(r["baseline_iteration_s"], 0)
            # The bench's parameter count is the one train reports.
            with open(os.path.join(d, "none.log")) as f:
                log = f.read()
            m = re.search(r"model llama (\d+) params", log)
            self.assertIsNotNone(m, log[-2000:])
            self.assertEqual(r["n_params"], int(m.group(1)))
            self.assertIn("around = iterations 6..9", p.stdout)
            # overlap-chunked sets checkpoint.device_snapshot: off.
            with open(os.path.join(d, "overlap-chunked.log")) as f:
                self.assertIn("checkpoint.device_snapshot=off", f.read())

    def test_a_failing_train_is_an_error_naming_the_command(self):
        with tempfile.TemporaryDirectory() as d:
            p = self.run_bench(d, "--interval", "4", "--modes", "none", "--set", "optim.lr=-1")
            self.assertNotEqual(p.returncode, 0, p.stdout)
            self.assertIn("train failed", p.stdout)
            self.assertIn("optim.lr", p.stdout)


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--train" not in args:
        sys.exit("usage: test_train_ckpt_bench.py --train TRAIN [unittest args]")
    i = args.index("--train")
    TRAIN = os.path.abspath(args[i + 1])
    del args[i:i + 2]
    unittest.main(argv=[sys.argv[0]] + args, verbosity=2)
