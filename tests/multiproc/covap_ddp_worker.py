"""One rank of tests/multiproc/test_covap_ddp.py: COVAP as hipress's DDP comm hook.

    python covap_ddp_worker.py OUT_DIR

Run A: DDP with buckets of one parameter each (after DDP's first step; its first step has one
bucket of all), compression="covap", interval 2, a momentum SGD, STEPS steps, in mode "paper"
and in mode "local": the final parameters, the filter's buckets (names, their parameters in
the hook's order), how many steps the filter ran and the parameters after state.synchronize().
Run B: one DDP bucket, COVAP around TBQ, interval 2: STEPS steps uninterrupted against K steps,
a checkpoint (model, SGD, hook state through torch.save), fresh objects loading it and the rest.
Run C: interval "auto" (2 profiled steps, mode "paper"): the profile, and the hook's calls and
the syncs it started, in order.
Results go to OUT_DIR/rank{r}.pt.
"""
import io
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hipress
import hipress.ddp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_hook_worker import batch, make_model, params  # noqa: E402  (the DDP hook tests' model and data)

STEPS = 9
K = 5


def train(ddp, opt, rank, first, last):
    for step in range(first, last):
        opt.zero_grad(set_to_none=True)
        x, y = batch(rank, step)
        ((ddp(x) - y) ** 2).mean().backward()
        opt.step()


def setup(model, ddp_kw, **covap_kw):
    ddp = DDP(model, **ddp_kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = hipress.ddp.register(ddp, "covap", **covap_kw)
    return ddp, opt, state


def run_fixed(rank, mode):
    model = make_model()
    wire = {"wire": "bf16"} if mode == "local" else {}  # its averages as bf16 differences (the replica's too)
    ddp, opt, state = setup(model, {"bucket_cap_mb": 1e-5}, interval=2, mode=mode, **wire)
    train(ddp, opt, rank, 0, STEPS)
    run = state.covap.run
    lays = {lay.name: [n for n, _ in lay.bucket.params] for lay in state._layouts.values()}
    out = {"params": params(model), "buckets": [(name, lays[name]) for name in run.sizes],
           "filtered_steps": run.filter.step, "units": run.filter.units}
    state.synchronize()  # mode "local": every parameter averaged; otherwise nothing to do
    return {**out, "synced": params(model)}


def run_resume(rank):
    kw = dict(interval=2, mode="paper", inner="tbq", threshold=0.01)
    model = make_model()
    ddp, opt, _ = setup(model, {}, **kw)
    train(ddp, opt, rank, 0, STEPS)
    whole = params(model)

    model = make_model()
    ddp, opt, state = setup(model, {}, **kw)
    train(ddp, opt, rank, 0, K)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    model = make_model()
    model.load_state_dict(ck["model"])
    ddp, opt, state = setup(model, {}, **kw)
    opt.load_state_dict(ck["opt"])
    state.load_state_dict(ck["hook"])
    train(ddp, opt, rank, K, STEPS)
    return {"whole": whole, "resumed": params(model), "checkpoint": ck["hook"]}


def run_auto(rank):
    model = make_model()
    ddp, opt, state = setup(model, {"bucket_cap_mb": 1e-5}, profile_steps=2, mode="paper")
    # the hook's calls and the syncs it starts, in order: ("ready", profiling, last) per bucket
    # handed over, ("sent",) per bucket's sync started
    events = []
    submit, launch = state.submit, state._launch
    def logged_submit(bucket):
        events.append(("ready", state.covap.profiling, bucket.is_last()))
        return submit(bucket)
    def logged_launch(*args, **kw):
        events.append(("sent",))
        return launch(*args, **kw)
    state.submit, state._launch = logged_submit, logged_launch
    train(ddp, opt, rank, 0, 4)
    before = state.covap_profile
    train(ddp, opt, rank, 4, 8)
    return {"before": before, "after": state.covap_profile, "state": state.state_dict()["covap"],
            "params": params(model), "events": events}


def main(out_dir):
    dist.init_process_group("gloo")
    hipress.ddp.init()
    rank = hipress.rank()
    res = {"fixed": run_fixed(rank, "paper"), "local": run_fixed(rank, "local"), "resume": run_resume(rank),
           "auto": run_auto(rank)}
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    hipress.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
