"""mexc.compile: float PyTorch model in, integer-only training program out."""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from mexc.distributed import agree_on_program, current_workers
from mexc.errors import InputError
from mexc.frontend import import_model
from mexc.ir import Graph, Op
from mexc.kernels import quantize, quantize_channels
from mexc.mx import MX
from mexc.numerics import MOMENT_EXP0, channel_exponents_for, rounding_mode_for
from mexc.optim import Optimizer, optimizer_of
from mexc.pass_manager import Instrument, PassContext, PassManager, instruments_from_env
from mexc.pipeline import PIPELINE
from mexc.program import Options, Program
from mexc.targets import get as get_target
from mexc.targets import refuse_data_parallel_target
from mexc.trainable import TrainableError, TrainableSpec, resolve_trainable
from mexc.types import Exp


def _whole_number(name: str, value: Any) -> int:
    """value as an int, where it is one (a NumPy integer too); an error naming `name` for a
    float, a bool or anything else."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be a whole number, got {value!r} ({type(value).__name__})")
    return int(value)


def _example_batch(example_inputs: Any) -> torch.Tensor:
    if isinstance(example_inputs, (tuple, list)) and len(example_inputs) != 1:
        raise InputError(
            f"example_inputs holds {len(example_inputs)} inputs; mexc compiles models with one "
            "input tensor (a float batch, or token ids): give (x,), and combine several "
            "inputs into one tensor in a wrapper module (torch.cat, then slices in forward). "
            "Token ids are read only whole, by embedding tables: give categorical columns "
            "beside float ones as one-hot floats (a linear layer over a one-hot column is an "
            "embedding)"
        )
    x = example_inputs[0] if isinstance(example_inputs, (tuple, list)) else example_inputs
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    if isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[0] == 0):
        raise InputError(
            f"example_inputs' batch has shape {list(x.shape)}; give a batch [N, ...] of N >= 1 "
            "samples, the batch size every training step takes"
        )
    integer = isinstance(x, torch.Tensor) and not (x.is_floating_point() or x.is_complex())
    if integer and x.dtype != torch.bool:  # token ids, read by the model's embedding tables
        return x.detach().long()
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise InputError(
            "example_inputs must be (x,) with x a float tensor batch [N, ...], or an integer "
            "batch of ids that the model looks up in embedding tables"
        )
    return x.detach().float()


# optimizer state that starts at zero: role -> its initial exponent
ZERO_START = {"velocity": 0, "moment": MOMENT_EXP0, "root_moment": MOMENT_EXP0}


def initial_state(
    graph: Graph,
    params: dict[str, np.ndarray],
    buffers: dict[str, np.ndarray],
    bits: int,
    channels: bool = False,
    constants: frozenset[str] = frozenset(),
) -> dict[str, MX]:
    """Quantize parameters and buffers once (host boundary); velocities start at zero with
    exponent 0, AdamW's moments at zero with exponent MOMENT_EXP0 (docs/numerics.md §12b).
    `channels`: each parameter row gets its own B-bit exponent in the tensor's int8 frame.
    The frontend's `constants` (never trained) keep the whole int8 container, whatever B: a
    divisor ratio of 2.25 stays exact at B = 4."""
    state: dict[str, MX] = {}
    for n in graph.nodes_of(Op.PARAM, Op.STATE):
        name = str(n.attrs.name)
        held = params.get(name) if n.op is Op.PARAM else buffers.get(name)
        if held is not None and not np.isfinite(held).all():
            raise InputError(_not_finite(name, held, n.op is Op.PARAM))
        if n.op is Op.PARAM:
            p, b = params[name], 8 if name in constants else bits
            state[name] = quantize_channels(p, b) if channels else quantize(p, b)
            if name not in constants:  # mexc's own (never trained): its choice, not the model's
                _warn_if_flushed(name, p, state[name], b)
        elif n.attrs.role in ZERO_START:
            groups = n.type.shape[0] if n.type.exp is Exp.AXIS0 else None
            e0 = ZERO_START[str(n.attrs.role)]
            e = np.full(groups, e0, np.int64) if groups is not None else np.asarray(e0, np.int64)
            state[name] = MX.of(np.zeros(n.type.shape, np.int8), e)
        elif n.type.exp is Exp.AXIS0:
            state[name] = quantize_per_group(buffers[name], bits)
        else:
            state[name] = quantize(buffers[name], bits)
    return state


# a parameter whose quantization zeroes more than this share of its nonzero values is named
FLUSHED_WARNING = 0.5


def _warn_if_flushed(name: str, values: np.ndarray, held: MX, bits: int) -> None:
    """Warn where one exponent for the whole tensor rounds most of a parameter's nonzero values
    to 0 (a few values far larger than the rest: the exponent is the largest's)."""
    nonzero = np.asarray(values) != 0
    count = int(nonzero.sum())
    flushed = int((nonzero & (held.m == 0)).sum())
    if count < 16 or flushed <= FLUSHED_WARNING * count:
        return
    mags = np.abs(np.asarray(values, np.float64)[nonzero])
    warnings.warn(
        f"parameter '{name}': {flushed} of its {count} nonzero values round to 0 at {bits} "
        f"bits, since its one exponent is set by its largest value ({mags.max():.3g}; the "
        f"median is {np.median(mags):.3g}). Training starts from those zeros; clip or rescale "
        "the outliers, or give the layer channel exponents (bits below 8)",
        stacklevel=4,
    )


def _not_finite(name: str, values: np.ndarray, param: bool) -> str:
    bad = int(np.size(values) - np.isfinite(values).sum())
    what = "parameter" if param else "buffer"
    if name.startswith("mexc."):  # a frontend constant: a buffer or what forward makes of it
        what, name = "constant made from", name.removeprefix("mexc.")
    return (
        f"the model's {what} '{name}' holds {bad} NaN or infinite value(s) of "
        f"{np.size(values)}: mexc holds every value as an int8 mantissa and a power-of-two "
        "exponent, which have no NaN or infinity. Replace them with finite values (check the "
        "checkpoint the model was loaded from; a mask of -inf added to attention scores by "
        "hand: give it to the attention as attn_mask, where a causal mask is supported)"
    )


def quantize_per_group(x: np.ndarray, bits: int) -> MX:
    """Host-side boundary quantization with one exponent per slice along axis 0."""
    parts = [quantize(x[i : i + 1], bits) for i in range(x.shape[0])]
    return MX.of(np.concatenate([p.m for p in parts]), np.array([int(p.e) for p in parts]))


def compile(  # noqa: A001 - the public name is part of the API contract
    model: nn.Module,
    example_inputs: Any,
    optimizer: Optimizer | str | None = None,
    bits: int = 8,
    seed: int = 0,
    target: str = "reference",
    per_group_velocity: bool = True,
    rounding: str = "auto",
    instruments: Sequence[Instrument] = (),
    verify_each: bool = True,
    recompute: bool = True,
    trainable: TrainableSpec = None,
    data_parallel: bool = False,
    channel_exponents: bool | None = None,
) -> Program:
    """Trace `model`, run the pass pipeline and return a Program on `target` (one of
    mexc.targets.NAMES). `optimizer`: mexc.SGD(...), mexc.AdamW(...), mexc.Adam(...), or one of
    their names with its defaults ("sgd", the default, "adamw", "adam"). `recompute`: the
    backward pass computes batch-norm outputs again from their saved xhat instead of keeping
    them (the rematerialize pass; the same bits, less memory, one more elementwise pass per
    batch norm). `trainable`: the parameters to train
    (sparse update; mexc.trainable: "last:K", "bias-norm", name patterns; None: all).
    `data_parallel`: this process is one worker of an initialised torch.distributed process
    group; `example_inputs` is the global batch, and `step` takes this worker's rows of it
    (mexc.distributed.shard_rows). Every worker ends each step with the state a single process
    reaches on the whole batch, bit for bit (docs/distributed.md). `channel_exponents`: below 8
    bits, every batch-major result compacted at one exponent (convolution, linear, batch norm,
    pooling, sums and their gradients; not layer norm's rows nor softmax's probabilities) and
    every weight row keep a B-bit mantissa at an exponent of their own channel, inside their
    tensor's int8 frame (docs/numerics.md §5, "Channel exponents"). None (the default): on below
    8 bits (numerics.channel_exponents_for), on every target."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    workers = None
    if data_parallel:
        refuse_data_parallel_target(target)
        workers = current_workers()
    chosen = get_target(target)
    bits = _whole_number("bits", bits)
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be in 2..8, got {bits}")
    seed = _whole_number("seed", seed)  # taken mod 2^32 (docs/numerics.md, the PRNG)
    rounding = rounding_mode_for(rounding, bits)
    channel_exponents = channel_exponents_for(channel_exponents, bits)
    opt = optimizer_of(optimizer)
    x = _example_batch(example_inputs)
    front = import_model(model, x)
    trains = resolve_trainable(trainable, front.graph)
    # parameters the model froze (requires_grad off: nn.Embedding.from_pretrained, a frozen
    # backbone) stay as they are, as torch's optimizer leaves them
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    if frozen & set(front.params):
        trains = (trains if trains is not None else frozenset(front.params)) - frozen
        if not trains:
            raise TrainableError(
                f"trainable={trainable!r} selects only parameters whose requires_grad is off "
                f"({', '.join(sorted(frozen)[:8])}); turn requires_grad on for those to train"
            )
    if front.constants:  # the frontend's own ones and zeros stay as they are
        trains = (trains if trains is not None else frozenset(front.params)) - front.constants
        if not trains and trainable is not None:  # a model without parameters trains none
            raise TrainableError(
                f"trainable={trainable!r} selects only constants mexc made for the model "
                f"({', '.join(sorted(front.constants))}), which are never trained; name "
                "parameters of the model"
            )
    ctx = PassContext(
        trainable=trains,
        bits=bits,
        seed=seed,
        rounding=rounding,
        per_group_velocity=per_group_velocity,
        recompute=recompute,
        optimizer=opt,
        batch=x.shape[0],
        num_classes=front.num_classes,
        world=workers.world if workers is not None else 1,
        channel_exponents=channel_exponents,
    )
    pm = PassManager(PIPELINE, [*instruments, *instruments_from_env()], verify_each=verify_each)
    graph = pm.run(front.graph, ctx)
    state = initial_state(
        graph, front.params, front.buffers, bits, channel_exponents, front.constants
    )
    opts = Options(bits, seed, rounding, per_group_velocity, target, channel_exponents)
    prog = Program(graph, state, opts, opt, 0, workers, ctx.results.get("global_graph"))
    if workers is not None:
        agree_on_program(workers, prog)
    prog.carry_memory_plan(ctx.results.get("memory_plan"))
    return chosen.build(prog)
