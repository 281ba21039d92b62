"""Train a compiled Program on a dataset: epochs, progress, evaluation, checkpoints, results.

```python
prog = mexc.compile(model, (torch.zeros(128, 1, 28, 28),), optimizer=...)
trainer = Trainer(prog, train, test, seed=0, epochs=5, checkpoint="runs/a", checkpoint_every=100)
history = trainer.fit()                      # one dict per epoch
trainer = Trainer.resume("runs/a", train, test)   # continues bit-exactly where the checkpoint is
```

Data order: epoch `e` visits `mexc.data.batches(len(train), batch, seed, e)` (the incomplete last
batch is dropped), so the order depends only on the seed and the epoch. A checkpoint holds the
program (`DIR/last.mexc`, `Program.save`) and the trainer's position and history
(`DIR/trainer.json`); both are written atomically (temp file + `os.replace`), the program first.
`trainer.json` records the program's step and state checksum, so a pair torn by a crash between the
two writes is detected on resume. Resuming after k steps gives the same state checksum as an
uninterrupted run.

History record (one per epoch): `epoch`, `step` (global steps done), `train_loss` (mean of the
epoch's step losses), `test_accuracy`, `seconds` (training time of the epoch, evaluation
excluded), `images_per_s` (samples per second, of any data: the key keeps its first name),
`step_losses`.

results.json (`build_results`, format "mexc-results-1"):
  format, date (UTC ISO 8601), command (argv list), machine {platform, python, processor,
  cpu_count, cpus_usable},
  config {model, dataset, bits, rounding, per_group_velocity, target, seed, batch, epochs,
    steps_per_epoch, train_size, test_size, optimizer, lr, momentum (SGD) or betas and eps (AdamW,
    Adam), weight_decay, schedule, resumed_from, trainable (the spec, or "all"), frozen_params},
  integer {accuracy, final_loss, steps, seconds, images_per_s, checksum, history[...]},
  fp32 (same keys but checksum, or null without --compare-fp32),
  gap_points (100 * (fp32 accuracy - integer accuracy), or null),
  memory {backend, allocated_host_bytes, allocated_device_bytes, allocated_bytes (what the
    backend allocated for the training step), allocated_eval_bytes (what the compiled
    evaluation plan allocated of its own), planned_persistent_bytes, planned_saved_activation_bytes,
    planned_arena_bytes (plan-memory over the IR values), params, saved_activation_elements,
    formula_int_bytes, formula_fp32_bytes, formula_ratio (the paper's formula), fp32_measured
    ({persistent_bytes, step_peak_bytes, peak_bytes} of one PyTorch FP32 step, or null without
    --compare-fp32), measured_ratio (allocated_bytes / fp32 peak_bytes, or null)}.
"""

from __future__ import annotations

import copy
import datetime as _dt
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np

from mexc.data import Arrays, batches
from mexc.distributed import shard_rows, split_accuracy
from mexc.errors import CheckpointError, InputError
from mexc.program import Program
from mexc.targets import load as load_program

TRAINER_FORMAT = "mexc-trainer-1"
RESULTS_FORMAT = "mexc-results-1"
PROGRAM_FILE = "last.mexc"
STATE_FILE = "trainer.json"


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> None:
    """Write JSON to `path` atomically (_write_atomic)."""

    def write(fh: IO[bytes]) -> None:
        fh.write((json.dumps(obj, indent=1) + "\n").encode())

    _write_atomic(path, write)


def _write_atomic(path: str | os.PathLike[str], write: Callable[[IO[bytes]], None]) -> None:
    """`write` fills a temp file in `path`'s folder, which os.replace then moves to `path`:
    a reader sees the old file or the whole new one."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _check_resumed(prog: Program, model: Any) -> None:
    """Before a resumed run trains: refuse a model other than the checkpoint's (its parameters'
    names and shapes, Program.check_module)."""
    try:
        prog.check_module(model)
    except InputError as err:
        raise InputError(
            f"the checkpoint resumed holds another model's state ({err}); resume with the "
            "model it was trained from"
        ) from None


class Trainer:
    """Runs epochs of `program.step` over `train_data`, evaluating on `test_data` after each."""

    def __init__(
        self,
        program: Program,
        train_data: Arrays,
        test_data: Arrays,
        batch: int | None = None,
        seed: int = 0,
        epochs: int = 1,
        progress: bool = True,
        checkpoint: str | os.PathLike[str] | None = None,
        checkpoint_every: int = 0,
    ) -> None:
        # a data-parallel worker's program steps on its rows of the global batch (eval_batch)
        batch = program.eval_batch if batch is None else batch
        if batch != program.eval_batch:
            raise ValueError(
                f"batch {batch} differs from the program's compiled batch {program.eval_batch}"
            )
        if epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}")
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
        for split, (xs, ys) in (("training", train_data), ("test", test_data)):
            try:  # before any step: not after an epoch, at the first evaluation
                program.check_labels(ys)
                if len(xs) != len(ys):
                    raise InputError(f"{len(xs)} samples but {len(ys)} labels")
                if not len(ys):
                    raise InputError("it is empty; give it at least one sample")
            except InputError as err:
                raise InputError(f"the {split} set: {err}") from None
        self.program = program
        self.workers = program.workers
        # one worker writes checkpoints and shows progress (every worker holds the same state)
        self.leader = self.workers is None or self.workers.rank == 0
        progress = progress and self.leader
        self.train_data = train_data
        self.test_data = test_data
        self.batch = batch
        self.seed = seed
        self.epochs = epochs
        self.progress = progress
        self.checkpoint = Path(checkpoint) if checkpoint is not None else None
        self.checkpoint_every = checkpoint_every
        self.steps_per_epoch = len(train_data[1]) // batch
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"the training set has {len(train_data[1])} samples, fewer than one batch of "
                f"{batch}; use a smaller --batch or more data"
            )
        self.step = 0  # steps this trainer has run (global position in the data order)
        self.history: list[dict[str, Any]] = []
        self.train_seconds = 0.0
        self._epoch_losses: list[float] = []  # losses of the current, unfinished epoch
        self._epoch_seconds = 0.0
        self._program_step0 = program.step_count

    # ----------------------------------------------------------------------------- training

    @property
    def total_steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    @property
    def done(self) -> bool:
        return len(self.history) >= self.epochs

    def fit(self, max_steps: int | None = None) -> list[dict[str, Any]]:
        """Train until all epochs are done (or `max_steps` more steps ran); returns the history."""
        from tqdm import tqdm

        x, y = self.train_data
        budget = math.inf if max_steps is None else max_steps
        while not self.done and budget > 0:
            epoch = len(self.history)
            pos = self.step - epoch * self.steps_per_epoch
            order = batches(len(y), self.batch, self.seed, epoch)
            bar = tqdm(
                total=self.steps_per_epoch,
                initial=pos,
                desc=f"epoch {epoch + 1}/{self.epochs}",
                unit="step",
                disable=not self.progress,
                file=sys.stderr,
                dynamic_ncols=True,
            )
            with bar:
                while pos < self.steps_per_epoch and budget > 0:
                    idx = order[pos]
                    if self.workers is not None:  # this worker's rows of the batch
                        idx = shard_rows(idx, self.workers.rank, self.workers.world)
                    start = time.perf_counter()
                    loss = self.program.step(x[idx], y[idx])
                    elapsed = time.perf_counter() - start
                    self._epoch_seconds += elapsed
                    self.train_seconds += elapsed
                    self._epoch_losses.append(loss)
                    self.step += 1
                    pos += 1
                    budget -= 1
                    bar.update(1)
                    if self.progress:
                        ips = len(self._epoch_losses) * self.batch / max(self._epoch_seconds, 1e-9)
                        bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{ips:.0f}", refresh=False)
                    if (
                        self.checkpoint_every
                        and self.step % self.checkpoint_every == 0
                        and pos < self.steps_per_epoch
                    ):
                        self._save()
            if pos == self.steps_per_epoch:
                self._finish_epoch(epoch)
        return self.history

    def _finish_epoch(self, epoch: int) -> None:
        if self.workers is not None:  # the test batches shared among the workers
            acc = split_accuracy(self.program, *self.test_data, self.workers)
        else:
            acc = self.program.evaluate(*self.test_data)
        losses = self._epoch_losses
        record = {
            "epoch": epoch + 1,
            "step": self.step,
            "train_loss": float(np.mean(losses)) if losses else float("nan"),
            "test_accuracy": acc,
            "seconds": self._epoch_seconds,
            "images_per_s": len(losses) * self.batch / self._epoch_seconds
            if self._epoch_seconds > 0
            else 0.0,
            "step_losses": list(losses),
        }
        self.history.append(record)
        self._epoch_losses = []
        self._epoch_seconds = 0.0
        if self.progress:
            print(
                f"epoch {epoch + 1}/{self.epochs}: loss {record['train_loss']:.4f}  "
                f"test accuracy {100 * acc:.2f} %  {record['images_per_s']:.0f} samples/s",
                file=sys.stderr,
            )
        self._save()

    # ----------------------------------------------------------------------------- checkpoints

    def _save(self) -> None:
        if self.checkpoint is not None and self.leader:
            self.save_checkpoint(self.checkpoint)

    def state(self) -> dict[str, Any]:
        """The trainer's position and history (what trainer.json holds)."""
        return {
            "format": TRAINER_FORMAT,
            "step": self.step,
            "epoch": len(self.history),
            "epochs": self.epochs,
            "batch": self.batch,
            "seed": self.seed,
            "steps_per_epoch": self.steps_per_epoch,
            "train_size": len(self.train_data[1]),
            "test_size": len(self.test_data[1]),
            "program_step": self.program.step_count,
            "program_step0": self._program_step0,
            "program_checksum": self.program.state_checksum(),
            "train_seconds": self.train_seconds,
            "history": self.history,
            "epoch_losses": self._epoch_losses,
            "epoch_seconds": self._epoch_seconds,
            "checkpoint_every": self.checkpoint_every,
        }

    def save_checkpoint(self, directory: str | os.PathLike[str]) -> None:
        """DIR/last.mexc (the program) then DIR/trainer.json, each written atomically."""
        d = Path(directory)
        self.program.save(d / PROGRAM_FILE)
        write_json_atomic(d / STATE_FILE, self.state())

    @classmethod
    def resume(
        cls,
        directory: str | os.PathLike[str],
        train_data: Arrays,
        test_data: Arrays,
        progress: bool = True,
        checkpoint: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None,
        target: str | None = None,
        data_parallel: bool = False,
    ) -> Trainer:
        """A Trainer continuing the run checkpointed in `directory` (the same data is required).
        Checkpoints keep going to `directory` unless `checkpoint` names another folder. The
        program resumes on the target it was saved from, or on `target` (mexc.load);
        `data_parallel`: as this process's worker of the torch.distributed group, at any
        number of workers."""
        d = Path(directory)
        state_path = d / STATE_FILE
        if not state_path.is_file() or not (d / PROGRAM_FILE).is_file():
            raise CheckpointError(
                f"{d} holds no mexc training checkpoint (expected {PROGRAM_FILE} and "
                f"{STATE_FILE}, written by `mexc train --checkpoint {d}`)"
            )
        try:
            st = json.loads(state_path.read_text())
            if not isinstance(st, dict) or st.get("format") != TRAINER_FORMAT:
                raise CheckpointError(f"{state_path} is not a mexc trainer state")
            prog = load_program(d / PROGRAM_FILE, target, data_parallel)
            trainer = cls(
                prog,
                train_data,
                test_data,
                batch=int(st["batch"]),
                seed=int(st["seed"]),
                epochs=int(st["epochs"]),
                progress=progress,
                checkpoint=d if checkpoint is None else checkpoint,
                checkpoint_every=int(
                    st["checkpoint_every"] if checkpoint_every is None else checkpoint_every
                ),
            )
            sizes = (len(train_data[1]), len(test_data[1]))
            if sizes != (st["train_size"], st["test_size"]):
                raise CheckpointError(
                    f"checkpoint {d} was made with {st['train_size']} training / "
                    f"{st['test_size']} test samples, this run has {sizes[0]} / {sizes[1]}; "
                    "resume with the same dataset and limits"
                )
            if prog.step_count != st["program_step"] or (
                prog.state_checksum() != st["program_checksum"]
            ):
                raise CheckpointError(
                    f"checkpoint {d} is inconsistent: {PROGRAM_FILE} is at step "
                    f"{prog.step_count} (checksum {prog.state_checksum()}) but {STATE_FILE} "
                    f"records step {st['program_step']} (checksum {st['program_checksum']}); "
                    "the run was probably interrupted while checkpointing"
                )
            trainer.step = int(st["step"])
            trainer.history = list(st["history"])
            trainer.train_seconds = float(st["train_seconds"])
            trainer._epoch_losses = [float(v) for v in st["epoch_losses"]]
            trainer._epoch_seconds = float(st["epoch_seconds"])
            trainer._program_step0 = int(st["program_step0"])
            pos = trainer.step - len(trainer.history) * trainer.steps_per_epoch
            if not 0 <= pos < trainer.steps_per_epoch and not trainer.done:
                raise CheckpointError(
                    f"{state_path}: step {trainer.step} does not fit epoch "
                    f"{len(trainer.history)} of {trainer.steps_per_epoch} steps"
                )
        except CheckpointError:
            raise
        except (OSError, KeyError, TypeError, ValueError) as err:
            raise CheckpointError(
                f"cannot resume from {d}: {state_path} is unreadable or incomplete "
                f"({type(err).__name__}: {err})"
            ) from None
        return trainer


# --- results, table, plot -----------------------------------------------------------------------


def machine() -> dict[str, Any]:
    from mexc.fp32 import cpu_threads

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": cpu_threads(),
    }


def provenance(fmt: str, command: list[str] | None = None) -> dict[str, Any]:
    """The header of every results document: format, UTC date, command line, machine."""
    return {
        "format": fmt,
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": list(sys.argv if command is None else command),
        "machine": machine(),
    }


def memory_summary(program: Program, fp32: dict[str, int] | None = None) -> dict[str, Any]:
    """program.memory_report() (allocated, planned and formula bytes), the formula's int/FP32
    ratio, and where PyTorch FP32 was measured (`fp32`: fp32.step_memory) its bytes and the
    measured ratio allocated / FP32 peak."""
    mem: dict[str, Any] = dict(program.memory_report())
    fp = mem["formula_fp32_bytes"]
    mem["formula_ratio"] = mem["formula_int_bytes"] / fp if fp else float("nan")
    mem["fp32_measured"] = fp32
    if fp32 and fp32["peak_bytes"] and mem["allocated_bytes"]:
        mem["measured_ratio"] = mem["allocated_bytes"] / fp32["peak_bytes"]
    else:
        mem["measured_ratio"] = None
    return mem


def _run_summary(history: list[dict[str, Any]], batch: int) -> dict[str, Any]:
    steps = history[-1]["step"] if history else 0
    seconds = float(sum(r["seconds"] for r in history))
    return {
        "accuracy": history[-1]["test_accuracy"] if history else None,
        "final_loss": history[-1]["train_loss"] if history else None,
        "steps": steps,
        "seconds": seconds,
        "images_per_s": steps * batch / seconds if seconds > 0 else 0.0,
        "history": history,
    }


def build_results(
    trainer: Trainer,
    fp32_history: list[dict[str, Any]] | None = None,
    config: dict[str, Any] | None = None,
    command: list[str] | None = None,
    fp32_memory: dict[str, int] | None = None,
) -> dict[str, Any]:
    """The results.json document (keys: see the module docstring)."""
    prog = trainer.program
    integer = _run_summary(trainer.history, trainer.batch)
    integer["checksum"] = prog.state_checksum()
    integer["seconds"] = trainer.train_seconds
    if trainer.train_seconds > 0:
        integer["images_per_s"] = integer["steps"] * trainer.batch / trainer.train_seconds
    fp32 = _run_summary(fp32_history, trainer.batch) if fp32_history is not None else None
    gap = None
    if fp32 is not None and integer["accuracy"] is not None and fp32["accuracy"] is not None:
        gap = 100.0 * (fp32["accuracy"] - integer["accuracy"])
    opt = prog.optimizer
    cfg = {
        "bits": prog.options.bits,
        "rounding": prog.options.rounding,
        "per_group_velocity": prog.options.per_group_velocity,
        "channel_exponents": prog.options.channel_exponents,
        "target": prog.options.target,
        "seed": trainer.seed,
        "batch": trainer.batch,
        "epochs": trainer.epochs,
        "steps_per_epoch": trainer.steps_per_epoch,
        "train_size": len(trainer.train_data[1]),
        "test_size": len(trainer.test_data[1]),
        **optimizer_config(opt),
        **(config or {}),
    }
    return {
        **provenance(RESULTS_FORMAT, command),
        "config": cfg,
        "integer": integer,
        "fp32": fp32,
        "gap_points": gap,
        "memory": memory_summary(prog, fp32_memory),
    }


def _kib(n: float) -> str:
    return f"{n / 1024:.1f} KiB"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f} %"


def format_table(results: dict[str, Any]) -> str:
    """The final table as aligned plain text."""
    i, f, m = results["integer"], results["fp32"], results["memory"]
    rows: list[tuple[str, str, str]] = [("", "integer (mexc)", "FP32 (PyTorch)" if f else "")]
    rows.append(("test accuracy", _pct(i["accuracy"]), _pct(f["accuracy"]) if f else ""))
    if results["gap_points"] is not None:
        rows.append(("gap (FP32 - integer)", f"{results['gap_points']:+.2f} points", ""))
    rows.append(
        (
            "final train loss",
            f"{i['final_loss']:.4f}" if i["final_loss"] is not None else "-",
            f"{f['final_loss']:.4f}" if f and f["final_loss"] is not None else "",
        )
    )
    fm = m.get("fp32_measured")
    where = "device" if m["allocated_device_bytes"] else "host"
    rows.append(
        (
            f"training memory (allocated, {where})",
            _kib(m["allocated_bytes"]),
            f"{_kib(fm['peak_bytes'])} (measured)" if fm else "",
        )
    )
    if m.get("allocated_eval_bytes"):
        rows.append(("evaluation plan (allocated)", _kib(m["allocated_eval_bytes"]), ""))
    if m.get("measured_ratio") is not None:
        rows.append(("memory ratio int/FP32 (measured)", f"{m['measured_ratio']:.3f}", ""))
    rows.append(
        ("training memory (formula)", _kib(m["formula_int_bytes"]), _kib(m["formula_fp32_bytes"]))
    )
    rows.append(("memory ratio int/FP32 (formula)", f"{m['formula_ratio']:.3f}", ""))
    rows.append(("planner: persistent", _kib(m["planned_persistent_bytes"]), ""))
    rows.append(("planner: saved activations", _kib(m["planned_saved_activation_bytes"]), ""))
    rows.append(("planner: arena peak", _kib(m["planned_arena_bytes"]), ""))
    rows.append(("steps", str(i["steps"]), str(f["steps"]) if f else ""))
    rows.append(("time (training)", f"{i['seconds']:.1f} s", f"{f['seconds']:.1f} s" if f else ""))
    rows.append(("samples/s", f"{i['images_per_s']:.0f}", f"{f['images_per_s']:.0f}" if f else ""))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    w2 = max(len(r[2]) for r in rows)
    lines = []
    for k, (a, b, c) in enumerate(rows):
        lines.append(f"{a:<{w0}}  {b:>{w1}}  {c:>{w2}}".rstrip())
        if k == 0:
            lines.append("-" * (w0 + w1 + w2 + 4))
    c = results["config"]
    head = (
        f"{c.get('model', 'model')} on {c.get('dataset', 'data')}: {c['epochs']} epoch(s), "
        f"batch {c['batch']}, bits {c['bits']}, rounding {c['rounding']}, per-group velocity "
        f"{'on' if c['per_group_velocity'] else 'off'}, {c['schedule']}"
    )
    return head + "\n" + "\n".join(lines) + "\n"


def plot_curves(results: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """PNG of per-step training loss and per-epoch test accuracy, integer vs FP32."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    runs = [("integer (mexc)", results["integer"])]
    if results["fp32"] is not None:
        runs.append(("FP32 (PyTorch)", results["fp32"]))
    for label, run in runs:
        losses = [v for r in run["history"] for v in r["step_losses"]]
        ax_loss.plot(np.arange(1, len(losses) + 1), losses, label=label, linewidth=0.8)
        ep = [r["epoch"] for r in run["history"]]
        ax_acc.plot(ep, [100 * r["test_accuracy"] for r in run["history"]], "o-", label=label)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss")
    ax_loss.set_title("loss")
    ax_acc.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_acc.set_xlabel("epoch")
    ax_acc.set_ylabel("test accuracy (%)")
    ax_acc.set_title("accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    c = results["config"]
    fig.suptitle(f"{c.get('model', '')} {c.get('dataset', '')}".strip())
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def trained_params(prog: Program) -> frozenset[str]:
    """The parameters `prog` updates (all of them unless compiled with `trainable`)."""
    from mexc.ir import Op

    updates = prog.graph.nodes_of(Op.SGD_UPDATE, Op.ADAMW_UPDATE)
    return frozenset(str(n.attrs.param) for n in updates)


def optimizer_config(opt: Any) -> dict[str, Any]:
    """The results document's optimizer keys: its kind and hyperparameters."""
    from mexc.optim import AdamW

    out: dict[str, Any] = {"optimizer": type(opt).__name__, "lr": opt.lr}
    if isinstance(opt, AdamW):
        out |= {"betas": list(opt.betas), "eps": opt.eps}
    else:
        out["momentum"] = opt.momentum
    return out | {"weight_decay": opt.weight_decay, "schedule": opt.schedule.describe()}


# --- one complete run (used by `mexc train` and bench/accuracy.py) ------------------------------


def make_optimizer(
    lr: float,
    momentum: float,
    weight_decay: float,
    schedule: str,
    steps_per_epoch: int,
    epochs: int,
    warmup_epochs: float | None = None,
    kind: str = "sgd",
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> Any:
    """mexc.SGD (`kind` "sgd", with `momentum`), mexc.AdamW ("adamw", with `betas`, `eps`) or
    mexc.Adam ("adam": the decay as torch's L2 term), with a schedule in steps. cosine: linear
    warmup over `warmup_epochs` (default min(1, epochs / 5) epochs), then cosine decay that
    reaches 0 at step `total` (one past the last step taken, as torch's CosineAnnealingLR
    with T_max = total); step: x0.1 at 50 % and 75 % of the steps (no warmup); constant: no
    change."""
    from mexc.optim import SGD, Adam, AdamW, Constant, Cosine, Schedule, Step

    total = steps_per_epoch * epochs
    sched: Schedule
    if schedule == "cosine":
        w = min(1.0, epochs / 5) if warmup_epochs is None else warmup_epochs
        if w < 0:
            raise ValueError(f"warmup must be >= 0 epochs, got {w}")
        warm = min(int(round(w * steps_per_epoch)), total)
        sched = Cosine(total_steps=total, warmup_steps=warm)
    elif schedule == "step":
        sched = Step(milestones=(total // 2, (3 * total) // 4))
    elif schedule == "constant":
        sched = Constant()
    else:
        raise ValueError(f"schedule must be cosine, step or constant, got {schedule!r}")
    if kind == "sgd":
        return SGD(lr, momentum, weight_decay, sched)
    if kind == "adamw":
        return AdamW(lr, betas, eps, weight_decay, sched)
    if kind == "adam":
        return Adam(lr, betas, eps, weight_decay, sched)
    raise ValueError(f"optimizer must be sgd, adamw or adam, got {kind!r}")


def export_state_dict(prog: Any, model: Any, path: str | os.PathLike[str]) -> None:
    """`prog`'s trained weights (Program.to_module: float32, the model's names and layouts)
    written as `model`'s PyTorch state dict to `path`, atomically (a temporary file in its
    folder, then a rename); torch.load(path, weights_only=True) reads it."""
    import torch

    state = prog.to_module(model).state_dict()
    _write_atomic(path, lambda fh: torch.save(state, fh))


def _batch_of(x: np.ndarray, rows: int) -> np.ndarray:
    """x's first `rows` rows as a model reads them: float32, or token ids as int64."""
    if np.issubdtype(x.dtype, np.integer):
        return np.ascontiguousarray(x[:rows], np.int64)
    return np.ascontiguousarray(x[:rows], np.float32)


def run_training(
    model: Any,
    train: Arrays,
    test: Arrays,
    *,
    model_name: str = "model",
    dataset: str = "data",
    epochs: int = 1,
    batch: int = 128,
    lr: float = 0.05,
    momentum: float = 0.9,
    weight_decay: float = 5e-4,
    schedule: str = "cosine",
    warmup: float | None = None,
    optimizer: str = "sgd",
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    trainable: str | None = None,
    bits: int = 8,
    rounding: str = "auto",
    per_group_velocity: bool = True,
    channel_exponents: bool | None = None,
    seed: int = 0,
    target: str = "auto",
    compare_fp32: bool = False,
    progress: bool = True,
    checkpoint: str | os.PathLike[str] | None = None,
    checkpoint_every: int = 0,
    resume: str | os.PathLike[str] | None = None,
    resume_target: str | None = None,
    command: list[str] | None = None,
    data_parallel: bool = False,
    export_torch: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Compile `model` (its current weights are the initial weights), train it integer-only,
    optionally train a deepcopy in FP32 the same way, and return the results document. With
    `resume`, the program, position and options come from that checkpoint instead, on the
    target it was saved from or on `resume_target` (same bits on every target).
    `data_parallel`: this process is one worker of an initialised torch.distributed group;
    `batch` is the global batch, and every worker trains on its rows of it (the FP32 baseline
    runs on worker 0 only). `export_torch`: write the trained weights as the model's PyTorch
    state dict there (export_state_dict)."""
    import torch

    from mexc.compiler import compile as compile_model
    from mexc.fp32 import train_fp32

    fp32_model = copy.deepcopy(model) if compare_fp32 else None
    architecture = copy.deepcopy(model) if export_torch is not None else None
    if resume is not None:
        trainer = Trainer.resume(
            resume,
            train,
            test,
            progress=progress,
            checkpoint=checkpoint,
            checkpoint_every=checkpoint_every or None,
            target=resume_target,
            data_parallel=data_parallel,
        )
        _check_resumed(trainer.program, model)
    else:
        spe = len(train[1]) // batch
        if spe == 0:
            raise ValueError(
                f"the training set has {len(train[1])} samples, fewer than one batch of {batch}"
            )
        opt = make_optimizer(
            lr, momentum, weight_decay, schedule, spe, epochs, warmup, optimizer, betas, eps
        )
        example = torch.from_numpy(np.zeros_like(_batch_of(train[0], batch)))  # the data's kind
        prog = compile_model(
            model,
            (example,),
            optimizer=opt,
            bits=bits,
            seed=seed,
            target=target,
            per_group_velocity=per_group_velocity,
            rounding=rounding,
            trainable=trainable,
            data_parallel=data_parallel,
            channel_exponents=channel_exponents,
        )
        trainer = Trainer(
            prog,
            train,
            test,
            batch=batch,
            seed=seed,
            epochs=epochs,
            progress=progress,
            checkpoint=checkpoint,
            checkpoint_every=checkpoint_every,
        )
    if not trainer.leader:
        fp32_model = None  # the baseline is worker 0's
    fp32_memory = None
    if fp32_model is not None:  # one measured step of a copy, before either run trains
        from mexc.fp32 import step_memory

        p, b = trainer.program.optimizer, trainer.batch
        xb = torch.from_numpy(_batch_of(train[0], b))
        yb = torch.from_numpy(np.asarray(train[1][:b], np.int64))
        fp32_memory = step_memory(copy.deepcopy(fp32_model), xb, yb, p)
    trainer.fit()
    if architecture is not None and export_torch is not None and trainer.leader:
        export_state_dict(trainer.program, architecture, export_torch)
    fp32_history = None
    if fp32_model is not None:
        if progress:
            print("training the FP32 baseline (PyTorch) ...", file=sys.stderr)
        fp32_history = train_fp32(
            fp32_model,
            train,
            test,
            trainer.program.optimizer,
            trainer.batch,
            trainer.seed,
            trainer.epochs,
            trainable=trained_params(trainer.program) if trainable else None,
        )
    return build_results(
        trainer,
        fp32_history,
        config={
            "model": model_name,
            "dataset": dataset,
            "resumed_from": str(resume or ""),
            "trainable": trainable or "all",
            "frozen_params": int(trainer.program.graph.attr("frozen_params", 0)),
            "workers": trainer.workers.world if trainer.workers is not None else 1,
        },
        command=command,
        fp32_memory=fp32_memory,
    )
