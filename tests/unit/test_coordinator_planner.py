"""Property tests of the coordinator's slot planner alone."""
import pytest
from hypothesis import given, settings, strategies as st

from hipress.comm.coordinator import protocol as P
from hipress.comm.coordinator.planner import Msg, SlotPlanner

msgs_strategy = st.integers(2, 9).flatmap(lambda n: st.tuples(
    st.just(n),
    st.lists(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1), st.integers(0, 5000)),
                      max_size=12), min_size=1, max_size=8),
    st.integers(1, 8000), st.integers(0, 3)))


@settings(max_examples=200, deadline=None)
@given(msgs_strategy)
def test_slots_are_matchings_fifo_and_complete(args):
    n, waves, batch_bytes, timeout = args
    planner = SlotPlanner(n, batch_bytes=batch_bytes, timeout_slots=timeout)
    sent_order = {}  # link -> keys in submission order
    key = 0
    scheduled = []
    waves = list(waves)
    for _ in range(200):
        if waves:
            batch = []
            for s, d, b in waves.pop(0):
                if s == d:
                    continue
                batch.append(Msg(key, s, d, b))
                sent_order.setdefault((s, d), []).append(key)
                key += 1
            planner.add(batch)
        slot = planner.plan()
        ups = [s for s, _ in slot.batches]
        downs = [d for _, d in slot.batches]
        assert len(ups) == len(set(ups)), "a node sends on two links in one slot"
        assert len(downs) == len(set(downs)), "a node receives on two links in one slot"
        # A batch stops at batch_bytes, or at the slot's largest single message if larger.
        cap = max([batch_bytes] + [b[0].nbytes for b in slot.batches.values()])
        for (s, d), b in slot.batches.items():
            assert b, "empty batch planned"
            assert all(m.src == s and m.dst == d for m in b)
            assert sum(m.nbytes for m in b) <= cap or len(b) == 1
            scheduled.extend((s, d, m.key) for m in b)
        if not waves and planner.pending() == 0:
            break
    assert planner.pending() == 0, "a message waited forever"
    keys = [k for _, _, k in scheduled]
    assert sorted(keys) == list(range(key)), "not every message scheduled exactly once"
    for link, order in sent_order.items():
        assert [k for s, d, k in scheduled if (s, d) == link] == order, "per-link order broken"


def test_batches_are_the_longest_fifo_prefix_within_the_cap_on_long_queues():
    """A link's batch is a prefix of its queue that only stops where the next message would take
    it over the cap (at least one message), over thousands of messages per link, so the queue drops what left many times."""
    import random

    rng = random.Random(3)
    sizes = {(s, d): [rng.choice([0, 1, 7, 300, 5000]) for _ in range(3000)] for s, d in ((0, 1), (1, 2), (2, 0))}
    p = SlotPlanner(3, batch_bytes=2000)
    key, queues = 0, {}
    for link, sz in sizes.items():
        msgs = [Msg(key + i, link[0], link[1], b) for i, b in enumerate(sz)]
        key += len(msgs)
        queues[link] = msgs
        p.add(msgs)
    while p.pending():
        slot = p.plan()
        cap = max([2000] + [sum(m.nbytes for m in b) for b in slot.batches.values()])
        for link, batch in slot.batches.items():
            q = queues[link]
            assert batch == q[:len(batch)], "not the queue's head, in order"
            del q[:len(batch)]
            size = sum(m.nbytes for m in batch)
            assert len(batch) == 1 or size <= cap
            # the running cap is at least batch_bytes, so a batch that stops early is over it
            assert not q or size + q[0].nbytes > 2000, "batch cut short"
    assert all(not q for q in queues.values())


def test_oldest_link_first_and_starvation_free():
    p = SlotPlanner(3, batch_bytes=10)
    p.add([Msg(0, 0, 1, 5)])
    p.plan()  # 0->1 leaves
    p.add([Msg(1, 2, 1, 100), Msg(2, 0, 1, 1)])  # both into node 1: one per slot
    first = p.plan()
    second = p.plan()
    assert len(first.batches) == 1 and len(second.batches) == 1
    assert {**first.batches, **second.batches}.keys() == {(2, 1), (0, 1)}


def test_bad_messages():
    p = SlotPlanner(2)
    with pytest.raises(ValueError):
        p.add([Msg(0, 0, 0, 1)])
    with pytest.raises(ValueError):
        p.add([Msg(0, 0, 5, 1)])


def test_protocol_round_trip_and_validation():
    raw = P.pack(P.META, 2, 77, 5, P.CLOSING, [(9, 1, P.SEND, 100)], 4)
    assert len(raw) == P.frame_bytes(4)
    assert P.unpack(raw, P.META, 77, 5, 2, 4, 3) == (P.CLOSING, [(9, 1, P.SEND, 100)])
    for bad, what in ((raw.replace(b"HPCO", b"XXXX"), "magic"),):
        with pytest.raises(P.ProtocolError, match=what):
            P.unpack(bad, P.META, 77, 5, 2, 4, 3)
    with pytest.raises(P.ProtocolError, match="token"):
        P.unpack(raw, P.META, 78, 5, 2, 4, 3)
    with pytest.raises(P.ProtocolError, match="slot"):
        P.unpack(raw, P.META, 77, 6, 2, 4, 3)
    with pytest.raises(P.ProtocolError, match="type"):
        P.unpack(raw, P.PLAN, 77, 5, 2, 4, 3)
    with pytest.raises(P.ProtocolError, match="peer"):
        P.unpack(raw, P.META, 77, 5, 2, 4, 1)
    with pytest.raises(P.ProtocolError, match="bytes"):
        P.unpack(raw[:-1], P.META, 77, 5, 2, 4, 3)
    with pytest.raises(P.ProtocolError, match="fit"):
        P.pack(P.META, 0, 1, 0, 0, [(1, 0, P.SEND, 1)] * 5, 4)
