"""Run the HF engine under torchrun with FSDP2 when the ranks hold different numbers of prompts.

Used by test_hf_engine.py, which also imports the helpers below for its single-process tests.

    torchrun --nproc_per_node=2 tests/hf_engine_check.py MODEL_DIR OUT.json

Rank 0 holds prompts 0-2, rank 1 prompt 3; with n=2 and rollout.max_num_seqs=2, rank 0 needs three generate calls
and rank 1 one, so rank 1 must run two filler calls. Each rank generates greedily, then with sampling, then greedily
again with rank 1 holding no prompt at all (it must borrow a filler prompt with an image). Rank 0 writes every
rank's samples and the rows of each of its generate calls.
"""

import json
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])

import rollout  # noqa: E402
import train_grpo  # noqa: E402
from grpo import distributed, loading  # noqa: E402

N, MAX_TOKENS = 2, 8
RANK_PROMPTS = [[0, 1, 2], [3]]


def image_prompts(processor, count):
    """`count` prompts of different lengths, each with a figure of its own size."""
    from PIL import Image, ImageDraw

    prompts = []
    for i in range(count):
        img = Image.new("RGB", (56 + 28 * (i % 3), 84), "white")
        ImageDraw.Draw(img).line((0, 0, 40, 60 - 10 * i), fill="black", width=3)
        content = [{"type": "image"}, {"type": "text", "text": "Find x. " * (i + 1)}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        out = processor(text=[text], images=[img], return_tensors="pt")
        prompts.append(rollout.Prompt(out["input_ids"][0], out["pixel_values"], out["image_grid_thw"], [img]))
    return prompts


def tiny_policy(model_dir, processor):
    """The tiny model with its <|im_end|> logit scaled up: a random model would almost never end an answer, and the
    tests need answers that end early next to answers that hit the token limit."""
    model = loading.load_model(model_dir, torch.device("cpu"), "sdpa")
    with torch.no_grad():
        model.lm_head.weight[processor.tokenizer.convert_tokens_to_ids("<|im_end|>")] *= 80
    return model.eval()


def hf_engine(processor, max_num_seqs):
    from grpo.hf_engine import HFEngine

    cfg = train_grpo.load_config(None, [f"rollout.max_num_seqs={max_num_seqs}"])
    return HFEngine(cfg, processor)


def count_generate_calls(model):
    """Wrap model.generate to record the rows of every call; returns the list it appends to."""
    calls, generate = [], model.generate

    def counted(**kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        return generate(**kwargs)

    model.generate = counted
    return calls


def main():
    from transformers import AutoProcessor

    model_dir, out_path = sys.argv[1], sys.argv[2]
    rank, world, device = distributed.setup_distributed()
    processor = AutoProcessor.from_pretrained(model_dir)
    prompts = image_prompts(processor, sum(len(p) for p in RANK_PROMPTS))
    mine = [prompts[i] for i in RANK_PROMPTS[rank]]
    model = tiny_policy(model_dir, processor)
    loading.apply_fsdp(model, device)
    loading.root_forward(model, processor.tokenizer.pad_token_id)
    engine = hf_engine(processor, max_num_seqs=2)
    engine.sync_weights(model)
    calls = count_generate_calls(model)
    result = {"calls": calls}
    for name, temperature, held in (
        ("greedy", 0.0, mine),
        ("sampled", 1.0, mine),
        ("empty", 0.0, mine if rank == 0 else []),
    ):
        samples = engine.generate(held, N, rollout.SamplingParams(temperature, 1.0, MAX_TOKENS), seed=11 + rank)
        result[name] = [(s.prompt_index, s.response_ids, s.logprobs, s.truncated) for s in samples]
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    distributed.exit_rank(0)
