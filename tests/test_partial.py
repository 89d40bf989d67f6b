"""Partial rollouts (partial.py) with a scripted engine: which answers continue, from which tokens, with which
log-probs, which groups train, and what a checkpoint keeps. The vLLM side runs in test_offload_train.py's launch."""

import io
import math
from types import SimpleNamespace

import pytest
import torch

import rollout
from data import ShardSampler
from grpo import mismatch, partial, tools, turns
from train_grpo import ConfigError, check_config, load_config

N = 3  # answers per prompt
CONTINUATION = rollout.Continuation  # (setup patches it)


def target_length(row: int, answer: int) -> int:
    """The scripted length of an answer: mostly short, a few long (answer 2 of every third prompt)."""
    return 12 + row % 5 if answer == 2 and row % 3 == 0 else 1 + (row + answer) % 3


def quota_met(requests, ended, quota) -> bool:
    """The engine's stop (vllm_engine.VLLMEngine.generate_until): `quota` groups with every answer ended (a paused one
    has not) and no pinned answer open. ended(k) says whether requests[k]'s answer has."""
    complete = sum(all(ended(k) for k, r in enumerate(requests) if r.group == g) for g in {r.group for r in requests})
    return complete >= quota and all(ended(k) for k, r in enumerate(requests) if r.pinned)


class ScriptedEngine:
    """Every open request gains one token per engine step; token t of an answer is t (so an answer continued from its
    prefix reads 0, 1, 2, ... and one sampled afresh would start at 0 again), with the log-prob -step: the training
    step that sampled it. Stops as the real engine does: when `quota` groups are complete and no pinned one is open."""

    def __init__(self):
        self.step, self.requests = 0, []

    def generate_until(self, requests, quota, params, seed):
        self.requests.append(requests)
        new = [[] for _ in requests]

        def done(k):
            r = requests[k]
            return len(r.prefix) + len(new[k]) >= target_length(r.prompt.row, r.prompt.answer_of[id(r.prefix)])

        while not quota_met(requests, done, quota) and not all(done(k) for k in range(len(requests))):
            for k, r in enumerate(requests):
                if not done(k):
                    new[k].append(len(r.prefix) + len(new[k]))
        return [(ids, [-float(self.step)] * len(ids), done(k), False) for k, ids in enumerate(new)]


def setup(monkeypatch, rows=24, **overrides):
    """A scripted engine carrying answers, its data and a function running one step of draw_and_generate (returning
    the step's examples, samples and counts)."""
    cfg = load_config(None, ["rollout.partial=true", "rollout.engine=vllm", "algorithm.rollout_is=token",
                             f"rollout.n={N}", *[f"{k}={v}" for k, v in overrides.items()]])  # fmt: skip
    engine = ScriptedEngine()
    engine.carry = partial.Carry(cfg)
    answer_of = {}  # which answer of its group a request's prefix list is (the script's lengths need it)

    def encode(processor, example):
        return SimpleNamespace(row=example, answer_of=answer_of)

    monkeypatch.setattr(partial, "encode_prompt", encode)

    def continuation(prompt, prefix, group, pinned=False, pause_ids=()):
        group_answers = engine.carry.groups[group].answers
        answer_of[id(prefix)] = next(j for j, a in enumerate(group_answers) if a.ids is prefix)
        return CONTINUATION(prompt, prefix, group, pinned, pause_ids)

    monkeypatch.setattr(partial, "Continuation", continuation)
    processor = SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids, skip_special_tokens: ""))
    sampler = ShardSampler(rows, 0, 1, shuffle=False)
    state = {"epoch": 0, "position": 0}

    def step(s, need=2, have=0):
        engine.step = s
        examples, prompts, samples, stats, state["epoch"], state["position"] = partial.draw_and_generate(
            engine, sampler, list(range(rows)), processor, state["epoch"], state["position"], need, N, None, 0, s, have
        )
        return examples, samples, stats

    return engine, step


def test_carried_answers_continue_from_their_tokens_with_the_logprobs_they_were_sampled_with(monkeypatch):
    """Guards against a carried answer that is sampled afresh instead of continued (its tokens would restart at 0),
    loses its old tokens' log-probs (trained as if this step's policy had sampled them), or trains before its group
    is complete (an advantage over fewer than n answers)."""
    engine, step = setup(monkeypatch)
    trained, carried_tokens = [], 0
    for s in range(1, 7):
        examples, samples, _ = step(s)
        carried_tokens += check_continued(s, examples, samples)
        trained += examples
    assert carried_tokens > 0  # the script makes answers wait: the check above saw carried tokens
    assert any(r.prefix for requests in engine.requests for r in requests)  # continued, with their tokens sent
    assert sorted(trained) == list(range(12))  # every prompt drawn is trained once, in time, none dropped


def check_continued(s, examples, samples) -> int:
    """Samples trained at step s are whole answers continued from their tokens, the first `carried` of them (and only
    those) sampled at earlier steps; returns how many tokens were carried."""
    assert len(examples) == 2 and len(samples) == 2 * N
    for i, smp in enumerate(samples):
        row, answer = examples[smp.prompt_index], i % N
        assert smp.response_ids == list(range(target_length(row, answer)))  # whole, and continued
        sampled_at = [-lp for lp in smp.logprobs]  # the step that sampled each token (the script's log-prob)
        assert all(t < s for t in sampled_at[: smp.carried]) and sampled_at == sorted(sampled_at)
        assert all(t == s for t in sampled_at[smp.carried :])
        assert smp.staleness == s - sampled_at[0]
    return sum(smp.carried for smp in samples)


def test_dynamic_samplings_rounds_of_one_step_carry_only_earlier_steps_tokens(monkeypatch):
    """Guards against tokens that a step's first round of dynamic sampling sampled being counted, in its next round,
    as sampled under older weights: the mismatch watch would leave them out, and the off-policy share and the
    counts of continued and in-flight answers would be the rounds' sum, not the step's."""
    engine, step = setup(monkeypatch)
    continued = []
    for s in range(1, 7):
        stats = {}
        continued.append(sum(bool(a.ids) for g in engine.carry.groups for a in g.answers if not a.done))
        for _ in range(2):  # the first round's groups all filtered out: a second round of the same step
            examples, samples, counts = step(s)
            stats = {k: stats.get(k, 0.0) + v for k, v in counts.items()}  # as collect_rollouts sums them
            check_continued(s, examples, samples)
        in_flight = [a for g in engine.carry.groups for a in g.answers if not a.done]
        assert stats["rollout/partial_in_flight"] == len(in_flight) and stats["rollout/partial_dropped"] == 0
        assert stats["rollout/partial_continued"] == continued[-1]  # resumed mid-answer from an earlier step
    assert max(continued) > 0


def test_dynamic_samplings_later_round_takes_only_the_groups_still_missing(monkeypatch):
    """Guards against a later round of dynamic sampling that returns the step's whole quota again: collect_rollouts
    keeps only the groups still missing, so the other complete groups would be thrown away with their answers.
    Here a filter keeps the odd rows; every group drawn must then train or be filtered out, none lost (a rank that
    is full already takes none in the rounds that other ranks still need)."""
    engine, step = setup(monkeypatch, rows=200)
    need, trained, filtered, rounds, kept = 3, [], [], [], 0
    for s in range(1, 9):
        have = []
        rounds.append(0)
        while len(have) < need and rounds[-1] < 8:
            examples, samples, _ = step(s, need, have=len(have))
            assert len(examples) == need - len(have) and len(samples) == N * len(examples)
            for row in examples:
                (have if row % 2 else filtered).append(row)
            rounds[-1] += 1
        assert len(have) == need
        trained += have
        # a rank already full takes the rounds another rank still needs: it takes no group, and loses none
        assert step(s, need, have=need)[:2] == ([], [])
        kept += sum(g.done for g in engine.carry.groups)
    assert max(rounds) > 1 and kept > 0  # the filter made steps take more rounds, complete groups stayed in flight
    waiting = [g.index for g in engine.carry.groups]
    assert sorted(trained + filtered + waiting) == list(range(len(trained + filtered + waiting)))


def test_no_token_waits_longer_than_max_staleness(monkeypatch):
    """Guards against answers that stay cut forever (the step would never wait for them): with max_staleness=1 an
    answer begun at the last step is not stopped again."""
    _, step = setup(monkeypatch, **{"rollout.max_staleness": 1, "rollout.partial_reserve": 2.0})
    for s in range(1, 8):
        _, samples, _ = step(s)
        assert all(smp.staleness <= 1 for smp in samples)


def test_answers_in_flight_survive_a_checkpoint(monkeypatch):
    """Guards against a resume that loses the carried answers or changes them: the rank file's state, read back with
    weights_only=True into a fresh carry, makes the next steps exactly those of the run that went on; an answer
    older than a lowered bound starts over and is counted."""
    engine, step = setup(monkeypatch)
    for s in range(1, 3):
        step(s)
    buffer = io.BytesIO()
    torch.save(engine.carry.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert any(a["ids"] and not a["done"] for g in state["groups"] for a in g["answers"])  # in flight mid-answer
    went_on = [step(s) for s in range(3, 6)]

    engine2, step2 = setup(monkeypatch)
    for s in range(1, 3):  # the same data position as the run that saved
        step2(s)
    engine2.carry = partial.Carry(load_config(None, ["rollout.partial=true", f"rollout.n={N}"]))
    engine2.carry.load_state_dict(state)
    resumed = [step2(s) for s in range(3, 6)]
    for (ex_a, sm_a, _), (ex_b, sm_b, _) in zip(went_on, resumed):
        assert ex_a == ex_b
        assert [(x.response_ids, x.logprobs, x.carried) for x in sm_a] == [
            (x.response_ids, x.logprobs, x.carried) for x in sm_b
        ]
    engine2.carry.max_staleness = 1
    assert step2(9)[2]["rollout/partial_dropped"] > 0


@pytest.mark.parametrize("setting", ["rollout.n", "data.max_response_length"])
def test_a_resume_starts_over_the_answers_it_cannot_continue(monkeypatch, setting):
    """Guards against a resume under another rollout.n that trains groups of the old n (the trainer cuts the batch
    into groups of the new n: advantages over answers of different prompts), and one under a lower answer limit
    that asks the engine for a negative number of tokens: those answers start over, counted, and the others go on."""
    engine, step = setup(monkeypatch)
    for s in range(1, 3):
        step(s)
    state = engine.carry.state_dict()
    longest = max(len(a["ids"]) for g in state["groups"] for a in g["answers"])
    value = {"rollout.n": N + 1, "data.max_response_length": longest}[setting]
    carry = partial.Carry(load_config(None, ["rollout.partial=true", f"rollout.n={N}", f"{setting}={value}"]))
    carry.load_state_dict(state)
    kept = [(a["ids"], b.ids) for g, h in zip(state["groups"], carry.groups) for a, b in zip(g["answers"], h.answers)]
    if setting == "rollout.n":
        assert all(len(g.answers) == N + 1 and not any(a.ids for a in g.answers) for g in carry.groups)
    else:  # the longest answers in flight start over, the others keep their tokens
        assert {len(a) for a, b in kept if not b} == {longest} and all(b == a for a, b in kept if b)
    restarted = sum(bool(a["ids"]) for g in state["groups"] for a in g["answers"]) - sum(bool(b) for _, b in kept)
    assert carry.restarted == restarted > 0
    engine.carry = carry
    assert step(3)[2]["rollout/partial_dropped"] == restarted  # counted once, at the step after the resume


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.engine=hf"], "needs rollout.engine=vllm"),
        (["algorithm.rollout_is=none"], "algorithm.rollout_is=token"),
        (["rollout.max_staleness=0"], "max_staleness=0"),
    ],
)
def test_partial_refuses_what_it_cannot_train_soundly(overrides, message):
    """Guards against partial rollouts where they cannot stop early (the HF engine) or would train stale tokens as
    on-policy (no correction against the recorded log-probs)."""
    sizes = ["data.rollout_batch_size=8", "actor.global_batch_size=8", "rollout.n=2"]
    base = [*sizes, "rollout.partial=true", "rollout.engine=vllm"]
    for sound in ("algorithm.rollout_is=token", "algorithm.rollout_bypass=true", "algorithm.tis_cap=2"):
        check_config(load_config(None, [*base, sound]), world_size=2)
    cfg = load_config(None, [*base, "algorithm.rollout_is=token", *overrides])
    with pytest.raises(ConfigError, match=message):
        check_config(cfg, world_size=2)


def test_carried_tokens_are_corrected_against_their_recorded_logprobs(one_rank_group):
    """Guards against stale tokens trained as on-policy: with rollout_is=token the weight of a carried token is
    p_trainer / p_engine at the log-prob recorded when it was sampled (decoupled PPO), and the start guard, which
    judges the engine by this step's policy, leaves carried tokens out (a resumed run would stop on them)."""
    cfg = load_config(None, ["rollout.partial=true", "rollout.engine=vllm", "algorithm.rollout_is=token"])
    recorded = [-3.0, -3.0, -1.0, -1.0]  # two carried tokens from an older policy, two of this step's
    sample = rollout.Sample(0, [5, 6, 7, 8], recorded, "", False, carried=2)
    trainer = torch.tensor([[-1.0, -2.5, -1.0, -1.0]])  # (1, T): this step's policy
    prompt = SimpleNamespace(pixel_values=None, pixel_values_videos=None)
    stats = dict.fromkeys(mismatch.STATS, 0.0)
    _, weights = mismatch.measure_and_correct(trainer, torch.ones(1, 4), [prompt], [sample], [0], cfg.algorithm, stats)
    assert torch.allclose(weights, torch.tensor([[2.0, math.exp(0.5), 1.0, 1.0]]))  # truncated at 2 (TIS)
    assert stats["mismatch/text/tokens"] == 2  # the gap is measured on this step's two tokens only
    mismatch.check_start([trainer[0]], [sample], [prompt], bound=0.01, step=1)  # carried gap of 2 nats: no stop
    with pytest.raises(SystemExit):
        mismatch.check_start([trainer[0]], [rollout.Sample(0, [5, 6, 7, 8], recorded, "", False)], [prompt], 0.01, 1)


class ToolScript:
    """An engine with tools (the turns.ToolEngine attributes partial uses, a real processor and tool pool) whose
    answer j of row r is written one token a step: calls[j] (calculate's 6*7, longer as j grows), which pauses it
    where its request pauses at </tool_call>; after the tool turn that partial takes, words(r, j). Each request is
    checked to hold exactly the answer's tokens so far (a continued answer is not re-sampled, and its tool turn is
    the one taken)."""

    BOUNDS = (56 * 56, 112 * 112)

    def __init__(self, processor, pool, calls, turn):
        self.processor, self.pool, self.calls, self.turn = processor, pool, calls, turn
        self.max_turns, self.budget, self.bounds, self.max_images = 2, 400, self.BOUNDS, None
        self.step, self.requests = 0, []

    @staticmethod
    def words(row, answer):
        n = 80 + row % 20 if answer == 2 and row % 3 == 0 else 1 + (row + answer) % 3
        return [100 + t for t in range(n)]

    def so_far(self, r):
        """The answer's tokens so far, as the request carries them: its prefix, or its conversation after the prompt."""
        return list(r.prefix) if r.prompt.max_tokens is None else r.prompt.input_ids[PROMPT_LEN:].tolist()

    def generate_until(self, requests, quota, params, seed):
        self.requests.append(requests)
        new, state = [[] for _ in requests], [None] * len(requests)  # state: "paused" or "done" once there

        def ended(k):
            return state[k] == "done"

        while not quota_met(requests, ended, quota) and any(s is None for s in state):
            for k, r in enumerate(requests):
                if state[k] is not None:
                    continue
                have, call = self.so_far(r) + new[k], self.calls[r.tag[1]]
                if len(have) < len(call):
                    assert have == call[: len(have)]
                    new[k].append(call[len(have)])
                    state[k] = "paused" if new[k][-1] in r.pause_ids else None
                    continue
                turn = r.prompt.input_ids[PROMPT_LEN + len(call) : PROMPT_LEN + len(call) + len(self.turn)]
                assert r.prompt.max_tokens is not None and turn.tolist() == self.turn and not r.pause_ids  # after it
                words, said = self.words(*r.tag), have[len(call) + len(self.turn) :]
                assert said == words[: len(said)]
                new[k].append(words[len(said)])
                state[k] = "done" if len(said) + 1 == len(words) else None
        return [(ids, [-float(self.step)] * len(ids), state[k] == "done", False) for k, ids in enumerate(new)]


PROMPT_LEN = 12


def test_a_stop_inside_a_tool_using_answer_continues_it_after_its_turn(tiny_tools_model_dir, monkeypatch):
    """Guards against partial rollouts with tools that lose or redo a tool turn: an answer stopped inside its call
    continues the call from its tokens; one that paused at its call gets its tool turn (log-prob 0, context) in the
    step it called, and one stopped after that turn continues from its conversation (prompt, call, turn) without
    calling again; the trained answers are whole, the reward's text is the last model turn's, and a checkpoint
    taken with such answers in flight resumes exactly, or, under a lower staleness bound, starts them over without
    the tool turns they had."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_tools_model_dir)
    tok = processor.tokenizer
    calls = [tok('<tool_call>{"name": "calculate", "arguments": {"expression": "6%s*7"}}</tool_call>' % (" " * 8 * j))[
        "input_ids"] for j in range(N)]  # fmt: skip
    stop = calls[0][-1]
    turn = turns.encode_turn(processor, tools.ToolResult("42"), 0, ToolScript.BOUNDS).input_ids.tolist()
    monkeypatch.setattr(partial, "encode_prompt", lambda processor, example: rollout.Prompt(
        torch.arange(10, 10 + PROMPT_LEN), None, None, []))  # fmt: skip
    tag = partial._request

    def tagged(engine, group, a, *more):
        r = tag(engine, group, a, *more)
        r.tag = (group.index, next(j for j, x in enumerate(group.answers) if x is a))
        return r

    monkeypatch.setattr(partial, "_request", tagged)
    args = ["rollout.partial=true", "rollout.engine=vllm", "algorithm.rollout_is=token", f"rollout.n={N}",
            "rollout.tools=[tools.py:calculate]", "rollout.max_turns=2", "rollout.partial_reserve=2.0"]  # fmt: skip
    cfg = load_config(None, args)

    def run(steps, state=None, position=0, config=cfg):
        """Steps `steps` of a fresh engine (from `state`, a carry's checkpoint, and the data position it was saved
        at); per step its trained samples and the data position after it."""
        with tools.ToolPool(["tools.py:calculate"], timeout=5.0) as pool:
            engine = ToolScript(processor, pool, calls, turn)
            engine.carry = partial.Carry(config)
            sampler = ShardSampler(24, 0, 1, shuffle=False)
            if state is not None:
                engine.carry.load_state_dict(state)
            out = []
            for s in steps:
                engine.step = s
                examples, _, samples, stats, _, position = partial.draw_and_generate(
                    engine, sampler, list(range(24)), processor, 0, position, 2, N, None, 0, s)  # fmt: skip
                out.append((s, examples, samples, stats, position))
                # an answer that paused at its call has had its tool turn, even when the quota was met then
                assert not any(a.ids[-1:] == [stop] and not a.done for g in engine.carry.groups for a in g.answers)
            return engine, out

    def check_whole(went):
        """Every trained answer is its call, its one tool turn and its words, each model token sampled at most at
        the step it trains, the carried ones before it."""
        for s, examples, samples, _, _ in went:
            assert len(examples) == 2
            for i, smp in enumerate(samples):
                words, call = ToolScript.words(examples[smp.prompt_index], i % N), calls[i % N]
                assert smp.response_ids == call + turn + words and [t.start for t in smp.turns] == [len(call)]
                assert smp.turns[0].input_ids.tolist() == turn and smp.text == tok.decode(words)
                assert smp.logprobs[len(call) : len(call) + len(turn)] == [0.0] * len(turn)
                model = [p for p in range(len(smp.response_ids)) if not len(call) <= p < len(call) + len(turn)]
                sampled_at = [-smp.logprobs[p] for p in model]  # the step that sampled each of the model's tokens
                assert sampled_at == sorted(sampled_at)
                assert all((t < s) == (p < smp.carried) and t <= s for p, t in zip(model, sampled_at))

    engine, went = run(range(1, 6))
    assert sum(stats["tool/calls"] for *_, stats, _ in went) > 0
    check_whole(went)
    requests = [r for step_requests in engine.requests for r in step_requests]
    call_len = {r.tag: len(calls[r.tag[1]]) for r in requests}
    assert any(0 < len(r.prefix) < call_len[r.tag] for r in requests)  # stopped inside its call, continued from there
    assert any(len(engine.so_far(r)) > call_len[r.tag] + len(turn) for r in requests)  # stopped after its tool turn

    # a checkpoint after step 2, with answers in flight past their tool turn, resumes exactly
    engine, before = run(range(1, 3))
    buffer = io.BytesIO()
    torch.save(engine.carry.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert any(a["turns"] and not a["done"] for g in state["groups"] for a in g["answers"])
    _, resumed = run(range(3, 6), state, before[-1][-1])
    for (_, ex_a, sm_a, *_), (_, ex_b, sm_b, *_) in zip(went[2:], resumed, strict=True):
        assert ex_a == ex_b
        assert [(x.response_ids, x.logprobs, x.carried, x.text) for x in sm_a] == [
            (x.response_ids, x.logprobs, x.carried, x.text) for x in sm_b
        ]

    # resumed at a later step under a lower staleness bound, the answers in flight start over, their turns too
    _, restarted = run(range(5, 7), state, before[-1][-1], load_config(None, [*args, "rollout.max_staleness=1"]))
    dropped = sum(a["born"] >= 0 for g in state["groups"] for a in g["answers"])  # all started by step 2
    assert restarted[0][3]["rollout/partial_dropped"] == dropped > 0
    check_whole(restarted)


class _Plain(torch.nn.Linear):
    def reshard(self):  # (FSDP2's: a plain module has nothing to reshard)
        pass


def _step_2_checkpoint(tmp_path, position):
    """A checkpoint of a plain module at step 2, epoch 1, `position` into the shard. Returns the config, the (model,
    optimizer, scheduler, scorer) that load_checkpoint restores into, and the checkpoint's path."""
    from grpo import checkpoint

    cfg = load_config(None, ["data.rollout_batch_size=8"])
    model = _Plain(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    scorer = SimpleNamespace(n_timeouts=0, n_errors=0)
    checkpoint.save_checkpoint(str(tmp_path), 2, 1, position, model, optimizer, scheduler, scorer, cfg)
    return cfg, (model, optimizer, scheduler, scorer), tmp_path / "checkpoints" / "step_2"


@pytest.mark.parametrize("case", ["same_ranks", "other_ranks", "rank_file_without_it"])
def test_each_rank_resumes_at_its_own_data_position(one_rank_group, tmp_path, case):
    """Guards against a resume that puts every rank at rank 0's data position: with partial rollouts and dynamic
    sampling a rank that filled its batch in fewer rounds has drawn fewer prompts (draw_and_generate's `have`), and
    would draw other prompts than the run that went on. A checkpoint of this rank at index 37 whose trainer_state (rank
    0's) says 30: the rank's own on the same ranks; on other ranks, and from a rank file written before positions
    were in it, rank 0's."""
    import json

    from grpo import checkpoint

    cfg, parts, path = _step_2_checkpoint(tmp_path, position=37)
    state = json.loads((path / "trainer_state.json").read_text())
    state["position"] = 30
    if case == "other_ranks":  # written by 2 ranks of 4 prompts: 7 steps into the epoch, 8 prompts a step now
        state["world_size"] = 2
    if case == "rank_file_without_it":
        rank_state = checkpoint.read_rank_state(str(path / "rank_0.pt"))
        assert rank_state.pop("data_position") == [1, 37]
        torch.save(rank_state, path / "rank_0.pt")
    (path / "trainer_state.json").write_text(json.dumps(state))
    got = checkpoint.load_checkpoint(str(path), *parts, cfg)
    assert got == {"same_ranks": (2, 1, 37), "other_ranks": (2, 1, 56), "rank_file_without_it": (2, 1, 30)}[case]


def test_a_resume_with_a_changed_config_says_what_changed(one_rank_group, tmp_path, capsys):
    """Guards against a run started again in an old output_dir with an edited config continuing the old run (its
    weights, its step) with nothing said but the resume line: the settings that differ are named, old and new; how the
    resume was asked for is no change; the same config says nothing."""
    from grpo import checkpoint

    cfg, parts, path = _step_2_checkpoint(tmp_path, position=16)
    checkpoint.load_checkpoint(str(path), *parts, cfg)
    assert "differ" not in capsys.readouterr().out
    edited = load_config(None, ["data.rollout_batch_size=8", "actor.lr=2e-6", "data.train_files=mine.parquet",
                                f"trainer.resume={path}"])  # fmt: skip
    checkpoint.load_checkpoint(str(path), *parts, edited)
    note = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert note == [f"note: 2 settings differ from the checkpoint's run: data.train_files='mine.parquet' (was "
                    f"{cfg.data.train_files!r}), actor.lr=2e-06 (was {cfg.actor.lr!r}) (trainer.resume=none or "
                    "another trainer.output_dir starts afresh)"]  # fmt: skip


def test_engine_steps_record_and_summary(tmp_path, monkeypatch):
    """bench/engine_steps.py, which `bench_partial.py --engine-steps` runs the trainer through: its wrappers on vLLM's
    engine write a line for each step that ran a batch (requests, tokens, whether requests came since the step
    before); summarise() starts a call at such a step, leaves the first (the warm-up) out, and tells prefill steps
    (more tokens than requests, a chunked prefill's later steps too) from decode steps and their tail."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    from bench import engine_steps

    scheduled = iter([{"a": 40, "b": 30}, {"a": 1, "b": 1}, {}])
    totals = iter([70, 2, 0])
    monkeypatch.setattr(Scheduler, "schedule", lambda self: SimpleNamespace(
        num_scheduled_tokens=next(scheduled), total_num_scheduled_tokens=next(totals)))  # fmt: skip
    monkeypatch.setattr(EngineCore, "step", lambda self: (self.scheduler.schedule(), ({}, True))[1])
    monkeypatch.setattr(EngineCore, "add_request", lambda self, request, request_wave=0: None)
    engine_steps.install(str(tmp_path / "recorded.txt"))
    core = SimpleNamespace(scheduler=object.__new__(Scheduler))
    EngineCore.add_request(core, "request")
    assert [EngineCore.step(core) for _ in range(3)] == [({}, True)] * 3
    lines = [line.split() for line in (tmp_path / "recorded.txt").read_text().splitlines()]
    assert [line[:3] for line in lines] == [["2", "70", "1"], ["2", "2", "0"]]  # (the empty step wrote nothing)

    steps = tmp_path / "steps.txt"
    steps.write_text(
        "10 500 1 0.5\n10 10 0 0.1\n4 4 0 0.1\n"  # the warm-up call
        "20 300 1 0.03\n20 20 0 0.004\n20 20 0 0.004\n5 5 0 0.002\n"
        "9 200 1 0.02\n9 100 0 0.01\n9 9 0 0.003\n"  # a prefill over two steps
    )
    s = engine_steps.summarise(str(steps))
    assert s["calls"] == 2 and s["steps"] == 3.5
    assert s["prefill_tokens"] == 300 and s["prefill_s"] == pytest.approx(0.03)
    assert s["decode_steps"] == 2 and s["decode_answers"] == 13.5 and s["decode_s"] == pytest.approx(0.0065)
    assert s["tail_steps"] == 0.5 and s["tail_s"] == pytest.approx(0.001)
