#!/usr/bin/python3
"""fsdp_overlap: how much of FSDP's communication the compute hides
(parallel.prefetch), on a network slow enough for it to matter.

  bench/fsdp_overlap.py [--train build/train] [--cases fsdp2,fsdp4,hsdp4]
                        [--dtypes fp32,bf16] [--per-rank-batch 4] [--layers 6]
                        [--steps 8] [--rounds 1] [--mtu 1500] [--free-link]
                        [--json F] [--trace-dir D]

Loopback is nearly free, so overlap would show nothing there. Every rank
runs in one network namespace of its own making whose loopback (MTU 1500,
or --mtu up to 65536: the 64 KiB packets a NIC with segmentation offload
hands the kernel) carries a `tc tbf` rate limit: all the job's traffic
shares that link. Each
rank is a `build/train` process with torchrun's environment, pinned to a
core (rank r on core r mod the cores; with 4 ranks on 2 cores, two share a
core, which is what this machine allows).

Per case (layout, world, dtype) it measures, each the median over steps
3..steps of rank 0's metrics.jsonl:
  compute_s         the step of one process on the same per-rank batch (world
                    1, no communication; its AdamW updates the whole model
                    where a rank updates its shard), with as many such
                    processes side by side, pinned as the ranks are, so that
                    it gets the same share of a core (the median over the
                    steps of all of them that ran while all of them were
                    timing steps: each round's compute_steps_side_by_side
                    counts them);
  comm_s            comm_wait_s with prefetch 0: every collective waited for
                    where it is issued, so the collectives' own time;
  step_s_prefetch0  and step_s_prefetch1: the sharded step at the chosen rate;
                    with --rounds R, compute_s, comm_s and both steps are
                    measured R times, alternated (compute, prefetch 0,
                    prefetch 1, compute, ...), each the median of its R
                    (every round's values are in the row's "rounds");
  exposed_prefetchN (step - compute) / comm, the exposed share of the
                    communication (about 1 with no overlap);
  ratio_prefetch1   step_s_prefetch1 / max(compute_s, comm_s);
  waited_share_prefetch1
                    comm_wait_s with prefetch 1 over comm_s: the share of the
                    communication the training thread still waited for. The
                    rest of exposed_prefetch1 is compute slowed down by the
                    network stack and Gloo's threads, which share the ranks'
                    cores here (a NIC would do that work on a real node).
With --free-link, also:
  step_s_free_prefetch1
                    the sharded step with prefetch 1 on the link with no
                    rate limit (with --rounds, in every round, alternated
                    with the others, the median) and comm_wait_s_free_prefetch1
                    the training thread's waits in it, free_link_extra_over_comm
                    its excess over compute_s in units of comm_s, and
                    link_exposed_prefetch1 = (step_s_prefetch1 -
                    step_s_free_prefetch1) / comm_s, what the link's limit
                    adds to the step (0: the limited link's time is hidden
                    entirely; the rest of exposed_prefetch1 is the cost of
                    moving the bytes at all on these cores);
  cpu_main_s_per_step_X, cpu_other_threads_s_per_step_X
                    each process's CPU time (user + system) per step, its
                    training thread's and its other threads' (Gloo, helpers),
                    for X = compute, free_prefetch1 and prefetch1: what
                    moving the bytes costs the ranks' own cores;
  idle_share_X      the share of all the cores' time that was idle while
                    the timed steps ran (/proc/stat; 0 when every core
                    always had a process to run): the time in which every
                    process on a core waited at once, a cost that is no
                    CPU work.
The link's rate is chosen per case so that comm_s is about compute_s: a
probe run at --probe-mbit gives the communication time at that rate, and
the rate scales with it.

Targets (issue #47): ratio_prefetch1 <= 1.15 and exposed_prefetch1 <= 0.25.
Needs root, iproute2 (ip, tc with tbf) and taskset; without them it says
so and exits 2. Prints a table, and with --json one JSON object
(scripts/plot-bench overlap draws it). With --trace-dir, the prefetch 0 and
1 runs of the first case also write a profiler trace of one step
(profile.every), whose shardkit::* ranges scripts/plot-bench draws as a
timeline.
"""
import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

PROG = "fsdp_overlap"

MODEL = {
    "kind": "llama", "vocab_size": 256, "seq_len": 128, "d_model": 256, "n_layers": 6,
    "n_heads": 4, "n_kv_heads": 2, "d_ff": 704,
}


def fail(msg, code=2):
    print(f"{PROG}: {msg}", file=sys.stderr)
    sys.exit(code)


def sh(*cmd):
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


class Link:
    """A network namespace whose loopback is the rate-limited link."""

    def __init__(self, mtu):
        self.ns = f"skov{os.getpid()}"
        self.mtu = mtu
        sh("ip", "netns", "add", self.ns)
        sh("ip", "-n", self.ns, "link", "set", "lo", "mtu", str(mtu))
        sh("ip", "-n", self.ns, "link", "set", "lo", "up")
        self.rate = None

    def set_rate(self, mbit):
        if self.rate is not None:
            sh("tc", "-n", self.ns, "qdisc", "del", "dev", "lo", "root")
            self.rate = None
        if mbit is None:
            return
        # A burst of 256 KiB (at least 4 packets): small against a unit's
        # collective (MiBs), so a link that idled during compute does not
        # send the next one for free.
        burst = max(256 * 1024, 4 * self.mtu)
        sh("tc", "-n", self.ns, "qdisc", "add", "dev", "lo", "root", "tbf", "rate",
           f"{int(mbit)}mbit", "burst", str(burst), "latency", "2000ms")
        self.rate = mbit

    def close(self):
        subprocess.run(["ip", "netns", "del", self.ns], stderr=subprocess.DEVNULL)


def config_args(args, case, dtype, world, prefetch, run_dir, trace_step=0):
    layout, _ = case
    sets = [f"run.dir={run_dir}", f"train.steps={args.steps}", "train.log_every=1",
            "train.eval_every=0", "checkpoint.interval=0", "data.kind=synthetic",
            "data.task=copy", "data.eval_fraction=0", f"parallel.prefetch={prefetch}",
            f"train.mixed_precision.param_dtype={dtype}", "train.mixed_precision.reduce_dtype=fp32"]
    sets += [f"model.{k}={v}" for k, v in MODEL.items()]
    per_rank = args.per_rank_batch
    if world == 1:
        sets += ["parallel.replicate=1", "parallel.shard=1", f"train.global_batch_size={per_rank}"]
    elif layout == "hsdp":
        sets += ["parallel.replicate=2", f"parallel.shard={world // 2}",
                 f"train.global_batch_size={per_rank * world}"]
    else:
        sets += ["parallel.replicate=1", "parallel.shard=-1", f"train.global_batch_size={per_rank * world}"]
    if trace_step:
        sets += [f"profile.every={trace_step}", "profile.active=1", f"profile.dir={run_dir}/profile"]
    out = ["--config", args.config]
    for s in sets:
        out += ["--set", s]
    return out


class ThreadCpu:
    """Samples the CPU time (user + system, from /proc/PID/task/*/stat) of
    every thread of the given processes until stopped, keeping each
    thread's latest reading (the ranks exit at the end, so the last sample
    before that is what counts)."""

    def __init__(self, pids):
        self.pids = pids
        self.latest = {}  # (pid, tid) -> seconds
        self.idle = []  # (wall-clock time, the machine's idle seconds over all cores so far)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        tick = os.sysconf("SC_CLK_TCK")
        while not self.stopped.is_set():
            try:
                with open("/proc/stat") as f:
                    cpu = f.readline().split()  # cpu user nice system idle iowait ...
                self.idle.append((time.time(), (int(cpu[4]) + int(cpu[5])) / tick))
            except (OSError, IndexError, ValueError):
                pass
            for pid in self.pids:
                try:
                    tids = os.listdir(f"/proc/{pid}/task")
                except OSError:
                    continue
                for tid in tids:
                    try:
                        with open(f"/proc/{pid}/task/{tid}/stat") as f:
                            fields = f.read().rsplit(")", 1)[1].split()
                        self.latest[(pid, int(tid))] = (int(fields[11]) + int(fields[12])) / tick
                    except (OSError, IndexError, ValueError):
                        pass
            self.stopped.wait(0.25)

    def stop(self):
        self.stopped.set()
        self.thread.join()
        main = [v for (pid, tid), v in self.latest.items() if tid == pid]
        rest = [v for (pid, tid), v in self.latest.items() if tid != pid]
        return {"main_s": sum(main) / max(len(main), 1), "other_threads_s": sum(rest) / max(len(main), 1),
                "idle": self.idle}

    @staticmethod
    def idle_share(samples, lo, hi, cores):
        """The share of all cores' time that was idle between wall-clock
        times lo and hi (the samples inside them), or None."""
        inside = [x for x in samples if lo <= x[0] <= hi]
        if len(inside) < 2 or inside[-1][0] - inside[0][0] <= 0:
            return None
        return (inside[-1][1] - inside[0][1]) / ((inside[-1][0] - inside[0][0]) * cores)


def free_port_base():
    """A rendezvous port for one job, spread over 20000-39999 by pid and time."""
    return 20000 + (os.getpid() * 7 + int(time.time() * 1000)) % 20000


def launch_ranks(link, train, run_dir, ranks):
    """Starts one `train` process per (world, rank, port, config args) of
    `ranks` in the link's network namespace, the i-th pinned to core i mod
    the cores, with torchrun's environment variables; each writes
    run_dir/rank<i>.log. Returns [(Popen, log file)]. (pipeline_schedules.py
    launches its jobs with it too.)"""
    cores = os.cpu_count() or 1
    procs = []
    for i, (size, rank, port, conf) in enumerate(ranks):
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1",
               "RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        cmd = ["ip", "netns", "exec", link.ns, "taskset", "-c", str(i % cores), "env"]
        cmd += [f"{k}={v}" for k, v in env.items()]
        cmd += [train] + conf
        log = open(os.path.join(run_dir, f"rank{i}.log"), "w")
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
    return procs


def wait_ranks(procs):
    """Waits for every process of launch_ranks; returns the failed ones' indices."""
    failed = []
    for i, (p, log) in enumerate(procs):
        if p.wait() != 0:
            failed.append(i)
        log.close()
    return failed


def fail_on(failed, run_dir, tag):
    """Ends the benchmark (exit 1) with the first failed rank's log tail."""
    if failed:
        with open(os.path.join(run_dir, f"rank{failed[0]}.log")) as f:
            tail = f.read()[-2000:]
        fail(f"{tag}: rank(s) {failed} failed; rank {failed[0]}'s log ends:\n{tail}", 1)


def run_job(args, link, case, dtype, world, prefetch, work, tag, trace_step=0, alone=False, cpu=False):
    """One job of `world` ranks; alone: `world` single-process jobs side by
    side instead, pinned as the ranks would be (compute without
    communication, on the same share of a core). cpu: also each process's
    CPU time, its training thread's and its other threads' (per process,
    averaged over the processes)."""
    run_dir = os.path.join(work, tag)
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    port = free_port_base()
    ranks = []
    for r in range(world):
        size, rank = (1, 0) if alone else (world, r)
        rank_dir = os.path.join(run_dir, f"alone{r}") if alone and r > 0 else run_dir
        ranks.append((size, rank, port + r if alone else port,
                      config_args(args, case, dtype, size, prefetch, rank_dir, trace_step)))
    procs = launch_ranks(link, args.train, run_dir, ranks)
    sampler = None
    if cpu:
        # ip netns exec and taskset exec into env, which execs train: the pid stays.
        sampler = ThreadCpu([p.pid for p, _ in procs])
    failed = wait_ranks(procs)
    threads = sampler.stop() if sampler else None
    fail_on(failed, run_dir, tag)
    steps = timed_steps(os.path.join(run_dir, "metrics.jsonl"), tag)
    out = {"dir": run_dir}
    if alone and world > 1:
        # Side-by-side processes start and finish at different times; a
        # step that ran while a core's other process had not started or had
        # ended ran alone and fast (a 2.5x low compute_s once). Only the
        # steps, of every process, that lie inside the span in which all of
        # them were timing steps count.
        every = [steps] + [timed_steps(os.path.join(run_dir, f"alone{r}", "metrics.jsonl"), tag)
                           for r in range(1, world)]
        lo = max(min(r["start"] for r in p) for p in every)
        hi = min(max(r["end"] for r in p) for p in every)
        inside = [r for p in every for r in p if r["start"] >= lo and r["end"] <= hi]
        out["steps_side_by_side"] = len(inside)
        if len(inside) >= 3:
            steps = inside
        else:
            print(f"{PROG}: {tag}: only {len(inside)} steps ran while all {world} processes did; "
                  "taking rank 0's steps", file=sys.stderr)
    out["step_s"] = statistics.median(r["step_time_s"] for r in steps)
    out["comm_wait_s"] = statistics.median(r["comm_wait_s"] for r in steps)
    if threads:
        # Per step: the whole run's CPU over its steps (start-up included,
        # the same for every run of a case).
        n = max(r["step"] for r in steps)
        out["cpu_main_s_per_step"] = threads["main_s"] / n
        out["cpu_other_threads_s_per_step"] = threads["other_threads_s"] / n
        # While the timed steps ran: how much of the cores' time nobody
        # used (every process on a core waiting at once).
        out["idle_share"] = ThreadCpu.idle_share(threads["idle"], min(r["start"] for r in steps),
                                                 max(r["end"] for r in steps), os.cpu_count() or 1)
    return out


def timed_steps(path, tag):
    """Steps 3.. of a metrics.jsonl, each with its wall-clock span (the
    record's time is the step's end, to the millisecond)."""
    steps = []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if "step_time_s" in rec and rec["step"] >= 3:
                end = datetime.datetime.strptime(rec["time"], "%Y-%m-%dT%H:%M:%S.%fZ").timestamp()
                steps.append(dict(rec, start=end - rec["step_time_s"], end=end))
    if not steps:
        fail(f"{tag}: no steps from 3 on in {path}", 1)
    return steps


def one_round(alone, p0, p1, free=None):
    """One round's measurements: compute alone, then the prefetch 0 and 1
    jobs (run_job's results), and with --free-link the prefetch 1 job on the
    unlimited link."""
    out = {"compute_s": alone["step_s"], "comm_s": p0["comm_wait_s"], "step_s_prefetch0": p0["step_s"],
           "step_s_prefetch1": p1["step_s"], "comm_wait_s_prefetch1": p1["comm_wait_s"]}
    if "steps_side_by_side" in alone:
        out["compute_steps_side_by_side"] = alone["steps_side_by_side"]
    if free is not None:
        out["step_s_free_prefetch1"] = free["step_s"]
        out["comm_wait_s_free_prefetch1"] = free["comm_wait_s"]
    return out


def share(res):
    return "-" if res.get("idle_share") is None else f"{100 * res['idle_share']:.1f}%"


def trace_ranges(path):
    """The shardkit::* ranges of a Chrome trace, as [name, start_ms, dur_ms]."""
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    out = []
    for e in events:
        name = e.get("name", "")
        if name.startswith("shardkit::") and e.get("ph") == "X":
            out.append([name, float(e["ts"]) / 1000.0, float(e["dur"]) / 1000.0])
    if out:
        t0 = min(r[1] for r in out)
        out = [[n, round(s - t0, 3), round(d, 3)] for n, s, d in out]
    return sorted(out, key=lambda r: r[1])


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--train", default=os.path.join(here, "..", "build", "train"))
    parser.add_argument("--config", default=os.path.join(here, "..", "configs", "default.yaml"))
    parser.add_argument("--cases", default="fsdp2,fsdp4,hsdp4")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--per-rank-batch", type=int, default=4)
    parser.add_argument("--layers", type=int, default=MODEL["n_layers"],
                        help="the llama's blocks, one FSDP unit each (default %(default)s)")
    parser.add_argument("--probe-mbit", type=float, default=1000)
    parser.add_argument("--mtu", type=int, default=1500,
                        help="the link's MTU: 1500 (every packet crosses the kernel) or up to "
                             "65536, which models a NIC's segmentation offload (default 1500)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure compute, prefetch 0 and prefetch 1 this many times, "
                             "alternated, and report each one's median (default 1)")
    parser.add_argument("--free-link", action="store_true",
                        help="also the sharded step with prefetch 1 on the link with no rate limit, "
                             "and each process's CPU time per step by thread (compute, free link, "
                             "prefetch 1): what moving the bytes costs the ranks' own cores")
    parser.add_argument("--json")
    parser.add_argument("--trace-dir")
    args = parser.parse_args()
    if os.geteuid() != 0:
        fail("needs root (network namespaces and tc)")
    for tool in ("ip", "tc", "taskset"):
        if shutil.which(tool) is None:
            fail(f"needs {tool}")
    if not os.access(args.train, os.X_OK):
        fail(f"{args.train}: not built")
    if args.rounds < 1:
        fail(f"--rounds must be at least 1, not {args.rounds}")
    if args.layers < 1:
        fail(f"--layers must be at least 1, not {args.layers}")
    MODEL["n_layers"] = args.layers
    if not 1280 <= args.mtu <= 65536:
        fail(f"--mtu must be 1280..65536, not {args.mtu}")
    if args.steps < 4:
        fail("--steps must be at least 4 (steps 3.. are timed)")
    cases = []
    for c in args.cases.split(","):
        layout, world = c.rstrip("0123456789"), c[len(c.rstrip("0123456789")):]
        if layout not in ("fsdp", "hsdp") or not world or int(world) < 2 or (layout == "hsdp" and int(world) % 2):
            fail(f"--cases: '{c}' is not fsdpN or hsdpN (N >= 2, even for hsdp)")
        cases.append((layout, int(world)))
    dtypes = args.dtypes.split(",")
    for d in dtypes:
        if d not in ("fp32", "bf16"):
            fail(f"--dtypes: '{d}' is not fp32 or bf16")

    work = tempfile.mkdtemp(prefix="fsdp_overlap.")
    link = Link(args.mtu)
    rows = []
    timelines = {}
    try:
        for case in cases:
            layout, world = case
            for dtype in dtypes:
                name = f"{layout}{world} {dtype}"
                link.set_rate(None)
                alone = run_job(args, link, case, dtype, world, 0, work, "compute", alone=True, cpu=args.free_link)
                compute = alone["step_s"]
                free = None
                if args.free_link:
                    free = run_job(args, link, case, dtype, world, 1, work, "free", cpu=True)
                link.set_rate(args.probe_mbit)
                probe = run_job(args, link, case, dtype, world, 0, work, "probe")["comm_wait_s"]
                rate = max(50.0, args.probe_mbit * probe / max(compute, 1e-3))
                link.set_rate(rate)
                trace = 5 if args.trace_dir and not timelines else 0
                p0 = run_job(args, link, case, dtype, world, 0, work, "p0", trace)
                p1 = run_job(args, link, case, dtype, world, 1, work, "p1", trace, cpu=args.free_link)
                rounds = [one_round(alone, p0, p1, free)]
                for i in range(1, args.rounds):
                    # Compute and the steps again, alternated, so that the
                    # machine's drift between runs falls on both sides. Run
                    # directories of their own: the first round's keep the
                    # traces copied below.
                    link.set_rate(None)
                    c = run_job(args, link, case, dtype, world, 0, work, f"compute_r{i}", alone=True)
                    qf = run_job(args, link, case, dtype, world, 1, work, f"free_r{i}") if free else None
                    link.set_rate(rate)
                    q0 = run_job(args, link, case, dtype, world, 0, work, f"p0_r{i}")
                    q1 = run_job(args, link, case, dtype, world, 1, work, f"p1_r{i}")
                    rounds.append(one_round(c, q0, q1, qf))
                med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
                compute = med["compute_s"]
                p0 = dict(p0, step_s=med["step_s_prefetch0"], comm_wait_s=med["comm_s"])
                p1 = dict(p1, step_s=med["step_s_prefetch1"], comm_wait_s=med["comm_wait_s_prefetch1"])
                comm = p0["comm_wait_s"]
                row = {
                    "case": name, "layout": layout, "world": world, "dtype": dtype,
                    "rate_mbit": round(rate, 1), "compute_s": compute, "comm_s": comm,
                    "step_s_prefetch0": p0["step_s"], "step_s_prefetch1": p1["step_s"],
                    "comm_wait_s_prefetch1": p1["comm_wait_s"],
                    "waited_share_prefetch1": p1["comm_wait_s"] / comm if comm > 0 else None,
                    "exposed_prefetch0": (p0["step_s"] - compute) / comm if comm > 0 else None,
                    "exposed_prefetch1": (p1["step_s"] - compute) / comm if comm > 0 else None,
                    "ratio_prefetch1": p1["step_s"] / max(compute, comm),
                    "rounds": rounds,
                }
                if free:
                    # The free link's step over compute: what moving the bytes
                    # costs the cores, in units of comm_s (0: nothing).
                    row["step_s_free_prefetch1"] = med["step_s_free_prefetch1"]
                    row["comm_wait_s_free_prefetch1"] = med["comm_wait_s_free_prefetch1"]
                    row["free_link_extra_over_comm"] = (
                        (med["step_s_free_prefetch1"] - compute) / comm if comm > 0 else None)
                    # What the link's limit adds to the same step, in units
                    # of comm_s: 0 when the limited link's time is hidden
                    # entirely and only moving the bytes costs the step.
                    row["link_exposed_prefetch1"] = (
                        (p1["step_s"] - med["step_s_free_prefetch1"]) / comm if comm > 0 else None)
                    for tag, res in (("compute", alone), ("free_prefetch1", free), ("prefetch1", p1)):
                        row[f"cpu_main_s_per_step_{tag}"] = res["cpu_main_s_per_step"]
                        row[f"cpu_other_threads_s_per_step_{tag}"] = res["cpu_other_threads_s_per_step"]
                        row[f"idle_share_{tag}"] = res["idle_share"]
                row["met"] = bool(row["ratio_prefetch1"] <= 1.15 and
                                  row["exposed_prefetch1"] is not None and row["exposed_prefetch1"] <= 0.25)
                rows.append(row)
                if trace:
                    for tag, res in (("prefetch0", p0), ("prefetch1", p1)):
                        src = os.path.join(res["dir"], "profile", f"step_{trace}", "rank0.json")
                        if os.path.exists(src):
                            os.makedirs(args.trace_dir, exist_ok=True)
                            dst = os.path.join(args.trace_dir, f"fsdp_overlap_{tag}_rank0.json")
                            shutil.copyfile(src, dst)
                            timelines[tag] = {"case": name, "step": trace, "ranges": trace_ranges(src)}
                print(f"{name:10s} rate {rate:7.0f} Mbit/s  compute {compute:.3f}  comm {comm:.3f}  "
                      f"step p0 {p0['step_s']:.3f}  p1 {p1['step_s']:.3f}", file=sys.stderr)
                if free:
                    print(f"{name:10s} free link: step p1 {free['step_s']:.3f}  CPU s/step, training thread "
                          f"and other threads: compute {alone['cpu_main_s_per_step']:.3f} + "
                          f"{alone['cpu_other_threads_s_per_step']:.3f}, free p1 "
                          f"{free['cpu_main_s_per_step']:.3f} + {free['cpu_other_threads_s_per_step']:.3f}, "
                          f"p1 {p1['cpu_main_s_per_step']:.3f} + {p1['cpu_other_threads_s_per_step']:.3f}; "
                          f"cores idle: compute {share(alone)}, free p1 {share(free)}, p1 {share(p1)}",
                          file=sys.stderr)
    finally:
        link.close()
        shutil.rmtree(work, ignore_errors=True)

    head = ["case", "Mbit/s", "compute_s", "comm_s", "step p0", "step p1", "exposed p0",
            "exposed p1", "waited p1", "p1/max", "met"]
    with_free = any("step_s_free_prefetch1" in r for r in rows)
    if with_free:
        head[-1:-1] = ["free p1", "free extra", "link exposed p1"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [r["case"], f"{r['rate_mbit']:.0f}", f"{r['compute_s']:.3f}", f"{r['comm_s']:.3f}",
                 f"{r['step_s_prefetch0']:.3f}", f"{r['step_s_prefetch1']:.3f}",
                 f"{r['exposed_prefetch0']:.2f}", f"{r['exposed_prefetch1']:.2f}",
                 f"{r['waited_share_prefetch1']:.2f}",
                 f"{r['ratio_prefetch1']:.2f}", "yes" if r["met"] else "no"]
        if with_free:
            cells[-1:-1] = [f"{r['step_s_free_prefetch1']:.3f}", f"{r['free_link_extra_over_comm']:.2f}",
                            f"{r['link_exposed_prefetch1']:.2f}"]
        print("| " + " | ".join(cells) + " |")
    result = {
        "benchmark": "fsdp_overlap",
        "command": "bench/fsdp_overlap.py " + " ".join(sys.argv[1:]),
        "model": MODEL, "per_rank_batch": args.per_rank_batch, "steps": args.steps,
        "cores": os.cpu_count(), "mtu": args.mtu, "targets": {"ratio_prefetch1": 1.15, "exposed_prefetch1": 0.25},
        "rows": rows, "timelines": timelines,
    }
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
