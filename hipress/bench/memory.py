"""Memory benchmark: per-rank peak memory of hipress versus the same training without
it, and growth over many steps.

    python -m hipress.bench.memory [--np 2] [--steps 1000] [--compression tbq] [--nonfinite skip]
                                   [--out results/memory.json]

Each configuration runs as its own job (fresh processes) so peaks do not mix:
  baseline   the same model and optimizer, torch DDP (gloo), no hipress
  hipress    DistributedOptimizer with the chosen compression and strategy
Reported per rank: peak RSS (VmHWM), RSS sampled every --sample steps, the model's
parameter bytes and hipress's compressor-state bytes. Goal (issue 5): hipress adds at
most one model size of error-feedback state plus the compressed buffers over the
baseline, and RSS does not grow between the first sample and the last. With
``nonfinite="skip"`` or ``"raise"`` (the default "skip"; hipress/torch/nonfinite.py) one more
copy of the compressor state and the momentum velocities is kept, to undo a step with a NaN
(reported as undo_copy_mb); ``--nonfinite off`` measures without it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from hipress.bench.common import markdown_table, write_result


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _model():
    import torch.nn as nn
    # One dominant fully connected layer plus small ones (the VGG-like gradient profile).
    return nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 512), nn.ReLU(), nn.Linear(512, 10))


def worker(mode: str, steps: int, sample: int, compression: str, strategy: str, out: str,
           nonfinite: str = "skip") -> None:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state_bytes = undo_bytes = lambda: 0  # noqa: E731
    if mode == "baseline":
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        net = torch.nn.parallel.DistributedDataParallel(model)
    else:
        import hipress
        hipress.init()
        rank = hipress.rank()
        opt = hipress.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression,
                                           strategy=strategy, nonfinite=nonfinite)
        net = model

        def undo_bytes():
            mc = opt._hp_momentum
            return opt._hp_states.undo_log.nbytes() + (mc.undo_log.nbytes() if mc is not None else 0)

        def state_bytes():
            total = 0
            for st in opt._hp_states._states.values():
                total += sum(b.numel() * 4 for b in getattr(st, "buffers", {}).values())
            return total
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)
    samples = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        if step % sample == 0 or step == 1:
            samples.append({"step": step, "rss_kb": _status_kb("VmRSS")})
    res = {"rank": rank, "mode": mode, "peak_kb": _status_kb("VmHWM"), "samples": samples,
           "param_bytes": sum(p.numel() * 4 for p in model.parameters()), "state_bytes": state_bytes(),
           "undo_bytes": undo_bytes()}
    with open(os.path.join(out, f"{mode}.rank{rank}.json"), "w") as f:
        json.dump(res, f)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--sample", type=int, default=100)
    p.add_argument("--compression", default="tbq")
    p.add_argument("--strategy", default="ring")
    p.add_argument("--nonfinite", default="skip", choices=["skip", "raise", "off"])
    p.add_argument("--out", default="results/memory.json")
    p.add_argument("--worker", choices=["baseline", "hipress"], help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a.worker, a.steps, a.sample, a.compression, a.strategy, a.dir, a.nonfinite)
        return {}
    from hipress.launch import run

    rows, raw = [], {}
    with tempfile.TemporaryDirectory() as d:
        for mode in ("baseline", "hipress"):
            cmd = [sys.executable, "-m", "hipress.bench.memory", "--worker", mode, "--dir", d, "--steps", str(a.steps),
                   "--sample", str(a.sample), "--compression", a.compression, "--strategy", a.strategy,
                   "--nonfinite", a.nonfinite]
            code, logs = run(cmd, a.np, timeout=1800, quiet=True)
            if code != 0:
                raise SystemExit(f"{mode} run failed ({code}):\n" + "\n".join(logs)[-3000:])
            raw[mode] = [json.load(open(os.path.join(d, f"{mode}.rank{r}.json"))) for r in range(a.np)]
    for r in range(a.np):
        b, h = raw["baseline"][r], raw["hipress"][r]
        first, last = h["samples"][1 if len(h["samples"]) > 1 else 0], h["samples"][-1]
        rows.append({
            "rank": r,
            "baseline_peak_mb": b["peak_kb"] / 1024,
            "hipress_peak_mb": h["peak_kb"] / 1024,
            "extra_mb": (h["peak_kb"] - b["peak_kb"]) / 1024,
            "model_mb": h["param_bytes"] / 2**20,
            "compressor_state_mb": h["state_bytes"] / 2**20,
            "undo_copy_mb": h.get("undo_bytes", 0) / 2**20,
            "rss_growth_mb": (last["rss_kb"] - first["rss_kb"]) / 1024,
            "growth_window": f"step {first['step']}..{last['step']}",
        })
    print(markdown_table(rows, list(rows[0])))
    write_result(a.out, "memory", {k: v for k, v in vars(a).items() if k not in ("worker", "dir")}, rows, {"raw": raw})
    return {"rows": rows}


if __name__ == "__main__":
    main()
