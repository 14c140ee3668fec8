#!/usr/bin/python3
"""goodput: how much of a training job's time is useful work when its
workers die at random (issue #71).

  bench/goodput.py [--leg debian12|trixie|both] [--launcher train|torchrun|netns|both|all]
                   [--configs default,fast] [--mtbf 30,60,120] [--steps 2400]
                   [--seed 71] [--quick] [--set KEY=VALUE]...
                   [--config-set NAME:KEY=VALUE]... [--max-restarts 1000]
                   [--monitor-interval 0.5] [--timeout S] [--json F] [--keep]
                   [--train build/train] [--trixie-train build-trixie/train]

Every job is configs/llama_tiny.yaml on 2 ranks (train.log_every=1,
train.eval_every=0), started by a launcher that restarts the group after a
rank dies:
  train      build/train --nproc 2 --max-restarts K (the built-in launcher);
  torchrun   scripts/torchrun --nproc_per_node 2 --max_restarts K
             --monitor_interval X --rdzv_backend c10d --rdzv_endpoint
             127.0.0.1:PORT --no_python train ... (the real elastic agent);
  netns      two simulated nodes of one rank each (the project's two-node
             setup, tests/reliability/netns/netns_lib.sh's layout): a network
             namespace per node joined by a bridge, a veth each, node K at
             10.X.Y.K+1, its own host name in /etc/netns/<ns>/hosts (removed
             at the end); in each, scripts/torchrun --nnodes 2
             --nproc_per_node 1 --max_restarts K --rdzv_backend c10d
             --rdzv_endpoint NODE0:PORT --no_python train ... with
             GLOO_SOCKET_IFNAME=eth0, so every collective and the store
             cross the bridge. The local tier is per node and, with two
             nodes, each rank's files get a partner copy on the other node
             (checkpoint.local.partner, on by default). Debian 12 leg only
             (the trixie root resolves no node names); needs root.
--launcher both is train and torchrun; all adds netns.
On the Debian 12 leg (torch and LibTorch 1.13) they run on this host; on the
trixie leg (Debian 13, LibTorch and torch 2.6) inside the debootstrapped root
of scripts/trixie-leg (/var/cache/shardkit/trixie-root): a private mount
namespace (unshare -m) binds /proc, /sys, /dev, /dev/shm and the work
directory into the root and chroots there, so scripts/trixie-leg's own mounts
are neither used nor disturbed. The binaries, the config and scripts/torchrun
are copied into the work directory first: a rebuild during the benchmark does
not change what it measures.

Faults: one worker (a rank process, never the launcher or the agent) gets
SIGKILL at random times: exponential inter-arrival times with mean T seconds
(--mtbf), the rank drawn at random too, from --seed, the same schedule for
every configuration and launcher at a given T. The clock of the schedule runs
only while training runs: from an attempt's first logged step to the kill; a
restart stops it, so a kill that would fall during a restart comes after the
first step of the new attempt. No kill after the last step is logged.

Configurations (CONFIGS below; --config-set NAME:KEY=VALUE adds an override
to one, or a new configuration; --set KEY=VALUE to all):
  default    configs/llama_tiny.yaml as it is (checkpoint.interval 50, async);
  fast       the recommended fast recovery: a checkpoint every step in
             overlap mode to a node-local tier in /dev/shm, flushed to
             checkpoint.dir every 50th.

Per launcher, configuration and T it reports:
  goodput    the fault-free run's wall time over the faulted run's, the same
             steps (a fault-free run of each launcher and configuration);
  accounted  1 - the time lost to failures (the union of the spans from
             each kill to its back_s, below) over the faulted wall time:
             the same share from the failures' own times, which the
             machine's drift between two runs does not move;
  vs_reference
             the first configuration's (--configs) fault-free wall time over
             this faulted run's: what a configuration's own steady cost (a
             checkpoint every step) adds to its failures' cost;
per failure:
  restart_s  the launcher's part: from the kill (time.time() just before
             os.kill) to the new rank 0 process's start (its startup record's
             time less its startup_s, which counts from the kernel's process
             start time);
  startup_s  our part: from that process's start to its first step, with
             its phases (load, rendezvous, groups, model, data, checkpoint,
             resume, other);
  redone     steps done again: the dead attempt's last logged step less the
             step the new attempt resumed from;
  back_s     from the kill until the step last logged before it is logged
             again (restart, start-up and the redone steps together).
Checks (a failed check ends the benchmark with one line naming it, exit 1):
  - every logged step's loss of a faulted run, redone steps included, equals
    the fault-free run's bit for bit (their repr compared);
  - no committed checkpoint lost: each restart resumed from a step at least
    as new as the newest step_N/.metadata on disk (checkpoint.dir and the
    local tier) just before the kill; with two nodes a local step counts
    once every rank's file is on its node or in a partner copy on the
    other (checkpoint/FORMAT.md, "State of a tier");
  - every run finished all its steps, in one attempt more than its kills.
Prints a table and one JSON object (--json F to write it; scripts/plot-bench
F draws it). Everything it creates (runs, /dev/shm directories) lies under
a temporary directory removed at the end unless --keep.
"""
import argparse
import datetime
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

PROG = "goodput"
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TRIXIE_ROOT = "/var/cache/shardkit/trixie-root"

# The configurations compared: name -> overrides of configs/llama_tiny.yaml.
# "{shm}" is replaced by a directory of /dev/shm unique to the run.
CONFIGS = {
    "default": {},
    "fast": {"checkpoint.interval": "1", "checkpoint.mode": "overlap",
             "checkpoint.local.dir": "{shm}/{node}", "checkpoint.durable.every": "50"},
}
# Every job: every step logged (the loss check and the redone steps need
# them), no evaluation.
COMMON = {"train.log_every": "1", "train.eval_every": "0"}
STARTUP_PHASES = ("load_s", "rendezvous_s", "groups_s", "model_s", "data_s", "checkpoint_s", "resume_s",
                  "other_s")


class BenchError(Exception):
    """A run that failed or a check that did not hold: the benchmark ends."""


def fail(msg, code=1):
    print(f"{PROG}: {msg}", file=sys.stderr)
    sys.exit(code)


def utc_seconds(text):
    """metrics.jsonl's "time" ("2026-11-23T01:02:03.456Z") as Unix seconds."""
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(
        tzinfo=datetime.timezone.utc).timestamp()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- processes ---------------------------------------------------------------

def children_of():
    """{ppid: [pid]} of every process now."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        out.setdefault(ppid, []).append(int(name))
    return out


def descendants(pid):
    tree, out, todo = children_of(), [], [pid]
    while todo:
        for c in tree.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def environ(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)


def worker_pid(root_pid, rank, attempt):
    """The pid of the rank process `rank` of attempt `attempt` below root_pid
    (the launcher's own process has no RANK), or None."""
    for pid in descendants(root_pid):
        env = environ(pid)
        if env.get("RANK") == str(rank) and env.get("TORCHELASTIC_RESTART_COUNT", "0") == str(attempt):
            return pid
    return None


def kill_tree(proc):
    """SIGKILL to the launcher and everything below it (the agent's workers
    may sit in sessions of their own)."""
    pids = descendants(proc.pid)
    for pid in [proc.pid] + pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


# --- checkpoints on disk -------------------------------------------------------

def committed_steps(dirs):
    """Steps N with a committed step_N (its .metadata) in any of `dirs` or
    one level below them (the local tier's per-node directories)."""
    steps = set()
    for d in dirs:
        for parent in [d] + ([os.path.join(d, x) for x in os.listdir(d)] if os.path.isdir(d) else []):
            try:
                names = os.listdir(parent)
            except OSError:
                continue
            for n in names:
                if n.startswith("step_") and n[5:].isdigit() and os.path.exists(
                        os.path.join(parent, n, ".metadata")):
                    steps.add(int(n[5:]))
    return steps


def complete_local_steps(base, nodes):
    """With `nodes` nodes of one rank each under base/<node>: the steps a
    resume can load from the local tiers, every rank r's file on node r
    (its .metadata committed) or as a partner copy on another node."""
    per_node = {}
    for k in range(nodes):
        d = os.path.join(base, str(k))
        try:
            per_node[k] = [n for n in os.listdir(d) if n.startswith("step_") and n[5:].isdigit()]
        except OSError:
            per_node[k] = []
    steps = set()
    for n in set(x for names in per_node.values() for x in names):
        def has(r):
            own = os.path.join(base, str(r), n)
            if os.path.exists(os.path.join(own, ".metadata")) and os.path.exists(os.path.join(own, f"rank_{r}.data")):
                return True
            return any(os.path.exists(os.path.join(base, str(o), n, ".partner.json")) and
                       os.path.exists(os.path.join(base, str(o), n, ".partner", f"rank_{r}.data"))
                       for o in range(nodes) if o != r)
        if all(has(r) for r in range(nodes)):
            steps.add(int(n[5:]))
    return steps


# --- two simulated nodes -----------------------------------------------------------

class Nodes:
    """Two nodes as network namespaces joined by a bridge (the layout of
    tests/reliability/netns/netns_lib.sh, under the prefix gpns<pid>), each
    with its own host name in /etc/netns/<ns>/hosts: torchrun's c10d
    rendezvous decides which agent hosts the store by its host name."""

    def __init__(self):
        pid = os.getpid()
        self.prefix = f"gpns{pid}"
        self.bridge = self.prefix + "br"
        self.names = [f"{self.prefix}n{k}" for k in range(2)]
        self.addrs = [f"10.{(pid >> 8) & 255}.{pid & 255}.{k + 1}" for k in range(2)]
        self.made_etc_netns = False
        self.up = False

    @staticmethod
    def ip(*args):
        p = subprocess.run(["ip", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if p.returncode != 0:
            raise BenchError(f"netns: ip {' '.join(args)}: {p.stdout.strip()}")
        return p.stdout

    def node_name(self, k):
        return f"node{k}.{self.prefix}"

    def setup(self):
        if os.geteuid() != 0:
            raise BenchError("--launcher netns needs root (network namespaces)")
        if shutil.which("ip") is None:
            raise BenchError("--launcher netns needs the ip command (iproute2)")
        self.up = True
        self.ip("netns", "add", self.bridge)
        self.ip("-n", self.bridge, "link", "set", "lo", "up")
        self.ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        self.ip("-n", self.bridge, "link", "set", "br0", "up")
        for k, ns in enumerate(self.names):
            self.ip("netns", "add", ns)
            self.ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{k}", "netns", self.bridge)
            self.ip("-n", self.bridge, "link", "set", f"p{k}", "master", "br0", "up")
            # One IPv4 address per interface: Gloo takes the interface's first.
            self.ip("netns", "exec", ns, "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6")
            self.ip("-n", ns, "link", "set", "lo", "up")
            self.ip("-n", ns, "addr", "add", self.addrs[k] + "/24", "dev", "eth0")
            self.ip("-n", ns, "link", "set", "eth0", "up")
        if not os.path.isdir("/etc/netns"):
            os.makedirs("/etc/netns")
            self.made_etc_netns = True
        host = os.uname().nodename
        for k, ns in enumerate(self.names):
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write("127.0.0.1 localhost\n")
                for j in range(2):
                    f.write(f"{self.addrs[j]} {self.node_name(j)}" + (f" {host}" if j == k else "") + "\n")
        # Each node reaches the other (a TCP connect to port 1: "refused"
        # proves the peer answered).
        for k, peer in ((1, 0), (0, 1)):
            probe = ("import socket,sys\ns=socket.socket();s.settimeout(2)\ntry: s.connect((sys.argv[1],1))\n"
                     "except ConnectionRefusedError: sys.exit(0)\nexcept OSError as e: sys.exit(str(e))")
            for attempt in range(3):
                p = subprocess.run(["ip", "netns", "exec", self.names[k], "/usr/bin/python3", "-c", probe,
                                    self.addrs[peer]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                if p.returncode == 0:
                    break
                time.sleep(0.2)
            else:
                raise BenchError(f"netns: node {k} cannot reach node {peer} ({self.addrs[peer]}): {p.stdout.strip()}")

    def cleanup(self):
        if not self.up:
            return
        for ns in self.names + [self.bridge]:
            for _ in range(50):
                p = subprocess.run(["ip", "netns", "pids", ns], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                   text=True)
                pids = [int(x) for x in p.stdout.split()]
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                time.sleep(0.1)
            subprocess.run(["ip", "netns", "del", ns], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        if self.made_etc_netns:
            try:
                os.rmdir("/etc/netns")
            except OSError:
                pass
        self.up = False


# --- metrics.jsonl -------------------------------------------------------------

class MetricsTail:
    """The records appended to a metrics.jsonl so far (a partly written last
    line waits for the next read)."""

    def __init__(self, path):
        self.path, self.offset, self.rest, self.records = path, 0, b"", []

    def read(self):
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        lines = (self.rest + data).split(b"\n")
        self.rest = lines.pop()
        new = [json.loads(line) for line in lines if line.strip()]
        self.records += new
        return new


def attempts(records):
    """The run's attempts, split at each "start" record: [{start, startup,
    steps: [step records], end}]."""
    out = []
    for r in records:
        ev = r.get("event")
        if ev == "start":
            out.append({"start": r, "startup": None, "steps": [], "end": None})
        elif not out:
            continue
        elif ev == "startup":
            out[-1]["startup"] = r
        elif ev == "end":
            out[-1]["end"] = r
        elif ev is None and "loss" in r:
            out[-1]["steps"].append(r)
    return out


# --- one job -----------------------------------------------------------------

class Leg:
    """Where jobs run: the host (Debian 12) or the trixie root."""

    def __init__(self, name, train, work, root=None):
        self.name, self.train, self.work, self.root = name, train, work, root

    def wrap(self, cmd):
        if self.root is None:
            return cmd
        # A private mount namespace: the binds vanish with the job and
        # scripts/trixie-leg's mounts of the same root are not touched.
        r = self.root
        script = ('set -e; r=$1; w=$2; shift 2; '
                  'for d in proc sys dev dev/pts dev/shm; do mount --bind /$d "$r/$d"; done; '
                  'mkdir -p "$r$w"; mount --bind "$w" "$r$w"; '
                  'exec chroot "$r" /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/root '
                  'LANG=C.UTF-8 USE_LIBUV=0 OMP_WAIT_POLICY=PASSIVE "$@"')
        return ["unshare", "--mount", "--propagation", "private", "/bin/bash", "-c", script, "goodput", r,
                self.work] + cmd

    def torch_major(self):
        if self.root is None:
            import torch
            return int(torch.__version__.split(".")[0])
        return 2  # Debian 13's python3-torch 2.6


def job_commands(a, leg, launcher, sets, run_id):
    """The launcher processes of one job: one, or one agent per node."""
    conf = ["--config", os.path.join(leg.work, "llama_tiny.yaml")]
    for k, v in sets.items():
        conf += ["--set", f"{k}={v}"]
    if launcher == "train":
        return [leg.wrap([leg.train, "--nproc", "2", "--max-restarts", str(a.max_restarts)] + conf)]
    if launcher == "netns":
        nodes = a.nodes
        port = str(random.Random(run_id).randrange(20000, 60000))
        out = []
        for k, ns in enumerate(nodes.names):
            cmd = ["ip", "netns", "exec", ns, "env", "GLOO_SOCKET_IFNAME=eth0", "/usr/bin/python3",
                   os.path.join(leg.work, "torchrun"), "--nnodes", "2", "--nproc_per_node", "1", "--max_restarts",
                   str(a.max_restarts), "--monitor_interval", str(a.monitor_interval), "--rdzv_id", run_id,
                   "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{nodes.addrs[0]}:{port}"]
            if leg.torch_major() >= 2:
                cmd += ["--local_addr", nodes.addrs[k]]
            out.append(cmd + ["--no_python", leg.train] + conf)
        return out
    cmd = ["/usr/bin/python3", os.path.join(leg.work, "torchrun"), "--nproc_per_node", "2", "--max_restarts",
           str(a.max_restarts), "--monitor_interval", str(a.monitor_interval), "--rdzv_id", run_id,
           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}"]
    if leg.torch_major() >= 2:
        # torchrun 2.x hands the workers the agent's store by host name,
        # which the root cannot resolve (docs/training.md).
        cmd += ["--local_addr", "127.0.0.1"]
    return [leg.wrap(cmd + ["--no_python", leg.train] + conf)]


def run_job(a, leg, launcher, overrides, tag, timeout, kills=None):
    """One job to its end. kills: [(training seconds, rank)], the schedule
    (None: fault-free). Returns {wall_s, records, failures: [{kill_time,
    rank, attempt, committed}]}."""
    run_dir = os.path.join(leg.work, tag)
    shm = os.path.join(a.shm, tag)
    sets = dict(COMMON)
    sets.update({k: v.replace("{shm}", shm) for k, v in overrides.items()})
    sets.update({"run.dir": run_dir, "train.steps": str(a.steps)})
    durable = sets.get("checkpoint.dir") or os.path.join(run_dir, "checkpoints")
    local = sets.get("checkpoint.local.dir", "")
    local_base = local.split("{node}")[0].rstrip("/") if local else None
    nodes = 2 if launcher == "netns" else 1
    cmds = job_commands(a, leg, launcher, sets, tag.replace("/", "-"))
    log_paths = [run_dir + ".log"] + [f"{run_dir}.node{k}.log" for k in range(1, len(cmds))]
    os.makedirs(os.path.dirname(log_paths[0]), exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC_", "SHARDKIT_")) and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "GROUP_RANK", "GROUP_WORLD_SIZE")}

    def committed():
        steps = committed_steps([durable])
        if local_base:
            steps |= committed_steps([local_base]) if nodes == 1 else complete_local_steps(local_base, nodes)
        return steps

    logs = [open(p, "w") for p in log_paths]
    tail = MetricsTail(os.path.join(run_dir, "metrics.jsonl"))
    failures = []
    t_start = time.time()
    procs = []
    try:
        for cmd, log in zip(cmds, logs):
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                          env=env))
        attempt, training_since, trained_s, last_step, done = -1, None, 0.0, 0, False
        pending = list(kills or [])
        while any(p.poll() is None for p in procs):
            if time.time() - t_start > timeout:
                raise BenchError(f"{tag}: no end after {timeout:.0f} s (--timeout)")
            for r in tail.read():
                ev = r.get("event")
                if ev == "startup":
                    attempt = int(r.get("restart", 0))
                    training_since = None
                elif ev is None and "loss" in r:
                    last_step = r["step"]
                    if training_since is None and attempt >= len(failures):
                        # The attempt's first step: the schedule's clock runs.
                        training_since = utc_seconds(r["time"])
                    done = done or last_step >= a.steps
            if pending and training_since is not None and not done:
                if trained_s + time.time() - training_since >= pending[0][0]:
                    rank = pending[0][1]
                    pid = None
                    deadline = time.time() + 10
                    while pid is None and time.time() < deadline:
                        pid = next((w for p in procs for w in [worker_pid(p.pid, rank, attempt)] if w), None)
                        if pid is None:
                            time.sleep(0.05)
                    if pid is None:
                        raise BenchError(f"{tag}: no process of rank {rank}, attempt {attempt} to kill")
                    before = committed()
                    t_kill = time.time()
                    os.kill(pid, signal.SIGKILL)
                    trained_s += t_kill - training_since
                    training_since = None
                    pending.pop(0)
                    failures.append({"kill_time": t_kill, "rank": rank, "attempt": attempt,
                                     "trained_s": trained_s, "step_at_kill": last_step,
                                     "committed_before": max(before) if before else None})
            time.sleep(0.05)
        rcs = [p.wait() for p in procs]
    except BaseException:
        for p in procs:
            kill_tree(p)
        raise
    finally:
        for log in logs:
            log.close()
    wall = time.time() - t_start
    tail.read()
    for rc, log_path in zip(rcs, log_paths):
        if rc != 0:
            with open(log_path, errors="replace") as f:
                text = f.read()[-3000:]
            where = f" ({log_path})" if a.keep else ""
            raise BenchError(f"{tag}: a launcher exited with status {rc}; its log{where} ends:\n{text}")
    return {"wall_s": wall, "records": tail.records, "failures": failures, "log": log_paths[0], "run_dir": run_dir}


# --- checks and per-failure figures ---------------------------------------------

def losses(records, tag):
    out = {}
    for r in records:
        if r.get("event") is None and "loss" in r:
            out.setdefault(r["step"], r["loss"])
    return out


def check_finished(res, a, tag, expected_attempts):
    att = attempts(res["records"])
    if len(att) != expected_attempts:
        raise BenchError(f"{tag}: {len(att)} attempts in metrics.jsonl where {expected_attempts} were expected "
                         f"({expected_attempts - 1} kills): a restart nobody asked for, or a kill without one")
    end = att[-1]["end"]
    if not end or end.get("status") != "finished" or end.get("step") != a.steps:
        raise BenchError(f"{tag}: the run did not finish its {a.steps} steps (last record: {res['records'][-1:]})")
    return att


def check_losses(base, res, tag):
    """Every logged step's loss, redone ones included, against the fault-free
    run's, bit for bit. Returns the number of step records compared."""
    n = 0
    for r in res["records"]:
        if r.get("event") is not None or "loss" not in r:
            continue
        want = base.get(r["step"])
        if want is None:
            raise BenchError(f"{tag}: step {r['step']} is not in the fault-free run")
        if repr(r["loss"]) != repr(want):
            raise BenchError(f"{tag}: the loss of step {r['step']} differs: {r['loss']!r}, fault-free {want!r}")
        n += 1
    return n


def failure_figures(res, att, tag):
    """Per kill: the launcher's part, ours, the redone steps and the check
    that the newest committed checkpoint was resumed."""
    out = []
    for i, f in enumerate(res["failures"]):
        dead, new = att[i], att[i + 1]
        st = new["startup"]
        if st is None or not new["steps"]:
            raise BenchError(f"{tag}: attempt {i + 1} has no startup record or no step")
        if int(st.get("restart", -1)) != f["attempt"] + 1:
            raise BenchError(f"{tag}: kill {i + 1} hit attempt {f['attempt']}, but the next startup record says "
                             f"restart {st.get('restart')}")
        started = utc_seconds(st["time"]) - st["startup_s"]
        last = max((r["step"] for r in dead["steps"]), default=dead["start"]["step"])
        resumed = new["start"].get("resumed_step")
        resumed_step = new["start"]["step"] if resumed is None else resumed
        committed = f["committed_before"]
        if committed is not None and (resumed is None or resumed < committed):
            raise BenchError(f"{tag}: kill {i + 1}: step_{committed} was committed before the kill, but the "
                             f"restart resumed from {new['start'].get('resumed_from')!r} (step {resumed}): "
                             "a committed checkpoint was lost")
        # The first time the run logs the step it had reached again: in this
        # attempt, or a later one when the next kill came first.
        back = next((r for later in att[i + 1:] for r in later["steps"] if r["step"] >= last), None)
        out.append({
            "kill_time": f["kill_time"], "rank": f["rank"], "attempt": f["attempt"],
            "trained_s": round(f["trained_s"], 3), "step_at_kill": f["step_at_kill"],
            "last_step": last, "committed_before_kill": committed, "resumed_step": resumed_step,
            "resumed_from": new["start"].get("resumed_from"), "resumed_tier": new["start"].get("resumed_tier"),
            "steps_redone": last - resumed_step,
            "restart_s": started - f["kill_time"],
            "startup_s": st["startup_s"],
            "startup_phases": {k[:-2]: st.get(k) for k in STARTUP_PHASES},
            "first_step_s": utc_seconds(new["steps"][0]["time"]) - f["kill_time"],
            "back_s": utc_seconds(back["time"]) - f["kill_time"] if back else None,
        })
    return out


def lost_s(fails):
    """The time the failures cost: the union of the spans from each kill
    until the run is back at its step (a later kill may fall inside one)."""
    spans = sorted((f["kill_time"], f["kill_time"] + f["back_s"]) for f in fails if f["back_s"] is not None)
    total, end = 0.0, None
    for lo, hi in spans:
        if end is None or lo > end:
            total += hi - lo
            end = hi
        elif hi > end:
            total += hi - end
            end = hi
    return total


# --- the benchmark ---------------------------------------------------------------

def kill_schedule(seed, mtbf, horizon):
    """[(training seconds, rank)]: exponential gaps of mean mtbf, up to horizon."""
    rng = random.Random(f"{seed}/{mtbf}")
    out, t = [], 0.0
    while t < horizon:
        t += rng.expovariate(1.0 / mtbf)
        out.append((t, rng.randrange(2)))
    return out


def mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else None


def parse_args():
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", default=os.path.join(REPO, "build", "train"), help="the Debian 12 leg's train")
    ap.add_argument("--trixie-train", default=os.path.join(REPO, "build-trixie", "train"),
                    help="the trixie leg's train (built by scripts/trixie-leg)")
    ap.add_argument("--trixie-root", default=os.environ.get("SHARDKIT_TRIXIE_ROOT", TRIXIE_ROOT))
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "llama_tiny.yaml"))
    ap.add_argument("--leg", choices=["debian12", "trixie", "both"], default="debian12")
    ap.add_argument("--launcher", choices=["train", "torchrun", "netns", "both", "all"], default="both",
                    help="both: train and torchrun; all: also netns (two simulated nodes, Debian 12 leg)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="which configurations, comma-separated")
    ap.add_argument("--config-set", action="append", default=[], metavar="NAME:KEY=VALUE",
                    help="an override of configuration NAME (a new NAME adds a configuration)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override of every configuration")
    ap.add_argument("--mtbf", default="30,60,120", help="mean seconds between kills, comma-separated")
    ap.add_argument("--steps", type=int, default=2400)
    ap.add_argument("--seed", type=int, default=71)
    ap.add_argument("--quick", action="store_true", help="T = 30 s only and 1200 steps (unless given)")
    ap.add_argument("--max-restarts", type=int, default=1000)
    ap.add_argument("--monitor-interval", type=float, default=0.5, help="torchrun's --monitor_interval")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per job (default: 600 + 0.5 s per step for a fault-free job, and 3x "
                         "the fault-free wall time + 60 s per expected kill for a faulted one)")
    ap.add_argument("--json")
    ap.add_argument("--keep", action="store_true", help="keep the work directory and /dev/shm directories")
    a = ap.parse_args()
    given = set(x.split("=")[0] for x in sys.argv[1:])
    if a.quick:
        if "--mtbf" not in given:
            a.mtbf = "30"
        if "--steps" not in given:
            a.steps = 1200
    try:
        a.mtbfs = [float(x) for x in a.mtbf.split(",") if x]
    except ValueError:
        fail(f"--mtbf: not numbers: {a.mtbf}", 2)
    if not a.mtbfs or min(a.mtbfs) <= 0:
        fail("--mtbf: give at least one positive number", 2)
    if a.steps < 2:
        fail("--steps must be at least 2", 2)
    configs = {k: dict(v) for k, v in CONFIGS.items()}
    for cs in a.config_set:
        name, sep, kv = cs.partition(":")
        k, eq, v = kv.partition("=")
        if not sep or not eq or not name or not k:
            fail(f"--config-set: '{cs}' is not NAME:KEY=VALUE", 2)
        configs.setdefault(name, {})[k] = v
        if name not in a.configs.split(","):
            a.configs += "," + name
    for s in a.set:
        k, eq, v = s.partition("=")
        if not eq or not k:
            fail(f"--set: '{s}' is not KEY=VALUE", 2)
        for c in configs.values():
            c[k] = v
    a.config_list = [c for c in a.configs.split(",") if c]
    for c in a.config_list:
        if c not in configs:
            fail(f"--configs: unknown configuration '{c}' (one of {', '.join(configs)}, or add one with "
                 "--config-set)", 2)
    a.config_table = configs
    return a


def prepare_legs(a, work):
    legs = []
    names = ["debian12", "trixie"] if a.leg == "both" else [a.leg]
    for name in names:
        src = a.train if name == "debian12" else a.trixie_train
        if not os.access(src, os.X_OK):
            fail(f"{src}: not built ({'scripts/trixie-leg --build-only' if name == 'trixie' else 'cmake --build build'})", 2)
        d = os.path.join(work, name)
        os.makedirs(d)
        # Copies: a rebuild during the benchmark changes nothing it measures.
        shutil.copy2(src, os.path.join(d, "train"))
        shutil.copy2(a.config, os.path.join(d, "llama_tiny.yaml"))
        shutil.copy2(os.path.join(REPO, "scripts", "torchrun"), os.path.join(d, "torchrun"))
        root = None
        if name == "trixie":
            root = a.trixie_root
            if os.geteuid() != 0:
                fail("--leg trixie needs root (unshare -m, mount, chroot)", 2)
            if not os.path.isdir(os.path.join(root, "usr", "lib", "python3", "dist-packages", "torch")):
                fail(f"{root}: no trixie root with python3-torch (run scripts/trixie-leg --build-only)", 2)
        legs.append(Leg(name, os.path.join(d, "train"), d, root))
    return legs


def main():
    a = parse_args()
    launchers = {"both": ["train", "torchrun"], "all": ["train", "torchrun", "netns"]}.get(a.launcher, [a.launcher])
    a.nodes = None
    if "netns" in launchers and a.leg != "debian12":
        fail("--launcher netns (or all) runs on the Debian 12 leg only: inside the trixie root the simulated "
             "nodes' host names do not resolve; give --leg debian12", 2)
    work = tempfile.mkdtemp(prefix="goodput.")
    a.shm = tempfile.mkdtemp(prefix="goodput.", dir="/dev/shm")
    legs = []
    rows = []
    try:
        legs = prepare_legs(a, work)
        if "netns" in launchers:
            a.nodes = Nodes()
            a.nodes.setup()
        for leg in legs:
            for launcher in launchers:
                these = []
                for config in a.config_list:
                    these += bench_one(a, leg, launcher, config)
                # Against the first configuration's fault-free run: what the
                # job costs, a configuration's own steady overhead included.
                ref = next(r["fault_free_wall_s"] for r in these if r["config"] == a.config_list[0])
                for r in these:
                    r["reference_config"] = a.config_list[0]
                    r["goodput_vs_reference"] = ref / r["wall_s"]
                rows += these
    except BenchError as e:
        fail(str(e) + (f"\n(work directory kept: {work})" if a.keep else ""))
    finally:
        if a.nodes is not None:
            a.nodes.cleanup()
        for leg in legs:
            if leg.root:
                # The mount point the namespaces made for the work directory.
                shutil.rmtree(leg.root + work, ignore_errors=True) if not os.path.ismount(leg.root + work) else None
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(a.shm, ignore_errors=True)
        else:
            print(f"{PROG}: kept {work} and {a.shm}", file=sys.stderr)
    report(a, rows)
    return 0


def bench_one(a, leg, launcher, config):
    """The fault-free run and one faulted run per T of one configuration."""
    overrides = a.config_table[config]
    name = f"{leg.name}/{launcher}/{config}"
    timeout = a.timeout or 600 + 0.5 * a.steps
    print(f"{PROG}: {name}: fault-free, {a.steps} steps", file=sys.stderr, flush=True)
    base = run_job(a, leg, launcher, overrides, f"{leg.name}-{launcher}-{config}-base", timeout)
    check_finished(base, a, name + " fault-free", 1)
    base_losses = losses(base["records"], name)
    missing = [s for s in range(1, a.steps + 1) if s not in base_losses]
    if missing:
        raise BenchError(f"{name} fault-free: steps not logged: {missing[:10]}")
    rows = []
    for mtbf in a.mtbfs:
        tag = f"{name} T={mtbf:g}"
        expected = base["wall_s"] / mtbf
        timeout = a.timeout or 3 * base["wall_s"] + 60 * (expected + 2) + 120
        schedule = kill_schedule(a.seed, mtbf, 20 * base["wall_s"] + 10 * mtbf)
        print(f"{PROG}: {tag}: faulted run (about {expected:.1f} kills expected)", file=sys.stderr, flush=True)
        res = run_job(a, leg, launcher, overrides, f"{leg.name}-{launcher}-{config}-t{mtbf:g}", timeout,
                      schedule)
        att = check_finished(res, a, tag, len(res["failures"]) + 1)
        compared = check_losses(base_losses, res, tag)
        fails = failure_figures(res, att, tag)
        row = {"leg": leg.name, "launcher": launcher, "config": config, "mtbf_s": mtbf, "steps": a.steps,
               "kills": len(fails), "fault_free_wall_s": base["wall_s"], "wall_s": res["wall_s"],
               "goodput": base["wall_s"] / res["wall_s"],
               "goodput_accounted": 1 - lost_s(fails) / res["wall_s"],
               "restart_s": mean(f["restart_s"] for f in fails), "startup_s": mean(f["startup_s"] for f in fails),
               "startup_phases": {k[:-2]: mean(f["startup_phases"][k[:-2]] for f in fails) for k in STARTUP_PHASES}
               if fails else None,
               "steps_redone": mean(f["steps_redone"] for f in fails),
               "first_step_s": mean(f["first_step_s"] for f in fails), "back_s": mean(f["back_s"] for f in fails),
               "losses_bit_equal": True, "step_records_compared": compared, "committed_lost": 0,
               "libtorch": (att[0]["start"].get("libtorch")), "failures": fails}
        rows.append(row)
        print(f"{PROG}: {tag}: {len(fails)} kills, goodput {row['goodput']:.3f}, losses equal "
              f"({compared} step records), no committed checkpoint lost", file=sys.stderr, flush=True)
    return rows


def fmt(v, f="%.2f"):
    return "-" if v is None else f % v


def report(a, rows):
    head = ["leg", "launcher", "config", "T s", "kills", "fault-free s", "faulted s", "goodput", "accounted",
            f"vs {a.config_list[0]}", "restart s",
            "startup s", "load s", "resume s", "redone steps", "back s", "losses", "lost ckpts"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        ph = r["startup_phases"] or {}
        print("| " + " | ".join([r["leg"], r["launcher"], r["config"], f"{r['mtbf_s']:g}", str(r["kills"]),
                                 fmt(r["fault_free_wall_s"], "%.1f"), fmt(r["wall_s"], "%.1f"),
                                 fmt(r["goodput"], "%.3f"), fmt(r["goodput_accounted"], "%.3f"),
                                 fmt(r["goodput_vs_reference"], "%.3f"), fmt(r["restart_s"]), fmt(r["startup_s"]),
                                 fmt(ph.get("load")), fmt(ph.get("resume")), fmt(r["steps_redone"], "%.1f"),
                                 fmt(r["back_s"]), "bit-equal", "0"]) + " |")
    print(f"(goodput: the fault-free run's wall time over the faulted run's, same configuration; accounted: 1 -"
          f" the failures' back s over the faulted wall time; vs {a.config_list[0]}: {a.config_list[0]}'s fault-free"
          " wall time over this faulted run's. Per failure, means: restart: kill to the new process's start;"
          " startup: its start to its first step; back: kill until the step last logged before it is logged"
          " again)")
    for r in rows:
        for i, f in enumerate(r["failures"]):
            print(f"  {r['leg']}/{r['launcher']}/{r['config']} T={r['mtbf_s']:g} kill {i + 1}: rank {f['rank']} at "
                  f"{f['trained_s']:.1f} s of training (step {f['step_at_kill']}), restart {f['restart_s']:.2f} s, "
                  f"startup {f['startup_s']:.2f} s, resumed step {f['resumed_step']} "
                  f"({f['resumed_tier'] or 'durable'}; newest committed before the kill: "
                  f"{f['committed_before_kill']}), redone {f['steps_redone']}, back {fmt(f['back_s'])} s")
    result = {"benchmark": "goodput", "command": "bench/goodput.py " + " ".join(sys.argv[1:]),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "cores": os.cpu_count(), "load_average": os.getloadavg(), "seed": a.seed, "steps": a.steps,
              "mtbf_s": a.mtbfs, "monitor_interval": a.monitor_interval, "max_restarts": a.max_restarts,
              "configs": {c: a.config_table[c] for c in a.config_list}, "common": COMMON, "rows": rows}
    print(json.dumps(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
