"""GRPO fine-tuning of Qwen2.5-VL on Geometry3K: one readable torchrun script.

The algorithm, as the default config (configs/geo3k.yaml) runs it, each choice with the function that holds it:
 1. Each step takes `data.rollout_batch_size` prompts (split evenly over ranks; a prompt's group stays on one rank):
    collect_rollouts.
 2. Rollout: `rollout.n` answers per prompt at temperature 1.0, top_p 1.0; vision special tokens are never sampled:
    the engine's generate (rollout.py).
 3. Reward: 0.9 * accuracy (last \\boxed{} graded equal to the answer) + 0.1 * format (<think>..</think>..\\boxed{}),
    every grading call bounded in time: reward.compute_score, graded by grpo/grading.RewardScorer.
 4. Advantage: GRPO, (score - group mean) / (group std + 1e-6), the same for every token of a response:
    compute_advantages (ADVANTAGE_ESTIMATORS holds the others).
 5. Loss: PPO clipped ratio with clip 0.2 low / 0.3 high and dual clip 3.0 for negative advantages: policy_loss;
    plus 1e-2 x low-variance KL (k3) to the frozen initial policy, as a loss term: kl_penalty (with LoRA,
    actor.lora_rank > 0, the reference is the policy with its adapters switched off, no second model); a
    micro-batch's loss and its logged terms: micro_batch_loss.
 6. Aggregation: token-mean over ALL response tokens of an optimizer step, exact across micro-batches and ranks:
    aggregate_loss.
 7. Update: AdamW (lr 1e-6, wd 1e-2), grad clip 1.0, a step with a non-finite grad norm is skipped and counted;
    `actor.global_batch_size` prompts per optimizer step (rollout batch 512 -> 4 optimizer steps per step):
    update_policy.
 8. Old log-probs are recomputed by the trainer once per rollout batch (skipped when a single on-policy
    update makes them equal to the detached current ones), with the reference's and a teacher's:
    compute_old_and_ref_logprobs.
 9. Validation before training and every `trainer.val_freq` steps at temperature 0.6 / top_p 0.95, n=1: validate.
10. Optional on-policy distillation (distill.model_path; off by default): a frozen teacher's log-probs of the sampled
    tokens add coef x (log p_teacher - log p_old) to each token's advantage: grpo/distill.token_terms.

Launch:
    torchrun --nproc_per_node=8 train_grpo.py configs/geo3k.yaml                   # one 8-GPU node
    torchrun --nproc_per_node=2 train_grpo.py configs/tiny.yaml                    # the CPU demo
    torchrun --nproc_per_node=2 train_grpo.py configs/tiny.yaml trainer.max_steps=5 rollout.n=4   # overrides
    python train_grpo.py configs/geo3k.yaml --dry-run         # the memory plan, the model, data, reward: no GPU needed

This file holds the GRPO math as pure functions, the phases of a step and main(); a variant is a function and an
entry in its table (ADVANTAGE_ESTIMATORS, KL_PENALTIES, POLICY_LOSSES, LOSS_AGGREGATIONS), which the config check
reads; its own settings are its keyword arguments (actor.policy_loss_kwargs, algorithm.adv_estimator_kwargs). A
statistic is one line where it is computed (grpo/stats.py). Below this file: rollout.py (the engines' interface),
reward.py (the rewards and their contract), data.py (prompts, images, videos) and the machinery in grpo/, a module a
job (grpo/config.py: every key with its default; the README's layout table names the rest). Nothing imports this
file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import rollout
from grpo import linear_attention, locate, mismatch, partial, preflight, replay, routing, sequence_parallel, turns
from grpo.attention import OWN_PACKED_ATTENTION
from grpo.batching import balance_over_ranks, collate, pack, plan_micro_batches, shared_prefix_parts, stack_padded
from grpo.checkpoint import find_resume_checkpoint, load_checkpoint, save_adapter, save_checkpoint, save_hf
from grpo.config import Config, ConfigError, config_to_dict, load_config
from grpo.config import check_config as check_config_against
from grpo.distill import load_teacher, token_terms
from grpo.distributed import (
    StopSignal,
    max_over_ranks,
    mean_over_ranks,
    phase,
    print0,
    report_stop,
    run_rank,
    setup_distributed,
    shut_down,
)
from grpo.loading import load_policy_and_reference, reshard
from grpo.logger import MetricsLogger, save_config
from grpo.logprobs import compute_device, forward_logprobs
from grpo.lora import adapters_disabled
from grpo.machine import release_host_memory
from grpo.memory_plan import plan_memory, planned_world
from grpo.mismatch import rollout_is_weights, rollout_rejection_mask  # noqa: F401 (the corrections' names here too)
from grpo.model_shape import PlanError
from grpo.offload import TrainerOffload
from grpo.optim import make_optimizer
from grpo.plan_advice import format_plan, plan_problem
from grpo.preflight import check_paths
from grpo.startup import check_gpu_memory, print_banner
from grpo.stats import StepStats

# ----------------------------------------------------------------------------------------------------------------------
# The math: pure functions on tensors. Response tensors are (B, T): B sequences, T response positions, `mask` marks
# real (non-padding) response tokens.


def _grpo_advantages(scores, group_size, eps):
    groups = scores.view(-1, group_size)  # (G, n)
    if group_size == 1:  # a lone sample has no group to compare with: no signal, and never NaN
        return torch.zeros_like(scores)
    mean = groups.mean(dim=1, keepdim=True)  # (G, 1)
    std = groups.std(dim=1, keepdim=True)  # (G, 1), unbiased
    return ((groups - mean) / (std + eps)).view(-1)  # (N,)


def _dr_grpo_advantages(scores, group_size, eps):
    # Dr. GRPO (https://arxiv.org/abs/2503.20783): dividing by the std favours too-easy and too-hard prompts
    groups = scores.view(-1, group_size)  # (G, n)
    return (groups - groups.mean(dim=1, keepdim=True)).view(-1)  # (N,)


def _rloo_advantages(scores, group_size, eps):
    # REINFORCE leave-one-out (https://arxiv.org/abs/2402.14740): baseline = mean of the other n - 1 answers
    if group_size == 1:
        return torch.zeros_like(scores)
    groups = scores.view(-1, group_size)  # (G, n)
    others = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)  # (G, n)
    return (groups - others).view(-1)  # (N,)


def batch_level(estimator):
    """Marks an estimator whose baseline is not the prompt's group (its table entry says so): it learns from one
    answer a prompt, so the config check lets it run at rollout.n=1, which it refuses to a group estimator."""
    estimator.batch_level = True
    return estimator


def _reinforce_pp_advantages(scores, group_size, eps):
    # REINFORCE++ (https://arxiv.org/abs/2501.03262): whiten the returns over the whole batch, not per group
    if scores.numel() == 1:
        return torch.zeros_like(scores)
    return (scores - scores.mean()) / (scores.std() + eps)  # (N,)


def _grpo_passk_advantages(scores, group_size, eps):
    # Pass@k training (https://arxiv.org/abs/2508.10751), the variant EasyR1 ships: only the best answer of a group
    # is credited, by its margin over the runner-up, so the group is optimised for its best try
    if group_size == 1:
        return torch.zeros_like(scores)
    groups = scores.view(-1, group_size)  # (G, n)
    top2 = groups.topk(2, dim=1).values  # (G, 2)
    best = groups.argmax(dim=1, keepdim=True)  # (G, 1), first of equal maxima
    adv = torch.zeros_like(groups).scatter(1, best, top2[:, :1] - top2[:, 1:])  # (G, n)
    return adv.view(-1)  # (N,)


ADVANTAGE_ESTIMATORS = {
    "grpo": _grpo_advantages,
    "dr_grpo": _dr_grpo_advantages,
    "rloo": _rloo_advantages,
    "reinforce_plus_plus": batch_level(_reinforce_pp_advantages),
    "grpo_passk": _grpo_passk_advantages,
}


def compute_advantages(scores: torch.Tensor, group_size: int, estimator: str = "grpo", eps: float = 1e-6, **kwargs):
    """scores (N,), consecutive groups of `group_size` samples of one prompt -> advantages (N,). `kwargs`: the
    estimator's own settings (algorithm.adv_estimator_kwargs), after the (scores, group_size, eps) every one takes."""
    if scores.numel() % group_size:
        raise ValueError(f"{scores.numel()} scores do not form groups of {group_size}")
    return ADVANTAGE_ESTIMATORS[estimator](scores.float(), group_size, eps, **kwargs)


def _low_var_kl(logp, ref_logp):
    # k3 estimator, unbiased and always >= 0 (http://joschu.net/blog/kl-approx.html); clamps keep exp() finite
    x = (ref_logp - logp).clamp(-20, 20)  # (B, T)
    return (x.exp() - x - 1).clamp(-10, 10)


KL_PENALTIES = {
    "k1": lambda logp, ref_logp: logp - ref_logp,
    "k2": lambda logp, ref_logp: 0.5 * (ref_logp - logp).square(),
    "low_var_kl": _low_var_kl,
    "abs": lambda logp, ref_logp: (logp - ref_logp).abs(),
}


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Elementwise estimate of KL(policy || reference) from the log-probs of the sampled tokens."""
    return KL_PENALTIES[kind](logp, ref_logp)


def _ppo_loss(logp, old_logp, advantages, clip_low, clip_high, clip_dual, mask):
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))  # (B, T)
    unclipped = -advantages * ratio  # (B, T)
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)  # (B, T)
    loss = torch.maximum(unclipped, clipped)  # (B, T)
    dual = torch.minimum(loss, -advantages * clip_dual)  # bounds the loss of A < 0 tokens whose ratio exploded
    is_dual = (advantages < 0) & (loss > -advantages * clip_dual)
    loss = torch.where(advantages < 0, dual, loss)
    return loss, (clipped > unclipped) | is_dual


def _gspo_loss(logp, old_logp, advantages, clip_low, clip_high, clip_dual, mask):
    # GSPO (https://arxiv.org/abs/2507.18071): one ratio per sequence, the geometric mean of its token ratios, clipped
    # as a whole (use clip ratios around 3e-4 / 4e-4). Written per token as sg[s_i] * exp(logp - sg[logp]) so the
    # gradient of every token is scaled by its sequence's ratio.
    mask = torch.ones_like(logp) if mask is None else mask.to(logp.dtype)
    log_seq_ratio = ((logp - old_logp) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # (B,1)
    log_ratio = (log_seq_ratio.detach() + logp - logp.detach()).clamp(max=10)  # (B, T), value = sequence ratio
    ratio = log_ratio.exp()  # (B, T)
    unclipped = -advantages * ratio  # (B, T)
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)  # (B, T)
    return torch.maximum(unclipped, clipped), clipped > unclipped


POLICY_LOSSES = {"ppo": _ppo_loss, "gspo": _gspo_loss}


def policy_loss(
    logp, old_logp, advantages, clip_low=0.2, clip_high=0.3, clip_dual=3.0, mode="ppo", mask=None, **kwargs
):
    """Clipped surrogate. logp, old_logp (B, T); advantages broadcastable to (B, T); `mask` (B, T) for sequence-level
    modes. "ppo": token ratios, clip low/high, dual clip for A < 0 (https://arxiv.org/abs/1912.09729); "gspo".
    `kwargs`: the loss's own settings (actor.policy_loss_kwargs), after the seven arguments every loss takes.

    Returns (loss (B, T), clipped (B, T) bool: tokens whose gradient the clip removed).
    """
    return POLICY_LOSSES[mode](logp, old_logp, advantages, clip_low, clip_high, clip_dual, mask, **kwargs)


def overlong_penalty(lengths, max_length, buffer, factor):
    """DAPO's soft overlong punishment (https://arxiv.org/abs/2503.14476): 0 up to max_length - buffer, then a linear
    ramp down to -factor at max_length. lengths (N,) -> (N,)."""
    over = (lengths.float() - (max_length - buffer)).clamp(min=0)  # (N,)
    return -factor * (over / buffer).clamp(max=1)


def _token_mean(loss, mask, num_tokens, num_seqs, horizon):
    return (loss * mask).sum() / num_tokens


def _seq_mean_token_mean(loss, mask, num_tokens, num_seqs, horizon):
    per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)
    return per_seq.sum() / num_seqs


def _seq_mean_token_sum_norm(loss, mask, num_tokens, num_seqs, horizon):
    # Dr. GRPO (https://arxiv.org/abs/2503.20783): a constant length normaliser (the max response length), the same
    # for every sequence, so long answers are not down-weighted per token
    per_seq = (loss * mask).sum(-1) / horizon  # (B,)
    return per_seq.sum() / num_seqs


LOSS_AGGREGATIONS = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def aggregate_loss(loss, mask, mode="token-mean", num_tokens=None, num_seqs=None, horizon=None):
    """(B, T) loss and mask -> scalar.

    With `num_tokens`/`num_seqs` left None this is the mean over this batch. Passing the totals of the whole
    optimizer step (over all micro-batches and ranks) makes each micro-batch's value its share of the full-batch
    mean, so the shares sum exactly to it under gradient accumulation and data parallelism. `horizon` is the
    length normaliser of seq-mean-token-sum-norm (default T; pass the max response length so it is the same for
    every micro-batch).
    """
    mask = mask.to(loss.dtype)
    num_tokens = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    num_seqs = mask.shape[0] if num_seqs is None else num_seqs
    horizon = loss.shape[-1] if horizon is None else horizon
    return LOSS_AGGREGATIONS[mode](loss, mask, num_tokens, num_seqs, horizon)


def micro_batch_loss(logp, old_logp, adv, mask, entropy, *, num_tokens, num_seqs, horizon, agg_mode="token-mean",
                     loss_mode="ppo", clip_low=0.2, clip_high=0.3, clip_dual=3.0, loss_kwargs=None, weights=None,
                     ref_logp=None, kl_kind="low_var_kl", kl_coef=0.0, entropy_coef=0.0, teacher_logp=None,
                     distill_coef=1.0, router_loss=None, router_coef=0.0):  # fmt: skip
    """One micro-batch's loss from its terms: policy term, mismatch correction, KL, entropy, distillation, router
    loss. Returns (loss, terms): the loss is this micro-batch's share of the optimizer step's mean over all ranks'
    tokens (`num_tokens`, `num_seqs`: the step's totals, see aggregate_loss); `terms` maps a metric name to a scalar,
    each a share of that mean too, which update_policy logs by its name (a new term is one entry here).

    logp (B, T) with gradient; old_logp (B, T); adv (B, 1), the reward's advantage; mask (B, T), the tokens the loss
    trains; entropy (B, T). Optional: weights (B, T), importance weights against the engine/trainer mismatch;
    ref_logp (B, T), the reference's, for the KL term; teacher_logp (B, T), a teacher's, whose term joins each token's
    advantage (grpo/distill.py); router_loss, an MoE forward's load-balancing loss (moe.RouterBalance).
    """
    agg = {"mode": agg_mode, "num_tokens": num_tokens, "num_seqs": num_seqs, "horizon": horizon}
    terms = {}
    if teacher_logp is not None:  # on-policy distillation: plus the teacher's term, token by token
        adv, taught = token_terms(adv, old_logp, teacher_logp, mask, distill_coef, num_tokens)  # (B, T)
        terms.update(taught)
    pg, clipped = policy_loss(logp, old_logp, adv, clip_low, clip_high, clip_dual, loss_mode, mask,
                              **(loss_kwargs or {}))  # (B, T), (B, T)  # fmt: skip
    if weights is not None:  # importance weights against the engine/trainer mismatch
        pg = pg * weights  # (B, T)
    pg_term = aggregate_loss(pg, mask, **agg)
    loss = pg_term
    kl_term = torch.zeros(())  # (no reference: algorithm.kl_in_reward, or a KL coefficient of 0)
    if ref_logp is not None:  # KL as a loss term
        kl_term = aggregate_loss(kl_penalty(logp, ref_logp, kl_kind), mask, **agg)
        loss = loss + kl_coef * kl_term
    if entropy_coef > 0:  # an entropy bonus keeps exploration alive
        loss = loss - entropy_coef * aggregate_loss(entropy, mask, **agg)
    if router_coef > 0:  # experts' balance, weighted by the micro-batch's share of the tokens
        aux = router_loss * mask.sum() / num_tokens
        loss = loss + router_coef * aux
        terms["actor/router_aux_loss"] = aux
    terms["actor/pg_loss"] = pg_term
    terms["actor/kl"] = kl_term
    terms["actor/entropy"] = (entropy.detach() * mask).sum() / num_tokens
    terms["actor/clip_frac"] = (clipped.float() * mask).sum() / num_tokens
    return loss, terms


# ----------------------------------------------------------------------------------------------------------------------
# Phases of a step, each a named function so the loop in main() reads top to bottom.


def collect_rollouts(engine, scorer, processor, train_set, sampler, epoch, position, cfg, step, timings):
    """Sample and score this rank's share of the rollout batch.

    With algorithm.online_filtering (DAPO dynamic sampling, https://arxiv.org/abs/2503.14476) a prompt group whose
    mean `filter_key` is <= filter_low or >= filter_high (all wrong or all right: zero advantage) is dropped and more
    prompts are drawn, in rounds that every rank takes together (generation can be collective) until every rank has
    a full batch. Returns (examples, prompts, samples, results, stats: the rollout's StepStats), epoch, position.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    alg, r = cfg.algorithm, cfg.rollout
    need = cfg.data.rollout_batch_size // world
    params = rollout.SamplingParams(r.temperature, r.top_p, cfg.data.max_response_length)
    rounds = alg.max_filter_rounds if alg.online_filtering else 1
    examples, prompts, samples, results = [], [], [], []
    stats = StepStats()  # the rollout's statistics, each reduced as its line says (grpo/stats.py)
    if alg.online_filtering:
        stats.count("rollout/filtered_groups", 0)  # (logged when no group was dropped too)
    timeouts_before = scorer.n_timeouts
    timings["time/generate"] = timings["time/reward"] = 0.0
    have = torch.tensor([0])
    for round_ in range(rounds):
        # a distinct, reproducible stream per step, round and rank (resumed runs sample exactly the same)
        seed = cfg.trainer.seed * 1_000_003 + step * world + rank + round_ * 10_000_019
        t0 = time.perf_counter()
        if engine.carry is None:  # draw the next prompts of this rank's shard, generate n answers to each
            indices, epoch, position = sampler.next_indices(epoch, position, need)
            batch = [train_set[i] for i in indices]
            batch_prompts = [rollout.encode_prompt(processor, ex) for ex in batch]
            batch_samples = engine.generate(batch_prompts, r.n, params, seed=seed)
            counts = engine.stats  # with tools, the calls and faults (turns.ToolEngine takes turns in generate)
        else:  # partial rollouts: the groups the step lacks, unfinished answers carried to the next step (partial.py)
            batch, batch_prompts, batch_samples, counts, epoch, position = partial.draw_and_generate(
                engine, sampler, train_set, processor, epoch, position, need, r.n, params, seed, step, len(examples)
            )
        timings["time/generate"] += time.perf_counter() - t0
        for key, value in counts.items():  # summed over the rounds, reduced by their modules (turns.py, partial.py)
            stats[key] += value
        t0 = time.perf_counter()
        rows = [batch[s.prompt_index] for s in batch_samples]  # (the reward may ask for their columns)
        batch_results = scorer.score([s.text for s in batch_samples], [ex.answer for ex in rows], rows)
        timings["time/reward"] += time.perf_counter() - t0
        stats.count("rollout/prompts_drawn", len(batch))
        for g in range(len(batch)):
            group = batch_results[g * r.n : (g + 1) * r.n]
            if alg.online_filtering:
                if alg.filter_key not in group[0]:
                    raise ConfigError(f"algorithm.filter_key={alg.filter_key!r} is not a reward key: {list(group[0])}")
                mean = sum(x[alg.filter_key] for x in group) / r.n
                if mean <= alg.filter_low or mean >= alg.filter_high:
                    stats.count("rollout/filtered_groups")
                    continue
            if len(examples) < need:
                for s in batch_samples[g * r.n : (g + 1) * r.n]:
                    s.prompt_index = len(examples)
                    samples.append(s)
                examples.append(batch[g])
                prompts.append(batch_prompts[g])
                results.extend(group)
        # every rank must take the same number of rounds: continue until the rank with the fewest groups is full. The
        # same reduction says whether every answer of every rank failed to grade (the run stops, naming the error)
        # and which rank failed first (it prints its first error): no rank may stop or go on alone
        agreed = torch.tensor([len(examples), int(scorer.all_failed()), rank if scorer.call_errors else world])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        have, first = agreed[0], agreed[2].item()
        scorer.report_failures(step, bool(agreed[1]), first if first < world else None, rank)
        if have.item() >= need:
            break
    else:
        raise RuntimeError(
            f"dynamic sampling: only {have.item()} of the {need} prompt groups a rank needs passed the filter "
            f"({alg.filter_key} mean in ({alg.filter_low}, {alg.filter_high})) after {rounds} rounds of {need} "
            f"prompts; raise algorithm.max_filter_rounds or widen filter_low/filter_high"
        )
    if alg.online_filtering:
        stats.last("rollout/filter_rounds", round_ + 1)  # (every rank takes the same rounds)
    stats.count("reward/timeouts_step", scorer.n_timeouts - timeouts_before)  # however many score() calls it took
    return (examples, prompts, samples, results, stats), epoch, position


def compute_old_and_ref_logprobs(model, ref_model, prompts, samples, cfg, ids, need_old, teacher=None, timings=None):
    """No-grad forwards over the rollout batch: per-sample log-probs (1-D, response length) under the policy that
    sampled (old, or None), under the reference (or None) and under the distillation teacher (or None; its forwards'
    time in timings["time/teacher"]). With LoRA the reference is the policy itself (`ref_model is model`) with its
    adapters switched off. The caller has the model in eval mode: no dropout, so all are deterministic (lora_dropout
    acts only in update_policy's forwards, as dropout does in PPO trainers)."""
    # sequence parallelism: each rank of a group computes the group's samples together, and keeps its own
    prompts, samples, mine = sequence_parallel.share_group(prompts, samples, cfg.actor.sequence_parallel_size)
    old, ref, taught = [None] * len(samples), [None] * len(samples), [None] * len(samples)
    t_teacher = 0.0
    with torch.no_grad():
        for mb, _ in micro_batches(prompts, samples, range(len(samples)), cfg, grad=False):  # a re-run writes again
            batch_inputs, response_ids, mask = make_micro_batch(
                prompts, samples, mb, ids, cfg.actor.padding_free, shares_prefixes(cfg.actor)
            )
            lengths = [len(samples[i].response_ids) for i in mb]  # (the mask has holes at tool turns)
            for out, m in ((old, model if need_old else None), (ref, ref_model), (taught, teacher)):
                if m is not None:
                    t0 = time.perf_counter()
                    off = adapters_disabled(m) if out is ref and m is model else contextlib.nullcontext()
                    # the engine's routes are the policy's experts (replayed by it and its reference), not a teacher's
                    inputs = {k: v for k, v in batch_inputs.items() if k != "routes"} if m is teacher else batch_inputs
                    with off:  # (the reference under LoRA: the policy's frozen base)
                        logp = forward_logprobs(m, inputs, response_ids, cfg.rollout.temperature)[0]  # (B, T)
                    logp = logp.cpu()
                    for row, i in enumerate(mb):
                        out[i] = logp[row, : lengths[row]]
                    if m is teacher:
                        t_teacher += time.perf_counter() - t0
    reshard(model, ref_model, teacher)
    if teacher is not None and timings is not None:
        timings["time/teacher"] = t_teacher
    return (
        (old[mine] if need_old else None),
        (ref[mine] if ref_model is not None else None),
        (taught[mine] if teacher else None),
    )


def shape_scores(scores, samples, old_logps, ref_logps, cfg):
    """Optional additions to the outcome reward: DAPO's soft overlong penalty, and the KL to the reference when
    algorithm.kl_in_reward places it there (score - kl_coef * summed token KL, the PPO-RLHF way)."""
    if cfg.reward.overlong_buffer > 0:
        lengths = torch.tensor([len(s.response_ids) for s in samples])  # (N,)
        r = cfg.reward
        scores = scores + overlong_penalty(lengths, cfg.data.max_response_length, r.overlong_buffer,
                                           r.overlong_penalty_factor)  # fmt: skip
    if cfg.algorithm.kl_in_reward and ref_logps is not None:
        kl = torch.stack([kl_penalty(o, ref, cfg.algorithm.kl_penalty).sum() for o, ref in zip(old_logps, ref_logps)])
        scores = scores - cfg.algorithm.kl_coef * kl  # (N,)
    return scores


def global_advantages(scores, group_size, estimator, eps, kwargs=None):
    """A group lives on one rank, but batch-level estimators (reinforce_plus_plus) need every rank's scores: gather
    them all, compute, keep this rank's slice. Every rank must call it (all_gather)."""
    gathered = [torch.empty_like(scores) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, scores.contiguous())
    adv = compute_advantages(torch.cat(gathered), group_size, estimator, eps, **(kwargs or {}))  # (world * N,)
    return adv.view(len(gathered), -1)[dist.get_rank()]


def shares_prefixes(actor) -> bool:
    """actor.shared_prefix where it is exact: packed micro-batches through this trainer's own attention functions.
    transformers' flash_attention_2 would find the sequences of a row from its positions alone and let the answers
    of a group see each other."""
    return actor.shared_prefix and actor.padding_free and actor.attn_implementation in OWN_PACKED_ATTENTION


def prompt_groups(prompts, samples, indices):
    """`indices` gathered into groups of samples with the same prompt (the same Prompt object), in order of first
    appearance: the samples of one group on this rank."""
    groups = {}
    for i in indices:
        groups.setdefault(id(prompts[samples[i].prompt_index]), []).append(i)
    return list(groups.values())


def micro_batches(prompts, samples, indices, cfg, grad):
    """Split `indices` (samples of this rank) into micro-batches: actor.micro_batch_size sequences each, or, with a
    token budget, balanced bins of at most that many prompt + response tokens, as many on every rank (collective).
    With shared prefixes a bin holds parts of groups, each costing its prompt once (batching.shared_prefix_parts).

    Yields (sample indices, live). A rank that ends up with fewer sequences than the agreed number of micro-batches
    (possible after balance_over_ranks) still has to join every forward and backward: its surplus micro-batches
    re-run its shortest sequence with live=False, and the caller gives them zero weight."""
    a, indices = cfg.actor, list(indices)
    budget = a.max_tokens_per_micro_batch
    if not grad:
        budget = a.max_tokens_per_micro_batch_no_grad or budget
    if not budget:
        size = a.micro_batch_size if grad else a.micro_batch_size_no_grad
        return [(indices[i : i + size], True) for i in range(0, len(indices), size)]
    prompt_len = {i: len(prompts[samples[i].prompt_index].input_ids) for i in indices}
    lengths = {i: len(samples[i].response_ids) for i in indices}
    if shares_prefixes(a):
        groups = prompt_groups(prompts, samples, indices)
        parts, costs = shared_prefix_parts(groups, [prompt_len[g[0]] for g in groups], lengths, budget)
    else:
        parts, costs = [[i] for i in indices], [prompt_len[i] + lengths[i] for i in indices]
    shortest = min(indices, key=lambda i: prompt_len[i] + lengths[i])
    bins = plan_micro_batches(costs, budget)
    return [([i for j in b for i in parts[j]], True) if b else ([shortest], False) for b in bins]


def make_micro_batch(prompts, samples, mb, ids, packed, shared=False):
    """Model inputs, response_ids (B, T) and response_mask (B, T) of the samples `mb`, packed (each group's prompt
    once when `shared`) or padded."""
    mb_prompts, responses = [prompts[samples[i].prompt_index] for i in mb], [samples[i].response_ids for i in mb]
    pad_id, image_token_id = ids
    tool_turns = [samples[i].turns for i in mb]  # tool turns inside answers: context, no loss (turns.py)
    routes = [samples[i].routes for i in mb]  # the engine's experts per token, replayed (replay.py), or None
    if packed:
        return pack(mb_prompts, responses, image_token_id, share_prompts=shared, turns=tool_turns, routes=routes)
    return collate(mb_prompts, responses, pad_id, image_token_id, turns=tool_turns, routes=routes)


def update_policy(model, optimizer, scheduler, samples, prompts, advantages, old_logps, ref_logps, cfg, ids, stats,
                  step, teacher_logps=None, locate=None):  # fmt: skip
    """One pass of PPO updates over the rollout batch: mini-batches of `global_batch_size` prompts, each an
    optimizer step accumulated over micro-batches. `old_logps`/`ref_logps`/`teacher_logps` are per-sample lists (None
    if unused). `advantages` (N,) is the reward's, one a sequence; a teacher's log-probs add a term per token.
    `locate`: the report the mismatch watch runs before it stops a run (locate.in_run), or None."""
    a, world = cfg.actor, dist.get_world_size()
    seqs_per_step = a.global_batch_size // world * cfg.rollout.n
    params = [p for group in optimizer.param_groups for p in group["params"]]
    device, shared = compute_device(model), shares_prefixes(a)
    stats.copies = a.sequence_parallel_size  # every rank of a group records the group's shares
    alg = cfg.algorithm
    settings = dict(agg_mode=a.loss_agg_mode, horizon=cfg.data.max_response_length, loss_mode=a.policy_loss,
                    clip_low=a.clip_ratio_low, clip_high=a.clip_ratio_high, clip_dual=a.clip_ratio_dual,
                    loss_kwargs=a.policy_loss_kwargs, kl_kind=alg.kl_penalty, kl_coef=alg.kl_coef,
                    entropy_coef=a.entropy_coef, distill_coef=cfg.distill.coef,
                    router_coef=a.router_aux_loss_coef)  # micro_batch_loss's, all but the batch  # fmt: skip
    all_samples, all_prompts, all_advantages, all_old, all_ref = samples, prompts, advantages, old_logps, ref_logps
    all_teacher = teacher_logps
    for start in range(0, len(all_samples), seqs_per_step):
        # this optimizer step's sequences, each with its own prompt entry so that they can move between ranks
        items = [(all_prompts[all_samples[i].prompt_index], all_samples[i], all_advantages[i],
                  all_old[i] if all_old else None, all_ref[i] if all_ref else None,
                  all_teacher[i] if all_teacher else None)
                 for i in range(start, start + seqs_per_step)]  # fmt: skip
        moved, sp = 0, a.sequence_parallel_size
        items = sequence_parallel.share_items(items, sp)  # a sequence-parallel group's ranks run the same sequences
        if a.max_tokens_per_micro_batch and a.balance_ranks and world > sp:
            # with shared prefixes a prompt is computed once for its group: each answer bears 1/n of it
            share = cfg.rollout.n if shared else 1
            lengths = [len(p.input_ids) // share + len(s.response_ids) for p, s, *_ in items]
            # between the sequence-parallel groups: each rank with its peers at the same place in the other groups
            items, moved = balance_over_ranks(items, lengths, sequence_parallel.groups(sp)[1] if sp > 1 else None)
        # sent to another rank to even out the tokens: balance_over_ranks returns all of the step's moves, every rank
        stats.count("actor/moved_sequences", moved, per_rank=True)
        prompts = [it[0] for it in items]
        samples = [dataclasses.replace(it[1], prompt_index=j) for j, it in enumerate(items)]
        advantages = torch.stack([torch.as_tensor(it[2]) for it in items])  # (S,)
        old_logps = [it[3] for it in items] if all_old else None
        ref_logps = [it[4] for it in items] if all_ref else None
        teacher_logps = [it[5] for it in items] if all_teacher else None
        chunk = range(len(items))
        # Totals of the whole optimizer step over every rank, so each micro-batch contributes its exact share of the
        # full-batch mean (every rank reaches this all_reduce once per optimizer step).
        kept = [i for i in chunk if not (a.mask_truncated and samples[i].truncated)]
        totals = torch.tensor([float(sum(samples[i].model_len for i in kept)), float(len(kept))])
        dist.all_reduce(totals)
        num_tokens, num_seqs = totals[0].item() / sp, totals[1].item() / sp  # (each of a group's ranks counted them)
        for mb, live in micro_batches(prompts, samples, chunk, cfg, grad=True):
            batch_inputs, response_ids, mask = make_micro_batch(prompts, samples, mb, ids, a.padding_free, shared)
            # forward/backward passes over the step's optimizer steps: as many on every rank (the collectives agree)
            stats.count("actor/micro_batches", per_rank=True)
            if not live:  # only here to keep the collectives in step: a zero mask zeroes its loss and every statistic
                mask = torch.zeros_like(mask)
            if a.mask_truncated:  # DAPO overlong filtering: a cut-off answer's reward says little about its tokens
                mask = mask * torch.tensor([not samples[i].truncated for i in mb], dtype=mask.dtype)[:, None]
            mask = mask.to(device)
            t_len = mask.shape[1]
            logp, entropy = forward_logprobs(
                model, batch_inputs, response_ids, cfg.rollout.temperature, True, entropy_grad=a.entropy_coef > 0
            )
            old = stack_padded([old_logps[i] for i in mb], t_len, device) if old_logps else logp.detach()
            # Engine-vs-trainer mismatch, free: `old` is the trainer's log-prob under the weights that sampled, either
            # precomputed or (single on-policy update) this pass's detached one, taken before the only optimizer step.
            trainer_logp = logp.detach() if cfg.algorithm.rollout_bypass else old  # bypass: old is the engine's
            mask, weights = mismatch.measure_and_correct(trainer_logp, mask, prompts, samples, mb, cfg.algorithm, stats)
            ref = stack_padded([ref_logps[i] for i in mb], t_len, device) if ref_logps else None  # (B, T)
            taught = stack_padded([teacher_logps[i] for i in mb], t_len, device) if teacher_logps else None  # (B, T)
            router = model.router_balance.loss() if a.router_aux_loss_coef > 0 else None  # (this forward's routes)
            adv = advantages[mb].to(device).unsqueeze(-1)  # (B, 1): the reward's, the same for every token
            loss, terms = micro_batch_loss(logp, old, adv, mask, entropy, weights=weights, ref_logp=ref,
                                           teacher_logp=taught, router_loss=router, num_tokens=num_tokens,
                                           num_seqs=num_seqs, **settings)  # fmt: skip
            # FSDP2 averages gradients over ranks; the loss is a share of the global mean, so undo the average
            (loss * world).backward()
            for name, value in terms.items():  # each a share of the step's mean over all ranks' tokens
                stats.share(name, value.item())
        grad_norm = torch.nn.utils.clip_grad_norm_(params, a.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        # skipped for the engine's mismatch (mismatch.watch) or a non-finite norm, both global: every rank together
        # (the watch first: it is collective)
        stepped = mismatch.watch(stats, cfg.algorithm, step, locate, samples, prompts) and torch.isfinite(grad_norm)
        if stepped:
            optimizer.step()
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        stats.count("actor/skipped_steps", not stepped, per_rank=True)  # (decided together)
        stats.last("actor/grad_norm", grad_norm.item())
        stats.count("actor/optimizer_steps", per_rank=True)


def validate(engine, val_set, processor, scorer, cfg, rank, world, logger):
    """Accuracy on the validation set; each rank generates for a strided share of it. The logger gets rank 0's
    first few generations (trainer.val_samples) to write next to the metrics."""
    mine = list(range(rank, len(val_set), world))
    per_rank = math.ceil(len(val_set) / world)
    bs = cfg.data.val_batch_size
    r = cfg.rollout
    params = rollout.SamplingParams(r.val_temperature, r.val_top_p, cfg.data.max_response_length)
    sums = dict.fromkeys(["val/accuracy", "val/overall", "val/format", "val/response_length"], 0.0)
    count, shown = 0, []
    for start in range(0, per_rank, bs):
        # Every rank makes the same number of generate calls with the same batch size (the HF engine's forwards are
        # collective): a rank whose share ran out repeats its last prompt and does not count the repeats.
        real = mine[start : start + bs]
        filler = mine[-1:] if mine else [0]
        batch = real + filler * (min(bs, per_rank - start) - len(real))
        examples = [val_set[i] for i in batch]
        prompts = [rollout.encode_prompt(processor, ex) for ex in examples]
        samples = engine.generate(prompts, r.val_n, params, seed=cfg.trainer.seed + 7919 * (rank + 1))
        rows = [examples[s.prompt_index] for s in samples]
        results = scorer.score([s.text for s in samples], [ex.answer for ex in rows], rows)
        for s, res in zip(samples, results):
            if s.prompt_index < len(real):
                sums["val/accuracy"] += res.get("accuracy", 0.0)
                sums["val/overall"] += res["overall"]
                sums["val/format"] += res.get("format", 0.0)
                sums["val/response_length"] += len(s.response_ids)
                count += 1
                if len(shown) < cfg.trainer.val_samples:
                    ex = examples[s.prompt_index]  # its source "file.parquet:17" says where the image is
                    shown.append({"source": ex.source, "problem": ex.problem, "answer": ex.answer, "response": s.text,
                                  "reward": res["overall"], "accuracy": res.get("accuracy")})  # fmt: skip
    logger.add_val_samples(shown)
    return mean_over_ranks(sums, dict.fromkeys(sums, count))


# ----------------------------------------------------------------------------------------------------------------------
# Setup and bookkeeping around the loop: datasets, validation with the engine, the step's metrics.

# Running sums (and maxima) update_policy keeps over one step's optimizer steps and micro-batches


def load_datasets(cfg, processor, rank, world, columns):
    """The train prompts, the validation prompts (None without data.val_files), this rank's sampler and the number
    of steps the run takes. `columns`: what each prompt keeps of its row for the reward (RewardScorer.columns)."""
    from data import PromptDataset, ShardSampler, batches_per_epoch

    d = cfg.data
    # PromptDataset sets the processor's pixel bounds to data.min/max_pixels: trainer and rollout see equal images
    dataset_kwargs = preflight.dataset_kwargs(cfg, processor, columns)
    train_set = PromptDataset(d.train_files, processor, **dataset_kwargs)
    val_set = None
    if d.val_files:
        val_set = PromptDataset(d.val_files, processor, **dataset_kwargs)
        if d.val_max_samples:
            val_set = torch.utils.data.Subset(val_set, range(min(d.val_max_samples, len(val_set))))

    sampler = ShardSampler(len(train_set), rank, world, seed=cfg.trainer.seed, shuffle=d.shuffle)
    steps_per_epoch = batches_per_epoch(len(train_set), world, d.rollout_batch_size)
    if steps_per_epoch == 0:
        raise SystemExit(f"error: {len(train_set)} train prompts are fewer than one rollout batch "
                         f"(data.rollout_batch_size={d.rollout_batch_size}): lower it or add data")  # fmt: skip
    total_steps = cfg.trainer.max_steps or steps_per_epoch * cfg.trainer.total_epochs
    rollout.check_prompt_limits(cfg.rollout, [train_set, val_set])  # the engine's, before it starts
    refused = preflight.family_refusal(cfg)  # (a family without videos, and data that has them)
    if refused:
        raise SystemExit(f"error: {refused}")
    media = rollout.data_media([train_set, val_set])  # what the data has, not the engine's limits
    print0(f"train: {len(train_set)} prompts ({train_set.n_skipped} bad rows skipped, {train_set.n_overlong} longer "
           f"than {d.max_prompt_length} tokens dropped) | val: {len(val_set) if val_set else 0} prompts | "
           f"{steps_per_epoch} steps per epoch, {total_steps} in all | {media}")  # fmt: skip
    return train_set, val_set, sampler, total_steps


def run_validation(engine, model, val_set, processor, scorer, cfg, logger):
    """Validate the trainer's current weights: an engine with its own copy must be brought up to them first (the
    step's update, or resumed weights before training). Collective."""
    phase("validation")
    model.eval()
    engine.wake()
    engine.sync_weights(model)
    metrics = validate(engine, val_set, processor, scorer, cfg, dist.get_rank(), dist.get_world_size(), logger)
    engine.sleep()
    reshard(model)
    return metrics


def step_metrics(cfg, batch, scores, shaped, stats, timings, t_step, epoch, scheduler, scorer):
    """The step's metrics, reduced over ranks (collective): rewards and lengths averaged over every sample, the
    loss statistics summed from each rank's shares, the slowest rank's phase times, throughput."""
    from grpo.grading import equal_reward_groups

    world = dist.get_world_size()
    _, prompts, samples, results, rollout_stats = batch
    n_updates = stats["actor/optimizer_steps"]
    lengths = [len(s.response_ids) for s in samples]
    sums = {
        "reward/overall": scores.sum().item(),
        "reward/shaped": shaped.sum().item(),
        "reward/accuracy": sum(x.get("accuracy", 0.0) for x in results),
        "reward/format": sum(x.get("format", 0.0) for x in results),
        # the share of groups whose rewards are all equal (no advantage without shaping), as their samples' share
        "reward/zero_std_groups": equal_reward_groups([x["overall"] for x in results], cfg.rollout.n) * cfg.rollout.n,
        "response_length/mean": float(sum(lengths)),
        "response_length/clip_ratio": float(sum(s.truncated for s in samples)),
    }
    keys = [None] * world  # a reward's own keys, as reward/<key>: every rank logs the keys any rank has seen
    dist.all_gather_object(keys, scorer.extra_keys())
    sums.update({f"reward/{k}": sum(x.get(k, 0.0) for x in results) for k in sorted(set().union(*keys))})
    metrics = mean_over_ranks(sums, dict.fromkeys(sums, len(samples)))
    metrics.update(stats.metrics(n_updates))  # the update's statistics, reduced as each was recorded (grpo/stats.py)
    metrics.update(max_over_ranks({"response_length/max": float(max(lengths)), "host/rss_gb": release_host_memory()}))
    metrics.update(mismatch.step_metrics(stats, cfg.algorithm))  # engine vs trainer log-probs, per modality
    # grading failures of all ranks together, the run's so far (this step's timeouts: the rollout's statistics)
    fails = {"reward/errors": float(scorer.n_errors), "reward/timeouts": float(scorer.n_timeouts)}
    metrics.update(mean_over_ranks(fails, dict.fromkeys(fails, 1.0 / world)))
    metrics.update(turns.step_metrics(rollout_stats, samples))  # tool calls and faults, when tools are on
    metrics.update(partial.step_metrics(rollout_stats, samples))  # carried answers and their staleness, with partial
    metrics.update(rollout_stats.metrics())  # the rest as recorded: prompts drawn, groups dropped, timeouts
    # generated tokens of all ranks (a TP group's members each count their own samples) per second of generate
    gen_tokens = mean_over_ranks({"gen": float(sum(lengths))}, {"gen": 1.0 / world})["gen"]
    gen_tokens = metrics.get("rollout/partial_generated", gen_tokens)  # partial: sampled now, carried ones not again
    tokens = sum(len(prompts[s.prompt_index].input_ids) + len(s.response_ids) for s in samples)
    metrics.update(mean_over_ranks({"tokens": float(tokens)}, {"tokens": 1.0 / world}))
    metrics.update({"epoch": epoch, "actor/lr": scheduler.get_last_lr()[0]})
    timings["time/step"] = time.perf_counter() - t_step
    metrics.update(max_over_ranks(timings))
    metrics["perf/tokens_per_s_per_device"] = metrics.pop("tokens") / (metrics["time/step"] * world)
    metrics["perf/rollout_tokens_per_s"] = gen_tokens / metrics["time/generate"]
    return metrics


def check_memory(cfg, world, dry_run):
    """The per-GPU memory plan (memory_plan.py), printed by a dry run. ConfigError, naming the key to change, when
    it does not fit on the GPUs, or cannot be made for them; None for a CPU run whose model it cannot read."""
    try:
        plan = plan_memory(cfg, world, host_run=not (dry_run or torch.cuda.is_available()))
    except PlanError as e:
        if dry_run or torch.cuda.is_available():
            raise ConfigError(str(e)) from None
        return None
    if dry_run:
        print(format_plan(plan))
    problem = plan_problem(plan) if dry_run or torch.cuda.is_available() else None  # GPU numbers: checked on a GPU
    if problem:
        raise ConfigError(problem)
    return plan


def check_config(cfg: Config, world_size: int) -> None:
    """The config's checks (grpo/config.py) with this file's tables of variants as the valid values of their keys, and
    a variant's own settings checked against its function: the keywords after the arguments every variant takes
    (an estimator's scores, group_size, eps; a loss's seven, see policy_loss)."""
    check_config_against(cfg, world_size, {
        "algorithm.adv_estimator": ADVANTAGE_ESTIMATORS, "algorithm.kl_penalty": KL_PENALTIES,
        "actor.policy_loss": POLICY_LOSSES, "actor.loss_agg_mode": LOSS_AGGREGATIONS, "rollout.engine": rollout.ENGINES,
    }, {
        "algorithm.adv_estimator_kwargs": ("algorithm.adv_estimator", 3),
        "actor.policy_loss_kwargs": ("actor.policy_loss", 7),
    })  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------------


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    dry_run = "--dry-run" in argv  # every check that needs no GPU (preflight.py), then exit: no process group
    argv = [arg for arg in argv if arg != "--dry-run"]
    if not argv or argv[0].startswith("-"):
        print(__doc__)
        return 2
    cfg_path, overrides = (argv[0], argv[1:]) if "=" not in argv[0] else (None, argv)
    try:
        cfg = load_config(cfg_path, overrides)
        world = planned_world(cfg.trainer, dry_run)
        check_config(cfg, world)
        check_paths(cfg)
        plan = check_memory(cfg, world, dry_run)
    except ConfigError as e:
        report_stop(f"config error: {e}")  # once, by rank 0
        return 2
    if dry_run:
        return preflight.dry_run(cfg, world)

    rank, world, device = setup_distributed(cfg.trainer.collective_timeout_s, cfg.trainer.verbose)
    torch.manual_seed(cfg.trainer.seed)
    save_config(cfg.trainer.output_dir, config_to_dict(cfg), rank)
    print_banner(cfg, world, device)
    if plan:
        print0(format_plan(plan))
    check_gpu_memory(cfg, device)

    # -------------------------------------------------------------------------------- data, reward, models, engine
    from transformers import AutoProcessor

    from grpo.grading import RewardScorer, default_num_workers

    a, r = cfg.actor, cfg.rollout
    processor = AutoProcessor.from_pretrained(a.model_path)
    # torchrun's ranks on a node share its cores; under srun with one task per GPU each task's cores are its own
    workers = cfg.reward.num_workers or default_num_workers(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    scorer = RewardScorer(cfg.reward.reward_fn, timeout=cfg.reward.timeout, num_workers=workers)  # (workers: later)
    train_set, val_set, sampler, total_steps = load_datasets(cfg, processor, rank, world, scorer.columns)
    offload = TrainerOffload()  # the trainer's idle state, to host while the engine generates (models: once loaded)
    # every rank, at the same point, before the trainer takes device memory: vLLM's start is collective
    engine = rollout.make_engine(cfg, processor, offload)
    tokenizer = processor.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model, ref_model = load_policy_and_reference(a, device, cfg.algorithm.kl_coef > 0, pad_id)
    teacher = load_teacher(cfg.distill, a, device, pad_id)  # None without distill.model_path
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)  # (a DTensor counts its full size)
    print0(f"trainable parameters: {n_trainable:,} of {sum(p.numel() for p in model.parameters()):,}")
    linear_attention.warm_up(model, device)  # fla's kernels tune at their first call: here, timed, not in step 1
    ids = (pad_id, model.config.image_token_id)
    optimizer, scheduler = make_optimizer(model, a)
    offload.hold(model, ref_model, optimizer, a, teacher, cfg.distill.offload)  # to host while generating, and back
    logger = MetricsLogger(cfg.trainer.output_dir, total_steps, cfg.trainer.logger, enabled=rank == 0, cfg=cfg)
    # one on-policy pass: the detached current log-probs ARE the old ones, so skip that forward
    need_old = a.ppo_epochs > 1 or a.global_batch_size < cfg.data.rollout_batch_size or cfg.algorithm.kl_in_reward
    need_old = need_old and not cfg.algorithm.rollout_bypass  # bypass: the engine's log-probs are the old ones

    step, epoch, position, stop_signum = 0, 0, 0, 0
    checkpoint = find_resume_checkpoint(cfg.trainer.output_dir, cfg.trainer.resume)
    if checkpoint:
        step, epoch, position = load_checkpoint(checkpoint, model, optimizer, scheduler, scorer, cfg, engine)
    # steps after the checkpoint are about to be rerun; a fresh run into an old output_dir starts a fresh file
    logger.drop_steps_after(step if checkpoint else -1)
    guard_step = step + 1 if cfg.algorithm.mismatch_guard > 0 else 0  # the first step of a run or of its resume
    stop = StopSignal()  # from here on SIGTERM/SIGINT finish the step, save and exit
    if val_set is not None and cfg.trainer.val_before_train and step == 0:
        logger.log(0, run_validation(engine, model, val_set, processor, scorer, cfg, logger))

    while step < total_steps:
        step += 1
        t_step, timings = time.perf_counter(), {}
        model.eval()

        # ------------------------------------------------------------------------------------- rollout + reward
        # (scored as they come: dynamic sampling decides from the rewards whether to draw more prompts)
        t0 = phase("rollout")
        engine.wake()
        engine.sync_weights(model)
        batch, epoch, position = collect_rollouts(
            engine, scorer, processor, train_set, sampler, epoch, position, cfg, step, timings
        )
        _, prompts, samples, results, _ = batch
        scores = torch.tensor([x["overall"] for x in results], dtype=torch.float32)  # (N,)
        if cfg.algorithm.routing_replay == "r3":  # answers the engine did not record whole (tool turns, carried)
            routing.record_routes(engine, model, prompts, samples)
        engine.sleep()
        reshard(model)
        timings["time/rollout"] = time.perf_counter() - t0 - timings["time/reward"]
        timings.update(engine.timings)  # time/wake, time/weight_sync, time/sleep

        # ------------------------------------------------------------------------------------ old/ref log-probs
        t0 = phase("log-probs and advantages")
        guard = step == guard_step  # the guard compares the trainer's log-probs with the engine's: it needs them
        old_logps, ref_logps, teacher_logps = compute_old_and_ref_logprobs(
            model, ref_model, prompts, samples, cfg, ids, need_old or guard, teacher, timings
        )
        if guard:  # collective; stops every rank when the engine's log-probs show it saw other prompts, naming the
            # module where the engine and the trainer part on the worst of them (grpo/locate.py)
            where = locate.in_run(engine, model, pad_id)
            mismatch.check_start(old_logps, samples, prompts, cfg.algorithm.mismatch_guard, step, where)
        old_logps = mismatch.engine_logps(samples) if cfg.algorithm.rollout_bypass else old_logps if need_old else None
        timings["time/logprobs"] = time.perf_counter() - t0

        # -------------------------------------------------------------------------------------------- advantage
        shaped = shape_scores(scores, samples, old_logps, ref_logps, cfg)  # (N,), what the advantage sees
        alg = cfg.algorithm
        advantages = global_advantages(shaped, r.n, alg.adv_estimator, alg.adv_eps, alg.adv_estimator_kwargs)  # (N,)
        if cfg.algorithm.kl_in_reward:
            ref_logps = None  # the KL is in the reward now, not a loss term

        # ---------------------------------------------------------------------------------------- policy update
        t0 = phase("policy update")
        model.train()
        stats = StepStats()
        for _ in range(a.ppo_epochs):
            update_policy(model, optimizer, scheduler, samples, prompts, advantages, old_logps, ref_logps, cfg, ids,
                          stats, step, teacher_logps, locate.in_run(engine, model, pad_id))  # fmt: skip
        timings["time/train"] = time.perf_counter() - t0
        # (the weights reach the engine at its next wake: sync_weights before the next rollout or validation)

        # ------------------------------------------------------------------------------------------------- log
        phase("metrics")
        metrics = step_metrics(cfg, batch, scores, shaped, stats, timings, t_step, epoch, scheduler, scorer)
        if cfg.algorithm.routing_replay == "r3":  # the routes replayed, and how often the trainer's own differ
            metrics.update(replay.step_metrics(model, samples))

        # --------------------------------------------------------------------------------------------- validate
        freq = cfg.trainer.val_freq
        if val_set is not None and freq > 0 and (step % freq == 0 or step == total_steps):
            metrics.update(run_validation(engine, model, val_set, processor, scorer, cfg, logger))
        logger.log(step, metrics)

        # ------------------------------------------------------------------------------------------- checkpoint
        stop_signum = stop.agreed()  # every rank reaches this once per step
        freq = cfg.trainer.save_freq
        if freq > 0 and (step % freq == 0 or step == total_steps or stop_signum):
            save_checkpoint(
                cfg.trainer.output_dir, step, epoch, position, model, optimizer, scheduler, scorer, cfg, engine
            )
        if stop_signum:
            break

    if stop_signum:
        saved = "saved its checkpoint; rerun the same command to resume" if cfg.trainer.save_freq > 0 else (
            "no checkpoint (trainer.save_freq=0)")  # fmt: skip
        name = signal.Signals(stop_signum).name
        print0(f"stopped by {name} after step {step}: {saved}; exit code {128 + stop_signum}")
    elif cfg.trainer.export_hf:
        save_hf(model, processor, os.path.join(cfg.trainer.output_dir, "hf"))  # with LoRA: merged, plain names
        if a.lora_rank:
            save_adapter(model, os.path.join(cfg.trainer.output_dir, "adapter"))  # PEFT's adapter format
        print0(f"done: final model in {os.path.join(cfg.trainer.output_dir, 'hf')}")
    scorer.close()
    logger.close()
    shut_down(engine)  # the engine, then the process group
    return 128 + stop_signum if stop_signum else 0


if __name__ == "__main__":
    run_rank(main)
