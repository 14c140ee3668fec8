#!/usr/bin/env python3
"""load_dcp.py DCP_DIR WORLD [--expected EXP_DIR] [--flatten-optim]
                             [--partial] [--generic] [--out FILE]

Loads a DCP checkpoint (e.g. one written by shardkit's C++ writer) and prints,
as JSON on stdout, a checksum of every tensor's FULL value plus the value of
every non-tensor ("bytes") item.

Modes
  default   : model+optimizer mode.  Builds the same Tiny model + AdamW as
              make_dcp.py (different random init, so loading is really
              tested), at WORLD=2 sharded Shard(0) over a 2-rank gloo mesh,
              at WORLD=1 unsharded and without any process group
              (dcp.load falls back to no_dist).  State dicts come from
              torch.distributed.checkpoint.state_dict.get_state_dict, are
              filled by dcp.load, pushed into the model/optimizer with
              set_state_dict, then read back with get_state_dict and
              checksummed.  This is the path torchtitan-like trainers use.
  --generic : model-agnostic.  Single process, no_dist, rebuilds the state
              dict purely from .metadata with _EmptyStateDictLoadPlanner
              (like torch.distributed.checkpoint.format_utils.dcp_to_torch_save)
              and checksums every key.  WORLD is ignored.

Options
  --expected EXP_DIR  compare against make_dcp.py's OUT_DIR.expected/index.json
                      (sha256 of each tensor, JSON value of each bytes item;
                      an entry without sha256 names its raw bytes in "file");
                      exit status 1 on any mismatch / missing key.
  --flatten-optim     the checkpoint uses flatten_optimizer_state_dict=True
                      keys (optim.param_groups.<param fqn>.lr ...).
  --layout titan      torchtitan-like checkpoint written by
                      make_dcp.py --layout titan: model keys at top level,
                      "optimizer" (flattened), "lr_scheduler", "train_state",
                      "dataloader".  Implies --flatten-optim.
  Any key of the checkpoint that is not part of the model/optimizer state
  (extra.*, train_state.*, dataloader.*) is loaded as well, using
  .metadata's planner_data to rebuild its nesting.
  --partial           DefaultLoadPlanner(allow_partial_load=True): keys the
                      model/optimizer has but the checkpoint lacks are skipped
                      instead of raising "Missing key in checkpoint state_dict".

Checksums: sha256 over the raw little-endian bytes of the C-contiguous full
tensor; "sum" is the float64 sum.  Identical to make_dcp.py's index.json.
"""
import argparse
import datetime
import faulthandler
import hashlib
import json
import os
import queue
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("USE_LIBUV", "0")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import common  # noqa: E402


def summarize(flat):
    tensors, objs = {}, {}
    for fqn, v in flat.items():
        if isinstance(v, torch.Tensor):
            tensors[fqn] = common.checksum(common.full_value(v))
        else:
            objs[fqn] = common.jsonable(v)
    return tensors, objs


def compare(result, exp_dir):
    idx = json.load(open(os.path.join(exp_dir, "index.json")))
    problems = []
    for fqn, e in idx.items():
        if e["kind"] == "tensor" and "sha256" not in e:
            # An index written by shardkit's test: raw bytes in "file".
            with open(os.path.join(exp_dir, e["file"]), "rb") as f:
                e["sha256"] = hashlib.sha256(f.read()).hexdigest()
            e.setdefault("sum", None)
        if e["kind"] == "tensor":
            got = result["tensors"].get(fqn)
            if got is None:
                problems.append(f"missing tensor {fqn}")
            elif (got["sha256"] != e["sha256"] or got["shape"] != e["shape"]
                  or got["dtype"] != e["dtype"]):
                problems.append(f"tensor mismatch {fqn}: got {got} want "
                                f"{ {k: e[k] for k in ('dtype', 'shape', 'sum', 'sha256')} }")
        else:
            got = result["bytes"].get(fqn, "<missing>")
            if got != e["value"]:
                problems.append(f"bytes mismatch {fqn}: got {got!r} want {e['value']!r}")
    extra = sorted(set(result["tensors"]) - {k for k, e in idx.items() if e["kind"] == "tensor"})
    return problems, extra


def build_state(world, rank, args, metadata):
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import get_state_dict, StateDictOptions

    torch.manual_seed(999 + rank)  # deliberately different from make_dcp.py
    model = common.Tiny()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        common.shard_model(model, mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = common.make_sched(optim) if args.layout == "titan" else None
    flatten_optim = args.flatten_optim or args.layout == "titan"
    opts = StateDictOptions(flatten_optimizer_state_dict=flatten_optim)
    # get_state_dict() initialises the (empty) AdamW state with a dummy step
    # (state_dict._init_optim_state), so every exp_avg/exp_avg_sq/step exists.
    msd, osd = get_state_dict(model, optim, options=opts)
    if args.layout == "titan":
        state = dict(msd)
        state["optimizer"] = osd
        state["lr_scheduler"] = sched.state_dict()
    else:
        state = {"model": msd, "optim": osd}
    # Every other key in the checkpoint (extra.*, train_state.*,
    # dataloader.*, ...) gets a placeholder so that it is loaded too:
    # bytes items -> None, tensors -> empty tensor of the saved size/dtype.
    known, _ = common.flatten(state)
    pd = metadata.planner_data or {}
    for key, md in metadata.state_dict_metadata.items():
        if key in known:
            continue
        path = pd.get(key) or tuple(key.split(".", 1))
        val = (torch.empty(md.size, dtype=md.properties.dtype)
               if isinstance(md, TensorStorageMetadata) else None)
        set_element(state, path, val)
    return model, optim, sched, opts, state, set(msd)


def model_mode(rank, world, args):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    md = FileSystemReader(args.dcp_dir).read_metadata()
    model, optim, sched, opts, state, model_keys = build_state(world, rank, args, md)
    planner = DefaultLoadPlanner(allow_partial_load=args.partial)
    dcp.load(state, checkpoint_id=args.dcp_dir, planner=planner)
    if args.layout == "titan":
        model_sd = {k: state.pop(k) for k in list(model_keys)}
        optim_sd = state.pop("optimizer")
        sched.load_state_dict(state.pop("lr_scheduler"))
    else:
        model_sd, optim_sd = state.pop("model"), state.pop("optim")
    set_state_dict(model, optim, model_state_dict=model_sd,
                   optim_state_dict=optim_sd, options=opts)
    # read back from the live model/optimizer (+ the other loaded items)
    msd, osd = get_state_dict(model, optim, options=opts)
    if args.layout == "titan":
        back = dict(msd)
        back["optimizer"] = osd
        back["lr_scheduler"] = sched.state_dict()
    else:
        back = {"model": msd, "optim": osd}
    back.update(state)
    flat, _ = common.flatten(back)
    tensors, objs = summarize(flat)  # collective (full_tensor) on all ranks
    return {"mode": "model", "world": world, "tensors": tensors, "bytes": objs}


def generic_mode(args):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd = {}
    _load_state_dict(sd, storage_reader=FileSystemReader(args.dcp_dir),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    flat, _ = common.flatten(sd)
    tensors, objs = summarize(flat)
    return {"mode": "generic", "world": 1, "tensors": tensors, "bytes": objs}


def finish(result, args):
    status = 0
    if args.expected:
        problems, extra = compare(result, args.expected)
        result["compare"] = {"expected": args.expected, "ok": not problems,
                             "problems": problems, "unexpected_tensors": extra}
        status = 0 if not problems else 1
    text = common.dump_json(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text, flush=True)
    if args.expected:
        print(f"COMPARE {'OK' if status == 0 else 'FAILED'}: "
              f"{len(result['compare']['problems'])} problem(s)",
              file=sys.stderr, flush=True)
    return status


def dump_stacks_if_slow():
    """$SHARDKIT_PY_STACKS_AFTER seconds: then every thread's stack goes to
    stderr (the process goes on), so a hang names where it waits."""
    after = os.environ.get("SHARDKIT_PY_STACKS_AFTER")
    if after:
        faulthandler.dump_traceback_later(float(after), exit=False)


def worker(rank, world, port, args, q):
    dump_stacks_if_slow()
    # A rank that fails leaves its peer in a collective: gloo's timeout ends
    # that wait with an error instead of the default 30 minutes.
    common.init_worker(rank, world, port, datetime.timedelta(seconds=120))
    try:
        res = model_mode(rank, world, args)
        if rank == 0:
            q.put(res)
    except Exception:
        traceback.print_exc()
        if rank == 0:
            q.put(None)
        raise
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dcp_dir")
    ap.add_argument("world", type=int, choices=[1, 2])
    ap.add_argument("--expected")
    ap.add_argument("--flatten-optim", action="store_true")
    ap.add_argument("--layout", choices=["plain", "titan"], default="plain")
    ap.add_argument("--partial", action="store_true")
    ap.add_argument("--generic", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    args.dcp_dir = os.path.abspath(args.dcp_dir)
    dump_stacks_if_slow()

    if args.generic:
        sys.exit(finish(generic_mode(args), args))
    if args.world == 1:
        sys.exit(finish(model_mode(0, 1, args), args))
    q = mp.get_context("fork").Queue()
    store, procs = common.fork_workers(worker, args.world, (args, q))  # noqa: F841 (store: until this process ends)
    # Rank 0's result, or the first rank that died without one: a worker that
    # crashes must fail the load, not leave this process waiting forever.
    res, deadline = None, time.monotonic() + 300
    while True:
        try:
            res = q.get(timeout=1.0)
            break
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.terminate()
                why = ("rank(s) %s exited with %s" % (dead, [procs[r].exitcode for r in dead]) if dead
                       else "no result after 300 s")
                print("load failed: " + why, file=sys.stderr)
                sys.exit(2)
    for p in procs:
        p.join(timeout=150)
        if p.exitcode is None:
            p.terminate()
    if res is None or any(p.exitcode for p in procs):
        print("load failed: exit codes %s" % [p.exitcode for p in procs], file=sys.stderr)
        sys.exit(2)
    sys.exit(finish(res, args))


if __name__ == "__main__":
    main()
