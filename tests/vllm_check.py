"""Drive the vLLM rollout engine against the FSDP2 trainer under torchrun and write what test_vllm.py checks.

Every rank: start the engine (from the checkpoint on disk), load the trainer's model and perturb its weights (so the
engine is stale until synced), discard the engine's weights as a level-2 sleep does (full tuning: NaN, the buffers
kept), sync, sample, and recompute the sampled tokens' log-probs with the trainer.

    torchrun --nproc_per_node=2 tests/vllm_check.py MODEL_DIR OUT_DIR TENSOR_PARALLEL_SIZE [lora]

With `lora` the trainer is the checkpoint with LoRA adapters (on q_proj, down_proj and the vision tower's qkv) and only
the adapters are perturbed; after the first sync they are perturbed again and synced again, as after each update of
the loop, and the log-probs are compared after that second sync, which resends only the modules LoRA changes. On an
MoE it then syncs a second trainer, the same targets plus `experts` with only the expert adapters perturbed, and
compares again (keys `experts/...`): that resync resends the MLPs of the adapted experts, merged, one expert at a time.
"""

import collections
import json
import os
import sys
from dataclasses import replace

import torch
import torch.distributed as dist
from PIL import Image, ImageDraw

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])

import rollout  # noqa: E402
import train_grpo  # noqa: E402
from grpo import batching, distributed, families, loading, logprobs, lora, moe, routing, video  # noqa: E402
from grpo.media import set_pixel_range  # noqa: E402

MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112
VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS, MAX_FRAMES = 56 * 56, 112 * 112, 6


def make_prompts(processor, rank, with_image):
    """Four prompts that differ per rank (so a TP group really has different prompts to pool)."""
    prompts = []
    for i in range(4):
        content = [{"type": "text", "text": f"Find x in figure {rank}-{i}."}]
        images = []
        if with_image:
            img = Image.new("RGB", (60 + 30 * i, 90 - 10 * rank), "white")
            ImageDraw.Draw(img).line((0, 0, 50, 70 - 10 * i), fill="black", width=3)
            content.insert(0, {"type": "image"})
            images = [img]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        out = processor(text=[text], images=images or None, return_tensors="pt")
        prompts.append(rollout.Prompt(out["input_ids"][0], out.get("pixel_values"), out.get("image_grid_thw"), images))
    return prompts


def make_video_prompts(processor, rank):
    """Three prompts with a video each (frame counts 2, 5 and 6 -- the odd one gets its last frame repeated -- and
    frames of other sizes), the middle one with an image too, encoded as the trainer encodes a dataset's rows."""
    from types import SimpleNamespace

    side = processor.video_processor.patch_size * processor.video_processor.merge_size
    g = torch.Generator().manual_seed(rank)
    prompts = []
    for i, (n, size) in enumerate([(2, (90, 70)), (5, (70, 110)), (6, (112, 56))]):
        frames = [Image.fromarray(torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy())
                  for _ in range(n)]  # fmt: skip
        clip = video.load_video(frames, 2.0, MAX_FRAMES, VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS, side)
        images = [Image.new("RGB", (84, 56), "white")] if i == 1 else []
        content = [{"type": "image"}] * len(images) + [{"type": "video"}, {"type": "text", "text": f"Count {rank}."}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        prompts.append(rollout.encode_prompt(processor, SimpleNamespace(prompt=text, images=images, videos=[clip])))
    return prompts


def max_logprob_diff(model, prompts, samples, ids, temperature, over=None):
    """max |engine log-prob - trainer log-prob| over all sampled tokens (one trainer forward, collective); with
    `over`, the share of the tokens whose difference is above it instead."""
    batch_inputs, response_ids, mask = batching.collate(
        [prompts[s.prompt_index] for s in samples], [s.response_ids for s in samples], *ids
    )
    with torch.no_grad():
        logp, _ = logprobs.forward_logprobs(model, batch_inputs, response_ids, temperature)  # (B, T)
    model.reshard()
    engine_logp = torch.zeros_like(logp)
    for row, s in enumerate(samples):
        engine_logp[row, : len(s.logprobs)] = torch.tensor(s.logprobs)
    diff = (engine_logp - logp).abs() * mask  # (B, T)
    return diff.max().item() if over is None else ((diff > over).sum() / mask.sum()).item()


def count_vision_tokens(samples, vision_ids):
    return sum(t in vision_ids for s in samples for t in s.response_ids)


def perturb_adapters(model, seed, experts_only=False):
    """Give the LoRA adapters (or the routed experts' alone) a value (B = 0 makes them a no-op), the same on every
    rank."""
    g = torch.Generator().manual_seed(seed)
    for layer in lora.lora_layers(model).values():
        if experts_only and not hasattr(layer, "parameter_name"):
            continue
        b = layer.lora_B[lora.LORA_ADAPTER].weight
        lora.copy_own_rows(b, torch.randn(b.shape, generator=g) * 0.5)


def record_synced_names(engine, names):
    """Wrap the engine's reload_weights call to append the names of the tensors each sync sends to `names`."""
    rpc = engine.llm.collective_rpc

    def recording(method, *args, kwargs=None, **rest):
        if method == "reload_weights":
            weights = kwargs["weights_iterator"]
            kwargs = {**kwargs, "weights_iterator": ((names.append(n), (n, t))[1] for n, t in weights)}
        return rpc(method, *args, kwargs=kwargs, **rest)

    engine.llm.collective_rpc = recording


def record_prefix_hits(engine, started):
    """Wrap the engine's scheduler to append, for each request it starts, (prompt tokens, tokens of them found in the
    prefix cache); returns the function that unwraps it."""
    scheduler = engine.llm.llm_engine.engine_core.engine_core.scheduler
    schedule = scheduler.schedule

    def recording(*args, **kwargs):
        out = schedule(*args, **kwargs)
        started.extend((len(r.prompt_token_ids), r.num_computed_tokens) for r in out.scheduled_new_reqs)
        return out

    scheduler.schedule = recording
    return lambda: delattr(scheduler, "schedule")


def check_grouped_stop(engine, prompt, result):
    """The same 4 answers as one request of n = 4 and as 4 requests of their own (seeds s .. s + 3: vLLM seeds the
    i-th of n s + i), stepped alike and stopped after a few tokens, some finished by a stop token and some not:
    vllm_compat.stop_requests must give each answer the same tokens, log-probs and finish reason either way."""
    from grpo import vllm_compat
    from grpo.samples import engine_prompt_ids
    from grpo.vllm_engine import sampled_logprobs

    params = rollout.SamplingParams(temperature=1.0, top_p=1.0, max_tokens=16, stop_token_ids=tuple(range(0, 256, 5)))
    request = engine._request(engine_prompt_ids(prompt, engine.image_token_id), prompt.images, [])
    for name, n in (("grouped", 4), ("alone", 1)):
        engine.llm.reset_prefix_cache()  # both compute the prompt alike
        sampling = [engine._sampling(params, n, 16, 777 + i) for i in range(4 // n)]
        internal = engine.llm.enqueue([request] * (4 // n), sampling, use_tqdm=False)
        answer = {rid: i for i, rid in enumerate(vllm_compat.external_ids(engine.llm, internal))}
        outputs = [out for _ in range(6) for out in engine.llm.llm_engine.step()]  # the prompt and 5 tokens
        answers = [None] * 4
        for out in outputs + vllm_compat.stop_requests(engine.llm, internal):
            for c in out.outputs:
                answers[answer[out.request_id] + c.index] = [list(c.token_ids), sampled_logprobs(c),
                                                             c.finish_reason]  # fmt: skip
        result[f"stopped_{name}"] = answers
    result["left_running"] = engine.llm.llm_engine.has_unfinished_requests()


def check_pause(engine, prompt, result):
    """rollout.generate_until with pauses, as partial rollouts send tool-using answers: group 0's 4 answers pause at
    any even token below 400 (where a tool call would end), group 1's 4 answers have no pause; quota 1. A paused
    answer is returned unfinished, its tokens up to the pause, and its group is not complete: the engine must run
    on until group 1 has ended (counted complete once its answers had all paused, group 0 would stop it early)."""
    params = rollout.SamplingParams(temperature=1.0, top_p=1.0, max_tokens=12)
    engine.llm.reset_prefix_cache()
    pause = tuple(range(0, 400, 2))
    requests = [rollout.Continuation(prompt, [], 0, pause_ids=pause)] * 4 + [rollout.Continuation(prompt, [], 1)] * 4
    out = engine.generate_until(requests, 1, params, seed=4242)
    result["paused"] = [[ids, finished, truncated] for ids, _, finished, truncated in out]


class BatchQueue(collections.deque):
    empty_steps = 0  # steps that only filled the queue


def batch_queue_steps(llm):
    """Make the in-process engine core step as step_with_batch_queue does under async scheduling, which vLLM 0.26 to
    0.33 turn on with CUDA (the CPU platform turns it off, platforms/cpu.py): a step that only fills the queue of two
    batches returns no output, every output comes one step late, and at a stop one batch is still in flight, its
    outputs delivered at the next call, for requests aborted by then (the output processor skips those). The
    in-process client calls `engine_core.step_fn()` (InprocClient.get_output in 0.32, read). Returns the queue (what
    is in flight) and the undo."""
    core = llm.llm_engine.engine_core.engine_core
    real, queue = core.step_fn, BatchQueue()

    def step_fn():
        queue.appendleft(real())
        if len(queue) < 2 and core.scheduler.has_requests():  # filling the queue: nothing to report yet
            queue.empty_steps += 1
            return None, queue[0][1]
        return queue.pop()

    core.step_fn = step_fn
    return queue, lambda: setattr(core, "step_fn", real)


def check_batch_queue(engine, prompt, result):
    """rollout.generate_until stepped as under async scheduling against the synchronous steps: group 0's answers end
    after 3 tokens (their own max_tokens), group 1's are cut where the quota of 1 group stops them; then a plain
    generate after the stop, with a batch of the stopped requests still in flight. Each answer must have the same
    tokens, log-probs and finish reason either way."""
    params = rollout.SamplingParams(temperature=1.0, top_p=1.0, max_tokens=16)
    short = replace(prompt, max_tokens=3)
    requests = [rollout.Continuation(short, [], 0)] * 4 + [rollout.Continuation(prompt, [], 1)] * 4
    for name in ("sync", "batch_queue"):
        engine.llm.reset_prefix_cache()
        queue, undo = batch_queue_steps(engine.llm) if name == "batch_queue" else ([], lambda: None)
        stopped = engine.generate_until(requests, 1, params, seed=5151)
        in_flight = sum(bool(outputs) for outputs, _ in queue)  # batches with outputs the loop has not seen
        after = engine.generate([prompt], 2, params, seed=5252)
        undo()
        result[f"queue/{name}"] = [[ids, logps, finished, truncated] for ids, logps, finished, truncated in stopped]
        result[f"queue/{name}_after"] = [[s.response_ids, s.logprobs, s.truncated] for s in after]
    result["queue/in_flight_at_stop"], result["queue/empty_steps"] = in_flight, queue.empty_steps


def record_applied(engine, names):
    """Wrap the engine's apply_model to append the name of each function it applies to the model to `names`."""
    apply = engine.llm.apply_model
    engine.llm.apply_model = lambda fn: (names.append(fn.__name__), apply(fn))[1]


def check_expert_adapters(cfg, engine, model_dir, device, prompts, ids, params, seed, result):
    """Sync a trainer with adapters on the routed experts too (only those perturbed) into an engine that holds the
    LoRA trainer's weights, as a resync after an update, and record what it sent and the log-prob gaps after it."""
    cfg.actor.lora_target_modules = [*cfg.actor.lora_target_modules, lora.EXPERTS]
    model = loading.load_model(model_dir, device, "sdpa")
    lora.add_lora(model, lora.lora_config(cfg.actor))
    lora.init_lora(model)
    perturb_adapters(model, 789, experts_only=True)
    loading.apply_fsdp(model, device)
    loading.root_forward(model, ids[0])
    model.eval()
    text, image = prompts
    before = engine.generate(image, 2, params, seed=seed)
    result["experts/over_before_sync"] = max_logprob_diff(model, image, before, ids, 1.0, over=0.05)
    synced, applied = [], []
    record_synced_names(engine, synced)
    record_applied(engine, applied)
    engine.sync_weights(model)
    result["experts/resynced"], result["experts/applied"] = synced, applied
    for kind, batch in (("text", text), ("image", image)):
        samples = engine.generate(batch, 4, params, seed=seed)
        result[f"experts/diff_{kind}"] = max_logprob_diff(model, batch, samples, ids, 1.0)
        result[f"experts/over_{kind}"] = max_logprob_diff(model, batch, samples, ids, 1.0, over=0.05)


def discard_weights(model) -> list[int]:
    """What a level-2 sleep leaves of the engine's weights, made visible: vLLM (0.26 to 0.33 gpu_worker.sleep and
    wake_up) saves and restores the model's buffers and maps every other tensor's memory anew, uninitialised. Here
    every parameter becomes NaN, and every layer's CPU matmul, which may hold the weights packed away from the
    parameter (vLLM's CPU build packs bf16 weights for oneDNN), returns NaN until a reload sets the layer up again;
    the buffers (rotary tables and the like) stay as they are. A layer the sync does not reach keeps its tensors
    (vLLM's layer-wise reload) and so computes NaN. Run on the engine's model (LLM.apply_model); returns [floating
    parameters, other parameters, kernels]."""
    floating = [p for p in model.parameters() if p.is_floating_point()]
    with torch.no_grad():
        for p in floating:
            p.fill_(float("nan"))
    kernels = [m for m in model.modules() if callable(getattr(m, "cpu_linear", None))]
    for m in kernels:
        m.cpu_linear = lambda x, weight, bias, kernel=m.cpu_linear: kernel(x, weight, bias) * float("nan")
    return [len(floating), sum(1 for _ in model.parameters()) - len(floating), len(kernels)]


def linear_kernels(model) -> list[int]:
    """The engine's linear layers that vLLM's CPU build set up (a `cpu_linear`), and how many of them hold no weight
    of their own: packed away by a oneDNN handler rather than kept for torch's matmul (vllm_compat.torch_cpu_linear).
    Run on the engine's model (LLM.apply_model)."""
    layers = [m for m in model.modules() if hasattr(m, "cpu_linear")]
    return [len(layers), sum(m.weight.numel() == 0 for m in layers)]


def main():
    model_dir, out_dir, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with_lora = sys.argv[4:] == ["lora"]
    rank, world, device = distributed.setup_distributed()
    from transformers import AutoProcessor

    from grpo.samples import vision_token_ids

    processor = AutoProcessor.from_pretrained(model_dir)
    with_videos = families.family_of(model_dir).videos
    set_pixel_range(processor, MIN_PIXELS, MAX_PIXELS)
    video.set_video_range(processor, VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS, MAX_FRAMES)
    cfg = train_grpo.load_config(None, [
        "rollout.engine=vllm", f"actor.model_path={model_dir}", f"rollout.tensor_parallel_size={tp}",
        f"data.min_pixels={MIN_PIXELS}", f"data.max_pixels={MAX_PIXELS}", "data.max_prompt_length=512",
        "data.max_response_length=16", f"rollout.cpu_kv_cache_bytes={64 << 20}", "rollout.max_num_seqs=256",
        f"data.video_min_pixels={VIDEO_MIN_PIXELS}", f"data.video_max_pixels={VIDEO_MAX_PIXELS}",
        f"data.max_frames={MAX_FRAMES}", f"rollout.max_videos_per_prompt={int(with_videos)}",
        "rollout.max_images_per_prompt=1",
        *(["actor.lora_rank=8", "actor.lora_target_modules=[q_proj,down_proj,visual.qkv]"] if with_lora else []),
    ])  # fmt: skip
    train_grpo.check_config(cfg, world)
    engine = rollout.make_engine(cfg, processor)

    model = loading.load_model(model_dir, device, "sdpa")
    if with_lora:  # the base stays the checkpoint's: only the adapters make the trainer differ from it
        lora.add_lora(model, lora.lora_config(cfg.actor))
        lora.init_lora(model)
        perturb_adapters(model, 123)
    else:
        with torch.no_grad():  # the same perturbation on every rank: the trainer now differs from the checkpoint
            g = torch.Generator().manual_seed(123)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    loading.apply_fsdp(model, device)
    pad_id = processor.tokenizer.pad_token_id
    loading.root_forward(model, pad_id)
    model.eval()
    ids = (pad_id, model.config.image_token_id)
    params = rollout.SamplingParams(temperature=1.0, top_p=1.0, max_tokens=16)
    text, image = make_prompts(processor, rank, False), make_prompts(processor, rank, True)
    result = {}

    # Before any sync the engine still holds the checkpoint's weights: the log-probs must disagree. The same images
    # come again after the sync, whose encoder outputs vLLM must not reuse.
    samples = engine.generate(image, 2, params, seed=rank)
    result["diff_before_sync"] = max_logprob_diff(model, image, samples, ids, 1.0)
    result["over_before_sync"] = max_logprob_diff(model, image, samples, ids, 1.0, over=0.05)
    moe_run = families.family(model).moe and not with_lora
    if moe_run:  # one answer a prompt: the engine reads each sequence in a request of its own
        result["routing_before_sync"] = routing.agreement(engine, model, image, samples[::2], pad_id)

    result["linear_kernels_at_start"] = engine.llm.apply_model(linear_kernels)[0]
    engine.wake()
    if not with_lora:  # full tuning sleeps at level 2 on CUDA: its first sync must set every weight
        result["discarded"] = engine.llm.apply_model(discard_weights)[0]
    first = []
    record_synced_names(engine, first)
    engine.sync_weights(model)
    result["linear_kernels_after_sync"] = engine.llm.apply_model(linear_kernels)[0]  # (the sync sets them up again)
    # the cap of its cache of processed images, rollout.mm_cache_gb, reached vLLM (its own default is 4 GiB a rank)
    result["mm_cache_gb"] = engine.llm.llm_engine.vllm_config.model_config.multimodal_config.mm_processor_cache_gb
    # an MoE's experts go one expert at a time, in the per-expert names, never as a whole gathered parameter
    result["synced_per_expert"] = sum(bool(moe.PER_EXPERT.match(n)) for n in first)
    result["synced_fused_experts"] = sum(bool(moe.EXPERT_PARAM.match(n)) for n in first)
    if with_lora:  # an update changes the adapters; the next sync resends only what they touch
        perturb_adapters(model, 456)
        synced, applied = [], []
        record_synced_names(engine, synced)
        record_applied(engine, applied)
        engine.sync_weights(model)
        result["resynced"], result["resync_applied"] = list(synced), list(applied)  # (the wrappers stay on)
    seed = 1000 + rank  # what the loop passes: a different stream per rank
    text_samples = engine.generate(text, 4, params, seed=seed)
    started = []
    unwrap = record_prefix_hits(engine, started)
    image_samples = engine.generate(image, 4, params, seed=seed)
    unwrap()
    result["image_prefix_hits"] = started  # the 4 answers of a prompt share its prefill (whole KV blocks)
    if engine.tp_group is None:  # (a TP group's members would have to submit the same requests)
        check_grouped_stop(engine, image[0], result)
    check_pause(engine, image[0], result)  # (generate_until pools a TP group's requests)
    if engine.tp_group is None:
        check_batch_queue(engine, image[0], result)
    result["diff_text"] = max_logprob_diff(model, text, text_samples, ids, 1.0)
    result["diff_image"] = max_logprob_diff(model, image, image_samples, ids, 1.0)
    # below temperature 1 too: the engine's processed log-probs (the bias and the temperature applied) are the
    # trainer's, whose softmax leaves the forbidden tokens out likewise
    cool_samples = engine.generate(text, 2, replace(params, temperature=0.7), seed=seed)
    result["diff_text_t07"] = max_logprob_diff(model, text, cool_samples, ids, 0.7)
    # the share of tokens beyond bf16's rounding: where an MoE engine in bf16 routes a token to other experts than
    # the fp32 trainer, that token alone differs by more
    result["over_text"] = max_logprob_diff(model, text, text_samples, ids, 1.0, over=0.05)
    result["over_image"] = max_logprob_diff(model, image, image_samples, ids, 1.0, over=0.05)
    videos, video_samples, result["diff_video"] = [], [], None  # (a family that refuses videos has none)
    if families.family(model).videos:  # vLLM expands each video's pad as the trainer's processor does
        videos = make_video_prompts(processor, rank)
        video_samples = engine.generate(videos, 4, params, seed=seed)
        result["diff_video"] = max_logprob_diff(model, videos, video_samples, ids, 1.0)
    if moe_run:  # one answer of each image and video prompt
        both = image + videos
        answers = image_samples[::4] + [
            replace(s, prompt_index=s.prompt_index + len(image)) for s in video_samples[::4]
        ]
        result["routing"] = routing.agreement(engine, model, both, answers, pad_id)
    result["prompt_index"] = [s.prompt_index for s in image_samples]
    result["image_samples"] = [s.response_ids for s in image_samples]
    result["repeat_equal"] = [s.response_ids for s in engine.generate(image, 4, params, seed=seed)] == [
        s.response_ids for s in image_samples
    ]
    result["other_seed_equal"] = [s.response_ids for s in engine.generate(image, 4, params, seed=seed + 1)] == [
        s.response_ids for s in image_samples
    ]

    # Vision tokens: ~1.2% of this random model's vocabulary, so 8 x 32 x 16 tokens would hold dozens of them.
    vision_ids = set(vision_token_ids(processor.tokenizer, families.family(model).vision_tokens))
    many = text + image + videos
    result["vision_tokens"] = count_vision_tokens(engine.generate(many, 32, params, seed=seed), vision_ids)
    bias, engine.logit_bias = engine.logit_bias, {}  # control: without the bias they do get sampled
    result["vision_tokens_unbiased"] = count_vision_tokens(engine.generate(many, 32, params, seed=seed), vision_ids)
    engine.logit_bias = bias
    if with_lora and families.family(model).moe:
        check_expert_adapters(cfg, engine, model_dir, device, (text, image), ids, params, seed, result)
    engine.sleep()

    distributed.shut_down(engine)  # as the trainer ends: the engine, then the process group
    from vllm.distributed import parallel_state

    # what is left of vLLM's parallel state (its groups, the world group) and of torch.distributed
    result["after_shut_down"] = [parallel_state.model_parallel_is_initialized(), parallel_state._WORLD is not None,
                                 dist.is_initialized()]  # fmt: skip
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
    distributed.exit_rank(0)
