"""One rank of the ordered all-reduce test (launched by test_pipeline_ranks.py).

    python tied_allreduce_worker.py OUT_DIR

Over groups of 4 (recursive halving/doubling), 3 (the gather fallback) and 2 ranks, with an
element count that does not split evenly, each member all-reduces its own values; the result
must be, bit for bit, the midpoint tree's sum of every member's values computed locally.
Writes OUT_DIR/rank{r}.json with the groups it checked.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

from hipress.pipeline.tied import ordered_allreduce, tree_sum

NUMEL = 1001


def values(rank):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(NUMEL, generator=g) * 10 ** (rank - 2)  # magnitudes apart: the order shows


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    checked = []
    for group in ([0, 1, 2, 3], [3, 1, 0], [2, 0]):
        if rank in group:
            got = ordered_allreduce(values(rank), group)
            want = tree_sum([values(r) for r in group])
            if not torch.equal(got, want):
                raise SystemExit(f"rank {rank} group {group}: max difference {(got - want).abs().max().item()}")
            checked.append(group)
        dist.barrier()
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(checked, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
