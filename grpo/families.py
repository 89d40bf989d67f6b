"""What differs between the model families this trainer supports (Qwen2.5-VL, Qwen3-VL, Qwen3.5 and the last two's
mixtures of experts, GLM-4.1V, and Gemma 4's dense models as far as docs/families.md says): one small table,
FAMILIES, so that everything else (loading, FSDP2, the packed forward, the weight sync) stays one code path. The
experts' own code is in moe.py; the start-up check that a checkpoint is one of these families, whole, is
loading.unsupported_model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
# GLM-4.1V's: each image is `<|begin_of_image|>` + one `<|image|>` per merged token + `<|end_of_image|>` (a video's
# frames likewise, inside `<|begin_of_video|>` ... `<|end_of_video|>`)
GLM_VISION_TOKENS = ("<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>", "<|image|>",
                     "<|video|>")  # fmt: skip
# Gemma 4's: each image is `<|image>` + one `<|image|>` per soft token + `<image|>`; a video frame's `<|video|>`s
# likewise; audio `<|audio>` + `<|audio|>`s + `<audio|>`
GEMMA_VISION_TOKENS = ("<|image>", "<image|>", "<|image|>", "<|video|>", "<|audio>", "<audio|>", "<|audio|>")


def tower_and_layers(model):
    """The FSDP2 units below the root: the vision tower as one unit (Qwen3-VL's deepstack mergers and every patch
    merger live inside it), then each decoder layer (Qwen3.5's linear- and full-attention layers alike)."""
    return [model.model.visual, *model.model.language_model.layers]


def gemma_tower_and_layers(model):
    """Gemma 4's FSDP2 units: its vision tower (model.vision_tower), the projection of its soft tokens into the text
    model (model.embed_vision: outside the tower, and run with it before generate's prefill, where the root's
    parameters are not gathered yet), then each decoder layer."""
    return [model.model.vision_tower, model.model.embed_vision, *model.model.language_model.layers]


@dataclass(frozen=True)
class Family:
    """What differs between the model families this trainer supports; everything else (loading, FSDP2, the packed
    forward, the weight sync) is one code path."""

    fsdp_units: Callable  # model -> the modules sharded as their own FSDP2 units, before the root
    # The side of one merged image token, vision patch x merge, to which data.py fits every image: 28 px for
    # Qwen2.5-VL (14 x 2), 32 px for Qwen3-VL and Qwen3.5 (16 x 2). data.py takes it from the checkpoint's processor,
    # which resizes by that factor; processor_problem stops (at start) a checkpoint whose processor says otherwise.
    image_side: int
    # Layers with a recurrent state (Qwen3.5's gated delta net) would carry it from one packed sequence into the
    # next: their packed forward restarts it per sequence (linear_attention.py).
    linear_attention: bool = False
    # vLLM options the family needs on CPU, where the engine runs without chunked prefill (see vllm_engine.VLLMEngine):
    # vLLM caches Qwen3.5's recurrent state for prefix caching only with chunked prefill ("Chunked prefill is
    # required for mamba cache mode 'align'"), so there its prefix caching is off.
    vllm_cpu_kwargs: dict = field(default_factory=dict)
    # The engine's dtype on CPU, where the trainer computes in fp32. vLLM 0.32's CPU gated-delta-net kernel asserts
    # bf16 ("CPU GDN attention requires BF16"), so a Qwen3.5 engine on CPU samples in bf16 (on GPU all are bf16).
    vllm_cpu_dtype: torch.dtype = torch.float32
    # Sampling one would put an image placeholder into a response: "Image features and image tokens do not match".
    vision_tokens: tuple = VISION_TOKENS
    # Routed experts in every decoder layer (moe.py): 3-D expert parameters, stored in the checkpoint in a layout of
    # their own, computed by transformers' experts_implementation.
    moe: bool = False
    # What the family cannot do here yet, each refused at start (refusal) naming its key: videos (GLM-4.1V writes a
    # video as one image block per frame with its timestamp in text, which neither the one-pass tower call of
    # logprobs.encode_vision nor video.py's token counts know), tool turns (turns.py writes them in Qwen's chat
    # format) and sequence parallelism (untested on any but Qwen's attention).
    videos: bool = True
    tools: bool = True
    sequence_parallel: bool = True
    # LoRA's `visual.NAME` targets (lora.lora_target_regex) name modules under model.visual, Qwen's and GLM's tower:
    # Gemma 4's is model.vision_tower, its linears inside clipping wrappers, so such a target would adapt nothing
    tower_lora: bool = True
    # text_config keys vLLM's model of the family reads and transformers' does not, with the values the checkpoint's
    # weights need there: GLM-4.1V's q/k/v have biases in transformers whatever the config says, in vLLM only with
    # attention_bias true (its config.json says so); without it vLLM would load and sync the model without them.
    vllm_text_config: dict = field(default_factory=dict)


# model_type (config.json) -> its Family: the families this trainer knows how to load, shard, pack and sync. The
# in-memory weight names transformers gives the dense families (Qwen's three, GLM-4.1V) are the ones vLLM's loaders
# take (their hf_to_vllm_mapper maps `model.language_model.` / `model.visual.` / `lm_head.`), so no dense family needs
# a name mapping for the sync. The mixture-of-experts ones are their dense siblings with routed experts in every
# layer: the same FSDP2 units (a decoder layer's unit holds its experts, sharded by expert), positions and vision
# tokens.
# (Qwen3.5's CPU engine shares no prefix, and vLLM sizes a hybrid model's blocks to its linear-attention state's:
# it keeps vLLM's own block size, not rollout.py's 32)
_QWEN3_5 = dict(
    linear_attention=True,
    vllm_cpu_kwargs={"enable_prefix_caching": False, "block_size": None},
    vllm_cpu_dtype=torch.bfloat16,
)
_GLM4V = dict(
    vision_tokens=GLM_VISION_TOKENS,
    videos=False,
    tools=False,
    sequence_parallel=False,
    vllm_text_config={"attention_bias": True},
)
_GEMMA4 = dict(
    vision_tokens=GEMMA_VISION_TOKENS,
    videos=False,
    tools=False,
    sequence_parallel=False,
    tower_lora=False,
)
FAMILIES = {
    "qwen2_5_vl": Family(tower_and_layers, 28),
    "qwen3_vl": Family(tower_and_layers, 32),
    "qwen3_5": Family(tower_and_layers, 32, **_QWEN3_5),
    "qwen3_vl_moe": Family(tower_and_layers, 32, moe=True),
    "qwen3_5_moe": Family(tower_and_layers, 32, **_QWEN3_5, moe=True),
    # GLM-4.1V: Qwen2.5-VL's 28 px tokens and 3-D positions (its get_rope_index takes the same arguments), its own
    # tower (learned position embeddings, a conv downsample before the merger, all inside model.visual), decoder
    # layers and vision tokens
    "glm4v": Family(tower_and_layers, 28, **_GLM4V),
    # Gemma 4 (dense: E2B, E4B, 31B): a SigLIP-style tower (model.model.vision_tower) whose 16 px patches pool 3 x 3
    # into soft tokens (48 px each), 1-D positions, sliding-window layers, logits soft-capped (logprobs.soft_capped).
    # Packed rows keep its sliding windows and, where its config asks, its images' bidirectional blocks (attention.py).
    # Its mixture of experts (26B-A4B) has the same model_type: of_config gives it moe=True.
    "gemma4": Family(gemma_tower_and_layers, 48, **_GEMMA4),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def unsupported_type(model_type) -> str | None:
    """Why a checkpoint of this model_type cannot be trained here, or None."""
    if model_type in SUPPORTED_MODEL_TYPES:
        return None
    return f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"


def refusal(model_type: str, sequence_parallel_size: int = 1, tools=(), max_videos_per_prompt: int = 0,
            engine: str = "hf", text_config=None, lora_targets=()) -> str | None:  # fmt: skip
    """Why a run with these settings cannot train a model_type checkpoint here (the first setting its family cannot
    run yet, named by its key), or None. Asked at start, before anything loads: the dry run's and the run's, and
    again once the data's videos are counted (rollout.max_videos_per_prompt at -1 becomes the data's most).
    `text_config`: the checkpoint's (its config's get_text_config()), held to Family.vllm_text_config when the
    engine is vLLM."""
    fam = FAMILIES.get(model_type)
    if fam is None:
        return None
    for key, want in fam.vllm_text_config.items() if engine == "vllm" else ():
        got = getattr(text_config, key, None)
        if got != want:
            return (f"rollout.engine=vllm: the checkpoint's text_config has {key}={got!r}, and vLLM's {model_type} "
                    f"model reads it (transformers' does not): it needs {want!r} to hold all of the checkpoint's "
                    "weights (rollout.engine=hf does not read it)")  # fmt: skip
    sp, videos = sequence_parallel_size, max_videos_per_prompt
    asks = (("actor.sequence_parallel_size", sp, sp > 1, fam.sequence_parallel),
            ("rollout.tools", list(tools), bool(tools), fam.tools),
            ("rollout.max_videos_per_prompt", videos, videos > 0, fam.videos),
            ("actor.lora_target_modules", list(lora_targets), any(t.startswith("visual.") for t in lora_targets),
             fam.tower_lora))  # fmt: skip
    for key, value, on, can in asks:
        if on and not can:
            what = {
                "rollout.max_videos_per_prompt": "videos (data.video_key)",
                "actor.lora_target_modules": "adapters in its vision tower (visual.NAME)",
            }.get(key, key)
            return f"{key}={value}: a {model_type} model cannot train with {what} here yet (docs/families.md)"
    if "experts" in lora_targets and getattr(text_config, "enable_moe_block", False):
        # (lora.EXPERT_PARAMS: the adapters go on mlp.experts.*, where Qwen's MoE holds them; Gemma 4's sit beside
        # the MLP, layers.N.experts.*)
        return (f"actor.lora_target_modules={list(lora_targets)}: a {model_type} model cannot train with adapters on "
                "its routed experts here yet (docs/families.md)")  # fmt: skip
    return None


def of_config(config) -> Family:
    """The Family of a model's config: its model_type's, with moe=True for Gemma 4's mixture of experts, which the
    dense models' model_type names too (its text config's enable_moe_block puts routed experts beside each layer's
    MLP)."""
    fam = FAMILIES[config.model_type]
    if getattr(config.get_text_config(), "enable_moe_block", False):
        return replace(fam, moe=True)
    return fam


def experts_problem(model_type: str, text_config: dict, needs: str) -> str | None:
    """Why a run cannot have what `needs` asks of routed experts on a checkpoint of this model_type and text config
    (config.json's), or None; `needs` is the config key and what it does ("actor.router_aux_loss_coef balances").
    Gemma 4's model_type names dense models too: its text config's enable_moe_block says which has experts."""
    if FAMILIES[model_type].moe or text_config.get("enable_moe_block"):
        return None
    return f"{needs} routed experts; a {model_type} model has none"


def family(model) -> Family:
    """The Family of a loaded model (by its config: of_config)."""
    return of_config(model.config)


def family_of(path: str) -> Family:
    """The Family of the checkpoint at `path` (its config.json only), for those that need it before the model loads:
    the rollout engines. An unsupported model_type stops here too."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    problem = unsupported_type(config.model_type)
    if problem:
        raise ValueError(f"{path}: {problem}")
    return of_config(config)


def processor_problem(path: str, want: int) -> str | None:
    """None if the checkpoint's processor fits images to its family's side (`want`, Family.image_side), else why not: a
    processor of another family beside the weights (a Qwen2.5-VL preprocessor_config.json with Qwen3-VL weights)
    would make image tokens that the vision tower cannot produce."""
    from transformers import AutoImageProcessor

    from grpo.media import image_side

    side = image_side(AutoImageProcessor.from_pretrained(path))
    if side != want:
        return f"its image processor fits images to {side} px (patch x merge), its model family's tower to {want}"
    return None
