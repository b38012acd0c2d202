"""Shared by the tests that run examples/train.py under different launchers."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(ROOT, "examples", "train.py")
# Exactly 16 hex digits: launchers such as torchrun interleave the ranks' output.
DONE = re.compile(r"rank (\d)/(\d) done: test accuracy ([0-9.]+) .*? params sha256 ([0-9a-f]{16})")


def digests(text: str, n: int):
    """(params digest, accuracy) that all n ranks printed; fails if they disagree."""
    found = DONE.findall(text)
    assert len(found) == n, text[-3000:]
    assert len({f[3] for f in found}) == 1, f"ranks disagree: {found}"
    return found[0][3], float(found[0][2])
