"""Emulated cluster (hipress.bench.cluster): shaping is measured, teardown is checked.

Needs root and iproute2 for everything but the fallback test; skipped otherwise.
"""
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

import pytest
from example_run import procs_with

from hipress.bench import cluster as cl
from hipress.bench.cluster import EmulatedCluster, measure_bandwidth, measure_rtt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_why = "" if os.geteuid() == 0 else "needs root (network namespaces)"
_why = _why or ("" if shutil.which("ip") and shutil.which("tc") else "needs iproute2 (`ip`, `tc`)")
needs_netns = pytest.mark.skipif(bool(_why), reason=_why)
PY = sys.executable


@pytest.fixture(autouse=True)
def _no_forced_fallback(monkeypatch):
    monkeypatch.delenv("HIPRESS_CLUSTER_FALLBACK", raising=False)


# ---------------------------------------------------------------- helpers

def netns_set():
    return set(cl._netns_list())


def root_links():
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def descendants(pid=None):
    pid = pid or os.getpid()
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, p in parent.items() if p in frontier} - out
        out |= frontier
    return {p for p in out if os.path.exists(f"/proc/{p}")}


def snapshot():
    return netns_set(), root_links()


def assert_clean(before, cluster=None, markers=()):
    ns_before, links_before = before
    deadline = time.time() + 5
    while True:
        leftovers = {
            "netns": sorted(netns_set() - ns_before),
            "links": sorted(root_links() - links_before),
            "children": sorted(descendants()),
            "markers": [m for m in markers if procs_with(m)],
        }
        if cluster is not None:
            leftovers["own_netns"] = [n for n in netns_set() if n.startswith(cluster.prefix)]
            leftovers["etc_netns"] = [n for n in os.listdir(cl.NETNS_ETC) if n.startswith(cluster.prefix)] \
                if os.path.isdir(cl.NETNS_ETC) else []
        if not any(leftovers.values()) or time.time() > deadline:
            break
        time.sleep(0.1)
    assert not any(leftovers.values()), leftovers


@pytest.fixture(scope="module")
def shaped():
    if _why:
        pytest.skip(_why)
    before = snapshot()
    c = EmulatedCluster(np=2, bandwidth="200mbit", quiet=True).start()
    assert c.emulated, c.fallback_reason
    yield c
    c.close()
    assert_clean(before, c)


# ---------------------------------------------------------------- shaping (measured)

@needs_netns
@pytest.mark.parametrize("rate_mbit", [200, 1000])
def test_bandwidth_within_15_percent(shaped, rate_mbit):
    shaped.set_link(bandwidth=f"{rate_mbit}mbit", latency=0)
    assert_goodput_near(shaped, rate_mbit, 0, 1, seconds=2)
    if rate_mbit == 200:  # the other direction is shaped too (host1 uplink, host0 downlink)
        assert_goodput_near(shaped, rate_mbit, 1, 0, seconds=1)


def assert_goodput_near(cluster, rate_mbit, src, dst, seconds, tries=3):
    """TCP goodput src -> dst within 15% of the set rate. Never above it (the shaper's cap is
    checked on every try); below it a try may be retried: on a 2-core machine a busy moment
    of the other processes starves the sender (846 Mbit/s at 1 Gbit/s seen once in CI)."""
    got = []
    for _ in range(tries):
        got.append(measure_bandwidth(cluster, seconds=seconds, src=src, dst=dst))
        print(f"\nset {rate_mbit} Mbit/s: measured {got[-1]:.1f} Mbit/s host{src}->host{dst} (TCP goodput)")
        assert got[-1] <= 1.15 * rate_mbit, (rate_mbit, got)
        if abs(got[-1] - rate_mbit) / rate_mbit <= 0.15:
            return
    raise AssertionError(f"set {rate_mbit} Mbit/s, measured {got} Mbit/s host{src}->host{dst}: all below 85%")


@needs_netns
def test_downlink_is_shaped(shaped):
    """Two senders into one host share its downlink: together they get ~the set rate, not 2x."""
    c3 = EmulatedCluster(np=3, bandwidth="200mbit", quiet=True).start()
    try:
        import threading
        res = {}
        ts = [threading.Thread(target=lambda s=s: res.__setitem__(s, measure_bandwidth(c3, 2, src=s, dst=2)))
              for s in (0, 1)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        total = res[0] + res[1]
        print(f"\n2 senders -> 1 host at 200 Mbit/s: {res[0]:.1f} + {res[1]:.1f} = {total:.1f} Mbit/s")
        assert total <= 200 * 1.15, res  # unshaped downlink would give ~2 x 190
        # loose floor: two senders + two receivers on a 2-core machine are CPU-sensitive
        assert total >= 200 * 0.5, res
    finally:
        c3.close()


@needs_netns
def test_latency_adds_rtt(shaped):
    shaped.set_link(bandwidth="1gbit", latency=0)
    base = statistics.median(measure_rtt(shaped, rounds=100))
    try:
        shaped.set_link(bandwidth="1gbit", latency="5ms")
        assert shaped.delay_method in ("netem", "nfqueue"), "no latency backend (netem or iptables) on this machine"
        rtt5 = statistics.median(measure_rtt(shaped, rounds=50))
        shaped.set_link(bandwidth="1gbit", latency="0.2ms")
        rtt02 = statistics.median(measure_rtt(shaped, rounds=200))
    finally:
        shaped.set_link(bandwidth="1gbit", latency=0)
    print(f"\nTCP RTT median ({shaped.delay_method}): base {base * 1e3:.3f} ms, latency 5ms -> {rtt5 * 1e3:.3f} ms, "
          f"latency 0.2ms -> {rtt02 * 1e3:.3f} ms (expected +10 ms / +0.4 ms)")
    assert 9.5e-3 <= rtt5 - base <= 12e-3, (base, rtt5)
    assert 0.38e-3 <= rtt02 - base <= 0.8e-3, (base, rtt02)


# ---------------------------------------------------------------- ranks look like hosts

@needs_netns
def test_rank_environment_and_hostnames(shaped):
    code, outs = shaped.run([PY, "-c", "import os, socket; e = os.environ; print(e['RANK'], e['WORLD_SIZE'], "
                             "e['LOCAL_RANK'], e['LOCAL_WORLD_SIZE'], e['MASTER_ADDR'], e['HIPRESS_HOSTNAME'], "
                             "e['GLOO_SOCKET_IFNAME'], socket.gethostname(), socket.gethostbyname(socket.gethostname()))"],
                            timeout=30)
    assert code == 0, outs
    for r in range(2):
        assert outs[r].split() == [str(r), "2", "0", "1", "10.77.0.1", f"host{r}", f"veth{r}", f"host{r}",
                                   f"10.77.0.{r + 1}"]


@needs_netns
def test_gloo_allreduce_across_hosts(shaped):
    shaped.set_link(bandwidth="1gbit", latency=0)
    script = ("import torch, torch.distributed as dist\n"
              "dist.init_process_group('gloo')\n"
              "t = torch.full((4,), float(dist.get_rank() + 1)); dist.all_reduce(t)\n"
              "print('sum', t.tolist()); dist.destroy_process_group()\n")
    code, outs = shaped.run([PY, "-c", script], timeout=60)
    assert code == 0, outs
    assert all("sum [3.0, 3.0, 3.0, 3.0]" in o for o in outs), outs


# ---------------------------------------------------------------- failure, timeout, signals, cleanup

@needs_netns
def test_failing_rank_stops_others_and_nothing_is_left():
    before = snapshot()
    marker = f"66.{os.getpid()}1"
    script = ("import os, subprocess, sys, time\n"
              f"subprocess.Popen(['sleep', '{marker}'], start_new_session=True)  # escapes the process group\n"
              "r = int(os.environ['RANK'])\n"
              "if r == 1:\n    time.sleep(0.5); sys.exit(3)\n"
              "time.sleep(60)\n")
    with EmulatedCluster(np=3, bandwidth="1gbit", latency="1ms", quiet=True) as c:
        assert c.emulated
        t0 = time.time()
        code, outs = c.run([PY, "-c", script], timeout=30)
        took = time.time() - t0
        assert code == 3, outs
        assert took < 15, took
        for ns in c.rank_ns:  # only the delay daemons may remain between runs
            assert set(cl._netns_pids(ns)) <= {p.pid for p in c._daemons.values()}
        assert not procs_with(marker)
        code, outs = c.run([PY, "-c", "print('again')"], timeout=30)  # the cluster is still usable
        assert code == 0 and all("again" in o for o in outs), outs
    assert_clean(before, c, [marker])


@needs_netns
def test_timeout_stops_everything():
    before = snapshot()
    marker = f"67.{os.getpid()}2"
    with EmulatedCluster(np=2, quiet=True) as c:
        t0 = time.time()
        code, _ = c.run(["sleep", marker], timeout=1)
        assert code == 124
        assert time.time() - t0 < 8
        assert not procs_with(marker)
    assert_clean(before, c, [marker])


@needs_netns
@pytest.mark.parametrize("sig,expected", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_cli_signal_tears_down(sig, expected):
    before = snapshot()
    marker = f"68.{os.getpid()}{int(sig)}"
    p = subprocess.Popen([PY, "-m", "hipress.bench.cluster", "--np", "2", "--bandwidth", "500mbit", "--latency", "1ms",
                          "--", "sleep", marker], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    prefix = f"{cl.PREFIX}{p.pid}-"
    try:
        deadline = time.time() + 20
        while time.time() < deadline and len(procs_with(marker)) < 3:  # the CLI itself + 2 ranks
            time.sleep(0.05)
        assert len(procs_with(marker)) == 3, "ranks did not start"
        assert any(n.startswith(prefix) for n in netns_set())
        inside = [pid for n in netns_set() if n.startswith(prefix) for pid in cl._netns_pids(n)]
        daemons = [d for d in procs_with("--delay-daemon") if d in inside]
        assert len(daemons) == 2
        p.send_signal(sig)
        try:
            out, _ = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # say where teardown stuck (seen once in CI, never reproduced)
            ps = subprocess.run(["ps", "-eo", "pid,pgid,stat,etime,args"], capture_output=True, text=True).stdout
            p.send_signal(signal.SIGUSR1)  # the CLI dumps its Python stacks (faulthandler)
            time.sleep(1)
            p.kill()
            out, _ = p.communicate()
            raise AssertionError(f"the CLI did not exit within 30 s of signal {sig}; its output:\n{out}\n{ps}")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == expected, out
    assert not [n for n in netns_set() if n.startswith(prefix)]
    assert not [d for d in daemons if os.path.exists(f"/proc/{d}")]
    assert_clean(before, None, [marker])


@needs_netns
def test_cli_returns_failing_rank_code():
    p = subprocess.run([PY, "-m", "hipress.bench.cluster", "--np", "2", "--", PY, "-c",
                        "import os, sys, time; r = int(os.environ['RANK']); print('hello from', r); "
                        "time.sleep(0.2 if r == 0 else 30); sys.exit(5)"],
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=60)
    assert p.returncode == 5, p.stdout + p.stderr
    assert "[0] hello from 0" in p.stdout and "[1] hello from 1" in p.stdout


@needs_netns
def test_stale_run_is_cleaned_first():
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert not cl._pid_alive(dead.pid)
    stale = f"{cl.PREFIX}{dead.pid}-0-r0"
    marker = f"69.{os.getpid()}3"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    subprocess.run(["ip", "-n", stale, "link", "add", "veth0", "type", "veth", "peer", "name", "veth1"], check=True)
    os.makedirs(os.path.join(cl.NETNS_ETC, stale), exist_ok=True)
    orphan = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", marker], start_new_session=True)
    try:
        deadline = time.time() + 5
        while not cl._netns_pids(stale) and time.time() < deadline:
            time.sleep(0.02)
        assert cl._netns_pids(stale)
        with EmulatedCluster(np=1, quiet=True) as c:
            assert c.emulated
            assert stale not in netns_set()
            assert not os.path.exists(os.path.join(cl.NETNS_ETC, stale))
            orphan.wait(timeout=5)
            assert not procs_with(marker)
    finally:
        if orphan.poll() is None:
            orphan.kill()
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


# ---------------------------------------------------------------- fallback

def test_fallback_local_processes(monkeypatch):
    monkeypatch.setenv("HIPRESS_CLUSTER_FALLBACK", "1")
    kids_before = descendants()
    with pytest.warns(RuntimeWarning, match="UNSHAPED"):
        c = EmulatedCluster(np=3, bandwidth="1gbit", latency="1ms", quiet=True).start()
    try:
        assert not c.emulated and "HIPRESS_CLUSTER_FALLBACK" in c.fallback_reason
        code, outs = c.run([PY, "-c", "import os; e = os.environ; print(e['RANK'], e['LOCAL_RANK'], "
                            "e['LOCAL_WORLD_SIZE'], e['MASTER_ADDR'], e['HIPRESS_HOSTNAME'])"], timeout=30)
        assert code == 0, outs
        assert [o.split() for o in outs] == [[str(r), "0", "1", "127.0.0.1", f"host{r}"] for r in range(3)]
        code, outs = c.run([PY, "-c", "import os, sys, time; r = int(os.environ['RANK']); "
                            "time.sleep(0.2) if r == 2 else time.sleep(30); sys.exit(7)"], timeout=20)
        assert code == 7
        mbit = measure_bandwidth(c, seconds=0.5, max_bytes=100 << 20)
        assert mbit > 0
    finally:
        c.close()
    assert descendants() - kids_before == set()


@needs_netns
def test_fallback_when_namespace_creation_fails(monkeypatch):
    before = snapshot()
    real_sh = cl._sh

    def failing_sh(args, *a, **k):  # the bridge cannot be created: namespaces exist by then and must go
        if "bridge" in args:
            raise RuntimeError("simulated: bridge not permitted")
        return real_sh(args, *a, **k)

    monkeypatch.setattr(cl, "_sh", failing_sh)
    with pytest.warns(RuntimeWarning, match="simulated"):
        with EmulatedCluster(np=2, quiet=True) as c:
            assert not c.emulated
            code, outs = c.run([PY, "-c", "print('ok')"], timeout=30)
            assert code == 0 and all("ok" in o for o in outs)
    monkeypatch.setattr(cl, "_sh", real_sh)
    assert_clean(before, c)


def test_fallback_when_not_root(monkeypatch):
    monkeypatch.setattr(cl.os, "geteuid", lambda: 1000)
    with pytest.warns(RuntimeWarning, match="not root"):
        with EmulatedCluster(np=2, bandwidth="1gbit", quiet=True) as c:
            assert not c.emulated
            code, outs = c.run([PY, "-c", "import os; print(os.environ['MASTER_ADDR'])"], timeout=30)
    assert code == 0 and all(o.strip() == "127.0.0.1" for o in outs), outs


def test_units():
    assert cl.parse_rate("1gbit") == 1e9 and cl.parse_rate("200mbit") == 2e8 and cl.parse_rate("10mbps") == 8e7
    assert cl.parse_time("0.2ms") == pytest.approx(2e-4) and cl.parse_time("50us") == pytest.approx(5e-5)
    assert cl.parse_rate(None) is None and cl.parse_time(None) == 0
    with pytest.raises(ValueError):
        cl.parse_rate("fast")
