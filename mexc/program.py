"""A compiled integer training program: step / predict / evaluate / state / checkpoints.

The run side: this module needs numpy and the reference executor, never the compile side
(torch, torch.fx, TVM) nor a compiled backend; the backends build on `Program`, and
`mexc.targets` (above both) turns a Program or a checkpoint into one of them.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tempfile
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mexc.arrangement import arrangements
from mexc.backends.reference.interp import (
    StepEnv,
    execute,
    infer,
    last_uses,
    split_nodes,
    value_bytes,
)
from mexc.distributed import Workers, shard_rows
from mexc.errors import CheckpointError, InputError
from mexc.ir import LABEL_SHAPE, Graph, Op, needed_nodes
from mexc.kernels.quantize import quantize
from mexc.mx import MX, Acc, RoundCtx
from mexc.numerics import ROUNDING_MODES, FixedScalar, site_rounding, state_checksum
from mexc.optim import SGD, Adam, AdamW, Constant, Cosine, Optimizer, Step, is_count
from mexc.parser import parse_graph
from mexc.printer import print_graph

if TYPE_CHECKING:  # the planner needs networkx, which a GPU runtime machine may lack
    from mexc.passes.plan_memory import MemoryPlan

# 2: the output head's probabilities are int16 (i16); a format-1 checkpoint's program typed them
# u8, and reads as format 2 with that type changed (its state means the same)
CHECKPOINT_FORMAT = "mexc-checkpoint-2"
# the largest |exponent| a loaded state may hold: AdamW's moments start at MOMENT_EXP0 = -2^14
# (docs/numerics.md 12b), and sums and differences of exponents in the kernels stay far
# inside int32
MAX_STATE_EXPONENT = 2**15
_OLDER_FORMATS = {"mexc-checkpoint-1": lambda text: re.sub(r"\bu8\[", "i16[", text)}
# a NumPy scalar hyperparameter printed by its repr in the header (`lr=np.float64(0.05)`),
# before the optimizers stored Python floats: such text never parsed, so reading the number
# inside changes nothing else
_NUMPY_SCALAR = re.compile(r"\bnp\.(?:float|int)(?:16|32|64)\(([^()]*)\)")


@dataclass(frozen=True)
class Options:
    bits: int = 8
    seed: int = 0
    rounding: str = "stochastic"
    per_group_velocity: bool = True
    target: str = "reference"
    channel_exponents: bool = False  # docs/numerics.md §5, "Channel exponents"


def as_numpy(x: Any, what: str) -> np.ndarray:
    """x (a torch tensor or a NumPy array) as a NumPy array; an InputError for anything else.
    bfloat16 and float16 tensors widen to float32 (exactly: NumPy has no bfloat16); a masked
    array is refused, since what its mask hides is not data."""
    if hasattr(x, "detach"):  # a torch tensor (the run side imports no torch: README)
        if getattr(x, "is_meta", False):
            raise InputError(f"{what} is a tensor on the meta device: it holds no values")
        if str(x.dtype) in ("torch.bfloat16", "torch.float16"):
            x = x.float()
        x = x.detach().cpu().numpy()
    if isinstance(x, np.ma.MaskedArray):
        raise InputError(
            f"{what} is a masked array: fill its masked entries first (x.filled(value))"
        )
    if not isinstance(x, np.ndarray):
        raise InputError(f"{what} must be a torch.Tensor or numpy array, got {type(x).__name__}")
    if x.dtype.kind == "f" and x.dtype.itemsize > 8:  # long double: as float64 (inf beyond)
        with np.errstate(over="ignore"):
            x = x.astype(np.float64)
    return x


def replay_indices(n_samples: int, batch: int, step: int) -> np.ndarray:
    """Sample indices of batch `step` in the replay order (Program.replay, exported C projects):
    k*B .. k*B+B-1 wrapping around the data."""
    return (step * batch + np.arange(batch)) % n_samples


class Program:
    """An integer-only training step for one model, run by the reference executor."""

    def __init__(
        self,
        graph: Graph,
        state: dict[str, MX],
        options: Options,
        optimizer: Optimizer,
        step: int = 0,
        workers: Workers | None = None,
        global_graph: Graph | None = None,
    ) -> None:
        """`workers` and `global_graph`: a data-parallel worker's program (mexc.distributed):
        `graph` is its step over its rows of the batch (shard-batch), `global_graph` the
        program before the split, which inference and checkpoints use."""
        self.graph = graph
        self.global_graph = global_graph if global_graph is not None else graph
        self.workers = workers
        self.state = state
        self.options = options
        self.optimizer = optimizer
        self.step_count = step
        self.batch = int(graph.attr("batch"))  # the rows one step takes (a worker's share)
        self.eval_batch = int(self.global_graph.attr("batch"))  # the rows of an inference batch
        self.num_classes = int(graph.attr("num_classes"))
        self.input_shape = tuple(graph.nodes_of(Op.INPUT)[0].type.shape[1:])
        # > 0: the input is integer ids in [0, vocab), read by embedding tables
        self.vocab = int(graph.nodes_of(Op.INPUT)[0].attrs.vocab)
        # a sample's labels: () for one, (d1, ...) for one per position of [N, C, d1, ...]
        # logits; the loss rows are the positions of every sample
        self.label_shape = tuple(int(d) for d in graph.attr(LABEL_SHAPE, ()))
        self.positions = int(np.prod(self.label_shape, dtype=np.int64))
        self._train_nodes = list(graph.nodes)
        keep = {v for _, v in graph.outputs}
        self._train_last_use = last_uses(self._train_nodes, keep)
        self._split = split_nodes(graph) if workers is not None else None
        inference = self.global_graph
        self._eval_nodes = needed_nodes(inference, ["logits"])
        self._eval_last_use = last_uses(self._eval_nodes, {inference.output("logits")})
        self._plan: MemoryPlan | None = None
        self._step_peak_bytes = 0  # the reference executor's live values at the last step

    @property
    def rows_nodes(self) -> frozenset[int]:
        """A data-parallel worker's nodes that read its rows of the batch (and its all_reduce
        nodes: split_nodes); none in one process."""
        return self._split or frozenset()

    # ----------------------------------------------------------------------------- inputs

    def _check_x(self, x: Any, exact_batch: bool) -> np.ndarray:
        arr = as_numpy(x, "x")
        if self.vocab:
            return self._check_ids(arr, exact_batch)
        if not np.issubdtype(arr.dtype, np.floating):
            raise InputError(
                f"x must be a float tensor, got dtype {arr.dtype}; convert images "
                "to float (e.g. x.float() / 255) before passing them"
            )
        self._check_shape(arr, exact_batch)
        # min and max carry any NaN or inf: no temporaries of the whole batch (a float64 copy
        # and a mask were a quarter of a compiled FashionCNN step's per-sample peak RSS);
        # quantize widens block by block, so the caller's dtype is kept
        if arr.size and not (np.isfinite(arr.min()) and np.isfinite(arr.max())):
            bad = int(np.size(arr) - np.count_nonzero(np.isfinite(arr)))
            raise InputError(
                f"x contains {bad} NaN or infinite value(s); integer training "
                "cannot represent them: clean or normalize the data first"
            )
        return arr

    def boundary(
        self, xs: np.ndarray, agree: Callable[[float], float] | None = None
    ) -> tuple[np.ndarray, int]:
        """A checked batch as the compiled steps read it: token ids as int32 (exponent 0,
        unread), or floats quantized at the host boundary (int8 mantissas, exponent); `agree`:
        a data-parallel worker's agreement on the batch's maximum (kernels.quantize)."""
        if self.vocab:
            return np.ascontiguousarray(xs, np.int32), 0
        q = quantize(xs, self.options.bits, agree)
        return np.ascontiguousarray(q.m), int(q.e)

    def random_batch(
        self, rng: np.random.Generator, rows: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """A batch of `rows` (default: the step's batch) random inputs of the kind the program
        reads, and labels, for checks and measurements: N(0, 1) floats or ids drawn uniformly
        from the vocabulary; a label per sample or per position, uniform over the classes."""
        n = self.batch if rows is None else rows
        shape = (n, *self.input_shape)
        if self.vocab:
            x = rng.integers(0, self.vocab, shape)
        else:
            x = rng.standard_normal(shape).astype(np.float32)
        return x, rng.integers(0, self.num_classes, (n, *self.label_shape))

    def _check_shape(self, arr: np.ndarray, exact_batch: bool) -> None:
        want = (self.batch, *self.input_shape)
        if (
            arr.ndim != len(want)
            or tuple(arr.shape[1:]) != self.input_shape
            or (exact_batch and arr.shape[0] != self.batch)
        ):
            shown = list(want) if exact_batch else ["N", *self.input_shape]
            raise InputError(
                f"x has shape {list(arr.shape)}, expected {shown} (the batch size and input "
                "shape are fixed by example_inputs at compile time; the Trainer drops an "
                "incomplete last batch)"
            )

    def _check_ids(self, arr: np.ndarray, exact_batch: bool) -> np.ndarray:
        """x of a model whose input is token ids: integers in [0, vocab) (an id outside
        would read outside an embedding table)."""
        if not np.issubdtype(arr.dtype, np.integer):
            raise InputError(
                f"x must hold integer ids (the model looks its input up in embedding tables), "
                f"got dtype {arr.dtype}"
            )
        self._check_shape(arr, exact_batch)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab):
            raise InputError(
                f"x holds ids in [{int(arr.min())}, {int(arr.max())}], outside [0, "
                f"{self.vocab - 1}]: the model's smallest embedding table that reads them has "
                f"{self.vocab} rows; map the ids into the vocabulary (an unknown-token id) "
                "first"
            )
        return arr.astype(np.int64)

    def _check_y(self, y: Any, n: int) -> np.ndarray:
        """y as int64 of shape [n, *label_shape], checked."""
        arr = as_numpy(y, "y")
        if not np.issubdtype(arr.dtype, np.integer):
            raise InputError(f"y must hold integer class ids, got dtype {arr.dtype}")
        if arr.shape != (n, *self.label_shape):
            per = (
                " (a label per position of the model's logits [N, C, d1, ...]: classes on "
                "axis 1, as F.cross_entropy reads them; a language model's [N, T, V] logits "
                "are returned as logits.transpose(1, 2); logits.view(N * T, V) takes labels "
                "[N, T])"
                if self.label_shape
                else ""
            )
            raise InputError(
                f"y has shape {list(arr.shape)}, expected {[n, *self.label_shape]}{per}"
            )
        if arr.size and (arr.min() < 0 or arr.max() >= self.num_classes):
            raise InputError(
                f"labels must be in [0, {self.num_classes - 1}], got values in "
                f"[{int(arr.min())}, {int(arr.max())}]"
            )
        return arr.astype(np.int64)

    def check_labels(self, y: Any) -> None:
        """An InputError where y (labels of any number of samples: a whole dataset split) is
        not what step and evaluate take: integer class ids in range, of the label shape."""
        arr = as_numpy(y, "y")
        self._check_y(arr, arr.shape[0] if arr.ndim else 0)

    def retargeted(self, target: str) -> Program:
        """A reference Program sharing this one's graph, state, optimizer and step count, with
        `options.target` set to `target`: what a backend's constructor takes."""
        opts = replace(self.options, target=target)
        prog = Program(
            self.graph,
            self.state,
            opts,
            self.optimizer,
            self.step_count,
            self.workers,
            self.global_graph,
        )
        prog.carry_memory_plan(self._plan)
        return prog

    # ----------------------------------------------------------------------------- training

    def lr_at(self, step: int) -> FixedScalar:
        return self.optimizer.lr_at(step)

    def step(self, x: Any, y: Any) -> float:
        """One integer training step on a batch; returns the float loss (for logging only)."""
        env = self.train_env(x, y)
        values = execute(self._train_nodes, env, self._train_last_use)
        self._step_peak_bytes = env.peak_bytes
        new_state = dict(self.state)
        for name, v in self.graph.outputs:
            if name.startswith("state:"):
                new_state[name[6:]] = values[v]
        self.state = new_state
        self.step_count += 1
        return float(values[self.graph.output("loss")])

    def train_env(self, x: Any, y: Any, lr: FixedScalar | None = None) -> StepEnv:
        """The environment a training step on (x, y) runs in (its rounding contexts, inputs,
        learning rate: the schedule's unless `lr` is given, and optimizer constants); state is
        not changed. Program.step executes the graph in it; a caller may execute its nodes to
        read every value of a step."""
        xs = self._check_x(x, exact_batch=True)
        ys = self._check_y(y, self.batch).reshape(-1)  # a row per sample, or per position
        o = self.options
        rows = None if self.workers is None else self.workers.rows(self.eval_batch)
        ctx = RoundCtx(
            site_rounding(o.rounding, False),
            o.seed,
            self.step_count,
            o.bits,
            rows,
            o.channel_exponents,
        )
        env = StepEnv(
            ctx=ctx,
            forward_ctx=replace(ctx, rounding=site_rounding(o.rounding, True)),
            forward_rids=self.graph.forward_rids,
            train=True,
            x=xs,
            y=ys,
            state=self.state,
            lr=self.lr_at(self.step_count) if lr is None else lr,
            valid=(self.batch if rows is None else rows.total) * self.positions,
            split=self._split,
        )
        opt = self.optimizer
        if isinstance(opt, AdamW):
            env.adam = opt.config(o.bits, self.step_count, site_rounding(o.rounding, False))
        else:
            env.momentum = FixedScalar.of(opt.momentum)
            env.weight_decay = FixedScalar.of(opt.weight_decay)
        return env

    def logit_batches(self, x: Any) -> list[tuple[MX | Acc, int]]:
        """The inference path's logits, batch by batch: (the logits of one full batch, as the
        int32 accumulator and its exponent (Acc) when a product computes them, else an MX;
        how many of its rows are x's). x's rows run in batches of the compiled batch size; the
        last one is padded with zero rows, whose logits are dropped. Rows of a batch are not
        independent (per-tensor exponents, batch norm's per-channel shifts take maxima over
        the batch), so every backend pads the same way: this is the definition."""
        xs = self._check_x(x, exact_batch=False)
        out = []
        for start in range(0, xs.shape[0], self.eval_batch):
            chunk = xs[start : start + self.eval_batch]
            n = chunk.shape[0]
            if n < self.eval_batch:
                pad = np.zeros((self.eval_batch - n, *self.input_shape), chunk.dtype)
                chunk = np.concatenate([chunk, pad])
            out.append((self._infer_batch(chunk), n))
        return out

    def _infer_batch(self, xs: np.ndarray) -> MX | Acc:
        """The logits of one full batch (float64, checked): the reference's inference nodes."""
        env = StepEnv(
            ctx=RoundCtx(
                "nearest",
                self.options.seed,
                0,
                self.options.bits,
                channels=self.options.channel_exponents,
            ),
            train=False,
            x=xs,
            y=None,
            state=self.state,
        )
        logits = self.global_graph.output("logits")
        return infer(self._eval_nodes, env, logits, self._eval_last_use)

    def logits(self, x: Any) -> np.ndarray:
        """Dequantized logits (float64) of the inference path, for any number of rows."""
        out = [v.dequantize()[:n] for v, n in self.logit_batches(x)]
        return np.concatenate(out) if out else np.zeros((0, self.num_classes, *self.label_shape))

    def predict(self, x: Any) -> np.ndarray:
        """Class ids (deterministic rounding, BN running statistics): the argmax of the integer
        logits, at any exponent (logits() is float64, inf or 0 past its range)."""
        out = [np.argmax(v.ordered()[:n], axis=1) for v, n in self.logit_batches(x)]
        return np.concatenate(out) if out else np.zeros((0, *self.label_shape), np.int64)

    def evaluate(self, x: Any, y: Any) -> float:
        """Accuracy in [0, 1] of at least one sample."""
        ids = self.predict(x)
        ys = self._check_y(y, ids.shape[0])
        if not ys.size:
            raise InputError("evaluate needs at least one sample; x and y are empty")
        return float(np.mean(ids == ys))

    # ----------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, np.ndarray]:
        """{name: int8 mantissas, name + ".exp": int32 exponents} for every persistent tensor."""
        out: dict[str, np.ndarray] = {}
        for name, v in sorted(self.state.items()):
            out[name] = v.m.copy()
            out[name + ".exp"] = v.e.astype(np.int32)
        return out

    def float_weights(self) -> dict[str, np.ndarray]:
        """The model's trained parameters and batch-norm running statistics as the program
        holds them, dequantized to float32, by the model's names and in its shapes (a
        parameter an op holds rearranged, mexc.arrangement, is put back). Not the optimizer's
        state, nor the constants mexc made (`mexc.*`)."""
        held = arrangements(self.global_graph)
        out: dict[str, np.ndarray] = {}
        for name in self._model_names():
            # np.asarray: a 0-dim parameter (a learned temperature) dequantizes to a scalar
            value = np.asarray(self.state[name].dequantize(), np.float32)
            way = held.get(name)
            if way is not None and not way.split:
                raise InputError(
                    f"parameter '{name}' is held in an order mexc cannot map back to the "
                    "model's: a contraction read it through an index that no reshape and "
                    "permutation of it gives (Program.state holds it in that order)"
                )
            out[name] = way.declared_of(value) if way is not None else value
        return out

    def _model_names(self) -> list[str]:
        """The model's names of the parameters and running statistics the program holds."""
        return [
            str(n.attrs.name)
            for n in self.global_graph.nodes
            if (n.op == Op.PARAM or (n.op == Op.STATE and n.attrs.role.startswith("running_")))
            and not str(n.attrs.name).startswith("mexc.")
        ]

    def check_module(self, model: Any) -> None:
        """An InputError where `model` lacks a parameter or buffer the program holds, or holds
        one in another shape (a parameter held rearranged is compared by name only): the
        module is not of the architecture this program was compiled from."""
        own = _module_tensors(model)
        held = arrangements(self.global_graph)
        for name in self._model_names():
            if name not in own:
                raise InputError(
                    f"the module has no parameter or buffer '{name}': give the module this "
                    "program was compiled from"
                )
            shape = tuple(self.state[name].m.shape)
            if name not in held and tuple(own[name].shape) != shape:
                raise InputError(
                    f"the module's '{name}' has shape {list(own[name].shape)}, the program's "
                    f"{list(shape)}: give the module this program was compiled from"
                )

    def to_module(self, model: Any) -> Any:
        """Copy float_weights() into `model` (the nn.Module this program was compiled from, or
        one of its architecture) in place, and return it: train integer-only, then evaluate,
        export or fine-tune the result in PyTorch. An error names a weight the module lacks or
        holds in another shape, and leaves the module unchanged."""
        import torch

        if not isinstance(model, torch.nn.Module):
            raise InputError(
                f"to_module takes the nn.Module this program was compiled from (or one of its "
                f"architecture), got {type(model).__name__}"
            )
        self.check_module(model)
        weights = self.float_weights()
        own = _module_tensors(model)
        for name, value in weights.items():
            if tuple(own[name].shape) != value.shape:  # one held rearranged
                raise InputError(
                    f"the module's '{name}' has shape {list(own[name].shape)}, the program's "
                    f"{list(value.shape)}: give the module this program was compiled from"
                )
        with torch.no_grad():
            for name, value in weights.items():
                own[name].copy_(torch.from_numpy(value))
        return model

    def load_state_dict(self, sd: dict[str, np.ndarray]) -> None:
        new: dict[str, MX] = {}
        for name, cur in self.state.items():
            if name not in sd or name + ".exp" not in sd:
                raise CheckpointError(f"state dict lacks '{name}' (or its exponent)")
            m, e = np.asarray(sd[name]), np.asarray(sd[name + ".exp"])
            if m.shape != cur.m.shape or e.shape != cur.e.shape:
                raise CheckpointError(
                    f"state '{name}' has shape {list(m.shape)} / exponent {list(e.shape)}, "
                    f"the program expects {list(cur.m.shape)} / {list(cur.e.shape)}"
                )
            if m.dtype != np.int8 or not np.issubdtype(e.dtype, np.integer):
                raise CheckpointError(f"state '{name}' must be int8 mantissas, integer exponents")
            if (
                e.size
                and not -MAX_STATE_EXPONENT <= int(e.min()) <= int(e.max()) <= MAX_STATE_EXPONENT
            ):
                raise CheckpointError(
                    f"state '{name}' has exponents in [{int(e.min())}, {int(e.max())}]; a "
                    f"state's exponents lie within ±{MAX_STATE_EXPONENT} (exponent arithmetic "
                    "must stay in int32): this state dict is not one a program wrote"
                )
            new[name] = MX.of(m, e)
        extra = sorted(set(sd) - {k for n in self.state for k in (n, n + ".exp")})
        if extra:
            raise CheckpointError(f"state dict has unknown entries {extra[:5]}")
        self.state = new

    def state_checksum(self) -> str:
        """FNV-1a 64 of the persistent state (docs/numerics.md); equal across backends."""
        return state_checksum({k: (v.m, v.e) for k, v in self.state.items()})

    @property
    def ir(self) -> str:
        return print_graph(self.graph)

    def carry_memory_plan(self, plan: MemoryPlan | None) -> None:
        """Keep plan-memory's plan of this graph (the compiler passes it on; None: computed
        when asked for)."""
        self._plan = plan

    def memory_plan(self) -> MemoryPlan:
        """plan-memory's plan of the IR values (carried from compilation, else computed)."""
        if self._plan is None:
            from mexc.passes.plan_memory import plan

            self._plan = plan(self.graph)
        return self._plan

    def allocated_bytes(self) -> dict[str, int]:
        """Bytes the backend holds for training, on the host and on the device. The reference:
        the state plus the peak of the live values of the last step (numpy's kernel
        temporaries not counted: bench/memory.py measures them with tracemalloc); 0 before the
        first step. A backend with a compiled evaluation plan adds "eval_host" (llvm) or
        "eval_device" (CUDA): that plan's own bytes."""
        state = sum(value_bytes(v) for v in self.state.values())
        live = self._step_peak_bytes
        return {"host": state + live if live else 0, "device": 0}

    def memory_report(self) -> dict[str, Any]:
        """Bytes, three ways, each labelled: what the backend really allocated for the training
        step (`allocated_*`; the inference plan's own bytes apart, `allocated_eval_bytes`),
        what plan-memory planned for the IR values (`planned_*`: persistent state, saved
        activations, the arena peak), and the paper's formula (`formula_*`: per parameter
        SGD's 3 bytes for int8 and 12 for FP32, AdamW's 4 and 16; 1 and 4 per saved
        activation element). `param_state_bytes`: the parameters and their optimizer state, int8
        mantissas and int32 exponents (as the compiled backends hold them)."""
        mp = self.memory_plan()
        p, a = mp.param_count, mp.saved_elements
        per_int, per_fp32 = self.optimizer.formula_bytes_per_param()
        owned = {str(n.attrs.name) for n in self.graph.nodes_of(Op.PARAM)}
        owned |= {
            str(n.attrs.name)
            for n in self.graph.nodes_of(Op.STATE)
            if str(getattr(n.attrs, "owner", "")) in owned
        }
        got = self.allocated_bytes()
        return {
            "backend": self.options.target,
            "allocated_host_bytes": got["host"],
            "allocated_device_bytes": got["device"],
            "allocated_bytes": got["host"] + got["device"],
            # the compiled inference plan's own bytes (predict, evaluate), not the step's
            "allocated_eval_bytes": got.get("eval_host", 0) + got.get("eval_device", 0),
            "planned_persistent_bytes": mp.persistent_bytes,
            "planned_saved_activation_bytes": mp.saved_bytes,
            "planned_arena_bytes": mp.arena_bytes,
            "params": p,
            "saved_activation_elements": a,
            "param_state_bytes": sum(
                self.state[k].m.size + 4 * np.size(self.state[k].e) for k in owned
            ),
            "formula_int_bytes": per_int * p + 1 * a,
            "formula_fp32_bytes": per_fp32 * p + 4 * a,
        }

    def replay(self, data: tuple[Any, Any], steps: int) -> list[float]:
        """Train `steps` steps in the order an exported C project does (its k-th step uses
        samples k*B .. k*B+B-1 of `data`, wrapping around: `replay_indices`); returns the
        losses."""
        x, y = as_numpy(data[0], "x"), as_numpy(data[1], "y")
        if steps > 0 and (x.ndim == 0 or x.shape[0] == 0):
            raise InputError("replay needs at least one sample; x is empty")
        losses = []
        for k in range(steps):
            idx = replay_indices(x.shape[0], self.eval_batch, k)
            if self.workers is not None:  # this worker's rows of the batch
                idx = shard_rows(idx, self.workers.rank, self.workers.world)
            losses.append(self.step(x[idx], y[idx]))
        return losses

    # ----------------------------------------------------------------------------- checkpoints

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write a checkpoint atomically (temp file + rename); no pickle."""
        target = Path(path)
        meta = {
            "format": CHECKPOINT_FORMAT,
            "step": self.step_count,
            "options": asdict(self.options),
            "optimizer": _optimizer_json(self.optimizer),
            "checksum": self.state_checksum(),
        }
        arrays = {f"state/{k}": v for k, v in self.state_dict().items()}
        target.parent.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
            z.comment = _DIGEST_TAG + b"0" * 64  # placeholder, patched below
            z.writestr("meta.json", json.dumps(meta, indent=1))
            # the program before any data-parallel split: it resumes on any number of workers
            z.writestr("program.mexir", print_graph(self.global_graph))
            for name, arr in arrays.items():
                with z.open(name + ".npy", "w") as out:
                    np.lib.format.write_array(out, np.asarray(arr, order="C"), allow_pickle=False)
        data = buf.getvalue()
        body = data[:-_DIGEST_LEN]
        data = body + _DIGEST_TAG + hashlib.sha256(body).hexdigest().encode()
        fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _module_tensors(model: Any) -> dict[str, Any]:
    """A module's parameters and buffers by name; tied parameters are one tensor under several
    names (the program holds the first)."""
    return dict(model.named_parameters(remove_duplicate=False)) | dict(
        model.named_buffers(remove_duplicate=False)
    )


def _checked_options(opts: Options) -> Options:
    """A checkpoint's options, refused (ValueError) where a program could not run them."""
    seed_ok = isinstance(opts.seed, int) and not isinstance(opts.seed, bool)
    if not (is_count(opts.bits) and 2 <= opts.bits <= 8) or not seed_ok:
        raise ValueError(f"bits {opts.bits!r} or seed {opts.seed!r}")
    if opts.rounding not in ROUNDING_MODES:
        raise ValueError(f"unknown rounding {opts.rounding!r}")
    return opts


def _optimizer_json(opt: Optimizer) -> dict[str, Any]:
    sched = opt.schedule
    out: dict[str, Any] = {
        "kind": type(opt).__name__,
        "lr": opt.lr,
        "weight_decay": opt.weight_decay,
        "schedule": type(sched).__name__,
        "schedule_args": asdict(sched),
    }
    if isinstance(opt, AdamW):
        out |= {"betas": list(opt.betas), "eps": opt.eps}
    else:
        out["momentum"] = opt.momentum
    return out


def _optimizer_from_json(d: dict[str, Any]) -> Optimizer:
    kinds: dict[str, Any] = {"Constant": Constant, "Step": Step, "Cosine": Cosine}
    args = d["schedule_args"]
    if "milestones" in args:
        args["milestones"] = tuple(args["milestones"])
    schedule = kinds[d["schedule"]](**args)
    kind = d.get("kind", "SGD")  # checkpoints before AdamW name no kind
    if kind not in ("SGD", "AdamW", "Adam"):
        raise ValueError(f"unknown optimizer kind {kind!r}")
    if kind in ("AdamW", "Adam"):
        cls = AdamW if kind == "AdamW" else Adam
        return cls(d["lr"], tuple(d["betas"]), d["eps"], d["weight_decay"], schedule)
    return SGD(d["lr"], d["momentum"], d["weight_decay"], schedule)


_DIGEST_TAG = b"mexc-sha256="
_DIGEST_LEN = len(_DIGEST_TAG) + 64


def _verified_bytes(p: Path) -> bytes:
    """The checkpoint's bytes, after checking the SHA-256 of everything before its trailer."""
    data = p.read_bytes()
    body, trailer = data[:-_DIGEST_LEN], data[-_DIGEST_LEN:]
    if not trailer.startswith(_DIGEST_TAG):
        raise CheckpointError(
            f"{p} is not a complete mexc checkpoint (no integrity trailer): it is truncated or "
            "was not written by mexc; use another checkpoint."
        )
    if hashlib.sha256(body).hexdigest().encode() != trailer[len(_DIGEST_TAG) :]:
        raise CheckpointError(
            f"checkpoint {p} is corrupt: its SHA-256 does not match the one recorded when it "
            "was written; use another checkpoint."
        )
    return data


def read_checkpoint(path: str | os.PathLike[str]) -> Program:
    """The program of a checkpoint written by Program.save (no pickle; its SHA-256 and state
    checksum verified), run by the reference executor whatever target it was saved from:
    `options.target` keeps the saved one. `mexc.load` (mexc.targets) rebuilds that target."""
    p = Path(path)
    try:
        with zipfile.ZipFile(io.BytesIO(_verified_bytes(p))) as z:
            meta = json.loads(z.read("meta.json"))
            fmt = meta.get("format")
            if fmt != CHECKPOINT_FORMAT and fmt not in _OLDER_FORMATS:
                raise CheckpointError(f"{p} is not a mexc checkpoint (format {fmt!r})")
            text = z.read("program.mexir").decode()
            text = _NUMPY_SCALAR.sub(r"\1", text)
            graph = parse_graph(_OLDER_FORMATS[fmt](text) if fmt in _OLDER_FORMATS else text)
            arrays = {}
            for name in z.namelist():
                if name.startswith("state/") and name.endswith(".npy"):
                    with z.open(name) as fh:
                        arrays[name[6:-4]] = np.lib.format.read_array(fh, allow_pickle=False)
        opts = _checked_options(Options(**meta["options"]))
        if not is_count(meta["step"]) or not isinstance(meta["checksum"], str):
            raise ValueError(f"step {meta['step']!r} or checksum {meta['checksum']!r}")
        # a state's mantissas are under its name, its exponents under name + ".exp": a name
        # that itself ends in ".exp" (a parameter `self.exp`) is a state too
        state = {k: MX.of(arrays[k], arrays[k + ".exp"]) for k in arrays if k + ".exp" in arrays}
        prog = Program(graph, state, opts, _optimizer_from_json(meta["optimizer"]), meta["step"])
    except CheckpointError:
        raise
    except (
        OSError,
        EOFError,
        KeyError,
        TypeError,
        ValueError,
        zipfile.BadZipFile,
        zlib.error,
    ) as err:
        raise CheckpointError(
            f"cannot read checkpoint {p}: {type(err).__name__}: {err}. The file is missing, "
            "truncated or not written by mexc; use another checkpoint or retrain."
        ) from None
    if prog.state_checksum() != meta["checksum"]:
        raise CheckpointError(
            f"checkpoint {p} is corrupt: its state checksum {prog.state_checksum()} differs "
            f"from the recorded {meta['checksum']}; use another checkpoint."
        )
    return prog
