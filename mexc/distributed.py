"""Data-parallel workers on torch.distributed (docs/distributed.md).

A worker is a process of an initialised torch.distributed process group (gloo on CPUs, NCCL on
GPUs; `torchrun`, `mexc train --nproc N` or `launch`). Its step holds batch / world rows
(`shard_rows`) and agrees with the others through `TorchCollectives`: exact integer sums and
maxima, so N workers compute the bits of one process training on the whole batch
(docs/numerics.md §16). A collective that does not complete within the group's timeout (a worker
crashed or hangs) raises DistributedError instead of waiting for ever.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np

from mexc.errors import DistributedError
from mexc.mx import Collectives, Rows

DEFAULT_TIMEOUT_S = 120.0  # a worker waits this long for the others at any collective


def _dist() -> Any:
    import torch.distributed as dist

    return dist


class TorchCollectives:
    """Collectives over torch.distributed's default group, on integer CPU tensors (gloo)."""

    def __init__(self) -> None:
        self.bytes_sent = 0  # payload bytes this worker contributed to collectives
        self.calls = 0  # collectives this worker took part in

    def _run(self, what: str, fn: Callable[[], Any]) -> Any:
        dist = _dist()
        self.calls += 1
        try:
            return fn()
        except (RuntimeError, ValueError) as err:  # gloo: timeouts, closed connections
            raise DistributedError(
                f"data-parallel worker {dist.get_rank()} of {dist.get_world_size()}: the "
                f"{what} across workers failed ({type(err).__name__}: {str(err).strip()[:300]}). "
                "Another worker stopped (crashed, was killed or hangs) or the workers run "
                "different programs; the step was not completed and this worker's state is "
                "that of the last completed step. Find the failing worker's error, fix it, and "
                "restart every worker from the last checkpoint."
            ) from None

    def _reduce(self, a: np.ndarray, op: Any, what: str, dtype: type) -> np.ndarray:
        import torch

        dist = _dist()
        arr: np.ndarray = np.array(a, dtype, order="C")  # a copy, of any rank (0 included)
        t = torch.from_numpy(arr.reshape(-1))
        self.bytes_sent += arr.nbytes
        self._run(what, lambda: dist.all_reduce(t, op=op))
        return t.numpy().reshape(arr.shape).astype(np.int64)

    def all_sum(self, a: np.ndarray) -> np.ndarray:
        """Sent as int32: every sum a step takes over the batch is an int32 accumulator whose
        whole-batch value the caps of docs/numerics.md §6 bound (half the bytes of int64). In
        the overflow-debug mode (docs/numerics.md §14) as int64, so that the check after the
        sum sees a total the caps failed to bound instead of its wrapped value (every worker
        must run in the same mode)."""
        from mexc.numerics import overflow_debug_on

        wide = np.int64 if overflow_debug_on() else np.int32
        return self._reduce(a, _dist().ReduceOp.SUM, "sum", wide)

    def all_max(self, a: np.ndarray) -> np.ndarray:
        return self._reduce(a, _dist().ReduceOp.MAX, "maximum", np.int64)

    def reduce_in_place(self, buf: Any, kind: str, stream: int | None = None) -> None:
        """Replace int32 buffer `buf` by its element-wise maximum ("all_max") or sum
        ("all_sum") over the workers, in place and without a copy: `buf` is any DLPack array,
        a numpy buffer of the llvm step or a CuPy device buffer of the CUDA step (NCCL on the
        device, or the group's CPU backend through its own staging). `stream`: the CUDA
        stream (a raw pointer) the buffer's kernels run on; the reduction is ordered after
        them and the stream's later work after it, without a host synchronisation. The sum
        wraps as int32 (the caps bound it; the overflow-debug mode's wide sum is all_sum's)."""
        import torch

        dist = _dist()
        op = dist.ReduceOp.MAX if kind == "all_max" else dist.ReduceOp.SUM
        what = "maximum" if kind == "all_max" else "sum"
        if stream is None:
            t = torch.from_dlpack(buf).reshape(-1)
            self.bytes_sent += t.numel() * t.element_size()
            self._run(what, lambda: dist.all_reduce(t, op=op))
            return
        # on the buffer's stream: torch's NCCL work waits for it and it waits for the work
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            t = torch.from_dlpack(buf).reshape(-1)
            self.bytes_sent += t.numel() * t.element_size()
            self._run(what, lambda: dist.all_reduce(t, op=op))

    def all_gather(self, a: np.ndarray) -> np.ndarray:
        """Every worker's `a` (the same shape on each) concatenated along axis 0, in rank
        order."""
        import torch

        dist = _dist()
        arr = np.array(a, np.int32, order="C", ndmin=1)  # probabilities and labels
        t = torch.from_numpy(arr)
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        self.bytes_sent += arr.nbytes
        self._run("gather", lambda: dist.all_gather(parts, t))
        return np.concatenate([p.numpy() for p in parts], axis=0).astype(np.int64)


@dataclass(frozen=True)
class Workers:
    """This process's place among the data-parallel workers."""

    rank: int
    world: int
    comm: Collectives

    def rows(self, batch: int) -> Rows:
        """This worker's rows of a global batch of `batch` rows."""
        count = batch // self.world
        return Rows(start=self.rank * count, count=count, total=batch, comm=self.comm)


def current_workers() -> Workers:
    """The workers of the initialised default process group; a clear error without one."""
    dist = _dist()
    if not (dist.is_available() and dist.is_initialized()):
        raise DistributedError(
            "data_parallel=True needs an initialised torch.distributed process group: start "
            "the workers with `torchrun --nproc-per-node N your_script.py` (whose script calls "
            "torch.distributed.init_process_group('gloo')), with `mexc train --nproc N`, or "
            "with mexc.distributed.launch"
        )
    return Workers(dist.get_rank(), dist.get_world_size(), TorchCollectives())


def _digest(text: str) -> int:
    """31 bits of text's SHA-256 (all_gather carries int32)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") >> 1


def agree_on_program(workers: Workers, prog: Any) -> None:
    """Check that every worker compiled the same program (model, batch and options: the seed
    and the target named included; the targets compute the same bits, but a reference worker
    beside an llvm one aborted gloo at the first step) and starts from the same state (its
    checksum and step: torch seeded otherwise, or another checkpoint, gives other initial
    weights, and the workers would train apart without a word)."""
    from mexc.printer import print_graph

    o = prog.options
    options = (o.bits, o.seed, o.rounding, o.per_group_velocity, o.channel_exponents, o.target)
    program = f"{print_graph(prog.graph)}\n{options!r}"
    start = f"{prog.state_checksum()} {prog.step_count}"
    mine = np.asarray([_digest(program), _digest(start)], np.int64)
    every = workers.comm.all_gather(mine).reshape(-1, 2)
    for column, what in (
        (
            0,
            "compiled different programs (worker(s) {ranks} differ from worker 0): every worker "
            "must compile the same model with the same options (seed included) and the same "
            "global example batch",
        ),
        (
            1,
            "start from different states (worker(s) {ranks} differ from worker 0: another "
            "initial model, torch seeded otherwise before it was built, or another checkpoint): "
            "seed torch alike on every worker before building the model, or load one checkpoint",
        ),
    ):
        ranks = [i for i, d in enumerate(every[:, column].tolist()) if d != int(every[0, column])]
        if ranks:
            raise DistributedError(f"the data-parallel workers {what.format(ranks=ranks)}")


def split_accuracy(prog: Any, x: np.ndarray, y: np.ndarray, workers: Workers) -> float:
    """prog.evaluate(x, y), its inference batches shared among the workers (batch c on worker
    c mod world): every batch is the one a single process evaluates, so the correct count, added
    over the workers, is the single-process count. Every worker must call it."""
    size = prog.eval_batch
    starts = range(workers.rank * size, len(y), workers.world * size)
    correct = 0
    for start in starts:
        ids = prog.predict(x[start : start + size])
        correct += int(np.count_nonzero(ids == np.asarray(y[start : start + size])))
    total = int(workers.comm.all_sum(np.asarray([correct], np.int64))[0])
    return total / np.size(y) if len(y) else 0.0  # (a label per position: over positions)


def shard_rows(x: Any, rank: int, world: int) -> Any:
    """Rows rank * B / world .. (rank + 1) * B / world - 1 of a global batch of B rows: what
    worker `rank` passes to Program.step."""
    n = len(x)
    if n % world:
        raise DistributedError(f"a batch of {n} rows does not split into {world} equal shares")
    share = n // world
    return x[rank * share : (rank + 1) * share]


def init_from_env(backend: str | None = None, timeout_s: float | None = None) -> Workers:
    """Join the process group described by torchrun's environment (MASTER_ADDR, MASTER_PORT,
    RANK, LOCAL_RANK, WORLD_SIZE), with a timeout on every collective (MEXC_DIST_TIMEOUT
    seconds, or DEFAULT_TIMEOUT_S), unless the group is initialised already. The default
    backend is gloo, and on a machine with CUDA "cpu:gloo,cuda:nccl" with this worker on GPU
    LOCAL_RANK: host arrays travel by gloo, the CUDA step's device buffers by NCCL."""
    import torch

    dist = _dist()
    if not dist.is_initialized():
        if backend is None:
            backend = "gloo"
            if torch.cuda.is_available():
                backend = "cpu:gloo,cuda:nccl"
                local = int(os.environ.get("LOCAL_RANK", "0"))
                torch.cuda.set_device(local % torch.cuda.device_count())
        seconds = timeout_s or float(os.environ.get("MEXC_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
        dist.init_process_group(backend, timeout=timedelta(seconds=seconds))
        # the group this joined is destroyed while the interpreter is still whole: a gloo
        # worker exiting without it can abort in finalization ("terminate called without an
        # active exception", SIGABRT: pytorch/pytorch#190489)
        atexit.register(_destroy_group)
        global _joined
        _joined = True
    return current_workers()


_joined = False  # init_from_env started the process group of this process


def _destroy_group() -> None:
    dist = _dist()
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_worker(code: int) -> None:
    """End a worker whose process group init_from_env started: flush the output, destroy the
    group and leave with `code` without the interpreter's finalization. Destroying the group
    at exit was not enough: gloo's threads still aborted the process in C++ static destruction
    now and then (SIGABRT after the worker had written its results, twice in CI runs), which
    made a finished worker look crashed. Does nothing in a process that did not join that way."""
    if not _joined:
        return
    import sys

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more to write
            stream.flush()
    _destroy_group()
    os._exit(code)


def free_port() -> int:
    """A TCP port on localhost nobody listens on now (for MASTER_PORT)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    cmd: list[str],
    nproc: int,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
    grace_s: float = 30.0,
) -> list[int]:
    """Run `cmd` as `nproc` workers on localhost, as torchrun would (MASTER_ADDR, MASTER_PORT,
    RANK, LOCAL_RANK, WORLD_SIZE, and MEXC_DIST_TIMEOUT for init_from_env: `timeout_s`, else
    the environment's, else the default), and wait for all. When one fails, the others get
    `grace_s` to fail on their own (their next collective reports the lost worker), then are
    terminated: a crash never leaves the launch hanging. An interrupt or SIGTERM of the
    launcher stops the workers too (they would train on, writing checkpoints). Returns the
    exit codes in rank order."""
    import signal
    import subprocess
    import time

    base = dict(os.environ if env is None else env)
    if timeout_s is None:
        timeout_s = float(base.get("MEXC_DIST_TIMEOUT") or DEFAULT_TIMEOUT_S)
    base |= {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(nproc),
        "MEXC_DIST_TIMEOUT": str(timeout_s),
    }
    procs: list[subprocess.Popen[bytes]] = []

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous: Any = signal.signal(signal.SIGTERM, stop)
        installed = True
    except ValueError:  # not the main thread: only an interrupt of this call stops them
        installed = False
    try:
        for r in range(nproc):
            procs.append(subprocess.Popen(cmd, env=base | {"RANK": str(r), "LOCAL_RANK": str(r)}))
        failed_at: float | None = None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                return [int(c) for c in codes if c is not None]
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.05)
    finally:
        if installed:  # None: a handler not set from Python, the default here
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        for p in procs:  # stopped by an interrupt (or an error here): the workers end with it
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
