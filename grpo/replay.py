"""Routing replay (algorithm.routing_replay=r3, Rollout Routing Replay: https://arxiv.org/abs/2510.11370): every
trainer forward of a sample routes each token to the experts the engine chose for it.

Why: the engine and the trainer compute the routers' logits with other kernels, and where two experts are nearly tied
a rounding sends the token through other weights (routing.py measures how often). Its log-prob then moves far more
than the rounding, and the PPO ratio and the mismatch corrections see a policy that did not sample. Replayed, the
token goes through the experts that sampled it; the combine weights are still the trainer's, the family's router's
function of its own probabilities at the recorded k experts (moe.combine_weights: the softmax over all experts,
renormalised over the k, as Qwen3-VL-MoE's and Qwen3.5-MoE's TopKRouter do for their top-k; Gemma 4's router then
multiplies each by its expert's per_expert_scale), so the router keeps its gradient.

The record: `Sample.routes`, (prompt + answer tokens, MoE layers, top_k) small integers (int8 up to 128 experts,
int16 beyond), NO_ROUTE (-1) where the engine recorded none (an answer's last token, which no forward reads before
the answer ends). Who records it:
- the HF engine: hooks on the routers during its own `generate` (the prompt's prefill, then each decode step);
- vLLM with its own capture (`enable_return_routed_experts`, `CompletionOutput.routed_experts`, [tokens, layers,
  top_k], every prompt token and every generated one but the last): vLLM 0.26's V1 model runner, CUDA graphs
  included; 0.32 and 0.33 wire it to Model Runner V2 only (and ask for prefix caching), which this trainer does not
  run (vllm_compat.model_runner_environment) unless VLLM_USE_V2_MODEL_RUNNER=1 is set;
- vLLM otherwise (the CPU builds, which subclass the V1 runner, and 0.32/0.33 on V1): hooks on its routers while
  it prefills each finished sequence once more (routing.engine_routing), eager only: CUDA graphs and compiled
  graphs do not run module hooks, so on CUDA that needs rollout.enforce_eager=true (vllm_engine checks it).
The answers assembled over several engine calls (tool turns, answers carried by partial rollouts) are recorded by
that re-prefill (routing.record_routes) whatever the engine: a tool turn's tokens get the routes of their prefill, and a
carried answer the routes of its re-prefill under this step's weights, the weights its old log-probs are taken at.
A checkpoint holds no routes: carried answers are stored as tokens, and their routes are taken when they complete.

In the trainer the record travels with the sample through rank balancing (pickled with it), into micro-batches
(batching.collate and pack lay the routes out as they lay out the tokens: left-padded rows, or packed back to back,
a shared prompt's routes once for its group) and into forward_logprobs, which sets them on the model's hooks for
that forward (and its backward's recomputation under activation checkpointing). Vision tokens and Qwen3-VL's
deepstack layers need nothing of their own: a vision token is a position of the sequence like any other, routed in
every MoE layer. LoRA on the experts adapts the experts' weights, not the choice of them.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from grpo import batching, moe

NO_ROUTE = batching.NO_ROUTE  # a token whose route was not recorded: the trainer's own router routes it
REPLAY = "r3"
MODES = ("none", REPLAY)


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer type that holds an expert's index and NO_ROUTE."""
    return torch.int8 if num_experts <= 128 else torch.int16


# ----------------------------------------------------------------------------------------------------------------------
# The trainer side: hooks on the routers that replace their choice by the record.


class RoutingReplay:
    """Forward hooks on every router of a model (moe.routers), installed first so that every other hook sees the
    replayed choice (moe.RouterBalance reads only the probabilities: its top-k is the router's own, as transformers'
    load-balancing loss takes it). While `routes` (N, layers, k) is set, layer i's router returns the
    recorded experts of each of its N rows (the forward's tokens, flattened as the MoE block flattens them) with the
    trainer's weights over them; a row with NO_ROUTE keeps the router's own choice. In forwards with gradients it
    also counts the (token, layer) pairs whose own top-k set differs from the record (moe/routing_disagreement)."""

    def __init__(self, model):
        self.routes = None  # (N, layers, k) on the forward's device, or None: every router chooses for itself
        self.counting = False  # in a forward with gradients (not in its backward's recomputation)
        self.pairs, self.differ = 0, 0
        routers = moe.routers(model)
        self.layers = len(routers)
        for layer, router in enumerate(routers):
            router.register_forward_hook(lambda m, args, out, layer=layer: self._replay(m, layer, out), prepend=True)

    def _replay(self, router, layer: int, out):
        if self.routes is None:
            return None
        scores, own_weights, own = out  # (N, E) logits (Gemma 4: probabilities), (N, k), (N, k)
        if self.routes.shape != (len(own), self.layers, own.shape[1]):  # another batch's, or another model's
            raise RuntimeError(
                f"routing replay: routes {tuple(self.routes.shape)} for {self.layers} routers choosing "
                f"{tuple(own.shape)} (laid out for another batch, or recorded of another model)"
            )
        recorded = self.routes[:, layer].to(own.device, torch.long)  # (N, k)
        recorded_row = (recorded >= 0).all(-1, keepdim=True)  # (N, 1)
        chosen = torch.where(recorded_row, recorded, own)  # (N, k)
        weights = moe.combine_weights(router, moe.probabilities(router, out), chosen, own_weights.dtype)  # (N, k)
        if self.counting:
            with torch.no_grad():
                differ = (own.sort(-1).values != recorded.sort(-1).values).any(-1) & recorded_row[:, 0]  # (N,)
                self.pairs += int(recorded_row.sum())
                self.differ += int(differ.sum())
        return scores, weights, chosen


@contextlib.contextmanager
def replaying(model, routes):
    """Within it the model's forwards route by `routes` (N, layers, k) (None: by its own routers). With gradients the
    routes stay set after the forward, for the backward's recomputation of checkpointed layers, until the next
    forward_logprobs sets its own or `clear` lifts them; without, they are lifted at once."""
    replay = getattr(model, "routing_replay", None)
    if replay is None and routes is None:
        yield
        return
    if replay is None:
        replay = model.routing_replay = RoutingReplay(model)
    replay.routes, replay.counting = routes, routes is not None and torch.is_grad_enabled()
    try:
        yield
    finally:
        replay.counting = False
        if not torch.is_grad_enabled():
            replay.routes = None


def clear(model) -> None:
    """Lift the last forward's routes (a generate call comes next, whose tokens have no record)."""
    replay = getattr(model, "routing_replay", None)
    if replay is not None:
        replay.routes = None


# ----------------------------------------------------------------------------------------------------------------------
# The engine side: the record of each sample.


def generate_routes(rows, prompt_lens, width: int, answer_lens, dtype) -> list[torch.Tensor]:
    """The routes of one HF `generate` call of C left-padded prompts `width` wide, from each layer's recorded calls
    (record): the prefill's (C * width, k), then one (C, k) per decode step (every row steps until the call ends).
    Per sequence (prompt + answer, layers, k); the answer's last token, never fed back, gets NO_ROUTE."""
    out = []
    layers = [torch.cat([calls[0].view(-1, width, calls[0].shape[-1]),
                         *(c[:, None] for c in calls[1:])], 1) for calls in rows]  # fmt: skip
    full = torch.stack(layers, 2)  # (C, width + steps, layers, k)
    for i, (p, n) in enumerate(zip(prompt_lens, answer_lens)):
        seq = torch.full((p + n, *full.shape[2:]), NO_ROUTE, dtype=dtype)
        have = full[i, width - p : width + n - 1]  # the prompt's, then each answer token fed back
        seq[: len(have)] = have.to(dtype)
        out.append(seq)
    return out


def completion_routes(completion, length: int, dtype) -> torch.Tensor | None:
    """A vLLM completion's captured routes (CompletionOutput.routed_experts, [tokens, layers, top_k], 0.26-0.33) as
    a sample's record of `length` tokens (prompt + answer); vLLM never forwards the last sampled token, which gets
    NO_ROUTE. None when the completion carries none."""
    captured = getattr(completion, "routed_experts", None)
    if captured is None:
        return None
    captured = torch.as_tensor(captured)
    if captured.dim() != 3 or len(captured) > length:
        raise RuntimeError(f"vLLM returned routes of shape {tuple(captured.shape)} for a sequence of {length} tokens")
    out = torch.full((length, *captured.shape[1:]), NO_ROUTE, dtype=dtype)
    out[: len(captured)] = captured.to(dtype)
    return out


def step_metrics(model, samples) -> dict:
    """moe/routing_disagreement: the share of (token, layer) pairs of the step's update forwards whose own top-k set
    differs from the record; moe/replayed_tokens: the step's tokens routed by a record, and moe/own_routed_tokens:
    those the trainer's router routed for want of one (each answer's last token at least); over all ranks.
    Collective."""
    replay = getattr(model, "routing_replay", None)
    pairs, differ = (replay.pairs, replay.differ) if replay is not None else (0, 0)
    if replay is not None:
        replay.pairs = replay.differ = 0
    replayed = own = 0
    for s in samples:
        if s.routes is not None:
            missing = int((s.routes < 0).any(-1).any(-1).sum())
            replayed, own = replayed + len(s.routes) - missing, own + missing
    totals = torch.tensor([pairs, differ, replayed, own], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(totals)
    pairs, differ, replayed, own = totals.tolist()
    return {"moe/routing_disagreement": differ / max(pairs, 1.0), "moe/replayed_tokens": replayed,
            "moe/own_routed_tokens": own}  # fmt: skip
