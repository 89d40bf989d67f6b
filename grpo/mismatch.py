"""Engine/trainer mismatch: measure it per modality, stop a run whose engine saw other prompts, correct the rest.

The rollout engine samples with its own kernels (vLLM; bf16 on GPU), so its log-prob of a sampled token is not
exactly the trainer's. Some gap is normal arithmetic; a gross one means the engine did not see the prompt the
trainer scores (images dropped on the way, a prompt expanded twice, other pixel bounds), and such a run trains for
hours on a falling reward without an error. So this module
 - measures the gap every step, for text-only, image and video samples apart: mean and max |log p_trainer -
   log p_engine| and the mismatch KL, the k3 estimate of KL(engine || trainer) from the engine's samples
   (http://joschu.net/blog/kl-approx.html), token-mean;
 - stops the run at its first step (and the first after a resume) when the mismatch KL of a prompt's answers is
   beyond what arithmetic explains (algorithm.mismatch_guard), naming the modality and the module where engine and
   trainer part on the worst prompt (grpo/locate.py);
 - watches every later optimizer step the same way, on each modality's mean, and stops the run there, naming that
   module too, or skips the optimizer step (algorithm.mismatch_action): an engine whose state goes bad mid-run (stale
   caches after a sync, a linear-attention state restored as garbage after a wake) otherwise trains the run on
   garbage for hours;
 - corrects what remains as verl 0.9 does (verl/trainer/ppo/rollout_corr_helper.py), on log_ratio = old_logp -
   rollout_logp: importance weights per token or per sequence, truncated at a bound (TIS,
   https://fengyao.notion.site/off-policy-rl) or zeroed outside a range (IcePop), and rejection of the tokens or
   whole sequences whose divergence passes a threshold.
Tensors are (B, T) response positions with a (B, T) mask of real tokens, as in train_grpo.py. Only the tokens an
answer's own step sampled measure the engine: the first `carried` of a sample continued from earlier steps (partial
rollouts) were sampled under older weights, and their engine log-probs belong to that older policy.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from grpo.batching import mask_tool_turns, stack_padded
from grpo.distributed import Stop, print0

SAFETY_BOUND = 20.0  # log ratios are clamped to +-20 before exp(): weights stay within [2e-9, 4.9e8]
MODALITIES = ("text", "image", "video")  # a sample with a video counts as video, one with images as image
IS_LEVELS = ("none", "token", "sequence")
ACTIONS = ("stop", "skip")  # algorithm.mismatch_action: what a later step past algorithm.mismatch_guard does
RS_MODES = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
            "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")  # fmt: skip

# Running sums (and maxima, `*_max`) of one step, kept in the step's stats (grpo/stats.py: a key not yet added reads
# 0) and reduced here over all of STATS: every rank reduces every key, so the reductions line up whichever modalities
# a rank holds
STATS = (
    *(f"mismatch/{m}/{k}" for m in MODALITIES for k in ("tokens", "diff_sum", "kl_sum", "diff_max")),
    "mismatch/seqs",
    "mismatch/mask_tokens",  # the tokens the corrections act on: the loss mask's, carried ones too
    "mismatch/rs_tokens",
    "mismatch/rs_seqs",
    "mismatch/is_sum",
    "mismatch/is_sq_sum",
    "mismatch/is_clipped",
)
# Kept by watch() on each rank and never summed over ranks: how much of each modality's gap (tokens, k3 sum) it has
# judged so far this step, so that it judges each optimizer step's samples alone; the optimizer steps it let through
# and those it skipped (the same on every rank: its decisions are collective)
WATCH_STATS = (
    *(f"mismatch/{m}/judged_{k}" for m in MODALITIES for k in ("tokens", "kl_sum")),
    "mismatch/passed_steps",
    "mismatch/skipped_steps",
)
STATS += WATCH_STATS


# ----------------------------------------------------------------------------------------------------------------------
# Thresholds, as verl writes them: a number, or "lower_upper"


def parse_is_threshold(spec) -> tuple[float | None, float]:
    """rollout_is_threshold -> (lower or None, upper): a number truncates the weight at it (TIS), "lower_upper"
    zeroes weights outside [lower, upper] (IcePop)."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"expected a number or a 'lower_upper' string, got {spec!r}")
    text = str(spec).strip()
    lower, sep, upper = text.partition("_") if "_" in text else ("", "", text)
    try:
        lower, upper = (float(lower) if sep else None), float(upper)
    except ValueError:
        raise ValueError(f"expected a number or a 'lower_upper' string, got {spec!r}") from None
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"bounds must be positive with lower <= upper, got {spec!r}")
    return lower, upper


def rs_modes(modes: str) -> list[str]:
    """A comma list of RS_MODES -> the modes, each once, in order ("" or "none": no rejection)."""
    out = []
    for mode in (m.strip() for m in modes.split(",")):
        if mode and mode != "none" and mode not in out:
            if mode not in RS_MODES:
                raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(RS_MODES)}")
            out.append(mode)
    return out


def parse_rs_thresholds(modes: list[str], spec) -> list[tuple[float | None, float]]:
    """rollout_rs_threshold for `modes` -> one (lower or None, upper) per mode. One entry for all modes or one per
    mode, comma separated. The k1 modes bound the probability ratio: "lower_upper", or a lone u meaning [1/u, u];
    the k2/k3 modes take an upper bound only."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"expected numbers or 'lower_upper' strings, got {spec!r}")
    parts = [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(parts) not in (1, len(modes)):
        raise ValueError(f"{len(parts)} thresholds for {len(modes)} modes {modes}: give one for all or one per mode")
    out = []
    for mode, part in zip(modes, parts * len(modes) if len(parts) == 1 else parts):
        try:
            lower, upper = parse_is_threshold(part)
        except ValueError:
            raise ValueError(f"{mode}: threshold {part!r} must be positive (lower <= upper for lower_upper)") from None
        if mode.endswith("k1"):
            lower = 1.0 / upper if lower is None else lower
        elif lower is not None:
            raise ValueError(f"{mode} takes an upper bound only, got {part!r}")
        out.append((lower, upper))
    return out


# ----------------------------------------------------------------------------------------------------------------------
# The corrections: pure functions, no gradient, padding 0


def _masked_sum(values, mask):
    # where() rather than a product: whatever sits in the padding (inf, NaN) stays out of the sum
    return torch.where(mask.bool(), values, torch.zeros_like(values)).sum(-1)  # (B,)


def _masked_max(values, mask):
    top = values.masked_fill(~mask.bool(), float("-inf")).max(-1).values  # (B,)
    return torch.where(torch.isneginf(top), torch.zeros_like(top), top)  # a sequence without tokens: 0


SEQ_REDUCE = {
    "sum": _masked_sum,
    "mean": lambda values, mask: _masked_sum(values, mask) / (mask.sum(-1) + 1e-8),
    "max": _masked_max,
}


@torch.no_grad()
def rollout_is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold) -> torch.Tensor:
    """Importance weights p_trainer / p_engine of the sampled tokens, (B, T) -> (B, T), 0 on padding.

    level "token": a weight per token; "sequence": every token gets its sequence's weight, the exponential of the
    sum of its log ratios (unbiased, high variance). threshold: a number truncates weights at it (TIS); a
    "lower_upper" string zeroes the weights outside [lower, upper] (IcePop). Log ratios are clamped to +-20 before
    the exponential. The values of verl 0.9's compute_rollout_correction_weights without batch normalisation."""
    lower, upper = parse_is_threshold(threshold)
    if level == "token":
        log_w = log_ratio  # (B, T)
    elif level == "sequence":
        log_w = _masked_sum(log_ratio, mask).unsqueeze(-1).expand_as(log_ratio)  # (B, T)
    else:
        raise ValueError(f"rollout_is level {level!r}; valid: token, sequence")
    w = log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()  # (B, T)
    w = torch.where(mask.bool(), w, torch.zeros_like(w))
    if lower is None:
        return w.clamp(max=upper)
    return torch.where((w >= lower) & (w <= upper), w, torch.zeros_like(w))


@torch.no_grad()
def rollout_rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, modes: str, thresholds) -> torch.Tensor:
    """`mask` (B, T) with the rejected tokens set to 0: the tokens, or every token of the sequences, whose divergence
    between trainer and engine passes its threshold. Every mode of the comma list `modes` must pass.

    With x = log_ratio clamped to +-20: k1 = -x, k2 = x^2 / 2, k3 = exp(x) - 1 - x. token_kN judges each token;
    seq_sum_kN, seq_mean_kN and seq_max_kN (k2, k3) the sum, mean or max over the sequence's tokens, and keep or
    drop the whole sequence. k1 modes keep log(lower) <= statistic <= log(upper); k2/k3 modes keep statistic <=
    upper. `thresholds` as parse_rs_thresholds takes them. The mask of verl 0.9's compute_rollout_rejection_mask."""
    names = rs_modes(modes)
    if not names:
        raise ValueError("rollout_rejection_mask needs at least one mode")
    bounds = parse_rs_thresholds(names, thresholds)
    x = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)  # (B, T)
    divergence = {"k1": -x, "k2": 0.5 * x.square(), "k3": x.exp() - 1 - x}  # each (B, T)
    keep = torch.ones_like(mask, dtype=torch.bool)  # (B, T)
    for name, (lower, upper) in zip(names, bounds):
        level, kind = name.rsplit("_", 1)
        stat = divergence[kind]  # (B, T)
        if level != "token":
            stat = SEQ_REDUCE[level.split("_")[1]](stat, mask).unsqueeze(-1).expand_as(stat)  # (B, T)
        if kind == "k1":
            keep &= (stat >= math.log(lower)) & (stat <= math.log(upper))
        else:
            keep &= stat <= upper
    return (mask * keep).to(mask.dtype)


# ----------------------------------------------------------------------------------------------------------------------
# The measure, the guard and the step's corrections


def modality(prompt) -> str:
    """Which of MODALITIES a prompt's samples count under, from what the trainer's model sees of it."""
    if getattr(prompt, "video_grid_thw", None) is not None:
        return "video"
    images = ("image_grid_thw", "image_position_ids")  # (Gemma 4's images have no grid, their patches' places)
    return "image" if any(getattr(prompt, k, None) is not None for k in images) else "text"


def is_setting(alg) -> tuple[str, str | float]:
    """The importance-weight level and threshold in force: algorithm.tis_cap > 0 is rollout_is=token at that cap."""
    return ("token", alg.tis_cap) if alg.tis_cap > 0 else (alg.rollout_is, alg.rollout_is_threshold)


def config_problem(alg) -> str | None:
    """What is wrong with the algorithm.rollout_* / mismatch_guard / tis_cap settings, or None."""
    if alg.rollout_is not in IS_LEVELS:
        return f"algorithm.rollout_is={alg.rollout_is!r}; valid: {', '.join(IS_LEVELS)}"
    if alg.tis_cap < 0 or (alg.tis_cap > 0 and alg.rollout_is != "none"):
        return f"algorithm.tis_cap={alg.tis_cap} is rollout_is=token at that cap: set it to 0 with rollout_is, or >= 0"
    if alg.mismatch_guard < 0:
        return f"algorithm.mismatch_guard={alg.mismatch_guard} must be >= 0 (0 turns the mismatch checks off)"
    if alg.mismatch_action not in ACTIONS:
        return f"algorithm.mismatch_action={alg.mismatch_action!r}; valid: {', '.join(ACTIONS)}"
    level, threshold = is_setting(alg)
    if alg.rollout_bypass and level != "none":
        return (
            "algorithm.rollout_bypass makes the PPO ratio p_policy / p_engine, which corrects the mismatch already: "
            "importance weights (rollout_is, tis_cap) on top would count it twice; use rollout_rs with it"
        )
    try:
        if level != "none":
            parse_is_threshold(threshold)
    except ValueError as e:
        return f"algorithm.rollout_is_threshold={threshold!r}: {e}"
    try:
        modes = rs_modes(alg.rollout_rs)
        if modes:
            parse_rs_thresholds(modes, alg.rollout_rs_threshold)
    except ValueError as e:
        return f"algorithm.rollout_rs={alg.rollout_rs!r} with rollout_rs_threshold={alg.rollout_rs_threshold!r}: {e}"
    return None


def _gap(trainer_logp, engine_logp, mask):
    """(|log ratio|, k3) per token, 0 off the mask: x = log(p_trainer / p_engine) clamped to +-20, and the mismatch KL
    term exp(x) - 1 - x, the k3 estimate of KL(engine || trainer) on the engine's samples. In float64: in fp32,
    exp(x) - 1 - x of an fp32-sized gap (x ~ 1e-7, k3 ~ 5e-15) rounds to 0. where() rather than a product: a NaN
    off the mask (a carried token's old log-prob, padding) stays out."""
    x = torch.where(mask.bool(), trainer_logp.double() - engine_logp.double(), 0.0)  # (B, T)
    x = x.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return x.abs(), torch.expm1(x) - x


def fresh(mask, carried) -> torch.Tensor:
    """`mask` (B, T) without each row's first carried[b] positions, the tokens sampled at earlier steps under older
    weights (partial rollouts): their engine log-probs are an older policy's, which no trainer log-prob of the
    weights that sampled this step's tokens can judge."""
    pos = torch.arange(mask.shape[-1], device=mask.device)  # (T,)
    return mask * (pos >= torch.as_tensor(carried, device=mask.device)[:, None]).to(mask.dtype)  # (B, T)


def measure(trainer_logp, engine_logp, mask, kinds, stats) -> None:
    """Add one micro-batch's gap to `stats` (STATS keys), per modality; `kinds` (B,) names each row's modality."""
    mask = mask.to(torch.float64)
    diff, kl = _gap(trainer_logp, engine_logp, mask)  # (B, T) each
    rows = torch.tensor([MODALITIES.index(k) for k in kinds], device=mask.device)  # (B,)
    onehot = torch.nn.functional.one_hot(rows, len(MODALITIES)).to(mask.dtype)  # (B, M)
    sums = onehot.T @ torch.stack([mask.sum(-1), diff.sum(-1), kl.sum(-1)], 1)  # (M, 3)
    maxes = (diff.max(-1).values[:, None] * onehot).max(0).values  # (M,), |diff| >= 0: 0 where a modality is absent
    # one transfer for the lot: an .item() per row and figure would stall a GPU once each
    for m, (tokens, diff_sum, kl_sum), top in zip(MODALITIES, sums.tolist(), maxes.tolist()):
        stats[f"mismatch/{m}/tokens"] += tokens
        stats[f"mismatch/{m}/diff_sum"] += diff_sum
        stats[f"mismatch/{m}/kl_sum"] += kl_sum
        stats[f"mismatch/{m}/diff_max"] = max(stats[f"mismatch/{m}/diff_max"], top)


def measure_and_correct(trainer_logp, mask, prompts, samples, mb, alg, stats):
    """The micro-batch `mb` (indices into `samples`, whose prompts are `prompts`): measure the gap of the trainer's
    log-probs `trainer_logp` (B, T) to the engine's on the tokens each answer's own step sampled, then the corrections
    algorithm.rollout_* asks for. Returns the loss mask without the rejected tokens (B, T) and the importance weights
    (B, T), or None without them."""
    samples = [samples[i] for i in mb]
    engine_logp = stack_padded([torch.tensor(s.logprobs) for s in samples], mask.shape[1], mask.device)  # (B, T)
    kinds = [modality(prompts[s.prompt_index]) for s in samples]
    judged = fresh(mask, [s.carried for s in samples])  # (B, T)
    measure(trainer_logp, engine_logp, judged, kinds, stats)
    if alg.mismatch_guard > 0 and alg.mismatch_action == "stop":  # each answer's figure, for the watch's report
        kl = _gap(trainer_logp, engine_logp, judged)[1]  # (B, T)
        rows = torch.stack([kl.sum(-1), judged.sum(-1).double()], 1).tolist()  # (B, 2), one transfer
        answers = stats.setdefault("mismatch/answers", {})
        for i, kind, (kl_sum, tokens) in zip(mb, kinds, rows):  # added up: a filler micro-batch re-runs an answer
            _, kl_before, tokens_before = answers.get(i, (kind, 0.0, 0.0))  # (masked out: micro_batches' live=False)
            answers[i] = (kind, kl_before + kl_sum, tokens_before + tokens)
    stats["mismatch/seqs"] += (mask.sum(-1) > 0).sum().item()
    stats["mismatch/mask_tokens"] += mask.sum().item()
    log_ratio = trainer_logp - engine_logp  # (B, T)
    level, threshold = is_setting(alg)
    weights = None
    if level != "none":  # from the whole mask, as verl: a sequence's weight counts its rejected tokens too
        weights = rollout_is_weights(log_ratio, mask, level, threshold)  # (B, T)
        lower, upper = parse_is_threshold(threshold)
        raw = log_ratio if level == "token" else _masked_sum(log_ratio, mask).unsqueeze(-1).expand_as(log_ratio)
        out = raw > math.log(upper)  # (B, T): weights truncated (TIS) or zeroed (IcePop)
        if lower is not None:
            out |= raw < math.log(lower)
        stats["mismatch/is_sum"] += (weights * mask).sum().item()
        stats["mismatch/is_sq_sum"] += (weights.square() * mask).sum().item()
        stats["mismatch/is_clipped"] += (out * mask).sum().item()
    if rs_modes(alg.rollout_rs):
        kept = rollout_rejection_mask(log_ratio, mask, alg.rollout_rs, alg.rollout_rs_threshold)  # (B, T)
        stats["mismatch/rs_tokens"] += (mask.sum() - kept.sum()).item()
        stats["mismatch/rs_seqs"] += (kept.sum(-1) < mask.sum(-1)).sum().item()
        mask = kept
    return mask, weights


def _over_ranks(stats) -> dict[str, float]:
    """STATS but WATCH_STATS summed (maxima: the max) over ranks. Collective: one SUM and one MAX all_reduce, which
    every rank makes with every key, whichever modalities it holds."""
    sum_keys = [k for k in STATS if not k.endswith("_max") and k not in WATCH_STATS]
    max_keys = [k for k in STATS if k.endswith("_max")]
    sums = torch.tensor([float(stats[k]) for k in sum_keys], dtype=torch.float64)
    maxes = torch.tensor([float(stats[k]) for k in max_keys], dtype=torch.float64)
    dist.all_reduce(sums)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    return dict(zip(sum_keys, sums.tolist())) | dict(zip(max_keys, maxes.tolist()))


def _gap_metrics(total) -> dict[str, float]:
    # the whole batch's keys, as logged before the split by modality; a modality no rank had is left out, not 0
    tokens = sum(total[f"mismatch/{m}/tokens"] for m in MODALITIES)
    metrics = {
        "rollout/logprob_diff_mean": sum(total[f"mismatch/{m}/diff_sum"] for m in MODALITIES) / max(tokens, 1),
        "rollout/logprob_diff_max": max(total[f"mismatch/{m}/diff_max"] for m in MODALITIES),
        "rollout/mismatch_kl": sum(total[f"mismatch/{m}/kl_sum"] for m in MODALITIES) / max(tokens, 1),
    }
    for m in MODALITIES:
        n = total[f"mismatch/{m}/tokens"]
        if n > 0:
            metrics[f"rollout/logprob_diff_mean/{m}"] = total[f"mismatch/{m}/diff_sum"] / n
            metrics[f"rollout/logprob_diff_max/{m}"] = total[f"mismatch/{m}/diff_max"]
            metrics[f"rollout/mismatch_kl/{m}"] = total[f"mismatch/{m}/kl_sum"] / n
    return metrics


def step_metrics(stats, alg) -> dict[str, float]:
    """The step's mismatch and correction metrics over all ranks (collective, _over_ranks)."""
    total = _over_ranks(stats)
    metrics = _gap_metrics(total)
    tokens = max(total["mismatch/mask_tokens"], 1)
    if alg.mismatch_action == "skip" and alg.mismatch_guard > 0:  # decided together: the same on every rank
        metrics["actor/mismatch_skipped_steps"] = stats["mismatch/skipped_steps"]
    if rs_modes(alg.rollout_rs):
        metrics["rollout/rs_rejected_token_frac"] = total["mismatch/rs_tokens"] / tokens
        metrics["rollout/rs_rejected_seq_frac"] = total["mismatch/rs_seqs"] / max(total["mismatch/seqs"], 1)
    if is_setting(alg)[0] != "none":
        w_sum, w_sq = total["mismatch/is_sum"], total["mismatch/is_sq_sum"]
        metrics["rollout/is_weight_mean"] = w_sum / tokens
        # effective sample size as a share of the tokens, verl's: mean(w)^2 / mean(w^2), 1 when all weights agree
        metrics["rollout/is_ess"] = w_sum**2 / (tokens * w_sq) if w_sq > 0 else 0.0
        metrics["rollout/is_clipped_frac"] = total["mismatch/is_clipped"] / tokens
        if alg.tis_cap > 0:  # the names tis_cap logged before rollout_is existed
            metrics["rollout/tis_weight_mean"] = metrics["rollout/is_weight_mean"]
            metrics["rollout/tis_capped_frac"] = metrics["rollout/is_clipped_frac"]
    return metrics


CAUSES = (
    "The engine did not see the prompts the trainer scores: images or videos dropped or replaced on the way to "
    "the engine, a prompt expanded twice, other pixel bounds on the two sides (data.min_pixels/max_pixels), "
    "M-RoPE positions computed from other grids, or weights the engine never received."
)


def check_start(old_logps, samples, prompts, bound, step, locate=None) -> None:
    """The guard of a run's first step (and the first after a resume): print each modality's mismatch, and stop
    every rank with a message when a prompt's answers together have a mismatch KL above `bound`
    (algorithm.mismatch_guard). Per prompt, not only per modality: one prompt whose image was lost among a hundred
    good ones moves the modality's mean by a hundredth. `old_logps` are the trainer's per-sample log-probs under the
    weights that sampled. `locate` (locate.in_run, or None): before it stops, where the engine and the trainer part
    on the worst answer of the worst prompt (locate_worst), printed and named in the message. Collective: every rank
    decides on the same reduced figures."""
    stats, groups = dict.fromkeys(STATS, 0.0), {}
    for i, (logp, s) in enumerate(zip(old_logps, samples)):
        kind = modality(prompts[s.prompt_index])
        engine = torch.tensor(s.logprobs, dtype=logp.dtype)  # (T,)
        mask = torch.ones_like(engine)  # (T,)
        mask_tool_turns(mask, s.turns)  # a tool turn's tokens are context: the engine gives them no log-prob
        mask[: s.carried] = 0  # sampled under older weights (partial.py): this step's policy cannot judge them
        measure(logp[None], engine[None], mask[None], [kind], stats)
        _add_answer(groups, s.prompt_index, i, kind, _gap(logp, engine, mask)[1].sum().item(), mask.sum().item(), s)
    worst = torch.zeros(len(MODALITIES), dtype=torch.float64)  # (M,), the worst prompt's mismatch KL
    for kind, kl_sum, tokens, *_ in groups.values():
        i = MODALITIES.index(kind)
        kl = kl_sum / max(tokens, 1)
        worst[i] = max(worst[i].item(), kl if not math.isnan(kl) else math.inf)  # NaN: garbage, past any bound
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    metrics = _gap_metrics(_over_ranks(stats))
    present = [(m, metrics[f"rollout/mismatch_kl/{m}"], w) for m, w in zip(MODALITIES, worst.tolist())
               if f"rollout/mismatch_kl/{m}" in metrics]  # fmt: skip
    print0(f"mismatch KL at step {step} (all samples / worst prompt): "
           + ", ".join(f"{m} {kl:.2g} / {w:.2g}" for m, kl, w in present) + f"; guard {bound:g}")  # fmt: skip
    for m, kl, w in present:
        if w > bound:
            where = ""
            if locate is not None:  # (collective: every rank is here, on the same figures)
                found = locate_worst(m, groups, samples, prompts, locate)
                where = f" Where the engine and the trainer part on that prompt: {found}."
            raise Stop(
                f"error: engine/trainer mismatch: the {m} samples of step {step} have a mismatch KL of {w:.3g} for "
                f"their worst prompt ({kl:.3g} over all of them), above algorithm.mismatch_guard={bound:g}, which "
                f"differing arithmetic stays below (bf16 on GPU ~1e-3, fp32 ~1e-12).{where} {CAUSES} Raise "
                f"algorithm.mismatch_guard, or 0 turns this check off."
            )


def _add_answer(groups, key, index, kind, kl_sum, tokens, sample) -> None:
    """Count answer `index` (its k3 summed over its `tokens`) in its prompt's group `key`: [modality, k3 sum, tokens,
    its worst answer's mean k3, that answer's index], the worst among the answers without tool turns (their images
    are not the prompt's)."""
    group = groups.setdefault(key, [kind, 0.0, 0, -math.inf, None])
    group[1] += kl_sum
    group[2] += int(tokens)
    mean = kl_sum / max(tokens, 1)
    if not sample.turns and not mean <= group[3]:
        group[3:] = [mean if not math.isnan(mean) else math.inf, index]


def locate_worst(kind, groups, samples, prompts, locate) -> str:
    """`first divergence: <module>` of the worst answer of the worst prompt of modality `kind` over all ranks (groups:
    check_start's), from `locate` (prompt, answer) -> locate.py's rows, its table printed by rank 0. Collective: the
    rank that holds that prompt sends it and the answer to every rank, and all run it (a forward of the FSDP2 model,
    one request of the engine's TP group)."""
    from grpo.locate import first_divergence, format_report

    kl = {p: g[1] / max(g[2], 1) for p, g in groups.items() if g[0] == kind and g[4] is not None}
    kl = {p: math.inf if math.isnan(v) else v for p, v in kl.items()}  # NaN: garbage, the worst
    mine = max(((v, p, groups[p][4]) for p, v in kl.items()), default=(-math.inf, None, None))
    figures = [None] * dist.get_world_size()
    dist.all_gather_object(figures, mine[0])
    owner = max(range(len(figures)), key=lambda r: figures[r])
    if figures[owner] == -math.inf:
        return "not located (every answer of those prompts has tool turns)"
    sent = [(prompts[mine[1]], samples[mine[2]].response_ids) if dist.get_rank() == owner else None]
    dist.broadcast_object_list(sent, src=owner)
    prompt, answer = sent[0]
    rows = locate(prompt, answer)
    print0(format_report(rows, f"engine and trainer, module by module, on the worst {kind} prompt of the step "
                               f"({len(prompt.input_ids)} tokens and an answer of {len(answer)}):"))  # fmt: skip
    return f"first divergence: {first_divergence(rows)}"


LATER_CAUSES = (
    "The run's first step passed the start check, so the engine's state went bad after it: caches kept from older "
    "weights after a weight sync, a model state (Qwen3.5's linear attention) restored as garbage (NaN or zeros) "
    "after a wake, a weight sync that missed weights, or media lost on the way to the engine for this batch."
)


def watch(stats, alg, step, locate=None, samples=None, prompts=None) -> bool:
    """The guard of every step, at each optimizer step between its backward and the step: True when the optimizer
    may step. It judges each modality's mean mismatch KL over the model's own fresh tokens of the samples this
    optimizer step trains on (those measure_and_correct measured since the last call), all ranks together; past
    algorithm.mismatch_guard it stops every rank (algorithm.mismatch_action=stop) or warns and returns False (skip:
    the caller must not step, and its zero_grad drops the gradients). `locate` (locate.in_run, or None): before it
    stops, where the engine and the trainer part on the worst answer of the worst prompt of that modality among
    this optimizer step's `samples` (whose prompts are `prompts`), as check_start does. Under rollout_bypass the
    trainer's side of the gap is the current policy, which is the one that sampled only until an optimizer step of
    this step changes it: after that the gap holds the policy's own drift, and the watch stays quiet. Collective (one
    all_reduce) whenever the guard is on: every rank decides the same, on the same figures."""
    answers = stats.pop("mismatch/answers", {})  # sample index -> (modality, k3 sum, tokens): measure_and_correct's
    keys = [(f"mismatch/{m}/{k}", f"mismatch/{m}/judged_{k}") for m in MODALITIES for k in ("tokens", "kl_sum")]
    new = torch.tensor([stats[k] - stats[judged] for k, judged in keys], dtype=torch.float64)  # (M * 2,)
    for k, judged in keys:
        stats[judged] = stats[k]
    if alg.mismatch_guard <= 0 or (alg.rollout_bypass and stats["mismatch/passed_steps"] > 0):
        stats["mismatch/passed_steps"] += 1
        return True
    dist.all_reduce(new)
    means = {m: kl / tokens for m, (tokens, kl) in zip(MODALITIES, new.view(-1, 2).tolist()) if tokens > 0}
    # NaN (an engine state gone to garbage) counts as past the bound: NaN > bound would be False
    over = sorted(((kl, m) for m, kl in means.items() if not kl <= alg.mismatch_guard), reverse=True)
    if not over:
        stats["mismatch/passed_steps"] += 1
        return True
    (kl, m), others = over[0], ", ".join(f"the {m} samples {kl:.3g}" for kl, m in over[1:])
    others = f" ({others})" if others else ""
    figure = (f"the {m} samples of step {step} have a mean mismatch KL of {kl:.3g} over the model's tokens{others}, "
              f"above algorithm.mismatch_guard={alg.mismatch_guard:g}")  # fmt: skip
    if alg.mismatch_action == "skip":
        print0(f"warning: {figure}: optimizer step skipped (algorithm.mismatch_action=skip)")
        stats["mismatch/skipped_steps"] += 1
        return False
    where = ""
    if locate is not None:  # (collective: every rank is here, on the same figures)
        groups, first = {}, {}
        for i, (kind, kl_sum, tokens) in sorted(answers.items()):
            s = samples[i]  # (each answer may hold its own entry of its prompt: grouped by the prompt itself)
            key = first.setdefault(id(prompts[s.prompt_index]), s.prompt_index)
            _add_answer(groups, key, i, kind, kl_sum, tokens, s)
        found = locate_worst(m, groups, samples, prompts, locate)
        where = f" Where the engine and the trainer part on its worst prompt: {found}."
    raise Stop(
        f"error: engine/trainer mismatch: {figure}, which differing arithmetic stays below (bf16 on GPU ~1e-3, fp32 "
        f"~1e-12).{where} {LATER_CAUSES} Raise algorithm.mismatch_guard (0 turns the checks off), or "
        f"algorithm.mismatch_action=skip skips such optimizer steps and trains on."
    )


def engine_logps(samples) -> list[torch.Tensor]:
    """algorithm.rollout_bypass: the engine's log-probs of each sample, to serve as the old ones."""
    if any(s.logprobs is None or len(s.logprobs) != len(s.response_ids) for s in samples):
        raise RuntimeError(
            "algorithm.rollout_bypass=true takes the engine's log-probs as the old ones, but the engine returned "
            "none for some samples: set rollout_bypass=false (the trainer then computes the old log-probs)"
        )
    return [torch.tensor(s.logprobs, dtype=torch.float32) for s in samples]
