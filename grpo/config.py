"""The run's configuration: one typed dataclass tree, two levels deep (`rollout.temperature`), every field with its
default and what it does. A YAML file holds overrides only; `section.key=value` on the command line beats the file,
which beats the defaults. Unknown keys, wrong types and choices that cannot work fail here, before any model loads,
naming the key to change."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
import re
import typing
from dataclasses import dataclass, field

from grpo.attention import OWN_PACKED_ATTENTION, PACKED_ATTENTION
from grpo.logger import LOGGERS
from grpo.mismatch import config_problem as mismatch_problem
from grpo.optim import config_problem as optimizer_problem
from grpo.partial import config_problem as partial_problem
from grpo.tools import tools_problem

# ----------------------------------------------------------------------------------------------------------------------
# Config: one dataclass tree, two levels deep. YAML holds overrides, CLI `section.key=value` beats YAML beats defaults.


# LoRA's default targets: the decoder layers' attention and MLP projections (GLM-4.1V's MLP is gate_up_proj, one
# Linear; no Qwen module has the name)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj")


@dataclass
class DataConfig:
    train_files: str = "hiyouga/geometry3k@train"  # HF `name@split`, or a local parquet/jsonl/json file or directory
    val_files: str = "hiyouga/geometry3k@test"  # same forms; "" disables validation
    prompt_key: str = "problem"  # column with the question text and its <image> marks, or chat messages (verl)
    answer_key: str = "answer"  # column with the ground truth; a dotted key reaches into a struct (verl)
    image_key: str = "images"  # column with a list of images ({bytes, path}, path string or PIL); absent = text only
    video_key: str = "videos"  # column with a list of videos (each a list of frames or a video file); absent = none
    format_prompt: str = "configs/format_prompt/geo3k.jinja"  # jinja template around the problem; "" for none
    system_prompt: str = ""  # "" keeps Qwen's default system prompt
    max_prompt_length: int = 2048  # tokens after image expansion
    max_response_length: int = 2048  # max new tokens per answer
    filter_overlong_prompts: bool = True  # drop (and count) prompts longer than max_prompt_length
    min_pixels: int = 262144  # images are resized into [min_pixels, max_pixels], in trainer and rollout alike
    max_pixels: int = 4194304
    # Gemma 4 only: the soft tokens an image becomes (70, 140, 280, 560 or 1120; its processor resizes every image to
    # fill them, whatever min/max_pixels say); 0: the checkpoint's processor's own (280 in the released ones)
    max_soft_tokens: int = 0
    video_fps: float = 2.0  # video files are sampled at this rate; frame lists are taken as sampled at it
    max_frames: int = 32  # most frames kept of one video (evenly spread)
    video_min_pixels: int = 16384  # each video frame is resized into [video_min_pixels, video_max_pixels]
    video_max_pixels: int = 65536
    rollout_batch_size: int = 512  # prompts per step, over all ranks
    val_batch_size: int = 64  # prompts per validation generate call, per rank
    val_max_samples: int = 0  # 0 = the whole validation set
    shuffle: bool = True  # reshuffle the train set every epoch (seeded by trainer.seed and the epoch)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"  # see ADVANTAGE_ESTIMATORS
    adv_estimator_kwargs: dict = field(default_factory=dict)  # the estimator's own keyword arguments, {name: value}
    kl_coef: float = 1e-2  # weight of the KL loss term; 0 skips the reference model entirely
    kl_penalty: str = "low_var_kl"  # see KL_PENALTIES: k1, k2, low_var_kl
    adv_eps: float = 1e-6  # added to the group std
    kl_in_reward: bool = False  # subtract kl_coef x KL from the reward (PPO-style) instead of adding a loss term
    tis_cap: float = 0.0  # the same as rollout_is=token with rollout_is_threshold=tis_cap; 0 = off
    rollout_is: str = "none"  # weights p_trainer / p_engine against the engine mismatch (mismatch.py): token, sequence
    rollout_is_threshold: str = "2.0"  # a number truncates the weights (TIS); "lower_upper" zeroes outside (IcePop)
    rollout_rs: str = ""  # reject tokens/sequences too far off the engine: comma list of mismatch.RS_MODES; "" = off
    rollout_rs_threshold: str = ""  # one for all modes or one per mode; "lower_upper" ratio bounds for the k1 modes
    rollout_bypass: bool = False  # the engine's log-probs are the old ones: no old-log-prob forward
    mismatch_guard: float = 0.01  # bound on a prompt's mismatch KL at the start, a modality's every step; 0 = off
    mismatch_action: str = "stop"  # a later step past mismatch_guard: stop, or skip its optimizer steps (mismatch.py)
    online_filtering: bool = False  # DAPO dynamic sampling: drop prompt groups whose mean filter_key is out of bounds
    filter_key: str = "accuracy"  # reward key the filter looks at
    filter_low: float = 0.01  # drop groups with mean <= filter_low (all wrong) ...
    filter_high: float = 0.99  # ... or >= filter_high (all right): they have zero advantage anyway
    max_filter_rounds: int = 8  # rollout rounds per step before giving up with an error
    # MoE: r3 = every trainer forward routes each token to the experts the engine chose for it (replay.py); none
    routing_replay: str = "none"


@dataclass
class ActorConfig:
    model_path: str = "Qwen/Qwen2.5-VL-7B-Instruct"  # HF hub name or local directory
    global_batch_size: int = 128  # prompts per optimizer step (divides data.rollout_batch_size)
    micro_batch_size: int = 4  # sequences per forward/backward per rank (gradient accumulation fills the rest)
    micro_batch_size_no_grad: int = 16  # sequences per forward for old/ref log-probs
    padding_free: bool = True  # pack each micro-batch's sequences into one row, no pad tokens
    shared_prefix: bool = True  # packed: a group's prompt and images once for all its answers in a micro-batch
    max_tokens_per_micro_batch: int = 0  # > 0: micro-batches by token budget instead of micro_batch_size
    max_tokens_per_micro_batch_no_grad: int = 0  # token budget of the old/ref log-prob forwards; 0 = as above
    balance_ranks: bool = True  # with a token budget: move a few sequences so every rank has as many tokens
    # > 1: groups of this many ranks share each sequence of the training forward (Ulysses over the heads, the vision
    # tower split by temporal patch; sequence_parallel.py); data parallelism is over the groups, token budgets count a
    # group's tokens; it must divide the ranks and the model's attention heads
    sequence_parallel_size: int = 1
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
    policy_loss_kwargs: dict = field(default_factory=dict)  # the loss's own keyword arguments, {name: value}
    entropy_coef: float = 0.0  # entropy bonus weight; 0 = off
    mask_truncated: bool = False  # leave answers cut at max_response_length out of the loss (DAPO)
    router_aux_loss_coef: float = 0.0  # > 0: MoE experts' load-balancing loss at this weight (pretraining's 1e-3)
    gradient_checkpointing: bool = True
    freeze_vision_tower: bool = False
    ref_offload: bool = False  # keep the reference model's shards in CPU memory (FSDP2 CPU offload)
    offload_params: bool = False  # policy + reference shards to host memory while vLLM generates (offload.py)
    offload_optimizer: bool = False  # AdamW's moments in host memory, on the GPU only for each optimizer step
    master_dtype: str = "fp32"  # trainable weights and AdamW moments: fp32, or bf16 (stochastic rounding, optim.py)
    attn_implementation: str = "auto"  # auto = varlen_packed (torch's flash varlen) on CUDA, sdpa_packed elsewhere
    lora_rank: int = 0  # > 0: train LoRA adapters of this rank (PEFT) on a frozen base, the reference; 0 = full FT
    lora_alpha: int = 16  # LoRA scale = lora_alpha / lora_rank
    lora_dropout: float = 0.0  # dropout on the adapters' input, in update forwards only (eval forwards have none)
    # modules given adapters: plain names are the language model's decoder-layer projections; `visual.NAME` adapts
    # the vision tower's (visual.qkv), else frozen; `lm_head` the head (not if tied to the embeddings); `experts` an
    # MoE's routed experts, opt-in: most of its weights, a bf16 copy of a layer's per forward (docs/lora.md)
    lora_target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))


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
    mm_cache_gb: float = 1.0  # vllm: GiB of processed images/videos it keeps per rank, host memory (its default: 4)
    sleep_level: int = -1  # vllm on CUDA: 1 = weights to host, 2 = discard, 0 = never; -1 = vllm_engine.sleep_level_for
    max_num_seqs: int = 256  # most sequences decoded together: per vllm engine, per generate call of the hf engine
    max_images_per_prompt: int = -1  # vllm reserves encoder memory for this many images a prompt; -1 = the data's most
    max_videos_per_prompt: int = -1  # ... and this many videos; -1 = the data's most (both read before vllm starts)
    enforce_eager: bool = False  # vllm: no CUDA graphs (slower decoding, faster start); always eager on CPU
    tools: list[str] = field(default_factory=list)  # path/to/file.py:function tools the model may call (turns.py)
    max_turns: int = 4  # with tools: most model turns in an answer (at most max_turns - 1 tool calls)
    tool_timeout: float = 10.0  # seconds per tool call; a hang or a crash comes back to the model as an error
    tool_workers: int = 1  # tool processes per rank
    tool_prompt: str = ""  # system text offering the tools where the chat template cannot ({tools}); "" = tools.py's
    partial: bool = False  # stop generating once the step has its groups, continue the rest next step (partial.py)
    partial_reserve: float = 0.5  # with partial: prompts in flight beyond the step's, as a share of them
    max_staleness: int = 4  # with partial: most steps a carried token waits to train; an older one starts over


@dataclass
class RewardConfig:
    reward_fn: str = "reward.py:compute_score"  # path/to/file.py:function returning a number or {"overall", ...}
    timeout: float = 10.0  # seconds per graded answer; a hang or crash scores 0 and is counted
    num_workers: int = 0  # grading processes per rank; 0 = the rank's share of the cores it may use (at most 8)
    overlong_buffer: int = 0  # DAPO soft overlong penalty over the last this-many tokens before the limit; 0 = off
    overlong_penalty_factor: float = 1.0  # the penalty at the length limit


@dataclass
class DistillConfig:
    # on-policy distillation (distill.py): a frozen teacher's log-probs of the policy's own sampled tokens give each
    # answer token coef x (log p_teacher - log p_policy) more advantage, beside the reward's
    model_path: str = ""  # the teacher: a checkpoint of a supported family with the policy's tokenizer; "" = off
    coef: float = 1.0  # weight of the teacher's per-token term (with a zero reward: pure distillation)
    offload: bool = False  # keep the teacher's shards in CPU memory (FSDP2 CPU offload, as actor.ref_offload)


@dataclass
class TrainerConfig:
    output_dir: str = "outputs/geo3k"
    total_epochs: int = 15
    max_steps: int = 0  # stop after this many steps (a step = one rollout batch and its update); 0 = from epochs
    val_freq: int = 5  # validate every this many steps; 0 = never
    val_before_train: bool = True
    save_freq: int = 5  # checkpoint every this many steps; 0 = never
    save_limit: int = 3  # keep the newest N checkpoints; 0 keeps all
    collective_timeout_s: float = 3600.0  # a collective that waits longer for a rank ends the run (distributed)
    export_hf: bool = True  # at the end, write the model to <output_dir>/hf (LoRA: merged, + the adapter directory)
    resume: str = "auto"  # auto | none | PATH
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # + tensorboard, wandb; jsonl always on
    val_samples: int = 4  # validation generations written to <output_dir>/val_samples.jsonl per validation
    wandb_project: str = "grpo-vl"  # wandb project; the run is named after output_dir
    seed: int = 1
    verbose: bool = False  # every library message, unfiltered (quiet.py names what a run hides and why)
    n_gpus_per_node: int = 0  # for the memory plan (memory_plan.py); 0 = the GPUs CUDA sees, or 8 without a GPU
    nnodes: int = 0  # nodes a dry run plans and checks for (x n_gpus_per_node); 0 = the launcher's world, or one node
    gpu_memory_gib: float = 0.0  # memory of one GPU for the plan; 0 = what CUDA reports, or 80 without a GPU


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


class ConfigError(ValueError):
    pass


def _coerce(value, typ, key):
    """Check a YAML/CLI value against a dataclass field type; return it converted where the conversion is lossless."""
    origin = typing.get_origin(typ)
    if typ is dict:  # a variant's own keyword arguments: `key={name: value}` on the command line, a map in YAML
        if value in (None, ""):
            return {}
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key}: expected a map like {{name: value}}, got {value!r}")
        # PyYAML reads `1e-3` (no dot) as a string: a number written so is meant as one
        return {k: float(v) if isinstance(v, str) and _EXPONENT.fullmatch(v) else v for k, v in value.items()}
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


_EXPONENT = re.compile(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+")


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
        try:
            with open(path) as f:
                tree = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as e:  # a missing file, or YAML that does not parse: one line, no traceback
            raise ConfigError(f"{path}: {getattr(e, 'strerror', None) or ' '.join(str(e).split())}") from None
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
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: {' '.join(str(e).split())}") from None
        _apply(cfg, section, key, raw if isinstance(value, (int, float)) and "_" in raw else value)  # YAML: 1_2 = 12
    return cfg


def kwargs_problem(key: str, fn, kwargs: dict, fixed: int) -> str | None:
    """A variant's own settings (`key`, a map of keyword arguments) against its function: every name one of the
    parameters after the `fixed` ones that every variant of its table takes, and none of those without a default
    left out. None when they fit."""
    params = list(inspect.signature(fn).parameters.values())[fixed:]
    own = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    name, listed = getattr(fn, "__name__", repr(fn)), ", ".join(own) or "none"
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        if unknown := [k for k in kwargs if k not in own]:
            return f"{key}: {name} takes no argument {unknown[0]!r}; its own arguments: {listed}"
    if missing := [p.name for p in params if p.name in own and p.default is p.empty and p.name not in kwargs]:
        return f"{key}: {name} needs its argument {missing[0]!r} (its own arguments: {listed})"
    return None


def _get(cfg: Config, name: str):
    section, key = name.split(".")
    return getattr(getattr(cfg, section), key)


def check_config(cfg: Config, world_size: int, choices: dict[str, dict], settings: dict | None = None) -> None:
    """Reject choices that cannot work before any model loads, naming the numbers to change. `choices` maps a key
    (`algorithm.adv_estimator`) to its valid values: the loop's own tables of variants, read at the call, so a variant
    added to a table is a valid value at once. `settings` maps a variant's own settings (`actor.policy_loss_kwargs`)
    to (the key choosing the variant, how many arguments every variant of its table takes), checked against the
    chosen function's signature."""
    d, a, r, alg = cfg.data, cfg.actor, cfg.rollout, cfg.algorithm
    for name, valid in choices.items():
        if (value := _get(cfg, name)) not in valid:
            raise ConfigError(f"{name}={value!r}; valid: {list(valid)}")
    for name, (chooser, fixed) in (settings or {}).items():
        if problem := kwargs_problem(name, choices[chooser][_get(cfg, chooser)], _get(cfg, name), fixed):
            raise ConfigError(problem)
    estimators = choices.get("algorithm.adv_estimator", {})
    if r.n == 1 and not getattr(estimators.get(alg.adv_estimator), "batch_level", False):  # groups of one answer
        batch_level = [k for k, fn in estimators.items() if getattr(fn, "batch_level", False)]
        raise ConfigError("rollout.n=1: with one answer a prompt every advantage is 0 and nothing is learned: "
                          f"set rollout.n >= 2, or algorithm.adv_estimator to a batch-level one: "
                          f"{', '.join(batch_level)}")  # fmt: skip
    if cfg.reward.num_workers < 0:
        raise ConfigError(f"reward.num_workers={cfg.reward.num_workers}; 0 = automatic, or a number of processes")
    if cfg.reward.overlong_buffer >= d.max_response_length:
        raise ConfigError(f"reward.overlong_buffer={cfg.reward.overlong_buffer} must be < data.max_response_length")
    unknown_loggers = set(cfg.trainer.logger) - set(LOGGERS)
    if unknown_loggers:
        raise ConfigError(f"trainer.logger: unknown {sorted(unknown_loggers)}; valid: {', '.join(LOGGERS)}")
    for name in cfg.trainer.logger:
        if LOGGERS[name] and importlib.util.find_spec(LOGGERS[name]) is None:
            raise ConfigError(
                f"trainer.logger includes {name} but {LOGGERS[name]} is not installed: pip install {LOGGERS[name]}"
                + (" (WANDB_MODE=offline logs without network)" if name == "wandb" else "")
            )
    for name in ("data.rollout_batch_size actor.global_batch_size actor.micro_batch_size rollout.n actor.ppo_epochs "
                 "actor.micro_batch_size_no_grad rollout.val_n rollout.max_turns data.max_response_length "
                 "data.val_batch_size trainer.collective_timeout_s").split():  # fmt: skip
        if (value := _get(cfg, name)) <= 0:
            raise ConfigError(f"{name} must be > 0, got {value}")
    if r.tools and (problem := tools_problem(r.tools)):  # a tool that cannot load or be shown to the model
        raise ConfigError(f"rollout.tools: {problem}")
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
    sp = a.sequence_parallel_size
    if sp < 1 or world_size % sp:
        raise ConfigError(f"actor.sequence_parallel_size={sp} must be >= 1 and divide the {world_size} ranks")
    if sp > 1 and not (a.padding_free and a.attn_implementation in OWN_PACKED_ATTENTION):
        raise ConfigError(
            f"actor.sequence_parallel_size={sp} cuts packed rows: it needs actor.padding_free=true and "
            f"actor.attn_implementation in {OWN_PACKED_ATTENTION}"
        )
    if sp > 1 and a.router_aux_loss_coef > 0:  # each rank would weigh its slice's routing by the group's tokens
        raise ConfigError(f"actor.sequence_parallel_size={sp} with actor.router_aux_loss_coef > 0 is not supported")
    if sp > 1 and cfg.algorithm.routing_replay != "none":  # the replayed routes are the whole row's, not cut yet
        raise ConfigError(f"actor.sequence_parallel_size={sp} with algorithm.routing_replay is not supported yet")
    if r.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("rollout.engine=vllm but vllm is not installed (see requirements*.txt), or use engine=hf")
    if r.tensor_parallel_size < 1 or world_size % r.tensor_parallel_size:
        raise ConfigError(f"rollout.tensor_parallel_size={r.tensor_parallel_size} must divide the {world_size} ranks")
    if r.tensor_parallel_size > 1 and r.engine != "vllm":
        raise ConfigError(f"rollout.tensor_parallel_size={r.tensor_parallel_size} needs rollout.engine=vllm")
    if a.lora_rank < 0 or (a.lora_rank and (a.lora_alpha <= 0 or not a.lora_target_modules)):
        raise ConfigError(
            f"actor.lora_rank={a.lora_rank} (0 = full fine-tuning) with lora_alpha={a.lora_alpha} > 0 and "
            f"lora_target_modules={a.lora_target_modules} not empty"
        )
    if not 0 <= a.lora_dropout < 1:
        raise ConfigError(f"actor.lora_dropout={a.lora_dropout} must be in [0, 1)")
    if cfg.distill.model_path and cfg.distill.coef <= 0:
        raise ConfigError(f"distill.coef={cfg.distill.coef} must be > 0 with a teacher (distill.model_path), "
                          "or set distill.model_path= (empty) to train without one")  # fmt: skip
    if problem := optimizer_problem(a, r.engine):
        raise ConfigError(problem)
    if r.sleep_level not in (-1, 0, 1, 2):
        raise ConfigError(f"rollout.sleep_level={r.sleep_level}; valid: -1 (auto), 0 (never sleep), 1, 2")
    if alg.routing_replay not in ("none", "r3"):  # (replay.MODES)
        raise ConfigError(f"algorithm.routing_replay={alg.routing_replay!r}; valid: none, r3 (MoE models: replay.py)")
    if problem := replay_capture_problem(cfg):
        raise ConfigError(problem)
    if problem := mismatch_problem(cfg.algorithm) or partial_problem(cfg):
        raise ConfigError(problem)
    if cfg.trainer.resume not in ("auto", "none") and not os.path.isdir(cfg.trainer.resume):
        raise ConfigError(f"trainer.resume={cfg.trainer.resume!r}: expected auto, none or a checkpoint directory")


def replay_capture_problem(cfg) -> str | None:
    """Routing replay under vLLM's Model Runner V2 with tensor parallelism and CUDA graphs: vLLM 0.32/0.33 capture
    the routes on the first TP rank only, where every rank's scheduler expects them (vllm_compat.captures_routes),
    so the engine reads them by hooks on its routers instead, which CUDA graphs do not run. Stopped here, at the
    config check (and --dry-run), not at the engine's start minutes later."""
    r = cfg.rollout
    if cfg.algorithm.routing_replay != "r3" or r.engine != "vllm" or r.tensor_parallel_size == 1 or r.enforce_eager:
        return None
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "1":
        return None
    from grpo import vllm_compat

    if not vllm_compat.v2_only_capture():
        return None
    return (
        f"algorithm.routing_replay=r3 with rollout.tensor_parallel_size={r.tensor_parallel_size} and "
        "VLLM_USE_V2_MODEL_RUNNER=1: this vLLM's own capture of the routes (Model Runner V2) returns them from the "
        "first TP rank only, and every other rank's scheduler stops at the first step; the engine reads them by "
        "hooks on its routers instead, which CUDA graphs do not run: set rollout.enforce_eager=true, or "
        "rollout.tensor_parallel_size=1"
    )


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
