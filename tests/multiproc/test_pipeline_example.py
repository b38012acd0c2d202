"""examples/train_gpt_3d.py runs as 4 ranks (pp=2 x dp=2) with every technique on, for a few
steps of a small model, and lowers the validation perplexity."""
import os
import re
import sys

from hipress.launch import run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "train_gpt_3d.py")
POINT = re.compile(r"step (\d+): validation perplexity ([0-9.]+), (\d+) tokens/s")


def test_train_gpt_3d_all_techniques(tmp_path):
    cmd = [sys.executable, EXAMPLE, "--pp", "2", "--dp", "2", "--all", "--steps", "4", "--eval-every", "4",
           "--d", "32", "--heads", "2", "--layers", "2", "--seq", "32", "--batch", "8", "--micro-batches", "4",
           "--compress-backward", "2", "--dp-rank", "2"]
    code, logs = run(cmd, 4, timeout=300, quiet=True)
    text = "\n".join(logs)
    assert code == 0, text[-4000:]
    points = {int(s): (float(ppl), int(tps)) for s, ppl, tps in POINT.findall(text)}
    assert sorted(points) == [0, 4], text[-2000:]
    assert points[4][0] < points[0][0]  # it learned
    assert points[4][1] > 0
    assert "done: pp=2 dp=2 steps=4" in text
