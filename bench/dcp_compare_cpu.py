#!/usr/bin/env python3
"""Our checkpoints against PyTorch DCP on host (CPU) state, same disk, one run.

bench/dcp_compare.py is the GPU comparison; this is its CPU sibling. For each
combination of --sizes (MiB over all ranks), --dtypes (fp32, bf16) and
--nprocs (ranks), every trial runs, back to back:
  ours  ckpt_bench --save-load-only: the disk's raw writes (page cache by one
        thread and by 4, O_DIRECT by 4; 8 MiB pieces, fsync), our default
        sync save (checkpoint.direct_io auto) and its load after the page
        cache is dropped, and an async save (blocking and total);
  dcp   dcp.save and dcp.load of the same tensors (names, shapes, dtype,
        each rank its rows) with DCP's defaults (FileSystemWriter: one thread,
        one file per rank, fsync), in the PyTorch of --torch-root (a chroot:
        Debian 13's 2.6) or of this python3 with --torch-root "".
Trials are interleaved over the combinations, so that drift of the disk or
of the machine's load hits both sides alike. Times are the maximum over
ranks; the table and JSON give medians over trials.

Each side's process saves --saves times (default 3) in a row, as a training
job saves every N steps: ckpt_bench --trials N, DCP's worker N dcp.save
calls. The save columns are the median of saves 2..N of every trial (the
steady state: checkpoint.direct_io auto has timed its first save's file and
tried the other way by then, direct_io.h), and *_first_s the first save of
each process (auto's probe's way; DCP's first save). With --saves 1 both are
the first save. The load is of the last save. DCP's worker waits
--between-saves seconds (default 5) between two saves, as a job trains
between them, and deletes its previous checkpoint once the next one is
committed, as a job keeping its last checkpoint does (torchtitan's
keep_latest_k, our checkpoint.keep_last); ckpt_bench deletes each save after
its load and does its raw writes, load and async save between two saves.
--dcp-prune after,before also runs DCP a second time per trial deleting the
previous checkpoint just before the next save instead, after the wait (the
order of the runs before 2026-12-01, an extra column): on this project's VM
a page-cache write into memory freed a moment ago is several times faster
than into memory freed seconds earlier (bench/page_reuse_check.py).

Targets (issue #49): ours save <= DCP save / 1.5; ours save >= 0.8 of the
fastest raw write; ours load <= DCP load.

  python3 bench/dcp_compare_cpu.py [--ckpt-bench build/ckpt_bench]
      [--sizes 1024,8192] [--dtypes fp32,bf16] [--nprocs 1,2] [--trials 3]
      [--torch-root /var/cache/shardkit/trixie-root] [--saves 3] [--between-saves 5]
      [--dcp-prune after[,before]]
      [--json F] [--plot F.png]

The scratch directory is <torch-root>/tmp/shardkit_dcp_cpu for both sides
(same disk); the worker copies itself there and runs under chroot. Needs
root for chroot. DCP ranks each hold their rows under their own key names
(plain tensors, not DTensors): DCP would write a plain tensor held by every
rank once, and DTensor's Shard(0) splits rows differently than our layout.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

K_ROWS, K_COLS = 4096, 1024  # ckpt_bench's layers: [4096, 1024] weight, [1024] norm


def layer_specs(size_mb, dtype_bytes):
    """ckpt_bench's make_specs: (name, global shape) of every item, in order."""
    total = (size_mb << 20) * (4 // dtype_bytes)  # sized as fp32, as ckpt_bench does
    per_layer = 3 * 4 * (K_ROWS * K_COLS + K_COLS)
    rows = [K_ROWS] * (total // per_layer)
    rest = total - len(rows) * per_layer
    last = rest // 12 // K_COLS - 1
    return rows, last


def item_shapes(size_mb, dtype_bytes, world):
    rows, last = layer_specs(size_mb, dtype_bytes)
    if not rows:
        last = max(last, world)
    if last >= world:
        rows.append(last)
    items = []
    for l, r in enumerate(rows):
        for param, shape in (("weight", [r, K_COLS]), ("norm", [K_COLS])):
            for prefix, suffix in (("model.", ""), ("optim.", ".exp_avg"), ("optim.", ".exp_avg_sq")):
                items.append(("%slayers.%d.%s%s" % (prefix, l, param, suffix), shape))
    return items


# ---------------------------------------------------------------------------
# The DCP worker (runs in the PyTorch under test; one process per rank)

def dcp_rank(rank, args):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    world = args.nproc
    dist.init_process_group("gloo", init_method="file://" + os.path.join(args.dir, "store"),
                            rank=rank, world_size=world)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(rank + 1)
    sd = {}
    for name, shape in item_shapes(args.size_mb, 2 if args.dtype == "bf16" else 4, world):
        r0, r1 = shape[0] * rank // world, shape[0] * (rank + 1) // world
        local = [r1 - r0] + shape[1:]
        sd["%s@rank%d" % (name, rank)] = torch.randn(local).to(dtype)
    ck = None
    bytes_local = sum(t.numel() * t.element_size() for t in sd.values())

    def max_over(x):
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    saves = []
    for i in range(max(1, args.saves)):  # as a job saves: each into a new directory, the last one kept
        prev = ck
        if prev:
            time.sleep(args.gap)  # the training between two saves
        dist.barrier()
        if prev and args.prune == "before" and rank == 0:
            shutil.rmtree(prev, ignore_errors=True)
        ck = os.path.join(args.dir, "dcp_ckpt_%d" % i)
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(sd, checkpoint_id=ck)
        saves.append(max_over(time.perf_counter() - t0))
        if prev and args.prune == "after" and rank == 0:  # once the new one is committed
            shutil.rmtree(prev, ignore_errors=True)
    save_s = statistics.median(saves[1:] or saves)
    dist.barrier()
    if rank == 0:  # as ckpt_bench does before its load: the files' pages out of the cache
        for f in os.listdir(ck):
            fd = os.open(os.path.join(ck, f), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    dist.barrier()
    t0 = time.perf_counter()
    dcp.load(target, checkpoint_id=ck)
    load_s = max_over(time.perf_counter() - t0)
    exact = all(torch.equal(sd[k], target[k]) for k in sd)
    exact = max_over(0.0 if exact else 1.0) == 0.0
    state_bytes = int(max_over(bytes_local)) * world  # collectives on every rank, before rank 0 writes
    dist.barrier()
    if rank == 0:
        shutil.rmtree(ck, ignore_errors=True)
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "dcp_save_s": save_s, "dcp_save_first_s": saves[0],
                       "dcp_save_s_each": saves, "dcp_load_s": load_s,
                       "dcp_load_exact": exact, "state_bytes": state_bytes}, f)
    dist.destroy_process_group()


def dcp_worker(args):
    import torch.multiprocessing as mp
    if args.nproc == 1:
        dcp_rank(0, args)
    else:
        mp.spawn(dcp_rank, args=(args,), nprocs=args.nproc, join=True)


# ---------------------------------------------------------------------------
# The driver

def run_ours(a, size, dtype, nproc, scratch):
    out = os.path.join(scratch, "ours.json")
    cmd = [a.ckpt_bench, "--save-load-only", "--size-mb", str(size), "--dtype", dtype, "--nproc", str(nproc),
           "--trials", str(a.saves), "--dir", os.path.join(scratch, "ours"), "--json", out]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        r = json.load(f)
    os.remove(out)
    keys = ["sync_save_s", "load_s", "async_blocking_s", "async_total_s", "raw_write_s",
            "raw_write_parallel_s", "raw_write_direct_parallel_s", "state_bytes"]
    got = {k: r[k] for k in keys if k in r}
    got["direct_io_auto"] = r.get("direct_io_auto", {}).get("detail", "")
    got["direct_io_learned"] = r.get("direct_io_auto", {}).get("learned", "")
    saves = r.get("sync_save_s_trials", [r["sync_save_s"]])
    got["sync_save_first_s"] = saves[0]
    got["sync_save_s"] = statistics.median(saves[1:] or saves)  # the steady saves
    got["sync_save_s_each"] = saves
    got["sync_save_direct_share"] = r.get("sync_save_direct_share", [])
    return got


def run_dcp(a, size, dtype, nproc, scratch, inner_scratch, prune):
    me = os.path.abspath(__file__)
    args = ["--dcp-worker", "--size-mb", str(size), "--dtype", dtype, "--nproc", str(nproc),
            "--saves", str(a.saves), "--prune", prune, "--gap", str(a.between_saves)]
    if a.torch_root:
        shutil.copy(me, os.path.join(scratch, "worker.py"))
        cmd = ["chroot", a.torch_root, "python3", os.path.join(inner_scratch, "worker.py")]
        cmd += args + ["--dir", os.path.join(inner_scratch, "dcp"), "--out", os.path.join(inner_scratch, "dcp.json")]
    else:
        cmd = [sys.executable, me] + args + ["--dir", os.path.join(scratch, "dcp"),
                                             "--out", os.path.join(scratch, "dcp.json")]
    shutil.rmtree(os.path.join(scratch, "dcp"), ignore_errors=True)
    os.makedirs(os.path.join(scratch, "dcp"))
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        shutil.rmtree(os.path.join(scratch, "dcp"), ignore_errors=True)
        return {"error": ["timed out after %d s" % a.timeout]}
    shutil.rmtree(os.path.join(scratch, "dcp"), ignore_errors=True)
    if r.returncode != 0:
        return {"error": (r.stderr or r.stdout).strip().splitlines()[-1:]}
    with open(os.path.join(scratch, "dcp.json")) as f:
        return json.load(f)


def median_of(samples, key):
    xs = [s[key] for s in samples if key in s]
    return statistics.median(xs) if xs else None


def summarize(label, ours, dcp, dcp_other):
    """dcp: DCP's runs with the first --dcp-prune order; dcp_other: {order: runs} for the others."""
    row = {"combo": label, "trials": len(ours)}
    for k in ["sync_save_s", "load_s", "async_blocking_s", "async_total_s", "raw_write_s",
              "raw_write_parallel_s", "raw_write_direct_parallel_s"]:
        row[k] = median_of(ours, k)
    row["sync_save_first_s"] = median_of(ours, "sync_save_first_s")
    row["direct_io_auto"] = ours[-1].get("direct_io_auto", "") if ours else ""
    row["direct_io_learned"] = ours[-1].get("direct_io_learned", "") if ours else ""
    row["dcp_save_s"] = median_of(dcp, "dcp_save_s")
    row["dcp_save_first_s"] = median_of(dcp, "dcp_save_first_s")
    row["dcp_load_s"] = median_of(dcp, "dcp_load_s")
    row["dcp_errors"] = [d["error"] for d in dcp if "error" in d]
    row["dcp_load_exact"] = all(d.get("dcp_load_exact", False) for d in dcp if "error" not in d)
    for order, runs in dcp_other.items():
        row["dcp_save_s_prune_" + order] = median_of(runs, "dcp_save_s")
        row["dcp_errors"] += [d["error"] for d in runs if "error" in d]
    raws = [row[k] for k in ("raw_write_s", "raw_write_parallel_s", "raw_write_direct_parallel_s") if row[k]]
    row["raw_best_s"] = min(raws) if raws else None
    t = {}
    if row["dcp_save_s"] and row["sync_save_s"]:
        t["save_dcp_over_ours"] = {"value": row["dcp_save_s"] / row["sync_save_s"], "op": ">=", "target": 1.5}
    if row["raw_best_s"] and row["sync_save_s"]:
        t["save_over_best_raw"] = {"value": row["raw_best_s"] / row["sync_save_s"], "op": ">=", "target": 0.8}
    if row["dcp_load_s"] and row["load_s"]:
        t["load_dcp_over_ours"] = {"value": row["dcp_load_s"] / row["load_s"], "op": ">=", "target": 1.0}
    for v in t.values():
        v["pass"] = v["value"] >= v["target"]
    row["targets"] = t
    return row


def print_table(rows, torch_version):
    print("\ndcp_compare_cpu: ours (ckpt_bench --save-load-only) vs DCP (torch %s), medians, seconds" % torch_version)
    head = ("combo", "save", "dcp", "x", "raw*", "r/s", "load", "dcp", "x", "async blk", "async tot",
            "1st save", "dcp 1st")
    print("  %-16s %7s %7s %5s %7s %5s %7s %7s %5s %9s %9s %8s %8s" % head)

    def f(x, w=7, p=3):
        return ("%*.*f" % (w, p, x)) if x is not None else "%*s" % (w, "-")
    for r in rows:
        t = r["targets"]

        def tv(k):
            return (("%5.2f" % t[k]["value"]) + ("" if t[k]["pass"] else "!")) if k in t else "    -"
        print("  %-16s %s %s %s %s %s %s %s %s %s %s %s %s" % (
            r["combo"], f(r["sync_save_s"]), f(r["dcp_save_s"]), tv("save_dcp_over_ours"), f(r["raw_best_s"]),
            tv("save_over_best_raw"), f(r["load_s"]), f(r["dcp_load_s"]), tv("load_dcp_over_ours"),
            f(r["async_blocking_s"], 9), f(r["async_total_s"], 9), f(r.get("sync_save_first_s"), 8),
            f(r.get("dcp_save_first_s"), 8)))
    print("  x: DCP time / ours (targets: save >= 1.5, load >= 1.0); raw*: fastest raw write (page cache or "
          "O_DIRECT, 1 or 4 threads); r/s: raw* / our save (target >= 0.8); ! = target missed;\n"
          "  save, dcp: saves 2..N of each process (steady); 1st save, dcp 1st: each process's first")


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("dcp_compare_cpu: no matplotlib, no plot")
        return
    labels = [r["combo"] for r in rows]
    series = [("ours save", "sync_save_s"), ("DCP save", "dcp_save_s")]
    if any(r.get("dcp_save_s_prune_before") for r in rows):
        series.append(("DCP save, previous checkpoint deleted just before", "dcp_save_s_prune_before"))
    series += [("raw write (best)", "raw_best_s"), ("ours load", "load_s"), ("DCP load", "dcp_load_s")]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
    w = 0.8 / len(series)
    for i, (name, key) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * w for j in range(len(rows))]
        ax.bar(xs, [r[key] or 0 for r in rows], w, label=name)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=20)
    ax.set_ylabel("seconds (median)")
    ax.set_title("checkpoint save/load, host state: ours vs PyTorch DCP")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.22))
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print("dcp_compare_cpu: plot in " + path)


def driver(a):
    combos = [(s, d, n) for s in a.sizes for d in a.dtypes for n in a.nprocs]
    scratch = os.path.join(a.torch_root, "tmp", "shardkit_dcp_cpu") if a.torch_root else \
        os.path.join(tempfile.gettempdir(), "shardkit_dcp_cpu")
    inner = "/tmp/shardkit_dcp_cpu"
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    ours = {c: [] for c in combos}
    dcp = {(c, p): [] for c in combos for p in a.dcp_prune}
    started = time.time()
    for t in range(a.trials):
        for c in combos:
            size, dtype, nproc = c
            print("trial %d: %d MiB %s, %d rank(s)" % (t, size, dtype, nproc), flush=True)
            ours[c].append(run_ours(a, size, dtype, nproc, scratch))
            for p in a.dcp_prune:
                dcp[(c, p)].append(run_dcp(a, size, dtype, nproc, scratch, inner, p))
    first = a.dcp_prune[0]
    rows = [summarize("%dM %s x%d" % c, ours[c], dcp[(c, first)], {p: dcp[(c, p)] for p in a.dcp_prune[1:]})
            for c in combos]
    tv = next((d["torch"] for k in dcp for d in dcp[k] if "torch" in d), "?")
    shutil.rmtree(scratch, ignore_errors=True)
    out = {"torch": tv, "trials": a.trials, "saves": a.saves, "dcp_prune": a.dcp_prune,
           "between_saves_s": a.between_saves,
           "wall_s": time.time() - started, "scratch": scratch, "rows": rows,
           "samples": {"%dM %s x%d" % c: dict({"ours": ours[c], "dcp": dcp[(c, first)]},
                                              **{"dcp_prune_" + p: dcp[(c, p)] for p in a.dcp_prune[1:]})
                       for c in combos}}
    print_table(rows, tv)
    for r in rows:
        for p in a.dcp_prune[1:]:
            print("  %s: dcp.save %.3f s with the previous checkpoint deleted %s the save (%s: %.3f s)" % (
                r["combo"], r["dcp_save_s_prune_" + p] or float("nan"), p, first, r["dcp_save_s"] or float("nan")))
    for r in rows:
        if r["dcp_errors"]:
            print("  %s: DCP failed: %s" % (r["combo"], r["dcp_errors"][0]))
    for r in rows:
        print("  %s direct_io auto: probe %s; after the saves %s" % (r["combo"], r["direct_io_auto"],
                                                                   r["direct_io_learned"]))
    if a.plot:
        plot(rows, a.plot)
    print(json.dumps({k: v for k, v in out.items() if k != "samples"}))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--ckpt-bench", default=os.path.join(here, "..", "build", "ckpt_bench"))
    ap.add_argument("--sizes", default="1024,8192")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--nprocs", default="1,2")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--torch-root", default="/var/cache/shardkit/trixie-root")
    ap.add_argument("--json", default="")
    ap.add_argument("--plot", default="")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per DCP worker run")
    ap.add_argument("--saves", type=int, default=3, help="saves per process, each side (see above)")
    ap.add_argument("--between-saves", type=float, default=5.0,
                    help="seconds DCP's worker waits between two saves, as a job trains between them")
    ap.add_argument("--dcp-prune", default="after",
                    help="when DCP's worker deletes its previous checkpoint: after the next save (as a job "
                         "keeping the last one does), before it, or both ('after,before': the first is the "
                         "table's, the others extra columns)")
    # The worker (internal).
    ap.add_argument("--dcp-worker", action="store_true")
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--dir", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--prune", default="after")
    ap.add_argument("--gap", type=float, default=0.0)
    a = ap.parse_args()
    if a.dcp_worker:
        dcp_worker(a)
        return 0
    a.sizes = [int(x) for x in a.sizes.split(",")]
    a.dtypes = a.dtypes.split(",")
    for d in a.dtypes:
        if d not in ("fp32", "bf16"):
            ap.error("--dtypes: %r is not fp32 or bf16" % d)
    a.nprocs = [int(x) for x in a.nprocs.split(",")]
    a.dcp_prune = a.dcp_prune.split(",")
    for p in a.dcp_prune:
        if p not in ("after", "before"):
            ap.error("--dcp-prune: %r is not after or before" % p)
    return driver(a)


if __name__ == "__main__":
    sys.exit(main())
