"""One rank whose model differs on rank 1: wrapping must fail with a precise error."""
import torch
import torch.nn as nn

import hipress

hipress.init()
width = 5 if hipress.rank() == 1 else 4
model = nn.Linear(width, 2)
try:
    hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters())
except ValueError as e:
    print("MISMATCH:", e, flush=True)
    raise SystemExit(3)
raise SystemExit(0)
