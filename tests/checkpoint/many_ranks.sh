#!/bin/bash
# ManyRanks (issue "Scale"): 64 real processes save a checkpoint over Gloo on
# loopback (coordinator-only planning, then the cached plan), and 48 load it
# resharded, checking every value. Usage: many_ranks.sh MANY_RANKS_BINARY
set -euo pipefail
bin=$1
dir=$(mktemp -d "${TMPDIR:-/tmp}/shardkit_many_ranks.XXXXXX")
trap 'rm -rf "$dir"' EXIT
start=$(date +%s)
"$bin" --nproc 64 --dir "$dir"
mid=$(date +%s)
"$bin" --nproc 48 --dir "$dir"
end=$(date +%s)
echo "many_ranks.sh: save at 64 took $((mid - start)) s, load at 48 took $((end - mid)) s"
