"""The host side of a compiled training step, shared by the llvm and CUDA backends.

A compiled step is a launch plan over named buffers (docs/cpu.md, docs/cuda.md), described by a
JSON manifest: buffers, views, constants, where the state, the batch, the labels, the learning
rate, the stream keys and the softmax probabilities live. Per step the host writes the quantized
batch (the float boundary), the labels, the learning rate pair and the stream keys, runs the
backend's kernels, and reads back the probabilities to log the loss. The state stays in the
backend's buffers; reading it (state_dict, checksum, checkpoints, evaluation) copies it out.
Imports neither TVM nor torch: the CUDA runtime machine has neither.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mexc.errors import TornStateError
from mexc.kernels.loss import ce_loss
from mexc.mx import MX, Acc, Collectives
from mexc.numerics import stream_keys
from mexc.program import Program

# the manifest entries every backend shares (each adds how it runs its kernels)
PLAN_FIELDS = (
    "buffers",
    "views",
    "constants",
    "keys",
    "key_ids",
    "key_rows",
    "state",
    "input",
    "labels",
    "valid",
    "lr",
    "loss_rows",
)
# and, in an inference plan's manifest only (step_plan.build_inference_plan): "logits"

# a data-parallel worker's launch list also holds collectives the host runs between kernels
# (plan_core.HostLaunch): symbol HOST_PREFIX + kind + ":" + buffer
HOST_PREFIX = "host:"
HOST_KINDS = ("all_max", "all_sum")


def is_host(symbol: str) -> bool:
    """Whether launch `symbol` is a host collective (no kernel)."""
    return symbol.startswith(HOST_PREFIX)


def host_collective(symbol: str, comm: Collectives | None) -> Callable[[np.ndarray], None]:
    """The call that runs host collective `symbol` on its buffer (a numpy view of it, changed
    in place): the element-wise maximum or sum over the data-parallel workers."""
    return collective(symbol[len(HOST_PREFIX) :].split(":", 1)[0], comm)


def collective(kind: str, comm: Collectives | None) -> Callable[[Any], None]:
    """The call that replaces an int32 buffer by its element-wise maximum ("all_max") or sum
    ("all_sum") over the data-parallel workers, in place: through `comm.reduce_in_place` where
    the workers' collectives take the buffer itself (TorchCollectives: a numpy or, on NCCL, a
    device array, by DLPack), else through a host copy (numpy buffers)."""
    if comm is None or kind not in HOST_KINDS:
        raise ValueError(f"collective {kind!r} needs the data-parallel workers of the step")
    in_place = getattr(comm, "reduce_in_place", None)
    if in_place is not None:
        return lambda buf: in_place(buf, kind)
    reduce = comm.all_max if kind == "all_max" else comm.all_sum

    def run(buf: np.ndarray) -> None:
        buf[...] = reduce(buf).astype(buf.dtype)

    return run


def window(base: Any, shape: Sequence[int], offset: int) -> Any:
    """The plan view of `shape` at element `offset` of buffer `base` (numpy or CuPy array),
    sharing its memory."""
    size = int(np.prod(shape))
    return base.reshape(-1)[offset : offset + size].reshape(tuple(shape))


def inference_keys(seed: int, manifest: dict[str, Any]) -> np.ndarray:
    """The stream keys of an inference plan (int64, the plan's key ids at step 0): written into
    its keys buffer once, when a backend loads the plan."""
    return stream_keys(seed, 0, np.asarray(manifest["key_ids"], np.int64)).astype(np.int64)


def state_buffers(manifest: dict[str, Any]) -> set[str]:
    """The names of a plan's state buffers: each state tensor's mantissas and exponents."""
    return {name for pair in manifest["state"].values() for name in pair}


def share_state(manifest: dict[str, Any], buffers: dict[str, Any], shared: dict[str, Any]) -> None:
    """Bind the state buffers of `manifest`'s plan in `buffers` to the arrays of the same
    names in `shared` (another plan's over the same state: the training step's, for its
    inference plan), and the plan's views of them: the plan reads the live state, no copy."""
    state = state_buffers(manifest)
    for name in state:
        buffers[name] = shared[name]
    for name, (base, shape, offset) in manifest["views"].items():
        if base in state:
            buffers[name] = window(buffers[base], shape, offset)


class PlanProgram(Program):
    """A Program whose training step runs a compiled launch plan (same API, same bits as the
    reference). Subclasses own the buffers: `_write`, `_read` and `_run`."""

    def __init__(self, prog: Program, manifest: dict[str, Any]) -> None:
        self._plan_json = manifest
        self._key_ids = np.asarray(manifest["key_ids"], np.int64)
        self._state_cache: dict[str, MX] | None = None
        self._torn: str | None = None  # why a step stopped part way (_run raised), else None
        self._key_rows = np.asarray(manifest["key_rows"], np.int64)
        super().__init__(
            prog.graph,
            prog.state,
            prog.options,
            prog.optimizer,
            prog.step_count,
            prog.workers,
            prog.global_graph,
        )
        self.carry_memory_plan(prog._plan)

    def _write(self, name: str, values: np.ndarray) -> None:
        """Copy `values` into the start of buffer or view `name`."""
        raise NotImplementedError

    def _read(self, name: str) -> np.ndarray:
        """A host copy of buffer or view `name`."""
        raise NotImplementedError

    def _run(self) -> None:
        """Run the step's kernels in order (inputs written, results left in the buffers)."""
        raise NotImplementedError

    @property
    def plan(self) -> dict[str, Any]:
        """The launch plan's manifest (buffers, views, kernels, host-facing names)."""
        return self._plan_json

    def read_buffer(self, name: str) -> np.ndarray:
        """A host copy of plan buffer or view `name` (for checks and debugging)."""
        return self._read(name)

    separate_buffers = False  # every buffer in an allocation of its own (no shared arena)

    def buffer_digests(self) -> dict[str, str]:
        """SHA-256 of plan buffers, in plan order; a kernel's scratch buffers (CUDA) are left
        out. Two backends running the same plan agree on every entry after a step. In the
        arena layout only the state region's buffers are digested: arena bytes are shared by
        buffers of disjoint lifetimes, so what a buffer holds after the step depends on the
        layout (the llvm twin and a CUDA artifact differ by the CUDA scratch). Programs with
        separate_buffers digest every buffer: what diagnoses a mismatch buffer by buffer."""
        offsets = self._plan_json["layout"]["offsets"]
        return {
            name: hashlib.sha256(np.ascontiguousarray(self._read(name)).tobytes()).hexdigest()
            for name in self._plan_json["buffers"]
            if not name.startswith("scratch:")
            and (self.separate_buffers or offsets[name][0] == "state")
        }

    # the state lives in the plan's buffers; reading it copies it out
    def _check_whole(self) -> None:
        """Refuse to read or advance a state a stopped step left partly updated."""
        if self._torn is not None:
            raise TornStateError(
                f"a training step (step {self.step_count}) stopped part way ({self._torn}): "
                "some of its kernels had updated the state, so it is no longer the state "
                "after any step. Load the last checkpoint (mexc.load) or set the state "
                "(Program.load_state_dict) to go on"
            )

    @property
    def state(self) -> dict[str, MX]:
        self._check_whole()
        if self._state_cache is None:
            out = {}
            for name, (m, e) in self._plan_json["state"].items():
                shape = self._exp_shapes[name]
                out[name] = MX.of(self._read(m), self._read(e).reshape(shape))
            self._state_cache = out
        return self._state_cache

    @state.setter
    def state(self, value: dict[str, MX]) -> None:
        self._exp_shapes = {name: tuple(v.e.shape) for name, v in value.items()}
        for name, (m, e) in self._plan_json["state"].items():
            self._write(m, np.ascontiguousarray(value[name].m, np.int8))
            self._write(e, np.asarray(value[name].e, np.int32).reshape(-1))
        self._state_cache = None
        self._torn = None  # every state buffer is written again

    def load_state_dict(self, sd: dict[str, np.ndarray]) -> None:
        """As Program's, also over a state a stopped step tore (it is written whole)."""
        torn, self._torn = self._torn, None
        try:
            super().load_state_dict(sd)
        except BaseException:
            self._torn = torn if self._torn is None else self._torn
            raise

    def _write_inputs(self, xs: np.ndarray, ys: np.ndarray) -> None:
        plan = self._plan_json
        rows = None if self.workers is None else self.workers.rows(self.eval_batch)
        xm, xe = plan["input"]
        # the host boundary (a data-parallel worker's exponent is the whole batch's: the
        # maximum is agreed); token ids have no exponent buffer
        m, e = self.boundary(xs, None if rows is None else rows.max_float)
        self._write(xm, m)
        if xe:
            self._write(xe, np.array([e], np.int32))
        self._write(plan["labels"], ys.astype(np.int32).reshape(-1))
        if plan["valid"]:  # the valid rows here, and in the whole batch (every row is valid)
            valid = (self.batch if rows is None else rows.total) * self.positions
            here = self.batch * self.positions
            self._write(plan["valid"], np.array([here, valid], np.int32))
        # the optimizer's per-step scalars as (num, shift) pairs: SGD (lr,), AdamW (lr_t,
        # eps_t, wd_t)
        scalars = self.optimizer.step_scalars(self.step_count)
        pairs = [v for f in scalars for v in (f.num, f.shift)]
        self._write(plan["lr"], np.array(pairs, np.int32))
        keys = stream_keys(self.options.seed, self.step_count, self._key_ids).astype(np.int64)
        if self.workers is not None and self.workers.rank:
            # the high half: this worker's first global element of each key's tensor (its
            # rows' PRNG indices, docs/numerics.md §16)
            keys |= (self.workers.rank * self._key_rows) << 32
        self._write(plan["keys"], keys)

    # ----------------------------------------------------------------------------- inference
    # A backend with a compiled inference plan (step_plan.build_inference_plan: the eval-mode
    # logits over the training plan's state buffers) returns its manifest from
    # `_inference_plan` and runs it with the `_infer_*` hooks; without one (None), predict and
    # evaluate run the reference's inference nodes on a copy of the state.

    def _inference_plan(self) -> dict[str, Any] | None:
        """The inference plan's manifest (built on first use), or None: the reference runs."""
        return None

    def _infer_write(self, name: str, values: np.ndarray) -> None:
        raise NotImplementedError

    def _infer_read(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def _infer_run(self) -> None:
        raise NotImplementedError

    def _infer_batch(self, xs: np.ndarray) -> MX | Acc:
        self._check_whole()
        plan = self._inference_plan()
        if plan is None:
            return super()._infer_batch(xs)
        xm, xe = plan["input"]
        m, e = self.boundary(xs)
        self._infer_write(xm, m)
        if xe:
            self._infer_write(xe, np.array([e], np.int32))
        self._infer_run()
        m, e = plan["logits"]
        whole = self.global_graph  # a data-parallel worker infers on whole batches
        shape = tuple(int(d) for d in whole.type_of(whole.output("logits")).shape)
        mant, exp = self._infer_read(m).reshape(shape), np.int64(self._infer_read(e)[0])
        if mant.dtype == np.int32:  # the product's accumulator (docs/numerics.md section 15)
            return Acc(mant.astype(np.int64), np.asarray(exp))
        return MX.of(mant, int(exp))

    def step(self, x: Any, y: Any) -> float:
        self._check_whole()
        xs = self._check_x(x, exact_batch=True)
        ys = self._check_y(y, self.batch)
        self._write_inputs(xs, ys)
        self._state_cache = None
        try:
            self._run()
        except BaseException as err:  # Ctrl-C too: the kernels that ran have written
            self._torn = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            raise
        self.step_count += 1
        rows = self._read(self._plan_json["loss_rows"])
        if self.workers is None:
            return ce_loss(rows, self.batch * self.positions)
        comm = self.workers.comm  # the whole batch's loss, on every worker
        return ce_loss(comm.all_gather(rows), self.eval_batch * self.positions)

    def _inference_source(self) -> Program:
        """The program an inference plan is built from: a data-parallel worker's step is
        split over the workers, its inference is the whole batch's (global_graph)."""
        if self.workers is None:
            return self
        return Program(self.global_graph, self.state, self.options, self.optimizer)
