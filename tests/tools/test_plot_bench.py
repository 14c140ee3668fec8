#!/usr/bin/env python3
"""Tests of scripts/plot-bench (registered in tests/tools/CMakeLists.txt).

  test_plot_bench.py --plot-bench SCRIPT
      The script on benchmark JSON written here, shaped as the benchmarks
      write it (bench/scale_bench.cpp; bench/ckpt_bench.cpp with
      bench/bench_util.cpp's compression rows and bench/cuda_bench.cpp's
      --device cuda output; bench/dcp_compare.py; scripts/gpu-check;
      bench/goodput.py, also without a KIND), on
      docs/data/ac_bench.json, and on bad input (exit 2, one line naming the
      file).

The script runs as a user runs it, through its own #!/usr/bin/python3 line,
in the cases that say so (shebang=True) and where an environment is given;
the others run it as __main__ in a child forked from this process, which
imported matplotlib once (0.6 s a run less): the same code, its own exit
status, stdout and stderr. Nothing is skipped: without matplotlib the PNG cases fail, saying what to
install (scripts/bootstrap.sh installs it).
"""
import json
import os
import runpy
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import unittest

PLOT_BENCH = None
SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AC_JSON = os.path.join(SOURCE_DIR, "docs", "data", "ac_bench.json")
OVERLAP_JSON = os.path.join(SOURCE_DIR, "docs", "data", "fsdp_overlap.json")
OVERLAP_FREE_JSON = os.path.join(SOURCE_DIR, "docs", "data", "fsdp_overlap_free_rounds2.json")
PIPELINE_JSON = os.path.join(SOURCE_DIR, "docs", "data", "pipeline_schedules.json")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# --- bench/scale_bench.cpp: {"benchmark", "rows": [row]}; each role's object
# comes from a forked child (in_child adds "peak_mib"; a failed child is
# {"error"}; when the coordinator fails the row has no other role).

def scale_row(layout, world, shard):
    describe = f"hsdp {world // shard}x{shard}" if layout == "hsdp" else f"{layout} {world}"
    chunks = 873 * (world if layout != "ddp" else 1)
    f = {"fsdp": 1.0, "hsdp": 0.7, "ddp": 0.4}[layout]  # the layouts' curves apart
    return {
        "layout": layout, "world": world, "describe": describe, "items_per_rank": 874,
        "coordinator": {"plan_s": 0.001 * world * f, "metadata_s": 0.0004 * world * f,
                        "received_bytes": 9000 * world, "sent_bytes": 4000 * world,
                        "metadata_bytes": 120 * chunks, "chunks": chunks, "items": 874,
                        "peak_mib": 2.0 + world / 64 * f},
        "rank": {"plan_s": 0.002 * f, "sent_bytes": 20000, "received_bytes": 9000 + world,
                 "assignments": 873, "cached_plan_s": 0.0008, "cached_hit": True,
                 "cached_sent_bytes": 24, "cached_received_bytes": 24, "peak_mib": 1.5},
        "load": {"loading": describe, "rank": world // 2 + 1, "read_s": 0.003,
                 "head_bytes": 50000, "bytes_read": 50000 + 130 * 873, "own_bytes": 120 * 873,
                 "chunks": 873, "ratio": 1.08 * f, "peak_mib": 1.1},
        "load_resharded": {"loading": f"fsdp {world * 3 // 4}", "rank": world * 3 // 8 + 1,
                           "read_s": 0.004, "head_bytes": 50000, "bytes_read": 50000 + 260 * 873,
                           "own_bytes": 240 * 873, "chunks": 1746, "ratio": 1.1, "peak_mib": 1.2},
    }


def scale_json():
    rows = [scale_row(kind, world, {"fsdp": world, "hsdp": 8, "ddp": 1}[kind])
            for kind in ("fsdp", "hsdp", "ddp") for world in (64, 256, 1024)]
    rows.append({"layout": "ddp", "world": 4096, "describe": "ddp 4096", "items_per_rank": 874,
                 "coordinator": {"error": "planning failed: out of memory"}})
    return {"benchmark": "scale_bench", "rows": rows}


# --- bench/bench_util.cpp run_compression_study: one row per variant.

VARIANTS = [("none", 0), ("zstd", 1), ("zstd", 3), ("zstd", 9), ("floatgroup+zstd", 1),
            ("floatgroup+zstd", 3), ("floatgroup+zstd", 9), ("zstd_whole_chunk_1thread", 3)]


def compression_rows(logical, ratio_of, reference_only=False):
    rows = []
    for i, (name, level) in enumerate(VARIANTS):
        if reference_only and not (name == "none" or (level == 3 and name in ("zstd", "floatgroup+zstd"))):
            continue
        ratio = ratio_of(name, level)
        save_s, load_s = 0.2 + 0.02 * i, 0.1 + 0.01 * i
        rows.append({"name": name, "level": level, "stored_bytes": int(logical * ratio),
                     "logical_bytes": logical, "ratio": ratio, "save_s": save_s, "load_s": load_s,
                     "save_cpu_s": 2 * save_s, "load_cpu_s": 2 * load_s,
                     "save_s_trials": [save_s] * 3, "load_s_trials": [load_s] * 3,
                     "threads": 1 if name == "zstd_whole_chunk_1thread" else 4,
                     "save_mb_s_per_thread": logical / 1e6 / (2 * save_s),
                     "load_mb_s": logical / 1e6 / load_s, "tensors": 90, "tile_copies": 4})
    return rows


def ratio_of(name, level):
    return 1.0 if name == "none" else (0.93 - 0.01 * level if name == "zstd" else 0.8 - 0.01 * level)


def compression_only_json(paced=True):
    """ckpt_bench --compression-only --json F: report() on a run without make_state."""
    mb = 64 << 20
    out = {"proc_drop_caches_worked": False,
           "compression": {"trained_fp32": compression_rows(mb, ratio_of),
                           "init_fp32": compression_rows(mb, ratio_of),
                           "trained_bf16": compression_rows(mb // 2, ratio_of)},
           "compression_setup": {"group": "rank 0 alone, on a one-rank checkpoint group"},
           "total_s": 12.0, "state_bytes": 0, "state_bytes_per_rank": 0, "nproc": 1,
           "io_threads": 4, "trials": 1, "torch_threads": 2, "compression_trials": 3, "notes": [],
           "compression_targets": [{"target": "trained_bf16 stored/logical", "value": 0.7, "op": "<=",
                                    "want": 0.72, "pass": True}]}
    if paced:
        out["compression_paced"] = {"device_mb_s": 250.0,
                                    **{s: compression_rows(mb, ratio_of, reference_only=True)
                                       for s in ("trained_fp32", "init_fp32", "trained_bf16")}}
    return out


# --- bench/ckpt_bench.cpp main section: report() writes each sample's median
# under its key, next to what memory_run, time_raw_io, tiers and
# training_overhead set.

def ckpt_main_json():
    out = {"proc_drop_caches_worked": False, "async_blocking_first_s": 0.4, "async_stage_s": 0.2,
           "rss_baseline_bytes": 1.2e9, "peak_extra_host_bytes": 1.1e9, "staging_bytes": 1.07e9,
           "rss_after_5": 2.3e9, "rss_after_20": 2.3e9, "rss_growth_bytes_5_to_20": 0.0,
           "growth_saves": 20, "peak_rss_reset": True, "raw_read_cache_dropped": True,
           "raw_read_resident_fraction_after_drop": 0.0, "overlap_compute_s": 0.4,
           "checkpoint_section_s": 40.0, "tiers_durable_mb_s": 250.0, "tiers_nodes": 1,
           "training": {"step_time_no_ckpt_s": 0.1, "step_time_overlap_s": 0.101,
                        "step_time_no_ckpt_median_s": 0.1, "step_time_overlap_median_s": 0.1,
                        "overlap_step_overhead": 1.01, "steps_per_run": 60, "runs": "A B A B"},
           "total_s": 90.0, "state_bytes": 1 << 30, "state_bytes_per_rank": 1 << 30, "nproc": 1,
           "io_threads": 4, "trials": 1, "torch_threads": 2, "compression_trials": 3,
           "notes": ["raw_write_direct_s: O_DIRECT refused here"],
           "ratios": {"async_blocking_over_sync": 30.0}, "targets": {}}
    samples = {"memcpy_s": 0.25, "raw_write_s": 1.5, "raw_read_s": 0.9, "raw_write_parallel_s": 1.2,
               "raw_write_direct_parallel_s": 1.1, "torch_save_s": 4.0, "torch_load_s": 2.0,
               "sync_save_s": 1.3, "sync_save_direct_s": 1.2, "load_s": 0.8, "reshard_load_s": 1.0,
               "async_blocking_s": 0.0, "async_total_s": 1.5, "overlap_blocking_s": 0.002,
               "overlap_total_s": 1.6, "tiers_sync_single_blocking_s": 4.3,
               "tiers_sync_single_durable_commit_s": 4.3}
    out.update(samples)
    return out


# --- bench/cuda_bench.cpp (ckpt_bench --device cuda), bench/dcp_compare.py,
# scripts/gpu-check.

def cuda_json():
    return {"device": "cuda:0", "state_bytes": 8 << 30, "tensors": 128, "trials": 3,
            "bare_pinned_copy_s": 0.33, "reserve_pinned_s": 1.9, "staging_bytes": 8 << 30,
            "staging_pinned": True, "async_first_blocking_s": 0.36, "async_blocking_s": 0.34,
            "async_save_total_s": 6.1, "async_stage_s_last": 0.33, "overlap_blocking_s": 0.001,
            "overlap_stage_s": 0.34, "sync_save_s": 5.8, "sync_save_direct_s": 4.9,
            "raw_write_parallel_s": 5.5, "raw_write_direct_s": 4.7, "load_to_gpu_s": 3.1,
            "load_exact": True, "async_blocking_over_bare": 1.03,
            "async_first_blocking_over_bare": 1.09, "staging_bandwidth_fraction_of_bare": 0.97,
            "staging_bytes_over_state": 1.0}


def dcp_json():
    return {"torch": "2.5.1+cu124", "errors": {"dcp_async_staging": "ImportError: no StagingOptions"},
            "trials": 3, "state_bytes": 8 << 30, "tensors": 128, "bare_pinned_copy_s": 0.34,
            "dcp_save_s": 11.0, "dcp_async_default_blocking_s": 9.5,
            "dcp_async_default_first_blocking_s": 12.0, "dcp_async_default_total_s": 14.0,
            "dcp_async_pinned_blocking_s": 2.1, "dcp_async_pinned_first_blocking_s": 3.0,
            "dcp_async_pinned_total_s": 12.0, "dcp_load_s": 6.2, "dcp_load_exact": True}


def gpu_check_json(dcp=None):
    return {"tests": {"passed": 12, "failed": 0}, "ours": cuda_json(),
            "dcp": dcp_json() if dcp is None else dcp,
            "targets": [{"target": "load to GPU <= DCP load", "value": 3.1, "limit": 6.2, "met": True}]}


def goodput_json():
    """bench/goodput.py --json's shape: a row per leg, launcher,
    configuration and T."""
    rows = []
    for launcher in ("train", "torchrun"):
        for config, redone in (("default", 22.0), ("fast", 0.5)):
            for t in (30, 60, 120):
                restart = 0.3 if launcher == "train" else 1.2
                rows.append({"leg": "debian12", "launcher": launcher, "config": config, "mtbf_s": float(t),
                             "steps": 6000, "kills": 240 // t, "fault_free_wall_s": 300.0,
                             "wall_s": 300.0 + 240 / t * (restart + 4 + redone * 0.05),
                             "goodput": 300.0 / (300.0 + 240 / t * (restart + 4 + redone * 0.05)),
                             "restart_s": restart, "startup_s": 4.0, "steps_redone": redone,
                             "back_s": restart + 4 + redone * 0.05, "failures": []})
    return {"benchmark": "goodput", "command": "bench/goodput.py --json goodput.json",
            "date": "2026-12-04T23:00:00Z", "steps": 6000, "seed": 71, "cores": 2, "rows": rows}


def run_forked(argv, timeout):
    """argv[0] (a python script) run as __main__ with sys.argv = argv in a
    forked child: a CompletedProcess with its exit status, stdout and
    stderr, as subprocess.run(capture_output=True, text=True) gives."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(out_r)
            os.close(err_r)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", closefd=False)
            sys.argv = list(argv)
            try:
                runpy.run_path(argv[0], run_name="__main__")
                code = 0
            except SystemExit as e:
                if e.code is None or isinstance(e.code, int):
                    code = e.code or 0
                else:
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    os.close(out_w)
    os.close(err_w)
    chunks = {out_r: [], err_r: []}
    sel = selectors.DefaultSelector()
    for fd in chunks:
        sel.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while sel.get_map():
        events = sel.select(max(0.0, deadline - time.monotonic()))
        if not events:
            os.kill(pid, 9)
            break
        for key, _ in events:
            data = os.read(key.fd, 65536)
            if data:
                chunks[key.fd].append(data)
            else:
                sel.unregister(key.fd)
    for fd in chunks:
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    text = {fd: b"".join(c).decode(errors="replace") for fd, c in chunks.items()}
    return subprocess.CompletedProcess(argv, os.waitstatus_to_exitcode(status), text[out_r], text[err_r])


class Case(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="shardkit_plot_bench_")
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def write(self, name, data):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(data if isinstance(data, str) else json.dumps(data, indent=2))
        return path

    def plot(self, *args, env=None, shebang=False):
        if shebang or env is not None:
            return subprocess.run([PLOT_BENCH, *args], capture_output=True, text=True, env=env,
                                  timeout=120)
        return run_forked([PLOT_BENCH, *args], timeout=120)

    def assert_png(self, path, result):
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertNotIn("Traceback", result.stderr)
        with open(path, "rb") as f:
            data = f.read()
        self.assertGreater(len(data), 1000)
        self.assertEqual(data[:8], PNG_SIGNATURE)
        self.assertIn(f"plot-bench: wrote {path}", result.stdout)

    def assert_refused(self, result, path, *fragments):
        """Exit 2, one line `plot-bench: PATH: ...` holding the fragments."""
        self.assertEqual(result.returncode, 2, result.stdout + result.stderr)
        self.assertNotIn("Traceback", result.stderr)
        lines = result.stderr.splitlines()
        self.assertEqual(len(lines), 1, result.stderr)
        self.assertTrue(lines[0].startswith(f"plot-bench: {path}: "), lines[0])
        for fragment in fragments:
            self.assertIn(fragment, lines[0])
        self.assertEqual([f for f in os.listdir(self.dir) if f.endswith(".png")], [])  # nothing written


class PlotBenchDraws(Case):
    def test_scale_curves_over_ranks_default_out(self):
        path = self.write("scale.json", scale_json())
        result = self.plot("scale", path, shebang=True)
        self.assert_png(os.path.join(self.dir, "scale.png"), result)
        self.assertIn("9 rows, 3 layouts, worlds 64-1024", result.stdout)
        self.assertIn("ddp 4096: left out, the benchmark failed there", result.stderr)

    def test_compression_bars_with_paced_device(self):
        path = self.write("comp.json", compression_only_json())
        out = os.path.join(self.dir, "c.png")
        result = self.plot("compression", path, "--out", out)
        self.assert_png(out, result)
        self.assertIn("3 sets x 8 variants, paced device", result.stdout)
        self.assertFalse(os.path.exists(os.path.join(self.dir, "comp.png")))

    def test_compression_without_paced_section(self):
        path = self.write("comp.json", compression_only_json(paced=False))
        result = self.plot("compression", path)
        self.assert_png(os.path.join(self.dir, "comp.png"), result)
        self.assertIn("3 sets x 8 variants", result.stdout)
        self.assertNotIn("paced", result.stdout)

    def test_checkpoint_cpu_main_section_next_to_baselines(self):
        path = self.write("ckpt.json", ckpt_main_json())
        result = self.plot("checkpoint", path)
        self.assert_png(os.path.join(self.dir, "ckpt.png"), result)
        self.assertIn("15 shardkit and baseline times", result.stdout)

    def test_full_ckpt_bench_json_serves_checkpoint_and_compression(self):
        data = ckpt_main_json()
        data.update({k: v for k, v in compression_only_json().items() if k.startswith("compression")})
        path = self.write("all.json", data)
        for kind in ("checkpoint", "compression"):
            out = os.path.join(self.dir, kind + ".png")
            self.assert_png(out, self.plot(kind, path, "--out", out))

    def test_checkpoint_cuda_against_dcp(self):
        path = self.write("ours.json", cuda_json())
        dcp = self.write("dcp.json", dcp_json())
        result = self.plot("checkpoint", path, "--dcp", dcp)
        self.assert_png(os.path.join(self.dir, "ours.png"), result)
        self.assertIn("against DCP", result.stdout)
        self.assertEqual(result.stderr, "")

    def test_checkpoint_gpu_check_json(self):
        path = self.write("gpu-check.json", gpu_check_json())
        result = self.plot("checkpoint", path)
        self.assert_png(os.path.join(self.dir, "gpu-check.png"), result)
        self.assertIn("10 shardkit and baseline times, against DCP", result.stdout)

    def test_gpu_check_without_dcp_result_plots_shardkit_alone(self):
        path = self.write("gpu-check.json", gpu_check_json(dcp={"error": "No such file"}))
        result = self.plot("checkpoint", path)
        self.assert_png(os.path.join(self.dir, "gpu-check.png"), result)
        self.assertNotIn("against DCP", result.stdout)
        self.assertIn('"dcp" holds no result', result.stderr)

    def test_ac_from_docs_data(self):
        out = os.path.join(self.dir, "ac.png")
        result = self.plot("ac", AC_JSON, "--out", out)
        self.assert_png(out, result)
        self.assertIn("none, selective/2, full", result.stdout)

    def test_ac_default_out_beside_the_json(self):
        path = os.path.join(self.dir, "ac_bench.json")
        shutil.copy(AC_JSON, path)
        self.assert_png(os.path.join(self.dir, "ac_bench.png"), self.plot("ac", path))

    def test_overlap_bars_and_measured_timeline_from_docs_data(self):
        out = os.path.join(self.dir, "overlap.png")
        result = self.plot("overlap", OVERLAP_JSON, "--out", out)
        self.assert_png(out, result)
        self.assertIn("fsdp2 fp32", result.stdout)

    def test_overlap_with_the_unlimited_link_from_docs_data(self):
        # --free-link rows (step_s_free_prefetch1) get a fifth bar; rows
        # without it, four.
        out = os.path.join(self.dir, "overlap_free.png")
        result = self.plot("overlap", OVERLAP_FREE_JSON, "--out", out)
        self.assert_png(out, result)
        self.assertIn("hsdp4 bf16 (and each on the unlimited link)", result.stdout)
        result = self.plot("overlap", OVERLAP_JSON, "--out", out)
        self.assert_png(out, result)
        self.assertNotIn("unlimited link", result.stdout)

    def test_overlap_without_timelines(self):
        with open(OVERLAP_JSON) as f:
            data = json.load(f)
        del data["timelines"]
        path = self.write("fsdp_overlap.json", data)
        self.assert_png(os.path.join(self.dir, "fsdp_overlap.png"), self.plot("overlap", path))


    def test_pipeline_bars_and_measured_timeline_from_docs_data(self):
        out = os.path.join(self.dir, "pipeline.png")
        result = self.plot("pipeline", PIPELINE_JSON, "--out", out)
        self.assert_png(out, result)
        self.assertIn("1f1b P2", result.stdout)

    def test_pipeline_without_timeline(self):
        with open(PIPELINE_JSON) as f:
            data = json.load(f)
        del data["timeline"]
        path = self.write("pipeline_schedules.json", data)
        self.assert_png(os.path.join(self.dir, "pipeline_schedules.png"), self.plot("pipeline", path))


    def test_goodput_curves_and_failure_times_kind_from_the_json(self):
        path = self.write("goodput.json", goodput_json())
        result = self.plot(path)  # no KIND: the JSON's "benchmark" names it
        self.assert_png(os.path.join(self.dir, "goodput.png"), result)
        self.assertIn("goodput, debian12 train default", result.stdout)
        self.assertIn("T 30, 60, 120", result.stdout)
        out = os.path.join(self.dir, "g.png")
        self.assert_png(out, self.plot("goodput", path, "--out", out))


class PlotBenchRefuses(Case):
    def test_missing_file(self):
        missing = os.path.join(self.dir, "nope.json")
        result = self.plot("scale", missing)
        self.assert_refused(result, missing, "not found")
        self.assertEqual(result.stderr, f"plot-bench: {missing}: not found\n")

    def test_not_json(self):
        path = self.write("bad.json", '{"rows": [1, 2')
        self.assert_refused(self.plot("scale", path), path, "not JSON")

    def test_not_an_object(self):
        path = self.write("list.json", "[1, 2]")
        self.assert_refused(self.plot("ac", path), path, "not a JSON object")

    def test_ac_json_for_scale(self):
        self.assert_refused(self.plot("scale", AC_JSON), AC_JSON, '"rows"',
                            "it looks like KIND ac's JSON")

    def test_scale_json_for_ac(self):
        path = self.write("scale.json", scale_json())
        self.assert_refused(self.plot("ac", path), path, '"modes"', "KIND scale's JSON")

    def test_compression_only_json_for_checkpoint(self):
        path = self.write("comp.json", compression_only_json())
        self.assert_refused(self.plot("checkpoint", path), path,
                            "none of sync_save_s, async_blocking_s, load_s",
                            "KIND compression's JSON")

    def test_checkpoint_json_for_compression(self):
        path = self.write("ckpt.json", ckpt_main_json())
        self.assert_refused(self.plot("compression", path), path, 'no "compression" object',
                            "KIND checkpoint's JSON")

    def test_dcp_json_as_the_main_json(self):
        path = self.write("dcp.json", dcp_json())
        self.assert_refused(self.plot("checkpoint", path), path, "pass it as --dcp")

    def test_dcp_option_with_another_benchmarks_json(self):
        ours = self.write("ours.json", cuda_json())
        path = self.write("scale.json", scale_json())
        self.assert_refused(self.plot("checkpoint", ours, "--dcp", path), path,
                            "not bench/dcp_compare.py --json output")

    def test_overlap_row_without_comm_and_scale_json_for_overlap(self):
        with open(OVERLAP_JSON) as f:
            data = json.load(f)
        del data["rows"][1]["comm_s"]
        path = self.write("fsdp_overlap.json", data)
        self.assert_refused(self.plot("overlap", path), path, '"rows[1]" lacks comm_s')
        scale = self.write("scale.json", scale_json())
        self.assert_refused(self.plot("overlap", scale), scale, "KIND scale's JSON")

    def test_pipeline_row_without_bubble_and_overlap_json_for_pipeline(self):
        with open(PIPELINE_JSON) as f:
            data = json.load(f)
        del data["rows"][0]["bubble_measured"]
        path = self.write("pipeline_schedules.json", data)
        self.assert_refused(self.plot("pipeline", path), path, '"rows[0]" lacks bubble_measured')
        self.assert_refused(self.plot("pipeline", OVERLAP_JSON), OVERLAP_JSON, "KIND overlap's JSON")

    def test_mode_without_step_time(self):
        with open(AC_JSON) as f:
            data = json.load(f)
        del data["modes"]["full"]["step_time_s"]
        path = self.write("ac.json", data)
        self.assert_refused(self.plot("ac", path), path, '"modes.full" lacks step_time_s')

    def test_scale_rows_all_failed(self):
        path = self.write("scale.json", {"benchmark": "scale_bench", "rows": [
            {"layout": "fsdp", "world": 64, "describe": "fsdp 64", "items_per_rank": 874,
             "coordinator": {"error": "boom"}}]})
        result = self.plot("scale", path)
        self.assertEqual(result.returncode, 2)
        self.assertIn(f"plot-bench: {path}: \"rows\" holds no row", result.stderr)
        self.assertNotIn("Traceback", result.stderr)

    def test_goodput_row_without_goodput_and_scale_json_for_goodput(self):
        data = goodput_json()
        del data["rows"][2]["goodput"]
        path = self.write("goodput.json", data)
        self.assert_refused(self.plot("goodput", path), path, '"rows[2]" lacks goodput')
        scale = self.write("scale.json", scale_json())
        self.assert_refused(self.plot("goodput", scale), scale, "KIND scale's JSON")

    def test_json_without_kind_whose_benchmark_names_none(self):
        self.assert_refused(self.plot(AC_JSON), AC_JSON, "no KIND given")

    def test_unknown_kind_is_a_usage_error(self):
        result = self.plot("speed", AC_JSON, shebang=True)
        self.assertEqual(result.returncode, 2)
        self.assertIn("invalid choice", result.stderr)

    def test_missing_matplotlib_exits_1_saying_what_to_install(self):
        fake = os.path.join(self.dir, "fake", "matplotlib")
        os.makedirs(fake)
        with open(os.path.join(fake, "__init__.py"), "w") as f:
            f.write("raise ImportError('No module named matplotlib')\n")
        env = dict(os.environ, PYTHONPATH=os.path.dirname(fake))
        result = self.plot("ac", AC_JSON, "--out", os.path.join(self.dir, "ac.png"), env=env)
        self.assertEqual(result.returncode, 1)
        self.assertIn("apt install python3-matplotlib", result.stderr)
        self.assertNotIn("Traceback", result.stderr)


def main():
    global PLOT_BENCH
    args = sys.argv[1:]
    if len(args) >= 2 and args[0] == "--plot-bench":
        PLOT_BENCH = os.path.abspath(args[1])
        args = args[2:]
    if PLOT_BENCH is None:
        sys.exit("usage: test_plot_bench.py --plot-bench SCRIPT")
    # The forked runs must use the interpreter the script's #! line names (a
    # user's run does), not whichever python3 comes first on PATH.
    with open(PLOT_BENCH) as f:
        first = f.readline()
    interpreter = first[2:].strip().split()[0] if first.startswith("#!") else sys.executable
    if (os.path.basename(interpreter).startswith("python")
            and os.path.realpath(interpreter) != os.path.realpath(sys.executable)):
        os.execv(interpreter, [interpreter, os.path.abspath(__file__), "--plot-bench", PLOT_BENCH, *args])
    try:  # once, for every forked run (run_forked); its absence fails the PNG cases
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except ImportError:
        pass
    suite = unittest.TestSuite(unittest.defaultTestLoader.loadTestsFromTestCase(c)
                               for c in (PlotBenchDraws, PlotBenchRefuses))
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    sys.exit(0 if result.wasSuccessful() and result.testsRun > 0 else 1)


if __name__ == "__main__":
    main()
