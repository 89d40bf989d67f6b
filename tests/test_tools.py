"""The shipped tools, the call parser, the bounded tool pool, and the turn loop (turns.py) on the HF engine: tool
faults come back to the model as messages and are counted, and the later turns' log-probs equal the trainer's."""

import json

import pytest
import torch
from PIL import Image

import rollout
from grpo import batching, logprobs, tools, turns
from tests.hf_engine_check import hf_engine, image_prompts, tiny_policy

SPECS = ["tools.py:crop", "tools.py:calculate", "tests/tool_fixtures.py:sleepy", "tests/tool_fixtures.py:crash"]


def test_parse_call():
    """Guards against a parser that takes the first of several calls, chokes on arguments written as a JSON string,
    or accepts what is not a call."""
    call = '<tool_call>{"name": "crop", "arguments": {"box": [1, 2, 3, 4]}}</tool_call>'
    assert tools.parse_call("look: <tool_call>{}</tool_call> then " + call) == (
        {"name": "crop", "arguments": {"box": [1, 2, 3, 4]}}, None)  # fmt: skip
    text_args = '<tool_call>{"name": "calculate", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
    assert tools.parse_call(text_args)[0] == {"name": "calculate", "arguments": {"expression": "1+1"}}
    for bad in (
        "no call",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>["crop"]</tool_call>',
        '<tool_call>{"name": "crop", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": 1}</tool_call>',
    ):
        call, why = tools.parse_call(bad)
        assert call is None and why, bad
    for empty in ("</tool_call>", "<tool_call> </tool_call>", "x </tool_call>"):  # the one tool, without arguments
        assert tools.parse_call(empty, only="reveal") == ({"name": "reveal", "arguments": {}}, None)
        assert tools.parse_call(empty)[0] is None
    assert tools.parse_call("<tool_call>x</tool_call>", only="reveal")[0] is None


def test_crop_zooms_in_pixels_and_fractions():
    """Guards against a box read in the wrong coordinates, a zoom that leaves the image budget (the crop is scaled to
    the source's pixel count), and a box outside the image accepted."""
    img = Image.new("RGB", (200, 100), "white")
    img.paste((255, 0, 0), (100, 50, 200, 100))  # the bottom-right quarter is red
    by_pixels = tools.crop({"box": [100, 50, 200, 100]}, [img])
    by_fraction = tools.crop({"box": [0.5, 0.5, 1.0, 1.0], "image": -1}, [Image.new("RGB", (8, 8)), img])
    for out in (by_pixels, by_fraction):
        assert out.size == (200, 100) and out.getpixel((100, 50)) == (255, 0, 0)
        assert [colour for _, colour in out.getcolors()] == [(255, 0, 0)]
    for bad in ({"box": [300, 300, 400, 400]}, {"box": [1, 2]}, {"box": [0, 0, 10, 10], "image": 3}):
        with pytest.raises(ValueError):
            tools.crop(bad, [img])


def test_calculate_is_bounded():
    """Guards against eval (names, attributes, calls outside the table), unbounded powers and values, and wrong
    arithmetic or angle units."""
    assert tools.calculate({"expression": "2 * sqrt(3) * sin(30)"}, []) == f"{3**0.5:.10g}"
    assert tools.calculate({"expression": "2^10 - 24 % 5"}, []) == "1020"
    for bad in (
        "__import__('os').system('true')",
        "(1).real",
        "9**9**9",
        "10**99 * 10**99",
        "x + 1",
        "1" * 501,
        "open('f')",
        "",
    ):
        with pytest.raises((ValueError, SyntaxError, OverflowError, TypeError)):
            tools.calculate({"expression": bad}, [])


def test_pool_bounds_hangs_and_crashes():
    """Guards against a hanging tool hanging the step, a crashing one taking the pool down, and a tool's exception
    or an unknown name raising instead of coming back as the model's error message."""
    img = Image.new("RGB", (64, 64), "white")
    with tools.ToolPool(SPECS, timeout=2.0, num_workers=2) as pool:
        calls = [{"name": "sleepy", "arguments": {}}, {"name": "crash", "arguments": {}},
                 {"name": "calculate", "arguments": {"expression": "6*7"}}, {"name": "nope", "arguments": {}},
                 {"name": "crop", "arguments": {"box": "x"}},
                 {"name": "crop", "arguments": {"box": [0, 0, 32, 32]}}]  # fmt: skip
        results = pool.run(calls, [[img]] * len(calls))
        assert [r.fault for r in results] == ["timeout", "timeout", None, "unknown", "error", None]
        assert results[2].text == "42" and results[5].images[0].size == (64, 64)
        assert pool.run([calls[2]], [[]])[0].text == "42"  # the pool works on after the kills


class Scripted:
    """The engine, except that the first call returns the given answers (token ids): the tiny random model never
    calls a tool by itself; the continuation turns are the real engine's."""

    def __init__(self, engine, first):
        self.engine, self.first, self.calls = engine, first, []

    def generate(self, prompts, n, params, seed):
        self.calls.append((len(prompts), params))
        if len(self.calls) > 1:
            return self.engine.generate(prompts, n, params, seed)
        return [rollout.Sample(i // n, ids, [0.0] * len(ids), "", False) for i, ids in enumerate(self.first)]


def scripted_calls(tokenizer):
    calls = [{"name": "crop", "arguments": {"box": [0, 0, 0.5, 0.5]}}, {"name": "calculate", "arguments":
             {"expression": "6*7"}}, None, {"name": "zoom", "arguments": {}}, {"name": "crop", "arguments":
             {"box": [5, 5, 5, 5]}}, {"name": "sleepy", "arguments": {}}]  # fmt: skip
    texts = [f"<tool_call>{json.dumps(c)}</tool_call>" if c else "<tool_call>{oops</tool_call>" for c in calls]
    return [tokenizer(t)["input_ids"] for t in texts]


def test_turn_loop_on_the_hf_engine(tiny_tools_model_dir):
    """Guards against tool faults that crash the loop or go uncounted, a tool image that does not reach the engine
    (the continuation's log-probs would then differ from the trainer's, which sees it in the tool turn), tool tokens
    given log-probs, a re-tokenized answer, and a turn that is not one batched engine call."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_tools_model_dir)
    tok = processor.tokenizer
    assert len(tok("<tool_call></tool_call>")["input_ids"]) == 2
    model = tiny_policy(tiny_tools_model_dir, processor)
    engine = hf_engine(processor, max_num_seqs=256)
    engine.sync_weights(model)
    prompts, n = image_prompts(processor, 2), 3
    first = scripted_calls(tok)
    scripted = Scripted(engine, first)
    params = rollout.SamplingParams(1.0, 1.0, 200)
    with tools.ToolPool(SPECS, timeout=2.0, num_workers=2) as pool:
        samples, stats = turns.generate_with_tools(scripted, processor, pool, prompts, n, params, 11, max_turns=2,
                                                   budget=200, bounds=(56 * 56, 112 * 112))  # fmt: skip
    assert stats == {"tool/calls": 6, "tool/malformed": 1, "tool/unknown": 1, "tool/error": 1, "tool/timeout": 1}
    assert len(scripted.calls) == 2 and scripted.calls[1][0] == 6  # one batched call for the second turn
    stop = tok.convert_tokens_to_ids(tools.TOOL_CALL_END)
    assert scripted.calls[0][1].stop_token_ids == (stop,) and scripted.calls[1][1].stop_token_ids == ()  # the last turn
    image_token_id = model.config.image_token_id
    for s, ids in zip(samples, first):
        (turn,) = s.turns
        assert s.response_ids[: len(ids)] == ids and turn.start == len(ids)  # the model's own ids, kept
        end = turn.start + len(turn.input_ids)
        assert s.response_ids[turn.start : end] == turn.input_ids.tolist() and s.logprobs[turn.start : end] == [0] * (
            end - turn.start)  # fmt: skip
        assert len(s.response_ids) > end and s.model_len == len(s.response_ids) - len(turn.input_ids)
        assert s.text == tok.decode(s.response_ids[end:], skip_special_tokens=True)
    assert (samples[0].turns[0].input_ids == image_token_id).sum() > 0  # crop returned an image
    messages = [tok.decode(s.turns[0].input_ids) for s in samples]
    assert "42" in messages[1] and "not valid JSON" in messages[2] and "unknown tool 'zoom'" in messages[3]
    assert "failed: ValueError" in messages[4] and "no answer within 2.0s" in messages[5]
    # the trainer's log-probs of the later turn's tokens, the tool turn (with its image) as context
    batch, response_ids, mask = batching.pack([prompts[s.prompt_index] for s in samples],
                                              [s.response_ids for s in samples], image_token_id,
                                              turns=[s.turns for s in samples])  # fmt: skip
    with torch.no_grad():
        logp = logprobs.forward_logprobs(model, batch, response_ids, 1.0)[0]  # (B, T)
    for row, s in enumerate(samples):
        end = s.turns[0].start + len(s.turns[0].input_ids)
        torch.testing.assert_close(logp[row, end : len(s.response_ids)], torch.tensor(s.logprobs[end:]),
                                   rtol=1e-4, atol=1e-4)  # fmt: skip
        assert mask[row, end : len(s.response_ids)].all() and not mask[row, :end][len(first[row]) :].any()


def test_turn_loop_on_the_vllm_engine(tiny_tools_model_dir, tmp_path):
    """Guards against a vLLM continuation that does not see the tool's image (its log-probs of the later tokens would
    then differ from the trainer's, which has the image in the tool turn; a continuation with the pads expanded twice
    would be refused), a stop token dropped from the answer (the loop would never find a call), and tool faults that
    stop the vLLM loop. The bound is tests/test_vllm.py's for image prompts."""
    from tests.launch import torchrun

    out = tmp_path / "vllm_tools.json"
    torchrun(1, "tests/vllm_tools_check.py", tiny_tools_model_dir, str(out))
    result = json.loads(out.read_text())
    assert result["stopped_at_stop"] >= result["answers"] - 1, result  # ~all stop at their first tokens
    assert result["stats"]["tool/calls"] == 6 and result["stats"]["tool/timeout"] == 1, result["stats"]
    assert result["tool_images"] == [1, 0, 0, 0, 0, 0] and min(result["later_tokens"]) > 0, result
    assert max(result["diff"]) <= 0.05, result["diff"]


def test_config_rejects_tools_that_cannot_be_offered():
    """Guards against a run that loads its models before finding that a tool spec is wrong (a missing file or
    function, a function without a schema, two tools of one name)."""
    from train_grpo import ConfigError, check_config, load_config

    check_config(load_config(None, ["rollout.tools=[tools.py:crop,tools.py:calculate]"]), 1)
    for specs, message in (("[tools.py:nope]", "no function 'nope'"), ("[nofile.py:crop]", "not found"),
                           ("[reward.py:first_digit]", "needs a `schema`"),
                           ("[tools.py:crop,tools.py:crop]", "two tools are named 'crop'")):  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            check_config(load_config(None, [f"rollout.tools={specs}"]), 1)


def test_tool_images_over_the_engines_limit_become_an_error(tiny_tools_model_dir):
    """Guards against a continuation that carries more images than vLLM accepts in one request
    (rollout.max_images_per_prompt): vLLM would refuse it and stop the step; the model gets an error message instead."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_tools_model_dir)
    tok = processor.tokenizer
    call = tok('<tool_call>{"name": "crop", "arguments": {"box": [0, 0, 1, 1]}}</tool_call>')["input_ids"]

    class OneImageEngine:
        max_images = 1  # the prompt's image fills it

        def generate(self, prompts, n, params, seed):
            if params.stop_token_ids:  # the first turn: every answer calls
                return [
                    rollout.Sample(i // n, list(call), [0.0] * len(call), "", False) for i in range(len(prompts) * n)
                ]
            assert all(len(p.images) == 1 for p in prompts)
            return [rollout.Sample(i, [5, 6], [-1.0, -1.0], "", False) for i in range(len(prompts))]

    prompts = image_prompts(processor, 1)
    params = rollout.SamplingParams(1.0, 1.0, 200)
    with tools.ToolPool(SPECS[:1], timeout=0) as pool:
        samples, stats = turns.generate_with_tools(OneImageEngine(), processor, pool, prompts, 2, params, 1,
                                                   max_turns=2, budget=200, bounds=(56 * 56, 112 * 112))  # fmt: skip
    assert stats["tool/error"] == 2 and all(not s.turns[0].images for s in samples)
    assert "at most 1 images" in tok.decode(samples[0].turns[0].input_ids)


def test_every_turn_but_the_last_stops_at_a_call(tiny_tools_model_dir):
    """Guards against the turn loop past two turns: with max_turns=3 the second turn must stop at a call again (the
    sampling parameters that do, not anything else of that name) and the third must not; an answer that calls
    twice holds two tool turns, each at the position where its call ended, and only the model's tokens carry
    log-probs. With routing replay an answer's record is its last call's, which read the whole conversation (the
    tool turns prefilled), not the first call's, which stops at the first call."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_tools_model_dir)
    tok = processor.tokenizer
    stop = tok.convert_tokens_to_ids(tools.TOOL_CALL_END)
    call = tok('<tool_call>{"name": "calculate", "arguments": {"expression": "6*7"}}</tool_call>')["input_ids"]

    class CallingEngine:
        def __init__(self):
            self.stops = []

        def generate(self, prompts, n, params, seed):
            self.stops.append(params.stop_token_ids)
            ids = list(call) if stop in params.stop_token_ids else [5, 6]
            routes = [torch.full((len(prompts[i // n].input_ids) + len(ids), 1, 2), len(self.stops), dtype=torch.int8)
                      for i in range(len(prompts) * n)]  # fmt: skip
            return [rollout.Sample(i // n, list(ids), [-1.0] * len(ids), "", False, routes=routes[i])
                    for i in range(len(prompts) * n)]  # fmt: skip

    engine = CallingEngine()
    params = rollout.SamplingParams(1.0, 1.0, 400)
    prompts = image_prompts(processor, 1)
    with tools.ToolPool(["tools.py:calculate"], timeout=2.0) as pool:
        samples, stats = turns.generate_with_tools(engine, processor, pool, prompts, 2, params, 1,
                                                   max_turns=3, budget=400, bounds=(56 * 56, 112 * 112))  # fmt: skip
    assert [stop in stops for stops in engine.stops] == [True, True, False]
    assert stats["tool/calls"] == 4
    for s in samples:
        first, second = s.turns
        assert first.start == len(call) and second.start == first.start + len(first.input_ids) + len(call)
        assert s.response_ids[second.start + len(second.input_ids) :] == [5, 6] and s.text == tok.decode([5, 6])
        model = [i for i in range(len(s.response_ids)) if not any(t.start <= i < t.start + len(t.input_ids)
                                                                   for t in s.turns)]  # fmt: skip
        assert all(s.logprobs[i] == -1.0 for i in model) and sum(s.logprobs) == -len(model)
        assert s.routes.shape[0] == len(prompts[0].input_ids) + len(s.response_ids) and (s.routes == 3).all()


def test_a_tool_turn_survives_a_checkpoint(tiny_tools_model_dir):
    """Guards against a partial rollout's carried answer losing its tool turn's picture on resume: the turn's state,
    saved and read back with weights_only=True (the rank files' reader), is the same turn, pixels and all."""
    import io

    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_tools_model_dir)
    picture = Image.new("RGB", (80, 60), "white")
    picture.paste((200, 30, 30), (10, 10, 50, 40))
    turn = turns.encode_turn(processor, tools.ToolResult("a crop", [picture]), 7, (56 * 56, 112 * 112))
    buffer = io.BytesIO()
    torch.save(turns.turn_state(turn), buffer)
    buffer.seek(0)
    back = turns.turn_from_state(torch.load(buffer, weights_only=True))
    assert back.start == 7 and back.template_ids == turn.template_ids
    for name in ("input_ids", "token_types", "pixel_values", "image_grid_thw"):
        assert torch.equal(getattr(back, name), getattr(turn, name)), name
    assert [(img.mode, img.size, img.tobytes()) for img in back.images] == [
        (img.mode, img.size, img.tobytes()) for img in turn.images
    ]
