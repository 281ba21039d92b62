"""Golden IR files for pass tests: Before (input IR) -> Expected (output IR).

The golden files under `golden/` are read, never written, unless the environment variable
MEXC_UPDATE_GOLDEN is set to 1: `MEXC_UPDATE_GOLDEN=1 pytest tests/passes` regenerates (or
creates) every golden file the selected tests use; review the diff before committing. Without
the flag a missing golden file fails the test (it is not silently created), so a deleted or
misnamed file cannot turn a golden test into a test that compares its output with itself.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from mexc.frontend import import_model
from mexc.ir import Graph
from mexc.optim import SGD, Cosine
from mexc.parser import parse_graph
from mexc.pass_manager import PassContext
from mexc.pipeline import PIPELINE
from mexc.printer import print_graph

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("MEXC_UPDATE_GOLDEN") == "1"
CASES = {
    "mlp": ("MLP", (1, 8, 8)),
    "digits_cnn": ("DigitsCNN", (1, 8, 8)),
    "vit": ("ViTTiny", (1, 28, 28)),
}


def context() -> PassContext:
    return PassContext(optimizer=SGD(0.05, 0.9, 5e-4, Cosine(100, 10)), batch=4)


def _model_graph(case: str) -> Graph:
    sys.path.insert(0, str(ROOT))
    from examples import models, vit

    name, shape = CASES[case]
    torch.manual_seed(0)
    model = vit.ViTTiny(depth=1) if name == "ViTTiny" else getattr(models, name)()
    return import_model(model, torch.zeros(4, *shape)).graph


def _require(path: Path) -> None:
    """Fail the calling test when a golden file is missing (never create it implicitly)."""
    if not path.exists():
        pytest.fail(
            f"golden file {_shown(path)} is missing; create it with "
            f"`MEXC_UPDATE_GOLDEN=1 pytest {_caller_hint()}` and review it before committing",
            pytrace=False,
        )


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _caller_hint() -> str:
    test = os.environ.get("PYTEST_CURRENT_TEST", "")
    return test.split("::", 1)[0] if test else "tests/passes"


def graph_before(case: str, pass_name: str) -> Graph:
    """The input of `pass_name`: from the golden file, or (when updating) from the pipeline."""
    path = GOLDEN / f"{pass_name}.{case}.before.mexir"
    if UPDATE:
        g = _model_graph(case)
        ctx = context()
        for p in PIPELINE:
            if p.name == pass_name:
                break
            g = p.fn(g, ctx)
        path.write_text(print_graph(g))
    _require(path)
    return parse_graph(path.read_text())


def check_golden(case: str, pass_name: str, after: Graph) -> None:
    path = GOLDEN / f"{pass_name}.{case}.expected.mexir"
    text = print_graph(after)
    if UPDATE:
        path.write_text(text)
    _require(path)
    assert text == path.read_text(), f"{path.name} differs; rerun with MEXC_UPDATE_GOLDEN=1"


def run_pass(pass_name: str, g: Graph) -> Graph:
    p = next(p for p in PIPELINE if p.name == pass_name)
    return p.fn(g, context())
