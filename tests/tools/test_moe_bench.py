#!/usr/bin/env python3
"""Tests of bench/moe.py (registered in tests/tools/CMakeLists.txt).

  test_moe_bench.py --train TRAIN

Runs the benchmark as a user does on a small llama through the real `train`
(worlds 1 and 2, a few steps) and checks what it reports against what must
hold whatever the machine's speed: the dense and MoE models' active
parameters differ by the routers' weights alone, every world has both
sides' tokens/s and each rank's peak RSS, every routing variant's max/mean
per MoE layer lies in [1, E / K], the auxiliary loss is reported only
where it is on, and the all-to-all is left unmeasured (null, with the
reason) instead of a number.
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

TRAIN = None
SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(SOURCE_DIR, "bench", "moe.py")
SMALL = ["--seq-len", "32", "--d-model", "64", "--n-layers", "3", "--n-heads", "4", "--n-kv-heads", "2",
         "--experts", "4", "--top-k", "2", "--expert-ff", "32", "--shared", "1", "--first-dense", "1",
         "--per-rank-batch", "2"]


class MoeBench(unittest.TestCase):
    def test_moe_against_dense_and_the_balance_variants(self):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "r.json")
            p = subprocess.run([BENCH, "--train", TRAIN, "--workdir", os.path.join(d, "runs"), "--json-out", out,
                                "--worlds", "1,2", "--steps", "4", "--rounds", "1", "--balance-steps", "8",
                                "--balance-warmup", "2", "--balance-rates", "0.01"] + SMALL,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True,
                               timeout=600)
            self.assertEqual(p.returncode, 0, p.stdout)
            self.assertIn("all-to-all share of the step: not measured: no expert parallelism yet", p.stdout)
            with open(out) as f:
                r = json.load(f)
            self.assertEqual(r["dense_d_ff"], (2 + 1) * 32)
            dense, moe = r["params"]["dense"], r["params"]["moe"]
            self.assertEqual(dense["params"], dense["active_params"])
            # 2 MoE blocks (the first is dense): their routers, 4 x 64 each.
            self.assertEqual(moe["active_params"] - dense["active_params"], 2 * 4 * 64)
            self.assertGreater(moe["params"], moe["active_params"])
            self.assertEqual([row["world"] for row in r["rows"]], [1, 2])
            for row in r["rows"]:
                for side in ("dense", "moe"):
                    self.assertGreater(row[side]["tokens_per_s"], 0)
                    self.assertEqual(len(row[side]["peak_rss_mib"]), row["world"])
                    self.assertIsNone(row[side]["peak_gpu_mib"])
                self.assertIsNone(row["all_to_all_share"])
                self.assertGreater(row["moe_over_dense"]["tokens_per_s"], 0)
            self.assertIsNone(r["all_to_all"]["share_of_step"])
            self.assertIn("no expert parallelism", r["all_to_all"]["note"])
            variants = r["balance"]["variants"]
            self.assertEqual([v["variant"] for v in variants], ["none", "bias=0.01", "aux=0.01"])
            for v in variants:
                self.assertEqual(v["moe_layers"], 2)
                self.assertEqual(v["steps"], 8)
                for span in ("first", "after_warmup", "last_quarter"):
                    for x in v[span]["per_layer"]:
                        self.assertGreaterEqual(x, 1.0 - 1e-9, v["variant"])
                        self.assertLessEqual(x, 4 / 2 + 1e-9, v["variant"])
                # Each step's loads: every token's 2 choices, over the global batch.
                for loads in v["last_step_expert_load"]:
                    self.assertEqual(sum(loads), 2 * 2 * 32)
            self.assertIsNone(variants[0]["aux_loss_after_warmup"])
            self.assertIsNotNone(variants[2]["aux_loss_after_warmup"])
            self.assertEqual(variants[0]["vs_none"], 1.0)


if __name__ == "__main__":
    if "--train" in sys.argv:
        i = sys.argv.index("--train")
        TRAIN = sys.argv[i + 1]
        del sys.argv[i:i + 2]
    if not TRAIN or not os.path.exists(TRAIN):
        print("FAIL: give --train PATH to a built train binary")
        sys.exit(1)
    unittest.main(verbosity=2)
