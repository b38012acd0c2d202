"""One rank of the FSDP2 reduce-scatter tests (launched by test_fsdp_hook.py).

    python fsdp_worker.py OUT_DIR CONFIGS_JSON

Every config has a "case":
  equiv   a small MLP whose parameters do not divide by the world size (one of them has fewer
          rows than there are ranks), fully_shard per layer and at the root, trained `steps` SGD
          steps three times: FSDP2's own reduce-scatter, hipress's (compression "none",
          `partition_bytes` small enough for several ring partitions per module), and, for the
          reference, the same model unsharded in this one process on the global batch (the mean
          of every rank's loss). Options: "divide" (FSDPModule.set_gradient_divide_factor: FSDP
          then asks for PREMUL_SUM), "force_sum" (set_force_sum_reduction_for_comms: SUM, FSDP
          divides after), "reduce_dtype" (MixedPrecisionPolicy: FSDP divides before
          and after and asks for SUM).
  train   the digits CNN (hipress.bench.models), fully_shard per layer, trained `steps` steps
          with hipress's reduce-scatter and `compression`; records the test loss and accuracy,
          the compressor's state keys and sizes after the last step, and whether the states of
          step `steps - 1` were the same objects, changed, at the last step.
  error   a reduce-scatter whose encode fails, then one that takes longer than timeout_s: the
          backward() of both raises, not hangs.
Results go to OUT_DIR/rank{r}.pt.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import hipress
import hipress.fsdp
from hipress.bench.models import DigitsCNN, digits_data

DTYPES = {None: None, "float16": torch.float16, "bfloat16": torch.bfloat16}


# ------------------------------------------------------------------ equiv
def make_mlp():
    torch.manual_seed(0)
    # 7x11 weight, 7 rows: uneven for 2 and 3 ranks; the 2x5 weight and its bias have fewer
    # rows than 3 ranks (one rank's shard is empty)
    return nn.Sequential(nn.Linear(11, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 2))


def batch(rank, i):
    g = torch.Generator().manual_seed(1000 * rank + i)
    return torch.randn(6, 11, generator=g), torch.randn(6, 2, generator=g)


def shard(model, mesh, cfg):
    mp = MixedPrecisionPolicy(reduce_dtype=DTYPES[cfg.get("reduce_dtype")])
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for module in model.modules():  # both are per FSDPModule
        if isinstance(module, FSDPModule):
            if cfg.get("divide") is not None:
                module.set_gradient_divide_factor(float(cfg["divide"]))
            if cfg.get("force_sum"):
                module.set_force_sum_reduction_for_comms(True)
    return model


def full_params(model):
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def train_fsdp(cfg, rank, mesh, custom):
    model = shard(make_mlp(), mesh, cfg)
    state = hipress.fsdp.register(model, "none", partition_bytes=cfg.get("partition_bytes")) if custom else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(cfg["steps"]):
        x, y = batch(rank, i)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return full_params(model), state


def train_single(cfg, size):
    """The same steps unsharded in one process: the gradient of the mean over ranks of each
    rank's loss is the average FSDP computes (times size / divide when a divide factor is set)."""
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    factor = size / float(cfg["divide"]) if cfg.get("divide") is not None else 1.0
    for i in range(cfg["steps"]):
        opt.zero_grad()
        loss = sum(F.mse_loss(model(x), y) for x, y in (batch(r, i) for r in range(size))) / size
        (loss * factor).backward()
        opt.step()
    return full_params(model)


def case_equiv(cfg, rank, mesh):
    default = default_error = None
    if cfg.get("divide") is None:
        default, _ = train_fsdp(cfg, rank, mesh, custom=False)
    else:  # FSDP's own reduce-scatter asks gloo for PREMUL_SUM, which gloo refuses (torch 2.13) and
        # leaves the group failed: tried on a group of its own
        side = DeviceMesh.from_group(dist.new_group(backend="gloo"), "cpu")
        try:
            default, _ = train_fsdp(cfg, rank, side, custom=False)
        except RuntimeError as e:
            default_error = str(e)
    hip, state = train_fsdp(cfg, rank, mesh, custom=True)
    return {"default": default, "default_error": default_error, "hipress": hip,
            "single": train_single(cfg, dist.get_world_size()), "reduce_scatters": state.reduce_scatters}


# ------------------------------------------------------------------ train
def tensors(st):
    """A compressor state's buffers (residuals) and scalars (RNG counters)."""
    return [*st.buffers.values(), st.scalars]


def case_train(cfg, rank, mesh):
    size = dist.get_world_size()
    (xtr, ytr), (xte, yte) = digits_data(0)
    torch.manual_seed(0)
    model = DigitsCNN()
    for layer in (model.conv1, model.conv2, model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = hipress.fsdp.register(model, cfg["compression"], **cfg.get("kwargs", {}))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.get("lr", 0.1), momentum=0.9)
    per_rank = cfg.get("batch", 32)
    snapshot = None
    for i in range(cfg["steps"]):
        start = (i * per_rank * size) % (len(ytr) - per_rank * size)
        lo = start + rank * per_rank
        opt.zero_grad()
        F.cross_entropy(model(xtr[lo:lo + per_rank]), ytr[lo:lo + per_rank]).backward()
        opt.step()
        if i == cfg["steps"] - 2:
            snapshot = {k: [t.clone() for t in tensors(st)] for k, st in state._states._states.items()}
            objects = dict(state._states._states)
    with torch.no_grad():
        out = model(xte)
        loss = F.cross_entropy(out, yte).item()
        acc = (out.argmax(1) == yte).float().mean().item()
    states = state._states._states
    same_objects = all(states.get(k) is st for k, st in objects.items())
    changed = sum(any(not torch.equal(a, b) for a, b in zip(snapshot[k], tensors(states[k])))
                  for k in snapshot)
    sizes = {k: {b: t.numel() for b, t in st.buffers.items()} for k, st in states.items()}
    return {"loss": loss, "acc": acc, "state_keys": sorted(state.state_dict()["compressor_state"]),
            "state_sizes": sizes, "same_objects": same_objects, "changed": changed,
            "module_numels": {n: sum(p.numel() for p in m.parameters(recurse=False))
                              for n, m in model.named_modules() if n}}


# ------------------------------------------------------------------ error
class _Faulty:
    """The real compressor, except that its encode raises (fail) or takes 4 s (stall)."""

    def __init__(self, inner, stall):
        self.inner, self.stall = inner, stall

    @property
    def merged(self):
        return self

    def encode(self, x, state):
        if not self.stall:
            raise RuntimeError("injected failure")
        time.sleep(4.0)
        return self.inner.encode(x, state)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def case_error(cfg, rank, mesh):
    """A reduce-scatter whose encode fails, then one slower than timeout_s=2: backward() must
    raise both times, within bounded time, on every rank."""
    out = {}
    for what in ("fail", "stall"):
        torch.manual_seed(0)
        model = fully_shard(nn.Linear(11, 2), mesh=mesh)
        state = hipress.fsdp.register(model, "none", timeout_s=2.0)
        x, y = batch(rank, 0)
        F.mse_loss(model(x), y).backward()  # one good step sets the sync up
        state._ctx.compressor = _Faulty(state._ctx.compressor, what == "stall")
        t0 = time.monotonic()
        try:
            F.mse_loss(model(x), y).backward()
            out[what] = {"raised": None}
        except Exception as e:  # noqa: BLE001
            out[what] = {"raised": f"{type(e).__name__}: {e}"[:500], "seconds": time.monotonic() - t0}
        if what == "stall":
            time.sleep(4.0)  # the slow encodes finish and the ring's hops complete before shutdown
    return out


CASES = {"equiv": case_equiv, "train": case_train, "error": case_error}


def main():
    out_dir, configs = sys.argv[1], json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = []
    for cfg in configs:
        res = CASES[cfg["case"]](cfg, rank, mesh)
        res["config"] = cfg
        results.append(res)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    hipress.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
