"""Chunked log-probs and entropy (no full (B, T, V) logits) against the plain full-logits computation."""

import pytest
import torch
import torch.distributed as dist

import rollout
from grpo import batching, loading, logprobs
from grpo.logprobs import chunked_logprobs, entropy_from_logits, token_logprobs
from tests.launch import free_port


def _naive(hidden, weight, labels, temperature):
    logits = torch.nn.functional.linear(hidden, weight)  # (B, T, V)
    return token_logprobs(logits, labels, temperature), entropy_from_logits(logits, temperature)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [4, 7, 1000])
def test_chunked_matches_naive_values_and_gradients(temperature, chunk_size):
    """Guards against chunk-boundary bugs (a last partial chunk dropped or misaligned with its labels when B*T is
    not a multiple of the chunk), a temperature applied in one path only, and a checkpointed chunk whose backward
    loses the gradient of the hidden states or of the LM head weight."""
    g = torch.Generator().manual_seed(0)
    b, t, h, v = 3, 5, 16, 50  # B*T = 15: not divisible by 4 or 7
    hidden = torch.randn(b, t, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    labels = torch.randint(0, v, (b, t), generator=g)
    w_logp, w_ent = torch.randn(b, t, generator=g), torch.randn(b, t, generator=g)  # arbitrary upstream gradients

    logp, ent = _naive(hidden, weight, labels, temperature)
    torch.autograd.backward([logp, ent], [w_logp, w_ent])
    expected = (logp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad, weight.grad = None, None

    logp, ent = chunked_logprobs(hidden, weight, labels, temperature, chunk_size=chunk_size)
    assert logp.shape == ent.shape == (b, t)
    torch.autograd.backward([logp, ent], [w_logp, w_ent])
    for got, want in zip((logp.detach(), ent.detach(), hidden.grad, weight.grad), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_chunked_without_entropy_and_without_grad():
    """Guards against the no-grad path (old/ref log-probs) or with_entropy=False computing something else."""
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(2, 9, 8, generator=g), torch.randn(30, 8, generator=g)
    labels = torch.randint(0, 30, (2, 9), generator=g)
    with torch.no_grad():
        logp, ent = chunked_logprobs(hidden, weight, labels, 0.5, chunk_size=4, with_entropy=False)
    assert ent is None and not logp.requires_grad
    torch.testing.assert_close(logp, _naive(hidden, weight, labels, 0.5)[0], rtol=1e-5, atol=1e-5)


def _tiny_batch(processor, model):
    """Two prompts (one with an image) and responses of uneven lengths, laid out by batching.collate."""
    from PIL import Image, ImageDraw

    prompts = []
    for i in range(2):
        img = Image.new("RGB", (56 + 28 * i, 84), "white")
        ImageDraw.Draw(img).line((0, 0, 40, 60), fill="black", width=3)
        content = [{"type": "text", "text": f"Find x {i}."}]
        if i == 0:
            content.insert(0, {"type": "image"})
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        out = processor(text=[text], images=None if i else [img], return_tensors="pt")
        prompts.append(rollout.Prompt(out["input_ids"][0], out.get("pixel_values"), out.get("image_grid_thw"), []))
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (7, 3)]
    return batching.collate(prompts, responses, processor.tokenizer.pad_token_id, model.config.image_token_id)


def _full_logits_logprobs(model, batch_inputs, response_ids, temperature):
    """The computation before chunked log-probs: full logits of the last T + 1 positions, then log_softmax/entropy
    on them."""
    logits = model(**batch_inputs, use_cache=False, logits_to_keep=response_ids.shape[1] + 1).logits[:, :-1]
    return token_logprobs(logits, response_ids, temperature), entropy_from_logits(logits, temperature)


@pytest.mark.parametrize("fsdp", [False, True])
def test_forward_logprobs_matches_full_logits_on_tiny_model(tiny_model_dir, tiny_processor, fsdp):
    """Guards against the swapped LM head reading the wrong positions (off by one against the labels), leaking
    outside forward_logprobs (generate would get log-probs instead of logits), or cutting the gradient to the LM
    head or to the layers below it; with FSDP2 (1-rank gloo group), against running the head outside the root's
    forward, where its weight is not all-gathered."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch_inputs, response_ids, _ = _tiny_batch(tiny_processor, model)
    temperature = 0.8
    logp_ref, ent_ref = _full_logits_logprobs(model, batch_inputs, response_ids, temperature)
    (logp_ref.sum() + 0.1 * ent_ref.sum()).backward()
    head_grad_ref = model.lm_head.weight.grad.clone()
    layer_grad_ref = model.model.language_model.layers[0].mlp.up_proj.weight.grad.clone()
    model.zero_grad(set_to_none=True)

    if fsdp:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        if fsdp:
            loading.apply_fsdp(model, torch.device("cpu"))
            loading.root_forward(model, tiny_processor.tokenizer.pad_token_id)
        with torch.no_grad():
            logp_nograd, _ = logprobs.forward_logprobs(model, batch_inputs, response_ids, temperature)
        if fsdp:
            model.reshard()
        logp, ent = logprobs.forward_logprobs(model, batch_inputs, response_ids, temperature, True, True)
        (logp.sum() + 0.1 * ent.sum()).backward()
        head_grad, layer_grad = model.lm_head.weight.grad, model.model.language_model.layers[0].mlp.up_proj.weight.grad
        if fsdp:
            head_grad, layer_grad = head_grad.full_tensor(), layer_grad.full_tensor()
        torch.testing.assert_close(logp_nograd, logp_ref.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logp.detach(), logp_ref.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent.detach(), ent_ref.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(head_grad, head_grad_ref, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(layer_grad, layer_grad_ref, rtol=1e-4, atol=1e-6)
        assert "forward" not in vars(model.lm_head)  # the plain nn.Linear forward is back
        _, no_entropy = logprobs.forward_logprobs(model, batch_inputs, response_ids, temperature, True, False)
        assert not no_entropy.requires_grad  # the metric-only entropy builds no graph
    finally:
        if fsdp:
            dist.destroy_process_group()


def test_the_trainers_softmax_leaves_out_the_tokens_the_engines_never_sample(tiny_model_dir, tiny_processor):
    """Guards against the trainer normalising over tokens the engines forbid (the vision tokens: vLLM's logit bias,
    the HF engine's suppress_tokens). Over the whole vocabulary every sampled token's log-prob is lower by
    log(1 - p(vision tokens)), a distribution nobody samples from, and a loss whose advantages do not sum to zero over
    tokens pushes mass onto tokens that nothing samples and so nothing pushes back: the forbidden rows of the head
    must get no gradient at all, and the entropy must stay finite (0 x -inf is NaN)."""
    from grpo.samples import vision_token_ids

    torch.manual_seed(0)
    model = loading.load_model(tiny_model_dir, torch.device("cpu"), "sdpa")
    forbidden = torch.tensor(vision_token_ids(tiny_processor.tokenizer))
    assert model.forbidden_token_ids.tolist() == forbidden.tolist() and len(forbidden) == 5
    batch_inputs, response_ids, mask = _tiny_batch(tiny_processor, model)
    logp, ent = logprobs.forward_logprobs(model, batch_inputs, response_ids, 0.7, True, True)
    ((logp * mask).sum() + 0.1 * (ent * mask).sum()).backward()
    assert torch.isfinite(ent).all()
    assert model.lm_head.weight.grad[forbidden].abs().max() == 0
    assert model.lm_head.weight.grad.abs().sum() > 0
    with torch.no_grad():
        logits = model(**batch_inputs, use_cache=False, logits_to_keep=response_ids.shape[1] + 1).logits[:, :-1]
        allowed = token_logprobs(logits, response_ids, 0.7, forbidden)
        whole = token_logprobs(logits, response_ids, 0.7)
    torch.testing.assert_close(logp.detach() * mask, allowed * mask, rtol=1e-5, atol=1e-5)
    gap = (allowed - whole)[mask.bool()]  # log(1 / (1 - p(forbidden))) > 0 at every token
    assert (gap > 1e-4).all(), gap


def _short_answer_run(model_dir, processor, seed, trainer_forbids, steps=40):
    """GRPO for `steps` steps on a reward for short answers: token-mean loss, one Adam step (lr 1e-3) a batch of two
    prompts x 8 answers of at most 16 tokens, sampled by the HF engine, which forbids the vision tokens whatever the
    trainer does. An answer ends at any of 20 ordinary tokens (about 5 % of a random model's mass at each position: its
    lengths vary from the first step, where its end-of-answer token would almost never come). With
    trainer_forbids=False the trainer's forward runs over the whole vocabulary. Returns the vision tokens' mean mass,
    over the whole vocabulary at the answer positions, of the first batch before training and of the last after."""
    import train_grpo
    from grpo.samples import SamplingParams
    from tests.hf_engine_check import hf_engine

    torch.manual_seed(seed)
    model = loading.load_model(model_dir, torch.device("cpu"), "sdpa")
    forbidden, n = model.forbidden_token_ids, 8
    engine = hf_engine(processor, 16)
    engine.sync_weights(model)
    if not trainer_forbids:
        model.forbidden_token_ids = forbidden[:0]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    tokenizer, params = processor.tokenizer, SamplingParams(max_tokens=16, stop_token_ids=tuple(range(20)))
    chats = [[{"role": "user", "content": [{"type": "text", "text": "Say it. " * i}]}] for i in (1, 2)]
    texts = [processor.apply_chat_template(chat, add_generation_prompt=True) for chat in chats]
    prompts = [rollout.Prompt(tokenizer(t, return_tensors="pt")["input_ids"][0], None, None, []) for t in texts]

    def vision_mass(batch, response_ids, mask):
        with torch.no_grad():
            logits = model(**batch, use_cache=False, logits_to_keep=response_ids.shape[1] + 1).logits[:, :-1]
        mass = logits.float().softmax(-1)[..., forbidden].sum(-1)  # (B, T)
        return float((mass * mask).sum() / mask.sum())

    for step in range(steps):
        samples = engine.generate(prompts, n, params, seed=1000 * seed + step)
        answers = [s.response_ids for s in samples]
        batch, response_ids, mask = batching.collate(
            [prompts[s.prompt_index] for s in samples], answers, tokenizer.pad_token_id, model.config.image_token_id
        )
        if step == 0:
            before = vision_mass(batch, response_ids, mask)
        scores = -torch.tensor([len(a) for a in answers], dtype=torch.float32)  # (B,): the shorter the better
        advantages = train_grpo.compute_advantages(scores, n).unsqueeze(1)  # (B, 1)
        logp, _ = logprobs.forward_logprobs(model, batch, response_ids, 1.0)
        loss, _ = train_grpo.micro_batch_loss(logp, logp.detach(), advantages, mask, torch.zeros_like(logp),
                                              num_tokens=mask.sum(), num_seqs=len(answers), horizon=16)  # fmt: skip
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return before, vision_mass(batch, response_ids, mask)


def test_the_vision_tokens_mass_stays_put_under_a_short_answer_reward(tiny_model_dir, tiny_processor):
    """Guards against the drift a softmax over the whole vocabulary lets happen: with a reward for short answers and a
    token-mean loss the long answers' tokens outweigh the short ones', the advantages summed over the tokens are below
    0, and a whole-vocabulary softmax hands what every sampled token loses to the tokens nothing samples, the vision
    tokens among them, which nothing then pushes back down. The same 40 steps (seed 1) with the trainer's softmax over
    the whole vocabulary, the engine still forbidding the tokens, show the test can fail. Measured at seeds 1-3: the
    vision tokens' mass starts at 0.0125; with the mask it ends at 0.0035-0.0044 (0.28-0.35x: the 20 ending tokens
    take mass from every other), without it at 0.34-0.41 (27-33x)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (16 x 128 rows: a second thread adds only its waits, ten-fold on a busy machine)
    try:
        before, forbidding = _short_answer_run(tiny_model_dir, tiny_processor, 1, trainer_forbids=True)
        _, whole = _short_answer_run(tiny_model_dir, tiny_processor, 1, trainer_forbids=False)
    finally:
        torch.set_num_threads(threads)
    assert 0.1 * before < forbidding <= before, (before, forbidding)
    assert whole > 10 * before, (before, whole)
