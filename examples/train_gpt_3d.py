"""A small GPT-style character language model trained with pipeline x data parallelism and
Optimus-CC's compression techniques (hipress.pipeline, docs/pipeline.md).

    python -m hipress.launch -np 4 python examples/train_gpt_3d.py --pp 2 --dp 2
    python -m hipress.launch -np 4 python examples/train_gpt_3d.py --pp 2 --dp 2 --all
    python -m hipress.launch -np 8 python examples/train_gpt_3d.py --pp 4 --dp 2 --fuse-embedding

Data: the convergence bench's character corpus (hipress.bench.tasks.charlm_data). Model: token
and position embeddings, --layers pre-norm causal transformer blocks, a final norm and an output
head whose weight is the token embedding's (tied: the first stage and the last stage each hold
a copy). Techniques, each off by default: --fuse-embedding, --compress-backward R (low-rank rank
R for activation gradients sent backward after --cb-warmup uncompressed steps, 10% of --steps by
default; --no-lazy-error, --every-send), --compress-stages K
(PowerSGD rank --dp-rank, default 32, for the data-parallel gradients of the first K stages);
--all turns on all three (R=16, the paper's rank; K=1). Prints validation perplexity and
training tokens/s (rank 0).
"""
import argparse
import collections
import datetime
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from hipress import config
from hipress.bench.tasks import charlm_data, lm_loss
from hipress.pipeline import Pipeline


class Embed(nn.Module):
    def __init__(self, vocab, d, seq):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        nn.init.normal_(self.tok.weight, std=0.02)  # GPT-2's: it is the output head's weight too
        self.pos = nn.Parameter(0.02 * torch.randn(seq, d))

    def forward(self, ids):
        return self.tok(ids) + self.pos[: ids.shape[1]]


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, d, heads):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.layer(x, src_mask=mask, is_causal=True)


def gpt(vocab, d, heads, layers, seq):
    torch.manual_seed(0)
    parts = [("embed", Embed(vocab, d, seq))]
    parts += [(f"block{i}", Block(d, heads)) for i in range(layers)]
    parts += [("norm", nn.LayerNorm(d)), ("head", nn.Linear(d, vocab, bias=False))]
    model = nn.Sequential(collections.OrderedDict(parts))
    model.head.weight = model.embed.tok.weight
    return model


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16, help="sequences per replica per step")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--fuse-embedding", action="store_true")
    p.add_argument("--compress-backward", type=int, default=0, metavar="R",
                   help="low-rank (PowerSGD) rank of the activation gradients sent backward; 0: off")
    p.add_argument("--no-lazy-error", action="store_true", help="drop each send's compression error")
    p.add_argument("--cb-warmup", type=int, default=None, metavar="N",
                   help="steps sent uncompressed before backward compression starts (default: 10%% of --steps, "
                        "the paper's warm-up of uncompressed iterations)")
    p.add_argument("--every-send", action="store_true", help="compress every backward send, not the epilogue's only")
    p.add_argument("--compress-stages", type=int, default=0, metavar="K",
                   help="compress the data-parallel gradients of the first K stages")
    # 32: on this model's 128-wide matrices rank 8 cost +8% perplexity in 300 steps, rank 32 +0.7% (docs/pipeline.md)
    p.add_argument("--dp-rank", type=int, default=32, help="PowerSGD rank of the compressed stages' gradients")
    p.add_argument("--all", action="store_true", help="--fuse-embedding --compress-backward 16 --compress-stages 1")
    p.add_argument("--json", help="rank 0 writes the evaluation points here")
    a = p.parse_args()
    if a.all:
        a.fuse_embedding = True
        a.compress_backward = a.compress_backward or 16  # the paper's CB rank (§9.1)
        a.compress_stages = a.compress_stages or 1

    # the pipeline's sends and receives are bounded by this group's timeout: a lost peer fails the
    # step instead of hanging it
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=config.get("HIPRESS_TIMEOUT_S")))
    data = charlm_data(a.seq)
    model = gpt(data.vocab, a.d, a.heads, a.layers, a.seq)
    pipe = Pipeline(model, lambda ps: torch.optim.Adam(ps, lr=a.lr), lm_loss, pp=a.pp, dp=a.dp,
                    micro_batches=a.micro_batches, tied=[("embed.tok.weight", "head.weight")],
                    fuse_embedding=a.fuse_embedding,
                    backward_compression="powersgd" if a.compress_backward else None,
                    backward_compression_kwargs={"rank": a.compress_backward},
                    lazy_error=not a.no_lazy_error, epilogue_only=not a.every_send,
                    backward_compression_warmup=a.steps // 10 if a.cb_warmup is None else a.cb_warmup,
                    compress_stages=a.compress_stages, dp_compression="powersgd",
                    dp_compression_kwargs={"rank": a.dp_rank})
    rank = dist.get_rank()
    # validation: replica d takes sequences d, d+D, ..., as many as split into micro-batches
    per = (len(data.val_inputs) // a.dp) // a.micro_batches * a.micro_batches
    mine = torch.arange(pipe.replica, len(data.val_inputs), a.dp)[:per]
    val_x, val_t = data.val_inputs[mine], data.val_targets[mine]

    def evaluate(step, train_s):
        loss = pipe.evaluate(val_x, val_t)
        tokens = step * a.dp * a.batch * a.seq
        point = {"step": step, "val_loss": loss, "val_perplexity": math.exp(loss),
                 "tokens_per_s": tokens / train_s if train_s else 0.0}
        if rank == 0:
            print(f"step {step}: validation perplexity {point['val_perplexity']:.3f}, "
                  f"{point['tokens_per_s']:.0f} tokens/s", flush=True)
        return point

    points = [evaluate(0, 0.0)]
    train_s = 0.0
    for step in range(a.steps):
        g = torch.Generator().manual_seed(a.seed * 1_000_003 + step * a.dp + pipe.replica)
        x, t = data.examples(torch.randint(0, data.n_train, (a.batch,), generator=g))
        t0 = time.perf_counter()
        pipe.step(x, t)
        train_s += time.perf_counter() - t0
        if (step + 1) % a.eval_every == 0 or step + 1 == a.steps:
            points.append(evaluate(step + 1, train_s))
    if rank == 0:
        last = points[-1]
        print(f"done: pp={a.pp} dp={a.dp} steps={a.steps} validation perplexity {last['val_perplexity']:.3f} "
              f"tokens/s {last['tokens_per_s']:.0f}", flush=True)
        per_step = {k: 1e3 * v / a.steps for k, v in pipe.timings.items()}
        print("rank 0 ms/step: " + ", ".join(f"{k[:-2]} {v:.1f}" for k, v in per_step.items()), flush=True)
        if a.json:
            os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
            with open(a.json, "w") as f:
                json.dump({"args": vars(a), "points": points, "rank0_ms_per_step": per_step}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
