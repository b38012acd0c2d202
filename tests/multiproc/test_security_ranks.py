"""docs/security.md with real ranks started by hipress.launch: rank 0's store (and every
rank's gloo listener) on loopback only, not reachable from this host's other address;
broadcast_object refuses what needs unpickling unless allowed; broadcast_optimizer_state
works across processes. The in-process cases are in tests/unit/test_security.py."""
import json
import os
import sys

import pytest

from hipress.launch import run

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.timeout(180)
def test_launched_job_listens_on_loopback_and_refuses_pickles():
    env = {k: v for k, v in os.environ.items() if k not in ("HIPRESS_JOB_SECRET", "HIPRESS_BIND_ADDR",
                                                            "GLOO_SOCKET_IFNAME", "HIPRESS_TRANSPORT")}
    env.update(HIPRESS_TIMEOUT_S="60", PYTHONPATH=os.path.dirname(os.path.dirname(HERE)) + os.pathsep
               + env.get("PYTHONPATH", ""))
    code, logs = run([sys.executable, os.path.join(HERE, "security_worker.py")], 2, timeout=150, quiet=True,
                     env=env, cwd=HERE)
    assert code == 0, "\n".join(logs)[-4000:]
    res = {}
    for log in logs:
        for line in log.splitlines():
            if line.startswith("RESULT "):
                d = json.loads(line[len("RESULT "):])
                res[d["rank"]] = d
    assert sorted(res) == [0, 1], "\n".join(logs)[-4000:]
    r0, r1 = res[0], res[1]
    assert r0["secret_set"] and r1["secret_set"]  # hipress.launch gave the job a secret
    assert r0["store_listens"] and all(a[0] == "127.0.0.1" for a in r0["store_listens"]), r0["listening"]
    assert r0["store_on_loopback"] is True
    for r in (r0, r1):
        assert r["non_loopback_listeners"] == [], r["listening"]  # neither the store nor gloo
    for r in (r0, r1):
        assert r["plain"] == [5, [0.0, 1.0, 2.0]]
        assert r["unsafe"] == "refused" and r["opt_in"] == 2
    assert r0["before"] != r1["before"]  # the states differed
    assert r1["after"] == r0["after"] == r0["before"]
    if r0["other"] is None:
        pytest.skip("this host has no non-loopback IPv4 address to connect from (the other checks passed)")
    assert r0["store_from_other"] is False  # refused on this host's address r0["other"]
