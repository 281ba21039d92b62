"""PassManager: instruments, env-var instruments, verification between passes, reproducers."""

from __future__ import annotations

import dataclasses
import io
import tempfile
from pathlib import Path

import pytest

from mexc.errors import InputError, PassError, UnsupportedOpError, VerificationError
from mexc.ir import Graph, Value
from mexc.parser import parse_graph
from mexc.pass_manager import (
    DumpIR,
    Pass,
    PassContext,
    PassManager,
    PrintAfter,
    PrintAfterAll,
    PrintAfterChange,
    Timing,
    instruments_from_env,
)
from mexc.types import f32


def _mark_stage(g: Graph, ctx: PassContext) -> Graph:
    return g.with_attrs(stage=ctx.bits + 1)


def _identity(g: Graph, ctx: PassContext) -> Graph:
    return g


def _crash(g: Graph, ctx: PassContext) -> Graph:
    raise ZeroDivisionError("boom")


def _float_relu(g: Graph, ctx: PassContext) -> Graph:
    nodes = tuple(n.with_(types=(f32(4, 16, 8, 8),)) if n.id == 5 else n for n in g.nodes)
    return dataclasses.replace(g, nodes=nodes)


def _drop_cap(g: Graph, ctx: PassContext) -> Graph:
    nodes = tuple(
        n.with_(attrs=dataclasses.replace(n.attrs, shift_cap=None)) if n.id == 4 else n
        for n in g.nodes
    )
    return dataclasses.replace(g, nodes=nodes)


BUMP = Pass("mark-stage", _mark_stage, "sets graph attr stage")
SAME = Pass("identity", _identity, "changes nothing")
PIPE = [BUMP, SAME]


@pytest.fixture(autouse=True)
def _reproducers_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reproducer written to the default folder (tempfile.mkdtemp) lands in the test's own
    folder, not in /tmp for good."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def _run(sample: Graph, *instruments: object, passes: list[Pass] = PIPE, **kw: object) -> Graph:
    pm = PassManager(passes, list(instruments), **kw)  # type: ignore[arg-type]
    return pm.run(sample, PassContext())


def test_runs_passes_in_order(sample: Graph) -> None:
    out = _run(sample)
    assert out.attr("stage") == 9


def test_print_after_all_has_one_header_per_pass(sample: Graph) -> None:
    buf = io.StringIO()
    _run(sample, PrintAfterAll(buf))
    text = buf.getvalue()
    assert text.count("// ----- IR after ") == 2
    assert "// ----- IR after mark-stage -----\n// graph {" in text
    assert "// ----- IR after identity -----" in text
    # each section parses back
    sections = text.split("// ----- IR after ")[1:]
    assert all(parse_graph("// " + s).attr("stage") == 9 for s in sections)


def test_print_after_all_defaults_to_stdout(
    sample: Graph, capsys: pytest.CaptureFixture[str]
) -> None:
    _run(sample, PrintAfterAll())
    assert capsys.readouterr().out.count("// ----- IR after ") == 2


def test_print_after_selects(sample: Graph) -> None:
    buf = io.StringIO()
    _run(sample, PrintAfter(["identity"], buf))
    assert buf.getvalue().count("// ----- IR after ") == 1
    assert "IR after identity" in buf.getvalue()


def test_print_after_unknown_pass_warns(sample: Graph) -> None:
    with pytest.warns(UserWarning, match="idnetity"):
        PassManager(PIPE, [PrintAfter(["idnetity"])])


def test_print_after_change_skips_unchanged(sample: Graph) -> None:
    buf = io.StringIO()
    _run(sample, PrintAfterChange(buf))
    assert "IR after mark-stage" in buf.getvalue()
    assert "IR after identity" not in buf.getvalue()


def test_dump_ir_writes_files_that_parse(sample: Graph, tmp_path: Path) -> None:
    dump = DumpIR(tmp_path / "ir")
    out = _run(sample, dump)
    names = sorted(p.name for p in (tmp_path / "ir").iterdir())
    assert names == ["00_input.mexir", "01_mark-stage.mexir", "02_identity.mexir"]
    assert parse_graph((tmp_path / "ir" / "00_input.mexir").read_text()) == sample
    assert parse_graph((tmp_path / "ir" / "02_identity.mexir").read_text()) == out
    assert (
        (tmp_path / "ir" / "01_mark-stage.mexir")
        .read_text()
        .startswith("// ----- IR after mark-stage -----\n")
    )


def test_timing_reports_each_pass(sample: Graph) -> None:
    buf = io.StringIO()
    timing = Timing(buf)
    _run(sample, timing)
    assert set(timing.seconds) == {"mark-stage", "identity"}
    assert all(s >= 0 for s in timing.seconds.values())
    report = timing.report()
    assert "mark-stage" in report and "identity" in report and "total" in report
    assert buf.getvalue() == report


def test_instruments_from_env(tmp_path: Path) -> None:
    assert instruments_from_env({}) == []
    env = {
        "MEXC_PRINT_IR_AFTER": "all",
        "MEXC_PRINT_IR_AFTER_CHANGE": "1",
        "MEXC_DUMP_IR": str(tmp_path),
        "MEXC_TIME_PASSES": "yes",
    }
    kinds = [type(i) for i in instruments_from_env(env)]
    assert kinds == [PrintAfterAll, PrintAfterChange, DumpIR, Timing]
    some = instruments_from_env({"MEXC_PRINT_IR_AFTER": "a, b", "MEXC_TIME_PASSES": "0"})
    assert len(some) == 1 and isinstance(some[0], PrintAfter)
    assert some[0].names == {"a", "b"}


def test_env_instruments_print_to_stderr(
    sample: Graph, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MEXC_PRINT_IR_AFTER", "mark-stage")
    monkeypatch.setenv("MEXC_TIME_PASSES", "1")
    _run(sample, *instruments_from_env())
    err = capsys.readouterr().err
    assert err.count("// ----- IR after ") == 1 and "pass timing" in err


def test_crashing_pass_gives_pass_error_with_reproducer(sample: Graph, tmp_path: Path) -> None:
    crash = Pass("crash", _crash, "raises")
    with pytest.raises(PassError) as info:
        _run(sample, passes=[BUMP, crash], reproducer_dir=tmp_path)
    e = info.value
    assert e.pass_name == "crash" and e.reproducer is not None
    assert "ZeroDivisionError: boom" in str(e) and e.reproducer in str(e)
    assert isinstance(e.__cause__, ZeroDivisionError)
    text = Path(e.reproducer).read_text()
    assert "pass 'crash'" in text
    assert parse_graph(text) == sample.with_attrs(stage=9)  # the crashing pass's input


def test_reproducer_defaults_to_a_temp_dir(sample: Graph) -> None:
    with pytest.raises(PassError) as info:
        _run(sample, passes=[Pass("crash", _crash, "raises")])
    assert info.value.reproducer is not None and Path(info.value.reproducer).is_file()


def test_user_errors_pass_through(sample: Graph) -> None:
    def unsupported(g: Graph, ctx: PassContext) -> Graph:
        raise UnsupportedOpError("no such op")

    with pytest.raises(UnsupportedOpError):
        _run(sample, passes=[Pass("lower", unsupported, "raises")])

    def bad_input(g: Graph, ctx: PassContext) -> Graph:
        raise InputError("labels out of range")

    with pytest.raises(InputError):
        _run(sample, passes=[Pass("check", bad_input, "raises")])


def test_pass_returning_non_graph(sample: Graph, tmp_path: Path) -> None:
    def returns_none(g: Graph, ctx: PassContext) -> Graph:
        return None  # type: ignore[return-value]

    with pytest.raises(PassError, match="returned NoneType"):
        _run(sample, passes=[Pass("bad", returns_none, "")], reproducer_dir=tmp_path)


def test_broken_output_names_the_pass(sample: Graph, tmp_path: Path) -> None:
    def dangling(g: Graph, ctx: PassContext) -> Graph:
        return dataclasses.replace(g, outputs=(("loss", Value(77)),))

    with pytest.raises(VerificationError) as info:
        _run(sample, passes=[BUMP, Pass("dangle", dangling, "")], reproducer_dir=tmp_path)
    e = info.value
    assert e.stage == "dangle" and e.reproducer is not None
    assert "after pass 'dangle'" in str(e) and e.reproducer in str(e)
    assert parse_graph(Path(e.reproducer).read_text()) == sample.with_attrs(stage=9)


def test_verify_each_off_skips_verification(sample: Graph) -> None:
    pm = PassManager([Pass("float", _float_relu, "", integer_only_after=True)], verify_each=False)
    pm.run(sample, PassContext())


def test_integer_only_sticks_after_the_flagged_pass(sample: Graph) -> None:
    mx_types = Pass("insert-mx-types", _identity, "", integer_only_after=True)
    float_again = Pass("float-again", _float_relu, "")
    _run(sample, passes=[Pass("float", _float_relu, ""), SAME])  # fine: no flag yet
    with pytest.raises(VerificationError) as info:
        _run(sample, passes=[mx_types, float_again])
    assert info.value.stage == "float-again" and info.value.rule == "integer-only"


def test_caps_stick_after_the_flagged_pass(sample: Graph) -> None:
    caps = Pass("assign-shift-caps", _identity, "", caps_after=True)
    with pytest.raises(VerificationError) as info:
        _run(sample, passes=[caps, Pass("drop-cap", _drop_cap, "")])
    assert info.value.stage == "drop-cap" and info.value.rule == "shift-cap"
    _run(sample, passes=[Pass("drop-cap", _drop_cap, ""), SAME])


def test_duplicate_pass_names_rejected() -> None:
    with pytest.raises(ValueError, match="unique"):
        PassManager([SAME, SAME])


def test_invalid_input_graph_is_reported(sample: Graph) -> None:
    bad = dataclasses.replace(sample, outputs=(("x", Value(500)),))
    with pytest.raises(VerificationError, match="in the input graph"):
        _run(bad)


def test_dump_ir_into_a_file_is_refused_before_the_pipeline(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    for where in (tmp_path / "afile", tmp_path / "afile" / "ir"):
        with pytest.raises(InputError, match="afile is a file"):
            DumpIR(where)
        with pytest.raises(InputError, match="afile is a file"):
            instruments_from_env({"MEXC_DUMP_IR": str(where)})
