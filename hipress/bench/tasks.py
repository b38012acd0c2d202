"""The training tasks of the convergence bench, defined once for hipress's ranks
(hipress/bench/convergence.py) and for the reference simulator (hipress/bench/simulate.py):
data, model, each rank's batches, loss, evaluation, optimizer and the training loop.

Tasks (all offline: no downloads):

  digits       CNN on sklearn.datasets.load_digits (1797 8x8 images, bundled with
               scikit-learn): fixed shuffle, 1500 train / 297 test. Metric: test accuracy (%).
  charlm       character-level GRU language model on a text corpus that ships with installed
               packages: scikit-learn's dataset descriptions (sklearn/datasets/descr/*.rst)
               followed by CPython's LICENSE.txt (about 57 KB; file names and sha256 are
               recorded); 90% train / 10% validation, sequences of ``seq`` characters.
               Metric: validation perplexity (lower is better).
  transformer  a 2-layer transformer encoder (d 64, 4 heads, feed-forward 128, learned
               positions, mean pooling, no dropout) classifying synthetic token sequences:
               16 tokens drawn uniformly from a vocabulary of 16 (ids 0-15); the label is the
               leftmost token whose id is in 1-8 (8 classes; a sequence with none gets one
               planted at a random position). Answering needs positions and attention: the
               label is neither the most frequent token nor at a fixed place. 8000 train /
               1000 test sequences from numpy's RandomState(seed). Uncompressed, 4 ranks of
               batch 32 at lr 0.05 reach 98.9% in the default 4 epochs (97.2% after 3; chance
               is about 12.5%). Compressed, the reference simulator's 4 workers end (points vs
               none): onebit -0.5, TBQ -35.9, TernGrad +1.0, DGC -62.5, GradDrop +0.3 (-2.0
               before its density warm-up, docs/convergence.md cause 13),
               PowerSGD +1.0. Metric: test accuracy (%).

Sharding and order: rank r of N trains on examples r, r+N, r+2N, ... of the training set; in
epoch e every rank permutes its shard with torch.Generator seeded seed*1000+e and takes
consecutive batches; every rank runs (n_train // N) // batch steps per epoch (the same on
every rank, so none waits for a collective the others never start).
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import math
import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

NAMES = ["digits", "charlm", "transformer"]
# Per task: the defaults of the bench (epochs, per-rank batch, learning rate) and its metric.
DEFAULTS = {
    "digits": dict(epochs=10, batch=32, lr=0.05, eval_every=1),
    "charlm": dict(epochs=4, batch=16, lr=0.5, eval_every=1),
    "transformer": dict(epochs=4, batch=32, lr=0.05, eval_every=1),
}
METRIC = {"digits": "test_accuracy", "charlm": "val_perplexity", "transformer": "test_accuracy"}


@dataclass
class Task:
    name: str
    metric: str
    model: nn.Module
    n_train: int
    batch_size: int
    seed: int
    examples: Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]  # training examples by index
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    evaluate: Callable[[], Dict[str, float]]

    def steps_per_epoch(self, size: int) -> int:
        return (self.n_train // size) // self.batch_size

    def batch(self, rank: int, size: int, epoch: int, i: int):
        """Rank ``rank``'s i-th batch of ``epoch`` (see the module docstring)."""
        mine = torch.arange(rank, self.n_train, size)
        g = torch.Generator().manual_seed(self.seed * 1000 + epoch)
        perm = torch.randperm(len(mine), generator=g)[i * self.batch_size:(i + 1) * self.batch_size]
        return self.examples(mine[perm])


# ------------------------------------------------------------------ data


def text_corpus() -> tuple:
    """(text, [{path, bytes, sha256}]) from files that ship with installed packages."""
    files = []
    try:
        import sklearn
        files += sorted(glob.glob(os.path.join(os.path.dirname(sklearn.__file__), "datasets", "descr", "*.rst")))
    except ImportError:
        pass
    import sysconfig
    lic = os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt")
    if os.path.exists(lic):
        files.append(lic)
    parts, meta = [], []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            t = fh.read()
        parts.append(t)
        meta.append({"path": f, "bytes": len(t.encode()), "sha256": hashlib.sha256(t.encode()).hexdigest()[:16]})
    text = "\n".join(parts)
    if len(text) < 20000:  # fall back on the standard library's docstrings
        import collections, json as _j, tempfile, textwrap  # noqa: E401 - modules with long docstrings
        mods = [collections, _j, textwrap, argparse, glob, hashlib, tempfile]
        text += "\n".join(m.__doc__ or "" for m in mods)
        meta.append({"path": "stdlib docstrings", "bytes": len(text)})
    return text, meta


@dataclass
class CharData:
    """The charlm task's data: ``examples(idx)`` gives training sequences by index (inputs, and
    targets one character later), the validation sequences are whole tensors."""
    vocab: int
    n_train: int
    examples: Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]
    val_inputs: torch.Tensor
    val_targets: torch.Tensor


def charlm_data(seq: int) -> CharData:
    """The corpus (:func:`text_corpus`) as character ids: 90% train, 10% validation, cut into
    sequences of ``seq`` characters (also used by examples/train_gpt_3d.py)."""
    text, _ = text_corpus()
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    split = int(0.9 * len(ids))
    train, val = ids[:split], ids[split:]
    starts = torch.arange((len(train) - 1) // seq) * seq

    def examples(idx):
        chunk = train[starts[idx][:, None] + torch.arange(seq + 1)[None, :]]
        return chunk[:, :-1], chunk[:, 1:]

    vn = (len(val) - 1) // seq
    vchunk = val[(torch.arange(vn) * seq)[:, None] + torch.arange(seq + 1)[None, :]]
    return CharData(len(chars), len(starts), examples, vchunk[:, :-1], vchunk[:, 1:])


def lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of a language model's logits (..., vocab) against next-token ids."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def first_token_data(n: int, rs, vocab: int = 16, length: int = 16, classes: int = 8):
    """The transformer task's sequences and labels (module docstring)."""
    import numpy as np

    x = rs.randint(0, vocab, size=(n, length))
    in_set = (x >= 1) & (x <= classes)
    none = ~in_set.any(1)
    x[none, rs.randint(0, length, size=int(none.sum()))] = rs.randint(1, classes + 1, size=int(none.sum()))
    in_set = (x >= 1) & (x <= classes)
    y = x[np.arange(n), in_set.argmax(1)] - 1  # argmax: the first True
    return torch.tensor(x, dtype=torch.long), torch.tensor(y, dtype=torch.long)


# ------------------------------------------------------------------ models


class CharLM(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, 64)
        self.rnn = nn.GRU(64, 256, batch_first=True)
        self.out = nn.Linear(256, vocab)

    def forward(self, ids):
        h, _ = self.rnn(self.emb(ids))
        return self.out(h)


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 16, length: int = 16, classes: int = 8, d: int = 64, heads: int = 4,
                 layers: int = 2):
        super().__init__()
        self.pos = nn.Parameter(0.1 * torch.randn(length, d))
        self.emb = nn.Embedding(vocab, d)
        # dropout 0: the simulator and hipress's ranks then draw no random numbers in training
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.out = nn.Linear(d, classes)

    def forward(self, x):
        return self.out(self.enc(self.emb(x) + self.pos).mean(1))


# ------------------------------------------------------------------ tasks


def _accuracy(model, x, y) -> Callable[[], Dict[str, float]]:
    def evaluate():
        model.eval()
        with torch.no_grad():
            out = model(x)
            acc = (out.argmax(1) == y).float().mean().item()
            loss = F.cross_entropy(out, y).item()
        model.train()
        return {"test_accuracy": 100 * acc, "test_loss": loss}
    return evaluate


def build(name: str, seed: int, batch: int, seq: int = 64) -> Task:
    """The task ``name`` with its model initialised from ``seed`` (the same on every rank)."""
    torch.manual_seed(seed)
    if name == "digits":
        from hipress.bench.models import DigitsCNN, digits_data

        (xtr, ytr), (xte, yte) = digits_data(seed)
        model = DigitsCNN()
        return Task(name, METRIC[name], model, len(ytr), batch, seed, lambda idx: (xtr[idx], ytr[idx]),
                    F.cross_entropy, _accuracy(model, xte, yte))
    if name == "transformer":
        import numpy as np

        rs = np.random.RandomState(seed)
        xtr, ytr = first_token_data(8000, rs)
        xte, yte = first_token_data(1000, rs)
        model = TinyTransformer()
        return Task(name, METRIC[name], model, len(ytr), batch, seed, lambda idx: (xtr[idx], ytr[idx]),
                    F.cross_entropy, _accuracy(model, xte, yte))
    if name == "charlm":
        data = charlm_data(seq)
        model = CharLM(data.vocab)
        loss = lm_loss

        def evaluate():
            model.eval()
            with torch.no_grad():
                v = loss(model(data.val_inputs), data.val_targets).item()
            model.train()
            return {"val_loss": v, "val_perplexity": math.exp(v)}

        return Task(name, METRIC[name], model, data.n_train, batch, seed, data.examples, loss, evaluate)
    raise ValueError(f"unknown task {name!r}; choose from {NAMES}")


def describe(name: str) -> dict:
    """What the JSON records about a task's data beyond the module docstring."""
    if name != "charlm":
        return {}
    text, meta = text_corpus()
    return {"corpus": meta, "corpus_chars": len(text), "vocab": len(set(text))}


def optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The local optimizer of every run: SGD with momentum 0.9 (which hipress.DistributedOptimizer
    turns into momentum correction for single-round compressors, hipress/torch/momentum.py)."""
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def train(task: Task, size: int, epochs: int, eval_every: int, step: Callable[[int, int], float]) -> List[dict]:
    """The training loop: ``step(epoch, i)`` runs one optimizer step (every rank's part of it)
    and returns rank 0's training loss. Returns the evaluation points (epoch 0 = before training)."""
    spe = task.steps_per_epoch(size)
    points = [{"epoch": 0, "step": 0, "wall_s": 0.0, **task.evaluate()}]
    train_s, n = 0.0, 0
    for epoch in range(1, epochs + 1):
        t0 = time.perf_counter()
        tot = 0.0
        for i in range(spe):
            tot += step(epoch, i)
            n += 1
        train_s += time.perf_counter() - t0
        if epoch % eval_every == 0 or epoch == epochs:
            points.append({"epoch": epoch, "step": n, "wall_s": train_s, "train_loss": tot / max(1, spe),
                           **task.evaluate()})
    return points
