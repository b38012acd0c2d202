"""Helpers shared by the multi-process tests (launch environments, the example's digests, leftover processes)."""
import os
import re

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


def procs_with(marker: str):
    """pids whose command line contains marker (finds orphans reparented away from the test)."""
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(d))
            except OSError:
                pass
    return found
