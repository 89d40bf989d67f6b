"""On-policy distillation (grpo/distill.py): the teacher's per-token term, the teachers refused, and the CPU demo in
which a digit-writing teacher teaches a fresh tiny model with no reward. (The term is 0 for every token when the
teacher is the policy's own checkpoint: tests/load_check.py, in test_loading's launches on 1 and 2 ranks.)"""

import json

import pytest
import torch

import train_grpo
from grpo import distill
from grpo.config import ActorConfig, DistillConfig
from grpo.stats import StepStats
from scripts.make_synthetic_data import make_geo3k_like
from tests.launch import torchrun


def test_teacher_term_by_hand_and_on_answer_tokens_only():
    """Guards against the term's sign (the token the teacher likes more than the policy must gain), its weight, a
    term on masked tokens (tool-returned tokens, padding) and statistics over other tokens than the loss's."""
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])  # (B, T)
    teacher = torch.tensor([[-0.5, -4.0, -3.0], [-1.5, -0.5, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # row 1: a tool token, then padding
    term = distill.teacher_advantage(old, teacher, 0.5)
    assert torch.equal(term, torch.tensor([[0.25, -1.0, 0.0], [-0.5, 0.0, -4.5]]))
    stats = StepStats()
    adv = distill.token_advantages(torch.tensor([[1.0], [-1.0]]), old, teacher, mask, 2.0, 8.0, stats)
    assert torch.equal(adv, torch.tensor([[2.0, -3.0, 1.0], [-3.0, -1.0, -1.0]]))  # the reward's + 2 x log ratio
    # over the 4 answer tokens, as a share of a step of 8: (old - teacher) = -0.5, 2, 0, 1
    assert stats["distill/reverse_kl"] == pytest.approx(2.5 / 8) and stats["distill/advantage"] == pytest.approx(-5 / 8)


def test_policy_loss_takes_per_token_advantages():
    """Guards against a loss that assumes one advantage a sequence: a (B, T) advantage must give each token its own
    clipped surrogate, equal to the (B, 1) form where the tokens agree."""
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]])
    old = torch.tensor([[-1.2, -1.5], [-0.5, -1.0]])
    adv = torch.tensor([[1.0, -2.0], [0.5, 0.5]])
    loss, clipped = train_grpo.policy_loss(logp, old, adv)
    for b in range(2):
        for t in range(2):
            one, one_clipped = train_grpo.policy_loss(logp[b : b + 1, t : t + 1], old[b : b + 1, t : t + 1], adv[b, t])
            assert loss[b, t] == one[0, 0] and clipped[b, t] == one_clipped[0, 0]
    assert torch.equal(train_grpo.policy_loss(logp, old, adv[:, :1].expand(2, 2))[0][1], loss[1])


@pytest.mark.parametrize("teacher, says", [("tools", "its tokenizer differs"), ("qwen3_vl", "its processor cuts")])
def test_a_teacher_of_another_tokenizer_or_processor_is_refused(
    teacher, says, tiny_model_dir, tiny_tools_model_dir, tiny_family_dir, tmp_path, capsys
):
    """Guards against distilling from a teacher whose token ids or image patches mean other things than the
    policy's (its log-probs would be of other tokens, silently): the dry run and the start stop before anything loads,
    naming distill.model_path and what differs. The tools model has two tokens more; the tiny Qwen3-VL the same
    tokenizer, but 16 px patches where Qwen2.5-VL's are 14."""
    path = tiny_tools_model_dir if teacher == "tools" else tiny_family_dir("qwen3_vl")
    data = make_geo3k_like(str(tmp_path / "train.parquet"), n_rows=16, seed=0)
    argv = ["configs/tiny_distill.yaml", f"actor.model_path={tiny_model_dir}", f"distill.model_path={path}",
            f"data.train_files={data}", f"data.val_files={data}", "--dry-run"]  # fmt: skip
    assert train_grpo.main(argv) == 2
    out = capsys.readouterr()
    assert f"distill.model_path={path!r}: {says}" in out.out + out.err
    with pytest.raises(ValueError, match=says):  # a hub id the dry run could not read: refused at load, unloaded
        distill.load_teacher(DistillConfig(model_path=path), ActorConfig(model_path=tiny_model_dir), None, 0)
    assert distill.teacher_problem(tiny_model_dir, tiny_model_dir) is None


def test_a_teacher_needs_a_positive_coefficient():
    """Guards against loading a teacher whose term weighs nothing (or pushes the policy away from it) by a typo."""
    from grpo.config import ConfigError

    for coef in ("0", "-1"):
        cfg = train_grpo.load_config(None, ["distill.model_path=some/teacher", f"distill.coef={coef}"])
        with pytest.raises(ConfigError, match="distill.coef"):
            train_grpo.check_config(cfg, 1)
    train_grpo.check_config(train_grpo.load_config(None, ["distill.coef=0"]), 1)  # no teacher: the weight is unused


def test_a_mixture_of_experts_teacher_scores_a_dense_students_batch(tiny_family_dir, one_rank_group):
    """Guards against a teacher that works only as a copy of the policy: a tiny Qwen3-VL-MoE (routed experts, another
    model class) teaching the tiny dense Qwen3-VL (the same tokenizer and processor) must give, on the student's
    packed batch with images, exactly the log-probs the MoE checkpoint gives as a policy of its own."""
    from transformers import AutoProcessor

    import rollout
    from grpo import loading
    from tests.test_packing import _mixed_batch

    student, teacher_dir = tiny_family_dir("qwen3_vl"), tiny_family_dir("qwen3_vl_moe")
    assert distill.teacher_problem(student, teacher_dir) is None
    cfg = train_grpo.load_config(None, [f"actor.model_path={student}", f"distill.model_path={teacher_dir}"])
    processor = AutoProcessor.from_pretrained(student)
    prompts, responses = _mixed_batch(processor, processor.tokenizer.convert_tokens_to_ids("<|image_pad|>"))
    samples = [rollout.Sample(i, r, [0.0] * len(r), "", False) for i, r in enumerate(responses)]
    cpu, pad_id = torch.device("cpu"), processor.tokenizer.pad_token_id
    policy, _ = loading.load_policy_and_reference(cfg.actor, cpu, False, pad_id)
    teacher = distill.load_teacher(cfg.distill, cfg.actor, cpu, pad_id)
    ids = (pad_id, policy.config.image_token_id)
    policy.eval()
    old, _, taught = train_grpo.compute_old_and_ref_logprobs(policy, None, prompts, samples, cfg, ids, True, teacher)
    as_policy, _ = loading.load_policy_and_reference(ActorConfig(model_path=teacher_dir), cpu, False, pad_id)
    as_policy.eval()
    own, _, _ = train_grpo.compute_old_and_ref_logprobs(as_policy, None, prompts, samples, cfg, ids, True)
    assert [len(t) for t in taught] == [len(r) for r in responses]
    assert all(torch.equal(t, o) for t, o in zip(taught, own))
    assert max((t - o).abs().max().item() for t, o in zip(taught, old)) > 1e-2  # another model than the student


STEPS = 30  # the demo's: every seed of 1-5 rose by 0.62-0.65 (docs/tests.md), 20 steps by about 0.25


def test_distill_demo_student_writes_as_its_teacher(tiny_model_dir, tmp_path):
    """Guards against a teacher's signal that does not reach the update (misaligned tokens, wrong samples after the
    ranks' rebalancing, the wrong sign, the term lost beside a zero reward advantage, a teacher's shards garbled by
    the offload round trip, which on CPU must copy them out and back unchanged): the demo's config (2 ranks, vLLM,
    packed shared prefixes, token budgets) with a zero reward and the tiny model with its digits raised as teacher
    (make demo-distill), with actor.offload_params. The student's share of digits must rise by at least 0.2 from the
    first 5 steps to the last 5, and its reverse KL to the teacher fall."""
    from scripts.make_tiny_model import build_tiny_model

    teacher = build_tiny_model(str(tmp_path / "teacher"), seed=0, digit_logit=5.0)
    data = make_geo3k_like(str(tmp_path / "train.parquet"), n_rows=128, seed=0)
    out_dir = tmp_path / "run"
    torchrun(
        2, "train_grpo.py", "configs/tiny_distill.yaml", f"actor.model_path={tiny_model_dir}",
        f"distill.model_path={teacher}", f"data.train_files={data}", f"trainer.output_dir={out_dir}",
        "trainer.export_hf=false", "actor.offload_params=true",  # (the teacher's shards to host and back each step)
    )  # fmt: skip
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["reward/overall"] == 0 and r["time/teacher"] > 0 for r in rows)  # the teacher is the only signal
    mean = lambda key, part: sum(r[key] for r in part) / len(part)  # noqa: E731
    first, last = mean("reward/digits", rows[:5]), mean("reward/digits", rows[-5:])
    kl_first, kl_last = mean("distill/reverse_kl", rows[:5]), mean("distill/reverse_kl", rows[-5:])
    print(f"digits {first:.3f} -> {last:.3f}, reverse KL {kl_first:.3f} -> {kl_last:.3f}")
    assert last >= first + 0.2, (first, last)
    assert kl_last < kl_first - 0.1, (kl_first, kl_last)


def test_a_teacher_routes_by_its_own_routers_under_routing_replay(tiny_family_dir, one_rank_group):
    """Guards against the student's recorded routes reaching the teacher's forward: the routes are the policy's
    experts, replayed by the policy (and its reference), meaningless for another model's routers. Student and teacher
    are the same tiny Qwen3-VL-MoE checkpoint and the samples carry random routes: the student's log-probs follow
    them, the teacher's must be its own routing's, as if no route were recorded."""
    from transformers import AutoProcessor

    import rollout
    from grpo import loading, replay
    from tests.test_packing import _mixed_batch

    moe_dir = tiny_family_dir("qwen3_vl_moe")
    cfg = train_grpo.load_config(None, [f"actor.model_path={moe_dir}", f"distill.model_path={moe_dir}",
                                        "algorithm.routing_replay=r3"])  # fmt: skip
    processor = AutoProcessor.from_pretrained(moe_dir)
    prompts, responses = _mixed_batch(processor, processor.tokenizer.convert_tokens_to_ids("<|image_pad|>"))
    cpu, pad_id = torch.device("cpu"), processor.tokenizer.pad_token_id
    policy, _ = loading.load_policy_and_reference(cfg.actor, cpu, False, pad_id)
    teacher = distill.load_teacher(cfg.distill, cfg.actor, cpu, pad_id)
    text = policy.config.get_text_config()
    layers = len(replay.moe.routers(policy))
    gen, k = torch.Generator().manual_seed(0), text.num_experts_per_tok
    pick = lambda n: torch.stack([torch.randperm(text.num_experts, generator=gen)[:k] for _ in range(n)])  # noqa: E731
    routes = [pick((len(p.input_ids) + len(r)) * layers).view(-1, layers, k) for p, r in zip(prompts, responses)]
    routed = [rollout.Sample(i, r, [0.0] * len(r), "", False, routes=x.to(torch.int8))
              for i, (r, x) in enumerate(zip(responses, routes))]  # fmt: skip
    plain = [rollout.Sample(i, r, [0.0] * len(r), "", False) for i, r in enumerate(responses)]
    ids = (pad_id, policy.config.image_token_id)
    policy.eval()
    old, _, taught = train_grpo.compute_old_and_ref_logprobs(policy, None, prompts, routed, cfg, ids, True, teacher)
    own, _, _ = train_grpo.compute_old_and_ref_logprobs(policy, None, prompts, plain, cfg, ids, True)
    assert all(torch.allclose(t, o, atol=1e-6) for t, o in zip(taught, own))
    assert max((t - o).abs().max().item() for t, o in zip(taught, old)) > 1e-3  # the student's followed the routes
