"""COVAP's local mode by hand (hipress/torch/covap.py, MODES), for the optimizer's and the DDP
hook's tests: one replica of the model per rank, each stepping its own momentum SGD on its own
gradient. At each step the parameters of the units selected then are averaged across the
replicas as they are at its backward, and in the next step, before the optimizer's step, each
replica adds average - what it sent to them. The first ``whole_steps`` steps average the
gradients instead (DDP's buckets settling before the filter starts). A (rank, step) in
``skipped_on`` is that rank's step not taken (a non-finite gradient there): its optimizer does
not step; the averages and the filter go on as on every other rank.
``wire="bf16"``: a unit's first average is of its parameters
in fp32; later ones sum each replica's bf16 difference from the unit's reference (its last
average in bf16), as gloo sums bf16 (each add in fp32, rounded to bf16), and the average is
reference + sum / ranks."""
import torch

from hipress.torch import covap


def local_replicas(make_model, batch, buckets, interval, whole_steps, steps, ranks=2, skipped_on=(), wire="fp32",
                   settle=False):
    """``buckets``: [(name, [parameter names])] in the filter's order. Returns every replica's
    final parameters and the filter; with ``settle``, the last step's averages applied too (as
    synchronize() does before it averages every parameter). ``skipped_on``: (rank, step) pairs
    where that rank's optimizer does not step (a non-finite gradient there: the averages and the
    schedule go on)."""
    models = [make_model() for _ in range(ranks)]
    named = [dict(m.named_parameters()) for m in models]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    filt = covap.Filter({name: sum(named[0][n].numel() for n in members) for name, members in buckets}, interval)
    members_of = dict(buckets)

    def flat(r, name):
        return torch.cat([named[r][n].detach().reshape(-1) for n in members_of[name]])

    def add(r, name, s, delta):
        with torch.no_grad():
            off = 0
            for n in members_of[name]:
                k = named[r][n].numel()
                lo, hi = max(s, off), min(s + delta.numel(), off + k)
                if lo < hi:
                    named[r][n].view(-1)[lo - off:hi - off] += delta[lo - s:hi - s]
                off += k

    refs = {}  # wire "bf16": (bucket, start, end) -> the unit's reference
    due = []  # (bucket, start, end, the average, what each replica's parameters move by)
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
            started = []
            for name, _ in buckets:
                for _, (s, e) in filt.selected_units(name):
                    ref = refs.get((name, s, e)) if wire == "bf16" else None
                    if ref is None:
                        sent = [flat(r, name)[s:e].clone() for r in range(ranks)]
                        avg = sum(sent) / ranks
                        started.append((name, s, e, avg, [avg - x for x in sent]))
                    else:
                        diffs = [(flat(r, name)[s:e] - ref.float()).to(torch.bfloat16) for r in range(ranks)]
                        total = diffs[0]
                        for d in diffs[1:]:
                            total = (total.float() + d.float()).to(torch.bfloat16)
                        mean = total.float() / ranks
                        started.append((name, s, e, ref.float() + mean, [mean - d.float() for d in diffs]))
            filt.advance()
            for name, s, e, avg, moves in due:
                for r in range(ranks):
                    add(r, name, s, moves[r])
                refs[(name, s, e)] = avg.to(torch.bfloat16)
            due = started
        for r, o in enumerate(opts):
            if (r, step) not in skipped_on:
                o.step()
    for name, s, e, avg, moves in due if settle else ():
        for r in range(ranks):
            add(r, name, s, moves[r])
    return [{n: p.detach().clone() for n, p in nd.items()} for nd in named], filt
