"""Compiles generated C++ into a shared library, cached by content hash.

    cache dir: $HIPRESS_COMPLL_CACHE or ~/.cache/hipress/compll

The generated module is self-contained: the common operators it calls
(csrc/compress/ops.cc, thread_pool.cc, format.cc) are compiled once per cache
directory (keyed by their content and the flags) into position-independent
objects and linked into every generated library, with hidden visibility, so
nothing depends on hipress._C's symbol table. The operators are the same
sources, compiler and flags as in hipress._C, hence the same results.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from typing import List, Optional

from hipress import config
from hipress.dsl.errors import DSLError

OPS_SOURCES = ("compress/ops.cc", "compress/thread_pool.cc", "compress/format.cc")
HEADERS = ("compress/ops.h", "compress/thread_pool.h", "compress/format.h", "compress/rng.h")
WARN = ["-Wall", "-Wextra", "-Werror"]


def csrc_dir() -> str:
    env = config.get("HIPRESS_CSRC")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    d = os.path.join(os.path.dirname(os.path.dirname(here)), "csrc")
    if not os.path.isdir(d):
        raise DSLError("cannot find hipress's csrc/ (the operator sources); set HIPRESS_CSRC", "<build>", 0, 0)
    return d


def cache_dir() -> str:
    d = config.get("HIPRESS_COMPLL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hipress", "compll")
    os.makedirs(d, exist_ok=True)
    return d


def cxx() -> str:
    return os.environ.get("CXX", "g++")


def base_flags() -> List[str]:
    march = config.get("HIPRESS_MARCH")
    f = ["-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden", "-pthread"]
    if march:
        f.append(f"-march={march}")
    return f


_version_cache = {}


def compiler_id() -> str:
    c = cxx()
    if c not in _version_cache:
        try:
            _version_cache[c] = subprocess.run([c, "--version"], capture_output=True, text=True,
                                               timeout=60).stdout.splitlines()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            raise DSLError(f"C++ compiler {c!r} not found (set CXX)", "<build>", 0, 0) from None
    return _version_cache[c]


def _hash(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:24]


def _run(cmd, what):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise DSLError(f"{what} failed ({' '.join(cmd[:3])} ...):\n{p.stderr[-6000:]}", "<build>", 0, 0)


class _Lock:
    def __init__(self, path):
        self.path = path

    def __enter__(self):
        self.f = open(self.path, "w")
        fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *a):
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


def ops_objects() -> List[str]:
    """The operator objects for this csrc/compiler/flags, built once per cache dir."""
    src = csrc_dir()
    content = [open(os.path.join(src, p), "rb").read() for p in OPS_SOURCES + HEADERS]
    key = _hash(compiler_id(), " ".join(base_flags()), *content)
    d = os.path.join(cache_dir(), "ops-" + key)
    objs = [os.path.join(d, os.path.basename(p)[:-3] + ".o") for p in OPS_SOURCES]
    if all(os.path.exists(o) for o in objs):
        return objs
    with _Lock(os.path.join(cache_dir(), ".ops.lock")):
        if all(os.path.exists(o) for o in objs):
            return objs
        tmp = tempfile.mkdtemp(dir=cache_dir(), prefix=".ops-")
        try:
            for p, o in zip(OPS_SOURCES, objs):
                _run([cxx(), *base_flags(), "-Wall", "-Wextra", "-Wno-unused-parameter", f"-I{src}", "-c",
                      os.path.join(src, p), "-o", os.path.join(tmp, os.path.basename(o))], f"compiling {p}")
            os.makedirs(os.path.dirname(d), exist_ok=True)
            try:
                os.rename(tmp, d)
            except OSError:  # raced: someone else finished first
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            if os.path.exists(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
    return objs


def cached_path(name: str, key: str, ext: str) -> str:
    """<cache>/<name>-<key><ext>, the name made file-system safe."""
    safe = "".join(ch if ch.isalnum() or ch in "_-" else "_" for ch in name)[:45]
    return os.path.join(cache_dir(), f"{safe}-{key}{ext}")


def build_cached(code: str, path: str, src_ext: str, build) -> str:
    """path, built unless it exists: code is written to a private temporary folder in the cache, build(src, out)
    compiles it, and out then replaces path atomically (the source is kept next to it for inspection)."""
    if os.path.exists(path):
        return path
    base, ext = os.path.splitext(path)
    tmp_dir = tempfile.mkdtemp(dir=cache_dir(), prefix=".build-")
    try:
        src = os.path.join(tmp_dir, "gen" + src_ext)
        with open(src, "w") as f:
            f.write(code)
        out = os.path.join(tmp_dir, "out" + ext)
        build(src, out)
        shutil.copy(src, base + src_ext)
        os.replace(out, path)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return path


def compile_cpp(code: str, name: str, extra_flags: Optional[List[str]] = None) -> str:
    """Compile generated C++ into a shared library; returns its path (cached by content hash)."""
    objs = ops_objects()
    flags = base_flags() + WARN + list(extra_flags or [])
    key = _hash(code, compiler_id(), " ".join(flags), *[os.path.basename(os.path.dirname(o)) for o in objs[:1]])
    so = cached_path(name, key, ".so")

    def build(src: str, out: str):
        _run([cxx(), *flags, f"-I{csrc_dir()}", "-shared", src, *objs, "-o", out, "-Wl,-Bsymbolic"],
             f"compiling the generated code of {name}")

    return build_cached(code, so, ".cc", build)


# ---- CUDA back end (hipress/dsl/codegen_cuda.py) ----------------------------------------
# nvcc is found as $HIPRESS_NVCC, `nvcc` on PATH, $CUDA_HOME/bin/nvcc, or in the pip wheels
# below (the CUDA 13 split wheels: the nvidia-cuda-nvcc-cu12 12.9 wheel ships ptxas only, no nvcc).
NVCC_WHEELS = ("nvidia-cuda-nvcc==13.0.88", "nvidia-cuda-crt==13.0.88", "nvidia-nvvm==13.0.88",
               "nvidia-cuda-runtime==13.0.96")
NVCC_INSTALL_HINT = ("install the CUDA compiler with: python -m pip install " + " ".join(NVCC_WHEELS) +
                     "  (or set HIPRESS_NVCC to an nvcc binary)")
CUDA_HEADERS = ("compress/cuda/ops_cuda.cuh", "compress/cuda/hp_device.h", "compress/format.h", "compress/format.cc")
# Warnings are errors on both sides: nvcc's front end (all-warnings) and the host compiler.
# --fmad=false: no contraction into fused multiply-adds, like the CPU back end's fp-contract=off,
# so a float expression rounds the same on the GPU as on the CPU.
CUDA_FLAGS = ["-std=c++17", "-O3", "--fmad=false", "-Werror", "all-warnings",
              "-Xcompiler", "-Wall,-Wextra,-Werror,-fPIC,-fvisibility=hidden"]


def find_nvcc() -> Optional[str]:
    env = config.get("HIPRESS_NVCC")
    if env:
        return env
    p = shutil.which("nvcc")
    if p:
        return p
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    try:
        import nvidia  # namespace package of NVIDIA's pip wheels
        for d in list(getattr(nvidia, "__path__", [])):
            for sub in ("cu13", "cuda_nvcc"):
                c = os.path.join(d, sub, "bin", "nvcc")
                if os.path.exists(c):
                    return c
    except ImportError:
        pass
    return None


def require_nvcc() -> str:
    p = find_nvcc()
    if p is None:
        raise DSLError("nvcc not found: " + NVCC_INSTALL_HINT, "<build>", 0, 0)
    return p


def nvcc_id(nvcc: str) -> str:
    if nvcc not in _version_cache:
        try:
            out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=120).stdout
            _version_cache[nvcc] = out.strip().splitlines()[-1]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            raise DSLError(f"nvcc {nvcc!r} does not run: " + NVCC_INSTALL_HINT, "<build>", 0, 0) from None
    return _version_cache[nvcc]


def default_cuda_arch() -> str:
    """$HIPRESS_CUDA_ARCH, else the current GPU's (torch), else sm_80."""
    a = config.get("HIPRESS_CUDA_ARCH")
    if a:
        return a
    try:
        import torch
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"sm_{major}{minor}"
    except Exception:  # noqa: BLE001 - no usable torch/CUDA: the default arch
        pass
    return "sm_80"


def compile_cuda(code: str, name: str, arch: Optional[str] = None, shared: bool = True) -> str:
    """Compile a generated .cu with nvcc (warnings are errors); returns the cached library path
    (shared=True, the CUDA runtime linked statically) or object path (shared=False: compile only,
    no GPU needed). Cached by the hash of the code, nvcc, flags and the operator headers."""
    nvcc = require_nvcc()
    arch = arch or default_cuda_arch()
    src = csrc_dir()
    flags = CUDA_FLAGS + [f"-arch={arch}"]
    content = [open(os.path.join(src, p), "rb").read() for p in CUDA_HEADERS]
    key = _hash(code, nvcc_id(nvcc), " ".join(flags), str(shared), *content)
    out_path = cached_path(name + "-cuda", key, ".so" if shared else ".o")

    def build(cu: str, out: str):
        cmd = [nvcc, *flags, f"-I{src}", *(["-shared"] if shared else ["-c"]), cu, "-o", out]
        p = subprocess.run(cmd, capture_output=True, text=True)
        # Warning-free means no diagnostics at all, not only a zero exit status.
        if p.returncode != 0 or p.stderr.strip():
            raise DSLError(f"compiling the generated CUDA code of {name} failed ({' '.join(cmd[:3])} ...):\n"
                           f"{p.stderr[-6000:]}", "<build>", 0, 0)

    return build_cached(code, out_path, ".cu", build)
