"""Optimus-CC figures on the emulated cluster (hipress.bench.cluster; docs/pipeline.md).

    python -m hipress.bench.pipeline embed --pp 2 --dp 2 --mbytes 16 --bandwidth 1gbit --latency 0.2ms
    python -m hipress.bench.pipeline speed --pp 2 --dp 2 --steps 60 --bandwidth 1gbit --latency 0.2ms [-- --batch 8]

embed: the tied-parameter sync of hipress.pipeline (hipress/pipeline/tied.py) on a V-byte
gradient, unfused and fused, each repeated --repeat times between barriers; the median time
next to eqs. 15-16's bytes per rank, V(3D-2)/D and V(2D-1)/D, sent at the link rate.
speed: examples/train_gpt_3d.py with every technique off, each one alone, and all on, the
same steps and data; tokens/s and validation perplexity, speed-ups over all off.
Each prints a markdown table and writes JSON (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "train_gpt_3d.py")
SPEED_CONFIGS = {
    "all off": [],
    "FE (fused embedding sync)": ["--fuse-embedding"],
    "CB (compressed backprop, epilogue, lazy error)": ["--compress-backward", "16"],
    "SC (stage 0's DP gradients, PowerSGD)": ["--compress-stages", "1"],
    "all on (CB+FE+SC)": ["--all"],
}
DONE = re.compile(r"done: .*validation perplexity ([0-9.]+) tokens/s (\d+)")


def embed_worker(a) -> None:
    """One rank of ``embed`` (run under the cluster)."""
    import torch
    import torch.distributed as dist

    from hipress.pipeline.layout import Layout
    from hipress.pipeline.tied import sync_tied_gradients

    dist.init_process_group("gloo")
    lay = Layout(a.pp, a.dp)
    rank = dist.get_rank()
    stage, replica = lay.stage_of(rank), lay.replica_of(rank)
    holds = stage in (0, a.pp - 1)
    grad = torch.randn(int(a.mbytes * 2 ** 20) // 4)
    times = {"unfused": [], "fused": []}
    for i in range(a.repeat + 1):  # the first round connects the pairs: not timed
        for mode in times:
            dist.barrier()
            t0 = time.perf_counter()
            if holds:
                sync_tied_gradients([grad], lay, stage, replica, fused=mode == "fused")
            if i:
                times[mode].append(time.perf_counter() - t0)
    if rank == 0:
        print("RESULT " + json.dumps({m: statistics.median(v) for m, v in times.items()}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _cluster(a):
    from hipress.bench.cluster import EmulatedCluster

    return EmulatedCluster(np=a.pp * a.dp, bandwidth=a.bandwidth, latency=a.latency)


def embed(a) -> dict:
    from hipress.bench.cluster import parse_rate

    with _cluster(a) as c:
        cmd = [sys.executable, "-m", "hipress.bench.pipeline", "embed-worker", "--pp", str(a.pp), "--dp", str(a.dp),
               "--mbytes", str(a.mbytes), "--repeat", str(a.repeat)]
        code, outs = c.run(cmd, timeout=a.timeout, quiet=True)
        emulated = c.emulated
    if code != 0:
        raise RuntimeError(f"embed ranks failed with {code}:\n" + "\n".join(outs)[-3000:])
    got = json.loads(next(line for line in outs[0].splitlines() if "RESULT " in line).split("RESULT ", 1)[1])
    v, d = a.mbytes * 2 ** 20, a.dp
    rate = parse_rate(a.bandwidth) / 8  # bytes/s
    model = {"unfused": v * (3 * d - 2) / d / rate, "fused": v * (2 * d - 1) / d / rate}
    res = {"pp": a.pp, "dp": d, "mbytes": a.mbytes, "bandwidth": a.bandwidth, "latency": a.latency,
           "emulated": emulated, "measured_s": got, "eq15_16_s": model,
           "measured_saving": 1 - got["fused"] / got["unfused"], "model_saving": 1 - model["fused"] / model["unfused"]}
    print("| sync | measured ms | eqs. 15-16 ms (bytes per rank / link rate) |\n|---|---|---|")
    for m in ("unfused", "fused"):
        print(f"| {m} | {1e3 * got[m]:.1f} | {1e3 * model[m]:.1f} |")
    print(f"| fused saves | {100 * res['measured_saving']:.1f}% | {100 * res['model_saving']:.1f}% |")
    return res


def speed(a) -> dict:
    rows = {}
    with _cluster(a) as c:
        for name, flags in SPEED_CONFIGS.items():
            cmd = [sys.executable, EXAMPLE, "--pp", str(a.pp), "--dp", str(a.dp), "--steps", str(a.steps),
                   "--eval-every", str(a.steps), *a.example_args, *flags]
            code, outs = c.run(cmd, timeout=a.timeout, quiet=True)
            text = "\n".join(outs)
            found = DONE.findall(text)
            if code != 0 or not found:
                raise RuntimeError(f"{name}: the example failed with {code}:\n{text[-3000:]}")
            rows[name] = {"val_perplexity": float(found[0][0]), "tokens_per_s": int(found[0][1])}
            print(f"{name}: {rows[name]}", flush=True)
        emulated = c.emulated
    base = rows["all off"]
    print("\n| configuration | tokens/s | speed-up | validation perplexity | vs all off |\n|---|---|---|---|---|")
    for name, r in rows.items():
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] - 1
        r["perplexity_change"] = r["val_perplexity"] / base["val_perplexity"] - 1
        print(f"| {name} | {r['tokens_per_s']} | {100 * r['speedup']:+.1f}% | {r['val_perplexity']:.3f} | "
              f"{100 * r['perplexity_change']:+.1f}% |")
    return {"pp": a.pp, "dp": a.dp, "steps": a.steps, "bandwidth": a.bandwidth, "latency": a.latency,
            "example_args": a.example_args, "emulated": emulated, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hipress.bench.pipeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["embed", "speed", "embed-worker"])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--mbytes", type=float, default=16.0, help="embed: the tied gradient's size in MiB")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--bandwidth", default="1gbit")
    p.add_argument("--latency", default="0.2ms")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", help="JSON results")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []  # speed: the example's own arguments
    a = p.parse_args(argv[:len(argv) - len(extra) - (1 if extra or "--" in argv else 0)])
    a.example_args = extra
    if a.what == "embed-worker":
        embed_worker(a)
        return 0
    res = embed(a) if a.what == "embed" else speed(a)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
