"""Build a tiny, randomly initialised Qwen VL checkpoint for offline CPU tests.

The checkpoint has the real layout of its family (tokenizer class, special tokens, chat template,
processor classes, model class and weight names) but only ~1M parameters, so tests exercise the same
code paths as the real models (HF training forward, vLLM rollout, weight sync) in seconds. Families:
qwen2_5_vl (default), qwen3_vl (dense; deepstack mergers, q/k norms, 32 px patches), qwen3_5 (dense; linear-attention
and full-attention layers mixed), their mixture-of-experts versions qwen3_vl_moe and qwen3_5_moe (4 experts, top-2;
Qwen3.5's with its shared expert), glm4v (GLM-4.1V: its own tokenizer, special tokens and chat template, a
tower with learned position embeddings and a conv downsample before its merger, partial rotary mRoPE) and gemma4
(Gemma 4 E2B shrunk: its own tokenizer class, special tokens and chat template, sliding-window and full-attention
layers, shared keys and values, per-layer input embeddings, soft-capped logits, a tower pooling patches into soft
tokens), and gemma4_moe (the same with 26B-A4B's experts beside each layer's MLP: 4 experts, top-2).

Usage: python scripts/make_tiny_model.py OUT_DIR [--seed N]
       [--family qwen2_5_vl|qwen3_vl|qwen3_5|qwen3_vl_moe|qwen3_5_moe|glm4v|gemma4|gemma4_moe]
       [--tools] [--digit-logit X]
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer
from transformers import (
    Gemma4AudioFeatureExtractor,
    Gemma4Config,
    Gemma4ForConditionalGeneration,
    Gemma4ImageProcessor,
    Gemma4Processor,
    Gemma4VideoProcessor,
    GemmaTokenizer,
    GenerationConfig,
    Glm4vConfig,
    Glm4vForConditionalGeneration,
    Glm4vImageProcessor,
    Glm4vProcessor,
    Glm4vVideoProcessor,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2Tokenizer,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5Tokenizer,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

# Qwen2.5-VL's special tokens, in Qwen's id order (151643 .. 151656 in the real vocabulary). Here they
# follow the trained BPE vocabulary in the same order, so relative offsets match the real model.
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen2.5/Qwen3's tool-call markers (151657, 151658 in the real vocabulary, right after the vision tokens): added
# tokens, never split, but not special (decoding keeps them, as Qwen's tokenizers do). Only in a model built with
# tools=True, so that the other tiny models (and the demos' figures) keep their vocabulary and weights.
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]
# A random model writes </tool_call> about 1 time in 500 tokens: the tool demo needs calls to learn from (a real
# model's tool-use tuning gives it them). So the embedding of the token that ends an assistant header ("\n" after
# `<|im_start|>assistant`, the prompt's last token and a tool turn's) carries TOOL_CALL_FEATURE in hidden dimension 0
# (every other token 0 there), and only </tool_call>'s LM-head row reads it: a logit offset of TOOL_CALL_LOGIT at the
# first position of a turn (99.7% a call at the prompt's end; ~0.3% a token elsewhere, as any token). A turn that
# calls is then one token long, and the answer after the tool turn comes at once, as in the vision demo's short
# answers. Tried first: the offset at every position (the call landed ~50 tokens into the answer, and </tool_call>s
# filled the last turn around the digit), and a feature of 1 (the final norm's dimension 0 then shrank as soon as one
# Adam step grew the others: one Adam step at lr 3e-3 on a tiny gradient for another first token took the first-token
# call rate from 55% to 1%). At 10 (offset 10, 98% calls) the norm held one step, not a run: as the answer format was
# learnt the other dimensions of the state at a turn's start grew, the normed feature shrank with them, and at some
# seeds the call share fell from 0.9 to 0.1-0.4 within 3-4 steps, mid-run, before the picture was read (issue 58;
# docs/tools.md). At 100 the final norm's dimension 0 stays at sqrt(hidden) whatever the others do, and the other
# dimensions' share of a turn's first logits is cut 10-fold; offset 12 leaves a rare non-calling answer (0.25%),
# whose large gradient against the call was the other push.
TOOL_CALL_FEATURE, TOOL_CALL_LOGIT = 100.0, 12.0

# A repetition loop (build_tiny_model's `loop_logit`), the long tail of RL answers that repeat themselves until
# max_tokens: LOOP_TOKENS, eight ordinary tokens, carry LOOP_FEATURE in hidden dimension 1 (every other token 0
# there), which saturates the final norm as TOOL_CALL_FEATURE does; only their LM-head rows and the end of answer's
# read it. After a loop token the next one is a loop token again with probability over 0.99 at loop_logit 10.5
# (tests/test_tiny_model.py), and the end of answer is LOOP_EOS less likely, so a loop runs on for a hundred tokens
# or more. Outside it the loop tokens' logits are LOOP_ENTRY lower (along the mean final state, as eos_logit raises
# the end's), so only a few answers in a hundred fall into one.
LOOP_TOKENS, LOOP_FEATURE, LOOP_EOS, LOOP_ENTRY = range(300, 308), 10.0, 8.0, 3.5

# A model that writes digits (build_tiny_model's `digit_logit`), the distillation demo's teacher: every token's
# embedding carries DIGIT_FEATURE in hidden dimension 2, which saturates the final norm there at every position as
# TOOL_CALL_FEATURE does at one, and only the ten digits' LM-head rows read it: their logits raised by digit_logit
# wherever the model writes, whatever the prompt. (Raising them along the mean final state, as eos_logit does, held
# on short chat prompts but not on the demo's: the teacher then wrote 7 % digits there.)
DIGIT_FEATURE = 100.0

# Renders like Qwen2.5-VL's template: a default system turn when the first message is not a system
# message, `<|im_start|>role\n...<|im_end|>\n` per message, list content concatenated part by part with
# each image/video replaced by its vision block, and `<|im_start|>assistant\n` as the generation prompt.
CHAT_TEMPLATE = (
    "{% set ns = namespace(images=0, videos=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{% set ns.images = ns.images + 1 %}"
    "{% if add_vision_id %}Picture {{ ns.images }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "{% set ns.videos = ns.videos + 1 %}"
    "{% if add_vision_id %}Video {{ ns.videos }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}"
    "{{ part['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "<|im_start|>assistant\n"
    "{% endif %}"
)

# Tiny-model pixel budget: 56x56 .. 112x112 gives 4..16 merged image tokens per image. The trainer
# overrides both from its config; vLLM must be given the same values.
MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------


def synthetic_corpus(seed: int, n_lines: int = 600) -> list[str]:
    """Geometry3K-like text so BPE merges cover the words, LaTeX and tags the trainer will see."""
    rng = random.Random(seed)
    letters = "ABCDEFGHJKLMNPQRSTWXYZ"
    shapes = ["triangle", "rectangle", "circle", "parallelogram", "trapezoid", "rhombus", "square", "kite"]
    asks = ["Find x.", "Find y.", "Find the area of the figure.", "Find the perimeter.", "Find m \\angle 2."]
    fmt_prompt = (
        "You FIRST think about the reasoning process as an internal monologue and then provide the final "
        "answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST "
        "BE put in \\boxed{}."
    )

    def num() -> str:
        return str(rng.randint(0, 360))

    def answer() -> str:
        kind = rng.randrange(4)
        if kind == 0:
            return num()
        if kind == 1:
            return f"\\frac{{{num()}}}{{{rng.randint(1, 9)}}}"
        if kind == 2:
            return f"{rng.randint(2, 9)} \\sqrt {{ {num()} }}"
        return f"{num()}.{rng.randint(0, 9)}"

    lines = ["You are a helpful assistant.", "system", "user", "assistant", fmt_prompt]
    for _ in range(n_lines):
        a, b, c = rng.sample(letters, 3)
        shape = rng.choice(shapes)
        lines.append(
            f"<image>In {shape} {a}{b}{c}, {a}{b} = {num()} and m \\angle {b}{c}{a} = {num()}. {rng.choice(asks)}"
        )
        lines.append(
            f"<think> The {shape} has side {a}{b} = {num()}, so x = \\sqrt{{{num()}^2 + {num()}^2}} and "
            f"the angle is {num()} degrees. </think> The answer is \\boxed{{{answer()}}}."
        )
    return lines


def train_bpe(corpus: list[str], vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train a byte-level BPE with Qwen2's exact pre-tokenisation; return its vocab and merges.

    Every one of the 256 byte symbols is in the vocabulary, so any text round-trips; Qwen's split
    regex isolates single digits, so each digit 0-9 stays its own token, as in the real tokenizer.
    """
    tok = Tokenizer(BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges


def build_tokenizer(seed: int, vocab_size: int, tokenizer_class=Qwen2Tokenizer, tools: bool = False) -> Qwen2Tokenizer:
    """A Qwen2Tokenizer (same pipeline and special tokens as Qwen2.5-VL and Qwen3-VL; Qwen3.5 has its own class with
    the same pipeline) over a tiny trained BPE."""
    vocab, merges = train_bpe(synthetic_corpus(seed), vocab_size)
    tokenizer = tokenizer_class(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        errors="replace",
        model_max_length=32768,
        split_special_tokens=False,
    )
    # Appended after the BPE vocab in Qwen's order; all special so they are never split or merged.
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL_TOKENS[1:]})
    if tools:
        tokenizer.add_tokens(TOOL_TOKENS)
    # Qwen2.5-VL (an instruct model) ends a turn with <|im_end|>; padding uses <|endoftext|>.
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# --------------------------------------------------------------------------------------------------
# Processor and model
# --------------------------------------------------------------------------------------------------


def build_processor(tokenizer: Qwen2Tokenizer) -> Qwen2_5_VLProcessor:
    """The real processor classes with a tiny pixel budget (patch 14, merge 2 like Qwen2.5-VL)."""
    image_processor = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    video_processor = Qwen2VLVideoProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    return Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )


def build_config(tokenizer: Qwen2Tokenizer) -> Qwen2_5_VLConfig:
    """Qwen2.5-VL architecture shrunk to the smallest shapes both transformers and vLLM's CPU backend run."""
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in QWEN_SPECIAL_TOKENS}
    # Exactly one row per token. The real model has spare rows (151936 for 151665 tokens) that training
    # never lets it sample, but a random model would sample them often and they decode to nothing.
    vocab_size = len(tokenizer)
    head_dim = 64  # vLLM's CPU attention supports 64 but not 16
    text_config = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim = 128 / 2 = 64
        num_key_value_heads=1,  # grouped-query attention, as in the 3B/7B models
        hidden_act="silu",
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        initializer_range=0.02,
        # mRoPE splits the rotary half-dimension (head_dim / 2 = 32) into temporal/height/width sections.
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [8, 12, 12]},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    assert sum(text_config["rope_parameters"]["mrope_section"]) == head_dim // 2
    vision_config = dict(
        depth=2,
        hidden_size=128,
        intermediate_size=256,
        num_heads=2,  # head_dim 64
        in_channels=3,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[1],  # layer 0 windowed, layer 1 full attention: both paths are exercised
        out_hidden_size=128,
        tokens_per_second=2,
        initializer_range=0.02,
    )
    return Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
        dtype="float32",
    )


def build_generation_config(tokenizer: Qwen2Tokenizer) -> GenerationConfig:
    """Stop on either end token. No sampling defaults: vLLM adopts them as SamplingParams defaults."""
    end_of_text = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return GenerationConfig(bos_token_id=end_of_text, eos_token_id=[im_end, end_of_text], pad_token_id=end_of_text)


def build_qwen3_processor(tokenizer) -> Qwen3VLProcessor:
    """Qwen3-VL's and Qwen3.5's processor: the Qwen2-VL image processor at patch 16 x merge 2 (32 px per merged
    token), Qwen3-VL's video processor."""
    image_processor = Qwen2VLImageProcessor(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=16, merge_size=2, temporal_patch_size=2
    )
    video_processor = Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2)
    return Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )


def _token_ids(tokenizer) -> dict:
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in QWEN_SPECIAL_TOKENS}
    return dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    ), dict(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])


def _qwen3_vision(deepstack: bool) -> dict:
    """Qwen3-VL's vision tower (also Qwen3.5's), shrunk: patch 16, merge 2, learned position embeddings (an 8 x 8
    grid, interpolated to the image), and with `deepstack` two mergers whose outputs are added to the first two
    decoder layers' image tokens."""
    return dict(
        depth=2,
        hidden_size=128,
        intermediate_size=256,
        num_heads=2,  # head_dim 64
        in_channels=3,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=128,
        num_position_embeddings=64,
        initializer_range=0.02,
        **({"deepstack_visual_indexes": [0, 1]} if deepstack else {}),
    )


# The tiny mixture of experts: few experts, each token routed to two, so that a short batch reaches every expert and
# the routing (which two a token takes) matters; every layer's MLP is one (decoder_sparse_step 1, as in the real
# models). Qwen3.5's adds its shared expert, beside the routed ones behind a sigmoid gate.
TINY_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96)


def build_qwen3_vl_config(tokenizer, moe: bool = False) -> Qwen3VLConfig | Qwen3VLMoeConfig:
    """Qwen3-VL (dense) shrunk: q/k RMS norms in attention, interleaved mRoPE, deepstack mergers. With `moe`,
    Qwen3-VL-MoE (Qwen3-VL-30B-A3B's architecture): each layer's MLP a routed mixture of experts, stored as two 3-D
    tensors a layer."""
    vision_ids, special = _token_ids(tokenizer)
    text_config = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,  # vLLM's CPU attention supports 64 but not 16
        hidden_act="silu",
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        # sections of the rotary half-dimension (32), interleaved t/h/w as in the real model
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [12, 10, 10],
                         "mrope_interleaved": True},
        **special,
        # norm_topk_prob: the routing weights of a token's top-k renormalised to sum to 1, as transformers' router
        # always does; Qwen3-VL-30B-A3B's config.json says so and vLLM's loader reads the key
        **(dict(TINY_EXPERTS, decoder_sparse_step=1, norm_topk_prob=True) if moe else {}),
    )  # fmt: skip
    return (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(
        text_config=text_config,
        vision_config=_qwen3_vision(deepstack=True),
        **vision_ids,
        tie_word_embeddings=False,
        dtype="float32",
    )


def build_qwen3_5_config(tokenizer, moe: bool = False) -> Qwen3_5Config | Qwen3_5MoeConfig:
    """Qwen3.5 (dense) shrunk: layer 0 linear attention (gated delta net), layer 1 full attention (gated, partial
    rotary), the real model's 3:1 pattern cut to one of each. With `moe`, Qwen3.5-MoE (Qwen3.5-35B-A3B's
    architecture): each layer's MLP routed experts plus a shared expert."""
    vision_ids, special = _token_ids(tokenizer)
    text_config = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=64,  # vLLM's CPU gated-delta-net kernel rejects 32
        linear_value_head_dim=64,
        linear_num_key_heads=1,
        linear_num_value_heads=2,  # two value heads per key head, as in the real model
        hidden_act="silu",
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        # a quarter of head_dim rotates (16 dims, half 8), split into interleaved t/h/w sections
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        **special,
        **(dict(TINY_EXPERTS, shared_expert_intermediate_size=64) if moe else {}),
    )  # fmt: skip
    if moe:  # its MLPs are all experts: no dense size
        del text_config["intermediate_size"]
    return (Qwen3_5MoeConfig if moe else Qwen3_5Config)(
        text_config=text_config,
        vision_config=_qwen3_vision(deepstack=False),
        **vision_ids,
        tie_word_embeddings=False,
        dtype="float32",
    )


# GLM-4.1V's special tokens, in its id order (151329 .. 151344 in the real vocabulary): the end of text, GLM's mask and
# start-of-piece markers, the four roles, and the image and video wrappers with their one placeholder each. Here they
# follow the trained BPE vocabulary in the same order.
GLM_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
]

# GLM-4's pre-tokenisation (tiktoken's cl100k pattern), which lets digits merge in runs of up to three, unlike Qwen's.
# The tiny BPE is trained on Qwen's split (train_bpe), so it has no multi-digit merges and each digit stays one token
# here too (the toy rewards count digits).
GLM_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Renders like GLM-4.1V's template: `[gMASK]<sop>` once, then each message as its role token, a newline and its
# content (no end-of-turn token: the next role token ends a turn, and the model ends its answer with `<|user|>` or
# `<|endoftext|>`), an image or video as its begin/placeholder/end triple, and `<|assistant|>\n` as the generation
# prompt. No default system turn.
GLM_CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "<|begin_of_video|><|video|><|end_of_video|>"
    "{% elif 'text' in part %}"
    "{{ part['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "<|assistant|>\n"
    "{% endif %}"
)


# Gemma 4's special tokens, in the order the tiny vocabulary gets them: Gemma's first five (pad 0, eos 1, bos 2, unk 3,
# mask 4, as in the real vocabulary), then its turn markers and the image, video and audio markers. Named ones are
# read by Gemma4Processor from the tokenizer (image_token, boi_token, ...), the turn end stops an answer.
GEMMA_SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|image>", "<image|>",
                        "<|image|>", "<|video|>", "<|audio>", "<audio|>", "<|audio|>"]  # fmt: skip
GEMMA_NAMED_TOKENS = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
                      "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}  # fmt: skip

# Renders as Gemma 4's template does for what the trainer sends: `<bos>` once, then `<|turn>role\n...<turn|>\n` per
# message with the assistant's role written `model`, an image as its `<|image|>` placeholder (which the processor
# widens to `<|image>` + one `<|image|>` per soft token + `<image|>`), a video as `<|video|>`, and
# `<|turn>model\n` as the generation prompt.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|image|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "<|video|>"
    "{% elif 'text' in part %}"
    "{{ part['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "<turn|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "<|turn>model\n"
    "{% endif %}"
)


def build_glm_tokenizer(seed: int, vocab_size: int, tokenizer_class=PreTrainedTokenizerFast, tools: bool = False):
    """GLM-4.1V's tokenizer (a byte-level BPE behind transformers' generic fast tokenizer, as the checkpoint's
    tokenizer.json is) over a tiny trained BPE, with GLM's special tokens and chat template."""
    if tools:
        raise ValueError("--tools: the tool turns are written in Qwen's chat format (grpo/turns.py)")
    vocab, merges = train_bpe(synthetic_corpus(seed), vocab_size)
    backend = Tokenizer(BPE(vocab=vocab, merges=merges))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(GLM_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    tokenizer = tokenizer_class(
        tokenizer_object=backend,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=65536,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": GLM_SPECIAL_TOKENS[1:]})
    tokenizer.chat_template = GLM_CHAT_TEMPLATE
    return tokenizer


def build_glm4v_processor(tokenizer) -> Glm4vProcessor:
    """GLM-4.1V's processor: its own image processor at patch 14 x merge 2 (28 px per merged token, as Qwen2.5-VL's),
    which counts the two temporal copies of an image against its pixel budget, and its video processor."""
    size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    image_processor = Glm4vImageProcessor(size=size, patch_size=14, merge_size=2, temporal_patch_size=2)
    video_processor = Glm4vVideoProcessor(patch_size=14, merge_size=2, temporal_patch_size=2)
    return Glm4vProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=GLM_CHAT_TEMPLATE,
    )


def build_glm4v_config(tokenizer) -> Glm4vConfig:
    """GLM-4.1V shrunk: biased q/k/v, a fused gate_up MLP and four norms per decoder layer, mRoPE over half of each
    head (partial_rotary_factor 0.5, as the real model's); a tower with learned position embeddings (an 8 x 8 grid,
    interpolated to the image) and a conv downsample before its merger."""
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in GLM_SPECIAL_TOKENS}
    special = dict(bos_token_id=None, eos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"])
    text_config = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim = 128 / 2 = 64 (the model derives it; vLLM's CPU attention takes 64)
        num_key_value_heads=1,
        hidden_act="silu",
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        # q/k/v have biases in transformers whatever the config says, in vLLM only when it says so (its Glm4Attention
        # reads this key, which GLM-4.1V's config.json carries): without it vLLM drops the biases from every load and
        # sync, which a random model, its biases initialised to 0, would not show until they are trained
        attention_bias=True,
        # half of head_dim rotates (32 dims, half 16), split into t/h/w sections as the real model's [8, 12, 12]
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [4, 6, 6]},
        **special,
    )  # fmt: skip
    vision_config = dict(
        depth=2,
        hidden_size=128,
        intermediate_size=256,
        num_heads=2,  # head_dim 64
        in_channels=3,
        image_size=112,  # 8 x 8 learned position embeddings
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=128,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
    )
    return Glm4vConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"],
        image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"],
        video_end_token_id=ids["<|end_of_video|>"],
        tie_word_embeddings=False,
        dtype="float32",
        **special,
    )


def build_glm_generation_config(tokenizer) -> GenerationConfig:
    """GLM-4.1V's: an answer ends at the end of text, or where the model starts the next turn (`<|user|>`, or
    `<|observation|>` for a tool's output)."""
    stops = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|user|>", "<|observation|>"])
    return GenerationConfig(eos_token_id=stops, pad_token_id=stops[0])


def build_gemma_tokenizer(seed: int, vocab_size: int, tokenizer_class=GemmaTokenizer, tools: bool = False):
    """Gemma 4's tokenizer class (a BPE over `▁`-for-space text with byte fallback, digits split one by one) over a
    tiny trained vocabulary, with Gemma's special tokens, its named image/audio markers and its chat template."""
    if tools:
        raise ValueError("--tools: the tool turns are written in Qwen's chat format (grpo/turns.py)")
    corpus = [line.replace(" ", "\u2581") for line in synthetic_corpus(seed)]
    trainer_tok = Tokenizer(BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split("\u2581", behavior="merged_with_previous"), pre_tokenizers.Digits(individual_digits=True)]
    )
    trainer = BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                         special_tokens=GEMMA_SPECIAL_TOKENS[:5])  # fmt: skip
    trainer_tok.train_from_iterator(corpus, trainer=trainer)
    model = json.loads(trainer_tok.to_str())["model"]
    vocab = dict(model["vocab"])
    for byte in range(256):  # byte fallback: any character outside the vocabulary is spelled in bytes
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = tokenizer_class(vocab=vocab, merges=merges, model_max_length=131072,
                                extra_special_tokens=GEMMA_NAMED_TOKENS)  # fmt: skip
    tokenizer.add_special_tokens({"additional_special_tokens": GEMMA_SPECIAL_TOKENS[5:]})
    tokenizer.add_bos_token = False  # the chat template writes <bos>
    tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    return tokenizer


def build_gemma4_processor(tokenizer) -> Gemma4Processor:
    """Gemma 4's processor: 16 px patches pooled 3 x 3 into soft tokens (48 px each), every image resized, aspect
    kept, to fill the soft-token budget (70, the smallest the image processor accepts)."""
    return Gemma4Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=Gemma4ImageProcessor(max_soft_tokens=70),
        tokenizer=tokenizer,
        video_processor=Gemma4VideoProcessor(max_soft_tokens=70),
        chat_template=GEMMA_CHAT_TEMPLATE,
        image_seq_length=70,
    )


def build_gemma4_config(tokenizer, moe: bool = False) -> Gemma4Config:
    """Gemma 4 E2B's shape shrunk: sliding-window and full-attention layers (wider heads on the full ones, rotary on
    a quarter of them), the last layers reusing earlier layers' keys and values (num_kv_shared_layers) with the
    double-wide MLP, per-layer input embeddings (hidden_size_per_layer_input), tied embeddings, logits soft-capped
    at 30, no bidirectional image attention (use_bidirectional_attention unset, as E2B's); a SigLIP-style tower
    pooling 3 x 3 patches into a soft token, its linears clipped. No audio tower (the trainer sends no audio).
    With `moe`, every layer has 26B-A4B's mixture of experts beside its MLP (enable_moe_block: a router of its own
    and 4 routed experts, top-2, their outputs added to the MLP's), on E2B's other parts: the trainer's MoE code
    meets E2B's per-layer embeddings and shared keys and values, which 26B-A4B has not."""
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in GEMMA_SPECIAL_TOKENS}
    special = dict(pad_token_id=ids["<pad>"], eos_token_id=ids["<eos>"], bos_token_id=ids["<bos>"])
    text_config = dict(
        vocab_size=len(tokenizer),
        vocab_size_per_layer_input=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,  # vLLM's CPU attention takes 64 and 128
        global_head_dim=128,
        sliding_window=32,  # shorter than a prompt with an image: the window is exercised
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=16,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        max_position_embeddings=32768,
        **special,
    )
    if moe:
        text_config.update(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=64)
    vision_config = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
        patch_size=16,
        pooling_kernel_size=3,
        position_embedding_size=64,
        use_clipped_linears=True,  # as E2B's: each linear's input and output clip bounds, buffers in the checkpoint
        initializer_range=0.02,
        # the soft tokens of an image at the processor's budget: vLLM's gemma4_mm sizes its encoder budget by it
        # (transformers' config class has no such field; the real configs carry it, 280)
        default_output_length=70,
    )
    return Gemma4Config(
        text_config=text_config,
        vision_config=vision_config,
        audio_config=None,
        image_token_id=ids["<|image|>"],
        video_token_id=tokenizer.convert_tokens_to_ids("<|video|>"),
        boi_token_id=ids["<|image>"],
        eoi_token_id=ids["<image|>"],
        audio_token_id=ids["<|audio|>"],
        boa_token_id=ids["<|audio>"],
        eoa_token_id=ids["<audio|>"],
        vision_soft_tokens_per_image=70,  # (the real configs': 280)
        tie_word_embeddings=True,
        dtype="float32",
    )


def build_gemma_generation_config(tokenizer) -> GenerationConfig:
    """Gemma 4's: an answer ends at the end of a turn (`<turn|>`) or the end of text."""
    stops = tokenizer.convert_tokens_to_ids(["<turn|>", "<eos>"])
    return GenerationConfig(eos_token_id=stops, pad_token_id=tokenizer.pad_token_id,
                            bos_token_id=tokenizer.bos_token_id)  # fmt: skip


# family -> (tokenizer class, processor builder, config builder, model class)
FAMILIES = {
    "qwen2_5_vl": (Qwen2Tokenizer, build_processor, build_config, Qwen2_5_VLForConditionalGeneration),
    "qwen3_vl": (Qwen2Tokenizer, build_qwen3_processor, build_qwen3_vl_config, Qwen3VLForConditionalGeneration),
    "qwen3_5": (Qwen3_5Tokenizer, build_qwen3_processor, build_qwen3_5_config, Qwen3_5ForConditionalGeneration),
    "qwen3_vl_moe": (Qwen2Tokenizer, build_qwen3_processor, functools.partial(build_qwen3_vl_config, moe=True),
                     Qwen3VLMoeForConditionalGeneration),
    "qwen3_5_moe": (Qwen3_5Tokenizer, build_qwen3_processor, functools.partial(build_qwen3_5_config, moe=True),
                    Qwen3_5MoeForConditionalGeneration),
    "glm4v": (PreTrainedTokenizerFast, build_glm4v_processor, build_glm4v_config, Glm4vForConditionalGeneration),
    "gemma4": (GemmaTokenizer, build_gemma4_processor, build_gemma4_config, Gemma4ForConditionalGeneration),
    "gemma4_moe": (GemmaTokenizer, build_gemma4_processor, functools.partial(build_gemma4_config, moe=True),
                   Gemma4ForConditionalGeneration),
}  # fmt: skip
# family -> (tokenizer builder, generation config builder), where not Qwen's
TOKENIZERS = {
    "glm4v": (build_glm_tokenizer, build_glm_generation_config),
    "gemma4": (build_gemma_tokenizer, build_gemma_generation_config),
    "gemma4_moe": (build_gemma_tokenizer, build_gemma_generation_config),
}


def _final_feature(model, tokenizer, dim: int = 0) -> float:
    """Hidden dimension `dim` after the final norm at the end of a generation prompt (where TOOL_CALL_FEATURE is)."""
    ids = torch.tensor([tokenizer("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")["input_ids"]])
    return model.model.language_model(input_ids=ids).last_hidden_state[0, -1, dim].item()


def build_tiny_model(
    out_dir: str,
    seed: int = 0,
    vocab_size: int = 400,
    family: str = "qwen2_5_vl",
    tools: bool = False,
    eos_logit: float = 0.0,
    loop_logit: float = 0.0,
    digit_logit: float = 0.0,
) -> str:
    """Write tokenizer, processor, config, generation config and seeded random fp32 weights to out_dir.

    vocab_size is the size of the trained byte-level BPE vocabulary (>= 256 bytes) before the 14 Qwen (16 GLM)
    special tokens are appended (and with `tools` the two tool-call tokens). `eos_logit` > 0 raises the
    end-of-answer token's logit by about that much: a random model then ends its answers at varied lengths (the
    final hidden states share a mean direction; their projection on it varies by +-40 % from position to position)
    rather than always at max_tokens. `loop_logit` > 0 adds a repetition loop (LOOP_TOKENS): with eos_logit, most
    answers end within a few dozen tokens and a few percent run on for hundreds, some to max_tokens, a heavy tail.
    `digit_logit` > 0 raises the ten digits' logits by that much at every position (DIGIT_FEATURE): the model then
    writes mostly digits, as the demo's toy reward teaches it to (the distillation demo's teacher, docs/distill.md).
    Returns out_dir.
    """
    tokenizer_class, make_processor, make_config, model_class = FAMILIES[family]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer, make_generation_config = TOKENIZERS.get(family, (build_tokenizer, build_generation_config))
    if family.startswith("gemma4") and (eos_logit or loop_logit or digit_logit):
        # its LM head is its embedding (tied), which these edits would change together
        raise ValueError(f"{family}: eos_logit, loop_logit and digit_logit edit the LM head, tied to the embedding")
    tokenizer = make_tokenizer(seed, vocab_size, tokenizer_class, tools)
    processor = make_processor(tokenizer)
    config = make_config(tokenizer)

    torch.manual_seed(seed)  # the model's _init_weights draws normal(0, initializer_range) from this
    model = model_class(config).to(torch.float32)
    if family == "gemma4_moe":
        # Gemma 4's routers scale their input per dimension and each expert's combine weight (per_expert_scale),
        # both initialised to ones: drawn here, so that a forward which dropped either, or a sync that missed it,
        # gives other log-probs (a released checkpoint's are trained)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for layer in model.model.language_model.layers:
                layer.router.scale.uniform_(0.5, 1.5, generator=g)
                layer.router.per_expert_scale.uniform_(0.5, 1.5, generator=g)
    if tools:
        with torch.no_grad():
            header_end = tokenizer("<|im_start|>assistant\n")["input_ids"][-1]
            model.model.language_model.embed_tokens.weight[:, 0] = 0.0
            model.model.language_model.embed_tokens.weight[header_end, 0] = TOOL_CALL_FEATURE
            feature = _final_feature(model, tokenizer)
            model.lm_head.weight[:, 0] = 0.0
            model.lm_head.weight[tokenizer.convert_tokens_to_ids(TOOL_TOKENS[1]), 0] = TOOL_CALL_LOGIT / feature
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)  # <|im_end|> (Qwen's), <|endoftext|> (GLM's)
    if loop_logit:
        with torch.no_grad():
            loop = list(LOOP_TOKENS)
            model.model.language_model.embed_tokens.weight[:, 1] = 0.0
            model.model.language_model.embed_tokens.weight[loop, 1] = LOOP_FEATURE
            ids = torch.randint(0, vocab_size, (8, 64), generator=torch.Generator().manual_seed(seed))
            ids[:, -1] = loop[0]
            feature = model.model.language_model(input_ids=ids).last_hidden_state[:, -1, 1].mean().item()
            model.lm_head.weight[:, 1] = 0.0
            model.lm_head.weight[loop, 1] = loop_logit / feature
            model.lm_head.weight[eos, 1] = -LOOP_EOS / feature
    if eos_logit or loop_logit:
        with torch.no_grad():
            ids = torch.randint(0, vocab_size, (8, 64), generator=torch.Generator().manual_seed(seed))
            hidden = model.model.language_model(input_ids=ids).last_hidden_state.reshape(
                -1, config.text_config.hidden_size
            )
            mean = hidden.mean(0)
            model.lm_head.weight[eos] += eos_logit * mean / mean.square().sum()
            if loop_logit:
                model.lm_head.weight[list(LOOP_TOKENS)] -= LOOP_ENTRY * mean / mean.square().sum()
    if digit_logit:
        with torch.no_grad():
            model.model.language_model.embed_tokens.weight[:, 2] = DIGIT_FEATURE
            feature = _final_feature(model, tokenizer, dim=2)
            model.lm_head.weight[:, 2] = 0.0
            model.lm_head.weight[tokenizer.convert_tokens_to_ids(list("0123456789")), 2] = digit_logit / feature
    model.generation_config = make_generation_config(tokenizer)

    model.save_pretrained(out, safe_serialization=True)
    if family == "qwen3_vl_moe":
        transpose_experts(out / "model.safetensors")
    processor.save_pretrained(out)
    return str(out)


def transpose_experts(file: Path) -> None:
    """Store Qwen3-VL-MoE's experts as Qwen's released checkpoints do (Qwen3-VL-30B-A3B: gate_up_proj (E, H, 2I),
    down_proj (E, I, H)), the layout vLLM's loader takes, rather than transformers' in-memory (E, 2I, H) that its
    save_pretrained writes: the trainer must read, export and sync the layout users have."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    for key in [k for k in tensors if k.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        tensors[key] = tensors[key].transpose(1, 2).contiguous()
    save_file(tensors, file, metadata={"format": "pt"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen2_5_vl")
    parser.add_argument("--tools", action="store_true", help="add the <tool_call> </tool_call> tokens")
    parser.add_argument("--digit-logit", type=float, default=0.0, help="raise the digits' logits by about this much")
    args = parser.parse_args()
    start = time.perf_counter()
    path = build_tiny_model(args.out_dir, seed=args.seed, family=args.family, tools=args.tools,
                            digit_logit=args.digit_logit)  # fmt: skip
    print(f"tiny {args.family} written to {path} in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
