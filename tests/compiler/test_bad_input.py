"""Bad input gets one clear error naming what is wrong; the program state is unchanged after it."""

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mexc
from tests.compiler.helpers import example


def _line_of(snippet: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if snippet in text and "_line_of" not in text)


class WithSort(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(x, 1)
        x, _ = torch.sort(x, dim=1)
        return self.fc(x)


class WithLPPool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pool = nn.LPPool2d(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(x.view(x.size(0), 1, 8, 8)).flatten(1)[:, :10]


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            x = x * 2
        return self.fc(torch.flatten(x, 1))


def test_unsupported_function_names_op_node_line_and_list() -> None:
    with pytest.raises(mexc.UnsupportedOpError) as err:
        mexc.compile(WithSort(), (torch.zeros(4, 1, 8, 8),))
    msg = str(err.value)
    assert "sort" in msg and "node 'sort'" in msg
    assert f"test_bad_input.py:{_line_of('torch.sort(x')}" in msg  # the user's source line
    assert "docs/frontend.md lists the" in msg and "supported_ops()" in msg and len(msg) < 600


def test_unsupported_module() -> None:
    line = _line_of("self.pool(x.view")
    with pytest.raises(mexc.UnsupportedOpError, match=f"LPPool2d.*test_bad_input.py:{line}"):
        mexc.compile(WithLPPool(), (torch.zeros(4, 1, 8, 8),))


class SigmoidOfParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)
        self.gate = nn.Parameter(torch.zeros(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a function of a parameter read by a layer (one that multiplies an activation is
        # lifted over the batch: tests/compiler/test_lifted_params.py)
        return self.fc(torch.flatten(x, 1)) + self.fc(torch.sigmoid(self.gate))


def test_a_parameter_used_as_an_activation_is_named() -> None:
    with pytest.raises(mexc.UnsupportedOpError, match=r"node 'gate' .*uses as an activation"):
        mexc.compile(SigmoidOfParameter(), (torch.zeros(4, 1, 8, 8),))


def _weight_norm(layer: nn.Module) -> nn.Module:
    return nn.utils.parametrizations.weight_norm(layer)


def _spectral_norm(layer: nn.Module) -> nn.Module:
    return nn.utils.parametrizations.spectral_norm(layer)


def _old_weight_norm(layer: nn.Module) -> nn.Module:
    import warnings

    with warnings.catch_warnings():  # torch deprecates the hook form
        warnings.simplefilter("ignore")
        return nn.utils.weight_norm(layer)


@pytest.mark.parametrize(
    ("wrap", "kind"),
    [
        (_weight_norm, "_WeightNorm"),
        (_spectral_norm, "_SpectralNorm"),
        (_old_weight_norm, "WeightNorm"),
    ],
)
def test_a_weight_computed_from_other_parameters_is_refused_by_node(wrap, kind: str) -> None:  # type: ignore[no-untyped-def]
    """Trained as a plain weight, the layer would train another parametrization (and, under
    spectral_norm, another model) without a word."""
    model = nn.Sequential(nn.Flatten(), wrap(nn.Linear(64, 10)))
    with pytest.raises(mexc.UnsupportedOpError, match=rf"node '_1' .*\({kind}\).*Remove the"):
        mexc.compile(model, (torch.zeros(4, 1, 8, 8),))


class _ReadsTheWeight(nn.Module):
    def __init__(self, wrap) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.fc = wrap(nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.flatten(1), self.fc.weight, self.fc.bias)


@pytest.mark.parametrize("wrap", [_weight_norm, _old_weight_norm])
def test_a_reparametrized_weight_read_by_itself_is_refused_by_node(wrap) -> None:  # type: ignore[no-untyped-def]
    """Read as an attribute, the older hook's weight would be a constant: frozen, g and v
    never trained."""
    with pytest.raises(mexc.UnsupportedOpError, match=r"node 'fc_.*WeightNorm.*Remove the"):
        mexc.compile(_ReadsTheWeight(wrap), (torch.zeros(4, 1, 8, 8),))


def test_data_dependent_control_flow() -> None:
    with pytest.raises(mexc.TraceError, match=r"data-dependent control flow at test_bad_input"):
        mexc.compile(DataDependent(), (torch.zeros(4, 1, 8, 8),))


class NamedLike(nn.Module):
    """A submodule whose name fx's generated code cannot read as `self.<name>`."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.add_module(name, nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.name)(x.flatten(1))


@pytest.mark.parametrize("name", ["return", "graph", "code", "meta"])
def test_a_submodule_named_like_a_keyword_or_graphmodule_attribute_is_named(name: str) -> None:
    """`return` does not compile, `graph` fails in GraphModule's constructor, and `code` and
    `meta` built a module that called something else (an error blaming the example input)."""
    with pytest.raises(mexc.TraceError, match=rf"cannot be one. Rename '{name}' \('{name}'\)"):
        mexc.compile(NamedLike(name), (torch.zeros(4, 1, 8, 8),))


class NestedLike(nn.Module):
    """The same names one level down: fx reads them from a plain module, so they compile."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.block = NamedLike(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


@pytest.mark.parametrize("name", ["graph", "code", "meta"])
def test_a_nested_submodule_named_like_a_graphmodule_attribute_compiles(name: str) -> None:
    prog = mexc.compile(NestedLike(name), (torch.zeros(4, 1, 8, 8),))
    assert f"block.{name}.weight" in prog.state


class IteratesChunks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = (part * 2 for part in torch.flatten(x, 1).chunk(2, dim=-1))
        return self.fc(torch.cat([a, b], dim=-1))


def test_iterating_over_a_traced_tensor_says_how_to_unpack() -> None:
    line = _line_of("a, b = (part * 2")
    with pytest.raises(mexc.TraceError) as err:
        mexc.compile(IteratesChunks(), (torch.zeros(4, 1, 8, 8),))
    msg = str(err.value)
    assert f"iterates over a tensor at test_bad_input.py:{line}" in msg
    assert "q, k, v = t.chunk(3, dim=-1)" in msg and "control flow" not in msg


class UnpacksThenLoops(nn.Module):
    """A star-unpacked shape (which known shapes resolve) before a loop over a traced shape's
    entries that they do not (Meta LLaMA's reshape_for_broadcast of a complex tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.reshape(*x.shape[:-2], -1)
        if y.sum() > 0:
            y = y * 2
        return self.fc(y.flatten(1))


def test_a_later_line_that_stops_the_trace_is_named_beside_the_first() -> None:
    first, later = _line_of("y = x.reshape(*x.shape[:-2]"), _line_of("if y.sum() > 0:")
    with pytest.raises(mexc.TraceError) as err:
        mexc.compile(UnpacksThenLoops(), (torch.zeros(4, 1, 8, 8),))
    msg = str(err.value)
    assert f"at test_bad_input.py:{first}" in msg
    assert f"tracing gets past that line and fails at test_bad_input.py:{later}" in msg


@pytest.fixture(scope="module")
def prog() -> mexc.Program:
    model, x, _ = example("MLP", batch=8)
    return mexc.compile(model, (x,))


GOOD_X = np.zeros((8, 1, 8, 8), np.float32)
GOOD_Y = np.arange(8) % 10


@pytest.mark.parametrize(
    ("x", "y", "pattern"),
    [
        (
            np.zeros((8, 1, 8, 7), np.float32),
            GOOD_Y,
            r"shape \[8, 1, 8, 7\], expected \[8, 1, 8, 8\]",
        ),
        (np.zeros((5, 1, 8, 8), np.float32), GOOD_Y[:5], r"shape \[5, 1, 8, 8\], expected"),
        (np.zeros((8, 1, 8, 8), np.int64), GOOD_Y, "must be a float tensor, got dtype int64"),
        (GOOD_X, np.full(8, 10), r"labels must be in \[0, 9\], got values in \[10, 10\]"),
        (GOOD_X, -np.ones(8, np.int64), r"labels must be in \[0, 9\]"),
        (GOOD_X, GOOD_Y.astype(np.float32), "integer class ids"),
        (GOOD_X, GOOD_Y[:4], r"y has shape \[4\], expected \[8\]"),
        (np.full((8, 1, 8, 8), np.nan, np.float32), GOOD_Y, "512 NaN or infinite"),
        (
            np.where(np.eye(8)[None, None] > 0, np.inf, 0).repeat(8, 0).astype(np.float32),
            GOOD_Y,
            "NaN or infinite",
        ),
        ("not an array", GOOD_Y, "must be a torch.Tensor or numpy array"),
        (np.ma.masked_array(GOOD_X, mask=GOOD_X > 1), GOOD_Y, "masked array"),
        (torch.empty(8, 1, 8, 8, device="meta"), GOOD_Y, "meta device"),
        (np.full((8, 1, 8, 8), 1e300, np.longdouble) ** 2, GOOD_Y, "512 NaN or infinite"),
    ],
)
def test_step_rejects_bad_batches_and_keeps_state(prog: mexc.Program, x, y, pattern) -> None:  # type: ignore[no-untyped-def]
    before, step = prog.state_checksum(), prog.step_count
    with pytest.raises(ValueError, match=pattern) as err:
        prog.step(x, y)
    assert isinstance(err.value, mexc.InputError)
    assert prog.state_checksum() == before and prog.step_count == step


def test_torch_tensors_are_accepted(prog: mexc.Program) -> None:
    loss = prog.step(torch.zeros(8, 1, 8, 8), torch.arange(8) % 10)
    assert np.isfinite(loss)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_narrow_float_batches_train_as_their_float64_values(dtype) -> None:  # type: ignore[no-untyped-def]
    """The batch is checked and quantized in the caller's dtype (no float64 copy of it): the
    same bits as the same values in float64, and a lone -inf or NaN is still found."""
    model, x, y = example("DigitsCNN", batch=8)
    xs = (x * 3).astype(dtype)
    xt = torch.from_numpy(x)
    a, b = mexc.compile(model, (xt,)), mexc.compile(model, (xt,))
    for _ in range(2):
        assert a.step(xs, y) == b.step(xs.astype(np.float64), y)
    assert a.state_checksum() == b.state_checksum()
    for bad in (-np.inf, np.nan):
        xb = xs.copy()
        xb[3, 0, 2, 5] = bad
        with pytest.raises(mexc.InputError, match="1 NaN or infinite"):
            a.step(xb, y)


def test_bfloat16_batches_train_as_their_float32_values() -> None:
    model, x, y = example("MLP", batch=8)
    xt = torch.from_numpy(x).bfloat16()
    a, b = mexc.compile(model, (xt.float(),)), mexc.compile(model, (xt.float(),))
    assert a.step(xt, torch.from_numpy(y)) == b.step(xt.float().numpy(), y)
    assert a.state_checksum() == b.state_checksum()


def test_evaluating_or_replaying_no_samples_is_refused(prog: mexc.Program) -> None:
    empty = np.zeros((0, 1, 8, 8), np.float32)
    with pytest.raises(mexc.InputError, match="at least one sample"):
        prog.evaluate(empty, np.zeros(0, np.int64))
    with pytest.raises(mexc.InputError, match="at least one sample"):
        prog.replay((empty, np.zeros(0, np.int64)), 2)


def test_predict_handles_any_number_of_rows(prog: mexc.Program) -> None:
    assert prog.predict(np.zeros((3, 1, 8, 8), np.float32)).shape == (3,)
    assert prog.predict(np.zeros((19, 1, 8, 8), np.float32)).shape == (19,)


def test_compile_argument_errors(capfd: pytest.CaptureFixture[str]) -> None:
    model, x, _ = example("MLP", batch=4)
    with pytest.raises(ValueError, match="bits must be in 2..8"):
        mexc.compile(model, (x,), bits=9)
    with pytest.raises(ValueError, match="rounding must be .auto. or one of"):
        mexc.compile(model, (x,), rounding="up")
    with pytest.raises(ValueError, match="not available yet"):
        mexc.compile(model, (x,), target="tpu")
    # whole numbers only (a NumPy integer is one); an empty example batch
    assert mexc.compile(model, (x,), bits=np.int64(6), seed=np.uint32(3)).options.bits == 6
    for kw in ({"bits": 8.0}, {"bits": True}, {"seed": None}, {"seed": 1.5}):
        with pytest.raises(ValueError, match="must be a whole number"):
            mexc.compile(model, (x,), **kw)  # type: ignore[arg-type]
    with pytest.raises(mexc.InputError, match=r"batch has shape \[0, 1, 8, 8\]; give a batch"):
        mexc.compile(model, (x[:0],))
    with pytest.raises(mexc.InputError, match="holds 2 inputs; .* as one-hot floats"):
        mexc.compile(model, (x, x))
    with pytest.raises(mexc.InputError, match="example input of shape") as err:
        mexc.compile(model, (torch.zeros(4, 3, 5, 5),))
    # one paragraph: the failing node, its source line, the model's own error, what to do
    text = str(err.value)
    assert "at node '" in text and "models.py:" in text and "RuntimeError:" in text, text
    assert "meta=" not in text and "\n" not in text and "--input-shape" in text
    # nothing else: torch's shape propagation prints the node's traceback unless told not to
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("layer", [nn.Dropout(1.0), nn.Dropout2d(1.0)])
def test_dropout_of_every_element_is_refused_at_compile_time(layer: nn.Module) -> None:
    """p = 1 (torch zeroes everything): named at compile time, not a ValueError at step 1."""
    model = nn.Sequential(nn.Conv2d(1, 2, 1), layer, nn.Flatten(), nn.Linear(8, 3))
    with pytest.raises(mexc.UnsupportedOpError, match=r"node '_1'.*probability 1.0; mexc takes"):
        mexc.compile(model, (torch.zeros(2, 1, 2, 2),))


def test_batch_statistics_of_one_value_per_channel_are_refused_at_compile_time() -> None:
    """BatchNorm1d over [1, C] (a batch of one): named at compile time, not a ValueError from
    inside the first step. Over [1, C, H, W] it has H W values per channel and compiles."""
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    with pytest.raises(mexc.InputError, match=r"node '_1'.*one value per channel.*at least 2"):
        mexc.compile(model, (torch.zeros(1, 4),))
    mexc.compile(nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2)), (torch.zeros(1, 1, 2, 2),))


def test_optimizer_by_name_or_a_clear_error() -> None:
    model, x, _ = example("MLP", batch=4)
    prog = mexc.compile(model, (x,), optimizer="AdamW")
    assert isinstance(prog.optimizer, mexc.AdamW) and prog.optimizer.lr == mexc.AdamW().lr
    assert type(mexc.compile(model, (x,), optimizer="sgd").optimizer) is mexc.SGD
    with pytest.raises(ValueError, match="optimizer must be one of sgd, adamw, adam"):
        mexc.compile(model, (x,), optimizer="lion")
    with pytest.raises(TypeError, match="not a torch.optim one"):
        mexc.compile(model, (x,), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda: mexc.Step(3), "milestones must be a list"),
        (lambda: mexc.Step((2, -1)), "milestones must be a list"),
        (lambda: mexc.Step((2,), float("nan")), "gamma must be a finite number"),
        (lambda: mexc.Step((2,), -1.0), "gamma must be a finite number"),
        (lambda: mexc.Cosine(-5), "total_steps must be a whole number >= 1"),
        (lambda: mexc.Cosine(10.0), "total_steps must be a whole number >= 1"),
        (lambda: mexc.Cosine(5, -1), "warmup_steps must be a whole number >= 0"),
    ],
)
def test_schedules_refuse_bad_arguments_when_made(make, says: str) -> None:  # type: ignore[no-untyped-def]
    """Not at the milestone, mid-training: the schedule's own constructor. NumPy numbers and
    arrays are numbers; a warmup longer than the schedule is one (older checkpoints hold it)."""
    with pytest.raises(ValueError, match=says):
        make()
    step = mexc.Step(np.array([2, 4]), np.float32(0.5))
    assert step.milestones == (2, 4) and step.gamma == 0.5
    assert mexc.Cosine(10, 20).factor(3) == 4 / 20


def test_a_fresh_adamw_state_loads_back() -> None:
    """AdamW's moments start at exponent -2^14 (numerics 12b), inside the bound."""
    model, x, _ = example("MLP", batch=4)
    prog = mexc.compile(model, (x,), optimizer="adamw")
    before = prog.state_checksum()
    prog.load_state_dict(prog.state_dict())
    assert prog.state_checksum() == before


def test_what_is_not_a_model_is_refused_and_a_model_without_parameters_trains_none() -> None:
    class Buffers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("w", torch.ones(4, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w

    x = torch.zeros(2, 4)
    for model in (Buffers(), nn.ReLU()):  # a function of the input: compiled, nothing trained
        prog = mexc.compile(model, (x,))
        before = prog.state_checksum()
        assert np.isfinite(prog.step(x + 1, np.array([0, 2])))
        assert prog.state_checksum() == before
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        mexc.compile("net.py", (x,))  # type: ignore[arg-type]
    prog = mexc.compile(nn.Linear(4, 3), (x,))
    with pytest.raises(mexc.InputError, match="to_module takes the nn.Module"):
        prog.to_module(None)
    with pytest.raises(ValueError, match="trainable=3: give names"):
        mexc.compile(nn.Linear(4, 3), (x,), trainable=3)  # type: ignore[arg-type]


def test_a_model_returning_several_tensors_is_refused_with_a_way_out() -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.fc(x), x

    with pytest.raises(mexc.UnsupportedOpError, match=r"returns a tuple, not one tensor.*\[0\]"):
        mexc.compile(Pair(), (torch.zeros(2, 4),))


def test_compile_leaves_the_module_in_its_mode() -> None:
    from examples.models import DigitsCNN

    model = DigitsCNN().train()
    mexc.compile(model, (torch.zeros(4, 1, 8, 8),))
    assert model.training and all(m.training for m in model.modules())
    model.eval()
    mexc.compile(model, (torch.zeros(4, 1, 8, 8),))
    assert not model.training


class _SharedBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        return (self.bn(h) + self.bn(h * 2)).mean((2, 3))


class _PooledChannelMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, 6, 6) read as one (C, H, W)
        return F.avg_pool2d(self.conv(x).mean(1), 2).flatten(1)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (_SharedBatchNorm, r"'bn_1'.*calls the layer 'bn' a second time.*its own layer"),
        (_PooledChannelMean, r"'avg_pool2d'.*pools a tensor of shape \[4, 6, 6\].*unsqueeze"),
    ],
)
def test_layers_mexc_cannot_call_so_are_refused_by_node(
    model: type[nn.Module], message: str
) -> None:
    with pytest.raises(mexc.UnsupportedOpError, match=message) as err:
        mexc.compile(model(), (torch.zeros(4, 1, 8, 8),))
    assert "test_bad_input.py" in str(err.value)


class _Noise(nn.Module):
    """Random numbers drawn in forward from known sizes: tracing would keep one draw."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.enc, self.fc = nn.Linear(6, 8), nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        if self.form == "added":
            h = h + torch.randn(x.size(0), 8)
        elif self.form == "mask":  # a dropout written by hand
            h = h * (torch.rand(x.size(0), 8) > 0.5)
        elif self.form == "fixed":  # literal sizes: the plain symbolic trace keeps it too
            h = h + torch.randn(8)
        else:  # a layer's input
            h = h + self.enc(torch.randn(x.size(0), 6))
        return self.fc(h)


@pytest.mark.parametrize("form", ["added", "mask", "fixed", "layer"])
def test_random_numbers_drawn_in_forward_are_refused_by_node(form: str) -> None:
    """They compiled as one fixed draw, added in every step."""
    draw = torch.randn
    with pytest.raises(mexc.UnsupportedOpError, match="reads random numbers the forward draws"):
        mexc.compile(_Noise(form), (torch.zeros(4, 6),))
    assert torch.randn is draw and type(torch.randn(2)) is torch.Tensor  # torch's own again
