import numpy as np
import torch
import torch.nn.functional as F
from kernel_helpers import cos, rand_mx, tt

from mexc.kernels import softmax_ce_backward, softmax_ce_forward
from mexc.mx import MX, RoundCtx


def test_softmax_ce() -> None:
    rng = np.random.default_rng(0)
    ctx = RoundCtx("stochastic", 0, 1)
    n, k, valid = 32, 10, 28
    logits = rand_mx(rng, (n, k), -6)  # |logit| < 2: p_y stays well above 1/256
    labels = rng.integers(0, k, n)
    probs, loss = softmax_ce_forward(logits, labels, valid, ctx, 0)
    assert probs.min() >= 0 and probs.max() <= 255
    assert np.all(np.abs(probs.sum(axis=1) - 256) <= k)
    lt = tt(logits, True)
    ref = torch.softmax(lt, 1).detach().numpy()
    assert np.max(np.abs(probs / 256 - ref)) < 0.01
    tl = F.cross_entropy(lt[:valid], torch.tensor(labels[:valid]))
    assert abs(loss - float(tl.detach())) < 0.05
    tl.backward()
    g = softmax_ce_backward(probs, labels, valid, ctx, 16)
    assert not g.m[valid:].any()
    assert cos(g.dequantize(), lt.grad) >= 0.99
    assert np.max(np.abs(g.dequantize() - lt.grad.numpy())) < 2.0 / 256 / valid + 2.0 ** float(g.e)


def test_softmax_ce_all_padding() -> None:
    ctx = RoundCtx("nearest")
    logits = rand_mx(np.random.default_rng(1), (4, 3), -4)
    probs, loss = softmax_ce_forward(logits, np.zeros(4, np.int64), 0, ctx, 0)
    assert loss == 0.0
    assert not softmax_ce_backward(probs, np.zeros(4, np.int64), 0, ctx, 16).m.any()


def test_a_confidently_right_sample_gives_no_gradient_and_rows_sum_to_zero() -> None:
    """The label's p caps at 255/256, so p - 256 onehot left -1/256 on every confidently right
    sample: a push on its logit that never fades (MobileNetV3-Small's logits grew far past
    FP32's and its training diverged). With t = p - S onehot every row sums to 0, as in float."""
    ctx = RoundCtx("nearest")
    n, k = 8, 10
    labels = np.arange(n) % k
    m = np.zeros((n, k), np.int8)
    m[np.arange(n), labels] = 127  # logit margin 127 * 2^-2 = 32: p_y rounds to 255
    m[:4] += np.random.default_rng(2).integers(-40, 41, (4, k)).astype(np.int8)
    logits = MX.of(m, -2)
    probs, _ = softmax_ce_forward(logits, labels, n, ctx, 0)
    assert np.all(probs[4:, :][np.arange(4), labels[4:]] == 255)
    g = softmax_ce_backward(probs, labels, n, ctx, 16)
    assert not g.m[4:].any()  # the confident rows
    t = g.m.astype(np.int64)
    assert np.all(np.abs(t.sum(axis=1)) <= k)  # zero up to the compaction's rounding
