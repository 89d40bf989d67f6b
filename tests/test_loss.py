"""The loss of a micro-batch as one pure function of tensors: its total and its named terms, against hand values."""

import pytest
import torch

from train_grpo import micro_batch_loss


def _batch():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -1.0]], requires_grad=True)  # (B, T)
    old = logp.detach().clone()  # on-policy: every ratio is 1
    adv = torch.tensor([[1.0], [-2.0]])  # (B, 1)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])  # 3 tokens
    entropy = torch.tensor([[0.3, 0.6], [0.9, 5.0]])  # the masked-out 5.0 must not count
    ref = logp.detach() - 0.1  # x = ref - logp = -0.1 on every token
    return logp, old, adv, mask, entropy, ref


def test_the_total_is_its_named_terms_at_their_weights():
    """Guards against a term that enters the loss and not the logs, or the logs and not the loss: the total must be
    pg + kl_coef x kl - entropy_coef x entropy + router_coef x router share, each term a share of the step's token
    mean (here 6 tokens over all ranks, 3 of them in this micro-batch)."""
    logp, old, adv, mask, entropy, ref = _batch()
    loss, terms = micro_batch_loss(logp, old, adv, mask, entropy, num_tokens=6.0, num_seqs=4, horizon=2,
                                   ref_logp=ref, kl_coef=0.5, entropy_coef=0.1, router_loss=torch.tensor(2.0),
                                   router_coef=0.01)  # fmt: skip
    k3 = torch.tensor(-0.1).exp().item() + 0.1 - 1  # low_var_kl at x = -0.1
    pg = (-1.0 - 1.0 + 2.0) / 6  # -A x ratio over the masked tokens
    assert terms["actor/pg_loss"].item() == pytest.approx(pg, abs=1e-7)
    assert terms["actor/kl"].item() == pytest.approx(3 * k3 / 6, rel=1e-4)  # (float32: exp(x) - x - 1 cancels)
    assert terms["actor/entropy"].item() == pytest.approx((0.3 + 0.6 + 0.9) / 6)
    assert terms["actor/router_aux_loss"].item() == pytest.approx(2.0 * 3 / 6)
    assert terms["actor/clip_frac"].item() == 0.0
    expected = pg + 0.5 * 3 * k3 / 6 - 0.1 * 1.8 / 6 + 0.01 * 1.0
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss.backward()  # the gradient flows to logp through the policy, KL and nothing masked
    assert logp.grad[1, 1] == 0 and logp.grad[0, 0] != 0


def test_corrections_and_a_teacher_enter_the_loss_and_the_terms():
    """Guards against the mismatch correction's weights or a teacher's term missing from the loss: weights scale each
    token's policy term; the teacher's coef x (teacher - old) joins each token's advantage and is logged as
    distill/advantage and distill/reverse_kl."""
    logp, old, adv, mask, entropy, _ = _batch()
    weights = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    plain, _ = micro_batch_loss(logp, old, adv, mask, entropy, num_tokens=3.0, num_seqs=2, horizon=2)
    weighted, _ = micro_batch_loss(logp, old, adv, mask, entropy, num_tokens=3.0, num_seqs=2, horizon=2,
                                   weights=weights)  # fmt: skip
    assert plain.item() == pytest.approx((-1 - 1 + 2) / 3, abs=1e-7)
    assert weighted.item() == pytest.approx((-2 + 0 + 2) / 3, abs=1e-7)
    teacher = old + 1.0  # the teacher is 1 nat surer of every token
    loss, terms = micro_batch_loss(logp, old, adv, mask, entropy, num_tokens=3.0, num_seqs=2, horizon=2,
                                   teacher_logp=teacher, distill_coef=0.5)  # fmt: skip
    assert terms["distill/advantage"].item() == pytest.approx(0.5)  # 0.5 on each of the 3 tokens, / 3
    assert terms["distill/reverse_kl"].item() == pytest.approx(-1.0)
    assert loss.item() == pytest.approx((-1.5 - 1.5 + 1.5) / 3, abs=1e-7)
