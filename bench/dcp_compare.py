#!/usr/bin/env python3
"""PyTorch DCP on the same GPU state as `ckpt_bench --device cuda`, same disk.

One process. The state is fp32 tensors of --tensor-mb on the GPU totalling
--size-mb (the same shapes ckpt_bench makes). Measures, median of --trials:
  bare_pinned_copy_s      the state into preallocated pinned host memory
  dcp_save_s              dcp.save (sync)
  dcp_async_default_*     dcp.async_save with its default staging
  dcp_async_pinned_*      async_save with DefaultStager(pinned memory)
  dcp_async_staging_*     async_save with asynchronous staging, where the
                          version has it (the call returns before the copy)
  dcp_load_s              dcp.load into GPU tensors
For async variants *_blocking_s is the time until async_save returns (what a
training loop waits for) and *_total_s until the save is committed.
Every DCP call is wrapped: a failure inside DCP is reported in the JSON
("errors") and the table, never fatal.

  python3 bench/dcp_compare.py [--size-mb 8192] [--trials 3] [--dir D] [--json F]
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=float, default=8192)
    ap.add_argument("--tensor-mb", type=int, default=64)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "shardkit_dcp_compare"))
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    out = {"torch": torch.__version__, "errors": {}, "trials": args.trials}
    if not torch.cuda.is_available():
        print("dcp_compare: no CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    # DCP's async path wants a process group with a CPU backend.
    # Absolute: in file://build-gpu/... the first component would be a host.
    store_file = os.path.abspath(os.path.join(args.dir, "store"))
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method="file://" + store_file, rank=0, world_size=1)

    total = int(args.size_mb * 1048576) // 4
    per = max(1, args.tensor_mb * 1048576 // 4)
    torch.manual_seed(1)
    sd = {}
    left, i = total, 0
    while left > 0:
        n = min(per, left)
        sd["w%d" % i] = torch.randn(n, device=dev)
        left -= n
        i += 1
    torch.cuda.synchronize()
    nbytes = total * 4
    out["state_bytes"] = nbytes
    out["tensors"] = len(sd)

    def timed(name, fn, trials=args.trials, warm=False):
        times = []
        try:
            for t in range(trials + (1 if warm else 0)):
                t0 = time.perf_counter()
                fn(t)
                dt = time.perf_counter() - t0
                if not (warm and t == 0):
                    times.append(dt)
            out[name] = statistics.median(times)
        except Exception as e:  # DCP's own failures are results, not crashes
            out["errors"][name] = "%s: %s" % (type(e).__name__, e)
            traceback.print_exc()

    # Bare pinned copy.
    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in sd.items()}

    def bare(_):
        for k, v in sd.items():
            pinned[k].copy_(v, non_blocking=True)
        torch.cuda.synchronize()
    timed("bare_pinned_copy_s", bare, warm=True)
    del pinned

    def path(tag, t):
        return os.path.join(args.dir, "%s_%d" % (tag, t))

    timed("dcp_save_s", lambda t: dcp.save(sd, checkpoint_id=path("sync", t)))

    def async_variant(tag, make_kwargs):
        blocking, total_s = [], []
        try:
            kwargs = make_kwargs()
            for t in range(args.trials):
                t0 = time.perf_counter()
                fut = dcp.async_save(sd, checkpoint_id=path(tag, t), **kwargs)
                blocking.append(time.perf_counter() - t0)
                if hasattr(fut, "upload_completion"):
                    # Async staging (2.9+) returns an AsyncSaveResponse.
                    fut.staging_completion.result()
                    fut.upload_completion.result()
                else:
                    fut.result()
                total_s.append(time.perf_counter() - t0)
            out["dcp_async_%s_blocking_s" % tag] = statistics.median(blocking)
            out["dcp_async_%s_first_blocking_s" % tag] = blocking[0]
            out["dcp_async_%s_total_s" % tag] = statistics.median(total_s)
        except Exception as e:
            out["errors"]["dcp_async_" + tag] = "%s: %s (after %d calls)" % (type(e).__name__, e, len(blocking))
            if blocking:
                out["dcp_async_%s_first_blocking_s" % tag] = blocking[0]
            traceback.print_exc()

    async_variant("default", lambda: {})

    def stager(async_staging):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        opts = StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                              use_async_staging=async_staging, use_non_blocking_copy=True)
        return {"async_stager": DefaultStager(opts)}
    async_variant("pinned", lambda: stager(False))
    async_variant("staging", lambda: stager(True))

    target = {k: torch.zeros_like(v) for k, v in sd.items()}

    def load(_):
        dcp.load(target, checkpoint_id=path("sync", 0))
        torch.cuda.synchronize()
    timed("dcp_load_s", load)
    if "dcp_load_s" in out:
        out["dcp_load_exact"] = all(torch.equal(sd[k], target[k]) for k in sd)

    dist.destroy_process_group()
    shutil.rmtree(args.dir, ignore_errors=True)
    print("dcp_compare: torch %s, %.2f GiB fp32 in %d tensors (median of %d)" %
          (out["torch"], nbytes / 2**30, len(sd), args.trials))
    for k, v in out.items():
        if k.endswith("_s"):
            print("  %-40s %10.4f s" % (k, v))
    for k, v in out["errors"].items():
        print("  %-40s FAILED: %s" % (k, v))
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
