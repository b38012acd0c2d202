"""Resuming on another number of ranks (2 saved, 3 resumed; local processes over gloo): the
compressor states belong to the saved layout (ring chunks and PS aggregators follow the number
of ranks, and so does PS's choice of aggregators), so their error-feedback residuals go, element by
element, into the next gradients of the rank that loads them; state that is not a residual (DGC's)
is refused with a ValueError. The same for DDP with hipress's comm hook (HookState). (A resume on
the same number of ranks loads the states as they are: test_resume.py and test_ddp_hook.py,
bit-identical.) COVAP's units (each its own inner compressor states) move the same way."""
import json
import os
import sys

import pytest
import torch

from hipress.launch import run

HERE = os.path.dirname(os.path.abspath(__file__))
# the ring's chunks follow the number of ranks (dear runs the ring's phases), and so does PS's choice
# of aggregators: their states move; DGC's momentum cannot
CONFIGS = [{"compression": "onebit", "strategy": s} for s in ("ring", "dear", "ps")] + \
          [{"compression": "dgc", "strategy": "ring"}] + \
          [{"compression": c, "strategy": "ring", "hook": True} for c in ("onebit", "dgc")] + \
          [{"compression": "covap", "strategy": "ring", "kwargs": {"mode": "paper", "inner": "onebit", "interval": 2},
            **hook} for hook in ({}, {"hook": True})]  # COVAP's units: a sync each, sharded by the median rule
MOVED, REFUSED = (0, 1, 2, 4, 6, 7), (3, 5)


def launch(out, phase, np):
    cmd = [sys.executable, os.path.join(HERE, "resize_worker.py"), str(out), phase, json.dumps(CONFIGS)]
    code, logs = run(cmd, np, timeout=240, quiet=True)
    assert code == 0, "\n".join(logs)[-4000:]
    return [torch.load(out / f"{phase}-rank{r}.pt", weights_only=False) for r in range(np)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("resize")
    launch(out, "save", 2)
    loaded = launch(out, "load", 3)
    ckpts = [[torch.load(out / f"ckpt-{i}-rank{r}.pt", weights_only=False) for r in range(2)]
             for i in range(len(CONFIGS))]
    return loaded, ckpts


def test_residuals_become_the_loading_ranks_carry(results):
    loaded, ckpts = results
    for i in MOVED:
        for r in range(3):
            rec, hp = loaded[r][i], ckpts[i][r % 2]["optimizer"]
            hp = hp if CONFIGS[i].get("hook") else hp["hipress"]  # the hook's state_dict, or the optimizer's part
            what = f"{CONFIGS[i]['strategy']}{' hook' if CONFIGS[i].get('hook') else ''} rank {r}"
            assert rec["error"] is None and any("another layout" in w for w in rec["warnings"]), what
            # every saved residual element lands on the parameter element its owners name
            want = {n: torch.zeros_like(p) for n, p in rec["params"].items()}
            for key, st in hp["compressor_state"].items():
                res = st["buffers"].get("residual")
                if res is None:
                    continue
                res = res.reshape(-1)
                for name, at, start, count in hp["state_owners"][key]:
                    want[name].view(-1)[at:at + count] += res[start:start + count]
            assert sum(float(t.abs().sum()) for t in want.values()) > 1e-3, f"{what}: no residual saved: no teeth"
            for name, t in want.items():
                got = rec["carry"].get(name, torch.zeros_like(t))
                torch.testing.assert_close(got, t, rtol=1e-6, atol=1e-7, msg=f"{what} {name}")
            # saved again before a step, the carry is in the checkpoint
            assert rec["carry_resaved"].keys() == rec["carry"].keys()
            assert all(torch.equal(rec["carry_resaved"][n], t) for n, t in rec["carry"].items()), what
            # and the job trains on, every rank with the same parameters
            for name, t in loaded[0][i]["params"].items():
                assert torch.equal(rec["params"][name], t), f"{what} {name}"


def test_state_other_than_residuals_is_refused(results):
    loaded, _ = results
    for i in REFUSED:
        for r in range(3):
            err = loaded[r][i]["error"]
            assert err is not None and "another layout" in err and "accum" in err, (CONFIGS[i], r)
