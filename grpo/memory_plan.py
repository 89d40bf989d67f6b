"""The memory plan: what one GPU and one node's host memory will hold, worked out before anything loads.

`python train_grpo.py CONFIG --dry-run` prints it without a GPU and without weights; every start prints it too,
and on CUDA a plan over the limit stops the run with the config key to change. The model's size comes from its
config.json (a local directory), the embedded numbers of the known sizes (a hub id: Qwen2.5-VL 3B to 72B, Qwen3-VL-8B,
Qwen3.5-9B), or the hub's config.json, never from the weights; each supported family (Qwen2.5-VL, Qwen3-VL, Qwen3.5)
has its own exact count.

What is exact and what is estimated:
- Exact: the parameter counts (checked against transformers' models in tests/test_memory_plan.py), and so the
  sharded states: FSDP2 shards every parameter over all ranks, each rank keeps 1/world of the fp32 master weights,
  their fp32 gradients and AdamW's two fp32 moments (trainable parameters only; all three bf16 with
  actor.master_dtype=bf16), and of the reference model in the compute dtype (bf16). What actor.offload_params and
  actor.offload_optimizer move to host memory leaves the phases it is away from (offload.py).
- Estimated: everything that depends on kernels and the allocator. The all-gathered bf16 units (the root's
  embedding and LM head stay gathered through forward and backward, one block plus the prefetched next), the
  gradients in flight (FSDP2 reduce-scatters them in fp32), the activations of one micro-batch (as if every token
  of the budget were an image token: the worst case the config allows), the chunked LM head, vLLM's share while
  awake (exactly what it takes: rollout.gpu_memory_utilization of the device) and a fixed RUNTIME for the CUDA
  context, NCCL buffers and what vLLM keeps while asleep. Fragmentation is what FIT_SHARE leaves free. The weight
  sync's layer reload (reload_peak: vLLM's largest layer, whole as sent and again as materialised) and, at sleep level
  1, vLLM's pinned host copy of its weights: torch's power-of-two rounding of each block exactly, vLLM's allocations
  modelled from the model's tensors (vllm_tensors, pinned_copy). From vLLM 0.32.0 on its sleep also copies its
  "runtime" and "cudagraph" pools to pinned host memory, at every level (vllm sleep pools): the first holds the
  runner's block tables, slot mappings and sampling vectors, sized from rollout.max_num_seqs and the sequence length
  (vllm_runtime_pool; its attention builders' few buffers estimated), the second only CUDA graphs vLLM is asked to
  copy, which the engine does not ask: empty. The plan is for a vLLM version (plan_memory's vllm_version; the
  installed one by default), and counts them for 0.32 and later only.

Videos cost what images cost per token: an LM token of a clip is merge^2 patches (each of temporal_patch frames),
as an image's is, so the activation terms' worst case (every token of the budget a vision token) covers them, and the
KV caches count a prompt's video tokens with the rest of it. vLLM's vision encoder runs inside its share of the GPU
while awake: vLLM profiles its largest image and clip (rollout.max_images_per_prompt / max_videos_per_prompt at the
data's budgets) at start and stops there if they do not fit. With rollout.max_videos_per_prompt set > 0 the plan says
how many tokens one clip can take at the video budget (video_clip_tokens); at -1 (the data's most, known only once
the data is read, after the plan) it does not.

Tool rollouts (rollout.tools, turns.py) add no term of their own: an answer's tool turns, their images' tokens with
them, count inside data.max_response_length (the turn loop stops an answer whose next tool turn would not fit), so
every sequence stays within seq_len and every micro-batch within its token budget, whose worst case is already all
vision tokens; each continuation turn is one more prompt of at most seq_len tokens to vLLM's KV cache or the HF
engine's, as the first turn's was. What tools do change is how many images one vLLM request can carry: the prompt's
and each turn's, which rollout.max_images_per_prompt must cover (the plan says how many turns it is counting).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass

GIB = 2**30
FIT_SHARE = 0.95  # a phase fits when it needs at most this share of the GPU; the rest is for fragmentation
# CUDA context and kernels, NCCL buffers, vLLM's CUDA graphs and buffers while asleep, and the few MiB of its "runtime"
# pool and its scratch that 0.32+ maps again with the weights, before the sync (estimate)
RUNTIME = 2 * GIB
HEAD_CHUNK = 512  # tokens per LM-head chunk (logprobs.chunked_logprobs)
DEFAULT_GPUS, DEFAULT_GPU_GIB = 8, 80.0  # the plan's node when no GPU is here and the config names none
LORA_LEVER_RANK = 8  # the adapter rank a plan that does not fit suggests


class PlanError(ValueError):
    pass


# ----------------------------------------------------------------------------------------------------------------------
# Model sizes: the few numbers of a config.json the count needs, for each supported family (families.FAMILIES).


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool  # tie_word_embeddings: the LM head is the embedding matrix
    vision_depth: int = 32
    vision_hidden: int = 1280
    vision_intermediate: int = 3420
    patch: int = 14
    temporal_patch: int = 2
    in_channels: int = 3
    merge: int = 2  # spatial_merge_size: merge x merge patches become one LM token
    family: str = "qwen2_5_vl"  # config.json's model_type
    head_dim: int = 0  # 0: hidden // heads (Qwen2.5-VL); Qwen3-VL and Qwen3.5 give it
    vision_positions: int = 0  # Qwen3-VL/Qwen3.5 towers: a learned table of this many position embeddings
    deepstack: int = 0  # Qwen3-VL: mergers that feed tower layers' outputs into the first decoder layers
    linear_layers: int = 0  # Qwen3.5: decoder layers with linear attention (gated DeltaNet); the rest full attention
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    conv_kernel: int = 0  # Qwen3.5: the linear layers' causal depthwise convolution
    # The mixture-of-experts families (`*_moe`): every decoder layer's MLP is `experts` routed experts of
    # `expert_intermediate`, all stored (in parameters, gradients, optimizer state, the FSDP2 gathers), of which a
    # token goes through its top `experts_per_token` (in activations and FLOPs), plus Qwen3.5-MoE's shared expert
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0

    @property
    def dim(self) -> int:  # one attention head
        return self.head_dim or self.hidden // self.heads

    @property
    def base_family(self) -> str:  # an MoE family's dense sibling, whose attention and tower it has
        return self.family.removesuffix("_moe")

    @property
    def active_intermediate(self) -> int:
        """The MLP width a token goes through: the dense MLP's, or its top-k experts' and the shared expert's."""
        if not self.experts:
            return self.intermediate
        return self.experts_per_token * self.expert_intermediate + self.shared_expert_intermediate


# The public config.json numbers of the known hub ids, so a dry run of the shipped configs needs no download.
# Qwen2.5-VL 3B and 7B are checked in the tests against their published totals (3.75 B, 8.29 B) and module shapes;
# 32B and 72B are as their config.json files read (a vision MLP of 3456 instead of 3420), not checked here.
# Qwen3-VL-8B (8.77 B) and Qwen3.5-9B (9.41 B without the multi-token-prediction layer that transformers does not
# load; 9.65 B in its files) are checked against transformers' models built on the meta device, and so are the
# mixtures of experts Qwen3-VL-30B-A3B (31.07 B, 3.89 B active) and Qwen3.5-35B-A3B (35.11 B without its
# multi-token-prediction layer, 3.90 B active): their numbers as their model cards' config.json give them (the hub's
# files were not readable where these were written; transformers' Qwen3.5-MoE defaults are the same).
_QWEN3_TOWER = dict(vision_depth=27, vision_hidden=1152, vision_intermediate=4304, patch=16, vision_positions=2304)
KNOWN_SHAPES = {
    "Qwen/Qwen2.5-VL-3B-Instruct": ModelShape(2048, 11008, 36, 16, 2, 151936, tied=True),
    "Qwen/Qwen2.5-VL-7B-Instruct": ModelShape(3584, 18944, 28, 28, 4, 152064, tied=False),
    "Qwen/Qwen2.5-VL-32B-Instruct": ModelShape(5120, 27648, 64, 40, 8, 152064, tied=False, vision_intermediate=3456),
    "Qwen/Qwen2.5-VL-72B-Instruct": ModelShape(8192, 29568, 80, 64, 8, 152064, tied=False, vision_intermediate=3456),
    "Qwen/Qwen3-VL-8B-Instruct": ModelShape(
        4096, 12288, 36, 32, 8, 151936, tied=False, family="qwen3_vl", head_dim=128, deepstack=3, **_QWEN3_TOWER
    ),
    # a distillation teacher for the 8B (configs/qwen3_vl_8b_distill_32b.yaml): its published config.json's numbers
    # (33.4 B parameters), checked against transformers' model built on the meta device
    "Qwen/Qwen3-VL-32B-Instruct": ModelShape(
        5120, 25600, 64, 64, 8, 151936, tied=False, family="qwen3_vl", head_dim=128, deepstack=3, **_QWEN3_TOWER
    ),
    "Qwen/Qwen3.5-9B": ModelShape(
        4096, 12288, 32, 16, 4, 248320, tied=False, family="qwen3_5", head_dim=256, linear_layers=24,
        linear_key_heads=16, linear_value_heads=32, linear_key_dim=128, linear_value_dim=128, conv_kernel=4,
        **_QWEN3_TOWER,
    ),
    "Qwen/Qwen3-VL-30B-A3B-Instruct": ModelShape(
        2048, 6144, 48, 32, 4, 151936, tied=False, family="qwen3_vl_moe", head_dim=128, deepstack=3, experts=128,
        experts_per_token=8, expert_intermediate=768, **_QWEN3_TOWER,
    ),
    "Qwen/Qwen3.5-35B-A3B": ModelShape(
        2048, 0, 40, 16, 2, 248320, tied=False, family="qwen3_5_moe", head_dim=256, linear_layers=30,
        linear_key_heads=16, linear_value_heads=32, linear_key_dim=128, linear_value_dim=128, conv_kernel=4,
        experts=256, experts_per_token=8, expert_intermediate=512, shared_expert_intermediate=512, **_QWEN3_TOWER,
    ),
}  # fmt: skip


def shape_from_config(config: dict) -> ModelShape:
    """A config.json as a dict, of any supported family. Files written before transformers 5 keep the text numbers at
    the top level and may keep tie_word_embeddings in text_config; transformers reads both places, and so does this."""
    family = config.get("model_type", "qwen2_5_vl")
    if family not in PARAM_COUNTS:
        raise KeyError(f"model_type {family!r}")
    text = {**config, **config.get("text_config", {})}
    vision = config["vision_config"]
    base, is_moe = family.removesuffix("_moe"), family.endswith("_moe")
    if is_moe and (text.get("mlp_only_layers") or text.get("decoder_sparse_step", 1) != 1):
        raise KeyError("mlp_only_layers / decoder_sparse_step: dense MLP layers among the experts are not counted")
    layer_types = text.get("layer_types") or []
    if base == "qwen3_5" and not layer_types:  # transformers' default: every full_attention_interval-th is full
        every = text.get("full_attention_interval", 4)
        layer_types = ["full_attention" if (i + 1) % every == 0 else "x" for i in range(text["num_hidden_layers"])]
    return ModelShape(
        hidden=text["hidden_size"],
        intermediate=text.get("intermediate_size", 0) if is_moe else text["intermediate_size"],
        layers=text["num_hidden_layers"],
        heads=text["num_attention_heads"],
        kv_heads=text["num_key_value_heads"],
        vocab=text["vocab_size"],
        # the top level's flag when it has one: transformers 5 writes Qwen3-VL-MoE's text_config with its own default
        # (true) beside the model's false, and ties by the latter
        tied=bool(config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings"))),
        vision_depth=vision["depth"],
        vision_hidden=vision["hidden_size"],
        vision_intermediate=vision["intermediate_size"],
        patch=vision["patch_size"],
        temporal_patch=vision["temporal_patch_size"],
        in_channels=vision.get("in_channels", vision.get("in_chans", 3)),
        merge=vision["spatial_merge_size"],
        family=family,
        head_dim=text.get("head_dim", 0) if family not in ("qwen2_5_vl", "glm4v") else 0,
        vision_positions=_vision_positions(family, vision),
        deepstack=len(vision.get("deepstack_visual_indexes", [])) if base == "qwen3_vl" else 0,
        linear_layers=sum(t != "full_attention" for t in layer_types) if base == "qwen3_5" else 0,
        linear_key_heads=text.get("linear_num_key_heads", 0),
        linear_value_heads=text.get("linear_num_value_heads", 0),
        linear_key_dim=text.get("linear_key_head_dim", 0),
        linear_value_dim=text.get("linear_value_head_dim", 0),
        conv_kernel=text.get("linear_conv_kernel_dim", 0),
        # (config.json names the experts num_experts, or num_local_experts as transformers writes Qwen3-VL-MoE's)
        experts=text.get("num_experts", text.get("num_local_experts", 0)) if is_moe else 0,
        experts_per_token=text.get("num_experts_per_tok", 0) if is_moe else 0,
        expert_intermediate=text.get("moe_intermediate_size", 0) if is_moe else 0,
        shared_expert_intermediate=text.get("shared_expert_intermediate_size", 0) if base == "qwen3_5" else 0,
    )


def _vision_positions(family: str, vision: dict) -> int:
    """The tower's learned position embeddings: Qwen3-VL's and Qwen3.5's num_position_embeddings, GLM-4.1V's one per
    patch of an image_size image, none in Qwen2.5-VL's."""
    if family == "glm4v":
        return (vision.get("image_size", 336) // vision["patch_size"]) ** 2
    return vision.get("num_position_embeddings", 0) if family != "qwen2_5_vl" else 0


def read_model_shape(model_path: str, key: str = "actor.model_path") -> ModelShape:
    """A local directory's config.json, else a known hub id's embedded numbers, else the hub's config.json (from the
    cache, or downloaded: a few kB, never the weights). `key`: the config key that names it, for the errors."""
    if os.path.isdir(model_path):
        path = os.path.join(model_path, "config.json")
    elif model_path in KNOWN_SHAPES:
        return KNOWN_SHAPES[model_path]
    else:
        from huggingface_hub import hf_hub_download

        try:
            path = hf_hub_download(model_path, "config.json")
        except Exception as e:  # offline and not cached, no such repository, no network
            raise PlanError(f"{key}={model_path!r}: cannot read its config.json to plan memory ({e})") from None
    try:
        with open(path) as f:
            return shape_from_config(json.load(f))
    except (OSError, KeyError, json.JSONDecodeError) as e:
        raise PlanError(
            f"{key}={model_path!r}: {path} is not a config.json of a supported family "
            f"({', '.join(PARAM_COUNTS)}): {e!r}"
        ) from None


# Exact parameter counts of transformers' models, per FSDP2 unit: a decoder layer (the largest, where layers differ),
# all decoder layers, the vision tower, and the root (what is in neither: embedding, final norm, LM head).


def _qwen2_5_vl_layers(s: ModelShape) -> list[int]:
    h, i, kv = s.hidden, s.intermediate, s.kv_heads * s.dim
    # q, k, v with biases, o without; gate, up, down without biases; two RMSNorm weights
    return [(h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h] * s.layers


def _mlp(s: ModelShape) -> int:
    """A decoder layer's MLP: gate, up, down without biases; or an MoE's router (experts x hidden), every expert's
    gate, up and down (stored as two 3-D tensors), and Qwen3.5-MoE's shared expert with its one-output gate."""
    h = s.hidden
    if not s.experts:
        return 3 * h * s.intermediate
    shared = 3 * h * s.shared_expert_intermediate + h if s.shared_expert_intermediate else 0
    return s.experts * h + s.experts * 3 * h * s.expert_intermediate + shared


def _qwen3_vl_layers(s: ModelShape) -> list[int]:
    h, q, kv = s.hidden, s.heads * s.dim, s.kv_heads * s.dim
    # q, k, v, o without biases, RMSNorms over each head's q and k; the MLP; two RMSNorm weights
    return [h * q + 2 * h * kv + q * h + 2 * s.dim + _mlp(s) + 2 * h] * s.layers


def _qwen3_5_layers(s: ModelShape) -> list[int]:
    h, q, kv = s.hidden, s.heads * s.dim, s.kv_heads * s.dim
    mlp_norms = _mlp(s) + 2 * h
    # full attention: q_proj also gives the output gate (2q), k, v, o without biases, q/k RMSNorms
    full = h * 2 * q + 2 * h * kv + q * h + 2 * s.dim + mlp_norms
    # gated DeltaNet: in_proj_qkv, in_proj_z (gate), in_proj_b and in_proj_a (per value head), a depthwise conv over
    # q, k and v without bias, dt_bias and A_log per value head, a gated RMSNorm over a value head, out_proj
    keys, values = s.linear_key_heads * s.linear_key_dim, s.linear_value_heads * s.linear_value_dim
    vh, conv = s.linear_value_heads, 2 * keys + values
    linear = h * conv + h * values + 2 * h * vh + conv * s.conv_kernel + 2 * vh + s.linear_value_dim + values * h
    return [linear + mlp_norms] * s.linear_layers + [full] * (s.layers - s.linear_layers)


def _qwen2_5_vl_tower(s: ModelShape) -> int:
    hv, iv, merged = s.vision_hidden, s.vision_intermediate, s.vision_hidden * s.merge**2
    patch_embed = s.in_channels * s.temporal_patch * s.patch**2 * hv  # Conv3d without bias
    # qkv and proj with biases; a gated MLP (gate, up, down) with biases; two RMSNorm weights
    block = (hv * 3 * hv + 3 * hv) + (hv * hv + hv) + 2 * (hv * iv + iv) + (iv * hv + hv) + 2 * hv
    # the merger: RMSNorm over each patch, then Linear(merged, merged), GELU, Linear(merged, LM hidden)
    merger = hv + (merged * merged + merged) + (merged * s.hidden + s.hidden)
    return patch_embed + s.vision_depth * block + merger


def _qwen3_tower(s: ModelShape) -> int:
    """Qwen3-VL's tower, which Qwen3.5 shares without the deepstack mergers."""
    hv, iv, merged = s.vision_hidden, s.vision_intermediate, s.vision_hidden * s.merge**2
    patch_embed = s.in_channels * s.temporal_patch * s.patch**2 * hv + hv  # Conv3d with bias
    # qkv and proj with biases; a plain MLP (fc1, fc2) with biases; two LayerNorms (weight and bias)
    block = (hv * 3 * hv + 3 * hv) + (hv * hv + hv) + (hv * iv + iv) + (iv * hv + hv) + 4 * hv
    mlp = (merged * merged + merged) + (merged * s.hidden + s.hidden)  # a merger's Linear, GELU, Linear
    # the merger's LayerNorm is over each patch; each deepstack merger's over the merged patches
    mergers = (2 * hv + mlp) + s.deepstack * (2 * merged + mlp)
    return patch_embed + s.vision_positions * hv + s.vision_depth * block + mergers


def _glm4v_layers(s: ModelShape) -> list[int]:
    h, i, kv = s.hidden, s.intermediate, s.kv_heads * s.dim
    # q, k, v with biases, o without; the MLP's gate and up as one Linear (gate_up_proj), down; four RMSNorm weights
    # (before and after attention, before and after the MLP)
    return [(h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * i + 4 * h] * s.layers


def _glm4v_tower(s: ModelShape) -> int:
    """GLM-4.1V's tower: its blocks' MLPs are as wide as the language model (out_hidden_size), the merge is a conv
    downsample to the language model's width, and the merger a gated MLP of vision_intermediate after a projection."""
    hv, iv, h = s.vision_hidden, s.vision_intermediate, s.hidden
    patch_embed = s.in_channels * s.temporal_patch * s.patch**2 * hv + hv  # Conv3d with bias
    # qkv and proj without biases (attention_bias false, as the checkpoint's); gate, up, down; two RMSNorm weights
    block = hv * 3 * hv + hv * hv + 3 * hv * h + 2 * hv
    downsample = hv * s.merge**2 * h + h  # Conv2d (merge x merge kernel) with bias, after an RMSNorm
    merger = h * h + 2 * h + 3 * h * iv  # projection, LayerNorm (weight and bias), gate, up, down
    return patch_embed + s.vision_positions * hv + s.vision_depth * block + hv + downsample + hv + merger


PARAM_COUNTS = {  # model_type -> (decoder layers, vision tower)
    "qwen2_5_vl": (_qwen2_5_vl_layers, _qwen2_5_vl_tower),
    "qwen3_vl": (_qwen3_vl_layers, _qwen3_tower),
    "qwen3_5": (_qwen3_5_layers, _qwen3_tower),
    "qwen3_vl_moe": (_qwen3_vl_layers, _qwen3_tower),
    "qwen3_5_moe": (_qwen3_5_layers, _qwen3_tower),
    "glm4v": (_glm4v_layers, _glm4v_tower),
}


def count_params(s: ModelShape) -> dict[str, int]:
    """Exact parameter counts of the family's transformers model (..ForConditionalGeneration), per FSDP2 unit: the
    largest decoder layer, all of them, the vision tower, and the root; and `active`, those a token goes through
    (an MoE's top-k experts of each layer, not all of them: what its FLOPs count)."""
    layers_of, tower_of = PARAM_COUNTS[s.family]
    layers, vision = layers_of(s), tower_of(s)
    root = s.vocab * s.hidden + s.hidden + (0 if s.tied else s.vocab * s.hidden)
    total = root + vision + sum(layers)
    idle = s.layers * (s.experts - s.experts_per_token) * 3 * s.hidden * s.expert_intermediate  # unrouted experts
    return {"layer": max(layers), "layers": sum(layers), "vision": vision, "root": root, "total": total,
            "active": total - idle}  # fmt: skip


def _decoder_linears(s: ModelShape) -> list[dict[str, tuple[int, int]]]:
    """Each decoder layer's nn.Linear modules by name: (in, out) features."""
    h, i, q, kv = s.hidden, s.intermediate, s.heads * s.dim, s.kv_heads * s.dim
    mlp = {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    if s.experts:  # the experts are 3-D parameters, no Linear for an adapter; Qwen3.5-MoE's shared expert is one
        i = s.shared_expert_intermediate
        shared = {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h), "shared_expert_gate": (h, 1)}
        mlp = shared if i else {}
    if s.family == "glm4v":  # GLM-4.1V's gate and up are one Linear
        mlp = {"gate_up_proj": (h, 2 * i), "down_proj": (i, h)}
    gated = 2 if s.base_family == "qwen3_5" else 1  # Qwen3.5's q_proj also gives the attention output's gate
    full = {"q_proj": (h, gated * q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    keys, values = s.linear_key_heads * s.linear_key_dim, s.linear_value_heads * s.linear_value_dim
    linear = {"in_proj_qkv": (h, 2 * keys + values), "in_proj_z": (h, values), "in_proj_b": (h, s.linear_value_heads),
              "in_proj_a": (h, s.linear_value_heads), "out_proj": (values, h)}  # fmt: skip
    return [{**linear, **mlp}] * s.linear_layers + [{**full, **mlp}] * (s.layers - s.linear_layers)


def _tower_linears(s: ModelShape) -> list[tuple[str, tuple[int, int]]]:
    """The vision tower's modules an adapter can go on: (name, (in, out)) for the patch embedding (a Conv3d, whose LoRA
    factors are a Conv3d of its kernel to rank and a 1x1x1 one from rank), every block's linears and the mergers'."""
    hv, iv, merged = s.vision_hidden, s.vision_intermediate, s.vision_hidden * s.merge**2
    if s.family == "qwen2_5_vl":
        mlp, merger = {"gate_proj": (hv, iv), "up_proj": (hv, iv), "down_proj": (iv, hv)}, {"0": (merged, merged)}
        merger["2"] = (merged, s.hidden)  # (its nn.Sequential's first and third modules)
    elif s.family == "glm4v":  # blocks' MLPs as wide as the language model; a projection, then a gated MLP
        h = s.hidden
        mlp = {"gate_proj": (hv, h), "up_proj": (hv, h), "down_proj": (h, hv)}
        merger = {"proj": (h, h), "gate_proj": (h, iv), "up_proj": (h, iv), "down_proj": (iv, h)}
    else:
        mlp, merger = {"linear_fc1": (hv, iv), "linear_fc2": (iv, hv)}, {"linear_fc1": (merged, merged)}
        merger["linear_fc2"] = (merged, s.hidden)
    block = {"qkv": (hv, 3 * hv), "proj": (hv, hv), **mlp}
    patch_embed = ("proj", (s.in_channels * s.temporal_patch * s.patch**2, hv))
    blocks = [kv for _ in range(s.vision_depth) for kv in block.items()]
    return [patch_embed, *blocks, *list(merger.items()) * (1 + s.deepstack)]


def lora_params(s: ModelShape, rank: int, targets) -> dict[str, int]:
    """Exact parameter counts of LoRA adapters of `rank` on the modules actor.lora_target_modules names (lora.py
    reads them the same way: a plain name is a decoder-layer projection, `visual.NAME` one of the vision tower's,
    `lm_head` the output head, `experts` an MoE's routed experts); an adapter on an (in, out) Linear has
    rank x (in + out), one on an experts parameter (E, out, in) that for each of its E experts. Per FSDP2 unit: the
    largest decoder layer's, the vision tower's, the root's (the head), and all."""
    text = {t.split(".")[-1] for t in targets if not t.startswith("visual.") and t != "lm_head"}
    vision = {t.split(".")[-1] for t in targets if t.startswith("visual.")}
    h, i = s.hidden, s.expert_intermediate
    experts = rank * s.experts * ((h + 2 * i) + (i + h)) if "experts" in text else 0  # gate_up_proj, down_proj
    layers = [experts + rank * sum(a + b for name, (a, b) in layer.items() if name in text)
              for layer in _decoder_linears(s)]  # fmt: skip
    tower = rank * sum(a + b for name, (a, b) in _tower_linears(s) if name in vision)
    head = rank * (s.hidden + s.vocab) if "lm_head" in targets else 0
    return {"layer": max(layers), "vision": tower, "root": head, "total": sum(layers) + tower + head}


# ----------------------------------------------------------------------------------------------------------------------
# What vLLM holds beside its weights, asleep at level 1 and while the weight sync reloads them.


def pinned_block(n: int) -> int:
    """Bytes torch's pinned-memory allocator takes for a request of n: the next power of two (CachingHostAllocator
    .allocate, torch 2.11-2.14: c10::llvm::PowerOf2Ceil; 2.14's pinned_max_round_threshold is unlimited by default).
    A freed block stays cached for the next request of its power of two, never given back."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def pinned_copy(n: int) -> float:
    """Bytes of vLLM's level-1 sleep copy for a tensor of n bytes: CuMemAllocator.sleep (vLLM 0.26-0.33) pins one
    host tensor per allocation of its pool, and an allocation is a segment of torch's CUDA caching allocator: a tensor
    over 10 MiB its own, rounded up to 2 MiB; one of 1-10 MiB a share of a 20 MiB segment; a smaller one of a 2 MiB
    segment (c10/cuda/CUDACachingAllocator.cpp: kMinLargeAlloc, kLargeBuffer, kSmallBuffer, kRoundLarge)."""
    mib = 2**20
    if n >= 10 * mib:
        return pinned_block(-(-n // (2 * mib)) * 2 * mib)
    return n * pinned_block(20 * mib) / (20 * mib) if n > mib else n  # (2 MiB is a power of two already)


def vllm_tensors(s: ModelShape) -> list[int]:
    """Elements of the tensors vLLM holds for the model (before its TP split), its fusions applied: q, k, v as one;
    gate and up as one (the vision tower's too); Qwen3.5's in_proj_qkv and in_proj_z, in_proj_b and in_proj_a; a
    layer's experts as w13 and w2. Last, the parameters in none of these (norms, biases, routers, convolutions,
    position tables): small tensors, whose segments cost what they hold."""
    fused = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("in_proj_qkv", "in_proj_z"),
             ("in_proj_b", "in_proj_a")]  # fmt: skip
    out = [s.vocab * s.hidden] * (1 if s.tied else 2)
    for layer in _decoder_linears(s):
        alone = set(layer) - {name for group in fused if set(group) <= set(layer) for name in group}
        out += [sum(layer[g][0] * layer[g][1] for g in group) for group in fused if set(group) <= set(layer)]
        out += [a * b for name, (a, b) in layer.items() if name in alone]
    experts = s.experts * s.hidden * s.expert_intermediate
    out += [2 * experts, experts] * (s.layers if s.experts else 0)
    tower = [a * b for _, (a, b) in _tower_linears(s)]
    names = [name for name, _ in _tower_linears(s)]
    for i, name in enumerate(names):
        if name == "gate_proj":  # (followed by its up_proj)
            tower[i], tower[i + 1] = tower[i] + tower[i + 1], 0
    out += [n for n in tower if n]
    return out + [count_params(s)["total"] - sum(out)]


def vllm_sleep_copy(s: ModelShape, tp: int) -> float:
    """Pinned host bytes of vLLM's level-1 sleep: every tensor's TP slice in bf16, as its segment, rounded up to a
    power of two by torch's pinned allocator. Up to twice the weights (Qwen2.5-VL-7B at TP 2: 14.3 GiB for 7.7)."""
    *big, rest = vllm_tensors(s)
    return sum(pinned_copy(2 * n // tp) for n in big) + 2 * rest / tp


# vLLM's sleep (device_allocator/sleep_mode_backend.py, CuMemBackend.suspend) backs up its "runtime" and "cudagraph"
# pools to pinned host memory at every level from 0.32.0 on, beside the weights at level 1; 0.26.0 to 0.31.0 back up
# only the weights, at level 1 (read in each release's wheel)
SLEEP_POOLS_SINCE = (0, 32)
VLLM_BLOCK = 16  # tokens of vLLM's KV-cache block on CUDA (its default; hybrid models' attention blocks are larger)
VLLM_BATCHED_TOKENS = 16384  # vLLM's LLM-class max_num_batched_tokens on an H100/H200 or larger (8192 on smaller GPUs)


def sleep_backs_up_pools(vllm_version: str) -> bool:
    """Whether this vLLM's sleep copies its "runtime" and "cudagraph" pools to host memory: from 0.32.0 on."""
    major, minor = re.match(r"(\d+)\.(\d+)", vllm_version).groups()
    return (int(major), int(minor)) >= SLEEP_POOLS_SINCE


def pool_segments(sizes: list[int]) -> list[int]:
    """The segments torch's CUDA caching allocator takes from a fresh pool for tensors of these sizes, in bytes: one
    CuMemAllocator allocation each (c10/cuda/CUDACachingAllocator.cpp): tensors of up to 1 MiB share 2 MiB segments,
    of 1-10 MiB 20 MiB ones, a larger one has its own, rounded up to 2 MiB. Packed as if nothing were freed between."""
    mib = 2**20
    small = sum(-(-n // 512) * 512 for n in sizes if n <= mib)  # (blocks of 512 B)
    medium = sum(-(-n // 512) * 512 for n in sizes if mib < n < 10 * mib)
    large = [-(-n // (2 * mib)) * 2 * mib for n in sizes if n >= 10 * mib]
    return [2 * mib] * -(-small // (2 * mib)) + [20 * mib] * -(-medium // (20 * mib)) + large


def vllm_runtime_pool(s: ModelShape, x: Settings) -> list[int]:
    """Bytes of each allocation of vLLM's "runtime" pool on one rank: what its V1 runner (the one the engine picks)
    builds while the worker sets up the KV cache, which gpu_worker.initialize_from_config (0.32-0.33) wraps in that
    pool (the cache itself is tagged "kv_cache", the activations' scratch "workspace": both discarded by a sleep, not
    copied). Per KV-cache group the input batch's block table (int32, max_num_seqs x max_model_len / VLLM_BLOCK) and
    slot mapping (int64, VLLM_BATCHED_TOKENS or max_model_len), and the attention builder's buffers (FlashAttention 3's
    scheduler metadata, Qwen3.5's GDN state indices: a few int32 per sequence, counted as 64 KiB, an estimate); six
    sampling-parameter vectors (4 B per sequence). A hybrid model's layers go in groups of as many as it has full-
    attention layers, each counted as full attention (its linear groups' tables are one block a row): an upper
    bound. A few MiB: everything fits in 2 MiB segments unless max_num_seqs x max_model_len is in the millions."""
    groups = 1 + (-(-s.linear_layers // (s.layers - s.linear_layers)) if s.linear_layers else 0)
    table = 4 * x.max_num_seqs * -(-x.seq_len // VLLM_BLOCK)
    per_group = [table, 8 * max(VLLM_BATCHED_TOKENS, x.seq_len), 64 * 2**10]
    return pool_segments(per_group * groups + [4 * x.max_num_seqs] * 6)


def reload_peak(s: ModelShape, tp: int) -> float:
    """What vLLM's weight sync holds beside its weights. Its layer-wise reload (model_loader/reload/layerwise.py,
    0.26-0.33) keeps every tensor the sync sends a layer (full, bf16) until the layer has them all, then materialises
    the layer's own copy (its TP slice) to load them into, before copying that into the weights in place: the largest
    layer's bf16 weights, once whole and once split. A fused-MoE layer is all its experts, though they come one at a
    time (1.2 GB for Qwen3-VL-30B-A3B, 1.6 GB for Qwen3.5-35B-A3B); a dense model's largest is its embedding."""
    largest = max(s.vocab * s.hidden, 3 * s.experts * s.hidden * s.expert_intermediate, 2 * s.hidden * s.intermediate)
    return 2 * largest * (1 + 1 / tp)


# ----------------------------------------------------------------------------------------------------------------------
# The plan: pure arithmetic on the model's shape and the run's settings, in bytes.


@dataclass(frozen=True)
class Settings:
    """What the plan depends on, taken from the config by plan_memory; _levers tries changes to it."""

    world: int  # ranks FSDP2 shards over
    gpus_per_node: int
    ranks_per_node: int
    gpu_bytes: float
    train_tokens: int  # tokens of one training micro-batch
    nograd_tokens: int  # tokens of one old/ref log-prob micro-batch
    checkpointing: bool
    freeze_vision: bool
    reference: bool  # algorithm.kl_coef > 0
    ref_offload: bool
    engine: str
    vllm_util: float
    sleep_level: int
    tp: int
    seq_len: int  # max_prompt_length + max_response_length
    response_len: int
    hf_rows: int  # sequences one HF generate call decodes at once
    max_num_seqs: int  # rollout.max_num_seqs: sequences one vLLM engine decodes together
    vllm_version: str  # the vLLM release planned for (what its sleep copies to host memory depends on it)
    lora_rank: int = 0  # actor.lora_rank: > 0 trains adapters only, and the reference is the base itself
    lora_targets: tuple[str, ...] = ()  # actor.lora_target_modules
    master_bytes: int = 4  # actor.master_dtype: 4 (fp32) or 2 (bf16) bytes a trainable weight, gradient, moment
    offload_params: bool = False  # actor.offload_params: policy and reference shards in host memory while generating
    offload_optimizer: bool = False  # actor.offload_optimizer: AdamW's moments in host memory while generating
    vllm_bytes: float = 0.0  # a CPU run: vLLM's weights and KV cache in bytes (there is no GPU share to take)
    video_clip_tokens: int = 0  # most vision tokens of one video at data.max_frames and data.video_max_pixels
    video_pair_tokens: int = 0  # ... of one pair of its frames (one temporal token): a second of video at 2 fps
    tool_turns: int = 0  # rollout.max_turns - 1 with rollout.tools: tool turns an answer may hold, inside response_len
    max_images: int = 1  # rollout.max_images_per_prompt: images one vLLM request may carry, the tool turns' included
    teacher: ModelShape | None = None  # distill.model_path's shape: a frozen bf16 shard, as the reference's
    teacher_offload: bool = False  # distill.offload: its shards in host memory, on the GPU for its forwards only
    mm_cache_gb: float = 0.0  # rollout.mm_cache_gb: vLLM's cache of processed images and videos, host memory per rank
    sp: int = 1  # actor.sequence_parallel_size: ranks that share each micro-batch's tokens (and its images' patches)
    route_tokens: int = 0  # algorithm.routing_replay=r3: tokens whose routes a rank holds (its samples x seq_len)
    act_bytes: int = 2  # bytes an activation element: 2 in bf16 (a GPU run); 4 in fp32 (bench/bench_sp.py on CPU)


def layer_elems(h, kv, i, checkpointing, fused_qkv=False, rope=0):
    """Activation elements per token of one transformer block: (kept until its backward, extra while its backward
    runs). A block's forward keeps 8h + 4kv + 4i: each RMSNorm its fp32 input and bf16 output, the projections'
    inputs, q, k, v, rotated q and k, the attention output, and the MLP's gate, up, act(gate) and product; a vision
    block also its fused qkv output (3h), a decoder layer the cos and sin it rebuilds from the mRoPE sections
    (`rope` = 2 x head_dim). Counted with saved_tensors_hooks on transformers 5.19's layers in bf16
    (tests/test_memory_plan.py). Backward adds their gradients in flight (~2h + 2i, an estimate). With
    checkpointing only the block's input stays, and its backward first recomputes the rest."""
    kept, grads = 8 * h + 4 * kv + 4 * i + (3 * h if fused_qkv else 0) + rope, 2 * h + 2 * i
    return (h, kept + grads) if checkpointing else (kept, grads)


def compute_plan(s: ModelShape, x: Settings) -> dict:
    """Bytes per GPU in each phase of a step, the parts of each phase in order, and the host bytes per rank at load."""
    n = count_params(s)
    kv = s.kv_heads * s.dim
    # What trains, per FSDP2 unit: every parameter (but a frozen tower's), or with LoRA the adapters alone (fp32)
    # beside the frozen base, kept in bf16 like a reference; the reference is then that base with the adapters off
    tower = 0 if x.freeze_vision else n["vision"]
    trains = {"layer": n["layer"], "vision": tower, "root": n["root"], "total": n["total"] - n["vision"] + tower}
    if x.lora_rank:
        trains = lora_params(s, x.lora_rank, x.lora_targets)
    adapters, frozen_tower = trains["total"] if x.lora_rank else 0, trains["vision"] == 0
    reference = x.reference and not x.lora_rank  # a second model to hold
    with_vllm = x.engine == "vllm"
    b = x.master_bytes  # 4, or 2 with bf16 masters (optim.AdamWBF16: weights, gradients and moments in bf16)
    # A distillation teacher: a frozen bf16 shard of its own shape (it may be larger than the policy), used in the
    # log-prob phase only; its units are gathered there as the reference's are
    nt = count_params(x.teacher) if x.teacher else None
    states = {
        # master weights (the whole model in their dtype), or with LoRA the bf16 base and fp32 adapters
        "params": (2 * n["total"] + 4 * adapters if x.lora_rank else b * n["total"]) / x.world,
        "grads": b * trains["total"] / x.world,  # freed by zero_grad(set_to_none) after each optimizer step
        "adam": 2 * b * trains["total"] / x.world,  # exp_avg and exp_avg_sq
        "reference": 0 if x.ref_offload or not reference else 2 * n["total"] / x.world,  # bf16 shards
    }
    if nt:
        states["teacher"] = 0 if x.teacher_offload else 2 * nt["total"] / x.world
    # what actor.offload_params / offload_optimizer move to host memory while the engine generates (offload.py's
    # arenas, their exact size; pinned on CUDA); the moments stay there but for each optimizer step
    offloaded = {
        "params": states["params"] if x.offload_params and with_vllm else 0,  # the hf engine generates with them
        "reference": states["reference"] if x.offload_params and with_vllm else 0,
        "adam": states["adam"] if x.offload_optimizer else 0,
    }
    if nt:
        offloaded["teacher"] = states["teacher"] if x.offload_params and with_vllm else 0
    # FSDP2 units all-gathered in bf16: the root's stay gathered from the root's forward to the end of its backward,
    # beside one block and the one prefetched next to it (the vision tower is followed by decoder layer 0)
    pair = n["layer"] + max(n["vision"], n["layer"])
    gathered = 2 * (n["root"] + pair)
    # LoRA on the experts: PEFT's forward adds B A to a layer's whole experts parameters, a bf16 copy of them that the
    # backward keeps (the experts' matmuls saved it) unless the layer is recomputed: one layer's, or every layer's
    adapted = 2 * 3 * s.experts * s.hidden * s.expert_intermediate if x.lora_rank and "experts" in x.lora_targets else 0

    e = x.act_bytes  # 2: bf16

    def head(tokens, grad):  # one chunk's logits: bf16, fp32 upcast, /temperature, softmax (+ their grads backward)
        per_logit = 20 if grad else 14
        return HEAD_CHUNK * s.vocab * per_logit + (2 if grad else 1) * e * tokens * s.hidden  # + final hidden states

    # Activations of one training micro-batch (bf16, 2 B an element). Its images can have at most merge^2 patches per
    # LM token, all in the vision tower at once; the tower's blocks are checkpointed like the decoder layers.
    # Sequence parallelism: a rank holds 1/sp of the tokens and encodes 1/sp of the patches, a long clip's too (the
    # tower split by temporal patch, sequence_parallel.py: to within one temporal patch; an image is never cut),
    # beside the whole row's merged embeddings and the group's gathered vision embeddings, before the cut (bf16)
    whole = 2 * e * x.train_tokens * s.hidden if x.sp > 1 else 0
    t, patches = math.ceil(x.train_tokens / x.sp), math.ceil(x.train_tokens / x.sp) * s.merge**2
    # (an MoE token's activations are those of its top-k experts: the MLP width it goes through)
    lm_kept, lm_extra = layer_elems(s.hidden, kv, s.active_intermediate, x.checkpointing, rope=2 * s.dim)
    vis_kept, vis_extra = layer_elems(s.vision_hidden, s.vision_hidden, s.vision_intermediate, x.checkpointing, True)
    vis_saved = 0 if frozen_tower else e * patches * vis_kept * s.vision_depth  # a frozen tower builds no graph
    lm_saved = e * t * lm_kept * s.layers
    # Gradients in flight: the root's (bf16) live through the whole backward, beside the bf16 gradients of the unit
    # whose backward runs and the fp32 copy FSDP2 reduce-scatters them in (MixedPrecisionPolicy reduce_dtype).
    # The peak is at the top of the LM's backward (every layer's saved activations, and the head or one layer's
    # backward) or later at the vision tower's (the LM's activations are freed by then): (grads, activations).
    # (With LoRA only the adapters have gradients: a frozen base still passes them down, so activations are the same.)
    top = (2 * trains["root"] + 6 * trains["layer"],
           whole + lm_saved + vis_saved + max(head(t, True), e * t * lm_extra))  # fmt: skip
    bottom = (2 * trains["root"] + 6 * trains["vision"], whole + vis_saved + e * patches * vis_extra)
    unit_grads, activations = top if frozen_tower or sum(top) >= sum(bottom) else bottom

    # The no-grad log-prob forwards: residual stream in and out plus the MLP's gate, up and product of one layer at a
    # time (or one vision block's), and a chunk of the head. Policy and reference run in turn and FSDP2 leaves both
    # roots gathered after a forward without backward, until the phase reshards them.
    # (sequence parallelism: a rank's 1/sp of the tokens, beside the whole row's merged embeddings; a teacher's too,
    # cut like the policy)
    def nograd_activations(m: ModelShape, tn: int) -> float:
        layer = e * tn * (4 * m.hidden + 3 * m.active_intermediate)
        tower = e * tn * m.merge**2 * (2 * m.vision_hidden + 3 * m.vision_intermediate)
        return max(layer, tower) + HEAD_CHUNK * m.vocab * 14 + e * tn * m.hidden  # + a chunk of its head, no grad

    whole_nograd = 2 * e * x.nograd_tokens * s.hidden if x.sp > 1 else 0
    nograd = whole_nograd + nograd_activations(s, math.ceil(x.nograd_tokens / x.sp))
    # the teacher runs last: every root stays gathered, beside its own block pair (its own width, its own head)
    teacher_gathered = 0
    if nt:
        whole_teacher = 2 * e * x.nograd_tokens * x.teacher.hidden if x.sp > 1 else 0
        nograd = max(nograd, whole_teacher + nograd_activations(x.teacher, math.ceil(x.nograd_tokens / x.sp)))
        teacher_gathered = 2 * nt["root"] + max(0, 2 * (nt["layer"] + max(nt["vision"], nt["layer"])) - 2 * pair)
    resident = {**states, "adam": 0} if x.offload_optimizer else states  # on the device outside optimizer steps
    awake = (x.vllm_bytes or x.vllm_util * x.gpu_bytes) if with_vllm else 0.0  # vLLM takes its share of the device
    never_sleeps = {"vllm awake": awake} if with_vllm and x.sleep_level == 0 else {}
    phases = {
        "update": {
            **resident,
            "gathered": gathered + adapted * (1 if x.checkpointing else s.layers),
            "grads in flight": unit_grads,
            "activations": activations,
            **never_sleeps,
            "runtime": RUNTIME,
        },
        "log-probs": {
            **resident,
            "grads": 0,
            "gathered": gathered + adapted + (2 * n["root"] if reference else 0) + teacher_gathered,
            "activations": nograd,
            **never_sleeps,
            "runtime": RUNTIME,
        },
    }
    if x.offload_optimizer:  # the moments come in for the step, the gradients are still there
        phases["optimizer step"] = {**states, "runtime": RUNTIME}
    generating = {k: v - offloaded.get(k, 0) for k, v in states.items()}
    if with_vllm:
        if any(offloaded.values()) or not x.vllm_bytes:
            # the sync reads the policy's shards before they leave: vLLM's weights (its KV cache still asleep, unless
            # it never sleeps) beside the whole state and what the reload of one layer holds (the full tensors sent,
            # its materialised copy). (A CPU run's engine holds its weights and KV cache in one figure: only with
            # offloading, as before.)
            vllm = {"vllm awake": awake} if x.sleep_level == 0 else {"vllm weights": 2 * n["total"] / x.tp}
            phases["weight sync"] = {
                **resident,
                "grads": 0,
                **vllm,
                "layer reload": reload_peak(s, x.tp),
                "runtime": RUNTIME,
            }
        phases["rollout"] = {**generating, "grads": 0, "vllm awake": awake, "runtime": RUNTIME}
    else:  # HF generate with the training model: its KV cache, and the logits of the one decoding step at hand
        phases["rollout"] = {
            **generating,
            "grads": 0,
            "gathered": gathered,
            "kv cache": x.hf_rows * x.seq_len * (s.layers - s.linear_layers) * 2 * kv * 2,
            # generate keeps no per-step logits unless asked (output_logits / output_scores; the HF engine asks for
            # neither): one step's bf16 logits, their fp32 copy and the sampling probabilities, 10 bytes a logit
            "logits": x.hf_rows * s.vocab * 10,
            "runtime": RUNTIME,
        }
    # What vLLM 0.32+ copies to pinned host memory at every sleep besides the weights, as CuMemAllocator allocations
    # (sleep needs CUDA). The "cudagraph" pool holds the CUDA graphs only with sleep_mode_offload_cudagraph, which the
    # engine leaves off (vLLM's default): they stay on the GPU in vLLM's own graph pool (RUNTIME), and it is empty.
    sleeps = with_vllm and not x.vllm_bytes and x.sleep_level > 0
    copied = sleeps and sleep_backs_up_pools(x.vllm_version)
    pools = {"runtime": vllm_runtime_pool(s, x) if copied else [], "cudagraph": []}
    # host memory per rank while loading: this rank's policy shard (fp32; with LoRA a bf16 base) and bf16 reference
    # shard, read through a buffer of up to the largest tensor (the embedding, bf16), beside vLLM's level-1 sleep copy
    # (pinned, bf16, its TP slice, each block a power of two), which the engine made before the trainer's model
    # loads and which torch's pinned allocator keeps cached from then on (a level-2 sleep keeps only the buffers),
    # and the pools vLLM 0.32+ copies at every level, the same way
    host = {
        "policy": (2 * n["total"] + 4 * adapters if x.lora_rank else x.master_bytes * n["total"]) / x.world,
        "reference": 2 * n["total"] / x.world if reference else 0,
        "read buffer": 2 * max(s.vocab * s.hidden, x.teacher.vocab * x.teacher.hidden if nt else 0),
        "vllm sleep copy": vllm_sleep_copy(s, x.tp) if with_vllm and x.sleep_level == 1 else 0,
        "vllm sleep pools": sum(pinned_block(n) for n in pools["runtime"] + pools["cudagraph"]),
    }
    if nt:  # the teacher's bf16 shard, read as the reference's is (in host memory for good with distill.offload)
        host["teacher"] = 2 * nt["total"] / x.world
    # its weights and one sequence's KV cache (Qwen3.5's linear layers keep a fixed-size state instead: left out)
    vllm_min = 2 * n["total"] / x.tp + x.seq_len * (s.layers - s.linear_layers) * 2 * kv * 2 / x.tp
    return {
        "params": n,
        "teacher_params": nt,
        "phases": phases,
        "host": host,
        "vllm_min": vllm_min if with_vllm else 0.0,
        "offloaded": offloaded,  # host bytes per rank while generating (pinned on CUDA)
        "vllm pools": pools,  # the allocations of the pools vLLM's sleep copies besides the weights, bytes each
        "states": states,
        # routing replay: each sample's experts per token and MoE layer, held from the rollout to the step's end
        "routes": x.route_tokens * s.layers * s.experts_per_token * (1 if s.experts <= 128 else 2),  # int8 or int16
    }


def _phase_over(shape: ModelShape, x: Settings) -> tuple[str, float] | None:
    """The phase that needs the most and its bytes, when it is over the limit; None when every phase fits."""
    phases = compute_plan(shape, x)["phases"]
    totals = {name: sum(parts.values()) for name, parts in phases.items()}
    worst = max(totals, key=totals.get)
    return (worst, totals[worst]) if totals[worst] > FIT_SHARE * x.gpu_bytes else None


def _largest(lo: int, hi: int, ok) -> int | None:
    """The largest v in [lo, hi] with ok(v), for ok true up to some point and false above it; None if not ok(lo)."""
    if not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _levers(shape: ModelShape, x: Settings, keys: dict[str, str]) -> list[tuple[str, str]]:
    """Single config changes that make every phase fit, as (the part of the plan it shrinks, advice naming the key).
    `keys` names the config keys the token counts came from (a token budget, or a sequence count)."""
    fits = lambda **change: _phase_over(shape, dataclasses.replace(x, **change)) is None  # noqa: E731
    out = []
    for field, part in (("train_tokens", "activations"), ("nograd_tokens", "activations")):
        key, now = keys[field], getattr(x, field)
        if key.endswith("size"):  # a sequence count: micro-batches of that many full-length sequences
            best = _largest(1, now // x.seq_len, lambda v, f=field: fits(**{f: v * x.seq_len}))
            if best is not None and best < now // x.seq_len:
                out.append((part, f"lower {key} from {now // x.seq_len} to {best}"))
        else:
            best = _largest(x.seq_len, now, lambda v, f=field: fits(**{f: v}))
            if best is not None and best < now:
                best = max(x.seq_len, best // 1024 * 1024) if best >= 1024 else best
                out.append((part, f"lower {key} from {now} to {best}"))
    if x.engine == "vllm":
        least = math.ceil(compute_plan(shape, x)["vllm_min"] / x.gpu_bytes * 100)  # its weights must still fit
        best = _largest(least, round(x.vllm_util * 100), lambda v: fits(vllm_util=v / 100))
        if best is not None and best < round(x.vllm_util * 100):
            out.append(("vllm awake", f"lower rollout.gpu_memory_utilization from {x.vllm_util} to {best / 100}"))
    if not (x.offload_params and x.offload_optimizer) and x.engine == "vllm":
        if not x.offload_optimizer and fits(offload_optimizer=True):
            out.append(("adam", "set actor.offload_optimizer=true (AdamW's moments in host memory while generating)"))
        elif fits(offload_params=True, offload_optimizer=True):
            out.append(("adam", "set actor.offload_params=true and actor.offload_optimizer=true (weights and AdamW "
                                "moments in host memory while vLLM generates)"))  # fmt: skip
    if x.master_bytes == 4 and not x.lora_rank and fits(master_bytes=2):
        out.append(("adam", "set actor.master_dtype=bf16 (weights, gradients and AdamW moments in bf16: half of each)"))
    if x.reference and not x.ref_offload and fits(ref_offload=True):
        out.append(("reference", "set actor.ref_offload=true (the reference's shards in host memory)"))
    if x.teacher and not x.teacher_offload and fits(teacher_offload=True):
        out.append(("teacher", "set distill.offload=true (the teacher's shards in host memory)"))
    if not x.freeze_vision and not x.lora_rank and fits(freeze_vision=True):
        out.append(("adam", "set actor.freeze_vision_tower=true"))
    if not x.lora_rank and x.lora_targets and fits(lora_rank=LORA_LEVER_RANK):
        out.append(("adam", f"train LoRA adapters: actor.lora_rank={LORA_LEVER_RANK} (no reference model, AdamW "
                            "moments for the adapters only)"))  # fmt: skip
    if not x.checkpointing and fits(checkpointing=True):
        out.append(("activations", "set actor.gradient_checkpointing=true"))
    # a sequence too long for one GPU's activations: share it over a group of ranks (Ulysses needs the group to
    # divide the attention heads, and the ranks)
    groups = [k for k in (2, 4, 8, 16, 32) if k > x.sp and x.world % k == 0 and shape.heads % k == 0]
    if best := next((k for k in groups if fits(sp=k)), None):
        out.append(("activations", f"set actor.sequence_parallel_size={best} (each sequence shared by {best} ranks)"))
    if x.engine == "vllm" and x.sleep_level == 0 and fits(sleep_level=1):
        out.append(("vllm awake", "set rollout.sleep_level=-1 (vLLM gives its memory back while the trainer works)"))
    if x.engine == "hf" and fits(engine="vllm"):
        out.append(("kv cache", "set rollout.engine=vllm"))
    world = _largest(x.world, 1 << 16, lambda v: not fits(world=v))  # the largest world that still does not fit
    if world is not None and world < 1 << 16:
        out.append(("adam", f"shard over at least {world + 1} GPUs (more nodes; now {x.world})"))
    return out


# ----------------------------------------------------------------------------------------------------------------------
# From the config to a printed plan, and the verdict.


@dataclass
class Plan:
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


def host_bytes_per_rank(ranks: int) -> float:
    """This machine's physical memory over the ranks that share it."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, ranks)


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
        per_node, gpu_bytes = ranks_per_node, host_bytes_per_rank(ranks_per_node)
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


def _gib(b: float) -> str:
    return f"{b / GIB:.1f}"


def format_plan(plan: Plan) -> str:
    """A few lines: the sharded states, each phase's further parts and total, the verdict, host memory at load."""
    x, numbers = plan.settings, plan.numbers
    phases, host, n = numbers["phases"], numbers["host"], numbers["params"]
    states = ("params", "grads", "adam", "reference", "teacher")
    size = f"{n['total'] / 1e9:.2f} B" if n["total"] >= 1e8 else f"{n['total'] / 1e6:.2f} M"
    if plan.shape.experts:  # a mixture of experts: all stored, the top-k computed
        size += f", {n['active'] / 1e9:.2f} B active" if n["active"] >= 1e8 else f", {n['active'] / 1e6:.2f} M active"
    if x.lora_rank:
        adapters = lora_params(plan.shape, x.lora_rank, x.lora_targets)["total"]
        size += f", LoRA rank {x.lora_rank}: " + (f"{adapters / 1e6:.1f} M" if adapters >= 1e6 else f"{adapters:,}")
        size += " trainable"
    device = "rank (host memory)" if x.vllm_bytes else "GPU"
    lines = [
        f"memory plan, GiB per {device}: {plan.model} ({size} parameters), world {x.world}, "
        f"{x.gpus_per_node} x {_gib(x.gpu_bytes)} GiB per node ({plan.gpu_source})",
        "  sharded    "
        + " | ".join(f"{k} {_gib(numbers['states'][k])}" for k in states if k != "teacher" or x.teacher)
        + "  (exact; the rest estimated)",
    ]
    tokens = {"update": x.train_tokens, "log-probs": x.nograd_tokens}
    for name, parts in phases.items():
        extra = [f"{k} {_gib(v)}" + (f" ({tokens[name]} tokens)" if k == "activations" else "")
                 for k, v in parts.items() if k not in states]  # fmt: skip
        # sharded states that are in host memory during this phase (offload), not on the GPU
        away = [k for k in ("params", "adam", "reference", "teacher") if numbers["states"].get(k) and not parts.get(k)]
        without = f"(without {', '.join(away)}) " if away else ""
        lines.append(f"  {name:<10} {without}+ " + " | ".join(extra) + f" = {_gib(sum(parts.values()))}")
    if x.teacher:  # what distillation costs, beside the reference's when the KL to it is on too
        nt = numbers["teacher_params"]
        kind = "its shards in host memory, distill.offload" if x.teacher_offload else "its shard on the GPU"
        ref = (f"; the reference {_gib(numbers['states']['reference'])} GiB beside it"
               if x.reference and not x.lora_rank else "")  # fmt: skip
        size_t = f"{nt['total'] / 1e9:.2f} B" if nt["total"] >= 1e8 else f"{nt['total'] / 1e6:.2f} M"
        lines.insert(2, f"  teacher    {plan.teacher} ({size_t} parameters, {x.teacher.family}, bf16): "
                        f"{_gib(2 * nt['total'] / x.world)} GiB a shard ({kind}){ref}; in the log-prob phase its "
                        "root and blocks gathered and its activations, counted above")  # fmt: skip
    totals = {name: sum(parts.values()) for name, parts in phases.items()}
    worst = max(totals, key=totals.get)
    verdict = "fits" if _phase_over(plan.shape, x) is None else "DOES NOT FIT"
    lines.append(
        f"  peak       {_gib(totals[worst])} ({worst}) of {_gib(FIT_SHARE * x.gpu_bytes)} usable "
        f"({FIT_SHARE} x {_gib(x.gpu_bytes)}) -> {verdict}"
    )
    if x.engine == "vllm" and not x.vllm_bytes:
        # how far vLLM's share may rise with everything else as it is (offloading is what frees the most)
        fits = lambda v: _phase_over(plan.shape, dataclasses.replace(x, vllm_util=v / 100)) is None  # noqa: E731
        best = _largest(math.ceil(numbers["vllm_min"] / x.gpu_bytes * 100), 99, fits)
        if best is not None:
            lines.append(f"  vllm share up to {best / 100} of the GPU fits (rollout.gpu_memory_utilization, now "
                         f"{x.vllm_util})")  # fmt: skip
    if x.video_clip_tokens:
        lines.append(f"  videos     up to {x.video_clip_tokens} tokens a clip (data.max_frames, video_max_pixels), "
                     f"{x.video_pair_tokens} per pair of frames: counted above as vision tokens")  # fmt: skip
    if x.tool_turns:
        images = x.max_images if x.max_images >= 0 else "the data's most + 1 a tool turn:"
        lines.append(f"  tools      up to {x.tool_turns} tool turns an answer, within its {x.response_len} tokens "
                     f"(data.max_response_length); {images} images a request "
                     "(rollout.max_images_per_prompt)")  # fmt: skip
    offloaded = {k: v for k, v in numbers["offloaded"].items() if v}
    if offloaded:
        moved = " + ".join(f"{k} {_gib(v)}" for k, v in offloaded.items())
        lines.append(f"offloaded to host memory while generating, GiB: {x.ranks_per_node} x ({moved}) = "
                     f"{_gib(x.ranks_per_node * sum(offloaded.values()))} per node, pinned")  # fmt: skip
    # (vLLM's pools are a few MiB: shown to the MiB rather than as 0.0)
    per_rank = " + ".join(f"{k} {_gib(v) if v >= 0.05 * GIB else f'{v / GIB:.3f}'}" for k, v in host.items() if v)
    limit = f" of the {_gib(plan.host_limit)} Slurm allows" if plan.host_limit else ""
    ranks = f"{x.ranks_per_node} rank{'s' if x.ranks_per_node > 1 else ''}"
    lines.append(
        f"host memory per node at load, GiB: {ranks} x ({per_rank}) = "
        f"{_gib(x.ranks_per_node * sum(host.values()))}{limit}, plus each process's own"
    )
    if host["vllm sleep pools"]:
        lines.append(f"  vllm sleep pools: vLLM {x.vllm_version} copies its \"runtime\" pool (block tables, sampling "
                     f"parameters: {host['vllm sleep pools'] / 2**20:.0f} MiB a rank, pinned) to host memory at every "
                     "sleep, level 2 too (0.26-0.31: none)")  # fmt: skip
    if numbers["routes"]:
        lines.append(f"  + from each rollout to its step's end: the routes replayed (algorithm.routing_replay=r3), "
                     f"{_gib(numbers['routes'])} GiB per rank at most ({x.route_tokens} tokens)")  # fmt: skip
    if x.engine == "vllm" and x.mm_cache_gb:  # the one cache that fills as a run goes on (docs/memory.md)
        lines.append(f"  + during the run: vLLM's processed images and videos, up to {x.mm_cache_gb:g} GiB per rank "
                     "(rollout.mm_cache_gb)")  # fmt: skip
    return "\n".join(lines)


def host_per_node(numbers: dict, x: Settings) -> float:
    """The host bytes per node the plan compares with Slurm's --mem: at load, or from the first offload on (the
    arenas, beside vLLM's sleep copies, which torch's pinned allocator keeps cached, and routing replay's routes),
    whichever is more."""
    host = numbers["host"]
    running = sum(numbers["offloaded"].values()) + host["vllm sleep copy"] + host["vllm sleep pools"]
    running += numbers["routes"]  # routing replay's routes, from each rollout to its step's end
    return x.ranks_per_node * max(sum(host.values()), running)


def plan_problem(plan: Plan) -> str | None:
    """Why the plan cannot run, naming the config key to change (the change that shrinks the biggest part first);
    None when it fits."""
    x, numbers = plan.settings, plan.numbers
    if x.engine == "vllm" and x.vllm_util * x.gpu_bytes < numbers["vllm_min"]:
        need = math.ceil(numbers["vllm_min"] / x.gpu_bytes * 100) / 100
        return (
            f"rollout.gpu_memory_utilization={x.vllm_util} gives vLLM {_gib(x.vllm_util * x.gpu_bytes)} GiB, less "
            f"than its weights and one sequence's KV cache ({_gib(numbers['vllm_min'])} GiB): raise it to >= {need}"
        )
    host = host_per_node(numbers, x)
    if plan.host_limit and host > plan.host_limit:
        return (
            f"host memory, {_gib(host)} GiB per node (at load, or with the state offloaded), is over the "
            f"{_gib(plan.host_limit)} GiB this Slurm job may use (--mem): ask for more"
            + (
                f", or set rollout.sleep_level=2 (no host copy of vLLM's weights, "
                f"{_gib(x.ranks_per_node * numbers['host']['vllm sleep copy'])} GiB)"
                if numbers["host"]["vllm sleep copy"]
                else ""
            )
        )
    over = _phase_over(plan.shape, x)
    if over is None:
        return None
    phase, total = over
    parts = numbers["phases"][phase]
    head = (
        f"memory plan does not fit: the {phase} phase needs {_gib(total)} GiB per GPU, over the "
        f"{_gib(FIT_SHARE * x.gpu_bytes)} GiB usable ({FIT_SHARE} x {_gib(x.gpu_bytes)} GiB, {plan.gpu_source}); "
        + ", ".join(f"{k} {_gib(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v)
    )
    levers = sorted(_levers(plan.shape, x, plan.keys), key=lambda lever: -parts.get(lever[0], 0))
    if levers:
        return head + ": " + "; or ".join(advice for _, advice in levers)
    # no single change is enough: name what shrinks each part, biggest first
    shrinks = {
        "activations": plan.keys["train_tokens" if phase == "update" else "nograd_tokens"],
        "vllm awake": "rollout.gpu_memory_utilization",
        "reference": "actor.ref_offload=true",
        "teacher": "distill.offload=true",
        "adam": "more GPUs, actor.offload_optimizer=true, actor.master_dtype=bf16, actor.freeze_vision_tower=true or "
        "actor.lora_rank",
        "params": "actor.offload_params=true or actor.master_dtype=bf16",
        "kv cache": "rollout.engine=vllm or a lower rollout.max_num_seqs",
        "logits": "rollout.engine=vllm or a lower rollout.max_num_seqs",
    }
    named = [f"{shrinks[k]} ({k})" for k, _ in sorted(parts.items(), key=lambda kv: -kv[1]) if k in shrinks]
    return head + ": no single change fits it; combine: " + ", ".join(named)
