"""Property tests of the coordinator's slot planner alone."""
import struct

import pytest
from hypothesis import given, settings, strategies as st

from hipress.comm.coordinator import protocol as P
from hipress.comm.coordinator.executor import RoundPlanner
from hipress.comm.coordinator.planner import DependencyGate, Msg, SlotPlanner

msgs_strategy = st.integers(2, 9).flatmap(lambda n: st.tuples(
    st.just(n),
    st.lists(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1), st.integers(0, 5000)),
                      max_size=12), min_size=1, max_size=8),
    st.integers(1, 8000), st.integers(0, 3), st.sampled_from([0, 1000])))


@settings(max_examples=300, deadline=None)
@given(msgs_strategy)
def test_slots_are_matchings_fifo_and_complete(args):
    """Slots are matchings, except that small messages (of known size) go in batches of their own
    that any rank may send or receive beside its matched link, up to fan_bytes in and out of each
    rank per slot."""
    n, waves, batch_bytes, timeout, fan = args
    planner = SlotPlanner(n, batch_bytes=batch_bytes, timeout_slots=timeout, fan_bytes=fan)
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
        small = {link for link, b in slot.batches.items() if 0 < b[0].nbytes <= fan}
        ups = [s for s, _ in slot.batches.keys() - small]
        downs = [d for _, d in slot.batches.keys() - small]
        assert len(ups) == len(set(ups)), "a node sends on two links in one slot"
        assert len(downs) == len(set(downs)), "a node receives on two links in one slot"
        # A batch stops at batch_bytes, or at the slot's largest single message if larger.
        cap = max([batch_bytes] + [b[0].nbytes for link, b in slot.batches.items() if link not in small])
        small_in, small_out = {}, {}
        for (s, d), b in slot.batches.items():
            assert b, "empty batch planned"
            assert all(m.src == s and m.dst == d for m in b)
            if (s, d) in small:
                assert all(m.nbytes > 0 for m in b)
                small_out[s] = small_out.get(s, 0) + sum(m.nbytes for m in b)
                small_in[d] = small_in.get(d, 0) + sum(m.nbytes for m in b)
            else:
                assert sum(m.nbytes for m in b) <= cap or len(b) == 1
            scheduled.extend((s, d, m.key) for m in b)
        assert all(v <= fan for v in list(small_in.values()) + list(small_out.values())), "over a node's fan_bytes"
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


def test_small_messages_go_to_and_from_every_peer_in_one_slot():
    """A PS gather of small partitions (every rank to every other) is one slot with fan_bytes,
    n - 1 matchings without; a large message still takes its destination's link alone, and an
    unknown size (0) counts as large; a rank takes in no more than fan_bytes of small messages
    per slot, however many send to it."""
    n = 4
    alltoall = [Msg(10 * s + d, s, d, 4096) for s in range(n) for d in range(n) if s != d]
    fan = SlotPlanner(n, fan_bytes=64 << 10)
    fan.add(alltoall)
    assert len(fan.plan(flush=True).batches) == n * (n - 1) and not fan.pending()
    plain = SlotPlanner(n)
    plain.add(alltoall)
    slots = 0
    while plain.pending():
        assert len(plain.plan(flush=True).batches) <= n
        slots += 1
    assert slots == n - 1
    mixed = SlotPlanner(3, fan_bytes=64 << 10)
    mixed.add([Msg(1, 0, 2, 1 << 20), Msg(2, 1, 2, 0), Msg(3, 1, 2, 100), Msg(4, 0, 1, 100)])
    first = mixed.plan(flush=True)
    assert set(first.batches) == {(0, 2), (0, 1)}  # node 2's downlink holds one large (or unknown) batch
    assert [m.key for m in mixed.plan(flush=True).batches[(1, 2)]] == [2, 3]  # a large batch takes the queue
    incast = SlotPlanner(9, fan_bytes=10_000)
    incast.add([Msg(s, s, 0, 3000) for s in range(1, 9)])  # 8 senders into rank 0, 3000 bytes each
    per_slot = [sorted(s for s, _ in incast.plan(flush=True).batches) for _ in range(3)]
    assert per_slot == [[1, 2, 3], [4, 5, 6], [7, 8]] and not incast.pending()


def test_bad_messages():
    p = SlotPlanner(2)
    with pytest.raises(ValueError):
        p.add([Msg(0, 0, 0, 1)])
    with pytest.raises(ValueError):
        p.add([Msg(0, 0, 5, 1)])


def test_protocol_round_trip_and_validation():
    decls = [(9, [1], [0, 3], [5, 6], [4096]), (11, [], [1], [], [])]
    body = P.pack_decls([(False, decls)])
    assert len(body) == 2 * 24 + 4 * 4 + 2 * 8 + 1 * 8  # sized to its content, no padding
    assert P.unpack_decls(body, 2, 2, 4) == [(False, decls)]
    assert P.pack_decls([]) == b"" and P.unpack_decls(b"", 0, 2, 4) == []
    # Groups keep their order and kind; empty ones are left out.
    groups = [(True, decls[:1]), (True, []), (False, decls[1:]), (True, decls)]
    assert P.unpack_decls(P.pack_decls(groups), 4, 2, 4) == [g for g in groups if g[1]]

    def one(group):  # a declaration of a send to rank 1 in ``group``
        return P._DECL.pack(9, 1, 0, 0, group) + struct.pack("<iQ", 1, 0)

    assert P.unpack_decls(one(0) + one(1 | P.WAVE), 2, 2, 4) == [(False, [(9, [1], [], [], [0])]),
                                                                 (True, [(9, [1], [], [], [0])])]
    for bad in (one(1), one(0) + one(P.WAVE), one(0) + one(2), one(1) + one(0)):
        with pytest.raises(P.ProtocolError, match="numbered in order"):
            P.unpack_decls(bad, len(bad) // len(one(0)), 2, 4)
    head = P.pack_head(2, 77, 5, P.CLOSING, 2, len(body))
    assert len(head) == P.HEAD_BYTES
    assert P.unpack_head(head, 77, 5, 2) == (P.CLOSING, 2, len(body))
    with pytest.raises(P.ProtocolError, match="magic"):
        P.unpack_head(head.replace(b"HPCO", b"XXXX"), 77, 5, 2)
    with pytest.raises(P.ProtocolError, match="token"):
        P.unpack_head(head, 78, 5, 2)
    with pytest.raises(P.ProtocolError, match="round"):
        P.unpack_head(head, 77, 6, 2)
    with pytest.raises(P.ProtocolError, match="claims rank"):
        P.unpack_head(head, 77, 5, 1)
    with pytest.raises(P.ProtocolError, match="expected 40"):
        P.unpack_head(head[:-1], 77, 5, 2)
    with pytest.raises(P.ProtocolError, match="peer 3"):
        P.unpack_decls(body, 2, 2, 3)  # rank 3 is outside a job of 3
    with pytest.raises(P.ProtocolError, match="peer 1"):
        P.unpack_decls(P.pack_decls([(False, [(9, [1], [], [], [0])])]), 1, 1, 3)  # to itself
    with pytest.raises(P.ProtocolError, match="ends inside"):
        P.unpack_decls(body[:-1], 2, 2, 4)
    with pytest.raises(P.ProtocolError, match="ends inside"):
        P.unpack_decls(body, 3, 2, 4)  # the head claims more declarations than the body holds
    with pytest.raises(P.ProtocolError, match="holds"):
        P.unpack_decls(body + b"\0", 2, 2, 4)
    many = [(1, [0], [], list(range(70000)), [1 << 40])]  # an exchange may wait on many others
    assert P.unpack_decls(P.pack_decls([(True, many)]), 1, 1, 2) == [(True, many)]


# ------------------------------------------------------------------ the dependency gate
dag_strategy = st.integers(2, 6).flatmap(lambda n: st.tuples(
    st.just(n),
    st.lists(st.tuples(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), min_size=1, max_size=5),
                       st.lists(st.integers(0, 30), max_size=3)), min_size=1, max_size=25),
    st.permutations(range(n)), st.integers(1, 4)))


@settings(max_examples=200, deadline=None)
@given(dag_strategy)
def test_gate_plans_every_message_after_what_its_ends_wait_on(args):
    """Exchanges (each a set of messages) in submission order, each waiting on some earlier ones;
    every rank declares its part (sends, receives, and the earlier exchanges it waits on among
    those it takes part in), ranks' declarations arriving in rounds in any order. Every message is
    planned exactly once, after every message that either of its ends has in the exchanges that
    end waits on, in slots that stay matchings."""
    n, exchanges, rank_order, rounds = args
    exs = []  # (messages [(src, dst)], predecessor indices)
    for links, preds in exchanges:
        msgs = sorted({(s, d) for s, d in links if s != d})
        exs.append((msgs, sorted({p % len(exs) for p in preds}) if exs else []))
    part = [{r for m in msgs for r in m} for msgs, _ in exs]  # the ranks each exchange involves
    decls = {r: [] for r in range(n)}  # rank -> its declarations in submission order
    for q, (msgs, preds) in enumerate(exs):
        for r in range(n):
            if r in part[q]:
                after = [p for p in preds if r in part[p]]
                decls[r].append((q, [d for s, d in msgs if s == r], [s for s, d in msgs if d == r], after))
    gate, planner = DependencyGate(), SlotPlanner(n)
    slot_of = {}
    pending = {r: list(d) for r, d in decls.items()}
    for rnd in range(rounds + 1):
        for r in rank_order:  # a prefix of each rank's declarations per round, the rest at the end
            take = len(pending[r]) if rnd == rounds else len(pending[r]) // (rounds - rnd + 1)
            for key, dsts, srcs, after in pending[r][:take]:
                planner.add(gate.declare(r, key, dsts, srcs, after))
            del pending[r][:take]
        while planner.pending():
            slot = planner.plan(flush=True)
            ups = [s for s, _ in slot.batches]
            downs = [d for _, d in slot.batches]
            assert len(ups) == len(set(ups)) and len(downs) == len(set(downs))
            for b in slot.batches.values():
                for m in b:
                    assert (m.key, m.src, m.dst) not in slot_of
                    slot_of[(m.key, m.src, m.dst)] = slot.number
            planner.add(gate.planned([m for b in slot.batches.values() for m in b]))
    assert gate.waiting == 0 and planner.pending() == 0 and gate.open == {}
    assert set(slot_of) == {(q, s, d) for q, (msgs, _) in enumerate(exs) for s, d in msgs}
    for (q, s, d), t in slot_of.items():
        for p in exs[q][1]:
            for (ps, pd) in exs[p][0]:
                if {s, d} & {ps, pd}:
                    assert slot_of[(p, ps, pd)] < t, f"message {q}:{s}->{d} planned beside or before {p}:{ps}->{pd}"


@settings(max_examples=150, deadline=None)
@given(dag_strategy, st.data())
def test_round_planner_plans_each_ranks_waves_in_order_and_reuses_a_repeated_rounds_plan(args, data):
    """One round carries every rank's declarations, each rank's cut in waves at random points (a
    step declared ahead). Every rank's part of the plan puts each of its waves in later slots than
    everything it declared before; a second round of the same shape under new keys (the next step)
    takes the first's plan, renamed, which is what planning it afresh gives; one of other sizes
    does not."""
    n, exchanges, _, _ = args
    exs = []
    for links, preds in exchanges:
        msgs = sorted({(s, d) for s, d in links if s != d})
        exs.append((msgs, sorted({p % len(exs) for p in preds}) if exs else []))
    part = [{r for m in msgs for r in m} for msgs, _ in exs]
    waves = {}  # rank -> its exchanges, in waves
    for r in range(n):
        mine = [q for q in range(len(exs)) if r in part[q]]
        cuts = sorted(data.draw(st.sets(st.integers(1, len(mine) - 1))) if len(mine) > 1 else [])
        waves[r] = [mine[a:b] for a, b in zip([0] + cuts, cuts + [len(mine)])]

    def declared(base: int, size: int = 64):  # exchange q's key is base + q; base - 1: one of an earlier round
        out = {}
        for r in range(n):
            out[r] = [(True, [(base + q, [d for s, d in exs[q][0] if s == r], [s for s, d in exs[q][0] if d == r],
                               [base - 1] + [base + p for p in exs[q][1] if r in part[p]],
                               [size * (q + 1)] * sum(s == r for s, _ in exs[q][0])) for q in wave])
                      for wave in waves[r]]
        return out

    for r in range(n):
        rp = RoundPlanner(n, r)
        first = rp.plan(declared(1000))
        slot_of = {k: slot for slot, sends, recvs in first for ks, _ in [*sends.values(), *recvs.values()] for k in ks}
        assert set(slot_of) == {1000 + q for q in range(len(exs)) if r in part[q]}
        for earlier, later in zip(waves[r], waves[r][1:]):
            assert max(slot_of[1000 + q] for q in earlier) < min(slot_of[1000 + q] for q in later)
        used = rp.slots.slot
        second = rp.plan(declared(5000))
        assert rp.reused == 1
        fresh = RoundPlanner(n, r).plan(declared(5000))
        assert [(slot - used, sends, recvs) for slot, sends, recvs in second] == fresh
        rp.plan(declared(9000, size=32))  # other sizes: planned afresh (where anything is sent)
        assert rp.reused == (1 if any(msgs for msgs, _ in exs) else 2)


def test_gate_holds_a_message_until_both_ends_declared_and_the_receivers_wait_is_planned():
    """Rank 0 pushes exchange 5 to rank 1, which waits on exchange 4 (its receive from rank 2)
    before it takes part in 5: 5's message must come after 4's, though its sender waits on nothing."""
    gate = DependencyGate()
    assert gate.declare(0, 5, [1], [], []) == [] and gate.waiting == 1  # the receiver has not declared it
    assert gate.declare(1, 4, [], [2], []) == []
    assert gate.declare(1, 5, [], [0], [4]) == [] and gate.held == 1  # held: rank 1 waits on 4
    four = Msg(4, 2, 1, 0)
    assert gate.declare(2, 4, [1], [], []) == [four]
    assert gate.planned([four]) == [Msg(5, 0, 1, 0)]
    assert gate.waiting == 0 and gate.open == {(0, 5): 1, (1, 5): 1}
