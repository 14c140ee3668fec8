#!/usr/bin/env python3
"""Does checkpoint.direct_io auto's probe pick the way that is faster for a
save-sized write? Side by side, per round on the same disk:

  - the probe as `probe_direct_io` runs it (checkpoint/storage/direct_io.cpp):
    64 MiB in 8 MiB pieces, page cache and O_DIRECT interleaved, twice each
    way, each write followed by fsync, the faster of the two kept; by one
    thread (what the product does) and by the save's four I/O threads;
  - the write it stands for: 1 GiB in 8 MiB pieces by four threads (a save's
    default io_threads), twice each way, interleaved.

Each round says which way each probe chose and which way won at 1 GiB; the
summary counts how often each probe agreed. The bytes come from one buffer
written before the first round (touched memory: new memory costs 2-5 s per
GiB on this project's machine, docs/benchmarks.md); O_DIRECT writes go from
a page-aligned copy of each piece in a buffer per thread that is allocated
and touched once, as the save's bounce buffers are.

  python3 bench/direct_io_probe_check.py [--dir DIR] [--rounds 6] [--size-mb 1024]
                                         [--probe-mb 64] [--threads 4] [--json FILE]

Prints a table and JSON. Needs a directory whose file system takes O_DIRECT
(an error names it otherwise); the default is the current directory.
"""
import argparse
import json
import mmap
import os
import sys
import threading
import time

PIECE = 8 << 20


BOUNCE = []  # one page-aligned, touched piece buffer per thread, kept (as the save's are)


def bounce_buffers(threads):
    while len(BOUNCE) < threads:
        b = mmap.mmap(-1, PIECE)
        b.write(b"\0" * PIECE)
        BOUNCE.append(b)
    return BOUNCE


def timed_write(path, data, nbytes, direct, threads):
    """Seconds to write data[:nbytes] into a new `path` by `threads` threads
    (piece i by thread i % threads) and fsync it; the file is removed."""
    buffers = bounce_buffers(threads)
    t0 = time.perf_counter()
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    errors = []

    def writer(first):
        bounce = buffers[first]
        try:
            for i in range(first, (nbytes + PIECE - 1) // PIECE, threads):
                lo = i * PIECE
                piece = data[lo:min(nbytes, lo + PIECE)]
                if direct:
                    bounce[:len(piece)] = piece
                    piece = memoryview(bounce)[:len(piece)]
                done = 0
                while done < len(piece):
                    done += os.pwrite(fd, piece[done:], lo + done)
        except OSError as e:
            errors.append(e)

    pool = [threading.Thread(target=writer, args=(w,)) for w in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    try:
        if errors:
            raise errors[0]
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(path)
    return time.perf_counter() - t0


def best_of_two(path, data, nbytes, threads):
    """(page cache s, O_DIRECT s): the faster of two writes each way, interleaved."""
    pc, dio = float("inf"), float("inf")
    for _ in range(2):
        pc = min(pc, timed_write(path, data, nbytes, False, threads))
        dio = min(dio, timed_write(path, data, nbytes, True, threads))
    return pc, dio


def way(pc, dio):
    return "O_DIRECT" if dio < pc else "page cache"  # a tie keeps the page cache, as prefer_direct does


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=".")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--probe-mb", type=int, default=64)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--json")
    a = ap.parse_args()
    if min(a.rounds, a.size_mb, a.probe_mb, a.threads) < 1:
        sys.exit("direct_io_probe_check: --rounds, --size-mb, --probe-mb and --threads must be >= 1")
    path = os.path.join(a.dir, ".direct_io_probe_check.%d" % os.getpid())
    size, probe = a.size_mb << 20, a.probe_mb << 20
    data = memoryview(os.urandom(max(size, probe)))
    rows = []
    for r in range(a.rounds):
        try:
            p1 = best_of_two(path, data, probe, 1)
            pn = best_of_two(path, data, probe, a.threads)
            big = best_of_two(path, data, size, a.threads)
        except OSError as e:
            sys.exit("direct_io_probe_check: %s: %s" % (a.dir, e))
        rows.append({"round": r, "probe_1_thread_s": list(p1), "probe_threads_s": list(pn), "write_s": list(big),
                     "probe_1_thread_way": way(*p1), "probe_threads_way": way(*pn), "faster_way": way(*big)})
    print("probe %d MiB; write %d MiB by %d threads; seconds as page cache / O_DIRECT (the faster of two each)"
          % (a.probe_mb, a.size_mb, a.threads))
    print("%-5s  %-28s  %-28s  %-28s" % ("round", "probe, 1 thread", "probe, %d threads" % a.threads,
                                         "write, %d threads" % a.threads))
    for x in rows:
        cell = lambda s, w: "%.3f / %.3f  %s" % (s[0], s[1], w)  # noqa: E731
        print("%-5d  %-28s  %-28s  %-28s" % (x["round"], cell(x["probe_1_thread_s"], x["probe_1_thread_way"]),
                                             cell(x["probe_threads_s"], x["probe_threads_way"]),
                                             cell(x["write_s"], x["faster_way"])))
    agree1 = sum(x["probe_1_thread_way"] == x["faster_way"] for x in rows)
    agreen = sum(x["probe_threads_way"] == x["faster_way"] for x in rows)
    print("the probe chose the faster way in %d of %d rounds by 1 thread, %d of %d by %d threads"
          % (agree1, len(rows), agreen, len(rows), a.threads))
    report = {"probe_mb": a.probe_mb, "size_mb": a.size_mb, "threads": a.threads, "rounds": rows,
              "agree_1_thread": agree1, "agree_threads": agreen}
    print(json.dumps(report))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
