"""Convergence of each compression algorithm on real, offline data (issue 9), beside a
pure reference of the same training.

    python -m hipress.bench.convergence --task digits --np 4        # CNN on scikit-learn's digits: test accuracy
    python -m hipress.bench.convergence --task charlm --np 4        # character LM: validation perplexity
    python -m hipress.bench.convergence --task transformer --np 4   # transformer on a synthetic sequence task
    python -m hipress.bench.convergence --task digits --np 4 --reference-only   # the simulator alone (fast)
    python -m hipress.bench.convergence --task digits --np 4 --ddp --no-reference   # through DDP's comm hook

Every algorithm (and no compression) trains the same model from the same seed with the
same hyper-parameters, data order and number of epochs / steps, as ``--np`` local ranks
(``hipress.launch``) with ``hipress.DistributedOptimizer(compression=..., strategy="auto")``
and its defaults otherwise (clipping as the algorithm's paper prescribes, momentum correction
for single-round algorithms; docs/convergence.md). Algorithm parameters are hipress's defaults
(``--kwargs ALGO=JSON`` changes them); the learning-rate schedule is not changed per algorithm.

The algorithms train one after another in one launch of the ranks, each from a model, data and
optimizer built anew from the seed: the same figures, to the last bit, as a launch per algorithm,
in 40-52% of the time (5 and 3 algorithms, 2 ranks, digits, on a 2-core machine). Where that
launch fails, the algorithms it left unfinished run again in a launch each, so a failure is
reported against its own algorithm.

Beside each hipress run, the ``reference`` column is the same training simulated in this
process by hipress/bench/simulate.py: N workers, pure torch and the algorithms' numpy
references, allgather semantics (each worker's payload decoded once, summed in rank order,
divided by N; PowerSGD's two summed rounds), the same clipping, buckets and compressor
parameters as hipress. ``--strategy`` applies to the hipress runs only. The tasks and their
data are described in hipress/bench/tasks.py (below).

Writes into ``--out-dir`` (default results/): convergence-<task>.json (every evaluation
point of every run and of its reference, configuration, data description, machine),
convergence-<task>.md (final metric per algorithm, its reference, their difference and the
difference to no compression) and convergence-<task>.png (metric versus training wall time).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

from hipress.bench import tasks
from hipress.bench.common import machine_info, markdown_table

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALGOS = ["none", "onebit", "tbq", "terngrad", "dgc", "graddrop", "powersgd"]


# ------------------------------------------------------------------ worker


def worker(a) -> None:
    """Trains every run of ``--runs`` in turn, in this one launch of the ranks: starting torch and
    the ranks cost about four times a digits run's training on a 2-core machine. Each run builds its
    model, data and optimizer anew from the seed, as a launch of its own would."""
    import torch

    import hipress

    torch.set_num_threads(1)
    if a.ddp:  # torch DistributedDataParallel with hipress's comm hook (hipress/torch/ddp.py)
        import torch.distributed as dist

        import hipress.ddp
        dist.init_process_group("gloo")
        hipress.ddp.init()
    else:
        hipress.init()
    for run in json.loads(a.runs):
        _train(a, run["algo"], run["kwargs"], _result_path(a.result_dir, run["algo"]))


def _result_path(d: str, algo: str) -> str:
    """Where the worker writes an algorithm's run (rank 0) and the driver reads it."""
    return os.path.join(d, f"{algo}.json")


def _train(a, algo: str, kw: dict, result: str) -> None:
    import torch

    import hipress

    rank, size = hipress.rank(), hipress.size()
    task = tasks.build(a.task, a.seed, a.batch, a.seq)
    model = net = task.model
    opt = tasks.optimizer(model, a.lr)
    if a.ddp:
        from hipress import compression
        from hipress.torch import covap, momentum

        mc = None  # momentum correction where the optimizer's "auto" applies it: in the hook, the SGD without
        # compression="covap": the inner algorithm decides, as in the optimizer
        inner, inner_kw = covap.split_options(kw)[1:] if algo == "covap" else (algo, kw)
        if momentum.resolve("auto", opt, compression.get(inner, **inner_kw)):
            mc = opt.param_groups[0]["momentum"]
            opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.0)
        net = torch.nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's parameters
        state = hipress.ddp.HookState(algo, a.strategy, named_parameters=model.named_parameters(),
                                      momentum_correction=mc, **kw)
        net.register_comm_hook(state, hipress.ddp.hook)
    else:
        extra = {} if a.bucket_bytes is None else {"bucket_bytes": a.bucket_bytes}
        # strategy "dear" updates in the model's forward pre-hooks, so it takes the model itself
        extra.update({"model": model} if a.strategy == "dear" else {"named_parameters": model.named_parameters()})
        opt = hipress.DistributedOptimizer(opt, compression=algo, strategy=a.strategy, **extra, **kw)
        hipress.broadcast_parameters(model.state_dict(), root_rank=0)

    if algo == "covap":  # its local mode: every rank holds the same model when it is evaluated
        flush, evaluate = (state if a.ddp else opt).synchronize, task.evaluate
        task = dataclasses.replace(task, evaluate=lambda: (flush(), evaluate())[1])

    def step(epoch, i):
        x, y = task.batch(rank, size, epoch, i)
        opt.zero_grad()
        loss = task.loss(net(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    points = tasks.train(task, size, a.epochs, a.eval_every, step)
    if rank == 0:
        with open(result, "w") as f:
            # multi-round compressors (PowerSGD) sync with the low-rank strategy whatever the option says
            comp, name = (state.compressor, state.strategy) if a.ddp else (opt._hp_compressor, opt._hp_strategy_name)
            name = "dear" if a.strategy == "dear" else name  # dear syncs with the ring's phases
            strategy = ("lowrank" if comp.lowrank else name) + (" (DDP hook)" if a.ddp else "")
            profile = (state if a.ddp else opt).covap_profile if algo == "covap" else None  # interval "auto"
            trial = None if a.ddp else opt.plan_trial  # plan="auto" measured against no compression
            if trial is not None:
                strategy += f", {trial.chosen or trial.in_use} plan kept" if trial.done else ", plans still measured"
            coordinator = None if a.ddp else opt.coordinator_trial  # coordinator="auto": measured on and off
            if coordinator is not None and coordinator.seconds:
                strategy += f", coordinator {coordinator.chosen} kept" if coordinator.done else ", coordinator measured"
            json.dump({"algo": algo, "points": points, "steps_per_epoch": task.steps_per_epoch(size),
                       "strategy": strategy, "covap_profile": profile and dataclasses.asdict(profile)}, f)


# ------------------------------------------------------------------ driver


def _final(result: dict, metric: str):
    """(value, shown): a run's final metric and how the table shows it."""
    val = result["points"][-1][metric]
    if val != val or abs(val) > 1e6:
        return None, f"diverged ({val:.1e})"
    return val, round(val, 2)


def _hipress_runs(a, algos: list, kwargs: dict, d: str, env: dict) -> dict:
    """{algo: result} of every algorithm, trained one after another in one launch of the ranks.
    Where that launch fails, each algorithm it left without a result runs again in a launch of its
    own, so a failure is reported against its own algorithm and does not take the others with it."""
    out = _launch(a, algos, kwargs, d, env)
    missing = [x for x in algos if x not in out]
    if missing and len(algos) > 1:
        print(f"[convergence]   the shared launch failed; {', '.join(missing)} in launches of their own",
              file=sys.stderr)
        for algo in missing:
            out.update(_launch(a, [algo], kwargs, d, env))
    return out


def _launch(a, algos: list, kwargs: dict, d: str, env: dict) -> dict:
    from hipress.launch import run

    runs = [{"algo": algo, "kwargs": kwargs.get(algo, {})} for algo in algos]
    cmd = [sys.executable, "-m", "hipress.bench.convergence", "--worker", "--task", a.task, "--runs", json.dumps(runs),
           "--result-dir", d, "--epochs", str(a.epochs), "--batch", str(a.batch), "--lr", str(a.lr),
           "--seq", str(a.seq), "--eval-every", str(a.eval_every), "--seed", str(a.seed), "--strategy", a.strategy]
    if a.bucket_bytes is not None:
        cmd += ["--bucket-bytes", str(a.bucket_bytes)]
    if a.ddp:
        cmd += ["--ddp"]
    code, logs = run(cmd, a.np, timeout=a.timeout * len(algos), quiet=True, env=env)
    out = {}
    for algo in algos:
        res = _result_path(d, algo)
        if os.path.exists(res):
            with open(res) as f:
                out[algo] = json.load(f)
    if code != 0 and len(algos) == 1 and not out:
        print(f"[convergence]   failed ({code})", file=sys.stderr)
        out[algos[0]] = {"algo": algos[0], "error": f"exit code {code}", "output_tail": "\n".join(logs)[-3000:]}
    return out


def _reference_run(a, algo: str, kwargs: dict) -> dict:
    from hipress.bench import simulate

    extra = {} if a.bucket_bytes is None else {"bucket_bytes": a.bucket_bytes}
    return simulate.run(a.task, a.np, algo, kwargs, epochs=a.epochs, batch=a.batch, lr=a.lr, seed=a.seed,
                        seq=a.seq, eval_every=a.eval_every, **extra)


def _diff(a, b):
    """a - b for the table, blank where either is missing (+ 0.0: no '-0')."""
    return "" if a is None or b is None else round(a - b, 2) + 0.0


def _row(algo_label: str, metric: str, run: dict, refr: dict, base, ref_base, digits: bool) -> dict:
    """One table row: hipress's figure (when run), the reference's (when run), and the differences."""
    row = {"algorithm": algo_label}
    val = None
    if run is not None:
        if "error" in run:
            row["strategy"], row[metric] = "", f"failed: {run['error']}"
        else:
            last = run["points"][-1]
            row["strategy"], row["epochs"], row["steps"] = run["strategy"], last["epoch"], last["step"]
            val, row[metric] = _final(run, metric)
    rval = None
    if refr is not None and "na" in refr:
        row["reference"] = f"n/a ({refr['na']})"
    elif refr is not None:
        rval, row["reference"] = _final(refr, metric)
    if run is not None and refr is not None:
        row["hipress_minus_reference"] = _diff(val, rval)
    if run is not None:
        row["diff_vs_none"] = _diff(val, base)
    if refr is not None:
        row["reference_vs_none"] = _diff(rval, ref_base)
    if run is not None and digits:
        row["within_1_point"] = "" if val is None or base is None else ("yes" if abs(val - base) <= 1.0 else "NO")
    if run is not None and "points" in run:
        row["train_wall_s"] = round(run["points"][-1]["wall_s"], 1)
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__ + "\n" + tasks.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=tasks.NAMES, default="digits")
    p.add_argument("--algos", default=",".join(ALGOS))
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--epochs", type=int)
    p.add_argument("--batch", type=int, help="per rank")
    p.add_argument("--lr", type=float)
    p.add_argument("--seq", type=int, default=64, help="charlm sequence length")
    p.add_argument("--eval-every", type=int, help="epochs between evaluations")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--seeds", help="comma-separated seeds: one full run per seed, then each algorithm's mean "
                                   "(single runs move by about 1.5 points on digits with the seed alone)")
    p.add_argument("--strategy", default="auto", choices=["auto", "ring", "ps", "allgather", "dear"],
                   help="CaSync strategy of every compressed hipress run (low-rank compressors always use their "
                        "own); the reference always has allgather semantics")
    p.add_argument("--bucket-bytes", type=int,
                   help="tensor fusion of hipress and the reference (0: every gradient alone; default: hipress's)")
    p.add_argument("--ddp", action="store_true",
                   help="hipress runs as torch DistributedDataParallel with hipress's comm hook (hipress.ddp): "
                        "momentum correction in the hook where the optimizer's \"auto\" applies it, with an SGD of "
                        "momentum 0 (docs/ddp.md), DDP's buckets")
    p.add_argument("--reference-only", action="store_true", help="run only the reference simulator (no hipress)")
    p.add_argument("--no-reference", action="store_true", help="run only hipress (no reference simulator)")
    p.add_argument("--out-dir", default="results")
    p.add_argument("--timeout", type=float, default=1800,
                   help="seconds per algorithm (a launch of k algorithms: k times it)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--runs", help=argparse.SUPPRESS)  # the worker's: JSON [{"algo": ..., "kwargs": {...}}]
    p.add_argument("--result-dir", help=argparse.SUPPRESS)
    p.add_argument("--kwargs", action="append", default=[], metavar="ALGO=JSON",
                   help='compressor keyword arguments of one algorithm, e.g. tbq=\'{"threshold": 0.05}\'')
    a = p.parse_args(argv)
    if a.reference_only and a.no_reference:
        p.error("--reference-only and --no-reference leave nothing to run")
    for k, v in tasks.DEFAULTS[a.task].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.worker:
        worker(a)
        return {}
    if a.seeds:
        return _over_seeds(a, list(sys.argv[1:] if argv is None else argv))

    algos = [x for x in a.algos.split(",") if x]
    kwargs = {}
    for item in a.kwargs:
        algo, _, js = item.partition("=")
        try:
            kwargs[algo] = json.loads(js)
        except ValueError:
            raise SystemExit(f"--kwargs {item!r}: expected ALGO={{json object}}, e.g. tbq={{\"threshold\": 0.05}}")
    metric = tasks.METRIC[a.task]
    runs, refs = {}, {}
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t_all = time.time()
    with tempfile.TemporaryDirectory(prefix="hpconv-") as d:
        if not a.reference_only:
            print(f"[convergence] {a.task}: {', '.join(algos)} on {a.np} ranks ...", file=sys.stderr, flush=True)
            runs = _hipress_runs(a, algos, kwargs, d, env)
        for i, algo in enumerate(algos):
            if a.no_reference:
                continue
            print(f"[convergence] {a.task} {i + 1}/{len(algos)} {algo} reference ...", file=sys.stderr, flush=True)
            refs[algo] = _reference_run(a, algo, kwargs.get(algo, {}))
            if "na" in refs[algo]:
                print(f"[convergence]   reference n/a: {refs[algo]['na']}", file=sys.stderr)

    def base_of(results):
        r = results.get("none", {})
        return _final(r, metric)[0] if "points" in r else None

    base, ref_base = base_of(runs), base_of(refs)
    rows = [_row(algo + (f" {json.dumps(kwargs[algo])}" if algo in kwargs else ""), metric,
                 None if a.reference_only else runs[algo], refs.get(algo), base, ref_base, a.task == "digits")
            for algo in algos]
    cols = list(dict.fromkeys(k for r in rows for k in r))
    what = "reference simulator only" if a.reference_only else f"hipress strategy {a.strategy}"
    if a.ddp and not a.reference_only:
        what += ", DDP comm hook"
    md = (f"### convergence: {a.task}, {a.np} ranks, {a.epochs} epochs, batch {a.batch}/rank, lr {a.lr}, "
          f"seed {a.seed}, {what}\n\n" + markdown_table(rows, cols) + "\n")
    if refs:
        md += (f"\n`reference`: {metric} of the same training simulated with the pure references and allgather "
               f"semantics (hipress/bench/simulate.py).\n")
    print(md)
    os.makedirs(a.out_dir, exist_ok=True)
    basep = os.path.join(a.out_dir, f"convergence-{a.task}")
    pngs = []
    if not a.no_plots:
        from hipress.bench import plots
        if a.reference_only:  # the simulator's wall time says nothing: plot against steps
            series = {f"{algo} (reference)": r["points"] for algo, r in refs.items() if "points" in r}
            png = plots.curves(series, "step", metric, basep + ".png",
                               title=f"{a.task}: {metric} vs step (reference, {a.np} workers)",
                               xlabel="optimizer step", ylabel=metric)
        else:
            series = {algo: r["points"] for algo, r in runs.items() if "points" in r}
            png = plots.curves(series, "wall_s", metric, basep + ".png",
                               title=f"{a.task}: {metric} vs training wall time ({a.np} ranks)",
                               xlabel="training wall time (s)", ylabel=metric)
        pngs = [png] if png else []
    doc = {"benchmark": "convergence", "task": a.task, "metric": metric,
           "config": {k: v for k, v in vars(a).items() if k not in ("worker", "runs", "result_dir")},
           "machine": machine_info(), "wall_s": time.time() - t_all, "rows": rows, "runs": runs,
           "reference": refs, **tasks.describe(a.task)}
    with open(basep + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    with open(basep + ".md", "w") as f:
        f.write(md)
    print(f"wrote {basep}.json, {basep}.md" + "".join(f", {x}" for x in pngs))
    return doc


def _over_seeds(a, argv: list) -> dict:
    """Runs main once per seed of ``--seeds`` (into out-dir/seed-S) and summarises each
    algorithm's final metric: per seed, mean, and the mean's difference to no compression."""
    i = argv.index("--seeds")
    rest = argv[:i] + argv[i + 2:]
    seeds = [int(x) for x in a.seeds.split(",") if x]
    metric = tasks.METRIC[a.task]
    per = {}  # (algo, "hipress" | "reference") -> [metric per seed]
    for seed in seeds:
        doc = main(rest + ["--seed", str(seed), "--out-dir", os.path.join(a.out_dir, f"seed-{seed}"), "--no-plots"])
        for side, results in (("hipress", doc["runs"]), ("reference", doc["reference"])):
            for algo, r in results.items():
                val = _final(r, metric)[0] if "points" in r else None  # None: failed, n/a or diverged
                per.setdefault((algo, side), []).append(float("nan") if val is None else val)
    rows = []
    for (algo, side), vals in per.items():
        mean = sum(vals) / len(vals)
        base = per.get(("none", side))
        row = {"algorithm": algo, "side": side, **{f"seed {s}": round(v, 2) for s, v in zip(seeds, vals)},
               f"mean {metric}": round(mean, 2)}
        if base:
            row["mean_diff_vs_none"] = round(mean - sum(base) / len(base), 2)
        rows.append(row)
    md = (f"### convergence over seeds {a.seeds}: {a.task}, {a.np} ranks, hipress strategy {a.strategy}\n\n"
          + markdown_table(rows, list(dict.fromkeys(k for r in rows for k in r))) + "\n")
    print(md)
    os.makedirs(a.out_dir, exist_ok=True)
    basep = os.path.join(a.out_dir, f"convergence-{a.task}-seeds")
    with open(basep + ".json", "w") as f:
        json.dump({"benchmark": "convergence", "task": a.task, "seeds": seeds, "rows": rows}, f, indent=1)
    with open(basep + ".md", "w") as f:
        f.write(md)
    return {"rows": rows}


if __name__ == "__main__":
    main()
