"""The `hf` rollout engine: samples with the (FSDP2-sharded) training model itself, no second copy of the weights,
nothing to sync, slow; at most rollout.max_num_seqs sequences per generate call (rollout.py: the engine interface)."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
import torch.distributed as dist

from grpo import families, logprobs, moe, replay, routing
from grpo.batching import VISION_INPUTS, collate, pack
from grpo.samples import Prompt, Sample, SamplingParams, vision_token_ids


class HFEngine:
    """Samples with the training model's own `generate`. Under FSDP2 every forward is a collective, so every rank
    must generate together (`synced_gpus` keeps finished ranks stepping until all are done).

    `generate` returns token ids only: asking it for logits (`output_logits`) would keep a fp32 (rows, vocab) tensor
    per decode step until the call ends, 0.6 MB a row and step for Qwen's 151,936 tokens (~400 GB for 320 answers of
    2,048 tokens). The sampled tokens' log-probs come instead from one no-grad forward over each chunk's prompts and
    answers (logprobs.forward_logprobs: chunked LM head, no full logits), and at most `rollout.max_num_seqs` sequences
    go through one generate call, which bounds the KV cache and that forward alike."""

    def __init__(self, cfg, processor, offload=None, carry=None):
        if cfg.rollout.max_num_seqs < 1:
            raise ValueError(f"rollout.max_num_seqs={cfg.rollout.max_num_seqs} must be >= 1")
        self.model, self.tokenizer = None, processor.tokenizer
        self.pad_id = self.tokenizer.pad_token_id
        self.max_seqs = cfg.rollout.max_num_seqs
        self.packed = cfg.actor.padding_free  # score the answers in the trainer's own layout
        self.timings = {"time/wake": 0.0, "time/weight_sync": 0.0, "time/sleep": 0.0}
        self.stats = {}  # counts of the last generate call: none of its own
        self.offload = offload  # what to move to host memory while generating (offload.TrainerOffload), or None
        self.carry = carry  # partial rollouts' answers in flight: always None here (they need vLLM's generate_until)
        self.record_routes = cfg.algorithm.routing_replay == "r3"  # each answer's experts, for the trainer (replay.py)

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
            for i, (ids, logp, truncated, routes) in zip(real, answers):
                cap = prompts[i].max_tokens
                if cap is not None and len(ids) > cap:  # one generate call has one length limit: cut to the prompt's
                    ids, logp, truncated = ids[:cap], logp[:cap], True
                    routes = None if routes is None else routes[: len(prompts[i].input_ids) + cap]
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                samples.append(Sample(prompt_index=i, response_ids=ids, logprobs=logp, text=text, truncated=truncated,
                                      routes=routes))  # fmt: skip
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
        sampled. Returns (response ids cut after the first end-of-sequence token, their log-probs, truncated, routes)
        per prompt. With routing replay the routers' choices are recorded during generate (the prefill, then each
        decode step: replay.generate_routes), and the log-prob forward replays them, so the log-probs are those of
        the routes that sampled; routes is None otherwise."""
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
        replay.clear(self.model)  # the last training forward's routes are no record of this call's tokens
        rows, handles = (routing.record(moe.routers(self.model), lambda out: out[2]) if self.record_routes
                         else (None, []))  # fmt: skip
        try:
            with one_pass:
                sequences = self.model.generate(**inputs, generation_config=gen_cfg, synced_gpus=world > 1)  # (C, P+R)
        finally:
            for h in handles:
                h.remove()
        width = inputs["input_ids"].shape[1]
        responses, truncated = [], []
        stops = set(gen_cfg.eos_token_id)
        for ids in sequences[:, width:].tolist():  # pad after the EOS of a finished row
            end = next((t + 1 for t, tok in enumerate(ids) if tok in stops), None)
            responses.append(ids if end is None else ids[:end])
            truncated.append(end is None)
        del inputs, sequences  # the KV cache went with the call: the forward below has the memory to itself
        routes = [None] * len(prompts)
        if rows is not None:
            dtype = replay.route_dtype(self.model.config.get_text_config().num_experts)
            routes = replay.generate_routes(rows, [len(p.input_ids) for p in prompts], width,
                                            [len(r) for r in responses], dtype)  # fmt: skip
        if self.packed:
            batch, response_ids, _ = pack(prompts, responses, self.image_token_id, routes=routes)
        else:
            batch, response_ids, _ = collate(prompts, responses, self.pad_id, self.image_token_id, routes=routes)
        # each rank's own answers, whole: a sequence-parallel group's ranks sampled different ones
        logp = logprobs.forward_logprobs(self.model, batch, response_ids, temperature, split_over_group=False)[0]
        logp = logp.cpu()  # (C, T)
        return [(ids, logp[row, : len(ids)].tolist(), cut, routes[row])
                for row, (ids, cut) in enumerate(zip(responses, truncated))]  # fmt: skip


def chunk_seed(seed: int, chunk: int) -> int:
    """Seed of the chunk-th generate call of one `HFEngine.generate`: chunk 0 keeps the caller's seed (a batch that
    fits one call samples what it did before chunking existed), later chunks step by 2^64 / golden ratio (a Weyl
    sequence), far from any nearby caller seed, so a resumed run samples exactly the same answers."""
    return (seed + chunk * 0x9E3779B97F4A7C15) % 2**64
