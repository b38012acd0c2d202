"""Horovod's PyTorch synthetic benchmark, rewritten for this repository: a model trained on
random data, the throughput of timed batches per rank and in total.

Plain Horovod code: the one hipress line is the import (``import horovod.torch as hvd``
runs it on Horovod). Any launcher:

    A="--no-cuda --model resnet_tiny --image-size 32"
    python -m hipress.launch -np 2 python examples/horovod/pytorch_synthetic_benchmark.py $A
    torchrun --nproc_per_node 2 examples/horovod/pytorch_synthetic_benchmark.py $A
    mpirun -np 2 python examples/horovod/pytorch_synthetic_benchmark.py $A
    horovodrun -np 2 python examples/horovod/pytorch_synthetic_benchmark.py $A

--model takes the small built-in models below (no torchvision needed) or, where torchvision
is installed, any of torchvision.models (Horovod's default, resnet50).
"""
import argparse
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import hipress as hvd


class ResidualBlock(nn.Module):
    def __init__(self, channels_in, channels_out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or channels_in != channels_out:  # match the shape of the block's output
            self.shortcut = nn.Sequential(nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                                          nn.BatchNorm2d(channels_out))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNetTiny(nn.Module):
    """ResNet's shape (a stem, four stages of residual blocks, global pooling) at a width a CPU
    trains in milliseconds per small batch."""

    def __init__(self, num_classes, width=8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        stages, channels = [], width
        for k in range(4):
            out = width * 2 ** k
            stages += [ResidualBlock(channels, out, 1 if k == 0 else 2), ResidualBlock(out, out, 1)]
            channels = out
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class CNNSmall(nn.Module):
    """Two convolutions and a linear layer: the smallest model worth timing."""

    def __init__(self, num_classes):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


BUILT_IN = {"resnet_tiny": ResNetTiny, "cnn_small": CNNSmall}


def make_model(name, num_classes):
    if name in BUILT_IN:
        return BUILT_IN[name](num_classes)
    try:
        from torchvision import models
    except ImportError:
        raise SystemExit(f"--model {name} needs torchvision, which is not installed; "
                         f"the built-in models are {sorted(BUILT_IN)}")
    return getattr(models, name)(num_classes=num_classes)


parser = argparse.ArgumentParser(description="PyTorch synthetic benchmark",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--model", type=str, default="resnet50", help="model to benchmark")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
parser.add_argument("--num-warmup-batches", type=int, default=10,
                    help="number of warm-up batches that don't count towards benchmark")
parser.add_argument("--num-batches-per-iter", type=int, default=10, help="number of batches per benchmark iteration")
parser.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
parser.add_argument("--use-adasum", action="store_true", default=False, help="use adasum algorithm to do reduction")
parser.add_argument("--image-size", type=int, default=224, help="height and width of the random images")
parser.add_argument("--num-classes", type=int, default=1000, help="number of classes of the random labels")

args = parser.parse_args()
args.cuda = not args.no_cuda and torch.cuda.is_available()

hvd.init()

if args.cuda:
    torch.cuda.set_device(hvd.local_rank())  # one GPU per process
    torch.backends.cudnn.benchmark = True

model = make_model(args.model, args.num_classes)

# Adasum does not scale the learning rate by the number of workers (except by the GPUs of
# a node, whose gradients are summed first where NCCL is used).
lr_scaler = 1 if args.use_adasum else hvd.size()
if args.use_adasum and args.cuda and hvd.nccl_built():
    lr_scaler = hvd.local_size()
if args.cuda:
    model.cuda()

optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression,
                                     op=hvd.Adasum if args.use_adasum else hvd.Average)

# every rank starts from rank 0's weights and optimizer state
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

# one fixed batch of random images and labels
data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
target = torch.randint(0, args.num_classes, (args.batch_size,))
if args.cuda:
    data, target = data.cuda(), target.cuda()


def benchmark_step():
    optimizer.zero_grad()
    loss = F.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()


def log(s, nl=True):
    if hvd.rank() == 0:
        print(s, end="\n" if nl else "", flush=True)


device = "GPU" if args.cuda else "CPU"
log(f"Model: {args.model}")
log(f"Batch size: {args.batch_size}")
log(f"Number of {device}s: {hvd.size()}")

log("Running warmup...")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)

log("Running benchmark...")
img_secs = []
for x in range(args.num_iters):
    seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / seconds
    log(f"Iter #{x}: {img_sec:.1f} img/sec per {device}")
    img_secs.append(img_sec)

# mean and 95% confidence interval over the iterations
img_sec_mean = np.mean(img_secs)
img_sec_conf = 1.96 * np.std(img_secs)
log(f"Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
log(f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * img_sec_mean:.1f} +-{hvd.size() * img_sec_conf:.1f}")
