"""One rank of the coordinator failure test: the rank named by argv[1] dies after one
step; the others must end with a clear error within HIPRESS_TIMEOUT_S."""
import os
import sys
import time

import torch
import torch.nn as nn

import hipress

from worker_common import start_together

victim = int(sys.argv[1])
if len(sys.argv) > 2:  # a directory: start init together (torch imported)
    start_together(sys.argv[2], int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
hipress.init()
model = nn.Linear(50, 50)
# compressed: uncompressed gradients would go beside the coordinator, through the backend's allreduce
opt = hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), coordinator=True, compression="onebit")
# A survivor may already fail in step 0: the victim leaves once its own step 0 is done,
# possibly before a survivor's last transfer of step 0 has reached it.
t0 = time.time()
try:
    for step in range(100):
        if step == 1 and hipress.rank() == victim:
            os._exit(17)  # dies without a word, like a crashed host
        if step == 1:
            t0 = time.time()
        opt.zero_grad()
        model(torch.randn(8, 50)).sum().backward()
        opt.step()
except RuntimeError as e:
    print(f"FAILED-CLEANLY after {time.time() - t0:.1f}s: {str(e)[:300]}", flush=True)
    os._exit(3)
print("finished without noticing the dead rank", flush=True)
