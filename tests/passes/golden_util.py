"""Golden IR files for pass tests: Before (input IR) -> Expected (output IR).

Regenerate with `MEXC_UPDATE_GOLDEN=1 pytest tests/passes` and review the diff.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

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


def graph_before(case: str, pass_name: str) -> Graph:
    """The input of `pass_name`: from the golden file, or (when updating) from the pipeline."""
    path = GOLDEN / f"{pass_name}.{case}.before.mexir"
    if UPDATE or not path.exists():
        g = _model_graph(case)
        ctx = context()
        for p in PIPELINE:
            if p.name == pass_name:
                break
            g = p.fn(g, ctx)
        path.write_text(print_graph(g))
    return parse_graph(path.read_text())


def check_golden(case: str, pass_name: str, after: Graph) -> None:
    path = GOLDEN / f"{pass_name}.{case}.expected.mexir"
    text = print_graph(after)
    if UPDATE or not path.exists():
        path.write_text(text)
    assert text == path.read_text(), f"{path.name} differs; rerun with MEXC_UPDATE_GOLDEN=1"


def run_pass(pass_name: str, g: Graph) -> Graph:
    p = next(p for p in PIPELINE if p.name == pass_name)
    return p.fn(g, context())
