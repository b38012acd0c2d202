"""CompLL code synthesis (HiPress §4.3): compile a DSL spec and plug it into hipress.

    from hipress import compll
    compll.load("my_algo.cll")                      # -> registered as "my_algo" (or the spec's algorithm name)
    opt = hipress.DistributedOptimizer(opt, named_parameters=..., compression="my_algo")

    compll.load("terngrad", name="dsl_terngrad")    # a spec shipped in hipress/dsl/specs/

Command line (``python -m hipress.compll`` / ``hipress-compll``)::

    hipress-compll check SPEC...          parse and type-check, report errors as file:line:col
    hipress-compll build SPEC...          also generate and compile (prints the library path)
    hipress-compll show SPEC              print the generated C++ source
    hipress-compll --target cuda SPEC     print the generated CUDA source (also: show --target cuda SPEC;
                                          build --target cuda SPEC compiles it with nvcc)
    hipress-compll list                   the specs shipped with hipress

The generated library is cached by content hash in $HIPRESS_COMPLL_CACHE or
~/.cache/hipress/compll; generated code is build output and is never written
into the source tree.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Dict, Optional, Tuple

from hipress.dsl import SPEC_DIR, DSLError

_LOADED: Dict[str, object] = {}


def resolve(spec: str) -> str:
    """A spec path; a bare name (e.g. "terngrad") means hipress/dsl/specs/<name>.cll."""
    if os.path.exists(spec):
        return spec
    shipped = os.path.join(SPEC_DIR, spec if spec.endswith(".cll") else spec + ".cll")
    if os.path.exists(shipped):
        return shipped
    raise FileNotFoundError(f"no spec {spec!r} (not a file, not one of {', '.join(shipped_specs())})")


def shipped_specs():
    from hipress.dsl.target_module import builtin_specs
    return [name for name, _ in builtin_specs()]


def cuda_specs():
    """The shipped specs the CUDA back end lowers: not those with a matrix view (PowerSGD-like),
    nor onebit's per-row scales (a DSL error names what has no device lowering)."""
    from hipress.dsl.codegen_cuda import generate_cuda
    from hipress.dsl.errors import DSLError

    out = []
    for s in shipped_specs():
        spec = check(s)
        if spec.view is not None:
            continue
        try:
            generate_cuda(spec)
        except DSLError:
            continue
        out.append(s)
    return out


def read(spec: str, source: Optional[str] = None) -> Tuple[str, str]:
    if source is not None:
        return source, spec
    path = resolve(spec)
    with open(path, encoding="utf-8") as f:
        return f.read(), path


def check(spec: str, source: Optional[str] = None, name: Optional[str] = None):
    """Parse and type-check a spec (a path, a shipped name, or ``source`` text with ``spec`` as its file name)."""
    from hipress.dsl.checker import check_source
    src, path = read(spec, source)
    return check_source(src, path, name)


def generate(spec: str, source: Optional[str] = None, name: Optional[str] = None, cuda: bool = False) -> str:
    s = check(spec, source, name)
    if cuda:
        from hipress.dsl.codegen_cuda import generate_cuda
        return generate_cuda(s)
    from hipress.dsl.codegen import generate_cpp
    return generate_cpp(s)


def build(spec: str, source: Optional[str] = None, name: Optional[str] = None, cuda: bool = False):
    """Check, generate and compile; returns (Spec, library path). ``cuda``: the CUDA library
    (hipress/dsl/codegen_cuda.py, nvcc) instead of the CPU one."""
    s = check(spec, source, name)
    if cuda:
        from hipress.dsl.build import compile_cuda
        from hipress.dsl.codegen_cuda import generate_cuda
        return s, compile_cuda(generate_cuda(s), s.name)
    from hipress.dsl.build import compile_cpp
    from hipress.dsl.codegen import generate_cpp
    return s, compile_cpp(generate_cpp(s), s.name)


def _cuda_available() -> bool:
    try:
        import torch
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


def load(spec: str, name: Optional[str] = None, *, source: Optional[str] = None, register: bool = True,
         overwrite: bool = False):
    """Compile ``spec`` (cached) and return a factory ``factory(**params) -> Compressor``.

    With ``register`` (default) the factory is registered with
    ``hipress.compression.register`` under ``name`` (default: the spec's
    ``algorithm`` name or its file name), so ``compression="<name>"`` works in
    ``DistributedOptimizer``. Re-loading the same spec under the same name is a
    no-op; registering over a different compressor needs ``overwrite=True``.
    """
    from hipress.compression import registry
    from hipress.dsl.runtime import CudaLibrary, GeneratedCompressor, GeneratedLibrary, GeneratedLowRank
    s, path = build(spec, source, name)
    key = s.name.lower()
    lib = GeneratedLibrary(path, s)
    if s.view is not None:
        # Matrix views (PowerSGD-like) have no CUDA back end yet: CPU only.
        factory = functools.partial(GeneratedLowRank, lib)
    else:
        # The CUDA library only where torch.cuda is available; elsewhere CPU only (CUDA tensors are then
        # refused with a clear error by the compressor).
        cuda_lib, why = None, "torch.cuda is not available"
        if _cuda_available():
            try:
                cuda_lib = CudaLibrary(build(spec, source, name, cuda=True)[1], s)
            except DSLError as e:
                import warnings
                why = f"the CUDA build failed: {e}"
                warnings.warn(f"compll: {s.name}: CPU only, {why}")
        factory = functools.partial(GeneratedCompressor, lib, cuda_lib, "" if cuda_lib else why)
    factory.spec = s
    factory.library = path
    if register:
        prev = _LOADED.get(key)
        if key in registry._REGISTRY and not overwrite and (prev is None or prev.library != path):
            if prev is None:
                raise ValueError(f"compressor {s.name!r} is registered already (a built-in or another module): "
                                 f"load it under another name (name=...) or pass overwrite=True")
        registry.register(s.name, factory, error_feedback=s.error_feedback, overwrite=True)
        _LOADED[key] = factory
    return factory


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="hipress-compll", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for c in ("check", "build"):
        p = sub.add_parser(c)
        p.add_argument("specs", nargs="+")
        if c == "build":
            p.add_argument("--target", choices=("cpu", "cuda"), default="cpu",
                           help="cuda: compile the CUDA library with nvcc")
    p = sub.add_parser("show")
    p.add_argument("spec")
    p.add_argument("--target", choices=("cpu", "cuda"), default="cpu", help="cuda: print the generated CUDA code")
    p.add_argument("--cuda", action="store_true", help="same as --target cuda")
    sub.add_parser("list")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].startswith("--target"):  # `hipress-compll --target cuda SPEC`: show SPEC
        argv = ["show"] + argv
    a = ap.parse_args(argv)
    if a.cmd == "list":
        for s in shipped_specs():
            print(os.path.join(SPEC_DIR, s + ".cll"))
        return 0
    status = 0
    try:
        if a.cmd == "show":
            sys.stdout.write(generate(a.spec, cuda=a.cuda or a.target == "cuda"))
            return 0
        for sp in a.specs:
            try:
                if a.cmd == "check":
                    s = check(sp)
                    print(f"{sp}: ok (algorithm {s.name}, id {s.algo_id}, parameters: "
                          f"{', '.join(s.param_names) or 'none'})")
                else:
                    s, path = build(sp, cuda=a.target == "cuda")
                    print(f"{sp}: {path}")
            except DSLError as e:
                print(e, file=sys.stderr)
                status = 1
    except (DSLError, FileNotFoundError) as e:
        print(e, file=sys.stderr)
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
