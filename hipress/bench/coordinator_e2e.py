"""Coordinator on versus off, end to end, on the emulated cluster.

    python -m hipress.bench.coordinator_e2e [--np 4] [--bandwidth 1gbit] [--latency 0.2ms]
        [--layers 48] [--steps 30] [--compression tbq] [--bucket-bytes 0] [--modes off,on,auto]
        [--out results/coordinator_e2e.json]

A model with many small gradients (``--layers`` blocks of a 96x96 linear layer and a
LayerNorm: 4 tensors each, the ResNet-like profile) trained with hipress on ``--np``
emulated hosts; the same job runs with ``coordinator=False`` and ``coordinator=True``,
for each strategy, and the median step time of each is reported with the ratio. With
``--modes ...,auto`` also ``coordinator="auto"``: the job measures both itself
(HIPRESS_COORDINATOR_TRIAL_STEPS each) and its median step time after that choice is reported,
with the choice (how often "on" was kept, over the repeats).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from hipress.bench.common import markdown_table, write_result


def worker(args) -> None:
    import torch
    import torch.nn as nn

    import hipress

    torch.set_num_threads(1)
    torch.manual_seed(0)
    hipress.init()
    blocks = []
    for _ in range(args.layers):
        blocks += [nn.Linear(96, 96), nn.LayerNorm(96)]
    model = nn.Sequential(*blocks)
    coordinator = {"off": False, "on": True, "auto": "auto"}[args.coordinator]
    opt = hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(), compression=args.compression,
                                       strategy=args.strategy, coordinator=coordinator, bucket_bytes=args.bucket_bytes)
    x = torch.randn(32, 96)
    trial = opt.coordinator_trial
    times = []
    step = 0
    while len(times) < args.steps:
        measuring = trial is not None and not trial.done  # "auto": timed from its choice on
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if step >= 3 and not measuring:
            times.append(time.perf_counter() - t0)
        step += 1
    if hipress.rank() == 0:
        print("RESULT " + json.dumps({"median_step_s": statistics.median(times), "steps": len(times),
                                      "chosen": trial.chosen if trial is not None else None}), flush=True)
    hipress.shutdown()


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--bandwidth", default="1gbit")
    p.add_argument("--latency", default="0.2ms")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--compression", default="tbq")
    p.add_argument("--strategies", default="ring,ps")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--bucket-bytes", type=int, default=0,
                   help="tensor fusion bucket size (default 0: every small gradient alone, the case at issue)")
    p.add_argument("--modes", default="off,on", help="coordinator modes to run: off, on, auto (measured by the job)")
    p.add_argument("--out", default="results/coordinator_e2e.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--strategy", default="ring", help=argparse.SUPPRESS)
    p.add_argument("--coordinator", default="off", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a)
        return []
    from hipress.bench.cluster import EmulatedCluster

    modes = a.modes.split(",")
    if not modes or set(modes) - {"off", "on", "auto"}:
        raise SystemExit(f"--modes takes off, on and auto, got {a.modes!r}")
    rows, chosen = [], {}
    with EmulatedCluster(np=a.np, bandwidth=a.bandwidth, latency=a.latency) as c:
        for strategy in a.strategies.split(","):
            res = {}
            for rep in range(a.repeats):
                for coord in modes:
                    cmd = [sys.executable, "-m", "hipress.bench.coordinator_e2e", "--worker", "--strategy", strategy,
                           "--coordinator", coord, "--layers", str(a.layers), "--steps", str(a.steps),
                           "--compression", a.compression, "--bucket-bytes", str(a.bucket_bytes)]
                    code, outs = c.run(cmd, timeout=600, quiet=True)
                    if code != 0:
                        raise SystemExit(f"{strategy}/{coord} failed ({code}):\n" + "\n".join(outs)[-3000:])
                    line = next(ln for ln in outs[0].splitlines() if ln.startswith("RESULT "))
                    rec = json.loads(line[7:])
                    res.setdefault(coord, []).append(rec["median_step_s"])
                    if rec["chosen"] is not None:
                        chosen.setdefault(strategy, []).append(rec["chosen"])
            row = {"strategy": strategy}
            row.update({f"coordinator_{m}_ms": statistics.median(res[m]) * 1e3 for m in modes})
            if "off" in res and "on" in res:
                row["speedup_on_vs_off"] = statistics.median(res["off"]) / statistics.median(res["on"])
            if strategy in chosen:
                row["auto_kept_on"] = f"{chosen[strategy].count('on')} of {len(chosen[strategy])}"
            row["emulated"] = c.emulated
            rows.append(row)
    print(markdown_table(rows, list(dict.fromkeys(k for r in rows for k in r))))
    write_result(a.out, "coordinator_e2e", {k: v for k, v in vars(a).items()
                                            if k not in ("worker", "strategy", "coordinator")}, rows)
    return rows


if __name__ == "__main__":
    main()
