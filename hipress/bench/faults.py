"""Fault injection with real ranks (issue 22): one scenario per row of the fault table, each
asserting the promise of its row, as a table.

    python -m hipress.bench.faults [--only NAME[,NAME...]] [--json] [--list] [--steps-memory 300]

Every scenario starts its own ranks (2-3 local processes over gloo, launched with
``hipress.launch``'s environment), injects one fault and reports what it observed; a row
passes when the promise holds. tests/faults/ runs the same scenario functions and asserts on
their results (one implementation). Exit code: 0 when every row that ran passed, 1 otherwise.

The ranks run this module with ``--worker KIND``; each writes ``OUT/rank{r}.json``.
The rows and what they promise are in ``ROWS`` (docs/security.md, "Fault injection").
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional

VICTIM = 1          # the rank that faults in every multi-rank scenario
FAULT_STEP = 3      # the step at which it faults
SLACK_S = 20.0      # beyond HIPRESS_TIMEOUT_S: start-up and scheduling on a loaded machine, never a hang


@dataclass
class Row:
    """One row of the table: what was promised, what happened, whether the promise held."""
    name: str
    expected: str
    observed: str = ""
    failures: List[str] = field(default_factory=list)   # empty: passed
    skipped: Optional[str] = None                        # why the row could not run here
    seconds: float = 0.0
    facts: dict = field(default_factory=dict)            # what the ranks reported (the tests read it)

    @property
    def passed(self) -> bool:
        return not self.failures


# ------------------------------------------------------------------------------ rank side

def _model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def _batch(rank: int, step: int):
    import torch
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def _digest(obj) -> str:
    """sha256 (16 hex digits) of nested dicts/lists of tensors and plain values, exactly."""
    import torch
    h = hashlib.sha256()

    def walk(o):
        if isinstance(o, dict):
            for k in sorted(o, key=str):
                h.update(repr(k).encode())
                walk(o[k])
        elif isinstance(o, (list, tuple)):
            for x in o:
                walk(x)
        elif isinstance(o, torch.Tensor):
            h.update(repr((o.dtype, tuple(o.shape))).encode())
            h.update(o.detach().contiguous().view(torch.uint8).numpy().tobytes() if o.numel() else b"")
        else:
            h.update(repr(o).encode())
    walk(obj)
    return h.hexdigest()[:16]


def _params(model) -> str:
    return _digest({k: v for k, v in model.state_dict().items()})


def _optimizer(model, compression="tbq", strategy="ring", **kw):
    import torch

    import hipress
    return hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                        named_parameters=model.named_parameters(), compression=compression,
                                        strategy=strategy, **kw)


def _step(model, opt, rank, step):
    x, y = _batch(rank, step)
    opt.zero_grad(set_to_none=True)
    ((model(x) - y) ** 2).mean().backward()
    opt.step()


def _error(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())  # one line, for the table


def _start_together(out: str, rank: int, size: int, timeout_s: float = 120.0) -> None:
    """File barrier before hipress.init(): importing torch under load can take one rank many
    seconds longer than another, which would eat into the short HIPRESS_TIMEOUT_S of the fault."""
    open(os.path.join(out, f"ready.{rank}"), "w").close()
    deadline = time.monotonic() + timeout_s
    while sum(os.path.exists(os.path.join(out, f"ready.{r}")) for r in range(size)) < size:
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {rank}: the other ranks did not start within {timeout_s:g} s")
        time.sleep(0.02)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _train_with_fault(a, rank: int, res: dict) -> None:
    """a.fault at step FAULT_STEP on rank VICTIM: kill (SIGKILL itself), stop (SIGSTOP itself:
    the driver continues it, or not), sleep (a.sleep s before every step), none. Survivors
    record their error and how long after the fault it came; with a.reference, the same
    training again without the fault (its parameters are the uninterrupted run's)."""
    import hipress
    model = _model()
    opt = _optimizer(model, a.compression, a.strategy)
    victim = rank == VICTIM
    try:
        for step in range(a.steps):
            if victim and step == FAULT_STEP and a.fault in ("kill", "stop"):
                with open(os.path.join(a.out, "fault_at"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL if a.fault == "kill" else signal.SIGSTOP)
            if victim and a.fault == "sleep":
                time.sleep(a.sleep)
            _step(model, opt, rank, step)
        res["params"] = _params(model)
    except Exception as e:  # noqa: BLE001 (the error is what the scenario observes)
        res["error"] = _error(e)[:600]
        try:
            with open(os.path.join(a.out, "fault_at")) as f:
                res["error_after_s"] = time.time() - float(f.read())
        except OSError:
            pass
        return
    if a.reference:
        model = _model()
        opt = _optimizer(model, a.compression, a.strategy)
        for step in range(a.steps):
            _step(model, opt, rank, step)
        res["reference"] = _params(model)
    hipress.shutdown()


def _mismatch(a, rank: int, res: dict) -> None:
    """Rank VICTIM wraps with another strategy or compression than the others, then trains."""
    import hipress
    cfg = {"compression": "tbq", "strategy": "ring"}
    if rank == VICTIM:
        cfg[a.differ] = {"compression": "onebit", "strategy": "ps"}[a.differ]
    t0 = time.time()
    try:
        model = _model()
        opt = _optimizer(model, **cfg)
        for step in range(a.steps):
            _step(model, opt, rank, step)
        res["params"] = _params(model)
        hipress.shutdown()
    except Exception as e:  # noqa: BLE001
        res["error"] = _error(e)[:600]
        res["error_after_s"] = time.time() - t0


def _uneven(a, rank: int, res: dict) -> None:
    """Rank r has 2 + 2r batches, then joins: with a.joiner == "collective", a Horovod-style
    loop of hipress.allreduce + hipress.join(); with "optimizer", DistributedOptimizer + opt.join()."""
    import torch

    import hipress
    batches = 2 + 2 * rank
    try:
        if a.joiner == "collective":
            res["averages"] = [float(hipress.allreduce(torch.full((4,), float(rank + 1)), name=f"g{s}")[0])
                               for s in range(batches)]
            res["last_joined"] = hipress.join()
        else:
            model = _model()
            opt = _optimizer(model)
            for step in range(batches):
                _step(model, opt, rank, step)
            res["last_joined"] = opt.join()
        hipress.shutdown()
    except Exception as e:  # noqa: BLE001
        res["error"] = _error(e)[:600]


def _nonfinite(a, rank: int, res: dict) -> None:
    """Every algorithm (ring): a NaN in rank VICTIM's gradient of '0.weight' at step 1. Per
    algorithm: parameters and hipress state digests before/after the step, last_nonfinite, final."""
    import warnings

    from hipress import compression
    import hipress
    res["algorithms"] = {}
    for algo in compression.available():
        model = _model()
        opt = _optimizer(model, algo, "ring", bucket_bytes=0)
        named = dict(model.named_parameters())
        got = {}
        for step in range(3):
            if step == 1:
                got["before"] = [_params(model), _digest(opt.state_dict()["hipress"])]
                if rank == VICTIM:
                    def poison(g):
                        handle.remove()
                        g = g.clone()
                        g.view(-1)[7] = float("nan")
                        return g
                    handle = named["0.weight"].register_hook(poison)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _step(model, opt, rank, step)
            if step == 1:
                got["after"] = [_params(model), _digest(opt.state_dict()["hipress"])]
                got["last_nonfinite"] = dict(opt.last_nonfinite)
        got["final"] = _params(model)
        res["algorithms"][algo] = got
    hipress.shutdown()


def _memory(a, rank: int, res: dict) -> None:
    """a.steps training steps (TBQ, ring); RSS after every step."""
    import hipress
    model = _model()
    opt = _optimizer(model)
    res["rss"] = []
    for step in range(a.steps):
        _step(model, opt, rank, step % 16)
        res["rss"].append(_rss_bytes())
    hipress.shutdown()


def _store(a, rank: int, res: dict) -> None:
    """Rank 0: whether its rendezvous store (MASTER_PORT) accepts a connection on loopback (the
    advertised address) and on this host's other address."""
    import hipress
    if rank == 0:
        port = int(os.environ["MASTER_PORT"])
        other = non_loopback_ipv4()
        res["other"] = other
        res["loopback"] = _connects("127.0.0.1", port)
        res["from_other"] = _connects(other, port) if other else None
    hipress.broadcast_object(None)  # keeps rank 0's store up until rank 0 has tried
    hipress.shutdown()


def non_loopback_ipv4() -> Optional[str]:
    """An IPv4 address of this host that is not loopback (None if it has none)."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except OSError:
        infos = []
    for info in infos:
        if not info[4][0].startswith("127."):
            return info[4][0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # the address of the default route
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent (UDP connect)
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


def _connects(addr: str, port: int) -> bool:
    try:
        socket.create_connection((addr, port), timeout=5).close()
        return True
    except OSError:
        return False


def _payloads(a, res: dict) -> None:
    """Single process, address space capped 512 MiB above its start: mutated and forged payloads
    of every built-in algorithm through decompress and payload_info. Counts each outcome; any
    exception but ValueError is recorded (an allocation of what a forged header announces
    fails under the cap with RuntimeError or MemoryError, so it is caught here too)."""
    import random
    import resource

    import torch

    from hipress import compression as C
    from hipress.compression import reference as ref
    from hipress.compression.native import NativeCompressor

    def native(name):  # the 48-byte header format (acpsgd has its own, tested in tests/unit/test_acpsgd.py)
        c = C.get(name)
        return isinstance(getattr(c, "inner", c), NativeCompressor)

    rng = random.Random(22)
    grad = torch.randn(1000)
    good = {n: C.compress(grad, n) for n in C.available() if n != "none" and native(n)}
    for p in good.values():  # warm every decoder before the cap (first-use allocations)
        C.decompress(p)

    def vm_bytes():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    cap = vm_bytes() + (512 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    try:
        torch.empty(1 << 30, dtype=torch.float32).fill_(1)  # 4 GiB
        res["cap_bites"] = False
    except (RuntimeError, MemoryError):
        res["cap_bites"] = True

    def forged(p: torch.Tensor) -> torch.Tensor:
        """p's header with random fields and a valid check (a forgery, not an accident)."""
        f = list(ref._HDR.unpack(bytes(p[:ref._HDR.size].tolist())))
        i = rng.choice([1, 3, 4, 6, 7, 8, 9, 10, 11, 12])  # algo, bits, kind, count, numel, body, words
        f[i] = rng.choice([0, 1, 2 ** 31, 2 ** 32 - 1, rng.randrange(2 ** 32)] if i not in (7, 8) else
                          [0, 2 ** 63, 2 ** 64 - 1, 1 << rng.randrange(64), rng.randrange(2 ** 64)])
        if i == 1:
            f[i] %= 256
        elif i in (3, 4):
            f[i] %= 256
        f[5] = 0
        f[5] = ref.fnv1a(ref._HDR.pack(*f))
        raw = ref._HDR.pack(*f) + bytes(p[ref._HDR.size:].tolist())
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    counts = {"cases": 0, "rejected": 0, "decoded": 0}
    others: List[str] = []
    names = sorted(good)
    for i in range(a.cases):
        p = good[names[i % len(names)]].clone()
        kind = i // len(names) % 4
        if kind == 0:
            p[rng.randrange(p.numel())] ^= 1 << rng.randrange(8)
        elif kind == 1:
            p = p[:rng.randrange(p.numel())].clone()
        elif kind == 2:
            p = torch.cat([p, torch.randint(0, 256, (rng.randrange(1, 64),), dtype=torch.uint8)])
        else:
            p = forged(p)
        for fn in (C.payload_info, C.decompress):
            counts["cases"] += 1
            try:
                fn(p)
                counts["decoded"] += 1
            except ValueError:
                counts["rejected"] += 1
            except Exception as e:  # noqa: BLE001 (what the row must never see)
                others.append(f"{fn.__name__}: {_error(e)[:200]}")
    res.update(counts, others=others[:10], other_count=len(others))
    res["maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(argv) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--fault", default="none")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--compression", default="tbq")
    p.add_argument("--strategy", default="ring")
    p.add_argument("--reference", action="store_true")
    p.add_argument("--differ", default="strategy")
    p.add_argument("--joiner", default="collective")
    p.add_argument("--cases", type=int, default=4000)
    p.add_argument("--tag", default="")  # only marks the command line (the driver finds leftovers by it)
    a = p.parse_args(argv)
    if a.worker == "payloads":
        res = {"rank": 0}
        _payloads(a, res)
        _write(a.out, 0, res)
        return
    rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))  # hipress.launch or mpirun
    size = int(os.environ.get("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
    res = {"rank": rank}
    if a.worker != "never_starts":
        _start_together(a.out, rank, size)
    import hipress
    t0 = time.time()
    try:
        hipress.init()
    except Exception as e:  # noqa: BLE001
        res.update(error=_error(e)[:600], error_after_s=time.time() - t0)
        _write(a.out, rank, res)
        return
    {"train": _train_with_fault, "mismatch": _mismatch, "uneven": _uneven, "nonfinite": _nonfinite,
     "memory": _memory, "store": _store, "never_starts": lambda *_: None}[a.worker](a, rank, res)
    _write(a.out, rank, res)


def _write(out: str, rank: int, res: dict) -> None:
    tmp = os.path.join(out, f".rank{rank}.json")
    with open(tmp, "w") as f:
        json.dump(res, f)
    os.replace(tmp, os.path.join(out, f"rank{rank}.json"))


# ------------------------------------------------------------------------------ driver side

def _env(timeout_s: float) -> Dict[str, str]:
    """This process's environment without any launcher's variables or address choices (the
    ranks get hipress.launch's: loopback), hipress importable from where this module is, and
    the scenario's HIPRESS_TIMEOUT_S."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "HOROVOD_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HIPRESS_TRANSPORT",
                         "HIPRESS_BIND_ADDR", "GLOO_SOCKET_IFNAME")}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["HIPRESS_TIMEOUT_S"] = str(timeout_s)
    return env


def _cmd(kind: str, out: str, *extra: str) -> List[str]:
    return [sys.executable, "-m", "hipress.bench.faults", "--worker", kind, "--out", out, *extra]


class _Ranks:
    """np rank processes started by hand (hipress.launch would stop the survivors as soon as
    one rank dies, and the survivors' own reaction is what is observed). Each rank leads its
    own process group; stop() kills what is left."""

    def __init__(self, cmd: List[str], np: int, timeout_s: float, out: str, ranks=None):
        from hipress.launch import job_secret, rank_env
        from hipress.supervise import free_port
        env, port = _env(timeout_s), free_port()
        secret = job_secret(env)
        self.out = out
        self.logs = [open(os.path.join(out, f"log{r}.txt"), "w") for r in range(np)]
        self.procs = {r: subprocess.Popen(cmd, env=rank_env(r, np, port, env, secret=secret), stdout=self.logs[r],
                                          stderr=subprocess.STDOUT, start_new_session=True)
                      for r in (range(np) if ranks is None else ranks)}

    def wait(self, ranks, within_s: float) -> bool:
        """Whether the given ranks all exited within within_s seconds."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if all(self.procs[r].poll() is not None for r in ranks):
                return True
            time.sleep(0.05)
        return False

    def stopped(self, rank: int, within_s: float) -> bool:
        """Whether rank reached the stopped state ('T' in /proc/PID/stat) within within_s seconds."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline and self.procs[rank].poll() is None:
            try:
                with open(f"/proc/{self.procs[rank].pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "T":
                        return True
            except OSError:
                return False
            time.sleep(0.02)
        return False

    def stop(self) -> None:
        for p in self.procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()
        for f in self.logs:
            f.close()

    def results(self) -> Dict[int, dict]:
        found = {}
        for r in self.procs:
            path = os.path.join(self.out, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    found[r] = json.load(f)
        return found

    def log_tail(self, r: int, chars: int = 1500) -> str:
        with open(os.path.join(self.out, f"log{r}.txt"), errors="replace") as f:
            return f.read()[-chars:]


# "rank 1", "ranks [1]", "rank(s) 0, 1": a message that names the rank; "peers [1, 2]" (every
# peer of a failed exchange) does not say which one failed
_RANK_LIST = r"\brank(?:s|\(s\))?:?\s*\[?(?:\d+,\s*)*{}\b"


def _names_victim(msg: str) -> bool:
    return re.search(_RANK_LIST.format(VICTIM), msg) is not None


def _survivor_errors(res: Dict[int, dict], np: int, row: Row, timeout_s: float, ranks=None) -> List[float]:
    """Every survivor raised within timeout_s + SLACK_S of the fault, naming rank VICTIM. Returns the delays."""
    delays = []
    for r in (ranks if ranks is not None else [r for r in range(np) if r != VICTIM]):
        got = res.get(r)
        if got is None:
            row.failures.append(f"rank {r} reported nothing")
        elif "error" not in got:
            row.failures.append(f"rank {r} finished without an error")
        else:
            delay = got.get("error_after_s", float("nan"))
            delays.append(delay)
            if not delay <= timeout_s + SLACK_S:
                row.failures.append(f"rank {r} raised {delay:.1f} s after the fault (> {timeout_s:g} + {SLACK_S:g} s)")
            if not _names_victim(got["error"]):
                row.failures.append(f"rank {r}'s error does not name rank {VICTIM}: {got['error'][:200]}")
    return delays


def _first_error(res: Dict[int, dict]) -> str:
    errs = [g["error"] for g in res.values() if "error" in g]
    return errs[0][:160] if errs else "no error"


def killed(row: Row, timeout_s: float = 10.0) -> None:
    np = 3
    with tempfile.TemporaryDirectory() as out:
        ranks = _Ranks(_cmd("train", out, "--fault", "kill", "--steps", "40"), np, timeout_s, out)
        try:
            ended = ranks.wait(range(np), timeout_s + SLACK_S + 60)
            res = ranks.results()
            codes = {r: p.poll() for r, p in ranks.procs.items()}
        finally:
            ranks.stop()
    if not ended:
        row.failures.append("a survivor still ran after the timeout (a hang)")
    if codes[VICTIM] != -signal.SIGKILL:
        row.failures.append(f"the victim exited with {codes[VICTIM]}, not killed")
    delays = _survivor_errors(res, np, row, timeout_s)
    row.facts = {"results": res, "codes": codes, "timeout_s": timeout_s}
    row.observed = (f"survivors ended {', '.join(f'{d:.1f}' for d in delays)} s after the kill with "
                    f"'{_first_error({r: g for r, g in res.items() if r != VICTIM})}'")


def _killed_under(row: Row, name: str, launcher: List[str], timeout_s: float) -> None:
    """A rank SIGKILLs itself under ``launcher`` (a command prefix taking the worker's command):
    the launcher must exit non-zero and leave no process behind."""
    np = 3
    tag = f"hipress-fault-{os.getpid()}-{time.monotonic_ns()}"
    with tempfile.TemporaryDirectory() as out:
        cmd = [*launcher, "-np", str(np), *_cmd("train", out, "--fault", "kill", "--steps", "400", "--tag", tag)]
        p = subprocess.Popen(cmd, env=_env(timeout_s), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        try:
            log, _ = p.communicate(timeout=timeout_s + SLACK_S + 90)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            log, _ = p.communicate()
            row.failures.append(f"{name} still ran long after the kill (a hang)")
        injected = os.path.exists(os.path.join(out, "fault_at"))
    left = procs_with(tag)
    row.facts = {"code": p.returncode, "left": left, "injected": injected, "log_tail": log[-1500:]}
    if not injected:
        row.failures.append("the job ended before the victim killed itself")
    if p.returncode in (0, None):
        row.failures.append(f"{name} exited with {p.returncode}")
    if left:
        row.failures.append(f"processes left behind: {left}")
    row.observed = f"{name} exited {p.returncode}, {len(left)} processes left"


def killed_under_launcher(row: Row, timeout_s: float = 10.0) -> None:
    _killed_under(row, "launcher", [sys.executable, "-m", "hipress.launch"], timeout_s)


def killed_under_mpirun(row: Row, timeout_s: float = 10.0) -> None:
    import shutil
    if shutil.which("mpirun") is None:
        row.skipped = "mpirun not installed"
        row.observed = row.skipped
        return
    _killed_under(row, "mpirun", ["mpirun", "--allow-run-as-root", "--oversubscribe"], timeout_s)


def procs_with(marker: str) -> List[int]:
    """pids (other than this one) whose command line contains marker: finds ranks and orphans
    reparented away from the process that started them."""
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(d))
            except OSError:
                pass
    return found


def _same_as_uninterrupted(res: Dict[int, dict], np: int, row: Row) -> None:
    for r in range(np):
        got = res.get(r, {})
        if "error" in got or "params" not in got:
            row.failures.append(f"rank {r}: {got.get('error', 'no result')}")
        elif got["params"] != got["reference"]:
            row.failures.append(f"rank {r}'s parameters differ from the uninterrupted run's")
    if len({res.get(r, {}).get("params") for r in range(np)}) != 1:
        row.failures.append("ranks end with different parameters")


def stopped_briefly(row: Row, timeout_s: float = 20.0, pause_s: float = 2.0) -> None:
    np = 2
    with tempfile.TemporaryDirectory() as out:
        ranks = _Ranks(_cmd("train", out, "--fault", "stop", "--steps", "8", "--reference"), np, timeout_s, out)
        try:
            if ranks.stopped(VICTIM, 120):
                time.sleep(pause_s)
                os.kill(ranks.procs[VICTIM].pid, signal.SIGCONT)
            else:
                row.failures.append("the victim never stopped itself")
            ranks.wait(range(np), 120)
            res = ranks.results()
        finally:
            ranks.stop()
    _same_as_uninterrupted(res, np, row)
    row.facts = {"results": res}
    row.observed = (f"stopped {pause_s:g} s (timeout {timeout_s:g} s): "
                    + ("finished, parameters equal the uninterrupted run's" if row.passed else "; ".join(row.failures)))


def stopped_too_long(row: Row, timeout_s: float = 6.0) -> None:
    np = 2
    with tempfile.TemporaryDirectory() as out:
        ranks = _Ranks(_cmd("train", out, "--fault", "stop", "--steps", "40"), np, timeout_s, out)
        try:
            ranks.stopped(VICTIM, 120)
            survivors = [r for r in range(np) if r != VICTIM]
            ended = ranks.wait(survivors, timeout_s + SLACK_S + 60)
            os.kill(ranks.procs[VICTIM].pid, signal.SIGCONT)
            victim_ended = ranks.wait([VICTIM], timeout_s + SLACK_S)
            res = ranks.results()
        finally:
            ranks.stop()
    if not ended:
        row.failures.append("a survivor still waits for the stopped rank (a hang)")
    delays = _survivor_errors(res, np, row, timeout_s, survivors)
    if not victim_ended:
        row.failures.append("the stopped rank, continued after its peers had gone, hung")
    row.facts = {"results": res, "timeout_s": timeout_s}
    row.observed = (f"survivors ended {', '.join(f'{d:.1f}' for d in delays)} s after the stop with "
                    f"'{_first_error({r: res[r] for r in survivors if r in res})}'; the continued rank "
                    + ("ended" if victim_ended else "hung") + f" ({res.get(VICTIM, {}).get('error', 'no error')[:80]})")


def slowed(row: Row, timeout_s: float = 30.0, sleep_s: float = 0.3) -> None:
    np = 2
    with tempfile.TemporaryDirectory() as out:
        ranks = _Ranks(_cmd("train", out, "--fault", "sleep", "--sleep", str(sleep_s), "--steps", "8", "--reference"),
                       np, timeout_s, out)
        try:
            ranks.wait(range(np), 180)
            res = ranks.results()
        finally:
            ranks.stop()
    _same_as_uninterrupted(res, np, row)
    row.facts = {"results": res}
    row.observed = (f"rank {VICTIM} slept {sleep_s:g} s per step: "
                    + ("finished, parameters equal the uninterrupted run's" if row.passed else "; ".join(row.failures)))


def _launched(kind: str, np: int, timeout_s: float, *extra: str, within_s: float = 120.0):
    """Runs a worker kind on np ranks by hand to the end (all ranks, however they end); returns their results."""
    with tempfile.TemporaryDirectory() as out:
        ranks = _Ranks(_cmd(kind, out, *extra), np, timeout_s, out)
        try:
            ended = ranks.wait(range(np), within_s)
            res = ranks.results()
            tails = {r: ranks.log_tail(r) for r in range(np) if r not in res}
        finally:
            ranks.stop()
    return ended, res, tails


def _uneven_row(row: Row, joiner: str, timeout_s: float) -> dict:
    """Two ranks with 2 and 4 batches, the first joining early; every rank must end with a
    result naming the last rank to join. Returns the ranks' results."""
    np = 2
    ended, res, tails = _launched("uneven", np, timeout_s, "--joiner", joiner)
    row.facts = {"results": res, "logs": tails}
    if not ended:
        row.failures.append("a rank hung")
    for r in range(np):
        got = res.get(r, {})
        if "error" in got or "last_joined" not in got:
            row.failures.append(f"rank {r}: {got.get('error', 'no result')[:160]}")
        elif got["last_joined"] != np - 1:
            row.failures.append(f"rank {r}: join() returned {got['last_joined']}, not {np - 1}")
    return res


def uneven_collective(row: Row, timeout_s: float = 20.0) -> None:
    res = _uneven_row(row, "collective", timeout_s)
    # rank 1's first two averages are (1 + 2) / 2; after rank 0 joined, rank 0 adds zeros: 2 / 2
    if res.get(1, {}).get("averages") not in (None, [1.5, 1.5, 1.0, 1.0]):
        row.failures.append(f"rank 1's averages {res[1]['averages']}, not [1.5, 1.5, 1.0, 1.0]")
    row.observed = ("2 and 4 batches: both ranks done, join() -> 1, averages with the joined rank's zeros"
                    if row.passed else "; ".join(row.failures))


def uneven_optimizer(row: Row, timeout_s: float = 8.0) -> None:
    _uneven_row(row, "optimizer", timeout_s)
    row.observed = "both ranks done after opt.join()" if row.passed else "; ".join(row.failures)


def _mismatched(row: Row, differ: str, timeout_s: float) -> None:
    np = 2
    ended, res, tails = _launched("mismatch", np, timeout_s, "--differ", differ, "--steps", "3")
    row.facts = {"results": res, "logs": tails, "timeout_s": timeout_s}
    if not ended:
        row.failures.append("a rank hung")
    for r in range(np):
        got = res.get(r, {})
        if "error" not in got:
            row.failures.append(f"rank {r} " + ("trained without an error" if got else "reported nothing"))
        elif not _names_mismatch(got["error"], differ, r):
            row.failures.append(f"rank {r}'s error does not say which {differ} differs on which rank "
                                f"(after {got.get('error_after_s', float('nan')):.1f} s): {got['error'][:160]}")
    after = [f"{g['error_after_s']:.1f}" for g in res.values() if "error_after_s" in g]
    row.observed = f"errors after {', '.join(after) or '-'} s: '{_first_error(res)}'"


def _names_mismatch(msg: str, differ: str, rank: int) -> bool:
    """The error names the setting, and the rank that differs: VICTIM on the other ranks; on
    VICTIM itself, any rank (the one it differs from)."""
    named = _names_victim(msg) if rank != VICTIM else re.search(r"\brank(?:s|\(s\))?:?\s*\[?\d", msg) is not None
    return differ in msg and named


def mismatched_strategy(row: Row, timeout_s: float = 8.0) -> None:
    _mismatched(row, "strategy", timeout_s)


def mismatched_compression(row: Row, timeout_s: float = 8.0) -> None:
    _mismatched(row, "compression", timeout_s)


def never_starts(row: Row, timeout_s: float = 5.0) -> None:
    np = 2
    with tempfile.TemporaryDirectory() as out:
        ranks = _Ranks(_cmd("never_starts", out), np, timeout_s, out, ranks=[0])
        try:
            ended = ranks.wait([0], timeout_s + SLACK_S + 60)
            res = ranks.results()
        finally:
            ranks.stop()
    row.facts = {"results": res}
    got = res.get(0, {})
    if not ended:
        row.failures.append("rank 0 hung")
    if "error" not in got:
        row.failures.append("rank 0 reported no error")
    elif not _names_victim(got["error"]):
        row.failures.append(f"rank 0's error does not name rank {VICTIM}: {got['error'][:200]}")
    row.observed = f"rank 0 ended after {got.get('error_after_s', float('nan')):.1f} s: '{got.get('error', '')[:160]}'"


def nonfinite_gradient(row: Row, timeout_s: float = 30.0) -> None:
    np = 2
    ended, res, tails = _launched("nonfinite", np, timeout_s, within_s=240)
    row.facts = {"results": res, "logs": tails}
    if not ended or sorted(res) != [0, 1] or any("error" in g for g in res.values()):
        row.failures.append(f"the job failed: {_first_error(res)} {tails}")
        row.observed = "; ".join(row.failures)
        return
    algos = sorted(res[0]["algorithms"])
    for algo in algos:
        for r in range(np):
            got = res[r]["algorithms"][algo]
            if got["before"] != got["after"]:
                what = "parameters" if got["before"][0] != got["after"][0] else "hipress state"
                row.failures.append(f"{algo} rank {r}: the skipped step changed its {what}")
            if got["last_nonfinite"] != {"0.weight": [VICTIM]}:
                row.failures.append(f"{algo} rank {r}: last_nonfinite {got['last_nonfinite']}")
        if res[0]["algorithms"][algo]["final"] != res[1]["algorithms"][algo]["final"]:
            row.failures.append(f"{algo}: ranks end with different parameters")
    row.observed = (f"{len(algos)} algorithms: step skipped on both ranks, state untouched, "
                    f"'0.weight' (rank {VICTIM}) reported" if row.passed else "; ".join(row.failures[:3]))


def malformed_payloads(row: Row, cases: int = 4000) -> None:
    with tempfile.TemporaryDirectory() as out:
        r = subprocess.run(_cmd("payloads", out, "--cases", str(cases)), env=_env(60), capture_output=True,
                           text=True, timeout=300)
        res = json.load(open(os.path.join(out, "rank0.json"))) if r.returncode == 0 else {}
    row.facts = {"results": res, "returncode": r.returncode, "stderr": r.stderr[-1500:]}
    if r.returncode != 0:
        row.failures.append(f"the process died with {r.returncode}: {r.stderr[-300:]}")
    else:
        if not res["cap_bites"]:
            row.failures.append("the address-space cap did not stop a 4 GiB allocation (nothing checked)")
        if res["other_count"]:
            row.failures.append(f"{res['other_count']} calls raised something else than ValueError: "
                                f"{res['others'][:3]}")
        if res["rejected"] == 0 or res["decoded"] == 0:
            row.failures.append(f"nothing {'rejected' if res['rejected'] == 0 else 'decoded'}: the mutations are off")
    row.observed = (f"{res.get('cases', 0)} calls: {res.get('rejected', 0)} ValueError, {res.get('decoded', 0)} "
                    f"decoded (undetectable damage), {res.get('other_count', '?')} other; cap +512 MiB")


def foreign_address(row: Row, timeout_s: float = 30.0) -> None:
    np = 2
    ended, res, tails = _launched("store", np, timeout_s)
    row.facts = {"results": res, "logs": tails}
    got = res.get(0, {})
    if not ended or "error" in got or "loopback" not in got:
        row.failures.append(f"the job failed: {got.get('error', tails)}")
    elif got["other"] is None:
        row.skipped = "this host has no non-loopback IPv4 address to connect from"
    else:
        if not got["loopback"]:
            row.failures.append("the store did not accept a connection on loopback (nothing checked)")
        if got["from_other"]:
            row.failures.append(f"the store accepted a connection to {got['other']}")
    row.observed = (row.skipped or f"store reached on 127.0.0.1: {got.get('loopback')}; from {got.get('other')}: "
                    f"{'accepted' if got.get('from_other') else 'refused'}")


def memory_flat(row: Row, steps: int = 300, bound_mib: float = 32.0, timeout_s: float = 30.0) -> None:
    """RSS of every rank: the median of the last tenth of the steps minus the median of the
    tenth after a warm-up fifth. A leak of one 256 KB gradient a step grows 300 steps by 70 MiB."""
    np = 2
    ended, res, tails = _launched("memory", np, timeout_s, "--steps", str(steps), within_s=300)
    row.facts = {"results": {r: {k: v for k, v in g.items() if k != "rss"} for r, g in res.items()}, "logs": tails}
    growth = {}
    for r in range(np):
        rss = res.get(r, {}).get("rss")
        if not ended or not rss:
            row.failures.append(f"rank {r}: {res.get(r, {}).get('error', 'no result')}")
            continue
        w = max(1, steps // 10)
        first = statistics.median(rss[steps // 5: steps // 5 + w])
        last = statistics.median(rss[-w:])
        growth[r] = (last - first) / 2 ** 20
        if growth[r] > bound_mib:
            row.failures.append(f"rank {r}: RSS grew {growth[r]:.1f} MiB over {steps} steps (> {bound_mib:g})")
    row.facts["growth_mib"] = growth
    row.observed = f"RSS growth over {steps} steps: " + ", ".join(f"rank {r} {g:+.1f} MiB" for r, g in growth.items())


@dataclass
class Scenario:
    name: str
    expected: str
    run: Callable[[Row], None]


ROWS = [
    Scenario("killed", "a rank SIGKILLed mid-training: every survivor raises within HIPRESS_TIMEOUT_S, naming it",
             killed),
    Scenario("killed_under_launcher", "hipress.launch exits non-zero and leaves no process behind",
             killed_under_launcher),
    Scenario("killed_under_mpirun", "the same under mpirun (MPI transport): mpirun exits non-zero, no process left",
             killed_under_mpirun),
    Scenario("stopped_briefly", "SIGSTOP then SIGCONT within the timeout: training completes, same parameters "
             "as an uninterrupted run", stopped_briefly),
    Scenario("stopped_too_long", "SIGSTOP beyond the timeout: survivors raise naming it, no hang; continued, "
             "the rank ends too", stopped_too_long),
    Scenario("slowed", "a rank sleeping 0.3 s a step: same parameters as an uninterrupted run, no error", slowed),
    Scenario("uneven_collective", "uneven inputs with hipress.allreduce + hipress.join(): every rank done",
             uneven_collective),
    Scenario("uneven_optimizer", "uneven inputs with DistributedOptimizer + opt.join(): every rank done",
             uneven_optimizer),
    Scenario("nonfinite", "a NaN gradient on one rank, every algorithm: step skipped on every rank, state "
             "untouched, the parameter and rank named", nonfinite_gradient),
    Scenario("mismatched_strategy", "ranks wrapping with different strategies: an error on every rank naming "
             "the strategy and the rank", mismatched_strategy),
    Scenario("mismatched_compression", "ranks wrapping with different compression: an error on every rank "
             "naming the compression and the rank", mismatched_compression),
    Scenario("never_starts", "a rank that never starts: rank 0 raises naming it", never_starts),
    Scenario("malformed_payloads", "mutated and forged payloads through decompress/payload_info: ValueError, "
             "no big allocation, no crash", malformed_payloads),
    Scenario("foreign_address", "a connection to the store from a non-advertised address: refused",
             foreign_address),
    Scenario("memory_flat", "RSS flat over the run (median growth < 32 MiB; 300 steps unless told)", memory_flat),
]
BY_NAME = {s.name: s for s in ROWS}


def run_scenario(name: str, **kw) -> Row:
    """Runs one row (kw: the scenario function's keywords, e.g. steps=); never raises for a failed promise."""
    s = BY_NAME[name]
    row = Row(s.name, s.expected)
    t0 = time.monotonic()
    try:
        s.run(row, **kw)
    except Exception as e:  # noqa: BLE001 (a scenario that broke is a failed row, the table goes on)
        row.failures.append(f"the scenario broke: {_error(e)}")
    row.seconds = time.monotonic() - t0
    return row


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        worker(argv)
        return 0
    p = argparse.ArgumentParser(prog="python -m hipress.bench.faults", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument("--steps-memory", type=int, default=300, help="steps of the memory_flat row")
    a = p.parse_args(argv)
    if a.list:
        for s in ROWS:
            print(f"{s.name:24s} {s.expected}")
        return 0
    names = [n for n in a.only.split(",") if n] or [s.name for s in ROWS]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        p.error(f"unknown scenario(s) {unknown}; known: {', '.join(BY_NAME)}")
    rows = []
    for n in names:
        row = run_scenario(n, **({"steps": a.steps_memory} if n == "memory_flat" else {}))
        rows.append(row)
        if not a.json:
            verdict = "skip" if row.skipped else ("pass" if row.passed else "FAIL")
            print(f"| {row.name} | {row.expected} | {row.observed} | {verdict} | {row.seconds:.1f} s |", flush=True)
            for f in row.failures:
                print(f"|   | | {f} | | |", flush=True)
    if a.json:
        print(json.dumps([asdict(r) | {"passed": r.passed} for r in rows], indent=1, default=str))
    return 0 if all(r.passed for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
