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
    sampled them, which the trainer's corrections take as the behaviour policy (config_problem says which);
 7. with tools (turns.ToolEngine) an answer pauses at a tool call: its group is not complete, its tool turn is
    taken in the same step (quota met or not: a carried answer never waits inside a turn), and while the rank is
    short of groups the answers go on in another engine call of the step; one with turns continues from its
    conversation so far (turns.continuation), and the checkpoint keeps its turns.
The quota is per rank, as the prompts are (each rank stops on its own; a TP group stops when each member has its
quota, a decision every member takes alike from the same outputs). The carried answers are part of the checkpoint
(rank files: `state_dict`), prompts by their row in the train set, so a resumed run continues exactly.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch.distributed as dist

from grpo import tools, turns
from grpo.distributed import max_over_ranks, mean_over_ranks
from grpo.samples import Continuation, Prompt, Sample, encode_prompt


@dataclass
class Answer:
    ids: list[int] = field(default_factory=list)  # sampled so far
    logprobs: list[float] = field(default_factory=list)  # the engine's, each under the weights that sampled it
    born: int = -1  # step that sampled its first token (-1: not started)
    done: bool = False
    truncated: bool = False
    turns: list = field(default_factory=list)  # turns.ToolTurn inside `ids`, with tools: context, log-prob 0

    def sample(self, group: int, **more) -> Sample:
        """The answer so far as the trainer and the tool loop read it (its text is left empty)."""
        return Sample(group, self.ids, self.logprobs, "", self.truncated, turns=self.turns, **more)


@dataclass
class Group:
    index: int  # the prompt's row in the train set (what a checkpoint stores)
    answers: list[Answer]
    example: object = None  # the row and its encoded prompt, rebuilt from `index` after a resume
    prompt: Prompt | None = None

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
    """This rank's answers in flight between steps, held by the engine (`engine.carry`, rollout.make_engine), where
    draw_and_generate and the checkpoint's rank files find them."""

    def __init__(self, cfg):
        r = cfg.rollout
        self.n, self.reserve, self.max_staleness = r.n, r.partial_reserve, r.max_staleness
        self.max_tokens = cfg.data.max_response_length
        self.groups: list[Group] = []
        # the step being generated and what each answer had when it began: dynamic sampling's later rounds of a step
        # continue answers of its first, whose tokens are this step's (id(a) -> (a, tokens); holding `a` keeps its id
        # from being reused)
        self.step, self.before = -1, {}
        self.unfinished = 0.0  # answers left unfinished by the step's rounds so far (their metric sums the rounds)
        self.restarted = 0  # answers of a checkpoint that start over (load_state_dict), counted at the next step

    def state_dict(self) -> dict:
        """Plain numbers, lists and tensors, which torch.load(weights_only=True) reads back."""
        return {"groups": [{"index": g.index, "answers": [
            {**vars(a), "turns": [turns.turn_state(t) for t in a.turns]} for a in g.answers
        ]} for g in self.groups]}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's answers in flight. Those that this run's settings cannot continue start over, counted in
        the next step's rollout/partial_dropped: every answer of a group drawn with another rollout.n (its advantage
        needs this n), and an answer with more tokens than data.max_response_length, or as many without having
        finished (the engine could sample none more)."""

        def answer(a):
            a = Answer(**{**a, "turns": [turns.turn_from_state(t) for t in a.get("turns", [])]})
            return a if len(a.ids) < self.max_tokens or (a.done and len(a.ids) == self.max_tokens) else None

        self.groups, self.restarted = [], 0
        for g in state["groups"]:
            answers = [answer(a) for a in g["answers"]]
            if len(answers) != self.n:
                answers = [None] * self.n
            self.restarted += sum(bool(a["ids"]) for a in g["answers"]) - sum(bool(a and a.ids) for a in answers)
            self.groups.append(Group(g["index"], [a or Answer() for a in answers]))


def draw_and_generate(engine, sampler, train_set, processor, epoch, position, need, n, params, seed, step, have=0):
    """Groups of n answers with the engine's carry (engine.carry, see the module docstring): (examples, prompts,
    samples prompt-major, this call's rollout/partial_* and tool/* counts), epoch, position. The `need - have` groups
    the step still lacks (`have`: those that dynamic sampling's earlier rounds of the step kept); complete groups past
    them stay in flight for the next round or step."""
    carry = engine.carry
    stats = {"rollout/partial_dropped": float(carry.restarted), "rollout/partial_generated": 0.0}
    carry.restarted = 0
    for g in carry.groups:
        for j, a in enumerate(g.answers):
            if a.born >= 0 and step - a.born > carry.max_staleness:  # older than the bound: it starts over
                g.answers[j] = Answer()  # (its tool turns too)
                stats["rollout/partial_dropped"] += 1
    in_flight = need + math.ceil(carry.reserve * need)
    if len(carry.groups) < in_flight:
        indices, epoch, position = sampler.next_indices(epoch, position, in_flight - len(carry.groups))
        carry.groups += [Group(i, [Answer() for _ in range(n)]) for i in indices]
    for g in carry.groups:
        if g.prompt is None:  # drawn now, or restored from a checkpoint
            g.example = train_set[g.index]
            g.prompt = encode_prompt(processor, g.example)
    open_ = [(gi, a) for gi, g in enumerate(carry.groups) for a in g.answers if not a.done]
    # a group whose oldest token is at the bound finishes now: stopping it again would make that token too old
    pinned = [any(0 <= a.born <= step - carry.max_staleness for a in g.answers) for g in carry.groups]
    if carry.step != step:
        carry.step, carry.before, carry.unfinished = step, {}, 0.0
    stats["rollout/partial_continued"] = float(sum(bool(a.ids) for _, a in open_ if id(a) not in carry.before))
    for g in carry.groups:
        for a in g.answers:
            carry.before.setdefault(id(a), (a, len(a.ids)))  # its tokens sampled before this step
    marks = None  # with tools (turns.ToolEngine) an answer may pause at a tool call
    if getattr(engine, "pool", None) is not None:
        marks = _ToolMarks(*processor.tokenizer.convert_tokens_to_ids([tools.TOOL_CALL_END, "<|image_pad|>"]))
        stats.update(dict.fromkeys(("tool/calls", *turns.FAULT_KEYS), 0.0))
    # Without tools one engine call. With them, an answer that calls a tool pauses there; its tool turn is taken
    # (whether or not the quota is met: a carried answer waits after its turn, not inside it) and, while this rank
    # is short of its groups, it goes on in the next call of the same step. Every rank makes as many calls (a TP
    # group's members submit together).
    missing = need - have  # the groups this call returns
    for round_ in itertools.count():
        quota = missing - sum(g.done for g in carry.groups)
        requests = [_request(engine, carry.groups[gi], a, gi, pinned[gi], marks) for gi, a in open_]
        results = engine.generate_until(requests, quota, params, turns.turn_seed(seed, round_))
        for (_, a), (ids, logprobs, finished, truncated) in zip(open_, results, strict=True):
            if ids and a.born < 0:
                a.born = step
            a.ids, a.logprobs = a.ids + ids, a.logprobs + logprobs
            a.done, a.truncated = finished, truncated
            stats["rollout/partial_generated"] += len(ids)
        if marks is None:
            break
        going = _take_tool_turns(engine, processor, carry, open_, stats, marks.call_end)
        open_ = [(gi, a) for gi, a in open_ if not a.done]
        short = missing > sum(g.done for g in carry.groups) or any(pinned[gi] for gi, _ in open_)
        if turns.busiest_rank(int(short and going > 0)) == 0:
            break
    ready = [g for g in carry.groups if g.done][:missing]  # oldest first: the list keeps the order they were drawn
    carry.groups = [g for g in carry.groups if not any(g is r for r in ready)]
    samples = []
    for gi, g in enumerate(ready):
        for a in g.answers:
            staleness = step - a.born if a.born >= 0 else 0
            samples.append(a.sample(gi, carried=carry.before[id(a)][1], staleness=staleness))
            samples[-1].text = turns.model_text(processor.tokenizer, samples[-1])  # the last model turn's
    unfinished = float(sum(not a.done for g in carry.groups for a in g.answers))
    stats["rollout/partial_in_flight"] = unfinished - carry.unfinished  # this round's change (the rounds are summed)
    carry.unfinished = unfinished
    return [g.example for g in ready], [g.prompt for g in ready], samples, stats, epoch, position


class _ToolMarks(NamedTuple):
    """The token ids an answer with tools is continued by."""

    call_end: int  # </tool_call>: where the answer pauses for its tool turn
    image_pad: int  # a picture's placeholder, in the turns that bring one


def _request(engine, group: Group, a: Answer, gi: int, pinned: bool, marks: _ToolMarks | None):
    """An open answer as the engine continues it (samples.Continuation): from its tokens; with tool turns, from its
    conversation so far (turns.continuation: the turns' images with the prompt's). It pauses at a tool call while it
    may take a turn."""
    if marks is None:
        return Continuation(group.prompt, a.ids, gi, pinned)
    pause = (marks.call_end,) if len(a.turns) + 1 < engine.max_turns else ()
    if not a.turns:
        return Continuation(group.prompt, a.ids, gi, pinned, pause)
    prompt = turns.continuation(group.prompt, a.sample(gi), engine.budget - len(a.ids), marks.image_pad)
    return Continuation(prompt, [], gi, pinned, pause)


def _take_tool_turns(engine, processor, carry: Carry, open_, stats, call_end: int) -> int:
    """The tool turns of the open answers that paused at a call (turns.take_tool_turns); an answer whose turn does
    not fit its budget ends where it called. Returns how many go on."""
    called = [(gi, a) for gi, a in open_
              if not a.done and a.ids[-1:] == [call_end] and len(a.turns) + 1 < engine.max_turns]  # fmt: skip
    views = [a.sample(gi) for gi, a in called]
    prompts = [carry.groups[gi].prompt for gi, _ in called]
    going = turns.take_tool_turns(engine, processor, engine.pool, prompts, views, engine.budget, engine.bounds, stats)
    for (_, a), s in zip(called, views, strict=True):
        a.ids, a.logprobs, a.turns = s.response_ids, s.logprobs, s.turns
        a.done = a.truncated = s.truncated
    return len(going)


def step_metrics(rollout_stats: dict, samples) -> dict:
    """The partial rollout's metrics (its counts taken out of rollout_stats, the rollout's StepStats), over all ranks
    (collective when partial is on; {} when off): answers trained with carried tokens (`partial_carried`, a share of
    the trained answers), answers that started over past the staleness bound (`partial_dropped`, a count), their
    staleness in steps (mean, max), the share of the trained model tokens sampled at an earlier step
    (`rollout/off_policy_share`), tokens generated at this step."""
    counts = {k: rollout_stats.pop(k) for k in [k for k in rollout_stats if k.startswith("rollout/partial_")]}
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
