"""Framework overhead per step: hipress against DDP on the same model, A/B in one job (issue 21).

    python -m hipress.bench.overhead --model resnet50 --np 4 [--bandwidth 10gbit --latency 0.2ms]
        [--systems ddp,ddp-fp16,hipress-ring-none,hipress-auto] [--blocks 8 --steps 3]

Every rank builds every system at once (the system names of ``hipress.bench.compare``, set up by
``hipress.bench.train``: each on its own copy of the model, same seed) and then runs blocks of
``--steps`` training steps, system after system, the order reversed every block, so a drift of
the machine's load falls on all of them. Per block and system: the slowest rank's wall time per
step, the mean over ranks of the wall time in forward, backward and ``opt.step()`` (DDP waits for
its allreduces at the end of backward, hipress in ``opt.step()``; strategy "dear" waits in the
forward too; a system whose step leaves work in flight ends its block by waiting for it, counted
in opt.step: dear's ``synchronize()``, its last step's all-gathers and updates, and COVAP's local
mode's parameter averages, ``hipress.comm.world.quiesce()``; without that, the next system's block
would hide them), and every rank's CPU time per step, of the whole process (every thread)
and of the training thread alone, and the other threads' CPU by what they run (the engine's compute
and communication queues, the backend's threads, the rest: ``THREADS``). Where the first system is
DDP, a ``compute-only`` row runs its model under ``no_sync()`` (no communication at all): the limit
every system is measured against.
Where ranks outnumber cores (this 2-core machine runs 4), a framework's own work costs throughput
one for one, and CPU time shows it with far less noise than wall time.

After the timed blocks, a probe step per hipress system times its gradient hook (the Python work
per gradient per step on the training thread: ``_hp_on_grad``), so the table also gives the hook's
microseconds per gradient and milliseconds per step.

``--bandwidth none`` runs the ranks as plain local processes over loopback (compute and framework
only); a rate runs them in the emulated cluster (``hipress.bench.cluster``). Prints a markdown table
(medians over blocks); ``--json`` writes every block.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import threading
import time

from hipress.bench.common import describe_link, run_ranks

DEFAULT_SYSTEMS = "ddp,ddp-fp16,hipress-ring-none,hipress-auto"
COMPUTE_ONLY = "compute-only"  # the base DDP model under no_sync(): the limit with no communication
PHASES = ("forward_s", "backward_s", "opt_step_s")  # wall time per step in each, mean over ranks
# CPU time per step of the threads beside the training thread, mean over ranks, by what they run:
# the engine's two queues (threads named in csrc/engine/engine.cc), the backend's own threads
# (gloo's), and the rest (torch's, the coordinator's Python threads, ...). Linux (/proc) only.
THREADS = ("engine_compute_cpu_s", "engine_comm_cpu_s", "backend_cpu_s", "other_cpu_s")


def thread_cpu_ns(training_tid: int) -> list:
    """CPU nanoseconds so far of this process's threads, summed per entry of THREADS (the training
    thread, ``training_tid``, left out); zeros where /proc/self/task cannot be read. A thread that
    ends within a block takes its time with it, so a block's figures may miss a little."""
    out = [0] * len(THREADS)
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        if int(tid) == training_tid:
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])  # time on a CPU, ns
        except (OSError, ValueError, IndexError):  # ended since the listing
            continue
        i = {"hipress-compute": 0, "hipress-comm": 1}.get(name, 2 if "gloo" in name else 3)
        out[i] += ns
    return out


def _hook_probe(opt, step) -> dict:
    """CPU time of ``opt``'s gradient hook over one step (a hipress DistributedOptimizer): its
    hooks are registered again around a timer for the step, then as they were."""
    spent = [0, 0]

    def timed(p):
        t = time.thread_time_ns()
        try:
            opt._hp_on_grad(p)
        finally:
            spent[0] += time.thread_time_ns() - t
            spent[1] += 1

    def register(fn):
        for key in list(opt._hp_hooks):
            opt._hp_hooks[key].remove()
        opt._hp_hooks = {id(p): p.register_post_accumulate_grad_hook(fn) for _, p in opt._hp_named if p.requires_grad}

    register(timed)
    try:
        step()
    finally:
        register(opt._hp_on_grad)
    return {"hook_us_per_gradient": spent[0] / 1e3 / max(spent[1], 1), "hook_ms_per_step": spent[0] / 1e6,
            "gradients_per_step": spent[1]}


def _configs(systems: list) -> dict:
    """Each system's configuration (hipress.bench.train's names); SystemExit for one this bench cannot run."""
    from hipress.bench import train

    cfgs = {s: train.parse_system(s) for s in systems}
    for s, cfg in cfgs.items():
        if cfg["kind"] not in ("ddp", "hipress"):
            raise SystemExit(f"{s}: this bench runs DDP and hipress systems with a step() per step (not horovod)")
    return cfgs


def worker(model_name: str, systems: list, blocks: int, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from hipress.bench import models, train
    from hipress.comm import world

    cfgs = _configs(systems)
    torch.set_num_threads(1)
    os.environ.setdefault("HIPRESS_TRANSPORT", "torch")
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    spec = models.get(model_name)
    x, y = spec.batch(spec.batch_size, torch.Generator().manual_seed(1000 + rank))
    runs = {}
    phases = [0.0, 0.0, 0.0]  # this block's forward, backward and opt.step() wall seconds
    training_tid = threading.get_native_id()

    def timed_step(net, opt, sync=None):
        t0 = time.perf_counter()
        opt.zero_grad()
        with sync() if sync is not None else contextlib.nullcontext():
            loss = spec.loss(net(x), y)
            t1 = time.perf_counter()
            loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        for i, d in enumerate((t1 - t0, t2 - t1, t3 - t2)):
            phases[i] += d

    for s, cfg in cfgs.items():
        torch.manual_seed(0)
        net, opt, no_sync, _, _ = train._setup(s, cfg, spec.build(), 0.01)
        # drain: what a system's last step leaves in flight (dear's all-gathers and updates, COVAP's local
        # mode's averages), waited for at the end of its block as part of its steps' work
        drain = opt.synchronize if cfg.get("strategy") == "dear" else \
            world.quiesce if cfg.get("compression") == "covap" else None
        runs[s] = {"step": functools.partial(timed_step, net, opt), "opt": opt if cfg["kind"] == "hipress" else None,
                   "drain": drain, "covap": cfg.get("compression") == "covap"}
        if s == systems[0] and cfg["kind"] == "ddp":  # the same model, no communication at all
            runs[COMPUTE_ONLY] = {"step": functools.partial(timed_step, net, opt, no_sync), "opt": None}
    order = list(runs)

    def block(s, n):
        dist.barrier()
        phases[:] = [0.0, 0.0, 0.0]
        t, c, m = time.perf_counter(), time.process_time(), time.thread_time()
        th = thread_cpu_ns(training_tid)
        for _ in range(n):
            runs[s]["step"]()
        if runs[s].get("drain") is not None:
            t3 = time.perf_counter()
            runs[s]["drain"]()
            phases[2] += time.perf_counter() - t3
        threads = [(b - a) / 1e9 for a, b in zip(th, thread_cpu_ns(training_tid))]
        mine = torch.tensor([time.perf_counter() - t, time.process_time() - c, time.thread_time() - m] + phases
                            + threads, dtype=torch.float64) / n
        every = [torch.zeros(len(mine), dtype=torch.float64) for _ in range(size)]
        dist.all_gather(every, mine)
        return {"step_s": max(float(e[0]) for e in every), "cpu_s": sum(float(e[1]) for e in every) / size,
                "main_cpu_s": sum(float(e[2]) for e in every) / size,
                **{k: sum(float(e[3 + i]) for e in every) / size for i, k in enumerate(PHASES + THREADS)}}

    def warming(r, steps):
        """Whether a system still measures a choice: plan="auto"'s and coordinator="auto"'s trials, COVAP's
        profile (its filter on), as hipress.bench.train's warm-up waits for them."""
        opt = r["opt"]
        return opt is not None and (train._trying(opt) or (
            r.get("covap") and not train._covap_on(opt) and steps < train.COVAP_MAX_WARMUP))

    for s in order:  # warm-up: first steps allocate, plan, profile; plan="auto" and coordinator="auto" measure
        block(s, 2)
        warm = 2
        while warming(runs[s], warm):
            block(s, 1)
            warm += 1
    res = {s: [] for s in order}
    for b in range(blocks):
        for s in (order if b % 2 == 0 else order[::-1]):
            res[s].append(block(s, steps))
    probes = {}
    for s, r in runs.items():
        if r["opt"] is not None:
            probes[s] = _hook_probe(r["opt"], r["step"])
            if r.get("drain") is not None:  # the probe step's work in flight, before any other system runs
                r["drain"]()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"np": size, "model": model_name, "systems": order, "blocks": res, "hook": probes,
                       "plans": {s: train._plan_info(r["opt"]) for s, r in runs.items()
                                 if r["opt"] is not None and r["opt"]._hp_plan is not None},
                       "covap": {s: dataclasses.asdict(r["opt"].covap_profile) for s, r in runs.items()
                                 if r.get("covap") and r["opt"].covap_profile is not None}}, f)
    dist.barrier()
    dist.destroy_process_group()


def summarize(res: dict, systems: list) -> list:
    """One row per system: medians over blocks, and the ratios against the first system."""
    rows = []
    for s in res.get("systems", systems):
        row = {"system": s}
        for k in ("step_s", "cpu_s", "main_cpu_s") + PHASES + THREADS:
            row[k] = statistics.median(b[k] for b in res["blocks"][s])
        row.update(res["hook"].get(s, {}))
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["x_base"] = base["step_s"] / row["step_s"]
        row["cpu_over_base_ms"] = 1e3 * (row["cpu_s"] - base["cpu_s"])
    return rows


def table(rows: list, base: str) -> str:
    head = ["system", "step ms", f"x {base}", "forward / backward / opt.step ms", "cpu ms/step", f"cpu over {base} ms",
            "training-thread cpu ms", "engine compute / comm, backend, other threads cpu ms", "hook us/gradient",
            "hook ms/step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        hook = (f"{r['hook_us_per_gradient']:.1f}", f"{r['hook_ms_per_step']:.2f}") if "hook_ms_per_step" in r else ("", "")
        split = " / ".join(f"{1e3 * r[k]:.1f}" for k in PHASES) if PHASES[0] in r else ""
        compute, comm, backend, other = (f"{1e3 * r[k]:.1f}" for k in THREADS)
        threads = f"{compute} / {comm}, {backend}, {other}"
        lines.append(f"| {r['system']} | {1e3 * r['step_s']:.1f} | {r['x_base']:.3f} | {split} | {1e3 * r['cpu_s']:.1f} | "
                     f"{r['cpu_over_base_ms']:+.1f} | {1e3 * r['main_cpu_s']:.1f} | {threads} | {hook[0]} | {hook[1]} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--systems", default=DEFAULT_SYSTEMS, help="names of hipress.bench.compare; the first is the base")
    p.add_argument("--bandwidth", default="none", help="tc rate per host (emulated cluster); 'none' = local processes")
    p.add_argument("--latency", default="0.2ms")
    p.add_argument("--switch-buffer", default=None,
                   help="bytes a switch port queues before dropping (hipress.bench.cluster), e.g. 256k; default: deep")
    p.add_argument("--blocks", type=int, default=8, help="timed blocks of every system")
    p.add_argument("--steps", type=int, default=3, help="steps per block")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", help="write every block here")
    p.add_argument("--worker", nargs=5, metavar=("MODEL", "SYSTEMS", "BLOCKS", "STEPS", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a.worker[0], a.worker[1].split(","), int(a.worker[2]), int(a.worker[3]), a.worker[4])
        return {}
    from hipress.bench import models

    systems = [s for s in a.systems.split(",") if s]
    if a.model not in models.NAMES:
        raise SystemExit(f"--model must be one of {', '.join(models.NAMES)}, got {a.model!r}")
    _configs(systems)  # a bad name fails here, before any rank starts
    if a.blocks < 1 or a.steps < 1:
        raise SystemExit("--blocks and --steps must be >= 1")
    res, emulated = run_ranks("hipress.bench.overhead", [a.model, ",".join(systems), a.blocks, a.steps], a.np,
                              a.bandwidth, a.latency, a.timeout, a.switch_buffer)
    rows = summarize(res, systems)
    link = describe_link(a.bandwidth, a.latency, a.switch_buffer, emulated)
    print(f"### overhead: {a.model}, {a.np} ranks, {link}; medians of {a.blocks} blocks of {a.steps} steps "
          f"(load average {os.getloadavg()[0]:.1f})\n")
    print(table(rows, systems[0]))
    for s, plan in res.get("plans", {}).items():
        if "gradients" in plan:
            coord = plan.get("coordinator_trial")
            print(f"\n{s}: plan compresses {plan['compressed_gradients']}/{plan['gradients']} gradients, "
                  f"{plan.get('bf16_mb', 0):.1f} MB as bf16" + ("" if coord is None else
                  f"; coordinator {coord['chosen']}" + ("" if not coord["ms_per_step"] else  # else: unmeasured
                  f" ({', '.join(f'{m} {t:.1f}' for m, t in coord['ms_per_step'].items())} ms per step)")))
    for s, prof in res.get("covap", {}).items():
        print(f"\n{s}: COVAP interval {prof['interval']} (CCR {prof['ccr']:.2f})")
    doc = {"config": vars(a), "emulated": emulated, "rows": rows, "raw": res}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


if __name__ == "__main__":
    main()
