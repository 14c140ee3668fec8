#!/usr/bin/env python3
"""Tests of scripts/plot-run (registered in tests/tools/CMakeLists.txt).

  test_plot_run.py --plot-run SCRIPT
      The script on metrics.jsonl files written here (segments, resumes, eval
      and checkpoint records, a truncated last line, bad input) and, imported
      as a module, its choice of what to plot (last_run).
  test_plot_run.py --plot-run SCRIPT --train TRAIN
      Trains 20 steps on 2 ranks with the train binary and plots the run.

The script runs through its own #!/usr/bin/python3 line, as a user runs it.
Nothing is skipped: without matplotlib the PNG cases fail, saying what to
install (scripts/bootstrap.sh installs it).
"""
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import unittest

PLOT_RUN = None
TRAIN = None
SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def step(n, loss, **extra):
    return {"step": n, "loss": loss, "lr": 1e-3, "tokens_per_s": 1000.0 + n,
            "step_time_s": 0.1, "grad_norm": 1.0, **extra}


def checkpoint(n, ok=True):
    return {"event": "checkpoint", "step": n, "mode": "async", "blocking_s": 0.001,
            "stage_s": 0.001, "write_s": 0.02, "commit_s": 0.003, "bytes": 100,
            "stored_bytes": 100, "ok": ok, "path": f"ck/step_{n}"}


def start(n, resumed_from=None):
    return {"event": "start", "step": n, "resumed_from": resumed_from, "world": 2,
            "layout": "fsdp", "time": "2025-01-01T00:00:00Z"}


def load_plot_run():
    sys.dont_write_bytecode = True  # no scripts/__pycache__ in the source tree
    loader = importlib.machinery.SourceFileLoader("plot_run", PLOT_RUN)
    spec = importlib.util.spec_from_loader("plot_run", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


class Case(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="shardkit_plot_run_")
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def write_metrics(self, records, tail=""):
        with open(os.path.join(self.dir, "metrics.jsonl"), "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
            f.write(tail)

    def plot(self, *args, env=None):
        return subprocess.run([PLOT_RUN, *args], capture_output=True, text=True, env=env,
                              timeout=120)

    def assert_png(self, path, result):
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertNotIn("Traceback", result.stderr)
        with open(path, "rb") as f:
            data = f.read()
        self.assertGreater(len(data), 1000)
        self.assertEqual(data[:8], PNG_SIGNATURE)


class PlotRunOnWrittenMetrics(Case):
    def test_segments_resume_eval_and_truncated_last_line_make_a_png(self):
        old = [start(0)] + [step(n, 9.0) for n in range(1, 41)]
        new = [start(0)] + [step(n, 3.0 - 0.1 * n) for n in range(1, 21)]
        new += [checkpoint(5, ok=False), checkpoint(10), {"event": "eval", "step": 10, "val_loss": 2.5, "val_tokens": 64}]
        new += [{"event": "something_new", "step": 12}, checkpoint(20)]
        resumed = [{"event": "resume_skipped", "path": "ck/step_20", "moved_to": "x", "error": "e"},
                   start(10, "ck/step_10"),
                   {"event": "restart", "step": 10, "restart": 1, "lost_s": 4.0, "redone_steps": 10,
                    "redone_s": 2.0, "goodput": 0.5}]
        resumed += [step(n, 2.0 - 0.05 * n, time="t", wall_s=1.0, peak_rss_mib=12.5)
                    for n in range(11, 31)]
        resumed += [{"event": "eval", "step": 30, "val_loss": 0.9, "val_tokens": 64}]
        self.write_metrics(old + new + resumed, tail='{"step": 31, "loss": 0.')
        result = self.plot(self.dir)
        self.assert_png(os.path.join(self.dir, "run.png"), result)
        self.assertIn("steps 1-30, 1 resume (step 10), 2 checkpoints (1 failed), 2 evals, "
                      "1 failure: 4.0 s lost, 10 steps redone, goodput 0.500 (restarted from step 10)",
                      result.stdout)
        self.assertIn("skipped the last line", result.stderr)

    def test_out_names_the_png(self):
        self.write_metrics([step(1, 3.0), step(2, 2.0)])
        out = os.path.join(self.dir, "sub.png")
        result = self.plot(self.dir, "--out", out)
        self.assert_png(out, result)
        self.assertFalse(os.path.exists(os.path.join(self.dir, "run.png")))

    def test_missing_run_dir_exits_2_naming_it(self):
        missing = os.path.join(self.dir, "nope")
        result = self.plot(missing)
        self.assertEqual(result.returncode, 2)
        self.assertEqual(result.stderr, f"plot-run: {missing}: no such run directory\n")

    def test_missing_metrics_exits_2_naming_the_file(self):
        result = self.plot(self.dir)
        self.assertEqual(result.returncode, 2)
        self.assertIn("metrics.jsonl: not found", result.stderr)
        self.assertEqual(len(result.stderr.splitlines()), 1, result.stderr)

    def test_no_step_records_exits_2(self):
        self.write_metrics([start(0), checkpoint(5)], tail="{tru")
        result = self.plot(self.dir)
        self.assertEqual(result.returncode, 2)
        self.assertIn("no step records to plot", result.stderr)
        self.assertNotIn("Traceback", result.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.dir, "run.png")))

    def test_missing_matplotlib_exits_1_saying_what_to_install(self):
        self.write_metrics([step(1, 3.0)])
        fake = os.path.join(self.dir, "fake", "matplotlib")
        os.makedirs(fake)
        with open(os.path.join(fake, "__init__.py"), "w") as f:
            f.write("raise ImportError('No module named matplotlib')\n")
        env = dict(os.environ, PYTHONPATH=os.path.dirname(fake))
        result = self.plot(self.dir, env=env)
        self.assertEqual(result.returncode, 1)
        self.assertIn("apt install python3-matplotlib", result.stderr)
        self.assertNotIn("Traceback", result.stderr)


class LastRunSelection(unittest.TestCase):
    """What is plotted: last_run() on records, no files."""

    def setUp(self):
        self.m = load_plot_run()

    def test_last_fresh_start_drops_the_runs_before_it(self):
        run = self.m.last_run([start(0), step(1, 9.0), step(50, 9.0), start(0), step(1, 3.0),
                               step(5, 2.0)])
        self.assertEqual(sorted(run.steps), [1, 5])
        self.assertEqual(run.resumes, [])

    def test_resume_marks_its_step_and_supersedes_the_steps_after_it(self):
        run = self.m.last_run([start(0), step(1, 3.0), step(7, 2.0), checkpoint(5), step(8, 2.0),
                               start(5, "ck/step_5"), step(6, 1.0), step(7, 1.5)])
        self.assertEqual(sorted(run.steps), [1, 6, 7])
        self.assertEqual(run.steps[7]["loss"], 1.5)
        self.assertEqual(run.resumes, [5])

    def test_restart_records_mark_failures_with_the_time_lost(self):
        restart = {"event": "restart", "step": 5, "restart": 1, "lost_s": 12.5, "redone_steps": 3,
                   "redone_s": 1.5, "goodput": 0.75}
        run = self.m.last_run([start(0), step(1, 3.0), checkpoint(5), step(8, 2.0),
                               start(5, "ck/step_5"), restart, step(6, 1.0)])
        self.assertEqual([r["step"] for r in run.restarts], [5])
        self.assertEqual(run.resumes, [5])
        self.assertEqual(self.m.lost_text(run), "1 failure: 12.5 s lost, 3 steps redone, goodput 0.750")
        self.assertIn("1 failure: 12.5 s lost, 3 steps redone, goodput 0.750 (restarted from step 5)",
                      self.m.summary(run))
        fresh = self.m.last_run([start(0), step(1, 3.0)])
        self.assertEqual(fresh.restarts, [])
        self.assertNotIn("failure", self.m.summary(fresh))

    def test_without_start_records_a_backward_step_starts_a_new_run(self):
        run = self.m.last_run([step(1, 9.0), step(40, 9.0), step(1, 3.0), step(10, 2.0)])
        self.assertEqual(sorted(run.steps), [1, 10])

    def test_without_start_records_one_past_a_committed_checkpoint_is_a_resume(self):
        run = self.m.last_run([step(1, 3.0), checkpoint(5), step(10, 2.0), step(6, 2.5),
                               step(12, 1.0)])
        self.assertEqual(sorted(run.steps), [1, 6, 12])
        self.assertEqual(run.resumes, [5])

    def test_one_past_a_failed_checkpoint_is_a_new_run(self):
        run = self.m.last_run([step(1, 3.0), checkpoint(5, ok=False), step(10, 2.0), step(6, 2.5)])
        self.assertEqual(sorted(run.steps), [6])


class Timeline(Case):
    """timeline(): each rank's checkpoint_events/rank<r>.jsonl, for the plotted run."""

    def setUp(self):
        super().setUp()
        self.m = load_plot_run()

    def write_rank(self, rank, records):
        os.makedirs(os.path.join(self.dir, "checkpoint_events"), exist_ok=True)
        with open(os.path.join(self.dir, "checkpoint_events", f"rank{rank}.jsonl"), "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")

    def test_phases_per_rank_and_the_last_save_of_a_step_counts(self):
        def ev(rank, step, t0, write_t0):
            return {"step": step, "rank": rank, "mode": "async", "ok": True, "started_unix_s": t0,
                    "blocking_s": 0.1, "stage_s": 0.05, "write_started_unix_s": write_t0,
                    "write_s": 0.5, "commit_s": 0.2}
        # Rank 0 saved step 10 twice (the second after a resume); step 99
        # is not a checkpoint of the plotted run.
        self.write_rank(0, [ev(0, 5, 100.0, 100.2), ev(0, 10, 110.0, 110.1), ev(0, 99, 1.0, 1.0),
                            ev(0, 10, 200.0, 200.3)])
        self.write_rank(1, [ev(1, 5, 100.01, 100.25), ev(1, 10, 200.02, 200.3)])
        run = self.m.last_run([start(0), step(1, 3.0), checkpoint(5), checkpoint(10), step(10, 2.0)])
        rows = self.m.timeline(self.dir, run)
        self.assertEqual(sorted(rows), [0, 1])
        zero = {(phase, step): (a, b) for phase, a, b, step in rows[0]}
        self.assertEqual(sorted({s for _, s in zero}), [5, 10])
        self.assertEqual(zero[("blocking", 10)], (200.0, 200.1))
        self.assertAlmostEqual(zero[("write", 10)][0], 200.3)
        self.assertAlmostEqual(zero[("commit", 10)][0], 200.8)
        self.assertAlmostEqual(zero[("commit", 10)][1], 201.0)
        self.assertEqual(zero[("stage", 5)], (100.0, 100.05))
        self.write_metrics([start(0), step(1, 3.0, time="1970-01-01T00:01:40.500Z"), checkpoint(5),
                            checkpoint(10), step(10, 2.0)])
        result = self.plot(self.dir)
        self.assert_png(os.path.join(self.dir, "timeline.png"), result)
        self.assertIn("timeline.png: 2 ranks, 2 checkpoints", result.stdout)

    def test_no_rank_files_no_timeline(self):
        self.write_metrics([step(1, 3.0), step(2, 2.0)])
        result = self.plot(self.dir)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertNotIn("timeline", result.stdout)
        self.assertFalse(os.path.exists(os.path.join(self.dir, "timeline.png")))


class PlotRunOnATrainedRun(Case):
    def test_twenty_steps_on_two_ranks_plot(self):
        self.assertIsNotNone(TRAIN, "--train TRAIN is required for this case")
        run_dir = os.path.join(self.dir, "run")
        train = subprocess.run(
            [TRAIN, "--config", os.path.join(SOURCE_DIR, "configs", "default.yaml"),
             "--nproc", "2", "--set", f"run.dir={run_dir}", "--set", "train.steps=20",
             "--set", "train.log_every=2", "--set", "checkpoint.interval=5",
             "--set", "checkpoint.mode=async"],
            capture_output=True, text=True, timeout=300)
        self.assertEqual(train.returncode, 0, train.stdout + train.stderr)
        result = self.plot(run_dir)
        self.assert_png(os.path.join(run_dir, "run.png"), result)
        self.assertIn("steps 1-20", result.stdout)
        self.assertIn("4 checkpoints", result.stdout)
        # Every rank recorded its own saves: the timeline has both.
        self.assert_png(os.path.join(run_dir, "timeline.png"), result)
        self.assertIn("timeline.png: 2 ranks, 4 checkpoints", result.stdout)
        rows = load_plot_run().timeline(run_dir, load_plot_run().last_run(
            load_plot_run().read_records(os.path.join(run_dir, "metrics.jsonl"))))
        for rank in (0, 1):
            phases = {phase for phase, _, _, _ in rows[rank]}
            self.assertEqual(phases, {"blocking", "stage", "write", "commit"}, rank)
            for phase, a, b, _ in rows[rank]:
                self.assertLessEqual(a, b, (rank, phase))


def main():
    global PLOT_RUN, TRAIN
    args = sys.argv[1:]
    while args and args[0] in ("--plot-run", "--train"):
        value = os.path.abspath(args[1])
        if args[0] == "--plot-run":
            PLOT_RUN = value
        else:
            TRAIN = value
        args = args[2:]
    if PLOT_RUN is None:
        sys.exit("usage: test_plot_run.py --plot-run SCRIPT [--train TRAIN]")
    classes = [PlotRunOnATrainedRun] if TRAIN else [PlotRunOnWrittenMetrics, LastRunSelection, Timeline]
    suite = unittest.TestSuite(unittest.defaultTestLoader.loadTestsFromTestCase(c)
                               for c in classes)
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    sys.exit(0 if result.wasSuccessful() and result.testsRun > 0 else 1)


if __name__ == "__main__":
    main()
