"""Rollout engines: turn prompts into n sampled answers each, with the log-prob of every sampled token.

The loop in train_grpo.py only calls the engine interface below, so engines plug in without touching it:

    engine = make_engine(cfg, model, processor)
    engine.wake(); engine.sync_weights(model)            # bring the engine up to the trainer's weights
    samples = engine.generate(prompts, n, params, seed)  # list[Sample], prompt-major: n consecutive per prompt
    engine.sleep()                                       # give memory back to training

`hf` samples with the (FSDP2-sharded) training model itself: no second copy of the weights, nothing to sync,
slow. The in-process vLLM engine is the fast path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# Sampling one of these would put an image placeholder into a response, and the next training forward fails with
# "Image features and image tokens do not match". They are forbidden at every sampling step.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_tokens: int = 2048


@dataclass
class Prompt:
    """A prompt as the trainer's model sees it (image pads expanded by the processor) plus the raw images, which
    engines with their own image processing need."""

    input_ids: torch.Tensor  # (P,)
    pixel_values: torch.Tensor | None  # (patches, dim) for all images of the prompt
    image_grid_thw: torch.Tensor | None  # (images, 3)
    images: list


@dataclass
class Sample:
    prompt_index: int  # index into the prompts passed to generate()
    response_ids: list[int]  # sampled tokens, including the end-of-sequence token when there is one
    logprobs: list[float]  # log-prob of each sampled token under the engine's model (temperature applied)
    text: str
    truncated: bool  # hit max_tokens before end-of-sequence


def encode_prompt(processor, example) -> Prompt:
    out = processor(text=[example.prompt], images=example.images or None, return_tensors="pt")
    return Prompt(out["input_ids"][0], out.get("pixel_values"), out.get("image_grid_thw"), list(example.images))


def vision_token_ids(tokenizer) -> list[int]:
    vocab = tokenizer.get_vocab()
    return sorted(vocab[t] for t in VISION_TOKENS if t in vocab)


def collate(prompts, responses, pad_id, image_token_id):
    """Lay each sequence out as [left-padded prompt | right-padded response]: every response starts at the same
    column, so the model needs logits only for the last T + 1 positions.

    Returns the model inputs, `response_ids` (B, T) and `response_mask` (B, T).
    """
    p_len = max(len(p.input_ids) for p in prompts)
    t_len = max(len(r) for r in responses)
    batch = len(prompts)
    input_ids = torch.full((batch, p_len + t_len), pad_id, dtype=torch.long)  # (B, L)
    attention_mask = torch.zeros((batch, p_len + t_len), dtype=torch.long)  # (B, L)
    response_mask = torch.zeros((batch, t_len), dtype=torch.float32)  # (B, T)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        start = p_len - len(p.input_ids)
        input_ids[i, start:p_len] = p.input_ids
        input_ids[i, p_len : p_len + len(r)] = torch.as_tensor(r, dtype=torch.long)
        attention_mask[i, start : p_len + len(r)] = 1
        response_mask[i, : len(r)] = 1
    inputs = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        # transformers 5.x builds Qwen2.5-VL's 3-D (mRoPE) positions only when told which tokens are image tokens
        "mm_token_type_ids": (input_ids == image_token_id).long(),
    }
    with_images = [p for p in prompts if p.pixel_values is not None]
    if with_images:
        inputs["pixel_values"] = torch.cat([p.pixel_values for p in with_images])
        inputs["image_grid_thw"] = torch.cat([p.image_grid_thw for p in with_images])
    return inputs, input_ids[:, p_len:], response_mask


class HFEngine:
    """Samples with the training model's own `generate`. Under FSDP2 every forward is a collective, so every rank
    must generate together (`synced_gpus` keeps finished ranks stepping until all are done)."""

    def __init__(self, model, processor):
        self.model, self.tokenizer = model, processor.tokenizer
        self.pad_id = self.tokenizer.pad_token_id
        eos = model.generation_config.eos_token_id or self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self.forbidden = vision_token_ids(self.tokenizer)
        self.image_token_id = model.config.image_token_id

    def wake(self):
        pass

    def sleep(self):
        pass

    def sync_weights(self, model):
        pass  # it samples with the training model itself

    @torch.no_grad()
    def generate(self, prompts: list[Prompt], n: int, params: SamplingParams, seed: int) -> list[Sample]:
        from transformers import GenerationConfig

        device = next(self.model.parameters()).device
        inputs, _, _ = collate(prompts, [[] for _ in prompts], self.pad_id, self.image_token_id)
        inputs = {k: v.to(device) for k, v in inputs.items()}
        greedy = params.temperature <= 0
        # A fresh config: a checkpoint's own generation_config (Qwen ships top_k=1, repetition_penalty=1.05) must
        # not silently change the sampling distribution the loss assumes.
        gen_cfg = GenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p,
            top_k=0,  # 0 disables it; None would fall back to the library default of 50
            max_new_tokens=params.max_tokens,
            num_return_sequences=n,
            eos_token_id=sorted(self.eos_ids),
            pad_token_id=self.pad_id,
            suppress_tokens=self.forbidden,
            output_logits=True,
            return_dict_in_generate=True,
            use_cache=True,
        )
        torch.manual_seed(seed)
        out = self.model.generate(**inputs, generation_config=gen_cfg, synced_gpus=dist.get_world_size() > 1)
        generated = out.sequences[:, inputs["input_ids"].shape[1] :].cpu()  # (B*n, R)
        temperature = 1.0 if greedy else params.temperature
        # one (B*n,) log-prob per generated position, never a (B*n, R, V) tensor
        logps = torch.stack(
            [
                (step.float() / temperature)
                .log_softmax(-1)
                .gather(-1, generated[:, t, None].to(step.device))[:, 0]
                .cpu()
                for t, step in enumerate(out.logits)
            ],
            dim=1,
        )  # (B*n, R)
        samples = []
        for row in range(generated.shape[0]):
            ids = generated[row].tolist()
            end = next((t + 1 for t, tok in enumerate(ids) if tok in self.eos_ids), None)
            ids = ids if end is None else ids[:end]
            samples.append(Sample(
                prompt_index=row // n,
                response_ids=ids,
                logprobs=logps[row, : len(ids)].tolist(),
                text=self.tokenizer.decode(ids, skip_special_tokens=True),
                truncated=end is None,
            ))  # fmt: skip
        return samples


ENGINES = {"hf": HFEngine}


def make_engine(cfg, model, processor):
    return ENGINES[cfg.rollout.engine](model, processor)
