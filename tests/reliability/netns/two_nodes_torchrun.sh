#!/usr/bin/env bash
# The real torchrun on two simulated nodes, node-local tier on: SIGKILL of a
# worker on node 1 after the first commit; both agents restart the group
# through the c10d rendezvous, which resumes from the newest committed
# checkpoint (the local tier's) and equals an uninterrupted run bit for bit.
#
#   two_nodes_torchrun.sh BUILD_DIR_OR_TRAIN_BINARY WORK_DIR
#
# Node K is a network namespace (netns_lib.sh) with address 10.x.y.(K+1) on
# eth0. In each, one torchrun agent (scripts/torchrun: Debian's
# python3-torch, 1.13 on Debian 12, 2.6 on Debian 13):
#   scripts/torchrun --nnodes 2 --nproc_per_node 1 --max_restarts R
#     --rdzv_backend c10d --rdzv_endpoint <node 0's address>:<port>
#     --rdzv_id <id> --monitor_interval 0.5 [--local_addr <node K's address>]
#     --no_python train --config configs/llama_tiny.yaml
#     --set 'checkpoint.local.dir="{run.dir}/local/node{node}"' ...
# with GLOO_SOCKET_IFNAME=eth0. Both agents share one run.dir (one file
# system, as a shared durable tier); each node's local tier is its own
# directory, local/node0 and local/node1.
#
# Node names. Every namespace shares the host's hostname (here "vm", which
# /etc/hosts maps to 127.0.0.1). torchrun 1.13's c10d rendezvous hands the
# workers MASTER_ADDR = socket.getfqdn(gethostname()) of the agent with group
# rank 0 (it has no --local_addr, and --master_addr is only read by the
# static backend), and decides whether an agent hosts the rendezvous store by
# matching the endpoint against the addresses its host name resolves to. With
# the shared hostname no agent hosts the store (both fail after the read
# timeout: "RendezvousConnectionError: The connection to the C10d store has
# failed"), and with --rdzv_conf is_host=1 on node 0 the workers get
# MASTER_ADDR=localhost, node 1's its own loopback. As on a real cluster,
# each node therefore gets its own name: /etc/netns/<namespace>/hosts, which
# `ip netns exec` mounts over /etc/hosts for that node only, maps node K's
# name node<K>.<ns-prefix> and the hostname to node K's address and lists
# the other nodes' names. That changes nothing outside the test's namespaces;
# the files are removed with them. On torchrun 2.x each agent also gets
# --local_addr (its node's address), as docs/training.md says.
#
# Checks:
#   1. An uninterrupted run (a 2-layer llama_tiny, 16 steps, an async
#      checkpoint every 4 steps, local tier on, every 2nd flushed to the
#      durable tier): both agents
#      exit 0, rank 0 finishes; both nodes' local dirs have committed steps;
#      the workers' MASTER_ADDR was node 0's name (the agent's log).
#   2. The same run with --max_restarts 2 in a fresh run.dir: once rank 0
#      logs the first committed checkpoint (step 4: local only), the worker
#      on node 1 is SIGKILLed. Both agents restart the group (the banner
#      says "restart 1"), which resumes from the newest committed step at
#      the time of the restart, from the local tier ("resume tier: local"),
#      and finishes; both agents exit 0; the durable tier has the flushed
#      steps 8 and 16.
#   3. Every step's loss (metrics.jsonl, the last logged for each step)
#      equals the uninterrupted run's, bit for bit.
#   4. No namespace and no /etc/netns entry of this test is left.
# Every wait is bounded (the uninterrupted job 150 s; the other 120 s to the
# first commit, 120 s to the restart, 150 s to the end: under the 600 s CTest
# timeout): a job that does not end is killed (its agents' process groups)
# and fails the test. 36 to 63 s on the 2-core Debian 12 machine.
# Exit status: 0 all passed; 1 a check failed; 2 usage; 77 skipped (not root,
# or no network namespaces here), printing "SKIP: <reason>" (stderr) and the
# project's skip marker "shardkit-skip: two_nodes_torchrun: <reason>"
# (stdout). A missing python3-torch fails the test: scripts/bootstrap.sh
# installs it.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../../.." && pwd)
# shellcheck source-path=SCRIPTDIR
source "$here/netns_lib.sh"

netns_parse_args two_nodes_torchrun "$@"
config=$repo/configs/llama_tiny.yaml
torchrun=$repo/scripts/torchrun
python=/usr/bin/python3

if ! netns_available; then
  echo "shardkit-skip: two_nodes_torchrun: $NETNS_SKIP_REASON"
  exit 77
fi
if ! torch_version=$("$python" -c 'import torch; print(torch.__version__)' 2>&1); then
  echo "FAIL: $python cannot import torch (python3-torch, from scripts/bootstrap.sh): $torch_version"
  exit 1
fi
torch_major=${torch_version%%.*}

timings=()
started=$(now)

# A tiny llama (2 layers, width 32, one micro-batch, no activation
# checkpointing): every collective crosses the veth, so fewer is faster.
steps=16
train_args=(--config "$config" --set train.log_every=1 --set train.eval_every=0
  --set "train.steps=$steps" --set train.global_batch_size=8 --set train.micro_batch_size=4
  --set model.n_layers=2 --set model.d_model=32 --set model.d_ff=96 --set model.seq_len=16
  --set model.activation_checkpointing=none --set checkpoint.mode=async --set checkpoint.interval=4
  --set checkpoint.keep_last=0 --set 'checkpoint.local.dir="{run.dir}/local/node{node}"'
  --set checkpoint.local.keep_last=0 --set checkpoint.durable.every=2 --set dist.timeout_s=30)

# Per-node names (see the header), written before any agent starts and
# removed by the EXIT/INT/TERM traps with the namespaces.
etc_netns_made=0
[[ -d /etc/netns ]] || etc_netns_made=1
remove_hosts_files() {  # idempotent: runs again from the EXIT trap
  local ns
  for ns in "${hosts_namespaces[@]}"; do rm -rf "/etc/netns/$ns"; done
  hosts_namespaces=()
  if ((etc_netns_made)); then
    rmdir /etc/netns 2>/dev/null || true
    etc_netns_made=0
  fi
  return 0
}
hosts_namespaces=()
cleanup_all() {
  stop_agents
  netns_cleanup
  remove_hosts_files
}
on_exit() {
  local rc=$?
  cleanup_all
  exit "$rc"
}

rm -rf "$work/a" "$work/b" "$work/logs"
mkdir -p "$work/logs"
NETNS_LOG_DIR=$work/logs  # read by netns_setup: keep the logs
netns_setup 2 1
prefix_pid=$$
namespaces=("${NETNS_NAMES[@]}")
agent_pids=()
stop_agents() {  # SIGKILL every agent's process group (idempotent)
  local pid
  for pid in "${agent_pids[@]}"; do kill -9 -- "-$pid" 2>/dev/null || true; done
  return 0
}
trap on_exit EXIT
trap 'cleanup_all; trap - EXIT; exit 130' INT
trap 'cleanup_all; trap - EXIT; exit 143' TERM

node_name() { echo "node$1.skns$prefix_pid"; }
for k in 0 1; do
  ns=${NETNS_NAMES[k]}
  mkdir -p "/etc/netns/$ns"
  hosts_namespaces+=("$ns")
  {
    echo "127.0.0.1 localhost"
    for j in 0 1; do
      if ((j == k)); then
        echo "${NETNS_ADDRS[j]} $(node_name "$j") $(uname -n)"
      else
        echo "${NETNS_ADDRS[j]} $(node_name "$j")"
      fi
    done
  } >"/etc/netns/$ns/hosts"
done
timings+=("setup $(seconds_since "$started") s")
echo "torch $torch_version; nodes: ${NETNS_NAMES[*]} at ${NETNS_ADDRS[*]} ($(node_name 0), $(node_name 1)); logs in $work/logs"

# start_agents NAME RUN_DIR MAX_RESTARTS: one agent per node, in the
# background, each the leader of its own process group; logs in
# $work/logs/NAME-node<K>.log. Sets agent_pids, run_id, agent_logs.
start_agents() {
  local name=$1 rundir=$2 restarts=$3 port k extra
  port=$(netns_free_port 0)
  run_id="skns$prefix_pid-$name-$RANDOM$RANDOM"
  agent_pids=()
  agent_logs=()
  for k in 0 1; do
    extra=()
    ((torch_major >= 2)) && extra=(--local_addr "${NETNS_ADDRS[k]}")
    agent_logs[k]=$work/logs/$name-node$k.log
    setsid ip netns exec "${NETNS_NAMES[k]}" env -u SHARDKIT_LAUNCHED -u SHARDKIT_STORE_HOSTED \
      -u SHARDKIT_JOB_ID GLOO_SOCKET_IFNAME="$NETNS_IFNAME" PYTHONUNBUFFERED=1 LOGLEVEL=INFO \
      "$python" "$torchrun" --nnodes 2 --nproc_per_node 1 --max_restarts "$restarts" \
      --rdzv_backend c10d --rdzv_endpoint "${NETNS_ADDRS[0]}:$port" --rdzv_id "$run_id" \
      --monitor_interval 0.5 "${extra[@]}" \
      --no_python "$train" "${train_args[@]}" --set "run.dir=$rundir" \
      >"${agent_logs[k]}" 2>&1 &
    agent_pids[k]=$!
  done
  echo "$name: agents ${agent_pids[*]}: $python $torchrun --nnodes 2 --nproc_per_node 1" \
    "--max_restarts $restarts --rdzv_backend c10d --rdzv_endpoint ${NETNS_ADDRS[0]}:$port" \
    "--rdzv_id $run_id --monitor_interval 0.5 ${extra[*]} --no_python $train ${train_args[*]}" \
    "--set run.dir=$rundir"
}

agents_running() {
  local pid
  for pid in "${agent_pids[@]}"; do kill -0 "$pid" 2>/dev/null && return 0; done
  return 1
}

# wait_agents TIMEOUT_S: waits for both agents (killing their process groups
# after TIMEOUT_S); sets agent_rcs.
wait_agents() {
  local deadline=$((SECONDS + $1)) k rc
  while agents_running && ((SECONDS < deadline)); do sleep 0.2; done
  if agents_running; then
    echo "agents still running after $1 s: killing their process groups" >&2
    stop_agents
  fi
  agent_rcs=()
  for k in 0 1; do
    rc=0
    wait "${agent_pids[k]}" || rc=$?
    agent_rcs[k]=$rc
  done
}

# losses RUN_DIR: "step loss" lines, the last loss logged for each step.
losses() {
  "$python" - "$1/metrics.jsonl" <<'EOF'
import json, sys
out = {}
with open(sys.argv[1]) as f:
    for line in f:
        j = json.loads(line)
        if "loss" in j and "step" in j and j.get("event") is None:
            out[j["step"]] = j["loss"]
for s in sorted(out):
    print(s, repr(out[s]))
EOF
}

# The steps a resume can load: committed in the durable tier, or complete in
# the local tiers (checkpoint/FORMAT.md, "State of a tier": every rank's
# file on the node that committed it, or as a partner copy on a node with a
# .partner.json). Here rank r is node r's one worker. A step that node 0
# committed locally while node 1's worker was being killed is not complete.
# Sorted, one a line.
committed_steps() {
  local meta step s r o ok
  for meta in "$1"/checkpoints/step_*/.metadata "$1"/local/node*/step_*/.metadata; do
    [[ -f $meta ]] || continue
    step=${meta%/.metadata}
    s=${step##*/step_}
    if [[ $meta == "$1"/local/* ]]; then
      ok=1
      for r in 0 1; do
        o=$((1 - r))
        [[ -f $1/local/node$r/step_$s/.metadata && -f $1/local/node$r/step_$s/rank_$r.data ]] && continue
        [[ -f $1/local/node$o/step_$s/.partner.json && -f $1/local/node$o/step_$s/.partner/rank_$r.data ]] && continue
        ok=0
      done
      ((ok)) || continue
    fi
    echo "$s"
  done | sort -n | uniq
}
newest_committed() { committed_steps "$1" | tail -n1; }

# worker_pid K: the pid of the train process in node K (the newest, if
# several), or nothing.
worker_pid() {
  local pid found=""
  for pid in $(ip netns pids "${NETNS_NAMES[$1]}" 2>/dev/null); do
    [[ $(readlink "/proc/$pid/exe" 2>/dev/null) == "$train" ]] && found=$pid
  done
  [[ -n $found ]] && echo "$found"
}

is_step() { [[ $1 =~ ^[0-9]+$ ]]; }
both_exited_0() { [[ ${agent_rcs[0]}-${agent_rcs[1]} == 0-0 ]]; }
log_has() { grep -qE -- "$2" "$1"; }
has_local_commits() { compgen -G "$1/local/node$2/step_*/.metadata" >/dev/null; }
same_losses() {
  [[ -s $1 ]] && cmp -s "$1" "$2" && (($(wc -l <"$1") == steps))
}

# 1: uninterrupted.
t=$(now)
start_agents a "$work/a" 0
wait_agents 150
timings+=("uninterrupted $(seconds_since "$t") s")
grep -h '^shardkit: world' "${agent_logs[0]}" | sed 's/^/a: /' || true
check "uninterrupted: both agents exited 0 (${agent_rcs[*]})" both_exited_0
check "uninterrupted: rank 0 finished at step $steps" log_has "${agent_logs[0]}" "finished at step $steps"
check "uninterrupted: 2 nodes x 1 worker under torchrun" log_has "${agent_logs[0]}" '^shardkit: world 2 \(torchrun'
check "uninterrupted: node 0's local tier has committed steps" has_local_commits "$work/a" 0
check "uninterrupted: node 1's local tier has committed steps" has_local_commits "$work/a" 1
if ((torch_major < 2)); then
  # torchrun 1.13 logs its rendezvous result with the master address.
  check "uninterrupted: the workers' MASTER_ADDR is node 0's name ($(node_name 0))" \
    log_has "${agent_logs[1]}" "master_addr=$(node_name 0)\$"
fi
losses "$work/a" >"$work/a-losses.txt" 2>/dev/null || true

# 2: SIGKILL of node 1's worker after the first commit.
t=$(now)
start_agents b "$work/b" 2
# Node 1's worker, found while rank 0 starts up, so that the kill lands
# right after the first commit (step 4: local only, not yet flushed).
victim=""
commit_line=""
for _ in $(seq 2400); do  # 120 s
  [[ -n $victim ]] || victim=$(worker_pid 1 || true)
  commit_line=$(grep -Em1 '^checkpoint step [0-9]+ \(async\) committed' "${agent_logs[0]}" || true)
  [[ -n $commit_line ]] && break
  agents_running || break
  sleep 0.05
done
if [[ -n $commit_line && -n $victim ]]; then
  kill -9 "$victim"
else
  victim=""
fi
echo "b: killed the worker on node 1 (rank 1, pid ${victim:-<none>}) with SIGKILL after: ${commit_line:-<no commit line>}"
# The newest step a resume can load, once the victim is dead: no step can
# become complete after that until the group restarts (node 1's files are
# final, and partner copies follow every node's local commit), and the
# restarted group resumes from it. (Sampled at the restarted rank 0's banner
# instead, the resumed run may already have committed a newer step: under
# load the banner reaches the log late.)
gone() { [[ ! -e /proc/$1 ]] || grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null; }
if [[ -n $victim ]]; then
  for _ in $(seq 200); do gone "$victim" && break; sleep 0.05; done
fi
at_kill=$(newest_committed "$work/b")
restarted=""
for _ in $(seq 1200); do  # 120 s
  restarted=$(grep -Em1 '^shardkit: world 2 .*restart 1' "${agent_logs[0]}" || true)
  [[ -n $restarted ]] && break
  agents_running || break
  sleep 0.1
done
wait_agents 150
timings+=("killed and restarted $(seconds_since "$t") s")
resumed=$(sed -n 's/^shardkit: resumed from .* (step \([0-9][0-9]*\).*/\1/p' "${agent_logs[0]}" | head -n1)
grep -hE '^shardkit: (world|resumed from|resume tier|resume:)' "${agent_logs[0]}" | sed 's/^/b: /' || true
check "restart: a checkpoint was committed and the node 1 worker was killed" test -n "$victim"
check "restart: both agents exited 0 (${agent_rcs[*]})" both_exited_0
check "restart: the group was restarted (restart 1)" test -n "$restarted"
check "restart: rank 0 finished at step $steps" log_has "${agent_logs[0]}" "finished at step $steps"
check "restart: resumed from step $resumed, the newest a resume could load once the worker was dead (${at_kill:-none})" \
  test -n "$resumed" -a "$resumed" = "${at_kill:-x}"
check "restart: resumed from the local tier" log_has "${agent_logs[0]}" '^shardkit: resume tier: local \('
if is_step "$resumed" && [[ ! -e $work/b/checkpoints/step_$resumed ]]; then
  echo "b: step_$resumed was in the local tiers only (not flushed to the durable tier)"
fi
# Every 2nd checkpoint is flushed: step 8 by the run that saves it after
# the restart, unless the kill landed after step 8's local commit (under
# load) and the resumed run never saves it again; step 16, the final save,
# always.
if is_step "$resumed" && ((resumed >= 8)); then
  check "restart: the durable tier has step_16 (the final save; resumed after step 8)" \
    test -f "$work/b/checkpoints/step_16/.metadata"
else
  check "restart: the durable tier has step_8 and step_16 (every 2nd checkpoint flushed)" \
    test -f "$work/b/checkpoints/step_8/.metadata" -a -f "$work/b/checkpoints/step_16/.metadata"
fi
check "restart: node 1's agent restarted its worker too" \
  log_has "${agent_logs[1]}" 'restart_count=1'
losses "$work/b" >"$work/b-losses.txt" 2>/dev/null || true
check "losses: all $steps steps equal the uninterrupted run's, bit for bit" \
  same_losses "$work/b-losses.txt" "$work/a-losses.txt"
if ! same_losses "$work/b-losses.txt" "$work/a-losses.txt"; then
  diff "$work/a-losses.txt" "$work/b-losses.txt" | head -n 10 || true
fi

# 4
cleanup_all
check "cleanup: no namespace left" bash -c "! ip netns list | awk '{print \$1}' | grep -Eq '^skns$prefix_pid(n[0-9]+|br)\$'"
check "cleanup: no /etc/netns entry left" bash -c "! ls -d /etc/netns/${namespaces[0]} /etc/netns/${namespaces[1]} 2>/dev/null"

echo "timings: ${timings[*]/%/;} total $(seconds_since "$started") s"
echo "two_nodes_torchrun: ${#passed[@]} passed, ${#failed[@]} failed (torchrun $torch_version)"
if ((${#failed[@]})); then
  printf 'FAIL: %s\n' "${failed[@]}"
  echo "FAIL (logs in $work/logs)"
  exit 1
fi
echo "PASS"
