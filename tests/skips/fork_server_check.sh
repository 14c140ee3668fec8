#!/usr/bin/env bash
# fork_server_check.sh TEST_FORK SKIP_FIXTURES WORK_DIR
#
# ctest runs every GoogleTest test through test_fork, which has the test
# binary's fork server fork the test (comm/fork_server.h). Checks,
# with skip_fixtures' ForkProbe tests, that a served test is a process of its
# own that sees what an exec'd one would: the client's environment, working
# directory, umask and standard streams; that its exit status and a death by
# signal reach ctest unchanged; that killing the client (ctest's timeout) kills
# the test; and that SHARDKIT_TEST_FORKSERVER=0 execs the binary instead.
set -euo pipefail
fork=$1 fixtures=$2 work=$3
rm -rf "$work"
mkdir -p "$work/cwd"
fail() { echo "fork_server_check: $*" >&2; exit 1; }
field() { sed -n "s/^$1=//p" "$2"; }

probe() {  # OUT [env...]: ForkProbe.ReportsItsProcess through test_fork
  local out=$1
  shift
  (cd "$work/cwd" && umask 027 && echo "stdin line $$" |
    env "$@" SHARDKIT_FORK_PROBE_OUT="$out" "$fork" "$fixtures" --gtest_filter=ForkProbe.ReportsItsProcess \
      > "$out.stdout" 2> "$out.stderr")
}

# 1. Two runs: each sees its own environment, the client's directory, umask
#    and stdin; each is a process of its own, forked by the same server (not
#    the client, which never runs LibTorch).
probe "$work/a" SHARDKIT_FORK_PROBE="first $RANDOM"
probe "$work/b" -i PATH=/usr/bin:/bin SHARDKIT_FORK_PROBE="second"
[[ $(field env "$work/a") == "first "* ]] || fail "run a saw env '$(field env "$work/a")'"
[[ $(field env "$work/b") == second ]] || fail "run b saw env '$(field env "$work/b")'"
# Run b's whole environment is env -i's three variables: nothing of the
# server's own (that of the client that started it) leaks in.
[[ $(field envc "$work/b") == 3 ]] || fail "run b had $(field envc "$work/b") variables, not its client's 3"
for r in a b; do
  [[ $(field cwd "$work/$r") == "$work/cwd" ]] || fail "run $r ran in '$(field cwd "$work/$r")'"
  [[ $(field umask "$work/$r") == 27 ]] || fail "run $r had umask '$(field umask "$work/$r")', not 027"
  [[ $(field stdin "$work/$r") == "stdin line $$" ]] || fail "run $r read '$(field stdin "$work/$r")' on stdin"
  grep -q "probe stdout" "$work/$r.stdout" || fail "run $r: its stdout did not reach the client's"
  grep -q "probe stderr" "$work/$r.stderr" || fail "run $r: its stderr did not reach the client's"
  grep -q "\[       OK \] ForkProbe.ReportsItsProcess" "$work/$r.stdout" || fail "run $r: no gtest OK line"
done
pa=$(field pid "$work/a") pb=$(field pid "$work/b") server=$(field ppid "$work/a")
[[ $pa != "$pb" ]] || fail "both runs had pid $pa"
[[ $server == "$(field ppid "$work/b")" ]] || fail "the runs had different parents: not one server"
tr '\0' ' ' < "/proc/$server/cmdline" | grep -q "skip_fixtures" || fail "the parent $server is not the fixtures' server"

# 2. Exit statuses and signals come back as they were.
set +e
"$fork" "$fixtures" --gtest_filter=Skips.WithEmptyReason > "$work/exit.log" 2>&1
rc=$?
SHARDKIT_FORK_PROBE_SIGNAL=6 "$fork" "$fixtures" --gtest_filter=ForkProbe.DiesOfTheSignalItIsAsked > "$work/sig.log" 2>&1
sig=$?
set -e
[[ $rc == 1 ]] || fail "a failing test gave status $rc, not 1"
[[ $sig == 134 ]] || fail "a test that raised SIGABRT gave status $sig, not 134 (killed by signal 6)"

# 3. Killing the client kills the test.
SHARDKIT_FORK_PROBE_SLEEP="$work/sleep.pid" "$fork" "$fixtures" \
  --gtest_filter=ForkProbe.SleepsUntilKilledWhenAsked > "$work/sleep.log" 2>&1 &
client=$!
for _ in $(seq 100); do [[ -s $work/sleep.pid ]] && break; sleep 0.1; done
[[ -s $work/sleep.pid ]] || fail "the sleeping probe never started: $(cat "$work/sleep.log")"
test_pid=$(cat "$work/sleep.pid")
[[ $test_pid != "$client" ]] || fail "the sleeping probe was not forked by the server"
kill -9 "$client"
wait "$client" 2>/dev/null || true
for _ in $(seq 50); do kill -0 "$test_pid" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$test_pid" 2>/dev/null; then
  kill -9 "$test_pid"
  fail "the test (pid $test_pid) outlived its killed client by 5 s"
fi

# 4. SHARDKIT_TEST_FORKSERVER=0: the client execs the binary (same pid).
SHARDKIT_TEST_FORKSERVER=0 SHARDKIT_FORK_PROBE_SLEEP="$work/exec.pid" "$fork" "$fixtures" \
  --gtest_filter=ForkProbe.SleepsUntilKilledWhenAsked > "$work/exec.log" 2>&1 &
client=$!
for _ in $(seq 100); do [[ -s $work/exec.pid ]] && break; sleep 0.1; done
exec_pid=$(cat "$work/exec.pid" 2>/dev/null || true)
kill -9 "$client"
wait "$client" 2>/dev/null || true
[[ $exec_pid == "$client" ]] || fail "SHARDKIT_TEST_FORKSERVER=0 ran the test as pid '$exec_pid', not the client's $client"

echo "fork_server_check: environment, directory, umask, streams, statuses, signals and kills as exec'd"
