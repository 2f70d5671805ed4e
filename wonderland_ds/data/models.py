"""The built-in tasks' models: an MLP for digits and a small byte-level GPT."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class Normalize(nn.Module):
    """Input normalization whose statistics are buffers: computed once by stage 15's
    pre-normalization pass, saved with every checkpoint, never trained."""

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, features: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(features))
        self.register_buffer("std", torch.ones(features))

    def set_stats(self, mean: np.ndarray, std: np.ndarray) -> None:
        with torch.no_grad():
            self.mean.copy_(torch.as_tensor(mean, dtype=self.mean.dtype))
            self.std.copy_(torch.as_tensor(std, dtype=self.std.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean.to(x.dtype)) / self.std.to(x.dtype)


def gathered(params) -> Any:
    """Whole parameters to write into, also where ZeRO-3's ``zero.Init`` has already split
    them (``ds_id``): gathered, and re-split from rank 0's values on leaving. Every rank
    computes the same seeded values, so rank 0's are everyone's."""
    params = list(params)
    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0)


class DigitsNet(nn.Module):
    """An MLP with a frozen random projection (a pretrained feature layer stand-in: it shows
    that frozen parameters survive a universal-checkpoint resume)."""

    def __init__(self, features: int = 64, hidden: int = 128, classes: int = 10) -> None:
        super().__init__()
        self.norm = Normalize(features)
        gen = torch.Generator().manual_seed(7)
        self.proj = nn.Linear(features, features)
        weight = torch.randn(features, features, generator=gen) / features**0.5
        with gathered(self.proj.parameters()), torch.no_grad():
            self.proj.weight.copy_(weight)
            self.proj.bias.zero_()
        self.proj.requires_grad_(False)
        self.body = nn.Sequential(
            nn.Linear(2 * features, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.norm(x)
        return self.body(torch.cat([z, torch.tanh(self.proj(z))], dim=-1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.out(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class ByteGPT(nn.Module):
    """A small GPT over bytes (vocabulary 256). ``dim``/``layers`` set the size: the default
    is ~0.8M parameters; dim 512, 8 layers is ~25M (checkpoint benchmarks)."""

    def __init__(
        self,
        context: int = 128,
        dim: int = 128,
        layers: int = 4,
        heads: int = 4,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256, bias=False)
        with gathered(self.parameters()):  # under zero.Init the blocks are split already
            nn.init.normal_(self.pos, std=0.02)
            for p in self.parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))
