"""The 1F1B schedule (PipeDream-flush, as Megatron-LM runs it) of one stage.

Stage s of P runs min(P - s - 1, M) forwards first (warm-up), then alternates one forward and
one backward (steady state), then runs the backwards left (cool-down). The last stage has no
warm-up: it starts each micro-batch's backward right after its forward. At most P - s
micro-batches are in flight on stage s, whatever M is.
"""
from __future__ import annotations

from typing import List, Tuple


def warmup(stage: int, stages: int, micro_batches: int) -> int:
    return min(stages - stage - 1, micro_batches)


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> List[Tuple[str, int]]:
    """The stage's operations in order: ("F", i) forward and ("B", i) backward of micro-batch i."""
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not in [0, {stages})")
    w = warmup(stage, stages, micro_batches)
    ops = [("F", i) for i in range(w)]
    for i in range(micro_batches - w):
        ops += [("F", w + i), ("B", i)]
    ops += [("B", i) for i in range(micro_batches - w, micro_batches)]
    return ops


def in_epilogue(sender: int, stages: int, micro_batches: int, micro_batch: int) -> bool:
    """Whether the backward send of ``micro_batch`` from stage ``sender`` to ``sender - 1`` lies
    in the pipeline's epilogue: the receiver is then in its cool-down (the backwards it runs
    one after another, with no forward between them to hide the wait behind), so the send is on
    the critical path (Optimus-CC §5.2; Megatron-LM's cool-down loop). Sender and receiver
    decide alike from the schedule alone."""
    if not 1 <= sender < stages:
        raise ValueError(f"stage {sender} sends no activation gradient (stages 1..{stages - 1} do)")
    return micro_batch >= micro_batches - warmup(sender - 1, stages, micro_batches)
