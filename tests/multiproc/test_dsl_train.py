"""A compression algorithm that exists only in the DSL (3LC-style ternary quantisation with a
max-magnitude scale, written in this test) compiles, decodes correctly and trains on 2 ranks."""
import os
import sys
import tempfile

import numpy as np
import pytest
import torch

from hipress import compll
from hipress import compression as C
from hipress.launch import run

os.environ.setdefault("HIPRESS_COMPLL_CACHE", os.path.join(tempfile.gettempdir(), f"hipress-compll-tests-{os.getuid()}"))
HERE = os.path.dirname(os.path.abspath(__file__))

THREELC = r"""
// 3LC-style ternary quantisation (Lim et al. 2019): values in {-M, 0, +M} with
// M = sparsity * max|g|, rounded to nearest; error feedback keeps the rest.
algorithm threelc(category = quantization, error_feedback = 1);

param P { float sparsity = 1.0; }

float m, inv;

uint2 tern(float x) {
    float r = round(x * inv);
    return r > 0 ? 1 : (r < 0 ? 2 : 0);
}
float value(uint2 c) { return c == 1 ? m : (c == 2 ? -m : 0.0); }

void encode(float* gradient, uint8* compressed, P params) {
    m = reduce(gradient, maxabs) * params.sparsity;
    inv = m > 0 ? 1.0 / m : 0.0;
    uint2* q = map(gradient, tern);
    compressed = concat(m, q);
}

void decode(uint8* compressed, float* gradient) {
    extract(compressed, m, q);
    gradient = map(q, value);
}
"""


def reference(g, sparsity):
    m = np.float32(np.abs(g).max() * np.float32(sparsity)) if g.size else np.float32(0)
    inv = np.float32(1) / m if m > 0 else np.float32(0)
    r = np.round(g * inv)  # numpy rounds half to even, C++ round() half away from zero: avoid exact halves
    return np.where(r > 0, m, np.where(r < 0, -m, np.float32(0))).astype(np.float32)


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("dsl") / "threelc.cll"
    p.write_text(THREELC)
    return str(p)


def test_user_algorithm_decodes_correctly(spec_file):
    compll.load(spec_file, overwrite=True)
    for sparsity in (1.0, 1.5):
        c = C.get("threelc", error_feedback=False, sparsity=sparsity)
        for n in (0, 1, 17, 4097, 100003):
            g = (np.random.default_rng(n).standard_normal(n) * 0.1).astype(np.float32)
            out = torch.empty(n)
            p = c.encode(torch.from_numpy(g))
            assert p.numel() == 48 + (2 * n + 7) // 8
            c.decode(p, out)
            np.testing.assert_array_equal(out.numpy(), reference(g, sparsity))


def test_user_algorithm_trains_on_two_ranks(spec_file, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    code, logs = run([sys.executable, os.path.join(HERE, "dsl_train_worker.py"), spec_file, str(out), "30"], 2,
                     timeout=240, quiet=True)
    assert code == 0, "\n".join("\n".join(l) if isinstance(l, list) else str(l) for l in logs)[-4000:]
    r = [torch.load(out / f"rank{k}.pt") for k in range(2)]
    for a, b in zip(r[0]["params"], r[1]["params"]):
        assert torch.equal(a, b)  # the ranks stay in sync
    for k in range(2):
        first, last = np.mean(r[k]["losses"][:5]), np.mean(r[k]["losses"][-5:])
        assert last < 0.7 * first, r[k]["losses"]


def _train(tmp_path, tag, spec, name, steps=20):
    out = tmp_path / tag
    out.mkdir()
    code, logs = run([sys.executable, os.path.join(HERE, "dsl_train_worker.py"), spec, str(out), str(steps), name], 2,
                     timeout=240, quiet=True)
    assert code == 0, "\n".join("\n".join(l) if isinstance(l, list) else str(l) for l in logs)[-4000:]
    return [torch.load(out / f"rank{k}.pt") for k in range(2)]


def test_generated_powersgd_trains_like_handwritten(tmp_path):
    """DistributedOptimizer(compression=<the PowerSGD generated from specs/powersgd.cll>) goes through the
    low-rank strategy (encode_round/combine/finish) and trains exactly like the hand-written PowerSGD:
    same losses, same parameters, bit for bit."""
    gen = _train(tmp_path, "gen", "powersgd", "dsl_powersgd")
    hand = _train(tmp_path, "hand", "builtin", "powersgd")
    for k in range(2):
        assert gen[k]["losses"] == hand[k]["losses"]
        for a, b in zip(gen[k]["params"], hand[k]["params"]):
            assert torch.equal(a, b)
    for a, b in zip(gen[0]["params"], gen[1]["params"]):
        assert torch.equal(a, b)
    first, last = np.mean(gen[0]["losses"][:5]), np.mean(gen[0]["losses"][-5:])
    assert last < 0.7 * first, gen[0]["losses"]
