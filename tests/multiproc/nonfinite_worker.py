"""One rank of the non-finite gradient tests (launched by test_nonfinite.py).

    python nonfinite_worker.py OUT_DIR CONFIGS_JSON K T

Reuses the resume test's model, batches and optimizer (momentum SGD, every parameter its own
gradient unless the config sets bucket_bytes, the large one in two partitions: several
states, PS aggregators on both ranks). Strategy "dear" gets the model and is synchronized
before parameters are read (its updates wait for the next forward).
For every config {compression, strategy, kwargs} it trains T steps:
  * "nan" / "inf": rank 1's gradient of "0.weight" gets a NaN (an Inf) at step K, injected
    during backward (a tensor hook, before hipress sees the gradient); recorded: parameters
    and opt.state_dict()["hipress"] before and after step K, the warnings of every step,
    opt.last_nonfinite, the final parameters;
  * "raise": the same NaN with nonfinite="raise": the exception's text and ``where``;
    training goes on after it;
  * "reference": the same run without step K's batch (steps 0..K-1, K+1..T-1);
  * "plain": every batch, nothing injected;
  * "amp" (only for configs with "amp": true): Horovod's GradScaler pattern with an Inf at
    step K on rank 1; the scale after every step.
Results go to OUT_DIR/rank{r}.pt.
"""
import json
import os
import sys
import warnings

import torch

import hipress
from hipress.torch.nonfinite import NonFiniteGradientError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from resume_worker import batch, make_model, params  # noqa: E402

POISONED = "0.weight"


def poison(p, value, index=37):
    def hook(g):
        handle.remove()
        g = g.clone()
        g.view(-1)[index] = value
        return g

    handle = p.register_hook(hook)


def hipress_state(opt):
    return opt.state_dict()["hipress"]


def train(cfg, rank, k, t, kind):
    model = make_model()
    # resume_worker.make_optimizer's, with a bucket size of the config's (default 0: one per parameter)
    dear = cfg["strategy"] == "dear"  # updates deferred to the next forward: synchronize() before reading
    where = {"model": model} if dear else {"named_parameters": model.named_parameters()}
    opt = hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                       **where, compression=cfg["compression"],
                                       strategy=cfg["strategy"], bucket_bytes=cfg.get("bucket_bytes", 0),
                                       partition_bytes=16 << 10, nonfinite="raise" if kind == "raise" else "skip",
                                       **cfg["kwargs"])
    named = dict(model.named_parameters())
    out = {"warnings": [], "errors": [], "scales": []}
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if kind == "amp" else None
    for step in range(t):
        if kind == "reference" and step == k:
            continue
        if step == k:
            if dear:
                opt.synchronize()
            out["params_before"], out["state_before"] = params(model), hipress_state(opt)
            if rank == 1 and kind != "plain":
                poison(named[POISONED], float("inf") if kind in ("inf", "amp") else float("nan"))
        x, y = batch(rank, step)
        opt.zero_grad(set_to_none=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = ((model(x) - y) ** 2).mean()
            try:
                if scaler is None:
                    loss.backward()
                    opt.step()
                else:  # Horovod's pattern
                    scaler.scale(loss).backward()
                    opt.synchronize()
                    scaler.unscale_(opt)
                    with opt.skip_synchronize():
                        scaler.step(opt)
                    scaler.update()
                    out["scales"].append(float(scaler.get_scale()))
            except NonFiniteGradientError as e:
                out["errors"].append({"step": step, "message": str(e), "where": e.where})
        out["warnings"] += [{"step": step, "message": str(w.message), "category": w.category.__name__}
                            for w in caught]
        if step == k:
            if dear:
                opt.synchronize()
            out["params_after"], out["state_after"] = params(model), hipress_state(opt)
            out["last_nonfinite"] = dict(opt.last_nonfinite)
    if dear:
        opt.synchronize()
    out["final"] = params(model)
    return out


def main():
    out_dir, configs, k, t = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    hipress.init()
    rank = hipress.rank()
    results = []
    for cfg in configs:
        kinds = ["plain", "reference", "nan", "inf", "raise"] + (["amp"] if cfg.get("amp") else [])
        results.append({"config": cfg} | {kind: train(cfg, rank, k, t, kind) for kind in kinds})
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    hipress.shutdown()


if __name__ == "__main__":
    main()
