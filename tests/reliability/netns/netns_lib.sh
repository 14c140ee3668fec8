# shellcheck shell=bash
# shellcheck disable=SC2034  # NETNS_* are this library's output to callers
# Simulated nodes for multi-node tests: one network namespace per node, all
# joined by a bridge, so that ranks of different "nodes" talk over a real
# interface (a veth pair through a bridge) and cannot reach each other's
# loopback. Needs root and iproute2. Source it from bash; it works under
# `set -euo pipefail`.
#
# Typical use (see two_nodes_train.sh):
#   source netns_lib.sh
#   netns_available || exit 77           # prints "SKIP: <reason>" on stderr
#   netns_setup 2 2                      # 2 nodes x 2 ranks; traps EXIT/INT/TERM
#   for k in 0 1; do for r in 0 1; do netns_start_rank $k $r train ...; done; done
#   netns_wait_ranks                     # non-zero if any rank failed
#   netns_cleanup                        # also runs from the traps
#
# Functions (all return non-zero on a caller error, naming it on stderr):
#   netns_available              can we? else "SKIP: <reason>", return 1
#   netns_setup NODES [PER_NODE] namespaces, bridge, addresses, traps
#   netns_cleanup                kill everything in them, delete them
#   netns_sweep_stale            delete namespaces of dead test processes
#   netns_exec K CMD...          CMD in node K, in the foreground
#   netns_start_rank K LR CMD... CMD in node K as rank K*PER_NODE+LR, in the
#                                background, with torchrun's environment
#   netns_wait_ranks [TIMEOUT_S] wait for the job's ranks; 0 if all exited 0
#   netns_job_running            0 while any rank of the job still runs
#   netns_kill_node K            SIGKILL all of node K (its peers see the
#                                connections close)
#   netns_cut_node K / netns_join_node K
#                                node K's link down / up again (cut, then
#                                kill: a node that vanished; peers time out)
#   netns_tcp_peers K            node K's established TCP connections
#   netns_sample_tcp_peers K STOP OUT
#                                append them to OUT every 0.2 s until file
#                                STOP exists (run it in the background)
#   netns_connected_beyond_port SAMPLES K PEER PORT
#                                did node K talk to node PEER on a port
#                                other than PORT (Gloo, not the store)?
#   netns_free_port K            a TCP port unused in node K
#
# Layout, for a test process with pid P and N nodes:
#   namespace skns<P>br   bridge br0 with ports p0..p<N-1>
#   namespace skns<P>n<K> lo and eth0 (the veth peer of pK), address
#                         10.<P/256%256>.<P%256>.<K+1>/24, IPv6 off
# Everything is created inside those namespaces (never in the caller's), so
# deleting them removes every interface, and concurrent tests cannot clash:
# their prefixes differ by pid.
# Only the network is per node: every node shares the host's hostname (no
# UTS namespace; a per-node name would not resolve) and its file system. Code
# that needs a node's identity takes GROUP_RANK or the node's address, not
# gethostname().
#
# Variables set by netns_setup (globals; arrays cannot be exported):
#   NETNS_NAMES[K]          node K's namespace
#   NETNS_ADDRS[K]          node K's IPv4 address (no prefix length)
#   NETNS_IFNAME            the interface inside every node namespace: eth0
#   NETNS_BRIDGE            the bridge's namespace
#   NETNS_LOCAL_WORLD_SIZE  ranks per node (netns_setup's second argument);
#                           may be changed between jobs
#   NETNS_LOG_DIR           rank logs; set it before netns_setup to keep
#                           them, else a temporary directory that
#                           netns_cleanup removes
# Per job (the ranks started since the last netns_wait_ranks), keyed by the
# global rank: NETNS_RANK_PIDS, NETNS_RANK_NODES, NETNS_RANK_LOGS and, after
# netns_wait_ranks, NETNS_RANK_RCS. NETNS_MASTER_PORT: the job's rendezvous
# port (chosen free on node 0 at the first start; set it to force one).
#
# The state lives in shell variables: call everything from the shell that ran
# netns_setup, never from a subshell ($(...), a pipeline), which would lose
# the recorded pids (or, for netns_cleanup, do nothing useful).

NETNS_NAMES=()
NETNS_ADDRS=()
NETNS_IFNAME=eth0
NETNS_BRIDGE=""
NETNS_LOCAL_WORLD_SIZE=1
NETNS_MASTER_PORT=${NETNS_MASTER_PORT:-}
NETNS_WAIT_TIMEOUT_S=${NETNS_WAIT_TIMEOUT_S:-300}
NETNS_RANK_PIDS=()
NETNS_RANK_NODES=()
NETNS_RANK_LOGS=()
NETNS_RANK_RCS=()
NETNS_SKIP_REASON=""
_NETNS_PREFIX=""
_NETNS_OWNER_PID=""
_NETNS_OWN_LOG_DIR=0
_NETNS_JOB=0
_NETNS_JOB_WAITED=1
# Matches the namespaces of any test using this library: prefix pid, suffix.
_NETNS_NAME_PATTERN='^skns([0-9]+)(n[0-9]+|br)$'

_netns_log() { echo "netns: $*" >&2; }

# A test's checks: `check NAME CMD...` runs CMD and records NAME in the
# array `passed` or `failed`, printing "ok:   NAME" or "FAIL: NAME".
passed=()
failed=()
check() {
  local name=$1
  shift
  if "$@"; then
    passed+=("$name")
    echo "ok:   $name"
  else
    failed+=("$name")
    echo "FAIL: $name"
  fi
}

# Wall time: `started=$(now)`, then `seconds_since "$started"` ("12.3").
now() { date +%s.%N; }
seconds_since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# The tests' arguments, "BUILD_DIR_OR_TRAIN_BINARY WORK_DIR", for test NAME:
# sets `train` (the absolute path of an executable train) and `work` (the
# work directory, created, absolute). A wrong call exits 2 naming it.
netns_parse_args() {
  local name=$1
  shift
  if (($# != 2)); then
    echo "usage: $0 BUILD_DIR_OR_TRAIN_BINARY WORK_DIR" >&2
    exit 2
  fi
  train=$1
  [[ -d $train ]] && train=$train/train
  if [[ ! -x $train ]]; then
    echo "$name: no executable train at $train" >&2
    exit 2
  fi
  train=$(cd "$(dirname "$train")" && pwd)/$(basename "$train")
  mkdir -p "$2"
  work=$(cd "$2" && pwd)
}

# 0 when we are root and can create a namespace with a veth pair and a bridge
# in it (then deleted). Else prints "SKIP: <reason>" on stderr, sets
# NETNS_SKIP_REASON and returns 1: the caller exits 77, loudly skipped.
netns_available() {
  local probe="skns$$probe" err
  NETNS_SKIP_REASON=""
  if [[ $(id -u) != 0 ]]; then
    NETNS_SKIP_REASON="not root (network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN)"
  elif ! command -v ip >/dev/null 2>&1; then
    NETNS_SKIP_REASON="no 'ip' command (iproute2)"
  elif ! err=$(ip netns add "$probe" 2>&1); then
    NETNS_SKIP_REASON="cannot create a network namespace: ip netns add: $err"
  else
    if ! err=$(ip -n "$probe" link add pa type veth peer name pb 2>&1); then
      NETNS_SKIP_REASON="cannot create a veth pair: $err"
    elif ! err=$(ip -n "$probe" link add br0 type bridge 2>&1); then
      NETNS_SKIP_REASON="cannot create a bridge: $err"
    fi
    ip netns del "$probe" 2>/dev/null || true
  fi
  if [[ -n $NETNS_SKIP_REASON ]]; then
    echo "SKIP: $NETNS_SKIP_REASON" >&2
    return 1
  fi
  return 0
}

# Removes the namespaces of this library's pattern whose creating process is
# gone (a test killed with SIGKILL runs no trap). A live pid is left alone,
# even if reused by an unrelated process: never delete what may be in use.
netns_sweep_stale() {
  local ns pid
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
    [[ $ns =~ $_NETNS_NAME_PATTERN ]] || continue
    pid=${BASH_REMATCH[1]}
    [[ $pid == "$$" ]] && continue
    kill -0 "$pid" 2>/dev/null && continue
    _netns_log "removing stale namespace $ns (pid $pid is gone)"
    _netns_delete_ns "$ns"
  done
}

# Kills every process in namespace $1 (waits up to 5 s for them to go), then
# deletes it. Never fails.
_netns_delete_ns() {
  local ns=$1 pids i
  for ((i = 0; i < 50; i++)); do
    mapfile -t pids < <(ip netns pids "$ns" 2>/dev/null || true)
    ((${#pids[@]})) || break
    kill -9 "${pids[@]}" 2>/dev/null || true
    sleep 0.1
  done
  ip netns del "$ns" 2>/dev/null || true
}

# netns_setup NODES [RANKS_PER_NODE]
# Creates NODES (>= 2) node namespaces joined by a bridge, checks that every
# node reaches node 0 and back, and installs `trap netns_cleanup` on EXIT,
# INT and TERM (replacing the caller's traps: a caller that needs its own
# EXIT trap sets it afterwards and calls netns_cleanup from it). Returns 1,
# having cleaned up, when any step fails.
netns_setup() {
  local nodes=${1:?netns_setup NODES [RANKS_PER_NODE]} per_node=${2:-1}
  if [[ -n $_NETNS_PREFIX ]]; then
    _netns_log "netns_setup: already set up ($_NETNS_PREFIX); call netns_cleanup first"
    return 1
  fi
  if ! [[ $nodes =~ ^[0-9]+$ && $nodes -ge 2 && $nodes -le 250 ]]; then
    _netns_log "netns_setup: NODES must be 2..250, got '$nodes'"
    return 1
  fi
  if ! [[ $per_node =~ ^[0-9]+$ && $per_node -ge 1 ]]; then
    _netns_log "netns_setup: RANKS_PER_NODE must be >= 1, got '$per_node'"
    return 1
  fi
  netns_sweep_stale
  _NETNS_PREFIX="skns$$"
  _NETNS_OWNER_PID=$BASHPID
  trap '_netns_on_exit' EXIT
  trap '_netns_on_signal INT 130' INT
  trap '_netns_on_signal TERM 143' TERM
  NETNS_LOCAL_WORLD_SIZE=$per_node
  if [[ -z ${NETNS_LOG_DIR:-} ]]; then
    NETNS_LOG_DIR=$(mktemp -d "${TMPDIR:-/tmp}/${_NETNS_PREFIX}-logs.XXXXXX")
    _NETNS_OWN_LOG_DIR=1
  else
    mkdir -p "$NETNS_LOG_DIR"
  fi
  if ! _netns_build "$nodes" || ! _netns_check_links; then
    netns_cleanup
    return 1
  fi
}

_netns_build() {
  local nodes=$1 k ns net
  net="10.$(( ($$ >> 8) & 255 )).$(( $$ & 255 ))"
  NETNS_BRIDGE="${_NETNS_PREFIX}br"
  ip netns add "$NETNS_BRIDGE" || return 1
  ip -n "$NETNS_BRIDGE" link set lo up || return 1
  ip -n "$NETNS_BRIDGE" link add br0 type bridge || return 1
  ip -n "$NETNS_BRIDGE" link set br0 up || return 1
  for ((k = 0; k < nodes; k++)); do
    ns="${_NETNS_PREFIX}n$k"
    ip netns add "$ns" || return 1
    NETNS_NAMES[k]=$ns
    NETNS_ADDRS[k]="$net.$((k + 1))"
    # Both ends are created in their namespaces: the names need only be
    # unique there, and nothing is ever left in the caller's namespace.
    ip link add "$NETNS_IFNAME" netns "$ns" type veth peer name "p$k" netns "$NETNS_BRIDGE" ||
      return 1
    ip -n "$NETNS_BRIDGE" link set "p$k" master br0 up || return 1
    # One IPv4 address per interface: Gloo takes the interface's first
    # address, and IPv6 would only add DAD and router solicitations.
    if [[ -d /proc/sys/net/ipv6 ]]; then
      ip netns exec "$ns" sh -c "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6" || return 1
    fi
    ip -n "$ns" link set lo up || return 1
    ip -n "$ns" addr add "${NETNS_ADDRS[k]}/24" dev "$NETNS_IFNAME" || return 1
    ip -n "$ns" link set "$NETNS_IFNAME" up || return 1
  done
}

# 0 when node $1 reaches address $2 (ping if installed, else a TCP connect to
# port 1: "refused" proves the peer answered). Three tries.
_netns_reaches() {
  local k=$1 addr=$2 _ out
  for _ in 1 2 3; do
    if command -v ping >/dev/null 2>&1; then
      netns_exec "$k" ping -c1 -W1 "$addr" >/dev/null 2>&1 && return 0
    else
      if out=$(netns_exec "$k" timeout 2 bash -c "exec 3<>/dev/tcp/$addr/1" 2>&1) ||
          [[ $out == *"refused"* ]]; then
        return 0
      fi
    fi
    sleep 0.2
  done
  return 1
}

_netns_check_links() {
  local k
  for ((k = 1; k < ${#NETNS_NAMES[@]}; k++)); do
    if ! _netns_reaches "$k" "${NETNS_ADDRS[0]}" || ! _netns_reaches 0 "${NETNS_ADDRS[k]}"; then
      _netns_log "node $k (${NETNS_ADDRS[k]}) and node 0 (${NETNS_ADDRS[0]}) cannot reach each other"
      return 1
    fi
  done
}

_netns_on_exit() {
  local rc=$?
  [[ $BASHPID == "$_NETNS_OWNER_PID" ]] && netns_cleanup
  exit "$rc"
}

_netns_on_signal() {
  local sig=$1 rc=$2
  _netns_log "caught SIG$sig: cleaning up"
  netns_cleanup
  trap - EXIT
  exit "$rc"
}

# Kills every process left in the namespaces, deletes them (with their veth
# pairs and the bridge) and the library's own log directory. Idempotent;
# never fails; safe from a trap.
netns_cleanup() {
  local - ns
  set +e
  [[ -z $_NETNS_PREFIX ]] && return 0
  # First the ranks we started, by pid: one whose `ip netns exec` has not
  # entered its namespace yet would escape the namespace sweep below.
  _netns_kill_ranks "${!NETNS_RANK_PIDS[@]}"
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
    [[ $ns == "${_NETNS_PREFIX}br" || $ns =~ ^${_NETNS_PREFIX}n[0-9]+$ ]] || continue
    _netns_delete_ns "$ns"
  done
  if ((_NETNS_OWN_LOG_DIR)); then
    rm -rf "$NETNS_LOG_DIR"
    NETNS_LOG_DIR=""
    _NETNS_OWN_LOG_DIR=0
  fi
  NETNS_NAMES=()
  NETNS_ADDRS=()
  NETNS_BRIDGE=""
  NETNS_RANK_PIDS=()
  NETNS_RANK_NODES=()
  NETNS_RANK_LOGS=()
  NETNS_RANK_RCS=()
  NETNS_MASTER_PORT=""
  _NETNS_JOB_WAITED=1
  _NETNS_PREFIX=""
  return 0
}

_netns_check_node() {
  if ! [[ $1 =~ ^[0-9]+$ && $1 -lt ${#NETNS_NAMES[@]} ]]; then
    _netns_log "no node '$1' (nodes: 0..$((${#NETNS_NAMES[@]} - 1)); did netns_setup run?)"
    return 1
  fi
}

# netns_exec K CMD...: runs CMD in node K's namespace, in the foreground.
netns_exec() {
  _netns_check_node "$1" || return 1
  local ns=${NETNS_NAMES[$1]}
  shift
  ip netns exec "$ns" "$@"
}

# A TCP port nothing uses in node $1's namespace (listening or otherwise).
netns_free_port() {
  local k=$1 port _
  for _ in $(seq 50); do
    port=$((20000 + RANDOM % 40000))
    if [[ -z $(netns_exec "$k" ss -Htan "( sport = :$port )") ]]; then
      echo "$port"
      return 0
    fi
  done
  _netns_log "no free port found on node $k"
  return 1
}

# netns_start_rank K LOCAL_RANK CMD...
# Starts CMD in the background in node K with torchrun's environment:
# RANK = K * NETNS_LOCAL_WORLD_SIZE + LOCAL_RANK, WORLD_SIZE, LOCAL_RANK,
# LOCAL_WORLD_SIZE, GROUP_RANK=K, GROUP_WORLD_SIZE=nodes, MASTER_ADDR (node
# 0's address), MASTER_PORT (NETNS_MASTER_PORT), TORCHELASTIC_RUN_ID (one per
# job) and GLOO_SOCKET_IFNAME=eth0. stdout and stderr go to
# NETNS_RANK_LOGS[RANK]. The first start after a netns_wait_ranks begins a
# new job: new logs, new port, new run id. Returns at once (the rank may not
# have entered its namespace yet).
netns_start_rank() {
  local k=${1:?netns_start_rank K LOCAL_RANK CMD...} local_rank=${2:?} ns rank world log
  shift 2
  _netns_check_node "$k" || return 1
  if ! [[ $local_rank =~ ^[0-9]+$ && $local_rank -lt $NETNS_LOCAL_WORLD_SIZE ]]; then
    _netns_log "LOCAL_RANK '$local_rank' is not in 0..$((NETNS_LOCAL_WORLD_SIZE - 1))"
    return 1
  fi
  (($# > 0)) || { _netns_log "netns_start_rank: no command"; return 1; }
  if ((_NETNS_JOB_WAITED)); then
    _NETNS_JOB=$((_NETNS_JOB + 1))
    _NETNS_JOB_WAITED=0
    _NETNS_RUN_ID="${_NETNS_PREFIX}-job$_NETNS_JOB-$RANDOM$RANDOM"
    NETNS_RANK_PIDS=()
    NETNS_RANK_NODES=()
    NETNS_RANK_LOGS=()
    NETNS_RANK_RCS=()
    [[ -n $NETNS_MASTER_PORT ]] || NETNS_MASTER_PORT=$(netns_free_port 0) || return 1
  fi
  ns=${NETNS_NAMES[k]}
  rank=$((k * NETNS_LOCAL_WORLD_SIZE + local_rank))
  world=$((${#NETNS_NAMES[@]} * NETNS_LOCAL_WORLD_SIZE))
  if [[ -n ${NETNS_RANK_PIDS[rank]:-} ]]; then
    _netns_log "rank $rank already started in this job"
    return 1
  fi
  log="$NETNS_LOG_DIR/job$_NETNS_JOB-rank$rank.log"
  # Not ours to inherit: the local launcher's markers would make a rank
  # skip the run directory lock or connect as a client only.
  ip netns exec "$ns" env -u SHARDKIT_LAUNCHED -u SHARDKIT_STORE_HOSTED -u SHARDKIT_JOB_ID \
    RANK="$rank" WORLD_SIZE="$world" LOCAL_RANK="$local_rank" \
    LOCAL_WORLD_SIZE="$NETNS_LOCAL_WORLD_SIZE" GROUP_RANK="$k" \
    GROUP_WORLD_SIZE="${#NETNS_NAMES[@]}" MASTER_ADDR="${NETNS_ADDRS[0]}" \
    MASTER_PORT="$NETNS_MASTER_PORT" TORCHELASTIC_RUN_ID="$_NETNS_RUN_ID" \
    GLOO_SOCKET_IFNAME="$NETNS_IFNAME" "$@" >"$log" 2>&1 &
  NETNS_RANK_PIDS[rank]=$!
  NETNS_RANK_NODES[rank]=$k
  NETNS_RANK_LOGS[rank]=$log
}

# Whether pid $1 still runs (exists and is no zombie).
_netns_running() {
  local stat
  { read -r stat </proc/"$1"/stat; } 2>/dev/null || return 1
  stat=${stat##*) }
  [[ ${stat%% *} != Z ]]
}

# netns_job_running: 0 while any rank of the current job still runs (not
# collected, not a zombie); for loops that wait for something in a log.
netns_job_running() {
  local rank
  for rank in "${!NETNS_RANK_PIDS[@]}"; do
    [[ -z ${NETNS_RANK_RCS[rank]:-} ]] && _netns_running "${NETNS_RANK_PIDS[rank]}" && return 0
  done
  return 1
}

# _netns_kill_ranks RANK...: SIGKILLs those ranks of the current job that
# were not collected yet and collects them (NETNS_RANK_RCS). Reaping them here,
# with stderr closed, keeps bash's "Killed ..." job notices out of the output.
_netns_kill_ranks() {
  local rank rc
  {
    for rank in "$@"; do
      [[ -n ${NETNS_RANK_RCS[rank]:-} ]] || kill -9 "${NETNS_RANK_PIDS[rank]}" || true
    done
    for rank in "$@"; do
      [[ -z ${NETNS_RANK_RCS[rank]:-} ]] || continue
      rc=0
      wait "${NETNS_RANK_PIDS[rank]}" || rc=$?
      NETNS_RANK_RCS[rank]=$rc
    done
  } 2>/dev/null
}

# netns_wait_ranks [TIMEOUT_S]
# Waits for every rank of the current job (default timeout
# NETNS_WAIT_TIMEOUT_S; ranks still running then are killed and count as
# failed), records exit codes in NETNS_RANK_RCS, and prints the last lines of
# each failed rank's log on stderr. Returns 0 when every rank exited 0. The
# next netns_start_rank begins a new job.
netns_wait_ranks() {
  local timeout=${1:-$NETNS_WAIT_TIMEOUT_S} deadline rank rc any_failed=0 running
  deadline=$((SECONDS + timeout))
  while :; do
    running=()
    for rank in "${!NETNS_RANK_PIDS[@]}"; do
      [[ -z ${NETNS_RANK_RCS[rank]:-} ]] && _netns_running "${NETNS_RANK_PIDS[rank]}" &&
        running+=("$rank")
    done
    ((${#running[@]})) || break
    if ((SECONDS >= deadline)); then
      _netns_log "ranks ${running[*]} still running after ${timeout}s: killing them"
      _netns_kill_ranks "${running[@]}"
      break
    fi
    sleep 0.1
  done
  for rank in "${!NETNS_RANK_PIDS[@]}"; do
    if [[ -z ${NETNS_RANK_RCS[rank]:-} ]]; then
      rc=0
      wait "${NETNS_RANK_PIDS[rank]}" || rc=$?
      NETNS_RANK_RCS[rank]=$rc
    fi
    rc=${NETNS_RANK_RCS[rank]}
    if ((rc != 0)); then
      any_failed=1
      _netns_log "rank $rank (node ${NETNS_RANK_NODES[rank]}) exited $rc; last lines of ${NETNS_RANK_LOGS[rank]}:"
      tail -n 15 "${NETNS_RANK_LOGS[rank]}" | sed 's/^/    /' >&2
    fi
  done
  _NETNS_JOB_WAITED=1
  NETNS_MASTER_PORT=""
  return "$any_failed"
}

# netns_kill_node K: SIGKILLs everything in node K ("losing a node"). Its
# ranks are collected at once and show up as failed (137) in
# netns_wait_ranks.
netns_kill_node() {
  _netns_check_node "$1" || return 1
  local k=$1 rank pids node_ranks=()
  for rank in "${!NETNS_RANK_PIDS[@]}"; do
    [[ ${NETNS_RANK_NODES[rank]} != "$k" ]] || node_ranks+=("$rank")
  done
  _netns_kill_ranks "${node_ranks[@]}"
  mapfile -t pids < <(ip netns pids "${NETNS_NAMES[k]}" 2>/dev/null || true)
  ((${#pids[@]} == 0)) || kill -9 "${pids[@]}" 2>/dev/null || true
}

# netns_cut_node K: takes node K's bridge port down: from now on nothing
# reaches node K or leaves it, not even the FIN or RST of a process that
# dies there. Cut, then kill, is a node that vanished (power loss): its peers
# hear nothing and must time out. netns_join_node K undoes the cut.
netns_cut_node() {
  _netns_check_node "$1" || return 1
  ip -n "$NETNS_BRIDGE" link set "p$1" down
}

netns_join_node() {
  _netns_check_node "$1" || return 1
  ip -n "$NETNS_BRIDGE" link set "p$1" up
}

# netns_tcp_peers K: the established TCP connections in node K, one
# "LOCAL PEER" address:port pair per line.
netns_tcp_peers() {
  netns_exec "$1" ss -Htn state established | awk '{print $(NF-1), $NF}'
}

# netns_sample_tcp_peers K STOP_FILE OUT: appends node K's established TCP
# connections (netns_tcp_peers) to OUT every 0.2 s until STOP_FILE exists or
# the test process is gone. Run it in the background while a job runs: a
# job's connections live only as long as the job.
netns_sample_tcp_peers() {
  local k=${1:?netns_sample_tcp_peers K STOP_FILE OUT} stop=${2:?} out=${3:?}
  _netns_check_node "$k" || return 1
  while [[ ! -e $stop ]] && kill -0 $$ 2>/dev/null; do
    netns_tcp_peers "$k" >>"$out" 2>/dev/null || true
    sleep 0.2
  done
}

# netns_connected_beyond_port SAMPLES K PEER PORT: 0 when SAMPLES (output of
# netns_tcp_peers K) holds a connection from node K's address to node PEER's
# address with PORT (the rendezvous store's) on neither end: Gloo's pairs,
# which can only have crossed the veth (each namespace has its own lo).
# ss writes IPv4 as 10.1.2.3:port, or [::ffff:10.1.2.3]:port on a
# dual-stack socket (the store's).
netns_connected_beyond_port() {
  local samples=${1:?netns_connected_beyond_port SAMPLES K PEER PORT} k=${2:?} peer=${3:?} port=${4:?}
  _netns_check_node "$k" || return 1
  _netns_check_node "$peer" || return 1
  awk -v me="${NETNS_ADDRS[k]}" -v peer="${NETNS_ADDRS[peer]}" -v store="$port" '
    function addr(ep) { sub(/:[0-9]+$/, "", ep); gsub(/[][]/, "", ep); sub(/^::ffff:/, "", ep); return ep }
    function port(ep) { sub(/.*:/, "", ep); return ep }
    addr($1) == me && addr($2) == peer && port($2) != store && port($1) != store { found = 1 }
    END { exit !found }' "$samples"
}
