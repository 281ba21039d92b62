"""The C backend: generated C training programs are bit-exact with the reference executor, on the
host (target="c", ctypes), as a standalone host build (also under ASan/UBSan) and on a Cortex-M3
under QEMU; they contain no float; their static RAM fits MCU budgets."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import mexc
from mexc.backends.c.mcu_sizes import STACK_MARGIN, measure
from mexc.backends.c.project import ICOUNT_SHIFT, MCU_BOARDS, check_ram
from mexc.data import load_digits, load_fashion_mnist
from tests.compiler.helpers import EXAMPLES

HAVE_ARM = shutil.which("arm-none-eabi-gcc") is not None
HAVE_QEMU = shutil.which("qemu-system-arm") is not None
needs_arm = pytest.mark.skipif(not HAVE_ARM, reason="arm-none-eabi-gcc not installed")
needs_qemu = pytest.mark.skipif(not (HAVE_ARM and HAVE_QEMU), reason="qemu-system-arm missing")
SOFT_FLOAT = re.compile(r"__aeabi_[fd]\w*|__\w*[sd]f\d?\b|__float\w*|__fix\w*")
FPU_INSN = re.compile(r"\tv(?:add|sub|mul|div|mla|mls|ldr|str|mov|cvt|cmp|sqrt|abs|neg)\b")
C_SUPPORTED = ("DigitsCNN", "FashionCNN", "MLP")


def _model(name: str, batch: int, target: str = "reference") -> mexc.Program:
    cls, shape = EXAMPLES[name]
    torch.manual_seed(0)
    opt = mexc.SGD(
        lr=0.05,
        momentum=0.9,
        weight_decay=5e-4,
        schedule=mexc.Cosine(total_steps=40, warmup_steps=4),
    )
    return mexc.compile(cls(), (torch.zeros(batch, *shape),), optimizer=opt, target=target)


def _data(name: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    x, y = load_fashion_mnist("train") if EXAMPLES[name][1][-1] == 28 else load_digits("train")
    return x[:n], y[:n]


def _make(project: Path, target: str, **env: str) -> str:
    res = subprocess.run(
        ["make", "-s", "-C", str(project), target, *[f"{k}={v}" for k, v in env.items()]],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return res.stdout + res.stderr  # QEMU's semihosting console writes to stderr


def _symbols(elf: Path) -> str:
    """The image's symbol table (`arm-none-eabi-nm`)."""
    return subprocess.run(
        ["arm-none-eabi-nm", str(elf)], capture_output=True, text=True, check=True
    ).stdout


def _state_line(out: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.startswith("STATE ")]
    assert lines, out[-2000:]
    return lines[-1].split()[1]


@pytest.mark.parametrize("name", C_SUPPORTED)
def test_host_c_target_is_bit_exact_with_reference(name: str) -> None:
    batch = 8
    x, y = _data(name, 4 * batch)
    ref, c = _model(name, batch), _model(name, batch, target="c")
    assert c.state_checksum() == ref.state_checksum()
    for _ in range(3):  # 12 steps, both through the same replay order
        ref.replay((x, y), 4)
        c.replay((x, y), 4)
        assert c.state_checksum() == ref.state_checksum()
    assert np.array_equal(c.predict(x), ref.predict(x))


def test_two_programs_of_the_same_c_keep_their_own_state() -> None:
    """Equal models build the same library; each program loads its own copy, whose static
    state the other's steps do not touch (dlopen of one path shared them)."""
    x, y = _data("MLP", 16)
    refs = [_model("MLP", 8), _model("MLP", 8)]
    cs = [_model("MLP", 8, target="c"), _model("MLP", 8, target="c")]
    for _ in range(2):  # stepped in turn, each on its own half of the data
        for k, (ref, c) in enumerate(zip(refs, cs)):
            ref.step(x[8 * k : 8 * k + 8], y[8 * k : 8 * k + 8])
            c.step(x[8 * k : 8 * k + 8], y[8 * k : 8 * k + 8])
    assert refs[0].state_checksum() != refs[1].state_checksum()
    assert [c.state_checksum() for c in cs] == [r.state_checksum() for r in refs]


def test_a_second_program_of_a_read_only_cache_loads_from_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where no copy can be written beside the cached library, the copy is a memfd."""
    from mexc.backends.c import host

    def read_only(*args: object, **kwargs: object) -> None:
        raise PermissionError("read-only file system")

    x, y = _data("MLP", 8)
    ref, first = _model("MLP", 8), _model("MLP", 8, target="c")
    monkeypatch.setattr(host.tempfile, "mkstemp", read_only)
    second = _model("MLP", 8, target="c")
    for prog in (ref, first, second, second):
        prog.step(x, y)
    assert first.state_checksum() == ref.state_checksum() != second.state_checksum()
    ref.step(x, y)
    assert second.state_checksum() == ref.state_checksum()


def test_unsupported_op_in_c_backend_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from mexc.ir import Op
    from mexc.ops import REGISTRY

    # every op of the reference executor has a C lowering now: take one away to see the error
    d = REGISTRY[Op.GLOBAL_AVGPOOL]
    lower = {k: v for k, v in d.lower.items() if k != "c"}
    monkeypatch.setitem(REGISTRY, Op.GLOBAL_AVGPOOL, dataclasses.replace(d, lower=lower))
    with pytest.raises(
        mexc.UnsupportedOpError, match="C backend has no lowering for op global_avgpool"
    ):
        _model("SmallResNet", 2, target="c")


@pytest.fixture(scope="module")
def digits_project(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    prog = _model("DigitsCNN", 8)
    data = _data("DigitsCNN", 64)
    out = mexc.export(prog, tmp_path_factory.mktemp("digits"), data=data, steps=10)
    prog.replay(data, 10)
    return out, prog.state_checksum()


@pytest.fixture(scope="module")
def fashion_project(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    prog = _model("FashionCNN", 4)
    data = _data("FashionCNN", 16)
    out = mexc.export(prog, tmp_path_factory.mktemp("fashion"), data=data, steps=4)
    prog.replay(data, 4)
    return out, prog.state_checksum()


def test_host_build_matches_reference_under_sanitizers(digits_project: tuple[Path, str]) -> None:
    project, expected = digits_project
    flags = "-O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all"
    (project / "train_host").unlink(missing_ok=True)  # rebuild with the sanitizers
    out = _make(project, "run-host", HOST_CFLAGS=flags)
    assert _state_line(out) == expected
    assert len([ln for ln in out.splitlines() if ln.startswith("step ")]) == 10


@needs_qemu
@pytest.mark.mcu
@pytest.mark.parametrize("which", ["digits_project", "fashion_project"])
def test_qemu_cortex_m3_matches_reference(which: str, request: pytest.FixtureRequest) -> None:
    project, expected = request.getfixturevalue(which)
    out = _make(project, "run-qemu")
    assert _state_line(out) == expected
    # every step line carries its instruction count, and equal steps cost about the same
    insns = [int(m) for m in re.findall(r"^step \d+ loss -?[\d.]+ insns (\d+)$", out, re.M)]
    assert len(insns) == len([ln for ln in out.splitlines() if ln.startswith("step ")]) > 0
    assert min(insns) > 10**6 and max(insns) < 1.05 * min(insns), insns


COUNT_LOOP = r"""
#include <stdint.h>
void mexc_io_puts(const char *s);
void mexc_io_count_start(void);
uint64_t mexc_io_count_read(void);
static const uint32_t lengths[3] = {1000u, 200000u, 60000000u};
int main(void)
{
    char line[24];
    uint32_t i, j;
    for (i = 0; i < 3u; i++) {
        uint32_t n = lengths[i], c;
        mexc_io_count_start();
        __asm__ volatile("1: subs %0, #1\n bne 1b" : "+r"(n)); /* 2 instructions a turn */
        c = (uint32_t)mexc_io_count_read();
        for (j = 0; j < 10u; j++) {
            line[9u - j] = (char)('0' + c % 10u);
            c /= 10u;
        }
        line[10] = '\n';
        line[11] = 0;
        mexc_io_puts(line);
    }
    return 0;
}
"""


@needs_qemu
@pytest.mark.mcu
@pytest.mark.parametrize("board", list(MCU_BOARDS))
def test_instruction_counts_count_instructions(board: str, tmp_path: Path) -> None:
    """The counting method (SysTick on the core clock of QEMU's -icount time): a loop of 2
    instructions a turn reads as 2 per turn, to within one tick and the calls, also past a
    wrap of the 24-bit counter (120M instructions: 20M ticks at netduinoplus2's 168 MHz)."""
    spec = MCU_BOARDS[board]
    rt = Path(mexc.__file__).parent / "backends" / "c" / "runtime" / "board"
    (tmp_path / "loop.c").write_text(COUNT_LOOP)
    elf = tmp_path / "loop.elf"
    cpu = [f"-mcpu={spec.cpu}", "-mthumb", "-mfloat-abi=soft", "-O2", "-ffreestanding"]
    flags = [
        f"-DMEXC_SYSTICK_HZ={spec.clock_hz}u",
        f"-DMEXC_ICOUNT_SHIFT={ICOUNT_SHIFT}",
    ]
    subprocess.run(
        ["arm-none-eabi-gcc", *cpu, *flags, "-nostdlib", "-T", str(rt / spec.linker_script)]
        + [str(rt / "cortex_m_semihosting.c"), str(tmp_path / "loop.c"), "-lgcc", "-o", str(elf)],
        check=True,
    )
    run = subprocess.run(
        ["qemu-system-arm", "-M", spec.machine, "-cpu", spec.cpu, "-nographic", "-monitor"]
        + ["none", "-icount", f"shift={ICOUNT_SHIFT}", "-semihosting-config"]
        + ["enable=on,target=native", "-kernel", str(elf)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    counts = [int(v) for v in (run.stdout + run.stderr).split()]
    tick = -(-(10**9) // (spec.clock_hz << ICOUNT_SHIFT))  # instructions a tick, about
    for turns, got in zip((1000, 200000, 60000000), counts, strict=True):
        assert abs(got - 2 * turns) <= tick + 50, (turns, got)


@needs_qemu
@pytest.mark.mcu
def test_stm32f405_board_matches_reference(tmp_path: Path) -> None:
    """board="netduinoplus2": the STM32F405's linker script (flash at 0x08000000, 128 KB of
    SRAM) and QEMU's Netduino Plus 2 (Cortex-M4): the same STATE as the reference, and the
    program's RAM, stack included, within the chip's SRAM."""
    prog = _model("DigitsCNN", 8)
    data = _data("DigitsCNN", 64)
    out = mexc.export(prog, tmp_path, data=data, steps=10, board="netduinoplus2")
    prog.replay(data, 10)
    assert "QEMU_MACHINE := netduinoplus2" in (out / "Makefile").read_text()
    assert _state_line(_make(out, "run-qemu")) == prog.state_checksum()
    sizes = measure(out, "cortex-m4")
    assert 0 < sizes.ram <= MCU_BOARDS["netduinoplus2"].ram, sizes


@needs_qemu
@pytest.mark.mcu
@pytest.mark.parametrize("trainable", [None, "last:1"])
def test_fashion_cnn_trains_on_the_stm32f405(trainable: str | None, tmp_path: Path) -> None:
    """The Fashion CNN at batch 4, every layer trained or (sparse update) only its classifier,
    in the STM32F405's 128 KB of SRAM, stack included, with the same STATE as the reference."""
    cls, shape = EXAMPLES["FashionCNN"]
    torch.manual_seed(0)
    prog = mexc.compile(cls(), (torch.zeros(4, *shape),), trainable=trainable)
    data = _data("FashionCNN", 32)
    out = mexc.export(prog, tmp_path, data=data, steps=6, board="netduinoplus2")
    prog.replay(data, 6)
    assert _state_line(_make(out, "run-qemu")) == prog.state_checksum()
    sizes = measure(out, "cortex-m4")
    assert 0 < sizes.ram <= 128 * 1024, sizes


@needs_qemu
@pytest.mark.mcu
def test_adamw_on_cortex_m4_matches_reference(tmp_path: Path) -> None:
    """Integer AdamW (docs/numerics.md section 12b) in the exported project, under QEMU's
    mps2-an386 (Cortex-M4): the same STATE as the reference after 10 steps, and no float
    anywhere in the image (the runtime's AdamW has an isqrt and a division per element)."""
    cls, shape = EXAMPLES["DigitsCNN"]
    torch.manual_seed(0)
    opt = mexc.AdamW(lr=3e-3, schedule=mexc.Cosine(total_steps=40, warmup_steps=4))
    prog = mexc.compile(cls(), (torch.zeros(8, *shape),), optimizer=opt)
    data = _data("DigitsCNN", 64)
    out = mexc.export(prog, tmp_path, data=data, steps=10, board="mps2-an386")
    prog.replay(data, 10)
    assert _state_line(_make(out, "run-qemu")) == prog.state_checksum()
    symbols = _symbols(out / "train_cortex-m4.elf")
    assert "mexc_adamw_update" in symbols and not SOFT_FLOAT.findall(symbols)


@needs_qemu
@pytest.mark.mcu
def test_channel_exponents_train_on_qemu_as_in_the_reference(
    tmp_path: Path, digits_project: tuple[Path, str]
) -> None:
    """B = 4 with channel exponents (on by default below 8 bits, docs/numerics.md section 5) in
    the exported project: the reference's STATE under QEMU's Cortex-M3, a Cortex-M0 image that
    links without libc and uses no float, and in RAM the 8-bit program's bytes plus one word
    per channel of the widest result or weight (its maximum, then its shifts)."""
    cls, shape = EXAMPLES["DigitsCNN"]
    torch.manual_seed(0)
    opt = mexc.SGD(lr=0.02, momentum=0.9, weight_decay=5e-4)
    prog = mexc.compile(cls(), (torch.zeros(8, *shape),), optimizer=opt, bits=4)
    assert prog.options.channel_exponents
    data = _data("DigitsCNN", 48)
    out = mexc.export(prog, tmp_path, data=data, steps=6)
    assert "mexc_chan_t" in (out / "model.c").read_text()
    prog.replay(data, 6)
    assert _state_line(_make(out, "run-qemu")) == prog.state_checksum()
    _make(out, "mcu", CPU="cortex-m0")
    symbols = _symbols(out / "train_cortex-m0.elf")
    assert "mexc_channel_shifts" in symbols and not SOFT_FLOAT.findall(symbols)
    words = re.findall(r"static uint32_t mexc_ch\d_word\[(\d+)\];", (out / "model.c").read_text())
    _make(digits_project[0], "mcu", CPU="cortex-m0")
    plain = measure(digits_project[0], "cortex-m0")  # the same CNN and batch at 8 bits
    assert 0 < measure(out, "cortex-m0").bss - plain.bss <= 4 * sum(map(int, words)) + 16


@needs_arm
@pytest.mark.mcu
@pytest.mark.parametrize("cpu", ["cortex-m0", "cortex-m3", "cortex-m4"])
def test_no_float_anywhere(cpu: str, digits_project: tuple[Path, str]) -> None:
    project, _ = digits_project
    sources = [
        *(project / f for f in ("model.c", "kernels.c", "kernels.h", "data.c")),
        *project.glob("runtime/**/*.[ch]"),
    ]
    for src in sources:
        text = re.sub(r"/\*.*?\*/", "", src.read_text(), flags=re.S)
        assert not re.search(r"\b(float|double)\b", text), src
    _make(project, "mcu", CPU=cpu)
    elf = project / f"train_{cpu}.elf"
    symbols = _symbols(elf)
    assert not SOFT_FLOAT.findall(symbols)
    helpers = set(re.findall(r"__aeabi_\w+", symbols))
    assert helpers <= {
        "__aeabi_uidiv",
        "__aeabi_uidivmod",
        "__aeabi_uldivmod",
        "__aeabi_lmul",
        "__aeabi_llsl",
        "__aeabi_llsr",
        "__aeabi_lasr",
        "__aeabi_idiv0",
        "__aeabi_ldiv0",
    }, helpers
    disasm = subprocess.run(
        ["arm-none-eabi-objdump", "-d", str(elf)], capture_output=True, text=True, check=True
    ).stdout
    assert not FPU_INSN.search(disasm)
    attrs = subprocess.run(
        ["arm-none-eabi-readelf", "-A", str(elf)], capture_output=True, text=True, check=True
    ).stdout
    assert "Tag_FP_arch" not in attrs


class _TinyMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 8), torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _tiny_project(out: Path, board: str, **kw: object) -> tuple[Path, str]:
    """A 16-8-4 MLP at batch 2 exported for `board`, and its reference STATE after 2 steps."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 16)).astype(np.float32), rng.integers(0, 4, 4)
    torch.manual_seed(0)
    prog = mexc.compile(_TinyMLP(), (torch.tensor(x[:2]),), seed=0, **kw)  # type: ignore[arg-type]
    project = mexc.export(prog, out, data=(x, y), steps=2, board=board)
    prog.replay((x, y), 2)
    return project, prog.state_checksum()


@needs_qemu
@pytest.mark.mcu
def test_cortex_m0_links_the_memcpy_gcc_calls(tmp_path: Path) -> None:
    """GCC lowers a struct copy (AdamW below 8 bits: `mexc_ctx_t fctx = ctx;`) to a memcpy call
    on ARMv6-M even under -ffreestanding -fno-builtin; the board startup defines memcpy,
    memset and memmove for the -nostdlib image. The Cortex-M0 image (run on QEMU's
    Cortex-M3, a superset) and the host build (libc's) end at the reference's STATE."""
    project, state = _tiny_project(tmp_path, "mps2-an385", optimizer=mexc.AdamW(lr=1e-2), bits=4)
    assert "mexc_ctx_t fctx = ctx;" in (project / "model.c").read_text()
    out = _make(project, "run-qemu", CPU="cortex-m0", QEMU_CPU="cortex-m3")
    assert _state_line(out) == state
    symbols = _symbols(project / "train_cortex-m0.elf")
    assert re.search(r" T memcpy$", symbols, re.M) and not SOFT_FLOAT.findall(symbols)
    assert _state_line(_make(project, "run-host")) == state


@needs_arm
@pytest.mark.mcu
def test_mcu_build_refuses_an_image_whose_stack_does_not_fit(tmp_path: Path) -> None:
    """`make mcu` checks .data + .bss + the call graph's stack bound + STACK_MARGIN (the
    exception frame) against the board's RAM (runtime/board/ram_check.awk): at the boundary,
    moved with STACK_MARGIN, the image fits with 0 bytes free, one byte more and the build fails,
    naming the figures, and leaves no image. The stack bound is mcu_sizes.measure's."""
    project, _ = _tiny_project(tmp_path, "netduinoplus2")
    line = _make(project, "mcu")
    m = re.search(r"RAM: (\d+) B of (\d+): \.data\+\.bss (\d+), stack bound (\d+), ", line)
    assert m, line
    need, ram, static, stack = map(int, m.groups())
    sizes = measure(project, "cortex-m4")
    assert (ram, static, stack) == (
        MCU_BOARDS["netduinoplus2"].ram,
        sizes.data + sizes.bss,
        sizes.stack,
    )
    elf = project / "train_cortex-m4.elf"
    margin = STACK_MARGIN + ram - need
    elf.unlink()
    assert "(0 B free)" in _make(project, "mcu", STACK_MARGIN=str(margin))
    elf.unlink()
    res = subprocess.run(
        ["make", "-s", "-C", str(project), "mcu", f"STACK_MARGIN={margin + 1}"],
        capture_output=True,
        text=True,
    )
    assert res.returncode != 0 and not elf.exists()
    assert f"does not fit the board's RAM, 1 B over. RAM: {ram + 1} B of {ram}" in res.stderr
    assert f"stack bound {stack}, " in res.stderr and "Lower the batch size" in res.stderr
    check = check_ram(project)
    assert check is not None and check.fits and check.text.startswith("RAM: ")


@needs_arm
@pytest.mark.mcu
def test_ram_budgets(digits_project: tuple[Path, str], fashion_project: tuple[Path, str]) -> None:
    # the targets of docs/mcu.md: the digits CNN at batch 8 in 32 KiB, the Fashion CNN at batch
    # 4 in 128 KiB, every layer trained (docs/benchmarks.md has the measured bytes)
    for project, budget in ((digits_project[0], 32 * 1024), (fashion_project[0], 128 * 1024)):
        _make(project, "mcu", CPU="cortex-m3")
        sizes = measure(project, "cortex-m3")
        assert 0 < sizes.stack < 4096
        assert sizes.ram <= budget, (project, sizes)


class _NormsAndDropout(torch.nn.Module):
    """Statics beside the arena: a LayerNorm's and a batch norm's saved statistics, a dropout
    mask, and under last:1 a frozen LayerNorm's xhat and a mask nothing reads."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc1 = torch.nn.Linear(4 * 8 * 8, 32)
        self.ln = torch.nn.LayerNorm(32)
        self.drop = torch.nn.Dropout(0.1)
        self.fc2 = torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x))).flatten(1)
        return self.fc2(self.drop(torch.relu(self.ln(self.fc1(h)))))


@needs_arm
@pytest.mark.parametrize("trainable", [None, "last:1"])
def test_reported_static_ram_is_what_the_mcu_image_declares(
    trainable: str | None, tmp_path: Path
) -> None:
    """memory_report's bytes of target="c" against the .data + .bss of model.c compiled for a
    Cortex-M3 (the kernels' own statics were missing from the report)."""
    torch.manual_seed(0)
    x = torch.randn(4, 1, 8, 8)
    prog = mexc.compile(_NormsAndDropout(), (x,), target="c", trainable=trainable)
    project = mexc.export(prog, tmp_path / "p", data=(x.numpy(), np.arange(4)), steps=1)
    obj = tmp_path / "model.o"
    subprocess.run(
        ["arm-none-eabi-gcc", "-mcpu=cortex-m3", "-mthumb", "-O2", "-ffreestanding",
         f"-I{project}", f"-I{project / 'runtime'}", "-c", str(project / "model.c"),
         "-o", str(obj)],
        check=True,
    )  # fmt: skip
    symbols = subprocess.run(
        ["arm-none-eabi-nm", "-S", str(obj)], capture_output=True, text=True, check=True
    ).stdout
    rows = [line.split() for line in symbols.splitlines()]
    # the symbols' own sizes: the sections add a few bytes of alignment between int8 arrays
    ram = sum(int(r[1], 16) for r in rows if len(r) == 4 and r[2] in "bBdD")
    assert prog.allocated_bytes()["host"] == ram


def _mlp(opt: mexc.SGD | mexc.AdamW) -> mexc.Program:
    torch.manual_seed(0)
    cls, shape = EXAMPLES["MLP"]
    return mexc.compile(cls(), (torch.zeros(8, *shape),), optimizer=opt, target="reference")


@pytest.mark.parametrize(
    ("opt", "exact"),
    [
        (mexc.AdamW(lr=1e-3), False),  # its bias corrections change at every step
        (mexc.SGD(lr=0.05, schedule=mexc.Cosine(total_steps=5)), False),  # still decaying
        (mexc.SGD(lr=0.05, schedule=mexc.Step(milestones=(2,), gamma=0.5)), True),
    ],
)
def test_a_step_past_the_rate_table_is_refused_unless_the_table_holds_there(
    opt: mexc.SGD | mexc.AdamW, exact: bool
) -> None:
    """A device caller may step past the steps it exported: the step takes the table's last
    scalars only where the schedule is constant from there, and otherwise returns
    MEXC_PAST_TABLE with the state unchanged (it took the last entry's, silently)."""
    from mexc.backends.c.host import CProgram

    x, y = _data("MLP", 8)
    ref = _mlp(opt)
    c = CProgram(_mlp(opt), steps_hint=3)
    xm, xe = c.boundary(np.asarray(x, np.float32))
    ys = np.ascontiguousarray(y, np.int32)
    for k in range(4):
        before = c.state_checksum()
        loss = c._lib.mexc_model_step(k, xm.ctypes.data, xe, ys.ctypes.data)
        c._pull_state()
        if k < 3 or exact:
            ref.step(x, y)
            assert loss != -(2**31) + 1 and c.state_checksum() == ref.state_checksum()
        else:
            assert loss == -(2**31) + 1 and c.state_checksum() == before
