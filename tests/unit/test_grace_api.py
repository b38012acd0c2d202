"""hipress.grace (hipress/compression/grace_api.py): GRACE-style compressors written in torch, their
tensors and ctx through hipress payloads, the communicators' reductions, and what is rejected.
The multi-rank check against the reference simulator is tests/multiproc/test_grace_port.py."""
import numpy as np
import pytest
import torch

import hipress
from hipress import compression as C
from hipress.compression import grace_api as G
from hipress.sync.factory import resolve_strategy


class TopK(G.Compressor):
    """GRACE-style top-k: values and int64 indices; ctx (numel, shape)."""

    def __init__(self, ratio=0.1):
        super().__init__(tensors_size_are_same=True)
        self.ratio = ratio

    def compress(self, tensor, name):
        k = max(1, int(tensor.numel() * self.ratio))
        _, idx = torch.topk(tensor.abs(), k, sorted=False)
        return [tensor[idx], idx], (tensor.numel(), tensor.size())

    def decompress(self, tensors, ctx):
        values, idx = tensors
        numel, shape = ctx
        out = torch.zeros(numel, dtype=values.dtype)
        out.scatter_(0, idx, values)
        return out.view(shape)


class Cast16(G.Compressor):
    """Summable compressed tensors (fp16), ctx the dtype: the allreduce communicator's case."""

    def compress(self, tensor, name):
        return [tensor.to(torch.float16)], tensor.dtype

    def decompress(self, tensors, ctx):
        return tensors[0].to(ctx)


class SignVote(G.Compressor):
    """GRACE's signSGD aggregation: majority vote, not averaged."""

    def __init__(self):
        super().__init__(average=False)

    def compress(self, tensor, name):
        return [tensor >= 0], None

    def decompress(self, tensors, ctx):
        return tensors[0].to(torch.float32) * 2 - 1

    def aggregate(self, tensors):
        return torch.sign(sum(tensors))


def g(n, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(n).astype(np.float32))


CTXS = [None, True, 3, -2**62, 2.5, "name/é", torch.bfloat16, torch.Size([3, 4]), (1, (2, [3.0, None])), [],
        (torch.arange(5), torch.ones(2, 3, dtype=torch.bool))]


@pytest.mark.parametrize("ctx", CTXS, ids=range(len(CTXS)))
def test_payload_round_trips_tensors_and_ctx(ctx):
    tensors = [g(7), torch.arange(6, dtype=torch.int64).view(2, 3), torch.tensor([1, 0, 1], dtype=torch.bool),
               g(4).to(torch.bfloat16), torch.zeros(0, 5), torch.tensor(3.5), torch.tensor([-1, 7], dtype=torch.int8)]
    p = G.encode_payload(tensors, ctx)
    assert p.dtype == torch.uint8 and p.dim() == 1
    got, got_ctx = G.decode_payload(p)
    assert len(got) == len(tensors)
    for a, b in zip(got, tensors):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)

    def same(a, b):
        if isinstance(b, torch.Tensor):
            return isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        if isinstance(b, (tuple, list)):
            return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return type(a) is type(b) and a == b
    assert same(got_ctx, ctx)


def test_adapter_round_trips_a_user_compressor():
    comp = G.wrap(TopK(0.25))
    x = g(100, 1)
    p = comp.encode(x)
    out = comp.decode(p, torch.empty(100))
    expect = TopK(0.25).decompress(*TopK(0.25).compress(x, "t"))
    assert torch.equal(out, expect) and int((out != 0).sum()) == 25
    acc = torch.ones(100)
    comp.decode_add(p, acc, alpha=0.5)
    torch.testing.assert_close(acc, 1 + 0.5 * expect, rtol=0, atol=0)
    buf = torch.zeros(p.numel() + 10, dtype=torch.uint8)
    assert torch.equal(comp.encode(x, out=buf), p)
    with pytest.raises(ValueError, match="bytes"):
        comp.encode(x, out=torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="elements"):
        comp.decode(p, torch.empty(99))


def test_residual_memory_through_the_adapter():
    comp = G.wrap(TopK(0.1), memory=G.ResidualMemory())
    st = comp.new_state(50)
    assert st.key is not None
    x1, x2 = g(50, 2), g(50, 3)
    d1 = comp.decode(comp.encode(x1, st), torch.empty(50))
    torch.testing.assert_close(comp.memory.residuals[st.key], x1 - d1, rtol=0, atol=0)
    d2 = comp.decode(comp.encode(x2, st), torch.empty(50))
    # compensate: residual + gradient; what is sent plus the new residual is that sum
    torch.testing.assert_close(d2 + comp.memory.residuals[st.key], (x1 - d1) + x2, rtol=0, atol=0)
    # a store's state is named by its key (the memory's name for the partition)
    from hipress.sync.base import StateStore
    s = StateStore(rank=1).get("bucket.w/p0/worker", comp, 50)
    comp.encode(x1, s)
    assert "bucket.w/p0/worker" in comp.memory.residuals


def test_communicator_reductions():
    xs = [g(40, 10 + r) for r in range(3)]
    out = torch.empty(40)
    # allgather and broadcast: decompress each rank's, aggregate, average
    for comm in ("allgather", "broadcast"):
        comp = G.wrap(TopK(0.2), communicator=comm)
        comp.aggregate_payloads([comp.encode(x) for x in xs], out, True)
        dec = [TopK(0.2).decompress(*TopK(0.2).compress(x, "t")) for x in xs]
        torch.testing.assert_close(out, sum(dec) / 3, rtol=0, atol=0)
        comp.aggregate_payloads([comp.encode(x) for x in xs], out, False)  # the optimizer sums: no division
        torch.testing.assert_close(out, sum(dec), rtol=0, atol=0)
    # average=False and a custom aggregate (majority vote)
    vote = G.wrap(SignVote())
    vote.aggregate_payloads([vote.encode(x) for x in xs], out, True)
    torch.testing.assert_close(out, torch.sign(sum(torch.where(x >= 0, 1.0, -1.0) for x in xs)), rtol=0, atol=0)
    # allreduce: the compressed tensors summed (averaged), decompressed once
    comp = G.wrap(Cast16(), communicator="allreduce")
    comp.aggregate_payloads([comp.encode(x) for x in xs], out, True)
    h = [x.to(torch.float16) for x in xs]
    torch.testing.assert_close(out, ((h[0] + h[1] + h[2]) / 3).to(torch.float32), rtol=0, atol=0)
    # allreduce needs summable tensors: same shapes and ctx on every rank
    bad = G.wrap(TopK(0.2), communicator="allreduce")
    with pytest.raises(ValueError, match="allreduce"):
        bad.aggregate_payloads([bad.encode(xs[0]), bad.encode(g(41, 1))], out, True)
    ints = G.wrap(SignVote(), communicator="allreduce")
    ints.compressor.average = True
    with pytest.raises(ValueError, match="floating point"):
        ints.aggregate_payloads([ints.encode(x) for x in xs], out, True)


def test_builtin_aggregate_payloads_is_the_rank_order_sum():
    c = C.get("qsgd")
    xs = [g(300, r) for r in range(3)]
    ps = [c.encode(x) for x in xs]
    acc = torch.zeros(300)
    for p in ps:
        c.decode_add(p, acc)
    out = torch.empty(300)
    c.aggregate_payloads(ps, out, True)
    assert torch.equal(out, acc / 3)


def test_corrupt_payloads_raise_value_error():
    comp = G.wrap(TopK(0.2))
    p = comp.encode(g(30, 4))
    out = torch.empty(30)
    for cut in range(p.numel()):  # every truncation
        with pytest.raises(ValueError):
            comp.decode(p[:cut].clone(), out)
    raw = bytearray(p.numpy().tobytes())
    for i, b in ((0, ord("X")), (4, 9), (5, ord("Q"))):  # magic, version, tag
        q = bytearray(raw)
        q[i] = b
        with pytest.raises(ValueError):
            comp.decode(torch.frombuffer(q, dtype=torch.uint8), out)
    with pytest.raises(ValueError, match="trailing"):
        comp.decode(torch.frombuffer(bytearray(raw + b"N"), dtype=torch.uint8), out)
    # a tensor announcing 2^60 elements: rejected before anything is allocated
    forged = b"HPGR\x01L\x01\x00\x00\x00X\x00\x01" + (1 << 60).to_bytes(8, "little") + b"N"
    with pytest.raises(ValueError, match="truncated"):
        G.decode_payload(torch.frombuffer(bytearray(forged), dtype=torch.uint8))
    boolean = b"HPGR\x01L\x01\x00\x00\x00X\x09\x01" + (2).to_bytes(8, "little") + b"\x01\x02N"
    with pytest.raises(ValueError, match="bool"):
        G.decode_payload(torch.frombuffer(bytearray(boolean), dtype=torch.uint8))
    deep = b"HPGR\x01L\x00\x00\x00\x00" + b"U\x01\x00\x00\x00" * 40 + b"N"
    with pytest.raises(ValueError, match="deeply"):
        G.decode_payload(torch.frombuffer(bytearray(deep), dtype=torch.uint8))


def test_what_is_rejected():
    class Obj:
        pass

    class BadCtx(TopK):
        def compress(self, tensor, name):
            tensors, _ = super().compress(tensor, name)
            return tensors, Obj()

    with pytest.raises(TypeError, match="ctx"):
        G.wrap(BadCtx()).encode(g(10))
    with pytest.raises(ValueError, match="communicator"):
        G.wrap(TopK(), communicator="ring")
    with pytest.raises(TypeError, match="decompress"):
        G.wrap(object())
    with pytest.raises(TypeError, match="compensate"):
        G.wrap(TopK(), memory=object())
    with pytest.raises(TypeError):
        G.Compressor()  # abstract, as GRACE's
    comp = G.wrap(TopK())
    assert resolve_strategy("auto", comp) == "allgather" and resolve_strategy("allgather", comp) == "allgather"
    assert resolve_strategy("auto", comp, planned=True) == "allgather"
    for s in ("ring", "ps"):
        with pytest.raises(ValueError, match="allgather"):
            resolve_strategy(s, comp)
    with pytest.raises(NotImplementedError):
        comp.max_encoded_bytes(10)


def test_lazy_export():
    assert hipress.grace is G and hipress.grace.wrap is G.wrap
    assert set(G.COMMUNICATORS) == {"allreduce", "allgather", "broadcast"}
