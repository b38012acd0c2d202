"""End-to-end throughput comparison inside the emulated cluster (issue 9).

    python -m hipress.bench.compare --preset issue9            # VGG19- and ResNet50-like, 4 ranks, 1 and 10 Gbit/s
    python -m hipress.bench.compare --preset issue7            # planner vs compress all / nothing (mixed model)
    python -m hipress.bench.compare --model vgg19 --bandwidth 1gbit,10gbit --np 4 [--systems ...] [--quick]
    python -m hipress.bench.compare --preset dear-bo   # bucket_bytes="tune" against a sweep of fixed sizes
    python -m hipress.bench.compare --model bert --bandwidth 1gbit --switch-buffer 128k   # shallow switch ports (incast drops)

For every bandwidth (the cluster is re-shaped with ``set_link`` between them), model
and repeat, the systems run as ranks of ``hipress.bench.train`` inside
``EmulatedCluster`` (one network namespace per rank, tc-shaped links; plain loopback
with a warning when namespaces are unavailable). The systems of one (bandwidth, model,
repeat) share one set of processes and run one after the other, each on a fresh model
(horovod, if installed, gets its own launch). A system that fails is recorded with its
error and the launch is restarted with the systems after it.

Writes, per model, into ``--out-dir`` (default ``results/``):
  compare-<model>.json             every record of every run, the medians, the exact
                                   configuration, cluster and machine, and the goal checks
  compare-<model>.md               the markdown table (also printed)
  compare-<model>-throughput.png   throughput versus bandwidth, one line per system
  compare-<model>-breakdown.png    stacked ms/step: compute, compression, other exposed communication

Every row also gives x_compute: its throughput over the model's compute-only throughput (the
same job with communication removed: world samples / compute time), and COVAP's rows the interval
its profiler chose beside the CCR it measured. The compute time is DDP's (its model under
``no_sync()``) where a ``ddp`` row ran on that link, one figure for every row, else the system's
own compute-only steps (a system's own vary more: 2 steps, and hipress's skip its hooks but keep
its threads). cpu_ms and cpu_compute_ms are CPU time per step
of a rank's whole process (every thread; mean over ranks) in the timed and the compute-only
steps: where ranks outnumber cores, a framework's own work (hooks, copies, engine threads,
extra collectives) costs throughput one for one, and CPU time shows it with far less noise
than wall time.

Bucket-size tuning (docs/dear.md): a system ``X-tune`` runs X with bucket_bytes="tune" (its
warm-up lasts until the tuner settles; ``--tune-*`` set the tuner's knobs), ``X-b<MiB>`` runs X
with that fixed size. With both, the goals list the tuned throughput over the best of the fixed
ones (the issue's target: at least 0.95 in at most 20 trials); the tuned row's note says the
size chosen and what tuning cost.

Time breakdown (per step, medians over repeats): compute = forward + backward + local
optimizer update with synchronization off (measured on all ranks at once, so with the
same CPU contention); exposed communication = step - compute; compression = hipress
engine compute-queue busy seconds per step (may overlap backward). In the stacked plot
compression is capped at the exposed time and the rest of the exposed time is "other
exposed communication". ``spread``: (fastest - slowest) / median of a system's repeats' samples/s,
so that a reader sees how far apart two medians must be to differ (one system's repeats here
often span 5-10%, and a job's first repeat can be slower still: docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Dict, List, Sequence

from hipress.bench.common import machine_info, markdown_table
from hipress.bench.train import parse_system

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ALL_SYSTEMS = (["ddp", "ddp-fp16", "ddp-powersgd", "ddp-covap-hook", "horovod", "hipress-covap",
                "hipress-covap-bf16"]
               + [f"hipress-{s}-{a}" for s in ("ring", "ps")
                  for a in ("none", "onebit", "tbq", "terngrad", "dgc", "graddrop")]
               + ["hipress-powersgd", "hipress-acpsgd", "hipress-auto", "hipress-ps-tbq-plan", "hipress-bf16"]
               + ["hipress-dear"] + [f"hipress-dear-{a}" for a in ("onebit", "tbq", "terngrad", "dgc", "graddrop")])

PRESETS = {
    # One command for issue 9: 4 ranks at 1 and 10 Gbit/s, VGG19- and ResNet50-like (< 15 min here).
    "issue9": dict(model="vgg19,resnet50", bandwidth="1gbit,10gbit", np=4, latency="0.2ms",
                   systems="ddp,ddp-fp16,ddp-powersgd,horovod,hipress-ring-none,hipress-ring-onebit,"
                           "hipress-ps-onebit,hipress-ring-tbq,hipress-ring-terngrad,"
                           "hipress-ps-dgc,hipress-ps-graddrop,hipress-powersgd,hipress-auto",
                   warmup=2, steps=8, compute_steps=2, repeats=1, max_seconds=8),
    # Issue 7: the planner against compressing everything and nothing, on many small + a few huge gradients.
    "issue7": dict(model="mixed", bandwidth="1gbit", np=4, latency="0.2ms",
                   systems="hipress-ring-none,hipress-ring-tbq,hipress-ring-tbq-plan,"
                           "hipress-ps-none,hipress-ps-tbq,hipress-ps-tbq-plan",
                   warmup=2, steps=8, compute_steps=2, repeats=2, max_seconds=0),
    # Issue 17's bucket-size tuning: DeAR with bucket_bytes="tune" (20 trials of 3 measured steps
    # after 1 warm-up step) against a sweep of fixed sizes over the tuner's range, 1 MiB to the
    # model's 5.8 MiB (about 10 min here).
    "dear-bo": dict(model="resnet50", bandwidth="10gbit", np=4, latency="0.2ms",
                    systems="hipress-dear-tune,hipress-dear-b1,hipress-dear-b2,hipress-dear-b4,hipress-dear-b6",
                    warmup=2, steps=8, compute_steps=2, repeats=1, max_seconds=0,
                    tune_trials=20, tune_window=3, tune_warmup=1),
    # Everything, all four models, three bandwidths (long: about an hour here).
    "full": dict(model="vgg19,resnet50,bert,lstm", bandwidth="1gbit,10gbit,25gbit", np=4, latency="0.2ms",
                 systems=",".join(ALL_SYSTEMS), warmup=3, steps=10, compute_steps=3, repeats=3, max_seconds=0),
}

QUICK = dict(systems="ddp,hipress-ring-onebit", warmup=1, steps=2, compute_steps=1, repeats=1, max_seconds=0)


# ------------------------------------------------------------------ progress bar


class Progress:
    """Plain stderr progress bar: overall fraction of steps, current run and system, ETA."""

    def __init__(self, total_units: int, enabled: bool = True, stream=sys.stderr):
        self.total = max(1, total_units)
        self.base = 0              # units of finished launches
        self.current = 0           # units of the launch in progress
        self.label = ""
        self.sub = ""
        self.t0 = time.time()
        self.enabled = enabled and stream is not None
        self.stream = stream
        self._lock = threading.Lock()
        self._width = 0
        self._tty = bool(getattr(stream, "isatty", lambda: False)())
        self._last = None

    def draw(self):
        if not self.enabled:
            return
        with self._lock:
            done = min(self.total, self.base + self.current)
            frac = done / self.total
            el = time.time() - self.t0
            eta = el / frac - el if frac > 0.02 else float("nan")
            bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
            eta_s = "--:--" if eta != eta else f"{int(eta) // 60}:{int(eta) % 60:02d}"
            line = (f"\r[{bar}] {100 * frac:5.1f}% {int(el) // 60}:{int(el) % 60:02d} eta {eta_s}  "
                    f"{self.label} {self.sub}")[:160]
            if not self._tty:   # a log file: one line per change of run/system, not per redraw
                key = (self.label, self.sub.split(" ")[0])
                if key == self._last:
                    return
                self._last = key
                self.stream.write(line[1:] + "\n")
                self.stream.flush()
                return
            pad = max(0, self._width - len(line))
            self._width = len(line)
            self.stream.write(line + " " * pad)
            self.stream.flush()

    def note(self, text: str):
        """A line of its own above the bar."""
        if not self.enabled:
            print(text, file=sys.stderr)
            return
        with self._lock:
            self.stream.write("\r" + " " * self._width + "\r" + text + "\n")
            self._width = 0
            self.stream.flush()
        self.draw()

    def finish(self):
        if self.enabled and self._tty:
            self.base, self.current = self.total, 0
            self.sub = "done"
            self.draw()
            self.stream.write("\n")
            self.stream.flush()


def _watch(progress_path: str, prog: Progress, per_system: int, stop: threading.Event):
    """Follows the worker's progress file: '<i>/<n> <system> <done>/<steps>' lines."""
    while not stop.wait(0.5):
        try:
            with open(progress_path) as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        if not lines:
            continue
        parts = lines[-1].split()
        try:
            i = int(parts[0].split("/")[0]) - 1
            done = int(parts[2].split("/")[0]) if len(parts) > 2 and "/" in parts[2] else 0
        except (ValueError, IndexError):
            continue
        prog.current = i * per_system + done
        prog.sub = " ".join(parts[1:3])
        prog.draw()


# ------------------------------------------------------------------ running


def _groups(systems: Sequence[str]) -> List[List[str]]:
    """Every system in a launch of its own: fresh processes, so none inherits another's threads,
    process groups and heap. In one launch, a system ran up to 20% slower or faster by the
    systems before it (VGG19-like at 10 Gbit/s: uncompressed ring 270 ms per step second,
    324 ms third after dear; docs/benchmarks.md, "One launch per system")."""
    return [[s] for s in systems]


TUNE_FLAGS = ("tune_trials", "tune_window", "tune_warmup", "tune_min_bytes")  # passed on to hipress.bench.train


def _run_group(cluster, group: List[str], a, bw: str, model: str, repeat: int, prog: Progress,
               env: dict) -> List[dict]:
    """Runs the systems of group (re-launching after a failure); returns one record per system."""
    records, todo = [], list(group)
    per_system = a.warmup + a.steps + a.compute_steps
    while todo:
        with tempfile.TemporaryDirectory(prefix="hpbench-") as d:
            os.chmod(d, 0o777)
            cmd = [sys.executable, "-m", "hipress.bench.train", "--model", model, "--systems", ",".join(todo),
                   "--warmup", str(a.warmup), "--steps", str(a.steps), "--compute-steps", str(a.compute_steps),
                   "--out", d, "--seed", str(a.seed)]
            if a.batch:
                cmd += ["--batch", str(a.batch)]
            if a.max_seconds:
                cmd += ["--max-seconds", str(a.max_seconds)]
            for k in TUNE_FLAGS:
                if getattr(a, k) is not None:
                    cmd += ["--" + k.replace("_", "-"), str(getattr(a, k))]
            prog.label = f"{model} {bw} rep{repeat + 1}"
            stop = threading.Event()
            w = threading.Thread(target=_watch, args=(os.path.join(d, "progress"), prog, per_system, stop),
                                 daemon=True)
            w.start()
            t0 = time.time()
            try:
                code, outputs = cluster.run(cmd, timeout=a.timeout * len(todo), env=env, quiet=not a.verbose, cwd=REPO)
            finally:
                stop.set()
                w.join()
            wall = time.time() - t0
            got = []
            path = os.path.join(d, "results.jsonl")
            if os.path.exists(path):
                with open(path) as f:
                    got = [json.loads(line) for line in f if line.strip()]
        for r in got:
            r.update(bandwidth=bw, latency=a.latency, repeat=repeat, launch_wall_s=wall)
            if r.get("skipped"):
                prog.note(f"[compare] {model} {bw}: {r['system']} skipped: {r['skipped']}")
            records.append(r)
        done = {r["system"] for r in got}
        prog.base += per_system * len(done)
        prog.current = 0
        todo = [s for s in todo if s not in done]
        if code != 0 and todo:
            failed = todo.pop(0)
            tail = "\n".join("\n".join(o.splitlines()[-15:]) for o in outputs)[-3000:]
            err = "timeout" if code == 124 else f"exit code {code}"
            prog.note(f"[compare] {model} {bw}: {failed} failed ({err}); see the JSON for its output")
            records.append({"system": failed, "model": model, "bandwidth": bw, "latency": a.latency,
                            "repeat": repeat, "error": err, "output_tail": tail})
            prog.base += per_system
        elif code != 0:
            break
    return records


# ------------------------------------------------------------------ summarising


def _median(vals):
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def summarize(records: List[dict], bandwidths: Sequence[str], systems: Sequence[str]) -> List[dict]:
    rows = []
    for bw in bandwidths:
        for s in systems:
            rs = [r for r in records if r["bandwidth"] == bw and r["system"] == s]
            if not rs:
                continue
            ok = [r for r in rs if r.get("step_s")]
            row = {"bandwidth": bw, "system": s, "runs": len(ok)}
            if not ok:
                row["note"] = rs[0].get("skipped") or rs[0].get("error", "")
                rows.append(row)
                continue
            for k in ("throughput", "step_s", "compute_s", "compression_s", "exposed_comm_s", "comm_busy_s", "ff_s",
                      "cpu_s", "cpu_compute_s"):
                row[k] = _median([r.get(k) for r in ok])
            if s.startswith("hipress-dear") and row["comm_busy_s"] and row["ff_s"]:
                _eq6(row, ok[0]["np"])
            row["throughput_all"] = [r["throughput"] for r in ok]
            if len(ok) > 1:
                row["spread"] = (max(row["throughput_all"]) - min(row["throughput_all"])) / row["throughput"]
            exposed = row["exposed_comm_s"] or 0.0
            row["compression_stack_s"] = min(row["compression_s"] or 0.0, exposed)
            row["comm_stack_s"] = exposed - row["compression_stack_s"]
            if not all(r.get("loss_finite", True) for r in ok):
                row["note"] = "loss not finite"
            profiles = [r["covap"]["profile"] for r in ok if (r.get("covap") or {}).get("profile")]
            if profiles:
                row["note"] = "; ".join(f"interval {p['interval']} at CCR {p['ccr']:.2f}" for p in profiles)
                row["covap_intervals"] = [p["interval"] for p in profiles]
                row["covap_ccrs"] = [p["ccr"] for p in profiles]
            tuned = [r["bucket_tune"] for r in ok if r.get("bucket_tune")]
            if tuned:
                row["tuned_bytes"] = [t["chosen_bytes"] for t in tuned]
                row["tune_trials"] = [len(t["trials"]) for t in tuned]
                row["note"] = "; ".join(
                    f"tuned to {t['chosen_bytes'] / 2**20:.2f} MiB ({t['buckets']} buckets) after {len(t['trials'])} "
                    f"trials, {t['warmup_steps']} steps, {t['tuning_s']:.0f} s" + ("" if t["done"] else " (NOT settled)")
                    for t in tuned)
            plan = ok[0].get("plan")
            if plan and "gradients" in plan:
                via = f", {plan['strategy']}" if "strategy" in plan else ""
                row["note"] = f"plan: {plan['compressed_gradients']}/{plan['gradients']} gradients compressed " \
                              f"({plan['compressed_mb']:.1f} MB{via}), {plan.get('bf16_mb', 0):.1f} MB as bf16"
                if (plan.get("coordinator_trial") or {}).get("chosen"):
                    row["note"] += f", coordinator {plan['coordinator_trial']['chosen']}"
            rows.append(row)
        base = next((r for r in rows if r["bandwidth"] == bw and r["system"] == "ddp" and r.get("throughput")), None)
        for r in rows:
            if r["bandwidth"] != bw or not r.get("throughput"):
                continue
            if base:
                r["x_ddp"] = r["throughput"] / base["throughput"]
            compute = (base or {}).get("compute_s") or r["compute_s"]  # the model's, one figure per link
            if compute:
                r["x_compute"] = compute / r["step_s"]  # throughput / compute-only throughput
    return rows


def _eq6(row: dict, workers: int) -> None:
    """DeAR's speed-up bound (paper 001 eq. 6) next to the achieved speed-up over one worker
    (workers x compute time / step time). t_ff and t_bp come from the compute-only steps
    (t_bp includes the local update); t_rs + t_ag is the comm queue's busy time per step,
    split evenly: the ring's two phases send the same N-1 chunks per partition."""
    from hipress.torch.dear import speedup_bound

    t_ff = row["ff_s"]
    t_bp = max(row["compute_s"] - t_ff, 0.0)
    half = row["comm_busy_s"] / 2
    row["workers"] = workers
    row["eq6_bound"] = speedup_bound(workers, t_ff, t_bp, half, half)
    row["speedup"] = workers * row["compute_s"] / row["step_s"]
    row["of_bound"] = row["speedup"] / row["eq6_bound"]


def goals(model: str, rows: List[dict], bandwidths: Sequence[str]) -> List[dict]:
    """The issue's targets, computed (never asserted)."""
    from hipress.bench.cluster import parse_rate

    def tp(bw, s):
        r = next((r for r in rows if r["bandwidth"] == bw and r["system"] == s), None)
        return r.get("throughput") if r else None

    def best_hp(bw):
        hp = [r for r in rows if r["bandwidth"] == bw and r["system"].startswith("hipress") and r.get("throughput")]
        return max(hp, key=lambda r: r["throughput"]) if hp else None

    out = []
    by_rate = {bw: (parse_rate(bw) if bw != "none" else None) or float("inf") for bw in bandwidths}
    for bw in bandwidths:  # issue 17: a tuned bucket size against the best fixed one of a sweep
        for r in rows:
            if r["bandwidth"] != bw or not r["system"].endswith("-tune") or not r.get("throughput"):
                continue
            base = r["system"][:-len("-tune")]
            sweep = [x for x in rows if x["bandwidth"] == bw and x.get("throughput")
                     and x["system"].startswith(base + "-b") and x["system"][len(base) + 2:].replace(".", "").isdigit()]
            if sweep:
                best = max(sweep, key=lambda x: x["throughput"])
                ratio = r["throughput"] / best["throughput"]
                trials = max(r.get("tune_trials") or [0])
                out.append({"goal": f"{model} @ {bw}: {r['system']} >= 0.95x the best fixed buffer of "
                                    f"{len(sweep)} ({best['system']}) in <= 20 trials ({trials})",
                            "best": best["system"], "ratio": ratio, "met": ratio >= 0.95 and trials <= 20})
    if model == "vgg19":
        bw = next((b for b in bandwidths if by_rate[b] == 1e9), None)
        if bw and best_hp(bw):
            b = best_hp(bw)
            for ref, target in (("ddp", 1.5), ("ddp-powersgd", 1.2)):
                if tp(bw, ref):
                    ratio = b["throughput"] / tp(bw, ref)
                    out.append({"goal": f"vgg19 @ {bw}: best hipress >= {target}x {ref}",
                                "best": b["system"], "ratio": ratio, "met": ratio >= target})
    if model == "mixed":
        # planned vs the better of compress-everything and compress-nothing, per bandwidth and strategy
        for bw in bandwidths:
            for strategy in ("ring", "ps"):
                none, every, plan = (tp(bw, f"hipress-{strategy}-{s}") for s in ("none", "tbq", "tbq-plan"))
                if none and every and plan:
                    best = max(none, every)
                    out.append({"goal": f"mixed @ {bw}, {strategy}: planned >= 0.95x the better of "
                                        f"compress-all / compress-none (and faster than both)",
                                "best": f"hipress-{strategy}-tbq-plan", "ratio": plan / best,
                                "met": plan >= 0.95 * best, "faster_than_both": plan > best})
    def row_of(bw, s):
        return next((r for r in rows if r["bandwidth"] == bw and r["system"] == s and r.get("throughput")), None)

    def overlap_limits(bw) -> Dict[str, dict]:
        """The ceilings measured on bw (overlap-limit[-<fraction>] rows: the step's bytes overlapping
        the whole step, no framework), by system name."""
        return {r["system"]: r for r in rows
                if r["bandwidth"] == bw and r["system"].startswith("overlap-limit") and r.get("throughput")}

    for bw in bandwidths:  # issue 17: uncompressed DeAR against DDP, beside what eq. 6 allows it
        d, r = row_of(bw, "ddp"), row_of(bw, "hipress-dear")
        if d and r and r.get("eq6_bound") and d.get("compute_s"):
            # DDP's speed-up over one worker, measured as dear's (workers x compute / step): the
            # bound over it is the most x DDP any overlap of the two phases can reach here
            ceiling = r["eq6_bound"] / (r["workers"] * d["compute_s"] / d["step_s"])
            target = 1.10 if d["exposed_comm_s"] >= 0.05 * d["step_s"] else 0.97  # where DDP exposes communication
            ratio = r["throughput"] / d["throughput"]
            goal = {"best": "hipress-dear", "ratio": ratio, "met": ratio >= target, "eq6_x_ddp": ceiling}
            limit = overlap_limits(bw).get("overlap-limit")
            measured = ""
            if limit:  # the same bytes overlapping the whole step, with their CPU: measured, not modelled
                goal["overlap_limit_x_ddp"] = limit["throughput"] / d["throughput"]
                measured = f"; overlap-limit measures {goal['overlap_limit_x_ddp']:.2f}x"
            goal["goal"] = f"{model} @ {bw}: hipress-dear >= {target:.2f}x ddp (eq. 6 allows {ceiling:.2f}x{measured})"
            out.append(goal)
            out.append({"goal": f"{model} @ {bw}: hipress-dear within 10% of its eq. 6 bound", "best": "hipress-dear",
                        "ratio": r["of_bound"], "met": r["of_bound"] >= 0.90})
    for s in ("hipress-covap", "ddp-covap-hook"):  # COVAP's targets (issue 18)
        if model == "vgg19":
            bw = next((b for b in bandwidths if by_rate[b] == 1e9), None)
            r = row_of(bw, s) if bw else None
            if r and r.get("x_compute") is not None:
                limits = {n: x["x_compute"] for n, x in overlap_limits(bw).items() if x.get("x_compute") is not None}
                seen = "".join(f"; {n} reaches {v:.2f}" for n, v in sorted(limits.items()))
                out.append({"goal": f"vgg19 @ {bw}: {s} >= 0.90 of compute-only{seen}", "best": s,
                            "ratio": r["x_compute"], "met": r["x_compute"] >= 0.90, "overlap_limits": limits})
            if r and tp(bw, "ddp"):
                ratio = r["throughput"] / tp(bw, "ddp")
                out.append({"goal": f"vgg19 @ {bw}: {s} >= 1.5x ddp", "best": s, "ratio": ratio, "met": ratio >= 1.5})
        if model == "resnet50":
            bw = next((b for b in bandwidths if by_rate[b] == 1e10), None)
            r = row_of(bw, s) if bw else None
            if r and tp(bw, "ddp"):
                ratio = r["throughput"] / tp(bw, "ddp")
                out.append({"goal": f"resnet50 @ {bw}: {s} >= 0.97x ddp", "best": s, "ratio": ratio,
                            "met": ratio >= 0.97})
    if model == "resnet50":
        bw = next((b for b in bandwidths if by_rate[b] == 1e10), None)
        if bw and tp(bw, "ddp"):
            hp = [r for r in rows if r["bandwidth"] == bw and r["system"].startswith("hipress") and r.get("throughput")]
            if hp:
                worst = min(hp, key=lambda r: r["throughput"])
                best = max(hp, key=lambda r: r["throughput"])
                ratio = worst["throughput"] / tp(bw, "ddp")
                out.append({"goal": f"resnet50 @ {bw}: every hipress configuration >= 0.97x ddp",
                            "worst": worst["system"], "ratio": ratio, "met": ratio >= 0.97,
                            "best": best["system"], "best_ratio": best["throughput"] / tp(bw, "ddp")})
    return out


COLUMNS = ["bandwidth", "system", "throughput", "x_ddp", "x_compute", "step_ms", "compute_ms", "compression_ms",
           "exposed_comm_ms", "cpu_ms", "cpu_compute_ms", "speedup", "eq6_bound", "runs", "spread", "note"]


def table(rows: List[dict]) -> str:
    view = []
    for r in rows:
        v = dict(r)
        for k in ("step", "compute", "compression", "exposed_comm", "cpu", "cpu_compute"):
            x = r.get(k + "_s")
            v[k + "_ms"] = "" if x is None else round(1e3 * x, 1)
        if r.get("throughput") is not None:
            v["throughput"] = round(r["throughput"], 1)
        for k in ("x_ddp", "x_compute"):
            if r.get(k) is not None:
                v[k] = f"{r[k]:.2f}"
        for k in ("speedup", "eq6_bound"):  # hipress-dear rows (paper 001 eq. 6)
            v[k] = f"{r[k]:.2f}" if r.get(k) is not None else ""
        v["spread"] = f"{100 * r['spread']:.0f}%" if r.get("spread") is not None else ""
        view.append(v)
    return markdown_table(view, COLUMNS)


# ------------------------------------------------------------------ main


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), help="a named configuration (flags given override it)")
    p.add_argument("--model", help="comma list of vgg19,resnet50,bert,lstm,mixed (default vgg19)")
    p.add_argument("--bandwidth", help="comma list, tc units (default 1gbit,10gbit); 'none' = unshaped")
    p.add_argument("--latency", help="one-way host-to-host delay (default 0.2ms)")
    p.add_argument("--switch-buffer", default=None,
                   help="bytes a switch port queues before dropping (hipress.bench.cluster), e.g. 256k; default: deep")
    p.add_argument("--np", type=int)
    p.add_argument("--systems", help=f"comma list (default all): {','.join(ALL_SYSTEMS)}")
    p.add_argument("--warmup", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--compute-steps", type=int)
    p.add_argument("--repeats", type=int, help="runs of each configuration; the tables show medians")
    p.add_argument("--max-seconds", type=float,
                   help="cap each system's timed phase near this many seconds (at least 2 steps; 0 = no cap)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment of the ranks, e.g. HIPRESS_TRANSPORT_CHECK=0 (recorded in the JSON)")
    p.add_argument("--batch", type=int, default=0, help="per-rank batch (default: the model's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tune-trials", type=int, help="-tune systems: trials of the bucket-size search (default 20)")
    p.add_argument("--tune-window", type=int, help="-tune systems: measured steps per trial (default 10)")
    p.add_argument("--tune-warmup", type=int, help="-tune systems: unmeasured steps after each change (default 1)")
    p.add_argument("--tune-min-bytes", type=int, help="-tune systems: smallest size searched (default 1 MiB)")
    p.add_argument("--quick", action="store_true", help="ddp and hipress-ring-onebit, 2 timed steps (smoke test)")
    p.add_argument("--out-dir", default="results")
    p.add_argument("--timeout", type=float, default=300, help="seconds per system of a launch")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--verbose", action="store_true", help="show the ranks' output")
    a = p.parse_args(argv)
    defaults = dict(model="vgg19", bandwidth="1gbit,10gbit", latency="0.2ms", np=4, systems=",".join(ALL_SYSTEMS),
                    warmup=3, steps=10, compute_steps=3, repeats=1, max_seconds=0,
                    **{k: None for k in TUNE_FLAGS})
    if a.preset:
        defaults.update(PRESETS[a.preset])
    if a.quick:
        defaults.update(QUICK)
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    models_ = [m for m in a.model.split(",") if m]
    bandwidths = [b for b in a.bandwidth.split(",") if b]
    systems = [s for s in a.systems.split(",") if s]
    for s in systems:
        parse_system(s)
    from hipress.bench import models as _m
    for m in models_:
        _m.get(m)
    from hipress.bench.cluster import EmulatedCluster
    if a.switch_buffer is not None and "none" in bandwidths:
        raise SystemExit("--switch-buffer needs a bandwidth on every run: an unshaped link ('none') has no switch queue")

    horovod_ok = importlib.util.find_spec("horovod") is not None
    run_systems = [s for s in systems if s != "horovod" or horovod_ok]
    groups = _groups(run_systems)
    per_system = a.warmup + a.steps + a.compute_steps
    total = len(bandwidths) * len(models_) * a.repeats * len(run_systems) * per_system
    prog = Progress(total, enabled=not a.no_progress)
    os.makedirs(a.out_dir, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    for kv in a.env:
        k, _, v = kv.partition("=")
        env[k] = v
    records: List[dict] = []
    t_start = time.time()
    cluster_info = {}
    first = None if bandwidths[0] == "none" else bandwidths[0]
    partial = os.path.join(a.out_dir, "compare-partial.json")
    with EmulatedCluster(np=a.np, bandwidth=first, latency=a.latency, quiet=True, switch_buffer=a.switch_buffer) as c:
        cluster_info = {"emulated": c.emulated, "delay_method": c.delay_method,
                        "fallback_reason": c.fallback_reason}
        if not c.emulated:
            prog.note(f"[compare] WARNING: no emulated network ({c.fallback_reason}); ranks on unshaped loopback")
        for bw in bandwidths:
            c.set_link(bandwidth=None if bw == "none" else bw, latency=a.latency)
            # planner profiles are per link: keep them apart (the cache key has no bandwidth)
            env["HIPRESS_PROFILE_DIR"] = os.path.abspath(os.path.join(
                a.out_dir, "profiles", f"np{a.np}-{bw}-{a.latency}-{'emu' if c.emulated else 'loopback'}"
                + (f"-switch{a.switch_buffer}" if a.switch_buffer else "")))
            for model in models_:
                for rep in range(a.repeats):
                    for g in groups:
                        records += _run_group(c, g, a, bw, model, rep, prog, env)
                        with open(partial, "w") as f:   # raw records so far (survives a crash below)
                            json.dump({"config": vars(a), "records": records}, f)
    prog.finish()
    if "horovod" in systems and not horovod_ok:
        for bw in bandwidths:
            for model in models_:
                records.append({"system": "horovod", "model": model, "bandwidth": bw, "latency": a.latency,
                                "skipped": "horovod is not installed (horovod.torch does not import)"})
    wall = time.time() - t_start
    config = {k: v for k, v in vars(a).items()}
    config.update(models=models_, bandwidths=bandwidths, systems=systems, argv=sys.argv[1:] if argv is None else argv)
    out = {}
    for model in models_:
        recs = [r for r in records if r["model"] == model]
        rows = summarize(recs, bandwidths, systems)
        gl = goals(model, rows, bandwidths)
        md = [f"### {model}-like, {a.np} ranks, latency {a.latency}"
              f"{f', switch buffer {a.switch_buffer}' if a.switch_buffer else ''}"
              f"{'' if cluster_info.get('emulated') else ' (NOT emulated: unshaped loopback)'}", "",
              table(rows), ""]
        for g in gl:
            md.append(f"- goal {g['goal']}: {g['ratio']:.2f}x ({'met' if g['met'] else 'MISSED'}; "
                      + (f"best {g['best']}" if "worst" not in g else
                         f"worst {g['worst']}, best {g['best']} at {g['best_ratio']:.2f}x") + ")")
        md_text = "\n".join(md) + "\n"
        print(md_text)
        base = os.path.join(a.out_dir, f"compare-{model}")
        pngs = []
        if not a.no_plots:
            from hipress.bench import plots
            pngs = [x for x in (
                plots.throughput_vs_bandwidth(rows, base + "-throughput.png", f"{model}-like, {a.np} ranks"),
                plots.breakdown(rows, base + "-breakdown.png", f"{model}-like, {a.np} ranks,")) if x]
        doc = {"benchmark": "compare", "model": model, "config": config, "cluster": cluster_info,
               "machine": machine_info(), "wall_s": wall, "rows": rows, "goals": gl, "records": recs,
               "files": [base + ".md"] + pngs}
        with open(base + ".json", "w") as f:
            json.dump(doc, f, indent=1)
        with open(base + ".md", "w") as f:
            f.write(md_text)
        print(f"wrote {base}.json, {base}.md" + "".join(f", {x}" for x in pngs))
        out[model] = doc
    print(f"total wall time {wall:.0f} s", file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
