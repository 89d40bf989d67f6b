"""Padding-free packing and token-budget micro-batches: the packed forward against the padded one and
against each sequence alone, and the properties of the micro-batch partition."""

import random

import pytest
import torch
import torch.distributed as dist

import rollout
from grpo import attention, batching, loading, logprobs
from grpo.batching import balanced_bins, rebalance_moves, token_budget_micro_batches
from tests.launch import free_port
from train_grpo import ConfigError, check_config, load_config


def _mixed_batch(processor, image_token_id):
    """Four prompts -- two with images of different sizes, two text-only, of different lengths -- and responses of
    uneven lengths: everything that could misplace a packed sequence's positions, images or labels."""
    from PIL import Image, ImageDraw

    prompts = []
    for i in range(4):
        img = Image.new("RGB", (56 + 28 * i, 84), "white")
        ImageDraw.Draw(img).line((0, 0, 40, 60), fill="black", width=3)
        content = [{"type": "text", "text": "Find x. " * (i + 1)}]
        if i % 2 == 0:
            content.insert(0, {"type": "image"})
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        out = processor(text=[text], images=[img] if i % 2 == 0 else None, return_tensors="pt")
        prompts.append(rollout.Prompt(out["input_ids"][0], out.get("pixel_values"), out.get("image_grid_thw"), []))
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (9, 2, 14, 5)]
    return prompts, responses


@pytest.mark.parametrize("fsdp", [False, True])
def test_packed_logprobs_equal_padded_and_alone(tiny_model_dir, tiny_processor, fsdp):
    """Guards against attention crossing from one packed sequence into the next (plain sdpa with no mask does that:
    the log-probs then differ by ~0.3 here), mRoPE positions that run on across sequences instead of restarting,
    images assigned to the wrong sequence, labels read one position off, and a packed backward that differs from
    the padded one. Reference: every sequence alone, unpadded."""
    torch.manual_seed(0)
    model = loading.load_model(tiny_model_dir, torch.device("cpu"), "sdpa")
    assert model.config._attn_implementation == "sdpa_packed"
    pad_id, image_token_id = tiny_processor.tokenizer.pad_token_id, model.config.image_token_id
    prompts, responses = _mixed_batch(tiny_processor, image_token_id)
    temperature = 0.9
    with torch.no_grad():
        alone = [
            logprobs.forward_logprobs(model, *batching.collate([p], [r], pad_id, image_token_id)[:2], temperature)[0]
            for p, r in zip(prompts, responses)
        ]
    padded_inputs, response_ids, mask = batching.collate(prompts, responses, pad_id, image_token_id)
    packed_inputs, packed_ids, packed_mask = batching.pack(prompts, responses, image_token_id)
    assert packed_inputs["input_ids"].shape == (1, sum(len(p.input_ids) + len(r) for p, r in zip(prompts, responses)))
    assert torch.equal(packed_ids * mask.long(), response_ids * mask.long()) and torch.equal(packed_mask, mask)

    if fsdp:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        if fsdp:
            loading.apply_fsdp(model, torch.device("cpu"))
            loading.root_forward(model, pad_id)
        grads = {}
        for name, inputs in (("padded", padded_inputs), ("packed", packed_inputs)):
            model.zero_grad(set_to_none=True)
            logp, ent = logprobs.forward_logprobs(model, inputs, response_ids, temperature, True, True)
            ((logp * mask).sum() + 0.1 * (ent * mask).sum()).backward()
            head, layer = model.lm_head.weight.grad, model.model.language_model.layers[0].self_attn.q_proj.weight.grad
            vision = model.model.visual.blocks[0].attn.qkv.weight.grad
            grads[name] = [g.full_tensor() if fsdp else g.clone() for g in (head, layer, vision)]
            for i, ref in enumerate(alone):
                torch.testing.assert_close(logp[i, : ref.shape[1]].detach(), ref[0], rtol=1e-5, atol=1e-5)
            if name == "packed":
                assert (logp.detach() * (1 - mask)).abs().max() == 0  # nothing outside the responses
        for got, want in zip(grads["packed"], grads["padded"]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    finally:
        if fsdp:
            dist.destroy_process_group()


def test_sdpa_packed_is_plain_sdpa_off_the_packed_path():
    """Guards against the CPU packed attention leaking into other calls: with a mask, with a batch of rows, or with
    keys longer than queries (a KV cache) it must be transformers' sdpa exactly."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(0)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 1
    q, k, v = (torch.randn(2, 2, 6, 8, generator=g) for _ in range(3))
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]] * 2)
    for args in ((q, k, v, mask), (q, k, v, None)):
        want = sdpa_attention_forward(module, *args)[0]
        torch.testing.assert_close(attention.sdpa_packed(module, *args, position_ids=positions)[0], want)
    # one packed row of two sequences: each half equals that half alone
    got = attention.sdpa_packed(module, q[:1], k[:1], v[:1], None, position_ids=positions[:1])[0]
    for s, e in ((0, 3), (3, 6)):
        alone = sdpa_attention_forward(module, q[:1, :, s:e], k[:1, :, s:e], v[:1, :, s:e], None)[0]
        torch.testing.assert_close(got[:, s:e], alone)


@pytest.mark.parametrize("seed", range(5))
def test_token_budget_micro_batches_partition(seed):
    """Guards against a partition that drops or repeats a sequence, overflows the budget, uses more micro-batches
    than needed, or leaves them unbalanced (a rank's step lasts as long as its fullest micro-batch)."""
    rng = random.Random(seed)
    lengths = [rng.randint(50, 300) + rng.choice([0, 0, 0, 1500]) for _ in range(rng.randint(8, 40))]
    budget = 2048
    bins = token_budget_micro_batches(lengths, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(b == sorted(b) and b for b in bins)
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert max(loads) <= budget
    assert len(bins) <= -(-sum(lengths) // budget) + 1  # at most one over the lower bound for these lengths
    assert max(loads) - min(loads) <= max(lengths)  # LPT: the gap is at most one sequence


def test_balanced_bins_and_oversized_sequence():
    assert balanced_bins([5, 1, 4, 2, 3, 3], 2) == [[0, 1, 5], [2, 3, 4]]  # 9 and 9 tokens
    bins = token_budget_micro_batches([100, 10, 10, 10], budget=50)  # 100 alone can only be its own micro-batch
    assert [0] in bins and sorted(i for b in bins for i in b) == [0, 1, 2, 3]


@pytest.mark.parametrize("seed", range(5))
def test_rebalance_moves_even_out_ranks_with_few_moves(seed):
    """Guards against a rebalancing plan that loses or duplicates a sequence, leaves the ranks uneven (the lockstep
    step waits for the fullest), or moves far more than the imbalance needs (each move ships a prompt's images)."""
    rng = random.Random(seed)
    ranks = [[min(2048, int(rng.lognormvariate(5.7, 0.7))) + rng.randint(330, 620) for _ in range(80)]
             for _ in range(8)]  # fmt: skip
    moves = rebalance_moves(ranks)
    assert moves == rebalance_moves([list(r) for r in ranks])  # every rank computes the same plan
    assert len({(src, i) for src, i, _ in moves}) == len(moves)  # nothing moved twice
    held = [[n for i, n in enumerate(r) if (k, i) not in {(s, j) for s, j, _ in moves}] for k, r in enumerate(ranks)]
    for src, i, dst in moves:
        assert src != dst
        held[dst].append(ranks[src][i])
    assert sorted(n for h in held for n in h) == sorted(n for r in ranks for n in r)
    loads = [sum(h) for h in held]
    before = [sum(r) for r in ranks]
    assert max(loads) - min(loads) <= max(n for r in ranks for n in r)
    assert max(loads) - min(loads) < (max(before) - min(before)) / 4
    assert len(moves) <= 20  # of 640 sequences
    assert rebalance_moves([[5, 5], [5, 5]]) == []


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["actor.max_tokens_per_micro_batch=1000"], "smaller than one sequence"),
        (["actor.max_tokens_per_micro_batch=8192", "actor.padding_free=false"], "needs actor.padding_free"),
        (["actor.max_tokens_per_micro_batch_no_grad=-1"], "must be >= 0"),
        (["actor.attn_implementation=eager"], "attention that stays inside"),
    ],
)
def test_packing_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_config(load_config(None, overrides), world_size=1)
