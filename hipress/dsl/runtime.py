"""Loads a generated CompLL library (ctypes, plain C ABI) as a hipress Compressor."""
from __future__ import annotations

import ctypes
import math
import threading
from typing import Optional

import torch

from hipress.compression.base import Compressor, CompressorState, check_payload, flat_f32, is_f32_flat, out_buffer
from hipress.dsl.checker import UINTS, Spec

ERRLEN = 1024
_c_double_p = ctypes.POINTER(ctypes.c_double)


class GeneratedLibrary:
    """A generated CPU library (hipress/dsl/codegen.py) loaded with ctypes."""

    #: extra trailing arguments of hpc_encode / hpc_decode (none on the CPU)
    EXTRA_ARGS: tuple = ()

    def __init__(self, path: str, spec: Spec):
        self.path = path
        self.spec = spec
        lib = ctypes.CDLL(path)
        self.lib = lib
        vp, u64, i32 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int
        lib.hpc_abi_version.restype = i32
        lib.hpc_num_params.restype = i32
        lib.hpc_set_num_threads.argtypes = [i32]
        lib.hpc_check_params.argtypes = [vp, ctypes.c_char_p, i32]
        lib.hpc_max_encoded_bytes.argtypes = [vp, u64, ctypes.POINTER(u64), ctypes.c_char_p, i32]
        lib.hpc_encode.argtypes = [vp, vp, u64, vp, u64, vp, vp, vp, i32, ctypes.POINTER(u64), ctypes.c_char_p, i32,
                                   *self.EXTRA_ARGS]
        lib.hpc_decode.argtypes = [vp, u64, vp, u64, ctypes.c_float, i32, ctypes.c_char_p, i32, *self.EXTRA_ARGS]
        lib.hpc_rate.argtypes = [vp, ctypes.POINTER(ctypes.c_double), ctypes.c_char_p, i32]
        for f in ("hpc_rate", "hpc_check_params", "hpc_max_encoded_bytes", "hpc_encode", "hpc_decode"):
            getattr(lib, f).restype = i32
        from hipress.dsl.codegen import ABI_VERSION
        if lib.hpc_abi_version() != ABI_VERSION or not self._right_target():
            raise RuntimeError(f"{path}: not a {type(self).__name__} of CompLL ABI version {ABI_VERSION} "
                               f"(it has version {lib.hpc_abi_version()})")
        self._threads = None

    def _right_target(self) -> bool:
        return True

    def sync_threads(self):
        from hipress import compression
        t = compression.num_threads()
        if t != self._threads:
            self.lib.hpc_set_num_threads(t)
            self._threads = t


class CudaLibrary(GeneratedLibrary):
    """A generated CUDA library (hipress/dsl/codegen_cuda.py): the CPU ABI with device pointers
    and a trailing cudaStream_t. Not exercised on a GPU in this repository's tests (compile-only)."""

    EXTRA_ARGS = (ctypes.c_void_p,)

    def _right_target(self) -> bool:
        self.lib.hpc_target.restype = ctypes.c_int
        return self.lib.hpc_target() == 1


_tls = threading.local()


def _write_back(out, target, flat: bool, add: bool, alpha: float):
    """out (+)= alpha * target, where target is the float32 scratch a decode wrote because out was not a flat
    float32 buffer (flat: the kernel wrote into out itself, alpha and add included)."""
    if not flat:
        if add:
            out.add_(target.view(out.shape).to(out.dtype), alpha=alpha)
        else:
            out.copy_(target.view(out.shape))
    return out


def _errbuf():
    b = getattr(_tls, "buf", None)
    if b is None:
        b = _tls.buf = ctypes.create_string_buffer(ERRLEN)
    return b


def _raise(code: int, buf) -> None:
    msg = buf.value.decode(errors="replace")
    if code == 1:
        from hipress.compression.native import PayloadError
        raise PayloadError(msg)
    if code == 2:
        raise ValueError(msg)
    raise RuntimeError(msg)


def param_values(spec: Spec, params: dict):
    """Validated parameters in ABI order (doubles)."""
    known = spec.param_names
    for k in params:
        if k not in known:
            raise ValueError(f"{spec.name}: unknown parameter '{k}' (known: {', '.join(known) or 'none'})")
    vals = []
    for f in spec.params:
        if f.name in params:
            v = params[f.name]
        elif f.default is not None:
            from hipress.dsl.checker import const_value
            v = const_value(f.default)
        else:
            raise ValueError(f"{spec.name}: parameter '{f.name}' is required (it has no default in the spec)")
        try:
            v = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"{spec.name}: parameter '{f.name}' must be a number, got {v!r}") from None
        base = f.type.base
        if base not in ("float", "double"):
            if not math.isfinite(v) or v != int(v):
                raise ValueError(f"{spec.name}: parameter '{f.name}' ({base}) must be an integer, got {v}")
            lo, hi = (0, (1 << UINTS[base]) - 1) if base in UINTS else (-(1 << 31), (1 << 31) - 1)
            if f.name == "seed" and spec.implicit_seed:
                lo, hi = 0, (1 << 53)
            if not lo <= v <= hi:
                raise ValueError(f"{spec.name}: parameter '{f.name}' = {int(v)} does not fit {base}")
        elif not math.isfinite(v):
            raise ValueError(f"{spec.name}: parameter '{f.name}' must be finite")
        vals.append(v)
    return vals


class GeneratedCompressor(Compressor):
    """A compressor whose kernels were generated from a CompLL DSL spec."""

    aggregatable = False
    rounds = 1

    def __init__(self, library: GeneratedLibrary, cuda_library: Optional[CudaLibrary] = None,
                 cuda_unavailable: str = "", **params):
        self._lib = library
        self._cuda = cuda_library
        self._cuda_why = cuda_unavailable
        spec = library.spec
        self.spec = spec
        self.name = spec.name
        self.category = spec.category
        vals = param_values(spec, params)
        self.params = dict(zip(spec.param_names, vals))
        self._p = (ctypes.c_double * max(1, len(vals)))(*vals)
        err = ctypes.create_string_buffer(ERRLEN)
        rc = library.lib.hpc_check_params(ctypes.cast(self._p, ctypes.c_void_p), err, ERRLEN)
        if rc:
            raise ValueError(f"{spec.name}: {err.value.decode(errors='replace')}")
        self._pv = ctypes.cast(self._p, ctypes.c_void_p)
        self._mb = {}
        rate = ctypes.c_double()
        rc = library.lib.hpc_rate(self._pv, ctypes.byref(rate), err, ERRLEN)
        if rc:
            _raise(rc, err)
        self.rate = rate.value

    @property
    def algo_id(self) -> int:
        return self.spec.algo_id

    def max_encoded_bytes(self, numel: int, shape=None) -> int:
        numel = int(numel)
        if numel in self._mb:
            return self._mb[numel]
        res = ctypes.c_uint64()
        err = ctypes.create_string_buffer(ERRLEN)
        rc = self._lib.lib.hpc_max_encoded_bytes(ctypes.cast(self._p, ctypes.c_void_p), int(numel),
                                                  ctypes.byref(res), err, ERRLEN)
        if rc:
            _raise(rc, err)
        if len(self._mb) > 4096:
            self._mb.clear()
        self._mb[numel] = int(res.value)
        return int(res.value)

    def new_state(self, numel: int, shape=None) -> CompressorState:
        """Zero state: the spec's 'state float*' arrays as named buffers (numel floats each), in declaration
        order, and its 'state int32' scalars in scalars[1..] (scalars[0] is the RNG counter)."""
        return CompressorState(self.name, numel, shape, {g.name: int(numel) for g in self.spec.state_arrays})

    def _state_ptrs(self, state: CompressorState):
        k = len(self.spec.state_arrays)
        if k == 0:
            return None, None, 0
        names = list(state.buffers)[:k]
        want = [g.name for g in self.spec.state_arrays]
        if names != want:
            raise ValueError(f"{self.name}: state buffers {names} differ from {want} (make it with new_state)")
        bufs = list(state.buffers.values())[:k]
        ptrs = (ctypes.c_void_p * k)(*[b.data_ptr() for b in bufs])
        lens = (ctypes.c_uint64 * k)(*[b.numel() for b in bufs])
        return ptrs, lens, k

    def _cuda_lib(self, what: str) -> CudaLibrary:
        if self._cuda is None:
            why = self._cuda_why or "torch.cuda was not available when the spec was loaded"
            raise ValueError(f"{self.name}: {what} is a CUDA tensor, but no CUDA library was built for this "
                             f"spec ({why}); use CPU tensors, or load the spec where CUDA is available")
        return self._cuda

    def _encode_cuda(self, grad, state, out):
        lib = self._cuda_lib("the gradient")
        g = grad.detach()
        if not g.is_floating_point():
            raise TypeError(f"gradients must be floating point, got {g.dtype}")
        g = g.to(torch.float32).contiguous().view(-1)
        n = g.numel()
        need = self.max_encoded_bytes(n)
        if out is None:
            buf = torch.empty(need, dtype=torch.uint8, device=g.device)
        else:
            if out.dtype != torch.uint8 or out.device != g.device or not out.is_contiguous():
                raise TypeError("out must be a contiguous uint8 tensor on the gradient's device")
            buf = out.view(-1)
            if buf.numel() < need:
                raise ValueError(f"out has {buf.numel()} bytes, needs max_encoded_bytes = {need}")
        ptrs, lens, k = None, None, 0
        if state is not None:
            for b in list(state.buffers.values())[:len(self.spec.state_arrays)]:
                if b.device != g.device:
                    raise ValueError(f"{self.name}: state buffers must be on {g.device} (new_state(...) then .to())")
            ptrs, lens, k = self._state_ptrs(state)
        nb = ctypes.c_uint64()
        err = _errbuf()
        stream = torch.cuda.current_stream(g.device).cuda_stream
        with torch.cuda.device(g.device):
            rc = lib.lib.hpc_encode(self._pv, g.data_ptr(), n, buf.data_ptr(), buf.numel(),
                                    state.scalars.data_ptr() if state is not None else None, ptrs, lens, k,
                                    ctypes.byref(nb), err, ERRLEN, stream)
        if rc:
            _raise(rc, err)
        return buf[:nb.value]

    def _decode_cuda(self, payload, out, alpha, add):
        lib = self._cuda_lib("the output" if out.is_cuda else "the payload")
        if not (payload.is_cuda and out.is_cuda and payload.device == out.device):
            raise ValueError(f"{self.name}: payload and output must be on the same CUDA device")
        if payload.dtype != torch.uint8:
            raise TypeError("a payload is a uint8 torch.Tensor")
        p = payload.contiguous().view(-1)
        flat = out.dtype == torch.float32 and out.is_contiguous()
        target = out.view(-1) if flat else torch.empty(out.numel(), dtype=torch.float32, device=out.device)
        err = _errbuf()
        stream = torch.cuda.current_stream(out.device).cuda_stream
        with torch.cuda.device(out.device):
            rc = lib.lib.hpc_decode(p.data_ptr(), p.numel(), target.data_ptr(), target.numel(),
                                    float(alpha if flat else 1.0), int(add and flat), err, ERRLEN, stream)
        if rc:
            _raise(rc, err)
        return _write_back(out, target, flat, add, alpha)

    def encode(self, grad, state: Optional[CompressorState] = None, out=None):
        if isinstance(grad, torch.Tensor) and grad.is_cuda:
            if state is not None and not isinstance(state, CompressorState):
                raise TypeError("state must be a CompressorState (from new_state)")
            if state is not None and state.numel != grad.numel():
                raise ValueError(f"state was made for {state.numel} elements, the gradient has {grad.numel()}")
            return self._encode_cuda(grad, state, out)
        g = flat_f32(grad)
        n = g.numel()
        if state is not None:
            if not isinstance(state, CompressorState):
                raise TypeError("state must be a CompressorState (from new_state)")
            if state.numel != n:
                raise ValueError(f"state was made for {state.numel} elements, the gradient has {n}")
        buf = out_buffer(out, self.max_encoded_bytes(n))
        nb = ctypes.c_uint64()
        err = _errbuf()
        ptrs, lens, k = self._state_ptrs(state) if state is not None else (None, None, 0)
        self._lib.sync_threads()
        rc = self._lib.lib.hpc_encode(self._pv, g.data_ptr(), n, buf.data_ptr(),
                                      buf.numel(), state.scalars.data_ptr() if state is not None else None,
                                      ptrs, lens, k, ctypes.byref(nb), err, ERRLEN)
        if rc:
            _raise(rc, err)
        return buf[:nb.value]

    def _decode(self, payload, out, alpha, add):
        if (isinstance(payload, torch.Tensor) and payload.is_cuda) or (isinstance(out, torch.Tensor) and out.is_cuda):
            return self._decode_cuda(payload, out, alpha, add)
        p = check_payload(payload)
        flat = is_f32_flat(out)
        target = out if flat else torch.empty(out.numel(), dtype=torch.float32)
        err = _errbuf()
        self._lib.sync_threads()
        rc = self._lib.lib.hpc_decode(p.data_ptr(), p.numel(), target.data_ptr(), target.numel(),
                                      float(alpha if flat else 1.0), int(add and flat), err, ERRLEN)
        if rc:
            _raise(rc, err)
        return _write_back(out, target, flat, add, alpha)

    def decode(self, payload, out):
        return self._decode(payload, out, 1.0, False)

    def decode_add(self, payload, acc, alpha: float = 1.0):
        return self._decode(payload, acc, alpha, True)

    def __repr__(self):
        args = ", ".join(f"{k}={v:g}" for k, v in self.params.items())
        return f"GeneratedCompressor({self.name}{', ' + args if args else ''})"


class GeneratedLowRank(GeneratedCompressor):
    """A generated compressor with a matrix view (``view rows, cols, r = ...;``): PowerSGD-like. State buffers
    are sized from the view, and with ``encode_round0..`` and ``finish`` it is a multi-round, aggregatable
    compressor (``encode_round``/``combine``/``finish``, see hipress/compression/base.py), driven by
    hipress.sync.lowrank like the hand-written PowerSGD."""

    def __init__(self, library: GeneratedLibrary, **params):
        lib = library.lib
        vp, u64, i32, cp = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p
        pu64 = ctypes.POINTER(u64)
        lib.hpc_rounds.restype = i32
        lib.hpc_view.argtypes = [vp, u64, u64, u64, pu64, pu64, i32, cp, i32]
        lib.hpc_kind_bytes.argtypes = [vp, u64, u64, u64, i32, pu64, cp, i32]
        lib.hpc_encode_round.argtypes = [vp, i32, vp, vp, u64, u64, u64, u64, vp, u64, vp, vp, vp, i32, pu64, cp, i32]
        names = ["hpc_view", "hpc_kind_bytes", "hpc_encode_round"]
        if lib.hpc_rounds() > 0:
            lib.hpc_finish.argtypes = [vp, vp, u64, vp, u64, u64, u64, i32, vp, vp, vp, i32, cp, i32]
            lib.hpc_combine.argtypes = [vp, u64, vp, u64, vp, u64, pu64, cp, i32]
            names += ["hpc_finish", "hpc_combine"]
        for f in names:
            getattr(lib, f).restype = i32
        self.rounds = max(1, lib.hpc_rounds())
        self.aggregatable = lib.hpc_rounds() > 0
        super().__init__(library, None, "the CUDA back end does not support matrix views yet", **params)

    @staticmethod
    def _matrix(numel: int, shape):
        """The hand-written PowerSGD's view (hipress.sync.lowrank.matrix_shape): shape[0] x the rest, n x 1."""
        numel = int(numel)
        if shape is None or len(shape) < 2 or numel == 0:
            return (numel, 1 if numel else 0)
        rows = int(shape[0])
        return (rows, numel // rows)

    def _call(self, fn, *args):
        err = _errbuf()
        rc = fn(*args, err, ERRLEN)
        if rc:
            _raise(rc, err)

    def kind_bytes(self, numel: int, matrix, kind: int) -> int:
        res = ctypes.c_uint64()
        self._call(self._lib.lib.hpc_kind_bytes, self._pv, int(numel), int(matrix[0]), int(matrix[1]), int(kind),
                   ctypes.byref(res))
        return int(res.value)

    def max_encoded_bytes(self, numel: int, shape=None) -> int:
        """Single-process payload (P^ and Q) of this shape; without a shape, the largest over all matrix shapes
        of numel elements."""
        if shape is None:
            return super().max_encoded_bytes(numel)
        return self.kind_bytes(numel, self._matrix(numel, shape), 0)

    def new_state(self, numel: int, shape=None) -> CompressorState:
        m = self._matrix(numel, shape)
        k = len(self.spec.state_arrays)
        dims = (ctypes.c_uint64 * 3)()
        sizes = (ctypes.c_uint64 * max(1, k))()
        self._call(self._lib.lib.hpc_view, self._pv, int(numel), m[0], m[1], dims, sizes, k)
        return CompressorState(self.name, numel, shape, {g.name: int(sizes[i]) for i, g in
                                                         enumerate(self.spec.state_arrays)}, m)

    def _check_state(self, state, n):
        if not isinstance(state, CompressorState):
            raise TypeError("state must be a CompressorState (from new_state)")
        if state.numel != n:
            raise ValueError(f"state was made for {state.numel} elements, the gradient has {n}")

    def _run(self, rnd, g, prev, n, matrix, state, out, kind):
        buf = out_buffer(out, self.kind_bytes(n, matrix, kind))
        nb = ctypes.c_uint64()
        ptrs, lens, k = self._state_ptrs(state) if state is not None else (None, None, 0)
        self._lib.sync_threads()
        self._call(self._lib.lib.hpc_encode_round, self._pv, int(rnd), g, prev[0], prev[1], int(n), matrix[0],
                   matrix[1], buf.data_ptr(), buf.numel(), state.scalars.data_ptr() if state is not None else None,
                   ptrs, lens, k, ctypes.byref(nb))
        return buf[:nb.value]

    def encode(self, grad, state: Optional[CompressorState] = None, out=None):
        """Both rounds locally (one rank): payload P^ and Q. Without a state: a fresh one (random Q, no
        residual), the matrix view from grad's shape."""
        g = flat_f32(grad)
        n = g.numel()
        if state is not None:
            self._check_state(state, n)
            matrix = state.matrix
        else:
            matrix = self._matrix(n, tuple(grad.shape))
        return self._run(-1, g.data_ptr(), (None, 0), n, matrix, state, out, 0)

    def encode_round(self, round: int, inp, state: CompressorState, out=None):
        if state is None:
            raise ValueError(f"{self.name} encode_round needs a state (new_state(numel, shape))")
        round = int(round)
        if not 0 <= round < self.rounds or not self.aggregatable:
            raise ValueError(f"{self.name}: round must be in [0, {self.rounds}) (then finish)")
        n = state.numel
        if round == 0:
            g = flat_f32(inp)
            self._check_state(state, g.numel())
            return self._run(0, g.data_ptr(), (None, 0), n, state.matrix, state, out, 1)
        self._check_state(state, n)
        p = check_payload(inp)
        return self._run(round, None, (p.data_ptr(), p.numel()), n, state.matrix, state, out, round + 1)

    def combine(self, a, b, out=None):
        if not self.aggregatable:
            return super().combine(a, b, out)
        a, b = check_payload(a), check_payload(b)
        buf = out_buffer(out, a.numel())
        nb = ctypes.c_uint64()
        self._call(self._lib.lib.hpc_combine, a.data_ptr(), a.numel(), b.data_ptr(), b.numel(), buf.data_ptr(),
                   buf.numel(), ctypes.byref(nb))
        return buf[:nb.value]

    def finish(self, payload, state: CompressorState, out, add: bool = False):
        if not self.aggregatable:
            return super().finish(payload, state, out, add)
        if state is None:
            raise ValueError(f"{self.name} finish needs the state of its rounds")
        p = check_payload(payload)
        flat = is_f32_flat(out)
        target = out if flat else torch.zeros(out.numel(), dtype=torch.float32)
        if not flat and add:
            target.copy_(out.reshape(-1))
        self._check_state(state, target.numel())
        ptrs, lens, k = self._state_ptrs(state)
        self._lib.sync_threads()
        self._call(self._lib.lib.hpc_finish, self._pv, p.data_ptr(), p.numel(), target.data_ptr(), target.numel(),
                   state.matrix[0], state.matrix[1], int(bool(add)), state.scalars.data_ptr(), ptrs, lens, k)
        if target is not out:
            out.copy_(target.view(out.shape))
        return out
