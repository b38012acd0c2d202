"""Planner validation on the emulated cluster: the cost model's predicted sync time of one
gradient against the measured one (issue 7), for a ladder of gradient sizes.

    python -m hipress.bench.planner --np 4 --bandwidth 1gbit --latency 0.2ms --strategy ring,ps

Each rank runs in its own network namespace behind a shaped link (hipress.bench.cluster).
On every rank, per strategy: ``profile_online`` measures T_enc/T_dec of the compressor and
T_send over the real link (fresh, never cached); the first profile's model picks, for every
ladder size, three configurations to run for real through CaSync (the same strategy
builders DistributedOptimizer uses): the plan's choice, the best uncompressed K and the
best compressed K. Then ``--rounds`` rounds of (a new profile, every configuration once,
three times below 1 MB): this VM's speed drifts by tens of percent over tens of seconds,
and alternating the profile with the syncs it predicts exposes both to the same drift.
The prediction comes from the pooled profile (per size, the median of the rounds); a
measurement is the slowest rank's time from a common barrier to its result, the median
over the rounds (the first sync of each configuration is a warm-up). Rank 0 writes
``<out-dir>/planner-validate.json`` and a markdown table with measured/predicted per row;
the goal is every row within 25%.

The second half of issue 7 (a model mixing many small and a few very large gradients:
planned vs compress-all vs compress-none) is ``python -m hipress.bench.compare --preset
issue7`` (the ``mixed`` model of hipress.bench.models).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from hipress.bench.common import markdown_table, write_result

KB, MB = 1 << 10, 1 << 20
DEFAULT_SIZES = "32KB,128KB,512KB,2MB,8MB,32MB,128MB"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_size(s: str) -> int:
    s = s.strip().upper()
    for unit, mult in (("KB", KB), ("MB", MB), ("GB", 1 << 30), ("B", 1)):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


def pooled_profile(profiles):
    """One profile from several taken over time: per curve and size the median of the rounds'
    medians, and the median task hand-off."""
    from hipress.planner.profile import build_profile

    first = profiles[0]
    med = {key: [(size, statistics.median(p.samples[key][i][1] for p in profiles))
                 for i, (size, _) in enumerate(pts)] for key, pts in first.samples.items()}
    plain = (med["enc_plain"], med["dec_plain"]) if "enc_plain" in med else None
    return build_profile(n=first.n, strategy=first.strategy, device=first.device, algorithm=first.algorithm,
                         category=first.category, rate=first.rate, send_samples=med["send"],
                         enc_samples=med["enc"], dec_samples=med["dec"], plain_samples=plain,
                         task_s=statistics.median(p.task_s for p in profiles),
                         send_one_samples=med.get("send_one"), meta={"rounds": len(profiles)})


# ------------------------------------------------------------------ on every rank
def worker(a) -> None:
    import torch

    import hipress
    from hipress import compression
    from hipress.engine import get_engine
    from hipress.planner.online import profile_online, slowest
    from hipress.planner.profile import repeats_for
    from hipress.comm.exchange import open_exchanges
    from hipress.planner.plan import chunk_bounds
    from hipress.sync import STRATEGIES
    from hipress.sync import base as sync_base

    torch.set_num_threads(1)
    hipress.init()
    tr = hipress.comm.world.transport()
    rank = tr.rank
    comp = compression.get(a.algorithm)
    none = compression.get("none")
    engine = get_engine()
    sizes = [parse_size(s) for s in a.sizes.split(",") if s]
    rows, profiles = [], {}

    slowest_rank = slowest(tr)
    exchange = open_exchanges(engine).world
    for strategy_name in a.strategy.split(","):
        strategy = STRATEGIES[strategy_name]()
        ctx = {c: sync_base.SyncContext(engine, exchange, cc, sync_base.StateStore()) for c, cc in
               ((False, none), (True, comp))}
        inputs = {m: torch.randn(m // 4, generator=torch.Generator().manual_seed(rank)) for m in sizes}

        def profile_round():
            return profile_online(comp, tr, strategy_name, cache_dir=a.profile_dir, refresh=True,
                                  repeats=a.profile_repeats)

        def sync_once(m, cpr, k) -> float:
            work = inputs[m].clone()
            tr.barrier()
            t = time.perf_counter()
            h = strategy.build(ctx[cpr], f"g{m}.{int(cpr)}.{k}", work, chunk_bounds(m // 4, max(1, min(k, m // 4))))
            if not h.wait(600):
                raise RuntimeError(f"sync of {m} bytes did not finish")
            if h.exception(0) is not None:
                raise RuntimeError(str(h.exception(0)))
            return slowest_rank(time.perf_counter() - t)

        t0 = time.time()
        taken = [profile_round()]
        # Distinct configurations (size, compress, K): the plan's choice and the best of each
        # branch, as the first profile decides them.
        cases, configs = [], {}
        for m in sizes:
            d = taken[0].cost_model().decide(m)
            for case, (cpr, k) in (("plan", (d.compress, d.k)), ("orig", (False, d.k_orig)), ("cpr", (True, d.k_cpr))):
                cases.append((m, case, cpr, k))
                configs.setdefault((m, cpr, k), [])
        # Rounds of (profile, then every configuration once or, below 1 MB, three times): this
        # VM's speed drifts by tens of percent over tens of seconds, and alternating the
        # profile with the syncs it predicts exposes both to the same drift. The first sync of
        # each configuration is a warm-up.
        for rnd in range(a.rounds):
            if rnd:
                taken.append(profile_round())
            for (m, cpr, k), times in configs.items():
                times.extend(sync_once(m, cpr, k) for _ in range(repeats_for(m, 1)))
        prof = pooled_profile(taken)
        profiles[strategy_name] = {"profile": prof.to_dict(), "seconds": time.time() - t0, "rounds": a.rounds}
        model = prof.cost_model()
        for m, case, cpr, k in cases:
            times, predicted = configs[(m, cpr, k)][1:], model.t_sync(m, cpr, k)  # [0]: the warm-up
            measured = statistics.median(times)
            row = {"strategy": strategy_name, "bytes": m, "case": case, "compress": cpr, "k": k, "predicted_ms": 1e3 * predicted,
                   "measured_ms": 1e3 * measured, "ratio": measured / predicted if predicted > 0 else None,
                   "times_ms": [1e3 * x for x in times]}
            rows.append(row)
            if rank == 0:
                print(f"[planner] {strategy_name} {m:>10} B {case:4s} compress={int(cpr)} K={k:<3d} "
                      f"predicted {row['predicted_ms']:9.2f} ms measured {row['measured_ms']:9.2f} ms "
                      f"ratio {row['ratio']:.2f}", flush=True)
    if rank == 0:
        with open(os.path.join(a.out_dir, "rows.json"), "w") as f:
            json.dump({"rows": rows, "profiles": profiles}, f)
    hipress.shutdown()


# ------------------------------------------------------------------ driver
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--bandwidth", default="1gbit", help="tc units; 'none' = unshaped")
    p.add_argument("--latency", default="0.2ms")
    p.add_argument("--algorithm", default="tbq")
    p.add_argument("--strategy", default="ring,ps", help="comma list of ring, ps, allgather")
    p.add_argument("--sizes", default=DEFAULT_SIZES)
    p.add_argument("--rounds", type=int, default=7, help="rounds of (profile, every configuration once)")
    p.add_argument("--profile-repeats", type=int, default=1, help="repeats of each profile round")
    p.add_argument("--tolerance", type=float, default=0.25, help="goal: |measured/predicted - 1| <= this")
    p.add_argument("--out-dir", default="results")
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--profile-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a)
        return {}
    from hipress.bench.cluster import EmulatedCluster

    os.makedirs(a.out_dir, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="hpplanner-") as d:
        os.chmod(d, 0o777)
        cmd = [sys.executable, "-m", "hipress.bench.planner", "--worker", "--out-dir", d, "--profile-dir", d,
               "--algorithm", a.algorithm, "--strategy", a.strategy, "--sizes", a.sizes,
               "--rounds", str(a.rounds), "--profile-repeats", str(a.profile_repeats)]
        bw = None if a.bandwidth == "none" else a.bandwidth
        with EmulatedCluster(np=a.np, bandwidth=bw, latency=a.latency, quiet=not a.verbose) as c:
            cluster = {"emulated": c.emulated, "delay_method": c.delay_method, "fallback_reason": c.fallback_reason}
            code, outputs = c.run(cmd, timeout=a.timeout, env=env, cwd=REPO)
        if code != 0:
            tail = "\n".join("\n".join(o.splitlines()[-20:]) for o in outputs)
            raise SystemExit(f"planner benchmark failed (exit {code}):\n{tail}")
        with open(os.path.join(d, "rows.json")) as f:
            got = json.load(f)
    rows = got["rows"]
    for r in rows:
        r["within"] = r["ratio"] is not None and abs(r["ratio"] - 1) <= a.tolerance
    bad = [r for r in rows if not r["within"]]
    title = (f"### Planner: predicted vs measured sync time, {a.np} ranks, {a.bandwidth}, latency {a.latency}, "
             f"{a.algorithm}{'' if cluster['emulated'] else ' (NOT emulated: unshaped loopback)'}")
    table = markdown_table([dict(r, size=f"{r['bytes'] // KB} KB" if r["bytes"] < MB else f"{r['bytes'] // MB} MB")
                            for r in rows],
                           ["strategy", "size", "case", "compress", "k", "predicted_ms", "measured_ms", "ratio"])
    summary = (f"- goal: every row within {a.tolerance:.0%}: {len(rows) - len(bad)}/{len(rows)} rows "
               f"({'met' if not bad else 'MISSED'})")
    md = f"{title}\n\n{table}\n{summary}\n"
    print(md)
    base = os.path.join(a.out_dir, "planner-validate")
    with open(base + ".md", "w") as f:
        f.write(md)
    write_result(base + ".json", "planner-validate", {**vars(a), "cluster": cluster}, rows,
                 {"profiles": got["profiles"], "goal_met": not bad, "wall_s": time.time() - t0})
    return {"rows": rows, "goal_met": not bad}


if __name__ == "__main__":
    main()
