"""Training on interleaved answers [model tokens | tool turn (text, images) | model tokens]: the padded, packed and
shared-prefix layouts agree in log-probs and gradients, the tool turns carry no loss, and a tool turn's image is
really seen (the later tokens' log-probs depend on its pixels)."""

import pytest
import torch
from PIL import Image, ImageDraw

from grpo import attention, batching, loading, logprobs, tools, turns
from tests.test_shared_prefix import _groups
from tests.test_varlen import reference_varlen

BOUNDS = (56 * 56, 112 * 112)  # the tiny model's pixel budget (scripts/make_tiny_model.py)


def _picture(size, seed):
    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).line((seed, 0, 40, 50 - seed), fill=(200, 30 * seed % 255, 0), width=4)
    return img


def interleaved(processor, pieces, g):
    """An answer [model tokens | tool turn | model tokens | ...]: `pieces` alternates model-token counts and tool
    results; returns (response_ids, tool turns)."""
    ids, found = [], []
    for piece in pieces:
        if isinstance(piece, int):
            ids += torch.randint(0, 300, (piece,), generator=g).tolist()
        else:
            turn = turns.encode_turn(processor, piece, len(ids), BOUNDS)
            ids += turn.input_ids.tolist()
            found.append(turn)
    return ids, found


def _interleaved_groups(processor):
    """_groups' prompts (A three answers, B two, C one, A one more apart), some answers with tool turns: one image,
    two images in two turns, text only, and plain answers beside them in the same groups."""
    prompts, _ = _groups(processor)
    g = torch.Generator().manual_seed(3)
    pic = [tools.ToolResult("zoomed", [_picture((84, 56), s)]) for s in range(3)]
    text = tools.ToolResult("42")
    plans = [[4, pic[0], 5], [6], [3, pic[1], 2, pic[2], 4], [5, text, 3], [2, pic[0], 1], [7], [3, text, 2, pic[1], 2]]
    responses, tool_turns = zip(*(interleaved(processor, plan, g) for plan in plans))
    return prompts, list(responses), list(tool_turns)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "varlen_packed"])
def test_interleaved_layouts_agree(tiny_model_dir, tiny_processor, attn_implementation, monkeypatch):
    """Guards against tool turns' images placed out of token order (the vision tower's features scattered into the
    wrong pads), mRoPE positions after an answer's image taken from another answer's row, a shared prompt's images
    counted once per row in the grids, tool tokens left in the loss, and a packed or shared backward that differs
    from the padded one (transformers' own positions): 1e-5 in fp32."""
    monkeypatch.setattr(attention, "varlen_kernel", reference_varlen)
    torch.manual_seed(0)
    model = loading.load_model(tiny_model_dir, torch.device("cpu"), attn_implementation)
    prompts, responses, tool_turns = _interleaved_groups(tiny_processor)
    layouts = _layouts(tiny_processor, model, prompts, responses, tool_turns)
    images = sum(len(t.images) for ts in tool_turns for t in ts)
    assert layouts["packed"][0]["image_grid_thw"].shape[0] == 5 + images  # A's image 4 times, C's once
    assert layouts["shared"][0]["image_grid_thw"].shape[0] == 3 + images  # A's twice (two parts), C's once
    _assert_layouts_agree(model, layouts)


def _layouts(processor, model, prompts, responses, tool_turns):
    """The padded, packed and shared-prefix batches of the answers, after checking that the mask holds exactly the
    model's tokens."""
    pad_id, image_token_id = processor.tokenizer.pad_token_id, model.config.image_token_id
    layouts = {
        "padded": batching.collate(prompts, responses, pad_id, image_token_id, turns=tool_turns),
        "packed": batching.pack(prompts, responses, image_token_id, turns=tool_turns),
        "shared": batching.pack(prompts, responses, image_token_id, share_prompts=True, turns=tool_turns),
    }
    padded_mask = layouts["padded"][2]
    for i, ts in enumerate(tool_turns):
        model_tokens = len(responses[i]) - sum(len(t.input_ids) for t in ts)
        assert padded_mask[i].sum() == model_tokens
        for t in ts:
            assert padded_mask[i, t.start : t.start + len(t.input_ids)].sum() == 0
    return layouts


def _assert_layouts_agree(model, layouts):
    """Log-probs and every parameter's gradient (the vision tower's included) of the packed and shared layouts
    equal the padded one's, 1e-5."""
    padded_mask = layouts["padded"][2]
    results = {}
    for name, (inputs, response_ids, mask) in layouts.items():
        torch.testing.assert_close(mask, padded_mask)
        model.zero_grad(set_to_none=True)
        logp, ent = logprobs.forward_logprobs(model, inputs, response_ids, 0.9, True, True)
        ((logp * mask).sum() + 0.1 * (ent * mask).sum()).backward()
        results[name] = (logp.detach() * mask, {n: p.grad.clone() for n, p in model.named_parameters()})
    logp_ref, grads_ref = results["padded"]
    for name in ("packed", "shared"):
        logp, grads = results[name]
        torch.testing.assert_close(logp, logp_ref, rtol=1e-5, atol=1e-5, msg=name)
        for key in grads_ref:  # every parameter, the vision tower's included
            torch.testing.assert_close(grads[key], grads_ref[key], rtol=1e-5, atol=1e-5, msg=f"{name} {key}")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_shared_video_prompt_whose_answers_hold_tool_images(tiny_family_dir, tmp_path, family):
    """Guards against the clip of a shared prompt whose answers hold tool images (each answer its own row of mRoPE
    positions, the prompt in each) given to one row's positions only: its grid (and Qwen2.5-VL's seconds per
    patch) must be repeated with the prompt, in Qwen2.5-VL's one run of video tokens and in Qwen3-VL's runs split
    by timestamps. (A tool run on video rows used to stop at its first log-prob forward.)"""
    from transformers import AutoProcessor

    from data import PromptDataset
    from grpo import preflight
    from grpo.config import load_config
    from grpo.samples import encode_prompt
    from scripts.make_synthetic_data import make_video_count_task

    torch.manual_seed(0)
    model = loading.load_model(tiny_family_dir(family), torch.device("cpu"), "sdpa")
    processor = AutoProcessor.from_pretrained(tiny_family_dir(family))
    path = make_video_count_task(str(tmp_path / "clips.parquet"), n_rows=2)
    cfg = load_config("configs/tiny_video.yaml")
    ds = PromptDataset(path, processor, **preflight.dataset_kwargs(cfg, processor))
    a, b = (encode_prompt(processor, ds[i]) for i in range(2))
    g = torch.Generator().manual_seed(3)
    pic = [tools.ToolResult("zoomed", [_picture((84, 56), s)]) for s in range(3)]
    plans = [[4, pic[0], 5], [6], [3, pic[1], 2, pic[2], 4], [5], [2, pic[0], 1]]
    responses, tool_turns = zip(*(interleaved(processor, plan, g) for plan in plans))
    layouts = _layouts(processor, model, [a, a, a, b, b], list(responses), list(tool_turns))
    assert layouts["shared"][0]["video_grid_thw"].shape[0] == 2  # each clip once in the shared row
    _assert_layouts_agree(model, layouts)


def test_tool_image_reaches_the_forward(tiny_model_dir, tiny_processor):
    """Guards against a tool turn whose pixels never reach the model (image pads without features, or the prompt's
    features reused): the log-probs of the tokens after a tool image change with that image, not before it; and
    against an interleaved answer scored differently from the same tokens with the conversation so far as prompt
    (turns.continuation, what the engines generate from)."""
    torch.manual_seed(0)
    model = loading.load_model(tiny_model_dir, torch.device("cpu"), "sdpa")
    pad_id, image_token_id = tiny_processor.tokenizer.pad_token_id, model.config.image_token_id
    prompt = _groups(tiny_processor)[0][0]
    g = torch.Generator().manual_seed(5)
    before = torch.randint(0, 300, (5,), generator=g).tolist()
    after = torch.randint(0, 300, (6,), generator=g).tolist()
    out = []
    for seed in (0, 7):
        turn = turns.encode_turn(tiny_processor, tools.ToolResult("", [_picture((84, 84), seed)]), 5, BOUNDS)
        ids = before + turn.input_ids.tolist() + after
        with torch.no_grad():
            batch = batching.pack([prompt], [ids], image_token_id, turns=[[turn]])
            out.append(logprobs.forward_logprobs(model, *batch[:2], 1.0)[0][0])
        if seed == 0:  # the same tokens, everything before `after` as the prompt
            sample = type("S", (), {"response_ids": before + turn.input_ids.tolist(), "turns": [turn]})()
            context = turns.continuation(prompt, sample, 6, image_token_id)
            batch = batching.collate([context], [after], pad_id, image_token_id)
            with torch.no_grad():
                alone = logprobs.forward_logprobs(model, *batch[:2], 1.0)[0][0]
            torch.testing.assert_close(out[0][-len(after) :], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[0][:5], out[1][:5], rtol=1e-6, atol=1e-6)  # before the tool image: the same
    assert (out[0][-len(after) :] - out[1][-len(after) :]).abs().max() > 1e-4  # after it: the image matters
