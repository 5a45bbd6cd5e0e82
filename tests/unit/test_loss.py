"""The default RL loss (DPPO binary TV mask + squared log-ratio KL) against hand-computed values."""

import math

import pytest
import torch

from slipstream.trainer.loss import dppo_kl_loss

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
