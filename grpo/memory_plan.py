"""The memory plan: what one GPU and one node's host memory will hold, worked out before anything loads.

`python train_grpo.py CONFIG --dry-run` prints it without a GPU and without weights; every start prints it too,
and on CUDA a plan over the limit stops the run with the config key to change. This module takes the config and the
machine (GPUs per node and their memory, the launcher's ranks) to the plan's Settings, and composes its parts:

- model_shape.py: the model's size from its config.json, never from the weights (exact parameter counts);
- device_plan.py: one GPU's bytes in each phase of a step (what is exact there, and what estimated);
- host_plan.py: one node's host memory, at load and as the run goes on;
- vllm_memory.py: what vLLM holds beside its weights (its sleep's host copies, the weight sync's reload). The plan is
  for a vLLM version (plan_memory's vllm_version; the installed one by default);
- plan_advice.py: the printed plan, its verdict, and the config change that makes it fit.

With rollout.max_videos_per_prompt set > 0 the plan says how many tokens one clip can take at the video budget
(video_clip_tokens); at -1 (the data's most, known only once the data is read, after the plan) it does not. With
tools it says how many turns it is counting, whose images rollout.max_images_per_prompt must cover (the prompt's and
each turn's).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from grpo import host_plan
from grpo.device_plan import GIB, Settings, plan_device
from grpo.model_shape import ModelShape, count_params, read_model_shape

DEFAULT_GPUS, DEFAULT_GPU_GIB = 8, 80.0  # the plan's node when no GPU is here and the config names none


def compute_plan(s: ModelShape, x: Settings) -> dict:
    """Bytes per GPU in each phase of a step, the parts of each phase in order, and the host bytes per rank at load:
    the device plan and the host plan of one shape and one run's settings."""
    return {**plan_device(s, x), **host_plan.plan_host(s, x)}


@dataclass
class Plan:
    """One run's plan: the model and its shape, the Settings taken from the config, where the limits came from;
    `numbers` is its arithmetic (compute_plan)."""

    model: str
    shape: ModelShape
    settings: Settings
    gpu_source: str  # where the GPU's size came from
    keys: dict[str, str]  # the config keys behind train_tokens and nograd_tokens
    host_limit: float | None  # bytes a Slurm job may use per node (--mem), when Slurm says
    teacher: str = ""  # distill.model_path, when a teacher distils into the policy

    @property
    def numbers(self) -> dict:
        return compute_plan(self.shape, self.settings)


def gpus_per_node(configured: int) -> int:
    """trainer.n_gpus_per_node, else the GPUs CUDA sees, else DEFAULT_GPUS (a dry run on a machine without one)."""
    import torch

    if configured > 0:
        return configured
    return torch.cuda.device_count() if torch.cuda.is_available() else DEFAULT_GPUS


def planned_world(trainer, dry_run: bool) -> int:
    """The ranks the config checks and the plan are for: a dry run's trainer.nnodes x GPUs per node when nnodes is
    set, else the launcher's (WORLD_SIZE, SLURM_NTASKS), else one node for a dry run and one rank for a run."""
    if dry_run and trainer.nnodes > 0:
        return trainer.nnodes * gpus_per_node(trainer.n_gpus_per_node)
    launched = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "0")))
    return launched or (gpus_per_node(trainer.n_gpus_per_node) if dry_run else 1)


def gpu_memory(configured_gib: float) -> tuple[float, str]:
    """Bytes of one GPU and where the number came from: trainer.gpu_memory_gib, else CUDA, else DEFAULT_GPU_GIB."""
    import torch

    if configured_gib > 0:
        return configured_gib * GIB, "trainer.gpu_memory_gib"
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory, "CUDA"
    return DEFAULT_GPU_GIB * GIB, "no GPU here: assumed"


def plan_memory(cfg, world: int, host_run: bool = False, vllm_version: str | None = None) -> Plan:
    """The plan for `cfg` (grpo.config.Config) with FSDP2 sharding over `world` ranks. Reads config.json (or the
    known sizes) and what CUDA reports; loads nothing else. `host_run`: a run on a machine without a GPU (the tests,
    the demo), whose ranks hold everything in host memory: the plan is then of each rank's share of this machine's
    memory, and vLLM holds its weights and rollout.cpu_kv_cache_bytes instead of a share of a GPU. `vllm_version`:
    the vLLM release to plan for; by default the installed one, else the GPU set's (startup.SUPPORTED_VERSIONS)."""
    from grpo.startup import SUPPORTED_VERSIONS, library_versions
    from grpo.vllm_engine import sleep_level_for

    a, d, r, t = cfg.actor, cfg.data, cfg.rollout, cfg.trainer
    shape = read_model_shape(a.model_path)
    teacher = read_model_shape(cfg.distill.model_path, "distill.model_path") if cfg.distill.model_path else None
    seq_len = d.max_prompt_length + d.max_response_length
    # micro_batches() in train_grpo.py: a token budget, else a sequence count of at most seq_len tokens each
    train = ("actor.micro_batch_size", a.micro_batch_size * seq_len)
    if a.max_tokens_per_micro_batch:
        train = ("actor.max_tokens_per_micro_batch", a.max_tokens_per_micro_batch)
    nograd = ("actor.micro_batch_size_no_grad", a.micro_batch_size_no_grad * seq_len)
    if a.max_tokens_per_micro_batch_no_grad:
        nograd = ("actor.max_tokens_per_micro_batch_no_grad", a.max_tokens_per_micro_batch_no_grad)
    elif a.max_tokens_per_micro_batch:
        nograd = train
    if vllm_version is None:
        vllm_version = library_versions()["vllm"]
        if vllm_version == "not installed":
            vllm_version = SUPPORTED_VERSIONS["GPU"]["vllm"]
    gpu_bytes, gpu_source = gpu_memory(t.gpu_memory_gib)
    per_node = gpus_per_node(t.n_gpus_per_node)
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or min(world, per_node)  # torchrun sets it
    vllm_bytes = 0.0
    if host_run:
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or world
        per_node, gpu_bytes = ranks_per_node, host_plan.host_bytes_per_rank(ranks_per_node)
        gpu_source = f"CPU run: host memory per rank, this machine's over {ranks_per_node}"
        vllm_bytes = 4 * count_params(shape)["total"] / r.tensor_parallel_size + r.cpu_kv_cache_bytes
    settings = Settings(
        world=world,
        gpus_per_node=per_node,
        ranks_per_node=ranks_per_node,
        gpu_bytes=gpu_bytes,
        train_tokens=train[1],
        nograd_tokens=nograd[1],
        checkpointing=a.gradient_checkpointing,
        freeze_vision=a.freeze_vision_tower,
        reference=cfg.algorithm.kl_coef > 0,
        ref_offload=a.ref_offload,
        engine=r.engine,
        vllm_util=r.gpu_memory_utilization,
        sleep_level=sleep_level_for(r.sleep_level, a.lora_rank),
        tp=r.tensor_parallel_size,
        seq_len=seq_len,
        response_len=d.max_response_length,
        hf_rows=hf_rows(cfg, world),
        max_num_seqs=r.max_num_seqs,
        vllm_version=vllm_version,
        lora_rank=a.lora_rank,
        lora_targets=tuple(a.lora_target_modules),
        master_bytes={"fp32": 4, "bf16": 2}.get(a.master_dtype, 4),
        offload_params=a.offload_params,
        offload_optimizer=a.offload_optimizer,
        vllm_bytes=vllm_bytes,
        tool_turns=r.max_turns - 1 if r.tools else 0,
        max_images=r.max_images_per_prompt,
        teacher=teacher,
        teacher_offload=cfg.distill.offload,
        mm_cache_gb=r.mm_cache_gb,
        sp=a.sequence_parallel_size,
        route_tokens=d.rollout_batch_size // world * r.n * seq_len if cfg.algorithm.routing_replay == "r3" else 0,
        **dict(zip(("video_clip_tokens", "video_pair_tokens"),  # -1 (the data's most) is unknown before the data
                   video_clip_tokens(shape, d.max_frames, d.video_max_pixels) if r.max_videos_per_prompt > 0
                   else (0, 0))),
    )  # fmt: skip
    keys = {"train_tokens": train[0], "nograd_tokens": nograd[0]}
    # a job over its --mem is killed by the cgroup without a traceback (docs/memory.md); Slurm says it in MB
    slurm_mem = os.environ.get("SLURM_MEM_PER_NODE", "")
    host_limit = int(slurm_mem) * 2**20 if slurm_mem.isdigit() else None
    return Plan(a.model_path, shape, settings, gpu_source, keys, host_limit, cfg.distill.model_path)


def video_clip_tokens(s: ModelShape, max_frames: int, max_pixels: int) -> tuple[int, int]:
    """(tokens of the longest clip, tokens per pair of frames) at the video budget: a frame holds at most
    max_pixels / (patch x merge)^2 merged tokens (video.frame_size rounds its sides down to that grid to fit), and the
    tower merges frames in pairs (an odd count gets its last frame repeated)."""
    pair = max_pixels // (s.patch * s.merge) ** 2
    return math.ceil(max_frames / s.temporal_patch) * pair, pair


def hf_rows(cfg, world) -> int:
    """The most sequences one generate call of the HF engine decodes: a rank's share of a rollout batch, or its
    validation batch (data.val_batch_size is per rank) when the run validates, in calls of at most
    rollout.max_num_seqs."""
    d, r, t = cfg.data, cfg.rollout, cfg.trainer
    rows = d.rollout_batch_size // world * r.n
    if d.val_files and (t.val_before_train or t.val_freq > 0):
        rows = max(rows, d.val_batch_size * r.val_n)
    return min(rows, r.max_num_seqs)
