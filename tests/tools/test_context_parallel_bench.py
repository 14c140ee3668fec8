#!/usr/bin/env python3
"""Tests of bench/context_parallel.py (registered in tests/tools/CMakeLists.txt).

  test_context_parallel_bench.py --train TRAIN

Runs the benchmark as a user does through the real `train`, small: the base
length searched by doubling from 256 tokens under a memory budget that a
tiny llama reaches within a few doublings, then context 2 at twice that
length with and without the head-tail load balance. Checks what must hold
whatever the machine's speed: the search stopped at the first length that
did not fit and took the one before; the rows' lengths, degrees and tokens
per rank; every rank's peak RSS; the wait share in (0, 1); each rank's
attention seconds; the slowest over the fastest at least 1; the table; and
that a bad --contexts or an --seq-len that does not split is refused with
exit 2 before any job.
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

TRAIN = None
SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(SOURCE_DIR, "bench", "context_parallel.py")


def bench(*args, timeout=600):
    return subprocess.run([BENCH, "--train", TRAIN] + list(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=timeout)


class ContextParallelBench(unittest.TestCase):
    def test_search_then_context_two_with_and_without_balance(self):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "r.json")
            # A budget of 270 MiB per rank: this llama's rank holds about 230
            # at 256 tokens and 300 at 1024 (LibTorch itself about 220), so
            # the search ends after a few doublings, on memory, which the
            # machine's speed does not move; the step limit stays out of it.
            p = bench("--workdir", os.path.join(d, "runs"), "--json-out", out, "--contexts", "2",
                      "--min-seq-len", "256", "--max-step-s", "60", "--budget-mib", "270", "--steps", "4",
                      "--d-model", "32", "--n-layers", "1", "--n-heads", "4", "--n-kv-heads", "2", "--d-ff", "64")
            self.assertEqual(p.returncode, 0, p.stdout)
            self.assertIn("| seq_len | context | balance |", p.stdout)
            self.assertIn("load balance at context 2: slowest/fastest rank's attention compute", p.stdout)
            with open(out) as f:
                r = json.load(f)
        self.assertEqual(r["kind"], "context_parallel")
        search = r["search"]
        self.assertTrue(r["base_seq_len_searched"])
        self.assertGreaterEqual(len(search), 2, search)
        self.assertTrue(all(s["fits"] for s in search[:-1]), search)
        self.assertFalse(search[-1]["fits"], search)
        self.assertEqual([s["seq_len"] for s in search], [256 * 2 ** i for i in range(len(search))])
        base = r["base_seq_len"]
        self.assertEqual(base, search[-2]["seq_len"])
        rows = r["rows"]
        self.assertEqual([(x["seq_len"], x["context"], x["load_balance"]) for x in rows],
                         [(base, 1, None), (2 * base, 2, "head_tail"), (2 * base, 2, "none")])
        for row in rows:
            self.assertEqual(row["tokens_per_rank"], base, row)
            self.assertEqual(len(row["peak_rss_mib"]), row["context"], row)
            self.assertTrue(all(m > 0 for m in row["peak_rss_mib"]), row)
            self.assertGreater(row["step_s"], 0, row)
        for row in rows[1:]:
            self.assertEqual(len(row["attention_s"]), 2, row)
            self.assertTrue(all(a > 0 for a in row["attention_s"]), row)
            self.assertTrue(all(0 < c <= a for c, a in zip(row["compute_s"], row["attention_s"])), row)
            self.assertGreater(row["wait_share"], 0, row)
            self.assertLess(row["wait_share"], 1, row)
            self.assertGreaterEqual(row["imbalance"], 1, row)
        self.assertEqual(len(r["load_balance"]), 1)
        self.assertEqual(r["load_balance"][0]["context"], 2)

    def test_bad_arguments_exit_2_before_any_job(self):
        p = bench("--contexts", "1")
        self.assertEqual(p.returncode, 2, p.stdout)
        self.assertIn("--contexts must name degrees of 2 or more", p.stdout)
        p = bench("--contexts", "2,4", "--seq-len", "100")
        self.assertEqual(p.returncode, 2, p.stdout)
        self.assertIn("--seq-len must be a multiple of 2 x the largest context degree (8)", p.stdout)


def main():
    global TRAIN
    args = sys.argv[1:]
    if len(args) != 2 or args[0] != "--train":
        print("usage: test_context_parallel_bench.py --train TRAIN", file=sys.stderr)
        return 2
    TRAIN = args[1]
    result = unittest.TextTestRunner(verbosity=2).run(unittest.defaultTestLoader.loadTestsFromTestCase(
        ContextParallelBench))
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
