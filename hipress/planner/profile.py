"""Profiling T_enc, T_dec and T_send on a ladder of sizes, fitting curves, caching as JSON.

* :func:`measure_codec` times a compressor's ``encode``/``decode`` on fp32 tensors
  of each ladder size (median of ``repeats`` runs after ``warmup``). T_enc is keyed
  by the original bytes, T_dec by the *payload* (compressed) bytes, matching
  equation 2's T_dec(r m / K).
* :func:`measure_send` takes a callable ``send_once(nbytes) -> seconds`` (one
  point-to-point transfer between real peers, or a fake in tests) and records the
  median per size.
* :class:`Profile` holds the samples and the fitted curves, keyed by cluster shape
  (N, strategy), device and algorithm; :func:`save_profile` / :func:`load_profile`
  write and validate the JSON; :func:`load_or_profile` reuses a cached profile from
  ``$HIPRESS_PROFILE_DIR`` (default ``~/.cache/hipress/profiles``).
"""
from __future__ import annotations

import json
import math
import os
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from hipress import config
from hipress.planner.cost_model import (
    CATEGORIES, STRATEGIES, AffineCurve, CostModel, PiecewiseAffineCurve, curve_from_dict,
)

FORMAT = "hipress-planner-profile"
# 2: key.strategy is "ring" / "ps" for hipress's executed strategies and "paper_ring",
#    "paper_ps", "paper_ps_colocated" for the paper's rows (version 1 called them
#    "casync_ring" / "casync_ps" and "ring" / "ps" / "ps_colocated"). Older files are stale:
#    load_or_profile and profile_online re-profile over them.
# 3: the backend's allreduce is measured (curve "allreduce", where the transport has one); a
#    version-2 file would price it from the transfers until re-profiled, so it is stale.
VERSION = 3
# Versions a checkpoint's profile may have and still load (Profile.from_dict(accept_older=True)):
# version 2 lacks only the optional allreduce curve, so the plans it made can be made again. A cached
# file of version 2 stays stale, so that the allreduce gets measured.
READABLE_VERSIONS = (2, VERSION)
KB, MB = 1 << 10, 1 << 20
#: 4 KB, 16 KB, ..., 64 MB (x4 steps)
DEFAULT_LADDER: Tuple[int, ...] = tuple(4 * KB * 4 ** i for i in range(8))
#: transfers are measured up to this size: they are bandwidth-bound long before it, the
#: fitted curve extends its last slope beyond, and a bulk exchange of 64 MB per peer is the
#: longest step of profiling
SEND_LADDER_MAX = 16 * MB
FITS = ("piecewise", "affine")
CURVES = ("send", "enc", "dec", "enc_plain", "dec_plain", "send_one", "allreduce")

Samples = List[Tuple[float, float]]


class ProfileError(ValueError):
    """A profile file is missing, corrupt, or for another cluster shape/device/algorithm."""


class StaleProfileError(ProfileError):
    """A profile file written by another hipress (another profile VERSION): re-profile to replace it."""


# --------------------------------------------------------------------------- measuring
def repeats_for(nbytes: float, repeats: int) -> int:
    """Sizes below 1 MB cost milliseconds and scatter most: three times the repeats."""
    return 3 * repeats if nbytes < MB else repeats


def _median_time(fn: Callable[[], float], repeats: int, warmup: int) -> float:
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    return statistics.median(fn() for _ in range(repeats))


def measure_send(send_once: Callable[[int], float], sizes: Sequence[int] = DEFAULT_LADDER,
                 repeats: int = 5, warmup: int = 1) -> Samples:
    """[(nbytes, median seconds)] of ``send_once(nbytes)`` for each size (``repeats`` runs,
    three times as many below 1 MB, after ``warmup``). The sizes are interleaved, one run
    of each per round: a network slows down for seconds at a time (other traffic, a busy
    host), and a slow spell should blur the whole curve a little rather than lift one
    size's every run."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    runs: Dict[int, List[float]] = {int(s): [] for s in sizes}
    for rnd in range(warmup + max(repeats_for(s, repeats) for s in runs)):
        for s, got in runs.items():
            if rnd < warmup + repeats_for(s, repeats):
                t = float(send_once(s))
                if not (math.isfinite(t) and t >= 0):
                    raise ValueError(f"send_once({s}) returned {t!r}, expected seconds >= 0")
                if rnd >= warmup:
                    got.append(t)
    return [(float(s), statistics.median(got)) for s, got in runs.items()]


def measure_codec(compressor, sizes: Sequence[int] = DEFAULT_LADDER, repeats: int = 5, warmup: int = 1,
                  device: str = "cpu", seed: int = 0, before: Optional[Callable[[], None]] = None,
                  reduce: Optional[Callable[[float], float]] = None) -> Tuple[Samples, Samples]:
    """Time ``compressor.encode`` and ``compressor.decode`` on random fp32 gradients.

    Returns (enc, dec): enc = [(original bytes, median s)], dec = [(payload bytes,
    median s)] (``repeats`` runs, three times as many below 1 MB). sizes are bytes
    (rounded down to whole fp32 elements). Each timed call is bracketed by
    ``torch.cuda.synchronize`` on a CUDA device so asynchronous kernels are fully
    counted. ``before()`` runs before each timed call, untimed, and ``reduce(seconds)``
    turns each timing into the sample: a running job passes a barrier, so every rank runs
    the kernel at the same moment (sharing the host's cores and memory bandwidth as during
    a sync), and the maximum over ranks, because a sync waits for its slowest rank at
    every exchange.
    """
    before = before or (lambda: None)
    reduce = reduce or (lambda t: t)
    import torch

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    enc, dec = [], []
    for s in sizes:
        numel = max(1, int(s) // 4)
        grad = torch.randn(numel, generator=gen).to(dev)
        state = compressor.new_state(numel) if hasattr(compressor, "new_state") else None
        out = torch.empty_like(grad)
        box = {}

        def run_enc():
            before()
            sync()
            t0 = time.perf_counter()
            box["p"] = compressor.encode(grad, state)
            sync()
            return reduce(time.perf_counter() - t0)

        def run_dec():
            before()
            sync()
            t0 = time.perf_counter()
            compressor.decode(box["p"], out)
            sync()
            return reduce(time.perf_counter() - t0)

        enc.append((float(4 * numel), _median_time(run_enc, repeats_for(4 * numel, repeats), warmup)))
        payload_bytes = float(box["p"].numel() * box["p"].element_size())
        dec.append((payload_bytes, _median_time(run_dec, repeats_for(4 * numel, repeats), warmup)))
    return enc, dec


def fit_curve(samples: Samples, kind: str = "piecewise"):
    """Fit a curve of bytes -> seconds: 'piecewise' (through the medians) or 'affine'."""
    if kind not in FITS:
        raise ValueError(f"unknown fit {kind!r}; expected one of {FITS}")
    xs, ys = [s for s, _ in samples], [t for _, t in samples]
    if kind == "affine":
        return AffineCurve.fit(xs, ys)
    return PiecewiseAffineCurve.fit(xs, ys)


# ----------------------------------------------------------------------------- profile
@dataclass
class Profile:
    """Measured samples and fitted curves for one (N, strategy, device, algorithm)."""

    n: int
    strategy: str
    device: str
    algorithm: str
    category: str
    rate: float
    send: object
    enc: object
    dec: object
    samples: Dict[str, Samples] = field(default_factory=dict)
    created: str = ""
    meta: Dict[str, object] = field(default_factory=dict)
    # The uncompressed path's own copy / merge operators (CostModel.enc_plain/dec_plain)
    # and the engine's hand-off of one compute task (CostModel.task_s); None / 0 in
    # profiles measured without them.
    enc_plain: object = None
    dec_plain: object = None
    task_s: float = 0.0
    # CaSync-PS: T_send with a single aggregator (CostModel.send_one); None: as send.
    send_one: object = None
    # the backend's allreduce of fp32 bytes (CostModel.allreduce); None: not measured.
    allreduce: object = None

    @property
    def key(self) -> Dict[str, object]:
        return {"n": self.n, "strategy": self.strategy, "device": self.device, "algorithm": self.algorithm}

    def cost_model(self, strategy: Optional[str] = None, n: Optional[int] = None,
                   plain_allreduce: bool = False, plain16: bool = False,
                   plain_fusion_bytes: float = 0.0) -> CostModel:
        """The model of this profile's strategy (or another one, on the same curves);
        plain_allreduce: uncompressed gradients priced as the backend's allreduce; plain16: which
        also sums bf16; plain_fusion_bytes: the size uncompressed runs are fused to (CostModel)."""
        return CostModel(self.send, self.enc, self.dec, int(n or self.n), strategy or self.strategy,
                         self.category, self.rate, self.enc_plain, self.dec_plain, self.task_s, self.send_one,
                         plain_allreduce, plain16, plain_fusion_bytes, self.allreduce)

    def curves(self) -> Dict[str, object]:
        return {k: getattr(self, k) for k in CURVES if getattr(self, k) is not None}

    def to_dict(self) -> dict:
        return {
            "format": FORMAT, "version": VERSION, "key": self.key, "category": self.category, "rate": self.rate,
            "curves": {k: v.to_dict() for k, v in self.curves().items()},
            "samples": {k: [list(p) for p in v] for k, v in self.samples.items()},
            "task_s": self.task_s, "created": self.created, "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: dict, source: str = "<dict>", accept_older: bool = False) -> "Profile":
        """accept_older: also a profile of an older version in READABLE_VERSIONS (a checkpoint's)."""
        def bad(msg):
            return ProfileError(f"{source}: invalid hipress planner profile: {msg}")

        if not isinstance(d, dict):
            raise bad(f"top level is {type(d).__name__}, expected an object")
        if d.get("format") != FORMAT:
            raise bad(f"format is {d.get('format')!r}, expected {FORMAT!r}")
        if d.get("version") != VERSION and not (accept_older and d.get("version") in READABLE_VERSIONS):
            raise StaleProfileError(f"{source}: hipress planner profile version {d.get('version')!r}, this hipress "
                                    f"reads version {VERSION} (re-profile to replace it)")
        for k in ("key", "category", "rate", "curves"):
            if k not in d:
                raise bad(f"missing field {k!r}")
        key = d["key"]
        if not isinstance(key, dict) or set(key) != {"n", "strategy", "device", "algorithm"}:
            raise bad(f"key must have exactly n, strategy, device, algorithm; got {key!r}")
        if not isinstance(key["n"], int) or isinstance(key["n"], bool) or key["n"] < 1:
            raise bad(f"key.n must be an integer >= 1, got {key['n']!r}")
        if key["strategy"] not in STRATEGIES:
            raise bad(f"key.strategy {key['strategy']!r} not in {STRATEGIES}")
        for k in ("device", "algorithm"):
            if not isinstance(key[k], str) or not key[k]:
                raise bad(f"key.{k} must be a non-empty string, got {key[k]!r}")
        if d["category"] not in CATEGORIES:
            raise bad(f"category {d['category']!r} not in {CATEGORIES}")
        rate = d["rate"]
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (math.isfinite(rate) and rate > 0):
            raise bad(f"rate must be a number > 0, got {rate!r}")
        curves = d["curves"]
        if not isinstance(curves, dict) or not {"send", "enc", "dec"} <= set(curves) <= set(CURVES):
            raise bad(f"curves must have send, enc, dec (and optionally enc_plain, dec_plain, send_one, allreduce); "
                      f"got {curves!r}")
        try:
            built = {k: curve_from_dict(v) for k, v in curves.items()}
        except (ValueError, KeyError, TypeError) as e:
            raise bad(f"bad curve: {e}") from None
        task_s = d.get("task_s", 0.0)
        if isinstance(task_s, bool) or not isinstance(task_s, (int, float)) or not (
                math.isfinite(task_s) and task_s >= 0):
            raise bad(f"task_s must be a number >= 0, got {task_s!r}")
        samples = d.get("samples", {})
        try:
            samples = {str(k): [(float(a), float(b)) for a, b in v] for k, v in samples.items()}
        except (ValueError, TypeError, AttributeError) as e:
            raise bad(f"bad samples: {e}") from None
        return cls(key["n"], key["strategy"], key["device"], key["algorithm"], d["category"], float(rate),
                   built["send"], built["enc"], built["dec"], samples, str(d.get("created", "")),
                   dict(d.get("meta", {}) or {}), built.get("enc_plain"), built.get("dec_plain"), float(task_s),
                   built.get("send_one"), built.get("allreduce"))


def build_profile(*, n: int, strategy: str, device: str, algorithm: str, category: str, rate: float,
                  send_samples: Samples, enc_samples: Samples, dec_samples: Samples,
                  fit: str = "piecewise", meta: Optional[dict] = None,
                  plain_samples: Optional[Tuple[Samples, Samples]] = None, task_s: float = 0.0,
                  send_one_samples: Optional[Samples] = None,
                  allreduce_samples: Optional[Samples] = None) -> Profile:
    """Fit curves to already-measured samples and wrap them in a :class:`Profile`.
    plain_samples: (enc, dec) of the uncompressed path's operators, if measured;
    task_s: the measured hand-off of one compute task; send_one_samples: CaSync-PS's
    transfers with a single aggregator, if measured; allreduce_samples: the backend's
    allreduce, if measured."""
    samples = {"send": list(send_samples), "enc": list(enc_samples), "dec": list(dec_samples)}
    send_one = allreduce = None
    if send_one_samples is not None:
        samples["send_one"] = list(send_one_samples)
        send_one = fit_curve(send_one_samples, fit)
    if allreduce_samples is not None:
        samples["allreduce"] = list(allreduce_samples)
        allreduce = fit_curve(allreduce_samples, fit)
    plain = (None, None)
    if plain_samples is not None:
        samples.update(enc_plain=list(plain_samples[0]), dec_plain=list(plain_samples[1]))
        plain = tuple(fit_curve(x, fit) for x in plain_samples)
    return Profile(int(n), strategy, device, algorithm, category, float(rate),
                   fit_curve(send_samples, fit), fit_curve(enc_samples, fit), fit_curve(dec_samples, fit),
                   samples, time.strftime("%Y-%m-%dT%H:%M:%S"), {"fit": fit, **(meta or {})}, *plain, float(task_s),
                   send_one, allreduce)


def profile_compressor(compressor, send_once: Callable[[int], float], *, n: int, strategy: str,
                       device: str = "cpu", algorithm: Optional[str] = None,
                       sizes: Sequence[int] = DEFAULT_LADDER, repeats: int = 5, fit: str = "piecewise",
                       plain=None, before=None, reduce=None,
                       task_once: Optional[Callable[[], float]] = None,
                       send_one_once: Optional[Callable[[int], float]] = None,
                       allreduce_once: Optional[Callable[[int], float]] = None) -> Profile:
    """Measure the codec on ``device`` and ``send_once`` on the ladder (up to SEND_LADDER_MAX)
    and fit a profile.
    plain: the uncompressed path's codec (hipress's "none"), measured too when given;
    before, reduce: around each codec call (see :func:`measure_codec`); task_once() ->
    seconds of one empty compute task, measured too when given (median of 4 * repeats);
    send_one_once: CaSync-PS's transfers with a single aggregator, measured too when given;
    allreduce_once: the backend's allreduce of that many bytes, measured too when given."""
    enc, dec = measure_codec(compressor, sizes, repeats, device=device, before=before, reduce=reduce)
    plain_samples = (measure_codec(plain, sizes, repeats, device=device, before=before, reduce=reduce)
                     if plain is not None else None)
    task_s = _median_time(task_once, 4 * repeats, 2) if task_once is not None else 0.0
    send_sizes = [s for s in sizes if s <= SEND_LADDER_MAX] or list(sizes)[:1]
    send = measure_send(send_once, send_sizes, repeats)
    send_one = measure_send(send_one_once, send_sizes, repeats) if send_one_once is not None else None
    allreduce = measure_send(allreduce_once, send_sizes, repeats) if allreduce_once is not None else None
    measured_rate = statistics.median(d / e for (e, _), (d, _) in zip(enc, dec) if e > 0)
    rate = float(getattr(compressor, "rate", measured_rate) or measured_rate)
    return build_profile(n=n, strategy=strategy, device=device, algorithm=algorithm or compressor.name,
                         category=compressor.category, rate=rate, send_samples=send, enc_samples=enc,
                         dec_samples=dec, fit=fit, plain_samples=plain_samples, task_s=task_s,
                         send_one_samples=send_one, allreduce_samples=allreduce,
                         meta={"repeats": repeats, "measured_rate": measured_rate})


# ------------------------------------------------------------------------------ caching
def default_profile_dir() -> Path:
    return Path(config.get("HIPRESS_PROFILE_DIR") or Path.home() / ".cache" / "hipress" / "profiles")


def _safe(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(s)) or "_"


def profile_path(n: int, strategy: str, device: str, algorithm: str, cache_dir=None) -> Path:
    d = Path(cache_dir) if cache_dir is not None else default_profile_dir()
    return d / f"{_safe(algorithm)}__{_safe(device)}__n{int(n)}__{_safe(strategy)}.json"


def save_profile(profile: Profile, path=None, cache_dir=None) -> Path:
    """Write ``profile`` as JSON (atomically); default path from :func:`profile_path`."""
    p = Path(path) if path is not None else profile_path(profile.n, profile.strategy, profile.device,
                                                         profile.algorithm, cache_dir)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(profile.to_dict(), indent=1, sort_keys=True))
    os.replace(tmp, p)
    return p


def load_profile(path, *, n: Optional[int] = None, strategy: Optional[str] = None,
                 device: Optional[str] = None, algorithm: Optional[str] = None) -> Profile:
    """Read and validate a profile; every key given must match the file's key."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ProfileError(f"{p}: cannot read profile: {e}") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"{p}: corrupt profile (not valid JSON: {e}); delete it to re-profile") from None
    prof = Profile.from_dict(d, str(p))
    want = {"n": n, "strategy": strategy, "device": device, "algorithm": algorithm}
    diff = {k: (v, prof.key[k]) for k, v in want.items() if v is not None and prof.key[k] != v}
    if diff:
        what = ", ".join(f"{k}: wanted {a!r}, file has {b!r}" for k, (a, b) in diff.items())
        raise ProfileError(f"{p}: profile is for another configuration ({what})")
    return prof


def load_or_profile(compressor, send_once: Callable[[int], float], *, n: int, strategy: str,
                    device: str = "cpu", algorithm: Optional[str] = None, cache_dir=None,
                    refresh: bool = False, **kw) -> Profile:
    """Reuse the cached profile for this (N, strategy, device, algorithm), else measure and save it.

    A corrupt or mismatched cached file raises :class:`ProfileError` rather than being
    silently overwritten (pass ``refresh=True`` to re-measure); one of an older profile
    version (:class:`StaleProfileError`) is re-measured and replaced.
    """
    algorithm = algorithm or compressor.name
    p = profile_path(n, strategy, device, algorithm, cache_dir)
    if p.exists() and not refresh:
        try:
            return load_profile(p, n=n, strategy=strategy, device=device, algorithm=algorithm)
        except StaleProfileError:
            pass
    prof = profile_compressor(compressor, send_once, n=n, strategy=strategy, device=device,
                              algorithm=algorithm, **kw)
    save_profile(prof, p)
    return prof
