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

from hipress.dsl.errors import DSLError

OPS_SOURCES = ("compress/ops.cc", "compress/thread_pool.cc", "compress/format.cc")
HEADERS = ("compress/ops.h", "compress/thread_pool.h", "compress/format.h", "compress/rng.h")
WARN = ["-Wall", "-Wextra", "-Werror"]


def csrc_dir() -> str:
    env = os.environ.get("HIPRESS_CSRC")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    d = os.path.join(os.path.dirname(os.path.dirname(here)), "csrc")
    if not os.path.isdir(d):
        raise DSLError("cannot find hipress's csrc/ (the operator sources); set HIPRESS_CSRC", "<build>", 0, 0)
    return d


def cache_dir() -> str:
    d = os.environ.get("HIPRESS_COMPLL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hipress", "compll")
    os.makedirs(d, exist_ok=True)
    return d


def cxx() -> str:
    return os.environ.get("CXX", "g++")


def base_flags() -> List[str]:
    march = os.environ.get("HIPRESS_MARCH", "native")
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


def compile_cpp(code: str, name: str, extra_flags: Optional[List[str]] = None) -> str:
    """Compile generated C++ into a shared library; returns its path (cached by content hash)."""
    objs = ops_objects()
    flags = base_flags() + WARN + list(extra_flags or [])
    key = _hash(code, compiler_id(), " ".join(flags), *[os.path.basename(os.path.dirname(o)) for o in objs[:1]])
    safe = "".join(ch if ch.isalnum() or ch in "_-" else "_" for ch in name)[:40]
    so = os.path.join(cache_dir(), f"{safe}-{key}.so")
    if os.path.exists(so):
        return so
    fd, tmp_dir = None, tempfile.mkdtemp(dir=cache_dir(), prefix=".build-")
    try:
        cc = os.path.join(tmp_dir, f"{safe}.cc")
        with open(cc, "w") as f:
            f.write(code)
        out = os.path.join(tmp_dir, f"{safe}.so")
        _run([cxx(), *flags, f"-I{csrc_dir()}", "-shared", cc, *objs, "-o", out, "-Wl,-Bsymbolic"],
             f"compiling the generated code of {name}")
        shutil.copy(cc, so[:-3] + ".cc")  # kept next to the library for inspection
        os.replace(out, so)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return so
