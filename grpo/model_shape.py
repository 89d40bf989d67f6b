"""A model's size without its weights: the few numbers of its config.json (ModelShape) and the exact parameter counts
of each supported family's transformers model, per FSDP2 unit, with those of LoRA's adapters.

The numbers come from a local directory's config.json, the embedded numbers of the known sizes (a hub id: Qwen2.5-VL
3B to 72B, Qwen3-VL-8B and 32B, Qwen3.5-9B, the two mixtures of experts, GLM-4.1V-9B, Gemma 4 E2B, E4B and 31B), or
the hub's config.json, never from the weights; each supported family (families.FAMILIES; Gemma 4's dense models, not
its mixture of experts) has its own exact count, checked against transformers' models in tests/test_memory_plan.py.
They are the memory plan's exact part (memory_plan.py): the sharded states follow from them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass


class PlanError(ValueError):
    """A model whose size cannot be read: no config.json, or not one of a supported family."""


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
    # Gemma 4 (dense): its full-attention layers (by index; the rest slide over a window) have heads of their own
    # width and, with k_eq_v (31B), their own KV heads and no v_proj (the keys are the values); the last
    # kv_shared_layers reuse earlier layers' keys and values (no k_proj, v_proj or their norms), with an MLP twice as
    # wide where double_wide (E2B); per_layer_hidden > 0 (E2B, E4B): each layer takes a per-layer input from an
    # embedding table of per_layer_vocab x (layers x per_layer_hidden) and a projection of the embeddings
    full_layers: tuple[int, ...] = ()
    global_head_dim: int = 0
    global_kv_heads: int = 0
    k_eq_v: bool = False
    kv_shared_layers: int = 0
    double_wide: bool = False
    per_layer_hidden: int = 0
    per_layer_vocab: int = 0
    vision_head_dim: int = 0  # Gemma 4's tower: q/k norms over each head
    # Gemma 4's audio tower (E2B, E4B), a conformer the trainer sends nothing to but which loads (and shards, in the
    # root unit) with the checkpoint: its width, blocks, heads, output width, depthwise kernel, subsampling channels
    audio_hidden: int = 0
    audio_layers: int = 0
    audio_heads: int = 0
    audio_out: int = 0
    audio_conv: int = 0
    audio_channels: tuple[int, int] = (0, 0)

    @property
    def dim(self) -> int:  # one attention head (Gemma 4's sliding layers')
        return self.head_dim or self.hidden // self.heads

    @property
    def widest_head(self) -> int:  # Gemma 4's full layers' heads are wider than its sliding ones'
        return max(self.dim, self.global_head_dim)

    @property
    def kv_width(self) -> int:
        """K (or V) elements per token of the widest layer: Gemma 4's full layers' may be wider."""
        return max(self.kv_heads * self.dim, self.global_kv_heads * self.global_head_dim)

    @property
    def kv_cache_elems(self) -> int:
        """K and V elements one token keeps over all layers that have a cache of their own. Gemma 4's sliding layers
        are counted as if they kept every token (vLLM and transformers keep only their window's: an upper bound); its
        kv-shared layers read earlier layers' caches and count nothing."""
        if self.family != "gemma4":
            return (self.layers - self.linear_layers) * 2 * self.kv_heads * self.dim
        return sum(2 * kv * d for full, shared, d, kv, _ in gemma_layers(self) if not shared)

    @property
    def mlp_width(self) -> int:
        """The widest MLP a token goes through in one layer: Gemma 4's double-wide layers' (and its mixture's top-k
        experts beside its dense MLP), else the active one."""
        if self.family != "gemma4":
            return self.active_intermediate
        return max(i for *_, i in gemma_layers(self)) + self.experts_per_token * self.expert_intermediate

    @property
    def largest_table(self) -> int:
        """Elements of the largest tensor: the embedding, or Gemma 4's per-layer embedding table (2.8 B in E4B)."""
        return max(self.vocab * self.hidden, self.per_layer_vocab * self.layers * self.per_layer_hidden)

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
# Gemma 4 E2B's and E4B's tower (16 blocks of 768, 3 x 3 patches of 16 px pooled into a soft token, a 2 x 10240
# table of learned positions) and audio tower (12 conformer blocks of 1024)
_GEMMA_SMALL = dict(per_layer_hidden=256, per_layer_vocab=262144, vision_depth=16, vision_hidden=768,
                    vision_intermediate=3072, vision_head_dim=64, patch=16, temporal_patch=1, merge=3,
                    vision_positions=10240, audio_hidden=1024, audio_layers=12, audio_heads=8, audio_out=1536,
                    audio_conv=5, audio_channels=(128, 32))  # fmt: skip
# Gemma 4 31B's and 26B-A4B's tower (27 blocks of 1152), no audio tower
_GEMMA_LARGE_TOWER = dict(vision_depth=27, vision_hidden=1152, vision_intermediate=4304, vision_head_dim=72, patch=16,
                          temporal_patch=1, merge=3, vision_positions=10240)  # fmt: skip
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
    # GLM-4.1V-9B-Thinking and its base model share one config.json shape (10.29 B), which is also transformers'
    # Glm4vConfig default: checked against transformers' model built on the meta device
    **dict.fromkeys(("zai-org/GLM-4.1V-9B-Thinking", "zai-org/GLM-4.1V-9B-Base"), ModelShape(
        4096, 13696, 40, 32, 2, 151552, tied=False, family="glm4v", vision_depth=24, vision_hidden=1536,
        vision_intermediate=13696, vision_positions=(336 // 14) ** 2,
    )),
    # Gemma 4's dense models as their config.json files read (E2B 5.10 B and E4B 7.94 B with their audio towers, 31B
    # 31.27 B), checked against transformers' model built on the meta device from those numbers
    "google/gemma-4-E2B-it": ModelShape(
        1536, 6144, 35, 8, 1, 262144, tied=True, family="gemma4", head_dim=256, full_layers=tuple(range(4, 35, 5)),
        global_head_dim=512, global_kv_heads=1, kv_shared_layers=20, double_wide=True, **_GEMMA_SMALL,
    ),
    "google/gemma-4-E4B-it": ModelShape(
        2560, 10240, 42, 8, 2, 262144, tied=True, family="gemma4", head_dim=256, full_layers=tuple(range(5, 42, 6)),
        global_head_dim=512, global_kv_heads=2, kv_shared_layers=18, **_GEMMA_SMALL,
    ),
    "google/gemma-4-31B-it": ModelShape(
        5376, 21504, 60, 32, 16, 262144, tied=True, family="gemma4", head_dim=256, full_layers=tuple(range(5, 60, 6)),
        global_head_dim=512, global_kv_heads=4, k_eq_v=True, **_GEMMA_LARGE_TOWER,
    ),
    # the mixture of experts: 128 experts of 704 a layer, top 8, beside a dense MLP of 2112
    "google/gemma-4-26B-A4B-it": ModelShape(
        2816, 2112, 30, 16, 8, 262144, tied=True, family="gemma4", head_dim=256, full_layers=tuple(range(5, 30, 6)),
        global_head_dim=512, global_kv_heads=2, k_eq_v=True, experts=128, experts_per_token=8, expert_intermediate=704,
        **_GEMMA_LARGE_TOWER,
    ),
}  # fmt: skip


def shape_from_config(config: dict) -> ModelShape:
    """A config.json as a dict, of any supported family. Files written before transformers 5 keep the text numbers at
    the top level and may keep tie_word_embeddings in text_config; transformers reads both places, and so does this."""
    family = config.get("model_type", "qwen2_5_vl")
    if family not in PARAM_COUNTS:
        raise KeyError(f"model_type {family!r}")
    if family == "gemma4":
        return _gemma_shape(config)
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


# transformers' Gemma4AudioConfig defaults (E2B's and E4B's), for a config.json that leaves some out
_GEMMA_AUDIO_DEFAULTS = dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=8, output_proj_dims=1536,
                             conv_kernel_size=5, subsampling_conv_channels=(128, 32))  # fmt: skip


def _gemma_shape(config: dict) -> ModelShape:
    """Gemma 4's config.json: the hub's names its full layers' head width and KV heads global_head_dim and
    num_global_key_value_heads (the latter read only with attention_k_eq_v, as transformers reads it); transformers
    5.19 writes them as per_layer_config, each full layer's overrides. Its mixture of experts (26B-A4B,
    enable_moe_block) has routed experts beside each layer's dense MLP."""
    text, vision, audio = config["text_config"], config["vision_config"], config.get("audio_config")
    moe = bool(text.get("enable_moe_block"))  # 26B-A4B: routed experts beside every layer's dense MLP
    layers, kv_heads = text["num_hidden_layers"], text["num_key_value_heads"]
    layer_types = list(text.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0 else "x" for i in
                                                   range(layers)])  # fmt: skip
    layer_types[-1] = "full_attention"  # (transformers makes the last layer a full one whatever the file says)
    full = tuple(i for i, t in enumerate(layer_types) if t == "full_attention")
    k_eq_v = bool(text.get("attention_k_eq_v", False))
    overrides = {int(i): o for i, o in (text.get("per_layer_config") or {}).items()}
    if overrides:
        if set(overrides) != set(full) or len({tuple(sorted(o.items())) for o in overrides.values()}) != 1:
            raise KeyError(f"per_layer_config {overrides}: other than one override of the full-attention layers")
        head = overrides[full[0]]
        global_dim, global_kv = head.get("head_dim", text["head_dim"]), head.get("num_key_value_heads", kv_heads)
    else:
        global_dim = text.get("global_head_dim", 512)
        global_kv = (text.get("num_global_key_value_heads") if k_eq_v else None) or kv_heads
    heads, hv = vision["num_attention_heads"], vision["hidden_size"]
    if heads * vision["head_dim"] != hv or vision.get("num_key_value_heads", heads) != heads:
        raise KeyError("vision_config: heads x head_dim other than hidden_size, or grouped KV heads")
    per_layer = text.get("hidden_size_per_layer_input") or 0
    audio = {**_GEMMA_AUDIO_DEFAULTS, **audio} if audio else {}
    return ModelShape(
        hidden=text["hidden_size"],
        intermediate=text["intermediate_size"],
        layers=layers,
        heads=text["num_attention_heads"],
        kv_heads=kv_heads,
        vocab=text["vocab_size"],
        tied=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))),
        vision_depth=vision["num_hidden_layers"],
        vision_hidden=hv,
        vision_intermediate=vision["intermediate_size"],
        patch=vision["patch_size"],
        temporal_patch=1,
        merge=vision.get("pooling_kernel_size", 3),
        family="gemma4",
        head_dim=text["head_dim"],
        vision_positions=vision.get("position_embedding_size", 10240),
        full_layers=full,
        global_head_dim=global_dim,
        global_kv_heads=global_kv,
        k_eq_v=k_eq_v,
        kv_shared_layers=text.get("num_kv_shared_layers", 0),
        double_wide=bool(text.get("use_double_wide_mlp", False)),
        per_layer_hidden=per_layer,
        per_layer_vocab=text.get("vocab_size_per_layer_input", 262144) if per_layer else 0,
        vision_head_dim=vision["head_dim"],
        audio_hidden=audio.get("hidden_size", 0),
        audio_layers=audio.get("num_hidden_layers", 0),
        audio_heads=audio.get("num_attention_heads", 0),
        audio_out=audio.get("output_proj_dims", 0),
        audio_conv=audio.get("conv_kernel_size", 0),
        audio_channels=tuple(audio.get("subsampling_conv_channels", (0, 0))),
        experts=text["num_experts"] if moe else 0,
        experts_per_token=text["top_k_experts"] if moe else 0,
        expert_intermediate=text["moe_intermediate_size"] if moe else 0,
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
            config = json.load(f)
        return shape_from_config(config)
    except PlanError as e:
        raise PlanError(f"{key}={model_path!r}: {e}: a CPU run goes on without a plan, a dry run or a GPU run "
                        "cannot") from None  # fmt: skip
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


def gemma_layers(s: ModelShape) -> list[tuple[bool, bool, int, int, int]]:
    """Gemma 4's decoder layers as transformers builds them: (full attention, kv-shared, head width, KV heads, MLP
    width) each. A kv-shared layer is one of the last kv_shared_layers; its MLP is double-wide with
    use_double_wide_mlp, unless every layer is shared."""
    first_shared = s.layers - s.kv_shared_layers
    out = []
    for i in range(s.layers):
        full, shared = i in s.full_layers, i >= first_shared
        wide = 2 if s.double_wide and shared and first_shared > 0 else 1
        d, kv = (s.global_head_dim, s.global_kv_heads) if full else (s.dim, s.kv_heads)
        out.append((full, shared, d, kv, wide * s.intermediate))
    return out


def _gemma4_layers(s: ModelShape) -> list[int]:
    # the linears (q, k, v, o without biases; gate, up, down; the per-layer input's gate and projection; the MoE
    # router's projection), a q RMSNorm over each head and, but in kv-shared layers, a k one (v's has no weight); four
    # RMSNorm weights around attention and the MLP, one after the per-layer input (the layer_scalar is a buffer)
    linears = [sum(a * b for a, b in layer.values()) for layer in decoder_linears(s)]
    norms = [d + (0 if shared else d) + 4 * s.hidden + (s.hidden if s.per_layer_hidden else 0)
             for _, shared, d, _, _ in gemma_layers(s)]  # fmt: skip
    # the mixture: every expert's gate, up and down (two 3-D tensors), the router's scale over the hidden state and
    # its per-expert scale of the weights, three more RMSNorm weights around the experts
    moe = 3 * s.experts * s.hidden * s.expert_intermediate + s.hidden + s.experts + 3 * s.hidden if s.experts else 0
    return [a + b + moe for a, b in zip(linears, norms)]


def _gemma4_tower(s: ModelShape) -> int:
    """Gemma 4's vision tower and the projection of its soft tokens into the text model (model.embed_vision): two
    FSDP2 units, counted together (a frozen tower freezes both)."""
    hv, iv = s.vision_hidden, s.vision_intermediate
    # patch embedding: a Linear over each patch's pixels without bias, and two tables of learned positions (x, y)
    patch_embed = s.in_channels * s.patch**2 * hv + 2 * s.vision_positions * hv
    # q, k, v, o and gate, up, down without biases (their clip bounds are buffers); q/k RMSNorms over a head; four
    # RMSNorm weights (the pooler, its standardisation and v's norm hold no parameters)
    block = 4 * hv * hv + 3 * hv * iv + 2 * s.vision_head_dim + 4 * hv
    return patch_embed + s.vision_depth * block + hv * s.hidden  # + embed_vision's projection (its norm: no weight)


def _gemma4_root(s: ModelShape) -> int:
    """What Gemma 4's root unit holds beyond the embedding, final norm and head: the per-layer inputs' embedding
    table, the projection of the embeddings into them and its RMSNorm; the audio tower and its projection into the
    text model (model.embed_audio)."""
    p = s.layers * s.per_layer_hidden
    per_layer = s.per_layer_vocab * p + s.hidden * p + s.per_layer_hidden if s.per_layer_hidden else 0
    if not s.audio_layers:
        return per_layer
    h, (c0, c1), k = s.audio_hidden, s.audio_channels, s.audio_conv
    # subsampling: two 3 x 3 convolutions without bias, each with a LayerNorm without bias, then a Linear
    subsample = 9 * c0 + c0 + 9 * c0 * c1 + c1 + (c0 // 4) * c1 * h
    # a block: two feed-forward halves (h -> 4h -> h, two RMSNorms each); attention (q, k, v, post, the relative
    # positions' k projection, a per-dimension scale of a head); a light convolution (h -> 2h GLU, depthwise conv of
    # kernel k without bias, h -> h, two RMSNorms); three RMSNorms
    block = 2 * (8 * h * h + 2 * h) + (5 * h * h + h // s.audio_heads) + (3 * h * h + h * k + 2 * h) + 3 * h
    out = h * s.audio_out + s.audio_out + s.audio_out * s.hidden  # output projection (bias), embed_audio's
    return per_layer + subsample + s.audio_layers * block + out


PARAM_COUNTS = {  # model_type -> (decoder layers, vision tower)
    "qwen2_5_vl": (_qwen2_5_vl_layers, _qwen2_5_vl_tower),
    "qwen3_vl": (_qwen3_vl_layers, _qwen3_tower),
    "qwen3_5": (_qwen3_5_layers, _qwen3_tower),
    "qwen3_vl_moe": (_qwen3_vl_layers, _qwen3_tower),
    "qwen3_5_moe": (_qwen3_5_layers, _qwen3_tower),
    "glm4v": (_glm4v_layers, _glm4v_tower),
    "gemma4": (_gemma4_layers, _gemma4_tower),
}


def count_params(s: ModelShape) -> dict[str, int]:
    """Exact parameter counts of the family's transformers model (..ForConditionalGeneration), per FSDP2 unit: the
    largest decoder layer, all of them, the vision tower, and the root; and `active`, those a token goes through
    (an MoE's top-k experts of each layer, not all of them: what its FLOPs count)."""
    layers_of, tower_of = PARAM_COUNTS[s.family]
    layers, vision = layers_of(s), tower_of(s)
    root = s.vocab * s.hidden + s.hidden + (0 if s.tied else s.vocab * s.hidden)
    root += _gemma4_root(s) if s.family == "gemma4" else 0
    total = root + vision + sum(layers)
    idle = s.layers * (s.experts - s.experts_per_token) * 3 * s.hidden * s.expert_intermediate  # unrouted experts
    return {"layer": max(layers), "layers": sum(layers), "vision": vision, "root": root, "total": total,
            "active": total - idle}  # fmt: skip


def decoder_linears(s: ModelShape) -> list[dict[str, tuple[int, int]]]:
    """Each decoder layer's nn.Linear modules by name: (in, out) features."""
    h, i, q, kv = s.hidden, s.intermediate, s.heads * s.dim, s.kv_heads * s.dim
    if s.family == "gemma4":
        return [_gemma4_linears(s, *layer) for layer in gemma_layers(s)]
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


def _gemma4_linears(s: ModelShape, full: bool, shared: bool, d: int, kv: int, i: int) -> dict:
    """One Gemma 4 decoder layer's linears: a kv-shared layer has no k_proj or v_proj, a full layer with k_eq_v no
    v_proj; the per-layer input's gate and projection where the model has per-layer inputs."""
    h, p = s.hidden, s.per_layer_hidden
    attention = {"q_proj": (h, s.heads * d)}
    if not shared:
        attention["k_proj"] = (h, kv * d)
        if not (full and s.k_eq_v):
            attention["v_proj"] = (h, kv * d)
    attention["o_proj"] = (s.heads * d, h)
    per_layer = {"per_layer_input_gate": (h, p), "per_layer_projection": (p, h)} if p else {}
    router = {"proj": (h, s.experts)} if s.experts else {}  # (the mixture's router: layers.N.router.proj)
    return {**attention, "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h), **per_layer, **router}


def tower_linears(s: ModelShape) -> list[tuple[str, tuple[int, int]]]:
    """The vision tower's modules an adapter can go on: (name, (in, out)) for the patch embedding (a Conv3d, whose LoRA
    factors are a Conv3d of its kernel to rank and a 1x1x1 one from rank), every block's linears and the mergers'."""
    hv, iv, merged = s.vision_hidden, s.vision_intermediate, s.vision_hidden * s.merge**2
    if s.family == "gemma4":  # a Linear patch embedding, q/k/v/o and a gated MLP a block, embed_vision's projection
        block = {"q_proj": (hv, hv), "k_proj": (hv, hv), "v_proj": (hv, hv), "o_proj": (hv, hv),
                 "gate_proj": (hv, iv), "up_proj": (hv, iv), "down_proj": (iv, hv)}  # fmt: skip
        blocks = [kv for _ in range(s.vision_depth) for kv in block.items()]
        return [("input_proj", (s.in_channels * s.patch**2, hv)), *blocks, ("embedding_projection", (hv, s.hidden))]
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
              for layer in decoder_linears(s)]  # fmt: skip
    # (`visual.NAME` reaches a tower at model.visual: Gemma 4's, model.vision_tower, gets none)
    tower = rank * sum(a + b for name, (a, b) in tower_linears(s) if name in vision) if s.family != "gemma4" else 0
    head = rank * (s.hidden + s.vocab) if "lm_head" in targets else 0
    return {"layer": max(layers), "vision": tower, "root": head, "total": sum(layers) + tower + head}
