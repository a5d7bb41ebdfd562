"""The CNN of examples/cnn (cnn_train) in PyTorch, for benchmarks/bench-sync-batch-norm.sh: the
same layers, data (Fashion-MNIST, Debian's dataset-fashion-mnist), normalisation, AdamW and
global batch split over the ranks, timed per step. One process per rank, started by the
caller with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (DDP over Gloo when WORLD_SIZE > 1).
--sync_bn converts the BatchNorms to torch.nn.SyncBatchNorm; PyTorch refuses that on CPU
tensors with more than one rank (ValueError: "SyncBatchNorm expected input tensor to be on
GPU ..."): the script then prints that error as its result and exits 3.
Prints one JSON line (rank 0): the median step's wall time (as cnn_train's step_ms_median)."""
import argparse
import gzip
import json
import os
import struct
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

MEAN, STD = 0.2860, 0.3530


def load(path_dir, limit):
    with gzip.open(f"{path_dir}/train-images-idx3-ubyte.gz", "rb") as f:
        magic, n, rows, cols = struct.unpack(">IIII", f.read(16))
        assert magic == 0x803 and rows == 28 and cols == 28
        n = min(n, limit) if limit else n
        x = torch.frombuffer(bytearray(f.read(n * 784)), dtype=torch.uint8)
    with gzip.open(f"{path_dir}/train-labels-idx1-ubyte.gz", "rb") as f:
        f.read(8)
        y = torch.frombuffer(bytearray(f.read(n)), dtype=torch.uint8)
    x = (x.view(n, 1, 28, 28).float() / 255.0 - MEAN) / STD
    return x, y.long()


def model():
    def block(i, o):
        return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(),
                             nn.MaxPool2d(2))
    return nn.Sequential(block(1, 16), block(16, 32), nn.Flatten(), nn.Linear(32 * 7 * 7, 10))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sync_bn", action="store_true")
    p.add_argument("--train_limit", type=int, default=8192)
    p.add_argument("--global_batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--data_dir", default="/usr/share/datasets/fashion-mnist")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    m = model()
    if a.sync_bn:
        m = nn.SyncBatchNorm.convert_sync_batchnorm(m)
    net = nn.parallel.DistributedDataParallel(m) if world > 1 else m
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=0)
    x, y = load(a.data_dir, a.train_limit)
    local = a.global_batch // world
    steps_per_epoch = x.shape[0] // a.global_batch
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(x.shape[0], generator=gen)
    times = []
    try:
        for step in range(a.steps):
            start = time.perf_counter()
            s = step % steps_per_epoch
            rows = order[s * a.global_batch + rank * local:][:local]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x[rows]), y[rows])
            loss.backward()
            opt.step()
            # cnn_train's step also all-reduces the loss for its log: the same here.
            if world > 1:
                t = loss.detach().clone()
                dist.all_reduce(t)
            times.append((time.perf_counter() - start) * 1000.0)
    except ValueError as e:
        if rank == 0:
            print(json.dumps({"error": str(e), "torch": torch.__version__}))
        sys.exit(3)
    times.sort()
    if rank == 0:
        print(json.dumps({"torch": torch.__version__, "world_size": world, "sync_bn": a.sync_bn,
                          "step_ms_median": times[len(times) // 2]}))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
