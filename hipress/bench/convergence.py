"""Convergence of each compression algorithm on real, offline data (issue 9).

    python -m hipress.bench.convergence --task digits      # CNN on scikit-learn's digits: test accuracy
    python -m hipress.bench.convergence --task charlm      # character LM: validation perplexity

Every algorithm (and no compression) trains the same model from the same seed with the
same hyper-parameters, data order and number of epochs / steps, as ``--np`` local ranks
(``hipress.launch``) with ``hipress.DistributedOptimizer(compression=..., strategy="auto")``
(ring for quantization and low-rank, PS for sparsification, paper §5.3). Algorithm
parameters are hipress's defaults, which follow each algorithm's paper (onebit with error
feedback, TBQ threshold 0.01, TernGrad 2 bits, DGC 0.1% with momentum correction,
GradDrop 1%, PowerSGD rank 4); the learning-rate schedule is not changed per algorithm
(DGC's warm-up of the sparsity is not applied). One paper-prescribed difference is applied:
DGC runs with optimizer momentum 0 because its momentum correction inside the compressor
replaces it (``--no-paper-overrides`` turns this off).

Data:
  digits  sklearn.datasets.load_digits (1797 8x8 images, bundled with scikit-learn):
          fixed shuffle, 1500 train / 297 test; each rank trains on its shard.
  charlm  a text corpus that ships with installed packages: scikit-learn's dataset
          descriptions (sklearn/datasets/descr/*.rst) followed by CPython's LICENSE.txt
          (about 57 KB; file names and sha256 are recorded); 90% train / 10% validation.

Writes into ``--out-dir`` (default results/): convergence-<task>.json (every evaluation
point of every run, configuration, data description, machine), convergence-<task>.md
(final metric per algorithm and its difference to no compression) and
convergence-<task>.png (metric versus training wall time).
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import sys
import tempfile
import time

from hipress.bench.common import machine_info, markdown_table

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALGOS = ["none", "onebit", "tbq", "terngrad", "dgc", "graddrop", "powersgd"]
DEFAULTS = {
    "digits": dict(epochs=10, batch=32, lr=0.05, eval_every=1),
    "charlm": dict(epochs=4, batch=16, lr=0.5, eval_every=1),
}


# ------------------------------------------------------------------ data


def text_corpus() -> tuple:
    """(text, [{path, bytes, sha256}]) from files that ship with installed packages."""
    files = []
    try:
        import sklearn
        files += sorted(glob.glob(os.path.join(os.path.dirname(sklearn.__file__), "datasets", "descr", "*.rst")))
    except ImportError:
        pass
    import sysconfig
    lic = os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt")
    if os.path.exists(lic):
        files.append(lic)
    parts, meta = [], []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            t = fh.read()
        parts.append(t)
        meta.append({"path": f, "bytes": len(t.encode()), "sha256": hashlib.sha256(t.encode()).hexdigest()[:16]})
    text = "\n".join(parts)
    if len(text) < 20000:  # fall back on the standard library's docstrings
        import collections, json as _j, textwrap  # noqa: E401,F401 - modules with long docstrings
        mods = [collections, _j, textwrap, argparse, glob, hashlib, tempfile]
        text += "\n".join(m.__doc__ or "" for m in mods)
        meta.append({"path": "stdlib docstrings", "bytes": len(text)})
    return text, meta


# ------------------------------------------------------------------ models


def _charlm_model(vocab: int):
    import torch.nn as nn

    class CharLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, 64)
            self.rnn = nn.GRU(64, 256, batch_first=True)
            self.out = nn.Linear(256, vocab)

        def forward(self, ids):
            h, _ = self.rnn(self.emb(ids))
            return self.out(h)

    return CharLM()


# ------------------------------------------------------------------ worker


def worker(a) -> None:
    import math

    import torch
    import torch.nn.functional as F

    import hipress

    torch.set_num_threads(1)
    hipress.init()
    rank, size = hipress.rank(), hipress.size()
    torch.manual_seed(a.seed)
    if a.task == "digits":
        from hipress.bench.models import DigitsCNN, digits_data

        (xtr, ytr), (xte, yte) = digits_data(a.seed)
        xtr, ytr = xtr[rank::size], ytr[rank::size]
        model = DigitsCNN()
        steps_per_epoch = len(ytr) // a.batch

        def batch(epoch, i):
            g = torch.Generator().manual_seed(a.seed * 1000 + epoch)
            perm = torch.randperm(len(ytr), generator=g)[i * a.batch:(i + 1) * a.batch]
            return xtr[perm], ytr[perm]

        def loss_fn(out, y):
            return F.cross_entropy(out, y)

        def evaluate():
            model.eval()
            with torch.no_grad():
                out = model(xte)
                acc = (out.argmax(1) == yte).float().mean().item()
                loss = F.cross_entropy(out, yte).item()
            model.train()
            return {"test_accuracy": 100 * acc, "test_loss": loss}
    else:
        text, _ = text_corpus()
        chars = sorted(set(text))
        ids = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
        split = int(0.9 * len(ids))
        train, val = ids[:split], ids[split:]
        seq = a.seq
        model = _charlm_model(len(chars))
        nseq = (len(train) - 1) // seq
        starts_all = torch.arange(nseq) * seq
        mine = starts_all[rank::size]
        steps_per_epoch = len(mine) // a.batch

        def batch(epoch, i):
            g = torch.Generator().manual_seed(a.seed * 1000 + epoch)
            st = mine[torch.randperm(len(mine), generator=g)[i * a.batch:(i + 1) * a.batch]]
            idx = st[:, None] + torch.arange(seq + 1)[None, :]
            chunk = train[idx]
            return chunk[:, :-1], chunk[:, 1:]

        def loss_fn(out, y):
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

        vn = (len(val) - 1) // seq
        vidx = (torch.arange(vn) * seq)[:, None] + torch.arange(seq + 1)[None, :]
        vchunk = val[vidx]

        def evaluate():
            model.eval()
            with torch.no_grad():
                loss = loss_fn(model(vchunk[:, :-1]), vchunk[:, 1:]).item()
            model.train()
            return {"val_loss": loss, "val_perplexity": math.exp(loss)}

    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    opt = hipress.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=a.algo,
                                       strategy=a.strategy, **json.loads(a.algo_kwargs or "{}"))
    hipress.broadcast_parameters(model.state_dict(), root_rank=0)
    points = [{"epoch": 0, "step": 0, "wall_s": 0.0, **evaluate()}]
    train_s, step = 0.0, 0
    for epoch in range(1, a.epochs + 1):
        t0 = time.perf_counter()
        tot = 0.0
        for i in range(steps_per_epoch):
            x, y = batch(epoch, i)
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            tot += float(loss.detach())
            step += 1
        train_s += time.perf_counter() - t0
        if epoch % a.eval_every == 0 or epoch == a.epochs:
            points.append({"epoch": epoch, "step": step, "wall_s": train_s,
                           "train_loss": tot / max(1, steps_per_epoch), **evaluate()})
    if rank == 0:
        with open(a.result, "w") as f:
            json.dump({"algo": a.algo, "points": points, "steps_per_epoch": steps_per_epoch,
                       "strategy": opt._hp_strategy_name}, f)


# ------------------------------------------------------------------ driver


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=["digits", "charlm"], default="digits")
    p.add_argument("--algos", default=",".join(ALGOS))
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--epochs", type=int)
    p.add_argument("--batch", type=int, help="per rank")
    p.add_argument("--lr", type=float)
    p.add_argument("--seq", type=int, default=64, help="charlm sequence length")
    p.add_argument("--eval-every", type=int, help="epochs between evaluations")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--strategy", default="auto", choices=["auto", "ring", "ps", "allgather"],
                   help="CaSync strategy of every compressed run (low-rank compressors always use their own)")
    p.add_argument("--out-dir", default="results")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--algo", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--algo-kwargs", help=argparse.SUPPRESS)
    p.add_argument("--kwargs", action="append", default=[], metavar="ALGO=JSON",
                   help='compressor keyword arguments of one algorithm, e.g. tbq=\'{"threshold": 0.05}\'')
    a = p.parse_args(argv)
    for k, v in DEFAULTS[a.task].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.worker:
        worker(a)
        return {}
    from hipress.launch import run

    algos = [x for x in a.algos.split(",") if x]
    kwargs = {}
    for item in a.kwargs:
        algo, _, js = item.partition("=")
        try:
            kwargs[algo] = json.loads(js)
        except ValueError:
            raise SystemExit(f"--kwargs {item!r}: expected ALGO={{json object}}, e.g. tbq={{\"threshold\": 0.05}}")
    metric = "test_accuracy" if a.task == "digits" else "val_perplexity"
    runs, rows = {}, []
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t_all = time.time()
    with tempfile.TemporaryDirectory(prefix="hpconv-") as d:
        for i, algo in enumerate(algos):
            res = os.path.join(d, f"{algo}.json")
            cmd = [sys.executable, "-m", "hipress.bench.convergence", "--worker", "--task", a.task, "--algo", algo,
                   "--result", res, "--epochs", str(a.epochs), "--batch", str(a.batch), "--lr", str(a.lr),
                   "--seq", str(a.seq), "--eval-every", str(a.eval_every), "--seed", str(a.seed),
                   "--strategy", a.strategy, "--algo-kwargs", json.dumps(kwargs.get(algo, {}))]
            print(f"[convergence] {a.task} {i + 1}/{len(algos)} {algo} ...", file=sys.stderr, flush=True)
            t0 = time.time()
            code, logs = run(cmd, a.np, timeout=a.timeout, quiet=True, env=env)
            if code != 0 or not os.path.exists(res):
                runs[algo] = {"algo": algo, "error": f"exit code {code}", "output_tail": "\n".join(logs)[-3000:]}
                print(f"[convergence]   failed ({code})", file=sys.stderr)
                continue
            with open(res) as f:
                runs[algo] = json.load(f)
            runs[algo]["launch_wall_s"] = time.time() - t0
    base = runs.get("none", {}).get("points", [{}])[-1].get(metric)
    for algo in algos:
        r = runs[algo]
        if "error" in r:
            rows.append({"algorithm": algo, "note": r["error"]})
            continue
        last = r["points"][-1]
        val = last[metric]
        bad = val != val or abs(val) > 1e6
        row = {"algorithm": algo + (f" {json.dumps(kwargs[algo])}" if algo in kwargs else ""), "strategy": r["strategy"], "epochs": last["epoch"], "steps": last["step"],
               metric: f"diverged ({val:.1e})" if bad else round(val, 2), "train_wall_s": round(last["wall_s"], 1)}
        if base is not None:
            row["diff_vs_none"] = "" if bad else round(val - base, 2)
        if a.task == "digits" and base is not None:
            row["within_1_point"] = "yes" if abs(last[metric] - base) <= 1.0 else "NO"
        rows.append(row)
    cols = list(dict.fromkeys(k for r in rows for k in r))
    md = (f"### convergence: {a.task}, {a.np} ranks, {a.epochs} epochs, batch {a.batch}/rank, lr {a.lr}, "
          f"seed {a.seed}\n\n" + markdown_table(rows, cols) + "\n")
    print(md)
    os.makedirs(a.out_dir, exist_ok=True)
    basep = os.path.join(a.out_dir, f"convergence-{a.task}")
    pngs = []
    if not a.no_plots:
        from hipress.bench import plots
        series = {algo: r["points"] for algo, r in runs.items() if "points" in r}
        png = plots.curves(series, "wall_s", metric, basep + ".png",
                           title=f"{a.task}: {metric} vs training wall time ({a.np} ranks)",
                           xlabel="training wall time (s)", ylabel=metric)
        pngs = [png] if png else []
    extra = {}
    if a.task == "charlm":
        text, meta = text_corpus()
        extra = {"corpus": meta, "corpus_chars": len(text), "vocab": len(set(text))}
    doc = {"benchmark": "convergence", "task": a.task, "metric": metric,
           "config": {k: v for k, v in vars(a).items() if k not in ("worker", "algo", "result")},
           "machine": machine_info(), "wall_s": time.time() - t_all, "rows": rows, "runs": runs, **extra}
    with open(basep + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    with open(basep + ".md", "w") as f:
        f.write(md)
    print(f"wrote {basep}.json, {basep}.md" + "".join(f", {x}" for x in pngs))
    return doc


if __name__ == "__main__":
    main()
