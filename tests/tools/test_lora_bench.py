#!/usr/bin/env python3
"""Tests of bench/lora_finetune.py (registered in tests/tools/CMakeLists.txt).

  test_lora_bench.py --train TRAIN

Runs the benchmark as a user does on a small Llama through the real `train`
(2 ranks) and checks what it reports against what must hold whatever the
machine's speed: the trainable counts (all parameters for the full
fine-tune, exactly the adapters' count for LoRA), the training state and
checkpoint far smaller under LoRA, the bf16 base's parameter shards smaller
than the fp32 base's, every save committed at the chosen step.
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

TRAIN = None
SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(SOURCE_DIR, "bench", "lora_finetune.py")
SMALL = ["--vocab", "64", "--seq-len", "32", "--d-model", "64", "--n-layers", "2", "--n-heads", "4",
         "--n-kv-heads", "2", "--d-ff", "176", "--batch", "4"]


class LoraBench(unittest.TestCase):
    def test_lora_state_and_checkpoint_against_a_full_fine_tune(self):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "r.json")
            p = subprocess.run([BENCH, "--train", TRAIN, "--workdir", d, "--json", out, "--steps", "6",
                                "--interval", "4", "--rank", "4"] + SMALL,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True,
                               timeout=600)
            self.assertEqual(p.returncode, 0, p.stdout)
            self.assertIn("LoRA (rank 4 on q_proj,k_proj,v_proj,o_proj) against full fine-tuning", p.stdout)
            with open(out) as f:
                r = json.load(f)
            v = r["variants"]
            self.assertEqual(set(v), {"full", "lora", "lora-bf16"})
            full, lora, bf16 = v["full"], v["lora"], v["lora-bf16"]
            self.assertEqual(full["trainable"], full["params"])
            # rank 4 on q (64->64), k, v (64->32), o (64->64) in 2 layers: r x (in + out) each
            adapters = 2 * 4 * ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 64))
            self.assertEqual(lora["trainable"], adapters)
            self.assertEqual(lora["params"], full["params"] + adapters)
            for name, x in v.items():
                self.assertIsNotNone(x["blocking_s"], name)
                self.assertGreater(x["step_s"], 0, name)
            self.assertLess(lora["state_mib"], 0.5 * full["state_mib"])
            self.assertLess(lora["ckpt_mib"], 0.2 * full["ckpt_mib"])
            self.assertLess(bf16["sharded_mib"], lora["sharded_mib"])


if __name__ == "__main__":
    if "--train" in sys.argv:
        i = sys.argv.index("--train")
        TRAIN = sys.argv[i + 1]
        del sys.argv[i:i + 2]
    if not TRAIN or not os.path.exists(TRAIN):
        print("FAIL: give --train PATH to a built train binary")
        sys.exit(1)
    unittest.main(verbosity=2)
