"""CompLL kernel benchmark: encode / decode throughput of every algorithm.

    python -m hipress.bench.kernels [--sizes 1,16,256] [--quick] [--threads 1,all]
                                    [--out results/kernels.json] [--reference-max-mb 16]
    python -m hipress.bench.kernels --generated [--sizes 1,16] [--threads 1]
    python -m hipress.bench.kernels --sizes 16,64 --threads 1 --runs 3 --check
    python -m hipress.bench.kernels --sizes 16,64 --threads 1 --runs 3 --check --only floored [--cpu-time]

--check fails (exit status 1) when a kernel's encode throughput, as a fraction of the memcpy
bandwidth measured in the same run (one thread, median over --runs), is below its floor in
FLOORS; the JSON's "check" field holds the floors, the measured ratios and the failures either way.

--generated compares the kernels generated from the DSL specs in
hipress/dsl/specs/ (hipress.compll) with the hand-written ones, same input,
same thread count; "gen/hand" is the generated kernel's time over the
hand-written one's (1.00 = as fast; goal <= 1.25).

Throughput is GB/s of fp32 gradient (input bytes / time, best of a few runs).
The same run measures the machine's single-thread memcpy bandwidth (numpy
copyto of the same buffer) and the pure numpy reference
(hipress/compression/reference.py), so the ratios are from one machine state.
Writes JSON to --out and a markdown table to stdout.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from typing import Callable, Dict, List

import numpy as np
import torch

from hipress import compression as C
from hipress.compression import reference as ref

MB = 1 << 20

# Regression floors: encode GB/s at one thread as a fraction of the same run's memcpy GB/s, at every
# size measured (issue 21: onebit, TernGrad and PowerSGD encode >= 25% of copy bandwidth on one core;
# TBQ since its sums were vectorised, docs/compll_kernels.md).
FLOORS = {"onebit": 0.25, "terngrad-2bit": 0.25, "powersgd-r4": 0.25, "tbq": 0.25}


# Wall clock by default. --cpu-time switches to the calling thread's CPU time: on a machine shared with
# other jobs, a kernel longer than a scheduler time slice is rarely timed undisturbed by wall clock (the
# best of a few runs of a 0.7 ms memcpy is, of a 5 ms PowerSGD encode is not), which biases its ratio
# to copy; CPU time leaves the waits out. Only valid when the kernels run on the calling thread alone.
_clock = time.perf_counter


def best_time(fn: Callable[[], object], repeat: int, min_time: float = 0.2) -> float:
    return best_times([fn], repeat, min_time)[0]


def best_times(fns: List[Callable[[], object]], repeat: int, min_time: float = 0.2) -> List[float]:
    """Best time of each function, the functions run in turn (one run of each per round):
    a shared VM's speed drifts over tens of milliseconds, and alternating runs expose the
    functions compared to the same drift. At least ``repeat`` rounds, and up to 50 until
    ``min_time`` has been spent on each function."""
    for fn in fns:
        fn()  # warm-up (page faults, lazy pools)
    best = [math.inf] * len(fns)
    total = [0.0] * len(fns)
    runs = 0
    while runs < repeat or (min(total) < min_time and runs < 50):
        for i, fn in enumerate(fns):
            t0 = _clock()
            fn()
            dt = _clock() - t0
            best[i] = min(best[i], dt)
            total[i] += dt
        runs += 1
    return best


def configs():
    """(label, compressor factory, reference encode(x) -> bytes, reference decode(payload, n))."""
    return [
        ("onebit", lambda: C.OneBit(), ref.onebit_encode, ref.onebit_decode),
        # with its error feedback, as training runs it (compensate, encode, residual -= decode: one fused
        # kernel, ops::feedback_scaled_signs); rows of the matrix view's width
        ("onebit+ef", lambda: C.get("onebit", error_feedback=True),
         lambda x: ref.error_feedback_step(ref.onebit_encode, ref.onebit_decode, x, np.zeros_like(x))[0],
         ref.onebit_decode),
        ("tbq", lambda: C.TBQ(0.01), lambda x: ref.tbq_encode(x, 0.01), ref.tbq_decode),
        ("terngrad-2bit", lambda: C.TernGrad(2), lambda x: ref.terngrad_encode(x, 2), ref.terngrad_decode),
        ("terngrad-8bit", lambda: C.TernGrad(8), lambda x: ref.terngrad_encode(x, 8), ref.terngrad_decode),
        # warmup_steps=0: the steady-state density the label names (DGC's and GradDrop's default
        # warm-ups start at 25%)
        ("dgc-0.1%", lambda: C.DGC(ratio=0.001, warmup_steps=0), None, ref.sparse_decode),
        ("dgc-1%", lambda: C.DGC(ratio=0.01, warmup_steps=0), None, ref.sparse_decode),
        ("graddrop-1%", lambda: C.GradDrop(ratio=0.01, warmup_steps=0), lambda x: ref.graddrop_encode(x, 0.01),
         ref.sparse_decode),
        ("graddrop-0.1%", lambda: C.GradDrop(ratio=0.001, warmup_steps=0), lambda x: ref.graddrop_encode(x, 0.001),
         ref.sparse_decode),
        ("powersgd-r4", lambda: C.PowerSGD(rank=4), None, None),
        # GRACE's quantizers (docs/grace.md); u8bit, efsignsgd and natural without their error feedback
        ("u8bit", lambda: C.U8bit(), ref.u8bit_encode, ref.u8bit_decode),
        ("signsgd", lambda: C.SignSGD(), ref.signsgd_encode, ref.sign_decode),
        ("signum", lambda: C.Signum(), None, ref.sign_decode),
        ("efsignsgd", lambda: C.EFSignSGD(), ref.efsignsgd_encode, ref.sign_decode),
        ("qsgd-64", lambda: C.QSGD(64), ref.qsgd_encode, ref.qsgd_decode),
        ("natural", lambda: C.Natural(), ref.natural_encode, ref.natural_decode),
        ("terngrad_grace", lambda: C.TernGradGrace(), ref.terngrad_grace_encode, ref.terngrad_grace_decode),
        ("fp16", lambda: C.FP16(), lambda x: ref.half_encode(x, "fp16"), ref.half_decode),
        ("bf16", lambda: C.BF16(), lambda x: ref.half_encode(x, "bf16"), ref.half_decode),
        # GRACE's sparsifiers and hybrids at GRACE's defaults (docs/grace.md)
        ("randomk-1%", lambda: C.RandomK(0.01), ref.randomk_encode, ref.sparse_decode),
        ("topk-1%", lambda: C.TopK(0.01), ref.topk_encode, ref.sparse_decode),
        ("threshold-0.01", lambda: C.Threshold(0.01), ref.threshold_encode, ref.sparse_decode),  # 32% of N(0, 0.01)
        ("threshold-1%", lambda: C.Threshold(0.02576), lambda x: ref.threshold_encode(x, 0.02576), ref.sparse_decode),
        ("adaq-1%", lambda: C.Adaq(0.01), ref.adaq_encode, ref.adaq_decode),
        ("dgc_grace-1%", lambda: C.DGCGrace(0.01), ref.dgc_grace_encode_stateless, ref.sparse_decode),
        ("sketch-64", lambda: C.Sketch(64), ref.sketch_encode, ref.sketch_decode),
        ("inceptionn", lambda: C.Inceptionn(), ref.inceptionn_encode, ref.inceptionn_decode),
        ("powersgd_grace-r1", lambda: C.PowerSGDGrace(rank=1), None, None),
    ]


# ---- pure-torch implementations of GRACE's sparsifiers and hybrids (same use as the quantizers' below)
# The same methods written with torch tensor ops only (as a framework-level implementation such as
# GRACE's would be), timed on one intra-op thread. Encode returns the tensors sent, decode rebuilds.

def _torch_sparse_dec(t, n):
    idx, val = t
    return torch.zeros(n).index_put_((idx,), val)


def _torch_k(n, ratio):
    return max(1, int(n * ratio))


def _torch_randomk(x, ratio=0.01):
    idx = torch.randperm(x.numel())[:_torch_k(x.numel(), ratio)]
    return idx, x[idx]


def _torch_topk(x, ratio=0.01):
    _, idx = torch.topk(x.abs(), _torch_k(x.numel(), ratio), sorted=False)
    return idx, x[idx]


def _torch_threshold(x, v=0.01):
    idx = torch.nonzero(x.abs() >= v).view(-1)
    return idx, x[idx]


def _torch_sample_thr(a, keep, s):
    sm = a[torch.randint(0, a.numel(), (s,))]
    return torch.topk(sm, max(1, min(s, math.ceil(keep * s)))).values.min()


def _torch_adaq(x, ratio=0.01):
    n = x.numel()
    thr0 = _torch_sample_thr(x.abs(), ratio, max(1, n // 100))
    out = []
    for part in (x.clamp(min=0), (-x).clamp(min=0)):
        k = math.ceil(float((part > 0).sum()) * ratio)
        thr, sel = thr0, int((part > thr0).sum())
        for _ in range(20):
            if not (sel > 1.25 * k or sel < 0.8 * k):
                break
            thr = thr * (1.25 if sel > 1.25 * k else 0.9)
            sel = int((part >= thr).sum())
        if sel < 1:
            thr = thr * 0.8
        idx = torch.nonzero(part > thr).view(-1)
        out += [idx, x[idx].mean() if idx.numel() else torch.tensor(0.0)]
    return out


def _torch_adaq_dec(t, n):
    ip, mp, ineg, mn = t
    out = torch.zeros(n)
    out[ip] = mp
    out[ineg] = mn
    return out


def _torch_dgc_grace(x, ratio=0.01):
    n = x.numel()
    a = x.abs()
    s = max(1, n // 100)
    thr = _torch_sample_thr(a, max(1, int(n * ratio / 100)) / s, s)
    sel = int((a >= thr).sum())
    for _ in range(10):
        if not (sel > 1.3 * n * ratio or sel < 0.7 * n * ratio):
            break
        thr = thr * (1.3 if sel > 1.3 * n * ratio else 0.7)
        sel = int((a >= thr).sum())
    idx = torch.nonzero(a >= thr).view(-1)
    return idx, x[idx]


def _torch_sketch(x, q=64, sample=65536):
    n = x.numel()
    vals = x if n <= sample else x[torch.randint(0, n, (sample,))]
    srt = torch.sort(vals).values.double()
    pos = torch.arange(1, q, dtype=torch.float64) * (srt.numel() - 1) / q
    lo = pos.floor().long()
    hi = (lo + 1).clamp(max=srt.numel() - 1)
    edges = (srt[lo] + (srt[hi] - srt[lo]) * (pos - lo)).float()
    codes = torch.bucketize(x, edges, right=True)
    sums = torch.zeros(q, dtype=torch.float64).index_add_(0, codes, x.double())
    cnt = torch.bincount(codes, minlength=q).clamp(min=1)
    return codes.to(torch.uint8), (sums / cnt).float()



# ---- pure-torch implementations of GRACE's quantizers (GRACE's own form: torch ops, codes one per byte,
# not bit-packed), the baseline of the "x torch" column: (make_state(x), encode(x, state) -> codes,
# decode(codes, n) -> tensor). Timed at one torch thread beside the kernels at one thread.
_U8 = torch.from_numpy(ref.U8BIT_TABLE)


def _t_sign_dec(c, n):
    neg, s = c
    return (1.0 - 2.0 * neg.float()) * s


def _t_signum_enc(x, m):
    m.mul_(0.9).add_(x, alpha=0.1)
    return (m < 0).to(torch.uint8), 1.0


def _t_qsgd_enc(x, st, s=64):
    norm = x.norm()
    lv = x.abs() * (s / norm)
    f = lv.floor()
    q = f + (torch.rand_like(lv) < lv - f).float()
    return (q + 128.0 * (x < 0).float()).to(torch.uint8), norm / s


def _t_qsgd_dec(c, n):
    codes, unit = c
    v = (codes & 127).float() * unit
    return torch.where(codes >= 128, -v, v)


def _t_natural_enc(x, st):
    m, e = torch.frexp(x.abs())            # |x| = m 2^e, m in [0.5, 1)
    e = e - 1 + (torch.rand_like(x) < 2 * m - 1).to(e.dtype)
    code = (e.clamp(-109, 18) + 109).to(torch.int32)
    code = torch.where((x == 0) | (e < -109), torch.zeros_like(code), code)
    return (code + 128 * torch.signbit(x).to(torch.int32)).to(torch.uint8)


def _t_natural_dec(codes, n):
    k = (codes & 127).to(torch.int32)
    v = torch.where(k == 0, torch.zeros(n), torch.ldexp(torch.ones(n), (k - 109).float()))
    return torch.where(codes >= 128, -v, v)


def _t_terngrad_enc(x, st):  # GRACE's TernGradCompressor
    std = (x - x.mean()).pow(2).mean().sqrt()
    c = 2.5 * std.item()
    g = x.clamp(-c, c)
    a = g.abs()
    scalar = a.max()
    keep = torch.rand_like(x) * scalar < a
    return (torch.sign(g) * keep).to(torch.int8), scalar


def _t_terngrad_dec(c, n):
    codes, scalar = c
    return codes.float() * scalar


def _t_u8bit_enc(x, st):  # GRACE's U8bitCompressor (find_bins: bucketize)
    scale = x.abs().max()
    b = (torch.bucketize(x.abs() / scale, _U8, right=True) - 1).clamp(min=0)
    return (b * torch.sign(x)).to(torch.int8), scale


def _t_u8bit_dec(c, n):
    codes, scale = c
    k = codes.to(torch.int64)
    return _U8[k.abs()] * scale * torch.sign(k).float()


def _t_inceptionn_enc(x, st, eb=117):  # GRACE's INCEPTIONNCompressor (tags one per byte), hipress's anchoring
    mid = eb + (127 - eb + 1) // 2
    u = x.view(torch.int32)
    e = (u >> 23) & 0xFF
    sig = (u & 0x7FFFFF) | 0x800000
    tag = ((e >= eb).to(torch.uint8) + (e >= mid).to(torch.uint8) + (e >= 127).to(torch.uint8))
    m16, m8 = tag == 2, tag == 1
    v16 = (sig[m16] >> (135 - e[m16])) | ((u[m16] < 0).to(torch.int32) << 15)
    v8 = (sig[m8] >> (16 + mid - e[m8]).clamp(max=31)) | ((u[m8] < 0).to(torch.int32) << 7)
    return tag, x[tag == 3], v16.to(torch.int16), v8.to(torch.uint8), mid


def _t_inceptionn_dec(c, n):
    tag, v32, v16, v8, mid = c
    out = torch.zeros(n)
    out[tag == 3] = v32
    m16 = (v16.to(torch.int32) & 0x7FFF).float() * 2.0 ** -15
    out[tag == 2] = torch.where(v16 < 0, -m16, m16)
    m8 = (v8.to(torch.int32) & 0x7F).float() * 2.0 ** (mid - 134)
    out[tag == 1] = torch.where(v8 >= 128, -m8, m8)
    return out


TORCH = {
    "signsgd": (lambda x: None, lambda x, st: ((x < 0).to(torch.uint8), 1.0), _t_sign_dec),
    "signum": (torch.zeros_like, _t_signum_enc, _t_sign_dec),
    "efsignsgd": (lambda x: None, lambda x, st: ((x < 0).to(torch.uint8), x.abs().mean()), _t_sign_dec),
    "qsgd-64": (lambda x: None, _t_qsgd_enc, _t_qsgd_dec),
    "natural": (lambda x: None, _t_natural_enc, _t_natural_dec),
    "terngrad_grace": (lambda x: None, _t_terngrad_enc, _t_terngrad_dec),
    "u8bit": (lambda x: None, _t_u8bit_enc, _t_u8bit_dec),
    "fp16": (lambda x: None, lambda x, st: x.half(), lambda c, n: c.float()),
    "bf16": (lambda x: None, lambda x, st: x.bfloat16(), lambda c, n: c.float()),
    "randomk-1%": (lambda x: None, lambda x, st, f=_torch_randomk: f(x), _torch_sparse_dec),
    "topk-1%": (lambda x: None, lambda x, st, f=_torch_topk: f(x), _torch_sparse_dec),
    "threshold-0.01": (lambda x: None, lambda x, st, f=_torch_threshold: f(x), _torch_sparse_dec),
    "threshold-1%": (lambda x: None, lambda x, st, f=lambda x: _torch_threshold(x, 0.02576): f(x), _torch_sparse_dec),
    "adaq-1%": (lambda x: None, lambda x, st, f=_torch_adaq: f(x), _torch_adaq_dec),
    "dgc_grace-1%": (lambda x: None, lambda x, st, f=_torch_dgc_grace: f(x), _torch_sparse_dec),
    "sketch-64": (lambda x: None, lambda x, st, f=_torch_sketch: f(x), lambda t, n: t[1][t[0].long()]),
    "inceptionn": (lambda x: None, _t_inceptionn_enc, _t_inceptionn_dec),
}


def matrix_shape(n: int):
    rows = 1 << int(math.log2(max(1, n)) // 2)
    return (rows, n // rows)


def bench_size(nbytes: int, threads: List[int], ref_max: int, repeat: int, only=None) -> Dict:
    n = nbytes // 4
    x = torch.from_numpy(np.random.default_rng(0).standard_normal(n).astype(np.float32) * 0.01)
    xn = x.numpy()
    shape = matrix_shape(n)
    dst = np.empty_like(xn)
    def copy():
        np.copyto(dst, xn)
    copy_s = best_time(copy, repeat)
    res = {"bytes": nbytes, "numel": n, "memcpy_gbs": nbytes / copy_s / 1e9, "algorithms": {}}
    for label, make, ref_enc, ref_dec in configs():
        if only is not None and label not in only:
            continue
        c = make()
        row = {}
        for t in threads:
            C.set_num_threads(t)
            st = c.new_state(n, shape)
            buf = torch.empty(c.max_encoded_bytes(n, shape), dtype=torch.uint8)
            out = torch.empty(n)
            payload = c.encode(x.view(shape), st, out=buf).clone()
            # each kernel alternates with a memcpy (best_times): its ratio to copy compares the two at the
            # same moments of a shared machine's drifting speed
            copy_e, enc_s = best_times([copy, lambda: c.encode(x.view(shape), st, out=buf)], repeat)
            copy_d, dec_s = best_times([copy, lambda: c.decode(payload, out)], repeat)
            add_s = best_time(lambda: c.decode_add(payload, out), repeat)
            row[f"threads={t}"] = {"encode_gbs": nbytes / enc_s / 1e9, "decode_gbs": nbytes / dec_s / 1e9,
                                   "decode_add_gbs": nbytes / add_s / 1e9, "payload_bytes": int(payload.numel()),
                                   "enc_dec_gbs": nbytes / (enc_s + dec_s) / 1e9,
                                   "encode_ratio_to_copy": copy_e / enc_s, "decode_ratio_to_copy": copy_d / dec_s}
        C.set_num_threads(1)
        if label in TORCH:  # the same method in pure torch, one thread
            mk, tenc, tdec = TORCH[label]
            tst = mk(x)
            codes = tenc(x, tst)
            tthreads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                te = best_time(lambda: tenc(x, tst), repeat)
                td = best_time(lambda: tdec(codes, n), repeat)
            finally:
                torch.set_num_threads(tthreads)
            row["torch"] = {"encode_gbs": nbytes / te / 1e9, "decode_gbs": nbytes / td / 1e9,
                            "enc_dec_gbs": nbytes / (te + td) / 1e9}
        if nbytes <= ref_max:
            rref = {}
            if label.startswith("dgc"):
                ratio = 0.001 if label == "dgc-0.1%" else 0.01
                r = ref.DGCReference(n, ratio=ratio, warmup_steps=0)
                ref_enc = r.encode
            if label == "signum":
                ref_enc = ref.SignumReference(n).encode
            if label.startswith("powersgd"):
                grace = label.startswith("powersgd_grace")
                r = ref.PowerSGDReference(shape[0], shape[1], 1 if grace else 4, fresh_q=grace)
                e = best_time(lambda: r.round1(r.round0(xn)), 1, 0)
                d = best_time(lambda: r.P @ r.Q.T, 1, 0)
            else:
                pb = ref_enc(xn)
                e = best_time(lambda: ref_enc(xn), 1, 0)
                d = best_time(lambda: ref_dec(pb, n), 1, 0)
            rref = {"encode_gbs": nbytes / e / 1e9, "decode_gbs": nbytes / d / 1e9}
            row["reference"] = rref
        res["algorithms"][label] = row
    return res


def add_ratios(size: Dict) -> None:
    """encode/decode GB/s over the same run's memcpy GB/s, on every thread row of one size's results
    that bench_size did not already give a ratio measured beside its own memcpy runs."""
    cp = size["memcpy_gbs"]
    for row in size["algorithms"].values():
        for key, r in row.items():
            if key.startswith("threads="):
                r.setdefault("encode_ratio_to_copy", r["encode_gbs"] / cp)
                r.setdefault("decode_ratio_to_copy", r["decode_gbs"] / cp)


def median_of_runs(runs: List[Dict]) -> Dict:
    """One size's results from several runs: every figure the median over the runs (ratios to copy are
    medians of each run's own ratio, so a run's memcpy is only ever compared with that run's kernels)."""
    first = runs[0]
    med = lambda vals: float(np.median(vals))  # noqa: E731
    out = {"bytes": first["bytes"], "numel": first["numel"], "runs": len(runs),
           "memcpy_gbs": med([r["memcpy_gbs"] for r in runs]), "algorithms": {}}
    for label, row in first["algorithms"].items():
        merged = {}
        for key, fields in row.items():
            merged[key] = {f: (med([r["algorithms"][label][key][f] for r in runs])
                               if isinstance(v, float) else v) for f, v in fields.items()}
        out["algorithms"][label] = merged
    return out


def check_floors(results: Dict, floors: Dict[str, float] = FLOORS) -> Dict:
    """Compares each floored kernel's one-thread encode ratio to copy, at every size in results, with its
    floor. Returns {"floors", "measured": {label: {MB: ratio}}, "failures": [text], "passed"}; a floored
    kernel missing from the results (or measured without one thread) is a failure, not a pass."""
    measured: Dict[str, Dict[str, float]] = {label: {} for label in floors}
    failures = []
    if not results.get("sizes"):
        failures.append("no sizes measured")
    for size in results.get("sizes", []):
        mb = f"{size['bytes'] / MB:g}"
        for label, floor in floors.items():
            row = size["algorithms"].get(label, {}).get("threads=1")
            if row is None:
                failures.append(f"{label} at {mb} MB: not measured at threads=1")
                continue
            ratio = row["encode_ratio_to_copy"]
            measured[label][mb] = ratio
            if not ratio >= floor:
                failures.append(f"{label} encode at {mb} MB: {100 * ratio:.1f}% of copy, floor {100 * floor:.0f}%")
    return {"floors": dict(floors), "measured": measured, "failures": failures, "passed": not failures}


def markdown(results: Dict) -> str:
    lines = []
    for size in results["sizes"]:
        mb = size["bytes"] / MB
        cp = size["memcpy_gbs"]
        lines.append(f"\n### {mb:g} MB fp32 gradient ({size['numel']} elements), memcpy 1 thread: {cp:.2f} GB/s\n")
        tkeys = [k for k in next(iter(size["algorithms"].values())) if k.startswith("threads=")]
        hdr = "| algorithm | payload B |"
        for k in tkeys:
            hdr += f" enc {k} GB/s | dec {k} GB/s | dec+add {k} GB/s |"
        hdr += (" enc %copy (1t) | dec %copy (1t) | ref enc GB/s | ref dec GB/s | enc x ref | dec x ref |"
                " enc+dec GB/s (1t) | enc+dec %copy | torch enc+dec GB/s (1t) | x torch |")
        lines.append(hdr)
        lines.append("|" + "---|" * (hdr.count("|") - 1))
        for label, row in size["algorithms"].items():
            t1 = row[tkeys[0]]
            s = f"| {label} | {t1['payload_bytes']} |"
            for k in tkeys:
                s += f" {row[k]['encode_gbs']:.2f} | {row[k]['decode_gbs']:.2f} | {row[k]['decode_add_gbs']:.2f} |"
            s += f" {100 * t1['encode_ratio_to_copy']:.0f}% | {100 * t1['decode_ratio_to_copy']:.0f}% |"
            r = row.get("reference")
            if r:
                s += (f" {r['encode_gbs']:.3f} | {r['decode_gbs']:.3f} | {t1['encode_gbs'] / r['encode_gbs']:.0f}x |"
                      f" {t1['decode_gbs'] / r['decode_gbs']:.0f}x |")
            else:
                s += " - | - | - | - |"
            ed = t1["enc_dec_gbs"]
            s += f" {ed:.2f} | {100 * ed / cp:.0f}% |"
            tr = row.get("torch")
            s += f" {tr['enc_dec_gbs']:.3f} | {ed / tr['enc_dec_gbs']:.1f}x |" if tr else " - | - |"
            lines.append(s)
    return "\n".join(lines)


GENERATED = [("onebit", "onebit", {}), ("tbq", "tbq", {"threshold": 0.01}), ("terngrad-2bit", "terngrad", {"bitwidth": 2}),
             ("terngrad-8bit", "terngrad", {"bitwidth": 8}), ("dgc-0.1%", "dgc", {"ratio": 0.001, "warmup_steps": 0}),
             ("graddrop-1%", "graddrop", {"ratio": 0.01, "warmup_steps": 0}), ("powersgd-r4", "powersgd", {"rank": 4})]


def bench_generated(sizes_mb, threads: List[int], repeat: int) -> Dict:
    from hipress import compll
    rows = []
    for label, algo, params in GENERATED:
        compll.load(algo, name="dsl_" + algo)
        hand = C.get(algo, error_feedback=False, **params)
        gen = C.get("dsl_" + algo, error_feedback=False, **params)
        for mb in sizes_mb:
            n = int(mb * MB) // 4
            x = torch.from_numpy(np.random.default_rng(0).standard_normal(n).astype(np.float32) * 0.01)
            shape = matrix_shape(n) if hand.category == "lowrank" else None  # PowerSGD: a near-square matrix
            if shape is not None:
                x = x.view(shape)
            for t in threads:
                C.set_num_threads(t)
                row = {"algorithm": label, "mb": mb, "threads": t}
                enc, dec = [], []
                for c in (hand, gen):
                    st = c.new_state(n, shape)
                    buf = torch.empty(c.max_encoded_bytes(n, shape), dtype=torch.uint8)
                    out = torch.empty(n)
                    payload = c.encode(x, st, out=buf).clone()
                    enc.append(lambda c=c, st=st, buf=buf: c.encode(x, st, out=buf))
                    dec.append(lambda c=c, payload=payload, out=out: c.decode(payload, out))
                row["hand_enc_s"], row["gen_enc_s"] = best_times(enc, repeat)
                row["hand_dec_s"], row["gen_dec_s"] = best_times(dec, repeat)
                rows.append(row)
    C.set_num_threads(1)
    return {"rows": rows}


def markdown_generated(res: Dict) -> str:
    lines = ["| algorithm | MB | threads | enc hand ms | enc gen ms | enc gen/hand | dec hand ms | dec gen ms | "
             "dec gen/hand |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['algorithm']} | {r['mb']:g} | {r['threads']} | {1e3 * r['hand_enc_s']:.3f} | "
                     f"{1e3 * r['gen_enc_s']:.3f} | {r['gen_enc_s'] / r['hand_enc_s']:.2f} | "
                     f"{1e3 * r['hand_dec_s']:.3f} | {1e3 * r['gen_dec_s']:.3f} | "
                     f"{r['gen_dec_s'] / r['hand_dec_s']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,16,256", help="gradient sizes in MB (comma separated)")
    ap.add_argument("--quick", action="store_true", help="skip sizes above 16 MB")
    ap.add_argument("--threads", default="1,all", help="thread counts, 'all' = every core")
    ap.add_argument("--out", default="results/kernels.json")
    ap.add_argument("--reference-max-mb", type=float, default=16, help="run the numpy reference up to this size")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--runs", type=int, default=1,
                    help="measure every size this many times and report the medians (ratios to copy included)")
    ap.add_argument("--check", action="store_true",
                    help="exit with status 1 when a kernel's encode ratio to copy is below its floor (FLOORS)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time with the thread's CPU time instead of the wall clock (needs --threads 1)")
    ap.add_argument("--only", default="",
                    help="comma-separated kernel labels to measure ('floored' = those in FLOORS); default all")
    ap.add_argument("--generated", action="store_true",
                    help="compare the DSL-generated kernels (hipress/dsl/specs) with the hand-written ones")
    a = ap.parse_args(argv)
    if a.runs < 1:
        raise ValueError(f"--runs must be >= 1, got {a.runs}")
    sizes = [float(s) for s in a.sizes.split(",") if s]
    if a.quick:
        sizes = [s for s in sizes if s <= 16]
    ncpu = os.cpu_count() or 1
    threads = sorted({ncpu if t.strip() == "all" else int(t) for t in a.threads.split(",")})
    only = None
    if a.only:
        only = set(FLOORS) if a.only.strip() == "floored" else {x.strip() for x in a.only.split(",") if x.strip()}
        unknown = only - {c[0] for c in configs()}
        if unknown:
            raise ValueError(f"--only: unknown kernel label(s) {sorted(unknown)}")
    if a.cpu_time and threads != [1]:
        raise ValueError(f"--cpu-time measures the calling thread only: use --threads 1 (got {a.threads!r})")
    if a.check and a.generated:
        raise ValueError("--check applies to the kernel table, not to --generated")
    if a.check and 1 not in threads:
        raise ValueError(f"--check needs one-thread figures: include 1 in --threads (got {a.threads!r})")
    global _clock
    _clock = time.thread_time if a.cpu_time else time.perf_counter
    try:
        return run(a, sizes, threads, only, ncpu)
    finally:
        _clock = time.perf_counter


def run(a, sizes: List[float], threads: List[int], only, ncpu: int) -> Dict:
    results = {"machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": ncpu,
                           "torch": torch.__version__}, "threads": threads,
               "clock": "thread_cpu" if a.cpu_time else "wall", "sizes": []}
    if a.generated:
        results["generated"] = bench_generated(sizes, threads, a.repeat)
        if a.out:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            with open(a.out, "w") as f:
                json.dump(results, f, indent=1)
        print(markdown_generated(results["generated"]))
        return results
    for s in sizes:
        runs = []
        for _ in range(a.runs):
            size = bench_size(int(s * MB), threads, int(a.reference_max_mb * MB), a.repeat, only)
            add_ratios(size)
            runs.append(size)
        results["sizes"].append(median_of_runs(runs))
    C.set_num_threads(1)
    if 1 in threads:
        results["check"] = check_floors(results)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    print(markdown(results))
    if "check" in results:
        chk = results["check"]
        print("\ncheck: " + ("passed" if chk["passed"] else "FAILED: " + "; ".join(chk["failures"])))
    if a.check and not results["check"]["passed"]:
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    main()
