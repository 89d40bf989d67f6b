"""Shared-prefix training (actor.shared_prefix): a group's prompt and images go through the model once for all of its
answers in a micro-batch. Exact by construction -- these tests hold it to the unshared packed layout in fp32."""

import pytest
import torch

import rollout
from grpo import attention, batching, loading, logprobs
from grpo.batching import shared_prefix_parts
from tests.test_varlen import reference_varlen


def _groups(processor):
    """Three prompts (two with images of different sizes, one text-only) and their answers, laid out as a
    micro-batch would hold them: A's three answers (one of them a single token), B's two, C's one, then a fourth
    answer of A that is not next to the others (another part of A's group: its own prompt copy)."""
    from PIL import Image, ImageDraw

    prompts = []
    for i, size in enumerate([(84, 84), None, (112, 56)]):
        img = Image.new("RGB", size, "white") if size else None
        content = [{"type": "text", "text": "Find x. " * (i + 1)}]
        if img:
            ImageDraw.Draw(img).line((0, 0, 40, 50), fill="black", width=3)
            content.insert(0, {"type": "image"})
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        out = processor(text=[text], images=[img] if img else None, return_tensors="pt")
        prompts.append(rollout.Prompt(out["input_ids"][0], out.get("pixel_values"), out.get("image_grid_thw"), []))
    a, b, c = prompts
    order = [a, a, a, b, b, c, a]
    g = torch.Generator().manual_seed(1)
    responses = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (9, 1, 14, 5, 2, 7, 3)]
    return order, responses


@pytest.mark.parametrize("attn_implementation", ["sdpa", "varlen_packed"])
def test_shared_prefix_equals_unshared(tiny_model_dir, tiny_processor, attn_implementation, monkeypatch):
    """Guards against an answer that sees another answer of its group, positions that do not continue from the
    prompt as they would alone, a first answer token predicted from the wrong position, images counted once too
    often or too rarely, and a prompt gradient that is not the sum of its copies' -- for the CPU block mask and
    for the CUDA varlen path (the kernel swapped for its CPU reference, prompt keys gathered per answer)."""
    monkeypatch.setattr(attention, "varlen_kernel", reference_varlen)
    torch.manual_seed(0)
    model = loading.load_model(tiny_model_dir, torch.device("cpu"), attn_implementation)
    image_token_id = model.config.image_token_id
    prompts, responses = _groups(tiny_processor)
    unshared = batching.pack(prompts, responses, image_token_id)
    shared = batching.pack(prompts, responses, image_token_id, share_prompts=True)
    assert shared[0]["group_sizes"].tolist() == [3, 2, 1, 1] and unshared[0]["group_sizes"].tolist() == [1] * 7
    assert shared[0]["pixel_values"].shape[0] < unshared[0]["pixel_values"].shape[0]  # A's image twice, not 4 times
    assert shared[0]["input_ids"].shape[1] == unshared[0]["input_ids"].shape[1] - 3 * len(prompts[0].input_ids) + len(
        prompts[0].input_ids
    ) - len(prompts[3].input_ids)
    torch.testing.assert_close(shared[1], unshared[1])
    torch.testing.assert_close(shared[2], unshared[2])

    results = {}
    for name, (inputs, response_ids, mask) in (("unshared", unshared), ("shared", shared)):
        model.zero_grad(set_to_none=True)
        logp, ent = logprobs.forward_logprobs(model, inputs, response_ids, 0.9, True, True)
        ((logp * mask).sum() + 0.1 * (ent * mask).sum()).backward()
        results[name] = (logp.detach() * mask, ent.detach() * mask, {n: p.grad.clone() for n, p in
                                                                     model.named_parameters()})  # fmt: skip
    (logp_u, ent_u, grads_u), (logp_s, ent_s, grads_s) = results["unshared"], results["shared"]
    torch.testing.assert_close(logp_s, logp_u, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_s, ent_u, rtol=1e-5, atol=1e-5)
    assert grads_s.keys() == grads_u.keys()
    for name in grads_u:  # every parameter, the vision tower's included
        torch.testing.assert_close(grads_s[name], grads_u[name], rtol=1e-5, atol=1e-5, msg=name)


def test_shared_prefix_attention_mask():
    """Guards against the layout itself: a prompt attends causally to itself, an answer to all of its prompt and
    causally to itself, never to a sibling; plain sequences are causal over themselves alone."""
    # part 1: prompt 0-2, answers 3-4 and 5; part 2: one sequence 6-8
    layout = attention.PackedLayout([(0, 3, 0, 0), (3, 5, 0, 3), (5, 6, 0, 3), (6, 9, 0, 0)], 9, torch.device("cpu"))
    masks = layout.prefix_masks()
    assert masks[0] is None and masks[3] is None  # a prompt and a plain sequence: causal over themselves
    mask = torch.zeros(9, 9, dtype=torch.int)
    for s, e in ((0, 3), (6, 9)):
        mask[s:e, s:e] = torch.ones(e - s, e - s).tril()
    for (s, e, ps, pe), m in zip(layout.segments[1:3], masks[1:3]):  # answers: columns [prompt | themselves]
        mask[s:e, [*range(ps, pe), *range(s, e)]] = m[0, 0].int()
    key_index, cu_q, cu_k, max_q, max_k = layout.varlen_args()
    assert key_index.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 8]
    assert cu_q.tolist() == [0, 3, 5, 6, 9] and cu_k.tolist() == [0, 3, 8, 12, 15] and (max_q, max_k) == (3, 5)


def test_shared_prefix_parts_fit_the_budget():
    """Guards against a planner that counts a shared prompt once per answer (budgets too loose to be honest, or
    too many micro-batches) or lets a part overflow the budget."""
    groups, prompt_lens = [[0, 1, 2, 3], [4, 5]], [100, 40]
    lengths = {0: 30, 1: 50, 2: 40, 3: 20, 4: 500, 5: 10}
    parts, costs = shared_prefix_parts(groups, prompt_lens, lengths, budget=200)
    assert parts == [[0, 1], [2, 3], [4], [5]]
    assert costs == [180, 160, 540, 50]  # the 540 part is one answer: it cannot be split
    assert sorted(i for p in parts for i in p) == list(range(6))
