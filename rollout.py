"""Rollout: turn prompts into n sampled answers each, with the log-prob of every sampled token.

A step's rollout, as train_grpo.collect_rollouts reads it: draw the next prompts, generate, score.

    indices, epoch, position = sampler.next_indices(epoch, position, need)  # this rank's shard (data.ShardSampler)
    prompts = [encode_prompt(processor, train_set[i]) for i in indices]
    samples = engine.generate(prompts, n, params, seed)  # list[Sample], prompt-major: n consecutive per prompt

The engine's interface is all the loop calls, so engines plug in without touching it:

    check_prompt_limits(cfg.rollout, [train_set, val_set])  # the data's images and videos a prompt, for vLLM
    engine = make_engine(cfg, processor, offload)        # right after init_process_group, before the model loads
    engine.wake(); engine.sync_weights(model)            # bring the engine up to the trainer's weights
    samples = engine.generate(prompts, n, params, seed)
    engine.stats                                         # the last generate call's counts (tool/* with tools)
    engine.carry                                         # partial rollouts' answers in flight (partial.Carry), or None
    engine.sleep()                                       # give memory back to training
    engine.timings                                       # seconds of the last wake / weight sync / sleep
    engine.close()                                       # at the end, before the process group goes (shut_down)

make_engine builds the engine whole; nothing sets anything on it later. Two layers come with settings:
- rollout.tools: the engine inside turns.ToolEngine, whose `generate` lets the model call tools between its turns
  (the same interface; the calls and faults in `stats`);
- rollout.partial (vLLM): the engine holds a partial.Carry, the answers in flight between steps, and the loop draws
  and generates with partial.draw_and_generate instead, which stops at the step's quota of complete groups.
`offload` (offload.TrainerOffload) is the trainer's idle state: the engine moves it to host memory when it generates
(vLLM: after the weight sync, before its KV cache wakes) and the parameters back when it sleeps, at rollouts and
validations alike (AdamW's moments stay there until the optimizer steps).

ENGINES: `hf` (grpo/hf_engine.py) samples with the (FSDP2-sharded) training model itself: no second copy of the
weights, nothing to sync, slow; at most rollout.max_num_seqs sequences per generate call. `vllm`
(grpo/vllm_engine.py) runs a vLLM engine inside every torchrun rank: the fast path. The types are grpo/samples.py's,
named here for the loop (`rollout.Prompt`, `rollout.Sample`).
"""

from __future__ import annotations

from grpo import partial, turns
from grpo.hf_engine import HFEngine
from grpo.samples import Continuation, Prompt, Sample, SamplingParams, encode_prompt  # noqa: F401 (the loop's names)
from grpo.vllm_engine import VLLMEngine

ENGINES = {"hf": HFEngine, "vllm": VLLMEngine}


def make_engine(cfg, processor, offload=None):
    """Build the engine whole: the engine of rollout.engine, holding `offload` (offload.TrainerOffload, or None) and,
    with rollout.partial, the answers carried between steps; with rollout.tools, inside the tool loop. Every rank must
    call it at the same point, right after init_process_group: vLLM's engine start is collective and should see the
    device before the trainer takes memory."""
    carry = partial.Carry(cfg) if cfg.rollout.partial else None  # answers in flight between steps (partial.py)
    engine = ENGINES[cfg.rollout.engine](cfg, processor, offload, carry)
    if cfg.rollout.tools:  # the model may call tools between turns: generate runs the tool loop (turns.py)
        engine = turns.ToolEngine(engine, cfg, processor)
    return engine


def _media_sources(dataset, what: str) -> list:
    """Each prompt's image or video sources (what: images, videos); a Subset (validation) has only its own."""
    whole = getattr(getattr(dataset, "dataset", dataset), f"{what[:5]}_sources")
    return [whole[i] for i in dataset.indices] if hasattr(dataset, "indices") else whole


def data_media(datasets) -> str:
    """What the data really has, for the start-up line: the prompts with images and with videos, and the most of
    either one prompt has (not the engine's limits, which keep one image for text-only data)."""
    parts = []
    for what in ("images", "videos"):
        counts = [len(s) for d in datasets if d is not None for s in _media_sources(d, what)]
        n = sum(c > 0 for c in counts)
        parts.append(f"{what} in {n} prompts (at most {max(counts)} a prompt)" if n else f"no {what}")
    return ", ".join(parts)


def check_prompt_limits(rollout_cfg, datasets) -> tuple[int, int]:
    """The vLLM engine's limits of images and videos per prompt (limit_mm_per_prompt), set before it starts: a limit
    left at -1 becomes the data's most (written back into rollout_cfg), an explicit one is kept, and one below the
    data's most stops the run before the models load (vLLM would refuse such a prompt only at the rollout that
    draws it). Data with neither images nor videos keeps one image: with both limits 0 vLLM would build no vision
    tower, and the weight sync sends one. With tools, each tool turn may bring one image more (crop returns one)."""
    most = {what: max((len(s) for d in datasets if d is not None for s in _media_sources(d, what)), default=0)
            for what in ("images", "videos")}  # fmt: skip
    auto = {"images": most["images"] or int(not most["videos"]), "videos": most["videos"]}
    if rollout_cfg.tools:  # the prompt's images and one from each tool turn go to vLLM in one request
        auto["images"] = max(auto["images"], most["images"] + rollout_cfg.max_turns - 1)
    for what, count in most.items():
        key = f"max_{what}_per_prompt"
        limit = getattr(rollout_cfg, key)
        if limit < 0:
            setattr(rollout_cfg, key, auto[what])
        elif count > limit and rollout_cfg.engine == "vllm":
            raise SystemExit(f"a prompt of the data has {count} {what}: set rollout.{key}={count} or -1, the data's "
                             f"most (now {limit}; vLLM reserves encoder memory for that many)")  # fmt: skip
    return rollout_cfg.max_images_per_prompt, rollout_cfg.max_videos_per_prompt
