"""Partial rollouts: stop generating when the step has its groups, continue the unfinished answers at the next step.

A step's generation is bounded by its longest answer: with lengths that vary widely the engine spends most of its
decode steps finishing the last few answers at a batch of a handful. With rollout.partial=true (APRIL,
https://arxiv.org/abs/2509.18521; AReaL's and verl's fully-async trainers bound the staleness the same way):
 1. the engine gets the step's prompts plus a reserve (rollout.partial_reserve x the step's prompts in flight), and
    the answers of a group that have not started go as one request of that many answers, the others one each;
 2. generation stops as soon as this rank has its quota of complete groups (all rollout.n answers of a prompt
    finished); the unfinished answers are stopped and kept here with their tokens and the engine's log-probs;
 3. at the next step they are resubmitted under the new weights as prompt (images, videos) + their tokens so far,
    with max_tokens reduced by what they have, and continue until they finish: an answer is never dropped for being
    long, which would bias every batch toward short answers;
 4. a group trains only when all its answers have finished (its advantage is computed as without partial), oldest
    groups first; a finished answer waits here for its group;
 5. a group whose oldest token is rollout.max_staleness steps old is not stopped again (the step waits for its
    answers), so no trained token is older than that; an answer found older anyway (a resume with a lower bound)
    starts over, counted;
 6. `Sample.carried` marks the leading tokens sampled at earlier steps: their `logprobs` are those of the policy that
    sampled them, which the trainer's corrections take as the behaviour policy (config_problem says which).
The quota is per rank, as the prompts are (each rank stops on its own; a TP group stops when each member has its
quota, a decision every member takes alike from the same outputs). The carried answers are part of the checkpoint
(rank files: `state_dict`), prompts by their row in the train set, so a resumed run continues exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch.distributed as dist

import rollout
from runtime import max_over_ranks, mean_over_ranks


@dataclass
class Answer:
    ids: list[int] = field(default_factory=list)  # sampled so far
    logprobs: list[float] = field(default_factory=list)  # the engine's, each under the weights that sampled it
    born: int = -1  # step that sampled its first token (-1: not started)
    done: bool = False
    truncated: bool = False


@dataclass
class Group:
    index: int  # the prompt's row in the train set (what a checkpoint stores)
    answers: list[Answer]
    example: object = None  # the row and its encoded prompt, rebuilt from `index` after a resume
    prompt: rollout.Prompt | None = None

    @property
    def done(self) -> bool:
        return all(a.done for a in self.answers)


def config_problem(cfg) -> str | None:
    """Why rollout.partial cannot run with these settings, or None."""
    r, alg = cfg.rollout, cfg.algorithm
    if not r.partial:
        return None
    if r.engine != "vllm":
        return (f"rollout.partial=true needs rollout.engine=vllm: the {r.engine} engine generates a batch to its end "
                "and cannot stop when the step has its groups")  # fmt: skip
    if r.tools:
        return "rollout.partial=true with rollout.tools: continuing an answer stopped inside a tool turn is not built"
    if r.partial_reserve < 0 or r.max_staleness < 1:
        return f"rollout.partial_reserve={r.partial_reserve} must be >= 0 and max_staleness={r.max_staleness} >= 1"
    if not (alg.rollout_bypass or alg.rollout_is != "none" or alg.tis_cap > 0):
        return (
            "rollout.partial=true trains tokens sampled under older weights, but the old log-probs the PPO ratio uses "
            "would be the trainer's at this step's weights, as if they were on-policy. Set algorithm.rollout_is=token "
            "(decoupled PPO: importance weights p_trainer / p_engine against the log-probs recorded when each token "
            "was sampled, truncated at rollout_is_threshold) or algorithm.rollout_bypass=true (those recorded "
            "log-probs are the old ones)"
        )
    return None


class Carry:
    """This rank's answers in flight between steps."""

    def __init__(self, cfg):
        r = cfg.rollout
        self.n, self.reserve, self.max_staleness = r.n, r.partial_reserve, r.max_staleness
        self.max_tokens = cfg.data.max_response_length
        self.groups: list[Group] = []

    def state_dict(self) -> dict:
        """Plain numbers and lists, which torch.load(weights_only=True) reads back."""
        return {"groups": [{"index": g.index, "answers": [vars(a).copy() for a in g.answers]} for g in self.groups]}

    def load_state_dict(self, state: dict) -> None:
        self.groups = [Group(g["index"], [Answer(**a) for a in g["answers"]]) for g in state["groups"]]


def with_carry(engine, cfg):
    """The engine, holding this rank's answers in flight when rollout.partial is on (draw_and_generate, the
    checkpoint's rank files)."""
    if cfg.rollout.partial:
        engine.carry = Carry(cfg)
    return engine


def draw_and_generate(engine, sampler, train_set, processor, epoch, position, need, n, params, seed, step):
    """`need` groups of n answers: (examples, prompts, samples prompt-major), epoch, position. Without partial, the
    next `need` prompts of the shard, generated to the end; with it (engine.carry), see the module docstring."""
    carry = getattr(engine, "carry", None)
    if carry is None:
        indices, epoch, position = sampler.next_indices(epoch, position, need)
        batch = [train_set[i] for i in indices]
        prompts = [rollout.encode_prompt(processor, ex) for ex in batch]
        return batch, prompts, engine.generate(prompts, n, params, seed=seed), epoch, position
    stats = {"rollout/partial_dropped": 0.0, "rollout/partial_generated": 0.0}
    for g in carry.groups:
        for a in g.answers:
            if a.born >= 0 and step - a.born > carry.max_staleness:  # older than the bound: it starts over
                a.ids, a.logprobs, a.born, a.done, a.truncated = [], [], -1, False, False
                stats["rollout/partial_dropped"] += 1
    in_flight = need + math.ceil(carry.reserve * need)
    if len(carry.groups) < in_flight:
        indices, epoch, position = sampler.next_indices(epoch, position, in_flight - len(carry.groups))
        carry.groups += [Group(i, [Answer() for _ in range(n)]) for i in indices]
    for g in carry.groups:
        if g.prompt is None:  # drawn now, or restored from a checkpoint
            g.example = train_set[g.index]
            g.prompt = rollout.encode_prompt(processor, g.example)
    open_ = [(gi, a) for gi, g in enumerate(carry.groups) for a in g.answers if not a.done]
    # a group whose oldest token is at the bound finishes now: stopping it again would make that token too old
    pinned = [any(0 <= a.born <= step - carry.max_staleness for a in g.answers) for g in carry.groups]
    requests = [rollout.Continuation(carry.groups[gi].prompt, a.ids, gi, pinned[gi]) for gi, a in open_]
    stats["rollout/partial_continued"] = float(sum(bool(c.prefix) for c in requests))  # resumed mid-answer
    had = {id(a): len(a.ids) for g in carry.groups for a in g.answers}  # tokens sampled before this step
    quota = need - sum(g.done for g in carry.groups)
    results = engine.generate_until(requests, quota, params, seed) if requests else []
    for (_, a), (ids, logprobs, finished, truncated) in zip(open_, results, strict=True):
        if ids and a.born < 0:
            a.born = step
        a.ids, a.logprobs = a.ids + ids, a.logprobs + logprobs
        a.done, a.truncated = finished, truncated
        stats["rollout/partial_generated"] += len(ids)
    ready = [g for g in carry.groups if g.done][:need]  # oldest first: the list keeps the order they were drawn
    carry.groups = [g for g in carry.groups if not any(g is r for r in ready)]
    samples = []
    for gi, g in enumerate(ready):
        for a in g.answers:
            samples.append(rollout.Sample(
                gi, a.ids, a.logprobs, processor.tokenizer.decode(a.ids, skip_special_tokens=True), a.truncated,
                carried=had[id(a)], staleness=step - a.born if a.born >= 0 else 0,
            ))  # fmt: skip
    stats["rollout/partial_in_flight"] = float(sum(not a.done for g in carry.groups for a in g.answers))
    engine.stats = stats
    return [g.example for g in ready], [g.prompt for g in ready], samples, epoch, position


def step_metrics(filter_stats: dict, samples) -> dict:
    """The partial rollout's metrics, over all ranks (collective when partial is on; {} when off): answers trained
    with carried tokens (`partial_carried`, a share of the trained answers), answers that started over past the
    staleness bound (`partial_dropped`, a count), their staleness in steps (mean, max), the share of the trained
    model tokens sampled at an earlier step (`rollout/off_policy_share`), tokens generated at this step."""
    counts = {k: filter_stats.pop(k) for k in [k for k in filter_stats if k.startswith("rollout/partial_")]}
    if not counts:
        return {}
    world = dist.get_world_size()
    sums = {**counts, "rollout/partial_carried": float(sum(s.carried > 0 for s in samples)),
            "rollout/staleness_mean": float(sum(s.staleness for s in samples)),
            "rollout/off_policy_share": float(sum(s.carried for s in samples))}  # fmt: skip
    tokens = float(sum(len(s.response_ids) for s in samples))
    metrics = mean_over_ranks(
        sums,
        {
            **dict.fromkeys(counts, 1.0 / world),
            "rollout/partial_carried": len(samples),
            "rollout/staleness_mean": len(samples),
            "rollout/off_policy_share": tokens,
        },
    )
    metrics.update(max_over_ranks({"rollout/staleness_max": float(max((s.staleness for s in samples), default=0))}))
    return metrics
