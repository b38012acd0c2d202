"""DistributedOptimizer's Horovod keyword arguments: gradient_predivide_factor, groups /
num_groups and sparse_as_dense, on 2 and 3 real ranks over gloo against exact expected
values (hvd_kwargs_worker.py), and their argument checks on a single rank."""
import os
import sys
import warnings

import pytest
import torch
import torch.nn as nn
from hvd_kwargs_worker import local_input

import hipress
from hipress.launch import run

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = [2 + k for k in range(5)]  # the worker's five parameters


def expected(n, step):
    """Each parameter's gradient averaged over n ranks, in float64."""
    return [torch.stack([local_input(i, m, r, step).double() for r in range(n)]).mean(0)
            for i, m in enumerate(SIZES)]


@pytest.fixture(scope="module", params=[2, 3])
def ranks(request, tmp_path_factory):
    n = request.param
    out = tmp_path_factory.mktemp(f"hvd_kwargs{n}")
    code, logs = run([sys.executable, os.path.join(HERE, "hvd_kwargs_worker.py"), str(out)], n,
                     timeout=180, quiet=True)
    assert code == 0, "\n".join(logs)[-4000:]
    return n, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(n)]


def check_averages(n, steps, what):
    for step, grads in enumerate(steps):
        for i, (got, want) in enumerate(zip(grads, expected(n, step))):
            torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6,
                                       msg=lambda m: f"{what}, step {step}, p.{i}: {m}")


def test_gradient_predivide_factor_gives_the_average(ranks):
    n, res = ranks
    for r in range(n):
        assert res[r]["size"] == n
        for f in (1.0, 2.5, 4.0):
            check_averages(n, res[r][f"predivide {f}"], f"rank {r}, gradient_predivide_factor={f}")
            # the same as without the factor, up to float rounding
            for a, b in zip(sum(res[r][f"predivide {f}"], []), sum(res[r]["predivide 1.0"], [])):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


@pytest.mark.parametrize("case,want_layout", [
    ("groups 2", [["p.0", "p.1", "p.2"], ["p.3", "p.4"]]),               # 5 parameters cut into 3 + 2
    ("num_groups 3", [["p.0", "p.1"], ["p.2", "p.3"], ["p.4"]]),
    ("groups lists", [["p.0", "p.3"], ["p.4"], ["p.2", "p.1"]]),          # the rest fused as usual
])
def test_groups_are_buckets_and_average(ranks, case, want_layout):
    n, res = ranks
    for r in range(n):
        layout, steps = res[r][case]
        assert layout == want_layout, (r, layout)
        check_averages(n, steps, f"rank {r}, {case}")


def test_sparse_as_dense_synchronizes_embedding_gradients(ranks):
    n, res = ranks
    # rank r looks up rows r, r + 1, r with weights (1, 2) per column
    counts = torch.zeros(6, dtype=torch.float64)
    for r in range(n):
        counts[r] += 2
        counts[r + 1] += 1
    want = counts[:, None] * torch.tensor([1.0, 2.0], dtype=torch.float64) / n
    for r in range(n):
        assert res[r]["sparse grad is sparse"] is True  # given back in the layout it came in
        torch.testing.assert_close(res[r]["sparse grad"].double(), want, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(res[r]["sparse step"].double(), 0.5 * want, rtol=1e-6, atol=1e-6)
        err = res[r]["sparse error"]
        assert err is not None and "sparse" in err and "sparse_as_dense=True" in err, err


def adasum_pair(a, b):
    """Horovod's Adasum of two updates, written from the paper's formula."""
    dot = float(a @ b)
    return (1 - dot / (2 * float(a @ a))) * a + (1 - dot / (2 * float(b @ b))) * b


def adasum_expected(n, steps):
    """Each rank runs its own Adam (its moments local) from the shared parameters; the ranks'
    updates are combined pairwise per tensor; every rank continues from the combination."""
    shared = [torch.zeros(m, dtype=torch.float64) for m in SIZES]
    local = [[torch.zeros(m, dtype=torch.float64, requires_grad=True) for m in SIZES] for _ in range(n)]
    adams = [torch.optim.Adam(ps, lr=0.1) for ps in local]
    out = []
    for step in range(steps):
        deltas = []
        for r in range(n):
            for i, q in enumerate(local[r]):
                q.data.copy_(shared[i])
                q.grad = local_input(i, SIZES[i], r, step).double()
            adams[r].step()
            deltas.append([q.detach() - s for q, s in zip(local[r], shared)])
        averaged = [s + sum(d[i] for d in deltas) / n for i, s in enumerate(shared)]
        for i in range(len(SIZES)):
            level = [d[i] for d in deltas]
            while len(level) > 1:
                level = [adasum_pair(level[j], level[j + 1]) for j in range(0, len(level), 2)]
            shared[i] = shared[i] + level[0]
        out.append(([s.clone() for s in shared], averaged))
    return out


def test_adasum_combines_each_ranks_adam_update(ranks):
    n, res = ranks
    if n & (n - 1):
        for r in range(n):  # every rank refuses, none hangs
            assert "power of 2" in res[r]["adasum"]["error"], res[r]["adasum"]
        return
    want = adasum_expected(n, 3)
    for r in range(n):
        got = res[r]["adasum"]["params"]
        for step, (combined, _) in enumerate(want):
            for i in range(len(SIZES)):
                torch.testing.assert_close(got[step][i].double(), combined[i], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"rank {r}, step {step}, p.{i}: {m}")
    # the ranks' updates differ from step 1 on (Adam's first step is about lr * sign(g) on both),
    # so there the combination is not the average
    combined, averaged = want[1]
    assert max(float((c - a).abs().max()) for c, a in zip(combined, averaged)) > 1e-3
    # a NaN in rank 1's gradient: no rank steps, every rank warns naming it
    for r in range(n):
        a = res[r]["adasum"]
        for before, after in zip(a["params"][-1], a["after nan"]):
            assert torch.equal(before, after)
        assert a["last_nonfinite"] == {"p.2": [1]}
        assert len(a["nan warnings"]) == 1 and "step skipped on every rank" in a["nan warnings"][0]


# ------------------------------------------------------------------ argument checks (one rank)
def wrap(model, **kw):
    return hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(), **kw)


@pytest.fixture
def model():
    return nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))


@pytest.mark.parametrize("kw,match", [
    ({"gradient_predivide_factor": 2.0, "op": hipress.Sum}, "only supported with op=hipress.Average"),
    ({"gradient_predivide_factor": 0.0}, "positive finite"),
    ({"gradient_predivide_factor": float("inf")}, "positive finite"),
    ({"gradient_predivide_factor": "2"}, "positive finite"),
    ({"groups": 0}, ">= 1"),
    ({"groups": "two"}, "positive int or a list"),
    ({"groups": [torch.zeros(2)]}, r"groups\[0\] must be a list"),
    ({"groups": [[1.0]]}, "must consist of torch.Tensor"),
    ({"groups": [[torch.zeros(2)]]}, "not a parameter of this optimizer"),
    ({"op": hipress.Adasum, "compression": "onebit"}, "Adasum .* takes none of .\"compression='onebit'\""),
    ({"op": hipress.Adasum, "gradient_predivide_factor": 2.0}, "none of .'gradient_predivide_factor'"),
    ({"op": hipress.Adasum, "ratio": 0.1}, r"none of \['ratio'\]"),
])
def test_bad_horovod_arguments_raise(model, kw, match):
    with pytest.raises(ValueError, match=match):
        wrap(model, **kw)


def test_a_parameter_twice_in_groups_raises(model):
    w = model[0].weight
    with pytest.raises(ValueError, match="'0.weight' appears twice in groups"):
        wrap(model, groups=[[w], [model[1].bias, w]])


def test_num_groups_is_deprecated_and_exclusive_with_groups(model):
    with pytest.warns(DeprecationWarning, match="num_groups"):
        opt = wrap(model, num_groups=2)
    assert [[n for n, _ in b.params] for b in opt._hp_buckets] == [["0.weight", "0.bias"], ["1.weight", "1.bias"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ValueError, match="not both"):
            wrap(nn.Linear(2, 2), num_groups=2, groups=1)


def test_single_rank_predivide_and_sparse_leave_gradients_as_they_were():
    torch.manual_seed(0)
    emb = nn.Embedding(5, 3, sparse=True)
    opt = wrap(emb, sparse_as_dense=True, gradient_predivide_factor=4.0)
    emb(torch.tensor([0, 3, 3])).sum().backward()
    opt.synchronize()
    g = emb.weight.grad
    assert g.is_sparse
    torch.testing.assert_close(g.to_dense(), torch.tensor([[1.0] * 3, [0.0] * 3, [0.0] * 3, [2.0] * 3, [0.0] * 3]))
