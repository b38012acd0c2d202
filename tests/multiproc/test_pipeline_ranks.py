"""hipress.pipeline with real ranks (pp x dp local processes over gloo, hipress.launch): one
launch of 4 ranks (pp=2, dp=2) runs every configuration, to keep the test short."""
import json
import os
import sys

import pytest
import torch

from hipress.launch import run

HERE = os.path.dirname(os.path.abspath(__file__))
PP, DP, STEPS, MICRO = 2, 2, 3, 4
BASE = {"steps": STEPS, "micro_batches": MICRO}
LOWRANK = {"backward_compression": "powersgd", "backward_compression_kwargs": {"rank": 2}}
CONFIGS = {
    "plain": BASE,
    "fused": dict(BASE, fuse_embedding=True),
    "all_on": dict(BASE, fuse_embedding=True, compress_stages=1, dp_compression_kwargs={"rank": 2}, **LOWRANK),
    "every_send": dict(BASE, epilogue_only=False, **LOWRANK),
    "plain_1": dict(BASE, steps=1),
    "stage1_only_1": dict(BASE, steps=1, compress_stages=[1], dp_compression="terngrad"),
    "cb_warmup": dict(BASE, backward_compression_warmup=2, **LOWRANK),
    "cb_warmup_1": dict(BASE, steps=1, backward_compression_warmup=1, **LOWRANK),
    # checkpointed after 2 of 4 steps and resumed: PowerSGD's Q in the data-parallel sync (stage 0)
    # and in the backward compressor (stage 1's sends), and the warm-up's step count
    "resume": dict(BASE, steps=4, resume_at=2, epilogue_only=False, backward_compression_warmup=1, compress_stages=1,
                   dp_compression_kwargs={"rank": 2}, **LOWRANK),
}


def launch(tmp_path, configs=CONFIGS, pp=PP, dp=DP, timeout=300):
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, os.path.join(HERE, "pipeline_worker.py"), str(out), str(pp), str(dp),
           json.dumps(list(configs.values()))]
    code, logs = run(cmd, pp * dp, timeout=timeout, quiet=True)
    assert code == 0, "\n".join(logs)[-4000:]
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(pp * dp)]
    by_name = [dict(zip(configs, res["configs"])) for res in results]
    return by_name, results[0]["reference"]


def test_pipeline_ranks(tmp_path):
    runs, reference = launch(tmp_path)
    for r, run_ in enumerate(runs):
        plain, fused = run_["plain"], run_["fused"]
        assert plain["stage"] == r // DP and plain["replica"] == r % DP
        assert plain["params"]
        for name, got in plain["params"].items():
            # every technique off: one process training the whole model on the global batch
            torch.testing.assert_close(got, reference[name], rtol=0, atol=1e-5, msg=lambda m: f"rank {r} {name}: {m}")
            assert not torch.equal(got, plain["initial"][name]), f"rank {r} {name} did not train"
            # fused embedding sync: the same bits
            assert torch.equal(fused["params"][name], got), f"rank {r} {name}: the fused sync changed the bits"
        # the fused sync did run as one all-reduce over the 2D ranks holding a copy
        pair = [r % DP, DP + r % DP]
        assert plain["tied_sync_groups"] == [[0, 1] if r < DP else [2, 3], pair]
        assert fused["tied_sync_groups"] == [[0, 1, 2, 3]]
        # compressed backward sends: stage 1 sends, stage 0 receives. Epilogue only: the last
        # micro-batch of each step (stage 0's cool-down is one backward); else every one
        sends = {"plain": 0, "fused": 0, "all_on": STEPS, "every_send": STEPS * MICRO,
                 "cb_warmup": STEPS - 2, "cb_warmup_1": 0}  # warm-up steps send uncompressed
        for name, n in sends.items():
            assert run_[name]["compressed_sends"] == (n if plain["stage"] == 1 else 0), (r, name)
        for name in ("all_on", "every_send"):  # compression changed training, which still learns
            cfg = run_[name]
            assert any(not torch.equal(cfg["params"][n], p) for n, p in plain["params"].items()), (r, name)
            if cfg["stage"] == 1:
                assert cfg["losses"][-1] < cfg["losses"][0], (r, name, cfg["losses"])
        # selective stage compression of stage 1 only: after one step stage 0 (uncompressed, and
        # its gradients depend only on the initial stage 1) is bit-identical, stage 1 is not
        one, sel = run_["plain_1"]["params"], run_["stage1_only_1"]["params"]
        assert all(torch.equal(run_["cb_warmup_1"]["params"][n], p) for n, p in one.items()), r  # a warm-up step is exact
        same = {n: torch.equal(sel[n], one[n]) for n in one}
        if plain["stage"] == 0:
            assert all(same.values()), (r, same)
        else:
            assert not same["block2.0.weight"] and same["head.weight"], (r, same)  # tied: never compressed
    for r, run_ in enumerate(runs):  # Pipeline.state_dict(): the resumed run is the uninterrupted one, bit for bit
        res = run_["resume"]
        assert res["resumed"].keys() == res["params"].keys()
        assert all(torch.equal(res["resumed"][n], p) for n, p in res["params"].items()), r
        if res["stage"] == 0:  # the teeth: without stage 1's warm-started Q, what it sends back differs
            assert any(not torch.equal(res["resumed_without_bc"][n], p) for n, p in res["params"].items()), r
    for cfg in CONFIGS:  # the tied copies stay one value: first stage's embed.weight = last stage's head.weight
        for d in range(DP):
            assert torch.equal(runs[d][cfg]["params"]["embed.weight"], runs[DP + d][cfg]["params"]["head.weight"]), cfg


def test_ordered_allreduce_is_the_midpoint_tree(tmp_path):
    """The tied sync's all-reduce, for a power-of-two group, a group of 3 and a pair, equals the
    midpoint tree's sum bit for bit on every member (what makes fused == unfused bitwise)."""
    code, logs = run([sys.executable, os.path.join(HERE, "tied_allreduce_worker.py"), str(tmp_path)], 4,
                     timeout=120, quiet=True)
    assert code == 0, "\n".join(logs)[-4000:]
    checked = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert checked[0] == [[0, 1, 2, 3], [3, 1, 0], [2, 0]]
    assert checked[2] == [[0, 1, 2, 3], [2, 0]]


@pytest.mark.slow
def test_four_stages_two_replicas(tmp_path):
    """pp=4 dp=2 (8 ranks, one layer per stage; the tied copies on stages 0 and 3): all off equals
    one process to 1e-5, fused is bit-identical, and epilogue-only compresses, per step, the
    sends that each receiver's cool-down waits for (stage s: min(4 - s, M) of them)."""
    configs = {"plain": BASE, "fused": dict(BASE, fuse_embedding=True), "cb": dict(BASE, **LOWRANK)}
    runs, reference = launch(tmp_path, configs, pp=4, dp=2, timeout=600)
    for r, run_ in enumerate(runs):
        stage = run_["plain"]["stage"]
        for name, got in run_["plain"]["params"].items():
            torch.testing.assert_close(got, reference[name], rtol=0, atol=1e-5, msg=lambda m: f"rank {r} {name}: {m}")
            assert torch.equal(run_["fused"]["params"][name], got), (r, name)
        assert run_["cb"]["compressed_sends"] == (STEPS * min(4 - stage, MICRO) if stage else 0), r
