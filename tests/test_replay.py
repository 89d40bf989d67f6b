"""Routing replay (replay.py, algorithm.routing_replay=r3) on the tiny MoE models: the trainer routes each token as
the engine recorded, in both layouts, with the router still learning; and the engines' records."""

import types

import numpy as np
import pytest
import torch
from transformers import AutoProcessor

from grpo import batching, loading, logprobs, moe, replay, routing
from tests.launch import spawn_ranks
from tests.test_moe import ROUTED_FAMILIES, routed_batch, router_params
from tests.test_packing import _mixed_batch


def _perturbed_engine(model, scale, seed=0):
    """The engine's routers as a stand-in: the same logits, but the top-k chosen after a small fixed per-expert bias
    (as another kernel's rounding tips near ties), combined as the family's router combines (softmax over the chosen
    k of the unbiased logits; Gemma 4's, whose router returns the probabilities, then times each chosen expert's
    per_expert_scale). Returns (chosen per layer, flips per layer), appended per call, and the hooks."""
    g = torch.Generator().manual_seed(seed)
    c = model.config.get_text_config()
    chosen, flips, handles = [], [], []
    for router in moe.routers(model):
        bias = scale * torch.randn(c.num_experts, generator=g)
        rows, flipped = [], []

        def hook(m, args, out, bias=bias, rows=rows, flipped=flipped):
            first, own_weights, own = out
            gemma = hasattr(m, "per_expert_scale")
            logits = first.float().log() if gemma else first.float()  # (N, E), up to a constant per row
            pick = (logits + bias).topk(own.shape[1], dim=-1).indices  # (N, k)
            w = torch.softmax(logits, -1).gather(-1, pick)
            w = w / w.sum(-1, keepdim=True)
            if gemma:
                w = w * m.per_expert_scale[pick]
            rows.append(pick)
            flipped.append((pick.sort(-1).values != own.sort(-1).values).any(-1))
            return first, w.to(own_weights.dtype), pick

        chosen.append(rows)
        flips.append(flipped)
        handles.append(router.register_forward_hook(hook))
    return chosen, flips, handles


def _per_sample(full, mask):
    """(B * L, layers, k) of a padded batch -> each sequence's (P + R, layers, k), its pads dropped."""
    full = full.view(*mask.shape, *full.shape[1:])
    return [full[i][mask[i].bool()] for i in range(len(mask))]


@pytest.mark.parametrize("family", ROUTED_FAMILIES)
def test_replay_closes_the_gap_of_perturbed_engine_routers(tiny_family_dir, family):
    """Guards against a replay that routes some tokens otherwise than the record (layouts that misplace the routes:
    left pads, packed sequences, a shared prompt's routes once for its group; vision tokens), or that combines the
    experts with other weights than the engine's function of the logits. An engine whose routers choose after a small
    bias (a known share of near-tied (token, layer) pairs flips) gives log-probs off the trainer's; replayed, the
    trainer's log-probs equal the engine's as they do where nothing is perturbed (the dense level: the same weights and
    kernels here, gap 0), its routers' choices equal the record token for token, and moe/routing_disagreement is the
    engine's flip share exactly. Gemma 4's router returns probabilities and weighs each expert by its per_expert_scale
    (the tiny model's drawn away from 1): a replay that took their softmax again or left the scale out would miss the
    engine's log-probs."""
    path = tiny_family_dir(family)
    processor = AutoProcessor.from_pretrained(path)
    model = loading.load_model(path, torch.device("cpu"), "sdpa")
    pad_id, image_token_id = processor.tokenizer.pad_token_id, model.config.image_token_id
    prompts, responses = routed_batch(family, processor, image_token_id)
    if len(prompts) == 2:  # Gemma 4's batch: a third answer, for the second answer to the image prompt
        responses = [*responses, responses[0][::-1]]
    prompts = [prompts[0], prompts[0], *prompts[1 : len(responses) - 1]]  # two answers to one image prompt: a group
    inputs, response_ids, mask = batching.collate(prompts, responses, pad_id, image_token_id)
    real = inputs["attention_mask"]  # (B, L)
    with torch.no_grad():
        trainer = logprobs.forward_logprobs(model, inputs, response_ids, 1.0)[0] * mask
        # (the tiny Gemma 4's router logits lie closer together: a tenth of the bias tips a like share)
        chosen, flips, handles = _perturbed_engine(model, scale=0.005 if family == "gemma4_moe" else 0.05)
        engine = logprobs.forward_logprobs(model, inputs, response_ids, 1.0)[0] * mask
        for h in handles:
            h.remove()
    recorded = torch.stack([torch.cat(rows) for rows in chosen], 1)  # (B * L, layers, k)
    share = torch.stack([torch.cat(f) for f in flips], 1)[real.flatten().bool()].double().mean().item()
    assert 0.02 < share < 0.5, share  # some near ties tipped, not all
    assert (engine - trainer).abs().max() > 1e-3  # flipped routes move log-probs far past the rounding
    routes = [r.to(torch.int8) for r in _per_sample(recorded, real)]
    routes[1][: len(prompts[1].input_ids)] = routes[0][: len(prompts[0].input_ids)]  # (one prefill for the group)

    seen, handles = routing.record(moe.routers(model), lambda out: out[2])
    layouts = {
        "padded": batching.collate(prompts, responses, pad_id, image_token_id, routes=routes),
        "packed": batching.pack(prompts, responses, image_token_id, share_prompts=True, routes=routes),
    }
    for name, (batch, ids, m) in layouts.items():
        for rows in seen:
            rows.clear()
        logp = logprobs.forward_logprobs(model, batch, ids, 1.0)[0] * m  # with gradients: the update's forward
        torch.testing.assert_close(logp.detach(), engine, rtol=0, atol=1e-5, msg=name)
        replayed = torch.stack([torch.cat(rows) for rows in seen], 1)  # (N, layers, k): what the routers returned
        want = batch["routes"].long()
        has = (want >= 0).all(-1).all(-1)
        assert has.sum() == sum(len(r) for r in routes) - (len(prompts[1].input_ids) if name == "packed" else 0)
        assert torch.equal(replayed[has], want[has]), name
        stats = replay.step_metrics(model, [types.SimpleNamespace(routes=r) for r in routes])
        assert stats["moe/routing_disagreement"] == pytest.approx(share, abs=1e-9 if name == "padded" else 0.02)
        assert stats["moe/replayed_tokens"] == sum(len(r) for r in routes)
    for h in handles:
        h.remove()
    replay.clear(model)
    with torch.no_grad():  # lifted: the model routes by its own routers again
        torch.testing.assert_close(logprobs.forward_logprobs(model, inputs, response_ids, 1.0)[0] * mask, trainer)


@pytest.mark.parametrize("family", ROUTED_FAMILIES)
def test_gradients_reach_the_router_under_replay(tiny_family_dir, family):
    """Guards against a replay whose combine weights are detached from the router's logits (the router would stop
    learning), or that weighs the experts otherwise than the family's router: replaying the trainer's own routes
    gives the loss and every gradient of no replay, and replaying other routes still gives every router a gradient.
    A record of another model (a distillation teacher's forward given the student's routes) stops the forward."""
    path = tiny_family_dir(family)
    processor = AutoProcessor.from_pretrained(path)
    model = loading.load_model(path, torch.device("cpu"), "sdpa")
    image_token_id = model.config.image_token_id
    prompts, responses = routed_batch(family, processor, image_token_id)
    plain = batching.pack(prompts, responses, image_token_id)
    with torch.no_grad():
        own, _ = routing.trainer_routing(model, prompts, responses, processor.tokenizer.pad_token_id)
    flipped = [r.flip(-1) if i % 2 else (r + 1) % model.config.get_text_config().num_experts
               for i, r in enumerate(own)]  # fmt: skip
    grads = {}
    for name, routes in (("none", None), ("own", own), ("other", flipped)):
        model.zero_grad(set_to_none=True)
        inputs, ids, mask = batching.pack(prompts, responses, image_token_id, routes=routes) if routes else plain
        logp, _ = logprobs.forward_logprobs(model, inputs, ids, 1.0)
        (logp * mask).sum().backward()
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    routers = router_params(model)  # Qwen's gate; Gemma 4's proj, scale and per_expert_scale
    assert len(routers) == model.config.get_text_config().num_hidden_layers * (3 if family == "gemma4_moe" else 1)
    for n in grads["none"]:
        torch.testing.assert_close(grads["own"][n], grads["none"][n], rtol=1e-5, atol=1e-6, msg=n)
    for n in routers:
        assert grads["other"][n].abs().sum() > 0, n
        assert not torch.allclose(grads["other"][n], grads["none"][n]), n
    inputs, ids, _ = batching.pack(prompts, responses, image_token_id, routes=[r[:, :1] for r in own])
    with pytest.raises(RuntimeError, match="recorded of another model"):  # a record of fewer MoE layers than here
        logprobs.forward_logprobs(model, inputs, ids, 1.0)


def test_routes_of_a_generate_call_and_of_a_vllm_completion():
    """Guards against an engine record shifted by a position (the prefill's left pads, the answer's first token
    being the prefill's output, not its input), or a record of another length than prompt + answer: hand-made
    calls in HF generate's order, and a completion of vLLM's shape ([prompt + answer - 1, layers, top_k], as
    CompletionOutput.routed_experts in 0.26 to 0.33)."""
    width, k = 4, 2

    # two rows, prompts of 3 and 4 tokens left-padded to 4, answers of 3 and 1 tokens, two decode steps after the
    # prefill; each layer's entry of a token = 100 * layer + 10 * row + column
    def value(layer, row, col):
        return torch.tensor([100 * layer + 10 * row + col] * k)

    rows = []
    for layer in range(2):
        prefill = torch.stack([value(layer, r, c) for r in range(2) for c in range(width)])  # (2 * width, k)
        steps = [torch.stack([value(layer, r, width + s) for r in range(2)]) for s in range(2)]  # (2, k) each
        rows.append([prefill, *steps])
    out = replay.generate_routes(rows, [3, 4], width, [3, 1], torch.int16)
    assert [tuple(r.shape) for r in out] == [(6, 2, k), (5, 2, k)]
    assert out[0][:, 1, 0].tolist() == [101, 102, 103, 104, 105, replay.NO_ROUTE]
    assert out[1][:, 0, 0].tolist() == [10, 11, 12, 13, replay.NO_ROUTE]
    captured = types.SimpleNamespace(routed_experts=np.arange(5 * 2 * k).reshape(5, 2, k))
    record = replay.completion_routes(captured, 6, torch.int8)
    assert record.dtype == torch.int8 and record.shape == (6, 2, k)
    assert record[:5].flatten().tolist() == list(range(20)) and (record[5] == replay.NO_ROUTE).all()
    assert replay.completion_routes(types.SimpleNamespace(routed_experts=None), 6, torch.int8) is None
    with pytest.raises(RuntimeError, match="for a sequence of 4 tokens"):
        replay.completion_routes(captured, 4, torch.int8)
    assert replay.route_dtype(129) == torch.int16 and replay.route_dtype(128) == torch.int8


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "gemma4_moe"])
def test_vllm_capture_gives_each_sample_its_routes_and_records_the_rest(tiny_family_dir, monkeypatch, family):
    """Guards against the vLLM capture branch (CUDA: 0.26's V1 runner, or 0.32/0.33 under Model Runner V2) reading
    the routes of another completion or of the wrong length, and against answers assembled outside generate (tool
    turns, carried answers) left without a record: vLLM's own CompletionOutput and RequestOutput (the installed
    version's signature) from a stand-in LLM, each completion's routes filled with its index. And which versions
    capture: only on CUDA, and 0.32/0.33 (AuxOutputConfig) only under VLLM_USE_V2_MODEL_RUNNER=1. Gemma 4's text
    config names its top-k top_k_experts, not num_experts_per_tok."""
    import vllm.config
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    from grpo import vllm_compat
    from grpo.samples import Prompt, SamplingParams
    from grpo.vllm_engine import VLLMEngine

    layers, k = 2, 2
    calls = []

    class LLM:
        def generate(self, requests, sampling, use_tqdm=False):
            outs = []
            for i, (request, params) in enumerate(zip(requests, sampling)):
                ids, completions = request["prompt_token_ids"], []
                calls.append(params.max_tokens)
                for j in range(params.n):
                    answer = [7 + j] * params.max_tokens
                    routed = np.full((len(ids) + len(answer) - 1, layers, k), j, dtype=np.int16)
                    completions.append(CompletionOutput(
                        index=j, text="", token_ids=answer, cumulative_logprob=None,
                        logprobs=[{t: Logprob(-1.0)} for t in answer], routed_experts=routed, finish_reason="length",
                    ))  # fmt: skip
                outs.append(RequestOutput(request_id=str(i), prompt=None, prompt_token_ids=ids, prompt_logprobs=None,
                                          outputs=completions, finished=True))  # fmt: skip
            return outs

    processor = AutoProcessor.from_pretrained(tiny_family_dir(family))
    engine = object.__new__(VLLMEngine)
    engine.llm, engine.tokenizer, engine.tp_group, engine.offload, engine.asleep = (
        LLM(),
        processor.tokenizer,
        None,
        None,
        set(),
    )
    engine.image_token_id, engine.max_images, engine.max_videos, engine.clip_metadata = 0, 0, 0, False
    engine.logit_bias, engine.capture_routes, engine.route_dtype = {}, True, torch.int8
    prompts = [Prompt(torch.tensor(ids), None, None, []) for ids in ([1, 2, 3], [4, 5, 6, 7, 8])]
    samples = engine.generate(prompts, 2, SamplingParams(max_tokens=3), seed=0)
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1]
    for s in samples:
        length = len(prompts[s.prompt_index].input_ids) + 3
        assert s.routes.dtype == torch.int8 and s.routes.shape == (length, layers, k)
        assert (s.routes[:-1] == s.response_ids[0] - 7).all() and (s.routes[-1] == replay.NO_ROUTE).all()

    samples[1].routes = samples[2].routes = None  # as a tool turn's or a carried answer's: assembled afterwards
    top_k = {"top_k_experts" if family == "gemma4_moe" else "num_experts_per_tok": k}
    config = types.SimpleNamespace(get_text_config=lambda: types.SimpleNamespace(**top_k, num_experts=4))
    tools = types.SimpleNamespace(engine=engine)  # the tool loop's wrapper: plain requests go to its engine
    assert routing.record_routes(tools, types.SimpleNamespace(config=config), prompts, samples) == 2
    assert calls[-2:] == [1, 1]  # one-token requests: prompt + answer prefilled, every token forwarded
    for s in samples[1:3]:
        assert s.routes.shape == (len(prompts[s.prompt_index].input_ids) + 3, layers, k) and (s.routes >= 0).all()

    assert not vllm_compat.captures_routes(on_cuda=False)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert vllm_compat.captures_routes(on_cuda=True) is not hasattr(vllm.config, "AuxOutputConfig")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert vllm_compat.captures_routes(on_cuda=True)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    monkeypatch.delattr(vllm.config, "AuxOutputConfig", raising=False)  # 0.26: the V1 runner captures
    assert vllm_compat.captures_routes(on_cuda=True)


def test_replay_under_model_runner_v2_and_tensor_parallelism_takes_the_hooks_or_stops_at_the_check(monkeypatch):
    """Guards against a first step that stops on every rank but the first: vLLM 0.32/0.33 (AuxOutputConfig) capture
    the routes in Model Runner V2 on the first TP rank's worker only, and under the external launcher each rank's
    scheduler asserts its requests' routes are there. At TP 2 the engine reads them by its routers' hooks instead, and
    with CUDA graphs on (which do not run hooks) the config check, the dry run's, stops naming the keys. On 0.26
    (no AuxOutputConfig) the V1 runner's capture is kept."""
    import vllm.config

    from grpo import vllm_compat
    from grpo.config import ConfigError
    from train_grpo import check_config, load_config

    def config(*extra):
        return load_config(None, ["rollout.engine=vllm", "algorithm.routing_replay=r3", "actor.global_batch_size=8",
                                  "data.rollout_batch_size=8", *extra])  # fmt: skip

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    monkeypatch.setattr(vllm.config, "AuxOutputConfig", getattr(vllm.config, "AuxOutputConfig", object), raising=False)
    assert vllm_compat.captures_routes(on_cuda=True, tensor_parallel_size=1)
    assert not vllm_compat.captures_routes(on_cuda=True, tensor_parallel_size=2)
    with pytest.raises(ConfigError) as stop:
        check_config(config("rollout.tensor_parallel_size=2"), world_size=2)
    for key in ("algorithm.routing_replay=r3", "rollout.tensor_parallel_size=2", "VLLM_USE_V2_MODEL_RUNNER=1",
                "rollout.enforce_eager=true"):  # fmt: skip
        assert key in str(stop.value)
    check_config(config("rollout.tensor_parallel_size=2", "rollout.enforce_eager=true"), world_size=2)  # the hooks
    check_config(config("rollout.tensor_parallel_size=1"), world_size=2)  # vLLM's capture on the only rank
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # V1: no capture; vllm_engine asks for eager at start
    check_config(config("rollout.tensor_parallel_size=2"), world_size=2)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    monkeypatch.delattr(vllm.config, "AuxOutputConfig")  # 0.26: its V1 runner's capture
    assert vllm_compat.captures_routes(on_cuda=True, tensor_parallel_size=2)
    check_config(config("rollout.tensor_parallel_size=2"), world_size=2)


def test_hf_engine_records_the_routes_of_its_generate(tiny_family_dir):
    """Guards against the HF engine's record shifted against its tokens (the left pads of a batch's prompts, the
    decode steps after the prefill, rows that finished early and go on stepping): the routes it records while
    generating (with images, answers of different lengths) are those one forward of prompt + answer takes, token for
    token but each answer's last (never fed back: NO_ROUTE)."""
    from grpo.config import load_config
    from grpo.hf_engine import HFEngine
    from grpo.samples import SamplingParams
    from tests.hf_engine_check import image_prompts, tiny_policy

    path = tiny_family_dir("qwen3_vl_moe")
    processor = AutoProcessor.from_pretrained(path)
    model = tiny_policy(path, processor)
    engine = HFEngine(load_config(None, ["algorithm.routing_replay=r3"]), processor)
    engine.sync_weights(model)
    prompts = image_prompts(processor, 3)
    samples = engine.generate(prompts, 2, SamplingParams(temperature=1.0, max_tokens=12), seed=0)
    assert len({len(s.response_ids) for s in samples}) > 1  # answers that ended early beside longer ones
    chosen = [prompts[s.prompt_index] for s in samples]
    own, _ = routing.trainer_routing(model, chosen, [s.response_ids for s in samples], processor.tokenizer.pad_token_id)
    differ = total = 0
    for s, o in zip(samples, own, strict=True):
        assert s.routes.dtype == torch.int8 and s.routes.shape == o.shape
        assert (s.routes[-1] == replay.NO_ROUTE).all() and (s.routes[:-1] >= 0).all()
        differ += int((s.routes[:-1].long().sort(-1).values != o[:-1].sort(-1).values).any(-1).sum())
        total += o[:-1].shape[0] * o.shape[1]
    assert differ <= 0.01 * total, (differ, total)  # a near tie may tip between a decode step and one forward


def _hf_routing_on_two_ranks(rank, path, out):
    """Rank 0 records the routes of two image prompts' answers, rank 1 has none to record (its answers came whole
    from generate), on one FSDP2-sharded model."""
    import torch.distributed as dist

    processor = AutoProcessor.from_pretrained(path)
    model = loading.load_model(path, torch.device("cpu"), "sdpa")
    loading.apply_fsdp(model, torch.device("cpu"))
    loading.root_forward(model, processor.tokenizer.pad_token_id)
    prompts, responses = _mixed_batch(processor, model.config.image_token_id)
    mine = ([prompts[0], prompts[2]], [responses[0], responses[2]]) if rank == 0 else ([], [])
    out[rank] = routing.hf_routing(model, *mine)
    dist.barrier()


def test_hf_routing_joins_the_forward_on_a_rank_without_samples(tiny_family_dir):
    """Guards against the HF engine's routing replay stopping (or hanging) when one rank has answers to record (a
    tool turn, a carried answer) and another has none: FSDP2's forward is a collective every rank must join, so the
    rank without runs a filler sequence and returns nothing, and the rank with gets the routes one unsharded forward
    gives."""
    import torch.multiprocessing as mp

    path = tiny_family_dir("qwen3_vl_moe")
    out = mp.Manager().dict()
    spawn_ranks(_hf_routing_on_two_ranks, path, out)
    assert out[1] == []
    processor = AutoProcessor.from_pretrained(path)
    model = loading.load_model(path, torch.device("cpu"), "sdpa")
    prompts, responses = _mixed_batch(processor, model.config.image_token_id)
    want = routing.hf_routing(model, [prompts[0], prompts[2]], [responses[0], responses[2]])
    assert len(out[0]) == 2
    for got, w in zip(out[0], want, strict=True):
        assert got.shape == w.shape and torch.equal(got.sort(-1).values, w.sort(-1).values)
