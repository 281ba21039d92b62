"""The `mexc` command line: passes, compile with IR dumps, train with table/JSON/PNG, errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import mexc
from mexc.cli import load_model, main
from mexc.pipeline import PIPELINE
from mexc.program import read_checkpoint

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "examples" / "models.py"


def test_passes_lists_the_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["passes"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(PIPELINE) == 8
    for line, p in zip(lines, PIPELINE, strict=True):
        assert line.split()[0] == p.name and p.summary in line


def test_python_dash_m_entry_point() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mexc", "passes"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].startswith("insert-mx-types")


def test_compile_print_after_all_dump_and_timing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = [
        "compile", f"{MODELS}:DigitsCNN", "--input-shape", "1,8,8", "--batch", "8",
        "--print-after-all", "--dump-ir", str(tmp_path / "ir"), "--time-passes",
    ]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    headers = [ln for ln in out.splitlines() if ln.startswith("// ----- IR after ")]
    assert headers == [f"// ----- IR after {p.name} -----" for p in PIPELINE]
    assert "// ----- pass timing -----" in out
    assert "parameters" in out and "formula FP32" in out
    dumps = sorted(p.name for p in (tmp_path / "ir").iterdir())
    assert len(dumps) == len(PIPELINE) + 1 and dumps[0] == "00_input.mexir"


def test_compile_print_after_named_repeated(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "compile", f"{MODELS}:MLP", "--input-shape", "1,8,8", "--batch", "4",
        "--print-after", "fuse-products", "--print-after", "plan-memory",
    ]  # fmt: skip
    assert main(args) == 0
    headers = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("// ----- IR")]
    assert headers == [
        "// ----- IR after fuse-products -----",
        "// ----- IR after plan-memory -----",
    ]


def test_resume_keeps_the_checkpoints_target_unless_target_is_given(tmp_path: Path) -> None:
    base = [
        "train", f"{MODELS}:MLP", "--data", "digits", "--epochs", "1", "--batch", "32",
        "--limit-train", "256", "--limit-test", "100", "--quiet",
    ]  # fmt: skip
    ck, runs = tmp_path / "ck", {}
    for name, extra in {
        "first": ["--target", "reference", "--checkpoint", str(ck)],
        "kept": ["--resume", str(ck)],  # the parser's default target is not a choice
        "moved": ["--resume", str(ck), "--target", "llvm"],
    }.items():
        out = tmp_path / f"{name}.json"
        assert main([*base, *extra, "--out", str(out)]) == 0
        runs[name] = json.loads(out.read_text())
    assert [r["config"]["target"] for r in runs.values()] == ["reference", "reference", "llvm"]
    first = runs["first"]["integer"]
    for name in ("kept", "moved"):  # the same state, evaluated on either target
        run = runs[name]["integer"]
        assert (run["checksum"], run["accuracy"]) == (first["checksum"], first["accuracy"])


def test_train_digits_table_json_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, png = tmp_path / "r.json", tmp_path / "c.png"
    args = [
        "train", f"{MODELS}:DigitsCNN", "--data", "digits", "--epochs", "1", "--batch", "32",
        "--limit-train", "256", "--limit-test", "100", "--compare-fp32", "--quiet",
        "--out", str(out_json), "--plot", str(png), "--checkpoint", str(tmp_path / "ck"),
        "--export-torch", str(tmp_path / "trained.pt"),
    ]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    for needle in ("test accuracy", "gap (FP32 - integer)", "memory ratio int/FP32", "samples/s"):
        assert needle in out
    res = json.loads(out_json.read_text())
    assert res["format"] == "mexc-results-1"
    for key in ("date", "command", "machine", "config", "integer", "fp32", "gap_points", "memory"):
        assert key in res
    assert res["command"][:2] == ["mexc", "train"]
    assert res["machine"]["cpu_count"] >= 1
    assert res["config"]["model"] == "DigitsCNN" and res["config"]["dataset"] == "digits"
    assert res["config"]["steps_per_epoch"] == 8 and res["config"]["rounding"] == "stochastic"
    for run in (res["integer"], res["fp32"]):
        assert run["steps"] == 8 and 0.0 <= run["accuracy"] <= 1.0
        assert len(run["history"]) == 1 and len(run["history"][0]["step_losses"]) == 8
    mem = res["memory"]
    assert mem["formula_int_bytes"] * 4 <= mem["formula_fp32_bytes"]
    planned = {"planned_persistent_bytes", "planned_saved_activation_bytes", "planned_arena_bytes"}
    assert planned <= set(mem) and mem["allocated_bytes"] > mem["planned_persistent_bytes"]
    fp = mem["fp32_measured"]
    assert fp["peak_bytes"] == fp["persistent_bytes"] + fp["step_peak_bytes"] > 0
    assert mem["measured_ratio"] == mem["allocated_bytes"] / fp["peak_bytes"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "ck" / "last.mexc").is_file() and (
        tmp_path / "ck" / "trainer.json"
    ).is_file()
    # the exported state dict is the last checkpoint's weights in the model's own layout
    trained = torch.load(tmp_path / "trained.pt", weights_only=True)
    model, _ = load_model(f"{MODELS}:DigitsCNN")
    model.load_state_dict(trained)  # every key of the model, strict
    weights = read_checkpoint(tmp_path / "ck" / "last.mexc").float_weights()
    for name, value in weights.items():
        assert np.array_equal(trained[name].numpy(), value), name


def test_train_with_adamw_beside_fp32_adamw(tmp_path: Path) -> None:
    """--optimizer adamw: integer AdamW with its default rate and decay, FP32 AdamW beside it,
    the optimizer in the results and the checkpoint; a resumed run keeps it."""
    out_json = tmp_path / "r.json"
    args = [
        "train", f"{MODELS}:DigitsCNN", "--data", "digits", "--epochs", "2", "--batch", "32",
        "--limit-train", "256", "--limit-test", "100", "--compare-fp32", "--quiet",
        "--optimizer", "adamw", "--target", "reference", "--out", str(out_json),
        "--checkpoint", str(tmp_path / "ck"),
    ]  # fmt: skip
    assert main(args) == 0
    res = json.loads(out_json.read_text())
    cfg = res["config"]
    assert (cfg["optimizer"], cfg["lr"], cfg["weight_decay"]) == ("AdamW", 1e-3, 0.01)
    assert cfg["betas"] == [0.9, 0.999] and "momentum" not in cfg
    losses = [h["train_loss"] for h in res["integer"]["history"]]
    assert losses[1] < losses[0] and res["integer"]["accuracy"] > 0.3
    mem = res["memory"]
    assert mem["formula_int_bytes"] * 4 <= mem["formula_fp32_bytes"]
    assert mem["param_state_bytes"] <= 4 * mem["params"]  # w, m, r and their exponents
    prog = mexc.load(tmp_path / "ck" / "last.mexc")
    assert isinstance(prog.optimizer, mexc.AdamW) and prog.optimizer.weight_decay == 0.01


def test_a_language_model_compiles_and_trains_on_token_ids(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`mexc compile --ids` and `mexc train --data digits-next`: a causal model of the digits'
    intensities, a label per position, beside FP32."""
    tokens = ROOT / "examples" / "tokens.py"
    assert (
        main(["compile", f"{tokens}:DigitsNext", "--input-shape", "63", "--ids", "--batch", "2"])
        == 0
    )
    assert "token ids in [0, 17)" in capsys.readouterr().out
    out_json = tmp_path / "r.json"
    args = [
        "train", f"{tokens}:DigitsNext", "--data", "digits-next", "--epochs", "1", "--batch", "16",
        "--limit-train", "64", "--limit-test", "32", "--compare-fp32", "--quiet",
        "--target", "llvm", "--out", str(out_json),
    ]  # fmt: skip
    assert main(args) == 0
    res = json.loads(out_json.read_text())
    for run in (res["integer"], res["fp32"]):
        assert run["steps"] == 4 and 0.0 < run["accuracy"] < 1.0
    assert res["memory"]["fp32_measured"]["peak_bytes"] > 0


def test_compile_with_a_sparse_update(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["compile", f"{MODELS}:DigitsCNN", "--input-shape", "1,8,8", "--batch", "4"]
    assert main([*base, "--trainable", "last:1"]) == 0
    assert "trainable        last:1 (6 parameter tensors frozen)" in capsys.readouterr().out
    assert main([*base, "--trainable", "head.*"]) == 2
    err = capsys.readouterr().err
    assert "pattern 'head.*' matches no parameter" in err and "conv1.weight" in err


def test_compile_with_channel_exponents(capsys: pytest.CaptureFixture[str]) -> None:
    """Below 8 bits the graph has channel exponents by default (--no-channel-exponents turns
    them off); llvm and c lower them."""
    base = ["compile", f"{MODELS}:DigitsCNN", "--input-shape", "1,8,8", "--batch", "4"]
    args = [*base, "--bits", "4", "--target", "reference", "--print-after", "insert-mx-types"]
    assert main(args) == 0
    assert "channel_exponents=true" in capsys.readouterr().out
    assert main([*args, "--no-channel-exponents"]) == 0
    assert "channel_exponents=true" not in capsys.readouterr().out
    for target in ("llvm", "c"):
        assert main([*base, "--bits", "4", "--target", target]) == 0


UNSUPPORTED = """
import torch
from torch import nn

class SortNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        x = torch.flatten(x, 1)
        x, _ = torch.sort(x, dim=1)
        return self.fc(x)
"""


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "MEXC_TRACEBACK"}
    return subprocess.run(
        [sys.executable, "-m", "mexc", *args], cwd=ROOT, capture_output=True, text=True, env=env
    )


WIDE_MLP = """
import torch.nn as nn
import torch.nn.functional as F


class Wide(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, hidden), nn.Linear(hidden, 10)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class Fits(Wide):
    def __init__(self):
        super().__init__(760)


class Over(Wide):  # .data + .bss fit the STM32F405's 128 KB, with the stack 684 B over
    def __init__(self):
        super().__init__(766)
"""


@pytest.mark.skipif(
    not (shutil.which("arm-none-eabi-gcc") and shutil.which("make")), reason="no arm-none-eabi-gcc"
)
def test_compile_to_a_board_says_whether_the_image_fits_its_ram(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "wide.py"
    model.write_text(WIDE_MLP)
    args = ["--input-shape", "1,8,8", "--batch", "4", "--target", "c", "--board", "netduinoplus2"]
    args += ["--train-data", "digits", "--steps", "2"]
    for name, code, says in (("Fits", 0, "fits netduinoplus2: RAM: "), ("Over", 1, "DOES NOT FIT")):
        assert main(["compile", f"{model}:{name}", *args, "--out", str(tmp_path / name)]) == code
        (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("board RAM")]
        assert says in line and "stack bound" in line, line
    assert " B over" in line and not (tmp_path / "Over" / "train_cortex-m4.elf").exists()


def test_unsupported_op_exits_2_without_traceback(tmp_path: Path) -> None:
    model = tmp_path / "bad_model.py"
    model.write_text(UNSUPPORTED)
    res = _run_cli("compile", f"{model}:SortNet", "--input-shape", "1,8,8", "--batch", "4")
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert "sort" in res.stderr and "UnsupportedOpError" in res.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["compile", "no/such/file.py:Net", "--input-shape", "1,8,8"], "not found"),
        (["compile", f"{MODELS}:NoSuchNet", "--input-shape", "1,8,8"], "DigitsCNN"),
        (["compile", f"{MODELS}", "--input-shape", "1,8,8"], "file.py:Name"),
        (["compile", f"{MODELS}:MLP", "--input-shape", "1,x"], "comma-separated"),
        (["compile", f"{MODELS}:MLP", "--input-shape", "1,8,8", "--bits", "12"], "bits"),
        (["compile", f"{MODELS}:MLP", "--input-shape", "1,8,8", "--print-after", "nope"], "nope"),
        (["compile", f"{MODELS}:MLP", "--input-shape", "1,8,8", "--target", "cuda"], "--out"),
        (
            ["compile", f"{MODELS}:MLP", "--input-shape", "1,8,8", "--target", "cuda"]
            + ["--out", "/tmp/never-written", "--arch", "sm_75"],
            "sm_80, sm_90",
        ),
        (["train", f"{MODELS}:MLP", "--data", "mnist"], "unknown dataset"),
        (["train", f"{MODELS}:MLP", "--data", "digits", "--resume", "/no/such/dir"], "resume"),
        # outputs that cannot be written are refused before training (not after it)
        (["train", f"{MODELS}:MLP", "--data", "digits", "--out", str(ROOT)], "is a folder"),
        (["train", f"{MODELS}:MLP", "--data", "digits", "--export-torch", "/"], "is a folder"),
        (["train", f"{MODELS}:MLP", "--data", "digits", "--checkpoint", str(MODELS)], "is a file"),
        (
            ["train", f"{MODELS}:MLP", "--data", "digits", "--plot", f"{MODELS}/c.png"],
            "models.py is a file",
        ),
        (
            ["compile", f"{MODELS}:MLP", "--input-shape", "1,8,8", "--dump-ir", str(MODELS)],
            "is a file",
        ),
    ],
)
def test_user_errors_exit_2(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    # the CLI wraps at 100 columns, so where a line breaks depends on the checkout's path
    assert needle in " ".join(err.split()) and "Traceback" not in err


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--seed", "-1", "argument --seed: must be in [0, 18446744073709551616), got -1"),
        ("--seed", "1e23", "argument --seed: '1e23' is not a whole number"),
        ("--warmup", "nan", "argument --warmup: must be a finite number, got nan"),
        ("--lr", "inf", "argument --lr: must be a finite number"),
        ("--limit-test", "0", "argument --limit-test: must be >= 1, got 0"),
        ("--limit-train", "-5", "argument --limit-train: must be >= 1, got -5"),
        ("--epochs", "0", "argument --epochs: must be >= 1"),
    ],
)
def test_bad_numbers_name_their_flag(
    flag: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as code:
        main(["train", f"{MODELS}:MLP", "--data", "digits", flag, value])
    assert code.value.code == 2 and says in capsys.readouterr().err


def test_a_model_whose_constructor_fails_is_one_error(tmp_path: Path) -> None:
    model = tmp_path / "broken.py"
    model.write_text(
        "import torch\nclass Net(torch.nn.Module):\n"
        "    def __init__(self):\n        raise RuntimeError('no weights file')\n"
    )
    with pytest.raises(ValueError, match=r"Net\(\) failed: RuntimeError: no weights file"):
        load_model(f"{model}:Net")
