"""One rank of tests/multiproc/test_covap_ranks.py.

    python covap_worker.py OUT_DIR

Run A: compression="covap" with a fixed interval 2 (and sharding: bucket_bytes=0 makes each
parameter a bucket, the large weight splits) for STEPS steps, in each mode (mode "local" with
wire="bf16"); the final parameters go to OUT_DIR/fixed-{mode}-rank{r}.pt, and in mode "local"
those after synchronize() to OUT_DIR/synced-rank{r}.pt. Then mode "local" with a NaN on rank 1 at step 1
(and rank 1's step 3 begun only after rank 0's has ended): each step's parameters, filter step,
last_nonfinite and warnings go to OUT_DIR/nonfinite-local-rank{r}.pt. Run B (one fused bucket,
mode "paper"): interval "auto" with 2 profiled steps; its profile and the steps it took go to
OUT_DIR/auto-rank{r}.pt. Run C (mode "paper", onebit inside, a bucket per parameter): the syncs
started at each gradient, then re-profiled to another interval; OUT_DIR/reprofile-rank{r}.pt.
"""
import os
import sys
import time
import warnings

import torch

import hipress
from hipress.torch import covap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from resume_worker import batch, make_model  # noqa: E402  (the resume test's model and batches)

STEPS = 7


def train(opt, model, rank, steps):
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad(set_to_none=True)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def main(out):
    hipress.init()
    rank = hipress.rank()
    for mode in ("paper", "local"):
        model = make_model()
        opt = hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                           named_parameters=model.named_parameters(), compression="covap",
                                           interval=2, mode=mode, bucket_bytes=0,
                                           **({"wire": "bf16"} if mode == "local" else {}))
        train(opt, model, rank, STEPS)
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, f"{out}/fixed-{mode}-rank{rank}.pt")
        if mode == "local":
            # the last step's averages are in flight; an eager collective waits for them first
            in_flight = [a.handle for a in opt._hp_averaged if a.handle is not None]
            total = hipress.allreduce(torch.ones(1), name="after-local-step")
            quiesced = {"in_flight": len(in_flight), "done": all(h.wait(0) for h in in_flight),
                        "allreduce": total.item()}
            torch.save(quiesced, f"{out}/quiesce-rank{rank}.pt")
            opt.synchronize()  # between steps: every parameter averaged
            torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, f"{out}/synced-rank{rank}.pt")

    # mode "local", rank 1's loss (so every gradient) NaN at step 1, a step where units are
    # averaged: rank 1 skips its step alone. At step 3 rank 1 begins its backward only once rank 0
    # has finished its step 3 (a file of rank 0's; a wait of at most 30 s): the ranks need not meet
    # at a step's end
    model = make_model()
    opt = hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), compression="covap",
                                       interval=2, bucket_bytes=0)
    snaps, passed = [], f"{out}/rank0-finished-step3"
    for step in range(4):
        x, y = batch(rank, step)
        opt.zero_grad(set_to_none=True)
        waited = None
        if step == 3 and rank == 1:
            end = time.monotonic() + 30
            while not os.path.exists(passed) and time.monotonic() < end:
                time.sleep(0.01)
            waited = os.path.exists(passed)
        ((model(x) - y) ** 2).mean().mul(float("nan") if step == 1 and rank == 1 else 1.0).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        if step == 3 and rank == 0:
            open(passed, "w").close()
        snaps.append({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                      "filter_step": opt._hp_covap.filter.step, "last_nonfinite": opt.last_nonfinite,
                      "warnings": [str(w.message) for w in caught if w.category is hipress.NonFiniteGradientWarning],
                      "waited_for_rank0": waited})
    torch.save(snaps, f"{out}/nonfinite-local-rank{rank}.pt")
    opt.synchronize()  # its last averages done before the next optimizer's profiler uses the transport

    model = make_model()
    opt = hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), compression="covap",
                                       profile_steps=2, mode="paper",
                                       bucket_bytes=1 << 20)  # fused: not synced in place
    train(opt, model, rank, 2)
    before = opt.covap_profile
    train(opt, model, rank, 2)
    torch.save({"before": before, "after": opt.covap_profile, "state": opt.state_dict()["hipress"]["covap"],
                "params": {n: p.detach().clone() for n, p in model.named_parameters()}}, f"{out}/auto-rank{rank}.pt")

    # Run C: mode "paper" with onebit inside, re-profiled to another interval (the cap lowered
    # before covap_reprofile()). The large weight is sharded into as many units as the interval,
    # so its units change ranges, and the onebit states keyed by their index no longer fit.
    # The profiles' communication time is floored at 3x the computation on every rank (the same
    # rows reach every rank, so they agree): over loopback this model's CCR is usually above 1,
    # but a loaded machine measured 0.95 once, and interval 1 leaves nothing to change.
    measured = covap.make_profile
    covap.make_profile = lambda before, comp, comm, cap: measured(before, comp, max(comm, 3 * comp), cap)
    model = make_model()
    opt = hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       compression="covap", mode="paper", inner="onebit", strategy="ring",
                                       profile_steps=2, bucket_bytes=0)
    # at each gradient (a hook after hipress's): whether COVAP profiles, and how many buckets'
    # syncs the step has started
    started = []
    hooks = [p.register_post_accumulate_grad_hook(
        lambda p: started.append((opt._hp_covap.profiling, len(opt._hp_handles)))) for p in model.parameters()]
    train(opt, model, rank, 5)
    for h in hooks:
        h.remove()
    first, old_filter = opt.covap_profile, opt._hp_covap.filter
    saved = opt.state_dict()["hipress"]  # the units' states stay as they are while re-profiling
    opt._hp_covap.max_interval = 1 if first.interval == 2 else 2  # another interval than the first, whatever it was
    opt.covap_reprofile()
    carries, step = [], 5
    while opt.covap_profile is first:
        x, y = batch(rank, step)
        opt.zero_grad(set_to_none=True)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        carries.append({opt._hp_names[k]: v.clone() for k, v in opt._hp_carry.items()})
        step += 1
    changed = covap.changed_units(old_filter, opt._hp_covap.filter)
    train(opt, model, rank, 3)  # goes on with the new units
    torch.save({"first": first, "second": opt.covap_profile, "saved": saved, "changed": changed, "carry": carries[-1],
                "started": started, "gradients": len(list(model.parameters())), "buckets": len(opt._hp_buckets),
                "params": {n: p.detach().clone() for n, p in model.named_parameters()}},
               f"{out}/reprofile-rank{rank}.pt")
    covap.make_profile = measured
    hipress.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
