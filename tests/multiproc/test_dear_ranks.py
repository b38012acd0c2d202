"""strategy="dear" with real ranks (local processes over gloo): the same parameters as
strategy="ring" at every forward, and checkpoints that resume identically."""

import pytest
import torch

from worker_common import launch_worker

STEPS = 5


def launch(tmp_path, np, configs, timeout=300):
    return launch_worker("dear_worker.py", tmp_path, np, configs, timeout)


def assert_same(got, want, what):
    assert got.keys() == want.keys(), what
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6, msg=lambda m: f"{what} {name}: {m}")


def check_matches_ring(results, np, pairs):
    """pairs: (index of the ring config, index of the dear config) in the launched list."""
    for ring_i, dear_i in pairs:
        for r in range(np):
            ring, dear = results[r][ring_i], results[r][dear_i]
            what = f"rank {r} {dear['config']}"
            assert sorted(dear["used"]) == list(range(STEPS))
            for step in range(STEPS):
                assert_same(dear["used"][step], ring["used"][step], f"{what} forward {step}")
            assert_same(dear["final"], ring["final"], f"{what} final")
            # every rank holds the same parameters
            assert_same(dear["final"], results[0][dear_i]["final"], f"{what} vs rank 0")
        # the parameters moved: a comparison of untouched models would prove nothing
        first, last = results[0][dear_i]["used"][0], results[0][dear_i]["final"]
        assert all(not torch.equal(first[n], last[n]) for n in first), dear["config"]


def configs_for(optimizer, scheduler, compression="none", **extra):
    base = {"optimizer": optimizer, "scheduler": scheduler, "steps": STEPS, "compression": compression, **extra}
    return [dict(base, strategy="ring"), dict(base, strategy="dear")]


@pytest.mark.parametrize("np", [2, 3])
def test_dear_matches_ring_uncompressed(tmp_path, np):
    configs = (configs_for("sgd", "step") + configs_for("adamw", "lambda", partition_bytes=256)
               + configs_for("adamw", "step"))
    results = launch(tmp_path, np, configs)
    check_matches_ring(results, np, [(0, 1), (2, 3), (4, 5)])
    for r in range(np):
        for ring, dear in [(0, 1), (2, 3), (4, 5)]:
            # One checking round a step, as ring's: the step's first reduce-scatter compares the
            # bucket layout, and its other reduce-scatters and all-gathers skip their rounds
            # (several buckets here: bucket_bytes=512, partition_bytes=256 in the second pair).
            assert list(results[r][dear]["rounds"].values()) == [1] * (STEPS - 1), results[r][dear]["rounds"]
            assert results[r][dear]["rounds"] == results[r][ring]["rounds"]


@pytest.mark.slow
def test_dear_matches_ring_uncompressed_4_ranks(tmp_path):
    configs = configs_for("sgd", "step") + configs_for("adamw", "lambda", partition_bytes=256)
    results = launch(tmp_path, 4, configs)
    check_matches_ring(results, 4, [(0, 1), (2, 3)])


@pytest.mark.parametrize("compression,kwargs", [("terngrad", {"bitwidth": 2}), ("onebit", {})])
def test_dear_compressed_matches_compressed_ring(tmp_path, compression, kwargs):
    """Both phases compressed: the same encodes, with the same states, as the ring's, only
    one iteration apart, so the parameters are those of strategy="ring" with the algorithm."""
    plain = {"optimizer": "sgd", "scheduler": "step", "steps": STEPS, "strategy": "dear"}
    results = launch(tmp_path, 2, configs_for("sgd", "step", compression, kwargs=kwargs) + [plain])
    check_matches_ring(results, 2, [(0, 1)])
    # compression changed the result: a sync that ignored the compressor would pass the above
    compressed, uncompressed = results[0][1]["final"], results[0][2]["final"]
    assert any((compressed[n] - uncompressed[n]).abs().max() > 1e-4 for n in compressed)


@pytest.mark.parametrize("np", [2, 3])
def test_checkpoint_after_synchronize_resumes_identically(tmp_path, np):
    save_at = 2
    results = launch(tmp_path, np, [{"optimizer": "adamw", "scheduler": "lambda", "steps": STEPS,
                                     "strategy": "dear", "save_at": save_at}])
    for r in range(np):
        res = results[r][0]
        # synchronize() made the parameters those the next forward uses, and the checkpoint holds them
        assert_same(res["after_synchronize"], res["used"][save_at + 1], f"rank {r} after synchronize")
        assert_same(res["saved_model"], res["after_synchronize"], f"rank {r} checkpoint")
        for step in range(save_at + 1, STEPS):
            assert_same(res["resumed_used"][step], res["used"][step], f"rank {r} resumed forward {step}")
        assert_same(res["resumed_final"], res["final"], f"rank {r} resumed final")
