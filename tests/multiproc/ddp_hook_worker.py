"""One rank of the DDP comm hook tests (launched by test_ddp_hook.py).

    python ddp_hook_worker.py OUT_DIR CONFIGS_JSON

Every config has a "case":
  equiv     the same model, data and seed trained `steps` steps by DistributedDataParallel with
            hipress's hook and by hipress.DistributedOptimizer (clipping "auto" on both sides;
            "momentum"/"weight_decay": SGD's, with momentum correction where the optimizer's "auto"
            applies it: in the hook, momentum_correction={m, wd} and a plain SGD), one
            bucket on both sides; records both final parameters. "accumulate": 2 micro-batches per step,
            the first under ddp.no_sync() / backward_passes_per_step=2. "ddp": extra DDP
            keywords (static_graph). "wrapper": "fp16"/"bf16" (hipress's) or "torch-fp16".
  rebuild   compression none, DDP buckets of one parameter each after DDP's first step
            (its first step has one bucket of all): compared with the optimizer's exact average;
            then TBQ so, whose state must hold the rebuilt buckets only.
  resume    (momentum SGD, corrected where "auto" would) hook training `steps` steps uninterrupted,
            against `k` steps, a checkpoint (model, optimizer, state.state_dict() through
            torch.save), fresh objects loading it and the rest.
  error     a sync whose task fails, then one that never finishes (timeout_s=2): backward()
            must raise both times, not hang.
Results go to OUT_DIR/rank{r}.pt.
"""
import io
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import hipress
import hipress.ddp
from worker_common import device, gloo_event_loops

DEVICE = device()  # cuda: DDP's buckets are CUDA tensors, staged through host memory by the hook


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 4)).to(DEVICE)


def batch(rank, i):
    g = torch.Generator().manual_seed(1000 * rank + i)
    return torch.randn(16, 64, generator=g).to(DEVICE), torch.randn(16, 4, generator=g).to(DEVICE)


def loss_of(model, rank, i):
    x, y = batch(rank, i)
    return ((model(x) - y) ** 2).mean()


def params(model):
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def corrected(cfg):
    """Whether momentum correction runs (in the hook; the optimizer's "auto" decides the same):
    a momentum SGD and a single-round compressor other than none."""
    comp = hipress.compression.get(cfg["compression"], **cfg.get("kwargs", {}))
    return bool(cfg.get("momentum")) and comp.name != "none" and not comp.lowrank


def hook_state(model, cfg):
    return hipress.ddp.HookState(cfg["compression"], cfg.get("strategy", "auto"),
                                 named_parameters=model.named_parameters(),
                                 momentum_correction={"momentum": cfg["momentum"],
                                                      "weight_decay": cfg.get("weight_decay", 0.0)}
                                 if corrected(cfg) else None,
                                 partition_bytes=cfg.get("partition_bytes", 16 << 10),
                                 coordinator=cfg.get("coordinator", False), **cfg.get("kwargs", {}))


WRAPPERS = {None: lambda h: h, "fp16": hipress.ddp.fp16_wrapper, "bf16": hipress.ddp.bf16_wrapper,
            "torch-fp16": default_hooks.fp16_compress_wrapper}


def plain_sgd(model, cfg):
    """The SGD given to DDP: with momentum correction the hook applies momentum and weight decay."""
    if corrected(cfg):
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=cfg.get("momentum", 0),
                           weight_decay=cfg.get("weight_decay", 0.0))


def train_ddp(cfg, rank, model=None, opt=None, state=None, first=0, last=None):
    model = model or make_model()
    ddp = DDP(model, **cfg.get("ddp", {}))
    # with momentum correction the hook applies the momentum: the SGD runs without it
    opt = opt or plain_sgd(model, cfg)
    state = state or hook_state(model, cfg)
    ddp.register_comm_hook(state, WRAPPERS[cfg.get("wrapper")](hipress.ddp.hook))
    passes = 2 if cfg.get("accumulate") else 1
    for step in range(first, cfg["steps"] if last is None else last):
        opt.zero_grad(set_to_none=True)
        if passes == 2:
            with ddp.no_sync():
                loss_of(ddp, rank, 2 * step).backward()
            loss_of(ddp, rank, 2 * step + 1).backward()
        else:
            loss_of(ddp, rank, step).backward()
        opt.step()
    return model, opt, state, ddp


def train_optimizer(cfg, rank):
    model = make_model()
    if cfg.get("wrapper") == "bf16":
        # the wrapper rounds each rank's gradients to bf16 before the hook compresses them: the
        # optimizer compresses the same values, or onebit's sign of an element near zero (after its
        # error feedback) may differ, by 2 x its scale x lr
        for p in model.parameters():
            p.register_hook(lambda g: g.to(torch.bfloat16).to(g.dtype))
    passes = 2 if cfg.get("accumulate") else 1
    opt = hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=cfg.get("momentum", 0),
                                                       weight_decay=cfg.get("weight_decay", 0.0)),
                                       named_parameters=model.named_parameters(), compression=cfg["compression"],
                                       strategy=cfg.get("strategy", "auto"), backward_passes_per_step=passes,
                                       partition_bytes=cfg.get("partition_bytes", 16 << 10),
                                       bucket_bytes=cfg.get("bucket_bytes", 64 << 20),
                                       coordinator=cfg.get("coordinator", False), **cfg.get("kwargs", {}))
    for step in range(cfg["steps"]):
        opt.zero_grad(set_to_none=True)
        for k in range(passes):
            loss_of(model, rank, passes * step + k).backward()
        opt.step()
    return model


def case_equiv(cfg, rank):
    model, _, state, _ = train_ddp(cfg, rank)
    ref = train_optimizer(cfg, rank)
    return {"ddp": params(model), "opt": params(ref), "layouts": [lay.name for lay in state._layouts.values()],
            "hierarchical": state.hierarchical, "transport": type(hipress.comm.world.transport()).__name__}


def case_rebuild(cfg, rank):
    cfg = dict(cfg, ddp={"bucket_cap_mb": 1e-5})
    model, _, state, _ = train_ddp(cfg, rank)
    ref = train_optimizer(dict(cfg, bucket_bytes=0), rank)
    # a compressor with state: the first step's bucket's states are dropped once DDP rebuilt its buckets
    _, _, tbq, _ = train_ddp(dict(cfg, compression="tbq", kwargs={"threshold": 0.01}), rank)
    return {"ddp": params(model), "opt": params(ref), "layouts": [lay.name for lay in state._layouts.values()],
            "state_keys": sorted(tbq.state_dict()["compressor_state"])}


def case_resume(cfg, rank):
    k, steps = cfg["k"], cfg["steps"]
    whole, _, _, _ = train_ddp(cfg, rank)
    model, opt, state, _ = train_ddp(cfg, rank, last=k)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}, buf)
    del model, opt, state
    buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    model = make_model()
    model.load_state_dict(ck["model"])
    opt = plain_sgd(model, cfg)
    opt.load_state_dict(ck["opt"])
    state = hook_state(model, cfg)
    state.load_state_dict(ck["hook"])
    resumed, _, _, _ = train_ddp(cfg, rank, model, opt, state, first=k, last=steps)
    return {"whole": params(whole), "resumed": params(resumed), "n_states": len(ck["hook"]["compressor_state"]),
            "n_velocities": len(ck["hook"].get("velocity", {})),
            "compresses": not state.hierarchical or hipress.comm.world.local_rank() == 0}


class _Boom:
    """Stands in for the hook's sync: its task fails, or (stall) never finishes."""

    def __init__(self, sync, stall):
        self.ctx, self.stall, self.spread = sync.ctx, stall, sync.spread

    def build(self, name, flat, bounds, **kw):
        if self.stall:
            return self.ctx.engine.submit_deferred(f"stall.{name}", lambda completion: None)

        def fail():
            raise RuntimeError("injected failure")
        return self.ctx.compute(f"boom.{name}", fail)


def case_error(cfg, rank):
    out = {}
    for what in ("fail", "stall"):
        model = make_model()
        ddp = DDP(model)
        state = hipress.ddp.HookState("none", named_parameters=model.named_parameters(), timeout_s=2.0)
        ddp.register_comm_hook(state, hipress.ddp.hook)
        loss_of(ddp, rank, 0).backward()  # one good step sets the sync up
        state._sync = _Boom(state._sync, what == "stall")
        t0 = time.monotonic()
        try:
            loss_of(ddp, rank, 1).backward()
            out[what] = {"raised": None}
        except Exception as e:  # noqa: BLE001
            out[what] = {"raised": f"{type(e).__name__}: {e}"[:500], "seconds": time.monotonic() - t0}
    return out


CASES = {"equiv": case_equiv, "rebuild": case_rebuild, "resume": case_resume, "error": case_error}


def main():
    out_dir, configs = sys.argv[1], json.loads(sys.argv[2])
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" in os.environ:  # mpirun: DDP's env:// from MPI's
        os.environ["RANK"], os.environ["WORLD_SIZE"] = (os.environ["OMPI_COMM_WORLD_RANK"],
                                                        os.environ["OMPI_COMM_WORLD_SIZE"])
    dist.init_process_group("gloo")
    hipress.ddp.init()  # hipress's private gloo group (or HIPRESS_TRANSPORT's); the optimizer runs use it too
    rank = hipress.rank()
    results = []
    for cfg in configs:
        t0 = time.monotonic()
        res = CASES[cfg["case"]](cfg, rank)
        res["config"], res["seconds"] = cfg, time.monotonic() - t0
        res["gloo_event_loops"] = gloo_event_loops()
        results.append(res)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    hipress.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
