"""Rollout engines: turn prompts into n sampled answers each, with the log-prob of every sampled token.

The loop in train_grpo.py only calls the engine interface below, so engines plug in without touching it:

    check_prompt_limits(cfg.rollout, [train_set, val_set])  # the data's images and videos a prompt, for vLLM
    engine = make_engine(cfg, processor)                 # right after init_process_group, before the model loads
    engine.wake(); engine.sync_weights(model)            # bring the engine up to the trainer's weights
    samples = engine.generate(prompts, n, params, seed)  # list[Sample], prompt-major: n consecutive per prompt
    engine.sleep()                                       # give memory back to training
    engine.timings                                       # seconds of the last wake / weight sync / sleep
    engine.close()                                       # at the end, before the process group goes (distributed.py)
    engine.offload = offload.TrainerOffload(...)         # optional: the trainer's idle state to host while generating

An engine that has `offload` set moves the trainer's state to host memory when it generates (vLLM: after the weight
sync, before its KV cache wakes) and the parameters back when it sleeps, at rollouts and validations alike (AdamW's
moments stay there until the optimizer steps).

`hf` samples with the (FSDP2-sharded) training model itself: no second copy of the weights, nothing to sync,
slow; at most rollout.max_num_seqs sequences per generate call. `vllm` runs a vLLM engine inside every torchrun rank
(the fast path, see VLLMEngine).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import gc
import os
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from grpo import families, logprobs, lora, moe, vllm_compat
from grpo.batching import VISION_INPUTS, collate, pack
from grpo.quiet import filtered_stderr, quiet_logs
from grpo.video import video_processor_size


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_tokens: int = 2048
    stop_token_ids: tuple = ()  # besides end-of-sequence: a tool rollout's turn ends at </tool_call> (turns.py)


@dataclass
class Prompt:
    """A prompt as the trainer's model sees it (image and video pads expanded by the processor) plus the raw images
    and videos, which engines with their own image processing need."""

    input_ids: torch.Tensor  # (P,)
    pixel_values: torch.Tensor | None  # (patches, dim) for all images of the prompt
    image_grid_thw: torch.Tensor | None  # (images, 3)
    images: list
    # (P,) the processor's mm_token_type_ids: 0 text, 1 image, 2 video token; None: image tokens found by their id
    token_types: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None  # (patches, dim) for all videos of the prompt
    video_grid_thw: torch.Tensor | None = None  # (videos, 3)
    second_per_grid_ts: torch.Tensor | None = None  # (videos,) Qwen2.5-VL: seconds per temporal patch, for mRoPE
    videos: list = field(default_factory=list)  # video.Video: the frames and their timing
    # the chat template's tokens, one pad per image and video: what engines that expand the pads themselves get
    template_ids: list[int] | None = None
    max_tokens: int | None = None  # fewer new tokens than SamplingParams.max_tokens (what a tool rollout has left)


@dataclass
class Sample:
    prompt_index: int  # index into the prompts passed to generate()
    response_ids: list[int]  # sampled tokens, including the end-of-sequence token when there is one
    logprobs: list[float]  # log-prob of each sampled token under the engine's model (temperature applied)
    text: str
    truncated: bool  # hit max_tokens before end-of-sequence
    # the tool turns inside response_ids (turns.ToolTurn, in order): context the model did not write, whose tokens
    # carry no log-prob (0 in `logprobs`) and no loss; empty for a plain answer
    turns: list = field(default_factory=list)
    # leading tokens of response_ids sampled at earlier steps, under older weights (an answer cut short by a partial
    # rollout and continued now); their `logprobs` are the older policy's, so only the rest measures the engine
    carried: int = 0
    staleness: int = 0  # steps since its first token was sampled (partial.py); 0 for an answer of this step

    @property
    def model_len(self) -> int:
        """The tokens the model wrote (those that carry loss)."""
        return len(self.response_ids) - sum(len(t.input_ids) for t in self.turns)


@dataclass
class Continuation:
    """An answer to sample or to continue (partial.py): its prompt, the tokens it has (sampled at earlier steps), its
    group among the requests, whether the step must wait for it to finish (the staleness bound), and the tokens at
    which it pauses rather than ends (a tool call, turns.py). A prompt with its own max_tokens is the answer's
    conversation so far, tool turns in it (turns.continuation): that answer has begun, and is a request of its own."""

    prompt: Prompt
    prefix: list[int]
    group: int
    pinned: bool = False
    pause_ids: tuple = ()


def encode_prompt(processor, example) -> Prompt:
    videos = getattr(example, "videos", [])
    # the frames come sampled and sized (video.py); the metadata places them in time
    kwargs = {"videos": [v.frames for v in videos], "video_metadata": [v.metadata() for v in videos]} if videos else {}
    out = processor(text=[example.prompt], images=example.images or None, return_tensors="pt", **kwargs)
    types = out.get("mm_token_type_ids")
    return Prompt(
        out["input_ids"][0], out.get("pixel_values"), out.get("image_grid_thw"), list(example.images),
        token_types=None if types is None else types[0], pixel_values_videos=out.get("pixel_values_videos"),
        video_grid_thw=out.get("video_grid_thw"), second_per_grid_ts=out.get("second_per_grid_ts"), videos=videos,
        template_ids=processor.tokenizer(example.prompt)["input_ids"],
    )  # fmt: skip


def vision_token_ids(tokenizer, tokens=families.VISION_TOKENS) -> list[int]:
    """Ids of the family's vision special tokens (families.Family.vision_tokens): sampling one would put an image
    placeholder into a response, and the next training forward fails with "Image features and image tokens do not
    match". They are forbidden at every sampling step."""
    vocab = tokenizer.get_vocab()
    return sorted(vocab[t] for t in tokens if t in vocab)


class HFEngine:
    """Samples with the training model's own `generate`. Under FSDP2 every forward is a collective, so every rank
    must generate together (`synced_gpus` keeps finished ranks stepping until all are done).

    `generate` returns token ids only: asking it for logits (`output_logits`) would keep a fp32 (rows, vocab) tensor
    per decode step until the call ends, 0.6 MB a row and step for Qwen's 151,936 tokens (~400 GB for 320 answers of
    2,048 tokens). The sampled tokens' log-probs come instead from one no-grad forward over each chunk's prompts and
    answers (logprobs.forward_logprobs: chunked LM head, no full logits), and at most `rollout.max_num_seqs` sequences
    go through one generate call, which bounds the KV cache and that forward alike."""

    def __init__(self, cfg, processor):
        if cfg.rollout.max_num_seqs < 1:
            raise ValueError(f"rollout.max_num_seqs={cfg.rollout.max_num_seqs} must be >= 1")
        self.model, self.tokenizer = None, processor.tokenizer
        self.pad_id = self.tokenizer.pad_token_id
        self.max_seqs = cfg.rollout.max_num_seqs
        self.packed = cfg.actor.padding_free  # score the answers in the trainer's own layout
        self.timings = {"time/wake": 0.0, "time/weight_sync": 0.0, "time/sleep": 0.0}
        self.offload = None  # set by the trainer: what to move to host memory while generating (offload.py)

    def wake(self):
        pass

    def sleep(self):
        if self.offload is not None:
            self.offload.onload(self.timings)

    def close(self):
        pass  # nothing of its own: it samples with the trainer's model

    def sync_weights(self, model):
        # it samples with the training model itself: "syncing" is pointing at it
        self.model = model
        self.forbidden = vision_token_ids(self.tokenizer, families.family(model).vision_tokens)
        eos = model.generation_config.eos_token_id or self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self.image_token_id = model.config.image_token_id

    @torch.no_grad()
    def generate(self, prompts: list[Prompt], n: int, params: SamplingParams, seed: int) -> list[Sample]:
        from transformers import GenerationConfig

        if self.offload is not None:  # the optimizer's state only: this engine generates with the policy's weights
            self.offload.offload(self.timings)
        world = dist.get_world_size() if dist.is_initialized() else 1
        greedy = params.temperature <= 0
        # A fresh config: a checkpoint's own generation_config (Qwen ships top_k=1, repetition_penalty=1.05) must
        # not silently change the sampling distribution the loss assumes. No output_logits / output_scores.
        gen_cfg = GenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p,
            top_k=0,  # 0 disables it; None would fall back to the library default of 50
            max_new_tokens=params.max_tokens,
            eos_token_id=sorted(self.eos_ids | set(params.stop_token_ids)),
            pad_token_id=self.pad_id,
            suppress_tokens=self.forbidden,
            use_cache=True,
        )
        rows = [i for i in range(len(prompts)) for _ in range(n)]  # prompt of each sequence, n consecutive
        chunks = [rows[i : i + self.max_seqs] for i in range(0, len(rows), self.max_seqs)]
        count, filler = self._agree_on_calls(prompts, len(chunks), world)
        temperature = 1.0 if greedy else params.temperature
        samples = []
        for k in range(count):
            real = chunks[k] if k < len(chunks) else []  # past its own chunks a rank runs filler calls
            chunk_prompts = [prompts[i] for i in real] or filler
            answers = self._sample_chunk(chunk_prompts, gen_cfg, chunk_seed(seed, k), temperature, world)
            for i, (ids, logp, truncated) in zip(real, answers):
                cap = prompts[i].max_tokens
                if cap is not None and len(ids) > cap:  # one generate call has one length limit: cut to the prompt's
                    ids, logp, truncated = ids[:cap], logp[:cap], True
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                samples.append(Sample(prompt_index=i, response_ids=ids, logprobs=logp, text=text, truncated=truncated))
        return samples

    def _agree_on_calls(self, prompts, chunks, world):
        """Every generate step and every log-prob forward all-gathers FSDP2 shards, so every rank must make as many
        calls as the rank with the most chunks, or their collectives pair up wrongly and hang or crash. synced_gpus
        covers answers of different lengths within a call; a rank with fewer chunks runs filler calls (one sequence
        of a prompt it holds) and drops what they return. Returns the agreed number of calls and the filler.

        Whether a call's prompts have images does not matter: every generate call and every log-prob forward runs
        the vision tower once, on a dummy image when it has none (logprobs.add_vision_dummy, _sample_chunk), as the
        training forwards do. A rank with no prompt at all borrows one from another rank, to have something to
        generate from."""
        device = logprobs.compute_device(self.model)
        need = torch.tensor([chunks, -len(prompts)], device=device)  # MAX of both: most chunks, fewest prompts
        if world > 1:
            dist.all_reduce(need, op=dist.ReduceOp.MAX)
        count, fewest = int(need[0]), -int(need[1])
        if fewest > 0 or count == 0:
            return count, prompts[-1:]
        offered = [None] * world
        mine = [replace(p, images=[], videos=[]) for p in prompts[-1:]]  # no PIL frames
        dist.all_gather_object(offered, mine)
        return count, next(o for o in offered if o)

    def _sample_chunk(self, prompts, gen_cfg, seed, temperature, world):
        """One generate call on `prompts` (one sequence each), then one no-grad forward for the log-probs of what it
        sampled. Returns (response ids cut after the first end-of-sequence token, their log-probs, truncated) per
        prompt."""
        device = logprobs.compute_device(self.model)
        inputs, _, _ = collate(prompts, [[] for _ in prompts], self.pad_id, self.image_token_id)
        inputs = {k: v.to(device) for k, v in inputs.items()}
        one_pass = contextlib.nullcontext()
        if "pixel_values" in inputs and "pixel_values_videos" in inputs:
            # one tower pass for both, whether generate encodes them before its prefill (transformers 5.19) or the
            # prefill's forward does (5.17)
            one_pass = logprobs.one_vision_pass(self.model, *(inputs[k] for k in VISION_INPUTS[:4]))
        elif "pixel_values" not in inputs and "pixel_values_videos" not in inputs:
            if logprobs.generate_encodes_images_first(self.model):
                logprobs.vision_dummy(self.model)  # where generate runs the tower on another rank's images
        torch.manual_seed(seed)
        with one_pass:
            sequences = self.model.generate(**inputs, generation_config=gen_cfg, synced_gpus=world > 1)  # (C, P + R)
        responses, truncated = [], []
        stops = set(gen_cfg.eos_token_id)
        for ids in sequences[:, inputs["input_ids"].shape[1] :].tolist():  # pad after the EOS of a finished row
            end = next((t + 1 for t, tok in enumerate(ids) if tok in stops), None)
            responses.append(ids if end is None else ids[:end])
            truncated.append(end is None)
        del inputs, sequences  # the KV cache went with the call: the forward below has the memory to itself
        if self.packed:
            batch, response_ids, _ = pack(prompts, responses, self.image_token_id)
        else:
            batch, response_ids, _ = collate(prompts, responses, self.pad_id, self.image_token_id)
        logp = logprobs.forward_logprobs(self.model, batch, response_ids, temperature)[0].cpu()  # (C, T)
        return [(ids, logp[row, : len(ids)].tolist(), cut) for row, (ids, cut) in enumerate(zip(responses, truncated))]


def chunk_seed(seed: int, chunk: int) -> int:
    """Seed of the chunk-th generate call of one `HFEngine.generate`: chunk 0 keeps the caller's seed (a batch that
    fits one call samples what it did before chunking existed), later chunks step by 2^64 / golden ratio (a Weyl
    sequence), far from any nearby caller seed, so a resumed run samples exactly the same answers."""
    return (seed + chunk * 0x9E3779B97F4A7C15) % 2**64


def collapse_image_pads(input_ids: list[int], image_token_id: int) -> list[int]:
    """The processor expands each image's single <|image_pad|> into one per image token; vLLM wants the single
    one back (it expands it again itself, and expanding an expanded prompt corrupts it)."""
    return [t for i, t in enumerate(input_ids) if t != image_token_id or i == 0 or input_ids[i - 1] != image_token_id]


def engine_prompt_ids(prompt: Prompt, image_token_id: int) -> list[int]:
    """The prompt as vLLM takes it: one pad per image and video, which it expands itself. Qwen3-VL's videos expand
    into more than pads (a timestamp and vision start/end tokens per frame pair), so the template's own tokens are
    used where the prompt has them."""
    if prompt.template_ids is not None:
        return list(prompt.template_ids)
    return collapse_image_pads(prompt.input_ids.tolist(), image_token_id)


def engine_video(clip) -> tuple:
    """A video as vLLM takes it: the frames as one (T, H, W, 3) uint8 array, and the metadata that places them in
    time, marked as sampled already (vLLM would otherwise sample again at its processor's default rate)."""
    import numpy as np

    return np.stack([np.asarray(f) for f in clip.frames]), {**dict(clip.metadata()), "do_sample_frames": False}


def sampled_logprobs(completion) -> list[float]:
    """A vLLM completion's log-prob of each token it sampled (requested with logprobs=0: the sampled token's only)."""
    return [completion.logprobs[t][tok].logprob for t, tok in enumerate(completion.token_ids)]


def request_seed(member_seed: int, prompt: int, n: int) -> int:
    """Per-request seed: a prompt's n samples draw from seed .. seed + n - 1 (vLLM gives the i-th of n seed + i),
    so every (step, rank, prompt, sample) has its own stream and a resumed run samples what an uninterrupted one
    would have sampled."""
    return (member_seed * 1_000_003 + prompt * n) % 2**63


def sleep_level_for(requested: int, lora_rank: int) -> int:
    """The vLLM sleep level a run uses (rollout.sleep_level; -1, the default, chooses). Level 1 copies every weight
    to host memory at each sleep (pinned, one block per allocation) and back at each wake; level 2 discards them,
    and vLLM (0.26-0.33 gpu_worker.sleep / wake_up) keeps and restores only the model's buffers. The cheapest correct
    level: 2 where the next sync resends every weight (full fine-tuning: sync_weights sends every parameter, the
    frozen vision tower's too), 1 where it resends only what changed (LoRA: the base's other weights must survive)."""
    if requested != -1:
        return requested
    return 1 if lora_rank else 2


class VLLMEngine:
    """A vLLM `LLM` inside each torchrun rank (`external_launcher`: no extra processes, no Ray).

    `rollout.tensor_parallel_size` = tp groups contiguous ranks [0..tp), [tp..2tp), ... into one engine sharded
    over them; vLLM requires every member to submit identical requests, so `generate` gathers the group's prompts,
    all members generate all of them (same seeds), and each keeps its own slice. Groups are data-parallel replicas.

    The engine loads the checkpoint from disk at start (not `load_format="dummy"`): non-parameter state that vLLM
    computes at load time, such as the rotary tables of the vision tower, is then right, and only parameters need
    to be streamed at each sync. vLLM itself saves and restores buffers across a level-2 sleep (gpu_worker.sleep).
    """

    def __init__(self, cfg, processor):
        # in-process engine core; vLLM reads this when it is imported and when the engine starts
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        on_cuda = torch.cuda.is_available()
        vllm_compat.sampler_environment(on_cuda)
        vllm_compat.model_runner_environment()  # the runner the CPU tests run, on CUDA too
        quiet = quiet_logs(cfg.trainer.verbose)
        from vllm import LLM

        r, d = cfg.rollout, cfg.data
        rank = dist.get_rank()
        family = families.family_of(cfg.actor.model_path)
        self.tp, self.max_images = r.tensor_parallel_size, r.max_images_per_prompt
        self.max_videos = r.max_videos_per_prompt
        if min(self.max_images, self.max_videos) < 0:
            raise ValueError("rollout.max_images_per_prompt / max_videos_per_prompt at -1 (the data's most): call "
                             "check_prompt_limits with the data before the engine starts")  # fmt: skip
        self.tokenizer = processor.tokenizer
        self.image_token_id = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        # -100 is the largest bias vLLM accepts: exp(-100) ~ 4e-44, so these tokens are never drawn
        self.logit_bias = {t: -100.0 for t in vision_token_ids(self.tokenizer, family.vision_tokens)}
        # Sleep mode exists on CUDA only (enabling it elsewhere raises): elsewhere the engine stays awake.
        self.sleep_level = sleep_level_for(r.sleep_level, cfg.actor.lora_rank) if on_cuda else 0
        if r.sleep_level > 0 and not on_cuda and rank == 0 and not quiet:
            print("rollout: vLLM sleep mode needs CUDA; here the engine stays awake (rollout.sleep_level ignored)")
        if not on_cuda:
            # Eager on CPU, as enforce_eager below asks of the model: vLLM still compiles its log-prob gather with
            # inductor at the first sample, 2.3 s of every CPU run's start for a count it computes alike without
            torch.compiler.set_stance("force_eager")
        # the trainer computes in bf16 on GPU, fp32 on CPU (where a family's CPU kernels may need another dtype)
        self.dtype = torch.bfloat16 if on_cuda else family.vllm_cpu_dtype
        self.cpu_moe = family.moe and not on_cuda
        self.torch_linear = not on_cuda and self.dtype == torch.float32  # (vllm_compat.torch_cpu_linear)
        if self.dtype != torch.float32 and not on_cuda and rank == 0:
            print(f"rollout: vLLM's CPU kernels for this model need {self.dtype}: the engine samples in it, the "
                  "trainer computes in fp32 (rollout/logprob_diff_mean shows the gap)")  # fmt: skip
        max_model_len = d.max_prompt_length + d.max_response_length
        if on_cuda:
            platform = {"gpu_memory_utilization": r.gpu_memory_utilization}
        else:
            platform = {
                # on CPU a utilization would be a share of the host's RAM: size the KV cache explicitly
                "kv_cache_memory_bytes": r.cpu_kv_cache_bytes,
                # vLLM 0.32's CPU runner crashes ("CPU Generator does not use offset") when it rewinds a seeded
                # request's generator after a partial prefill: schedule every prompt whole instead
                "enable_chunked_prefill": False,
                "max_num_batched_tokens": max(max_model_len, 8192),
                # Prefix caching shares whole KV blocks only, and vLLM's CPU blocks are 128 tokens by default, longer
                # than many prompts: the n answers of a prompt, and a partial rollout's continued answers, then each
                # prefilled the whole prompt again (5,808 prefilled tokens a step of the partial bench, 2,896 at 32).
                # 32 is the CPU attention's preferred multiple (vLLM warns below it), 0.26 to 0.33.
                "block_size": 32,
                **family.vllm_cpu_kwargs,
            }
        # the same image bounds as the trainer's processor, so an image becomes the same number of tokens
        mm_kwargs = {"size": {"shortest_edge": d.min_pixels, "longest_edge": d.max_pixels}}
        if self.max_videos:
            # Videos come sampled and sized (video.py) and get the bounds under which the trainer's processor keeps
            # them as they are. Scoped per modality: a plain `size` would bound video frames by the images' budget.
            # (Only with videos on, so an image-only run passes vLLM what it always did.)
            size = video_processor_size(processor.video_processor, d.video_min_pixels, d.video_max_pixels, d.max_frames)
            mm_kwargs = vllm_compat.modality_kwargs(mm_kwargs, {"size": size, "do_sample_frames": False})
        ip, vp = processor.image_processor, processor.video_processor
        if self.max_videos and [list(ip.image_mean), list(ip.image_std)] != [list(vp.image_mean), list(vp.image_std)]:
            # vLLM 0.32 normalizes pixels on the device, videos' too, with the IMAGE processor's mean and std: where
            # a checkpoint's video processor normalizes otherwise (the tiny Qwen3-VL of the tests), its video tokens
            # would differ from the trainer's (0.5 nats there); the processors' own normalization is then used
            platform.update(vllm_compat.processor_normalization())
        limits = {"image": r.max_images_per_prompt, "video": r.max_videos_per_prompt}
        if self.max_videos and not vllm_compat.budget_reads_modality_kwargs():
            sizes = (d.max_pixels, d.video_max_pixels, d.max_frames, family.image_side)
            limits = vllm_compat.capped_profile(limits, *sizes)
        self.clip_metadata = self.max_videos and vllm_compat.clip_metadata_per_request(cfg.actor.model_path)
        # The engine start runs five full garbage collections (around the model load, and to freeze the heap for
        # serving at its end: EngineCore.__init__'s freeze_gc_heap, 0.26 to 0.33), each walking every object the
        # imports made: 1.3 s of a CPU start. Frozen now, the heap is left out of them; it ends up frozen all the
        # same. (Without a collection first: that would cost one of the five, to free some 40 objects.)
        gc.freeze()
        with filtered_stderr(quiet), vllm_compat.torch_cpu_linear(self.torch_linear):  # (NUMA note: quiet.PRINTED)
            self.llm = LLM(
                model=cfg.actor.model_path,
                dtype=self.dtype,
                distributed_executor_backend="external_launcher",
                tensor_parallel_size=self.tp,
                seed=cfg.trainer.seed + rank // self.tp,  # one engine seed per TP group
                enable_sleep_mode=self.sleep_level > 0,
                enforce_eager=r.enforce_eager or not on_cuda,  # CUDA graphs only on CUDA
                max_model_len=max_model_len,
                max_num_seqs=r.max_num_seqs,
                limit_mm_per_prompt=limits,
                mm_processor_kwargs=mm_kwargs,
                # The trainer's log-prob is log_softmax(logits / T) over the whole vocabulary. At T = 1 that is exactly
                # vLLM's raw_logprobs; at other temperatures processed_logprobs has the temperature but also top-p and
                # the vision-token bias, a small mismatch that rollout/logprob_diff_mean then shows.
                logprobs_mode="raw_logprobs" if r.temperature == 1.0 else "processed_logprobs",
                # vLLM keeps the images and clips it has processed (their pixels, host memory) for requests that
                # bring them again, by default up to 4 GiB per rank: epochs of a large image set or a tool run's
                # ever-new crops fill it, 32 GiB on a node of 8. memory_plan.py counts the cap in host memory.
                mm_processor_cache_gb=r.mm_cache_gb,
                use_tqdm_on_load=not quiet,  # its progress bar for loading the checkpoint: with trainer.verbose
                **platform,
            )
        vllm_compat.skip_engine_teardown(self.llm)  # it would tear torch.distributed down after main() did
        # a sub-group's collectives get trainer.collective_timeout_s as well (new groups take torch's default otherwise)
        timeout = datetime.timedelta(seconds=cfg.trainer.collective_timeout_s)
        self.tp_group = dist.new_subgroups(group_size=self.tp, timeout=timeout)[0] if self.tp > 1 else None
        self.asleep = set()  # the sleeping parts: "weights", "kv_cache"
        self.synced = False  # until the first sync the engine holds the checkpoint's weights
        self.timings = {"time/wake": 0.0, "time/weight_sync": 0.0, "time/sleep": 0.0}
        self.offload = None  # set by the trainer: what to move to host memory while generating (offload.py)
        self.sleep()  # give the memory back until the first rollout, so the trainer can load its model

    def _wake(self, tags):
        tags = [t for t in tags if t in self.asleep]
        if tags:
            t0 = time.perf_counter()
            # the blocks training freed stay in PyTorch's cache, where vLLM's own allocator cannot use them: give
            # them back to the device first (memory_plan.py's rollout phase counts on it)
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=tags)
            self.asleep -= set(tags)
            self.timings["time/wake"] += time.perf_counter() - t0

    def wake(self):
        self.timings = dict.fromkeys(self.timings, 0.0)
        self._wake(["weights"])  # the KV cache comes back after the sync, so the sync's full tensors fit beside it

    def sleep(self):
        if self.sleep_level:
            t0 = time.perf_counter()
            self.llm.sleep(level=self.sleep_level)
            self.asleep = {"weights", "kv_cache"}
            self.timings["time/sleep"] = time.perf_counter() - t0
        if self.offload is not None:  # after the KV cache is gone: the trainer's state comes back into its memory
            self.offload.onload(self.timings)

    def close(self):
        """Shut the engine down (distributed.shut_down: every rank at the same point, while the process groups it uses
        are alive). A sleeping engine is woken first, the trainer's state offloaded as for a rollout (the memory plan's
        rollout phase): memory freed while asleep makes vLLM's CuMemAllocator unmap again what sleep unmapped, a
        CUDA error for each allocation (its free path handles that on ROCm only, vLLM 0.26 to 0.33)."""
        if self.asleep and self.offload is not None:
            self.offload.offload(self.timings)
        self._wake(["weights", "kv_cache"])
        vllm_compat.shut_down(self.llm, collect=torch.cuda.is_available())

    @torch.no_grad()
    def sync_weights(self, model):
        """Stream the trainer's parameters into vLLM one tensor at a time: all-gather one FSDP2 shard, cast, load,
        drop it. Never a full state dict on one rank. Every rank must call this (each all-gather is collective).

        With LoRA vLLM gets the merged weights (base + scale B A) under the plain names, and after the first sync
        only the modules whose weights can change. vLLM's layer-wise reload (model_loader/reload/layerwise.py) keeps a
        layer of which no tensor comes, but rebuilds one of which only some come from those alone, the rest
        uninitialised; and it fuses q/k/v into one layer and gate/up into another. So every parameter of the
        attention or MLP that holds an adapted module is resent (a lone q_proj adapter resends k, v, o and the
        biases too). A level-2 sleep discards the engine's weights: then every one, every time."""
        self._wake(["weights"])
        t0 = time.perf_counter()
        params = lora.merged_parameters(model)  # parameters only: see the class docstring on buffers
        if self.synced and self.sleep_level != 2 and any(layer is not None for _, _, layer in params):
            changed = {name.rsplit(".", 2)[0] for name, p, layer in params if layer is not None or p.requires_grad}
            params = [x for x in params if x[0].rsplit(".", 2)[0] in changed]

        def weights():
            for name, param, layer in params:
                if moe.EXPERT_PARAM.match(name):  # an MoE's experts: one expert at a time, merged if adapted
                    delta = lora.expert_deltas(layer) if layer is not None else None
                    yield from moe.stream_experts(name, param.detach(), self.dtype, delta)
                    continue
                if layer is None:
                    # cast before gathering (halves the traffic for bf16); fp32 -> bf16 is the same either way round
                    full = lora.full_tensor(param.detach().to(self.dtype))
                else:  # merged in fp32 (a bf16 base is promoted by the fp32 update), then cast
                    full = (lora.full_tensor(param.detach()) + lora.lora_delta(layer)).to(self.dtype)
                yield name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""), full

        # With an iterator reload_weights re-runs vLLM's post-load processing (CPU repacks weights); WITHOUT one it
        # would reload the checkpoint from disk and silently drop the sync.
        # (else vLLM 0.32 leaves reloaded experts unpacked on CPU; only when they come: a LoRA resync sends none, and
        # a layer that gets nothing keeps its tensors and must keep its kernel)
        if self.cpu_moe and any(moe.EXPERT_PARAM.match(name) for name, _, _ in params):
            self.llm.apply_model(vllm_compat.forget_cpu_moe_kernels)
        with vllm_compat.torch_cpu_linear(self.torch_linear):
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights()})
        self.synced = True
        # Cached KV and vision-encoder outputs belong to the old weights. reload_weights empties the runner's encoder
        # cache but not the scheduler's record of it, which then skips re-encoding ("Encoder cache miss"): reset both.
        self.llm.reset_prefix_cache()
        self.llm.llm_engine.reset_encoder_cache()
        self.llm.reset_mm_cache()  # (rollout.mm_cache_gb: it keeps one rollout's images, whose tool turns resend them)
        self.timings["time/weight_sync"] += time.perf_counter() - t0

    def generate(self, prompts: list[Prompt], n: int, params: SamplingParams, seed: int) -> list[Sample]:
        self._prepare(prompts)
        mine = [(engine_prompt_ids(p, self.image_token_id), p.images, [engine_video(v) for v in p.videos],
                 min(params.max_tokens, p.max_tokens or params.max_tokens)) for p in prompts]  # fmt: skip
        groups = self._gather((mine, seed))
        requests, sampling = [], []
        for member_prompts, member_seed in groups:
            for i, (ids, images, videos, max_tokens) in enumerate(member_prompts):
                requests.append(self._request(ids, images, videos))
                sampling.append(self._sampling(params, n, max_tokens, request_seed(member_seed, i, n)))
        outputs = self.llm.generate(requests, sampling, use_tqdm=False) if requests else []  # (a turn without calls)
        # the outputs follow the members' prompts in group order: keep this rank's own slice
        member = dist.get_rank(self.tp_group) if self.tp_group is not None else 0
        start = sum(len(member_prompts) for member_prompts, _ in groups[:member])
        samples = []
        for index, (prompt, out) in enumerate(zip(prompts, outputs[start : start + len(prompts)], strict=True)):
            # vLLM expanded the image pads itself: the prompt must be token for token the one the trainer scores
            if list(out.prompt_token_ids) != prompt.input_ids.tolist():
                raise RuntimeError(
                    f"vLLM's prompt ({len(out.prompt_token_ids)} tokens) differs from the trainer's "
                    f"({len(prompt.input_ids)}): are rollout and trainer image pixel bounds the same?"
                )
            for completion in sorted(out.outputs, key=lambda c: c.index):
                ids = list(completion.token_ids)
                samples.append(Sample(
                    prompt_index=index,
                    response_ids=ids,
                    logprobs=sampled_logprobs(completion),
                    text=self.tokenizer.decode(ids, skip_special_tokens=True),
                    truncated=completion.finish_reason == "length",
                ))  # fmt: skip
        return samples

    def _prepare(self, prompts):
        if self.offload is not None:  # the sync has read the policy: its state can leave before the KV cache wakes
            self.offload.offload(self.timings)
        self._wake(["weights", "kv_cache"])
        for what, most, limit in (
            ("images", max((len(p.images) for p in prompts), default=0), self.max_images),
            ("videos", max((len(p.videos) for p in prompts), default=0), self.max_videos),
        ):
            if most > limit:
                raise ValueError(f"a prompt has {most} {what}: raise rollout.max_{what}_per_prompt (now {limit})")

    def _gather(self, mine) -> list:
        """Every member of a TP group must submit the same requests: all members' (requests, ...), in rank order."""
        if self.tp_group is None:
            return [mine]
        members = [None] * self.tp
        dist.all_gather_object(members, mine, group=self.tp_group)
        return members

    def _request(self, ids, images, videos) -> dict:
        request = {"prompt_token_ids": ids}
        mm_data = {"image": images, "video": videos}
        if images or videos:
            request["multi_modal_data"] = {k: v for k, v in mm_data.items() if v}
        if videos and self.clip_metadata:  # flat: a request's own videos_kwargs would replace the engine's
            metadata = [{k: v for k, v in meta.items() if k != "do_sample_frames"} for _, meta in videos]
            request["mm_processor_kwargs"] = {"video_metadata": metadata}
        return request

    def _sampling(self, params, n, max_tokens, seed):
        from vllm import SamplingParams as VSamplingParams

        greedy = params.temperature <= 0
        return VSamplingParams(
            n=n,
            temperature=0.0 if greedy else params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=0,  # off, as in the HF engine and the trainer's log-probs
            max_tokens=max_tokens,
            stop_token_ids=list(params.stop_token_ids),
            logprobs=0,  # the sampled token's log-prob only
            logit_bias=self.logit_bias,
            seed=seed,
            detokenize=False,  # decoded by the caller exactly as the HF engine does
        )

    def generate_until(self, requests: list[Continuation], quota: int, params: SamplingParams, seed: int) -> list:
        """Partial rollouts (partial.py): each answer continued from its prefix with the same images and videos and
        max_tokens less what it has; generation stops as soon as `quota` of this rank's groups have all their answers
        finished and every pinned answer has, and the others are stopped where they are (vLLM's offline generate would
        run them all to the end, so the engine is stepped here). A group's answers that have not started go as one
        request of that many answers, rendered once (its images processed once, not once per answer); vLLM seeds the
        i-th answer of a request seed + i, so each draws the stream it would draw as a request of its own. Returns per
        answer (new token ids, their log-probs, finished, truncated); an answer that stopped at one of its pause_ids
        (a tool call) has not finished, and its group is not complete. A TP group's members submit every member's
        requests and stop when each member has its quota: a decision each takes alike from the same outputs."""
        self._prepare([c.prompt for c in requests])
        mine = [(engine_prompt_ids(c.prompt, self.image_token_id) + list(c.prefix), c.prompt.images,
                 [engine_video(v) for v in c.prompt.videos],
                 min(params.max_tokens, c.prompt.max_tokens or params.max_tokens) - len(c.prefix), c.group, c.pinned,
                 bool(c.prefix) or c.prompt.max_tokens is not None, tuple(c.pause_ids)) for c in requests]  # fmt: skip
        members = self._gather((mine, quota, seed))
        prompts, sampling, owner, first = [], [], [], []  # owner per answer; first answer of each request
        for m, (member_requests, _, member_seed) in enumerate(members):
            i = 0
            while i < len(member_requests):
                ids, images, videos, max_tokens, group, pinned, started, pause_ids = member_requests[i]
                n = 1  # (the answers of a group come one after another)
                while not started and member_requests[i + n : i + n + 1] and member_requests[i + n][4:] == (
                    group, pinned, False, pause_ids
                ):  # fmt: skip
                    n += 1
                first.append(len(owner))
                prompts.append(self._request(ids, images, videos))
                stops = replace(params, stop_token_ids=(*params.stop_token_ids, *pause_ids))
                sampling.append(self._sampling(stops, n, max_tokens, request_seed(member_seed, i, 1)))
                owner += [(m, group, pinned, pause_ids)] * n
                i += n
        unfinished = collections.Counter((m, g) for m, g, _, _ in owner)  # open answers per (member, group)
        complete = [0] * len(members)  # groups of each member whose answers all finished
        pinned = sum(p for _, _, p, _ in owner)

        def quota_met():
            return pinned == 0 and all(c >= q for c, (_, q, _) in zip(complete, members))

        tokens, logprobs, finish = [[] for _ in owner], [[] for _ in owner], [None] * len(owner)
        paused = [False] * len(owner)  # finished at one of its pause_ids: not the answer's end
        member = dist.get_rank(self.tp_group) if self.tp_group is not None else 0
        start = sum(len(r) for r, _, _ in members[:member])
        if owner and not quota_met():
            internal = self.llm.enqueue(prompts, sampling, use_tqdm=False)
            index = {rid: u for u, rid in enumerate(vllm_compat.external_ids(self.llm, internal))}
            engine = self.llm.llm_engine

            def record(out):
                """Each answer's tokens so far and the reason it finished (None: it has not)."""
                u = index[out.request_id]
                for completion in out.outputs:
                    k = first[u] + completion.index
                    if start <= k < start + len(requests):
                        self._check_prompt(out, requests[k - start])
                    tokens[k] = list(completion.token_ids)
                    logprobs[k] = sampled_logprobs(completion)
                    finish[k] = completion.finish_reason
                    paused[k] = finish[k] == "stop" and bool(tokens[k]) and tokens[k][-1] in owner[k][3]
                return u

            while not quota_met() and engine.has_unfinished_requests():
                for out in engine.step():  # (only finished requests report: final-only)
                    u = record(out)
                    m, group, was_pinned, _ = owner[first[u]]
                    ended = sum(not paused[first[u] + c.index] for c in out.outputs)
                    unfinished[m, group] -= ended
                    complete[m] += ended > 0 and unfinished[m, group] == 0
                    pinned -= was_pinned * ended
            for out in vllm_compat.stop_requests(self.llm, internal):  # (it skips those that finished)
                record(out)  # (a request of several answers: those that finished keep their reason)
        return [(tokens[k], logprobs[k], finish[k] is not None and not paused[k], finish[k] == "length")
                for k in range(start, start + len(requests))]  # fmt: skip

    def _check_prompt(self, out, request):
        # vLLM expanded the image pads itself: the prompt must be token for token the one the trainer scores
        if list(out.prompt_token_ids) != request.prompt.input_ids.tolist() + list(request.prefix):
            raise RuntimeError(
                f"vLLM's prompt ({len(out.prompt_token_ids)} tokens) differs from the trainer's "
                f"({len(request.prompt.input_ids)} + {len(request.prefix)} carried): are rollout and trainer image "
                "pixel bounds the same?"
            )


ENGINES = {"hf": HFEngine, "vllm": VLLMEngine}


def make_engine(cfg, processor):
    """Build the engine. Every rank must call it at the same point, right after init_process_group: vLLM's engine
    start is collective and should see the device before the trainer takes memory."""
    return ENGINES[cfg.rollout.engine](cfg, processor)


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
