"""One rank of tests/multiproc/test_security_ranks.py (run by hipress.launch): where this rank
listens, whether rank 0's store is reachable from a non-loopback address of this host, and
broadcast_object / broadcast_optimizer_state between real processes."""
import errno
import hashlib
import ipaddress
import os
import socket
import struct
import sys

import torch
from worker_common import emit

import hipress
from hipress import config
from hipress.comm import world

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "unit"))
from test_security import non_loopback_ipv4  # noqa: E402


class Plain:
    def __init__(self, x):
        self.x = x


def listening_addresses():
    """[(address, port)] of this process's listening TCP sockets (from /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for family, path in ((socket.AF_INET, "/proc/self/net/tcp"), (socket.AF_INET6, "/proc/self/net/tcp6")):
        try:
            with open(path) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            col = row.split()
            if col[3] != "0A" or col[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, hexport = col[1].split(":")
            raw = b"".join(struct.pack("<I", int(hexaddr[i:i + 8], 16)) for i in range(0, len(hexaddr), 8))
            found.append((socket.inet_ntop(family, raw), int(hexport, 16)))
    return found


def is_loopback(addr):
    a = ipaddress.ip_address(addr)
    return a.is_loopback or (a.version == 6 and a.ipv4_mapped is not None and a.ipv4_mapped.is_loopback)


def connects(addr, port):
    try:
        socket.create_connection((addr, port), timeout=5).close()
        return True
    except OSError as e:
        if e.errno not in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH):
            raise
        return False


def digest(sd):
    h = hashlib.sha256()
    for k in sorted(sd["state"]):
        for name in sorted(sd["state"][k]):
            h.update(f"{k}.{name}".encode())
            h.update(sd["state"][k][name].double().numpy().tobytes())
    h.update(repr(sd["param_groups"]).encode())
    return h.hexdigest()[:16]


def main():
    hipress.init()
    r = world.rank()
    port = int(os.environ["MASTER_PORT"])
    other = non_loopback_ipv4()
    res = {"rank": r, "secret_set": bool(config.get("HIPRESS_JOB_SECRET")), "other": other,
           "listening": listening_addresses()}
    res["non_loopback_listeners"] = [a for a in res["listening"] if not is_loopback(a[0])]
    if r == 0:
        res["store_listens"] = [a for a in res["listening"] if a[1] == port]
        res["store_on_loopback"] = connects("127.0.0.1", port)
        res["store_from_other"] = connects(other, port) if other else None

    obj = hipress.broadcast_object({"step": 5, "w": torch.arange(3.0)} if r == 0 else None)
    res["plain"] = [obj["step"], obj["w"].tolist()]
    try:
        hipress.broadcast_object(Plain(1) if r == 0 else None)
        res["unsafe"] = "loaded"
    except hipress.UnsafeObjectError:
        res["unsafe"] = "refused"
    res["opt_in"] = hipress.broadcast_object(Plain(2) if r == 0 else None, allow_pickle=True).x

    torch.manual_seed(r)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
    for _ in range(r + 1):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    res["before"] = digest(opt.state_dict())
    hipress.broadcast_optimizer_state(opt, root_rank=0)
    res["after"] = digest(opt.state_dict())
    emit(res)
    hipress.shutdown()


if __name__ == "__main__":
    main()
