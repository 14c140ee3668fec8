#!/usr/bin/python3
"""Pipeline parallelism through the train binary, as a user runs it, with
real processes: PP 2 x FSDP 2 x TP 2 on 8 (`train --nproc 8`) against one
process on the same work (losses within 1e-5 over 6 steps, one run); its
step-3 checkpoint resumes under FSDP 2; a split point that names no block exits 2 with one
line naming the key. one_leg: 8 LibTorch processes on CI's 2 cores take a
while, and nothing here differs between LibTorch versions (the 8-rank case
also runs in-process on both legs: PipelineTraining.With*).

  test_pipeline_cli.py --train build/train --config configs/llama_tiny.yaml
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

ARGS = None


def run(*args):
    p = subprocess.run([ARGS.train, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=900)
    return p.returncode, p.stdout


def losses(run_dir):
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "loss" in rec and "step" in rec:
                out[rec["step"]] = rec["loss"]
    return out


class PipelineCli(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="pp_cli.")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def common(self, name):
        return ["--config", ARGS.config, "--set", f"run.dir={os.path.join(self.dir, name)}",
                "--set", "train.steps=6", "--set", "train.log_every=1", "--set", "train.eval_every=0",
                "--set", "train.micro_batch_size=2", "--set", "train.mixed_precision.param_dtype=fp32",
                "--set", "model.activation_checkpointing=none", "--set", "checkpoint.interval=3"]

    def test_eight_ranks_match_one_process_and_resume_under_fsdp(self):
        code, one = run("--nproc", "1", *self.common("one"))
        self.assertEqual(code, 0, one)
        # One 8-rank run of the 6 steps (a stop at 3 and a resume in this
        # layout are PipelineTraining.ResumesBitExactInItsLayout*'s, in-process
        # on both legs); its step-3 checkpoint resumes under FSDP below.
        code, out = run("--nproc", "8", *self.common("pp"), "--set", "parallel.pipeline=2",
                        "--set", "parallel.shard=2", "--set", "parallel.tensor=2")
        self.assertEqual(code, 0, out)
        self.assertIn("layout pipeline=2 (1f1b, 2 stages, 4 micro-batches) x fsdp+tp replicate=1 shard=2 tensor=2",
                      out)
        ref, got = losses(os.path.join(self.dir, "one")), losses(os.path.join(self.dir, "pp"))
        self.assertEqual(sorted(got), list(range(1, 7)))
        for step, loss in ref.items():
            self.assertAlmostEqual(got[step], loss, delta=1e-5 * abs(loss), msg=f"step {step}")
        # The 8-rank checkpoint of step 3 under FSDP 2 on 2 processes.
        code, out = run("--nproc", "2", *self.common("fsdp"), "--set",
                        f"checkpoint.resume={os.path.join(self.dir, 'pp', 'checkpoints', 'step_3')}")
        self.assertEqual(code, 0, out)
        self.assertIn("saved by 8 ranks, pipeline=2", out)
        fsdp = losses(os.path.join(self.dir, "fsdp"))
        for step in (4, 5, 6):
            self.assertAlmostEqual(fsdp[step], ref[step], delta=1e-5 * abs(ref[step]), msg=f"step {step}")

    def test_a_split_point_that_names_no_block_exits_two_naming_the_key(self):
        code, out = run("--nproc", "2", *self.common("bad"), "--set", "parallel.pipeline=2",
                        "--set", "parallel.pipeline_split_points=model.layers.9")
        self.assertEqual(code, 2, out)
        self.assertIn("parallel.pipeline_split_points: 'model.layers.9' names no block", out)
        self.assertNotIn("Exception raised from", out)
        self.assertEqual(len(out.strip().splitlines()), 1, out)
        self.assertFalse(os.path.exists(os.path.join(self.dir, "bad")))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True)
    parser.add_argument("--config", required=True)
    ARGS, rest = parser.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest)
