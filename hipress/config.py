"""Every ``HIPRESS_*`` environment variable, in one typed table, with one parser.

    from hipress import config
    config.get("HIPRESS_TIMEOUT_S")        # 60.0, or the parsed value of the environment

Values are read from the environment at each call (launchers and tests set them late), and
a bad value raises :class:`ConfigError` naming the variable, what it holds and what it takes.
The README's option tables are this table (``python -m hipress.config --markdown``; a test
checks that they agree). Build-time variables are read by setup.py and the scripts, which
cannot import the package before it is built; they are listed here so that one table says
what every variable means.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

__all__ = ["Var", "VARIABLES", "ConfigError", "get", "markdown_table"]


class ConfigError(ValueError):
    """An environment variable holds a value its parser rejects."""


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _bool(raw: str) -> bool:
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)}")


def _number(convert: Callable[[str], Any], raw: str, ok: Callable[[Any], bool], expected: str):
    try:
        v = convert(raw)
    except ValueError:
        v = None
    if v is None or not ok(v):
        raise ValueError(f"expected {expected}")
    return v


def _positive_float(raw: str) -> float:  # also no inf: no wait may be unbounded
    return _number(float, raw, lambda v: v > 0 and math.isfinite(v), "a finite number > 0")


def _nonneg_float(raw: str) -> float:
    return _number(float, raw, lambda v: v >= 0 and math.isfinite(v), "a finite number >= 0")


def _int(raw: str) -> int:
    return _number(int, raw, lambda v: True, "an integer")


def _positive_int(raw: str) -> int:
    return _number(int, raw, lambda v: v > 0, "an integer > 0")


def _nonneg_int(raw: str) -> int:
    return _number(int, raw, lambda v: v >= 0, "an integer >= 0")


def _text(raw: str) -> str:
    return raw.strip()


def _choice(*options: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        v = raw.strip().lower()
        if v not in options:
            raise ValueError(f"expected one of {', '.join(options)}")
        return v

    parse.options = options  # type: ignore[attr-defined]
    return parse


@dataclasses.dataclass(frozen=True)
class Var:
    name: str
    parse: Callable[[str], Any]
    default: Any
    meaning: str
    group: str = "run"         # run: read by the package at run time; build: setup.py/scripts; test: the test suite
    shown_default: Optional[str] = None  # how the README shows the default, when it is computed
    empty_is_value: bool = False  # an empty value is passed on (HIPRESS_MARCH: no -march); else it means unset

    @property
    def kind(self) -> str:
        options = getattr(self.parse, "options", None)
        if options:
            return "|".join(options)
        return {_bool: "bool", _positive_float: "seconds > 0" if self.name.endswith("_S") else "number > 0",
                _nonneg_float: "number >= 0", _int: "integer", _positive_int: "integer > 0",
                _nonneg_int: "integer >= 0", _text: "text"}.get(self.parse, "text")


_V = Var
VARIABLES: Sequence[Var] = (
    # ------------------------------------------------------------------ run time
    _V("HIPRESS_TRANSPORT", _text, None,
       "transport backend by name (`torch`, `mpi`, `nccl`, `loopback`, `horovod`); default: Horovod's "
       "collectives under horovodrun, MPI under mpirun, torch/gloo otherwise, loopback for one process",
       shown_default="chosen by the launch"),
    _V("HIPRESS_TIMEOUT_S", _positive_float, 60.0,
       "seconds any wait on a peer may take before it fails with an error naming the peer"),
    _V("HIPRESS_TRANSPORT_CHECK", _bool, True,
       "cross-rank shape checks of collectives (off: faster, mismatches become undefined behaviour)"),
    _V("HIPRESS_TORCH_BACKEND", _choice("gloo", "nccl"), "gloo",
       "process-group backend of the torch transport"),
    _V("HIPRESS_TORCH_ALLTOALL", _choice("p2p", "native"), "p2p",
       "torch/gloo alltoallv as point-to-point sends, or through gloo's `alltoall_base` (slower on the "
       "emulated cluster)"),
    _V("HIPRESS_MPI_ALLTOALL", _choice("native", "p2p"), "native",
       "MPI alltoallv as `MPI_Alltoallv`, or as point-to-point sends"),
    _V("HIPRESS_MPI_CUDA_AWARE", _bool, False, "the MPI library takes CUDA buffers"),
    _V("HIPRESS_MPI4PY", _bool, True, "share MPI's initialisation with mpi4py when it imports"),
    _V("HIPRESS_NCCL_LIBRARY", _text, None, "path of libnccl.so for the NCCL transport",
       shown_default="found on the library path"),
    _V("HIPRESS_HOROVOD_P2P", _choice("auto", "pairs", "collective"), "auto",
       "Horovod transport: one process set per pair of ranks (`pairs`, auto up to 16 ranks) or ring steps "
       "as alltoall (`collective`)"),
    _V("HIPRESS_HOROVODRUN", _bool, None, "overrides the guess whether horovodrun started this process",
       shown_default="guessed from the environment"),
    _V("HIPRESS_HOSTNAME", _text, None, "hostname used to group ranks per host (local aggregation)",
       shown_default="socket.gethostname()"),
    _V("HIPRESS_ADDR", _text, None, "address rank 0 announces for the rendezvous",
       shown_default="the route's source address"),
    _V("HIPRESS_BIND_ADDR", _text, None,
       "local address rank 0's rendezvous store listens on (`*`: every interface); `docs/security.md`",
       shown_default="the address announced to the ranks"),
    _V("HIPRESS_JOB_SECRET", _text, None,
       "per-job secret: the ranks check that the rendezvous store is their job's (an HMAC, not access "
       "control; `docs/security.md`)", shown_default="set afresh by `hipress.launch`, else off"),
    _V("HIPRESS_COORDINATOR", _bool, None,
       "route compressed gradients through the global coordinator (`docs/coordinator.md`); unset: off, but "
       "measured on and off with `compression=\"auto\"` (`coordinator=\"auto\"`)",
       shown_default="unset"),
    _V("HIPRESS_COORDINATOR_AHEAD", _bool, True,
       "with the coordinator, declare a step's exchanges ahead, while the step before runs, once two steps "
       "in a row ran the same (`docs/coordinator.md`)"),
    _V("HIPRESS_COORDINATOR_TRIAL_STEPS", _positive_int, 10,
       "with `coordinator=\"auto\"`, steps measured with the coordinator off, then on, before the faster is kept "
       "(`docs/coordinator.md`)"),
    _V("HIPRESS_BATCH_COMPUTE_BYTES", _nonneg_int, 256 << 10,
       "partitions up to this size run their encode/merge/decode tasks in batches",
       shown_default="262144 (256 KiB)"),
    _V("HIPRESS_COMPRESS_THREADS", _int, 1,
       "threads of the CompLL kernels (<= 0: all hardware threads); read by the C++ pool "
       "(`csrc/compress/thread_pool.cc`) and checked when `hipress.compression` imports"),
    _V("HIPRESS_TIMELINE", _text, None,
       "path of a Chrome trace of every engine task (one row per queue, plus gradient-ready events and "
       "the coordinator's slots); "
       "`{rank}` in it is replaced by the rank (the launcher's, or `init()`'s)",
       shown_default="off"),
    _V("HIPRESS_PROFILE_DIR", _text, None, "where `plan=\"auto\"` caches its profiles",
       shown_default="~/.cache/hipress/profiles"),
    _V("HIPRESS_COMPLL_CACHE", _text, None, "where DSL-generated kernels are cached",
       shown_default="~/.cache/hipress/compll"),
    _V("HIPRESS_CSRC", _text, None, "hipress's `csrc/` (operator sources the DSL compiles against)",
       shown_default="found beside the package"),
    _V("HIPRESS_NVCC", _text, None, "nvcc binary for the DSL's CUDA back end",
       shown_default="PATH, CUDA_HOME, pip wheels"),
    _V("HIPRESS_CUDA_ARCH", _text, None, "CUDA architecture of DSL-generated kernels (e.g. `sm_90`)",
       shown_default="the GPU's, else sm_80"),
    _V("HIPRESS_NP", _positive_int, 4, "default `-np` of `hipress.launch` and `hipress.bench.cluster`"),
    _V("HIPRESS_CLUSTER_FALLBACK", _bool, False,
       "emulated cluster: run ranks as plain local processes (no network namespaces)"),
    _V("HIPRESS_CLUSTER_DELAY", _choice("auto", "netem", "nfqueue", "nfqueue-python", "none"), "auto",
       "emulated cluster: packet-delay method (`auto`: netem where the kernel has it, else an NFQUEUE "
       "daemon where iptables is installed, compiled from C; `nfqueue-python`: that daemon in Python; "
       "`none`: latency is not emulated)"),
    # ------------------------------------------------------------------ build
    _V("HIPRESS_WITH_CUDA", _choice("auto", "0", "1"), "auto",
       "compile `csrc/**/*.cu`; auto = nvcc found and torch is a CUDA build", group="build"),
    _V("HIPRESS_WITH_MPI", _choice("auto", "0", "1"), "auto",
       "compile `csrc/**/*_mpi.cc`; auto = `mpicxx` found", group="build"),
    _V("HIPRESS_MARCH", _text, "native",
       "target CPU (`-march`; empty: none) of the native core, and of DSL-generated kernels at run time",
       group="build", empty_is_value=True),
    _V("HIPRESS_BUILD_JOBS", _positive_int, None,
       "parallel compile jobs of setup.py and `scripts/install_horovod.sh`", group="build", shown_default="nproc"),
    _V("HIPRESS_WITH_HOROVOD", _bool, False, "`scripts/setup.sh` also installs Horovod", group="build"),
    _V("HIPRESS_SKIP_APT", _bool, False,
       "`scripts/setup.sh` and `scripts/install_horovod.sh` install no system packages (apt-get)", group="build"),
    _V("HIPRESS_WHEEL_CACHE", _text, None, "where `scripts/install_horovod.sh` keeps the Horovod wheel",
       group="build", shown_default="~/.cache/hipress/wheels"),
    _V("HIPRESS_HOROVOD_NICE", _int, 10, "niceness of the Horovod build (`nice -n`)", group="build"),
    # ------------------------------------------------------------------ tests
    _V("HIPRESS_TEST_RESULT_DIR", _text, None, "where the multi-process test workers (transport, Horovod) also write their results as files",
       group="test", shown_default="stdout only"),
    _V("HIPRESS_SKIP_CUDA_COMPILE", _bool, False, "skip the CUDA compile-only tests when nvcc is missing",
       group="test"),
    _V("HIPRESS_TEST_CUDA_ARCH", _text, "sm_80", "the one CUDA architecture the compile-only tests build for",
       group="test"),
    _V("HIPRESS_TEST_DEVICE", _text, "cpu", "where the optimizer and DDP-hook test workers put their models "
       "(`cuda` runs them on the GPU: gradients staged through host memory)", group="test"),
)
_BY_NAME: Dict[str, Var] = {v.name: v for v in VARIABLES}
_SECRET = ("HIPRESS_JOB_SECRET",)  # never printed


def get(name: str, env: Optional[Mapping[str, str]] = None) -> Any:
    """The parsed value of ``name`` (its default when unset or empty)."""
    try:
        var = _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not a hipress setting; known: {', '.join(sorted(_BY_NAME))}") from None
    raw = (os.environ if env is None else env).get(name)
    if raw is None or (raw.strip() == "" and not var.empty_is_value):
        return var.default
    try:
        return var.parse(raw)
    except ValueError as e:
        raise ConfigError(f"{name}={raw!r}: {e} ({var.meaning})") from None


def markdown_table(group: str) -> str:
    """The README table of one group of variables."""
    rows = ["| variable | values | default | meaning |", "|---|---|---|---|"]
    for v in VARIABLES:
        if v.group != group:
            continue
        default = v.shown_default if v.shown_default is not None else v.default
        if isinstance(default, bool):
            default = "1" if default else "0"
        kind = v.kind.replace("|", "\\|")  # a bare | would split the cell
        rows.append(f"| `{v.name}` | {kind} | {default if default not in ('', None) else 'unset'} | {v.meaning} |")
    return "\n".join(rows)


def _main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m hipress.config", description=__doc__.split("\n\n")[0])
    ap.add_argument("--markdown", choices=("run", "build", "test"), help="print the README table of a group")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown_table(args.markdown))
        return 0
    for v in VARIABLES:
        if v.name in _SECRET and os.environ.get(v.name):
            print(f"{v.name}=<set, not shown>")
            continue
        print(f"{v.name}={os.environ.get(v.name, '')!s:<12} -> {get(v.name)!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
