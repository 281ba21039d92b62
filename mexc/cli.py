"""The `mexc` command line: `mexc passes`, `mexc compile`, `mexc train`.

Errors the user can fix (a missing file or name, a bad flag value, an unsupported op, a missing
dataset, a corrupt checkpoint) print one paragraph to stderr, without a traceback, and exit with
status 2. Set MEXC_TRACEBACK=1 to see the traceback anyway.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

EXIT_USAGE = 2


class CliError(ValueError):
    """A user-fixable problem with the command line."""


# --- helpers ------------------------------------------------------------------------------------


def load_model(spec: str) -> tuple[Any, str]:
    """Build the model named by `path/to/file.py:Name` (a class constructed without arguments,
    or a function returning an nn.Module); returns (model, Name)."""
    from torch import nn

    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name:
        raise CliError(f"model must be given as path/to/file.py:Name, got {spec!r}")
    path = Path(path_text)
    if not path.is_file():
        raise CliError(f"model file {path} not found (from {spec!r})")
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    mod_name = f"_mexc_user_{path.stem}"
    spec_obj = importlib.util.spec_from_file_location(mod_name, path)
    if spec_obj is None or spec_obj.loader is None:
        raise CliError(f"cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec_obj)
    sys.modules[mod_name] = module
    try:
        spec_obj.loader.exec_module(module)
    except Exception as err:  # the user's file failed to import
        raise CliError(f"importing {path} failed: {type(err).__name__}: {err}") from err
    if not hasattr(module, name):
        found = sorted(
            k
            for k, v in vars(module).items()
            if not k.startswith("_")
            and (isinstance(v, type) and issubclass(v, nn.Module) and v.__module__ == mod_name)
        )
        raise CliError(f"{path} has no '{name}'; nn.Module classes defined there: {found}")
    obj = getattr(module, name)
    if not callable(obj):
        raise CliError(f"{spec}: '{name}' is neither an nn.Module class nor a function")
    try:
        model = obj()
    except TypeError as err:
        raise CliError(
            f"{spec}: calling {name}() without arguments failed ({err}); give a class whose "
            "arguments all have defaults, or a function returning the model"
        ) from err
    except Exception as err:  # the user's constructor failed
        raise CliError(f"{spec}: {name}() failed: {type(err).__name__}: {err}") from err
    if not isinstance(model, nn.Module):
        raise CliError(f"{spec}: {name}() returned {type(model).__name__}, not an nn.Module")
    return model, name


def _whole(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in [low, high) (argparse names the flag)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value >= high):
            bound = f">= {low}" if high is None else f"in [{low}, {high})"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


def _finite(text: str) -> float:
    """An argparse type: a finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise CliError(f"--input-shape must be comma-separated integers, got {text!r}") from None
    if not dims or any(d <= 0 for d in dims):
        raise CliError(f"--input-shape dimensions must be positive, got {text!r}")
    return dims


ROUNDING_CHOICES = ("auto", "stochastic", "nearest-forward", "nearest", "deterministic")


def rounding_mode(text: str) -> str:
    return "nearest" if text == "deterministic" else text


def _instruments(args: argparse.Namespace) -> tuple[list[Any], Any]:
    import mexc
    from mexc.pipeline import pass_names

    out: list[Any] = []
    if args.print_after_all:
        out.append(mexc.PrintAfterAll())
    if args.print_after:
        names = [n.strip() for arg in args.print_after for n in arg.split(",") if n.strip()]
        unknown = [n for n in names if n not in pass_names()]
        if unknown:
            raise CliError(f"--print-after names unknown pass(es) {unknown}; see `mexc passes`")
        out.append(mexc.PrintAfter(names))
    if args.print_after_change:
        out.append(mexc.PrintAfterChange())
    if args.dump_ir:
        out.append(mexc.DumpIR(args.dump_ir))
    timing = mexc.Timing(sys.stdout) if args.time_passes else None
    if timing is not None:
        out.append(timing)
    return out, timing


def _kib(n: int) -> str:
    return f"{n} B ({n / 1024:.1f} KiB)"


# --- commands -----------------------------------------------------------------------------------


def cmd_passes(args: argparse.Namespace) -> int:
    from mexc.pipeline import PIPELINE

    width = max(len(p.name) for p in PIPELINE)
    for p in PIPELINE:
        print(f"{p.name:<{width}}  {p.summary}")
    return 0


# the paths each command writes: a file, or a folder (created with its parents if needed)
_OUTPUTS = {
    "out": "file",
    "plot": "file",
    "export_torch": "file",
    "checkpoint": "folder",
    "dump_ir": "folder",
}


def _check_outputs(args: argparse.Namespace, kinds: dict[str, str]) -> None:
    """Refuse, before any work, an output path that cannot be written: a file path that is a
    folder, a folder path that is a file, or a path under a file."""
    for flag, kind in kinds.items():
        path = getattr(args, flag, None)
        if not path:
            continue
        p, name = Path(path), "--" + flag.replace("_", "-")
        if kind == "file" and p.is_dir():
            raise CliError(f"{name} {path} is a folder; give the path of a file to write")
        if kind == "folder" and p.exists() and not p.is_dir():
            raise CliError(f"{name} {path} is a file; give a folder (created if needed)")
        blocked = next((a for a in p.parents if a.exists() and not a.is_dir()), None)
        if blocked is not None:
            raise CliError(f"{name} {path}: {blocked} is a file, so nothing can be written there")


def cmd_compile(args: argparse.Namespace) -> int:
    import torch

    import mexc
    from mexc.optim import OPTIMIZER_CLASSES

    shape = parse_shape(args.input_shape)
    _check_outputs(args, {"dump_ir": "folder"})
    instruments, _ = _instruments(args)
    torch.manual_seed(args.seed)
    model, name = load_model(args.model)
    example = torch.zeros(args.batch, *shape, dtype=torch.long if args.ids else torch.float32)
    if args.target == "cuda" and not args.out:
        raise CliError("--target cuda compiles ahead of time and needs --out DIR")
    prog = mexc.compile(
        model,
        (example,),
        optimizer=OPTIMIZER_CLASSES[args.optimizer](),
        trainable=args.trainable,
        bits=args.bits,
        seed=args.seed,
        target="reference" if args.target == "cuda" else args.target,
        per_group_velocity=not args.no_per_group_velocity,
        rounding=rounding_mode(args.rounding),
        instruments=instruments,
        channel_exponents=args.channel_exponents,
    )
    ram = _export(prog, args) if args.out else None
    mem = prog.memory_report()
    ratio = mem["formula_int_bytes"] / max(mem["formula_fp32_bytes"], 1)
    print(f"// ----- summary: {name} -----")
    kind = f", token ids in [0, {prog.vocab})" if prog.vocab else ""
    print(f"input            [{args.batch}, {', '.join(map(str, shape))}] (batch fixed{kind})")
    print(f"nodes            {len(prog.graph.nodes)}")
    print(f"parameters       {mem['params']}")
    frozen = int(prog.graph.attr("frozen_params", 0))
    if frozen:
        print(f"trainable        {args.trainable} ({frozen} parameter tensors frozen)")
    print(f"bits             {args.bits}")
    if mem["allocated_bytes"]:
        print(f"allocated        {_kib(mem['allocated_bytes'])}  ({mem['backend']} backend)")
    else:
        print("allocated        (the reference executor allocates as it steps)")
    print(f"planned: state   {_kib(mem['planned_persistent_bytes'])}")
    print(f"planned: saved   {_kib(mem['planned_saved_activation_bytes'])}")
    print(f"planned: arena   {_kib(mem['planned_arena_bytes'])}")
    print(f"formula int      {_kib(mem['formula_int_bytes'])}")
    print(f"formula FP32     {_kib(mem['formula_fp32_bytes'])}  (int/FP32 = {ratio:.3f}, formula)")
    if ram is not None:
        print(f"board RAM        {ram}")
        if ram.startswith("DOES NOT FIT"):
            return 1
    return 0


def _export(prog: Any, args: argparse.Namespace) -> str | None:
    """--out DIR: write the standalone C training project (--target c) or the CUDA artifact.
    For a C project on an MCU board, whether its image fits the board's RAM (the summary's
    "board RAM" line), where arm-none-eabi-gcc is installed to build it."""
    from mexc.data import get_dataset

    if args.target == "cuda":
        _export_cuda(prog, args)
        return None
    if args.target != "c":
        raise CliError("--out writes a C project (--target c) or a CUDA artifact (--target cuda)")
    x, y = get_dataset(args.train_data, "train")
    want = prog.batch * min(args.steps, args.data_batches)
    if tuple(x.shape[1:]) != prog.input_shape:
        raise CliError(
            f"--train-data {args.train_data} has inputs of shape {list(x.shape[1:])}, "
            f"the model was compiled for {list(prog.input_shape)}"
        )
    from mexc.backends.c.project import MCU_BOARDS, check_ram, export

    out = export(prog, args.out, data=(x[:want], y[:want]), steps=args.steps, board=args.board)
    print(
        f"C project written to {out} ({args.steps} steps over {want} embedded samples); "
        f"build and run with: make -C {out} run-qemu   (or: make -C {out} run-host)"
    )
    if args.board not in MCU_BOARDS:
        return None
    check = check_ram(out)
    if check is None:
        return f"not checked (needs arm-none-eabi-gcc and make); `make -C {out} mcu` checks it"
    if not check.fits:
        return f"DOES NOT FIT {args.board} (`make mcu` refuses the image): {check.text}"
    return f"fits {args.board}: {check.text}"


def _export_cuda(prog: Any, args: argparse.Namespace) -> None:
    from mexc.backends.cuda.build import build_step
    from mexc.backends.cuda.runtime import ARCHS

    archs = tuple(a.strip() for a in args.arch.split(",") if a.strip())
    bad = [a for a in archs if a not in ARCHS]
    if bad or not archs:
        raise CliError(f"--arch {args.arch!r}: choose from {', '.join(ARCHS)}")
    man = build_step(prog, archs, args.out, pack_budget=args.pack_budget, eval_plan=True)
    evaluation = (
        f"predict and evaluate run its inference plan ({man['inference']}/)"
        if man["inference"]
        else f"predict and evaluate run on the host ({man['inference_missing']})"
    )
    print(
        f"CUDA artifact written to {args.out}: {len(man['kernels'])} kernel launches per step "
        f"in {len(man['modules'])} modules for {', '.join(archs)} (TVM {man['seconds']['tvm']} s, "
        f"nvcc {man['seconds']['nvcc']} s); {evaluation}; run it on the GPU with "
        f"mexc.load_cuda({str(args.out)!r}) (needs CuPy, not TVM)"
    )


def _without_nproc(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def _launch_workers(args: argparse.Namespace) -> int:
    """`mexc train --nproc N`: the same command as N data-parallel workers on this machine
    (gloo on localhost), as `torchrun --nproc-per-node N -m mexc train ...` would start them."""
    from mexc.distributed import launch

    if args.batch % args.nproc:
        raise CliError(f"--batch {args.batch} does not split into --nproc {args.nproc} workers")
    cmd = [sys.executable, "-m", "mexc", "train", *_without_nproc(args.argv[1:])]
    codes = launch(cmd, args.nproc)
    bad = [r for r, c in enumerate(codes) if c != 0]
    if bad:
        print(f"mexc: worker(s) {bad} failed (exit codes {codes})", file=sys.stderr)
        return max(codes)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    import torch

    from mexc.data import load_splits
    from mexc.trainer import format_table, plot_curves, run_training, write_json_atomic

    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return _launch_workers(args)
    data_parallel = int(os.environ.get("WORLD_SIZE", "1")) > 1  # a worker (torchrun, --nproc)
    leader = True
    if data_parallel:
        from mexc.distributed import init_from_env

        leader = init_from_env().rank == 0
    if args.resume and not Path(args.resume).is_dir():
        raise CliError(f"--resume {args.resume}: no such checkpoint folder")
    _check_outputs(args, _OUTPUTS)
    train, test = load_splits(args.data, args.limit_train, args.limit_test)
    torch.manual_seed(args.seed)
    model, name = load_model(args.model)
    if args.resume:
        st_path = Path(args.resume) / "trainer.json"
        if st_path.is_file():
            try:
                st = json.loads(st_path.read_text())
                for key in ("epochs", "batch", "seed"):
                    if key in st and st[key] != getattr(args, key):
                        print(
                            f"note: resuming uses the checkpoint's {key}={st[key]} "
                            f"(the command line says {getattr(args, key)})",
                            file=sys.stderr,
                        )
            except (OSError, ValueError):
                pass  # Trainer.resume reports a corrupt state file
    from mexc.optim import DEFAULT_DECAY, DEFAULT_LR

    results = run_training(
        model,
        train,
        test,
        model_name=name,
        dataset=args.data,
        epochs=args.epochs,
        batch=args.batch,
        lr=args.lr if args.lr is not None else DEFAULT_LR[args.optimizer],
        momentum=args.momentum,
        weight_decay=(
            args.weight_decay if args.weight_decay is not None else DEFAULT_DECAY[args.optimizer]
        ),
        schedule=args.schedule,
        optimizer=args.optimizer,
        betas=(args.beta1, args.beta2),
        eps=args.eps,
        trainable=args.trainable,
        warmup=args.warmup,
        bits=args.bits,
        rounding=rounding_mode(args.rounding),
        per_group_velocity=not args.no_per_group_velocity,
        channel_exponents=args.channel_exponents,
        seed=args.seed,
        target=args.target,
        compare_fp32=args.compare_fp32,
        progress=not args.quiet,
        checkpoint=args.checkpoint,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        # --target beside --resume moves the checkpointed program (its default does not)
        resume_target=args.target if "target" in getattr(args, "given", ()) else None,
        command=["mexc", *args.argv],
        data_parallel=data_parallel,
        export_torch=args.export_torch,
    )
    if not leader:
        return 0  # worker 0 reports: every worker holds the same state
    print(format_table(results), end="")
    if args.out:
        write_json_atomic(args.out, results)
        print(f"results written to {args.out}")
    if args.plot:
        plot_curves(results, args.plot)
        print(f"curves written to {args.plot}")
    if args.export_torch:
        print(f"trained weights written to {args.export_torch} (a PyTorch state dict)")
    return 0


class _Given(argparse.Action):
    """Stores the value and notes in `namespace.given` that the command line set it (a
    default is not a choice: `--resume` keeps the checkpoint's target unless --target is
    given)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = {*getattr(namespace, "given", ()), self.dest}


# --- parser -------------------------------------------------------------------------------------


def _compile_flags(
    p: argparse.ArgumentParser,
    rounding: Sequence[str],
    default: str,
    targets: Sequence[str],
    target: str = "reference",
) -> None:
    from mexc.optim import OPTIMIZERS
    from mexc.targets import TARGETS

    shown = "; ".join(f"{name} = {TARGETS[name].summary}" for name in targets)
    p.add_argument("model", help="path/to/file.py:Name (nn.Module class or function)")
    p.add_argument(
        "--bits", type=int, default=8, help="mantissa bits B, 2..8 (default 8); velocity: 8"
    )
    p.add_argument(
        "--seed", type=_whole(0, 2**64), default=0, help="seed of rounding, data order and init"
    )
    p.add_argument(
        "--target",
        default=target,
        choices=targets,
        action=_Given,
        help=f"backend (default: {target}; {shown})",
    )
    p.add_argument(
        "--no-per-group-velocity",
        action="store_true",
        help="one velocity exponent per tensor instead of one per output channel/neuron",
    )
    p.add_argument(
        "--channel-exponents",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a B-bit exponent per channel of every activation, gradient and weight row, in its "
        "tensor's int8 frame (docs/numerics.md §5; default: on below 8 bits)",
    )
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="sgd",
        help="integer SGD with momentum, AdamW (decoupled decay) or Adam (L2 decay); "
        "docs/numerics.md; compile uses its default hyperparameters",
    )
    p.add_argument(
        "--trainable",
        metavar="SPEC",
        default=None,
        help="sparse update: train only these parameters (last:K = the last K weight layers "
        "and what follows them; bias-norm = biases and norm affines; or comma-separated name "
        "patterns such as 'fc.*,*.bias'); default all",
    )
    p.add_argument(
        "--rounding",
        choices=rounding,
        default=default,
        help="rounding mode (default auto: nearest-forward below 8 bits, else stochastic; "
        "deterministic = nearest; docs/numerics.md section 4)",
    )


def build_parser() -> argparse.ArgumentParser:
    from mexc.backends.c.project import BOARDS
    from mexc.targets import HOST_NAMES, NAMES  # compile: every target; train: the host's

    parser = argparse.ArgumentParser(
        prog="mexc",
        description="Compile float PyTorch models into integer-only training programs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("passes", help="list the compilation pipeline, one line per pass")
    p.set_defaults(func=cmd_passes)

    p = sub.add_parser("compile", help="compile a model and show its IR / memory")
    _compile_flags(p, ROUNDING_CHOICES, "auto", NAMES)
    p.add_argument("--input-shape", required=True, help="shape of one input, e.g. 1,28,28")
    p.add_argument(
        "--ids",
        action="store_true",
        help="the input is integer token ids, which the model reads through embedding tables",
    )
    p.add_argument("--batch", type=_whole(1), default=128, help="batch size (default 128)")
    p.add_argument("--print-after-all", action="store_true", help="print the IR after every pass")
    p.add_argument(
        "--print-after",
        metavar="P1,P2",
        action="append",
        help="print the IR after the named passes (repeatable)",
    )
    p.add_argument(
        "--print-after-change",
        action="store_true",
        help="print the IR after passes that changed it",
    )
    p.add_argument("--dump-ir", metavar="DIR", help="write each stage to DIR/NN_<pass>.mexir")
    p.add_argument("--time-passes", action="store_true", help="print a pass timing table")
    p.add_argument(
        "--out",
        metavar="DIR",
        help="with --target c: write a standalone C project; with --target cuda: write the "
        "ahead-of-time CUDA artifact (run it with mexc.load_cuda(DIR))",
    )
    p.add_argument(
        "--arch",
        default="sm_80,sm_90",
        help="with --target cuda: GPU architectures, comma-separated (default sm_80,sm_90)",
    )
    p.add_argument(
        "--pack-budget",
        type=_whole(1),
        default=None,
        metavar="BYTES",
        help="with --target cuda: bytes one product's operand packs may take before it runs "
        "over chunks of the batch (default 4 MiB; smaller saves device memory)",
    )
    p.add_argument(
        "--board",
        default="mps2-an385",
        choices=BOARDS,
        help="board of the C project (default mps2-an385, QEMU's Cortex-M3 board; "
        "netduinoplus2: an STM32F405, Cortex-M4)",
    )
    p.add_argument(
        "--train-data",
        default="digits",
        help="dataset whose first samples the C project embeds (default digits)",
    )
    p.add_argument("--steps", type=_whole(1), default=10, help="training steps of the C project")
    p.add_argument(
        "--data-batches",
        type=_whole(1),
        default=16,
        help="distinct batches embedded (steps wrap around them; default 16)",
    )
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("train", help="train a model integer-only (optionally beside FP32)")
    _compile_flags(p, ROUNDING_CHOICES, "auto", HOST_NAMES, "auto")
    p.add_argument(
        "--data",
        default="fashion-mnist",
        help="fashion-mnist | digits | digits-tokens | digits-next | digits-sparse | npz:PATH",
    )
    p.add_argument("--epochs", type=_whole(1), default=5)
    p.add_argument("--batch", type=_whole(1), default=128)
    p.add_argument(
        "--lr", type=_finite, default=None, help="peak learning rate (default: sgd 0.05, adam 1e-3)"
    )
    p.add_argument("--momentum", type=_finite, default=0.9, help="SGD momentum")
    p.add_argument(
        "--weight-decay",
        type=_finite,
        default=None,
        help="default: sgd 5e-4 (L2 as a gradient term), adamw 0.01 (decoupled), adam 0",
    )
    p.add_argument("--beta1", type=_finite, default=0.9, help="Adam's first-moment decay")
    p.add_argument("--beta2", type=_finite, default=0.999, help="Adam's second-moment decay")
    p.add_argument("--eps", type=_finite, default=1e-8, help="Adam's epsilon")
    p.add_argument("--schedule", choices=("cosine", "step", "constant"), default="cosine")
    p.add_argument(
        "--warmup",
        type=_finite,
        default=None,
        help="cosine warmup in epochs (default: min(1, epochs/5))",
    )
    p.add_argument("--compare-fp32", action="store_true", help="also train in PyTorch FP32")
    p.add_argument("--plot", metavar="PNG", help="write loss/accuracy curves to a PNG")
    p.add_argument("--out", metavar="JSON", help="write results (see docs) to a JSON file")
    p.add_argument("--checkpoint", metavar="DIR", help="checkpoint to DIR after every epoch")
    p.add_argument(
        "--export-torch",
        metavar="PT",
        help="write the trained weights, dequantized to float32, as the model's PyTorch state "
        "dict to PT (load with model.load_state_dict(torch.load(PT, weights_only=True)))",
    )
    p.add_argument(
        "--checkpoint-every", type=_whole(0), default=0, metavar="N", help="also every N steps"
    )
    p.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the run checkpointed in DIR (on its target, or on --target when given)",
    )
    p.add_argument(
        "--limit-train", type=_whole(1), default=None, metavar="N", help="first N images"
    )
    p.add_argument("--limit-test", type=_whole(1), default=None, metavar="N", help="first N images")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--nproc",
        type=_whole(1),
        default=1,
        metavar="N",
        help="train as N data-parallel workers on this machine (targets llvm and reference; "
        "the same bits as one process; docs/distributed.md)",
    )
    p.set_defaults(func=cmd_train)
    return parser


def _report(err: BaseException) -> None:
    kind = type(err).__name__
    text = " ".join(str(err).split()) if not isinstance(err, CliError) else str(err)
    msg = f"mexc: error: {text}" if isinstance(err, CliError) else f"mexc: {kind}: {text}"
    print(
        textwrap.fill(msg, width=100, break_long_words=False, break_on_hyphens=False),
        file=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `mexc` console script and `python -m mexc`; returns the exit status."""
    from mexc.errors import MexcError

    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(args_list)
    args.argv = args_list
    try:
        code = int(args.func(args))
    except (MexcError, ValueError, FileNotFoundError) as err:
        if os.environ.get("MEXC_TRACEBACK"):
            raise
        _report(err)
        code = EXIT_USAGE
    except KeyboardInterrupt:
        print("mexc: interrupted", file=sys.stderr)
        code = 130
    if "mexc.distributed" in sys.modules:  # a data-parallel worker leaves without gloo's abort
        from mexc.distributed import exit_worker

        exit_worker(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
