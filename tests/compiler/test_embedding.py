"""Models whose input is integer token ids read through embedding tables (nn.Embedding,
F.embedding; docs/numerics.md §7b, "Embedding lookup"): against torch and autograd, bit-exact on
reference, llvm, C and the CUDA emulator; ids out of range, float input, ids read as an
activation and the embedding options mexc cannot train refused with a clear error."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import mexc
from mexc.errors import InputError, UnsupportedOpError
from mexc.ir import Op
from tests.compiler.helpers import (
    assert_cuda_source_trains_bit_exact,
    assert_logits_match_torch,
    assert_trains_bit_exact_on_llvm_and_c,
    cosine,
    float_gradients,
    integer_gradients,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))
from test_cuda_products import needs_cuda_tools  # noqa: E402

VOCAB, T, D = 40, 8, 16


class TokenEncoder(nn.Module):
    """Token and positional tables (the positions looked up at torch.arange(T)), one
    nn.TransformerEncoderLayer, the mean over tokens, a linear head; id 0 pads."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, D, padding_idx=0)
        self.positions = nn.Embedding(T, D)
        self.encoder = nn.TransformerEncoderLayer(D, 4, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(D, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        at = torch.arange(ids.shape[1], device=ids.device)
        return self.head(self.encoder(self.tokens(ids) + self.positions(at)).mean(1))


class BagOfWords(nn.Module):
    """F.embedding of a parameter table (the ids cast as models do, a no-op), the mean over
    tokens, ReLU, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(VOCAB, D))
        self.head = nn.Linear(D, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(nn.functional.embedding(ids.long(), self.table).mean(1)))


class TiedNextToken(nn.Module):
    """Predicts the next id from the last position, its output layer the token table itself
    (tied weights: the table's gradient is the sum of both readers')."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, D)
        self.mix = nn.Linear(D, D)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.tokens(ids).mean(1)))
        return nn.functional.linear(h, self.tokens.weight)


class CausalLM(nn.Module):
    """A language model: token (id 0 pads) and position tables, one causal pre-norm encoder
    layer (the square subsequent mask), a linear head over the vocabulary at every position;
    logits [N, V, T], classes on axis 1 as F.cross_entropy reads them (a label per position)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, D, padding_idx=0)
        self.positions = nn.Embedding(T, D)
        self.block = nn.TransformerEncoderLayer(
            D, 4, 32, dropout=0.0, batch_first=True, norm_first=True
        )
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(T))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        at = torch.arange(ids.shape[1], device=ids.device)
        h = self.block(self.tokens(ids) + self.positions(at), src_mask=self.mask, is_causal=True)
        return self.head(h).transpose(1, 2)


MODELS = {"encoder": TokenEncoder, "bag": BagOfWords, "tied": TiedNextToken, "lm": CausalLM}
LABELS = {"tied": (), "lm": (T,)}  # labels per sample beyond one
CLASSES = {"tied": VOCAB, "lm": VOCAB}


def batch(
    n: int = 4, seed: int = 0, classes: int = 10, labels: tuple[int, ...] = ()
) -> tuple[np.ndarray, np.ndarray]:
    """Ids in [0, VOCAB) (some 0: padding), labels in [0, classes) of shape (n, *labels)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, VOCAB, (n, T)), rng.integers(0, classes, (n, *labels))


def batch_of(name: str, n: int = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    return batch(n, seed, CLASSES.get(name, 10), LABELS.get(name, ()))


def compiled(name: str, target: str = "reference", n: int = 4, **options: object) -> mexc.Program:
    torch.manual_seed(0)
    model = MODELS[name]()
    ids, _ = batch(n)
    return mexc.compile(model, (torch.from_numpy(ids),), target=target, **options)


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_torch(name: str) -> None:
    torch.manual_seed(0)
    model = MODELS[name]()
    ids, _ = batch()
    prog = mexc.compile(model, (torch.from_numpy(ids),), rounding="nearest")
    assert prog.vocab == VOCAB
    assert prog.graph.nodes_of(Op.EMBEDDING)
    assert not prog.graph.nodes_of(Op.QUANTIZE)  # ids are never quantized
    assert_logits_match_torch(model, prog, batch(seed=1)[0])


def test_the_table_gradients_match_autograd_and_the_padding_row_gets_none() -> None:
    torch.manual_seed(0)
    model = TokenEncoder()
    ids, y = batch(8)
    prog = mexc.compile(model, (torch.from_numpy(ids),), rounding="nearest")
    got = integer_gradients(prog, ids, y)
    want = float_gradients(model, prog, ids, y)
    for name in ("tokens.weight", "positions.weight", "head.weight"):
        assert cosine(got[name], want[name]) >= 0.99, name
    assert (got["tokens.weight"][0] == 0).all() and (want["tokens.weight"][0] == 0).all()
    unseen = sorted(set(range(VOCAB)) - set(ids.ravel().tolist()))
    assert unseen and (got["tokens.weight"][unseen] == 0).all()


def test_a_tied_table_gets_the_sum_of_both_gradients() -> None:
    torch.manual_seed(0)
    model = TiedNextToken()
    ids, y = batch_of("tied", 8)
    prog = mexc.compile(model, (torch.from_numpy(ids),), rounding="nearest")
    assert prog.num_classes == VOCAB
    assert prog.graph.nodes_of(Op.PARAM_GRAD_SUM)
    got = integer_gradients(prog, ids, y)["tokens.weight"]
    want = float_gradients(model, prog, ids, y)["tokens.weight"]
    assert cosine(got, want) >= 0.99


class TiedThroughAttribute(TiedNextToken):
    """TiedNextToken's head written as a product with the table turned by an attribute or a
    method (GPT-style code writes h @ self.wte.weight.T)."""

    def __init__(self, turn: str) -> None:
        super().__init__()
        self.turn = turn

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.tokens(ids).mean(1)))
        w = self.tokens.weight
        turned = {"T": w.T, "mT": w.mT, "t": w.t(), "transpose": w.transpose(-1, -2)}
        return h @ turned[self.turn]


@pytest.mark.parametrize("turn", ["T", "mT", "t", "transpose"])
def test_a_tied_table_read_turned_is_the_head_weight(turn: str) -> None:
    """Each form reads the same parameter (one table, its gradient the sum of both readers')
    and trains as F.linear with it does, to the bit."""
    ids, y = batch_of("tied", 8)
    torch.manual_seed(0)
    linear = mexc.compile(TiedNextToken(), (torch.from_numpy(ids),))
    torch.manual_seed(0)
    model = TiedThroughAttribute(turn)
    prog = mexc.compile(model, (torch.from_numpy(ids),))
    assert sorted(prog.state) == sorted(linear.state) and prog.graph.nodes_of(Op.PARAM_GRAD_SUM)
    for _ in range(2):
        assert prog.step(ids, y) == linear.step(ids, y)
    assert prog.state_checksum() == linear.state_checksum()
    got = integer_gradients(prog, ids, y)["tokens.weight"]
    assert cosine(got, float_gradients(model, prog, ids, y)["tokens.weight"]) >= 0.99


class HeadsThroughMT(nn.Module):
    """A per-head projection kept as one (H, E, D) parameter, read as x @ w.mT."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 6, 8) * 0.3)
        self.head = nn.Linear(2 * 3 * 6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x.unsqueeze(1) @ self.w.mT)  # [N, 2, 3, 6]
        return self.head(h.flatten(1))


def test_a_batched_parameter_read_through_mT_follows_autograd() -> None:
    torch.manual_seed(0)
    model = HeadsThroughMT()
    x = np.random.default_rng(0).standard_normal((8, 3, 8)).astype(np.float32)
    y = np.arange(8) % 10
    prog = mexc.compile(model, (torch.from_numpy(x),), rounding="nearest")
    assert_logits_match_torch(model, prog, x)
    got, want = integer_gradients(prog, x, y), float_gradients(model, prog, x, y)
    assert cosine(got["w"], want["w"]) >= 0.99


def test_a_language_model_learns_a_label_per_position_as_cross_entropy_reads_them() -> None:
    """[N, V, T] logits against [N, T] labels: the loss is F.cross_entropy's mean over every
    position, its gradients autograd's; accuracy counts positions."""
    torch.manual_seed(0)
    model = CausalLM()
    ids, y = batch_of("lm", 8)
    prog = mexc.compile(model, (torch.from_numpy(ids),), rounding="nearest")
    assert (prog.num_classes, prog.label_shape) == (VOCAB, (T,))
    assert_logits_match_torch(model, prog, ids)
    got = integer_gradients(prog, ids, y)
    want = float_gradients(model, prog, ids, y)
    for name in ("tokens.weight", "positions.weight", "head.weight"):
        assert cosine(got[name], want[name]) >= 0.99, name
    logits = torch.from_numpy(prog.logits(ids))
    torch_loss = float(nn.functional.cross_entropy(logits, torch.from_numpy(y)))
    assert prog.step(ids, y) == pytest.approx(torch_loss, abs=0.05)
    predicted = prog.predict(ids)
    assert predicted.shape == (8, T)
    assert prog.evaluate(ids, y) == pytest.approx(float(np.mean(predicted == y)))
    with pytest.raises(InputError, match=r"expected \[8, 8\].*transpose\(1, 2\)"):
        prog.step(ids, y[:, 0])


# the language model's ops are the encoder's (padding_idx, positions, attention) but for the
# mean over tokens, and its head is per position; the tied table adds the gradient sum
@pytest.mark.parametrize("name", ["tied", "lm"])
def test_trains_bit_exact_on_reference_llvm_and_c(name: str) -> None:
    assert_trains_bit_exact_on_llvm_and_c(
        compiled(name), lambda target: compiled(name, target), batch_of(name)
    )


@needs_cuda_tools
def test_trains_bit_exact_from_its_cuda_source(tmp_path: Path) -> None:
    # 17 sequences of 8 positions: 136 loss rows, divided with 8 extra bits
    # (kernels.loss.grad_shift)
    assert_cuda_source_trains_bit_exact(compiled("lm", n=17), tmp_path)


def test_training_on_ids_learns() -> None:
    """The label is whether id 1 occurs: 30 steps take the loss well below its start."""
    prog = compiled("bag", optimizer=mexc.SGD(lr=0.2, momentum=0.9))
    rng = np.random.default_rng(3)
    losses = []
    for _ in range(30):
        ids = rng.integers(2, VOCAB, (4, T))
        y = rng.integers(0, 2, 4)
        ids[y == 1, 0] = 1
        losses.append(prog.step(ids, y))
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5])


def test_ids_outside_the_table_are_refused_and_the_state_is_unchanged() -> None:
    prog = compiled("encoder", "llvm")
    ids, y = batch()
    before = prog.state_checksum()
    ids[1, 2] = VOCAB
    with pytest.raises(InputError, match=r"outside \[0, 39\].*40 rows"):
        prog.step(ids, y)
    ids[1, 2] = -1
    with pytest.raises(InputError, match="outside"):
        prog.logits(ids)
    with pytest.raises(InputError, match="integer ids"):
        prog.step(ids.astype(np.float32), y)
    assert prog.state_checksum() == before


class NoTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(1, 10))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(ids.shape[0], 10) * 1.0


class PaddedPositions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, D)
        self.positions = nn.Embedding(T, D, padding_idx=0)
        self.head = nn.Linear(D, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        at = torch.arange(ids.shape[1], device=ids.device)
        return self.head((self.tokens(ids) + self.positions(at)).mean(1))


class OneTable(nn.Module):
    """A token table (`table`: its options) and a head over the mean of what `features` makes
    of the ids; each refused model below differs only there."""

    def __init__(self, features: Any = None, **table: Any) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, D, **table)
        self.head = nn.Linear(D, 10)
        self.features = features or (lambda m, ids: m.tokens(ids))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(self, ids).mean(1))


def ReadsIds() -> nn.Module:  # noqa: N802 - named as the models it stands beside
    return OneTable(lambda m, ids: m.tokens(ids) * ids.float()[..., None])


def MaxNorm() -> nn.Module:  # noqa: N802
    return OneTable(max_norm=1.0)


def SlicedIds() -> nn.Module:  # noqa: N802
    return OneTable(lambda m, ids: m.tokens(ids[:, 1:]))


def NarrowedIds() -> nn.Module:  # noqa: N802 - int8 wraps ids above 127
    return OneTable(lambda m, ids: m.tokens(ids.to(torch.int8).long()))


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (ReadsIds, r"node 'float\w*' \(call_method float\) .*integer input \(token ids\)"),
        (MaxNorm, r"max_norm"),
        (SlicedIds, r"node 'getitem' .*integer input \(token ids\)"),
        (NarrowedIds, r"node 'to' .*casts the token ids to torch.int8.*torch.long"),
        (NoTable, r"node 'ids' .*no embedding table reads"),
        (PaddedPositions, r"padding row \(0, padding_idx\) at fixed indices"),
    ],
)
def test_what_mexc_cannot_train_is_refused_by_node(
    model: Callable[[], nn.Module], message: str
) -> None:
    ids, _ = batch()
    with pytest.raises(UnsupportedOpError, match=message):
        mexc.compile(model(), (torch.from_numpy(ids),))


def test_the_c_step_refuses_ids_outside_the_vocabulary_before_it_changes_anything() -> None:
    """A device calls mexc_model_step without the host's check: an id outside the tables
    returns MEXC_BAD_IDS (INT32_MIN) and leaves the state as it was."""
    import ctypes

    prog = compiled("lm", "c")
    ids, y = batch_of("lm")
    labels = np.ascontiguousarray(y.reshape(-1), np.int32)
    lib = prog._lib  # type: ignore[attr-defined]
    lib.mexc_model_checksum.restype = ctypes.c_uint64
    before = lib.mexc_model_checksum()
    bad = np.ascontiguousarray(ids, np.int32)
    bad[3, 5] = VOCAB
    assert lib.mexc_model_step(0, bad.ctypes.data, 0, labels.ctypes.data) == -(2**31)
    assert lib.mexc_model_checksum() == before
    good = np.ascontiguousarray(ids, np.int32)
    assert lib.mexc_model_step(0, good.ctypes.data, 0, labels.ctypes.data) > 0
    assert lib.mexc_model_checksum() != before


@pytest.mark.parametrize("name", ["encoder", "lm"])
def test_a_checkpoint_resumes_bit_exact_on_another_target(tmp_path: Path, name: str) -> None:
    prog = compiled(name)
    ids, y = batch_of(name)
    prog.step(ids, y)
    prog.save(tmp_path / "ck")
    resumed = mexc.load(tmp_path / "ck", target="llvm")
    assert (resumed.vocab, resumed.label_shape) == (VOCAB, LABELS.get(name, ()))
    for p in (prog, resumed):
        p.step(ids, y)
    assert resumed.state_checksum() == prog.state_checksum()
    assert np.array_equal(resumed.logits(ids), prog.logits(ids))


def test_digit_tokens_are_the_digits_intensities_in_the_same_split() -> None:
    from mexc.data import get_dataset

    x, y = get_dataset("digits-tokens", "test")
    images, labels = get_dataset("digits", "test")
    assert x.shape == (297, 64) and x.dtype == np.int64
    assert x.min() == 0 and x.max() == 16
    assert np.array_equal(y, labels)
    # the same pixels: normalization is increasing, so the orders agree
    flat = images.reshape(len(images), -1)
    assert (np.argsort(x, axis=1, kind="stable") == np.argsort(flat, axis=1, kind="stable")).all()


def test_an_npz_of_integer_ids_is_token_ids(tmp_path: Path) -> None:
    from mexc.data import DatasetError, load_npz

    ids, y = batch(10)
    np.savez(tmp_path / "t.npz", x=ids.astype(np.int32), y=y)
    x, _ = load_npz(tmp_path / "t.npz", "train")
    assert x.dtype == np.int64 and x.shape == (8, T)
    np.savez(tmp_path / "bad.npz", x=-ids.astype(np.int16) - 1, y=y)
    with pytest.raises(DatasetError, match="negative token ids"):
        load_npz(tmp_path / "bad.npz", "train")


def test_the_trainer_trains_ids_beside_fp32() -> None:
    from mexc.trainer import run_training

    rng = np.random.default_rng(4)  # the label: whether the first id is 1
    ids = rng.integers(2, VOCAB, (320, T))
    y = rng.integers(0, 2, 320)
    ids[y == 1, 0] = 1
    torch.manual_seed(0)
    results = run_training(
        BagOfWords(),
        (ids[:256], y[:256]),
        (ids[256:], y[256:]),
        epochs=3,
        batch=16,
        lr=0.5,
        target="reference",
        compare_fp32=True,
        progress=False,
    )
    assert results["integer"]["accuracy"] >= 0.9
    assert results["fp32"]["accuracy"] >= 0.9
    assert results["memory"]["fp32_measured"]["peak_bytes"] > 0


@pytest.mark.mcu
@pytest.mark.skipif(shutil.which("qemu-system-arm") is None, reason="qemu-system-arm missing")
def test_trains_on_a_cortex_m3_as_in_the_reference(tmp_path: Path) -> None:
    prog = compiled("encoder")
    data = batch(8)
    project = mexc.export(prog, tmp_path / "tokens", data=data, steps=3)
    prog.replay(data, 3)
    run = subprocess.run(
        ["make", "-s", "-C", str(project), "run-qemu"], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = (run.stdout + run.stderr).splitlines()
    assert [ln.split()[1] for ln in out if ln.startswith("STATE ")] == [prog.state_checksum()]


class _Bags(nn.Module):
    """nn.EmbeddingBag over bags of one length (ids (N, T), no offsets), then a linear head."""

    def __init__(self, mode: str, **options: Any) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(30, 16, mode=mode, **options)
        self.fc = nn.Linear(16, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bag(ids))


@pytest.mark.parametrize("mode", ["mean", "sum", "max"])
def test_an_embedding_bag_of_one_length_matches_torch(mode: str) -> None:
    ids = np.random.default_rng(4).integers(0, 30, (8, 6))
    labels = np.arange(8) % 5
    torch.manual_seed(0)
    model = _Bags(mode)
    prog = mexc.compile(model, (torch.from_numpy(ids),), rounding="nearest")
    assert [n.op for n in prog.graph.nodes].count(Op.EMBEDDING) == 1
    assert_logits_match_torch(model, prog, ids, rel=0.03)
    got, want = integer_gradients(prog, ids, labels), float_gradients(model, prog, ids, labels)
    assert cosine(got["bag.weight"], want["bag.weight"]) >= 0.99


def test_an_embedding_bag_with_padding_idx_is_refused_by_node() -> None:
    with pytest.raises(UnsupportedOpError, match=r"'bag'.*padding_idx"):
        mexc.compile(_Bags("mean", padding_idx=0), (torch.zeros(4, 6, dtype=torch.long),))
