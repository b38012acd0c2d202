"""Scale simulation of the global coordinator's slot planner.

    python -m hipress.bench.coordinator [--ranks 16,128,1024] [--out results/coordinator.json]

Workload: a BERT-large-like model (399 gradients: 24 encoder layers of 16 tensors,
embeddings, pooler, pre-training heads), compressed at rate 1/16, synchronised with
CaSync-PS (aggregators balanced by bytes): every worker sends each gradient's payload to
its aggregator, and every aggregator sends the aggregate to every worker; all of it is
offered at once. The planner runs slot after slot until everything has moved; each
slot is timed as alpha + (largest batch of the slot) / bandwidth.

Reported per cluster size: planning time per slot (mean, p99: the real Python planner),
slots per iteration, simulated sync time, link utilisation (bytes moved / (N x bandwidth
x time)), and efficiency = lower bound / simulated time, where the lower bound is the
busiest node's (bytes in or out) / bandwidth plus alpha times the most links any node
must serve (each link needs a slot, a node serves one uplink and one downlink per slot).
Goals (issue 6): < 1 ms planning per slot at 128 ranks; efficiency >= 0.9.
"""
from __future__ import annotations

import argparse
import statistics
import time

from hipress.bench.common import markdown_table, write_result
from hipress.comm.coordinator.planner import Msg, SlotPlanner


def bert_large_gradients() -> list:
    h, ff, vocab, layers = 1024, 4096, 30522, 24
    g = [vocab * h, 512 * h, 2 * h, h, h]  # embeddings + LayerNorm
    for _ in range(layers):
        g += [h * h, h] * 4                 # q, k, v, attention output
        g += [h, h]                         # LayerNorm
        g += [h * ff, ff, ff * h, h]        # feed-forward
        g += [h, h]                         # LayerNorm
    g += [h * h, h]                         # pooler
    g += [h * h, h, h, h, vocab]            # MLM transform, LayerNorm, output bias
    g += [2 * h, 2, h]                      # next-sentence head, MLM decoder LayerNorm gain
    assert len(g) == 399, len(g)
    return [4 * x for x in g]               # fp32 bytes


def simulate(n: int, rate: float, bandwidth: float, alpha: float, batch_bytes: int) -> dict:
    grads = bert_large_gradients()
    load = [0] * n
    owners = []
    for b in grads:
        a = min(range(n), key=lambda j: (load[j], j))
        load[a] += b
        owners.append(a)
    planner = SlotPlanner(n, batch_bytes=batch_bytes)
    key = 0
    out_b, in_b = [0] * n, [0] * n
    out_links, in_links = [set() for _ in range(n)], [set() for _ in range(n)]
    msgs = []
    for b, a in zip(grads, owners):
        size = max(1, int(b * rate))
        for w in range(n):
            if w == a:
                continue
            for s, d in ((w, a), (a, w)):  # gather, then broadcast
                msgs.append(Msg(key, s, d, size))
                key += 1
                out_b[s] += size
                in_b[d] += size
                out_links[s].add(d)
                in_links[d].add(s)
    planner.add(msgs)
    plan_times, t_sim, slots, moved = [], 0.0, 0, 0
    while planner.pending():
        t0 = time.perf_counter()
        slot = planner.plan()
        plan_times.append(time.perf_counter() - t0)
        largest = max(sum(m.nbytes for m in b) for b in slot.batches.values())
        t_sim += alpha + largest / bandwidth
        moved += slot.nbytes
        slots += 1
    links_bound = max(max(len(x) for x in out_links), max(len(x) for x in in_links))
    t_lb = max(max(out_b), max(in_b)) / bandwidth + alpha * links_bound
    plan_times.sort()
    return {
        "ranks": n, "messages": key, "slots": slots,
        "plan_ms_mean": 1e3 * statistics.fmean(plan_times),
        "plan_ms_p99": 1e3 * plan_times[int(0.99 * (len(plan_times) - 1))],
        "sim_sync_ms": 1e3 * t_sim, "lower_bound_ms": 1e3 * t_lb,
        "utilisation": moved / (n * bandwidth * t_sim), "efficiency": t_lb / t_sim,
    }


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="16,128,1024")
    p.add_argument("--rate", type=float, default=1 / 16)
    p.add_argument("--bandwidth-gbit", type=float, default=25.0)
    p.add_argument("--alpha-us", type=float, default=20.0, help="fixed cost of one slot")
    p.add_argument("--batch-bytes", type=int, default=4 << 20)
    p.add_argument("--out", default="results/coordinator.json")
    a = p.parse_args(argv)
    rows = []
    for n in (int(x) for x in a.ranks.split(",")):
        t0 = time.perf_counter()
        r = simulate(n, a.rate, a.bandwidth_gbit * 1e9 / 8, a.alpha_us * 1e-6, a.batch_bytes)
        r["wall_s"] = time.perf_counter() - t0
        rows.append(r)
        print(f"{n} ranks done in {r['wall_s']:.1f} s", flush=True)
    print(markdown_table(rows, ["ranks", "messages", "slots", "plan_ms_mean", "plan_ms_p99", "sim_sync_ms",
                                "lower_bound_ms", "utilisation", "efficiency"]))
    write_result(a.out, "coordinator", vars(a), rows)
    return rows


if __name__ == "__main__":
    main()
