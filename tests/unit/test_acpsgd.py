"""ACP-SGD (hipress/compression/acpsgd.py): PowerSGD's two halves alternated over the steps,
one summed factor per step. Checked against the numpy reference (reference.ACPSGDReference, the
reference simulator's) for the low-rank protocol (encode_round / combine / finish) over 3 ranks
and both parities."""
import numpy as np
import pytest
import torch

from hipress import compression as C
from hipress.compression import reference as ref
from hipress.compression.acpsgd import ACPSGD

ROWS, COLS, RANK = 24, 10, 3


def grads(step, world):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(ROWS, COLS, generator=g) for _ in range(world)]


def test_three_ranks_match_the_reference_over_both_parities():
    comp = ACPSGD(rank=RANK, seed=5)
    states = [comp.new_state(ROWS * COLS, (ROWS, COLS)) for _ in range(3)]
    assert all(torch.equal(s.buffers["q"], states[0].buffers["q"]) for s in states)  # one seed, one first Q
    refs = [ref.ACPSGDReference(ROWS, COLS, RANK, seed=5) for _ in range(3)]
    np.testing.assert_array_equal(refs[0].Q.reshape(-1), states[0].buffers["q"].numpy())
    for step in range(5):
        gs = grads(step, 3)
        pays = [comp.encode_round(0, g, s) for g, s in zip(gs, states)]
        total = pays[0].clone()
        for p in pays[1:]:
            total = comp.combine(total, p)
        outs = [comp.finish(total, s, torch.empty(ROWS * COLS)) for s in states]
        ref_total = sum(r.local(g.numpy()) for r, g in zip(refs, gs))
        want = [r.finish(ref_total) for r in refs][0]
        for o in outs:
            assert torch.equal(o, outs[0])  # every rank decodes the same sum
        np.testing.assert_allclose(outs[0].numpy(), want, rtol=1e-4, atol=1e-4)
        for s, r in zip(states, refs):
            np.testing.assert_allclose(s.buffers["residual"].numpy(), r.e.reshape(-1), rtol=1e-4, atol=1e-4)
        # one factor per step, alternating: P (rows x r) on even steps, Q (cols x r) on odd ones
        assert pays[0].numel() == 24 + 4 * RANK * (ROWS if step % 2 == 0 else COLS)
        assert states[0].step == step + 1


def test_average_in_the_summed_factor_over_both_parities():
    """scale_sum(total, 1/3) then finish gives the sum's decode / 3 to float rounding, step after step:
    the scaled factor it keeps is orthonormalized before the next step uses it. encode's payload
    (both factors) is refused."""
    comp = ACPSGD(rank=RANK, seed=5)
    scaled, summed = ([comp.new_state(ROWS * COLS, (ROWS, COLS)) for _ in range(3)] for _ in range(2))
    for step in range(5):
        gs = grads(step, 3)
        outs = []
        for states, scale in ((scaled, True), (summed, False)):
            pays = [comp.encode_round(0, g, s) for g, s in zip(gs, states)]
            total = pays[0].clone()
            for p in pays[1:]:
                total = comp.combine(total, p)
            if scale:
                assert comp.scale_sum(total, 1 / 3)
            outs.append(comp.finish(total, states[0], torch.empty(ROWS * COLS)))
            for s in states[1:]:
                comp.finish(total, s, torch.empty(ROWS * COLS))
        torch.testing.assert_close(outs[0], outs[1] / 3, rtol=1e-4, atol=1e-5)  # 5 steps of float rounding
    with pytest.raises(ValueError, match="summed factor"):
        comp.scale_sum(comp.encode(gs[0]), 0.5)


def test_low_rank_gradient_is_exact_from_the_second_step():
    """Step 0 projects on a random Q; step 1's P^ spans the gradient's columns, so with error
    feedback the two steps together deliver exactly twice the gradient and the residual is 0."""
    g = (torch.randn(ROWS, 2, generator=torch.Generator().manual_seed(1))
         @ torch.randn(2, COLS, generator=torch.Generator().manual_seed(2)))
    comp = ACPSGD(rank=RANK)
    st = comp.new_state(g.numel(), g.shape)
    outs = []
    for _ in range(2):
        out = torch.empty(g.numel())
        comp.decode(comp.encode(g, st), out)
        outs.append(out.view(ROWS, COLS))
    assert float((outs[0] - g).abs().max()) > 1e-2  # a random subspace is not the gradient's
    torch.testing.assert_close(outs[0] + outs[1], 2 * g, rtol=1e-4, atol=1e-4)
    assert float(st.buffers["residual"].abs().max()) < 1e-4


def test_state_dict_resumes_bit_identically():
    comp = ACPSGD(rank=RANK)
    a = comp.new_state(ROWS * COLS, (ROWS, COLS))
    for step in range(3):
        comp.encode(grads(step, 1)[0], a)
    b = comp.new_state(ROWS * COLS, (ROWS, COLS))
    b.load_state_dict(a.state_dict())
    assert b.step == 3
    for step in range(3, 6):
        g = grads(step, 1)[0]
        assert torch.equal(comp.encode(g, a), comp.encode(g, b))
    # without the state (step 0, the first Q) the next payload differs
    c = comp.new_state(ROWS * COLS, (ROWS, COLS))
    g = grads(6, 1)[0]
    assert not torch.equal(comp.encode(g, a), comp.encode(g, c))


def test_bad_payloads_and_out_of_step_ranks_raise():
    comp = ACPSGD(rank=RANK)
    s0, s1 = (comp.new_state(ROWS * COLS, (ROWS, COLS)) for _ in range(2))
    g = grads(0, 1)[0]
    p = comp.encode_round(0, g, s0)
    with pytest.raises(ValueError, match="decodes only with the state"):
        comp.decode(p, torch.empty(ROWS * COLS))
    with pytest.raises(ValueError, match="header"):
        comp.finish(p[:10], s0, torch.empty(ROWS * COLS))
    with pytest.raises(ValueError, match="holds"):
        comp.finish(p[:-4], s0, torch.empty(ROWS * COLS))
    bad = p.clone()
    bad[0] ^= 0xFF
    with pytest.raises(ValueError, match="magic"):
        comp.combine(bad, p)
    comp.finish(p, s0, torch.empty(ROWS * COLS))  # s0 is at step 1 now, s1 at step 0
    q = comp.encode_round(0, g, s0)
    with pytest.raises(ValueError, match="one step and matrix"):
        comp.combine(p, q)
    with pytest.raises(ValueError, match="out of step"):
        comp.finish(q, s1, torch.empty(ROWS * COLS))
    with pytest.raises(ValueError, match="needs a state"):
        comp.encode_round(0, g, None)
    with pytest.raises(ValueError, match="rank must be a positive int"):
        ACPSGD(rank=0)


def test_registered_as_a_one_round_low_rank_algorithm():
    c = C.get("acpsgd", rank=4)
    assert isinstance(c, ACPSGD) and c.lowrank and c.rounds == 1 and c.aggregatable
    assert C.get("powersgd").lowrank and not C.get("tbq").lowrank
    # its own error feedback, never the generic wrapper
    with pytest.raises(ValueError, match="own error feedback"):
        C.get("acpsgd", error_feedback=True)
    g = torch.randn(7)
    out = torch.empty(7)
    c.decode(c.encode(g), out)  # a vector is n x 1 at rank 1: exact
    torch.testing.assert_close(out, g)
    assert c.encode(torch.zeros(0)).numel() == 24


def test_mutated_payloads_raise_value_error_or_decode():
    """Flipped bits and truncations: ValueError, or a decode of the damaged floats (which no header
    can detect); never another exception, never an allocation the header announces."""
    import random

    rng = random.Random(3)
    comp = ACPSGD(rank=RANK)
    g = grads(0, 1)[0]
    good = [comp.encode_round(0, g, comp.new_state(ROWS * COLS, (ROWS, COLS))), comp.encode(g)]
    outcomes = {"rejected": 0, "decoded": 0}
    for i in range(400):
        p = good[i % 2].clone()
        if i % 4 < 2:
            p[rng.randrange(p.numel())] ^= 1 << rng.randrange(8)
        else:
            p = p[:rng.randrange(p.numel())].clone()
        try:
            if i % 2:
                comp.decode(p, torch.empty(ROWS * COLS))
            else:
                comp.finish(p, comp.new_state(ROWS * COLS, (ROWS, COLS)), torch.empty(ROWS * COLS))
            outcomes["decoded"] += 1
        except ValueError:
            outcomes["rejected"] += 1
    assert outcomes["rejected"] > 0 and outcomes["decoded"] > 0, outcomes
