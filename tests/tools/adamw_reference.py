#!/usr/bin/python3
"""torch.optim.AdamW on the parameters and gradients a C++ test wrote, for
comparison with framework::optim::ShardedAdamW (tests/framework/train/
test_training.cpp, AdamWImpls.*).

  adamw_reference.py DIR

DIR/manifest.json: {"shapes": [[...], ...], "steps": S, "lrs": [S floats],
"beta1", "beta2", "eps", "weight_decay", "impls": ["fused", "foreach",
"for_loop"]}; DIR/param_I.bin: parameter I's initial values; DIR/grad_S_I.bin:
its gradient at step S (0-based). All raw little-endian float32.

For each impl this torch supports, writes DIR/py_IMPL_{param,exp_avg,
exp_avg_sq}_I.bin after S steps, and DIR/py_done.json: {"ran": [...],
"skipped": {"IMPL": "why"}, "torch": version}.
"""

import json
import os
import sys

import torch


def load(path, shape):
    with open(path, "rb") as f:
        data = bytearray(f.read())
    return torch.frombuffer(data, dtype=torch.float32).reshape(shape).clone()


def save(path, t):
    with open(path, "wb") as f:
        f.write(t.detach().contiguous().numpy().tobytes())


def main():
    d = sys.argv[1]
    with open(os.path.join(d, "manifest.json")) as f:
        m = json.load(f)
    shapes = [tuple(s) for s in m["shapes"]]
    ran, skipped = [], {}
    for impl in m["impls"]:
        params = [torch.nn.Parameter(load(os.path.join(d, "param_%d.bin" % i), s)) for i, s in enumerate(shapes)]
        kw = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
        try:
            opt = torch.optim.AdamW(params, lr=m["lrs"][0], betas=(m["beta1"], m["beta2"]), eps=m["eps"],
                                    weight_decay=m["weight_decay"], **kw)
        except (TypeError, RuntimeError, ValueError) as e:
            skipped[impl] = "torch %s: %s" % (torch.__version__, e)
            continue
        try:
            for s in range(m["steps"]):
                for i, p in enumerate(params):
                    p.grad = load(os.path.join(d, "grad_%d_%d.bin" % (s, i)), shapes[i])
                for g in opt.param_groups:
                    g["lr"] = m["lrs"][s]
                opt.step()
        except RuntimeError as e:  # e.g. no fused kernel for the CPU in this torch
            skipped[impl] = "torch %s: %s" % (torch.__version__, str(e).splitlines()[0])
            continue
        for i, p in enumerate(params):
            st = opt.state[p]
            save(os.path.join(d, "py_%s_param_%d.bin" % (impl, i)), p)
            save(os.path.join(d, "py_%s_exp_avg_%d.bin" % (impl, i)), st["exp_avg"])
            save(os.path.join(d, "py_%s_exp_avg_sq_%d.bin" % (impl, i)), st["exp_avg_sq"])
        ran.append(impl)
    with open(os.path.join(d, "py_done.json"), "w") as f:
        json.dump({"ran": ran, "skipped": skipped, "torch": torch.__version__}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
