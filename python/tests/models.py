"""Two small models and the data they train on, for the training tests and
the benchmark: a character-level GPT on text files this repository ships
(README.md and docs/), and a CNN on Fashion-MNIST as Debian's
dataset-fashion-mnist ships it (or $GRADKIT_FASHION_MNIST)."""
import gzip
import math
import os
import pathlib

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[2]
FASHION_MNIST = pathlib.Path(os.environ.get("GRADKIT_FASHION_MNIST", "/usr/share/datasets/fashion-mnist"))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(torch.ones(t, t, device=x.device, dtype=torch.bool).triu(1), float("-inf"))
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT-2-shaped decoder over bytes (vocabulary 256)."""

    def __init__(self, layers=2, d=128, heads=4, block=64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, 256, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.float().view(-1, 256), targets.view(-1))


def text_batches(device, steps, batch=16, block=64, seed=0):
    """Random windows of the repository's own documentation, as bytes."""
    files = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    data = torch.tensor(np.frombuffer(b"\n".join(f.read_bytes() for f in files), dtype=np.uint8).astype(np.int64))
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        at = torch.randint(0, len(data) - block - 1, (batch,), generator=g)
        x = torch.stack([data[i:i + block] for i in at])
        y = torch.stack([data[i + 1:i + block + 1] for i in at])
        yield x.to(device), y.to(device)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(1, 16, 3, padding=1), nn.Conv2d(16, 32, 3, padding=1)
        self.fc1, self.fc2 = nn.Linear(32 * 7 * 7, 128), nn.Linear(128, 10)

    def logits(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))

    def forward(self, x, targets):
        return F.cross_entropy(self.logits(x).float(), targets)


def fashion_mnist_available():
    return (FASHION_MNIST / "t10k-images-idx3-ubyte.gz").exists()


def _idx(path, header):
    with gzip.open(path, "rb") as f:
        return np.frombuffer(f.read()[header:], dtype=np.uint8)


def held_out_accuracy(model, device, dtype=torch.float32, count=4096):
    """The fraction of the first `count` images of Fashion-MNIST's training split that the
    model classifies right. image_batches trains on the test split, so these are unseen
    (scripts/gpu carry carries only the first 4096 of them to the GPU machine)."""
    images = _idx(FASHION_MNIST / "train-images-idx3-ubyte.gz", 16)[:count * 784].reshape(-1, 1, 28, 28)
    labels = _idx(FASHION_MNIST / "train-labels-idx1-ubyte.gz", 8)[:count]
    x = (torch.tensor(images, dtype=torch.float32) / 255.0).to(device=device, dtype=dtype)
    y = torch.tensor(labels, dtype=torch.int64, device=device)
    with torch.no_grad():
        return (model.logits(x).argmax(1) == y).double().mean().item()


def image_batches(device, steps, batch=64, seed=0):
    """Random batches of Fashion-MNIST's 10,000 test images (enough for these tests)."""
    images = _idx(FASHION_MNIST / "t10k-images-idx3-ubyte.gz", 16).reshape(-1, 1, 28, 28)
    labels = _idx(FASHION_MNIST / "t10k-labels-idx1-ubyte.gz", 8)
    x_all = torch.tensor(images, dtype=torch.float32) / 255.0
    y_all = torch.tensor(labels, dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        at = torch.randint(0, len(y_all), (batch,), generator=g)
        yield x_all[at].to(device), y_all[at].to(device)
