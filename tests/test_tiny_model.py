"""Checks that the tiny test checkpoint behaves like a real Qwen2.5-VL where the trainer depends on it."""

import json
from pathlib import Path

import torch
from PIL import Image

from scripts.make_tiny_model import QWEN_SPECIAL_TOKENS


def test_tokenizer_round_trips_and_knows_qwen_special_tokens(tiny_model_dir, tiny_processor):
    """Guards against a tokenizer that splits a special token into pieces (prompts then carry no real
    <|image_pad|> and rollouts never stop on <|im_end|>), loses text on decode, or has ids past the model's
    embedding."""
    tok = tiny_processor.tokenizer
    assert type(tok).__name__ == "Qwen2Tokenizer"
    text = "In triangle ABC, AB = 12. <think> x = \\frac{7}{2} </think> \\boxed{2 \\sqrt { 221 }} é°"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert [tok.decode([i]) for i in tok("0123456789")["input_ids"]] == list("0123456789")

    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in QWEN_SPECIAL_TOKENS]
    assert all(len(i) == 1 for i in ids), ids
    ids = [i[0] for i in ids]
    assert len(set(ids)) == len(ids)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"

    config = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    assert max(ids) < len(tok) <= config["text_config"]["vocab_size"]
    assert config["image_token_id"] == tok.convert_tokens_to_ids("<|image_pad|>")
    assert config["vision_start_token_id"] == tok.convert_tokens_to_ids("<|vision_start|>")


def test_processor_expands_image_pads_and_model_runs(tiny_model_dir, tiny_processor):
    """Guards against a processor/model mismatch: the wrong number of <|image_pad|> per image makes the
    forward fail with "Image features and image tokens do not match", and bad weights give NaN logits."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    width, height = 84, 56  # multiples of 28 inside the default pixel budget, so no resize rounding
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x."}]}]
    text = tiny_processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    batch = tiny_processor(text=[text], images=[Image.new("RGB", (width, height), (90, 160, 30))], return_tensors="pt")

    image_pad = tiny_processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert (batch["input_ids"] == image_pad).sum().item() == (height // 28) * (width // 28)
    assert batch["image_grid_thw"].tolist() == [[1, height // 14, width // 14]]

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape[:2] == batch["input_ids"].shape
    assert torch.isfinite(logits).all()


def test_chat_template_renders_like_qwen(tiny_processor):
    """Guards against prompt drift from Qwen2.5-VL's format (default system turn, newlines, vision block
    per image part): the trained model would see prompts unlike those the real model was tuned on."""
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look at "},
                {"type": "image"},
                {"type": "text", "text": " and find x."},
            ],
        }
    ]
    rendered = tiny_processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nLook at <|vision_start|><|image_pad|><|vision_end|> and find x.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
