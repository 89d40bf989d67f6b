"""The HF rollout engine at scale: no full-vocabulary logits kept while decoding, log-probs from one forward per
generate call, at most rollout.max_num_seqs sequences per call, and ranks that hold different numbers of prompts."""

import gc
import json

import pytest
import torch

import rollout
from grpo import batching, logprobs
from grpo.hf_engine import chunk_seed
from tests.hf_engine_check import count_generate_calls, hf_engine, image_prompts, tiny_policy
from tests.launch import torchrun


def _old_generate_logprobs(engine, model, prompts, n, params, seed):
    """What the engine did before: one generate call for all prompts with num_return_sequences=n and
    output_logits=True, log-probs from the kept per-step logits over the tokens it may sample. Returns sequences
    (B*n, R) and log-probs (B*n, R)."""
    from transformers import GenerationConfig

    inputs, _, _ = batching.collate(prompts, [[] for _ in prompts], engine.pad_id, engine.image_token_id)
    gen_cfg = GenerationConfig(
        do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0, max_new_tokens=params.max_tokens,
        num_return_sequences=n, eos_token_id=sorted(engine.eos_ids), pad_token_id=engine.pad_id,
        suppress_tokens=engine.forbidden, output_logits=True, return_dict_in_generate=True, use_cache=True,
    )  # fmt: skip
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**inputs, generation_config=gen_cfg)
    generated = out.sequences[:, inputs["input_ids"].shape[1] :]  # (B*n, R)
    logits = torch.stack(out.logits, dim=1).float() / params.temperature  # (B*n, R, V)
    logits[..., engine.forbidden] = float("-inf")  # what generate samples from: suppress_tokens leaves them out
    return generated, logits.log_softmax(-1).gather(-1, generated[..., None])[..., 0]  # (B*n, R)


def test_logprobs_equal_a_forward_and_the_old_generate_logits(tiny_model_dir, tiny_processor):
    """Guards against log-probs of the wrong token or position (one off after the prompt, a pad scored, the
    temperature left out), answers not cut after their first end-of-sequence token, samples attached to the wrong
    prompt, and a batch that fits one call sampling something other than what the engine sampled before it stopped
    keeping logits (same seed, same tokens; log-probs then from a full forward instead of the KV-cached steps)."""
    model = tiny_policy(tiny_model_dir, tiny_processor)
    engine = hf_engine(tiny_processor, max_num_seqs=256)
    engine.sync_weights(model)
    prompts, n, params = image_prompts(tiny_processor, 3), 3, rollout.SamplingParams(0.7, 1.0, 12)
    samples = engine.generate(prompts, n, params, seed=5)

    assert [s.prompt_index for s in samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert {s.truncated for s in samples} == {True, False}  # both kinds of answer occur
    for s in samples:
        ends = [t for t, tok in enumerate(s.response_ids) if tok in engine.eos_ids]
        assert ends == ([] if s.truncated else [len(s.response_ids) - 1])
        assert len(s.logprobs) == len(s.response_ids) and (len(s.response_ids) == 12 or not s.truncated)

    # the same samples scored separately, in the padded layout (the engine scores them packed)
    batch, response_ids, mask = batching.collate(
        [prompts[s.prompt_index] for s in samples], [s.response_ids for s in samples], engine.pad_id,
        engine.image_token_id,
    )  # fmt: skip
    with torch.no_grad():
        logp = logprobs.forward_logprobs(model, batch, response_ids, params.temperature)[0]  # (B*n, T)
    got = torch.zeros_like(logp)
    for row, s in enumerate(samples):
        got[row, : len(s.logprobs)] = torch.tensor(s.logprobs)
    torch.testing.assert_close(got, logp * mask, rtol=0, atol=1e-5)

    generated, old_logp = _old_generate_logprobs(engine, model, prompts, n, params, seed=5)
    for row, s in enumerate(samples):
        assert generated[row, : len(s.response_ids)].tolist() == s.response_ids
        torch.testing.assert_close(torch.tensor(s.logprobs), old_logp[row, : len(s.logprobs)], rtol=0, atol=1e-4)


def _vocab_sized_tensors(vocab):
    """Live plain tensors (not parameters) whose last dimension is the vocabulary: logits or scores of some step."""
    gc.collect()
    return [o for o in gc.get_objects() if type(o) is torch.Tensor and o.dim() >= 2 and o.shape[-1] == vocab]


def test_generate_keeps_no_vocab_sized_tensor(tiny_model_dir, tiny_processor):
    """Guards against output_logits / output_scores coming back: generate then keeps one fp32 (rows, vocab) tensor
    per decode step until it returns, 0.6 MB a row and step for Qwen (400 GB for a rank's 320 answers of 2,048
    tokens). Checked where it would show: right after generate returns, while its output is still held. The same
    check run on the old call sees the kept logits, so it is able to fail."""
    model = tiny_policy(tiny_model_dir, tiny_processor)
    vocab = model.config.text_config.vocab_size
    engine = hf_engine(tiny_processor, max_num_seqs=256)
    engine.sync_weights(model)
    prompts, params = image_prompts(tiny_processor, 2), rollout.SamplingParams(1.0, 1.0, 6)
    seen, generate = [], model.generate

    def checked(**kwargs):
        out = generate(**kwargs)
        seen.append((type(out), len(_vocab_sized_tensors(vocab))))
        return out

    model.generate = checked
    engine.generate(prompts, 4, params, seed=0)
    assert seen == [(torch.Tensor, 0)]  # one call, token ids only, nothing of the vocabulary's size alive

    generated, _ = _old_generate_logprobs(engine, model, prompts, 4, params, seed=0)
    assert seen[1][1] >= generated.shape[1]  # the old call: one kept (rows, vocab) tensor per decode step


def test_chunks_are_bounded_ordered_and_reproducible(tiny_model_dir, tiny_processor):
    """Guards against a chunk over rollout.max_num_seqs, answers returned out of prompt-major order or attached to
    the wrong prompt once a prompt's n answers span two calls (greedy answers must equal the unchunked ones), a
    seed that does not reproduce the samples (a resumed run would diverge), and every chunk reusing one seed (one
    prompt split over n calls would then get n identical answers: zero advantage)."""
    model = tiny_policy(tiny_model_dir, tiny_processor)
    prompts = image_prompts(tiny_processor, 3)
    whole, chunked = hf_engine(tiny_processor, max_num_seqs=256), hf_engine(tiny_processor, max_num_seqs=2)
    whole.sync_weights(model)
    chunked.sync_weights(model)
    calls = count_generate_calls(model)

    greedy = rollout.SamplingParams(0.0, 1.0, 8)
    want = whole.generate(prompts, 3, greedy, seed=0)
    assert calls == [9]
    calls.clear()
    got = chunked.generate(prompts, 3, greedy, seed=0)
    assert calls == [2, 2, 2, 2, 1]
    assert [s.prompt_index for s in got] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for g, w in zip(got, want, strict=True):
        assert (g.prompt_index, g.response_ids, g.truncated) == (w.prompt_index, w.response_ids, w.truncated)
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-5)

    sampled = rollout.SamplingParams(1.0, 1.0, 8)
    first = [s.response_ids for s in chunked.generate(prompts, 3, sampled, seed=3)]
    assert first == [s.response_ids for s in chunked.generate(prompts, 3, sampled, seed=3)]
    assert first != [s.response_ids for s in chunked.generate(prompts, 3, sampled, seed=4)]
    one_per_call = hf_engine(tiny_processor, max_num_seqs=1)
    one_per_call.sync_weights(model)
    answers = [tuple(s.response_ids) for s in one_per_call.generate(prompts[:1], 4, sampled, seed=3)]
    assert len(set(answers)) > 1, answers
    assert chunk_seed(3, 0) == 3 and len({chunk_seed(3, k) for k in range(4)}) == 4

    with pytest.raises(ValueError, match="max_num_seqs"):
        hf_engine(tiny_processor, max_num_seqs=0)


def test_two_ranks_with_unequal_prompts_and_chunks(tiny_model_dir, tiny_processor, tmp_path):
    """Guards against a hang or crash under FSDP2 when ranks need different numbers of generate calls (every call
    and every log-prob forward is a collective), including a rank with no prompt at all, and against a filler
    call's answers leaking into a rank's samples. The greedy answers must equal the unsharded model's, and the
    sampled answers' log-probs a single-process forward of them."""
    out = tmp_path / "out.json"
    torchrun(2, "tests/hf_engine_check.py", tiny_model_dir, str(out))
    ranks = json.loads(out.read_text())
    assert ranks[0]["calls"] == [2, 2, 2] * 3
    assert ranks[1]["calls"] == [2, 1, 1] * 2 + [1, 1, 1]  # its own call, then fillers of one sequence
    assert ranks[1]["empty"] == []

    model = tiny_policy(tiny_model_dir, tiny_processor)
    engine = hf_engine(tiny_processor, max_num_seqs=256)
    engine.sync_weights(model)
    prompts = image_prompts(tiny_processor, 4)
    held = [prompts[:3], prompts[3:]]
    greedy = rollout.SamplingParams(0.0, 1.0, 8)
    for rank, mine in enumerate(held):
        want = engine.generate(mine, 2, greedy, seed=0)
        for name in ("greedy", "empty") if rank == 0 else ("greedy",):
            got = ranks[rank][name]
            assert [g[0] for g in got] == [w.prompt_index for w in want]
            for (_, ids, logp, truncated), w in zip(got, want, strict=True):
                assert (ids, truncated) == (w.response_ids, w.truncated)
                torch.testing.assert_close(torch.tensor(logp), torch.tensor(w.logprobs), rtol=0, atol=1e-5)
        sampled = ranks[rank]["sampled"]
        assert [s[0] for s in sampled] == [i for i in range(len(mine)) for _ in range(2)]
        batch, response_ids, _ = batching.pack([mine[s[0]] for s in sampled], [s[1] for s in sampled],
                                                 engine.image_token_id)  # fmt: skip
        with torch.no_grad():
            logp = logprobs.forward_logprobs(model, batch, response_ids, 1.0)[0]  # (B, T)
        for row, s in enumerate(sampled):
            torch.testing.assert_close(torch.tensor(s[2]), logp[row, : len(s[1])], rtol=0, atol=1e-5)
