"""Shared model / sharding helpers for make_dcp.py and load_dcp.py.

Tested with torch 2.6.0 (Debian python3-torch, CPU only), gloo backend.
"""
import hashlib
import json
import os

import torch
import torch.nn as nn


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------
class Tiny(nn.Module):
    """Embedding[16,8] -> Linear 8->8 (bias) -> ReLU -> Linear 8->16 (no bias)
    -> Linear 16->5 (bias).  The last layer has dim0 = 5, so Shard(0) over 2
    ranks is UNEVEN (3 + 2 rows): useful to exercise chunk bookkeeping."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8, bias=True)
        self.out = nn.Linear(8, 16, bias=False)
        self.head = nn.Linear(16, 5, bias=True)

    def forward(self, x):
        # Functional forward over *full* parameter values.  For DTensor
        # parameters full_tensor() is an autograd-aware all-gather, so the
        # gradients come back as DTensors with the parameter's placements.
        # (FSDP2's own forward does not work on CPU in torch 2.6: it calls
        # Stream.record_event, see NOTES.md.)
        F = torch.nn.functional
        h = F.embedding(x, _full(self.emb.weight))
        h = torch.relu(F.linear(h, _full(self.proj.weight), _full(self.proj.bias)))
        h = F.linear(h, _full(self.out.weight))
        return F.linear(h, _full(self.head.weight), _full(self.head.bias))


def _full(p):
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        return p.full_tensor()
    return p


def fixed_input():
    x = torch.arange(16, dtype=torch.long).reshape(2, 8)
    y = torch.linspace(-1.0, 1.0, 2 * 8 * 5).reshape(2, 8, 5)
    return x, y


def _tcp_store(*args, **kwargs):
    """A TCPStore with the classic server: Debian's torch 2.6 has no libuv,
    and a TCPStore made directly asks for it unless told (USE_LIBUV=0 covers
    only init_process_group's own stores). Older torch has no use_libuv."""
    import torch.distributed as dist
    try:
        return dist.TCPStore(*args, use_libuv=False, **kwargs)
    except TypeError:
        return dist.TCPStore(*args, **kwargs)


def parent_store():
    """The workers' TCPStore server, held by the launching process on a port
    the kernel picks as it binds: (store, port). Keep the store alive until
    the workers end. (Picking a free port first and letting rank 0 bind it
    later raced with the other tests' sockets: "Address already in use".)"""
    import datetime
    store = _tcp_store("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                       timeout=datetime.timedelta(seconds=120))
    return store, store.port


def fork_workers(target, world, args):
    """Starts target(rank, world, port, *args) for each rank in a forked
    child of this process, which imported torch already (spawned children
    import it again: 3-4 s each with Debian 13's torch 2.6). The store
    server, parent_store(), starts after the forks, so that no child copies
    its thread; each child reads the port from a pipe. Returns (store,
    processes): keep the store until they end."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    ports = ctx.SimpleQueue()
    procs = [ctx.Process(target=_forked_worker, args=(target, r, world, ports, args)) for r in range(world)]
    for p in procs:
        p.start()
    store, port = parent_store()
    for _ in procs:
        ports.put(port)
    return store, procs


def _forked_worker(target, rank, world, ports, args):
    target(rank, world, ports.get(), *args)


def join_workers(procs, timeout_s=300):
    """Waits for fork_workers()'s processes; once one fails (its peers would
    wait in a collective) or none ended in time, kills the rest and exits
    this process with status 2, naming them."""
    import sys
    import time
    from multiprocessing.connection import wait

    deadline = time.monotonic() + timeout_s
    while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in procs):
            break
        wait([p.sentinel for p in procs if p.exitcode is None], max(0.0, deadline - time.monotonic()))
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        for p in procs:
            if p.exitcode is None:
                p.kill()
        print("workers failed (rank, exit code; None: no end yet): %s" % bad, file=sys.stderr)
        sys.exit(2)


def init_worker(rank, world, port, timeout):
    """Joins rank `rank` of `world` to the gloo group through parent_store()'s
    server on `port`."""
    import torch.distributed as dist
    os.environ.setdefault("USE_LIBUV", "0")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    store = _tcp_store("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


def shard_model(model, mesh, log=print, use_fsdp2=False):
    """Shard every parameter Shard(0) over the 1-D mesh.

    use_fsdp2=True applies FSDP2 fully_shard instead.  In torch 2.6 on CPU
    fully_shard() itself succeeds but the first forward fails with
    AttributeError: 'Stream' object has no attribute 'record_event'
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:171), so the
    default is distribute_tensor by hand.  Both give the same DCP layout
    (DTensor, Shard(0), torch.chunk split: 5 rows -> 3 + 2)."""
    if use_fsdp2:
        from torch.distributed._composable.fsdp import fully_shard

        for m in (model.emb, model.proj, model.out, model.head):
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return "fully_shard"
    else:
        from torch.distributed.tensor import distribute_tensor, Shard

        for mod in model.modules():
            for name, p in list(mod.named_parameters(recurse=False)):
                dp = nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)]))
                setattr(mod, name, dp)
        return "distribute_tensor"


# ---------------------------------------------------------------------------
# Checksums / dumps
# ---------------------------------------------------------------------------
def full_value(t):
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().cpu().contiguous()


def tensor_bytes(t):
    # numpy-free: raw bytes of a contiguous CPU tensor (little endian on x86)
    t = t.contiguous()
    return bytes(t.view(torch.uint8).reshape(-1).tolist()) if t.numel() else b""


def tensor_bytes_fast(t):
    t = t.contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if _has_numpy() else tensor_bytes(t)


_NP = None


def _has_numpy():
    global _NP
    if _NP is None:
        try:
            import numpy  # noqa: F401

            _NP = True
        except Exception:
            _NP = False
    return _NP


def checksum(t):
    b = tensor_bytes_fast(t)
    return {
        "dtype": str(t.dtype).replace("torch.", ""),
        "shape": list(t.shape),
        "sum": float(t.double().sum().item()) if t.numel() else 0.0,
        "sha256": hashlib.sha256(b).hexdigest(),
        "nbytes": len(b),
    }


def jsonable(v):
    import io

    if isinstance(v, io.BytesIO):
        pos = v.tell()
        v.seek(0)
        inner = torch.load(v, weights_only=False)
        v.seek(pos)
        return {"__BytesIO_torch_save__": jsonable(inner)}
    if isinstance(v, (bytes, bytearray)):
        return {"__bytes_hex__": bytes(v).hex()}
    if isinstance(v, torch.Tensor):
        return {"__tensor__": checksum(full_value(v))}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    return repr(v)


def flatten(sd):
    """Flatten exactly as DCP's DefaultSavePlanner does (torch 2.6)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, mapping = flatten_state_dict(sd)
    return flat, mapping


def dump_json(obj):
    return json.dumps(obj, indent=1, sort_keys=True)


# ---------------------------------------------------------------------------
# torchtitan-like top-level layout
# ---------------------------------------------------------------------------
def titan_extra_states(rank, world, step, losses=None):
    """Non-model/optimizer states shaped like torchtitan's (early-2025
    torchtitan/components/checkpoint.py TrainState, ParallelAwareDataloader).
    losses=None builds load placeholders."""
    import io
    import pickle

    def bio(obj):
        b = io.BytesIO()
        torch.save(obj, b)
        return b

    if losses is None:
        train_state = {"step": torch.zeros((), dtype=torch.int32),
                       "global_avg_losses": io.BytesIO(),
                       "global_max_losses": io.BytesIO(),
                       "log_steps": io.BytesIO()}
        dataloader = {"world_size": None, f"dp_rank_{rank}": None}
    else:
        train_state = {"step": torch.tensor(step, dtype=torch.int32),
                       "global_avg_losses": bio(list(losses)),
                       "global_max_losses": bio([max(losses)]),
                       "log_steps": bio(list(range(1, step + 1)))}
        dataloader = {"world_size": world,
                      f"dp_rank_{rank}": pickle.dumps({"sample_idx": 100 * rank + step})}
    return {"train_state": train_state, "dataloader": dataloader}


def make_sched(optim):
    return torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
