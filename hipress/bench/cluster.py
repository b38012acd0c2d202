"""Emulated cluster: every rank in its own network namespace, behind a shaped link.

    python -m hipress.bench.cluster --np 4 --bandwidth 1gbit --latency 0.2ms -- python train.py

Topology (see docs/cluster.md): one "switch" namespace holds a Linux bridge; each rank r
gets a namespace with a veth pair (``veth{r}`` inside the rank, ``port{r}`` on the bridge)
and the address 10.77.0.{r+1}/24. Bandwidth is a ``tbf`` qdisc on both ends of each
pair (the rank's uplink and its downlink), so every host sends and receives at most the
set rate. ``latency`` is the one-way host-to-host delay (a round trip adds 2x latency):
``netem`` on the downlink where the kernel has it, otherwise an NFQUEUE delay daemon
(iptables rule + this file run with ``--delay-daemon``) that holds each packet arriving
at a rank for ``latency`` before the kernel delivers it. ``--switch-buffer`` makes the
switch's ports shallow (the bytes a downlink queues before it drops), so that several
senders into one host lose packets, as on a shallow-buffered switch.

Each rank gets a torchrun-style environment where it looks like a separate host:
RANK, WORLD_SIZE, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, MASTER_ADDR=<rank 0's address>,
MASTER_PORT, HIPRESS_HOSTNAME=host{r}, GLOO_SOCKET_IFNAME / TP_SOCKET_IFNAME /
OMPI_MCA_btl_tcp_if_include=veth{r}; its UTS hostname is host{r} and /etc/hosts maps
host0..hostN-1 to their addresses.

Everything (namespaces, links, bridge, processes, /etc/netns/<ns>) is removed on exit,
failure, timeout, Ctrl-C and SIGTERM; names carry the prefix ``hpc<pid>-<n>-`` and sets
left by a killed earlier run (owner pid dead) are removed first. Without root or
``ip netns`` (or with HIPRESS_CLUSTER_FALLBACK=1) the ranks run as plain local
processes on loopback, unshaped, with a warning.

This module imports only the standard library, hipress.supervise (the rank supervision it
shares with hipress.launch) and hipress.config (standard library only too), so it can run as
a script (the delay daemon does).
"""
from __future__ import annotations

import argparse
import atexit
import faulthandler
import hashlib
import itertools
import json
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import warnings
from collections import deque
from typing import Dict, List, Optional, Sequence, Tuple, Union

if __name__ == "__main__" and not __package__:  # run as a script (the delay daemon): make hipress importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from hipress import config  # noqa: E402
from hipress.supervise import (Terminated, free_port, restore_signals, stop_groups, supervise,  # noqa: E402
                               terminate_on_signals)

PREFIX = "hpc"                      # common prefix of every namespace this tool creates
NETNS_ETC = "/etc/netns"            # `ip netns exec` bind-mounts /etc/netns/<ns>/* over /etc/*
MASTER_PORT = 29500
_STALE_RE = re.compile(rf"^{PREFIX}(\d+)-")
_counter = itertools.count()

Number = Union[int, float]


# ------------------------------------------------------------------ units
def parse_rate(v: Union[str, Number, None]) -> Optional[float]:
    """'1gbit', '200mbit', '500kbit', '1e9' (bit/s), '125mbps' (bytes/s, as tc) -> bit/s; None/0 -> None."""
    if v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v) or None
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", v)
    if not m:
        raise ValueError(f"bad bandwidth {v!r} (e.g. 1gbit, 200mbit)")
    num, unit = float(m.group(1)), m.group(2).lower()
    bits = {"": 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
            "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}
    if unit not in bits:
        raise ValueError(f"bad bandwidth unit in {v!r}; use bit/kbit/mbit/gbit (or tc's bps = bytes/s)")
    return num * bits[unit] or None


def parse_time(v: Union[str, Number, None]) -> float:
    """'0.2ms', '200us', '1s', 0.001 (seconds) -> seconds; None -> 0."""
    if v is None:
        return 0.0
    if isinstance(v, (int, float)):
        return float(v)
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Zµ]*)\s*", v)
    if not m:
        raise ValueError(f"bad latency {v!r} (e.g. 0.2ms, 50us)")
    scale = {"": 1, "s": 1, "sec": 1, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6, "µs": 1e-6,
             "ns": 1e-9}.get(m.group(2).lower())
    if scale is None:
        raise ValueError(f"bad latency unit in {v!r}; use s/ms/us")
    return float(m.group(1)) * scale


def parse_bytes(v: Union[str, Number, None]) -> Optional[int]:
    """'256k', '1m', '65536' (bytes; k = 1024) -> bytes; None -> None."""
    if v is None or isinstance(v, (int, float)):
        return None if v is None else int(v)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmM]?)[bB]?\s*", v)
    if not m:
        raise ValueError(f"bad size {v!r} (e.g. 256k, 1m, 65536)")
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20}[m.group(2).lower()])


# A GSO packet on the veth pairs is up to 64 KiB: a queue that cannot hold one drops every such packet.
MIN_SWITCH_BUFFER = 64 << 10


# ------------------------------------------------------------------ command helpers


def _sh(args: Sequence[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    p = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"command failed ({p.returncode}): {' '.join(args)}\n{p.stderr.strip()}")
    return p


def _netns_list() -> List[str]:
    p = _sh(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def _netns_pids(ns: str) -> List[int]:
    p = _sh(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_pids(pids: Sequence[int], sig=signal.SIGKILL) -> None:
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _delete_netns(ns: str) -> None:
    """Kills whatever runs inside ns, deletes it (which removes its links) and its /etc/netns dir."""
    for _ in range(50):
        pids = _netns_pids(ns)
        if not pids:
            break
        _kill_pids(pids)
        time.sleep(0.02)
    _sh(["ip", "netns", "del", ns], check=False)
    shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)


def cleanup_stale(verbose: bool = True) -> List[str]:
    """Removes namespaces (and /etc/netns dirs) named hpc<pid>-... whose owning pid is dead."""
    if shutil.which("ip") is None:
        return []
    names = set(_netns_list())
    if os.path.isdir(NETNS_ETC):
        names.update(n for n in os.listdir(NETNS_ETC) if _STALE_RE.match(n))
    removed = []
    for ns in sorted(names):
        m = _STALE_RE.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            _delete_netns(ns)
            removed.append(ns)
    if removed and verbose:
        print(f"[cluster] removed {len(removed)} stale namespaces of dead runs: {' '.join(removed)}", file=sys.stderr)
    return removed


def _netns_usable() -> Tuple[bool, str]:
    if config.get("HIPRESS_CLUSTER_FALLBACK"):
        return False, "HIPRESS_CLUSTER_FALLBACK is set"
    if not sys.platform.startswith("linux"):
        return False, "not Linux"
    if os.geteuid() != 0:
        return False, "not root (network namespaces need CAP_SYS_ADMIN/CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) not found"
    return True, ""


# ------------------------------------------------------------------ the cluster


class EmulatedCluster:
    """np hosts on this machine, each a network namespace behind a shaped link.

    with EmulatedCluster(np=4, bandwidth="1gbit", latency="0.2ms") as c:
        code, outputs = c.run([sys.executable, "train.py"], timeout=600)
        c.set_link(bandwidth="10gbit", latency=0)
        ...

    bandwidth: per-host rate in each direction (uplink and downlink); None = unshaped.
    latency: one-way host-to-host delay; a round trip adds 2*latency. 0/None = none.
    switch_buffer: bytes the switch's port queues for a host's downlink before it drops packets
    (a shallow-buffered switch, where several senders into one host lose packets: TCP incast);
    None = a deep queue (a bandwidth-delay product + 20 ms, at least 1 MiB). Needs a bandwidth.
    c.emulated is False when it fell back to local processes on loopback.
    c.delay_method is 'netem', 'nfqueue' or None (no latency emulated).
    """

    def __init__(self, np: int, bandwidth: Union[str, Number, None] = None, latency: Union[str, Number, None] = None,
                 subnet: str = "10.77.0", quiet: bool = False, switch_buffer: Union[str, Number, None] = None):
        if np < 1 or np > 250:
            raise ValueError(f"np must be in 1..250, got {np}")
        self.switch_buffer = parse_bytes(switch_buffer)
        if self.switch_buffer is not None and self.switch_buffer < MIN_SWITCH_BUFFER:
            raise ValueError(f"switch_buffer must be at least {MIN_SWITCH_BUFFER} bytes (one GSO packet), "
                             f"got {self.switch_buffer}")
        if not re.fullmatch(r"\d+\.\d+\.\d+", subnet):
            raise ValueError(f"subnet is the first three octets of a private /24, e.g. 10.77.0 (got {subnet!r})")
        self.np = np
        self.subnet = subnet
        self.quiet = quiet
        self.bandwidth = parse_rate(bandwidth)
        self.latency = parse_time(latency)
        self._check_shaping(self.bandwidth)
        self.prefix = f"{PREFIX}{os.getpid()}-{next(_counter)}-"
        self.switch_ns = self.prefix + "sw"
        self.rank_ns = [f"{self.prefix}r{r}" for r in range(np)]
        self.emulated = False
        self.delay_method: Optional[str] = None
        self.fallback_reason = ""
        self._created: List[str] = []
        self._daemons: Dict[int, subprocess.Popen] = {}
        self._iptables: Optional[str] = None
        self._started = self._closed = False
        self._old_handlers: Dict[int, object] = {}  # replaced by terminate_on_signals() while started
        self._set_bw = self._set_lat = None
        self._wake_latency_fd: Optional[int] = None

    # ---- addresses and names
    def address(self, rank: int) -> str:
        return f"{self.subnet}.{rank + 1}" if self.emulated else "127.0.0.1"

    def ifname(self, rank: int) -> str:
        return f"veth{rank}" if self.emulated else "lo"

    @property
    def namespaces(self) -> List[str]:
        return list(self._created)

    # ---- lifecycle
    def __enter__(self) -> "EmulatedCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> "EmulatedCluster":
        if self._started:
            return self
        self._started = True
        atexit.register(self.close)
        self._old_handlers = terminate_on_signals()
        ok, why = _netns_usable()
        if ok:
            cleanup_stale(verbose=not self.quiet)
            try:
                self._create()
                self.emulated = True
                self._wake_latency_fd = _hold_zero_wake_latency()
            except Exception as e:  # noqa: BLE001 - any failure -> clean up and fall back
                self._destroy()
                ok, why = False, f"creating namespaces failed: {e}"
        if not ok:
            self.fallback_reason = why
            warnings.warn(f"hipress.bench.cluster: network namespaces unavailable ({why}); running ranks as plain "
                          f"local processes on 127.0.0.1, UNSHAPED (bandwidth/latency not emulated)",
                          RuntimeWarning, stacklevel=2)
            return self
        self.set_link(self.bandwidth, self.latency, _force=True)
        return self

    def close(self) -> None:
        if self._closed or not self._started:
            return
        self._closed = True
        # no signal may interrupt teardown (a second Ctrl-C would otherwise leave things behind)
        masked = {}
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                try:
                    masked[s] = signal.signal(s, signal.SIG_IGN)
                except (ValueError, OSError):
                    pass
        try:
            self._stop_daemons()
            self._destroy()
            if self._wake_latency_fd is not None:
                os.close(self._wake_latency_fd)  # drops the request
                self._wake_latency_fd = None
        finally:
            for s, h in masked.items():
                signal.signal(s, h)
            restore_signals(self._old_handlers)
            try:
                atexit.unregister(self.close)
            except Exception:  # noqa: BLE001
                pass

    def _create(self) -> None:
        sw = self.switch_ns
        _sh(["ip", "netns", "add", sw])
        self._created.append(sw)
        _sh(["ip", "-n", sw, "link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0"])
        _sh(["ip", "-n", sw, "link", "set", "br0", "up"])
        hosts = "127.0.0.1 localhost\n::1 localhost\n" + "".join(
            f"{self.subnet}.{r + 1} host{r}\n::ffff:{self.subnet}.{r + 1} host{r}\n"  # v4-mapped: reverse lookups
            for r in range(self.np))                                                # of dual-stack servers (c10d)
        for r, ns in enumerate(self.rank_ns):
            _sh(["ip", "netns", "add", ns])
            self._created.append(ns)
            os.makedirs(os.path.join(NETNS_ETC, ns), exist_ok=True)
            with open(os.path.join(NETNS_ETC, ns, "hosts"), "w") as f:
                f.write(hosts)
            _sh(["ip", "link", "add", f"veth{r}", "netns", ns, "type", "veth", "peer", "name", f"port{r}",
                 "netns", sw])
            _sh(["ip", "-n", sw, "link", "set", f"port{r}", "master", "br0"])
            _sh(["ip", "-n", sw, "link", "set", f"port{r}", "up"])
            _sh(["ip", "-n", ns, "addr", "add", f"{self.subnet}.{r + 1}/24", "dev", f"veth{r}"])
            _sh(["ip", "-n", ns, "link", "set", f"veth{r}", "up"])
            _sh(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _destroy(self) -> None:
        for ns in reversed(self._created):
            _delete_netns(ns)
        self._created.clear()
        try:
            os.rmdir(NETNS_ETC)  # only if empty (i.e. nothing but ours was ever there)
        except OSError:
            pass

    # ---- shaping
    def _delay_backend(self) -> Optional[str]:
        forced = config.get("HIPRESS_CLUSTER_DELAY")
        if forced != "auto":
            return None if forced == "none" else forced.split("-")[0]  # nfqueue-python: nfqueue's Python daemon
        if _sh(["tc", "-n", self.switch_ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
               check=False).returncode == 0:
            _sh(["tc", "-n", self.switch_ns, "qdisc", "del", "dev", "lo", "root"], check=False)
            return "netem"
        if shutil.which("iptables") or shutil.which("iptables-legacy"):
            return "nfqueue"
        return None

    def set_link(self, bandwidth: Union[str, Number, None] = None, latency: Union[str, Number, None] = None,
                 _force: bool = False) -> None:
        """Re-shapes every host's link (both directions) without re-creating the namespaces.

        Call between runs: packets in flight may be dropped while the qdiscs are replaced.
        """
        bw, lat = parse_rate(bandwidth), parse_time(latency)
        self._check_shaping(bw)
        self.bandwidth, self.latency = bw, lat
        if not self._started:  # applied by start()
            return
        if not self.emulated:
            if bw or lat:
                warnings.warn("hipress.bench.cluster: fallback mode, set_link has no effect (links are unshaped)",
                              RuntimeWarning, stacklevel=2)
            return
        if not _force and (bw, lat) == (self._set_bw, self._set_lat):
            return
        if lat > 0 and self.delay_method is None:
            self.delay_method = self._delay_backend()
            if self.delay_method is None:
                warnings.warn("hipress.bench.cluster: the kernel has no netem and iptables (for the NFQUEUE delay) is "
                              "not installed: latency is NOT emulated", RuntimeWarning, stacklevel=2)
        use_netem = lat > 0 and self.delay_method == "netem"
        for r, ns in enumerate(self.rank_ns):
            self._shape(ns, f"veth{r}", bw, 0.0, lat)                       # uplink
            self._shape(self.switch_ns, f"port{r}", bw, lat if use_netem else 0.0, lat,  # downlink (+ netem delay)
                        self.switch_buffer)
        if self.delay_method == "nfqueue":
            self._stop_daemons()
            if lat > 0:
                self._start_daemons(lat)
        self._set_bw, self._set_lat = bw, lat

    def _check_shaping(self, bw: Optional[float]) -> None:
        """Refuses a link without a bandwidth under switch_buffer, at start or in set_link."""
        if self.switch_buffer is not None and not bw:
            raise ValueError("switch_buffer needs a bandwidth: an unshaped link never queues")

    def _shape(self, ns: str, dev: str, bw: Optional[float], netem_delay: float, lat: float,
               queue: Optional[int] = None) -> None:
        _sh(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
        tbf_parent = ["root", "handle", "1:"]
        if netem_delay > 0:
            pkts = int(max(1000, (bw or 10e9) / 8 * (netem_delay + 0.01) / 1500))
            _sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                 f"{netem_delay * 1e6:.0f}us", "limit", str(pkts)])
            tbf_parent = ["parent", "1:1", "handle", "10:"]
        if bw:
            rate_bytes = bw / 8
            burst = int(max(131072, rate_bytes * 0.001))            # >= one 64 KiB GSO packet, ~1 ms of tokens
            limit = queue or int(max(1 << 20, rate_bytes * (2 * lat + 0.02)))  # a BDP + 20 ms of queue
            _sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, *tbf_parent, "tbf", "rate", f"{int(bw)}bit",
                 "burst", str(burst), "limit", str(limit)])

    def _iptables_cmd(self) -> str:
        if self._iptables is None:
            self._iptables = shutil.which("iptables") or shutil.which("iptables-legacy") or "iptables"
        return self._iptables

    def _start_daemons(self, lat: float) -> None:
        ipt = self._iptables_cmd()
        native = None if config.get("HIPRESS_CLUSTER_DELAY") == "nfqueue-python" else native_delay_daemon()
        daemon = [native] if native else [sys.executable, os.path.abspath(__file__)]
        for r, ns in enumerate(self.rank_ns):
            rule = ["INPUT", "-i", f"veth{r}", "-j", "NFQUEUE", "--queue-num", "0", "--queue-bypass"]
            if _sh(["ip", "netns", "exec", ns, ipt, "-C", *rule], check=False).returncode != 0:
                _sh(["ip", "netns", "exec", ns, ipt, "-A", *rule])
            p = subprocess.Popen(["ip", "netns", "exec", ns, *daemon, "--delay-daemon", "0", repr(lat)],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, start_new_session=True)
            self._daemons[r] = p
        for r, p in self._daemons.items():
            line = ""
            ready, _, _ = select.select([p.stdout], [], [], 10)
            if ready:
                line = p.stdout.readline()
            if line.strip() != "ready":
                err = p.stderr.read() if p.poll() is not None else "(no answer in 10 s)"
                self._stop_daemons()
                raise RuntimeError(f"NFQUEUE delay daemon for rank {r} failed: {line}{err}")

    def _stop_daemons(self) -> None:
        procs = list(self._daemons.values())
        self._daemons.clear()
        stop_groups(procs, grace=2.0)
        for p in procs:
            for s in (p.stdout, p.stderr):
                if s:
                    s.close()

    # ---- running things inside
    def rank_env(self, rank: int, env: Optional[Dict[str, str]] = None, port: int = MASTER_PORT) -> Dict[str, str]:
        e = dict(os.environ if env is None else env)
        ifname = self.ifname(rank)
        e.update(RANK=str(rank), WORLD_SIZE=str(self.np), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                 MASTER_ADDR=self.address(0), MASTER_PORT=str(port), HIPRESS_HOSTNAME=f"host{rank}",
                 GLOO_SOCKET_IFNAME=ifname, TP_SOCKET_IFNAME=ifname, NCCL_SOCKET_IFNAME=ifname,
                 OMPI_MCA_btl_tcp_if_include=ifname, OMPI_MCA_oob_tcp_if_include=ifname,
                 PYTHONUNBUFFERED="1")
        return e

    def popen(self, rank: int, cmd: Sequence[str], env: Optional[Dict[str, str]] = None, **kw) -> subprocess.Popen:
        """Starts cmd as host `rank` (inside its namespace; hostname host{rank}) in a new session."""
        if not self._started:
            self.start()
        full = list(cmd)
        if self.emulated:
            pre = ["ip", "netns", "exec", self.rank_ns[rank]]
            if shutil.which("unshare"):  # own UTS namespace so gethostname() == host{r}
                pre += ["unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', f"host{rank}"]
            full = pre + full
        kw.setdefault("start_new_session", True)
        return subprocess.Popen(full, env=env if env is not None else dict(os.environ), **kw)

    def run(self, cmd: Sequence[str], timeout: Optional[float] = None, env: Optional[Dict[str, str]] = None,
            quiet: Optional[bool] = None, cwd: Optional[str] = None) -> Tuple[int, List[str]]:
        """Runs cmd once per rank, each as its own host. Returns (code, [output per rank]).

        code: 0 if every rank succeeded, else the first failing rank's exit code (124 on
        timeout). Every rank (and anything it left running in its namespace) is stopped
        before this returns; the namespaces stay for the next run.
        """
        if not self._started:
            self.start()
        quiet = self.quiet if quiet is None else quiet
        port = MASTER_PORT if self.emulated else free_port()
        return supervise(lambda r, **io: self.popen(r, cmd, env=self.rank_env(r, env, port), stdin=subprocess.DEVNULL,
                                                    cwd=cwd, **io),
                         self.np, timeout, quiet=quiet, tag="cluster", after_stop=self._sweep_namespaces)

    def _sweep_namespaces(self) -> None:
        """Kills anything still running in the rank namespaces (e.g. daemonized children), except delay daemons."""
        if not self.emulated:
            return
        keep = {p.pid for p in self._daemons.values()}
        for ns in self.rank_ns:
            for _ in range(50):
                pids = [p for p in _netns_pids(ns) if p not in keep]
                if not pids:
                    break
                _kill_pids(pids)
                time.sleep(0.02)


# ------------------------------------------------------------------ measurements

_BW_SERVER = r"""
import socket, sys, time, json
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 0)); s.listen(1)
s.settimeout(float(sys.argv[2]) + 10)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.settimeout(float(sys.argv[2]) + 10)
buf = bytearray(1 << 20); n = 0; t0 = t1 = None
while True:
    k = c.recv_into(buf)
    if not k:
        break
    t1 = time.perf_counter()
    if t0 is None:
        t0 = t1          # the first chunk only starts the clock
    else:
        n += k
print(json.dumps({"bytes": n, "seconds": (t1 - t0) if t0 else 0.0}), flush=True)
"""

_BW_CLIENT = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
seconds, limit = float(sys.argv[3]), int(sys.argv[4])
data = memoryview(b"\0" * (256 << 10)); sent = 0; end = time.perf_counter() + seconds
while time.perf_counter() < end and sent < limit:
    c.sendall(data); sent += len(data)
c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
"""

_RTT_SERVER = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 0)); s.listen(1)
s.settimeout(30)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.settimeout(30); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    d = c.recv(64)
    if not d:
        break
    c.sendall(d)
"""

_RTT_CLIENT = r"""
import socket, sys, time, json
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
ts = []
for i in range(int(sys.argv[3])):
    t = time.perf_counter(); c.sendall(b"x")
    if not c.recv(64):
        break
    ts.append(time.perf_counter() - t)
c.close()
print(json.dumps(ts), flush=True)
"""


def _pair(cluster: EmulatedCluster, server_code: str, server_args: List[str], client_code: str,
          client_args, src: int, dst: int, timeout: float) -> str:
    srv = cluster.popen(dst, [sys.executable, "-c", server_code, cluster.address(dst), *server_args],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    cli = None
    try:
        ready, _, _ = select.select([srv.stdout], [], [], 15)
        port = srv.stdout.readline().strip() if ready else ""
        if not port.isdigit():
            raise RuntimeError(f"measurement server did not start: {port} {srv.stderr.read() if srv.poll() else ''}")
        cli = cluster.popen(src, [sys.executable, "-c", client_code, cluster.address(dst), port, *client_args(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        out, err = cli.communicate(timeout=timeout)
        if cli.returncode != 0:
            raise RuntimeError(f"measurement client failed: {err.strip()}")
        sout, serr = srv.communicate(timeout=10)
        if srv.returncode != 0:
            raise RuntimeError(f"measurement server failed: {serr.strip()}")
        return out if out.strip() else sout
    finally:
        stop_groups([p for p in (srv, cli) if p is not None], grace=1.0)
        for p in (srv, cli):
            if p is not None:
                for s in (p.stdout, p.stderr):
                    if s:
                        s.close()


def measure_bandwidth(cluster: EmulatedCluster, seconds: float = 2.0, src: int = 0, dst: int = 1,
                      max_bytes: Optional[int] = None) -> float:
    """One TCP stream from host src to host dst for ~seconds; returns the goodput in Mbit/s.

    Sends at most max_bytes (default: 2x what the set bandwidth allows in `seconds`, or
    4 GiB unshaped) and stops after `seconds` either way. TCP/IP headers are not
    counted, so a 1500-byte MTU link shows ~95% of its line rate.
    """
    if max_bytes is None:
        max_bytes = int(cluster.bandwidth / 8 * seconds * 2) if cluster.bandwidth else 4 << 30
    out = _pair(cluster, _BW_SERVER, [str(seconds)], _BW_CLIENT,
                lambda port: [str(seconds), str(max_bytes)], src, dst, timeout=seconds + 30)
    # the client prints nothing; _pair returned the server's line
    res = json.loads(out.strip().splitlines()[-1])
    return res["bytes"] * 8 / res["seconds"] / 1e6 if res["seconds"] > 0 else 0.0


def measure_rtt(cluster: EmulatedCluster, rounds: int = 100, src: int = 0, dst: int = 1) -> List[float]:
    """TCP ping-pong (1 byte, TCP_NODELAY) between hosts src and dst; returns the round trips in seconds."""
    out = _pair(cluster, _RTT_SERVER, [], _RTT_CLIENT, lambda port: [str(rounds)], src, dst, timeout=60)
    return json.loads(out.strip().splitlines()[-1])


# ------------------------------------------------------------------ NFQUEUE delay daemon
DAEMON_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "delay_daemon.c")


def native_delay_daemon() -> Optional[str]:
    """The compiled delay daemon (delay_daemon.c, the same protocol as :func:`_delay_daemon`),
    built on first use into the user's cache (``$XDG_CACHE_HOME/hipress``, else ~/.cache/hipress)
    under a name that carries its source's hash; None, with a warning, where there is no C
    compiler or the build fails (the Python daemon then runs: the same delays, at about 46 us of
    CPU per packet where the compiled one spends a few, on the CPUs the ranks share)."""
    try:
        with open(DAEMON_SOURCE, "rb") as f:
            source = f.read()
    except OSError as e:
        warnings.warn(f"hipress.bench.cluster: {DAEMON_SOURCE} unreadable ({e}); the delay daemon runs in Python",
                      RuntimeWarning, stacklevel=2)
        return None
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hipress")
    binary = os.path.join(cache, f"delay_daemon-{hashlib.sha256(source).hexdigest()[:16]}")
    if os.access(binary, os.X_OK):
        return binary
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    why = "no C compiler (cc, gcc or $CC)"
    if cc:
        tmp = f"{binary}.{os.getpid()}.tmp"  # renamed into place: concurrent builds do not collide
        try:
            os.makedirs(cache, exist_ok=True)
            r = subprocess.run([cc, "-O2", "-o", tmp, DAEMON_SOURCE], capture_output=True, text=True)
            if r.returncode == 0:
                os.replace(tmp, binary)
                return binary
            why = f"{cc} failed: {(r.stderr or r.stdout).strip()[:300]}"
        except OSError as e:  # an unwritable cache, a compiler that cannot be run
            why = f"{cc}: {e}"
    warnings.warn(f"hipress.bench.cluster: cannot build the delay daemon ({why}); it runs in Python, "
                  f"on more of the CPUs that the ranks share", RuntimeWarning, stacklevel=2)
    return None


# The Python daemon. Runs inside one rank namespace: receives the metadata (not the payload) of each packet the
# iptables NFQUEUE rule queues, and accepts it `delay` seconds after it arrived. Packet ids
# are sequential, so one batch verdict accepts every packet that is due.

_NFNL_SUBSYS_QUEUE = 3
_NFQNL_MSG_PACKET, _NFQNL_MSG_CONFIG, _NFQNL_MSG_VERDICT_BATCH = 0, 2, 3


def _hold_zero_wake_latency() -> Optional[int]:
    """Asks the kernel (PM QoS) to keep idle CPUs out of halt while the returned fd is open.

    On a VM an idle vCPU halts and is woken by the host: 0.1-0.5 ms per wake-up, seen here as
    a 0.2 ms loopback-pair RTT (0.016 ms with the request held) and +0.8-1.9 ms instead of
    +0.4 ms for a 0.2 ms NFQUEUE delay, whose daemon wakes once per packet burst. A wire does
    not pay that; with the request held the emulated link does not either. None where the
    kernel has no such device or it cannot be opened (then the link is as before).
    """
    try:
        fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        os.write(fd, struct.pack("=i", 0))
    except OSError:
        os.close(fd)
        return None
    return fd


def _nlattr(t: int, payload: bytes) -> bytes:
    n = 4 + len(payload)
    return struct.pack("=HH", n, t) + payload + b"\0" * ((4 - n % 4) % 4)


def _nfq_msg(mtype: int, qnum: int, attrs: Sequence[bytes], flags: int = 1, seq: int = 0) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(qnum)) + b"".join(attrs)
    return struct.pack("=IHHII", 16 + len(body), (_NFNL_SUBSYS_QUEUE << 8) | mtype, flags, seq, 0) + body


def _delay_daemon(qnum: int, delay: float) -> int:
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)  # it plays the part of the wire: keep its timing tight
    except OSError:
        pass
    try:  # default 50 us timer slack would add to every delay
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK, 1 ns
    except Exception:  # noqa: BLE001
        pass
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)  # NETLINK_NETFILTER
    try:
        s.setsockopt(socket.SOL_SOCKET, 33, 32 << 20)  # SO_RCVBUFFORCE
    except OSError:
        pass
    s.setsockopt(270, 5, 1)  # SOL_NETLINK, NETLINK_NO_ENOBUFS: a lost notice is covered by the next batch verdict
    s.bind((0, 0))
    flags = 1 | 4  # NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO (no segmentation, accept when full)
    config = [
        [_nlattr(1, struct.pack("!BBH", 1, 0, socket.AF_INET))],               # CMD: BIND
        [_nlattr(2, struct.pack("!IB", 0, 1))],                                 # PARAMS: copy metadata only
        [_nlattr(3, struct.pack("!I", 1 << 17))],                               # QUEUE_MAXLEN
        [_nlattr(5, struct.pack("!I", flags)), _nlattr(4, struct.pack("!I", flags))],  # FLAGS, MASK
    ]
    for i, attrs in enumerate(config):
        s.send(_nfq_msg(_NFQNL_MSG_CONFIG, qnum, attrs, flags=1 | 4, seq=i + 1))  # REQUEST | ACK
        r = s.recv(65536)
        if struct.unpack_from("=H", r, 4)[0] == 2:  # NLMSG_ERROR
            err = struct.unpack_from("=i", r, 16)[0]
            if err:
                print(f"nfqueue config step {i}: {os.strerror(-err)}", file=sys.stderr)
                return 1
    stop: List[int] = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    signal.signal(signal.SIGINT, lambda *a: stop.append(1))
    pending: deque = deque()
    packet_type = (_NFNL_SUBSYS_QUEUE << 8) | _NFQNL_MSG_PACKET

    def accept_upto(pid: int) -> None:
        s.send(_nfq_msg(_NFQNL_MSG_VERDICT_BATCH, qnum, [_nlattr(2, struct.pack("!II", 1, pid))]))  # NF_ACCEPT

    # A timed wait returns late by a roughly fixed amount (timer exit and wake-up, ~35 us on
    # the VM this was written on, vs 0.2 ms delays): aim that much early so packets leave on time.
    lateness = []
    for _ in range(30):
        t0 = time.monotonic()
        select.select([], [], [], 1e-4)
        lateness.append(time.monotonic() - t0 - 1e-4)
    early = min(sorted(lateness)[len(lateness) // 2], delay / 4)
    print("ready", flush=True)
    while not stop:
        timeout = max(0.0, pending[0][0] - early - time.monotonic()) if pending else 0.2
        try:
            readable, _, _ = select.select([s], [], [], timeout)
        except InterruptedError:
            continue
        if readable:
            due = time.monotonic() + delay
            while True:
                try:
                    buf = s.recv(1 << 20, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    break
                off = 0
                while off + 16 <= len(buf):
                    length, mtype = struct.unpack_from("=IH", buf, off)
                    if length < 16:
                        break
                    if mtype == packet_type:
                        a = off + 20
                        while a + 4 <= off + length:
                            alen, atype = struct.unpack_from("=HH", buf, a)
                            if atype & 0x7FFF == 1:  # NFQA_PACKET_HDR: be32 id, be16 proto, u8 hook
                                pending.append((due, struct.unpack_from("!I", buf, a + 4)[0]))
                                break
                            if alen < 4:
                                break
                            a += (alen + 3) & ~3
                    off += (length + 3) & ~3
        now = time.monotonic() + early
        last = None
        while pending and pending[0][0] <= now:
            last = pending.popleft()[1]
        if last is not None:
            accept_upto(last)
    if pending:
        accept_upto(pending[-1][1])
    return 0


# ------------------------------------------------------------------ CLI


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--delay-daemon"]:
        return _delay_daemon(int(argv[1]), float(argv[2]))
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` shows where a run is stuck
    ap = argparse.ArgumentParser(prog="python -m hipress.bench.cluster", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-np", "--np", type=int, default=config.get("HIPRESS_NP"), help="number of hosts")
    ap.add_argument("--bandwidth", default=None, help="per-host rate each way, e.g. 1gbit, 200mbit (default: unshaped)")
    ap.add_argument("--latency", default=None, help="one-way host-to-host delay, e.g. 0.2ms (RTT = 2x)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds before every rank is stopped (exit 124)")
    ap.add_argument("--subnet", default="10.77.0", help="first three octets of the private /24 used inside")
    ap.add_argument("--switch-buffer", default=None,
                    help="bytes a switch port queues for its host before dropping, e.g. 256k (default: deep)")
    ap.add_argument("--measure", action="store_true", help="print measured bandwidth/RTT between hosts 0 and 1 first")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs (after --)")
    a = ap.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd and not a.measure:
        ap.error("no command given (e.g. python -m hipress.bench.cluster --np 4 --bandwidth 1gbit -- python train.py)")
    try:
        with EmulatedCluster(a.np, a.bandwidth, a.latency, subnet=a.subnet, switch_buffer=a.switch_buffer) as c:
            where = (f"{a.np} namespaces {c.prefix}r*, {c.subnet}.1-{a.np}, bandwidth={a.bandwidth or 'unshaped'}, "
                     f"latency={a.latency or 0} ({c.delay_method or 'none'})"
                     + (f", switch buffer {c.switch_buffer} bytes" if c.switch_buffer else "")) if c.emulated else "fallback (loopback)"
            print(f"[cluster] {where}", file=sys.stderr)
            if a.measure and a.np >= 2:
                mbit = measure_bandwidth(c, 2.0)
                rtt = sorted(measure_rtt(c, 100))
                print(f"[cluster] host0->host1: {mbit:.1f} Mbit/s goodput, TCP RTT median {rtt[len(rtt) // 2] * 1e3:.3f} ms",
                      file=sys.stderr)
            if not cmd:
                return 0
            code, _ = c.run(cmd, timeout=a.timeout)
            return code
    except KeyboardInterrupt:
        print("[cluster] interrupted; everything stopped and removed", file=sys.stderr)
        return 130
    except Terminated as t:
        print("[cluster] terminated; everything stopped and removed", file=sys.stderr)
        return t.code


if __name__ == "__main__":
    sys.exit(main())
