"""DistributedOptimizer with real ranks (local processes over gloo; MPI where present)."""
import json
import os
import re
import shutil
import sys

import pytest
import torch

from hipress import compression
from hipress.launch import run
from hipress.sync import StateStore, reference
from hipress.torch.optimizer import SPREAD_PARTITION_BYTES
from worker_common import run_ranks_by_hand

HERE = os.path.dirname(os.path.abspath(__file__))
ALGORITHMS = {
    "onebit": {},
    "tbq": {"threshold": 0.01},
    "terngrad": {"bitwidth": 2},
    "dgc": {},
    "graddrop": {},
    "powersgd": {"rank": 2},
}


def launch(tmp_path, np, configs, timeout=240, launcher="local", hosts=1):
    out = tmp_path / f"out{np}"
    out.mkdir()
    cmd = [sys.executable, os.path.join(HERE, "optim_worker.py"), str(out), json.dumps(configs)]
    if launcher == "local":
        code, logs = run(cmd, np, timeout=timeout, quiet=True, hosts=hosts)
    else:  # mpirun
        import subprocess
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        p = subprocess.run(["mpirun", "--oversubscribe", "-np", str(np), *cmd], capture_output=True, text=True,
                           timeout=timeout, env=env)
        code, logs = p.returncode, [p.stdout + p.stderr]
    assert code == 0, "\n".join(logs)[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(np)]


def check_exact_average(results, np):
    for c, cfg_res in enumerate(results[0]):
        for step in range(len(cfg_res["steps"])):
            names = cfg_res["steps"][step]["local"].keys()
            for name in names:
                local = [results[r][c]["steps"][step]["local"][name] for r in range(np)]
                exact = torch.stack(local).double().mean(0).float()
                for r in range(np):
                    got = results[r][c]["steps"][step]["synced"][name]
                    torch.testing.assert_close(got, exact, rtol=1e-6, atol=1e-6,
                                               msg=lambda m: f"{cfg_res['config']} rank {r} {name}: {m}")


def segments_of(tensors):
    """(offset, numel, shape) of each tensor of a fused bucket."""
    offsets = [sum(t.numel() for t in tensors[:i]) for i in range(len(tensors))]
    return [(o, t.numel(), tuple(t.shape)) for o, t in zip(offsets, tensors)]


def check_against_reference(results, np):
    """Every bucket (fused gradients, or one gradient) equals the sequential reference of
    its strategy run on the same local gradients, with state carried across steps."""
    for c, cfg_res in enumerate(results[0]):
        cfg = cfg_res["config"]
        stores = [StateStore(r) for r in range(np)]
        for step in range(len(cfg_res["steps"])):
            for b in cfg_res["buckets"]:
                name, bounds = b["name"], b["bounds"]
                comp = compression.get(cfg["compression"] if b["compressed"] else "none",
                                       **(cfg.get("kwargs", {}) if b["compressed"] else {}))
                grads = [[results[r][c]["steps"][step]["local"][p] for p in b["params"]] for r in range(np)]
                local = [torch.cat([g.reshape(-1) for g in gs]) for gs in grads]
                bf16 = b["wire"] == "torch.bfloat16"
                if b["strategy"] == "allreduce":  # uncompressed through the transport's allreduce: the average
                    want = [torch.stack(local).double().mean(0).float()] * np
                elif comp.lowrank:  # a fused bucket: each matrix on its own
                    want = reference.lowrank(local, comp, stores, name, None, segments=segments_of(grads[0]))
                elif cfg["strategy"] == "ring":
                    want = reference.ring(local, comp, stores, name, bounds)
                elif cfg["strategy"] == "allgather":
                    want = reference.allgather(local, comp, stores, name, bounds, segments=segments_of(grads[0]))
                else:
                    owners = [cfg_res["owners"][f"{name}/p{i}"] for i, (s, e) in enumerate(bounds) if e > s]
                    want = reference.ps(local, comp, stores, name, bounds, owners, segments=segments_of(grads[0]))
                for r in range(np):
                    got = torch.cat([results[r][c]["steps"][step]["synced"][p].reshape(-1) for p in b["params"]])
                    if bf16:  # np roundings to bf16 (2^-9 each) of values and partial sums, / np
                        bound = 2 ** -8 * torch.stack(local).abs().sum(0) + 1e-7
                        assert bool(((got - want[r]).abs() <= bound).all()), f"{cfg} step {step} rank {r} {name}"
                        continue
                    torch.testing.assert_close(got, want[r], rtol=1e-5, atol=1e-6,
                                               msg=lambda m: f"{cfg} step {step} rank {r} {name}: {m}")


@pytest.mark.parametrize("np", [2, 3, 4])
def test_uncompressed_equals_exact_average(tmp_path, np):
    configs = [{"compression": "none", "strategy": s, "passes": p, "steps": 2, "partition_bytes": pb,
                "bucket_bytes": bb}
               for s in ("ring", "ps") for p, pb, bb in ((1, 64 << 20, 0), (2, 1024, 4 << 20))]
    results = launch(tmp_path, np, configs)
    check_exact_average(results, np)
    assert_plain_allreduce(results)


def assert_plain_allreduce(results):
    """Every bucket of every config went through the transport's allreduce (compression none)."""
    used = {b["strategy"] for rank in results for cfg in rank for b in cfg["buckets"]}
    assert used == {"allreduce"}, used


@pytest.mark.parametrize("np", [2, 3])
def test_algorithms_match_reference(tmp_path, np):
    configs = [{"compression": a, "strategy": s, "kwargs": kw, "steps": 2, "partition_bytes": 2048}
               for a, kw in ALGORITHMS.items() for s in ("ring", "ps", "allgather")]
    check_against_reference(launch(tmp_path, np, configs), np)


def test_ps_spreads_a_large_gradient_over_every_rank(tmp_path):
    """Without a plan, a gradient of at least SPREAD_PARTITION_BYTES per rank gets one PS partition
    per rank, each aggregated by a different rank (not all of it by one), and every rank still gets
    the reference's result."""
    np = 3
    big = 3 * SPREAD_PARTITION_BYTES // 4 + 5
    configs = [{"compression": a, "strategy": "ps", "kwargs": ALGORITHMS[a], "steps": 2, "bucket_bytes": 0,
                "big_numel": big} for a in ("terngrad", "onebit", "dgc")]
    results = launch(tmp_path, np, configs)
    check_against_reference(results, np)
    for cfg_res in results[0]:
        (b,) = [b for b in cfg_res["buckets"] if b["name"] == "big"]
        assert len(b["bounds"]) == np and b["bounds"][-1][1] == big
        assert sorted(cfg_res["owners"][f"big/p{i}"] for i in range(np)) == list(range(np))


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")
def test_mpirun_uncompressed_and_compressed(tmp_path):
    configs = [{"compression": "none", "strategy": s, "steps": 1} for s in ("ring", "ps")]
    results = launch(tmp_path, 3, configs, launcher="mpi")
    check_exact_average(results, 3)
    assert_plain_allreduce(results)  # MPI_Iallreduce
    configs = [{"compression": a, "strategy": s, "kwargs": ALGORITHMS[a], "steps": 2, "partition_bytes": 2048}
               for a in ("tbq", "dgc", "powersgd") for s in ("ring", "ps")]
    # a plan under the coordinator: compressed buckets through it, plain ones beside it where MPI runs
    # both at once (MPI_THREAD_MULTIPLE), else through it too; the reference's results either way
    configs.append({"compression": "tbq", "strategy": "ps", "kwargs": {"threshold": 0.01}, "steps": 2,
                    "bucket_bytes": 0, "plan_force": {"a.weight": [False, 2], "big": [True, 3]}, "plan_measure": 0,
                    "coordinator": True})
    out = tmp_path / "compressed"
    out.mkdir()
    check_against_reference(launch(out, 3, configs, launcher="mpi"), 3)


@pytest.mark.parametrize("strategy", ["ring", "ps"])
def test_training_matches_ddp(tmp_path, strategy):
    np = 3
    cmd = [sys.executable, os.path.join(HERE, "ddp_worker.py"), str(tmp_path), strategy, "50"]
    code, logs = run(cmd, np, timeout=240, quiet=True)
    assert code == 0, "\n".join(logs)[-4000:]
    states = [torch.load(tmp_path / f"rank{r}.pt") for r in range(np)]
    for r in range(np):
        for k, v in states[r]["ddp"].items():
            torch.testing.assert_close(states[r]["hipress"][k], v, rtol=1e-4, atol=1e-5)
            assert torch.equal(states[r]["hipress"][k], states[0]["hipress"][k])  # ranks agree exactly


def test_timeline_shows_overlap(tmp_path):
    """Encodes of later layers run while earlier layers are still in backward, and so does their
    communication (read from rank 0's Chrome trace; the worker's first layer, the last gradient, comes
    0.2 s late, so that holds under any load)."""
    path = tmp_path / "tl.{rank}.json"
    env = dict(os.environ, HIPRESS_TIMELINE=str(path))
    cmd = [sys.executable, os.path.join(HERE, "timeline_worker.py"), "tbq"]
    code, logs = run(cmd, 2, timeout=180, quiet=True, env=env)
    assert code == 0, "\n".join(logs)[-4000:]
    events = json.loads((tmp_path / "tl.0.json").read_text())
    sl = [e for e in events if e["ph"] == "X"]
    grads = sorted((e for e in sl if e["tid"] == 2), key=lambda e: e["ts"])
    assert grads, "no gradient-ready events in the timeline"
    # Per step, backward ends at the last gradient-ready event of that step.
    encodes = [e for e in sl if e["tid"] == 0 and e["name"].startswith("encode.")]
    comms = [e for e in sl if e["tid"] == 1]
    n_params = len({e["name"] for e in grads})
    ends_of_backward = [grads[i + n_params - 1]["ts"] + grads[i + n_params - 1]["dur"]
                        for i in range(0, len(grads) - n_params + 1, n_params)]
    first_grad = [grads[i]["ts"] for i in range(0, len(grads) - n_params + 1, n_params)]

    def in_backward(events):
        return [e for e in events for a, b in zip(first_grad, ends_of_backward) if a <= e["ts"] < b]

    assert in_backward(encodes), "no encode task started while backward was still running"
    # (whether an exchange overlaps an encode or decode depends on their durations: TBQ's encodes got
    # 9x faster and under load one run saw none overlap; an exchange inside backward is the overlap
    # that hides communication)
    assert in_backward(comms), "no communication started while backward was still running"


def test_timeline_shows_the_coordinators_slots(tmp_path):
    """With the coordinator, the timeline has a row of its slots: each one's wait for this rank's
    payloads, then its exchange, naming the peers and the bytes moved."""
    path = tmp_path / "tl.{rank}.json"
    env = dict(os.environ, HIPRESS_TIMELINE=str(path))
    cmd = [sys.executable, os.path.join(HERE, "timeline_worker.py"), "tbq", "coordinator"]
    code, logs = run(cmd, 2, timeout=180, quiet=True, env=env)
    assert code == 0, "\n".join(logs)[-4000:]
    events = json.loads((tmp_path / "tl.0.json").read_text())
    assert {"name": "thread_name", "ph": "M", "pid": 0, "tid": 4,
            "args": {"name": "coordinator slots"}} in events
    slots = [e for e in events if e["ph"] == "X" and e["tid"] == 4]
    waits = {int(m[1]): e for e in slots if (m := re.fullmatch(r"slot (\d+): waits for payloads", e["name"]))}
    moves = {int(m[1]): (e, int(m[2])) for e in slots
             if (m := re.fullmatch(r"slot (\d+): to \[1?\] from \[1?\], (\d+) bytes", e["name"]))}
    assert len(waits) + len(moves) == len(slots) and moves and set(moves) == set(waits)
    assert all(e["ts"] >= waits[k]["ts"] + waits[k]["dur"] - 1 for k, (e, _) in moves.items())
    assert sum(b for _, b in moves.values()) > 2 * (8 << 20) // 32  # > one step's TBQ payload: 2 bits of 8 MiB fp32


def test_parameters_differing_across_ranks_are_rejected():
    code, logs = run([sys.executable, os.path.join(HERE, "mismatch_worker.py")], 3, timeout=120, quiet=True)
    assert code == 3, "\n".join(logs)[-3000:]
    text = "\n".join(logs)
    assert "MISMATCH" in text and "rank(s) [1] differ from rank 0" in text


@pytest.mark.parametrize("np,hosts", [(4, 2), (3, 2)])
def test_local_aggregation_uncompressed(tmp_path, np, hosts):
    configs = [{"compression": "none", "strategy": s, "steps": 1} for s in ("ring", "ps")]
    check_exact_average(launch(tmp_path, np, configs, hosts=hosts), np)


@pytest.mark.parametrize("coordinator", [False, True])
def test_local_aggregation_compresses_across_hosts_only(tmp_path, coordinator):
    """4 ranks on 2 hosts: host sums are exact (one fp32 add each), then the
    compressed sync (ring TBQ; PS DGC; low-rank PowerSGD over fused buckets) runs over the
    two host roots, then everything is shared; with the global coordinator on, all three
    levels go through it (host ring, cross-host sync, host broadcast)."""
    np = 4
    configs = [{"compression": "tbq", "strategy": "ring", "kwargs": {"threshold": 0.01}, "steps": 2},
               {"compression": "dgc", "strategy": "ps", "kwargs": ALGORITHMS["dgc"], "steps": 2},
               {"compression": "powersgd", "strategy": "ring", "kwargs": ALGORITHMS["powersgd"], "steps": 2}]
    for cfg in configs:
        cfg["coordinator"] = coordinator
    results = launch(tmp_path, np, configs, hosts=2)
    for c, cfg in enumerate(configs):
        assert all(results[r][c]["hierarchical"] for r in range(np))
        assert all(results[r][c]["coordinated"] == coordinator for r in range(np))
        comp = compression.get(cfg["compression"], **cfg["kwargs"])
        stores = [StateStore(0), StateStore(2)]  # the host roots (world ranks 0 and 2) compress
        res = results[0][c]
        for step in range(2):
            for b in res["buckets"]:
                name, bounds = b["name"], b["bounds"]
                grads = [[results[r][c]["steps"][step]["local"][p] for p in b["params"]] for r in range(np)]
                local = [torch.cat([g.reshape(-1) for g in gs]) for gs in grads]
                host_sums = [local[0] + local[1], local[2] + local[3]]
                if comp.lowrank:
                    want = reference.lowrank(host_sums, comp, stores, name, None, average=False,
                                             segments=segments_of(grads[0]))[0] / np
                elif cfg["strategy"] == "ring":
                    want = reference.ring(host_sums, comp, stores, name, bounds, average=False)[0] / np
                else:
                    owners = [res["owners"][f"{name}/p{i}"] for i, (s, e) in enumerate(bounds) if e > s]
                    want = reference.ps(host_sums, comp, stores, name, bounds, owners, average=False)[0] / np
                for r in range(np):
                    got = torch.cat([results[r][c]["steps"][step]["synced"][p].reshape(-1) for p in b["params"]])
                    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7,
                                               msg=lambda m: f"{cfg['compression']} {name} rank {r}: {m}")


@pytest.mark.parametrize("coordinator", [False, True])
def test_planned_selective_compression(tmp_path, monkeypatch, coordinator):
    """plan: per-gradient compress-or-not and K from the planner (profiled online, cached
    in HIPRESS_PROFILE_DIR), pinned here for two parameters; every gradient matches the
    reference of the decision it got, and every rank holds the same plan. Under the global
    coordinator the compressed buckets go through it and the uncompressed ones through the
    backend's allreduce beside it (gloo runs both at once)."""
    monkeypatch.setenv("HIPRESS_PROFILE_DIR", str(tmp_path / "profiles"))
    np = 3
    configs = [{"compression": "tbq", "strategy": s, "kwargs": {"threshold": 0.01}, "steps": 2, "bucket_bytes": 0,
                "plan_force": {"a.weight": [False, 2], "big": [True, 3]}, "plan_bf16": bf16,
                "plan_measure": 0,  # the model's plan from the first step (not measured against none)
                "coordinator": coordinator}
               for s, bf16 in (("ring", False), ("ps", False), ("allgather", False), ("ring", True))]
    results = launch(tmp_path, np, configs)
    for c in range(len(configs)):
        assert all(results[r][c]["coordinated"] == coordinator for r in range(np))
        # plan_bf16 True: every uncompressed bucket travels as bf16; False: as fp32
        wire = "torch.bfloat16" if configs[c]["plan_bf16"] else "torch.float32"
        assert {b["wire"] for b in results[0][c]["buckets"] if not b["compressed"]} == {wire}
        # a bf16 bucket's gradients are cast as they are copied in: the bucket's buffer is bf16
        assert {b["sent"] for b in results[0][c]["buckets"] if not b["compressed"]} == {wire}
        for b in results[0][c]["buckets"]:  # every rank the same bits, whatever the wire
            for step in range(2):
                got = [torch.cat([results[r][c]["steps"][step]["synced"][p].reshape(-1) for p in b["params"]])
                       for r in range(np)]
                assert all(torch.equal(g, got[0]) for g in got)
        plans = [results[r][c]["buckets"] for r in range(np)]
        assert all(p == plans[0] for p in plans), "ranks planned differently"
        bounds = {b["name"]: b["bounds"] for b in plans[0]}
        compressed = {b["name"]: b["compressed"] for b in plans[0]}
        assert compressed["a.weight"] is False and len(bounds["a.weight"]) == 2
        # uncompressed buckets go through the transport's allreduce, whatever the strategy
        assert {b["strategy"] for b in plans[0] if not b["compressed"]} == {"allreduce"}
        assert compressed["big"] is True and len(bounds["big"]) == 3
    check_against_reference(results, np)
    assert list((tmp_path / "profiles").glob("*.json")), "profile was not cached"


def test_coordinator_matches_reference_all_algorithms(tmp_path):
    """With the global coordinator on, every algorithm and both strategies give the
    results of the reference (which the coordinator-off runs match too). From the third step
    on, each step's exchanges were declared at the end of the step before
    (hipress/comm/coordinator/ahead.py), and every one of steps 3 and 4 was met as predicted."""
    np = 3
    configs = [{"compression": a, "strategy": s, "kwargs": kw, "steps": 4, "partition_bytes": 2048,
                "coordinator": True} for a, kw in ALGORITHMS.items() for s in ("ring", "ps")]
    configs.append({"compression": "none", "strategy": "ring", "steps": 1, "coordinator": True})
    results = launch(tmp_path, np, configs)
    check_against_reference(results, np)
    for c in range(len(configs) - 1):
        for r in range(np):
            stats = results[r][c]["predicted"]
            # predicted at the ends of steps 2, 3 and 4 (the last never met); met in steps 3 and 4
            assert stats["voided"] == 0 and stats["confirmed"] > 0, (configs[c], stats)
            assert stats["predicted"] == 3 * stats["confirmed"] // 2, (configs[c], stats)


@pytest.mark.parametrize("victim", [0, 2])
def test_coordinator_dead_rank_fails_fast(victim, tmp_path):
    """A dead rank (rank 0 hosts the coordinator) ends every other rank with an error
    naming the failure, within the timeout, instead of a hang.

    Load-proof: the error is asserted, not how long the job took (start-up of three torch
    processes on a loaded machine is what an elapsed-time bound mostly measured); a hang
    fails at the 180 s communicate timeout. The ranks start init together (a file barrier
    after importing torch), and HIPRESS_TIMEOUT_S is 30 s, not 8: under load (2 cores, load
    average 15) init's split timed out after 8 s once, before the victim had died. The dead
    rank is noticed at once (a closed connection), so the longer timeout costs nothing."""
    env = dict(os.environ, HIPRESS_TIMEOUT_S="30")
    cmd = [sys.executable, os.path.join(HERE, "coord_fail_worker.py"), str(victim), str(tmp_path)]
    codes, outs = run_ranks_by_hand(cmd, 3, env)
    for r, (code, out) in enumerate(zip(codes, outs)):
        if r == victim:
            assert code == 17
        else:
            print(f"\nrank {r}: {out.strip().splitlines()[-1][:400] if out.strip() else ''}")
            assert code == 3, out[-2000:]
            assert "FAILED-CLEANLY" in out and "coordinator" in out, out[-2000:]
