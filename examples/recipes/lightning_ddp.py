"""Lightning with hipress's DDP comm hook (docs/ddp.md, "Recipes").

    torchrun --nproc_per_node 2 examples/recipes/lightning_ddp.py --compression tbq

A plain LightningModule and Trainer; the hipress lines are marked "# hipress". On a CUDA
device, ``DDPStrategy(ddp_comm_state=HookState(...), ddp_comm_hook=hipress.ddp.hook)`` is
enough; on CPU Lightning registers no comm hook (its ``_register_ddp_hooks`` only does so for
CUDA), so a callback registers it once the strategy has wrapped the model in DDP.
"""
import argparse
import hashlib
import os

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy

import hipress.ddp  # hipress
from hipress.bench.models import DigitsCNN, digits_data  # a small CNN; sklearn's digits, shuffled by seed


class Digits(L.LightningModule):
    def __init__(self, lr, momentum):
        super().__init__()
        self.net, self.lr, self.momentum = DigitsCNN(), lr, momentum

    def training_step(self, batch, _):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class HipressHook(L.Callback):  # hipress
    """Registers hipress's hook on the DDP model the strategy made (before the first step)."""

    def __init__(self, compression, **kwargs):
        self.compression, self.kwargs, self.state = compression, kwargs, None

    def on_fit_start(self, trainer, pl_module):
        ddp = trainer.strategy.model
        if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            self.state = hipress.ddp.register(ddp, self.compression, **self.kwargs)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16, help="per process")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--compression", default="tbq")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=42)
    a = p.parse_args()

    L.seed_everything(a.seed, verbose=False)
    torch.set_num_threads(1)
    (xtr, ytr), (xte, yte) = digits_data(a.seed)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xtr, ytr), batch_size=a.batch_size,
                                         shuffle=True)
    # hipress: momentum correction moves SGD's momentum into the hook (applied before compression)
    corrected = a.compression not in ("none", "powersgd") and a.momentum > 0
    module = Digits(a.lr, 0.0 if corrected else a.momentum)
    hook = HipressHook(a.compression, momentum_correction=a.momentum if corrected else None)  # hipress
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),  # torchrun's processes
                        strategy=DDPStrategy(process_group_backend="gloo"), max_epochs=a.epochs,
                        callbacks=[hook], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, loader)
    module.net.eval()
    with torch.no_grad():
        acc = (module.net(xte).argmax(1) == yte).float().mean().item()
    digest = hashlib.sha256(b"".join(q.detach().numpy().tobytes() for q in module.net.parameters())).hexdigest()[:16]
    synced = hook.state.buckets_synced if hook.state is not None else 0
    print(f"rank {trainer.global_rank}/{trainer.world_size} done: test accuracy {acc:.4f} "
          f"buckets synced by hipress {synced} params sha256 {digest}", flush=True)
    hipress.shutdown()  # hipress


if __name__ == "__main__":
    main()
