#!/usr/bin/env python3
"""Tests of bench/direct_io_probe_check.py (registered in tests/tools/CMakeLists.txt).

  test_direct_io_probe_check.py --dir DIR

Runs the check as a user does, small (8 MiB probes, 16 MiB writes), in DIR
(the build directory: a file system that takes O_DIRECT), and checks what it
reports against its own timings: every round has both ways' times for each
probe and the write, each "way" is the faster of its pair (a tie keeps the
page cache), the agreement counts are the rounds where they match, it leaves
no file behind, and bad arguments and a missing directory are one-line errors.
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

DIR = None
SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECK = os.path.join(SOURCE_DIR, "bench", "direct_io_probe_check.py")


def run(*args):
    return subprocess.run([CHECK] + list(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=300)


class DirectIoProbeCheck(unittest.TestCase):
    def test_each_round_reports_both_ways_and_the_counts_follow_from_them(self):
        with tempfile.TemporaryDirectory(dir=DIR) as d:
            out = os.path.join(d, "r.json")
            p = run("--dir", d, "--rounds", "2", "--size-mb", "16", "--probe-mb", "8", "--threads", "2",
                    "--json", out)
            self.assertEqual(p.returncode, 0, p.stdout)
            self.assertEqual(os.listdir(d), ["r.json"], "the check left its scratch file")
            with open(out) as f:
                r = json.load(f)
            self.assertEqual((r["probe_mb"], r["size_mb"], r["threads"], len(r["rounds"])), (8, 16, 2, 2))
            way = lambda s: "O_DIRECT" if s[1] < s[0] else "page cache"  # noqa: E731
            for x in r["rounds"]:
                for key in ("probe_1_thread", "probe_threads"):
                    self.assertEqual(len(x[key + "_s"]), 2)
                    self.assertTrue(all(t > 0 for t in x[key + "_s"]), x)
                    self.assertEqual(x[key + "_way"], way(x[key + "_s"]), x)
                self.assertTrue(all(t > 0 for t in x["write_s"]), x)
                self.assertEqual(x["faster_way"], way(x["write_s"]), x)
            self.assertEqual(r["agree_1_thread"],
                             sum(x["probe_1_thread_way"] == x["faster_way"] for x in r["rounds"]))
            self.assertEqual(r["agree_threads"], sum(x["probe_threads_way"] == x["faster_way"] for x in r["rounds"]))
            self.assertIn("the probe chose the faster way in %d of 2 rounds by 1 thread, %d of 2 by 2 threads"
                          % (r["agree_1_thread"], r["agree_threads"]), p.stdout)

    def test_a_missing_directory_and_bad_counts_are_one_line_errors(self):
        with tempfile.TemporaryDirectory(dir=DIR) as d:
            missing = os.path.join(d, "no", "such")
            p = run("--dir", missing, "--rounds", "1", "--size-mb", "8", "--probe-mb", "8")
            self.assertNotEqual(p.returncode, 0)
            self.assertTrue(p.stdout.startswith("direct_io_probe_check: %s: " % missing), p.stdout)
            self.assertNotIn("Traceback", p.stdout)
            p = run("--dir", d, "--rounds", "0")
            self.assertNotEqual(p.returncode, 0)
            self.assertIn("--rounds, --size-mb, --probe-mb and --threads must be >= 1", p.stdout)
            self.assertNotIn("Traceback", p.stdout)


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--dir" not in args:
        sys.exit("usage: test_direct_io_probe_check.py --dir DIR [unittest args]")
    i = args.index("--dir")
    DIR = os.path.abspath(args[i + 1])
    del args[i:i + 2]
    unittest.main(argv=[sys.argv[0]] + args, verbosity=2)
