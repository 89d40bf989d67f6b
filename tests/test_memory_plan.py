"""The memory plan (memory_plan.py and the modules it composes: model_shape, device_plan, host_plan, vllm_memory,
plan_advice): exact parameter counts, each term of the 3B and 7B plans on 8 x 80 GB against hand arithmetic, the dry
run, and plans that do not fit naming the key to change."""

import dataclasses
import json
import math

import pytest
import torch

import train_grpo
from grpo import device_plan, host_plan, memory_plan, model_shape, plan_advice, vllm_memory
from grpo.config import ActorConfig
from grpo.device_plan import GIB
from grpo.memory_plan import plan_memory
from grpo.model_shape import KNOWN_SHAPES, PlanError, count_params, shape_from_config
from grpo.plan_advice import plan_problem
from train_grpo import load_config, main

NODE = ["trainer.n_gpus_per_node=8", "trainer.gpu_memory_gib=80"]  # the plan's node, whatever this machine has


@pytest.fixture(autouse=True)
def no_launcher_env(monkeypatch):
    """The plan reads the launcher's world size, ranks per node and Slurm's --mem: none of them here."""
    for key in ("WORLD_SIZE", "SLURM_NTASKS", "LOCAL_WORLD_SIZE", "SLURM_MEM_PER_NODE"):
        monkeypatch.delenv(key, raising=False)


# ----------------------------------------------------------------------------------------------------------------------
# Parameter counts


def test_count_equals_the_tiny_models_parameters(tiny_model_dir):
    """Guards against a miscounted bias, norm or merger layer: the count from config.json must equal the loaded
    model's parameters exactly, in total and per FSDP2 unit (decoder layer, vision tower, root)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    with open(f"{tiny_model_dir}/config.json") as f:
        counts = count_params(shape_from_config(json.load(f)))
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_model_dir)
    numel = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    assert counts["total"] == numel(model)
    assert counts["layer"] == numel(model.model.language_model.layers[0])
    assert counts["vision"] == numel(model.model.visual)
    assert counts["root"] == numel(model) - numel(model.model.visual) - numel(model.model.language_model.layers)


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_experts_are_all_stored_and_top_k_active(tiny_family_dir, family):
    """Guards against a plan that counts an MoE as the dense model of its active parameters (its states and gathers
    would be planned 8-10x too small) or as one whose every token goes through every expert (activations too large):
    the count from config.json equals the tiny model's parameters, all experts included, per FSDP2 unit; `active`
    leaves out the experts a token is not routed to; the activations are those of the top-k experts' width; adapters
    on the experts add the adapted copy PEFT's forward builds."""
    from transformers import AutoModelForImageTextToText

    path = tiny_family_dir(family)
    with open(f"{path}/config.json") as f:
        shape = shape_from_config(json.load(f))
    assert (shape.experts, shape.experts_per_token, shape.expert_intermediate) == (4, 2, 96)
    counts = count_params(shape)
    model = AutoModelForImageTextToText.from_pretrained(path)
    numel = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    assert counts["total"] == numel(model) and counts["vision"] == numel(model.model.visual)
    assert counts["layer"] == max(numel(layer) for layer in model.model.language_model.layers)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert counts["active"] == counts["total"] - experts // 2  # top-2 of 4: half the experts' weights idle
    assert shape.active_intermediate == 2 * 96 + (64 if family == "qwen3_5_moe" else 0)
    # the plan: a token's activations those of a dense MLP of the active width, the states those of all parameters
    plan = plan_memory(load_config(None, [f"actor.model_path={path}", *NODE]), 8)
    dense = dataclasses.replace(shape, experts=0, intermediate=shape.active_intermediate)
    moe_plan, dense_plan = (memory_plan.compute_plan(s, plan.settings)["phases"] for s in (shape, dense))
    for phase in ("update", "log-probs"):
        assert moe_plan[phase]["activations"] == dense_plan[phase]["activations"] > 0
    assert plan.numbers["states"]["params"] == 4 * counts["total"] / 8
    # LoRA on the experts: PEFT's forward builds a layer's adapted experts (bf16) beside the gathered units, and the
    # backward keeps every layer's unless the layers are recomputed
    for checkpointing, kept in (("true", 1), ("false", shape.layers)):
        args = [f"actor.model_path={path}", *NODE, "actor.lora_rank=8", f"actor.gradient_checkpointing={checkpointing}"]
        plain, adapted = (plan_memory(load_config(None, args + targets), 8).numbers["phases"]
                          for targets in ([], ["actor.lora_target_modules=[q_proj,experts]"]))  # fmt: skip
        assert adapted["update"]["gathered"] - plain["update"]["gathered"] == 2 * experts // shape.layers * kept
        assert adapted["log-probs"]["gathered"] - plain["log-probs"]["gathered"] == 2 * experts // shape.layers


def transformers_config(s):
    """The transformers config of a ModelShape: what a checkpoint of that shape would carry in its config.json."""
    from transformers import (
        Gemma4Config,
        Glm4vConfig,
        Qwen2_5_VLConfig,
        Qwen3_5Config,
        Qwen3_5MoeConfig,
        Qwen3VLConfig,
        Qwen3VLMoeConfig,
    )

    text = dict(hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=s.layers,
                num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, vocab_size=s.vocab)  # fmt: skip
    if s.family == "gemma4":
        return Gemma4Config(**gemma4_config(s), tie_word_embeddings=s.tied)
    if s.experts:
        text.update(num_experts=s.experts, num_experts_per_tok=s.experts_per_token,
                    moe_intermediate_size=s.expert_intermediate)  # fmt: skip
    if s.family == "qwen3_5_moe":
        del text["intermediate_size"]
        text["shared_expert_intermediate_size"] = s.shared_expert_intermediate
    vision = dict(depth=s.vision_depth, hidden_size=s.vision_hidden, intermediate_size=s.vision_intermediate,
                  out_hidden_size=s.hidden, patch_size=s.patch, spatial_merge_size=s.merge)  # fmt: skip
    if s.family == "qwen2_5_vl":
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=s.tied)
    if s.family == "glm4v":  # its tower's learned positions: one per patch of an image_size image
        vision["image_size"] = math.isqrt(s.vision_positions) * s.patch
        return Glm4vConfig(text_config=text, vision_config=vision, tie_word_embeddings=s.tied)
    text["head_dim"] = s.head_dim
    vision["num_position_embeddings"] = s.vision_positions
    if s.base_family == "qwen3_vl":
        vision["deepstack_visual_indexes"] = [8, 16, 24][: s.deepstack]
        config_class = Qwen3VLMoeConfig if s.experts else Qwen3VLConfig
        return config_class(text_config=text, vision_config=vision, tie_word_embeddings=s.tied)
    linear = dict(linear_num_key_heads=s.linear_key_heads, linear_num_value_heads=s.linear_value_heads,
                  linear_key_head_dim=s.linear_key_dim, linear_value_head_dim=s.linear_value_dim,
                  linear_conv_kernel_dim=s.conv_kernel,
                  full_attention_interval=s.layers // (s.layers - s.linear_layers))  # fmt: skip
    config_class = Qwen3_5MoeConfig if s.experts else Qwen3_5Config
    return config_class(text_config={**text, **linear}, vision_config=vision, tie_word_embeddings=s.tied)


def gemma4_config(s):
    """Gemma 4's text, vision and audio configs of a ModelShape, in the hub's config.json names."""
    text = dict(
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        vocab_size=s.vocab,
        head_dim=s.head_dim,
        global_head_dim=s.global_head_dim,
        attention_k_eq_v=s.k_eq_v,
        num_global_key_value_heads=s.global_kv_heads if s.k_eq_v else None,
        num_kv_shared_layers=s.kv_shared_layers,
        use_double_wide_mlp=s.double_wide,
        hidden_size_per_layer_input=s.per_layer_hidden,
        vocab_size_per_layer_input=s.per_layer_vocab or s.vocab,
        layer_types=["full_attention" if i in s.full_layers else "sliding_attention" for i in range(s.layers)],
    )
    if s.experts:
        text.update(enable_moe_block=True, num_experts=s.experts, top_k_experts=s.experts_per_token,
                    moe_intermediate_size=s.expert_intermediate)  # fmt: skip
    vision = dict(
        hidden_size=s.vision_hidden,
        intermediate_size=s.vision_intermediate,
        num_hidden_layers=s.vision_depth,
        num_attention_heads=s.vision_hidden // s.vision_head_dim,
        num_key_value_heads=s.vision_hidden // s.vision_head_dim,
        head_dim=s.vision_head_dim,
        patch_size=s.patch,
        pooling_kernel_size=s.merge,
        position_embedding_size=s.vision_positions,
    )
    audio = dict(hidden_size=s.audio_hidden, num_hidden_layers=s.audio_layers, num_attention_heads=s.audio_heads,
                 output_proj_dims=s.audio_out, conv_kernel_size=s.audio_conv,
                 subsampling_conv_channels=list(s.audio_channels))  # fmt: skip
    return dict(text_config=text, vision_config=vision, audio_config=audio if s.audio_layers else None)


def vision_units(model):
    """The vision tower's parameters: model.visual, or Gemma 4's tower and its projection into the text model (two
    FSDP2 units, frozen together)."""
    if model.config.model_type == "gemma4":
        return [*model.model.vision_tower.parameters(), *model.model.embed_vision.parameters()]
    return list(model.model.visual.parameters())


@pytest.mark.parametrize("name", list(KNOWN_SHAPES))
def test_count_equals_transformers_for_the_known_sizes(name):
    """Guards against the counter being right for the tiny model only (tied embeddings in 3B, GQA widths, Qwen3-VL's
    deepstack mergers and q/k norms, Qwen3.5's gated q_proj and linear-attention layers, GLM-4.1V's own tower and
    fused MLP): the known sizes built by transformers on the meta device (no memory) have exactly the counted
    parameters, in total and per FSDP2 unit."""
    from transformers import AutoModelForImageTextToText

    s = KNOWN_SHAPES[name]
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(transformers_config(s))
    numel = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    counts, layers = count_params(s), model.model.language_model.layers
    assert model.config.model_type == s.family
    assert counts["total"] == numel(model)
    assert counts["layer"] == max(numel(layer) for layer in layers)
    assert counts["layers"] == numel(layers)
    assert counts["vision"] == sum(p.numel() for p in vision_units(model))
    # and what a checkpoint's config.json says of the shape is the shape
    assert shape_from_config(transformers_config(s).to_dict()) == s


DEFAULT_TARGETS = ActorConfig().lora_target_modules


@pytest.mark.parametrize(
    "name, targets",
    [(name, targets) for name in ["Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen3-VL-8B-Instruct", "Qwen/Qwen3.5-9B"]
     for targets in [DEFAULT_TARGETS, ["q_proj", "in_proj_z", "visual.proj", "visual.up_proj", "visual.linear_fc1",
                                       "lm_head"]]]
    + [("Qwen/Qwen3-VL-30B-A3B-Instruct", ["q_proj", "experts"]),
       ("Qwen/Qwen3.5-35B-A3B", [*DEFAULT_TARGETS, "experts"])],
)  # fmt: skip
def test_lora_count_equals_the_adapters_peft_injects(name, targets):
    """Guards against a LoRA plan that counts the wrong modules (the tower's gate/up/down_proj, which share the
    decoder's names, only when `visual.` names them; the patch embedding's Conv3d, also named proj; Qwen3.5's
    linear-attention projections; the deepstack mergers' linear_fc1) or the wrong widths (Qwen3.5's gated q_proj,
    an MoE's experts: rank x (in + out) for each expert of gate_up_proj and down_proj):
    the adapters PEFT puts on transformers' model through lora.lora_config have exactly the counted parameters,
    per FSDP2 unit and in total."""
    from transformers import AutoModelForImageTextToText

    from grpo import lora

    s = KNOWN_SHAPES[name]
    actor = ActorConfig(model_path=name, lora_rank=8, lora_target_modules=targets)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(transformers_config(s))
    lora.add_lora(model, lora.lora_config(actor))
    adapters = lambda m: sum(p.numel() for n, p in m.named_parameters("m") if lora.is_lora_factor(n))  # noqa: E731
    counts = model_shape.lora_params(s, 8, targets)
    assert counts["total"] == adapters(model) > 0
    assert counts["layer"] == max(adapters(layer) for layer in model.model.language_model.layers)
    assert counts["vision"] == adapters(model.model.visual)
    assert counts["root"] == adapters(model.lm_head)


@pytest.mark.parametrize("tiny", [True, False])
def test_glm4v_count_and_lora_count_equal_transformers(tiny_family_dir, tiny):
    """Guards against planning GLM-4.1V as a Qwen: its four norms a decoder layer, fused gate_up_proj, a tower whose
    blocks' MLPs are the language model's width, learned position embeddings, a conv downsample and a gated merger.
    The tiny model's config.json and transformers' default (GLM-4.1V-9B's shape), built on the meta device, have
    exactly the counted parameters per FSDP2 unit, and LoRA on them exactly the counted adapters."""
    from transformers import AutoModelForImageTextToText, Glm4vConfig

    from grpo import lora

    config = Glm4vConfig.from_pretrained(tiny_family_dir("glm4v")) if tiny else Glm4vConfig()
    s = shape_from_config(config.to_dict())
    if not tiny:  # the hub ids' embedded numbers, which the recipe's dry run plans with, are that shape
        assert KNOWN_SHAPES["zai-org/GLM-4.1V-9B-Thinking"] == KNOWN_SHAPES["zai-org/GLM-4.1V-9B-Base"] == s
    targets = [*DEFAULT_TARGETS, "visual.qkv", "visual.up_proj", "visual.proj", "lm_head"]
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    numel = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    counts, layers = count_params(s), model.model.language_model.layers
    assert (counts["total"], counts["layer"], counts["vision"]) == (numel(model), numel(layers[0]),
                                                                     numel(model.model.visual))  # fmt: skip
    lora.add_lora(model, lora.lora_config(ActorConfig(lora_rank=8, lora_target_modules=targets)))
    adapters = lambda m: sum(p.numel() for n, p in m.named_parameters("m") if lora.is_lora_factor(n))  # noqa: E731
    assert adapters(layers[0].mlp.gate_up_proj) > 0  # the default targets reach its fused MLP
    planned = model_shape.lora_params(s, 8, targets)
    assert (planned["total"], planned["layer"], planned["vision"], planned["root"]) == (
        adapters(model),
        adapters(layers[0]),
        adapters(model.model.visual),
        adapters(model.lm_head),
    )


# Gemma 4's published config.json numbers (google/gemma-4-E2B-it, -E4B-it, -31B-it; the audio towers are
# transformers' Gemma4AudioConfig defaults, as the E2B's and E4B's files give them), written out here rather than
# taken from KNOWN_SHAPES, so that the embedded shapes are checked against them
_GEMMA_SMALL_TOWER = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
                          num_key_value_heads=12, head_dim=64, patch_size=16, pooling_kernel_size=3,
                          position_embedding_size=10240, use_clipped_linears=True)  # fmt: skip
_GEMMA_AUDIO = dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=8, output_proj_dims=1536,
                    conv_kernel_size=5, subsampling_conv_channels=[128, 32])  # fmt: skip
GEMMA4_CONFIGS = {
    "google/gemma-4-E2B-it": dict(
        text_config=dict(hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8,
                         num_key_value_heads=1, head_dim=256, global_head_dim=512, vocab_size=262144,
                         vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256, num_kv_shared_layers=20,
                         use_double_wide_mlp=True, attention_k_eq_v=False, num_global_key_value_heads=None,
                         sliding_window=512, layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7),
        vision_config=_GEMMA_SMALL_TOWER, audio_config=_GEMMA_AUDIO),
    "google/gemma-4-E4B-it": dict(
        text_config=dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=42, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=256, global_head_dim=512, vocab_size=262144,
                         vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256, num_kv_shared_layers=18,
                         use_double_wide_mlp=False, attention_k_eq_v=False, num_global_key_value_heads=None,
                         sliding_window=512, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 7),
        vision_config=_GEMMA_SMALL_TOWER, audio_config=_GEMMA_AUDIO),
    "google/gemma-4-31B-it": dict(
        text_config=dict(hidden_size=5376, intermediate_size=21504, num_hidden_layers=60, num_attention_heads=32,
                         num_key_value_heads=16, head_dim=256, global_head_dim=512, vocab_size=262144,
                         vocab_size_per_layer_input=262144, hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                         use_double_wide_mlp=False, attention_k_eq_v=True, num_global_key_value_heads=4,
                         sliding_window=1024, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 10),
        vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                           num_key_value_heads=16, head_dim=72, patch_size=16, pooling_kernel_size=3,
                           position_embedding_size=10240, standardize=True, use_clipped_linears=False),
        audio_config=None),
}  # fmt: skip
# 26B-A4B: 128 experts of 704 a layer, top 8, beside a dense MLP of 2112; 31B's tower (25.8 B with it; 3.8 B of the
# language model's a token goes through, as its model card says)
GEMMA4_CONFIGS["google/gemma-4-26B-A4B-it"] = dict(
    text_config=dict(hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=256, global_head_dim=512, vocab_size=262144,
                     vocab_size_per_layer_input=262144, hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                     use_double_wide_mlp=False, attention_k_eq_v=True, num_global_key_value_heads=2,
                     sliding_window=1024, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5,
                     enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704),
    vision_config=GEMMA4_CONFIGS["google/gemma-4-31B-it"]["vision_config"], audio_config=None)  # fmt: skip
GEMMA4_TOTALS = {"google/gemma-4-E2B-it": 5_104_297_504, "google/gemma-4-E4B-it": 7_941_100_832,
                 "google/gemma-4-31B-it": 31_273_086_512, "google/gemma-4-26B-A4B-it": 25_805_933_872}  # fmt: skip


@pytest.mark.parametrize("name", ["tiny", "tiny_moe", *GEMMA4_CONFIGS])
def test_gemma4_count_and_lora_count_equal_transformers(tiny_family_dir, name):
    """Guards against planning Gemma 4 as one width of layer: its sliding and full layers (the full ones' wider
    heads, 31B's own KV heads and no v_proj), the kv-shared layers without k/v projections or norms and E2B's
    double-wide MLP on them, every layer's per-layer-input gate and projection, the root's per-layer embedding table
    and projection and the audio tower, a tower with learned x/y positions and its projection into the text model;
    the mixture's routed experts beside each dense MLP, its router's projection and scales, and its extra norms.
    The tiny model's config.json and the published E2B, E4B and 31B configs, built on the meta device, have exactly
    the counted parameters per FSDP2 unit (the largest decoder layer: layers differ), and LoRA on them exactly the
    counted adapters; the hub ids' embedded shapes are those configs'."""
    from transformers import AutoModelForImageTextToText, Gemma4Config

    from grpo import lora

    tiny = {"tiny": "gemma4", "tiny_moe": "gemma4_moe"}.get(name)
    if tiny:
        config = Gemma4Config.from_pretrained(tiny_family_dir(tiny))
    else:
        config = Gemma4Config(**GEMMA4_CONFIGS[name], tie_word_embeddings=True)
    s = shape_from_config(config.to_dict())
    if not tiny:  # what the recipes' dry runs plan with, and the published totals
        assert KNOWN_SHAPES[name] == s and count_params(s)["total"] == GEMMA4_TOTALS[name]
    else:  # the tiny model's file (transformers 5.19 writes per_layer_config, the hub global_head_dim) reads the same
        with open(f"{tiny_family_dir(tiny)}/config.json") as f:
            assert shape_from_config(json.load(f)) == s and s.kv_shared_layers and s.double_wide
    assert bool(s.experts) == ("moe" in name or "A4B" in name)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    numel = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    counts, layers = count_params(s), model.model.language_model.layers
    vision = sum(p.numel() for p in vision_units(model))
    assert (counts["total"], counts["vision"], counts["layers"]) == (numel(model), vision, numel(layers))
    assert counts["layer"] == max(numel(layer) for layer in layers)
    assert counts["root"] == numel(model) - vision - numel(layers)
    assert len({numel(layer) for layer in layers}) > 1  # (the layers do differ)
    # LoRA: the default targets and the per-layer input's; `visual.` names a model.visual tower, which Gemma has not
    targets = [*DEFAULT_TARGETS, "per_layer_input_gate", "per_layer_projection", "visual.q_proj"]
    lora.add_lora(model, lora.lora_config(ActorConfig(lora_rank=8, lora_target_modules=targets)))
    adapters = lambda m: sum(p.numel() for n, p in m.named_parameters("m") if lora.is_lora_factor(n))  # noqa: E731
    planned = model_shape.lora_params(s, 8, targets)
    assert (planned["total"], planned["layer"], planned["vision"], planned["root"]) == (
        adapters(model),
        max(adapters(layer) for layer in layers),
        adapters(model.model.vision_tower) + adapters(model.model.embed_vision),
        adapters(model.lm_head),
    )
    assert planned["total"] > 0


def test_gemma4_mixture_of_experts_is_planned_with_all_its_experts():
    """Guards against planning Gemma 4 26B-A4B as its dense sibling or by its active parameters: every expert is
    stored (sharded states), a token goes through its top 8 beside the dense MLP (activations), and the dry run of
    its hub id plans offline."""
    s = model_shape.read_model_shape("google/gemma-4-26B-A4B-it")
    counts = count_params(s)
    experts = s.layers * 128 * 3 * s.hidden * 704
    assert counts["total"] == GEMMA4_TOTALS["google/gemma-4-26B-A4B-it"] and experts > 0.85 * counts["total"]  # (88 %)
    assert counts["total"] - counts["active"] == s.layers * (128 - 8) * 3 * s.hidden * 704
    assert s.mlp_width == 2112 + 8 * 704


# The published totals, by hand, module by module (shapes as transformers prints Qwen2.5-VL).
VISION_BLOCK = 2 * 1280 + (1280 * 3840 + 3840) + (1280 * 1280 + 1280) + 2 * (1280 * 3420 + 3420) + (3420 * 1280 + 1280)
VISION_3B = 3 * 2 * 14 * 14 * 1280 + 32 * VISION_BLOCK + 1280 + (5120 * 5120 + 5120) + (5120 * 2048 + 2048)
VISION_7B = 3 * 2 * 14 * 14 * 1280 + 32 * VISION_BLOCK + 1280 + (5120 * 5120 + 5120) + (5120 * 3584 + 3584)
# q, k, v (biases), o; gate, up, down; two norms
LAYER_3B = (2048 * 2048 + 2048) + 2 * (2048 * 256 + 256) + 2048 * 2048 + 3 * 2048 * 11008 + 2 * 2048
LAYER_7B = (3584 * 3584 + 3584) + 2 * (3584 * 512 + 512) + 3584 * 3584 + 3 * 3584 * 18944 + 2 * 3584
ROOT_3B = 151936 * 2048 + 2048  # tied: the LM head is the embedding
ROOT_7B = 2 * 152064 * 3584 + 3584
P_3B = ROOT_3B + 36 * LAYER_3B + VISION_3B
P_7B = ROOT_7B + 28 * LAYER_7B + VISION_7B


def test_known_sizes_are_the_published_ones():
    """Guards against a wrong embedded number for the hub ids the configs name (a 3B planned untied, a 7B with the
    3B's vocabulary): Qwen2.5-VL-3B has 3.75 B parameters, 7B 8.29 B."""
    assert P_3B == 3_754_622_976 and P_7B == 8_292_166_656
    assert count_params(KNOWN_SHAPES["Qwen/Qwen2.5-VL-3B-Instruct"])["total"] == P_3B
    assert count_params(KNOWN_SHAPES["Qwen/Qwen2.5-VL-7B-Instruct"])["total"] == P_7B


def test_pre_transformers_5_config_layout():
    """Guards against misreading the hub's older config.json (text numbers at the top level, `in_chans`, the tie
    flag in text_config): read wrong, 3B would lose or gain its 311 M-parameter LM head."""
    flat = {
        "model_type": "qwen2_5_vl", "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
        "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
        "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "out_hidden_size": 2048,
                          "patch_size": 14, "temporal_patch_size": 2, "in_chans": 3, "spatial_merge_size": 2},
    }  # fmt: skip
    assert shape_from_config(flat) == KNOWN_SHAPES["Qwen/Qwen2.5-VL-3B-Instruct"]
    nested = {"vision_config": flat["vision_config"], "text_config": {**flat, "vision_config": None}}
    assert shape_from_config(nested) == KNOWN_SHAPES["Qwen/Qwen2.5-VL-3B-Instruct"]


# ----------------------------------------------------------------------------------------------------------------------
# Activations per token


def _saved_elems(module, shared, *args, **kwargs):
    """bf16-sized elements `module`'s forward keeps for its backward, not counting its parameters and the `shared`
    tensors (the rotary tables every layer gets)."""
    skip = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *shared]}
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() / 2
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*args, **kwargs)
    return sum(kept.values())


def test_activation_formula_matches_what_the_layers_keep(tiny_model_dir):
    """Guards against the activation estimate drifting from what transformers' Qwen2.5-VL layers keep for their
    backward (each RMSNorm keeps an fp32 copy; the vision block keeps its fused qkv output): counted on the tiny
    model's decoder layer (h 128, one kv head of 64, MLP 256) and vision block (h 128, MLP 256) in bf16."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        tiny_model_dir, attn_implementation="sdpa", dtype=torch.bfloat16
    )
    tokens = 256
    x = torch.randn(1, tokens, 128, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(tokens).expand(3, 1, tokens)
    tables = model.model.language_model.rotary_emb(x, positions)
    layer = model.model.language_model.layers[0]
    saved = _saved_elems(layer, tables, x, attention_mask=None, position_ids=positions, position_embeddings=tables)
    assert saved / tokens == pytest.approx(device_plan.layer_elems(128, 64, 256, False, rope=128)[0], rel=0.01)
    x = torch.randn(tokens, 128, dtype=torch.bfloat16, requires_grad=True)
    angles = torch.randn(tokens, 64)  # the tower's rotary tables are fp32 (a buffer FSDP2 leaves alone)
    tables = (angles.cos(), angles.sin())
    cu_seqlens = torch.tensor([0, tokens], dtype=torch.int32)
    saved = _saved_elems(model.model.visual.blocks[0], tables, x, cu_seqlens=cu_seqlens, position_embeddings=tables)
    expected = device_plan.layer_elems(128, 128, 256, checkpointing=False, fused_qkv=True)[0]
    assert saved / tokens == pytest.approx(expected, rel=0.01)


# ----------------------------------------------------------------------------------------------------------------------
# The plans of configs/geo3k.yaml (7B) and configs/geo3k_3b.yaml on 8 x 80 GB, term by term


def _by_hand(P, root, layer, vision, hidden, kv, inter, layers, vocab):
    """The geo3k recipe's plan written out: 8 ranks, 16384 tokens per training micro-batch and 32768 per log-prob
    one, vLLM 0.33 at 0.6 of 80 GiB with TP 2 and sleep level 2 (full fine-tuning's default: no host copy of its
    weights, only of its "runtime" pool), the reference in bf16 on the GPU. Bytes."""
    tokens, patches = 16384, 4 * 16384  # at most 4 patches (a 2 x 2 merge) per LM token
    # training activations at the top of the LM backward: each checkpointed layer's bf16 input, each vision block's,
    # then one decoder layer recomputed: 8 hidden-wide, 4 kv-wide and 4 MLP-wide tensors, its cos and sin
    # (2 x head_dim 128), plus gradients (2 + 2)
    lm_inputs = layers * tokens * hidden * 2
    vision_inputs = 32 * patches * 1280 * 2
    one_layer = tokens * 2 * (10 * hidden + 4 * kv + 6 * inter + 256)
    head = 512 * vocab * 20 + tokens * hidden * 4  # one 512-token chunk of logits and its grads; final hidden states
    top = (2 * root + 6 * layer, lm_inputs + vision_inputs + max(one_layer, head))  # (grads in flight, activations)
    # later, the vision tower's backward: its inputs, one block recomputed (kv = hidden there, and the fused qkv
    # output: 15 hidden-wide and 4 MLP-wide, plus gradients), its gradients
    tower = (2 * root + 6 * vision, vision_inputs + patches * 2 * (17 * 1280 + 6 * 3420))
    grads_in_flight, activations = max(top, tower, key=sum)
    nograd_tokens = 32768
    nograd = max(nograd_tokens * 2 * (4 * hidden + 3 * inter), 4 * nograd_tokens * 2 * (2 * 1280 + 3 * 3420))
    nograd += 512 * vocab * 14 + nograd_tokens * hidden * 2
    states = {"params": P / 2, "grads": P / 2, "adam": P, "reference": P / 4}  # 4, 4, 8 and 2 bytes over 8 ranks
    return {
        "update": {**states, "gathered": 2 * (root + layer + max(layer, vision)), "grads in flight": grads_in_flight,
                   "activations": activations, "runtime": 2 * GIB},
        "log-probs": {**states, "grads": 0, "gathered": 2 * (2 * root + layer + max(layer, vision)),
                      "activations": nograd, "runtime": 2 * GIB},
        "rollout": {**states, "grads": 0, "vllm awake": 0.6 * 80 * GIB, "runtime": 2 * GIB},
        # policy, reference, read buffer, and vLLM's "runtime" pool: a block table of 256 sequences x 4096 / 16 blocks
        # (int32), a slot mapping of 16384 tokens (int64), 64 KiB for the attention builder, six sampling vectors of
        # 256 (4 B): 454 KiB, one 2 MiB segment, pinned as 2 MiB
        "host per node": 8 * (P / 2 + P / 4 + 2 * vocab * hidden + 2**21),
    }  # fmt: skip


@pytest.mark.parametrize(
    "config, hand",
    [
        ("configs/geo3k.yaml", _by_hand(P_7B, ROOT_7B, LAYER_7B, VISION_7B, 3584, 512, 18944, 28, 152064)),
        ("configs/geo3k_3b.yaml", _by_hand(P_3B, ROOT_3B, LAYER_3B, VISION_3B, 2048, 256, 11008, 36, 151936)),
    ],
)
def test_geo3k_plans_term_by_term(config, hand):
    """Guards against any term of the shipped recipes' plans drifting from the arithmetic docs/memory.md states (a
    shard divided by the wrong world, the frozen-in-bf16 reference counted in fp32, vLLM's share of the wrong total)."""
    numbers = plan_memory(load_config(config, NODE), 8, vllm_version="0.33.0").numbers
    for phase in ("update", "log-probs", "rollout"):
        assert numbers["phases"][phase] == pytest.approx(hand[phase], rel=1e-12), phase
    assert 8 * sum(numbers["host"].values()) == pytest.approx(hand["host per node"], rel=1e-12)
    peak = max(sum(parts.values()) for name, parts in hand.items() if name != "host per node")
    assert peak == pytest.approx(sum(hand["rollout"].values()))  # vLLM's 48 GiB makes the rollout the peak
    assert peak <= 0.95 * 80 * GIB and plan_problem(plan_memory(load_config(config, NODE), 8)) is None


@pytest.mark.parametrize(
    "config, model, params",
    [("configs/qwen3_vl_8b_geo3k.yaml", "Qwen/Qwen3-VL-8B-Instruct", 8_767_123_696),
     ("configs/qwen3_5_9b_geo3k.yaml", "Qwen/Qwen3.5-9B", 9_409_813_744),
     ("configs/glm4v_9b_geo3k.yaml", "zai-org/GLM-4.1V-9B-Thinking", 10_292_777_472),
     ("configs/gemma4_geo3k.yaml", "google/gemma-4-E4B-it", 7_941_100_832)],
)  # fmt: skip
def test_new_family_recipes_fit_one_node(config, model, params):
    """Guards against shipping a Qwen3-VL, Qwen3.5 or GLM-4.1V recipe that cannot run on 8 x 80 GB: the plan, from
    the known shape of its hub id (the same numbers transformers builds, above), fits, and its sharded states are
    those of that many parameters (fp32 weights and gradients, AdamW's two moments, a bf16 reference)."""
    plan = plan_memory(load_config(config, NODE), 8)
    assert plan.model == model and plan.numbers["params"]["total"] == params
    update = plan.numbers["phases"]["update"]
    assert [update[k] for k in ("params", "grads", "adam", "reference")] == pytest.approx(
        [4 * params / 8, 4 * params / 8, 8 * params / 8, 2 * params / 8]
    )
    assert plan_problem(plan) is None


@pytest.mark.parametrize(
    "config, model, params, active",
    [("configs/qwen3_vl_30b_a3b_geo3k.yaml", "Qwen/Qwen3-VL-30B-A3B-Instruct", 31_070_754_032, 3_891_664_112),
     ("configs/qwen3_5_35b_a3b_geo3k.yaml", "Qwen/Qwen3.5-35B-A3B", 35_107_181_936, 3_901_560_176),
     ("configs/gemma4_26b_a4b_geo3k.yaml", "google/gemma-4-26B-A4B-it", 25_805_933_872, 4_395_322_672)],
)  # fmt: skip
def test_moe_recipes_fit_one_node_with_bf16_masters_and_adam_offloaded(config, model, params, active):
    """Guards against shipping a 26B/30B/35B mixture-of-experts recipe that cannot run on 8 x 80 GB, or that fits only
    because the plan counts the active experts where all are stored: the sharded states are those of every
    parameter (bf16 weights and gradients, AdamW's two bf16 moments, a bf16 reference), the moments leave the GPU
    while it generates, the plan fits, and without the recipe's two levers it does not."""
    plan = plan_memory(load_config(config, NODE), 8)
    assert plan.model == model and plan.numbers["params"]["total"] == params
    assert plan.numbers["params"]["active"] == active
    update = plan.numbers["phases"]["update"]
    assert [update[k] for k in ("params", "grads", "reference")] == pytest.approx([2 * params / 8] * 3)
    assert plan.numbers["phases"]["rollout"]["adam"] == 0 and plan_problem(plan) is None
    assert plan.numbers["phases"]["optimizer step"]["adam"] == pytest.approx(4 * params / 8)
    plain = plan_memory(load_config(config, [*NODE, "actor.master_dtype=fp32", "actor.offload_optimizer=false"]), 8)
    assert "does not fit" in plan_problem(plain)
    # routing replay's routes in host memory: a rank's 64 prompts x 5 answers of up to 2,048 + 2,048 tokens, every
    # MoE layer's top-8, one byte an expert up to 128 experts (Qwen3-VL-30B-A3B: 48 layers), two beyond (Qwen3.5: 256)
    assert plan.numbers["routes"] == 0
    replayed = plan_memory(load_config(config, [*NODE, "algorithm.routing_replay=r3"]), 8)
    layers, width = (48, 1) if "qwen3_vl" in config else (30, 1) if "gemma4" in config else (40, 2)
    assert replayed.numbers["routes"] == 64 * 5 * 4096 * layers * 8 * width
    assert "the routes replayed" in plan_advice.format_plan(replayed)


def test_frozen_tower_and_offloaded_reference_shrink_their_terms():
    """Guards against actor.freeze_vision_tower or actor.ref_offload changing nothing in the plan (or everything):
    a frozen tower has no gradients, AdamW moments or activations; an offloaded reference leaves the GPU."""
    base = plan_memory(load_config("configs/geo3k.yaml", NODE), 8).numbers["phases"]["update"]
    over = ["actor.freeze_vision_tower=true", "actor.ref_offload=true"]
    changed = plan_memory(load_config("configs/geo3k.yaml", NODE + over), 8).numbers["phases"]["update"]
    assert base["grads"] - changed["grads"] == pytest.approx(4 * VISION_7B / 8)
    assert base["adam"] - changed["adam"] == pytest.approx(8 * VISION_7B / 8)
    assert changed["reference"] == 0 and changed["params"] == base["params"]
    assert changed["activations"] == pytest.approx(
        28 * 16384 * 3584 * 2 + 16384 * 2 * (10 * 3584 + 4 * 512 + 6 * 18944 + 256)
    )


def test_hf_engine_plans_one_decode_step_of_at_most_max_num_seqs_rows():
    """Guards against the HF engine's rollout counted as if generate kept every decode step's fp32 logits (rows x
    response length x vocabulary: 101 GiB for bench/gpu_check.py's one-GPU run, which no flag could make fit), over
    more rows than one generate call decodes (rollout.max_num_seqs), or over validation rows in a run that never
    validates. 7B on 8 GPUs: 512 prompts x 5 answers / 8 ranks = 320 rows, cut to 256 per call."""
    hf = NODE + ["rollout.engine=hf"]
    s, rows = KNOWN_SHAPES["Qwen/Qwen2.5-VL-7B-Instruct"], 256
    rollout = plan_memory(load_config("configs/geo3k.yaml", hf), 8).numbers["phases"]["rollout"]
    assert rollout["logits"] == rows * s.vocab * 10  # one step: bf16 logits, their fp32 copy, the probabilities
    assert rollout["kv cache"] == rows * (2048 + 2048) * 28 * 2 * 512 * 2  # bf16 keys and values, prompt + answer
    fewer = plan_memory(load_config("configs/geo3k.yaml", hf + ["rollout.max_num_seqs=64"]), 8).numbers["phases"]
    assert fewer["rollout"]["logits"] == 64 * s.vocab * 10
    # validation rows (data.val_batch_size x rollout.val_n per rank) count only when the run validates
    val = hf + ["data.rollout_batch_size=16", "data.val_batch_size=100", "actor.global_batch_size=16"]
    with_val = plan_memory(load_config("configs/geo3k.yaml", val), 8).numbers["phases"]["rollout"]
    without = plan_memory(load_config("configs/geo3k.yaml", val + ["data.val_files="]), 8).numbers["phases"]["rollout"]
    assert with_val["logits"] == 100 * s.vocab * 10 and without["logits"] == 16 // 8 * 5 * s.vocab * 10


def test_lora_plan_term_by_term():
    """Guards against a LoRA plan that still counts the full model's gradients and AdamW moments, or a
    reference model, or the frozen tower's activations: 7B with rank-8 adapters on the seven projections of each
    decoder layer, against hand arithmetic; what stays is every phase's other terms."""
    full = plan_memory(load_config("configs/geo3k.yaml", NODE), 8).numbers["phases"]
    lora = plan_memory(load_config("configs/geo3k.yaml", NODE + ["actor.lora_rank=8"]), 8).numbers["phases"]
    h, kv, i = 3584, 512, 18944
    adapters = 28 * 8 * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h))  # q, k, v, o, gate, up, down
    assert adapters == 20_185_088
    update = lora["update"]
    assert update["params"] == pytest.approx((2 * P_7B + 4 * adapters) / 8)  # a bf16 base, fp32 adapters
    assert update["grads"] == pytest.approx(4 * adapters / 8) and update["adam"] == pytest.approx(8 * adapters / 8)
    assert update["reference"] == 0 and lora["log-probs"]["gathered"] == full["update"]["gathered"]
    assert update["grads in flight"] == pytest.approx(6 * adapters / 28)  # one layer's adapters, bf16 + fp32
    frozen_tower = plan_memory(load_config("configs/geo3k.yaml", NODE + ["actor.freeze_vision_tower=true"]), 8)
    assert update["activations"] == frozen_tower.numbers["phases"]["update"]["activations"]
    assert lora["rollout"]["vllm awake"] == full["rollout"]["vllm awake"]


# ----------------------------------------------------------------------------------------------------------------------
# The dry run and the verdict


def _no_loading(monkeypatch):
    """Fail the test if anything loads weights, downloads a file or forms a process group."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the dry run must not load, download or start anything")

    from transformers import Qwen2_5_VLForConditionalGeneration

    monkeypatch.setattr(Qwen2_5_VLForConditionalGeneration, "from_pretrained", forbidden)
    monkeypatch.setattr(train_grpo, "setup_distributed", forbidden)
    monkeypatch.setattr("huggingface_hub.hf_hub_download", forbidden)
    monkeypatch.setattr(
        "grpo.preflight.hub_reachable", lambda: False
    )  # as on this machine, without waiting to find out


def test_dry_run_prints_the_plan_and_loads_nothing(tiny_model_dir, monkeypatch, capsys):
    """Guards against --dry-run needing a GPU, the weights or the network, or going on into training: for the hub
    id of configs/geo3k.yaml (the embedded 7B numbers) and for a local directory (its config.json)."""
    _no_loading(monkeypatch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # check_paths would want the 7B in the hub cache; the plan does not
    assert main(["configs/geo3k.yaml", "--dry-run", *NODE]) == 1  # the plan fits; the model's files need the hub
    out = capsys.readouterr().out
    assert (
        "ok    memory plan: fits 8 GPUs" in out and "cannot reach the hub: use a local path or HF_HUB_OFFLINE=1" in out
    )
    assert "Qwen/Qwen2.5-VL-7B-Instruct (8.29 B parameters), world 8, 8 x 80.0 GiB" in out
    assert "params 3.9 | grads 3.9 | adam 7.7 | reference 1.9" in out and "-> fits" in out
    assert "8 ranks x (policy 3.9 + reference 1.9 + read buffer 1.0" in out and ") = 54.5" in out
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the defaults of a machine without a GPU
    assert main(["configs/geo3k_3b.yaml", f"actor.model_path={tiny_model_dir}", "--dry-run"]) == 1  # hub data
    out = capsys.readouterr().out
    assert "(1.21 M parameters), world 8, 8 x 80.0 GiB per node (no GPU here: assumed)" in out
    assert "ok    model: qwen2_5_vl config" in out and "FAIL  data: data.train_files: " in out


def test_plan_that_does_not_fit_names_the_key(monkeypatch, capsys):
    """Guards against a plan over the GPU reaching the loaders (an OOM minutes in, or a kill without a traceback):
    the dry run stops with exit code 2 and names what to change."""
    _no_loading(monkeypatch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert main(["configs/geo3k.yaml", "--dry-run", "trainer.n_gpus_per_node=8", "trainer.gpu_memory_gib=16"]) == 2
    captured = capsys.readouterr()
    assert "DOES NOT FIT" in captured.out
    err = captured.err
    assert "the update phase needs 39.1 GiB per GPU, over the 15.2 GiB usable (0.95 x 16.0 GiB" in err
    assert "actor.max_tokens_per_micro_batch (activations)" in err and "actor.ref_offload=true" in err


@pytest.mark.parametrize(
    "overrides, advice",
    [
        # (76.0 - 3.86 params - 7.72 adam - 1.93 reference - 2.0 runtime) / 80 = 0.756
        (["rollout.gpu_memory_utilization=0.9"], "lower rollout.gpu_memory_utilization from 0.9 to 0.75"),
        (["actor.max_tokens_per_micro_batch=131072"], "lower actor.max_tokens_per_micro_batch from 131072 to"),
        # a 131,072-token sequence: 2 ranks hold 123,674 tokens' activations, 4 ranks 239,376 (28 heads: not 8)
        (["actor.max_tokens_per_micro_batch=131072"], "set actor.sequence_parallel_size=4"),
        (["actor.max_tokens_per_micro_batch=0", "actor.micro_batch_size=16"], "lower actor.micro_batch_size from 16"),
        (["actor.max_tokens_per_micro_batch_no_grad=400000"], "lower actor.max_tokens_per_micro_batch_no_grad"),
        (["actor.gradient_checkpointing=false"], "set actor.gradient_checkpointing=true"),
        (["rollout.sleep_level=0"], "set rollout.sleep_level=-1"),
        # HF generate's KV cache for 640 rows a call (1024 prompts x 5 / 8 ranks): 70 GiB
        (["rollout.engine=hf", "data.rollout_batch_size=1024", "rollout.max_num_seqs=1024"], "set rollout.engine=vllm"),
        (["rollout.gpu_memory_utilization=0.05"], "raise it to >= 0.1"),  # vLLM's 7.7 GiB of weights do not fit
        # 77.1 GiB in the rollout phase, 67.5 with LoRA (no reference, AdamW moments of the adapters only)
        (["rollout.gpu_memory_utilization=0.77"], "train LoRA adapters: actor.lora_rank=8"),
    ],
)
def test_each_lever_is_named(overrides, advice):
    """Guards against advice that names a key which would not help: each case is over the limit in one part
    only, and the advice names the key of that part."""
    problem = plan_problem(plan_memory(load_config("configs/geo3k.yaml", NODE + overrides), 8))
    assert problem is not None and advice in problem, problem


def test_sequence_parallel_splits_the_activations():
    """Guards against a plan that does not see the split (or splits what stays whole): at size k a rank's update
    activations are a k-th of size 1's, plus the whole row's merged and gathered embeddings."""
    plan = plan_memory(load_config("configs/geo3k.yaml", NODE), 8)
    x, t, h = plan.settings, plan.settings.train_tokens, plan.shape.hidden
    one = memory_plan.compute_plan(plan.shape, x)["phases"]["update"]["activations"]
    for k in (2, 4):
        split = memory_plan.compute_plan(plan.shape, dataclasses.replace(x, sp=k, train_tokens=k * t))
        assert split["phases"]["update"]["activations"] == pytest.approx(one + 2 * 2 * k * t * h, rel=1e-3)


def test_sequence_parallel_splits_the_teachers_activations():
    """Guards against a plan that counts a distillation teacher's rows whole under sequence parallelism: the teacher
    is cut like the policy, so the log-prob phase (where the 32B teacher's forward is the largest) needs a k-th of
    size 1's activations, plus the whole row's merged and gathered embeddings at the teacher's width."""
    plan = plan_memory(load_config("configs/geo3k.yaml", NODE), 8)
    teacher = KNOWN_SHAPES["Qwen/Qwen3-VL-32B-Instruct"]
    x = dataclasses.replace(plan.settings, teacher=teacher)
    t = x.nograd_tokens
    one = memory_plan.compute_plan(plan.shape, x)["phases"]["log-probs"]["activations"]
    assert one > memory_plan.compute_plan(plan.shape, plan.settings)["phases"]["log-probs"]["activations"]
    for k in (2, 4):
        split = memory_plan.compute_plan(plan.shape, dataclasses.replace(x, sp=k, nograd_tokens=k * t))
        assert split["phases"]["log-probs"]["activations"] == pytest.approx(one + 2 * 2 * k * t * teacher.hidden, 1e-3)


def test_slurm_mem_below_the_host_plan_stops(monkeypatch):
    """Guards against eight ranks loading into a Slurm job whose --mem cannot hold them: the cgroup kills the job
    without a traceback (docs/memory.md)."""
    monkeypatch.setenv("SLURM_MEM_PER_NODE", str(50 * 1024))  # MB: 50 GiB, under the 7B's 54.5
    problem = plan_problem(plan_memory(load_config("configs/geo3k.yaml", NODE), 8))
    assert "over the 50.0 GiB this Slurm job may use (--mem)" in problem and "sleep_level" not in problem
    # at level 1 vLLM's pinned copy comes on top (169.5 GiB in all): a level-2 sleep is the way out
    monkeypatch.setenv("SLURM_MEM_PER_NODE", str(100 * 1024))
    problem = plan_problem(plan_memory(load_config("configs/geo3k.yaml", [*NODE, "rollout.sleep_level=1"]), 8))
    assert "over the 100.0 GiB this Slurm job may use (--mem)" in problem and "rollout.sleep_level=2" in problem


def test_a_cpu_run_prints_but_does_not_stop_and_a_cuda_run_stops(tiny_model_dir, monkeypatch, capsys):
    """Guards against the GPU plan stopping the CPU tests and demo (their numbers are for a GPU that is not there),
    and against a real CUDA start that does not stop when the plan is over the GPU."""

    class Started(Exception):
        pass

    def started(*args, **kwargs):
        raise Started

    monkeypatch.setattr(train_grpo, "setup_distributed", started)
    monkeypatch.setenv("WORLD_SIZE", "8")  # as torchrun would
    # vLLM's 0.95 x 80 GiB alone is the whole usable 76 GiB
    args = ["configs/geo3k.yaml", f"actor.model_path={tiny_model_dir}", "rollout.gpu_memory_utilization=0.95", *NODE]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(Started):  # on CPU it goes on to start the run
        main(args)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(args) == 2
    assert "lower rollout.gpu_memory_utilization from 0.95 to 0.92" in capsys.readouterr().err


def test_unknown_model_offline_fails_naming_the_key(monkeypatch):
    """Guards against an unplannable model surfacing as a stack trace: with the hub offline and the model neither
    a directory nor a known size, the error names actor.model_path."""
    with pytest.raises(PlanError, match=r"actor\.model_path='nobody/no-such-model': cannot read its config\.json"):
        model_shape.read_model_shape("nobody/no-such-model")


# ----------------------------------------------------------------------------------------------------------------------
# bf16 master weights and offloading (actor.master_dtype, actor.offload_params, actor.offload_optimizer)


def test_bf16_masters_and_offload_terms_by_hand_for_7b_on_4x40():
    """Guards against the plan of configs/geo3k_4x40gb.yaml (7B, 4 ranks, bf16 masters, everything offloaded)
    counting a term the run does not hold, or missing one it does: bf16 weights, gradients and moments are 2, 2 and 4
    bytes a parameter over 4 ranks; the moments are on the GPU only in the optimizer step; the rollout holds no
    trainer state; the weight sync holds the state (without moments) beside vLLM's bf16 TP-2 weights and the reload of
    its largest layer, the embedding (the full tensor sent, vLLM's TP half of it); the host holds all of it while vLLM
    generates."""
    plan = plan_memory(load_config("configs/geo3k_4x40gb.yaml"), 4)
    x, numbers = plan.settings, plan.numbers
    assert (x.world, x.gpu_bytes, x.master_bytes, x.offload_params, x.offload_optimizer) == (4, 40 * GIB, 2, True, True)
    states = {"params": 2 * P_7B / 4, "grads": 2 * P_7B / 4, "adam": 4 * P_7B / 4, "reference": 2 * P_7B / 4}
    assert numbers["states"] == pytest.approx(states, rel=1e-12)
    phases = numbers["phases"]
    assert phases["optimizer step"] == pytest.approx({**states, "runtime": 2 * GIB}, rel=1e-12)
    assert phases["update"]["adam"] == 0 and phases["log-probs"]["adam"] == 0
    assert phases["update"]["params"] == pytest.approx(states["params"]) and phases["update"]["grads"] > 0
    assert phases["rollout"] == pytest.approx(
        {"params": 0, "grads": 0, "adam": 0, "reference": 0, "vllm awake": 0.8 * 40 * GIB, "runtime": 2 * GIB}
    )
    sync = {**states, "grads": 0, "adam": 0, "vllm weights": 2 * P_7B / 2, "layer reload": 1.5 * 2 * 152064 * 3584}
    assert phases["weight sync"] == pytest.approx({**sync, "runtime": 2 * GIB}, rel=1e-12)
    assert numbers["offloaded"] == pytest.approx({"params": P_7B / 2, "reference": P_7B / 2, "adam": P_7B}, rel=1e-12)
    # the same run with fp32 masters and nothing offloaded: every state twice (and the reference the same)
    fp32 = ["actor.master_dtype=fp32", "actor.offload_params=false", "actor.offload_optimizer=false"]
    full = plan_memory(load_config("configs/geo3k_4x40gb.yaml", fp32), 4).numbers
    assert {k: full["states"][k] / v for k, v in states.items()} == pytest.approx(
        {"params": 2, "grads": 2, "adam": 2, "reference": 1}
    )
    assert "optimizer step" not in full["phases"] and full["phases"]["weight sync"]["adam"] == pytest.approx(2 * P_7B)
    assert full["phases"]["rollout"]["adam"] == pytest.approx(2 * states["adam"])


def test_shipped_small_gpu_configs_fit(monkeypatch, capsys):
    """Guards against shipping configs/geo3k_4x40gb.yaml (7B on 4 x 40 GB) or configs/geo3k_3b_1x40gb.yaml (3B on one
    40 GB GPU) with a plan that does not fit the node they name: the dry run must exit 0 and say so."""
    _no_loading(monkeypatch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    for config, head in (("configs/geo3k_4x40gb.yaml", "world 4, 4 x 40.0 GiB"),
                         ("configs/geo3k_3b_1x40gb.yaml", "world 1, 1 x 40.0 GiB")):  # fmt: skip
        assert main([config, "--dry-run"]) == 1  # the plan fits; the model's files need the hub
        out = capsys.readouterr().out
        assert head in out and "-> fits" in out and "offloaded to host memory while generating" in out
        assert "ok    memory plan: fits" in out


@pytest.mark.parametrize(
    "overrides, advice",
    [
        # 7B on 8 x 40 GB: 53.0 GiB in the update with fp32 masters; bf16 halves the states (37.8)
        (["trainer.gpu_memory_gib=40", "rollout.gpu_memory_utilization=0.5"], "set actor.master_dtype=bf16"),
        # vLLM at 0.77 of 80 GiB beside 15.5 GiB of states: the moments out of the GPU make it fit
        (["rollout.gpu_memory_utilization=0.77"], "set actor.offload_optimizer=true"),
        # at 0.9, only the weights and the reference leaving too make room
        (["rollout.gpu_memory_utilization=0.9"], "set actor.offload_params=true and actor.offload_optimizer=true"),
    ],
)
def test_offload_and_bf16_levers_are_named(overrides, advice):
    """Guards against a plan that does not fit and does not name the new levers where they are what fits it."""
    problem = plan_problem(plan_memory(load_config("configs/geo3k.yaml", NODE + overrides), 8))
    assert problem is not None and advice in problem, problem


def test_a_cpu_runs_plan_is_of_host_memory_per_rank(monkeypatch):
    """Guards against a CPU run (the tests, the demo) printing a plan of assumed 80 GB GPUs: it is of each rank's
    share of this machine's memory, and vLLM holds its fp32 weights and rollout.cpu_kv_cache_bytes."""
    monkeypatch.setattr(host_plan, "host_bytes_per_rank", lambda ranks: 64 * GIB / ranks)
    plan = plan_memory(load_config("configs/geo3k.yaml"), 2, host_run=True)
    text = plan_advice.format_plan(plan)
    assert "GiB per rank (host memory)" in text and "2 x 32.0 GiB per node (CPU run" in text and "80" not in text
    awake = plan.numbers["phases"]["rollout"]["vllm awake"]
    assert awake == pytest.approx(4 * P_7B / 2 + (1 << 30))  # TP 2; the default 1 GiB KV cache


# ----------------------------------------------------------------------------------------------------------------------
# vLLM beside the trainer: the sleep level, its host copy as torch's pinned allocator takes it, the weight sync's reload


def test_sleep_level_is_the_cheapest_correct_one_per_mode_and_the_plan_follows_it():
    """Guards against a level-1 sleep where the sync resends everything (its pinned copy of every weight made at each
    sleep, restored at each wake, then overwritten: 8 ranks x 14.4 GiB for 7B at TP 2), and a level 2 where it does
    not (LoRA resends only the adapted modules: the base's other weights would be gone). rollout.sleep_level still
    overrides, and the plan counts the level the run uses."""
    from grpo.vllm_engine import sleep_level_for

    assert [sleep_level_for(-1, 0), sleep_level_for(-1, 8)] == [2, 1]
    assert [sleep_level_for(level, rank) for level in (0, 1, 2) for rank in (0, 8)] == [0, 0, 1, 1, 2, 2]
    copy = {}
    for overrides in (
        [],
        ["rollout.sleep_level=1"],
        ["actor.lora_rank=8"],
        ["actor.lora_rank=8", "rollout.sleep_level=2"],
    ):
        plan = plan_memory(load_config("configs/geo3k.yaml", NODE + overrides), 8)
        copy[tuple(overrides)] = plan.settings.sleep_level, round(plan.numbers["host"]["vllm sleep copy"] / GIB, 1)
    assert list(copy.values()) == [(2, 0.0), (1, 14.4), (1, 14.4), (2, 0.0)]


def _pinned_by_hand(n):
    """torch's pinned allocator on a request of n bytes (c10::llvm::PowerOf2Ceil), written apart from the plan's."""
    p = 1
    while p < n:
        p *= 2
    return p


def test_level_1_sleep_copy_is_planned_as_the_pinned_allocator_takes_it():
    """Guards against planning vLLM's level-1 sleep copy at the weights' size: CuMemAllocator pins one host tensor
    per allocation, and torch rounds each to a power of two, so Qwen2.5-VL-7B at TP 2 pins 15.4 GB, not 8.3. The
    plan must agree within 10 % with the allocator modelled from the 7B's config: vLLM's fused tensors (per layer qkv,
    o, gate_up, down; per tower block qkv, proj, gate_up, down; the mergers, the patch embedding, the embedding and the
    head), each its TP half in bf16 as a segment of torch's CUDA allocator (2 MiB steps above 10 MiB, 20 MiB segments
    between 1 and 10, 2 MiB ones below), each segment's pinned block a power of two."""
    h, kv, i, hv, iv, vocab = 3584, 512, 18944, 1280, 3420, 152064
    layer = [(h + 2 * kv) * h, h * h, 2 * i * h, i * h]
    block = [3 * hv * hv, hv * hv, 2 * iv * hv, iv * hv]
    tensors = [vocab * h] * 2 + layer * 28 + block * 32 + [5120 * 5120, 5120 * h, 3 * 2 * 14 * 14 * hv]
    mib, pinned = 2**20, 0
    for n in tensors:
        b = 2 * n // 2  # bf16, half of it on each TP rank
        pinned += _pinned_by_hand(-(-b // (2 * mib)) * 2 * mib) if b >= 10 * mib else b * 32 / 20 if b > mib else b
    pinned += 2 * (P_7B - sum(tensors)) / 2  # norms and biases, in 2 MiB segments (a power of two already)
    planned = vllm_memory.vllm_sleep_copy(KNOWN_SHAPES["Qwen/Qwen2.5-VL-7B-Instruct"], 2)
    assert planned == pytest.approx(pinned, rel=0.10) and pinned / 1e9 == pytest.approx(15.4, abs=0.1)
    assert not 2 * P_7B / 2 == pytest.approx(pinned, rel=0.10)  # the weights' own size, as planned before: 8.3 GB


class StandInAllocator:
    """vLLM 0.33's CuMemAllocator (device_allocator/cumem.py) on its bookkeeping alone: allocations by tag; `sleep`
    copies each of `offload_tags` into a pinned host tensor of the allocation's size, which torch's pinned allocator
    rounds up to a power of two, and unmaps every one; `wake_up` maps again those `tags` names and, whatever it names,
    every tag that is not deferrable (device_allocator/__init__.py DEFERRABLE_TAGS), dropping their host copies."""

    DEFERRABLE_TAGS = ("weights", "kv_cache")

    def __init__(self, allocations):  # {tag: [bytes of each allocation]}
        self.data = [dict(tag=tag, size=n, backup=0, asleep=False) for tag, sizes in allocations.items() for n in sizes]

    def sleep(self, offload_tags=None):
        if offload_tags is None:
            offload_tags = ("default",)
        elif isinstance(offload_tags, str):
            offload_tags = (offload_tags,)
        for d in self.data:
            if not d["asleep"]:
                d["backup"] = _pinned_by_hand(d["size"]) if d["tag"] in offload_tags else 0
                d["asleep"] = True

    def wake_up(self, tags=None):
        for d in self.data:
            if d["asleep"] and (tags is None or d["tag"] in tags or d["tag"] not in self.DEFERRABLE_TAGS):
                d["asleep"], d["backup"] = False, 0

    def host_bytes(self, tags):
        return sum(d["backup"] for d in self.data if d["tag"] in tags)


class StandInBackend:
    """vLLM 0.33's CuMemBackend (device_allocator/sleep_mode_backend.py), its suspend and resume as written there."""

    def __init__(self, allocator):
        self.allocator = allocator

    def suspend(self, level: int = 1) -> None:
        # Runtime state and graph pools are kept at every level; weights only at level 1.
        offload_tags: tuple[str, ...] = ("runtime", "cudagraph")
        if level == 1:
            offload_tags = ("weights", *offload_tags)
        self.allocator.sleep(offload_tags=offload_tags)

    def resume(self, tags: list[str] | None = None) -> None:
        self.allocator.wake_up(tags)


def test_the_stand_in_backs_up_what_the_installed_vllm_backs_up(monkeypatch):
    """Guards against a stand-in that misreads vLLM's rule: the installed vLLM's own CuMemBackend.suspend asks its
    allocator for the stand-in's tags at levels 1 and 2 where it is 0.32 or later (0.26 to 0.31: the weights at
    level 1, nothing at level 2), and its wake restores the stand-in's non-deferrable tags with the weights."""
    import vllm.device_allocator as allocators
    from vllm.device_allocator.sleep_mode_backend import CuMemBackend

    from grpo.startup import library_versions

    class Recorder:
        def __init__(self):
            self.asked = []

        def sleep(self, offload_tags=None):
            self.asked.append(offload_tags)

    real, stand_in = Recorder(), Recorder()
    monkeypatch.setattr(allocators, "get_mem_allocator_instance", lambda: real)
    for level in (1, 2):
        CuMemBackend().suspend(level)
        StandInBackend(stand_in).suspend(level)
    assert stand_in.asked == [("weights", "runtime", "cudagraph"), ("runtime", "cudagraph")]
    if vllm_memory.sleep_backs_up_pools(library_versions()["vllm"]):
        assert real.asked == stand_in.asked
        assert allocators.DEFERRABLE_TAGS == StandInAllocator.DEFERRABLE_TAGS
    else:
        assert real.asked == [("weights",), ()]


@pytest.mark.parametrize("config", ["configs/geo3k.yaml", "configs/qwen3_5_9b_geo3k.yaml"])
def test_vllm_033_sleep_copy_is_the_plans_host_bytes_at_levels_1_and_2(config):
    """Guards against a plan that leaves out what vLLM 0.32+'s sleep copies besides the weights: its "runtime" and
    "cudagraph" pools, to pinned host memory at every level. The stand-in of 0.33's backend, fed the allocations the
    plan assumes for the shape (its weights' TP slices in bf16 as segments of torch's allocator, its pools, and a KV
    cache and a workspace, which are never copied), backs up exactly the plan's pool bytes at levels 1 and 2 (the plan
    of today's main: none), and at level 1 the plan's copy of the weights besides; waking the weights maps the pools
    again and drops their host copies (which torch's pinned allocator keeps cached: the plan counts them for good)."""
    for level in (1, 2):
        plan = plan_memory(load_config(config, [*NODE, f"rollout.sleep_level={level}"]), 8, vllm_version="0.33.0")
        s, x, host = plan.shape, plan.settings, plan.numbers["host"]
        *big, rest = vllm_memory.vllm_tensors(s)
        weights = vllm_memory.pool_segments([2 * n // x.tp for n in big]) + [2**21] * -(-2 * rest // x.tp // 2**21)
        pools = plan.numbers["vllm pools"]
        assert pools["runtime"] and pools["cudagraph"] == []  # the engine leaves sleep_mode_offload_cudagraph off
        allocator = StandInAllocator({"weights": weights, "kv_cache": [20 * GIB], "workspace": [2**26], **pools})
        StandInBackend(allocator).suspend(level)
        assert allocator.host_bytes(["kv_cache", "workspace"]) == 0
        assert allocator.host_bytes(["runtime", "cudagraph"]) == host["vllm sleep pools"] > 0
        if level == 1:
            assert allocator.host_bytes(["weights"]) == pytest.approx(host["vllm sleep copy"], rel=0.01)
        else:
            assert allocator.host_bytes(["weights"]) == host["vllm sleep copy"] == 0
        StandInBackend(allocator).resume(["weights"])
        assert allocator.host_bytes(["weights", "runtime", "cudagraph"]) == 0
        assert not any(d["asleep"] for d in allocator.data if d["tag"] in ("weights", "runtime", "workspace"))


def test_host_total_counts_the_pools_for_vllm_033_and_not_026(monkeypatch):
    """Guards against a plan for vLLM 0.32+ whose per-node host total, the one compared with Slurm's --mem, leaves out
    the pools its sleep copies, or a plan for 0.26-0.31 that counts them: 7B, 8 ranks, level 2, against a --mem just
    above 0.26's total; and the printed plan names the term for 0.33 only."""
    plans = {v: plan_memory(load_config("configs/geo3k.yaml", NODE), 8, vllm_version=v) for v in ("0.26.0", "0.33.0")}
    totals = {v: host_plan.host_per_node(p.numbers, p.settings) for v, p in plans.items()}
    pools = plans["0.33.0"].numbers["host"]["vllm sleep pools"]
    assert totals["0.33.0"] - totals["0.26.0"] == 8 * pools == 8 * 2**21
    assert plans["0.26.0"].numbers["host"]["vllm sleep pools"] == 0
    assert [vllm_memory.sleep_backs_up_pools(v) for v in ("0.26.0", "0.31.0", "0.32.0", "0.33.0+cu130")] == [
        False, False, True, True
    ]  # fmt: skip
    monkeypatch.setenv("SLURM_MEM_PER_NODE", str(math.ceil(totals["0.26.0"] / 2**20)))  # MB
    problems = {v: plan_problem(plan_memory(load_config("configs/geo3k.yaml", NODE), 8, vllm_version=v))
                for v in plans}  # fmt: skip
    assert problems["0.26.0"] is None and "this Slurm job may use (--mem)" in problems["0.33.0"]
    texts = {v: plan_advice.format_plan(p) for v, p in plans.items()}
    assert "read buffer 1.0 + vllm sleep pools 0.002) = 54.5" in texts["0.33.0"]
    assert 'vLLM 0.33.0 copies its "runtime" pool' in texts["0.33.0"] and "sleep pools" not in texts["0.26.0"]


@pytest.mark.parametrize(
    "config, model, per_layer_gb",
    [
        ("configs/qwen3_vl_30b_a3b_geo3k.yaml", "Qwen/Qwen3-VL-30B-A3B-Instruct", 1.21),
        ("configs/qwen3_5_35b_a3b_geo3k.yaml", "Qwen/Qwen3.5-35B-A3B", 1.61),
    ],
)
def test_weight_sync_counts_a_moe_layers_experts_twice(config, model, per_layer_gb):
    """Guards against planning the sync at one expert at a time: vLLM's layer-wise reload (0.26-0.33) keeps every
    tensor sent to a layer until the layer is whole, then materialises its own copy (its TP slice) to load them into,
    so a fused-MoE layer holds all its experts as sent (bf16, 3 x experts x hidden x expert width, from the config)
    and again as materialised, beside vLLM's weights."""
    with open(f"{config}") as f:
        assert model in f.read()
    s = KNOWN_SHAPES[model]
    experts = 2 * 3 * s.experts * s.hidden * s.expert_intermediate
    assert experts / 1e9 == pytest.approx(per_layer_gb, abs=0.005)
    sync = plan_memory(load_config(config, NODE), 8).numbers["phases"]["weight sync"]
    assert sync["layer reload"] == pytest.approx(experts * (1 + 1 / 2), rel=1e-12)  # TP 2


P_32B = 33_357_390_064  # Qwen3-VL-32B-Instruct: its known shape, which transformers builds with as many (above)


def test_distill_recipe_fits_one_node_and_counts_its_teacher(monkeypatch, capsys):
    """Guards against a teacher the plan leaves out (a 32B's bf16 shard is 7.8 GiB a GPU of 8, more than the 8B's
    reference) or counts at the policy's shape: the recipe's dry run names the teacher and fits; the shard leaves the
    GPU with distill.offload and joins every phase without it; the log-prob phase holds the 32B's gathered root and
    blocks beside the policy's; the lever that fits an over-full plan is named."""
    _no_loading(monkeypatch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    config = "configs/qwen3_vl_8b_distill_32b.yaml"
    assert main([config, "--dry-run", *NODE]) == 1  # the plan fits; the model's files need the hub
    out = capsys.readouterr().out
    assert "teacher    Qwen/Qwen3-VL-32B-Instruct (33.36 B parameters, qwen3_vl, bf16): 7.8 GiB a shard" in out
    assert "the reference 2.0 GiB beside it" in out and "-> fits" in out and "ok    memory plan: fits" in out
    plan = plan_memory(load_config(config, NODE), 8)
    assert plan.teacher == "Qwen/Qwen3-VL-32B-Instruct" and plan.numbers["teacher_params"]["total"] == P_32B
    assert plan.numbers["states"]["teacher"] == 0 and plan.numbers["host"]["teacher"] == pytest.approx(2 * P_32B / 8)
    on_gpu = plan_memory(load_config(config, [*NODE, "distill.offload=false"]), 8).numbers
    alone = plan_memory(load_config(config, [*NODE, "distill.model_path="]), 8).numbers
    for phase in ("update", "log-probs", "rollout"):
        assert on_gpu["phases"][phase]["teacher"] == pytest.approx(2 * P_32B / 8)
        assert "teacher" not in alone["phases"][phase] or alone["phases"][phase]["teacher"] == 0
    pair = lambda n: n["layer"] + max(n["vision"], n["layer"])  # noqa: E731 (a block and the one prefetched)
    teacher, student = count_params(KNOWN_SHAPES["Qwen/Qwen3-VL-32B-Instruct"]), alone["params"]
    extra = on_gpu["phases"]["log-probs"]["gathered"] - alone["phases"]["log-probs"]["gathered"]
    assert extra == pytest.approx(2 * teacher["root"] + 2 * (pair(teacher) - pair(student)))  # its root, wider blocks
    assert on_gpu["phases"]["update"]["gathered"] == alone["phases"]["update"]["gathered"]  # it has no backward
    over = plan_problem(plan_memory(load_config(config, [*NODE, "distill.offload=false",
                                                         "rollout.gpu_memory_utilization=0.7"]), 8))  # fmt: skip
    assert "does not fit" in over and "set distill.offload=true" in over
