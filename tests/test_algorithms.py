"""Algorithm variants (estimators, KL kinds, GSPO, TIS, overlong penalty) against hand computations and properties."""

import math

import pytest
import torch

from train_grpo import (
    ADVANTAGE_ESTIMATORS,
    aggregate_loss,
    compute_advantages,
    kl_penalty,
    overlong_penalty,
    policy_loss,
    rollout_is_weights,
)


def test_dr_grpo_is_centred_without_std_division():
    """Guards against Dr. GRPO still dividing by the group std (or not summing to zero per group)."""
    scores = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.5, 2.0])
    adv = compute_advantages(scores, 3, "dr_grpo")
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, -0.5, -0.5, 1.0]))
    torch.testing.assert_close(adv.view(2, 3).sum(1), torch.zeros(2), atol=1e-6, rtol=0)


def test_rloo_is_score_minus_leave_one_out_mean():
    """Guards against RLOO including the sample itself in its own baseline."""
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(12, generator=g)
    adv = compute_advantages(scores, 4, "rloo")
    for i in range(12):
        group = scores[i // 4 * 4 : i // 4 * 4 + 4]
        others = (group.sum() - scores[i]) / 3
        assert adv[i].item() == pytest.approx((scores[i] - others).item(), abs=1e-6)


def test_reinforce_pp_whitens_over_the_batch():
    """Guards against REINFORCE++ normalising per group (it whitens over the whole batch)."""
    scores = torch.tensor([1.0, 1.0, 0.0, 0.0, 3.0, 3.0])
    adv = compute_advantages(scores, 2, "reinforce_plus_plus")
    expected = (scores - scores.mean()) / (scores.std() + 1e-6)
    torch.testing.assert_close(adv, expected)
    assert adv[:2].abs().sum() > 0  # a zero-variance group still gets a signal relative to the batch


def test_grpo_passk_credits_only_the_best_by_its_margin():
    """Guards against crediting every answer (plain GRPO) instead of the best one by its lead over the runner-up."""
    scores = torch.tensor([0.2, 0.9, 0.5, 1.0, 1.0, 0.0])
    adv = compute_advantages(scores, 3, "grpo_passk")
    torch.testing.assert_close(adv, torch.tensor([0.0, 0.4, 0.0, 0.0, 0.0, 0.0]))


@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
def test_groups_of_one_are_defined(estimator):
    """Guards against NaN advantages when rollout.n=1."""
    adv = compute_advantages(torch.tensor([1.0, 0.0, 0.5]), 1, estimator)
    assert torch.isfinite(adv).all()
    if estimator != "reinforce_plus_plus":  # batch whitening still compares samples across prompts
        assert torch.equal(adv, torch.zeros(3))


def test_abs_kl():
    """Guards against a signed value where the 'abs' kind must be |logp - ref_logp|."""
    assert kl_penalty(torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -1.0]), "abs").tolist() == [1.0, 2.0]


def test_gspo_ratio_is_per_sequence():
    """Guards against GSPO clipping per token: one sequence ratio (geometric mean) is clipped as a whole."""
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.3, -0.3, 0.0], [0.01, 0.01, 0.5]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0], [1.0]])
    loss, clipped = policy_loss(logp, old, adv, clip_low=3e-4, clip_high=4e-4, mode="gspo", mask=mask)
    # sequence 0: mean log-ratio 0 -> ratio 1, inside the clip: loss -1 at every token, gradient flows
    torch.testing.assert_close(loss[0], torch.full((3,), -1.0))
    assert not clipped[0].any()
    # sequence 1: mean log-ratio over its 2 real tokens 0.01 -> ratio e^0.01 > 1 + 4e-4: clipped for A > 0
    assert loss[1, 0].item() == pytest.approx(-(1 + 4e-4)) and clipped[1, :2].all()
    (loss * mask).sum().backward()
    assert logp.grad[0].abs().sum() > 0 and logp.grad[1].abs().sum() == 0


def test_gspo_equals_ppo_gradient_at_ratio_one():
    """Guards against a wrong GSPO gradient: at the old policy both give d loss / d logp = -A per token."""
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = policy_loss(logp, logp.detach().clone(), torch.tensor([[2.0]]), mode="gspo")
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0, -2.0]]))


def test_tis_weights_are_capped_ratios():
    """Guards against an uncapped (exploding) importance weight or a flipped ratio."""
    old = torch.tensor([[-1.0, -1.0, -5.0]])
    rollout = torch.tensor([[-1.0, -2.0, -1.0]])
    w = rollout_is_weights(old - rollout, torch.ones_like(old), "token", 2.0)  # what algorithm.tis_cap=2 applies
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, math.exp(-4.0)]]))


def test_overlong_penalty_ramp():
    """Guards against punishing answers inside the safe length, or past -factor at the limit."""
    pen = overlong_penalty(torch.tensor([10, 60, 80, 100, 120]), max_length=100, buffer=40, factor=1.0)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))


def test_sum_norm_uses_a_fixed_horizon_across_micro_batches():
    """Guards against Dr. GRPO's length normaliser following each micro-batch's padded width."""
    loss = torch.ones(2, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    full = aggregate_loss(loss, mask, "seq-mean-token-sum-norm", horizon=8)
    parts = aggregate_loss(loss[:1], mask[:1], "seq-mean-token-sum-norm", num_seqs=2, horizon=8) + aggregate_loss(
        loss[1:, :1], mask[1:, :1], "seq-mean-token-sum-norm", num_seqs=2, horizon=8
    )  # the second micro-batch is only 1 column wide
    assert full.item() == pytest.approx((4 / 8 + 1 / 8) / 2) and parts.item() == pytest.approx(full.item())


OPTION_RUNS = {
    "gspo_tis_kl_in_reward": [
        "algorithm.adv_estimator=reinforce_plus_plus", "algorithm.kl_in_reward=true", "algorithm.kl_penalty=k1",
        "algorithm.tis_cap=2.0",
        "actor.policy_loss=gspo", "actor.clip_ratio_low=3e-4", "actor.clip_ratio_high=4e-4",
        "actor.entropy_coef=1e-3", "actor.mask_truncated=true", "reward.overlong_buffer=4",
        "actor.loss_agg_mode=seq-mean-token-sum-norm", "actor.ppo_epochs=2", "actor.global_batch_size=4",
        "actor.micro_batch_size=8",
    ],
    "estimators_and_kl_kinds": [
        "algorithm.adv_estimator=rloo", "algorithm.kl_penalty=abs", "actor.loss_agg_mode=seq-mean-token-mean",
        "actor.freeze_vision_tower=true", "actor.gradient_checkpointing=false", "rollout.n=4",
        "algorithm.online_filtering=true", "algorithm.filter_key=overall", "algorithm.filter_low=0.001",
    ],
    "no_reference_model": ["algorithm.kl_coef=0", "algorithm.adv_estimator=grpo_passk", "actor.lr_warmup_steps=3"],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(OPTION_RUNS))
def test_non_default_options_run_end_to_end(name, tiny_model_dir, tmp_path):
    """Guards against an option that validates but crashes or produces NaN in a real 2-rank step."""
    import json

    from scripts.make_synthetic_data import make_geo3k_like
    from tests.launch import torchrun

    train = make_geo3k_like(str(tmp_path / "train.parquet"), n_rows=32, seed=0)
    out = tmp_path / "run"
    torchrun(
        2, "train_grpo.py", "configs/tiny.yaml", f"actor.model_path={tiny_model_dir}", f"data.train_files={train}",
        "data.val_files=", f"trainer.output_dir={out}", "trainer.max_steps=2", "data.rollout_batch_size=8",
        "actor.global_batch_size=8", *OPTION_RUNS[name],
    )  # fmt: skip
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
    if name == "gspo_tis_kl_in_reward":
        assert "rollout/tis_weight_mean" in rows[-1]
        assert rows[-1]["actor/optimizer_steps"] == 4  # 2 ppo epochs x 2 mini-batches of 4 prompts
    if name == "estimators_and_kl_kinds":
        assert all(r["rollout/prompts_drawn"] >= 8 and "rollout/filtered_groups" in r for r in rows)
    if name == "no_reference_model":
        assert rows[-1]["actor/kl"] == 0.0


class _FakeEngine:
    """Answers each prompt with n copies of its own problem text, so the fake scorer controls every group's score."""

    carry, stats = None, {}  # no partial rollouts, no tool counts

    def generate(self, prompts, n, params, seed):
        from rollout import Sample

        return [Sample(i, [1], [0.0], p.text, False) for i, p in enumerate(prompts) for _ in range(n)]


class _FakeScorer:
    n_timeouts = 0  # cumulative, as RewardScorer keeps it
    call_errors = []  # no grading failures: RewardScorer's failure report has nothing to say

    def all_failed(self):
        return False

    def report_failures(self, step, everywhere, first_rank, rank):
        assert not everywhere and first_rank is None

    def score(self, responses, answers, rows=None):
        # problems "right" score 1, "wrong" 0, "mixed" alternate: only mixed groups carry a learning signal; a
        # "hang" answer is one whose grading timed out: it scores 0 and counts
        out = []
        for k, text in enumerate(responses):
            self.n_timeouts += text == "hang"
            acc = {"right": 1.0, "wrong": 0.0, "hang": 0.0}.get(text, float(k % 2))
            out.append({"overall": acc, "accuracy": acc, "format": 0.0})
        return out


@pytest.fixture
def single_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29731", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _filtering_run(problems, rounds, scorer=None):
    from types import SimpleNamespace

    import rollout
    from data import ShardSampler
    from train_grpo import collect_rollouts, load_config

    cfg = load_config(None, ["data.rollout_batch_size=4", "rollout.n=2", "algorithm.online_filtering=true",
                             f"algorithm.max_filter_rounds={rounds}"])  # fmt: skip
    train_set = [SimpleNamespace(problem=p, answer="", text=p) for p in problems]
    processor = None
    encode = rollout.encode_prompt
    rollout.encode_prompt = lambda proc, ex: SimpleNamespace(text=ex.problem)
    try:
        sampler = ShardSampler(len(train_set), 0, 1, seed=0, shuffle=False)
        scorer = scorer or _FakeScorer()
        return collect_rollouts(_FakeEngine(), scorer, processor, train_set, sampler, 0, 0, cfg, 1, {})
    finally:
        rollout.encode_prompt = encode


def test_online_filtering_fills_the_batch_with_informative_groups(single_rank_group):
    """Guards against dynamic sampling returning a short batch, or keeping all-right/all-wrong groups."""
    problems = ["right", "mixed", "wrong", "wrong", "mixed", "right", "mixed", "wrong"] * 2
    (examples, prompts, samples, results, stats), epoch, position = _filtering_run(problems, rounds=8)
    assert [ex.problem for ex in examples] == ["mixed"] * 4
    assert len(samples) == 8 and [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2, 3, 3]
    # the 4th informative group is at index 9: 3 rounds of 4 prompts, 8 groups dropped
    assert stats["rollout/filter_rounds"] == 3 and stats["rollout/prompts_drawn"] == 12
    assert stats["rollout/filtered_groups"] == 8
    assert (epoch, position) == (0, 12)  # the data position moved past every prompt drawn


def test_online_filtering_gives_up_with_a_clear_error(single_rank_group):
    """Guards against an endless loop when no prompt is informative."""
    with pytest.raises(RuntimeError, match=r"only 0 of the 4 prompt groups .* after 3 rounds.*max_filter_rounds"):
        _filtering_run(["right", "wrong"] * 8, rounds=3)


def test_step_timeouts_count_every_round_of_the_step(single_rank_group):
    """Guards against reward/timeouts_step counting only the last score() call of a step (dynamic sampling grades
    in several rounds) or reporting the cumulative counter: 2 rounds of 4 prompts x 2 answers, 3 "hang" prompts
    drawn in them -> 6 timeouts this step, whatever the scorer counted before."""
    scorer = _FakeScorer()
    scorer.n_timeouts = 5  # from earlier steps
    problems = ["hang", "mixed", "wrong", "hang", "mixed", "hang", "mixed", "mixed"]
    (_, _, _, _, stats), _, _ = _filtering_run(problems, rounds=4, scorer=scorer)
    assert stats["rollout/filter_rounds"] == 2 and stats["reward/timeouts_step"] == 6
    assert scorer.n_timeouts == 11


def test_a_reward_failing_on_every_answer_stops_the_step(single_rank_group, tmp_path):
    """Guards against a reward that returns the wrong type on every answer training on at reward 0 (it did, to the
    end, exit 0): the step's reduction over ranks sees every answer failed and stops it with the function's error."""
    from grpo.grading import RewardScorer

    (tmp_path / "wrong.py").write_text("def reward(response, ground_truth):\n    return 'correct'\n")
    with RewardScorer(f"{tmp_path / 'wrong.py'}:reward", timeout=None) as scorer:
        with pytest.raises(SystemExit, match=r"^error: step 1: .* every answer, e.g. TypeError: .*returned str"):
            _filtering_run(["mixed"] * 8, rounds=3, scorer=scorer)
        assert scorer.n_errors == 8  # the first round's 4 prompts x 2 answers: no second round was drawn
