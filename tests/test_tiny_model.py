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


def test_repetition_loop_holds_an_answer_once_entered(tmp_path, tiny_model_dir, tiny_processor):
    """Guards bench/bench_partial.py's loop workload, whose long tail is answers caught in the repetition loop: after
    a loop token the next is a loop token again and the end of answer all but impossible (a feature read from the
    wrong dimension, or with the wrong sign, gives the plain model's odds), while a model built without loop_logit
    (every other test's) keeps the plain odds."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from scripts.make_tiny_model import LOOP_TOKENS, build_tiny_model

    tok = tiny_processor.tokenizer
    loop, eos = list(LOOP_TOKENS), tok.convert_tokens_to_ids("<|im_end|>")
    prompt = tok("<|im_start|>user\nFind x.<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    g = torch.Generator().manual_seed(0)
    answers = torch.randint(0, 256, (8, 24), generator=g)  # byte tokens, none of them a loop token
    answers[:, -5:] = torch.tensor(loop)[torch.randint(0, len(loop), (8, 5), generator=g)]
    ids = torch.cat([torch.tensor([prompt] * 8), answers], 1)

    def odds(path):
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path).eval()
        with torch.no_grad():
            probs = model(input_ids=ids).logits[:, -5:].softmax(-1)  # the next token after each loop token
        return probs[..., loop].sum(-1), probs[..., eos]

    in_loop, end = odds(build_tiny_model(str(tmp_path), seed=0, eos_logit=10.0, loop_logit=10.5))
    assert in_loop.min() > 0.98 and end.max() < 1e-4, (in_loop, end)
    plain, _ = odds(tiny_model_dir)
    assert plain.max() < 0.1, plain
