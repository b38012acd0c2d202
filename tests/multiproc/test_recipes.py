"""docs/ddp.md's recipes for libraries that wrap DDP: examples/recipes/accelerate_ddp.py
(Hugging Face Accelerate) and lightning_ddp.py (Lightning), each on 2 ranks under torchrun with
TBQ through hipress's comm hook.

Each must actually run the hook (Lightning silently drops a ``DDPStrategy(ddp_comm_hook=...)``
on CPU, which is why its recipe registers the hook in a callback: a dropped hook would train
with DDP's own allreduce and count 0 buckets here), end with the same parameters on both ranks
and learn (digits, 3 epochs, chance is 10%).
"""
import os
import re
import subprocess
import sys

import pytest
from example_run import ROOT, clean_env

RECIPES = os.path.join(ROOT, "examples", "recipes")
N = 2
STEPS = 3 * 47  # 3 epochs of the 1500 training images in batches of 16 per rank: 47 steps each
ACCURACY = 0.85  # both runs here: about 0.92-0.95 (uncompressed DDP: docs/ddp.md)


@pytest.mark.parametrize("recipe", ["accelerate_ddp.py", "lightning_ddp.py"])
def test_recipe_trains_through_hipress_hook(recipe):
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(N),
                        os.path.join(RECIPES, recipe), "--compression", "tbq"],
                       capture_output=True, text=True, timeout=240, env=clean_env("60"), cwd=ROOT)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    # the two ranks share torchrun's stdout, so one rank's line may run into the other's: the
    # digest is matched by its length, not up to the end of a word
    done = re.findall(r"rank (\d)/2 done: test accuracy ([0-9.]+) buckets synced by hipress (\d+) "
                      r"params sha256 ([0-9a-f]{16})", out)
    assert sorted(int(r) for r, *_ in done) == [0, 1], out[-3000:]
    for _, acc, synced, _ in done:
        assert int(synced) >= STEPS, f"{recipe}: the hook ran for {synced} buckets, expected one per step or more"
        assert float(acc) > ACCURACY, f"{recipe}: test accuracy {acc}"
    assert done[0][3] == done[1][3], f"{recipe}: the ranks ended with different parameters"
