#!/usr/bin/env python3
"""Tests of bench/moe.py (registered in tests/tools/CMakeLists.txt).

  test_moe_bench.py --train TRAIN

Runs the benchmark as a user does on a small llama through the real `train`
(worlds 1 and 2, a few steps) and checks what it reports against what must
hold whatever the machine's speed: the dense and MoE models' active
parameters differ by the routers' weights alone, every world has both
sides' tokens/s and each rank's peak RSS, world 2 also has the MoE with
expert parallelism 2 (its row, its tokens/s and peak RSS per rank, and
the all-to-all's seconds and share of the step, in (0, 1), in the row and
in the top-level all_to_all), world 1 has no expert layout (null), every
routing variant's max/mean per MoE layer lies in [1, E / K], and the
auxiliary loss is reported only where it is on. Which expert layouts a
world gets (EP 4 and EP 2 x FSDP 2 at world 4) is checked on the
bench's function without running them, to keep the test fast.
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
sys.path.insert(0, os.path.join(SOURCE_DIR, "bench"))
import moe as moe_bench  # noqa: E402
SMALL = ["--seq-len", "32", "--d-model", "64", "--n-layers", "3", "--n-heads", "4", "--n-kv-heads", "2",
         "--experts", "4", "--top-k", "2", "--expert-ff", "32", "--shared", "1", "--first-dense", "1",
         "--per-rank-batch", "2"]


class MoeBench(unittest.TestCase):
    def test_expert_layouts_of_each_world(self):
        degrees = ["world", 2]  # the default, --expert-degrees world,2
        self.assertEqual(moe_bench.expert_layouts(1, degrees, 8), ([], []))
        self.assertEqual(moe_bench.expert_layouts(2, degrees, 8), ([(2, 1)], []))
        self.assertEqual(moe_bench.expert_layouts(4, degrees, 8), ([(4, 1), (2, 2)], []))
        self.assertEqual(moe_bench.expert_layouts(8, degrees, 8), ([(8, 1), (2, 4)], []))
        # 4 does not divide 6 experts: left out, and said so.
        self.assertEqual(moe_bench.expert_layouts(4, degrees, 6), ([(2, 2)], [4]))
        self.assertEqual(moe_bench.expert_layouts(3, degrees, 8), ([], [3]))
        self.assertEqual([moe_bench.layout_key(4, 1), moe_bench.layout_key(2, 2)], ["ep4", "ep2xfsdp2"])
        self.assertEqual(moe_bench.layout_label(2, 2), "EP 2 x FSDP 2")

    def test_moe_against_dense_and_the_balance_variants(self):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "r.json")
            p = subprocess.run([BENCH, "--train", TRAIN, "--workdir", os.path.join(d, "runs"), "--json-out", out,
                                "--worlds", "1,2", "--steps", "4", "--rounds", "1", "--balance-steps", "8",
                                "--balance-warmup", "2", "--balance-rates", "0.01"] + SMALL,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True,
                               timeout=600)
            self.assertEqual(p.returncode, 0, p.stdout)
            self.assertIn("all-to-all share of the step: rank 0's", p.stdout)
            self.assertIn("| 2 | EP 2 | ", p.stdout)
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
                sides = [row["dense"], row["moe"]] + list(row["moe_ep"].values())
                for side in sides:
                    self.assertGreater(side["tokens_per_s"], 0)
                    self.assertEqual(len(side["peak_rss_mib"]), row["world"])
                    self.assertIsNone(side["peak_gpu_mib"])
                self.assertGreater(row["moe_over_dense"]["tokens_per_s"], 0)
                self.assertNotIn("all_to_all_share", row["moe"])
            w1, w2 = r["rows"]
            self.assertEqual(w1["moe_ep"], {})
            self.assertIsNone(w1["all_to_all_share"])
            self.assertIsNone(w1["all_to_all_s"])
            self.assertEqual(list(w2["moe_ep"]), ["ep2"])
            ep2 = w2["moe_ep"]["ep2"]
            self.assertEqual((ep2["layout"], ep2["expert"], ep2["expert_shard"]), ("EP 2", 2, 1))
            self.assertGreater(ep2["moe_over_dense"]["tokens_per_s"], 0)
            self.assertGreater(ep2["over_moe_fsdp"]["tokens_per_s"], 0)
            self.assertEqual(list(w2["all_to_all_share"]), ["ep2"])
            share, secs = w2["all_to_all_share"]["ep2"], w2["all_to_all_s"]["ep2"]
            self.assertGreater(share, 0)
            self.assertLess(share, 1)
            self.assertGreater(secs, 0)
            self.assertLess(secs, ep2["step_s"])
            a2a = r["all_to_all"]
            self.assertEqual(a2a["share_of_step"], {"ep2": share})
            self.assertEqual(a2a["seconds"], {"ep2": secs})
            self.assertEqual([(x["layout"], x["world"], x["expert"], x["expert_shard"]) for x in a2a["layouts"]],
                             [("ep2", 2, 2, 1)])
            self.assertEqual(a2a["measured_on"], "rank 0")
            self.assertEqual(r["skipped_expert_layouts"], [])
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
