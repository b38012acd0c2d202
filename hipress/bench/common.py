"""Shared plumbing for benchmarks: machine description, result files, launching a bench's ranks."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from typing import Optional


def machine_info() -> dict:
    info = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import torch
        info["torch"] = torch.__version__
    except ImportError:
        pass
    try:
        info["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        pass
    return info


def write_result(path: str, name: str, config: dict, results, extra: dict | None = None) -> None:
    """Writes {benchmark, config, machine, results, ...} as JSON, creating folders."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    doc = {"benchmark": name, "config": config, "machine": machine_info(), "results": results}
    if extra:
        doc.update(extra)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {path}")


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_ranks(module: str, worker_args: list, np: int, bandwidth: str, latency: str, timeout: float,
              switch_buffer: Optional[str] = None):
    """``python -m <module> --worker <worker_args> OUT`` as ``np`` ranks: local processes over
    loopback (``bandwidth`` "none") or one per emulated host (hipress.bench.cluster, with its
    ``switch_buffer``). The ranks see this environment (HIPRESS_TIMELINE, ...), with the repository
    on their path; one of them writes its result to OUT as JSON. Returns (that result, whether the
    cluster was emulated); SystemExit with the ranks' output where any failed."""
    out = os.path.join("/tmp", f"hipress-{module.rsplit('.', 1)[-1]}-{os.getpid()}.json")
    env = {**os.environ,
           "PYTHONPATH": REPO + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
    cmd = [sys.executable, "-m", module, "--worker", *map(str, worker_args), out]
    if bandwidth == "none":
        if switch_buffer is not None:
            raise SystemExit("--switch-buffer needs a --bandwidth: local processes have no switch")
        from hipress.launch import run
        code, outputs = run(cmd, np, timeout=timeout, quiet=True, env=env)
        emulated = False
    else:
        from hipress.bench.cluster import EmulatedCluster
        with EmulatedCluster(np, bandwidth=bandwidth, latency=latency, quiet=True, switch_buffer=switch_buffer) as cluster:
            code, outputs = cluster.run(cmd, timeout=timeout, env=env, cwd=REPO)
            emulated = cluster.emulated
    if code != 0:
        raise SystemExit(f"the ranks failed (exit {code}):\n" + "\n".join(o[-3000:] for o in outputs))
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    return res, emulated


def describe_link(bandwidth: str, latency: str, switch_buffer: Optional[str], emulated: bool) -> str:
    """How run_ranks' ranks were joined, for a bench's heading."""
    if bandwidth == "none":
        return "local processes (loopback)"
    return f"{bandwidth}, {latency}" + (f", switch buffer {switch_buffer}" if switch_buffer else "") \
        + ("" if emulated else " (NOT emulated: loopback)")
