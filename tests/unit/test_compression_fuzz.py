"""Decoding truncated, corrupted or foreign payloads: always a ValueError (or a
valid decode of a body whose damage is undetectable), never a crash."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hipress import compression as C

N = 300
ALGOS = {
    "onebit": C.OneBit(), "tbq": C.TBQ(0.01), "terngrad": C.TernGrad(4), "dgc": C.DGC(ratio=0.05),
    "graddrop": C.GradDrop(ratio=0.05), "powersgd": C.PowerSGD(rank=2),
}
G = torch.from_numpy(np.random.default_rng(0).standard_normal(N).astype(np.float32))
PAYLOADS = {name: c.encode(G.view(20, 15)).clone() for name, c in ALGOS.items()}
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def try_decode(c, payload, n=N):
    out = torch.zeros(n)
    acc = torch.zeros(n)
    try:
        c.decode(payload, out)
    except ValueError as e:
        assert str(e)  # a message that says something
        with pytest.raises(ValueError):
            c.decode_add(payload, acc)
        assert torch.count_nonzero(acc) == 0  # a rejected payload leaves the accumulator untouched
        return False
    c.decode_add(payload, acc)
    # a damaged body may hold NaN/inf floats (PowerSGD, sparse values): compare NaN-aware
    torch.testing.assert_close(acc, out, rtol=0, atol=0, equal_nan=True)
    return True


@pytest.mark.parametrize("name", list(ALGOS))
def test_valid_payload_decodes(name):
    assert try_decode(ALGOS[name], PAYLOADS[name])


@pytest.mark.parametrize("name", list(ALGOS))
@SETTINGS
@given(data=st.data())
def test_truncated(name, data):
    p = PAYLOADS[name]
    cut = data.draw(st.integers(0, p.numel() - 1))
    assert not try_decode(ALGOS[name], p[:cut].clone())


@pytest.mark.parametrize("name", list(ALGOS))
@SETTINGS
@given(data=st.data())
def test_corrupted_bytes(name, data):
    p = PAYLOADS[name].clone()
    k = data.draw(st.integers(1, 8))
    for _ in range(k):
        pos = data.draw(st.integers(0, p.numel() - 1))
        p[pos] ^= data.draw(st.integers(1, 255))
    header_hit = bool((p[:48] != PAYLOADS[name][:48]).any())
    ok = try_decode(ALGOS[name], p)
    if header_hit:
        assert not ok  # any header damage is detected (checksum)


@pytest.mark.parametrize("name", list(ALGOS))
@SETTINGS
@given(raw=st.binary(min_size=0, max_size=400))
def test_random_bytes(name, raw):
    p = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
    assert not try_decode(ALGOS[name], p)


@pytest.mark.parametrize("name", list(ALGOS))
@pytest.mark.parametrize("other", list(ALGOS))
def test_foreign_payload(name, other):
    if name == other:
        return
    with pytest.raises(ValueError, match="made by"):
        ALGOS[name].decode(PAYLOADS[other], torch.zeros(N))


@pytest.mark.parametrize("name", list(ALGOS))
def test_wrong_output_size(name):
    for n in (0, N - 1, N + 1):
        with pytest.raises(ValueError, match="elements"):
            ALGOS[name].decode(PAYLOADS[name], torch.zeros(n))


@pytest.mark.parametrize("name", ["dgc", "graddrop"])
@SETTINGS
@given(data=st.data())
def test_sparse_indices_rewritten_with_valid_header(name, data):
    """Forge a payload whose header is valid but whose indices are garbage."""
    from hipress.compression import reference as ref
    n = N
    k = data.draw(st.integers(0, 20))
    idx = np.array(data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=k, max_size=k)), dtype=np.uint32)
    val = np.ones(k, np.float32)
    raw = ref.sparse_payload(name, n, idx, val)
    p = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    valid = bool(np.all(idx < n)) and bool(np.all(np.diff(idx.astype(np.int64)) > 0))
    assert try_decode(ALGOS[name], p) == valid


def test_powersgd_round_payloads_need_state():
    c = ALGOS["powersgd"]
    s = c.new_state(N, (20, 15))
    p0 = c.encode_round(0, G, s)
    with pytest.raises(ValueError, match="state"):
        c.decode(p0, torch.zeros(N))
    with pytest.raises(ValueError):
        c.finish(p0, s, torch.zeros(N))  # a P payload where Q is expected
    q = c.encode_round(1, p0, s)
    bad = q.clone()
    bad[60] ^= 0xFF
    c.finish(bad, s, torch.zeros(N))  # body damage: decodes (no body checksum)
    bad[10] ^= 0xFF
    with pytest.raises(ValueError):
        c.finish(bad, s, torch.zeros(N))
    other = C.PowerSGD(rank=2).new_state(N, (15, 20))
    with pytest.raises(ValueError):
        c.encode_round(1, p0, other)
