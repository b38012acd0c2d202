"""One rank of the Horovod parity test (test_collectives.py, under horovodrun): runs the same calls
through ``horovod.torch`` and through ``hipress`` (the Horovod transport underneath) and compares
the results: integers exactly, floats to 1e-6 (Horovod's ring may sum in another order), shapes,
dtypes and gradients. Emits {"rank", "size", "compared": count, "diffs": [...]}.
"""
import os
import sys
import traceback

import horovod.torch as H
import torch

from worker_common import emit

import hipress as P
from hipress import config

DIFFS = []
COUNT = [0]


def started(what):
    """The call about to be made, in this rank's progress file: a run that hangs (CI once saw
    Horovod's background thread time out on every rank) then says which call each rank was in."""
    where = config.get("HIPRESS_TEST_RESULT_DIR")
    if where:
        with open(os.path.join(where, f"progress.{H.rank()}"), "a") as f:
            f.write(what + "\n")


def same(a, b, what):
    COUNT[0] += 1
    if isinstance(a, (tuple, list)):
        if not isinstance(b, (tuple, list)) or len(a) != len(b):
            DIFFS.append(f"{what}: horovod {type(a).__name__}[{len(a)}] vs hipress {b!r}")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{what}[{i}]")
        return
    if isinstance(a, torch.Tensor):
        ok = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and (
            torch.equal(a, b) if not a.dtype.is_floating_point else
            torch.allclose(a.double(), b.double(), rtol=1e-6, atol=1e-6))
        if not ok:
            DIFFS.append(f"{what}: horovod {a.dtype} {tuple(a.shape)} {a.tolist()} vs hipress "
                         f"{getattr(b, 'dtype', None)} {tuple(getattr(b, 'shape', ()))} "
                         f"{b.tolist() if isinstance(b, torch.Tensor) else b}")
        return
    if a != b:
        DIFFS.append(f"{what}: horovod {a!r} vs hipress {b!r}")


def both(what, fn):
    """fn(module) through both; exceptions compared by type."""
    res = []
    for mod in (H, P):
        started(f"{what} through {mod.__name__}")
        try:
            res.append(("ok", fn(mod)))
        except Exception as e:  # noqa: BLE001
            res.append(("exc", type(e).__name__, str(e)[:200]))
    (ka, *a), (kb, *b) = res
    if ka != kb:
        DIFFS.append(f"{what}: horovod {ka} {a} vs hipress {kb} {b}")
    elif ka == "ok":
        same(a[0], b[0], what)
    else:
        COUNT[0] += 1


def hipress_raises_as_horovod_would(what, fn):
    """An op Horovod's reducescatter rejects: Horovod raises HorovodInternalError for it, but now
    and then its background thread aborts every rank instead (operations.cc logs the same
    message), so only hipress is called and must raise that type."""
    COUNT[0] += 1
    started(f"{what} through hipress")
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        if type(e).__name__ != "HorovodInternalError":
            DIFFS.append(f"{what}: hipress raised {type(e).__name__}: {e}, Horovod raises HorovodInternalError")
        return
    DIFFS.append(f"{what}: hipress did not raise; Horovod raises HorovodInternalError")


def inputs(r, dtype, shape):
    k = 1
    for s in shape:
        k *= s
    vals = [((i * 7 + r * 5) % 11) - 5 for i in range(k)]
    return torch.tensor(vals, dtype=torch.float64).to(dtype).reshape(shape)


def main():
    H.init(process_sets="dynamic")  # hipress adds process sets (its transport and groups)
    P.init()
    r, n = H.rank(), H.size()
    assert (r, n) == (P.rank(), P.size())
    ops = {"Average": (H.Average, P.Average), "Sum": (H.Sum, P.Sum), "Min": (H.Min, P.Min), "Max": (H.Max, P.Max),
           "Product": (H.Product, P.Product)}
    try:
        for dtype in (torch.int32, torch.int64, torch.float32, torch.float64):
            for name, (ho, po) in ops.items():
                for pre, post in ((1.0, 1.0), (0.5, 1.0), (1.0, 0.3), (2.5, 0.7)):
                    x = inputs(r, dtype, (3, 4))
                    both(f"allreduce {dtype} {name} pre {pre} post {post}",
                         lambda m: m.allreduce(x, op=ho if m is H else po, prescale_factor=pre, postscale_factor=post))
                for rows in (1, n, 2 * n + 1):
                    x = inputs(r, dtype, (rows, 2))
                    if name in ("Average", "Sum"):
                        both(f"reducescatter {dtype} {name} rows {rows}",
                             lambda m: m.reducescatter(x, op=ho if m is H else po))
                    else:
                        hipress_raises_as_horovod_would(f"reducescatter {dtype} {name} rows {rows}",
                                                        lambda: P.reducescatter(x, op=po))
        for dtype in (torch.int32, torch.float32, torch.float64, torch.int64):
            x = inputs(r, dtype, (r + 1, 3))
            both(f"allgather {dtype}", lambda m: m.allgather(x))
            both(f"broadcast {dtype}", lambda m: m.broadcast(x[:1], n - 1))
            splits = [(r + j) % 3 for j in range(n)]
            y = inputs(r, dtype, (sum(splits), 2))
            both(f"alltoall {dtype}", lambda m: m.alltoall(y, splits=splits))
            z = inputs(r, dtype, (2 * n, 2))
            both(f"alltoall equal {dtype}", lambda m: m.alltoall(z))
        both("grouped_allreduce", lambda m: m.grouped_allreduce([inputs(r, torch.float32, (2,)),
                                                                inputs(r, torch.int64, (3,))]))
        both("grouped_allgather", lambda m: list(m.grouped_allgather([inputs(r, torch.float32, (r + 1,)),
                                                                    inputs(r, torch.int32, (1, 2))])))
        both("grouped_reducescatter", lambda m: m.grouped_reducescatter([inputs(r, torch.float32, (n + 1,)),
                                                                        inputs(r, torch.int32, (n, 2))]))
        both("allgather_object", lambda m: m.allgather_object({"r": r}))
        both("zero-size allgather", lambda m: m.allgather(torch.zeros(0 if r == 0 else 1, 2)))
        both("scalar allreduce", lambda m: m.allreduce(torch.tensor(float(r))))
        both("average and op", lambda m: m.allreduce(torch.ones(1), average=True, op=m.Sum))
        both("alltoall not divisible", lambda m: m.alltoall(torch.ones(n + 1)))
        both("reducescatter scalar", lambda m: m.reducescatter(torch.tensor(1.0)))
        both("broadcast bad root", lambda m: m.broadcast(torch.ones(1), n))

        def grads(m, kind, op=None):
            x = inputs(r, torch.float64, (n + 1, 2)).requires_grad_(True)
            if kind == "allreduce":
                y = m.allreduce(x, op=op)
            elif kind == "allgather":
                y = m.allgather(x)
            elif kind == "broadcast":
                y = m.broadcast(x, 1)
            elif kind == "reducescatter":
                y = m.reducescatter(x, op=op)
            else:
                y, _ = m.alltoall(x, splits=[(r + j) % 2 for j in range(n)])
            w = torch.arange(1.0, y.numel() + 1, dtype=torch.float64).reshape(y.shape) * (r + 1)
            (y * w).sum().backward()
            return x.grad
        for kind in ("allgather", "broadcast", "alltoall"):
            both(f"gradient {kind}", lambda m: grads(m, kind))
        for kind in ("allreduce", "reducescatter"):
            for name in ("Average", "Sum"):
                both(f"gradient {kind} {name}", lambda m: grads(m, kind, ops[name][0 if m is H else 1]))
    except Exception:  # noqa: BLE001
        DIFFS.append(traceback.format_exc()[-2000:])
    emit({"rank": r, "size": n, "compared": COUNT[0], "diffs": DIFFS})
    return 1 if DIFFS else 0


if __name__ == "__main__":
    sys.exit(main())
