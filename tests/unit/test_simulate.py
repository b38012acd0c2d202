"""The convergence bench's reference simulator (hipress/bench/simulate.py): N workers in one
process, the algorithms' numpy references, allgather semantics."""
import numpy as np
import pytest
import torch

from hipress import compression
from hipress.bench import simulate, tasks
from hipress.compression import reference as ref
from hipress.sync import reference as sync_reference
from hipress.sync.base import StateStore
from hipress.torch.optimizer import bucket_bounds, splits_tensors

pytest.importorskip("sklearn")
ALGOS = ["none", "onebit", "tbq", "terngrad", "dgc", "graddrop", "powersgd"]


def digits(seed=42, batch=8):
    return tasks.build("digits", seed, batch)


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def test_none_equals_one_process_on_the_concatenated_batch():
    task = digits()
    sim = simulate.Simulation(task, 2, "none", lr=0.05)
    single = digits()  # same seed: the same initial parameters
    opt = tasks.optimizer(single.model, 0.05)
    for i in range(3):
        sim.step(1, i)
        xs, ys = zip(*(single.batch(r, 2, 1, i) for r in range(2)))
        opt.zero_grad()
        single.loss(single.model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    for a, b in zip(params(task.model), params(single.model)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(params(task.model), params(digits().model)))


@pytest.mark.parametrize("bucket_bytes", [0, None])
@pytest.mark.parametrize("with_momentum", [False, True])
def test_onebit_mean_is_the_mean_of_decoded_error_feedback_payloads(bucket_bytes, with_momentum):
    """By hand, per worker and parameter: u = g (first step), else 0.9 u + g (momentum
    correction, with a momentum SGD) or u = g (without); c = u + e; d = decode(encode(c));
    e = c - d; mean = (d_0 + d_1) / 2. One payload per parameter both when every gradient is
    its own bucket (bucket_bytes=0) and in hipress's fused bucket of the digits CNN (allgather
    frames a quantizer's tensors apart)."""
    model = digits().model
    named = list(model.named_parameters())
    kw = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 if with_momentum else 0.0)
    sim = simulate.Reference(named, 2, "onebit", optimizer=opt, **kw)
    assert len(sim.buckets) == (len(named) if bucket_bytes == 0 else 1)
    assert (sim.momentum is not None) == with_momentum
    velocity, residual = {}, {}
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        grads = [[torch.randn(p.shape, generator=gen) * (j + 1) for j, (_, p) in enumerate(named)] for _ in range(2)]
        expect = []
        for j in range(len(named)):
            acc = 0
            for r in range(2):
                g = grads[r][j].numpy().reshape(-1).copy()
                u = g if (step == 0 or not with_momentum) else np.float32(0.9) * velocity[r, j] + g
                velocity[r, j] = u
                c = u + residual.get((r, j), 0)
                row = compression.OneBit().row_length(c.size, named[j][1].shape)  # per-row scales (cause 12)
                d = ref.onebit_decode(ref.onebit_encode(c, row), c.size)
                residual[r, j] = c - d
                acc = acc + d
            expect.append(acc / 2)
        got = sim.reduce(grads)
        for g, e in zip(got, expect):
            np.testing.assert_allclose(g.numpy().reshape(-1), e, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("algo", ["none", "onebit", "tbq", "terngrad", "dgc", "graddrop"])
def test_single_round_equals_hipress_allgather_oracle(algo):
    """Against hipress.sync.reference.allgather with the native compressors and per-rank
    StateStores (bit-exact against hipress's allgather strategy): the same partitions, state
    keys, random streams (independent per rank) and error feedback."""
    n = 3
    named = list(digits().model.named_parameters())
    sim = simulate.Reference(named, n, algo, grad_clip=None)
    comp = compression.get(algo)
    stores = [StateStore(r) for r in range(n)]
    (bucket,) = sim.buckets
    bounds = bucket_bounds(bucket, 64 << 20, splits_tensors(comp, "allgather"))
    index = {id(p): j for j, (_, p) in enumerate(named)}
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        grads = [[torch.randn(p.shape, generator=gen) * 0.01 for _, p in named] for _ in range(n)]
        flats = [torch.cat([g[index[id(p)]].reshape(-1) for _, p in bucket.params]) for g in grads]
        expect = sync_reference.allgather(flats, comp, stores, bucket.name, bounds, segments=bucket.segments)[0]
        got = sim.reduce(grads)
        got = torch.cat([got[index[id(p)]].reshape(-1) for _, p in bucket.params])
        np.testing.assert_allclose(got.numpy(), expect.numpy(), rtol=1e-6, atol=1e-9)


def test_powersgd_of_full_rank_is_the_plain_mean():
    """With rank >= the smaller side, P is an orthonormal basis of the summed M Q and the two
    summed rounds give back the mean gradient: a round summed per worker instead of over
    workers would not."""
    model = torch.nn.Linear(8, 4)
    named = list(model.named_parameters())
    sim = simulate.Reference(named, 3, "powersgd", {"rank": 4})
    assert sim.semantics == "lowrank"
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        grads = [[torch.randn(p.shape, generator=gen) for _, p in named] for _ in range(3)]
        for got, *gs in zip(sim.reduce(grads), *grads):
            torch.testing.assert_close(got, sum(gs) / 3, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("algo", ALGOS)
def test_every_algorithm_trains_two_steps_deterministically(algo):
    def two_steps():
        task = digits()
        sim = simulate.Simulation(task, 2, algo, lr=0.05)
        losses = [sim.step(1, i) for i in range(2)]
        return losses, params(task.model)

    init = params(digits().model)
    losses, after = two_steps()
    assert all(np.isfinite(losses))
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, init))
    losses2, after2 = two_steps()  # no global random state: the same run twice
    assert losses2 == losses and all(torch.equal(a, b) for a, b in zip(after, after2))


def test_terngrad_gradients_are_clipped_before_compression_when_asked():
    """grad_clip="paper" clips TernGrad's gradients (2.5 sigma); the default ("auto") does not."""
    model = torch.nn.Linear(100, 1, bias=False)
    named = list(model.named_parameters())
    g = torch.randn(1, 100, generator=torch.Generator().manual_seed(2))
    g[0, 0] = 1000.0
    grads = [[g.clone()], [g.clone()]]
    simulate.Reference(named, 2, "terngrad", grad_clip="paper").reduce(grads)
    assert float(grads[0][0].abs().max()) < 1000 * 0.5  # clipped in place to 2.5 sigma
    grads = [[g.clone()], [g.clone()]]
    simulate.Reference(named, 2, "terngrad").reduce(grads)
    assert float(grads[0][0].max()) == 1000.0


def test_missing_reference_is_reported_not_faked():
    class Half(compression.Compressor):
        name, category, rate = "half_sim_test", "quantization", 0.5

    compression.register("half_sim_test", Half, overwrite=True)
    named = list(torch.nn.Linear(2, 2).named_parameters())
    with pytest.raises(simulate.Unsupported, match="no pure reference"):
        simulate.Reference(named, 2, "half_sim_test")
    out = simulate.run("digits", 2, "half_sim_test", epochs=1, batch=8, lr=0.05, seed=1)
    assert "no pure reference" in out["na"] and "points" not in out
    with pytest.raises(simulate.Unsupported, match="planner"):
        simulate.Reference(named, 2, "auto")


def test_unknown_parameter_is_reported(monkeypatch):
    # a parameter hipress's compressor has and the reference does not take
    monkeypatch.setitem(simulate.SINGLE_ROUND, "tbq", (set(), set(), simulate._tbq))
    named = list(torch.nn.Linear(2, 2).named_parameters())
    with pytest.raises(simulate.Unsupported, match="has no parameter relative, threshold"):
        simulate.Reference(named, 2, "tbq")


def test_transformer_task_steps_and_labels():
    task = tasks.build("transformer", 3, 32)
    assert task.steps_per_epoch(4) == (8000 // 4) // 32
    x, y = task.batch(3, 4, 1, 0)
    assert x.shape == (32, 16) and y.shape == (32,)
    for row, label in zip(x.tolist(), y.tolist()):  # the label: the leftmost token of ids 1-8
        assert next(t for t in row if 1 <= t <= 8) == label + 1


def test_reference_only_bench_writes_the_reference_column(tmp_path):
    from hipress.bench import convergence

    doc = convergence.main(["--task", "digits", "--np", "2", "--epochs", "1", "--algos", "none,tbq",
                            "--kwargs", 'tbq={"threshold": 0.05}', "--reference-only", "--no-plots",
                            "--out-dir", str(tmp_path)])
    assert doc["runs"] == {}
    assert [p["epoch"] for p in doc["reference"]["tbq"]["points"]] == [0, 1]
    rows = {r["algorithm"]: r for r in doc["rows"]}
    assert rows["none"]["reference_vs_none"] == 0 and isinstance(rows['tbq {"threshold": 0.05}']["reference"], float)
    assert "| reference |" in (tmp_path / "convergence-digits.md").read_text()


def test_seeds_runs_each_seed_and_averages(tmp_path):
    from hipress.bench import convergence

    doc = convergence.main(["--task", "digits", "--np", "2", "--epochs", "1", "--algos", "none,onebit",
                            "--reference-only", "--seeds", "3,4", "--out-dir", str(tmp_path)])
    rows = {r["algorithm"]: r for r in doc["rows"]}
    for r in rows.values():
        assert r["side"] == "reference"
        assert r["mean test_accuracy"] == pytest.approx((r["seed 3"] + r["seed 4"]) / 2, abs=0.01)
    assert rows["none"]["seed 3"] != rows["none"]["seed 4"]  # two different runs, not one twice
    assert rows["onebit"]["mean_diff_vs_none"] == pytest.approx(
        rows["onebit"]["mean test_accuracy"] - rows["none"]["mean test_accuracy"], abs=0.02)
    assert (tmp_path / "seed-3" / "convergence-digits.json").exists()
    assert (tmp_path / "convergence-digits-seeds.md").exists()
