#!/usr/bin/env bash
# Idempotent set-up for a Debian 12 machine: installs the Debian packages that
# are missing, configures build/ once and builds what the default training job
# runs: the train binary and the libraries it links (-j2), so that the first
# step comes as early as the packages allow. scripts/test builds the rest
# (tests, benchmarks, tools). Quick when everything is already there. Run as
# root (or with sudo available).
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS=0

packages=(
  cmake ninja-build g++ pkg-config
  ccache                            # compiler cache outside the clone (scripts/ccache-env)
  libtorch-dev libgloo-dev          # LibTorch 1.13.1 (CPU) with c10d/Gloo
  libopenblas0-pthread              # LibTorch's matmuls call libblas.so.3; OpenBLAS takes it over
                                    # (update-alternatives) from the reference BLAS, 14-17x slower
  libyaml-cpp-dev libzstd-dev libxxhash-dev
  nlohmann-json3-dev libcli11-dev   # JSON, command-line parsing
  libgtest-dev                      # GoogleTest
  libthread-pool-dev                # header-only thread pool (checkpoint I/O)
  libsentencepiece-dev sentencepiece  # SentencePiece tokenizers (tokenize, generate); spm_encode for its test
  libpcre2-dev                      # the regexes of Hugging Face tokenizer.json pre-tokenizers
  iproute2                          # ip netns: nodes as network namespaces (tests/reliability/netns)
  python3-torch                     # independent reader for the interop tests
  python3-matplotlib                # scripts/plot-run (metrics.jsonl -> PNG) and its test
  python3-protobuf python3-crc32c   # independent reader of the TensorBoard event files (their test)
  slurmd slurmctld slurm-client munge  # SLURM 22.05 (slurm-wlm's parts) and its auth: scripts/slurm-cluster,
                                    # a one-machine cluster for tests/reliability/test_slurm.py
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "bootstrap: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

if [ ! -f build/build.ninja ]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
fi
# The compiler cache's counters of this build (cmake/ccache.cmake).
: >build/ccache-stats.log
cmake --build build -j2 --target train
# scripts/test's summary prints it as the bootstrap phase, with the cache's hit rate.
printf '%s\t%s\t%s\n' "$SECONDS" "$(date +%s)" "$(scripts/ccache-stats build/ccache-stats.log)" >build/.bootstrap-time
