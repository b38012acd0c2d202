"""One rank of the named, recoverable failure tests (test_robust_optimizer.py).

    python robust_worker.py SCENARIO OUT_DIR [ARG]

Scenarios (each rank writes OUT_DIR/rank{r}.pt):
  config   every rank wraps several configurations; rank 1 (and rank 2, with 3 ranks) differs in
           one field of each; records the ValueError text of each wrap.
  join     rank r trains STEPS[r] steps (ARG: the steps per rank, comma-separated), then calls
           opt.join(); records every rank's batches, the final parameters and join()'s result
           (COMPRESSION=covap: COVAP's local mode, the parameters after synchronize(); JOIN_DELAY_S:
           the ranks with the most steps wait that long before their join()).
  freeze   momentum SGD with TBQ: the first layer is frozen after step 1 and unfrozen after
           step 3; records the parameters at freeze time, before unfreezing, and at the end.
  freeze_one_rank  compression none, three buckets: rank 1 alone freezes the first layer
           for step 2; records each step's error (every rank resets after it) and the final parameters.
  reset    TBQ with momentum: at step 2 a comm call fails on every rank (injected into the
           transport; with COORDINATOR=1, into the global coordinator's data transport); every
           rank catches it, calls opt.reset() and goes on. A second run never fails but skips
           step 2's batch. Records both runs' final parameters.
  stall    (launched by hand, HIPRESS_TIMEOUT_S short) rank 1 sleeps ARG seconds before step 2's
           backward: every rank records the error of step 2, calls reset() and trains on
           (COORDINATOR=1: onebit through the global coordinator; else uncompressed).
  kill     (launched by hand) rank 1 exits at step 2; the others record the error and exit 3.
  rendezvous  (launched by hand, some ranks never started) hipress.init()'s error, exit 3.
"""
import os
import sys
import time

import torch
import torch.nn as nn

import hipress
from hipress.comm import world

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worker_common import start_together  # noqa: E402


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def batch(r, t):
    g = torch.Generator().manual_seed(1000 * r + t)
    return torch.randn(5, 6, generator=g)


def train_step(model, opt, x):
    opt.zero_grad()
    model(x).pow(2).sum().backward()
    opt.step()


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def main(scenario, out_dir, arg):
    if scenario in ("stall", "kill"):
        start_together(out_dir, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    if scenario == "rendezvous":
        try:
            hipress.init()
        except RuntimeError as e:
            torch.save({"error": str(e), "type": type(e).__name__},
                       os.path.join(out_dir, f"rank{os.environ['RANK']}.pt"))
            raise SystemExit(3)
        raise SystemExit(0)
    hipress.init()
    rank = hipress.rank()

    def save(obj):
        torch.save(obj, os.path.join(out_dir, f"rank{rank}.pt"))

    if scenario == "config":
        base = dict(compression="tbq", strategy="ring", partition_bytes=1 << 20, backward_passes_per_step=1,
                    op=hipress.Average, nonfinite="skip", bucket_bytes=1 << 20)
        odd = [("compression", "terngrad"), ("strategy", "allgather"), ("partition_bytes", 1024),
               ("backward_passes_per_step", 2), ("op", hipress.Sum), ("nonfinite", "raise"), ("bucket_bytes", 0),
               ("threshold", 0.5)]
        errors = {}
        for field, value in odd:
            mine = dict(base)
            if rank == 1 or (rank == 2 and field in ("op", "compression")):
                mine[field] = value
            model = make_model()
            try:
                hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=model.named_parameters(), **mine)
                errors[field] = None
            except ValueError as e:
                errors[field] = str(e)
        # the same configuration everywhere still wraps (and trains a step)
        model = make_model()
        opt = hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), **base)
        train_step(model, opt, batch(rank, 0))
        save({"errors": errors, "trained": params(model)})

    elif scenario == "join":
        steps = [int(s) for s in arg.split(",")]
        model = make_model()
        covap_local = os.environ.get("COMPRESSION") == "covap"  # its local mode, at interval 2
        opt = hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), strategy=os.environ["STRATEGY"],
                                           nonfinite=os.environ["NONFINITE"],
                                           **({"compression": "covap", "interval": 2} if covap_local else {}))
        for t in range(steps[rank]):
            train_step(model, opt, batch(rank, t))
        if steps[rank] == max(steps):  # the others' zero steps run ahead meanwhile (JOIN_DELAY_S)
            time.sleep(float(os.environ.get("JOIN_DELAY_S", "0")))
        last = opt.join()
        # the optimizer goes on afterwards: one more step on every rank
        train_step(model, opt, batch(rank, 99))
        if covap_local:
            opt.synchronize()  # every parameter averaged: the same model on every rank
        save({"last": last, "final": params(model)})

    elif scenario == "freeze":
        model = make_model()
        opt = hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3),
                                           named_parameters=model.named_parameters(), compression="tbq",
                                           strategy=os.environ["STRATEGY"], threshold=0.01)
        first = model[0]
        out = {}
        for t in range(7):
            if t == 2:
                first.requires_grad_(False)
                out["at_freeze"] = params(model)
            if t == 4:
                out["before_unfreeze"] = params(model)
                first.requires_grad_(True)
            train_step(model, opt, batch(rank, t))
        out["final"] = params(model)
        save(out)

    elif scenario == "freeze_one_rank":
        # compression none: the backend's allreduce over buckets [2.bias, 2.weight], [0.bias],
        # [0.weight]; rank 1 alone freezes the first layer for step 2, so it has the first bucket only
        model = make_model()
        opt = hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), compression="none",
                                           bucket_bytes=128)
        errors = []
        for t in range(4):
            if rank == 1 and t in (2, 3):
                model[0].requires_grad_(t == 3)
            try:
                train_step(model, opt, batch(rank, t))
            except RuntimeError as e:
                errors.append((t, str(e)))
                opt.reset()
        save({"errors": errors, "final": params(model)})

    elif scenario == "reset":
        coordinated = os.environ.get("COORDINATOR") == "1"

        def run(inject):
            model = make_model()
            opt = hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                               named_parameters=model.named_parameters(), compression="tbq",
                                               strategy=os.environ["STRATEGY"], threshold=0.01,
                                               coordinator=coordinated)
            errors = []
            for t in range(6):
                if t == 2 and not inject:
                    continue  # the reference: the failed step's batch never taken
                if t == 2:  # the next transfer on every rank fails
                    def broken(*a, **k):
                        raise RuntimeError("injected transport failure")
                    if coordinated:  # the executor's slots
                        opt._hp_exchanges.world.executor.tr.exchange = broken
                    else:
                        tr = world.transport()  # TBQ's payloads have a known size: they go by exchange
                        tr.sendrecv_alloc = tr.alltoallv_alloc = tr.exchange = broken
                try:
                    train_step(model, opt, batch(rank, t))
                except RuntimeError as e:
                    errors.append(str(e))
                    opt.reset()
            return params(model), errors

        failed, errors = run(True)
        reference, _ = run(False)
        save({"failed": failed, "errors": errors, "reference": reference})

    elif scenario in ("stall", "kill"):
        model = make_model()
        coordinated = os.environ.get("COORDINATOR") == "1"
        # through the coordinator: compressed (uncompressed gradients go beside it, by the allreduce)
        opt = hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(),
                                           compression="onebit" if coordinated else "none",
                                           strategy="allgather", coordinator=coordinated)
        errors = []
        for t in range(5):
            if t == 2 and rank == 1:
                if scenario == "kill":
                    os._exit(17)
                time.sleep(float(arg))
            try:
                train_step(model, opt, batch(rank, t))
            except RuntimeError as e:
                errors.append(str(e))
                if scenario == "kill":
                    save({"errors": errors})
                    # rank 0 hosts the store the others read to name the silent rank: stay a while,
                    # as a script reporting the error would, so a survivor that failed later can read it
                    time.sleep(5)
                    os._exit(3)
                opt.reset()
        save({"errors": errors, "final": params(model)})
    else:
        raise SystemExit(f"unknown scenario {scenario}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
