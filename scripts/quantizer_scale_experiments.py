"""The experiments of docs/convergence.md's causes 10 and 15 and its "Open" onebit entry: onebit,
TBQ and TernGrad with other scales, in the reference simulator (hipress/bench/simulate.py), the variant patched
over the algorithm's reference encode. An experiment tool, not part of hipress: the variants are
computed in double and decoded in-process (no payload bytes), so figures differ in the last bits
from a kernel's and, in a chaotic run, can part from them.

    PYTHONPATH=. python scripts/quantizer_scale_experiments.py [--task digits|charlm] [--algo onebit|tbq|terngrad]
        [--variant V] [--seeds 42,1,2] [--lr LR] [--warmup STEPS]

onebit variants: SCALE[-GRAIN] with SCALE base (Seide's two means), rms (per-sign root mean
square), rms1 (one scale ||x||_2 / sqrt(n), hipress's onebit now); GRAIN rows (a scale per row
of each weight matrix; env ROWSEL=name,name limits it to parameters whose names contain one) or
gates (a third of each GRU matrix); ef21 (an EF21-style estimate, Seide's means); none (no
compression). TBQ variants: mean (the mean magnitude of the sent elements, before cause 10),
rms (their root mean square), rows, signscale. TernGrad variants: rows[-MIN] (min/max per row of
each weight matrix with rows of at least MIN elements; cause 15). --warmup (onebit, TBQ): that
many uncompressed steps first.
Prints the final metric per seed and the mean.
"""
import argparse
import json
import os
import numpy as np, torch
from hipress.bench import simulate, tasks
from hipress.compression import reference as ref

ap = argparse.ArgumentParser()
ap.add_argument("--task", default="digits"); ap.add_argument("--algo", default="onebit")
ap.add_argument("--variant", default="base"); ap.add_argument("--seeds", default="42,1,2")
ap.add_argument("--lr", type=float, default=None); ap.add_argument("--warmup", type=int, default=0)
ap.add_argument("--kwargs", default="{}"); ap.add_argument("--np", type=int, default=4)
ap.add_argument("--epochs", type=int, default=None)
a = ap.parse_args()
d = tasks.DEFAULTS[a.task]
lr = a.lr or d["lr"]
ROWLEN = {}

def blocks(x, L):
    return x.reshape(-1, L) if L and x.size % L == 0 else x.reshape(1, -1)

def ob_block(r, scale):
    ng = np.signbit(r)
    if scale == "rms1":
        s_ = np.sqrt((r.astype(np.float64)**2).mean()); return np.where(ng, -s_, s_)
    if scale == "rms":
        pm = np.sqrt((r[~ng].astype(np.float64)**2).mean()) if (~ng).any() else 0
        nm = -np.sqrt((r[ng].astype(np.float64)**2).mean()) if ng.any() else 0
    else:
        pm = r[~ng].mean() if (~ng).any() else 0; nm = r[ng].mean() if ng.any() else 0
    return np.where(ng, nm, pm)

def onebit_var(kind):
    scale, _, gran = kind.partition("-")
    def make(p, n, counter):
        L = ROWLEN.get(("g", n), 0) if gran == "gates" else (ROWLEN.get(n, 0) if gran == "rows" else 0)
        calls = [0]
        def enc(x):
            calls[0] += 1
            x = np.asarray(x, np.float32)
            if calls[0] <= a.warmup: return x.copy()
            b = blocks(x, L)
            return np.stack([ob_block(b[i], scale) for i in range(b.shape[0])]).astype(np.float32).reshape(-1)
        return enc, (lambda y, n: y)
    return make

def tbq_var(kind):
    def make(p, n, counter):
        L = ROWLEN.get(n, 0)
        calls = [0]
        def enc(x):
            calls[0] += 1
            x = np.asarray(x, np.float32)
            if calls[0] <= a.warmup: return x.copy()
            if kind == "rows":
                b = blocks(x, L); out = np.empty_like(b)
                for i in range(b.shape[0]):
                    out[i] = ref.tbq_decode(ref.tbq_encode(b[i], p["threshold"], p["relative"]), b.shape[1])
                return out.reshape(-1)
            if kind == "signscale":  # separate scale per sign
                tau = p["relative"] * np.abs(x).mean()
                out = np.zeros_like(x); up = x > tau; dn = x < -tau
                if up.any(): out[up] = x[up].mean()
                if dn.any(): out[dn] = x[dn].mean()
                return out
            if kind == "rms":
                tau = p["relative"] * np.abs(x).mean()
                out = np.zeros_like(x); up = x > tau; dn = x < -tau; sel = up | dn
                if sel.any():
                    sc = np.sqrt((x[sel].astype(np.float64)**2).mean()); out[up] = sc; out[dn] = -sc
                return out
            if kind == "mean":
                tau = p["relative"] * np.abs(x).mean()
                out = np.zeros_like(x); up = x > tau; dn = x < -tau; sel = up | dn
                if sel.any():
                    sc = np.abs(x[sel]).astype(np.float64).mean(); out[up] = sc; out[dn] = -sc
                return out
            return ref.tbq_decode(ref.tbq_encode(x, p["threshold"], p["relative"]), n)
        return enc, (lambda y, n: y)
    return make

def terngrad_var(kind):
    """rows[-MIN]: min/max per row of each weight matrix, for rows of at least MIN elements."""
    min_row = int(kind.partition("-")[2] or 0)
    def make(p, n, counter):
        L = ROWLEN.get(n, 0)
        if L < min_row: L = 0
        st = [counter]
        def enc(x):
            x = np.asarray(x, np.float32)
            b = blocks(x, L); out = np.empty_like(b)
            for i in range(b.shape[0]):
                out[i] = ref.terngrad_decode(ref.terngrad_encode(b[i], int(p["bitwidth"]), int(p["seed"]), st[0] + i * b.shape[1]), b.shape[1])
            st[0] += n
            return out.reshape(-1)
        return enc, (lambda y, n: y)
    return make

if a.algo == "onebit":
    simulate.SINGLE_ROUND["onebit"] = (set(), set(), onebit_var(a.variant))
elif a.algo == "terngrad":
    simulate.SINGLE_ROUND["terngrad"] = ({"bitwidth", "seed"}, set(), terngrad_var(a.variant))
else:
    simulate.SINGLE_ROUND["tbq"] = ({"threshold", "relative"}, set(), tbq_var(a.variant))

if a.variant == "ef21":
    class EF21(simulate._Worker):
        def __call__(self, g):
            if self.residual is None: self.residual = np.zeros(self.n, np.float32)
            h = self.residual  # the worker's (and everyone's copy of its) estimate
            h += self.decode(self.encode(np.asarray(g, np.float32) - h), self.n)
            return h.copy()
    simulate._Worker = EF21

res = {}
for s in [int(x) for x in a.seeds.split(",")]:
    torch.manual_seed(s)
    # build rowlen map from the task's model
    t = tasks.build(a.task, s, d["batch"], 64)
    for name, prm in t.model.named_parameters():
        sel = os.environ.get("ROWSEL", "")
        if prm.dim() >= 2 and (not sel or any(k in name for k in sel.split(","))): ROWLEN[prm.numel()] = int(np.prod(prm.shape[1:]))
        if "rnn.weight" in name: ROWLEN[("g", prm.numel())] = prm.numel() // 3
    algo = a.algo if a.variant != "none" else "none"
    r = simulate.run(a.task, a.np, algo, json.loads(a.kwargs), epochs=a.epochs or d["epochs"], batch=d["batch"],
                     lr=lr, seed=s)
    pt = r["points"][-1]
    res[s] = pt.get("test_accuracy", pt.get("val_perplexity"))
vals = list(res.values())
print(a.task, a.algo, a.variant, "lr", lr, "warmup", a.warmup, a.kwargs, {k: round(v, 2) for k, v in res.items()}, "mean", round(float(np.mean(vals)), 2), flush=True)
