"""What nonfinite="skip" (hipress/torch/nonfinite.py) costs on one gradient: the check, and
the copy-on-write copy of its compressor state next to the encode that runs anyway.

    python -m hipress.bench.nonfinite [--mib 64] [--reps 25] [--algorithms tbq,onebit,dgc,terngrad]

Interleaved repetitions; min and median of each (the min is the figure on a shared host).
The agreement collective (one allgather of a byte per parameter per step) and the memory of
the copies are measured elsewhere: ``hipress.bench.memory --nonfinite``.
"""
from __future__ import annotations

import argparse
import time


def main(argv=None) -> dict:
    import torch

    from hipress import compression
    from hipress.sync import StateStore
    from hipress.torch.nonfinite import all_finite

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--algorithms", default="tbq,onebit,dgc,terngrad")
    a = p.parse_args(argv)
    n = a.mib << 18
    g = torch.randn(n) * 1e-3
    dst = torch.empty_like(g)
    cases = {"copy_ (reference)": lambda: dst.copy_(g),
             "check: all_finite (one sum)": lambda: all_finite(g),
             "check: isfinite(g).all()": lambda: bool(torch.isfinite(g).all())}
    for name in a.algorithms.split(","):
        comp = compression.get(name)
        for guard in (False, True):
            store = StateStore(0)
            store.undo_log.enabled = guard
            comp.encode(g, store.get("k", comp, n))
            store.commit()

            def step(comp=comp, store=store):
                comp.encode(g, store.get("k", comp, n))
                store.commit()
            cases[f"{name} encode" + (" + state copy" if guard else "")] = step
    times = {k: [] for k in cases}
    for _ in range(a.reps):
        for k, f in cases.items():
            t0 = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t0) * 1e3)
    print(f"{a.mib} MiB fp32 gradient, {torch.get_num_threads()} threads, {a.reps} interleaved repetitions")
    rows = {}
    for k, v in times.items():
        v.sort()
        rows[k] = {"min_ms": v[0], "median_ms": v[len(v) // 2]}
        print(f"  {k:34s} min {v[0]:8.2f} ms   median {v[len(v) // 2]:8.2f} ms")
    return rows


if __name__ == "__main__":
    main()
