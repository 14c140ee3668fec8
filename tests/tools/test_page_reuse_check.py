#!/usr/bin/env python3
"""Tests of bench/page_reuse_check.py (registered in tests/tools/CMakeLists.txt).

  test_page_reuse_check.py --dir DIR

Runs the check as a user does, small (16 MiB, no pause), in DIR (the build
directory: a file system that takes O_DIRECT), and checks what it reports
against its own rounds: every round has all five timings, the medians and
ratios follow from them, the table prints each, the balloon's reporting
flag matches sysfs, it leaves no file behind, and bad arguments and a
missing directory are one-line errors.
"""
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import unittest

DIR = None
SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECK = os.path.join(SOURCE_DIR, "bench", "page_reuse_check.py")
KEYS = ["anon_long_ago_s", "anon_just_freed_s", "cache_long_ago_s", "cache_just_freed_s", "direct_s"]


def run(*args):
    return subprocess.run([CHECK] + list(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=300)


class PageReuseCheck(unittest.TestCase):
    def test_each_round_times_every_way_and_the_medians_follow_from_the_rounds(self):
        with tempfile.TemporaryDirectory(dir=DIR) as d:
            out = os.path.join(d, "r.json")
            p = run("--dir", d, "--mib", "16", "--rounds", "3", "--pause", "0", "--threads", "2", "--json", out)
            self.assertEqual(p.returncode, 0, p.stdout)
            self.assertEqual(os.listdir(d), ["r.json"], "the check left its scratch file")
            with open(out) as f:
                r = json.load(f)
            self.assertEqual((r["mib"], r["threads"], r["pause_s"], len(r["rounds"])), (16, 2, 0.0, 3))
            for x in r["rounds"]:
                self.assertEqual(sorted(x), sorted(KEYS))
                self.assertTrue(all(x[k] > 0 for k in KEYS), x)
            for k in KEYS:
                self.assertEqual(r["medians"][k], statistics.median(x[k] for x in r["rounds"]), k)
            m = r["medians"]
            self.assertEqual(r["cache_long_ago_over_just_freed"],
                             round(m["cache_long_ago_s"] / m["cache_just_freed_s"], 2))
            self.assertEqual(r["cache_just_freed_over_direct"], round(m["cache_just_freed_s"] / m["direct_s"], 2))
            for label in ("page-cache write + fsync, 2 threads, memory freed long ago",
                          "page-cache write + fsync, 2 threads, memory just freed", "O_DIRECT write + fsync, 2 threads"):
                self.assertIn(label, p.stdout)
            # What sysfs says of the balloon (None where there is no virtio balloon).
            balloons = [dev for dev in glob.glob("/sys/bus/virtio/devices/*")
                        if open(os.path.join(dev, "device")).read().strip() == "0x0005"]
            if not balloons:
                self.assertIsNone(r["free_page_reporting"])
            else:
                bits = open(os.path.join(balloons[0], "features")).read().strip()
                self.assertEqual(r["free_page_reporting"], bits[5] == "1")

    def test_a_missing_directory_and_bad_sizes_are_one_line_errors(self):
        with tempfile.TemporaryDirectory(dir=DIR) as d:
            missing = os.path.join(d, "no", "such")
            p = run("--dir", missing, "--mib", "16", "--rounds", "1", "--pause", "0")
            self.assertEqual(p.returncode, 2, p.stdout)
            self.assertEqual(p.stdout, "page_reuse_check: %s: not a directory\n" % missing)
            for bad in (["--mib", "12"], ["--rounds", "0"], ["--pause", "-1"], ["--threads", "0"]):
                p = run("--dir", d, *bad)
                self.assertEqual(p.returncode, 2, (bad, p.stdout))
                self.assertEqual(len(p.stdout.splitlines()), 1, (bad, p.stdout))
                self.assertIn("need --mib a multiple of 8", p.stdout)
            self.assertEqual(os.listdir(d), [])


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--dir" not in args:
        sys.exit("usage: test_page_reuse_check.py --dir DIR [unittest args]")
    i = args.index("--dir")
    DIR = os.path.abspath(args[i + 1])
    del args[i:i + 2]
    unittest.main(argv=[sys.argv[0]] + args, verbosity=2)
