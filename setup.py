"""Build hipress and its native core hipress._C.

Sources are collected by convention, so a new seam never edits this file:
  csrc/**/*.cc        always compiled (C++17, -O3, warnings on); never needs torch headers
  hipress/dsl/specs/*.cll   the built-in compression algorithms: generated into C++ at build time
                      (hipress/dsl/target_module.py, into build_temp; never committed) and compiled in
  csrc/**/*_mpi.cc    only with MPI (HIPRESS_WITH_MPI=auto|0|1; auto = `mpicxx` found)
  csrc/**/*.cu        only with CUDA (HIPRESS_WITH_CUDA=auto|0|1; auto = nvcc found AND
                      the installed torch is a CUDA build); the CPU build never needs them
Set HIPRESS_MARCH to choose -march (default "native"; "" to omit).
"""
import glob
import os
import shlex
import shutil
import subprocess
import sys

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name):
    value = (os.environ.get(name) or "auto").strip().lower()  # empty = unset, as in hipress.config
    if value not in ("auto", "0", "1"):
        sys.exit(f"{name} must be auto, 0 or 1 (got {value!r})")
    return value


def _torch_has_cuda():
    # Asked in a subprocess: importing torch here would slow every build and
    # is impossible in an isolated build environment without torch.
    try:
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.version.cuda or '')"],
                             capture_output=True, text=True, timeout=120)
        return out.returncode == 0 and out.stdout.strip() != ""
    except (OSError, subprocess.TimeoutExpired):
        return False


def want_cuda():
    flag = _flag("HIPRESS_WITH_CUDA")
    nvcc = shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
                                    if os.environ.get("CUDA_HOME") else None)
    if flag == "0":
        return None
    if flag == "1":
        if not nvcc:
            sys.exit("HIPRESS_WITH_CUDA=1 but no nvcc was found (set CUDA_HOME or PATH)")
        return nvcc
    return nvcc if nvcc and _torch_has_cuda() else None


def mpi_flags():
    """(compile args, link args) from the MPI compiler wrapper, or None."""
    flag = _flag("HIPRESS_WITH_MPI")
    if flag == "0":
        return None
    wrapper = shutil.which("mpicxx") or shutil.which("mpic++")
    if not wrapper:
        if flag == "1":
            sys.exit("HIPRESS_WITH_MPI=1 but no mpicxx was found (apt-get install libopenmpi-dev)")
        return None
    try:
        comp = subprocess.run([wrapper, "--showme:compile"], capture_output=True, text=True, check=True).stdout
        link = subprocess.run([wrapper, "--showme:link"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        if flag == "1":
            raise
        return None
    return shlex.split(comp), shlex.split(link)


def sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "csrc", "**", pattern), recursive=True))


cc_sources = [s for s in sources("*.cc") if not s.endswith("_mpi.cc")]
extra_compile = ["-O3", "-Wall", "-Wextra", "-Wno-unused-parameter"]
march = os.environ.get("HIPRESS_MARCH", "native")
if march:
    extra_compile.append(f"-march={march}")
extra_link = ["-pthread"]
macros = []

mpi = mpi_flags()
if mpi:
    cc_sources += sources("*_mpi.cc")
    extra_compile += mpi[0]
    extra_link += mpi[1]
    macros.append(("HIPRESS_WITH_MPI", "1"))

nvcc = want_cuda()
cu_sources = sources("*.cu") if nvcc else []
if nvcc:
    macros.append(("HIPRESS_WITH_CUDA", "1"))
    cuda_home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    extra_link += [f"-L{cuda_home}/lib64", "-lcudart"]


def generate_builtins(out_dir):
    """The built-in compression algorithms' kernels, generated from hipress/dsl/specs/*.cll (their only
    source) into out_dir; returns the .cc paths. hipress.dsl's generator is pure Python: it is loaded
    from this tree under a stand-in 'hipress' package, so hipress/__init__.py, torch and hipress._C
    are never imported here; the stand-in is removed afterwards."""
    import importlib
    import types

    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "hipress" or k.startswith("hipress.")}
    stub = types.ModuleType("hipress")
    stub.__path__ = [os.path.join(ROOT, "hipress")]
    sys.modules["hipress"] = stub
    try:
        return importlib.import_module("hipress.dsl.target_module").generate_builtins(out_dir)
    finally:
        for k in [k for k in sys.modules if k == "hipress" or k.startswith("hipress.")]:
            del sys.modules[k]
        sys.modules.update(saved)


class BuildExt(build_ext):
    """pybind11's build_ext, plus the built-in algorithms generated from their DSL specs into build_temp
    (build output, never committed), plus nvcc for csrc/**/*.cu when CUDA is enabled."""

    def build_extension(self, ext):
        generated = generate_builtins(os.path.join(self.build_temp, "compll_builtins"))
        ext.sources = [s for s in ext.sources if "compll_builtins" not in s] + \
            [os.path.relpath(p, ROOT) if not os.path.isabs(self.build_temp) else p for p in generated]
        if cu_sources:
            objects = []
            tmp = os.path.join(self.build_temp, "cuda")
            os.makedirs(tmp, exist_ok=True)
            for src in cu_sources:
                obj = os.path.join(tmp, src.replace(os.sep, "_") + ".o")
                cmd = [nvcc, "-c", src, "-o", obj, "-O3", "-std=c++17", "-Icsrc", "-DHIPRESS_WITH_CUDA=1",
                       "-Xcompiler", "-fPIC,-Wall", "--expt-relaxed-constexpr"]
                print(" ".join(cmd))
                subprocess.check_call(cmd, cwd=ROOT)
                objects.append(obj)
            ext.extra_objects = list(ext.extra_objects or []) + objects
        super().build_extension(ext)


ParallelCompile("HIPRESS_BUILD_JOBS", default=0).install()

setup(
    name="hipress",
    version="0.1.0",
    description="Compression-aware data-parallel training for PyTorch (HiPress CaSync + CompLL)",
    packages=find_packages(include=["hipress", "hipress.*", "horovod_ext", "horovod_ext.*"]),
    package_data={"hipress": ["dsl/specs/*.cll", "dsl/prelude.h.txt", "bench/delay_daemon.c", "py.typed"]},
    ext_modules=[
        Pybind11Extension(
            "hipress._C",
            cc_sources,
            include_dirs=["csrc"],
            define_macros=macros,
            extra_compile_args=extra_compile,
            extra_link_args=extra_link,
            cxx_std=17,
        )
    ],
    cmdclass={"build_ext": BuildExt},
    python_requires=">=3.9",
    install_requires=["numpy"],
    extras_require={"test": ["pytest", "pytest-timeout", "hypothesis", "mpi4py"]},
    entry_points={"console_scripts": ["hipress-compll = hipress.compll:main"],
                  # transports outside the core register themselves (hipress.comm.transport)
                  "hipress.transports": ["horovod = horovod_ext:backend"]},
    zip_safe=False,
)
