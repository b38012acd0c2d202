"""COVAP's local mode by hand (hipress/torch/covap.py, MODES), for the optimizer's and the DDP
hook's tests: one replica of the model per rank, each stepping its own momentum SGD on its own
gradient; before each step, the parameters of the units selected that step are averaged across
the replicas. The first ``whole_steps`` steps average the gradients instead (DDP's buckets
settling before the filter starts)."""
import torch

from hipress.torch import covap


def local_replicas(make_model, batch, buckets, interval, whole_steps, steps, ranks=2):
    """``buckets``: [(name, [parameter names])] in the filter's order. Returns every replica's
    final parameters and the filter."""
    models = [make_model() for _ in range(ranks)]
    named = [dict(m.named_parameters()) for m in models]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    filt = covap.Filter({name: sum(named[0][n].numel() for n in members) for name, members in buckets}, interval)
    for step in range(steps):
        for r, m in enumerate(models):
            x, y = batch(r, step)
            m.zero_grad(set_to_none=True)
            ((m(x) - y) ** 2).mean().backward()
        if step < whole_steps:
            for n in named[0]:
                avg = sum(nd[n].grad for nd in named) / ranks
                for nd in named:
                    nd[n].grad = avg.clone()
        else:
            for name, members in buckets:
                flats = [torch.cat([nd[n].detach().reshape(-1) for n in members]) for nd in named]
                for _, (s, e) in filt.selected_units(name):
                    avg = sum(f[s:e] for f in flats) / ranks
                    for f in flats:
                        f[s:e] = avg
                with torch.no_grad():
                    for nd, f in zip(named, flats):
                        off = 0
                        for n in members:
                            nd[n].copy_(f[off:off + nd[n].numel()].view_as(nd[n]))
                            off += nd[n].numel()
            filt.advance()
        for o in opts:
            o.step()
    return [{n: p.detach().clone() for n, p in nd.items()} for nd in named], filt
