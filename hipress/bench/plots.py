"""PNG plots of the comparison and convergence benchmarks (matplotlib, Agg backend).

matplotlib is optional for the rest of hipress: every function here returns the path it
wrote, or None (with a warning on stderr) when matplotlib is not installed.
"""
from __future__ import annotations

import sys
from typing import Dict, List, Optional, Sequence


def _plt():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print("[plots] matplotlib is not installed (pip install matplotlib); no PNG written", file=sys.stderr)
        return None


def _bw_key(bw: str) -> float:
    from hipress.bench.cluster import parse_rate
    try:
        return parse_rate(bw) or float("inf")
    except ValueError:
        return float("inf")


def throughput_vs_bandwidth(rows: Sequence[dict], path: str, title: str = "") -> Optional[str]:
    """rows: {system, bandwidth, throughput}; one line per system, bandwidth on a log axis."""
    plt = _plt()
    if plt is None:
        return None
    bws = sorted({r["bandwidth"] for r in rows}, key=_bw_key)
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 5))
    xs = list(range(len(bws)))
    for s in systems:
        pts = [(xs[bws.index(r["bandwidth"])], r["throughput"]) for r in rows
               if r["system"] == s and r.get("throughput")]
        if not pts:
            continue
        pts.sort()
        style = "--" if s.startswith("ddp") or s == "horovod" else "-"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=s)
    ax.set_xticks(xs)
    ax.set_xticklabels(bws)
    ax.set_xlabel("per-host bandwidth (each way)")
    ax.set_ylabel("throughput (samples/s, all ranks)")
    ax.set_title(title or "throughput vs bandwidth")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def breakdown(rows: Sequence[dict], path: str, title: str = "") -> Optional[str]:
    """Stacked bars per (bandwidth, system): compute, compression, other exposed communication (ms/step)."""
    plt = _plt()
    if plt is None:
        return None
    bws = sorted({r["bandwidth"] for r in rows}, key=_bw_key)
    fig, axes = plt.subplots(len(bws), 1, figsize=(max(8, 0.55 * len(rows) / max(1, len(bws)) + 3), 3.2 * len(bws)),
                             squeeze=False)
    for ax, bw in zip(axes[:, 0], bws):
        sub = [r for r in rows if r["bandwidth"] == bw and r.get("step_s")]
        names = [r["system"] for r in sub]
        comp = [1e3 * r["compute_s"] for r in sub]
        cpr = [1e3 * r["compression_stack_s"] for r in sub]
        comm = [1e3 * r["comm_stack_s"] for r in sub]
        x = list(range(len(sub)))
        ax.bar(x, comp, label="compute (fwd+bwd+update, no sync)", color="#4c72b0")
        ax.bar(x, cpr, bottom=comp, label="compression (engine compute queue)", color="#dd8452")
        ax.bar(x, comm, bottom=[a + b for a, b in zip(comp, cpr)], label="other exposed communication",
               color="#c44e52")
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("ms per step")
        ax.set_title(f"{title} {bw}".strip())
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def curves(series: Dict[str, List[dict]], x: str, y: str, path: str, title: str = "", ylabel: str = "",
           xlabel: str = "") -> Optional[str]:
    """One line per name: series[name] = [{x: .., y: ..}, ...] (e.g. accuracy vs wall time)."""
    plt = _plt()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in series.items():
        pts = [p for p in pts if p.get(y) is not None]
        ax.plot([p[x] for p in pts], [p[y] for p in pts], marker=".", label=name)
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel or y)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
