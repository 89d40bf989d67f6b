"""Multi-turn rollouts with tools: the model writes, calls a tool, reads what comes back (text, images), writes on.

    engine = rollout.make_engine(cfg, processor)         # with rollout.tools: a ToolEngine around the engine
    samples = engine.generate(prompts, n, params, seed)  # the engine interface, unchanged
    engine.stats                                         # the last call's tool counts

An answer is [model tokens | tool turn | model tokens | ...], held in one Sample: `response_ids` all of it,
`logprobs` the engine's for the model's tokens and 0 for the tool turns', `turns` the ToolTurns (where each starts,
its tokens, its images' pixels and grids). The trainer lays the tool turns out as context (batching.collate/pack:
their image tokens typed, their pixels beside the prompt's, no loss on them); `text` is the last model turn's, the
answer the reward grades (a tool's output or a call's arguments are not the model's answer).

The loop (`generate_with_tools`):
1. every answer of the step is sampled in one engine call, which stops at </tool_call> as at end-of-sequence;
2. the answers that stopped at a call get it parsed (malformed: an error message) and run in the bounded pool
   (tools.ToolPool: a hang costs a timeout message, never the step), all calls of the turn together;
3. each result becomes a tool turn (text and images in a `<tool_response>`, then the next assistant header), and
   the answer continues, in one batched engine call per turn, from the exact token ids the engine sampled plus the
   tool turn (never a re-tokenization of the model's text), with the images of every turn so far;
4. until an answer ends without a call, the answer has had rollout.max_turns model turns (the last of which does
   not stop at a call: it could not be answered), or the token budget
   (data.max_response_length, tool turns included) runs out; a tool turn that does not fit ends the answer where
   it called (truncated), so no answer is ever cut inside an image's tokens.
Under torchrun every rank takes as many turns as the busiest one (the HF engine's forwards are collective, vLLM's
TP groups submit together): a rank with nothing left generates for no prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from grpo import tools
from grpo.distributed import mean_over_ranks
from grpo.samples import Prompt, Sample, engine_prompt_ids

# The tool turn around a result, Qwen's way: the model's turn ends after its call, the result comes back in a user
# turn inside <tool_response>, then the next assistant turn opens.
TURN_OPEN = "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
TURN_CLOSE = "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
VISION_BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"  # one per image, in all three families
FAULT_KEYS = tuple(f"tool/{kind}" for kind in tools.FAULTS)


@dataclass
class ToolTurn:
    """A tool turn inside an answer: context the model did not write."""

    start: int  # where it starts in the answer's response_ids
    input_ids: torch.Tensor  # (K,) image pads expanded, as the trainer's model sees it
    token_types: torch.Tensor  # (K,) 0 text, 1 image token
    template_ids: list[int]  # one pad per image: what vLLM takes (it expands them itself)
    images: list = field(default_factory=list)  # PIL, fitted to the data's pixel budget
    pixel_values: torch.Tensor | None = None  # (patches, dim)
    image_grid_thw: torch.Tensor | None = None  # (images, 3)


def turn_state(turn: ToolTurn) -> dict:
    """A tool turn as numbers, lists and tensors (what torch.load(weights_only=True) reads back): the images as
    their RGB pixels."""
    import numpy as np

    return {**vars(turn), "images": [torch.from_numpy(np.array(img.convert("RGB"))) for img in turn.images]}


def turn_from_state(state: dict) -> ToolTurn:
    from PIL import Image

    return ToolTurn(**{**state, "images": [Image.fromarray(pixels.numpy()) for pixels in state["images"]]})


def encode_turn(processor, result: tools.ToolResult, start: int, bounds: tuple[int, int]) -> ToolTurn:
    """The tool turn of a result. Its images are fitted to the data's pixel budget (media.fit_image), so the
    processor and vLLM turn each into the same number of tokens, as they do the prompt's."""
    from grpo.media import fit_image, image_side

    side = image_side(processor.image_processor)
    images = [fit_image(img, *bounds, side) for img in result.images]
    text = TURN_OPEN + VISION_BLOCK * len(images) + result.text + TURN_CLOSE
    out = processor(text=[text], images=images or None, return_tensors="pt")
    ids = out["input_ids"][0]
    types = out.get("mm_token_type_ids")
    image_token_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    types = (ids == image_token_id).long() if types is None else types[0].long()
    return ToolTurn(start, ids, types, processor.tokenizer(text)["input_ids"], images, out.get("pixel_values"),
                    out.get("image_grid_thw"))  # fmt: skip


def continuation(prompt: Prompt, sample: Sample, max_tokens: int, image_token_id: int) -> Prompt:
    """The conversation so far as a prompt: the original prompt, then the answer's own tokens and tool turns. The
    expanded ids are what the trainer's model (and the HF engine) read; the template ids, with one pad per image,
    are what vLLM reads: the prompt's engine ids, then the sampled ids as they came, then each tool turn's."""
    template, at = engine_prompt_ids(prompt, image_token_id), 0
    for turn in sample.turns:
        template += sample.response_ids[at : turn.start] + turn.template_ids
        at = turn.start + len(turn.input_ids)
    template += sample.response_ids[at:]
    types = torch.zeros(len(sample.response_ids), dtype=torch.long)  # (R,)
    for turn in sample.turns:
        types[turn.start : turn.start + len(turn.input_ids)] = turn.token_types
    prompt_types = prompt.token_types if prompt.token_types is not None else (prompt.input_ids == image_token_id)
    vision = [x for x in (prompt, *sample.turns) if x.pixel_values is not None]
    return replace(
        prompt,
        input_ids=torch.cat([prompt.input_ids, torch.as_tensor(sample.response_ids, dtype=torch.long)]),
        token_types=torch.cat([prompt_types.long(), types]),
        pixel_values=torch.cat([x.pixel_values for x in vision]) if vision else None,
        image_grid_thw=torch.cat([x.image_grid_thw for x in vision]) if vision else None,
        images=[*prompt.images, *(img for turn in sample.turns for img in turn.images)],
        template_ids=template,
        max_tokens=max_tokens,
    )


def model_text(tokenizer, sample: Sample, keep_special: bool = False) -> str:
    """The text of the answer's last model turn."""
    start = sample.turns[-1].start + len(sample.turns[-1].input_ids) if sample.turns else 0
    return tokenizer.decode(sample.response_ids[start:], skip_special_tokens=not keep_special)


def busiest_rank(count: int) -> int:
    """The most answers any rank still continues (every rank must make as many engine calls)."""
    if not dist.is_initialized():
        return count
    t = torch.tensor([count])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def turn_seed(seed: int, turn: int) -> int:
    """Seed of the turn-th continuation call: turn 0 is the caller's, later ones far from it and each other."""
    return (seed + turn * 0x9E3779B97F4A7C15) % 2**63


def take_tool_turns(engine, processor, pool, prompts, called, budget, bounds, stats) -> list:
    """Steps 2-3 of the loop for the samples that stopped at a call (each with its prompt): parse and run the calls,
    append each result's tool turn (log-prob 0) to its answer, or end the answer where it called when the turn does
    not fit the token budget. Adds to `stats`; returns [(sample, tokens it has left)] for the answers that go on."""
    tokenizer = processor.tokenizer
    only = next(iter(pool.fns)) if len(pool.fns) == 1 else None  # an empty call calls the only tool
    calls, results = [], {}
    for s, prompt in zip(called, prompts, strict=True):
        call, why = tools.parse_call(model_text(tokenizer, s, keep_special=True), only)
        if call is None:
            results[id(s)] = tools.ToolResult(f"error: {why}", fault="malformed")
        else:
            calls.append((s, call, [*prompt.images, *(img for t in s.turns for img in t.images)]))
    ran = pool.run([c for _, c, _ in calls], [seen for *_, seen in calls])  # every image of the conversation so far
    results.update({id(s): r for (s, _, _), r in zip(calls, ran)})
    limit = getattr(engine, "max_images", None)  # vLLM's per-request images (rollout.max_images_per_prompt)
    for s, _, seen in calls:
        if limit is not None and len(seen) + len(results[id(s)].images) > limit:  # refused by vLLM otherwise
            results[id(s)] = tools.ToolResult(f"error: the conversation may hold at most {limit} images", fault="error")
    going = []
    for s in called:
        result = results[id(s)]
        stats["tool/calls"] += 1
        if result.fault:
            stats[f"tool/{result.fault}"] += 1
        tool_turn = encode_turn(processor, result, len(s.response_ids), bounds)
        left = budget - len(s.response_ids) - len(tool_turn.input_ids)
        if left < 1:  # the result does not fit: the answer ends at its call, never inside the turn's images
            s.truncated = True
            continue
        s.response_ids = s.response_ids + tool_turn.input_ids.tolist()
        s.logprobs = s.logprobs + [0.0] * len(tool_turn.input_ids)
        s.turns = [*s.turns, tool_turn]
        going.append((s, left))
    return going


def generate_with_tools(engine, processor, pool, prompts, n, params, seed, max_turns, budget, bounds):
    """The loop of the module docstring. Returns (samples, stats): prompt-major samples as engine.generate's, and
    this call's counts: tool/calls, tool/<kind> of each tools.FAULTS."""
    tokenizer = processor.tokenizer
    stop = tokenizer.convert_tokens_to_ids(tools.TOOL_CALL_END)
    image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    # The last turn an answer may take does not stop at a call: no result could come back, so the model writes on
    # (stopping or not leaves the distribution it samples from, and so the log-probs, as they are).
    last = replace(params, max_tokens=min(params.max_tokens, budget))
    to_call = replace(last, stop_token_ids=(*params.stop_token_ids, stop))
    samples = engine.generate(prompts, n, to_call if max_turns > 1 else last, seed)
    stats = dict.fromkeys(("tool/calls", *FAULT_KEYS), 0.0)
    for turn in range(1, max_turns):
        called = [s for s in samples if s.response_ids and s.response_ids[-1] == stop and not s.truncated]
        going = take_tool_turns(engine, processor, pool, [prompts[s.prompt_index] for s in called], called, budget,
                                bounds, stats)  # fmt: skip
        if busiest_rank(len(going)) == 0:
            break
        mine = [continuation(prompts[s.prompt_index], s, left, image_token_id) for s, left in going]
        params = to_call if turn + 1 < max_turns else last
        for (s, _), more in zip(going, engine.generate(mine, 1, params, turn_seed(seed, turn)), strict=True):
            s.response_ids = s.response_ids + more.response_ids
            s.logprobs = s.logprobs + more.logprobs
            s.truncated = more.truncated
            # routing replay: the continuation read the whole conversation (its tool turns prefilled): its record is
            # the answer's whole record; None where the engine records none (routing.record_routes then does)
            s.routes = more.routes
    for s in samples:
        s.text = model_text(tokenizer, s)
    return samples, stats


class ToolEngine:
    """An engine whose `generate` runs the tool loop; everything else is the wrapped engine's (rollout.make_engine
    wraps the engine in it when rollout.tools names any)."""

    def __init__(self, engine, cfg, processor):
        r, d = cfg.rollout, cfg.data
        self.engine, self.processor = engine, processor
        self.pool = tools.ToolPool(r.tools, r.tool_timeout, max(1, r.tool_workers))
        self.max_turns, self.budget, self.bounds = r.max_turns, d.max_response_length, (d.min_pixels, d.max_pixels)
        self.stats = {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, n, params, seed):
        samples, self.stats = generate_with_tools(self.engine, self.processor, self.pool, prompts, n, params, seed,
                                                  self.max_turns, self.budget, self.bounds)  # fmt: skip
        return samples


def step_metrics(rollout_stats: dict, samples) -> dict:
    """The step's `tool/*` counts (taken out of rollout_stats, the rollout's StepStats), summed over ranks, and
    tool/call_share: the share of the trained answers (`samples`) with a tool turn. (Counted at the calls it would
    also count the answers that dynamic sampling drops and, with partial rollouts, those that train at a later step.)
    Collective when tools are on (every rank then has the same keys); {} without tools."""
    counts = {k: rollout_stats.pop(k) for k in [k for k in rollout_stats if k.startswith("tool/")]}
    if not counts:
        return {}
    counts["tool/call_share"] = float(sum(bool(s.turns) for s in samples))
    world = dist.get_world_size()
    return mean_over_ranks(counts, {**dict.fromkeys(counts, 1.0 / world), "tool/call_share": len(samples)})


def offer_tools(rollout_cfg, processor, system_prompt: str | None) -> dict:
    """The dataset's prompt arguments that offer the tools: their schemas for a chat template that presents tools
    (Qwen3-VL's), else rollout.tool_prompt with the schemas added to the system prompt (Qwen2.5-VL's template has no
    tool support)."""
    if not rollout_cfg.tools:
        return {"system_prompt": system_prompt}
    if tools.template_presents_tools(processor):
        return {"system_prompt": system_prompt, "tools": tools.schemas(rollout_cfg.tools)}
    offer = tools.tool_prompt(rollout_cfg.tool_prompt or tools.TOOL_PROMPT, rollout_cfg.tools)
    return {"system_prompt": "\n\n".join(x for x in (system_prompt or "You are a helpful assistant.", offer))}
