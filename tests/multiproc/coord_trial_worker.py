"""One rank of coordinator="auto"'s tests (launched by test_coordinator_trial_ranks.py).

    python coord_trial_worker.py OUT_DIR CONFIGS_JSON

For every config it trains a small model on rank-specific batches with hipress.DistributedOptimizer
and the config's ``coordinator`` (True, False or "auto"), ``strategy`` and ``compression``, for
``steps`` steps, 2 measured steps per candidate (HIPRESS_COORDINATOR_TRIAL_STEPS). ``seconds``
({"off": s, "on": s}) gives the trial a fake clock that the loop moves after each step() by the
step time of the mode in force, times (1 + rank / 4), so the slowest rank's objective is known
in advance. ``plan_seconds`` ({"plain": s, "model": s}): plan="auto" beside it, its two
candidates measured over 2 steps each with the same fake clock, which moves by the plan's time
on top (TBQ forced on a.weight and b.weight in the model's plan, one partition each, nothing as
bf16). ``save_at``: after that step, a checkpoint (model and optimizer state_dict) is loaded into a
fresh model and optimizer of the same options, which train the remaining steps. ``join``:
join() tried at step 1 (its error recorded) and called by every rank after the last step.

Recorded: the mode in force at each step, the parameters after each step, the trial's state at
the end, whether the optimizer still holds coordinated exchanges and how many coordinator
executors this config left running in this process, the PS aggregators chosen (layout_state) and
the model plan's entries. Saves OUT_DIR/rank{r}.pt.
"""
import json
import os
import sys

import torch
import torch.nn as nn

import hipress
from hipress.comm import coordinator
from hipress.planner import Overrides


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 40)
        self.b = nn.Linear(40, 5)
        self.c = nn.Linear(5, 1)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).squeeze(1)


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, generator=g)


def make(cfg, model, clock):
    # K, the bf16 choice and what is left uncompressed pinned (min_compress_bytes: so the trial has two
    # candidates, no "all"): the model would take them from the profile, which the configs after the
    # first load from its cache, or measure anew where the link seems changed (a loaded machine), and
    # a plan that differed from the reference's would change the bits compared
    plan = (Overrides(force={"a.weight": True, "b.weight": True}, min_compress_bytes=1 << 20, max_partitions=1,
                      bf16=False, measure=2)
            if cfg.get("plan_seconds") else None)
    opt = hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=cfg["compression"],
                                       strategy=cfg["strategy"], coordinator=cfg["coordinator"], bucket_bytes=0,
                                       grad_clip=None, plan=plan)
    for trial in (opt.coordinator_trial, opt.plan_trial):
        if trial is not None and cfg.get("seconds"):
            trial.clock = lambda: clock[0]
    return opt


def run(cfg, rank):
    torch.manual_seed(0)
    executors = len(coordinator._executors)  # earlier configs' (coordinator=True) still run
    model = Net()
    clock = [0.0]
    opt = make(cfg, model, clock)
    rec = {"modes": [], "params": [], "join_refused": None}
    for step in range(cfg["steps"]):
        if step == 1 and cfg.get("join"):  # mid-trial: refused, before anything is touched
            try:
                opt.join()
            except RuntimeError as e:
                rec["join_refused"] = str(e)
        x, y = batch(rank, step)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        trial = opt.coordinator_trial
        mode = trial.in_use if trial is not None else ("on" if cfg["coordinator"] is True else "off")
        rec["modes"].append(mode)
        rec["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})
        if cfg.get("seconds"):
            # whole binary fractions, so sums and differences are exact
            plan = cfg["plan_seconds"][opt.plan_trial.in_use] if cfg.get("plan_seconds") else 0.0
            clock[0] += (cfg["seconds"][mode] + plan) * (1 + rank / 4)
        if step == cfg.get("save_at"):
            saved = (model.state_dict(), opt.state_dict())
            model = Net()
            model.load_state_dict(saved[0])
            clock[0] = 1024.0  # the resumed job's clock starts elsewhere
            opt = make(cfg, model, clock)
            opt.load_state_dict(saved[1])
    if cfg.get("join"):  # the choice made: every rank out of data joins, all in the same step
        rec["joined"] = opt.join()
    trial = opt.coordinator_trial
    rec["trial"] = None if trial is None else {"seconds": dict(trial.seconds), "chosen": trial.chosen}
    rec["plan"] = None if opt.plan_trial is None else opt.plan_trial.chosen
    model_plan = opt._hp_plans.get("model")
    rec["model_plan"] = None if model_plan is None else [(e.name, e.compress, e.k, e.bf16) for e in model_plan]
    rec["coordinated"] = opt._hp_coordinated is not None
    rec["executors"] = len(coordinator._executors) - executors
    rec["aggregators"] = opt._hp_compressed.layout_state().get("aggregators", {})
    return rec


def main():
    out, configs = sys.argv[1], json.loads(sys.argv[2])
    os.environ["HIPRESS_COORDINATOR_TRIAL_STEPS"] = "2"
    os.environ["HIPRESS_PROFILE_DIR"] = os.path.join(out, "profiles")  # plan="auto" profiles once
    hipress.init()
    rank = hipress.rank()
    results = [run(cfg, rank) for cfg in configs]
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    hipress.shutdown()


if __name__ == "__main__":
    main()
