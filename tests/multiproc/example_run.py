"""Helpers shared by the multi-process tests (launch environments, the example's digests, leftover processes)."""
import os
import re
import shutil
import signal
import subprocess

import pytest

from hipress.bench.faults import procs_with

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(ROOT, "examples", "train.py")
# Exactly 16 hex digits: launchers such as torchrun interleave the ranks' output.
DONE = re.compile(r"rank (\d)/(\d) done: test accuracy ([0-9.]+) .*? params sha256 ([0-9a-f]{16})")


def digests(text: str, n: int):
    """(params digest, accuracy) that all n ranks printed; fails if they disagree."""
    found = DONE.findall(text)
    assert len(found) == n, text[-3000:]
    assert len({f[3] for f in found}) == 1, f"ranks disagree: {found}"
    return found[0][3], float(found[0][2])


def clean_env(timeout_s: str, **extra) -> dict:
    """This process's environment without any launcher's variables (so a rank never
    inherits pytest's), with the repository importable, unbuffered output and a
    HIPRESS_TIMEOUT_S default; extra entries override."""
    env = dict(os.environ)
    for k in list(env):
        if k.startswith(("OMPI_", "PMIX_", "PMI_", "HOROVOD_")) or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                         "MASTER_ADDR", "MASTER_PORT", "HIPRESS_TRANSPORT"):
            del env[k]
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("HIPRESS_TIMEOUT_S", timeout_s)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def as_from_a_terminal():
    """Popen preexec_fn: SIGINT and SIGQUIT back to their defaults in the child, as a terminal's
    Ctrl-C finds them. A job started in the background by a non-interactive shell (nohup, CI
    scripts) inherits them ignored, and a Python started so never raises KeyboardInterrupt: a
    clean-clone run launched that way failed the SIGINT tests without any fault of the CLIs."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def running(program: str, marker: str):
    """pids of `program` (argv[0]'s base name) whose command line contains marker: processes
    that got as far as exec'ing it. A process between fork and exec still shows its parent's
    command line (the marker included), so counting procs_with(marker) while ranks start is a
    race that load widens; this count only grows to the number of ranks, then holds."""
    found = []
    for pid in procs_with(marker):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0", 1)[0]
        except OSError:
            continue
        if os.path.basename(argv0.decode(errors="replace")) == program:
            found.append(pid)
    return found


def horovod_missing():
    """Why horovodrun with Horovod's PyTorch extension cannot run here (None: it can)."""
    try:
        import horovod.torch  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"horovod.torch does not import ({type(e).__name__}: {e}); install it: bash scripts/install_horovod.sh"
    if shutil.which("horovodrun") is None:
        return "horovodrun is not on PATH"
    return None


def horovod_mpi_missing():
    if shutil.which("mpirun") is None:
        return "mpirun not found"
    import horovod.torch as hvd

    return None if hvd.mpi_built() else "Horovod was built without MPI"


def horovodrun(mode, n, cmd, timeout=150, **extra):
    """Run ``horovodrun --gloo|--mpi -np n cmd`` from the repository root; return (rc, output).
    Skips where Horovod cannot run in that mode; fails (killing the job) on a hang."""
    reason = horovod_missing() or (horovod_mpi_missing() if mode == "mpi" else None)
    if reason:
        pytest.skip(reason)
    if mode == "mpi":  # ranks waiting in MPI yield the CPU (more ranks than cores here)
        extra.setdefault("OMPI_MCA_mpi_yield_when_idle", 1)
    full = ["horovodrun", f"--{mode}", "-np", str(n), "-H", f"localhost:{n}", *cmd]
    p = subprocess.Popen(full, env=clean_env("60", **extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True, cwd=ROOT)
    try:
        out = p.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out = p.communicate()[0]
        pytest.fail(f"horovodrun --{mode} -np {n} still running after {timeout} s (a hang):\n{out[-4000:]}")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return p.returncode, out
