"""RL losses (default DPPO binary TV mask, TIS, IcePop, geometric sequence mask) against hand-computed values."""

import math

import pytest
import torch

from slipstream.config.trainer import LossConfig
from slipstream.trainer.loss import dppo_kl_loss, rl_loss, sample_ids_from_positions

THR, KL = 0.2, 0.1
NUM_LOSS_TOKENS = 10  # the whole step's count: larger than this micro-batch's 6 loss tokens

# token: (p trainer, q inference, advantage, loss token, masked by hand)
TOKENS = [
    (0.3, 1.0, 0.0, False, False),  # prompt token: no loss, not counted
    (0.5, 0.4, 1.0, True, False),  # A > 0, dp = +0.1 inside the trust region
    (0.9, 0.5, 1.0, True, True),  # A > 0, dp = +0.4 > 0.2: masked
    (0.2, 0.6, -1.0, True, True),  # A < 0, dp = -0.4 < -0.2: masked
    (0.6, 0.2, -1.0, True, False),  # A < 0 but dp = +0.4 moves against the push: kept
    (0.1, 0.4, 0.0, True, True),  # A = 0 counts as A <= 0, dp = -0.3: masked
    (0.3, 0.45, 0.5, True, False),  # A > 0, dp = -0.15: kept
]


def _inputs(dtype=torch.float64):
    p, q, a, m, _ = zip(*TOKENS, strict=True)
    lp = torch.tensor([math.log(x) for x in p], dtype=dtype, requires_grad=True)
    lq = torch.tensor([math.log(x) for x in q], dtype=dtype)
    return lp, lq, torch.tensor(a, dtype=dtype), torch.tensor(m)


def _hand_values():
    loss_sum = kl_all = kl_masked = kl_unmasked = 0.0
    grads = []
    for p, q, a, is_loss, masked in TOKENS:
        if not is_loss:
            grads.append(0.0)
            continue
        ratio, log_ratio = p / q, math.log(p / q)
        keep = 0.0 if masked else 1.0
        loss_sum += -keep * a * ratio + KL * log_ratio**2
        # d/dlp of -keep*A*exp(lp - lq) + KL*(lp - lq)^2
        grads.append((-keep * a * ratio + 2 * KL * log_ratio) / NUM_LOSS_TOKENS)
        k3 = ratio - log_ratio - 1
        kl_all += k3
        kl_masked += k3 if masked else 0.0
        kl_unmasked += 0.0 if masked else k3
    return loss_sum / NUM_LOSS_TOKENS, kl_all, kl_masked, kl_unmasked, grads


def test_loss_matches_hand_computed_values():
    lp, lq, a, m = _inputs()
    loss, stats = dppo_kl_loss(lp, lq, a, m, NUM_LOSS_TOKENS, dp_threshold=THR, kl_coef=KL)
    expected_loss, kl_all, kl_masked, kl_unmasked, _ = _hand_values()

    # Per loss token, written out: kept tokens carry -A * ratio, every loss token the KL term.
    explicit = [
        -1.0 * 1.25 + KL * math.log(1.25) ** 2,
        KL * math.log(0.9 / 0.5) ** 2,
        KL * math.log(0.2 / 0.6) ** 2,
        1.0 * 3.0 + KL * math.log(3.0) ** 2,
        KL * math.log(0.1 / 0.4) ** 2,
        -0.5 * (0.3 / 0.45) + KL * math.log(0.3 / 0.45) ** 2,
    ]
    assert expected_loss == pytest.approx(sum(explicit) / NUM_LOSS_TOKENS, abs=1e-12)
    assert loss.item() == pytest.approx(sum(explicit) / NUM_LOSS_TOKENS, abs=1e-12)
    assert stats.loss.item() == pytest.approx(expected_loss, abs=1e-12)
    assert stats.mismatch_kl_sum.item() == pytest.approx(kl_all, abs=1e-12)
    assert stats.mismatch_kl_masked_sum.item() == pytest.approx(kl_masked, abs=1e-12)
    assert stats.mismatch_kl_unmasked_sum.item() == pytest.approx(kl_unmasked, abs=1e-12)
    assert int(stats.num_loss_tokens) == 6
    assert int(stats.num_masked) == 3


def test_loss_gradient_flows_through_trainer_logprobs_only():
    lp, lq, a, m = _inputs()
    lq.requires_grad_(True)
    a.requires_grad_(True)
    loss, _ = dppo_kl_loss(lp, lq, a, m, NUM_LOSS_TOKENS, dp_threshold=THR, kl_coef=KL)
    loss.backward()
    *_, grads = _hand_values()
    torch.testing.assert_close(lp.grad, torch.tensor(grads, dtype=torch.float64), rtol=0, atol=1e-12)
    assert lq.grad is None and a.grad is None


def test_loss_of_micro_batches_sums_to_step_mean():
    lp, lq, a, m = _inputs()
    whole, _ = dppo_kl_loss(lp, lq, a, m, NUM_LOSS_TOKENS, dp_threshold=THR, kl_coef=KL)
    first, s1 = dppo_kl_loss(lp[:4], lq[:4], a[:4], m[:4], NUM_LOSS_TOKENS, dp_threshold=THR, kl_coef=KL)
    second, s2 = dppo_kl_loss(lp[4:], lq[4:], a[4:], m[4:], NUM_LOSS_TOKENS, dp_threshold=THR, kl_coef=KL)
    assert (first + second).item() == pytest.approx(whole.item(), abs=1e-12)
    total = s1 + s2
    assert int(total.num_loss_tokens) == 6 and int(total.num_masked) == 3
    assert total.to_floats()["num_masked"] == 3.0


def test_non_loss_tokens_are_ignored_whatever_their_values():
    lp, lq, a, m = _inputs()
    base, _ = dppo_kl_loss(lp, lq, a, m, NUM_LOSS_TOKENS, dp_threshold=THR, kl_coef=KL)
    lq2, a2 = lq.clone(), a.clone()
    lq2[0], a2[0] = -50.0, 7.0
    other, _ = dppo_kl_loss(lp, lq2, a2, m, NUM_LOSS_TOKENS, dp_threshold=THR, kl_coef=KL)
    assert other.item() == base.item()


def test_loss_rejects_empty_step():
    lp, lq, a, m = _inputs()
    with pytest.raises(ValueError, match="num_loss_tokens"):
        dppo_kl_loss(lp, lq, a, m, 0, dp_threshold=THR, kl_coef=KL)


# --- loss kinds: tis, icepop, geo_mask (rl_loss with a LossConfig) ---


def _tensors(tokens, dtype=torch.float64):
    """(p trainer, q inference, advantage, loss token, ...) rows -> lp (requires grad), lq, A, loss mask."""
    p, q, a, m = (list(col) for col in list(zip(*tokens, strict=True))[:4])
    lp = torch.tensor([math.log(x) for x in p], dtype=dtype, requires_grad=True)
    lq = torch.tensor([math.log(x) for x in q], dtype=dtype)
    return lp, lq, torch.tensor(a, dtype=dtype), torch.tensor(m)


def _masked_ratio_expected(tokens, kl_coef, num_loss_tokens):
    """Hand values of `-(keep * A * ratio) + kl * log_ratio^2` for rows (p, q, A, is_loss, masked)."""
    loss_sum = kl_masked = kl_unmasked = 0.0
    grads = []
    for p, q, a, is_loss, masked in tokens:
        if not is_loss:
            grads.append(0.0)
            continue
        ratio, log_ratio = p / q, math.log(p / q)
        keep = 0.0 if masked else 1.0
        loss_sum += -keep * a * ratio + kl_coef * log_ratio**2
        grads.append((-keep * a * ratio + 2 * kl_coef * log_ratio) / num_loss_tokens)
        k3 = ratio - log_ratio - 1
        kl_masked += k3 if masked else 0.0
        kl_unmasked += 0.0 if masked else k3
    return loss_sum / num_loss_tokens, kl_masked, kl_unmasked, grads


def _check(loss, stats, lp, expected_loss, kl_masked, kl_unmasked, grads, num_loss, num_masked):
    assert loss.item() == pytest.approx(expected_loss, abs=1e-12)
    assert stats.loss.item() == pytest.approx(expected_loss, abs=1e-12)
    assert stats.mismatch_kl_masked_sum.item() == pytest.approx(kl_masked, abs=1e-12)
    assert stats.mismatch_kl_unmasked_sum.item() == pytest.approx(kl_unmasked, abs=1e-12)
    assert stats.mismatch_kl_sum.item() == pytest.approx(kl_masked + kl_unmasked, abs=1e-12)
    assert (int(stats.num_loss_tokens), int(stats.num_masked)) == (num_loss, num_masked)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor(grads, dtype=torch.float64), rtol=0, atol=1e-12)


# (p, q, A, loss token, truncated at C = 2)
TIS_TOKENS = [
    (0.3, 1.0, 5.0, False, False),  # prompt token
    (0.5, 0.4, 1.0, True, False),  # ratio 1.25: weight 1.25
    (0.9, 0.3, 1.0, True, True),  # ratio 3 > 2: weight 2
    (0.1, 0.4, -1.0, True, False),  # ratio 0.25: weight 0.25
    (0.6, 0.2, -0.5, True, True),  # ratio 3 > 2: weight 2
]


def test_tis_matches_hand_computed_values():
    lp, lq, a, m = _tensors(TIS_TOKENS)
    config = LossConfig(kind="tis", tis_cap=2.0, kl_coef=KL)
    loss, stats = rl_loss(lp, lq, a, m, NUM_LOSS_TOKENS, config)
    # pg = -(w * A * log_ratio) (value), gradient -(w * A) per token; plus KL * log_ratio^2.
    rows = [
        (1.25, 1.0, math.log(1.25)),
        (2.0, 1.0, math.log(3.0)),
        (0.25, -1.0, math.log(0.25)),
        (2.0, -0.5, math.log(3.0)),
    ]
    expected = sum(-w * adv * lr + KL * lr**2 for w, adv, lr in rows) / NUM_LOSS_TOKENS
    grads = [0.0] + [(-w * adv + 2 * KL * lr) / NUM_LOSS_TOKENS for w, adv, lr in rows]
    k3 = [r - math.log(r) - 1 for r in (1.25, 3.0, 0.25, 3.0)]
    _check(loss, stats, lp, expected, k3[1] + k3[3], k3[0] + k3[2], grads, num_loss=4, num_masked=2)


def test_tis_gradient_is_truncated_reinforce():
    """Same gradient as the textbook `-(min(ratio, C).detach() * A * lp)`."""
    lp, lq, a, m = _tensors(TIS_TOKENS)
    loss, _ = rl_loss(lp, lq, a, m, NUM_LOSS_TOKENS, LossConfig(kind="tis", kl_coef=0.0))
    loss.backward()
    lp2 = lp.detach().clone().requires_grad_(True)
    weight = torch.exp(lp2 - lq).clamp(max=2.0).detach()
    (-(weight * a * lp2 * m).sum() / NUM_LOSS_TOKENS).backward()
    torch.testing.assert_close(lp.grad, lp2.grad, rtol=0, atol=1e-12)


# (p, q, A, loss token, masked: ratio outside [0.5, 5])
ICEPOP_TOKENS = [
    (0.3, 0.01, 1.0, False, False),  # prompt token, ratio 30 but not a loss token
    (0.5, 0.4, 1.0, True, False),  # ratio 1.25
    (0.2, 0.5, 1.0, True, True),  # ratio 0.4 < 0.5
    (0.6, 0.1, -1.0, True, True),  # ratio 6 > 5
    (0.9, 0.2, -1.0, True, False),  # ratio 4.5
    (0.4, 0.4, 2.0, True, False),  # ratio 1
]


def test_icepop_matches_hand_computed_values():
    lp, lq, a, m = _tensors(ICEPOP_TOKENS)
    loss, stats = rl_loss(lp, lq, a, m, NUM_LOSS_TOKENS, LossConfig(kind="icepop", kl_coef=KL))
    explicit = [
        -1.25 + KL * math.log(1.25) ** 2,
        KL * math.log(0.4) ** 2,
        KL * math.log(6.0) ** 2,
        4.5 + KL * math.log(4.5) ** 2,
        -2.0,
    ]
    expected, kl_masked, kl_unmasked, grads = _masked_ratio_expected(ICEPOP_TOKENS, KL, NUM_LOSS_TOKENS)
    assert expected == pytest.approx(sum(explicit) / NUM_LOSS_TOKENS, abs=1e-12)
    _check(loss, stats, lp, expected, kl_masked, kl_unmasked, grads, num_loss=5, num_masked=2)


def test_icepop_masked_overflowing_ratio_stays_finite():
    lp = torch.tensor([0.0, -0.1, -0.2], requires_grad=True)
    lq = torch.tensor([0.0, -200.0, -0.2])  # ratio exp(199.9) overflows float32
    a, m = torch.tensor([0.0, 1.0, 1.0]), torch.tensor([False, True, True])
    loss, stats = rl_loss(lp, lq, a, m, 2, LossConfig(kind="icepop", kl_coef=KL))
    loss.backward()
    assert loss.item() == pytest.approx((KL * 199.9**2 - 1.0) / 2, rel=1e-5)
    assert torch.isfinite(lp.grad).all() and int(stats.num_masked) == 1


# Four packed samples; (p, q, A, loss token, masked: whole sample's geometric-mean ratio outside [0.5, 2]).
GEO_SAMPLES = [
    [  # ratios 3, 1/3, 1: geometric mean 1 -> kept despite extreme tokens; the prompt's ratio is ignored
        (0.3, 1e-6, 1.0, False, False),
        (0.6, 0.2, 1.0, True, False),
        (0.1, 0.3, 1.0, True, False),
        (0.5, 0.5, 1.0, True, False),
    ],
    [(0.3, 0.5, -0.5, False, False), (0.5, 0.2, -0.5, True, True), (0.8, 0.4, -0.5, True, True)],  # sqrt(5) > 2
    [(0.2, 0.5, 0.7, False, False), (0.15, 0.5, 0.7, True, True), (0.3, 0.5, 0.7, True, True)],  # sqrt(.18) < .5
    [(0.9, 0.5, -1.0, False, False), (0.4, 0.5, -1.0, True, False), (0.45, 0.5, -1.0, True, False)],  # 0.849
]


def _geo_inputs(samples):
    tokens = [t for s in samples for t in s]
    positions = torch.tensor([i for s in samples for i in range(len(s))])
    return tokens, positions


def test_geo_mask_matches_hand_computed_values():
    tokens, positions = _geo_inputs(GEO_SAMPLES)
    lp, lq, a, m = _tensors(tokens)
    loss, stats = rl_loss(lp, lq, a, m, 12, LossConfig(kind="geo_mask", kl_coef=KL), position_ids_T=positions)
    explicit = [
        -3.0 + KL * math.log(3.0) ** 2,
        -1 / 3 + KL * math.log(1 / 3) ** 2,
        -1.0,
        KL * math.log(2.5) ** 2,
        KL * math.log(2.0) ** 2,
        KL * math.log(0.3) ** 2,
        KL * math.log(0.6) ** 2,
        0.8 + KL * math.log(0.8) ** 2,
        0.9 + KL * math.log(0.9) ** 2,
    ]
    expected, kl_masked, kl_unmasked, grads = _masked_ratio_expected(tokens, KL, 12)
    assert expected == pytest.approx(sum(explicit) / 12, abs=1e-12)
    _check(loss, stats, lp, expected, kl_masked, kl_unmasked, grads, num_loss=9, num_masked=4)


def test_geo_mask_covers_every_token_of_one_sample_only():
    samples = [GEO_SAMPLES[0], GEO_SAMPLES[3], GEO_SAMPLES[0]]
    # Push the middle sample's geometric mean to 2.2: only its 2 loss tokens get masked.
    samples[1] = [(0.9, 0.5, -1.0, False, False), (0.44, 0.2, -1.0, True, True), (0.44, 0.2, -1.0, True, True)]
    tokens, positions = _geo_inputs(samples)
    lp, lq, a, m = _tensors(tokens)
    loss, stats = rl_loss(lp, lq, a, m, 8, LossConfig(kind="geo_mask", kl_coef=0.0), position_ids_T=positions)
    loss.backward()
    assert int(stats.num_masked) == 2
    grad_by_sample = torch.split(lp.grad, [len(s) for s in samples])
    assert torch.all(grad_by_sample[1] == 0)
    assert torch.all(grad_by_sample[0][1:] != 0) and torch.all(grad_by_sample[2][1:] != 0)


def test_geo_mask_needs_positions():
    tokens, _ = _geo_inputs(GEO_SAMPLES)
    lp, lq, a, m = _tensors(tokens)
    with pytest.raises(ValueError, match="position_ids_T"):
        rl_loss(lp, lq, a, m, 12, LossConfig(kind="geo_mask"))
    with pytest.raises(ValueError, match="starting at 0"):
        rl_loss(lp, lq, a, m, 12, LossConfig(kind="geo_mask"), position_ids_T=torch.arange(1, 14))


def test_sample_ids_from_positions():
    ids = sample_ids_from_positions(torch.tensor([0, 1, 2, 0, 0, 1]))
    assert ids.tolist() == [0, 0, 0, 1, 2, 2]


def test_rl_loss_default_kind_is_dppo_tv():
    lp, lq, a, m = _inputs()
    config = LossConfig(dp_threshold=THR, kl_coef=KL)
    assert config.kind == "dppo_tv"
    loss, stats = rl_loss(lp, lq, a, m, NUM_LOSS_TOKENS, config, position_ids_T=torch.arange(len(TOKENS)))
    expected_loss, *_ = _hand_values()
    assert loss.item() == pytest.approx(expected_loss, abs=1e-12) and int(stats.num_masked) == 3


@pytest.mark.parametrize("kind", ["dppo_tv", "tis", "icepop", "geo_mask"])
def test_every_kind_sums_over_micro_batches(kind):
    tokens, positions = _geo_inputs(GEO_SAMPLES)
    lp, lq, a, m = _tensors(tokens)
    config = LossConfig(kind=kind, kl_coef=KL)
    whole, s = rl_loss(lp, lq, a, m, 12, config, position_ids_T=positions)
    cut = len(GEO_SAMPLES[0]) + len(GEO_SAMPLES[1])  # micro-batches hold whole samples
    first, s1 = rl_loss(lp[:cut], lq[:cut], a[:cut], m[:cut], 12, config, position_ids_T=positions[:cut])
    second, s2 = rl_loss(lp[cut:], lq[cut:], a[cut:], m[cut:], 12, config, position_ids_T=positions[cut:])
    assert (first + second).item() == pytest.approx(whole.item(), abs=1e-12)
    assert (s1 + s2).to_floats() == pytest.approx(s.to_floats(), abs=1e-12)


@pytest.mark.parametrize(("field", "value"), [("icepop_low", 1.0), ("icepop_high", 0.9), ("geo_low", 1.5)])
def test_loss_config_rejects_bounds_that_drop_on_policy_tokens(field, value):
    with pytest.raises(ValueError, match=field.split("_")[0]):
        LossConfig(**{field: value})
