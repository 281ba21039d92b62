"""One worker of the data-parallel tests (tests/distributed/test_data_parallel.py), started by
mexc.distributed.launch: trains STEPS steps of an example model on its rows of a deterministic
global batch sequence and writes its state checksum and losses to OUT/rank<R>.json."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import mexc  # noqa: E402
from mexc.distributed import exit_worker, init_from_env, shard_rows  # noqa: E402

# models whose input is token ids: their vocabulary, and their labels' shape per sample
TOKENS = {"tokens": (40, ()), "causal_lm": (40, (8,)), "padded": (40, ())}


def batches(
    shape: tuple[int, ...], batch: int, steps: int, tokens: tuple[int, tuple[int, ...]] = (0, ())
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The global batches of the run: the same on every worker and in one process (`tokens`:
    ids in [0, vocab) where vocab > 0, and the labels' shape per sample)."""
    rng = np.random.default_rng(7)
    vocab, labels = tokens

    def x() -> np.ndarray:
        if vocab:
            return rng.integers(0, vocab, (batch, *shape))
        return rng.normal(size=(batch, *shape)).astype(np.float32)

    return [(x(), rng.integers(0, 10, (batch, *labels))) for _ in range(steps)]


class ZooLayers(torch.nn.Module):
    """The layers added for models users bring, each in one data-parallel step: GroupNorm,
    LeakyReLU, channel dropout, zero padding, nearest upsampling, pixel shuffle, a
    standardized weight with a gain (timm's ScaledStdConv2d: every worker computes it whole,
    its gradient from the all-reduced sum), Mish, a transposed convolution, tanh, adaptive max
    pooling and softsign (a quotient)."""

    def __init__(self) -> None:
        from timm.layers import ScaledStdConv2d

        super().__init__()
        nn = torch.nn
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1, bias=False)
        self.gn = nn.GroupNorm(2, 8)
        self.act = nn.LeakyReLU(0.1)
        self.drop = nn.Dropout2d(0.25)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2)
        self.up = nn.Upsample(scale_factor=2)
        self.shuffle = nn.PixelShuffle(2)
        self.conv3 = ScaledStdConv2d(2, 4, 3, padding=1)
        self.tconv = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.pool = nn.AdaptiveMaxPool2d(2)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = torch.nn.functional
        x = self.drop(self.act(self.gn(self.conv1(x))))  # 8 x 8 x 8
        x = self.up(self.conv2(f.pad(x, (0, 1, 0, 1))))  # 8 x 4 x 4 -> 8 x 8 x 8
        x = f.mish(self.conv3(self.shuffle(x)))  # 2 x 16 x 16 -> 4 x 16 x 16
        x = self.tconv(x)  # 4 x 32 x 32
        return self.fc(f.softsign(torch.tanh(torch.flatten(self.pool(x), 1))))


class WindowBiases(torch.nn.Module):
    """Attention in 2 x 2 windows of a 4 x 4 map with a relative-position bias table indexed
    by a buffer and a mask buffer over the windows, through SDPA's attn_mask (timm's Swin): the
    gathered mask repeats every 4 rows of the windows merged into the batch. The value
    projection is applied twice (shared weights: the sum of its two gradients reads the
    all-reduced terms)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        from tests.compiler.test_gathered_params import relative_index, window_mask

        self.embed = torch.nn.Conv2d(1, dim, 2, stride=2)
        self.q, self.k, self.v = (torch.nn.Linear(dim, dim) for _ in range(3))
        self.table = torch.nn.Parameter(torch.randn(9, 1) * 0.5)
        self.register_buffer("index", relative_index(2))
        self.register_buffer("mask", window_mask(4, 2, 1))
        self.head = torch.nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.embed(x).permute(0, 2, 3, 1)  # (B, 4, 4, C)
        b, c = y.shape[0], y.shape[3]
        w = y.view(b, 2, 2, 2, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(b * 4, 4, c)
        bias = self.table[self.index.view(-1)].view(4, 4)
        mask = self.mask.unsqueeze(0).expand(b, -1, -1, -1).reshape(b * 4, 4, 4)
        out = torch.nn.functional.scaled_dot_product_attention(
            self.q(w), self.k(w), self.v(w), attn_mask=bias + mask
        )
        out = self.v(out)  # v read twice: shared weights (param_grad_sum)
        return self.head(out.reshape(b, 16, c).mean(1))


def model(name: str) -> tuple[torch.nn.Module, tuple[int, ...]]:
    from examples.models import EXAMPLES
    from examples.vit import ViTTiny

    torch.manual_seed(0)
    if name == "mobilenet_v3_small":  # hardswish, squeeze-excitation, dropout (torchvision)
        import torchvision

        net = torchvision.models.mobilenet_v3_small(width_mult=0.25, num_classes=10)
        return net, (3, 32, 32)
    if name == "timm_vit":  # class token, positional embedding, dropout paths (timm)
        import timm

        vit = timm.models.vision_transformer.VisionTransformer(
            img_size=16,
            patch_size=8,
            in_chans=1,
            num_classes=10,
            embed_dim=32,
            depth=1,
            num_heads=2,
            drop_rate=0.1,
        )
        return vit, (1, 16, 16)
    if name == "zoo_layers":
        return ZooLayers(), (1, 8, 8)
    if name == "shifted_windows":  # gather_param: a bias table, a window mask of period 4
        return WindowBiases(), (1, 8, 8)
    if name == "tokens":  # token ids: embedding tables, a padding id, attention
        from tests.compiler.test_embedding import T, TokenEncoder

        return TokenEncoder(), (T,)
    if name == "padded":  # attention whose padding mask (ids == 0) hides keys
        from tests.compiler.test_attention_masks import PaddedEncoder, T

        return PaddedEncoder(), (T,)
    if name == "causal_lm":  # causal attention, a label per position (the next id)
        from tests.compiler.test_embedding import CausalLM, T

        return CausalLM(), (T,)
    cls, shape = {**EXAMPLES, "ViTTiny": (ViTTiny, (1, 28, 28))}[name]
    return cls(), shape


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="FashionCNN")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--bits", type=int, default=8)
    ap.add_argument("--optimizer", default="sgd")
    ap.add_argument("--channel-exponents", action="store_true", help="docs/numerics.md §5")
    ap.add_argument("--trainable", default=None, help="mexc.trainable spec (sparse update)")
    ap.add_argument(
        "--target", default="reference", help="a target, or cuda-emulated (no GPU needed)"
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--crash-rank", type=int, default=-1, help="this rank exits at step 2")
    ap.add_argument("--resume", default="", help="a checkpoint to resume from")
    ap.add_argument("--save", default="", help="rank 0 saves a checkpoint here at the end")
    ap.add_argument(
        "--differ",
        choices=("", "init", "seed"),
        default="",
        help="rank 1 builds its model under another torch seed (init) or compiles another seed",
    )
    args = ap.parse_args()
    workers = init_from_env()
    results = {}
    for name in args.model.split(","):
        net, shape = model(name)
        if args.differ == "init" and workers.rank == 1:
            torch.manual_seed(1)
            net, shape = type(net)(), shape
        data = batches(shape, args.batch, args.steps, TOKENS.get(name, (0, ())))
        emulated = args.target == "cuda-emulated"  # the CUDA step's kernels on the CPU
        target = "reference" if emulated else args.target
        if args.resume:
            prog = mexc.load(args.resume, target=target, data_parallel=True)
        else:
            x0 = torch.from_numpy(data[0][0])
            prog = mexc.compile(
                net,
                (x0,),
                bits=args.bits,
                optimizer=args.optimizer,
                trainable=args.trainable,
                target=target,
                data_parallel=True,
                channel_exponents=args.channel_exponents,
                seed=int(args.differ == "seed" and workers.rank == 1),
            )
        if emulated:
            from mexc.backends.cuda.emulator import emulate

            prog = emulate(prog)
        losses = []
        for i, (x, y) in enumerate(data[prog.step_count :], start=prog.step_count):
            if i == 2 and workers.rank == args.crash_rank:
                os._exit(3)
            rows = shard_rows(x, workers.rank, workers.world)
            losses.append(prog.step(rows, shard_rows(y, workers.rank, workers.world)))
        if args.save and workers.rank == 0:
            prog.save(args.save)
        results[name] = {"checksum": prog.state_checksum(), "losses": losses}
    Path(args.out, f"rank{workers.rank}.json").write_text(json.dumps(results))
    exit_worker(0)


if __name__ == "__main__":
    main()
