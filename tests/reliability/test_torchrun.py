#!/usr/bin/python3
"""train under the real torchrun: the elastic agent restarts the group after a
rank dies, and the run resumes bit for bit.

torchrun is Debian's python3-torch's (torch.distributed.run), started through
scripts/torchrun, which fixes two defaults of Debian's packages and changes
nothing else: Debian 13's torch 2.6 has no libuv, which torchrun's stores ask
for; Debian 12's 1.13 under Python 3.11 cannot parse --redirects/--tee "0".
`--no_python` starts our binary. 1.13 on the Debian 12 leg, 2.6 on the
Debian 13 leg.

1. An uninterrupted run: llama_tiny, 2 workers, c10d rendezvous.
2. The same with --max_restarts 2: after the first committed checkpoint one
   worker (rank 1) is killed with SIGKILL. The agent stops the other, starts
   the group again (TORCHELASTIC_RESTART_COUNT 1), which resumes from the
   newest committed checkpoint and finishes; the agent exits 0.
3. Every step's loss of run 2 (the last logged for each step) equals run 1's,
   bit for bit.
On torchrun 2.x the agent serves the store (TORCHELASTIC_USE_AGENT_STORE):
the banner must say the ranks used it.
4. Rank 0 refused (the run directory is held by another job): the job ends
   within 60 s naming why; rank 1 does not wait out the rendezvous timeout,
   and on 2.x it stops at once on the agent's SIGTERM, saying so (before
   its first step a rank has nothing to save), not after the agent's 30 s.

Never skipped: python3-torch comes with scripts/bootstrap.sh (and the Debian
13 root's package list).
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time


ENV = dict(os.environ)


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def run(cmd, timeout):
    """The command's result; on a timeout, its whole process group is killed
    and the test fails showing what it printed."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env=ENV)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        fail(f"no end after {timeout} s: {' '.join(cmd)}\n{(out + err)[-5000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_major():
    r = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                       text=True)
    if r.returncode != 0:
        fail("python3 cannot import torch (python3-torch): " + r.stderr)
    return int(r.stdout.split(".")[0]), r.stdout.strip()


def torchrun_cmd(major, run_id, restarts, build, source, rundir, steps):
    cmd = [sys.executable, os.path.join(source, "scripts", "torchrun"), "--nproc_per_node", "2",
           "--max_restarts", str(restarts), "--rdzv_id", run_id, "--monitor_interval", "0.5",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}"]
    if major >= 2:
        # The agent gives the workers its own address for its store: its host
        # name, which the Debian 13 root cannot resolve. (1.13 has no flag.)
        cmd += ["--local_addr", "127.0.0.1"]
    return cmd + ["--no_python", os.path.join(build, "train"), "--config",
                  os.path.join(source, "configs", "llama_tiny.yaml"), "--set", "run.dir=" + rundir,
                  "--set", f"train.steps={steps}", "--set", "train.log_every=1", "--set", "train.eval_every=0",
                  "--set", "checkpoint.interval=10"]


def losses(rundir):
    """step -> the loss last logged for it (a restarted run logs some again)."""
    out = {}
    with open(os.path.join(rundir, "metrics.jsonl")) as f:
        for line in f:
            j = json.loads(line)
            if "loss" in j and "step" in j and j.get("event") is None:
                out[j["step"]] = j["loss"]
    return out


def pid_of_rank(run_id, rank):
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"TORCHELASTIC_RUN_ID={run_id}".encode() in env and f"RANK={rank}".encode() in env:
            return int(pid)
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--source", required=True)
    args = ap.parse_args()
    build, source = os.path.abspath(args.build), os.path.abspath(args.source)
    major, version = torch_major()
    steps = 30
    with tempfile.TemporaryDirectory(prefix="shardkit_torchrun_") as work:
        a_dir = os.path.join(work, "a")
        a = run(torchrun_cmd(major, f"shardkit-a-{os.getpid()}", 0, build, source, a_dir, steps), 180)
        if a.returncode != 0 or f"finished at step {steps}" not in a.stdout:
            fail(f"torchrun {version}, uninterrupted run: status {a.returncode}\n{(a.stdout + a.stderr)[-4000:]}")
        banner = [l for l in a.stdout.splitlines() if "shardkit: world 2" in l]
        print(f"torchrun {version}: " + (banner[0] if banner else "(no banner)"))
        if not banner or "(torchrun" not in banner[0]:
            fail("the workers did not see torchrun's environment: " + a.stdout[-3000:])
        if major >= 2 and "the agent's store" not in banner[0]:
            fail("torchrun 2.x serves the store from its agent, and the ranks did not use it: " + banner[0])
        want = losses(a_dir)

        b_dir = os.path.join(work, "b")
        run_id = f"shardkit-b-{os.getpid()}"
        p = subprocess.Popen(torchrun_cmd(major, run_id, 2, build, source, b_dir, steps), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True, env=ENV)
        seen, killed = [], None
        deadline = time.time() + 400
        for line in p.stdout:
            seen.append(line)
            if killed is None and "checkpoint step 10 (async) committed" in line:
                pid = pid_of_rank(run_id, 1)
                if pid is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    fail("no worker with RANK=1 found in /proc")
                os.kill(pid, signal.SIGKILL)
                killed = pid
                print(f"killed rank 1 (pid {pid}) with SIGKILL after: {line.strip()}")
            if time.time() > deadline:
                os.killpg(p.pid, signal.SIGKILL)
                fail("the restarted run did not finish in 400 s: " + "".join(seen[-40:]))
        status = p.wait()
        out = "".join(seen)
        if killed is None:
            fail("the run never committed step 10: " + out[-4000:])
        if status != 0 or f"finished at step {steps}" not in out:
            fail(f"after the kill, torchrun exited {status}: " + out[-4000:])
        resumed = [l for l in out.splitlines() if "resumed from" in l]
        restarted = [l for l in out.splitlines() if "shardkit: world 2" in l and "restart 1" in l]
        if not resumed or not restarted:
            fail("the agent's second attempt did not resume: " + out[-4000:])
        print(restarted[0].strip())
        print(resumed[0].strip())
        got = losses(b_dir)
        if sorted(got) != sorted(want):
            fail(f"steps logged differ: {sorted(got)} vs {sorted(want)}")
        differ = [s for s in want if got[s] != want[s]]
        if differ:
            fail(f"losses differ from the uninterrupted run at steps {differ}: "
                 f"{[(s, got[s], want[s]) for s in differ[:5]]}")
        print(f"all {len(want)} steps' losses equal the uninterrupted run's, bit for bit")

        # Rank 0 refused (its run directory is another job's): the whole job
        # ends at once, naming why, rather than rank 1 waiting out the
        # rendezvous timeout (dist.timeout_s, 300 s by default).
        busy = os.path.join(work, "busy")
        os.makedirs(busy)
        holder = subprocess.Popen(["flock", "-x", os.path.join(busy, ".lock"), "sleep", "300"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        time.sleep(0.5)
        t0 = time.time()
        r = run(torchrun_cmd(major, f"shardkit-c-{os.getpid()}", 0, build, source, busy, steps), 180)
        took = time.time() - t0
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
        if r.returncode == 0 or "is in use by another job" not in r.stdout + r.stderr or took > 60:
            fail(f"a busy run directory: status {r.returncode} after {took:.1f} s: {(r.stdout + r.stderr)[-3000:]}")
        # torchrun 2.x's agent serves the store: rank 1 waits there for rank
        # 0 until the agent's SIGTERM, which it must act on at once (before
        # its first step there is nothing to save), not after the agent's
        # 30 s wait for SIGKILL. (1.13: rank 0 served the store, and rank 1
        # fails when it goes.)
        if major >= 2 and "train: rank 1: stopped by signal 15 before its first step" not in r.stdout + r.stderr:
            fail(f"rank 1 did not stop at once on the agent's SIGTERM ({took:.1f} s): "
                 f"{(r.stdout + r.stderr)[-3000:]}")
        print(f"rank 0 refused a busy run directory: the job ended in {took:.1f} s (status {r.returncode})")
    print("OK")


if __name__ == "__main__":
    main()
