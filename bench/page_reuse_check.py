#!/usr/bin/python3
"""page_reuse_check: what a page-cache write costs on this machine when the
memory it lands in was freed long ago, against memory freed a moment ago,
and against O_DIRECT, side by side.

  bench/page_reuse_check.py [--dir /work] [--mib 1024] [--threads 4]
                            [--pause 5] [--rounds 3] [--json F]

A VM whose virtio-balloon offers free page reporting (this project's machine
does: feature bit 5 of its balloon device) tells the host which guest memory
has been free for a while (blocks of 2^page_reporting_order pages, a couple
of seconds after they are freed); the host drops it, and the next touch of
that memory faults it in on the host again. A page-cache write needs new
pages for every byte, so where it gets them decides its speed: from memory
freed just before (a job that deletes its previous checkpoint right before
the next save) or from memory free for longer. An O_DIRECT write needs no
new pages.

Per round, in this order: sleep --pause s; touch --mib of new anonymous
memory (mmap, memset; "freed long ago"), unmap it, touch the same amount at
once ("just freed"), unmap; sleep --pause s; write --mib into a new file
through the page cache ("freed long ago": --threads threads, 8 MiB pwrite
pieces of a buffer touched beforehand, fsync; direct_io_probe_check.py's
timed_write), delete it, write a second file at once ("just freed"), delete
it; write a third with O_DIRECT (the same pieces through each thread's
page-aligned buffer, fsync), delete it. Prints a table of medians over rounds and one JSON object with
every round.
"""
import argparse
import ctypes
import glob
import json
import mmap
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from direct_io_probe_check import timed_write  # noqa: E402  (8 MiB pieces, fsync, file removed)

PROG = "page_reuse_check"


def free_page_reporting():
    """(True/False/None, page_reporting_order or None) from sysfs."""
    on = None
    for dev in glob.glob("/sys/bus/virtio/devices/*"):
        try:
            with open(os.path.join(dev, "device")) as f:
                if int(f.read().strip(), 16) != 5:  # virtio-balloon
                    continue
            with open(os.path.join(dev, "features")) as f:
                bits = f.read().strip()
            on = len(bits) > 5 and bits[5] == "1"  # VIRTIO_BALLOON_F_REPORTING
        except (OSError, ValueError):
            continue
    order = None
    try:
        with open("/sys/module/page_reporting/parameters/page_reporting_order") as f:
            order = int(f.read().strip())
    except (OSError, ValueError):
        pass
    return on, order


def touch_anon(nbytes):
    m = mmap.mmap(-1, nbytes)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    t = time.perf_counter()
    ctypes.memset(addr, 0x5A, nbytes)
    s = time.perf_counter() - t
    del addr
    m.close()
    return s


def main():
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/work")
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--pause", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.mib < 8 or a.mib % 8 or a.threads < 1 or a.rounds < 1 or a.pause < 0:
        print(f"{PROG}: need --mib a multiple of 8, --threads >= 1, --rounds >= 1, --pause >= 0",
              file=sys.stderr)
        sys.exit(2)
    if not os.path.isdir(a.dir):
        print(f"{PROG}: {a.dir}: not a directory", file=sys.stderr)
        sys.exit(2)
    nbytes = a.mib << 20
    source = memoryview(bytes(range(256)) * (nbytes // 256))  # touched before any timing
    path = os.path.join(a.dir, f".{PROG}.{os.getpid()}")
    reporting, order = free_page_reporting()
    keys = [("anon_long_ago_s", "touch new anonymous memory, freed long ago"),
            ("anon_just_freed_s", "touch new anonymous memory, just freed"),
            ("cache_long_ago_s", f"page-cache write + fsync, {a.threads} threads, memory freed long ago"),
            ("cache_just_freed_s", f"page-cache write + fsync, {a.threads} threads, memory just freed"),
            ("direct_s", f"O_DIRECT write + fsync, {a.threads} threads")]
    rounds = []
    try:
        for r in range(a.rounds):
            row = {}
            time.sleep(a.pause)
            row["anon_long_ago_s"] = touch_anon(nbytes)
            row["anon_just_freed_s"] = touch_anon(nbytes)
            time.sleep(a.pause)
            row["cache_long_ago_s"] = timed_write(path, source, nbytes, False, a.threads)
            row["cache_just_freed_s"] = timed_write(path, source, nbytes, False, a.threads)
            row["direct_s"] = timed_write(path, source, nbytes, True, a.threads)
            rounds.append({k: round(v, 3) for k, v in row.items()})
            print(f"{PROG}: round {r}: " + ", ".join(f"{k} {v:.3f}" for k, v in rounds[-1].items()),
                  file=sys.stderr)
    except OSError as e:
        print(f"{PROG}: {path}: {e.strerror}", file=sys.stderr)
        sys.exit(1)
    med = {k: round(statistics.median(x[k] for x in rounds), 3) for k, _ in keys}
    gib = nbytes / (1 << 30)
    print(f"free page reporting: {'on' if reporting else 'off' if reporting is False else 'unknown'}"
          f", page_reporting_order {order}; {a.mib} MiB in {a.dir}, pause {a.pause:g} s, "
          f"medians of {a.rounds} rounds")
    print(f"| {'what, ' + str(a.mib) + ' MiB':<62} | seconds | GB/s |")
    print(f"| {'-' * 62} | ------: | ---: |")
    for k, label in keys:
        print(f"| {label:<62} | {med[k]:7.3f} | {gib * 1.073741824 / med[k]:4.2f} |")
    out = {"bench": PROG, "free_page_reporting": reporting, "page_reporting_order": order,
           "dir": a.dir, "mib": a.mib, "threads": a.threads, "pause_s": a.pause,
           "medians": med, "rounds": rounds,
           "cache_long_ago_over_just_freed": round(med["cache_long_ago_s"] / med["cache_just_freed_s"], 2),
           "cache_just_freed_over_direct": round(med["cache_just_freed_s"] / med["direct_s"], 2)}
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
