"""A GRACE-style compressor written in torch (grace_port_worker.py) trains on 2 ranks through
hipress.DistributedOptimizer(compression=hipress.grace.wrap(...)) and ends where the reference
simulator (hipress/bench/simulate.py, GRACE's communicator semantics in one process) ends:
parameters equal within TOL after STEPS steps of the digits task."""
import os
import sys

import pytest
import torch

from hipress.launch import run

pytest.importorskip("sklearn")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import grace_port_worker as W  # noqa: E402

STEPS = 12
TOL = 1e-6  # absolute, per parameter element (the runs are bit-identical when nothing differs)


def simulate(make):
    from hipress.bench import simulate, tasks

    task = tasks.build("digits", W.SEED, W.BATCH)
    sim = simulate.Simulation(task, 2, make, lr=W.LR)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in range(STEPS):
            sim.step(1, i)
    finally:
        torch.set_num_threads(threads)
    return dict(task.model.named_parameters())


@pytest.fixture(scope="module")
def uncompressed():
    from hipress import grace

    class Identity(grace.Compressor):
        def compress(self, tensor, name):
            return [tensor], None

        def decompress(self, tensors, ctx):
            return tensors[0]

    return simulate(lambda rank: grace.wrap(Identity()))


@pytest.mark.parametrize("case", list(W.CASES))
def test_ported_compressor_matches_the_reference_simulator(case, tmp_path, uncompressed):
    code, logs = run([sys.executable, os.path.join(HERE, "grace_port_worker.py"), case, str(tmp_path), str(STEPS)], 2,
                     timeout=240, quiet=True)
    assert code == 0, "\n".join("\n".join(l) if isinstance(l, list) else str(l) for l in logs)[-4000:]
    ranks = [torch.load(tmp_path / f"rank{k}.pt") for k in range(2)]
    for name, p in ranks[0]["params"].items():
        assert torch.equal(p, ranks[1]["params"][name]), f"{name}: the ranks differ"
    expect = simulate(W.CASES[case])
    worst = max(float((ranks[0]["params"][n] - p.detach()).abs().max()) for n, p in expect.items())
    moved = max(float((p.detach() - uncompressed[n].detach()).abs().max()) for n, p in expect.items())
    print(f"{case}: |hipress - reference| <= {worst:g}, |reference - uncompressed| = {moved:g}")
    assert worst <= TOL, f"{case}: hipress and the reference simulator differ by {worst:g}"
    # the compressor changed the training far beyond TOL, so a wrong reduction would show
    assert moved > 100 * TOL, f"{case}: {moved:g} from uncompressed training"
