"""GRACE's INCEPTIONN (docs/grace.md; csrc/compress/algo_inceptionn.cc) against the numpy reference
(hipress/compression/reference.py inceptionn_encode / inceptionn_decode). Its corrupt, truncated and
forged payloads are also in tests/unit/test_compression_fuzz.py (ALGOS)."""
import math

import numpy as np
import pytest
import torch

from dsl_common import DTYPES, SIZES, as_np, pbytes, threads  # noqa: F401  (threads: a fixture)
from hipress import compression as C
from hipress.compression import reference as ref
from hipress.sync.factory import resolve_strategy

H = ref.HEADER_BYTES


def grad(n, seed=0, dtype=torch.float32, special=True):
    # magnitudes over many exponents, so every class (32 / 16 / 8 / 0 bits) is filled
    rng = np.random.default_rng(seed)
    g = (rng.standard_normal(n) * 10.0 ** rng.uniform(-5, 0.5, n)).astype(np.float32)
    if special and n > 8:  # signed zeros, a subnormal, a tiny and a large value
        g[1], g[2], g[3], g[4], g[5] = -0.0, 0.0, 3e-40, -1e-37, 7.5
    return torch.from_numpy(g).to(dtype)


def roundtrip(c, n, payload, expect):
    out = torch.full((n,), 123.0)
    c.decode(payload, out)
    np.testing.assert_array_equal(out.numpy(), expect)
    acc = torch.ones(n)
    c.decode_add(payload, acc, alpha=0.5)
    np.testing.assert_array_equal(acc.numpy(), (np.float32(1) + np.float32(0.5) * expect).astype(np.float32))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_exact(n, dtype, threads):
    g = grad(n, n, dtype)
    for bound in (2e-10, 2e-6, 2e-20):
        c = C.get("inceptionn", error_bound=bound)
        p = c.encode(g)
        expect = ref.inceptionn_encode(as_np(g), bound)
        assert pbytes(p) == expect
        assert p.numel() <= c.max_encoded_bytes(n)
        roundtrip(c, n, p, ref.inceptionn_decode(expect, n))


def test_ten_million_elements():
    n = 10_000_000
    g = grad(n, 42, special=False)
    c = C.get("inceptionn")
    p = c.encode(g)
    expect = ref.inceptionn_encode(g.numpy())
    assert pbytes(p) == expect
    out = torch.empty(n)
    c.decode(p, out)
    np.testing.assert_array_equal(out.numpy(), ref.inceptionn_decode(expect, n))


def test_classes_and_error_bound():
    """Default bound: exponent 117 (2^-10), mid 122. Each class decodes within its resolution
    (truncation toward zero, sign kept); below 2^-10 is 0; |x| >= 1, inf and NaN are exact."""
    assert ref.inceptionn_bound(2e-10) == 117 and ref.inceptionn_bound(2e-6) == 121
    edges = [2.0**k for k in range(-12, 2)]
    x = np.float32(edges + [np.nextafter(np.float32(e), np.float32(0)) for e in edges]
                   + [1.0, -1.0, 3.5, np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-45, 0.3, -0.3, 0.015, -0.0011])
    x = np.concatenate([x, -x]).astype(np.float32)
    c = C.get("inceptionn")
    p = c.encode(torch.from_numpy(x))
    n32, n16, n8, eb = ref.parse_header(pbytes(p))["words"]
    assert eb == 117
    out = torch.empty(x.size)
    c.decode(p, out)
    y = out.numpy()
    e = (x.view(np.uint32) >> 23) & 0xFF
    big = e >= 127
    np.testing.assert_array_equal(y[big], x[big])  # NaN == NaN for assert_array_equal
    assert n32 == big.sum() and n16 == ((e >= 122) & (e < 127)).sum() and n8 == ((e >= 117) & (e < 122)).sum()
    m16, m8, zero = (e >= 122) & (e < 127), (e >= 117) & (e < 122), e < 117
    for sel, res in ((m16, 2.0**-15), (m8, 2.0**(121 - 127 - 6))):
        err = x[sel].astype(np.float64) - y[sel]
        assert np.all(np.abs(err) < res) and np.all(err * np.sign(x[sel]) >= 0)  # truncated toward zero
        assert np.all(np.sign(y[sel]) == np.sign(x[sel]))
    assert np.all(y[zero] == 0) and np.all(np.abs(x[zero]) < 2.0**-10)


def test_bound_parameter():
    with pytest.raises(ValueError, match="error_bound"):
        C.get("inceptionn", error_bound=0)
    with pytest.raises(ValueError, match="error_bound"):
        C.get("inceptionn", error_bound=0.5)  # exponent 127: nothing below 1 would be sent
    with pytest.raises(ValueError, match="unknown parameter"):
        C.NativeCompressor("inceptionn", bound=1e-3)
    # a smaller bound keeps more: more 8-bit elements, fewer zeros
    g = grad(5000, 3, special=False)
    coarse, fine = (C.get("inceptionn", error_bound=b).encode(g) for b in (2e-3, 2e-10))
    zc = ref.inceptionn_decode(pbytes(coarse), 5000)
    zf = ref.inceptionn_decode(pbytes(fine), 5000)
    assert (zf == 0).sum() < (zc == 0).sum()
    assert np.abs(zf - g.numpy()).max() < np.abs(zc - g.numpy()).max()


def test_metadata_registry_and_auto_strategy():
    c = C.get("inceptionn")
    assert type(c) is C.Inceptionn  # GRACE Table I: no memory
    assert c.category == "quantization" and not c.aggregatable and c.rounds == 1 and not c.reencode_safe
    assert resolve_strategy("auto", c) == "allgather"
    assert resolve_strategy("auto", c, planned=True) == "ps"
    g = grad(300, 1)
    p = c.encode(g)
    info = C.payload_info(p)
    assert info["name"] == "inceptionn" and info["algo"] == ref.ALGO_IDS["inceptionn"] == 27
    out = torch.empty(300)
    c.decode(p, out)
    assert torch.equal(C.decompress(p), out)
    # a payload made with another bound decodes with any instance: the bound travels in the header
    p6 = C.get("inceptionn", error_bound=2e-6).encode(g)
    np.testing.assert_array_equal(c.decode(p6, torch.empty(300)).numpy(), ref.inceptionn_decode(pbytes(p6), 300))


def _forge(raw: bytes, **fields) -> torch.Tensor:
    h = ref.parse_header(raw)
    h.update(fields)
    words = h.pop("words")
    body = raw[H:]
    hdr = ref._HDR.pack(ref.MAGIC, h["algo"], ref.VERSION, h["bits"], h["kind"], 0, h["count"], h["numel"],
                        h["body_bytes"], *words)
    hdr = ref._HDR.pack(ref.MAGIC, h["algo"], ref.VERSION, h["bits"], h["kind"], ref.fnv1a(hdr), h["count"],
                        h["numel"], h["body_bytes"], *words)
    return torch.frombuffer(bytearray(hdr + body), dtype=torch.uint8)


def test_corrupt_payloads_raise_value_error():
    n = 1001  # tags end in a partly used byte
    c = C.get("inceptionn")
    raw = pbytes(c.encode(grad(n, 5)))
    n32, n16, n8, eb = ref.parse_header(raw)["words"]
    assert n32 and n16 and n8
    out = torch.empty(n)
    body = bytearray(raw)
    tb = (n + 3) // 4
    # the tags disagree with the header's counts (a 16-bit tag turned into a 32-bit one: same body size)
    tags = ref.unpack_bits(np.frombuffer(raw[H:H + tb], np.uint8), n, 2)
    i = int(np.flatnonzero(tags == 2)[0])
    body[H + i // 4] |= 3 << (2 * (i % 4))
    with pytest.raises(ValueError, match="tags announce"):
        c.decode(torch.frombuffer(body, dtype=torch.uint8), out)
    # padding tags after the last element
    body = bytearray(raw)
    body[H + tb - 1] |= 0x80
    with pytest.raises(ValueError, match="padding"):
        c.decode(torch.frombuffer(body, dtype=torch.uint8), out)
    # header fields (valid checksum): counts, bound, bit width
    for fields in ({"words": (n32 + 1, n16, n8, eb)}, {"words": (n32, n16, n8, 0)}, {"words": (n32, n16, n8, 127)},
                   {"words": (n, n16, n8, eb)}, {"bits": 1}, {"count": 1}, {"kind": 1}):
        q = _forge(raw, **fields)
        with pytest.raises(ValueError):
            c.decode(q, out)
        with pytest.raises(ValueError):
            C.payload_info(q)
    for cut in (0, 10, H, H + tb, len(raw) - 1):
        with pytest.raises(ValueError):
            c.decode(torch.frombuffer(bytearray(raw[:cut]), dtype=torch.uint8), out)
    with pytest.raises(ValueError):
        c.decode(torch.frombuffer(bytearray(raw), dtype=torch.uint8), torch.empty(n + 1))
    with pytest.raises(ValueError, match="made by"):
        c.decode(C.get("sketch", error_feedback=False).encode(grad(n, 5)), out)


def test_payload_size_follows_the_classes():
    g = grad(4000, 9, special=False)
    p = C.get("inceptionn").encode(g)
    n32, n16, n8, _ = ref.parse_header(pbytes(p))["words"]
    assert p.numel() == H + math.ceil(4000 / 4) + 4 * n32 + 2 * n16 + n8
    assert pbytes(p)[4] == 27  # the algorithm id byte


def test_foreign_payload_errors_name_the_algorithm():
    """csrc/compress/format.cc algo_name knows ids 20-27 (it called them unknown algorithms)."""
    from hipress.compression.native import BUILTIN_IDS
    from hipress.compression import _algo_name
    x = grad(300, 8, special=False)
    inc = C.get("inceptionn")
    for algo in range(20, 28):
        name = _algo_name(algo)
        p = BUILTIN_IDS[algo]().encode(x.view(20, 15))
        other = inc if algo != 27 else C.Sketch()
        with pytest.raises(ValueError, match=f"made by {name} \\(id {algo}\\), cannot decode it with "
                                             f"{'inceptionn' if algo != 27 else 'sketch'}"):
            other.decode(p, torch.empty(300))
