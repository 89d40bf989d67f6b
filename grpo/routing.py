"""Routing agreement between the rollout engine and the trainer, for the mixture-of-experts families.

An MoE layer sends each token to the top-k of its router's logits. The engine (vLLM, bf16 on GPU) and the trainer
compute those logits with other kernels, and where two experts' logits are close a rounding picks another expert:
the token then goes through other weights, and its log-prob moves by far more than the rounding itself. That is
the largest engine/trainer mismatch of an MoE model. This module measures it: the share of (token, layer) pairs
whose top-k SET differs between the two, over the same sequences (prompt and sampled answer), split into text
tokens, vision tokens (image and video pads) and the answer's tokens. Routing replay (replay.py) has the trainer
route each token as the engine did; record_routes reads the engine's routes for it where generate recorded none.

Both sides are read by forward hooks on each decoder layer's router (moe.ROUTER: Qwen's `layers.{i}.mlp.gate`,
Gemma 4's `layers.{i}.router`), a module of that name in transformers 5 (returning (logits or, Gemma's,
probabilities, combine weights, chosen experts)) and in vLLM 0.26 to 0.33 (called once a forward, returning the
logits, with a bias for Qwen's linear layer; vLLM's routers take the softmax's top-k, i.e. the logits' top-k).
Replicated under tensor parallelism: every rank of an engine records the whole routing. A measurement tool, not
part of the training step: it runs one engine request a sequence.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from grpo import batching, logprobs, moe, replay
from grpo.samples import Prompt, SamplingParams, engine_prompt_ids


def record(modules, pick) -> tuple[list[list[torch.Tensor]], list]:
    """Forward hooks that append pick(output) of every call of each module to that module's list. Returns the lists
    and the hooks' handles (to remove)."""
    rows = [[] for _ in modules]
    handles = [m.register_forward_hook(lambda _m, _i, out, r=r: r.append(pick(out).detach().cpu()))
               for m, r in zip(modules, rows)]  # fmt: skip
    return rows, handles


def stacked(rows, length: int, who: str) -> torch.Tensor:
    """(length, layers, k) from each layer's recorded calls; a layer that saw another number of tokens stops here
    (a router not called as a module, CUDA-graph replays, padded batches: the rows would not be this sequence's)."""
    counts = [sum(len(x) for x in r) for r in rows]
    if not rows or any(c != length for c in counts):
        raise RuntimeError(f"{who}: routers recorded {counts} tokens for a sequence of {length}")
    return torch.stack([torch.cat(r) for r in rows], 1)


def engine_logits(out) -> torch.Tensor:
    """vLLM's router returns (logits, bias) as its linear layers do, or the logits alone (return_bias=False)."""
    return out[0] if isinstance(out, tuple) else out


def with_answer(prompt: Prompt, answer: list[int], image_token_id: int) -> Prompt:
    """The prompt followed by its answer, as one prompt for the engine to read whole."""
    return replace(
        prompt, input_ids=torch.cat([prompt.input_ids, torch.as_tensor(answer, dtype=prompt.input_ids.dtype)]),
        template_ids=engine_prompt_ids(prompt, image_token_id) + list(answer), max_tokens=None,
        token_types=None if prompt.token_types is None else torch.cat([prompt.token_types, torch.zeros(len(answer),
                                                                       dtype=prompt.token_types.dtype)]),
    )  # fmt: skip


def engine_routing(engine, sequences: list[Prompt], top_k: int) -> list[torch.Tensor]:
    """The engine's chosen experts (L, layers, k) for every token of each sequence. One request a sequence, with the
    prefix cache emptied before it, so that every token goes through the layers (none comes from cached KV), and one
    new token (the prefill computes the whole sequence). The engine checks that it expanded the sequence into the
    trainer's tokens. In a TP group every member must submit the same requests: the members take turns, the others
    submitting nothing, and each keeps the rows of its own sequences."""
    rows, handles = [], []

    def install(model):
        found, hooks = record(moe.routers(model), lambda out: engine_logits(out).topk(top_k, dim=-1).indices)
        rows.extend(found)
        handles.extend(hooks)

    engine.llm.apply_model(install)  # in this process: the engine's model is this rank's worker's
    counts, me = [len(sequences)], 0
    if engine.tp_group is not None:
        counts, me = [None] * engine.tp, dist.get_rank(engine.tp_group)
        dist.all_gather_object(counts, len(sequences), group=engine.tp_group)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    out = []
    try:
        for member, count in enumerate(counts):
            for k in range(count):
                for r in rows:
                    r.clear()
                engine.llm.reset_prefix_cache()
                engine.generate([sequences[k]] if member == me else [], 1, params, seed=0)
                if member == me:
                    out.append(stacked(rows, len(sequences[k].input_ids), "vLLM"))
    finally:
        for h in handles:
            h.remove()
    return out


@torch.no_grad()
def trainer_routing(model, prompts, answers, pad_id: int):
    """The trainer's chosen experts (L, layers, k) for every token of each prompt + answer, from one forward (a
    collective under FSDP2), and each token's type (L,): 0 text, 1 image, 2 video."""
    image_token_id = model.config.image_token_id
    batch, answer_ids, _ = batching.collate(prompts, answers, pad_id, image_token_id)
    rows, handles = record(moe.routers(model), lambda out: out[2])
    try:
        logprobs.forward_logprobs(model, batch, answer_ids, 1.0)
    finally:
        for h in handles:
            h.remove()
    if hasattr(model, "reshard"):  # FSDP2 keeps the root's parameters gathered after a no-grad forward
        model.reshard()
    mask = batch["attention_mask"].bool()  # (B, L)
    routing = stacked(rows, mask.numel(), "trainer").view(*mask.shape, len(rows), -1)  # (B, L, layers, k)
    return [routing[i][mask[i]] for i in range(len(mask))], [batch["mm_token_type_ids"][i][mask[i]]
                                                             for i in range(len(mask))]  # fmt: skip


def disagreement(engine_rows, trainer_rows, types, answer_lens) -> dict:
    """The share of (token, layer) pairs whose top-k set differs, over text tokens, vision tokens and the answers'
    tokens, and how many tokens each counts. Each sequence's rows are (L, layers, k), its types (L,)."""
    differ, vision, answer = [], [], []
    for e, t, kind, n in zip(engine_rows, trainer_rows, types, answer_lens, strict=True):
        differ.append((e.sort(-1).values != t.sort(-1).values).any(-1).float())  # (L, layers)
        vision.append(kind > 0)  # (L,)
        answer.append(torch.arange(len(kind)) >= len(kind) - n)  # (L,)
    differ, vision, answer = torch.cat(differ), torch.cat(vision), torch.cat(answer)
    out = {}
    for name, where in (("text", ~vision), ("vision", vision), ("answer", answer)):
        out[name] = differ[where].mean().item() if where.any() else float("nan")
        out[f"{name}_tokens"] = int(where.sum())
    return out


def agreement(engine, model, prompts, samples, pad_id: int) -> dict:
    """disagreement() of the engine's and the trainer's routing over `samples` (samples.Sample, each of
    prompts[sample.prompt_index]). Collective: every rank of the trainer and of the engine's TP group calls it."""
    chosen = [prompts[s.prompt_index] for s in samples]
    answers = [list(s.response_ids) for s in samples]
    top_k = moe.top_k(model.config.get_text_config())
    sequences = [with_answer(p, a, engine.image_token_id) for p, a in zip(chosen, answers)]
    engine_rows = engine_routing(engine, sequences, top_k)
    trainer_rows, types = trainer_routing(model, chosen, answers, pad_id)
    return disagreement(engine_rows, trainer_rows, types, [len(a) for a in answers])


def record_routes(engine, model, prompts, samples) -> int:
    """Routing replay (replay.py): give every sample without a record one (its answer was assembled over several
    engine calls: tool turns, partial rollouts; or the engine captures none). vLLM prefills prompt + answer once
    more: with its capture, all at once (one-token requests: every token of the sequence is forwarded); otherwise
    one request a sequence with hooks on its routers (engine_routing). For the HF engine the trainer's model is the
    engine: one forward of it. Collective where generation is: every rank calls it, with or without samples to
    record. Returns how many it recorded."""
    todo = [s for s in samples if s.routes is None]
    top_k = moe.top_k(model.config.get_text_config())
    dtype = replay.route_dtype(model.config.get_text_config().num_experts)
    chosen = [prompts[s.prompt_index] for s in todo]
    inner = getattr(engine, "engine", engine)  # under the tool loop: its engine, for plain one-token requests
    if getattr(inner, "llm", None) is not None:
        sequences = [with_answer(p, list(s.response_ids), inner.image_token_id) for p, s in zip(chosen, todo)]
        if inner.capture_routes:  # vLLM's capture: all at once, each sequence's every token forwarded (prefilled)
            params = SamplingParams(temperature=0.0, max_tokens=1)
            done = inner.generate(sequences, 1, params, seed=0)
            found = [d.routes[: len(q.input_ids)] for d, q in zip(done, sequences, strict=True)]
        else:
            found = engine_routing(inner, sequences, top_k)
    else:  # the HF engine samples with the trainer's model: a forward of it (collective: every rank, one forward)
        found = hf_routing(model, chosen, [list(s.response_ids) for s in todo])
    for s, r in zip(todo, found, strict=True):
        s.routes = r.to(dtype)
    return len(todo)


def hf_routing(model, prompts, answers) -> list[torch.Tensor]:
    """The trainer's model's routes over prompt + answer, one no-grad forward for all (every rank joins it, with a
    filler sequence of its own if it has none to record: FSDP2's forwards are collectives; the filler's routes are
    dropped). A rank whose samples all came whole from generate has nothing to record while another, with a tool
    turn or a carried answer, has."""
    pad_id = getattr(model.config, "pad_token_id", None) or 0
    have = torch.tensor([len(prompts)])
    if dist.is_initialized():
        dist.all_reduce(have, op=dist.ReduceOp.MAX)
    if not have.item():
        return []
    if not prompts:  # one pad token answered by one: a text-only forward (the tower's dummy pass keeps it in step)
        trainer_routing(model, [Prompt(torch.tensor([pad_id]), None, None, [])], [[pad_id]], pad_id)
        return []
    rows, _ = trainer_routing(model, prompts, answers, pad_id)
    return rows
