"""Load an exported model directory with vLLM (CPU build) and generate; write what came out as JSON.

Used by test_checkpoint.py, in its own process so vLLM's thread binding stays out of the test process:

    python tests/export_vllm_check.py MODEL_DIR OUT.json

Writes the greedy tokens and their log-probs for a text-only prompt (the test re-scores them with transformers) and
the tokens generated for a prompt with an image, which goes through the exported processor and chat template.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, as the trainer runs it

TEXT_PROMPT = [20, 31, 42, 53, 64, 75, 86, 97]
MAX_TOKENS = 8


def main(model_dir, out_path):
    from PIL import Image, ImageDraw
    from transformers import AutoProcessor
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model_dir, dtype="float32", kv_cache_memory_bytes=64 << 20, enforce_eager=True,
        limit_mm_per_prompt={"image": 1, "video": 0}, seed=0,
    )  # fmt: skip
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    text = llm.generate([{"prompt_token_ids": TEXT_PROMPT}], greedy)[0].outputs[0]

    processor = AutoProcessor.from_pretrained(model_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x."}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    image = Image.new("RGB", (84, 56), "white")
    ImageDraw.Draw(image).line((0, 0, 60, 40), fill="black", width=3)
    with_image = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": image}}], greedy)[0].outputs[0]

    result = {
        "prompt_ids": TEXT_PROMPT,
        "text_tokens": list(text.token_ids),
        "text_logprobs": [lp[t].logprob for t, lp in zip(text.token_ids, text.logprobs)],
        "image_tokens": list(with_image.token_ids),
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
