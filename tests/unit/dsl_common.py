"""Shared by the DSL and compression-kernel tests: one compile cache for the whole test session
(content-addressed), the thread-count fixture, and the comparison of two codecs that must agree bit for
bit (a generated kernel against the hand-written one)."""
import os
import tempfile

import numpy as np
import pytest
import torch

os.environ.setdefault("HIPRESS_COMPLL_CACHE", os.path.join(tempfile.gettempdir(), f"hipress-compll-tests-{os.getuid()}"))


# sizes around the kernels' block and vector boundaries, and the input dtypes they accept
SIZES = [0, 1, 2, 7, 8, 9, 31, 33, 63, 65, 1000, 4095, 4097, 65535, 65537, 200003]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def grad(n, seed=0, dtype=torch.float32):
    """A seeded N(0, 0.05^2) gradient of n elements."""
    g = torch.from_numpy(np.random.default_rng(seed).standard_normal(n).astype(np.float32) * 0.05)
    return g.to(dtype)


def as_np(t):
    return t.to(torch.float32).numpy()


def pbytes(p):
    return p.numpy().tobytes()


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """The operators' thread pool at 1 and at 2 threads: results must not depend on it."""
    from hipress import compression as C
    old = C.num_threads()
    C.set_num_threads(request.param)
    yield request.param
    C.set_num_threads(old)


def same_state(a, b, what=""):
    assert list(a.buffers) == list(b.buffers), what
    assert a.matrix == b.matrix, what
    for k in a.buffers:
        assert torch.equal(a.buffers[k], b.buffers[k]), f"{what}: state buffer {k} differs"
    assert torch.equal(a.scalars, b.scalars), f"{what}: state scalars {a.scalars} != {b.scalars}"


def same_codec(gen, hand, grads, n, shape=None, what=""):
    """gen and hand, fed the gradients `grads` in turn (state carried over), write the same payloads and
    states, decode and decode_add each payload to the same floats, and agree statelessly (counter 0)."""
    dims = (n,) if shape is None else (n, shape)
    sg, sh = gen.new_state(*dims), hand.new_state(*dims)
    same_state(sg, sh, f"{what} new_state")
    assert gen.max_encoded_bytes(*dims) == hand.max_encoded_bytes(*dims), what
    for step, g in enumerate(grads):
        a, b = gen.encode(g, sg), hand.encode(g, sh)
        assert torch.equal(a, b), f"{what} step {step}: payloads differ"
        same_state(sg, sh, f"{what} step {step}")
        o1, o2 = torch.full((n,), 5.0), torch.full((n,), 5.0)
        gen.decode(a, o1)
        hand.decode(a, o2)
        assert torch.equal(o1, o2), f"{what} step {step}: decode differs"
        gen.decode_add(a, o1, alpha=0.5)
        hand.decode_add(a, o2, alpha=0.5)
        assert torch.equal(o1, o2), f"{what} step {step}: decode_add differs"
    assert torch.equal(gen.encode(grads[-1]), hand.encode(grads[-1])), f"{what}: stateless encode differs"
