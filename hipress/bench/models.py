"""Reference models for the throughput benchmarks, defined here (no downloads).

Each is scaled to a small CPU machine (one training step of the default batch takes
roughly 50-300 ms on one core) but keeps the *gradient-size profile* of the model of the
HiPress paper (paper 000, Table 6) it stands for, because that profile is what decides
how much compression and partitioning can help:

| name      | paper model (total / max gradient / # gradients) | here (approx.)              |
|-----------|--------------------------------------------------|-----------------------------|
| vgg19     | VGG19: 548 MB / 392 MB (72%) / 38                | 45 MB / 32 MB (71%) / 38    |
| resnet50  | ResNet50: 97 MB / 9 MB (9%) / 155                | 5.8 MB / 0.56 MB (10%) / 161 |
| bert      | Bert-base: 420 MB / 89 MB (21%) / 207            | 17 MB / 4 MB (23%) / 150    |
| lstm      | LSTM: 328 MB / 190 MB (58%) / 10                 | 24 MB / 9.8 MB (41%) / 11   |
| mixed     | (none: the planner's case)                       | 50 MB / 32 MB (64%) / 136   |

`python -m hipress.bench.models` prints each model's actual profile and the time of one
forward+backward on this machine.

API: ``get(name) -> Spec`` with ``spec.build()`` (a fresh nn.Module; seed it first),
``spec.batch(batch_size, generator) -> (inputs, targets)`` (synthetic data),
``spec.loss(output, targets)``, ``spec.batch_size`` (default per-rank batch) and
``spec.sample_unit``.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

# ------------------------------------------------------------------ digits (real data)
# The small CNN and data of examples/train.py and of the convergence bench (--task digits).


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions and two fully connected layers for scikit-learn's 8x8 digits."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def digits_data(seed: int):
    """sklearn's digits (offline), shuffled by seed: ((x_train, y_train), (x_test, y_test)), 1500 / 297."""
    import numpy as np
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.from_numpy(np.random.RandomState(seed).permutation(len(y)))
    x, y = x[perm], y[perm]
    return (x[:1500], y[:1500]), (x[1500:], y[1500:])


# ------------------------------------------------------------------ VGG19-like


class VGGLike(nn.Module):
    """16 small 3x3 convolutions (VGG19's layout, narrow channels) on 32x32 images, then
    three fully connected layers of which the first holds ~75% of all parameters."""

    CFG = [16, 16, "M", 32, 32, "M", 64, 64, 64, 64, "M", 128, 128, 128, 128, "M", 128, 128, 128, 128]

    def __init__(self, num_classes: int = 10, fc: int = 4096):
        super().__init__()
        layers: List[nn.Module] = []
        c = 3
        for v in self.CFG:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU(inplace=True)]
                c = v
        self.features = nn.Sequential(*layers)
        # 128 channels x 2 x 2 = 512 after four poolings of 32x32; widened by an 8x8 pool-free
        # reshaping: keep 2x2 spatial and use a 2048-wide input like VGG's 25088 -> 4096 layer.
        self.classifier = nn.Sequential(
            nn.Linear(128 * 2 * 2 * 4, fc), nn.ReLU(inplace=True),
            nn.Linear(fc, 512), nn.ReLU(inplace=True),
            nn.Linear(512, num_classes))
        self.num_classes = num_classes

    def forward(self, x):
        x = self.features(x)                       # N x 128 x 2 x 2
        x = torch.cat([x, x.flip(2), x.flip(3), x.flip(2, 3)], 1)  # N x 512 x 2 x 2 (cheap widening)
        return self.classifier(x.flatten(1))


# ------------------------------------------------------------------ ResNet50-like


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNetLike(nn.Module):
    """ResNet50's layout ([3, 4, 6, 3] bottlenecks, 53 convolutions, 53 batch norms: 161
    gradients) with a quarter of its widths, on 32x32 images."""

    def __init__(self, num_classes: int = 100, base: int = 16, blocks=(3, 4, 6, 3)):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, base, 3, 1, 1, bias=False), nn.BatchNorm2d(base)
        layers, cin = [], base
        for i, n in enumerate(blocks):
            width = base * 2 ** i
            for j in range(n):
                layers.append(Bottleneck(cin, width, 2 if (j == 0 and i > 0) else 1))
                cin = width * Bottleneck.expansion
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layers(x)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


# ------------------------------------------------------------------ BERT-like


class BertLike(nn.Module):
    """A BERT-style encoder (token + position embeddings, post-LN layers, masked-LM head
    tied to nothing): 12 layers of width 128, vocabulary 8192 -> the embedding and the head
    are the largest gradients, 150 gradients in all."""

    def __init__(self, vocab: int = 8192, d: int = 128, layers: int = 12, heads: int = 4, ffn: int = 512,
                 max_len: int = 128):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.ln = nn.LayerNorm(d)
        layer = nn.TransformerEncoderLayer(d, heads, ffn, dropout=0.0, batch_first=True, activation="gelu")
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)
        self.vocab = vocab

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        h = self.ln(self.tok(ids) + self.pos(pos))
        return self.head(self.encoder(h))


# ------------------------------------------------------------------ LSTM LM


class LSTMLM(nn.Module):
    """Word-level LSTM language model (embedding, 2-layer LSTM, decoder): 11 gradients,
    the embedding and the decoder dominate (as in the paper's wikitext-2 LSTM)."""

    def __init__(self, vocab: int = 10000, d: int = 256, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn = nn.LSTM(d, d, layers, batch_first=True)
        self.dec = nn.Linear(d, vocab)
        self.vocab = vocab

    def forward(self, ids):
        out, _ = self.rnn(self.emb(ids))
        return self.dec(out)


class MixedNet(nn.Module):
    """Many small gradients and a few very large ones (the planner's case, issue 7): two
    fully connected layers of 32 MB and 16 MB, then 64 residual 64x64 layers (16 KB
    weights, 256 B biases: 128 small gradients)."""

    def __init__(self, num_classes: int = 10, d_in: int = 1024, wide: int = 8192, small: int = 64, depth: int = 64):
        super().__init__()
        self.inp = nn.Linear(d_in, wide)
        self.mid = nn.Linear(wide, d_in // 2)
        self.proj = nn.Linear(d_in // 2, small)
        self.blocks = nn.ModuleList(nn.Linear(small, small) for _ in range(depth))
        self.out = nn.Linear(small, num_classes)

    def forward(self, x):
        h = self.proj(F.relu(self.mid(F.relu(self.inp(x)))))
        for b in self.blocks:
            h = h + 0.1 * F.relu(b(h))  # damped: 64 plain residual layers diverge at the benchmarks' lr
        return self.out(h)


def _vectors(classes: int, d: int):
    def batch(n: int, g: torch.Generator):
        return torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)
    return batch


# ------------------------------------------------------------------ specs


@dataclass
class Spec:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int, torch.Generator], Tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batch_size: int
    sample_unit: str
    paper: str


def _images(classes: int, size: int = 32):
    def batch(n: int, g: torch.Generator):
        return torch.randn(n, 3, size, size, generator=g), torch.randint(0, classes, (n,), generator=g)
    return batch


def _tokens(vocab: int, seq: int):
    def batch(n: int, g: torch.Generator):
        ids = torch.randint(0, vocab, (n, seq + 1), generator=g)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    return batch


def _seq_loss(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


SPECS: Dict[str, Spec] = {
    "vgg19": Spec("vgg19", lambda: VGGLike(10), _images(10), F.cross_entropy, 16, "images",
                  "VGG19: 548.05 MB, max gradient 392 MB, 38 gradients"),
    "resnet50": Spec("resnet50", lambda: ResNetLike(100), _images(100), F.cross_entropy, 16, "images",
                     "ResNet50: 97.46 MB, max gradient 9 MB, 155 gradients"),
    "bert": Spec("bert", lambda: BertLike(), _tokens(8192, 64), _seq_loss, 8, "sequences",
                 "Bert-base: 420.02 MB, max gradient 89.42 MB, 207 gradients"),
    "lstm": Spec("lstm", lambda: LSTMLM(), _tokens(10000, 35), _seq_loss, 8, "sequences",
                 "LSTM: 327.97 MB, max gradient 190.42 MB, 10 gradients"),
    "mixed": Spec("mixed", lambda: MixedNet(), _vectors(10, 1024), F.cross_entropy, 16, "samples",
                  "no paper model: many small and a few very large gradients (issue 7)"),
}

NAMES = list(SPECS)


def get(name: str) -> Spec:
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose from {NAMES}") from None


def profile(model: nn.Module) -> dict:
    """Gradient-size profile: total MB, largest gradient MB (and its share), gradient count."""
    sizes = [p.numel() * 4 for p in model.parameters() if p.requires_grad]
    return {"total_mb": sum(sizes) / 2**20, "max_gradient_mb": max(sizes) / 2**20,
            "max_share": max(sizes) / sum(sizes), "gradients": len(sizes), "parameters": sum(sizes) // 4}


def step_time(spec: Spec, batch_size: int = 0, steps: int = 5, threads: int = 1) -> float:
    """Median seconds of one forward+backward on this machine (no optimizer, no sync)."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    m = spec.build()
    g = torch.Generator().manual_seed(0)
    x, y = spec.batch(batch_size or spec.batch_size, g)
    times = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        m.zero_grad()
        spec.loss(m(x), y).backward()
        times.append(time.perf_counter() - t)
    times = sorted(times[1:])
    return times[len(times) // 2]


def main(argv=None):
    p = argparse.ArgumentParser(description="Print each reference model's gradient profile and step time.")
    p.add_argument("--models", default=",".join(NAMES))
    p.add_argument("--no-time", action="store_true")
    a = p.parse_args(argv)
    from hipress.bench.common import markdown_table
    rows = []
    for name in a.models.split(","):
        spec = get(name)
        row = {"model": name, **profile(spec.build()), "batch": spec.batch_size, "paper": spec.paper}
        if not a.no_time:
            row["fwd_bwd_ms_1core"] = 1e3 * step_time(spec)
        rows.append(row)
    print(markdown_table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
