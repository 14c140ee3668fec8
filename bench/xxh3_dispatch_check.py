#!/usr/bin/python3
"""xxh3_dispatch_check: XXH3-64 through the xxhash library's plain entry
points against its runtime dispatch (AVX2 / AVX-512), as
checkpoint/format/checksum.cpp uses them.

  bench/xxh3_dispatch_check.py [--mib 1024] [--block-mib 8] [--rounds 5] [--json F]

Calls the system libxxhash (Debian: libxxhash0) through ctypes: one call
over the whole buffer (from memory), and one --block-mib block hashed until
the same bytes are covered (in cache), --rounds times the plain way, then
the dispatched way, then the plain one call again. Not interleaved, on
purpose: Debian's dispatched code returns with the vector registers' upper
halves dirty (no vzeroupper), and legacy-SSE code run after it (the plain
XXH3 among it) stays slow until something clears them, which nothing in
this process does; the last column shows it. checksum.cpp clears them after
each dispatched call. The values are checked equal.
Prints a table and one JSON object; exits 2 where the library has no
dispatch (another architecture, another build).
"""
import argparse
import ctypes
import ctypes.util
import json
import statistics
import sys
import time

PROG = "xxh3_dispatch_check"


def main():
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--block-mib", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.mib < 1 or args.block_mib < 1 or args.block_mib > args.mib or args.rounds < 1:
        print(f"{PROG}: need 1 <= --block-mib <= --mib and --rounds >= 1", file=sys.stderr)
        sys.exit(2)
    name = ctypes.util.find_library("xxhash") or "libxxhash.so.0"
    try:
        lib = ctypes.CDLL(name)
        plain, dispatch = lib.XXH3_64bits, lib.XXH3_64bits_dispatch
    except (OSError, AttributeError) as e:
        print(f"{PROG}: {name}: no XXH3_64bits_dispatch ({e})", file=sys.stderr)
        sys.exit(2)
    for fn in (plain, dispatch):
        fn.restype = ctypes.c_uint64
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    n = args.mib << 20
    block = args.block_mib << 20
    buf = ctypes.create_string_buffer(n)  # zero-filled: every page touched
    ctypes.memset(buf, 0x5A, n)
    addr = ctypes.addressof(buf)
    reps = n // block

    def timed(fn, size, count):
        t = time.perf_counter()
        h = 0
        for _ in range(count):
            h = fn(addr, size)
        return time.perf_counter() - t, h

    # Plain first, every round, before any dispatched call: once one has run,
    # the upper halves stay dirty in this process (nothing here clears them).
    samples = {k: [] for k in ("plain_memory_s", "plain_cache_s", "dispatch_memory_s", "dispatch_cache_s",
                               "plain_after_dispatch_s")}
    want = plain(addr, n)
    for _ in range(args.rounds):
        samples["plain_memory_s"].append(timed(plain, n, 1)[0])
        samples["plain_cache_s"].append(timed(plain, block, reps)[0])
    for _ in range(args.rounds):
        t, h = timed(dispatch, n, 1)
        samples["dispatch_memory_s"].append(t)
        samples["dispatch_cache_s"].append(timed(dispatch, block, reps)[0])
        if h != want:
            print(f"{PROG}: the two ways disagree: {want:#x} {h:#x}", file=sys.stderr)
            sys.exit(1)
    for _ in range(args.rounds):
        t, h = timed(plain, n, 1)
        samples["plain_after_dispatch_s"].append(t)
        if h != want:
            print(f"{PROG}: plain XXH3 changed its value: {want:#x} {h:#x}", file=sys.stderr)
            sys.exit(1)
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"| XXH3-64 over {args.mib} MiB, medians of {args.rounds} | plain | dispatched |")
    print("| --- | ---: | ---: |")
    print(f"| one call, from memory | {med['plain_memory_s']:.3f} s | {med['dispatch_memory_s']:.3f} s |")
    print(f"| {reps} calls on one {args.block_mib} MiB block (in cache) | {med['plain_cache_s']:.3f} s | "
          f"{med['dispatch_cache_s']:.3f} s |")
    print(f"| one call, plain, after dispatched calls | {med['plain_after_dispatch_s']:.3f} s | |")
    result = {"benchmark": PROG, "command": "bench/xxh3_dispatch_check.py " + " ".join(sys.argv[1:]),
              "library": name, "mib": args.mib, "block_mib": args.block_mib, "rounds": args.rounds,
              "medians": med, "samples": samples}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
