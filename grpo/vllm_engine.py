"""The `vllm` rollout engine, the fast path: a vLLM engine inside every torchrun rank, its weights streamed from the
trainer at each sync, asleep while the trainer trains (rollout.py: the engine interface); for partial rollouts, its
generation stepped and stopped at the step's quota of complete groups (`generate_until`, partial.py)."""

from __future__ import annotations

import collections
import contextlib
import datetime
import gc
import os
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from grpo import families, lora, moe, replay, vllm_compat
from grpo.quiet import filtered_stderr, quiet_logs, unsent_weights
from grpo.samples import Continuation, Prompt, Sample, SamplingParams, engine_prompt_ids, vision_token_ids
from grpo.video import video_processor_size


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


def family_config(model_path: str):
    """The checkpoint's text config (its experts: num_experts, num_experts_per_tok)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path).get_text_config()


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

    def __init__(self, cfg, processor, offload=None, carry=None):
        # in-process engine core; vLLM reads this when it is imported and when the engine starts
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        on_cuda = torch.cuda.is_available()
        vllm_compat.sampler_environment(on_cuda)
        vllm_compat.model_runner_environment()  # the runner the CPU tests run, on CUDA too
        r, d = cfg.rollout, cfg.data
        # Sleep mode exists on CUDA only (enabling it elsewhere raises): elsewhere the engine stays awake.
        self.sleep_level = sleep_level_for(r.sleep_level, cfg.actor.lora_rank) if on_cuda else 0
        quiet = quiet_logs(cfg.trainer.verbose, self.sleep_level)
        from vllm import LLM

        rank = dist.get_rank()
        family = families.family_of(cfg.actor.model_path)
        self.tp, self.max_images = r.tensor_parallel_size, r.max_images_per_prompt
        self.max_videos = r.max_videos_per_prompt
        if min(self.max_images, self.max_videos) < 0:
            raise ValueError("rollout.max_images_per_prompt / max_videos_per_prompt at -1 (the data's most): call "
                             "check_prompt_limits with the data before the engine starts")  # fmt: skip
        self.tokenizer = processor.tokenizer
        # <|image_pad|> (Qwen's), <|image|> (GLM-4.1V's): what each image's run of tokens collapses back to
        self.image_token_id = getattr(processor, "image_token_id", None) or self.tokenizer.convert_tokens_to_ids(
            "<|image_pad|>"
        )
        # -100 is the largest bias vLLM accepts: exp(-100) ~ 4e-44, so these tokens are never drawn
        self.logit_bias = {t: -100.0 for t in vision_token_ids(self.tokenizer, family.vision_tokens)}
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
            platform = {"gpu_memory_utilization": r.gpu_memory_utilization, **vllm_compat.gdn_prefill(
                family.linear_attention)}  # fmt: skip
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
        if hasattr(processor.image_processor, "max_soft_tokens"):  # Gemma 4's budget instead (data.max_soft_tokens)
            mm_kwargs["max_soft_tokens"] = d.max_soft_tokens or processor.image_processor.max_soft_tokens
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
        # routing replay: vLLM's own capture of each request's experts where it has one, else the routers' hooks
        # during a re-prefill of each finished sequence (routing.record_routes), which only an eager engine runs
        self.route_dtype = replay.route_dtype(family_config(cfg.actor.model_path).num_experts) if (
            cfg.algorithm.routing_replay == "r3") else None  # fmt: skip
        self.capture_routes = self.route_dtype is not None and vllm_compat.captures_routes(on_cuda, self.tp)
        if self.route_dtype is not None and not self.capture_routes and on_cuda and not r.enforce_eager:
            raise ValueError(
                "algorithm.routing_replay=r3: this vLLM returns no routed experts under the V1 model runner, nor "
                "under tensor parallelism (0.32 and 0.33 capture them in Model Runner V2 only, on the first TP rank "
                "only), so the engine's routes are read by hooks on its routers, which CUDA graphs do not run: set "
                "rollout.enforce_eager=true, or VLLM_USE_V2_MODEL_RUNNER=1 with rollout.tensor_parallel_size=1"
            )
        if self.capture_routes:
            platform["enable_return_routed_experts"] = True
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
                # The trainer's log-prob is log_softmax(logits / T) over the vocabulary less the vision tokens
                # (logprobs.forbid_sampling): vLLM's processed_logprobs, taken after the logit bias that forbids them
                # and the temperature, at every temperature (its raw_logprobs, before the bias, would differ by
                # log(1 - p(vision tokens))). With rollout.top_p < 1 they are also renormalised over the nucleus,
                # which the trainer's are not: rollout/logprob_diff_mean then shows it.
                logprobs_mode="processed_logprobs",
                # vLLM keeps the images and clips it has processed (their pixels, host memory) for requests that
                # bring them again, by default up to 4 GiB per rank: epochs of a large image set or a tool run's
                # ever-new crops fill it, 32 GiB on a node of 8. plan_advice.format_plan names the cap with host memory.
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
        self.stats = {}  # counts of the last generate call: none of its own
        self.offload = offload  # what to move to host memory while generating (offload.TrainerOffload), or None
        self.carry = carry  # partial rollouts' answers in flight between steps (partial.Carry), or None
        self.sleep()  # give the memory back until the first rollout, so the trainer can load its model

    def _wake(self, tags):
        tags = [t for t in tags if t in self.asleep]
        if tags:
            t0 = time.perf_counter()
            # the blocks training freed stay in PyTorch's cache, where vLLM's own allocator cannot use them: give
            # them back to the device first (device_plan.py's rollout phase counts on it)
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
        # After a level-2 sleep a parameter the sync does not send holds uninitialised memory, and the engine would
        # sample from it: the run stops at its first sync, naming what vLLM reports as not loaded.
        unsent = unsent_weights() if self.sleep_level == 2 else contextlib.nullcontext(set())
        with vllm_compat.torch_cpu_linear(self.torch_linear), unsent as names:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights()})
        if names:
            raise RuntimeError(
                f"rollout: the weight sync did not reach these of vLLM's weights: {', '.join(sorted(names))}. After "
                "a level-2 sleep (rollout.sleep_level; 2 for full fine-tuning) they hold uninitialised memory. The "
                "trainer's parameter names must be ones vLLM's loader takes (vllm_engine.sync_weights); meanwhile "
                "rollout.sleep_level=1 keeps the engine's weights across sleeps, in host memory (docs/memory.md)"
            )
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
                routes = None
                if self.capture_routes:  # [prompt + answer - 1, layers, top_k]: the last token is never forwarded
                    routes = replay.completion_routes(completion, len(prompt.input_ids) + len(ids), self.route_dtype)
                samples.append(Sample(
                    prompt_index=index,
                    response_ids=ids,
                    logprobs=sampled_logprobs(completion),
                    text=self.tokenizer.decode(ids, skip_special_tokens=True),
                    truncated=completion.finish_reason == "length",
                    routes=routes,
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
