"""CompLL common operators (csrc/compress/ops.h) against numpy."""
import numpy as np
import pytest
import torch

from hipress import _C
from dsl_common import threads  # noqa: F401  (fixture)
from hipress.compression import reference as ref

SIZES = [0, 1, 2, 3, 7, 8, 9, 15, 17, 31, 33, 63, 64, 65, 1023, 1025, 4095, 4096, 4097, 65535, 65536, 65537, 200003]


def ptr(a):
    return a.ctypes.data


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", SIZES)
def test_pack_unpack_matches_reference(bits, n, threads):
    rng = np.random.default_rng(n * 10 + bits)
    codes = rng.integers(0, 1 << bits, size=n, dtype=np.uint8)
    nb = (n * bits + 7) // 8
    out = np.full(nb + 1, 0xAB, np.uint8)  # sentinel after the end
    _C.ops_pack_bits(ptr(codes), n, bits, ptr(out))
    np.testing.assert_array_equal(out[:nb], ref.pack_bits(codes, bits))
    assert out[nb] == 0xAB
    if bits == 1:
        np.testing.assert_array_equal(out[:nb], np.packbits(codes, bitorder="little"))
    back = np.zeros(n, np.uint8)
    _C.ops_unpack_bits(ptr(out), n, bits, ptr(back))
    np.testing.assert_array_equal(back, codes)


@pytest.mark.parametrize("n", SIZES)
def test_pack_signbits(n, threads):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    if n > 3:
        x[:4] = [0.0, -0.0, np.inf, -np.inf]
    out = np.zeros((n + 7) // 8, np.uint8)
    _C.ops_pack_signbits(ptr(x), n, ptr(out))
    np.testing.assert_array_equal(out, np.packbits(np.signbit(x).astype(np.uint8), bitorder="little"))


@pytest.mark.parametrize("seed,counter", [(0, 0), (1, 12345), (2**63 + 5, 2**32 - 100), (7, 2**40)])
def test_random_streams_identical(seed, counter, threads):
    n = 150001
    u = np.zeros(n, np.float32)
    _C.ops_random_uniform(seed, counter, ptr(u), n)
    np.testing.assert_array_equal(u, ref.random_uniform(seed, counter, n))
    assert u.min() >= 0 and u.max() < 1
    idx = np.zeros(n, np.uint32)
    _C.ops_random_index(seed, counter, 1000003, ptr(idx), n)
    np.testing.assert_array_equal(idx, ref.random_index(seed, counter, 1000003, n))
    assert idx.max() < 1000003


def test_random_uniform_quality():
    u = ref.random_uniform(3, 0, 1 << 20)
    assert abs(u.mean() - 0.5) < 2e-3
    assert abs(u.var() - 1 / 12) < 2e-3
    # successive counters are not correlated
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 5e-3
    # another seed gives another stream
    assert not np.array_equal(u[:100], ref.random_uniform(4, 0, 100))


@pytest.mark.parametrize("n", [1, 5, 1000, 65537, 300001])
def test_reduce_minmax_and_sign_sums(n, threads):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    assert _C.ops_reduce_minmax(ptr(x), n) == (x.min(), x.max())
    ps, ns, pc, nc = _C.ops_reduce_sign_sums(ptr(x), n)
    neg = np.signbit(x)
    assert pc == (~neg).sum() and nc == neg.sum()
    assert ps == pytest.approx(x[~neg].astype(np.float64).sum(), rel=1e-12, abs=1e-9)
    assert ns == pytest.approx(x[neg].astype(np.float64).sum(), rel=1e-12, abs=1e-9)


# densities from 0.1% to DGC's warm-up's 25% (the radix selection's bins, the sampled filter's dense blocks)
@pytest.mark.parametrize("n,k", [(1, 1), (10, 3), (1000, 1), (5000, 5), (100000, 100), (100000, 1000), (4097, 4097),
                                 (200003, 3125), (100000, 6250), (100000, 25000)])
@pytest.mark.parametrize("sample", [0, 2048])
def test_topk_exact_with_ties(n, k, sample, threads):
    rng = np.random.default_rng(n + k)
    x = rng.standard_normal(n).astype(np.float32)
    x[rng.integers(0, n, n // 3)] = 0.5  # many ties
    x[rng.integers(0, n, n // 3)] = 0.0
    idx = np.zeros(k, np.uint32)
    val = np.zeros(k, np.float32)
    got = _C.ops_topk_abs(ptr(x), n, k, ptr(idx), ptr(val), sample, 1, 0)
    ridx, rval = ref.topk_abs_exact(x, k)
    assert got == k
    np.testing.assert_array_equal(idx, ridx)
    np.testing.assert_array_equal(val, rval)


@pytest.mark.parametrize("n,sample", [(257, 0), (5000, 2048)])
def test_topk_every_k(n, sample):
    """Every k of one tensor (the exact path below 4096 elements, the sampled one above): the k-th
    largest is somewhere the last of its radix bin, or the first, or shares it with its ties."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    x[rng.integers(0, n, n // 10)] = -1.25  # ties, across the sign
    x[rng.integers(0, n, n // 10)] = 1.25
    for k in range(1, (n if n < 4096 else n // 8) + 1):
        idx = np.zeros(k, np.uint32)
        val = np.zeros(k, np.float32)
        assert _C.ops_topk_abs(ptr(x), n, k, ptr(idx), ptr(val), sample, 1, 0) == k
        ridx, rval = ref.topk_abs_exact(x, k)
        np.testing.assert_array_equal(idx, ridx, err_msg=f"k={k}")
        np.testing.assert_array_equal(val, rval, err_msg=f"k={k}")


def test_topk_constant_tensor_takes_lowest_indices():
    x = np.full(10000, -2.0, np.float32)
    idx = np.zeros(10, np.uint32)
    val = np.zeros(10, np.float32)
    assert _C.ops_topk_abs(ptr(x), 10000, 10, ptr(idx), ptr(val), 1024, 0, 0) == 10
    np.testing.assert_array_equal(idx, np.arange(10))


def test_sampled_threshold_matches_reference():
    x = np.random.default_rng(0).standard_normal(100000).astype(np.float32)
    t = _C.ops_sampled_threshold(ptr(x), x.size, 0.01, 1000, 5, 77)
    sm = np.abs(x[ref.random_index(5, 77, x.size, 1000)])
    assert t == np.sort(sm)[::-1][9]
    # a 1% threshold of a normal sample is near the true 99th percentile of |x|
    assert abs(t - np.quantile(np.abs(x), 0.99)) < 0.3


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (7, 5, 3), (130, 257, 4), (64, 1000, 8)])
def test_matmul_variants(m, k, n, threads):
    rng = np.random.default_rng(m * k * n)
    A = rng.standard_normal((m, k)).astype(np.float32)
    B = rng.standard_normal((k, n)).astype(np.float32)
    C = np.zeros((m, n), np.float32)
    _C.ops_matmul_nn(ptr(A), ptr(B), ptr(C), m, k, n)
    np.testing.assert_allclose(C, A @ B, rtol=1e-4, atol=1e-4)
    B2 = rng.standard_normal((m, n)).astype(np.float32)
    CT = np.zeros((k, n), np.float32)
    _C.ops_matmul_tn(ptr(A), ptr(B2), ptr(CT), m, k, n)
    np.testing.assert_allclose(CT, A.T @ B2, rtol=1e-4, atol=1e-4)
    Bk = rng.standard_normal((k, n)).astype(np.float32)  # (n_out x r) with r = n
    D = np.ones((m, k), np.float32)
    Ar = rng.standard_normal((m, n)).astype(np.float32)
    _C.ops_matmul_nt(ptr(Ar), ptr(Bk), ptr(D), m, n, k, -1.0, True)
    np.testing.assert_allclose(D, 1 - Ar @ Bk.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (7, 5, 3), (130, 257, 4), (64, 1000, 8), (65, 33, 5)])
def test_add_matmul_nn_is_add_then_matmul_nn_bit_for_bit(m, k, n, threads):
    """The fused pass (PowerSGD's error feedback and first product) gives the same floats as the
    two operators one after the other: the matrix after the add, and the product."""
    rng = np.random.default_rng(m + k + n)
    A = rng.standard_normal((m, k)).astype(np.float32)
    X = rng.standard_normal((m, k)).astype(np.float32)
    B = rng.standard_normal((k, n)).astype(np.float32)
    A1, C1 = A + X, np.zeros((m, n), np.float32)  # float32 adds, as ops::add's
    _C.ops_matmul_nn(ptr(A1), ptr(B), ptr(C1), m, k, n)
    A2, C2 = A.copy(), np.zeros((m, n), np.float32)
    _C.ops_add_matmul_nn(ptr(A2), ptr(X), ptr(B), ptr(C2), m, k, n)
    np.testing.assert_array_equal(A2, A1)
    np.testing.assert_array_equal(C2, C1)
    np.testing.assert_allclose(C2, (A + X) @ B, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m,k,n", [(130, 257, 4), (67, 4096, 8), (9, 40, 3), (6, 33, 2)])
def test_matmul_rows_in_groups_are_rows_alone_bit_for_bit(m, k, n, threads):
    """matmul_nn and matmul_nt run several rows per pass over the other factor (AVX-512); each
    row's outputs are still summed in the same order, so they equal that row computed alone."""
    rng = np.random.default_rng(m * k + n)
    A = rng.standard_normal((m, k)).astype(np.float32)
    B = rng.standard_normal((k, n)).astype(np.float32)
    C = np.zeros((m, n), np.float32)
    _C.ops_matmul_nn(ptr(A), ptr(B), ptr(C), m, k, n)
    Ar = rng.standard_normal((m, n)).astype(np.float32)
    D = rng.standard_normal((m, k)).astype(np.float32)
    D0 = D.copy()
    _C.ops_matmul_nt(ptr(Ar), ptr(B), ptr(D), m, n, k, -1.0, True)
    for i in range(m):
        row, c = np.ascontiguousarray(A[i:i + 1]), np.zeros((1, n), np.float32)
        _C.ops_matmul_nn(ptr(row), ptr(B), ptr(c), 1, k, n)
        np.testing.assert_array_equal(c[0], C[i])
        coef, d = np.ascontiguousarray(Ar[i:i + 1]), D0[i:i + 1].copy()
        _C.ops_matmul_nt(ptr(coef), ptr(B), ptr(d), 1, n, k, -1.0, True)
        np.testing.assert_array_equal(d[0], D[i])


@pytest.mark.parametrize("rows,r", [(1, 1), (50, 4), (1000, 8)])
def test_orthogonalize(rows, r):
    P = np.random.default_rng(rows).standard_normal((rows, r)).astype(np.float32)
    Q = P.copy()
    _C.ops_orthogonalize(ptr(Q), rows, r)
    np.testing.assert_allclose(Q, ref.orthogonalize(P), rtol=1e-4, atol=1e-5)
    if rows >= r:
        np.testing.assert_allclose(Q.T @ Q, np.eye(r), atol=1e-4)


@pytest.mark.parametrize("scale", [1e-9, 1e-4, 1e6])
def test_orthogonalize_does_not_depend_on_scale(scale):
    """PowerSGD's warm-started P = M Q scales as |M|^2; an absolute eps (1e-8) used to shrink the
    columns of small P's and collapse the basis (docs/pipeline.md)."""
    P = np.random.default_rng(7).standard_normal((64, 8)).astype(np.float32)
    unit, scaled = P.copy(), (P * np.float32(scale)).astype(np.float32)
    _C.ops_orthogonalize(ptr(unit), 64, 8)
    _C.ops_orthogonalize(ptr(scaled), 64, 8)
    np.testing.assert_allclose(scaled, unit, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(scaled.T @ scaled, np.eye(8), atol=1e-4)
    np.testing.assert_allclose(ref.orthogonalize(P * scale), ref.orthogonalize(P), rtol=1e-4, atol=1e-5)
    zero = np.zeros((64, 2), np.float32)
    _C.ops_orthogonalize(ptr(zero), 64, 2)
    assert not zero.any()  # a zero column stays zero, no NaN


def test_orthogonalize_keeps_ill_conditioned_columns_orthonormal():
    """A warm-started PowerSGD P = M Q has condition number ~ (sigma_1 / sigma_r)^2; the columns
    must still come out orthonormal (the regression test of the second Gram-Schmidt pass is
    test_pipeline_parts.py's test_full_rank_powersgd_is_exact_after_a_warm_start)."""
    rng = np.random.default_rng(8)
    U, _ = np.linalg.qr(rng.standard_normal((256, 32)))
    V, _ = np.linalg.qr(rng.standard_normal((32, 32)))
    P = ((U * np.logspace(0, -5, 32)) @ V.T).astype(np.float32)  # cond 1e5
    Q = P.copy()
    _C.ops_orthogonalize(ptr(Q), 256, 32)
    np.testing.assert_allclose(Q.T @ Q, np.eye(32), atol=1e-3)
    R = ref.orthogonalize(P)
    np.testing.assert_allclose(R.T @ R, np.eye(32), atol=1e-3)


def test_axpby_rounding_matches_numpy():
    x = np.random.default_rng(1).standard_normal(70001).astype(np.float32)
    y = np.random.default_rng(2).standard_normal(70001).astype(np.float32)
    y2 = y.copy()
    _C.ops_axpby(ptr(y2), 0.9, ptr(x), 0.3, x.size)
    np.testing.assert_array_equal(y2, np.float32(0.9) * y + np.float32(0.3) * x)


def _velocity_out(n, where, u):
    """Where a momentum update writes its new velocity: a fresh (aligned) spare, ``u`` itself, or
    a spare one float off alignment (the vector stores past the caches need an aligned one)."""
    import torch
    if where == "in_place":
        return u.clone()
    if where == "unaligned":
        return torch.full((n + 1,), float("nan"))[1:]
    return torch.full((n,), float("nan"))


@pytest.mark.parametrize("where", ["spare", "in_place", "unaligned"])
@pytest.mark.parametrize("n", [0, 1, 7, 65537, 200003])
def test_momentum_update_is_sgds_two_passes_bit_for_bit(n, where, threads):
    """u.mul_(m).add_(g) as torch's SGD computes it (the product rounded before the sum), and g
    set to the result: the same bits, whether the velocity is updated in place or into a spare,
    aligned or not."""
    import torch
    gen = torch.Generator().manual_seed(n)
    u = torch.randn(n, generator=gen) * 10
    g = torch.randn(n, generator=gen) * 1e-3
    for m in (0.9, 0.99, 0.5, 1.0):
        want = u.clone().mul_(m).add_(g)
        out = _velocity_out(n, where, u)
        g2 = g.clone()
        _C.ops_momentum_update(out.data_ptr(), out.data_ptr() if where == "in_place" else u.data_ptr(), m,
                               g2.data_ptr(), n)
        assert torch.equal(out.view(torch.int32), want.view(torch.int32)), m
        assert torch.equal(g2.view(torch.int32), want.view(torch.int32)), m
    if n > 1000:  # it would differ from a fused multiply-add: the test can tell the two apart
        fused = torch.from_numpy((u.double() * 0.9 + g.double()).float().numpy())
        assert not torch.equal(fused, u.clone().mul_(0.9).add_(g))


@pytest.mark.parametrize("where", ["spare", "unaligned"])
@pytest.mark.parametrize("n", [0, 1, 7, 17, 65537, 200003])
def test_momentum_update_finite_is_the_update_and_finds_every_nan_and_inf(n, where, threads):
    """Where g is finite: ops_momentum_update's bits (SGD's roundings) and True; a NaN or +-Inf
    anywhere in g (vector body, tail, a later chunk): False."""
    import torch
    gen = torch.Generator().manual_seed(n)
    u = torch.randn(n, generator=gen) * 10
    g = torch.randn(n, generator=gen) * 1e-3
    for m in (0.9, 0.5):
        want = u.clone().mul_(m).add_(g)
        out, g2 = _velocity_out(n, where, u), g.clone()
        assert _C.ops_momentum_update_finite(out.data_ptr(), u.data_ptr(), m, g2.data_ptr(), n) is True
        assert torch.equal(out.view(torch.int32), want.view(torch.int32)), m
        assert torch.equal(g2.view(torch.int32), want.view(torch.int32)), m
    for at in sorted({0, n // 2, n - 1}) if n else []:
        for bad in (float("nan"), float("inf"), -float("inf")):
            g2 = g.clone()
            g2[at] = bad
            out = torch.empty(n)
            assert _C.ops_momentum_update_finite(out.data_ptr(), u.data_ptr(), 0.9, g2.data_ptr(), n) is False


@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 1000, 65536 + 17, 200003])
def test_copy_finite_copies_and_finds_every_nan_and_inf(n, threads):
    """The copy is exact (bits, -0.0, denormals, NaN payloads included) and the answer is False
    exactly where some element is NaN or +-Inf, wherever it lies (vector body, tail, later chunk);
    the largest finite floats and denormals are finite."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    if n:
        x[rng.integers(0, n, size=min(n, 8))] = np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max,
                                                          1e-42, -0.0], np.float32)[rng.integers(0, 4, size=min(n, 8))]
    out = np.full(max(n, 1), 7.0, np.float32)
    assert _C.ops_copy_finite(ptr(out), ptr(x), n) is True
    assert np.array_equal(out[:n].view(np.uint32), x.view(np.uint32))
    for at in sorted({0, n // 2, n - 1}) if n else []:
        for bad in (np.nan, np.inf, -np.inf, np.float32(np.nan) * -1):
            y = x.copy()
            y[at] = bad
            assert _C.ops_copy_finite(ptr(out), ptr(y), n) is False, (at, bad)
            assert np.array_equal(out[:n].view(np.uint32), y.view(np.uint32))


@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 1000, 65536 + 17, 200003])
def test_copy_finite_bf16_is_torchs_cast_and_finds_what_would_not_be_finite(n, threads):
    """The copy is torch's fp32 -> bf16 cast bit for bit (ties to even, denormals, -0.0, values
    that round up to the largest bf16), a NaN or Inf stays one, and the answer is False exactly
    where an element is NaN, +-Inf or so large that bf16 rounds it to Inf (|x| bits >= 0x7f7f8000),
    wherever it lies."""
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * np.exp(rng.standard_normal(n) * 10)).astype(np.float32)  # all far below fp32 max
    special = np.array([0x3f808000, 0x3f818000, 0x7f7f7fff, 0x00018000, 0x80008000, 0x00000001],
                       np.uint32).view(np.float32)  # ties down and up, the largest finite, denormals
    if n:
        x[rng.integers(0, n, size=min(n, 8))] = special[rng.integers(0, special.size, size=min(n, 8))]
    out = torch.full((max(n, 1),), 7.0, dtype=torch.bfloat16)
    assert _C.ops_copy_finite_bf16(out.data_ptr(), ptr(x), n) is True
    assert torch.equal(out[:n].view(torch.int16), torch.from_numpy(x).to(torch.bfloat16).view(torch.int16))
    overflow = np.array([0x7f7f8000, 0xff7f8000, 0x7f7fffff], np.uint32).view(np.float32)
    nans = np.array([0xffffffff, 0x7f800001, 0x7fffffff, 0xff808000], np.uint32).view(np.float32)  # bits that round off
    for at in sorted({0, n // 2, n - 1}) if n else []:
        for bad in (np.nan, np.inf, -np.inf, np.float32(np.nan) * -1, *nans, *overflow):
            y = x.copy()
            y[at] = bad
            assert _C.ops_copy_finite_bf16(out.data_ptr(), ptr(y), n) is False, (at, bad)
            # a NaN stays a NaN, whatever its bits (rounded, 0xffffffff would wrap around to +0.0), and
            # Inf stays Inf, so the bucket's check finds them; every other element is torch's cast
            assert not torch.isfinite(out[at].float()), (at, bad)
            rest = torch.arange(n) != at
            want = torch.from_numpy(x).to(torch.bfloat16)[rest]
            assert torch.equal(out[:n][rest].view(torch.int16), want.view(torch.int16))


def _same_bf16(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit, but any NaN for a NaN."""
    nan = torch.isnan(want)
    return torch.equal(torch.isnan(got), nan) and torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


@pytest.mark.parametrize("n", [0, 1, 33, 1000, 65536 + 17, 200003])
def test_covap_bf16_ops_are_torchs_passes_bit_for_bit(n, threads):
    """COVAP's bf16 averages (hipress/torch/covap.py): bf16_difference is p.sub_(base.float())
    .to(bf16) and bf16_average_delta is sum.float().div_(ranks), base.float().add_(mean),
    mean.sub_(sent.float()) and average.to(bf16), bit for bit: ties to even, values whose sum
    overflows bf16 to Inf, and rank counts whose division is inexact (3, 5) as well as exact (4).
    A NaN stays a NaN (its bits are torch's own choice: 0x7fc0 in its scalar cast, 0xffff in its
    vectorized one)."""
    g = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
    base = (p + torch.randn(n, generator=g) * 1e-2).to(torch.bfloat16)
    if n > 8:
        p[:4] = torch.tensor([float("nan"), float("inf"), 3.3895e38, -3.3895e38])  # NaN, Inf, bf16 overflow
        p[4:8] = torch.tensor([0x3f808000, 0x3f818000, 0x00018000, 1], dtype=torch.int32).view(torch.float32)
        base[4:8] = 0.0  # the differences are the tie cases and denormals themselves
    diff = torch.full((n,), 7.0, dtype=torch.bfloat16)
    _C.ops_bf16_difference(diff.data_ptr(), p.data_ptr(), base.data_ptr(), n)
    assert _same_bf16(diff, p.clone().sub_(base.float()).to(torch.bfloat16))
    sent = diff.clone()
    total = (diff.float() * 3 + torch.randn(n, generator=g)).to(torch.bfloat16)
    for ranks in (3, 4, 5):
        delta = torch.empty(n, dtype=torch.float32)
        average = torch.empty(n, dtype=torch.bfloat16)
        _C.ops_bf16_average_delta(delta.data_ptr(), average.data_ptr(), total.data_ptr(), base.data_ptr(),
                                  sent.data_ptr(), float(ranks), n)
        mean = total.float().div_(ranks)
        want_average = base.float().add_(mean).to(torch.bfloat16)
        want_delta = mean.sub_(sent.float())
        assert _same_bf16(average, want_average), ranks
        nan = torch.isnan(want_delta)
        assert torch.equal(torch.isnan(delta), nan), ranks
        assert torch.equal(delta[~nan].view(torch.int32), want_delta[~nan].view(torch.int32)), ranks


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 1000, 70001])
def test_filter_abs_ge_matches_numpy(n, threads):
    """The indices and values of every |x| >= thr with |x| > 0, in order: the block test on the
    floats' bits may skip only blocks without one. Values at the threshold exactly, -0.0, denormals,
    infinities and NaN; thresholds positive, denormal, zero and negative; cap below the count."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    if n:
        special = np.array([0.5, -0.5, -0.0, 0.0, 1e-42, -1e-42, np.inf, -np.inf, np.nan, 3.0], np.float32)
        x[rng.integers(0, n, size=min(n, 40))] = special[rng.integers(0, special.size, size=min(n, 40))]
    for thr in (0.5, 2.5, 1e-42, 0.0, -1.0, np.inf):
        a = np.abs(x)
        with np.errstate(invalid="ignore"):
            want = np.flatnonzero((a >= np.float32(thr)) & (a > 0))
        for cap in (n, max(0, want.size - 3)):
            idx = np.zeros(max(cap, 1), np.uint32)
            val = np.zeros(max(cap, 1), np.float32)
            cnt = _C.ops_filter_abs_ge(ptr(x), n, thr, ptr(idx), ptr(val), cap)
            assert cnt == want.size, (thr, cap)
            kept = min(cnt, cap)
            np.testing.assert_array_equal(idx[:kept], want[:kept])
            np.testing.assert_array_equal(val[:kept], x[want[:kept]])
