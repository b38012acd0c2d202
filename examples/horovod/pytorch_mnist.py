"""Horovod's PyTorch MNIST example, rewritten for this repository, on data that needs no
download: scikit-learn's 8x8 digits, scaled up to MNIST's 28x28 so that MNIST's network runs
unchanged.

Plain Horovod code: the one hipress line is the import (``import horovod.torch as hvd``
runs it on Horovod). Any launcher:

    python -m hipress.launch -np 2 python examples/horovod/pytorch_mnist.py --no-cuda
    torchrun --nproc_per_node 2 examples/horovod/pytorch_mnist.py --no-cuda
    mpirun -np 2 python examples/horovod/pytorch_mnist.py --no-cuda
    horovodrun -np 2 python examples/horovod/pytorch_mnist.py --no-cuda

Every rank prints a last line with the test accuracy and a digest of its parameters, so runs
can be compared (the same seed gives the same digest on every rank).
"""
import argparse
import hashlib

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import hipress as hvd

parser = argparse.ArgumentParser(description="PyTorch MNIST-shaped example on scikit-learn's digits")
parser.add_argument("--batch-size", type=int, default=64, metavar="N", help="input batch size for training")
parser.add_argument("--test-batch-size", type=int, default=1000, metavar="N", help="input batch size for testing")
parser.add_argument("--epochs", type=int, default=10, metavar="N", help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.01, metavar="LR", help="learning rate")
parser.add_argument("--momentum", type=float, default=0.5, metavar="M", help="SGD momentum")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
parser.add_argument("--seed", type=int, default=42, metavar="S", help="random seed")
parser.add_argument("--log-interval", type=int, default=10, metavar="N",
                    help="how many batches to wait before logging training status")
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--use-adasum", action="store_true", default=False, help="use adasum algorithm to do reduction")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                    help="apply gradient predivide factor in optimizer")


class Net(nn.Module):
    """MNIST's classic network: two convolutions with max pooling, two linear layers, dropout."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))                   # 28 -> 24 -> 12
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))  # 12 -> 8 -> 4
        x = F.relu(self.fc1(x.flatten(1)))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def digits_datasets(seed):
    """scikit-learn's 1797 digits as 1x28x28 images normalised like MNIST: 1500 to train, the
    rest to test, split by a seeded shuffle (the same on every rank)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    images = (images - images.mean()) / images.std()
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    images, labels = images[order], labels[order]
    train = torch.utils.data.TensorDataset(images[:1500], labels[:1500])
    test = torch.utils.data.TensorDataset(images[1500:], labels[1500:])
    return train, test


def train(epoch):
    model.train()
    train_sampler.set_epoch(epoch)  # a different shuffle every epoch, the same on every rank
    for batch_idx, (data, target) in enumerate(train_loader):
        if args.cuda:
            data, target = data.cuda(), target.cuda()
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
            # len(data) samples of this rank, out of the len(train_sampler) it sees per epoch
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)} "
                  f"({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}", flush=True)


def metric_average(value, name):
    """The mean of a scalar over all ranks."""
    return hvd.allreduce(torch.tensor(value), name=name).item()


def test():
    model.eval()
    test_loss = 0.0
    test_accuracy = 0.0
    with torch.no_grad():
        for data, target in test_loader:
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.argmax(dim=1)
            test_accuracy += pred.eq(target).float().sum().item()

    # this rank's share of the test set, then the mean over ranks
    test_loss /= len(test_sampler)
    test_accuracy /= len(test_sampler)
    test_loss = metric_average(test_loss, "avg_loss")
    test_accuracy = metric_average(test_accuracy, "avg_accuracy")
    if hvd.rank() == 0:
        print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * test_accuracy:.2f}%\n", flush=True)
    return test_loss, test_accuracy


if __name__ == "__main__":
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()

    hvd.init()
    torch.manual_seed(args.seed)

    if args.cuda:
        torch.cuda.set_device(hvd.local_rank())  # one GPU per process
        torch.cuda.manual_seed(args.seed)

    torch.set_num_threads(1)  # several ranks share the CPU cores

    kwargs = {"num_workers": 1, "pin_memory": True} if args.cuda else {}
    train_dataset, test_dataset = digits_datasets(args.seed)
    # each rank trains on its own part of the data
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset, num_replicas=hvd.size(),
                                                                    rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler,
                                               **kwargs)
    test_sampler = torch.utils.data.distributed.DistributedSampler(test_dataset, num_replicas=hvd.size(),
                                                                   rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size, sampler=test_sampler,
                                              **kwargs)

    model = Net()

    # the summed batch is size times larger: so is the learning rate (not with Adasum, except
    # by the GPUs of a node where NCCL sums them first)
    lr_scaler = 1 if args.use_adasum else hvd.size()
    if args.use_adasum and args.cuda and hvd.nccl_built():
        lr_scaler = hvd.local_size()
    if args.cuda:
        model.cuda()

    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    # every rank starts from rank 0's weights and optimizer state
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)

    for epoch in range(1, args.epochs + 1):
        train(epoch)
        loss, accuracy = test()

    digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()
    print(f"rank {hvd.rank()}/{hvd.size()} done: test accuracy {accuracy:.4f} loss {loss:.4f} "
          f"params sha256 {digest[:16]}",
          flush=True)
