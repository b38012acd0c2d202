"""One rank of the Horovod-API collectives test (started by test_collectives.py, over gloo with
torchrun-style variables or under mpirun). Runs every check below against exact expected
values computed from what every rank contributes (each rank can rebuild every rank's input),
and emits one RESULT line: {"rank", "size", "transport", "passed": [...], "failed": {name: why}}.
Exit code 0 only if every check passed on this rank.
"""
import math
import os
import sys
import tempfile
import traceback

import torch

from worker_common import emit

import hipress as hvd
from hipress.comm import world
from hipress.torch import collectives

R = N = None
PASSED, FAILED = [], {}


def check(fn):
    """Runs a check now; a failure is recorded (and the following checks still run)."""
    try:
        fn()
        PASSED.append(fn.__name__)
    except Exception:  # noqa: BLE001
        FAILED[fn.__name__] = traceback.format_exc()[-1500:]
    return fn


def eq(got, want, what=""):
    assert isinstance(got, torch.Tensor), f"{what}: got {type(got).__name__}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(got, want), f"{what}: {got.tolist()} != {want.tolist()}"


def close(got, want, what="", tol=1e-5):
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.allclose(got, want, atol=tol, rtol=tol), f"{what}: max diff {(got - want).abs().max().item()}"


def raises_everywhere(fn, exc, *parts):
    """fn() must raise exc on this rank, with every string of parts in the message."""
    try:
        fn()
    except exc as e:
        msg = str(e)
        for p in parts:
            assert p in msg, f"{p!r} not in {msg!r}"
        return msg
    raise AssertionError(f"no {exc.__name__} raised")


# ---------------------------------------------------------------------------- inputs
INT_DTYPES = [torch.int32, torch.int64]
FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16]


def data(r, dtype, shape=(2, 3)):
    """Rank r's input: small signed integers (exact in every dtype), odd sums included."""
    k = _numel(shape)
    vals = [((i * 7 + r * 5) % 11) - 5 for i in range(k)]
    return torch.tensor(vals, dtype=torch.float64).to(dtype).reshape(shape)


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def trunc_scale(t, f):
    """Horovod's scaling: double-precision product cast back (integers truncate toward zero)."""
    if f == 1.0:
        return t
    return (t.double() * f).to(t.dtype)


def expected_reduce(op, dtype, pre=1.0, post=1.0, shape=(2, 3), ranks=None, inputs=None):
    ranks = list(range(N)) if ranks is None else ranks
    xs = inputs if inputs is not None else [data(r, dtype, shape) for r in ranks]
    xs = [trunc_scale(x, pre) for x in xs]
    acc = xs[0].clone()
    for x in xs[1:]:
        if op in ("sum", "average"):
            acc = acc + x
        elif op == "min":
            acc = torch.minimum(acc, x)
        elif op == "max":
            acc = torch.maximum(acc, x)
        else:
            acc = acc * x
    return trunc_scale(acc, post / len(ranks) if op == "average" else post)


# ---------------------------------------------------------------------------- checks
def run_all():
    ops = {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min, "max": hvd.Max, "product": hvd.Product}

    @check
    def allreduce_ops_and_dtypes():
        for dtype in INT_DTYPES + FLOAT_DTYPES + [torch.int8, torch.uint8, torch.bfloat16]:
            for name, op in ops.items():
                if dtype == torch.uint8 and name != "max":
                    continue  # negative inputs: max only
                x = data(R, dtype) if dtype != torch.uint8 else data(R, torch.int32).clamp_min(0).to(dtype)
                got = hvd.allreduce(x, op=op)
                if dtype == torch.uint8:
                    want = torch.stack([data(r, torch.int32).clamp_min(0) for r in range(N)]).max(0).values.to(dtype)
                else:
                    want = expected_reduce(name, dtype)
                eq(got, want, f"{name} {dtype}")
                eq(x, data(R, dtype) if dtype != torch.uint8 else x, "input unchanged")

    @check
    def float32_sum_uses_the_backends_allreduce():
        # gloo and MPI have one: float32 Sum/Average go through it; other dtypes and ops do not
        from hipress.comm.transport.base import Transport
        calls, real = [], Transport.allreduce

        def counted(self, values):
            calls.append(values.numel())
            return real(self, values)

        Transport.allreduce = counted
        try:
            eq(hvd.allreduce(data(R, torch.float32), op=hvd.Average), expected_reduce("average", torch.float32))
            eq(hvd.allreduce(data(R, torch.float64), op=hvd.Sum), expected_reduce("sum", torch.float64))
            eq(hvd.allreduce(data(R, torch.float32), op=hvd.Max), expected_reduce("max", torch.float32))
        finally:
            Transport.allreduce = real
        has = world.transport().has_allreduce
        assert calls == ([data(R, torch.float32).numel()] if N > 1 and has else []), (calls, has)

    @check
    def allreduce_average_of_integers_truncates_toward_zero():
        # rank 0: -3, others 0 (n=2: -1.5 -> -1; n=3: -1 -> -1); rank 0: 5 -> 2.5 -> 2 / 1.67 -> 1
        x = torch.tensor([-3 if R == 0 else 0, 5 if R == 0 else 0, 1], dtype=torch.int32)
        got = hvd.allreduce(x)
        want = torch.tensor([math.trunc(-3 / N), math.trunc(5 / N), math.trunc(N / N)], dtype=torch.int32)
        eq(got, want)
        eq(hvd.allreduce(x, average=True), want, "average=True")
        eq(hvd.allreduce(x, average=False), torch.tensor([-3, 5, N], dtype=torch.int32), "average=False")

    @check
    def allreduce_prescale_postscale():
        for dtype in (torch.int32, torch.float32, torch.float64):
            for op, pre, post in (("sum", 0.5, 1.0), ("sum", 1.0, 0.3), ("average", 2.0, 0.5), ("max", 3.0, 0.25)):
                got = hvd.allreduce(data(R, dtype), op=ops[op], prescale_factor=pre, postscale_factor=post)
                eq(got, expected_reduce(op, dtype, pre, post), f"{op} {dtype} pre {pre} post {post}")

    @check
    def allreduce_scalar_and_zero_size():
        eq(hvd.allreduce(torch.tensor(float(R + 1)), op=hvd.Sum), torch.tensor(float(N * (N + 1) // 2)))
        z = torch.zeros(0, 3, dtype=torch.int64)
        eq(hvd.allreduce(z, op=hvd.Sum), z, "zero-size")
        eq(hvd.grouped_allreduce([z, torch.ones(2)], op=hvd.Sum)[1], torch.full((2,), float(N)))

    @check
    def allreduce_inplace_async_and_grouped():
        x = data(R, torch.float32)
        y = hvd.allreduce_(x, op=hvd.Sum)
        assert y is x
        eq(x, expected_reduce("sum", torch.float32), "allreduce_")
        h = hvd.allreduce_async(data(R, torch.int64), op=hvd.Max, name="m")
        assert hvd.poll(h) is True
        eq(hvd.synchronize(h), expected_reduce("max", torch.int64), "async")
        assert hvd.synchronize(h) is None  # a handle is used once, as in Horovod
        x = data(R, torch.int32)
        h = hvd.allreduce_async_(x, op=hvd.Min)
        assert hvd.synchronize(h) is x
        eq(x, expected_reduce("min", torch.int32), "allreduce_async_")
        ts = [data(R, torch.float32), data(R, torch.int64, (4,)), data(R, torch.float32, (1, 1)), torch.zeros(0)]
        got = hvd.grouped_allreduce(ts, op=hvd.Sum)
        wants = [expected_reduce("sum", torch.float32), expected_reduce("sum", torch.int64, shape=(4,)),
                 expected_reduce("sum", torch.float32, shape=(1, 1)), torch.zeros(0)]
        for g, w in zip(got, wants):
            eq(g, w, "grouped")
        h = hvd.grouped_allreduce_async(ts, op=hvd.Product)
        for g, (t, shp) in zip(hvd.synchronize(h), [(torch.float32, (2, 3)), (torch.int64, (4,))]):
            eq(g, expected_reduce("product", t, shape=shp), "grouped async")
        # 60 tensors: the description of the call outgrows the first metadata block
        many = [torch.full((k % 3 + 1, 2), float(R + k)) for k in range(60)]
        for k, g in enumerate(hvd.grouped_allreduce(many, op=hvd.Sum)):
            eq(g, torch.full((k % 3 + 1, 2), float(sum(r + k for r in range(N)))), f"many {k}")
        ts2 = [data(R, torch.float64), data(R, torch.int32)]
        out = hvd.grouped_allreduce_(ts2)
        assert out[0] is ts2[0] and out[1] is ts2[1]
        eq(ts2[0], expected_reduce("average", torch.float64), "grouped_ avg f64")
        eq(ts2[1], expected_reduce("average", torch.int32), "grouped_ avg i32")

    @check
    def allreduce_compression():
        got = hvd.allreduce(data(R, torch.float32), op=hvd.Sum, compression=hvd.Compression.fp16)
        eq(got, expected_reduce("sum", torch.float32), "fp16")
        eq(hvd.allreduce(data(R, torch.int32), op=hvd.Sum, compression=hvd.Compression.fp16),
           expected_reduce("sum", torch.int32), "fp16 leaves ints")
        assert hvd.Compression.tbq == "tbq" and hvd.Compression.none == "none"
        # a hipress algorithm: each rank's values as the algorithm delivers them, then summed
        x = torch.tensor([1.0, -2.0, 0.5, 4.0]) * (R + 1)
        q = hvd.Compression.onebit.compress(x)[0]
        got = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.onebit)
        allq = hvd.allgather(q.unsqueeze(0))
        eq(got, allq.sum(0), "onebit")

    @check
    def allgather_variable_first_dim():
        for dtype in (torch.float32, torch.int64, torch.bool, torch.float16):
            x = (torch.arange((R + 1) * 2).reshape(R + 1, 2) + 100 * R).to(dtype)
            got = hvd.allgather(x)
            want = torch.cat([(torch.arange((r + 1) * 2).reshape(r + 1, 2) + 100 * r).to(dtype) for r in range(N)])
            eq(got, want, str(dtype))
        # rank 0 brings no rows
        x = torch.full((0 if R == 0 else R, 3), float(R))
        eq(hvd.allgather(x), torch.cat([torch.full((0 if r == 0 else r, 3), float(r)) for r in range(N)]), "zero rows")
        eq(hvd.allgather(torch.zeros(0, 2)), torch.zeros(0, 2), "all empty")
        h = hvd.allgather_async(torch.tensor([R]))
        eq(hvd.synchronize(h), torch.arange(N), "async")
        a, b = hvd.grouped_allgather([torch.tensor([R] * (R + 1)), torch.tensor([[float(R)]])])
        eq(a, torch.tensor([r for r in range(N) for _ in range(r + 1)]), "grouped 0")
        eq(b, torch.arange(N, dtype=torch.float32).reshape(N, 1), "grouped 1")
        assert hvd.allgather_object({"r": R, "s": "x" * R}) == [{"r": r, "s": "x" * r} for r in range(N)]
        big = hvd.allgather_object(list(range(300 * (R + 1))))  # more than one metadata block of bytes
        assert big == [list(range(300 * (r + 1))) for r in range(N)]

    @check
    def broadcast_every_root():
        for root in range(N):
            for dtype in (torch.float32, torch.int32, torch.bool):
                x = (torch.arange(6).reshape(2, 3) * (R + 1) % 2 if dtype == torch.bool else
                     torch.arange(6).reshape(2, 3) * (R + 1)).to(dtype)
                want = (torch.arange(6).reshape(2, 3) * (root + 1) % 2 if dtype == torch.bool else
                        torch.arange(6).reshape(2, 3) * (root + 1)).to(dtype)
                before = x.clone()
                eq(hvd.broadcast(x, root), want, f"root {root}")
                eq(x, before, "input unchanged")
                assert hvd.broadcast_(x, root) is x
                eq(x, want, "broadcast_")
            eq(hvd.broadcast(torch.zeros(0, 4), root), torch.zeros(0, 4), "zero-size")
            eq(hvd.broadcast(torch.tensor(float(R)), root), torch.tensor(float(root)), "scalar")
            assert hvd.broadcast_object({"from": R}, root_rank=root) == {"from": root}
        h = hvd.broadcast_async(torch.tensor([R]), N - 1)
        eq(hvd.synchronize(h), torch.tensor([N - 1]), "async")

    @check
    def alltoall_uneven_splits():
        def splits_of(r):
            return [(r + j) % 3 for j in range(N)]       # zeros included, uneven

        def rows_of(r):
            return torch.arange(sum(splits_of(r)) * 2).reshape(-1, 2) + 1000 * r

        for dtype in (torch.float32, torch.int64):
            x = rows_of(R).to(dtype)
            out, got = hvd.alltoall(x, splits=splits_of(R))
            parts = []
            for r in range(N):
                off = sum(splits_of(r)[:R])
                parts.append(rows_of(r)[off:off + splits_of(r)[R]])
            eq(out, torch.cat(parts).to(dtype), str(dtype))
            eq(got, torch.tensor([splits_of(r)[R] for r in range(N)], dtype=torch.int32), "received splits")
        out, got = hvd.alltoall(rows_of(R), splits=torch.tensor(splits_of(R), dtype=torch.int32))
        assert out.shape[0] == int(got.sum())
        # no splits: equal parts
        x = torch.arange(N * 2) + 10 * R
        eq(hvd.alltoall(x), torch.cat([torch.arange(2 * R, 2 * R + 2) + 10 * r for r in range(N)]), "equal parts")
        # everything empty
        out, got = hvd.alltoall(torch.zeros(0, 3), splits=[0] * N)
        eq(out, torch.zeros(0, 3), "zero-size")
        eq(got, torch.zeros(N, dtype=torch.int32), "zero splits")
        h = hvd.alltoall_async(torch.arange(N) + 10 * R)
        eq(hvd.synchronize(h)[0], torch.tensor([10 * r + R for r in range(N)]), "async")
        raises_everywhere(lambda: hvd.alltoall(torch.arange(N + 1)), ValueError, "not an even multiple")

    @check
    def reducescatter_uneven_rows():
        d = 2 * N + 1
        def inp(r, dtype):
            return data(r, dtype, (d, 2))
        q, rem = divmod(d, N)
        sizes = [q + (1 if i < rem else 0) for i in range(N)]
        start = sum(sizes[:R])
        for dtype in (torch.float32, torch.int32, torch.float64):
            for name in ("sum", "average"):
                got = hvd.reducescatter(inp(R, dtype), op=ops[name])
                want = expected_reduce(name, dtype, shape=(d, 2))[start:start + sizes[R]]
                eq(got, want, f"{name} {dtype}")
        got = hvd.reducescatter(inp(R, torch.float32), op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
        eq(got, expected_reduce("sum", torch.float32, 2.0, 0.5, shape=(d, 2))[start:start + sizes[R]], "scaled")
        # fewer rows than ranks: the last ranks get none
        got = hvd.reducescatter(torch.ones(1, 2), op=hvd.Sum)
        eq(got, torch.full((1, 2), float(N)) if R == 0 else torch.zeros(0, 2), "1 row")
        a, b = hvd.grouped_reducescatter([torch.ones(N, 1) * (R + 1), torch.arange(N * 2.0)], op=hvd.Sum)
        eq(a, torch.full((1, 1), float(N * (N + 1) // 2)), "grouped 0")
        eq(b, torch.tensor([2.0 * R * N, (2.0 * R + 1) * N]), "grouped 1")
        eq(hvd.synchronize(hvd.reducescatter_async(torch.ones(N), op=hvd.Sum)), torch.tensor([float(N)]), "async")
        raises_everywhere(lambda: hvd.reducescatter(torch.tensor(1.0)), ValueError, "scalar")
        raises_everywhere(lambda: hvd.reducescatter(torch.ones(N), op=hvd.Max), hvd.HorovodInternalError,
                          "only supports Average and Sum")

    @check
    def adasum():
        a = torch.tensor([1.0, 0.0, 0.0, 0.0]) if R % 2 == 0 else torch.tensor([0.0, 1.0, 0.0, 0.0])
        if N & (N - 1):
            raises_everywhere(lambda: hvd.allreduce(a, op=hvd.Adasum), NotImplementedError, "power of 2")
            return
        # orthogonal: plain sum; identical: the vector itself
        eq(hvd.allreduce(a, op=hvd.Adasum), torch.tensor([1.0, 1.0, 0.0, 0.0]), "orthogonal")
        same = torch.tensor([1.0, 2.0, -3.0])
        eq(hvd.allreduce(same, op=hvd.Adasum), same, "identical")
        # general pair: (1 - ab/2|a|^2) a + (1 - ab/2|b|^2) b with a=[1,1], b=[1,0]: ab=1, |a|^2=2, |b|^2=1
        v = torch.tensor([1.0, 1.0], dtype=torch.float64) if R == 0 else torch.tensor([1.0, 0.0], dtype=torch.float64)
        eq(hvd.allreduce(v, op=hvd.Adasum), torch.tensor([0.75 + 0.5, 0.75], dtype=torch.float64), "general")

    @check
    def autograd_gradients():
        x = torch.full((3,), float(R + 1), requires_grad=True)
        (hvd.allreduce(x) * (R + 1)).sum().backward()
        eq(x.grad, torch.full((3,), sum(r + 1 for r in range(N)) / N), "allreduce average")
        x = torch.full((3,), float(R + 1), requires_grad=True)
        (hvd.allreduce(x, op=hvd.Sum, postscale_factor=2.0) * (R + 1)).sum().backward()
        eq(x.grad, torch.full((3,), 2.0 * sum(r + 1 for r in range(N))), "allreduce sum, postscale")
        xs = [torch.ones(2, requires_grad=True), torch.ones(1, requires_grad=True)]
        ys = hvd.grouped_allreduce(xs, op=hvd.Sum)
        ((ys[0] * (R + 1)).sum() + (ys[1] * 2).sum()).backward()
        eq(xs[0].grad, torch.full((2,), float(sum(r + 1 for r in range(N)))), "grouped 0")
        eq(xs[1].grad, torch.full((1,), 2.0 * N), "grouped 1")

        # allgather: this rank's rows of the averaged output gradient
        x = torch.ones(R + 1, 2, requires_grad=True)
        y = hvd.allgather(x)
        total = y.shape[0]
        (y * torch.arange(total, dtype=torch.float32).view(-1, 1) * (R + 1)).sum().backward()
        off = sum(r + 1 for r in range(R))
        mean_w = sum(r + 1 for r in range(N)) / N
        eq(x.grad, (torch.arange(off, off + R + 1, dtype=torch.float32).view(-1, 1) * mean_w).expand(R + 1, 2),
           "allgather")

        # broadcast: the root gets the averaged gradient, the others zeros
        x = torch.ones(2, requires_grad=True)
        (hvd.broadcast(x, N - 1) * (R + 1)).sum().backward()
        eq(x.grad, torch.full((2,), mean_w if R == N - 1 else 0.0), "broadcast")

        # alltoall: the gradient of each sent row is the weight it had where it arrived
        def splits_of(r):
            return [(r + 2 * j) % 3 for j in range(N)]
        x = torch.arange(float(sum(splits_of(R))), requires_grad=True)
        y, got = hvd.alltoall(x, splits=splits_of(R))
        (y * torch.arange(1.0, y.shape[0] + 1) * (R + 1)).sum().backward()
        want = []
        for j in range(N):                      # rows sent to j, at their place in j's output
            before = sum(splits_of(r)[j] for r in range(R))
            want += [(before + k + 1) * (j + 1.0) for k in range(splits_of(R)[j])]
        eq(x.grad, torch.tensor(want), "alltoall")

        # reducescatter: allgather of the output gradients (times the size for Sum)
        d = N + 1
        q, rem = divmod(d, N)
        sizes = [q + (1 if i < rem else 0) for i in range(N)]
        for name, f in (("average", 1.0), ("sum", float(N))):
            x = torch.ones(d, 2, requires_grad=True)
            (hvd.reducescatter(x, op=ops[name]) * (R + 1)).sum().backward()
            want = torch.cat([torch.full((sizes[r], 2), (r + 1) * f) for r in range(N)])
            eq(x.grad, want, f"reducescatter {name}")

    @check
    def process_sets():
        sub = [0, 2] if N >= 3 else [1]
        ps = hvd.add_process_set(sub)
        assert ps.process_set_id is not None and ps.size() == len(sub), ps
        assert ps.included() == (R in sub)
        raises_everywhere(lambda: hvd.add_process_set(list(range(N))), ValueError, "duplicate")
        raises_everywhere(lambda: hvd.add_process_set([0] if R == 0 else [1]), ValueError, "disagree")
        if R in sub:
            assert ps.rank() == sub.index(R)
            eq(hvd.allreduce(data(R, torch.int32), op=hvd.Sum, process_set=ps),
               expected_reduce("sum", torch.int32, ranks=sub), "allreduce")
            eq(hvd.allreduce(data(R, torch.float32), process_set=ps),
               expected_reduce("average", torch.float32, ranks=sub), "average divides by the set size")
            eq(hvd.allgather(torch.tensor([R] * (R + 1)), process_set=ps),
               torch.tensor([r for r in sub for _ in range(r + 1)]), "allgather")
            eq(hvd.broadcast(torch.tensor([R]), sub[-1], process_set=ps), torch.tensor([sub[-1]]), "broadcast")
            out, got = hvd.alltoall(torch.tensor([R] * len(sub)), splits=[1] * len(sub), process_set=ps)
            eq(out, torch.tensor(sub), "alltoall")
            eq(hvd.reducescatter(torch.ones(len(sub)), op=hvd.Sum, process_set=ps), torch.tensor([float(len(sub))]),
               "reducescatter")
            assert hvd.allgather_object(R, process_set=ps) == sub
            # hipress.broadcast_object is hipress.torch.functions' (no process_set); the collectives
            # module has Horovod's signature
            assert collectives.broadcast_object(R, root_rank=sub[0], process_set=ps) == sub[0]
            hvd.barrier(process_set=ps)
            raises_everywhere(lambda: hvd.broadcast(torch.ones(1), [r for r in range(N) if r not in sub][0]
                                                    if len(sub) < N else N, process_set=ps), ValueError, "root")
        else:
            raises_everywhere(lambda: hvd.allreduce(torch.ones(1), process_set=ps), ValueError, "not part")
        hvd.barrier()
        assert hvd.remove_process_set(ps) is True
        assert hvd.remove_process_set(ps) is False and ps.process_set_id is None
        assert hvd.remove_process_set(hvd.global_process_set) is False
        raises_everywhere(lambda: hvd.allreduce(torch.ones(1), process_set=ps), ValueError, "registered")
        assert hvd.global_process_set.size() == N and hvd.global_process_set.rank() == R

    @check
    def mismatch_errors_on_every_rank():
        last = N - 1
        E = hvd.HorovodInternalError
        m = raises_everywhere(lambda: hvd.allreduce(torch.zeros(2 + (R == last))), E,
                              "Mismatched allreduce tensor shapes", f"rank {last}: [3]")
        raises_everywhere(lambda: hvd.allreduce(torch.zeros(2, dtype=torch.float64 if R == last else torch.float32)),
                          E, "Mismatched allreduce data types", f"rank {last}: torch.float64")
        raises_everywhere(lambda: hvd.allreduce(torch.zeros(2), op=hvd.Sum if R == 0 else hvd.Average), E,
                          "Mismatched allreduce reduction ops")
        raises_everywhere(lambda: hvd.allreduce(torch.zeros(2), prescale_factor=1.0 + (R == 0)), E,
                          "prescale factors")
        raises_everywhere(lambda: hvd.allgather(torch.zeros(1, 2 + (R == last))), E,
                          "Mismatched allgather tensor shapes beyond the first dimension")
        raises_everywhere(lambda: hvd.allgather(torch.zeros(1, 2) if R else torch.zeros(1, 2, 1)), E, "tensor ranks")
        raises_everywhere(lambda: hvd.broadcast(torch.zeros(2), R), E, "Mismatched broadcast root ranks")
        raises_everywhere(lambda: hvd.broadcast(torch.zeros(2 + (R == last)), 0), E, "Mismatched broadcast tensor shapes")
        raises_everywhere(lambda: hvd.reducescatter(torch.zeros(N + (R == last))), E, "Mismatched reducescatter")
        raises_everywhere(lambda: hvd.alltoall(torch.zeros(N, 1 + (R == last))), E, "Mismatched alltoall")
        raises_everywhere(lambda: hvd.grouped_allreduce([torch.zeros(1)] * (1 + (R == last))), E, "numbers of tensors")
        raises_everywhere(lambda: (hvd.allreduce(torch.zeros(1)) if R == 0 else hvd.allgather(torch.zeros(1))), E,
                          "Mismatched collective operations", "rank 0: allreduce")
        # one rank's bad arguments: ValueError there, HorovodInternalError naming it elsewhere
        bad = lambda: hvd.alltoall(torch.zeros(N), splits=[1] * (N + (R == 0)))  # noqa: E731
        if R == 0:
            raises_everywhere(bad, ValueError, "splits")
        else:
            raises_everywhere(bad, E, "rank(s) [0] passed invalid arguments")
        raises_everywhere(lambda: hvd.broadcast(torch.zeros(1), N), ValueError, "invalid root rank")
        raises_everywhere(lambda: hvd.allreduce(torch.zeros(1), average=True, op=hvd.Sum), ValueError, "supersedes")
        # async: the error comes from synchronize
        h = hvd.allreduce_async(torch.zeros(2 + (R == last)))
        raises_everywhere(lambda: hvd.synchronize(h), E, "Mismatched allreduce tensor shapes")
        # and the collectives still work afterwards
        eq(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(N)), "after the errors")
        others = ", ".join(str(r) for r in range(last))
        assert f"rank{'s' if last > 1 else ''} {others}: [2]" in m, m  # every rank named

    @check
    def join_with_one_rank_stopping_early():
        last = N - 1
        if R == last:
            got = hvd.join()
        else:
            x = torch.full((2,), 5.0 * (R + 1))
            # the joined rank contributes zeros; Average still divides by the full size
            eq(hvd.allreduce(x, op=hvd.Sum), torch.full((2,), 5.0 * sum(r + 1 for r in range(last))), "sum")
            eq(hvd.allreduce(x), torch.full((2,), 5.0 * sum(r + 1 for r in range(last)) / N), "average")
            eq(hvd.allreduce(x, op=hvd.Min), torch.zeros(2), "min sees the zeros")
            eq(hvd.allreduce(torch.tensor([5, -5]), ), torch.tensor([math.trunc(5 * last / N), math.trunc(-5 * last / N)]),
               "int average")
            a, b = hvd.grouped_allreduce([torch.ones(3), torch.ones(1, dtype=torch.int64)], op=hvd.Sum)
            eq(a, torch.full((3,), float(last)), "grouped")
            eq(b, torch.full((1,), last), "grouped int")
            eq(hvd.allgather(torch.tensor([R, R])), torch.tensor([r for r in range(last) for _ in (0, 1)]), "allgather")
            eq(hvd.broadcast(torch.tensor([R + 10]), 0), torch.tensor([10]), "broadcast")
            raises_everywhere(lambda: hvd.broadcast(torch.tensor([1]), last), hvd.HorovodInternalError, "has joined")
            raises_everywhere(lambda: hvd.alltoall(torch.zeros(N)), hvd.HorovodInternalError,
                              "not supported while rank(s) [%d] have joined" % last)
            hvd.barrier()
            got = hvd.join()
        # the working ranks join in the same round: the highest of them joined last
        assert got == (last - 1 if N > 1 else 0), got
        assert hvd.join() == last  # everyone at once: the highest rank
        eq(hvd.allreduce(torch.ones(1), op=hvd.Sum), torch.full((1,), float(N)), "after join")

    @check
    def sync_batch_norm_matches_batch_norm_over_all_batches():
        torch.manual_seed(0)
        C = 3
        xs = [torch.randn(r + 2, C, 2) * (r + 1) + r for r in range(N)]
        ws = [torch.randn(r + 2, C, 2) for r in range(N)]
        w0, b0 = torch.randn(C), torch.randn(C)
        ref = torch.nn.BatchNorm1d(C)
        sbn = hvd.SyncBatchNorm(C)
        with torch.no_grad():
            for m in (ref, sbn):
                m.weight.copy_(w0)
                m.bias.copy_(b0)
        xall = torch.cat(xs).requires_grad_(True)
        yref = ref(xall)
        (yref * torch.cat(ws)).sum().backward()
        x = xs[R].clone().requires_grad_(True)
        y = sbn(x)
        (y * ws[R]).sum().backward()
        off = sum(r + 2 for r in range(R))
        close(y, yref[off:off + R + 2].detach(), "forward")
        close(x.grad, xall.grad[off:off + R + 2], "input gradient")
        close(hvd.allreduce(sbn.weight.grad, op=hvd.Sum), ref.weight.grad, "weight gradient (summed)")
        close(hvd.allreduce(sbn.bias.grad, op=hvd.Sum), ref.bias.grad, "bias gradient (summed)")
        close(sbn.running_mean, ref.running_mean, "running mean")
        close(sbn.running_var, ref.running_var, "running var")
        sbn.eval()
        ref.eval()
        close(sbn(xs[R]), ref(xs[R]).detach(), "eval")

    @check
    def metrics_alongside_distributed_optimizer():
        """A Horovod training loop: the optimizer's exchanges and hvd.allreduce of a metric
        between steps, with hvd.Compression entries given to DistributedOptimizer."""
        for comp in (hvd.Compression.none, hvd.Compression.tbq):
            torch.manual_seed(R)
            model = torch.nn.Linear(4, 1)
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), compression=comp)
            for step in range(3):
                x = torch.full((2, 4), float(R + step))
                loss = model(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                avg = hvd.allreduce(loss.detach(), name="loss")
                every = hvd.allgather(loss.detach().reshape(1))
                close(avg, every.double().mean().float(), f"{comp} metric average")
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            allp = hvd.allgather(flat.unsqueeze(0))
            for r in range(N):
                eq(allp[r], flat, f"{comp}: parameters equal on every rank")

    @check
    def barrier_timeline_and_queries():
        hvd.barrier()
        assert hvd.is_initialized()
        path = os.path.join(tempfile.gettempdir(), f"hipress_tl_{os.getpid()}.json")
        hvd.start_timeline(path)
        hvd.allreduce(torch.ones(1), name="tl_probe")
        hvd.stop_timeline()
        if R == 0:
            import json
            with open(path) as f:
                ev = json.load(f)["traceEvents"]
            assert any(e["name"] == "tl_probe" for e in ev), ev
            os.remove(path)
        t = os.environ.get("EXPECT_TRANSPORT", "")
        assert hvd.gloo_enabled() == t.endswith("/gloo"), t
        assert hvd.mpi_enabled() == (t == "mpi" or t.endswith("/mpi")), t
        assert world.transport().name == t, (world.transport().name, t)
        assert hvd.gloo_built() and isinstance(hvd.nccl_built(), int) and hvd.ccl_built() is False
        assert hvd.mpi_built() in (True, False) and hvd.cuda_built() in (True, False) and not hvd.rocm_built()
        assert hvd.is_homogeneous()


def main():
    global R, N
    hvd.init()
    R, N = hvd.rank(), hvd.size()
    run_all()
    hvd.barrier()
    out = {"rank": R, "size": N, "transport": world.transport().name, "passed": PASSED, "failed": FAILED}
    hvd.shutdown()
    emit(out)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
