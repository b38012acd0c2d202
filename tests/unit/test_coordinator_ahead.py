"""The coordinator declaring the next step's exchanges ahead (hipress/comm/coordinator/ahead.py),
over the in-process loopback transport: real executors, real strategies and compressors."""
import pytest
import torch

from hipress import compression
from hipress.comm.coordinator import Executor
from hipress.comm.coordinator.ahead import StepPredictor
from hipress.comm.exchange import CommChain, CoordinatedExchange, DirectExchange
from hipress.comm.transport import loopback
from hipress.engine import Engine
from hipress.planner.plan import chunk_bounds
from hipress.sync import STRATEGIES, StateStore, SyncContext

N = 3
NUMEL = 2000
# The buckets synchronized at each step. Steps 0-2 repeat (predictions from the end of step 1),
# step 3 differs in its second bucket (the predictions left are voided there), step 4 is shorter
# (voided at its end), then the steps repeat again and are predicted again from the end of step 6.
SCHEDULE = [("a", "b")] * 3 + [("a", "c"), ("a",)] + [("a", "b")] * 4


def _grad(rank: int, step: int, bucket: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + ord(bucket))
    return torch.randn(NUMEL, generator=g)


def _train(strategy: str, mode: str):
    """Per rank: the synchronized buckets of every step, the predictor's counts after each step
    (none with the direct exchange), and the executor's slots with several peers."""
    def body(tr):
        eng = Engine()
        ex = predictor = None
        if mode != "direct":
            ex = Executor(tr.split(0, key=tr.rank), tr.split(0, key=tr.rank) if mode != "one thread" else None,
                          every_rank_declares=mode == "every rank declares")
            predictor = StepPredictor(ex)
            exchange = CoordinatedExchange(eng, ex, range(tr.size), predictor)
        else:
            exchange = DirectExchange(eng, tr, CommChain())
        ctx = SyncContext(eng, exchange, compression.get("tbq", threshold=0.05), StateStore(tr.rank))
        strat = STRATEGIES[strategy]()
        out, counts, fan_slots = [], [], 0
        try:
            for step, buckets in enumerate(SCHEDULE):
                flats = {b: _grad(tr.rank, step, b) for b in buckets}
                handles = [strat.build(ctx, b, flats[b], chunk_bounds(NUMEL, 2)) for b in buckets]
                for h in handles:
                    h.result(timeout=30)
                if predictor is not None:
                    predictor.step_submitted()
                    counts.append(dict(predictor.stats))
                out.append(flats)
        finally:
            if ex is not None:
                ex.close(timeout=20)  # the last step's predictions were never met: given up here
                fan_slots = ex.stats["fan_slots"]
            eng.shutdown()
        return out, counts, fan_slots

    return loopback.spawn(N, body, timeout_s=120)


@pytest.mark.parametrize("strategy", ["ring", "ps"])
@pytest.mark.parametrize("mode", ["one thread", "two threads", "every rank declares"])
def test_predicted_steps_give_the_direct_results_and_recover_from_changed_steps(strategy, mode):
    """Every step, predicted or not, gives the bits of the direct exchange (TBQ with error
    feedback: its residuals carry every step into the next); the steps that repeat are declared
    ahead and confirmed, the ones that differ void what was predicted, and prediction resumes."""
    direct = _train(strategy, "direct")
    ahead = _train(strategy, mode)
    for r in range(N):
        for step in range(len(SCHEDULE)):
            for b, want in direct[r][0][step].items():
                assert torch.equal(ahead[r][0][step][b], want), (r, step, b)
    # every rank predicted, confirmed and voided the same (how they fell in waves is each rank's timing)
    counts = [[{k: v for k, v in c.items() if k != "waves"} for c in per_rank] for _, per_rank, _ in ahead]
    assert all(c == counts[0] for c in counts)
    counts = counts[0]
    before = [{"predicted": 0, "confirmed": 0, "voided": 0}] + counts[:-1]
    delta = [{k: c[k] - b[k] for k in c} for b, c in zip(before, counts)]
    # nothing predicted for steps 0-2; step 2's exchanges all confirmed
    assert delta[0]["predicted"] == 0 and delta[1]["predicted"] > 0
    assert delta[2]["confirmed"] == delta[1]["predicted"] and delta[2]["voided"] == 0
    # step 3: bucket a confirmed, then c differs from b: b's predictions voided
    assert 0 < delta[3]["confirmed"] < delta[2]["predicted"] and delta[3]["voided"] > 0
    assert delta[3]["confirmed"] + delta[3]["voided"] == delta[2]["predicted"]
    # steps 3-5 differ from the step before: nothing predicted for steps 4-6
    assert delta[3]["predicted"] == delta[4]["predicted"] == delta[5]["predicted"] == 0
    assert delta[4]["confirmed"] == delta[5]["confirmed"] == delta[6]["confirmed"] == 0
    # steps 5 and 6 repeat: step 7 and 8 predicted and confirmed in full
    assert delta[6]["predicted"] == delta[2]["confirmed"]
    assert delta[7]["confirmed"] == delta[8]["confirmed"] == delta[2]["confirmed"]
    assert delta[7]["voided"] == delta[8]["voided"] == 0
    if strategy == "ps":  # predicted steps declare their sizes: the small partitions go to every peer at once
        assert all(fan > 0 for _, _, fan in ahead)


def test_where_every_rank_declares_an_idle_executor_sleeps_until_woken():
    """every_rank_declares: no backing off from 0.5 ms, so an idle executor runs at most one round
    per IDLE_MAX_S_EVERY_RANK (and one per wake); a declaration still starts its round, and an
    exchange runs through. Upper bounds only: load makes fewer rounds, not more."""
    from hipress.comm.coordinator.executor import IDLE_MAX_S_EVERY_RANK

    def body(tr):
        import time

        eng = Engine()
        ex = Executor(tr.split(0, key=tr.rank), tr.split(0, key=tr.rank), every_rank_declares=True)
        exchange = CoordinatedExchange(eng, ex, range(tr.size))
        nxt, prv = (tr.rank + 1) % tr.size, (tr.rank - 1) % tr.size
        try:
            got = []
            for step in range(2):
                box = {}
                exchange.sendrecv(f"x{step}", lambda: torch.full((4,), float(tr.rank)), nxt,
                                  lambda t, box=box: box.setdefault("t", t.clone()), prv).result(timeout=30)
                got.append(float(box["t"].view(torch.float32)[0]))
                before, t0 = ex.stats["idle_rounds"], time.monotonic()
                time.sleep(0.5)  # nothing declared anywhere
                idle, elapsed = ex.stats["idle_rounds"] - before, time.monotonic() - t0
        finally:
            ex.close(timeout=20)
            eng.shutdown()
        return got, idle, elapsed

    for r, (got, idle, elapsed) in enumerate(loopback.spawn(N, body, timeout_s=60)):
        assert got == [float((r - 1) % N)] * 2
        assert idle <= elapsed / IDLE_MAX_S_EVERY_RANK + 3, f"rank {r}: {idle} idle rounds in {elapsed:.2f} s"


def test_a_step_shorter_than_predicted_voids_the_rest_at_its_end():
    """The predictions a step does not meet are voided when it ends, so the next step's slots are
    not held behind them (nor is close())."""
    def body(tr):
        eng = Engine()
        ex = Executor(tr.split(0, key=tr.rank), tr.split(0, key=tr.rank))
        predictor = StepPredictor(ex)
        exchange = CoordinatedExchange(eng, ex, range(tr.size), predictor)
        nxt, prv = (tr.rank + 1) % tr.size, (tr.rank - 1) % tr.size
        got = []
        try:
            for step, names in enumerate([("x", "y")] * 3 + [("x",)] + [("x", "y")]):
                for name in names:
                    box = {}
                    exchange.sendrecv(name, lambda: torch.full((4,), float(10 * step + tr.rank)), nxt,
                                      lambda t, box=box: box.setdefault("t", t.clone()), prv).result(timeout=30)
                    got.append(float(box["t"].view(torch.float32)[0]))
                predictor.step_submitted()
        finally:
            ex.close(timeout=20)
            eng.shutdown()
        return got, dict(predictor.stats)

    out = loopback.spawn(N, body, timeout_s=60)
    for r, (got, stats) in enumerate(out):
        prv = (r - 1) % N
        want = [10 * s + prv for s, names in enumerate([("x", "y")] * 3 + [("x",)] + [("x", "y")]) for _ in names]
        assert got == want
        # steps 2 and 3 predicted (2 each, one wave each: y was made after x finished); step 3 met x
        # only: y voided at its end
        assert stats == {"predicted": 4, "confirmed": 3, "voided": 1, "waves": 4}


@pytest.mark.parametrize("every_rank_declares", [False, True])
def test_a_predicted_steps_waves_go_in_one_round(every_rank_declares):
    """Each exchange of a step is made after the one before finished, so each is a wave of its own
    (ahead.py); the waves of a predicted step are still declared in one round (not one each), and
    planned in order: every step moves the data in order and gives the right results."""
    names = ("w", "x", "y", "z")

    def body(tr):
        eng = Engine()
        ex = Executor(tr.split(0, key=tr.rank), tr.split(0, key=tr.rank), every_rank_declares=every_rank_declares)
        predictor = StepPredictor(ex)
        exchange = CoordinatedExchange(eng, ex, range(tr.size), predictor)
        nxt, prv = (tr.rank + 1) % tr.size, (tr.rank - 1) % tr.size
        got, marks = [], [0]
        try:
            for step in range(6):
                for i, name in enumerate(names):
                    box = {}
                    exchange.sendrecv(name, lambda: torch.full((4,), float(100 * step + 10 * i + tr.rank)), nxt,
                                      lambda t, box=box: box.setdefault("t", t.clone()), prv).result(timeout=30)
                    got.append(float(box["t"].view(torch.float32)[0]))
                # read before step_submitted: the next step's round falls after this mark, and
                # before the next step's exchanges can finish
                marks.append(ex.stats["declaring_rounds"])
                predictor.step_submitted()
        finally:
            ex.close(timeout=20)
            eng.shutdown()
        return got, [b - a for a, b in zip(marks, marks[1:])], dict(predictor.stats)

    for r, (got, declaring, stats) in enumerate(loopback.spawn(N, body, timeout_s=60)):
        assert got == [100 * s + 10 * i + (r - 1) % N for s in range(6) for i in range(len(names))]
        # steps 2-5 (and 6, never run) predicted, a wave per exchange; 2-5 confirmed
        assert stats["waves"] == 5 * len(names) and stats["confirmed"] == 4 * len(names), stats
        # the rounds that carried this rank's declarations: steps 0-1, one per exchange as each is
        # made; steps 2-5, the one of their predictions (made at the end of the step before, sent
        # by the time the step's first exchange moved), where a round per wave made one per exchange
        assert declaring == [len(names)] * 2 + [1] * 4, declaring


def test_repeating_steps_keep_their_first_predictions_waves(monkeypatch):
    """Where an exchange comes late after its wave's first, it starts a wave; the cuts found in the
    first prediction of a run of repeating steps stay while the steps repeat, whatever the timing
    of later steps (so the coordinator sees the same round shape and reuses its plan), and a step
    that differs starts over."""
    from types import SimpleNamespace

    from hipress.comm.coordinator import ahead

    clock = [0.0]
    monkeypatch.setattr(ahead, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(ahead, "last_observed", lambda: -1.0)  # the program never waited
    declared = []
    ex = SimpleNamespace(n=2, round_s=0.001, slot_s=0.0, declare=lambda *a: None, void=lambda *a: None,
                         declare_ahead=lambda waves: declared.append([len(w) for w in waves]))
    pred = StepPredictor(ex)
    group = pred.add_group()

    def step(names, late_before):  # exchanges 0.5 ms apart, 10 ms before those named in late_before
        for name in names:
            clock[0] += 0.01 if name in late_before else 0.0005
            pred.exchange(group, name, [1], [1], (), ())
        pred.step_submitted()

    abcd = ("a", "b", "c", "d")
    step(abcd, ())
    step(abcd, ("c",))   # the first prediction: c comes late
    step(abcd, ())       # no longer late, still cut there
    step(abcd, ("b",))   # late elsewhere: the cuts stay
    assert declared == [[2, 2]] * 3
    step(("a", "b", "c"), ("b",))  # a different step: nothing predicted, the cuts forgotten
    step(("a", "b", "c"), ("b",))
    assert declared[3:] == [[1, 2]]


def test_payloads_larger_or_smaller_than_declared_arrive_whole():
    """A step declared ahead carries the sizes the last step's payloads had, and each link's batch
    goes as one message of the planned length. Payloads that grew take a second round, smaller
    ones are padded and cut back, empty ones stay empty: every byte arrives as sent, and the steps
    whose sizes held moved in one round per slot."""
    sizes = [100, 100, 100, 100, 3000, 40, 0, 40, 40]  # bytes each rank sends each peer, per step

    def payload(step: int, src: int, dst: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(100 * step + 10 * src + dst)
        return torch.randint(0, 256, (sizes[step],), dtype=torch.uint8, generator=g)

    def body(tr):
        eng = Engine()
        ex = Executor(tr.split(0, key=tr.rank), tr.split(0, key=tr.rank))
        predictor = StepPredictor(ex)
        exchange = CoordinatedExchange(eng, ex, range(tr.size), predictor)
        peers = [p for p in range(tr.size) if p != tr.rank]
        got, rounds = [], []
        try:
            for step in range(len(sizes)):
                box = {}
                exchange.bulk("all", {p: (lambda p=p, step=step: payload(step, tr.rank, p)) for p in peers},
                              {p: (lambda t, p=p: box.__setitem__(p, t.clone())) for p in peers}).result(timeout=30)
                got.append(box)
                predictor.step_submitted()
                rounds.append(ex.stats["second_rounds"])
        finally:
            ex.close(timeout=20)
            eng.shutdown()
        return got, rounds, dict(predictor.stats), ex.stats["fan_slots"]

    out = loopback.spawn(N, body, timeout_s=60)
    for r, (got, rounds, stats, fan) in enumerate(out):
        for step, box in enumerate(got):
            for p, t in box.items():
                assert torch.equal(t, payload(step, p, r)), (r, step, p)
        assert stats["confirmed"] == len(sizes) - 2 and stats["voided"] == 0
        second = [b - a for a, b in zip([0] + rounds, rounds)]
        # steps 0-1 declared with no sizes: a second round each; steps 2-3 as declared: none;
        # step 4 grew past the declared 100 bytes: a second round; steps 5-6 fit what was declared;
        # step 7 was declared from step 6's empty payloads (0: unknown), step 8 from step 7's
        assert second[0] > 0 and second[1] > 0 and second[4] > 0 and second[7] > 0
        assert second[2] == second[3] == second[5] == second[6] == second[8] == 0, second
        assert fan > 0  # small payloads to and from both peers in one slot
