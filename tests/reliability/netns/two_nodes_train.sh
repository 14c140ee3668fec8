#!/usr/bin/env bash
# Two simulated nodes x two ranks train over a real interface and resume.
#
#   two_nodes_train.sh BUILD_DIR_OR_TRAIN_BINARY WORK_DIR
#
# Node K is a network namespace (netns_lib.sh) with address 10.x.y.(K+1) on
# eth0; each rank gets torchrun's environment with MASTER_ADDR = node 0's
# eth0 address and GLOO_SOCKET_IFNAME=eth0. Checks:
#   1. 4 ranks train 20 steps; all exit 0; step_20 is committed (.metadata).
#   2. Node 1's ranks held TCP connections to node 0's address on ports other
#      than the rendezvous port: Gloo pairs across the veth, seen with ss.
#      Loopback could not have carried them anyway: each namespace has its
#      own lo, so node 1 reaches nothing of node 0's but 10.x.y.1 (with
#      MASTER_ADDR=127.0.0.1 node 1's ranks time out connecting to the
#      store), and a job that trained at all used the veth.
#   3. A second job on the same run.dir resumes from step_20 ("resumed from"
#      in its output) and commits step_30.
#   4. Losing node 1 (SIGKILL of everything in it) mid-training: its ranks
#      die (137) and node 0's ranks fail (their connections close) instead of
#      hanging.
#   5. No namespace of this test is left after its cleanup.
#   6. A job whose ranks fail (a config file that does not exist) leaves no
#      namespace behind: the EXIT trap cleans up.
#   7. A test process stopped with SIGTERM mid-training leaves no namespace
#      and no rank process behind.
# Exit status: 0 all passed; 1 a check failed; 2 usage; 77 skipped (not root,
# or no network namespaces here), printing "SKIP: <reason>" (stderr) and the
# project's skip marker "shardkit-skip: two_nodes_train: <reason>" (stdout).
# Under ctest, register it with SKIP_REGULAR_EXPRESSION "shardkit-skip:"
# (which applies whatever the exit status), not SKIP_RETURN_CODE 77:
# scripts/check-skips refuses skip return codes.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../../.." && pwd)
# shellcheck source-path=SCRIPTDIR
source "$here/netns_lib.sh"

netns_parse_args two_nodes_train "$@"
config=$repo/configs/default.yaml

if ! netns_available; then
  echo "shardkit-skip: two_nodes_train: $NETNS_SKIP_REASON"
  exit 77
fi

started=$SECONDS

# Short: ~20 steps of the default small GPT, a checkpoint every 5 steps.
train_args=(--config "$config" --set "run.dir=$work/run" --set train.log_every=5
  --set train.eval_every=0 --set checkpoint.interval=5 --set dist.timeout_s=60)

start_job() {  # start_job STEPS: all 4 ranks
  local k r
  for k in 0 1; do
    for r in 0 1; do
      netns_start_rank "$k" "$r" "$train" "${train_args[@]}" --set "train.steps=$1"
    done
  done
}

committed() { [[ -f $work/run/checkpoints/step_$1/.metadata ]]; }

grep_logs() { grep -q -- "$1" "${NETNS_RANK_LOGS[@]}"; }
not_resumed() { ! grep_logs "resumed from"; }

failed_by_themselves() {  # exit codes of ranks $@: an error, not success nor SIGKILL
  local rank
  for rank in "$@"; do
    [[ ${NETNS_RANK_RCS[rank]} != 0 && ${NETNS_RANK_RCS[rank]} != 137 ]] || return 1
  done
}

no_rank_left() {  # of the SIGTERM child, whose rank pids are in term-run.pids
  local pid pids
  [[ -s $work/term-run.pids ]] || return 1
  read -ra pids <"$work/term-run.pids"
  for pid in "${pids[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then return 1; fi
  done
}

ours_gone() { ! ip netns list | awk '{print $1}' | grep -Eq "^skns$1(n[0-9]+|br)$"; }

rm -rf "$work/run" "$work/loss-run" "$work/logs" "$work/term-run" "$work/term-run.pids" "$work/term-logs"
mkdir -p "$work/logs"
NETNS_LOG_DIR=$work/logs  # read by netns_setup: keep the logs
netns_setup 2 2
prefix_pid=$$
echo "nodes: ${NETNS_NAMES[*]} at ${NETNS_ADDRS[*]} (${NETNS_IFNAME}); logs in $work/logs"

# 1 and 2: a fresh job.
rm -f "$work/stop-sampling" "$work/connections"
start_job 20
port=$NETNS_MASTER_PORT
netns_sample_tcp_peers 1 "$work/stop-sampling" "$work/connections" &
sampler=$!
job1_ok=0
netns_wait_ranks 180 && job1_ok=1
touch "$work/stop-sampling"
wait "$sampler" || true
check "job 1: all 4 ranks exited 0" test "$job1_ok" = 1
check "job 1: step_20 committed" committed 20
check "job 1: did not resume" not_resumed
check "job 1: node 1 talked to node 0 (${NETNS_ADDRS[0]}) beyond the store port $port" \
  netns_connected_beyond_port "$work/connections" 1 0 "$port"

# 3: the same run.dir again, 10 more steps.
job2_ok=0
start_job 30
netns_wait_ranks 180 && job2_ok=1
check "job 2: all 4 ranks exited 0" test "$job2_ok" = 1
check "job 2: resumed from step_20" grep_logs "resumed from .*step_20"
check "job 2: step_30 committed" committed 30

# 4: lose node 1 in a third job (its own run.dir) once rank 0 has trained.
for k in 0 1; do
  for r in 0 1; do
    netns_start_rank "$k" "$r" "$train" --config "$config" --set "run.dir=$work/loss-run" \
      --set train.steps=100000 --set train.log_every=5 --set checkpoint.interval=0
  done
done
for _ in $(seq 600); do
  grep -qs "^step 5/" "${NETNS_RANK_LOGS[0]}" && break
  sleep 0.1
done
netns_kill_node 1
lost_at=$SECONDS
# Killed by netns_wait_ranks after 90 s (137), had they hung: past
# dist.timeout_s (60 s), so a rank that waits out a collective to its timeout
# still fails by itself (at 60 s the two raced).
netns_wait_ranks 90 2>"$work/logs/loss-wait.log" || true
lost_after=$((SECONDS - lost_at))
check "node loss: node 1's ranks were killed (exit codes ${NETNS_RANK_RCS[*]})" \
  test "${NETNS_RANK_RCS[2]}-${NETNS_RANK_RCS[3]}" = 137-137
check "node loss: node 0's ranks failed by themselves, in ${lost_after} s" \
  failed_by_themselves 0 1

# 5
netns_cleanup
check "cleanup: no namespace left" ours_gone "$prefix_pid"

# 6: a failing job in a child test process.
child_lib=$here/netns_lib.sh
bash -c '
  set -euo pipefail
  source "$1"
  netns_setup 2 2
  for k in 0 1; do for r in 0 1; do
    netns_start_rank $k $r "$2" --config /nonexistent/shardkit-bogus.yaml
  done; done
  netns_wait_ranks
  echo "child: netns_wait_ranks succeeded with a missing config" >&2
' child "$child_lib" "$train" >"$work/logs/failing-child.log" 2>&1 &
child=$!
child_rc=0
wait "$child" || child_rc=$?
check "failing job: child exited non-zero ($child_rc)" test "$child_rc" -ne 0
check "failing job: ranks said why" grep -q "shardkit-bogus.yaml" "$work/logs/failing-child.log"
check "failing job: no namespace left" ours_gone "$child"

# 7: SIGTERM to a child test process while its ranks train.
NETNS_LOG_DIR=$work/term-logs bash -c '
  set -euo pipefail
  source "$1"
  netns_setup 2 2
  for k in 0 1; do for r in 0 1; do
    netns_start_rank $k $r "$2" --config "$3" --set "run.dir=$4" --set train.steps=100000 \
      --set checkpoint.interval=0
  done; done
  echo "${NETNS_RANK_PIDS[*]}" >"$4.pids"
  netns_wait_ranks
' child "$child_lib" "$train" "$config" "$work/term-run" >"$work/logs/term-child.log" 2>&1 &
child=$!
# Until rank 0 trains (its banner comes after the rendezvous), then a moment.
for _ in $(seq 300); do
  grep -qs "shardkit: world" "$work/term-logs/job1-rank0.log" && break
  sleep 0.1
done
sleep 1
kill -TERM "$child" 2>/dev/null || true  # a child that died early fails below
child_rc=0
wait "$child" || child_rc=$?
check "SIGTERM: child exited 143 ($child_rc)" test "$child_rc" = 143
check "SIGTERM: no namespace left" ours_gone "$child"
check "SIGTERM: no rank process left" no_rank_left

echo "two_nodes_train: ${#passed[@]} passed, ${#failed[@]} failed in $((SECONDS - started)) s"
if ((${#failed[@]})); then
  printf 'FAIL: %s\n' "${failed[@]}"
  echo "FAIL (logs in $work/logs)"
  exit 1
fi
echo "PASS"
