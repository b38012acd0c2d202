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
    # GRACE's quantizers (docs/grace.md)
    "signsgd": C.SignSGD(), "signum": C.Signum(), "efsignsgd": C.EFSignSGD(), "qsgd": C.QSGD(), "natural": C.Natural(),
    "terngrad_grace": C.TernGradGrace(), "u8bit": C.U8bit(), "fp16": C.FP16(), "bf16": C.BF16(),
    # GRACE's sparsifiers and hybrids (docs/grace.md)
    "randomk": C.RandomK(ratio=0.05), "topk": C.TopK(ratio=0.05), "threshold": C.Threshold(0.5),
    "adaq": C.Adaq(ratio=0.05), "dgc_grace": C.DGCGrace(ratio=0.05), "sketch": C.Sketch(quantiles=16),
    "inceptionn": C.Inceptionn(),
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


@pytest.mark.parametrize("name", ["dgc", "graddrop", "randomk", "topk", "threshold", "dgc_grace"])
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


# ---- decompress / payload_info: validated before anything is allocated -------------------
import struct  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from contextlib import contextmanager  # noqa: E402

from hipress.compression import reference as ref  # noqa: E402

IDS = {"onebit": 1, "tbq": 2, "terngrad": 3, "dgc": 4, "graddrop": 5, "powersgd": 6, "signsgd": 7, "signum": 8,
       "efsignsgd": 9, "qsgd": 10, "natural": 11, "terngrad_grace": 12, "u8bit": 13, "fp16": 14, "bf16": 15,
       "randomk": 20, "topk": 21, "threshold": 22, "adaq": 23, "dgc_grace": 24, "sketch": 25, "powersgd_grace": 26,
       "inceptionn": 27}
FLOAT_WORDS = {1: 0, 2: 1, 3: 3, 7: 1, 8: 1, 9: 1, 10: 2, 11: 0, 12: 1, 13: 1, 14: 0, 15: 0}  # quantised payloads
# (onebit: 0, its scales are in the body, one per row)
# fp32 header words that are scales or thresholds, sparse payloads included (DGC, GradDrop and GRACE's)
SCALE_WORDS = {**FLOAT_WORDS, 4: 1, 5: 1, 22: 1, 23: 2, 24: 1}
ALLOC_LIMIT = 64 << 20  # bytes: far above any payload here, far below what a forged header asks for


def as_tensor(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)


def forge(algo: int, numel: int, body: bytes, bits: int = 0, kind: int = 0, count: int = 0, words=(0, 0, 0, 0),
          body_bytes=None) -> torch.Tensor:
    """A payload with a valid header check (a forgery, not an accident) and any field values."""
    bb = len(body) if body_bytes is None else body_bytes
    w = [int(x) & 0xFFFFFFFF for x in words] + [0] * (4 - len(words))
    raw = ref._HDR.pack(ref.MAGIC, algo, ref.VERSION, bits, kind, 0, count, numel, bb, *w)
    check = ref.fnv1a(raw)
    return as_tensor(ref._HDR.pack(ref.MAGIC, algo, ref.VERSION, bits, kind, check, count, numel, bb, *w) + body)


@contextmanager
def alloc_guard(limit=ALLOC_LIMIT):
    """Fails the test if torch.empty / torch.zeros is asked for more than `limit` bytes (the
    buffers decompress allocates); the subprocess test below bounds every allocation."""
    real = {f: getattr(torch, f) for f in ("empty", "zeros")}

    def guarded(f):
        def call(*size, **kw):
            shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
            n = 1
            for s in shape:
                n *= int(s)
            item = real["empty"](0, dtype=kw.get("dtype") or torch.get_default_dtype()).element_size()
            assert n * item <= limit, f"torch.{f} of {n * item} bytes"
            return real[f](*size, **kw)
        return call

    for f in real:
        setattr(torch, f, guarded(f))
    try:
        yield
    finally:
        for f, fn in real.items():
            setattr(torch, f, fn)


def check_decompress(p: torch.Tensor, numel_hint=None):
    """payload_info and decompress agree: both raise ValueError, or the payload is valid; the
    built-in decoder never accepts what payload_info rejects. Returns whether it decoded."""
    with alloc_guard():
        try:
            info = C.payload_info(p)
        except ValueError as e:
            assert str(e)
            with pytest.raises(ValueError):
                C.decompress(p)
            return False
        try:
            out = C.decompress(p)
        except ValueError as e:
            assert str(e)
            return False
    assert out.dtype == torch.float32 and out.numel() == info["numel"]
    return True


@pytest.mark.parametrize("name", list(ALGOS))
def test_decompress_valid(name):
    p = PAYLOADS[name]
    info = C.payload_info(p)
    assert info["name"] == name and info["numel"] == N and info["body_bytes"] == p.numel() - C.HEADER_BYTES
    want = torch.zeros(N)
    ALGOS[name].decode(p, want)
    torch.testing.assert_close(C.decompress(p), want, rtol=0, atol=0)
    torch.testing.assert_close(C.decompress(p, numel=N), want, rtol=0, atol=0)
    torch.testing.assert_close(C.decompress(p, max_numel=N), want, rtol=0, atol=0)
    out = torch.empty(N)
    assert C.decompress(p, out) is out
    for kw in ({"numel": N + 1}, {"max_numel": N - 1}):
        with pytest.raises(ValueError, match="elements"):
            C.decompress(p, **kw)
    with pytest.raises(ValueError, match="elements"):
        C.decompress(p, torch.empty(N + 1))


@pytest.mark.parametrize("name", list(ALGOS))
@SETTINGS
@given(data=st.data())
def test_decompress_bit_flips(name, data):
    p = PAYLOADS[name].clone()
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, p.numel() - 1))
        p[pos] ^= 1 << data.draw(st.integers(0, 7))
    ok = check_decompress(p)
    if bool((p[:48] != PAYLOADS[name][:48]).any()):
        assert not ok  # any accidental header damage is detected


@pytest.mark.parametrize("name", list(ALGOS))
@SETTINGS
@given(data=st.data())
def test_decompress_truncated_or_trailing(name, data):
    p = PAYLOADS[name]
    if data.draw(st.booleans()):
        q = p[:data.draw(st.integers(0, p.numel() - 1))].clone()
    else:
        q = torch.cat([p, as_tensor(data.draw(st.binary(min_size=1, max_size=64)))])
    assert not check_decompress(q)
    with pytest.raises(ValueError):
        ALGOS[name].decode(q, torch.zeros(N))


def test_trailing_bytes_message():
    p = torch.cat([PAYLOADS["tbq"], torch.zeros(3, dtype=torch.uint8)])
    with pytest.raises(C.PayloadError, match="3 trailing bytes"):
        C.payload_info(p)
    with pytest.raises(C.PayloadError, match="3 trailing bytes"):
        ALGOS["tbq"].decode_add(p, torch.zeros(N))
    assert issubclass(C.PayloadError, ValueError)


BIG = st.one_of(st.integers(0, 2**16), st.sampled_from([2**28, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**64 - 1]))


@SETTINGS
@given(algo=st.sampled_from(sorted(IDS.values()) + [0, 19, 63, 64, 255]), numel=BIG,
       count=st.one_of(st.integers(0, 64), st.sampled_from([2**31, 2**32 - 1])),
       bits=st.sampled_from([0, 1, 2, 3, 4, 8, 16, 255]), kind=st.sampled_from([0, 1, 2, 3]),
       words=st.lists(st.one_of(st.integers(0, 2**32 - 1),
                                st.sampled_from([0x7F800000, 0xFF800000, 0x7FC00000, 0x3F800000, 0, 20, 15])),
                      min_size=4, max_size=4),
       body=st.binary(max_size=96), body_bytes=st.one_of(st.none(), BIG))
def test_forged_headers(algo, numel, count, bits, kind, words, body, body_bytes):
    """Valid header checks with any field values: ValueError or a valid decode, never a large
    allocation (a 56-byte DGC payload announcing 2^28 elements used to allocate 1 GiB)."""
    p = forge(algo, numel, body, bits, kind, count, words, body_bytes)
    if check_decompress(p):
        info = C.payload_info(p)
        assert len(body) == info["body_bytes"] and info["numel"] <= max(C.DECOMPRESS_MIN_NUMEL, 1024 * p.numel())
        assert algo in IDS.values()
        if algo in FLOAT_WORDS:  # the scale words of quantised payloads were finite
            assert all((w & 0x7F800000) != 0x7F800000 for w in words[:FLOAT_WORDS[algo]])


@pytest.mark.parametrize("name", ["onebit", "tbq", "terngrad", "dgc", "graddrop", "signsgd", "signum", "efsignsgd",
                                  "qsgd", "terngrad_grace", "u8bit", "threshold", "adaq", "dgc_grace"])
@pytest.mark.parametrize("word", [0x7F800000, 0xFF800000, 0x7FC00000, 0xFFFFFFFF])
def test_nonfinite_scale_rejected(name, word):
    """A forged inf/NaN scale or threshold is a ValueError everywhere, not inf/NaN values."""
    p = PAYLOADS[name]
    h = list(struct.unpack("<IBBBBIIQQ4I", bytes(p[:48].tolist())))
    if name == "onebit":  # its scales follow the sign bits in the body, one per row: forge the last
        body = bytes(p[48:].tolist())
        q = forge(h[1], h[7], body[:-4] + struct.pack("<I", word), h[3], h[4], h[6], h[9:13])
        with pytest.raises(ValueError, match="inf or NaN"):
            C.decompress(q)
        assert not try_decode(ALGOS[name], q)
    nfloat = SCALE_WORDS[IDS[name]]
    for w in range(nfloat):
        f = list(h)
        f[9 + w] = word
        q = forge(f[1], f[7], bytes(p[48:].tolist()), f[3], f[4], f[6], f[9:13])
        with pytest.raises(ValueError, match="inf or NaN"):
            C.payload_info(q)
        with pytest.raises(ValueError, match="inf or NaN"):
            C.decompress(q)
        assert not try_decode(ALGOS[name], q)


def test_forged_sizes_ask_for_numel():
    """Sparse and low-rank payloads do not bound their element count: without numel or
    max_numel, decompress refuses what exceeds the documented default cap."""
    dgc = forge(IDS["dgc"], 2**28, b"\0" * 8, count=1)  # 56 bytes, 2^28 elements (1 GiB of fp32)
    with alloc_guard(), pytest.raises(ValueError, match="max_numel"):
        C.decompress(dgc)
    lr = forge(IDS["powersgd"], 2**40, b"", count=0, words=(2**20, 2**20))  # rank 0: empty body
    assert C.payload_info(lr)["numel"] == 2**40
    with alloc_guard(), pytest.raises(ValueError, match="max_numel"):
        C.decompress(lr)
    small = forge(IDS["dgc"], 1000, struct.pack("<If", 7, 2.5), count=1)
    d = C.decompress(small, numel=1000)
    assert d[7] == 2.5 and float(d.abs().sum()) == 2.5
    with pytest.raises(ValueError, match="max_numel"):
        C.decompress(small, max_numel=999)
    with pytest.raises(ValueError, match="unknown algorithm id 19"):
        C.payload_info(forge(19, 8, b""))


@pytest.mark.parametrize("name", list(ALGOS))
@SETTINGS
@given(data=st.data())
def test_payload_info_not_stricter_than_decoders(name, data):
    """payload_info checks what each built-in's decoder checks: a mutated header the decoder
    accepts, payload_info accepts; one payload_info rejects, the decoder rejects."""
    p = PAYLOADS[name]
    h = list(struct.unpack("<IBBBBIIQQ4I", bytes(p[:48].tolist())))
    field = data.draw(st.sampled_from([3, 4, 6, 7, 8, 9, 10, 11]))  # bits kind count numel body words
    h[field] = data.draw(st.integers(0, {3: 255, 4: 255, 6: 2**32 - 1, 7: 2 * N, 8: 2 * p.numel()}.get(field, 2**32 - 1)))
    body = bytes(p[48:].tolist())
    q = forge(h[1], h[7], body, h[3], h[4], h[6], h[9:13], body_bytes=h[8])
    try:
        ALGOS[name].decode(q, torch.zeros(h[7]) if h[7] <= 4 * N else torch.zeros(N))
        decoded = h[7] <= 4 * N
    except ValueError:
        decoded = False
    try:
        C.payload_info(q)
        info_ok = True
    except ValueError:
        info_ok = False
    if decoded:
        assert info_ok
    if not info_ok:
        assert not decoded


def test_no_large_allocation_under_rlimit():
    """In a subprocess whose address space is capped a few hundred MiB above its start, forged
    payloads raise ValueError: an allocation of what they announce would fail (RuntimeError or
    MemoryError) instead. The cap is shown to bite first, so the test can fail."""
    code = textwrap.dedent(r'''
        import resource, struct, random
        import torch
        from hipress import compression as C
        from hipress.compression import reference as ref

        def vm_bytes():
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmSize:"):
                        return int(line.split()[1]) * 1024
        limit = vm_bytes() + (384 << 20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            torch.empty(1 << 30, dtype=torch.float32).fill_(1)   # 4 GiB: must fail under the cap
            raise SystemExit("the address-space cap does not bite")
        except (RuntimeError, MemoryError):
            pass

        def forge(algo, numel, body, bits=0, kind=0, count=0, words=(0, 0, 0, 0), bb=None):
            bb = len(body) if bb is None else bb
            raw = ref._HDR.pack(ref.MAGIC, algo, ref.VERSION, bits, kind, 0, count, numel, bb, *words)
            raw = ref._HDR.pack(ref.MAGIC, algo, ref.VERSION, bits, kind, ref.fnv1a(raw), count, numel, bb, *words)
            return torch.frombuffer(bytearray(raw + body), dtype=torch.uint8)

        cases = [forge(4, 1 << 28, b"\0" * 8, count=1), forge(5, 1 << 40, b"\0" * 8, count=1),
                 forge(4, 2**64 - 1, b""), forge(6, 2**40, b"", words=(2**20, 2**20, 0, 0)),
                 forge(6, 2**62, b"", words=(2**31, 2**31, 0, 0)), forge(1, 2**40, b"\0" * 16, bits=1),
                 forge(3, 2**33, b"", bits=8), forge(4, 2**28, b"\0" * 8, count=2**31)]
        rng = random.Random(1234)
        good = C.compress(torch.randn(300), "dgc", ratio=0.05)
        for _ in range(3000):  # random header fields with a valid check
            algo = rng.choice(list(range(1, 16)))
            numel = rng.choice([rng.randrange(1 << 70), rng.randrange(1 << 20), 1 << rng.randrange(64)]) % (1 << 64)
            body = bytes(rng.randrange(256) for _ in range(rng.choice([0, 8, 16, 40])))
            words = tuple(rng.choice([rng.randrange(1 << 32), 0x7F800000, 1 << rng.randrange(32)]) for _ in range(4))
            cases.append(forge(algo, numel, body, rng.choice([0, 1, 2, 4, 8]), rng.choice([0, 1, 2]),
                               rng.choice([0, 1, 2, 5, rng.randrange(1 << 32)]), words))
        for _ in range(1000):  # bit flips in a real payload
            p = good.clone()
            p[rng.randrange(p.numel())] ^= 1 << rng.randrange(8)
            cases.append(p)
        decoded = rejected = 0
        for p in cases:
            for f in (C.payload_info, C.decompress):
                try:
                    f(p)
                    decoded += 1
                except ValueError:
                    rejected += 1
        print("ok", decoded, rejected)
    ''')
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("ok"), r.stdout + r.stderr
    _, decoded, rejected = r.stdout.split()
    assert int(rejected) > 0 and int(decoded) > 0
