"""Where a weight-standardized model's logits part from torch's: its standardized weights'
rounding, or the integer step around them. Compiles a timm model (reference target) and
reports three logits cosines at random initialization (StdConv2d and ScaledStdConv2d; the
"Same" forms keep their float standardization):

- program: the integer logits against torch (standardizing the program's dequantized
  parameters in float), as bench/research/model_probe.py reports them;
- weights: torch with the program's own inference-time standardized weights put into plain
  convolutions, against torch standardizing in float (the weights' rounding alone);
- step: the integer logits against that torch (everything but the weights' rounding).

    python bench/research/standardized_weight_error.py nf_seresnet26 --size 64 --batch 2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mexc  # noqa: E402
from mexc.backends.reference.interp import StepEnv, execute  # noqa: E402
from mexc.ir import Op  # noqa: E402
from mexc.mx import RoundCtx  # noqa: E402
from tests.compiler.helpers import _as_input, cosine, dequantized_copy  # noqa: E402


def standardized_weights(prog: mexc.Program, x: np.ndarray) -> list[np.ndarray]:
    """The weights the program's inference path computes for its convolutions, in order."""
    o = prog.options
    ctx = RoundCtx("nearest", o.seed, 0, o.bits, channels=o.channel_exponents)
    env = StepEnv(ctx=ctx, train=False, x=x, y=None, state=prog.state)
    nodes = prog._eval_nodes
    values = execute(nodes[:-1], env, None)
    convs = [n for n in nodes if n.op in (Op.CONV2D, Op.CONV2D_COMPACT)]
    return [values[n.inputs[1]].dequantize() for n in convs if n.inputs[1] in values]


def main() -> None:
    import timm
    from timm.layers import ScaledStdConv2d, StdConv2d

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = timm.create_model(args.model, pretrained=False, num_classes=10)
    x = np.random.default_rng(0).standard_normal((args.batch, 3, args.size, args.size))
    x = x.astype(np.float32)
    prog = mexc.compile(model, (torch.from_numpy(x),), target="reference")
    ref = dequantized_copy(model, prog).eval()
    xin = _as_input(prog, x)
    with torch.no_grad():
        want = ref(xin).numpy()
    got = prog.logits(x)
    convs = [m for m in ref.modules() if isinstance(m, torch.nn.Conv2d)]
    weights = standardized_weights(prog, x)
    assert len(weights) == len(convs), (len(weights), len(convs))
    for conv, w in zip(convs, weights):
        if isinstance(conv, (StdConv2d, ScaledStdConv2d)):
            held = torch.from_numpy(w.astype(np.float32)).to(conv.weight.dtype)

            def plain(x: torch.Tensor, c: torch.nn.Conv2d = conv, w: torch.Tensor = held) -> Any:
                return F.conv2d(x, w, c.bias, c.stride, c.padding, c.dilation, c.groups)

            conv.forward = plain  # type: ignore[method-assign]
    with torch.no_grad():
        mid = ref(xin).numpy()
    row = {
        "model": args.model,
        "program": round(cosine(got, want), 4),
        "weights": round(cosine(mid, want), 4),
        "step": round(cosine(got, mid), 4),
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
