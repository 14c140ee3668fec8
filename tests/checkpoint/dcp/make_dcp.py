#!/usr/bin/env python3
"""make_dcp.py OUT_DIR [--flatten-optim] [--steps N]

Writes a torch.distributed.checkpoint (DCP) checkpoint at world size 2 (gloo,
CPU) into OUT_DIR, plus the expected full (unsharded) values into
OUT_DIR.expected/:

  OUT_DIR.expected/index.json   {fqn: {"kind": "tensor", dtype, shape, sum,
                                       sha256, nbytes, file}
                                  | {"kind": "bytes", "value": <json>} }
  OUT_DIR.expected/<fqn>.bin    raw little-endian bytes of the full tensor
                                (C-contiguous, row-major)

The FQNs are the *flattened DCP keys* exactly as they appear in
.metadata's state_dict_metadata (e.g. "model.proj.weight",
"optim.state.proj.weight.exp_avg", "optim.param_groups.0.lr").

Model: Tiny (see common.py), parameters sharded Shard(0) on a 1-D mesh of 2
CPU ranks with distribute_tensor (--fsdp2: FSDP2 fully_shard, broken on CPU in 2.6), AdamW, N=2
optimizer steps on a fixed input, state dicts from
torch.distributed.checkpoint.state_dict.get_state_dict.

--flatten-optim uses StateDictOptions(flatten_optimizer_state_dict=True)
(the torchtitan layout: optim.param_groups.<param fqn>.lr etc.).

--layout titan writes a torchtitan-like checkpoint instead: model keys at the
top level (emb.weight ...), "optimizer" (flattened optimizer state dict),
"lr_scheduler" (LambdaLR.state_dict()), "train_state" (step as 0-d int32
tensor + io.BytesIO items, like torchtitan's TrainState) and "dataloader"
(world_size + a per-rank dp_rank_<r> bytes item, only written by rank r).
"""
import argparse
import datetime
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("USE_LIBUV", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import common  # noqa: E402


def worker(rank, world, port, out_dir, flatten_optim, steps, fsdp2, layout):
    # A failing rank leaves its peer in a collective: end that wait in 120 s.
    common.init_worker(rank, world, port, datetime.timedelta(seconds=120))
    try:
        _worker(rank, world, out_dir, flatten_optim, steps, fsdp2, layout)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _worker(rank, world, out_dir, flatten_optim, steps, fsdp2, layout):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_state_dict,
        StateDictOptions,
    )
    from torch.distributed.device_mesh import init_device_mesh

    log = (lambda *a: print(f"[rank{rank}]", *a, flush=True))
    torch.manual_seed(1234)  # same init on every rank
    model = common.Tiny()
    mesh = init_device_mesh("cpu", (world,))
    how = common.shard_model(model, mesh, log, use_fsdp2=fsdp2)
    log("sharding via", how)
    for n, p in model.named_parameters():
        log(n, type(p.data).__name__, tuple(p.shape),
            getattr(p, "placements", None),
            tuple(p.to_local().shape) if hasattr(p, "to_local") else None)

    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = common.make_sched(optim) if layout == "titan" else None
    x, y = common.fixed_input()
    losses = []
    for _ in range(steps):
        optim.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        if sched is not None:
            sched.step()
        losses.append(float(loss))
    log("loss", float(loss))

    if layout == "titan":
        flatten_optim = True  # torchtitan's OptimizersContainer does this
    opts = StateDictOptions(flatten_optimizer_state_dict=flatten_optim)
    model_sd, optim_sd = get_state_dict(model, optim, options=opts)
    if layout == "titan":
        # torchtitan (mid-2025+) _flattened_model_states_sd(): model keys at
        # the top level, other states under "optimizer", "lr_scheduler",
        # "dataloader", "train_state".
        state = dict(model_sd)
        state["optimizer"] = optim_sd
        state["lr_scheduler"] = sched.state_dict()
        state.update(common.titan_extra_states(rank, world, steps, losses))
    else:
        state = {"model": model_sd, "optim": optim_sd,
                 # a couple of non-tensor items to show BytesStorageMetadata
                 "extra": {"step": steps, "note": "shardkit-dcp-fixture"}}

    dcp.save(state, checkpoint_id=out_dir)
    log("saved to", out_dir)

    # ---- expected values (full tensors) ------------------------------------
    flat, mapping = common.flatten(state)
    # non-tensor items can differ per rank (torchtitan dataloader.dp_rank_N):
    # gather them so rank 0 can record all of them
    objs = [None] * world
    dist.all_gather_object(objs, {k: (common.jsonable(v), type(v).__name__,
                                      list(mapping[k]))
                                  for k, v in flat.items()
                                  if not isinstance(v, torch.Tensor)})
    index = {}
    exp_dir = out_dir.rstrip("/") + ".expected"
    if rank == 0:
        os.makedirs(exp_dir, exist_ok=True)
    for fqn, v in flat.items():
        if isinstance(v, torch.Tensor):
            full = common.full_value(v)  # collective for DTensor: all ranks
            if rank == 0:
                fn = fqn + ".bin"
                with open(os.path.join(exp_dir, fn), "wb") as f:
                    f.write(common.tensor_bytes_fast(full))
                ent = common.checksum(full)
                ent.update(kind="tensor", file=fn,
                           python_type=type(v).__name__,
                           placements=[str(p) for p in v.placements]
                           if hasattr(v, "placements") else None,
                           obj_path=list(mapping[fqn]))
                index[fqn] = ent
    if rank == 0:
        for per_rank in objs:
            for fqn, (val, tname, path) in per_rank.items():
                index.setdefault(fqn, {"kind": "bytes", "value": val,
                                       "python_type": tname, "obj_path": path})
    if rank == 0:
        with open(os.path.join(exp_dir, "index.json"), "w") as f:
            f.write(common.dump_json(index))
        log("expected values in", exp_dir)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--flatten-optim", action="store_true")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--layout", choices=["plain", "titan"], default="plain",
                    help="plain: {model, optim, extra}; titan: torchtitan-like")
    ap.add_argument("--fsdp2", action="store_true",
                    help="use fully_shard (fails on CPU in torch 2.6)")
    a = ap.parse_args()
    out = os.path.abspath(a.out_dir)
    world = 2
    store, procs = common.fork_workers(worker, world, (out, a.flatten_optim, a.steps, a.fsdp2, a.layout))
    common.join_workers(procs)
    del store  # served the workers until they ended


if __name__ == "__main__":
    main()
