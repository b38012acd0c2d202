"""The error-feedback diagnostic of docs/convergence.md's cause 10: trains digits (or --task) in the
reference simulator with onebit, 4 workers, seed 42, and prints per parameter the share of the
encoded vector's energy the decoded payload keeps (||C(x)||^2 / ||x||^2) and the residual's norm
over the velocity's, averaged over the first and the last tenth of the run. --means: Seide's two
means (onebit before cause 10) instead of hipress's scale. An experiment tool, not part of hipress.

    PYTHONPATH=. python scripts/ef_residual_diagnostic.py [--task digits] [--means]
"""
import argparse
import collections

import numpy as np

from hipress.bench import simulate, tasks
from hipress.compression import reference as ref

ap = argparse.ArgumentParser()
ap.add_argument("--task", default="digits")
ap.add_argument("--means", action="store_true")
a = ap.parse_args()


def two_means(x):
    neg = np.signbit(x)
    pm = x[~neg].astype(np.float64).mean() if (~neg).any() else 0.0
    nm = x[neg].astype(np.float64).mean() if neg.any() else 0.0
    return np.where(neg, nm, pm).astype(np.float32)


def onebit(x):
    return two_means(x) if a.means else ref.onebit_decode(ref.onebit_encode(x), x.size)


if a.means:  # the simulator's workers encode with the same function
    simulate.SINGLE_ROUND["onebit"] = (set(), set(), lambda p, n, c: ((lambda x: two_means(np.asarray(x, np.float32))),
                                                                      (lambda y, n: y)))
stats = collections.defaultdict(list)
orig = simulate._Worker.__call__


def call(self, g):
    g = np.asarray(g, np.float32)
    comp = self.residual + g
    dec = onebit(comp)
    energy = float((dec.astype(np.float64) ** 2).sum() / max((comp.astype(np.float64) ** 2).sum(), 1e-30))
    out = orig(self, g)
    stats[self.n].append((energy, float(np.linalg.norm(self.residual) / max(np.linalg.norm(g), 1e-30))))
    return out


simulate._Worker.__call__ = call
d = tasks.DEFAULTS[a.task]
t = tasks.build(a.task, 42, d["batch"], 64)
names = {p.numel(): (n, tuple(p.shape)) for n, p in t.model.named_parameters()}
simulate.run(a.task, 4, "onebit", {}, epochs=d["epochs"], batch=d["batch"], lr=d["lr"], seed=42)
for n, s in sorted(stats.items()):
    s = np.array(s)
    k = max(1, len(s) // 10)
    print(names.get(n), n, "energy kept first/last tenth %.3f %.3f" % (s[:k, 0].mean(), s[-k:, 0].mean()),
          "|residual|/|velocity| first/last tenth %.2f %.2f" % (s[:k, 1].mean(), s[-k:, 1].mean()))
