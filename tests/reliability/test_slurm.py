#!/usr/bin/python3
"""train under a real SLURM: srun trains and resumes; a batch job stopped with
scancel --signal=TERM saves, exits 75, requeues itself and resumes.

The cluster is real and on this machine: munged, slurmctld and slurmd from
Debian 12's slurmd, slurmctld, slurm-client and munge packages (22.05),
started by scripts/slurm-cluster under a temporary directory (SLURM_CONF
points there; /etc/slurm is not used), one node declared with 4 CPUs (two
2-task jobs at once; the machine may have fewer), no cgroups.

1. `srun -N1 -n2 build/train --config configs/llama_tiny.yaml` (20 steps,
   checkpoint every 10): the banner says the ranks saw SLURM, the run
   finishes, `ckpt list` shows step 20 committed and `ckpt verify` passes.
   A second srun with train.steps 30 resumes from step_20 and finishes.
2. sbatch --requeue of a script that runs `srun build/train ...` (80 steps,
   checkpoint every 10) and, when train exits 75, requeues its own job
   (`scontrol requeue $SLURM_JOB_ID`). After the first commit (step 10) the
   test sends `scancel --signal=TERM <job>`: SLURM signals the job's steps,
   not the batch shell, so each task gets one SIGTERM, finishes its step,
   saves (checkpoint.save_on_signal) and exits 75; srun exits 75. The job
   requeues itself, starts again (SLURM_RESTART_COUNT 1), resumes from the
   checkpoint the signal made and finishes; the job ends COMPLETED with
   Restarts=1 and ExitCode 0:0, and that checkpoint verifies.
3. Two `srun -N1 -n2 build/train` jobs (3 steps each, own run dirs) at once on
   the one node, MASTER_PORT unset: rank 0 of each serves its store on
   15000 + the last four digits of its SLURM_JOB_ID, which the banner shows
   ("store HOST:PORT, port from SLURM_JOB_ID=ID"); the ports differ, squeue
   showed both jobs running at one time, and both finish. (Before ports
   were derived from the job id, both took 29500 and collided.)
The cluster is stopped in a `finally`.

Skipped (exit 77, "shardkit-skip: slurm: <reason>") only where SLURM cannot
run: its binaries are missing (the Debian 13 leg's root has none: this test
runs on the Debian 12 leg, where scripts/bootstrap.sh installs them), not
root (slurmd launches the tasks), or a daemon exits while starting
(scripts/slurm-cluster exit 3: the reason is the daemon's log). Anything else
fails (exit 1). Every wait is bounded.
"""
import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

SLURM_BINARIES = ["munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol", "scancel", "sinfo", "squeue"]
STEPS_BATCH = 80
STEPS_TOGETHER = 3


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def skip(reason):
    print("shardkit-skip: slurm: " + reason)
    sys.exit(77)


# Every wait before the cluster's stop ends by then, so that ctest's TIMEOUT
# (900 s) never kills the test before its `finally` stops the daemons.
DEADLINE = time.time() + 600


def bounded(timeout):
    return max(5, min(timeout, DEADLINE - time.time()))


def run(cmd, timeout, env):
    """The command's result; on a timeout, its whole process group is killed
    and the test fails showing what it printed."""
    timeout = bounded(timeout)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env=env)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        fail(f"no end after {timeout:.0f} s: {' '.join(cmd)}\n{(out + err)[-5000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_args(build, source, rundir, steps):
    return [os.path.join(build, "train"), "--config", os.path.join(source, "configs", "llama_tiny.yaml"),
            "--set", "run.dir=" + rundir, "--set", f"train.steps={steps}", "--set", "train.log_every=1",
            "--set", "train.eval_every=0", "--set", "checkpoint.interval=10", "--set", "checkpoint.keep_last=0"]


def run_together(cmds, logs, timeout, env):
    """Starts every command at once, each writing stdout and stderr to its log
    file, and waits for all. Returns the most SLURM jobs that squeue showed
    running at one time. When one fails, or on a timeout, kills the others
    (a rank left without its peers would wait for them until dist.timeout_s)
    and fails showing what they printed."""
    timeout = bounded(timeout)
    procs = []
    for cmd, log in zip(cmds, logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env))
    deadline, most = time.time() + timeout, 0
    while any(p.poll() is None for p in procs):
        failed = [p.returncode for p in procs if p.poll() not in (None, 0)]
        if failed or time.time() > deadline:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            for p in procs:
                p.wait()
            why = f"status {failed[0]}" if failed else f"no end after {timeout:.0f} s"
            fail(f"{why}: {' '.join(cmds[0])} (and {len(cmds) - 1} more at once)\n"
                 + "\n---\n".join(read(log)[-2500:] for log in logs))
        q = subprocess.run(["squeue", "-h", "-t", "R", "-o", "%i"], capture_output=True, text=True, env=env,
                           timeout=10)
        most = max(most, len(q.stdout.split()))
        time.sleep(0.5)
    if any(p.returncode != 0 for p in procs):
        fail(f"statuses {[p.returncode for p in procs]}: {' '.join(cmds[0])} (and {len(cmds) - 1} more at once)\n"
             + "\n---\n".join(read(log)[-2500:] for log in logs))
    return most


def job_fields(job, env):
    """scontrol show job's KEY=VALUE fields, or {} once the job is gone."""
    r = run(["scontrol", "show", "job", "-o", str(job)], 30, env)
    if r.returncode != 0:
        return {}
    return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", r.stdout))


def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def wait_for(what, predicate, timeout, show):
    timeout = bounded(timeout)
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.2)
    fail(f"{what}: not within {timeout:.0f} s\n{show()[-5000:]}")


def ckpt_check(build, ckdir, step, env):
    """`ckpt list` shows step_<step> committed and `ckpt verify` passes."""
    ckpt = os.path.join(build, "ckpt")
    ls = run([ckpt, "list", ckdir], 60, env)
    row = [l for l in ls.stdout.splitlines()
           if l.split()[:2] == [str(step), "committed"] and l.split()[-1].endswith(f"step_{step}")]
    if ls.returncode != 0 or not row:
        fail(f"ckpt list {ckdir}: status {ls.returncode}, no committed step {step}:\n{ls.stdout}{ls.stderr}")
    v = run([ckpt, "verify", os.path.join(ckdir, f"step_{step}")], 60, env)
    if v.returncode != 0:
        fail(f"ckpt verify step_{step}: status {v.returncode}\n{v.stdout}{v.stderr}")
    print(f"ckpt list: {row[0].strip()}; ckpt verify step_{step}: OK")


def main():
    global DEADLINE
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--source", required=True)
    args = ap.parse_args()
    build, source = os.path.abspath(args.build), os.path.abspath(args.source)

    missing = [b for b in SLURM_BINARIES if shutil.which(b) is None]
    if missing:
        skip(f"{' '.join(missing)} not installed; this test runs on the Debian 12 leg only, where "
             "scripts/bootstrap.sh installs slurmd slurmctld slurm-client munge")
    if os.geteuid() != 0:
        skip("not root: slurmd (SlurmdUser=root) launches the tasks")
    for b in ("train", "ckpt"):
        if not os.access(os.path.join(build, b), os.X_OK):
            fail(f"{os.path.join(build, b)} is not built")

    t_start = time.time()
    work = tempfile.mkdtemp(prefix="shardkit_slurm_")
    cluster = os.path.join(work, "cluster")
    script = os.path.join(source, "scripts", "slurm-cluster")
    env = dict(os.environ)
    env["SLURM_CONF"] = os.path.join(cluster, "slurm.conf")
    ok = False
    try:
        r = run([script, "start", cluster], 150, env)
        if r.returncode == 3:
            lines = r.stderr.splitlines()
            why = lines[:1] + [l.strip() for l in lines[1:] if re.search(r"error|fatal", l, re.I)][-3:]
            skip("a daemon refused to run here: " + " | ".join(why))
        if r.returncode != 0:
            fail(f"scripts/slurm-cluster start: status {r.returncode}\n{r.stdout}{r.stderr}")
        print(r.stdout.strip())

        # 1. srun: train, checkpoint, resume.
        a_dir = os.path.join(work, "a")
        # --immediate: fail rather than wait in the queue when the node is not free.
        srun = ["srun", "--immediate=60", "-N1", "-n2", "--ntasks-per-node=2"]
        # Rank 0 serves the rendezvous store on MASTER_PORT (29500 when
        # unset): a free one, so that tests beside this one cannot collide.
        env["MASTER_PORT"] = str(free_port())
        t0 = time.time()
        a = run(srun + train_args(build, source, a_dir, 20), 240, env)
        out = a.stdout + a.stderr
        if a.returncode != 0 or "finished at step 20" not in out:
            fail(f"srun train, 20 steps: status {a.returncode}\n{out[-4000:]}")
        banner = [l for l in out.splitlines() if "shardkit: world 2" in l]
        print(f"srun: {banner[0].strip() if banner else '(no banner)'} ({time.time() - t0:.1f} s)")
        if not banner or "(slurm, " not in banner[0]:
            fail("the ranks did not see SLURM's environment:\n" + out[-3000:])
        ckpt_check(build, os.path.join(a_dir, "checkpoints"), 20, env)
        env["MASTER_PORT"] = str(free_port())
        t0 = time.time()
        b = run(srun + train_args(build, source, a_dir, 30), 240, env)
        out = b.stdout + b.stderr
        resumed = [l for l in out.splitlines() if "resumed from" in l]
        if b.returncode != 0 or "finished at step 30" not in out or not resumed or "(step 20" not in resumed[0]:
            fail(f"second srun, 30 steps: status {b.returncode}, did not resume from step 20 and finish\n"
                 f"{out[-4000:]}")
        print(f"srun again: {resumed[0].strip()}; finished at step 30 ({time.time() - t0:.1f} s)")

        # 2. sbatch --requeue; scancel --signal=TERM after the first commit.
        c_dir = os.path.join(work, "c")
        log = os.path.join(work, "job.out")
        job_sh = os.path.join(work, "job.sh")
        with open(job_sh, "w") as f:
            f.write("#!/bin/bash\n"
                    'echo "job $SLURM_JOB_ID start, SLURM_RESTART_COUNT=${SLURM_RESTART_COUNT:-0}"\n'
                    "export MASTER_PORT=$(python3 -c 'import socket; s = socket.socket(); "
                    's.bind(("127.0.0.1", 0)); print(s.getsockname()[1])\')\n'
                    "srun " + " ".join(train_args(build, source, c_dir, STEPS_BATCH)) + "\n"
                    "rc=$?\n"
                    'echo "train exited $rc"\n'
                    '[ "$rc" -eq 75 ] && scontrol requeue "$SLURM_JOB_ID"\n'
                    "exit $rc\n")
        os.chmod(job_sh, 0o755)
        s = run(["sbatch", "--parsable", "--requeue", "-N1", "-n2", "--ntasks-per-node=2", "--open-mode=append",
                 "-o", log, "-D", work, job_sh], 60, env)
        if s.returncode != 0 or not s.stdout.strip().split(";")[0].isdigit():
            fail(f"sbatch: status {s.returncode}\n{s.stdout}{s.stderr}")
        job = int(s.stdout.strip().split(";")[0])
        print(f"sbatch --requeue: job {job}")
        show = lambda: read(log) + "\n" + str(job_fields(job, env))
        wait_for("the batch job's first commit (step 10)",
                 lambda: re.search(r"checkpoint step 10 \S+ committed", read(log)), 240, show)
        sc = run(["scancel", "--signal=TERM", str(job)], 30, env)
        if sc.returncode != 0:
            fail(f"scancel --signal=TERM {job}: status {sc.returncode}\n{sc.stdout}{sc.stderr}")
        print(f"scancel --signal=TERM {job} after the step-10 commit")
        m = wait_for("train's exit after SIGTERM", lambda: re.search(r"train exited (\d+)", read(log)), 120, show)
        first = read(log)
        stopped = re.search(r"stopped by signal at step (\d+)", first)
        if m.group(1) != "75" or not stopped:
            fail(f"after scancel --signal=TERM, train exited {m.group(1)} (want 75, stopped by signal)\n"
                 f"{first[-4000:]}")
        step = int(stopped.group(1))
        if not re.search(rf"checkpoint step {step} \S+ committed", first):
            fail(f"no checkpoint committed at step {step}, where the signal stopped the run\n{first[-4000:]}")
        ends = [json.loads(l) for l in read(os.path.join(c_dir, "metrics.jsonl")).splitlines()
                if '"event":"end"' in l.replace(" ", "")]
        if not ends or ends[-1].get("status") != "stopped" or ends[-1].get("step") != step:
            fail(f"metrics.jsonl: the last end record is {ends[-1:] or 'missing'}; want status stopped, step {step}")
        print(f"tasks stopped by SIGTERM at step {step}, saved it, exited 75 "
              f"({[l.strip() for l in first.splitlines() if 'exit code' in l]})")
        if step >= STEPS_BATCH:
            fail(f"the signal came too late: the run reached its last step {step}")

        def done():
            j = job_fields(job, env)
            return j if j.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                              "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED") else None
        j = wait_for("the requeued job's end", done, 300, show)
        out = read(log)
        restarted = out.split("SLURM_RESTART_COUNT=1", 1)[1] if "SLURM_RESTART_COUNT=1" in out else ""
        resumed = [l for l in restarted.splitlines() if "resumed from" in l]
        if (j.get("JobState") != "COMPLETED" or j.get("Restarts") != "1" or j.get("ExitCode") != "0:0"
                or not resumed or f"step_{step} (step {step}" not in resumed[0]
                or f"finished at step {STEPS_BATCH}" not in restarted or "train exited 0" not in restarted):
            fail(f"the requeued job: JobState={j.get('JobState')} Restarts={j.get('Restarts')} "
                 f"ExitCode={j.get('ExitCode')}; want COMPLETED, 1, 0:0, resumed from step_{step} and "
                 f"finished at step {STEPS_BATCH}\n{out[-5000:]}")
        print(f"requeued (SLURM_RESTART_COUNT=1): {resumed[0].strip()}")
        print(f"job {job}: JobState={j['JobState']} Restarts={j['Restarts']} ExitCode={j['ExitCode']}")
        ckpt_check(build, os.path.join(c_dir, "checkpoints"), step, env)

        # 3. Two srun jobs at once on the one node, MASTER_PORT unset: each
        # rank 0 serves its store on the port its job id gives.
        alone = {k: v for k, v in env.items() if k != "MASTER_PORT"}
        runs = [os.path.join(work, name) for name in ("d", "e")]
        logs = [os.path.join(work, name + ".out") for name in ("d", "e")]
        cmds = [srun + train_args(build, source, d, STEPS_TOGETHER) + ["--set", "checkpoint.interval=0"]
                for d in runs]
        t0 = time.time()
        most = run_together(cmds, logs, 240, alone)
        outs = [read(log) for log in logs]
        if any(f"finished at step {STEPS_TOGETHER}" not in out for out in outs):
            fail(f"two sruns at once without MASTER_PORT: not both finished at step {STEPS_TOGETHER}\n"
                 + "\n---\n".join(o[-3000:] for o in outs))
        if most < 2:
            fail(f"the two srun jobs did not run at the same time (squeue showed at most {most} running)")
        stores = []
        for out in outs:
            m = re.search(r"shardkit: world 2 \(slurm, store \S+:(\d+), port from SLURM_JOB_ID=(\d+)\)", out)
            if not m or int(m.group(1)) != 15000 + int(m.group(2)[-4:]):
                fail("the banner does not show a port from SLURM_JOB_ID (15000 + its last four digits):\n"
                     + out[-3000:])
            stores.append(m.groups())
        if stores[0][0] == stores[1][0]:
            fail(f"both jobs served their store on port {stores[0][0]}")
        print("two sruns at once: " + ", ".join(f"job {j} port {p}" for p, j in stores)
              + f"; both finished at step {STEPS_TOGETHER} ({time.time() - t0:.1f} s)")
        ok = True
    finally:
        if not ok:
            for name in ("slurmctld.log", "slurmd.log"):
                lines = [l for l in read(os.path.join(cluster, "log", name)).splitlines() if "pmix" not in l]
                print(f"--- the last lines of {name}:\n" + "\n".join(lines[-15:]))
        DEADLINE = time.time() + 120  # the stop's own bound, whatever is left
        r = run([script, "stop", cluster], 120, env)
        if r.returncode != 0:
            print(f"scripts/slurm-cluster stop: status {r.returncode}\n{r.stdout}{r.stderr}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if r.returncode != 0:
        fail(f"the cluster in {cluster} did not stop")
    print(f"OK ({time.time() - t_start:.1f} s)")


if __name__ == "__main__":
    main()
