"""One rank of the resume-on-another-number-of-ranks test (launched by test_resize_ranks.py).

    python resize_worker.py OUT_DIR PHASE CONFIGS_JSON

PHASE "save" (2 ranks): for every config {compression, strategy, hook?, kwargs?}, trains resume_worker's
model 3 steps (with hipress.DistributedOptimizer, or with "hook": DDP and hipress's comm hook)
and saves the model and optimizer (or hook) state_dict to OUT_DIR/ckpt-{i}-rank{r}.pt.
PHASE "load" (3 ranks): rank r loads the files of rank r % 2, records the error of
load_state_dict (if any), the warning it gave and the carry it made (per parameter), and the
carry of a third optimizer loaded from its state_dict (saved before any step), then trains 2 more
steps and records the parameters. Results: OUT_DIR/{PHASE}-rank{r}.pt.
"""
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hipress
import hipress.ddp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from resume_worker import batch, make_model  # noqa: E402


class Hooked:
    """DDP with hipress's hook, shaped as the optimizer runs use it: ``step()`` and the
    checkpointed state (the hook's, beside a plain SGD without state)."""

    def __init__(self, model, cfg):
        self.ddp = DDP(model, bucket_cap_mb=0.01)  # several buckets
        self.state = hipress.ddp.HookState(cfg["compression"], cfg["strategy"], partition_bytes=16 << 10,
                                           named_parameters=model.named_parameters(), **cfg.get("kwargs", {}))
        self.ddp.register_comm_hook(self.state, hipress.ddp.hook)
        self.sgd = torch.optim.SGD(model.parameters(), lr=0.05)
        self.shapes = {n: p.shape for n, p in model.named_parameters()}

    def zero_grad(self, set_to_none=True):
        self.sgd.zero_grad(set_to_none=set_to_none)

    def step(self):
        self.sgd.step()

    def state_dict(self):
        return self.state.state_dict()

    def load_state_dict(self, sd):
        self.state.load_state_dict(sd)

    def carry(self):
        return {n: t.view(self.shapes[n]).clone() for n, t in self.state._carry.items()}


def make(cfg):
    model = make_model()
    if cfg.get("hook"):
        hooked = Hooked(model, cfg)
        return hooked.ddp, hooked
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    kw = {"model": model} if cfg["strategy"] == "dear" else {"named_parameters": model.named_parameters()}
    kw = {"bucket_bytes": 0, "partition_bytes": 16 << 10, **kw, **cfg.get("kwargs", {})}
    return model, hipress.DistributedOptimizer(opt, compression=cfg["compression"], strategy=cfg["strategy"], **kw)


def train(cfg, model, opt, rank, first, last):
    for step in range(first, last):
        x, y = batch(rank, step)
        opt.zero_grad(set_to_none=True)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    if cfg["strategy"] == "dear":
        opt.synchronize()  # dear: the last update, deferred to the next forward


def carry(opt):
    if isinstance(opt, Hooked):
        return opt.carry()
    return {opt._hp_names[k]: v.clone() for k, v in opt._hp_carry.items()}


def main():
    out, phase, configs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    dist.init_process_group("gloo")
    hipress.ddp.init()  # hipress's private gloo group: the hook's, and the optimizer runs' too
    rank = hipress.rank()
    results = []
    for i, cfg in enumerate(configs):
        model, opt = make(cfg)
        if phase == "save":
            train(cfg, model, opt, rank, 0, 3)
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                       os.path.join(out, f"ckpt-{i}-rank{rank}.pt"))
            results.append(None)
            continue
        ck = torch.load(os.path.join(out, f"ckpt-{i}-rank{rank % 2}.pt"), weights_only=False)
        model.load_state_dict(ck["model"])
        rec = {"error": None}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                opt.load_state_dict(ck["optimizer"])
            except ValueError as e:
                rec["error"] = str(e)
        rec["warnings"] = [str(w.message) for w in caught]
        rec["carry"] = carry(opt)
        if rec["error"] is None:  # saved again before a step: the carry is in the checkpoint
            model3, opt3 = make(cfg)
            opt3.load_state_dict(opt.state_dict())
            rec["carry_resaved"] = carry(opt3)
            train(cfg, model, opt, rank, 3, 5)
            rec["params"] = {n.removeprefix("module."): p.detach().clone() for n, p in model.named_parameters()}
        results.append(rec)
    torch.save(results, os.path.join(out, f"{phase}-rank{rank}.pt"))
    hipress.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
