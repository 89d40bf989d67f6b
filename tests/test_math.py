"""The pure GRPO math in train_grpo.py against hand computations and edge cases."""

import math

import pytest
import torch

from train_grpo import aggregate_loss, compute_advantages, kl_penalty, policy_loss


def test_grpo_advantages_match_hand_values():
    """Guards against a biased std, a wrong group layout, or normalising over the batch instead of the group."""
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0])
    adv = compute_advantages(scores, group_size=3)
    g1_mean, g1_std = 1 / 3, math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    g2_mean, g2_std = 2.0, 2.0
    expected = [(1 - g1_mean) / (g1_std + 1e-6), -g1_mean / (g1_std + 1e-6), -g1_mean / (g1_std + 1e-6),
                (0 - g2_mean) / (g2_std + 1e-6), 0.0, (4 - g2_mean) / (g2_std + 1e-6)]  # fmt: skip
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=0, atol=1e-6)


def test_zero_variance_group_gives_zero_advantage():
    """Guards against dividing 0 by 0 (or by eps alone) when every answer of a prompt scored the same."""
    adv = compute_advantages(torch.tensor([0.7, 0.7, 0.7, 1.0, 0.0, 1.0]), group_size=3)
    assert torch.equal(adv[:3], torch.zeros(3))
    assert adv[3:].abs().sum() > 0


def test_group_of_one_gives_zero_not_nan():
    """Guards against NaN from the unbiased std of a single sample poisoning the loss."""
    adv = compute_advantages(torch.tensor([1.0, 0.0]), group_size=1)
    assert torch.equal(adv, torch.zeros(2))


def test_scores_must_form_whole_groups():
    """Guards against silently mixing samples of different prompts in one group."""
    with pytest.raises(ValueError):
        compute_advantages(torch.zeros(5), group_size=2)


@pytest.mark.parametrize("kind", ["k1", "k2", "low_var_kl"])
def test_identical_logprobs_give_zero_kl(kind):
    """Guards against an estimator with an offset: a policy equal to the reference must cost nothing."""
    logp = torch.tensor([[-0.1, -2.0, -5.0]])
    assert torch.equal(kl_penalty(logp, logp.clone(), kind), torch.zeros_like(logp))


def test_kl_estimators_hand_values():
    """Guards against a sign flip (x = ref - logp) or a swapped k2/k3."""
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    x = -0.5  # ref - logp
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_penalty(logp, ref, "low_var_kl").item() == pytest.approx(math.exp(x) - x - 1)


def test_low_var_kl_is_bounded_and_finite():
    """Guards against exp() overflow turning one wild token into an inf loss."""
    logp = torch.tensor([0.0, -100.0, -1e4])
    ref = torch.tensor([-1e4, 0.0, 0.0])
    kl = kl_penalty(logp, ref, "low_var_kl")
    assert torch.isfinite(kl).all() and (kl >= 0).all() and (kl <= 10).all()


def _loss_and_grad(logp_value, adv_value, **kw):
    logp = torch.tensor([[logp_value]], requires_grad=True)
    loss, clipped = policy_loss(logp, torch.zeros(1, 1), torch.tensor([[adv_value]]), **kw)
    loss.sum().backward()
    return loss.item(), logp.grad.item(), bool(clipped.item())


def test_policy_loss_unclipped_region():
    """Guards against a wrong surrogate: inside the trust region loss = -A r and d/dlogp = -A r."""
    ratio = 1.1
    loss, grad, clipped = _loss_and_grad(math.log(ratio), 2.0)
    assert loss == pytest.approx(-2.0 * ratio) and grad == pytest.approx(-2.0 * ratio) and not clipped


@pytest.mark.parametrize(("ratio", "adv"), [(1.5, 1.0), (0.5, -1.0)])
def test_clipped_region_has_zero_gradient(ratio, adv):
    """Guards against the clip leaking gradient (or clipping on the wrong side, low=0.2/high=0.3)."""
    loss, grad, clipped = _loss_and_grad(math.log(ratio), adv)
    bound = 1.3 if adv > 0 else 0.8
    assert loss == pytest.approx(-adv * bound) and grad == 0.0 and clipped


def test_asymmetric_clip_bounds():
    """Guards against clip_high being ignored: ratio 1.25 is inside [0.8, 1.3], so no clip for A > 0."""
    _, grad, clipped = _loss_and_grad(math.log(1.25), 1.0)
    assert grad != 0.0 and not clipped


def test_dual_clip_caps_negative_advantage_loss():
    """Guards against an unbounded loss when a token with A < 0 has an exploding ratio (dual clip c=3)."""
    loss, grad, clipped = _loss_and_grad(math.log(10.0), -2.0)
    assert loss == pytest.approx(6.0) and grad == 0.0 and clipped
    # below c the ordinary (unclipped, since r > 1 + high only matters for A > 0) surrogate applies
    loss, grad, _ = _loss_and_grad(math.log(2.0), -2.0)
    assert loss == pytest.approx(4.0) and grad == pytest.approx(4.0)


def _random_batch(seed=0, b=8, t=7):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(b, t, generator=g)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).float()
    return loss, mask


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("splits", [[8], [3, 5], [1, 2, 2, 3], [1] * 8])
def test_aggregation_is_exact_over_any_split(mode, splits):
    """Guards against averaging per micro-batch (or per rank): shares with global totals must sum to the full mean."""
    loss, mask = _random_batch()
    full = aggregate_loss(loss, mask, mode)
    num_tokens, num_seqs = mask.sum(), mask.shape[0]
    total, start = 0.0, 0
    for size in splits:  # micro-batches on one rank or chunks on different ranks: the same arithmetic
        part = slice(start, start + size)
        total = total + aggregate_loss(loss[part], mask[part], mode, num_tokens, num_seqs)
        start += size
    torch.testing.assert_close(total, full, rtol=1e-6, atol=1e-6)


def test_token_mean_hand_value_and_padding_ignored():
    """Guards against padding tokens entering the mean."""
    loss = torch.tensor([[1.0, 3.0, 100.0], [5.0, 100.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(3.0)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2.0 + 5.0) / 2)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx((4.0 / 3 + 5.0 / 3) / 2)
