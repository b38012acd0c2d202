"""One rank: a few training steps of a deep MLP with HIPRESS_TIMELINE set (by the test)."""
import sys
import time

import torch
import torch.nn as nn

import hipress


def main():
    compression = sys.argv[1]
    coordinator = sys.argv[2:] == ["coordinator"]
    hipress.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    layers = []
    for _ in range(8):  # 8 MiB of gradients: several compressed buckets of bucket_bytes="auto" (4 MiB)
        layers += [nn.Linear(512, 512), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(512, 10))
    # the first layer's gradient, the last of backward, comes 0.2 s after the others: the earlier
    # buckets' encodes and exchanges start inside backward however loaded the machine is
    model[0].weight.register_hook(lambda g: time.sleep(0.2))
    opt = hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(), compression=compression,
                                       coordinator=coordinator)
    for step in range(3):
        x = torch.randn(512, 512)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    hipress.shutdown()


if __name__ == "__main__":
    main()
