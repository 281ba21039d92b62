"""The FP32 baseline: the same model trained in PyTorch float32, matched to the integer run.

Matched: initial weights (pass a deepcopy of the model taken before `mexc.compile`), data order
(`mexc.data.batches` with the same seed), batch size (incomplete last batch dropped), optimizer
(`torch.optim.SGD` with the same momentum and weight decay, dampening 0, no Nesterov, weight decay
on every parameter as mexc's L2-as-gradient term; or `torch.optim.AdamW` / `Adam` with the same
betas, eps and decoupled decay) and the per-step learning rate
`lr * schedule.factor(step)` of the integer program's optimizer. The loss is the mean softmax
cross-entropy. Evaluation uses eval mode (BN running statistics), as `Program.predict` does.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from mexc.data import Arrays, batches
from mexc.frontend_eval_modes import set_modes, training_modes
from mexc.optim import SGD, Adam, AdamW, Optimizer


def cpu_threads() -> int:
    """CPUs this process may run on (affinity aware)."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


@torch.no_grad()
def evaluate(model: nn.Module, data: Arrays, batch: int = 1000) -> float:
    x, y = data
    if len(y) == 0:
        return 0.0
    model.eval()
    correct = 0
    for i in range(0, len(y), batch):
        logits = model(torch.from_numpy(x[i : i + batch]))
        correct += int((logits.argmax(1).numpy() == y[i : i + batch]).sum())
    return correct / y.size  # a label per position ([N, C, d1, ...] logits): over positions


def torch_optimizer(model: nn.Module, optimizer: Optimizer) -> torch.optim.Optimizer:
    """PyTorch's optimizer with `optimizer`'s hyperparameters: SGD with momentum (dampening 0,
    no Nesterov, coupled weight decay), AdamW, or Adam (coupled weight decay)."""
    params = model.parameters()
    if isinstance(optimizer, AdamW):  # Adam is an AdamW whose decay is coupled
        kind = torch.optim.Adam if isinstance(optimizer, Adam) else torch.optim.AdamW
        return kind(
            params,
            lr=optimizer.lr,
            betas=optimizer.betas,
            eps=optimizer.eps,
            weight_decay=optimizer.weight_decay,
        )
    return torch.optim.SGD(
        params,
        lr=optimizer.lr,
        momentum=optimizer.momentum,
        weight_decay=optimizer.weight_decay,
        dampening=0.0,
        nesterov=False,
    )


def train_fp32(
    model: nn.Module,
    train: Arrays,
    test: Arrays,
    optimizer: Optimizer,
    batch: int,
    seed: int,
    epochs: int,
    on_epoch: Callable[[dict[str, Any]], None] | None = None,
    trainable: frozenset[str] | None = None,
) -> list[dict[str, Any]]:
    """Train `model` in place; one history dict per epoch (same keys as the integer Trainer).
    `trainable`: the parameter names to train, as the integer program's (None: all); the
    others are frozen (requires_grad off: no gradient, no decay)."""
    torch.set_num_threads(cpu_threads())
    if trainable is not None:
        for name, p in model.named_parameters():
            p.requires_grad_(name in trainable)
    opt = torch_optimizer(model, optimizer)
    loss_fn = nn.CrossEntropyLoss()
    x_all, y_all = train
    history: list[dict[str, Any]] = []
    step = 0
    modes = training_modes(model)  # frozen batch norms stay frozen, as in the integer step
    for epoch in range(epochs):
        set_modes(modes)  # evaluate() leaves the model in eval mode
        start = time.perf_counter()
        losses: list[float] = []
        for idx in batches(len(y_all), batch, seed, epoch):
            for group in opt.param_groups:
                group["lr"] = optimizer.lr * optimizer.schedule.factor(step)
            xb = torch.from_numpy(x_all[idx])
            yb = torch.from_numpy(y_all[idx])
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(xb), yb)
            loss.backward()
            opt.step()
            losses.append(float(loss.item()))
            step += 1
        seconds = time.perf_counter() - start
        record = {
            "epoch": epoch + 1,
            "step": step,
            "train_loss": float(np.mean(losses)) if losses else float("nan"),
            "test_accuracy": evaluate(model, test),
            "seconds": seconds,
            "images_per_s": len(losses) * batch / seconds if seconds > 0 else 0.0,
            "step_losses": losses,
        }
        history.append(record)
        if on_epoch is not None:
            on_epoch(record)
    return history


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 sent to /dev/null: the profiler's C++ side prints start/stop lines."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def step_memory(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, optimizer: Optimizer | None = None
) -> dict[str, int]:
    """Bytes PyTorch FP32 eager holds for one training step of `model` (trained in place) on
    (x, y) with `optimizer`'s torch counterpart (default SGD with momentum 0.9, weight decay
    5e-4): `persistent_bytes` (parameters, buffers, the optimizer's state) and
    `step_peak_bytes`, the peak of the tensor bytes allocated during one step above that
    (activations saved for the backward pass, gradients, temporaries), summed from the torch
    profiler's memory events in time order. `peak_bytes` is their sum: what the step needs."""
    set_modes(training_modes(model))
    opt = torch_optimizer(model, optimizer or SGD(lr=1e-3, momentum=0.9, weight_decay=5e-4))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    step()  # the optimizer's state (momentum, moments) exists from here on
    opt.zero_grad(set_to_none=True)
    cpu = torch.profiler.ProfilerActivity.CPU
    with _quiet_stderr(), torch.profiler.profile(activities=[cpu], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += int(e.nbytes())
        peak = max(peak, live)
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
    persistent = sum(t.numel() * t.element_size() for t in tensors)
    return {
        "persistent_bytes": persistent,
        "step_peak_bytes": peak,
        "peak_bytes": persistent + peak,
    }
