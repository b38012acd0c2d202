"""hipress's Horovod API in one process: names, Compression, and the agreement rules that make a
mismatch raise on every rank (hipress.torch.collectives._Round, given what each rank announced).
The multi-process behaviour is tests/multiproc/test_collectives.py."""
import pytest
import torch

import hipress as hvd
from hipress.torch import collectives as C


def meta(op="allreduce", t=(("torch.float32", [2]),), **kw):
    d = {"op": op, "err": None, "count": len(t), "t": [list(x) for x in t], "rop": "sum", "pre": 1.0, "post": 1.0}
    d.update(kw)
    return d


def test_horovod_names_are_exported():
    for name in ("allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
                 "allgather", "allgather_object", "broadcast", "broadcast_", "alltoall", "reducescatter",
                 "grouped_reducescatter", "synchronize", "poll", "barrier", "join", "Compression", "SyncBatchNorm",
                 "ProcessSet", "add_process_set", "remove_process_set", "global_process_set", "start_timeline",
                 "stop_timeline", "mpi_built", "gloo_built", "nccl_built", "mpi_enabled", "gloo_enabled", "cuda_built",
                 "rocm_built", "Adasum", "Min", "Max", "Product", "HorovodInternalError", "is_initialized"):
        assert getattr(hvd, name) is not None, name
    assert (hvd.Average, hvd.Sum) == (C.Average, C.Sum)  # the optimizer's values


def test_ops_accept_horovod_codes_and_reject_the_rest():
    assert [C._norm_op(i) for i in range(6)] == [C.Average, C.Sum, C.Adasum, C.Min, C.Max, C.Product]
    assert C._resolve_op(None, None) == C.Average
    with pytest.warns(DeprecationWarning):
        assert C._resolve_op(None, False) == C.Sum
    with pytest.raises(ValueError, match="supersedes"):
        C._resolve_op(C.Sum, True)
    with pytest.raises(ValueError):
        C._norm_op("mean")


def test_agreement_names_the_ranks():
    rd = C._Round("allreduce", [meta(), meta(), meta(t=(("torch.float32", [3]),))], [0, 1, 2])
    assert rd.error == "Mismatched allreduce tensor shapes: ranks 0, 1: [2]; rank 2: [3]"
    rd = C._Round("allreduce", [meta(), meta(t=(("torch.float64", [2]),))], [0, 1])
    assert rd.error == "Mismatched allreduce data types: rank 0: torch.float32; rank 1: torch.float64"
    rd = C._Round("allreduce", [meta(), meta(op="allgather")], [4, 7])  # world ranks of a process set
    assert rd.error == "Mismatched collective operations: rank 4: allreduce; rank 7: allgather"
    rd = C._Round("allreduce", [meta(err="bad splits"), meta()], [0, 1])
    assert "rank(s) [0] passed invalid arguments" in rd.error and "bad splits" in rd.error
    rd = C._Round("allgather", [meta("allgather", (("torch.int64", [1, 2]),)),
                                meta("allgather", (("torch.int64", [5, 2]),))], [0, 1])
    assert rd.error is None and rd.plan is not None  # first dimensions may differ
    rd = C._Round("allreduce", [meta(), {"op": "join", "first": True}], [0, 1])
    assert rd.error is None and rd.joined == [1]
    rd = C._Round("alltoall", [meta("alltoall", splits=[1, 1]), {"op": "join", "first": True}], [0, 1])
    assert "not supported while rank(s) [1] have joined" in rd.error


def test_single_process_collectives():
    from hipress.comm import world

    mine = not world.is_initialized()
    hvd.init()
    try:
        assert hvd.size() == 1
        eq = torch.testing.assert_close
        x = torch.tensor([3, -3], dtype=torch.int32)
        eq(hvd.allreduce(x, postscale_factor=0.5), torch.tensor([1, -1], dtype=torch.int32))  # truncates
        eq(hvd.allgather(torch.ones(2, 3)), torch.ones(2, 3))
        out, got = hvd.alltoall(torch.arange(3), splits=[2])
        eq(out, torch.arange(2))
        eq(got, torch.tensor([2], dtype=torch.int32))
        eq(hvd.reducescatter(torch.arange(4.0), op=hvd.Sum), torch.arange(4.0))
        assert hvd.join() == 0
        with pytest.raises(ValueError, match="scalar"):
            hvd.allgather(torch.tensor(1.0))
    finally:
        if mine:
            world.shutdown()


def test_compression_entries():
    c = hvd.Compression
    assert c.tbq == "tbq" and isinstance(c.none, str) and c.fp16 == "fp16"
    t, ctx = c.fp16.compress(torch.tensor([1.5, 2.0]))
    assert t.dtype == torch.float16 and c.fp16.decompress(t, ctx).dtype == torch.float32
    x = torch.tensor([1.0, -2.0, 0.5, 4.0])
    q, _ = c.onebit.compress(x)
    assert q.shape == x.shape and not torch.equal(q, x)
    with pytest.raises(NotImplementedError, match="low-rank"):
        c.powersgd.compress(torch.ones(4, 4))
    with pytest.raises(AttributeError, match="no algorithm"):
        c.nope  # noqa: B018
