"""Per-rank throughput worker of the comparison benchmark (``hipress.bench.compare``).

    RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. \\
    python -m hipress.bench.train --model vgg19 --systems ddp,hipress-ring-onebit --out DIR

Runs each named system one after the other in the same processes (one gloo process
group; hipress wraps it), each on a freshly built model with the same seed:

  ddp                      torch DistributedDataParallel, no compression
  ddp-fp16                 DDP + ddp_comm_hooks.default_hooks.fp16_compress_hook
  ddp-powersgd             DDP + ddp_comm_hooks.powerSGD_hook (rank 4, error feedback, warm start,
                           compressing from the 2nd step)
  horovod                  horovod.torch DistributedOptimizer (only where it imports; else a skip record)
  hipress-<strategy>-<algo>[-plan]
                           hipress.DistributedOptimizer(compression=<algo>, strategy=<strategy>
                           [, plan="auto"]); strategy ring|ps|allgather|auto, algo none|onebit|tbq|terngrad|
                           dgc|graddrop|powersgd|acpsgd|auto (powersgd and acpsgd always run the
                           low-rank sync)
  hipress-auto             hipress.DistributedOptimizer(compression="auto") as a user writes it: TernGrad
                           where the planner says it pays, strategy "auto" (PS or allgather, the planner's
                           choice); hipress-ring-auto pins the ring (TernGrad there misses accuracy:
                           docs/convergence.md); hipress-powersgd and -acpsgd: their low-rank sync
  hipress-dear[-<algo>]    strategy="dear" (docs/dear.md): reduce-scatter in backward, all-gather
                           and update before the next forward; algo: a single-round one (default none)
  <hipress system>-tune    any hipress-<strategy>-<algo> or hipress-dear[-<algo>] system with bucket_bytes="tune"
                           (docs/dear.md: the fusion buffer size found online by Bayesian optimisation;
                           --tune-trials, --tune-window, --tune-warmup, --tune-min-bytes set its knobs)
  <hipress system>-b<MiB>  the same with a fixed bucket_bytes of that many MiB (e.g. hipress-dear-b4,
                           hipress-ring-none-b0.5): a sweep of these gives the best fixed buffer
  <hipress system>-p<MiB>  any hipress system without a plan, with partition_bytes=<MiB> MiB (-p0: None, one
                           partition per bucket: PS's layout before it spread large buckets over its ranks)
  <hipress system>-coord   any hipress system above with coordinator=True (the global coordinator;
                           uncompressed buckets go beside it, through the backend's allreduce);
                           -nocoord: coordinator=False (hipress-auto-nocoord: compression="auto" without
                           coordinator="auto"'s trial)
  hipress-covap            hipress.DistributedOptimizer(compression="covap") (docs/covap.md: interval
                           "auto", profiled by COVAP's distributed profiler, sharding on)
  hipress-covap-bf16       the same with wire="bf16" (its parameter averages as bf16 differences)
  hipress-covap[-bf16]-i<N>  either with a fixed interval of N steps (covap={"interval": N}: no profile;
                           docs/covap.md: the local mode trained as uncompressed at 8, and at 16 with bf16)
  ddp-covap-hook           DDP + hipress.ddp.register(model, "covap") (the same, as a DDP comm hook)
  hipress-bf16             hipress.DistributedOptimizer(compression="auto", plan={"max_compress_bytes": 0,
                           "bf16": True}): nothing compressed, every bucket through the backend's
                           allreduce in bf16 (hipress's counterpart of ddp-fp16)
  overlap-limit[-<f>]      not a training system: a ceiling. Local SGD with an allreduce of f x the
                           model's fp32 gradient bytes (default 1) overlapping each whole step
                           (_OverlapLimit): the most a schedule sending those bytes can reach here

COVAP's systems profile before they filter: their warm-up runs on until the filter is on
(at least ``--warmup`` steps), and the record holds the profile (CCR and the interval).
Likewise a ``-tune`` system's warm-up runs on until the tuner has settled, and its record holds
the trials (bytes, slowest rank's seconds per step), the size chosen and the tuning's steps and
seconds; the timed steps then run at the chosen size.

Per system: ``--warmup`` steps, then ``--steps`` timed steps (throughput = world samples /
slowest rank's time), then one untimed and ``--compute-steps`` timed steps of forward +
backward + local optimizer step with synchronization switched off, on all ranks at once (the
same CPU contention as the real steps): the compute time. Compression time = hipress engine
compute-queue busy seconds per timed step (``get_engine().counters()``); exposed
communication = step time - compute time. Rank 0 appends one JSON record per system to
``<out>/results.jsonl`` and progress lines to ``<out>/progress``.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import re
import sys
import time
import traceback

import torch
import torch.distributed as dist

from hipress import config
from hipress.bench import models

DDP_SYSTEMS = ("ddp", "ddp-fp16", "ddp-powersgd", "ddp-covap-hook")
ALGOS = ("none", "onebit", "tbq", "terngrad", "dgc", "graddrop", "powersgd", "acpsgd", "auto")
STRATEGIES = ("ring", "ps", "allgather", "auto")
# hipress-bf16's plan: every bucket through the backend's allreduce in bf16, hipress's counterpart of
# DDP's fp16 hook (and the branch of `compression="auto"` that compresses nothing)
FINAL_DENSITY = ("dgc", "graddrop")  # sparsifiers whose density warms up: timed without the warm-up
BF16_PLAN = {"max_compress_bytes": 0, "bf16": True}
DEAR_ALGOS = ("none", "onebit", "tbq", "terngrad", "dgc", "graddrop")  # single-round: the ring's phases carry them


def parse_system(name: str) -> dict:
    """'hipress-ps-onebit-plan' -> {'kind': 'hipress', 'strategy': 'ps', 'compression': 'onebit', 'plan': 'auto'};
    a hipress system's name may end in -tune (bucket_bytes="tune") or -b<MiB> (a fixed bucket_bytes):
    'hipress-dear-b4' -> {..., 'strategy': 'dear', 'compression': 'none', 'plan': None, 'bucket_bytes': 4194304};
    then -p<MiB> (partition_bytes; -p0: None, one partition per bucket), then -coord (coordinator=True)
    or -nocoord (coordinator=False): 'hipress-auto-coord' -> {..., 'coordinator': True}."""
    coordinated = re.fullmatch(r"(hipress-.+)-(no)?coord", name)
    if coordinated:
        return {**parse_system(coordinated[1]), "coordinator": not coordinated[2]}
    partitioned = re.fullmatch(r"(hipress-.+)-p(\d+(?:\.\d+)?)", name)
    if partitioned:
        cfg = parse_system(partitioned[1])
        if cfg["plan"] or cfg["compression"] == "covap":
            raise ValueError(f"system {name!r}: a plan and COVAP pick their partitions; -p<MiB> does not apply")
        size = int(float(partitioned[2]) * 2 ** 20)
        return {**cfg, "partition_bytes": size or None}
    bucket = re.fullmatch(r"(hipress-.+)-(tune|b(\d+(?:\.\d+)?))", name)
    if bucket and name != "hipress-covap":
        cfg = parse_system(bucket[1])
        if cfg["plan"] or cfg["compression"] == "covap":
            raise ValueError(f"system {name!r}: a plan and COVAP fix their buckets; -tune and -b<MiB> do not apply")
        size = "tune" if bucket[2] == "tune" else int(float(bucket[3]) * 2 ** 20)
        if size != "tune" and size < 4:
            raise ValueError(f"system {name!r}: bucket size {bucket[3]} MiB is below one fp32 element")
        return {**cfg, "bucket_bytes": size}
    if name in DDP_SYSTEMS:
        return {"kind": "ddp", "hook": {"ddp": None, "ddp-fp16": "fp16", "ddp-powersgd": "powersgd",
                                        "ddp-covap-hook": "covap"}[name]}
    if name == "horovod":
        return {"kind": "horovod"}
    limit = re.fullmatch(r"overlap-limit(?:-(\d*\.?\d+))?", name)
    if limit:
        fraction = float(limit[1] or 1.0)
        if not 0 < fraction <= 4:
            raise ValueError(f"system {name!r}: the fraction of the gradient's bytes must be in (0, 4]")
        return {"kind": "overlap-limit", "fraction": fraction}
    covap_system = re.fullmatch(r"hipress-covap(-bf16)?(?:-i(\d+))?", name)
    if covap_system:
        args = {**({"wire": "bf16"} if covap_system[1] else {}),
                **({"interval": int(covap_system[2])} if covap_system[2] else {})}
        if args.get("interval") == 0:
            raise ValueError(f"system {name!r}: COVAP's interval must be at least 1")
        return {"kind": "hipress", "strategy": "auto", "compression": "covap", "plan": None,
                **({"covap": args} if args else {})}
    if name == "hipress-bf16":  # compression="auto" with its plan pinned: nothing compressed, all as bf16
        return {"kind": "hipress", "strategy": "ring", "compression": "auto", "plan": dict(BF16_PLAN)}
    parts = name.split("-")
    if parts[0] == "hipress":
        plan = None
        if parts[-1] == "plan":
            plan, parts = "auto", parts[:-1]
        if len(parts) == 2 and parts[1] in ("powersgd", "acpsgd"):  # hipress-powersgd, -acpsgd: their own sync
            parts = ["hipress", "ring", parts[1]]
        if parts[1:] == ["auto"]:  # hipress-auto: compression="auto" as a user writes it (strategy "auto")
            parts = ["hipress", "auto", "auto"]
        if parts[1:] == ["dear"]:                                     # hipress-dear: uncompressed
            parts = ["hipress", "dear", "none"]
        if len(parts) == 3 and parts[1] == "dear" and parts[2] in DEAR_ALGOS and plan is None:
            return {"kind": "hipress", "strategy": "dear", "compression": parts[2], "plan": None}
        if len(parts) == 3 and parts[1] in STRATEGIES and parts[2] in ALGOS:
            return {"kind": "hipress", "strategy": parts[1], "compression": parts[2], "plan": plan}
    raise ValueError(f"unknown system {name!r}: ddp, ddp-fp16, ddp-powersgd, ddp-covap-hook, horovod, "
                     f"hipress-covap[-bf16][-i<N>], hipress-bf16, "
                     f"hipress-<{'|'.join(STRATEGIES)}>-<{'|'.join(ALGOS)}>[-plan], hipress-powersgd, "
                     f"hipress-acpsgd, hipress-auto, hipress-dear[-<{'|'.join(DEAR_ALGOS)}>], "
                     f"overlap-limit[-<fraction>]; a hipress system may end in -tune, -b<MiB>, then -coord or -nocoord")


COVAP_MAX_WARMUP = 30  # a bound on COVAP's warm-up (settling DDP's buckets, profiling)


def _tuning(opt) -> bool:
    """Whether a bucket_bytes="tune" optimizer is still searching (every rank says the same)."""
    tuner = getattr(opt, "bucket_tuner", None)
    return tuner is not None and not tuner.done


def _trials(opt) -> list:
    """The measured choices of a hipress optimizer: plan="auto"'s, then coordinator="auto"'s."""
    return [t for t in (getattr(opt, "plan_trial", None), getattr(opt, "coordinator_trial", None)) if t is not None]


def _trying(opt) -> bool:
    """Whether the optimizer still measures a choice (every rank says the same)."""
    return any(not t.done for t in _trials(opt))


def _plan_info(opt) -> dict:
    """The plan that runs: one entry per bucket (fused gradients share their bucket's decision),
    and the measured choice that put it there."""
    planned = [(b, opt._hp_plan.entry(b.name, b.numel)) for b in opt._hp_buckets]
    def measured(trial):
        return None if trial is None else {"chosen": trial.chosen,
                                           "ms_per_step": {c: 1e3 * v for c, v in trial.seconds.items()}}

    return {"strategy": opt._hp_strategy_name,  # what compressed buckets sync with (strategy "auto": chosen)
            "compressed_gradients": sum(len(b.params) for b, e in planned if e.compress),
            "gradients": sum(len(b.params) for b, _ in planned),
            "compressed_mb": sum(4 * b.numel for b, e in planned if e.compress) / 2**20,
            "bf16_mb": sum(4 * b.numel for b, e in planned if e.bf16) / 2**20,
            "buckets": [{"bytes": 4 * b.numel, "compress": e.compress, "bf16": e.bf16, "k": e.k} for b, e in planned],
            "trial": measured(opt.plan_trial), "coordinator_trial": measured(opt.coordinator_trial)}


def _covap_on(owner) -> bool:
    """Whether COVAP's filter runs (``owner``: the DistributedOptimizer or the DDP hook state)."""
    run = owner._hp_covap if hasattr(owner, "_hp_covap") else owner.covap.run
    return run is not None and run.filter is not None


def _progress(out: str, text: str) -> None:
    if out and int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(out, "progress"), "a") as f:
            f.write(text + "\n")


def _max_over_ranks(v: float) -> float:
    t = torch.tensor([v], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def _gather(v: float) -> list:
    t = torch.tensor([v], dtype=torch.float64)
    out = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [float(x[0]) for x in out]


def _horovod_rendezvous() -> None:
    """What horovodrun's gloo launcher does, inside this torchrun-style launch: rank 0 runs
    horovod's HTTP rendezvous server with a slot plan built from every rank's hostname,
    and every rank gets the HOROVOD_* environment that hvd.init() reads."""
    import socket

    rank, size = dist.get_rank(), dist.get_world_size()
    host = config.get("HIPRESS_HOSTNAME") or socket.gethostname()
    hosts: list = [None] * size
    dist.all_gather_object(hosts, host)
    order = list(dict.fromkeys(hosts))
    slots = []
    for r, h in enumerate(hosts):
        same = [q for q, hq in enumerate(hosts) if hq == h]
        slots.append(dict(hostname=h, rank=r, local_rank=same.index(r), cross_rank=order.index(h), size=size,
                          local_size=len(same), cross_size=len(order)))
    port = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        from horovod.runner.common.util.hosts import SlotInfo
        from horovod.runner.http.http_server import RendezvousServer

        global _HVD_SERVER
        _HVD_SERVER = RendezvousServer(False)
        port[0] = _HVD_SERVER.start()
        _HVD_SERVER.init([SlotInfo(**sl) for sl in slots])
    dist.broadcast(port, 0)
    me = slots[rank]
    os.environ.update(
        HOROVOD_GLOO_RENDEZVOUS_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        HOROVOD_GLOO_RENDEZVOUS_PORT=str(int(port[0])), HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo",
        HOROVOD_GLOO_IFACE=os.environ.get("GLOO_SOCKET_IFNAME", "lo"), HOROVOD_HOSTNAME=host,
        HOROVOD_RANK=str(rank), HOROVOD_SIZE=str(size), HOROVOD_LOCAL_RANK=str(me["local_rank"]),
        HOROVOD_LOCAL_SIZE=str(me["local_size"]), HOROVOD_CROSS_RANK=str(me["cross_rank"]),
        HOROVOD_CROSS_SIZE=str(me["cross_size"]))


_HVD_SERVER = None


class _Skip(Exception):
    """A system that cannot run here (recorded as skipped, not failed)."""


class _OverlapLimit:
    """The ``overlap-limit[-<fraction>]`` system: not a way to train, a ceiling to measure others
    against. Each step's forward starts (a pre-hook) an allreduce of ``fraction`` x the model's fp32
    gradient bytes on the default (gloo) group, and step() waits for it before a local SGD step. The
    communication thus overlaps the whole step, with no dependency on the gradients and no
    framework work of any kind: a schedule that sends those bytes through the backend cannot do
    better. Where ranks share cores (4 on this 2-core machine), the bytes' CPU (gloo's, and the
    kernel's for TCP and the emulated links) comes out of the model's computation all the same,
    which the compute-only figure never pays. So ``overlap-limit`` is the most DDP or uncompressed
    dear could reach on a link, and ``overlap-limit-0.25`` the most COVAP at interval 4 could. The
    buffer's values are not used."""

    def __init__(self, opt: torch.optim.Optimizer, model: torch.nn.Module, fraction: float):
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.opt, self.buffer = opt, torch.zeros(max(1, int(numel * fraction)))
        self.work, self.skip, self.started = None, False, 0
        model.register_forward_pre_hook(self._start)

    def _start(self, *_):
        if not self.skip and self.work is None:
            self.work = dist.all_reduce(self.buffer, async_op=True)
            self.started += 1

    def zero_grad(self):
        self.opt.zero_grad()

    def step(self):
        if self.work is not None:
            self.work.wait()
            self.work = None
        self.opt.step()

    @contextlib.contextmanager
    def no_sync(self):
        self.skip = True
        try:
            yield
        finally:
            self.skip = False


def _setup(system: str, cfg: dict, model: torch.nn.Module, lr: float):
    """Returns (net to call, optimizer, no_sync context factory, base step fn, info)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    info: dict = {}
    if cfg["kind"] == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        # PowerSGD under gloo: the hook issues its P/Q allreduces from future callbacks, so
        # with several buckets their order can differ between ranks (a gloo size mismatch,
        # seen here); one bucket keeps one order. The other DDP systems keep the defaults.
        net = DDP(model, bucket_cap_mb=4096) if cfg["hook"] == "powersgd" else DDP(model)
        if cfg["hook"] == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            net.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif cfg["hook"] == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
            state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                                     use_error_feedback=True, warm_start=True, random_seed=0)
            net.register_comm_hook(state, ps.powerSGD_hook)
            info["powersgd"] = {"matrix_approximation_rank": 4, "start_powerSGD_iter": 2, "bucket_cap_mb": 4096}
        elif cfg["hook"] == "covap":
            import hipress.ddp
            info["covap_state"] = hipress.ddp.register(net, "covap")
        return net, opt, net.no_sync, opt.step, info
    if cfg["kind"] == "horovod":
        import horovod.torch as hvd  # noqa: F401 - ImportError is handled by the caller

        _horovod_rendezvous()
        hvd.init()
        if hvd.size() != dist.get_world_size():
            raise _Skip(f"horovod.torch imports, but hvd.init() outside horovodrun sees size {hvd.size()} "
                        f"instead of {dist.get_world_size()} (no gloo rendezvous server in this launch)")
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        # horovod's hooks allreduce during backward even inside skip_synchronize(), so the
        # compute phase runs on an unhooked copy of the model with a plain optimizer.
        import copy
        plain = copy.deepcopy(model)
        plain_opt = torch.optim.SGD(plain.parameters(), lr=lr, momentum=0.9)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        info["horovod"] = {"version": getattr(__import__("horovod"), "__version__", "?"), "size": hvd.size(),
                           "controller": "gloo"}
        return model, opt, None, (plain, plain_opt), info
    if cfg["kind"] == "overlap-limit":
        limit = _OverlapLimit(opt, model, cfg["fraction"])
        info["overlap_limit"] = {"fraction": cfg["fraction"], "bytes": limit.buffer.numel() * 4}
        return model, limit, limit.no_sync, opt.step, info
    import hipress
    import hipress.ddp

    # hipress's own gloo group of the same ranks, not the default group: a DDP system with
    # hipress's hook (ddp-covap-hook) may run in the same processes, and its hook refuses a
    # world that shares DDP's group
    hipress.ddp.init()
    kw = {}
    if cfg["plan"]:
        kw["plan"] = cfg["plan"]
    # strategy "dear" updates in the model's forward pre-hooks, so it takes the model itself
    kw.update({"model": model} if cfg["strategy"] == "dear" else {"named_parameters": model.named_parameters()})
    if "coordinator" in cfg:
        kw["coordinator"] = cfg["coordinator"]
    kw.update(cfg.get("covap", {}))
    if "partition_bytes" in cfg:
        kw["partition_bytes"] = cfg["partition_bytes"]
    if "bucket_bytes" in cfg:
        kw["bucket_bytes"] = cfg["bucket_bytes"]
        if cfg["bucket_bytes"] == "tune":
            kw["bucket_tune"] = cfg["bucket_tune"]
    if cfg["compression"] in FINAL_DENSITY:
        # timed at the final density: their warm-up (dense first, 2040 steps by default) is an
        # accuracy feature of a training's first steps, and a few timed steps would see only it
        kw["warmup_steps"] = 0
        info["warmup_steps"] = 0
    opt = hipress.DistributedOptimizer(opt, compression=cfg["compression"], strategy=cfg["strategy"], **kw)
    base = type(opt).__mro__[1]
    info["hipress"] = {"strategy": "dear" if cfg["strategy"] == "dear" else opt._hp_strategy_name, "compressor": opt._hp_compressor.name,
                       "hierarchical": opt._hp_hierarchical}
    if cfg["compression"] == "covap":
        info["covap_state"] = opt
    @contextlib.contextmanager
    def no_sync():
        with opt.skip_synchronize():
            yield

    return model, opt, no_sync, lambda: base.step(opt), info


def run_system(system: str, spec: models.Spec, a, out: str, index: int, total: int) -> dict:
    cfg = parse_system(system)
    rank, size = dist.get_rank(), dist.get_world_size()
    rec = {"system": system, "model": spec.name, "np": size, "batch_per_rank": a.batch, "config": cfg,
           "loadavg_start": os.getloadavg()[0],
           "warmup": a.warmup, "steps": a.steps, "compute_steps": a.compute_steps, "lr": a.lr}
    if cfg["kind"] == "horovod":
        try:
            import horovod.torch  # noqa: F401
        except Exception as e:  # noqa: BLE001
            rec.update(skipped=f"horovod.torch does not import here: {type(e).__name__}: {e}")
            return rec
    if cfg.get("bucket_bytes") == "tune":
        cfg["bucket_tune"] = {"trials": a.tune_trials, "window": a.tune_window, "warmup": a.tune_warmup,
                              "min_bytes": a.tune_min_bytes}
    torch.manual_seed(a.seed)
    model = spec.build()
    rec["profile"] = models.profile(model)
    try:
        net, opt, no_sync, base_step, info = _setup(system, cfg, model, a.lr)
    except _Skip as e:
        rec.update(skipped=str(e))
        return rec
    covap_owner = info.pop("covap_state", None)  # the optimizer or hook state holding COVAP's profile
    rec.update(info)
    g = torch.Generator().manual_seed(a.seed + 1000 * rank)
    x, y = spec.batch(a.batch, g)

    def step():
        opt.zero_grad()
        loss = spec.loss(net(x), y)
        loss.backward()
        opt.step()
        return loss

    tag = f"{index + 1}/{total} {system}"
    nsteps = a.warmup + a.steps + a.compute_steps
    done = 0
    tw = 0.0
    warm = 0
    # COVAP profiles, then filters: its warm-up lasts until the filter is on (every rank
    # decides it from the same gathered profile, so all run the same number of steps)
    tune_max = (a.tune_trials * (a.tune_window + a.tune_warmup) + 2 * a.warmup + 2
                if cfg.get("bucket_bytes") == "tune" else 0)  # a bound, for skipped steps
    # plan="auto" measures its candidate plans first, then coordinator="auto" its modes
    # (hipress/torch/plan_trial.py): twice what they take, a bound for skipped steps
    trial_max = sum(2 * len(t.candidates) * (t.steps + t.WARMUP + 1) for t in _trials(opt)) + a.warmup
    tune_t0 = time.perf_counter()
    while warm < a.warmup or (covap_owner is not None and not _covap_on(covap_owner) and warm < COVAP_MAX_WARMUP) \
            or (_tuning(opt) and warm < tune_max) or (_trying(opt) and warm < trial_max):
        t = time.perf_counter()
        step()
        tw = time.perf_counter() - t
        warm += 1
        done += 1
        _progress(out, f"{tag} {done}/{nsteps}")
    if _trying(opt):
        print(f"hipress.bench.train: WARNING {system}: a measured choice is still measuring after {warm} warm-up "
              f"steps; the timed steps include its windows", file=sys.stderr, flush=True)
    if cfg.get("bucket_bytes") == "tune":
        tuner = opt.bucket_tuner
        rec["bucket_tune"] = {"knobs": cfg["bucket_tune"], "range": [tuner.lo, tuner.hi], "done": tuner.done,
                              "chosen_bytes": tuner.size, "trials": [list(t) for t in tuner.history],
                              "warmup_steps": warm, "tuning_s": time.perf_counter() - tune_t0,
                              "buckets": len(opt._hp_buckets)}
    elif cfg["kind"] == "hipress":
        rec["buckets"] = len(opt._hp_buckets)
    if cfg["kind"] == "hipress" and opt._hp_plan is not None:
        rec["plan"] = dict(_plan_info(opt), warmup_steps=warm)
    if covap_owner is not None:
        prof = covap_owner.covap_profile
        rec["covap"] = {"warmup_steps": warm, "filter_on": _covap_on(covap_owner),
                        "profile": None if prof is None else dataclasses.asdict(prof)}
    steps = a.steps
    if a.max_seconds > 0 and a.warmup:
        # Bound the timed phase on a slow or loaded machine: every rank uses the slowest
        # rank's last warm-up step, so all run the same number of steps.
        steps = int(min(a.steps, max(a.min_steps, a.max_seconds // max(_max_over_ranks(tw), 1e-6))))
        done += a.steps - steps
    rec["steps"] = steps
    engine = None
    if cfg["kind"] == "hipress":
        from hipress.engine import get_engine
        engine = get_engine()
    dist.barrier()
    c0 = engine.counters() if engine else None
    t0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        loss = step()
        done += 1
        _progress(out, f"{tag} {done}/{nsteps}")
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    c1 = engine.counters() if engine else None
    loss = float(loss.detach())
    if cfg["kind"] == "hipress" and cfg["strategy"] == "dear":
        opt.synchronize()  # the last step's all-gathers and updates, not inside the first compute step
    # compute only: forward + backward + local optimizer step, no synchronization
    dist.barrier()
    ctimes = []
    if no_sync is None:    # compute on an unhooked copy (horovod)
        net, opt = base_step
        no_sync, base_step = contextlib.nullcontext, opt.step
    fftimes = []

    def compute_step():
        t = time.perf_counter()
        opt.zero_grad()
        with no_sync():
            loss_c = spec.loss(net(x), y)
            ff = time.perf_counter() - t
            loss_c.backward()
        base_step()
        return ff, time.perf_counter() - t

    if a.compute_steps:
        # one untimed: the first local step after synchronized ones allocates what those did not
        # use (momentum correction steps the SGD without momentum, so its first step here makes the
        # momentum buffers), and with 2 timed steps the median is the slower one
        compute_step()
    cpu0 = time.process_time()
    for _ in range(a.compute_steps):
        ff, total = compute_step()
        fftimes.append(ff)
        ctimes.append(total)
        done += 1
        _progress(out, f"{tag} {done}/{nsteps}")
    cpu_compute = (time.process_time() - cpu0) / max(a.compute_steps, 1)
    opt.zero_grad()
    if cfg["kind"] == "overlap-limit":
        rec["overlap_limit"]["allreduces"] = opt.started  # one per warm-up and timed step, none in compute
    dist.barrier()
    ctimes.sort()
    compute_local = ctimes[len(ctimes) // 2] if ctimes else float("nan")
    fftimes.sort()
    ff_local = fftimes[len(fftimes) // 2] if fftimes else float("nan")
    elapsed_all = _gather(elapsed)
    compute_all = _gather(compute_local)
    ff_all = _gather(ff_local)
    # CPU seconds of the whole process (every thread) per step: on a machine with fewer cores
    # than ranks the framework's own work (hooks, copies, engine threads, extra collectives)
    # costs throughput one for one, and this figure shows it with far less noise than wall time
    cpu_all, cpu_compute_all = _gather(cpu / steps), _gather(cpu_compute)
    step_s = max(elapsed_all) / steps
    compute_s = sum(compute_all) / len(compute_all)
    rec.update(
        step_s=step_s,
        step_s_per_rank=[e / steps for e in elapsed_all],
        throughput=size * a.batch * steps / max(elapsed_all),
        compute_s=compute_s,
        compute_s_per_rank=compute_all,
        ff_s=sum(ff_all) / len(ff_all),  # forward + loss of the compute steps; the rest of compute_s is
        # backward + local update (eq. 6's t_bp in docs/dear.md)
        exposed_comm_s=max(0.0, step_s - compute_s),
        cpu_s=sum(cpu_all) / len(cpu_all),
        cpu_compute_s=sum(cpu_compute_all) / len(cpu_compute_all),
        final_loss=loss,
        loadavg_end=os.getloadavg()[0],
        loss_finite=math.isfinite(loss),
    )
    if c0 is not None:
        comp = _gather((c1["compute"]["busy_s"] - c0["compute"]["busy_s"]) / steps)
        comm = _gather((c1["comm"]["busy_s"] - c0["comm"]["busy_s"]) / steps)
        rec.update(compression_s=sum(comp) / len(comp), compression_s_per_rank=comp,
                   comm_busy_s=sum(comm) / len(comm),
                   comm_tasks_per_step=(c1["comm"]["tasks_run"] - c0["comm"]["tasks_run"]) / steps,
                   compute_tasks_per_step=(c1["compute"]["tasks_run"] - c0["compute"]["tasks_run"]) / steps,
                   engine_tasks_per_step=(c1["compute"]["tasks_run"] + c1["comm"]["tasks_run"]
                                          - c0["compute"]["tasks_run"] - c0["comm"]["tasks_run"]) / steps)
    else:
        rec.update(compression_s=None, comm_busy_s=None)
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vgg19", choices=models.NAMES)
    p.add_argument("--systems", default="ddp,hipress-ring-onebit")
    p.add_argument("--batch", type=int, default=0, help="per-rank batch (default: the model's)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--compute-steps", type=int, default=3)
    p.add_argument("--max-seconds", type=float, default=0,
                   help="cap the timed phase near this many seconds (from the last warm-up step; 0 = no cap)")
    p.add_argument("--min-steps", type=int, default=2, help="timed steps at least, with --max-seconds")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--tune-trials", type=int, default=20, help="-tune systems: trials of the bucket-size search")
    p.add_argument("--tune-window", type=int, default=10, help="-tune systems: measured steps per trial")
    p.add_argument("--tune-warmup", type=int, default=1, help="-tune systems: unmeasured steps after each change")
    p.add_argument("--tune-min-bytes", type=int, default=1 << 20, help="-tune systems: smallest size searched")
    p.add_argument("--out", default="", help="folder for results.jsonl and progress (rank 0)")
    a = p.parse_args(argv)
    spec = models.get(a.model)
    a.batch = a.batch or spec.batch_size
    systems = [s for s in a.systems.split(",") if s]
    for s in systems:
        parse_system(s)
    torch.set_num_threads(a.threads)
    os.environ.setdefault("HIPRESS_TRANSPORT", "torch")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if a.out and rank == 0:
        os.makedirs(a.out, exist_ok=True)
    for i, s in enumerate(systems):
        _progress(a.out, f"{i + 1}/{len(systems)} {s} start")
        try:
            rec = run_system(s, spec, a, a.out, i, len(systems))
        except Exception:
            # Every rank normally fails the same way; exit so the driver records it and goes on.
            traceback.print_exc()
            _progress(a.out, f"{i + 1}/{len(systems)} {s} failed")
            sys.stdout.flush()
            os._exit(3)
        if rank == 0:
            line = json.dumps(rec)
            if a.out:
                with open(os.path.join(a.out, "results.jsonl"), "a") as f:
                    f.write(line + "\n")
            print("RESULT " + line, flush=True)
        # Free the previous system (DDP reducers, hooks) at the same point on every rank.
        gc.collect()
        dist.barrier()
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
