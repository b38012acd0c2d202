"""One rank of the pipeline tests (launched by test_pipeline_ranks.py).

    python pipeline_worker.py OUT_DIR PP DP CONFIGS_JSON

Each config trains a small tied-embedding language model (embed, two blocks, head sharing the
embedding's weight) for `steps` steps with hipress.pipeline.Pipeline and records this rank's
final stage parameters (full-model names), its losses and its count of compressed backward
sends. Config keys are Pipeline keywords (fuse_embedding, backward_compression, ...), and
"resume_at": K, which also checkpoints the run after K steps (Pipeline.state_dict, through bytes)
and resumes it in a new Pipeline to the same end ("resumed"), and once more without the backward
compressor's states ("resumed_without_bc").
Rank 0 also trains the whole model in one process on every step's global batch (the replicas'
batches in replica order) and records the result as "reference". Results: OUT_DIR/rank{r}.pt.
"""
import collections
import io
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from hipress.pipeline import Pipeline

VOCAB, HIDDEN, SEQ, BATCH, LR = 24, 16, 8, 8, 0.2


def make_model():
    torch.manual_seed(0)
    model = nn.Sequential(collections.OrderedDict(
        embed=nn.Embedding(VOCAB, HIDDEN),
        block1=nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()),
        block2=nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()),
        head=nn.Linear(HIDDEN, VOCAB, bias=False)))
    model.head.weight = model.embed.weight  # tied
    return model


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batch(step, replica):
    g = torch.Generator().manual_seed(100 * step + replica)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def make_optimizer(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def reference(steps, dp):
    model = make_model()
    opt = make_optimizer(model.parameters())
    for s in range(steps):
        xs, ts = zip(*(batch(s, d) for d in range(dp)))
        opt.zero_grad()
        loss_fn(model(torch.cat(xs)), torch.cat(ts)).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def main():
    out, pp, dp, configs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {"configs": []}
    for cfg in configs:
        cfg = dict(cfg)
        steps = cfg.pop("steps")
        micro = cfg.pop("micro_batches")
        resume_at = cfg.pop("resume_at", None)

        def make():
            return Pipeline(make_model(), make_optimizer, loss_fn, pp=pp, dp=dp, micro_batches=micro,
                            tied=[("embed.weight", "head.weight")], **cfg)

        def train(pipe, first, last):
            return [pipe.step(*batch(s, pipe.replica)) for s in range(first, last)]

        def stage_params(pipe):
            return {n: p.detach().clone() for n, p in pipe.module.named_parameters(remove_duplicate=False)}

        pipe = make()
        initial = stage_params(pipe)
        losses = train(pipe, 0, steps if resume_at is None else resume_at)
        resumed = {}
        if resume_at is not None:
            buf = io.BytesIO()
            torch.save(pipe.state_dict(), buf)
            losses += train(pipe, resume_at, steps)
            for key, keep_bc in (("resumed", True), ("resumed_without_bc", False)):
                buf.seek(0)
                sd = torch.load(buf, weights_only=False)
                if not keep_bc and sd["backward_compressor"] is not None:
                    sd["backward_compressor"] = {"states": []}
                again = make()
                again.load_state_dict(sd)
                train(again, resume_at, steps)
                resumed[key] = stage_params(again)
        results["configs"].append({**resumed,
            "stage": pipe.stage, "replica": pipe.replica, "losses": losses,
            "compressed_sends": pipe.compressed_sends, "initial": initial,
            "tied_sync_groups": pipe.tied_sync_groups,
            "params": stage_params(pipe)})
    if rank == 0:
        results["reference"] = reference(configs[0]["steps"], dp)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
