import numpy as np
import torch
import torch.nn.functional as F
from kernel_helpers import cos, rand_mx, tt

from mexc.kernels import softmax_ce_backward, softmax_ce_forward
from mexc.kernels.loss import label_gap
from mexc.mx import MX, RoundCtx


def test_softmax_ce() -> None:
    rng = np.random.default_rng(0)
    ctx = RoundCtx("stochastic", 0, 1)
    n, k, valid = 32, 10, 28
    logits = rand_mx(rng, (n, k), -6)  # |logit| < 2
    labels = rng.integers(0, k, n)
    probs, loss = softmax_ce_forward(logits, labels, valid, ctx, 0)
    assert probs.dtype == np.int16 and probs.min() >= 0 and probs.max() <= 2**15 - 1
    assert np.all(np.abs(probs.astype(np.int64).sum(axis=1) - 2**15) <= k)
    lt = tt(logits, True)
    ref = torch.softmax(lt, 1).detach().numpy()
    assert np.max(np.abs(probs / 2**15 - ref)) < 0.01  # the exp table's index steps of 1/16
    tl = F.cross_entropy(lt[:valid], torch.tensor(labels[:valid]))
    assert abs(loss - float(tl.detach())) < 0.05
    tl.backward()
    g = softmax_ce_backward(probs, labels, valid, ctx, 16)
    assert not g.m[valid:].any()
    assert cos(g.dequantize(), lt.grad) >= 0.99
    assert np.max(np.abs(g.dequantize() - lt.grad.numpy())) < 0.01 / valid + 2.0 ** float(g.e)


def test_softmax_ce_all_padding() -> None:
    ctx = RoundCtx("nearest")
    logits = rand_mx(np.random.default_rng(1), (4, 3), -4)
    probs, loss = softmax_ce_forward(logits, np.zeros(4, np.int64), 0, ctx, 0)
    assert loss == 0.0
    assert not softmax_ce_backward(probs, np.zeros(4, np.int64), 0, ctx, 16).m.any()


def test_a_confidently_right_sample_gives_no_gradient_and_rows_sum_to_zero() -> None:
    """The label's p caps below 1, so p - 2^15 onehot would leave -2^-15 on every confidently
    right sample: a push on its logit that never fades (with 8-bit p, -1/256: MobileNetV3-
    Small's logits grew far past FP32's and its training diverged). With t = p - S onehot every
    row sums to 0, as in float."""
    ctx = RoundCtx("nearest")
    n, k = 8, 10
    labels = np.arange(n) % k
    m = np.zeros((n, k), np.int8)
    m[np.arange(n), labels] = 127  # logit margin 127 * 2^-2 = 32: p_y rounds to 2^15 - 1
    m[:4] += np.random.default_rng(2).integers(-40, 41, (4, k)).astype(np.int8)
    logits = MX.of(m, -2)
    probs, _ = softmax_ce_forward(logits, labels, n, ctx, 0)
    assert np.all(probs[4:, :][np.arange(4), labels[4:]] == 2**15 - 1)
    g = softmax_ce_backward(probs, labels, n, ctx, 16)
    assert not g.m[4:].any()  # the confident rows
    t = g.m.astype(np.int64)
    assert np.all(np.abs(t.sum(axis=1)) <= k)  # zero up to the compaction's rounding


def test_a_thousand_near_uniform_classes_keep_their_gradient() -> None:
    """p / 2^15: a 1000-class row near uniform holds p of about 33 units, where 8-bit p rounded
    every one to 0 (S = 0, so no gradient at all); the gradient is torch's."""
    rng = np.random.default_rng(3)
    ctx = RoundCtx("nearest")
    n, k = 8, 1000
    logits = MX.of(rng.integers(-20, 21, (n, k)), -7)  # within 0.16 of each other
    labels = rng.integers(0, k, n)
    probs, loss = softmax_ce_forward(logits, labels, n, ctx, 0)
    lt = tt(logits, True)
    tl = F.cross_entropy(lt, torch.tensor(labels))
    assert probs.min() >= 25 and abs(loss - float(tl.detach())) < 0.02
    tl.backward()
    g = softmax_ce_backward(probs, labels, n, ctx, 16)
    assert cos(g.dequantize(), lt.grad) >= 0.99
    assert abs(np.linalg.norm(g.dequantize()) / np.linalg.norm(lt.grad.numpy()) - 1) < 0.02


def test_classes_beyond_the_exp_table_have_no_mass() -> None:
    """Entries more than 8 below the row's max have E = 0 (the head's lookup flushes): a
    confidently right row has p_y = 2^15 - 1 and no gradient, where exp(-8)'s 11 units per
    class would leave p_y at 32669 and a push on its label for ever."""
    ctx = RoundCtx("nearest")
    m = np.zeros((2, 10), np.int8)
    m[:, 3] = 127  # 127 * 2^-3 = 15.9 above the others
    probs, _ = softmax_ce_forward(MX.of(m, -3), np.array([3, 3]), 2, ctx, 0)
    assert probs[:, 3].tolist() == [2**15 - 1] * 2 and not np.delete(probs, 3, axis=1).any()
    assert not softmax_ce_backward(probs, np.array([3, 3]), 2, ctx, 16).m.any()


def test_the_logged_loss_of_labels_far_below_the_maximum_is_their_cross_entropy() -> None:
    """The logged loss reads each row's sum S and its label's gap, not p_y: a label more than
    8 nats below its row's maximum has p_y = 0, which logged ln 2^15 = 10.4 whatever its
    gap (here 12 to 30 nats), and a uniform row of more than 2^15 classes logged 10.4 too."""
    ctx = RoundCtx("nearest")
    n, k = 6, 10
    m = np.zeros((n, k), np.int64)
    m[:, 0] = [48, 64, 80, 96, 112, 120]  # the label's gap: 12 to 30 nats at exponent -2
    labels = np.full(n, 3)
    lt = torch.tensor(m * 0.25)
    probs, loss = softmax_ce_forward(MX.of(m, -2), labels, n, ctx, 0)
    assert not probs[:, 3].any()
    want = float(F.cross_entropy(lt, torch.tensor(labels)))
    assert abs(loss - want) < 1e-3 * want and loss > 20.0

    wide = 40_000
    _, loss = softmax_ce_forward(MX.of(np.zeros((2, wide), np.int64), -4), [5, 7], 2, ctx, 0)
    assert abs(loss - np.log(wide)) < 1e-9  # 10.60, where the cap read 10.40


def test_the_label_gap_is_exact_above_exponent_minus_16_and_rounds_below() -> None:
    d = np.array([0, -1, -3, -255])
    assert label_gap(d, -16).tolist() == [0, -1, -3, -255]
    assert label_gap(d, -14).tolist() == [0, -4, -12, -1020]
    assert label_gap(d, -18).tolist() == [0, 0, -1, -64]  # 3/4 -> 1, 255/4 = 63.75 -> 64
    assert label_gap(d, 9).tolist() == [0, -(2**25), -3 * 2**25, -(2**31 - 1)]
    assert label_gap(d, 30).tolist() == [0] + [-(2**31 - 1)] * 3
