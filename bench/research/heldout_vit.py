"""A ViT unlike examples/vit.py, timed as bench/step_time.py times its models: is the compiled
step's speed general, or tuned to the repository's own ViTs?

It differs where transformer code in the wild differs: the patch embedding is a strided
convolution, q, k and v come from one fused linear layer split with `chunk`, the model is
narrow (dim 48, 3 heads of 16) on 49 tokens, depth 4, MLP ratio 4, a learned position
embedding and mean pooling. Prints, per batch, the median step of mexc llvm and PyTorch FP32
eager taken in alternation (`step_time.measure`) and their ratio.

    python bench/research/heldout_vit.py [--batches 64,128] [--repeats 9]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import step_time  # noqa: E402


class FusedAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.scale = (dim // heads) ** -0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # (a generator over chunk() would not trace)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), FusedAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class HeldOutViT(nn.Module):
    def __init__(self, dim: int = 48, heads: int = 3, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Conv2d(1, dim, 4, stride=4)  # 28 x 28 -> 49 tokens
        self.pos = nn.Parameter(torch.zeros(1, 49, dim))
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        return self.head(self.norm(self.blocks(x)).mean(dim=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="64,128")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    step_time.MODELS["HeldOutViT"] = (HeldOutViT, (1, 28, 28))
    for batch in (int(b) for b in args.batches.split(",")):
        r = step_time.measure("HeldOutViT", batch, args.repeats, ["llvm"], 0.1)
        med, ratio = r["median_s"], r["ratio_to_fp32"]
        print(
            f"batch {batch}: llvm {med['llvm']:.4f} s, FP32 {med['fp32']:.4f} s, "  # type: ignore[index]
            f"llvm / FP32 {ratio['llvm']:.2f}"  # type: ignore[index]
        )


if __name__ == "__main__":
    main()
