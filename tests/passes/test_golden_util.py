"""The golden helpers fail on a missing golden file instead of writing it."""

from __future__ import annotations

from pathlib import Path

import pytest

from mexc.parser import parse_graph
from tests.passes import golden_util

TINY = '%0 = input {name="x"} : f32[2]\nreturn {x=%0}\n'


@pytest.fixture
def empty_golden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(golden_util, "GOLDEN", tmp_path)
    monkeypatch.setattr(golden_util, "UPDATE", False)
    return tmp_path


def test_missing_expected_fails(empty_golden: Path) -> None:
    with pytest.raises(pytest.fail.Exception, match="MEXC_UPDATE_GOLDEN=1") as info:
        golden_util.check_golden("no-such-case", "no-such-pass", parse_graph(TINY))
    assert "no-such-pass.no-such-case.expected.mexir is missing" in str(info.value)
    assert not any(empty_golden.iterdir())


def test_missing_before_fails(empty_golden: Path) -> None:
    with pytest.raises(pytest.fail.Exception, match="MEXC_UPDATE_GOLDEN=1") as info:
        golden_util.graph_before("no-such-case", "no-such-pass")
    assert "no-such-pass.no-such-case.before.mexir is missing" in str(info.value)
    assert not any(empty_golden.iterdir())


def test_update_flag_writes_expected(empty_golden: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(golden_util, "UPDATE", True)
    g = parse_graph(TINY)
    golden_util.check_golden("tiny", "some-pass", g)
    monkeypatch.setattr(golden_util, "UPDATE", False)
    golden_util.check_golden("tiny", "some-pass", g)  # now present and equal
    assert [p.name for p in empty_golden.iterdir()] == ["some-pass.tiny.expected.mexir"]


def test_real_golden_files_exist() -> None:
    """Every (pass, case) the golden tests parametrize over has both of its files."""
    passes = {p.name.split(".", 1)[0] for p in golden_util.GOLDEN.glob("*.mexir")}
    for pass_name in passes:
        for case in golden_util.CASES:
            for kind in ("before", "expected"):
                assert (golden_util.GOLDEN / f"{pass_name}.{case}.{kind}.mexir").exists()
