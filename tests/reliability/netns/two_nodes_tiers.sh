#!/usr/bin/env bash
# Multi-level checkpoints on two simulated nodes x two ranks: losing a node
# costs only the steps since the newest local checkpoint, not since the
# newest durable one.
#
#   two_nodes_tiers.sh BUILD_DIR_OR_TRAIN_BINARY WORK_DIR
#
# Node K is a network namespace (netns_lib.sh) with address 10.x.y.(K+1) on
# eth0; every rank gets torchrun's environment (GROUP_RANK=K). All jobs share
# one run.dir with the local tier on: checkpoint.local.dir =
# {run.dir}/local/node{node} (a directory per node), a checkpoint every 2
# steps, partner copies on the next node, every 3rd local checkpoint (and
# the final one) flushed to the durable tier {run.dir}/checkpoints, and
# local.keep_last 0 so that the step job 3 restores is still there to see
# at its end. Checks:
#   1. Job 1 trains 12 steps: all ranks exit 0; both nodes' local dirs hold
#      committed steps (.local.json) with partner copies (.partner.json);
#      node 1's ranks held TCP connections to node 0's address on ports
#      other than the rendezvous port (Gloo pairs over the veth).
#   2. Losing a node: job 2 continues to 40 steps; once rank 0 logs a local
#      checkpoint with partner copies that is not flushed ("tier local |
#      ... | partner ok"), everything in node 1 is SIGKILLed. That step is
#      in node 0's local dir with .partner.json and not in the durable tier;
#      node 1's ranks died (137) and node 0's failed by themselves. Then
#      node 1's local dir is deleted (a replaced node's disk).
#   3. Job 3 (all four ranks, same config) resumes through the local tier
#      with node 1's files from their partner copies on node 0 ("resume
#      tier: local (the files of node 1 (missing or incomplete there) come
#      from partner copies on node 0)") at a step newer than the newest
#      durable checkpoint, finishes (exit 0, durable step_40), and node 1's
#      local dir holds the resumed step again (.metadata and its ranks'
#      files: restored).
#   4. Job 4, after deleting every node's local dir, resumes from the
#      durable tier (step_40, "resume tier: durable") and trains to 44.
#   5. No namespace of this test is left after its cleanup (the EXIT, INT
#      and TERM traps of netns_setup clean up after a failure too).
# Prints the time of each job and of the whole test.
# Exit status: 0 all passed; 1 a check failed; 2 usage; 77 skipped (not root,
# or no network namespaces here), printing "SKIP: <reason>" (stderr) and the
# project's skip marker "shardkit-skip: two_nodes_tiers: <reason>" (stdout).
# Under ctest, register it with SKIP_REGULAR_EXPRESSION "shardkit-skip:",
# not SKIP_RETURN_CODE 77: scripts/check-skips refuses skip return codes.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../../.." && pwd)
# shellcheck source-path=SCRIPTDIR
source "$here/netns_lib.sh"

netns_parse_args two_nodes_tiers "$@"
config=$repo/configs/default.yaml

if ! netns_available; then
  echo "shardkit-skip: two_nodes_tiers: $NETNS_SKIP_REASON"
  exit 77
fi

timings=()
started=$(now)

run=$work/run
durable=$run/checkpoints
local_dir() { echo "$run/local/node$1"; }
# Resuming must reach a checkpoint newer than the newest durable one, so the
# durable tier lags: with interval 2 and every 3, steps 6, 12, 18, ... (and
# the final step) are flushed, 2, 4, 8, 10, 14, 16, ... stay local.
train_args=(--config "$config" --set "run.dir=$run" --set train.log_every=10
  --set train.eval_every=0 --set checkpoint.interval=2
  --set 'checkpoint.local.dir="{run.dir}/local/node{node}"'
  --set checkpoint.local.keep_last=0 --set checkpoint.durable.every=3
  --set dist.timeout_s=60)

start_job() {  # start_job STEPS: all 4 ranks
  local k r
  for k in 0 1; do
    for r in 0 1; do
      netns_start_rank "$k" "$r" "$train" "${train_args[@]}" --set "train.steps=$1"
    done
  done
}

rank0_log() { echo "${NETNS_RANK_LOGS[0]}"; }
rank0_says() { grep -qF -- "$1" "$(rank0_log)"; }
durable_committed() { [[ -f $durable/step_$1/.metadata ]]; }
# A step that was never parsed ("") fails these: no check passes vacuously.
is_step() { [[ $1 =~ ^[0-9]+$ ]]; }
not_durable() { is_step "$1" && [[ ! -e $durable/step_$1 ]]; }
step_after() { is_step "$1" && is_step "$2" && (($1 > $2)); }        # step_after A B: A > B
step_at_least() { is_step "$1" && is_step "$2" && (($1 >= $2)); }   # A >= B

# The newest step_N with .metadata in the durable tier, or 0.
newest_durable() {
  local meta step newest=0
  for meta in "$durable"/step_*/.metadata; do
    [[ -f $meta ]] || continue
    step=${meta%/.metadata}
    step=${step##*/step_}
    ((step > newest)) && newest=$step
  done
  echo "$newest"
}

# Node $1's local dir has committed steps (.local.json) with partner copies.
local_steps_with_partner_copies() {
  local dir
  dir=$(local_dir "$1")
  compgen -G "$dir/step_*/.local.json" >/dev/null && compgen -G "$dir/step_*/.partner.json" >/dev/null
}

# The step of rank 0's "resumed from <path> (step N, ...)" line, or nothing.
resumed_step() {
  sed -n 's/^shardkit: resumed from .* (step \([0-9][0-9]*\).*/\1/p' "$(rank0_log)" | head -n1
}

failed_by_themselves() {  # exit codes of ranks $@: an error, not success nor SIGKILL
  local rank
  for rank in "$@"; do
    [[ ${NETNS_RANK_RCS[rank]} != 0 && ${NETNS_RANK_RCS[rank]} != 137 ]] || return 1
  done
}

ours_gone() { ! ip netns list | awk '{print $1}' | grep -Eq "^skns$1(n[0-9]+|br)$"; }

rm -rf "$run" "$work/logs" "$work/connections" "$work/stop-sampling"
mkdir -p "$work/logs"
NETNS_LOG_DIR=$work/logs  # read by netns_setup: keep the logs
netns_setup 2 2
prefix_pid=$$
timings+=("setup $(seconds_since "$started") s")
echo "nodes: ${NETNS_NAMES[*]} at ${NETNS_ADDRS[*]} (${NETNS_IFNAME}); logs in $work/logs"

# 1: a fresh run, 12 steps.
t=$(now)
start_job 12
port=$NETNS_MASTER_PORT
netns_sample_tcp_peers 1 "$work/stop-sampling" "$work/connections" &
sampler=$!
job1_ok=0
netns_wait_ranks 120 && job1_ok=1
touch "$work/stop-sampling"
wait "$sampler" || true
timings+=("job 1 $(seconds_since "$t") s")
check "job 1: all 4 ranks exited 0" test "$job1_ok" = 1
check "job 1: node 0's local dir has committed steps with partner copies" \
  local_steps_with_partner_copies 0
check "job 1: node 1's local dir has committed steps with partner copies" \
  local_steps_with_partner_copies 1
check "job 1: durable step_12 committed (the final checkpoint is flushed)" durable_committed 12
check "job 1: node 1 talked to node 0 (${NETNS_ADDRS[0]}) beyond the store port $port" \
  netns_connected_beyond_port "$work/connections" 1 0 "$port"

# 2: continue to 40 steps; lose node 1 right after a local-only checkpoint.
t=$(now)
start_job 40
local_only=""
for _ in $(seq 1200); do  # 60 s
  local_only=$(grep -Em1 '^checkpoint step [0-9]+ .*\| tier local \| .*\| partner ok$' "$(rank0_log)" || true)
  [[ -n $local_only ]] && break
  netns_job_running || break
  sleep 0.05
done
netns_kill_node 1
lost_at=$(now)
lost_step=$(sed -n 's/^checkpoint step \([0-9][0-9]*\) .*/\1/p' <<<"$local_only")
echo "node 1 lost after: ${local_only:-<no local-only checkpoint line>}"
# Killed by netns_wait_ranks after 90 s (137), had they hung: past
# dist.timeout_s (60 s), so a rank that waits out a collective to its timeout
# still fails by itself (at 60 s the two raced).
netns_wait_ranks 90 2>"$work/logs/loss-wait.log" || true
lost_after=$(seconds_since "$lost_at")
timings+=("job 2 $(seconds_since "$t") s (node 0 failed ${lost_after} s after the loss)")
grep -E '^shardkit: (resumed from|resume tier|resume:)' "$(rank0_log)" | sed 's/^/job 2: /' || true
check "job 2: resumed from step 12" test "$(resumed_step)" = 12
check "job 2: a local-only checkpoint with partner copies was logged before the loss" \
  is_step "$lost_step"
check "job 2: step_$lost_step has node 1's partner copies on node 0 (.partner.json)" \
  test -n "$lost_step" -a -f "$(local_dir 0)/step_$lost_step/.partner.json"
check "job 2: step_$lost_step is not in the durable tier" not_durable "$lost_step"
check "node loss: node 1's ranks were killed (exit codes ${NETNS_RANK_RCS[*]})" \
  test "${NETNS_RANK_RCS[2]}-${NETNS_RANK_RCS[3]}" = 137-137
check "node loss: node 0's ranks failed by themselves, in ${lost_after} s" \
  failed_by_themselves 0 1
rm -rf "$(local_dir 1)"

# 3: all four ranks again; node 1's files come from node 0's partner copies.
newest_durable_before=$(newest_durable)
t=$(now)
job3_ok=0
start_job 40
netns_wait_ranks 120 && job3_ok=1
timings+=("job 3 $(seconds_since "$t") s")
resumed=$(resumed_step)
grep -E '^shardkit: (resumed from|resume tier|resume:)' "$(rank0_log)" | sed 's/^/job 3: /' || true
check "job 3: all 4 ranks exited 0" test "$job3_ok" = 1
check "job 3: resume tier local with node 1's files from partner copies on node 0" \
  rank0_says "shardkit: resume tier: local (the files of node 1 (missing or incomplete there) come from partner copies on node 0)"
check "job 3: resumed from step $resumed, newer than the newest durable step_$newest_durable_before" \
  step_after "$resumed" "$newest_durable_before"
check "job 3: resumed from step $resumed, not older than the lost step_$lost_step" \
  step_at_least "$resumed" "$lost_step"
check "job 3: node 1's local step_$resumed restored (.metadata, rank_2.data, rank_3.data)" \
  test -n "$resumed" -a -f "$(local_dir 1)/step_$resumed/.metadata" -a -f "$(local_dir 1)/step_$resumed/rank_2.data" \
  -a -f "$(local_dir 1)/step_$resumed/rank_3.data"
check "job 3: durable step_40 committed" durable_committed 40

# 4: every node's local tier is gone: the durable tier it is.
rm -rf "$run/local"
t=$(now)
job4_ok=0
start_job 44
netns_wait_ranks 120 && job4_ok=1
timings+=("job 4 $(seconds_since "$t") s")
grep -E '^shardkit: (resumed from|resume tier|resume:)' "$(rank0_log)" | sed 's/^/job 4: /' || true
check "job 4: all 4 ranks exited 0" test "$job4_ok" = 1
check "job 4: resume tier durable" rank0_says "shardkit: resume tier: durable ("
check "job 4: resumed from the durable step_40" rank0_says "resumed from $durable/step_40 (step 40,"
check "job 4: durable step_44 committed" durable_committed 44

# 5
netns_cleanup
check "cleanup: no namespace left" ours_gone "$prefix_pid"

echo "timings: ${timings[*]/%/;} total $(seconds_since "$started") s"
echo "two_nodes_tiers: ${#passed[@]} passed, ${#failed[@]} failed"
if ((${#failed[@]})); then
  printf 'FAIL: %s\n' "${failed[@]}"
  echo "FAIL (logs in $work/logs)"
  exit 1
fi
echo "PASS"
