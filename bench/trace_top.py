#!/usr/bin/python3
"""Where a training step's time goes, from a Chrome trace of LibTorch's
profiler (Kineto): llama_ref --profile-trace FILE, or torch.profiler's
export_chrome_trace.

  bench/trace_top.py TRACE [--steps N] [--top 20] [--json FILE]

Prints three tables, per step (N: the trace's shardkit::step scopes, else
--steps, else 1):
  - the top kernels by GPU time (kernels, memcpy and memset), with calls,
    milliseconds per step and share of all GPU time;
  - the step's phases (the shardkit::* scopes the trainer marks: forward,
    step_stats, backward, finish_gradients, optimizer, fsdp_gather,
    fsdp_reduce): CPU wall time, and the GPU time of the kernels each launched
    (a kernel belongs to the innermost scope open when the CPU launched it,
    matched by Kineto's correlation id);
  - host syncs: CUDA runtime calls that wait for the GPU (stream, device and
    event synchronise, blocking memcpy), and GPU idle time within the steps.
On a CPU-only trace the kernel table lists CPU operators by self time instead.
"""

import argparse
import bisect
import collections
import json
import sys

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaStreamWaitEvent")


def load(path):
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def union_length(intervals):
    total, end = 0.0, None
    start = None
    for a, b in sorted(intervals):
        if end is None or a > end:
            if end is not None:
                total += end - start
            start, end = a, b
        else:
            end = max(end, b)
    if end is not None:
        total += end - start
    return total


def analyse(events, steps_hint=None, top=20):
    scopes = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("shardkit::")]
    step_scopes = [e for e in scopes if e["name"] == "shardkit::step"]
    phase_scopes = sorted((e for e in scopes if e["name"] != "shardkit::step"), key=lambda e: e["ts"])
    steps = len(step_scopes) or steps_hint or 1
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    report = {"steps": steps}
    if step_scopes:
        report["step_wall_ms"] = sum(e["dur"] for e in step_scopes) / 1000.0 / steps
        window = (min(e["ts"] for e in step_scopes), max(e["ts"] + e["dur"] for e in step_scopes))
    else:
        window = None

    # Kernels (or, without a GPU, CPU operators by self time).
    by_name = collections.defaultdict(lambda: [0, 0.0])
    if gpu:
        total_gpu = sum(e["dur"] for e in gpu)
        for e in gpu:
            by_name[e["name"]][0] += 1
            by_name[e["name"]][1] += e["dur"]
        report["gpu_time_ms"] = total_gpu / 1000.0 / steps
        if window:
            busy = union_length([(e["ts"], e["ts"] + e["dur"]) for e in gpu
                                 if e["ts"] >= window[0] and e["ts"] <= window[1]])
            report["gpu_busy_ms"] = busy / 1000.0 / steps
            report["gpu_idle_ms"] = report["step_wall_ms"] - report["gpu_busy_ms"]
        kind = "kernel"
    else:
        ops = [e for e in events if e.get("cat") == "cpu_op"]
        total_gpu = 0.0
        # self time: own duration less that of the ops nested directly inside (same thread)
        per_tid = collections.defaultdict(list)
        for e in ops:
            per_tid[e.get("tid")].append(e)
        for tid_ops in per_tid.values():
            tid_ops.sort(key=lambda e: (e["ts"], -e["dur"]))
            stack = []
            selfs = {}
            for e in tid_ops:
                while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                    stack.pop()
                if stack:
                    selfs[id(stack[-1])] = selfs.get(id(stack[-1]), stack[-1]["dur"]) - e["dur"]
                selfs.setdefault(id(e), e["dur"])
                stack.append(e)
            for e in tid_ops:
                by_name[e["name"]][0] += 1
                by_name[e["name"]][1] += max(0.0, selfs[id(e)])
                total_gpu += max(0.0, selfs[id(e)])
        kind = "cpu operator (self time)"
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    report["top"] = [{"name": n, "calls_per_step": c / steps, "ms_per_step": t / 1000.0 / steps,
                      "share": t / total_gpu if total_gpu else 0.0} for n, (c, t) in rows]
    report["top_kind"] = kind

    # Phases: CPU wall per scope name; GPU time of the kernels each launched.
    phases = collections.OrderedDict()
    for e in phase_scopes:
        p = phases.setdefault(e["name"], {"cpu_ms": 0.0, "gpu_ms": 0.0, "count": 0})
        p["cpu_ms"] += e["dur"] / 1000.0 / steps
        p["count"] += 1
    if gpu and phase_scopes:
        launch_ts = {}
        for e in runtime:
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                launch_ts[corr] = e["ts"]
        starts = [e["ts"] for e in phase_scopes]
        unattributed = 0.0
        for k in gpu:
            corr = k.get("args", {}).get("correlation")
            ts = launch_ts.get(corr)
            owner = None
            if ts is not None:
                # innermost scope containing ts: scan back over scopes starting before ts
                i = bisect.bisect_right(starts, ts) - 1
                best = None
                while i >= 0 and i > bisect.bisect_right(starts, ts) - 400:
                    s = phase_scopes[i]
                    if s["ts"] <= ts <= s["ts"] + s["dur"] and (best is None or s["dur"] < best["dur"]):
                        best = s
                    i -= 1
                owner = best
            if owner is None:
                unattributed += k["dur"]
            else:
                phases[owner["name"]]["gpu_ms"] += k["dur"] / 1000.0 / steps
        report["gpu_ms_outside_phases"] = unattributed / 1000.0 / steps
    for p in phases.values():
        p["count"] = p["count"] / steps
    report["phases"] = phases

    syncs = collections.defaultdict(lambda: [0, 0.0])
    for e in runtime:
        if e["name"].startswith(SYNC_CALLS) and not e["name"].startswith("cudaMemcpyAsync"):
            syncs[e["name"]][0] += 1
            syncs[e["name"]][1] += e["dur"]
    report["host_syncs"] = {n: {"calls_per_step": c / steps, "ms_per_step": t / 1000.0 / steps}
                            for n, (c, t) in sorted(syncs.items(), key=lambda kv: -kv[1][1])}
    return report


def print_report(r, title):
    print("%s: %d step(s)%s" % (title, r["steps"],
                                 ", %.1f ms of wall time per step" % r["step_wall_ms"] if "step_wall_ms" in r else ""))
    if "gpu_time_ms" in r:
        line = "  GPU time per step %.1f ms" % r["gpu_time_ms"]
        if "gpu_busy_ms" in r:
            line += ", busy %.1f ms, idle %.1f ms of the step" % (r["gpu_busy_ms"], r["gpu_idle_ms"])
        print(line)
    print("  top %d by %s time, per step:" % (len(r["top"]), r["top_kind"]))
    print("  | # | %s | calls | ms | share |" % r["top_kind"])
    print("  | --- | --- | --- | --- | --- |")
    for i, t in enumerate(r["top"], 1):
        name = t["name"] if len(t["name"]) <= 90 else t["name"][:87] + "..."
        print("  | %d | `%s` | %.0f | %.2f | %.1f%% |" % (i, name.replace("|", "\\|"), t["calls_per_step"],
                                                      t["ms_per_step"], 100 * t["share"]))
    if r["phases"]:
        print("  phases (shardkit::* scopes), per step:")
        print("  | phase | scopes | CPU wall ms | GPU ms launched |")
        print("  | --- | --- | --- | --- |")
        for n, p in r["phases"].items():
            print("  | %s | %.0f | %.2f | %.2f |" % (n, p["count"], p["cpu_ms"], p["gpu_ms"]))
        if "gpu_ms_outside_phases" in r:
            print("  | (outside the scopes) | | | %.2f |" % r["gpu_ms_outside_phases"])
    if r["host_syncs"]:
        print("  host syncs, per step: " + ", ".join("%s %.0fx %.2f ms" % (n, s["calls_per_step"], s["ms_per_step"])
                                                   for n, s in r["host_syncs"].items()))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    r = analyse(load(a.trace), a.steps, a.top)
    print_report(r, a.trace)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
