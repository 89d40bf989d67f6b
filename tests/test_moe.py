"""Mixture-of-experts families (moe.py): the experts' checkpoint layouts, read a rank's rows at a time, and the
experts' compute, the CUDA grouped-GEMM path included, run on CPU with the kernel swapped for a reference of its
signature (as tests/test_varlen.py does for the attention kernel)."""

import inspect

import pytest
import torch
from safetensors import safe_open

from grpo import batching, loading, logprobs, moe
from grpo.config import ActorConfig
from tests.test_packing import _mixed_batch

MOE_FAMILIES = ["qwen3_vl_moe", "qwen3_5_moe"]
# the families whose routers the load-balancing loss and routing replay hook: Qwen's and Gemma 4's 26B-A4B's
ROUTED_FAMILIES = [*MOE_FAMILIES, "gemma4_moe"]


def routed_batch(family, processor, image_token_id):
    """Prompts with and without images, answers of uneven lengths, for `family` (Gemma 4's prompts carry no image
    grid, its own processor's keys instead)."""
    if family.startswith("gemma4"):
        from tests.test_families import _gemma4_batch

        return _gemma4_batch(processor)
    return _mixed_batch(processor, image_token_id)


def router_params(model) -> list[str]:
    """The names of the routers' own parameters (Qwen's gate weight; Gemma 4's proj, scale and per_expert_scale)."""
    names = [name for name, _ in model.named_modules() if moe.ROUTER.search(name)]
    return [n for n, _ in model.named_parameters() if any(n.startswith(f"{name}.") for name in names)]


@pytest.mark.parametrize("family, kind", [("qwen3_vl_moe", "transposed"), ("qwen3_5_moe", "per_expert")])
def test_a_ranks_experts_are_read_from_the_checkpoints_layout(tiny_family_dir, family, kind):
    """Guards against a sharded load that reads another rank's experts (FSDP2 shards dim 0, the experts), or a
    layout read untransposed, or a per-expert checkpoint's gate and up halves swapped: rows [start, stop) read from
    the files are those of from_pretrained's parameter, for every split of the experts over ranks."""
    from transformers import AutoModelForImageTextToText

    path = tiny_family_dir(family)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    file = loading._safetensors_files(path)[0]
    with safe_open(file, "pt") as f:
        shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}

    def read(key, start=None, stop=None):
        with safe_open(file, "pt") as f:
            return f.get_slice(key)[start:stop]

    experts = {n: p for n, p in model.named_parameters() if moe.EXPERT_PARAM.match(n)}
    assert len(experts) == 2 * model.config.text_config.num_hidden_layers
    for name, p in experts.items():
        assert p.shape[1] != p.shape[2]  # a transposed read could not pass for a square one
        assert moe.layout(name, p.shape, shapes) == kind
        assert moe.layout(name, (p.shape[0] + 1, *p.shape[1:]), shapes) is None  # another shape: not this tensor
        for start, stop in ((0, 4), (0, 2), (2, 4), (3, 4), (1, 3)):
            torch.testing.assert_close(moe.read_experts(name, kind, read, start, stop), p.detach()[start:stop])
        pieces = moe.export_pieces(name, kind, p.shape)
        assert {key: shape for key, shape, _ in pieces} == {key: shapes[key] for key, _, _ in pieces}
        for key, _, cut in pieces:
            torch.testing.assert_close(cut(p.detach()), read(key))


def test_experts_implementation_per_device(tiny_family_dir):
    """Guards against the Python loop over experts on a GPU (transformers' eager forward: two small GEMMs per expert
    with tokens, 128 experts a layer in the real models), or a kernel path on CPU."""
    assert moe.experts_implementation(torch.device("cuda", 0)) == "grouped_mm"
    assert moe.experts_implementation(torch.device("cpu")) == "eager"
    model = loading.load_model(tiny_family_dir("qwen3_vl_moe"), torch.device("cpu"), "sdpa", meta=True)
    assert model.model.language_model.config._experts_implementation == "eager"
    assert "forward eager" in moe.describe(model) and "top-2" in moe.describe(model)


def reference_grouped_mm(mat_a, mat_b, *, offs=None, bias=None, out_dtype=None):
    """torch.nn.functional.grouped_mm as transformers' grouped_mm experts call it (the signature of torch 2.11 to
    2.14): mat_a (S, K) the tokens sorted by expert, mat_b (E, K, N) every expert's weight, offs (E,) int32 the end of
    each expert's rows -> (S, N), one matmul per expert (CPU, any dtype). The asserts are what the CUDA kernel asks."""
    assert mat_a.dim() == 2 and mat_b.dim() == 3 and mat_a.shape[1] == mat_b.shape[1]
    assert offs is not None and offs.dtype == torch.int32 and offs.shape == (mat_b.shape[0],)
    assert bias is None and out_dtype is None and mat_a.dtype == mat_b.dtype
    ends = offs.tolist()
    assert ends == sorted(ends) and ends[-1] == mat_a.shape[0]
    # one of the weight's two inner dims contiguous, the other's stride 16-byte aligned in bf16: the kernel's layout
    # rule (the weight it gets is a transposed view of the parameter)
    inner = sorted(mat_b.stride()[1:])
    assert inner[0] == 1 and inner[1] % 8 == 0
    starts = [0, *ends[:-1]]
    return torch.cat([mat_a[s:e] @ mat_b[i] for i, (s, e) in enumerate(zip(starts, ends))])


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_grouped_mm_path_equals_the_loop(tiny_family_dir, family, monkeypatch):
    """Guards against the CUDA experts path computing something else than the loop the CPU lane trains with: tokens
    sorted to the wrong expert, offsets off by one, a transposed weight, gradients that do not reach the experts or
    the router. The packed micro-batch through grouped_mm (kernel swapped for its reference) against the padded one
    through the loop: log-probs and every gradient within 1e-5."""
    from transformers import AutoProcessor

    assert list(inspect.signature(torch.nn.functional.grouped_mm).parameters) == [
        "mat_a", "mat_b", "offs", "bias", "out_dtype"]  # fmt: skip
    calls = []

    def kernel(mat_a, mat_b, *, offs=None, bias=None, out_dtype=None):
        calls.append(mat_b.shape)
        return reference_grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)

    monkeypatch.setattr(torch.nn.functional, "grouped_mm", kernel)
    path = tiny_family_dir(family)
    processor = AutoProcessor.from_pretrained(path)
    model = loading.load_model(path, torch.device("cpu"), "sdpa")
    image_token_id = model.config.image_token_id
    prompts, responses = _mixed_batch(processor, image_token_id)
    padded = batching.collate(prompts, responses, processor.tokenizer.pad_token_id, image_token_id)
    packed = batching.pack(prompts, responses, image_token_id)
    results = {}
    for impl, (inputs, response_ids, mask) in (("eager", padded), ("grouped_mm", packed)):
        model.set_experts_implementation(impl)
        model.zero_grad(set_to_none=True)
        logp, ent = logprobs.forward_logprobs(model, inputs, response_ids, 0.9, True, True)
        ((logp * mask).sum() + 0.1 * (ent * mask).sum()).backward()
        results[impl] = (logp.detach() * mask, {n: p.grad.clone() for n, p in model.named_parameters()})
    layers = model.config.text_config.num_hidden_layers
    assert len(calls) == 2 * layers  # two projections a layer, one call each, in the grouped_mm forward only
    (logp_a, grads_a), (logp_b, grads_b) = results["eager"], results["grouped_mm"]
    torch.testing.assert_close(logp_b, logp_a, rtol=1e-5, atol=1e-5)
    assert any(".experts." in n for n in grads_a) and any("mlp.gate." in n for n in grads_a)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-5, msg=name)


def reference_balance(plain, inputs, family) -> torch.Tensor:
    """transformers' load-balancing loss of the plain model's forward of the padded `inputs`: its aux_loss, or for
    Gemma 4, for which transformers computes none, its load_balancing_loss_func of the router outputs the model
    records (output_router_logits: Gemma's routers' probabilities) as logits, their logs, whose softmax they are."""
    out = plain(**inputs, output_router_logits=True, use_cache=False)
    if not family.startswith("gemma4"):
        return out.aux_loss
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func

    c = plain.config.get_text_config()
    assert all(torch.allclose(p.sum(-1), torch.ones(len(p))) for p in out.router_logits)  # probabilities, not logits
    logits = tuple(p.log() for p in out.router_logits)
    return load_balancing_loss_func(logits, c.num_experts, c.top_k_experts, inputs["attention_mask"])


@pytest.mark.parametrize("family", ROUTED_FAMILIES)
def test_router_balance_loss_and_its_gradient_equal_transformers(tiny_family_dir, family, one_rank_group):
    """Guards the experts' load-balancing loss (actor.router_aux_loss_coef) against another formula than the models'
    own (transformers' load_balancing_loss_func), pads counted as tokens, a packed micro-batch balanced otherwise than
    its padded twin, and gradients lost or doubled on their way through FSDP2 and activation checkpointing (whose
    backward re-runs the routers' hooks). The trainer's model, sharded and checkpointed, against the plain model's
    output_router_logits: the loss and every gradient of log-probs + 10 x the loss within 1e-5. Gemma 4's routers
    return probabilities: a loss that took their softmax again, or found no router, would miss the reference."""
    from transformers import AutoProcessor

    path = tiny_family_dir(family)
    processor = AutoProcessor.from_pretrained(path)
    pad_id, cpu, coef = processor.tokenizer.pad_token_id, torch.device("cpu"), 10.0
    plain = loading.load_model(path, cpu, "sdpa")
    prompts, responses = routed_batch(family, processor, plain.config.image_token_id)
    padded = batching.collate(prompts, responses, pad_id, plain.config.image_token_id)
    packed = batching.pack(prompts, responses, plain.config.image_token_id)
    assert (padded[0]["attention_mask"] == 0).any()  # pads the loss must leave out

    inputs, response_ids, mask = padded
    logp, _ = logprobs.forward_logprobs(plain, inputs, response_ids, 1.0)
    reference = reference_balance(plain, inputs, family)
    ((logp * mask).sum() + coef * reference).backward()
    want = {n: p.grad.clone() for n, p in plain.named_parameters()}
    plain.zero_grad(set_to_none=True)  # how much of a router's gradient is the balance's: the log-probs' alone
    (logprobs.forward_logprobs(plain, inputs, response_ids, 1.0)[0] * mask).sum().backward()
    # (the routers' projections: Gemma's per_expert_scale weighs the experts' outputs, not the probabilities)
    balance_share = {n: (want[n] - p.grad).abs().max() for n, p in plain.named_parameters()
                     if "mlp.gate." in n or ".router.proj." in n}  # fmt: skip
    assert len(balance_share) == plain.config.get_text_config().num_hidden_layers

    # Gemma 4's gradients reach 140 (its tied embedding and head), and its sharded, checkpointed backward rounds them
    # by up to 2e-6 of a parameter's largest without the loss too: its bound scales with that largest
    scale = {n: max(1.0, w.abs().max().item()) if family.startswith("gemma4") else 1.0 for n, w in want.items()}

    model = loading.load_sharded(path, cpu, "sdpa", gradient_checkpointing=True)
    loading.root_forward(model, pad_id)
    balance = moe.RouterBalance(model)
    for inputs, response_ids, mask in (padded, packed):
        model.zero_grad(set_to_none=True)
        logp, _ = logprobs.forward_logprobs(model, inputs, response_ids, 1.0)
        aux = balance.loss()
        torch.testing.assert_close(aux, reference.detach(), rtol=1e-5, atol=1e-6)
        ((logp * mask).sum() + coef * aux).backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad.full_tensor(), want[name], rtol=1e-5, atol=1e-5 * scale[name], msg=name)
    assert min(balance_share.values()) > 1e-3, balance_share  # the balance does move every router
    with torch.no_grad():  # no-grad forwards (old/reference log-probs, generation) are not the update's
        logprobs.forward_logprobs(model, *packed[:2], 1.0)
    with pytest.raises(RuntimeError, match="no forward with gradients"):
        balance.loss()


def test_routing_disagreement_compares_sets_per_token_kind():
    """Guards against a routing measure that counts the same experts listed in another order as a mismatch, mixes
    the token kinds up, or counts the answer from the wrong end. Hand values: 2 layers, top-2."""
    from grpo import routing

    engine = torch.tensor([[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[1, 2], [0, 3]], [[1, 2], [0, 3]]])  # (L, layers, k)
    trainer = torch.tensor([[[1, 0], [3, 2]], [[0, 2], [2, 3]], [[2, 1], [0, 1]], [[1, 2], [3, 0]]])
    types = torch.tensor([0, 1, 0, 0])  # text, image, text, text; the last two the answer
    got = routing.disagreement([engine], [trainer], [types], [2])
    assert got == pytest.approx({"text": 1 / 6, "text_tokens": 3, "vision": 1 / 2, "vision_tokens": 1, "answer": 1 / 4,
                                 "answer_tokens": 2})  # fmt: skip


@pytest.mark.parametrize("family", ROUTED_FAMILIES)
def test_trainer_routing_is_each_sequences_own(tiny_family_dir, family):
    """Guards against the trainer's routing rows misplaced by the padded layout (left-padded prompts, right-padded
    answers) or a router that is not the one the experts follow: each sequence's rows in a padded batch are those
    of the sequence alone, one per token and layer, and the experts the hooks record are the top-k of the router's
    logits."""
    from transformers import AutoProcessor

    from grpo import routing

    path = tiny_family_dir(family)
    processor = AutoProcessor.from_pretrained(path)
    model = loading.load_model(path, torch.device("cpu"), "sdpa")
    prompts, answers = routed_batch(family, processor, model.config.image_token_id)
    pad_id = processor.tokenizer.pad_token_id
    rows, types = routing.trainer_routing(model, prompts, answers, pad_id)
    config = model.config.get_text_config()
    k = moe.top_k(config)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        alone, _ = routing.trainer_routing(model, [p], [a], pad_id)
        assert rows[i].shape == (len(p.input_ids) + len(a), config.num_hidden_layers, k)
        assert torch.equal(rows[i], alone[0])
        assert int((types[i] == 1).sum()) == int((p.input_ids == model.config.image_token_id).sum())
    # the engine's side takes the top-k of its router's logits: transformers' routers choose the same (Gemma 4's
    # return the probabilities, whose top-k is the logits')
    gaps, handles = routing.record(moe.routers(model), lambda out: out[2].sort(-1).values
                                   - out[0].topk(k, dim=-1).indices.sort(-1).values)  # fmt: skip
    routing.trainer_routing(model, prompts, answers, pad_id)
    for h in handles:
        h.remove()
    assert len(gaps) == config.num_hidden_layers and all(r and not any(g.any() for g in r) for r in gaps)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_adapters_merge_as_peft_does(tiny_family_dir, family, tmp_path, one_rank_group, monkeypatch):
    """Guards against LoRA on the routed experts (target `experts`, PEFT's ParamWrapper) that trains one thing and
    ships another: factors read in the wrong layout (PEFT's lora_B holds an expert's rank columns strided by E), an
    update transposed against transformers' (E, out, in) experts, adapters left random or untrained after the
    meta-device load and FSDP2, a sync or export that drops or misplaces them. With random nonzero adapters the
    merged weights (lora_delta, the sync's per-expert stream, save_hf's export in the checkpoint's layout) must be
    PEFT's own merge of the adapter it exports, and the plain model with them must give the adapted model's
    log-probs, through the eager loop and the grouped_mm path; the expert adapters get gradients, and switched off
    they leave the base."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoProcessor

    from grpo import checkpoint, lora

    path = tiny_family_dir(family)
    processor = AutoProcessor.from_pretrained(path)
    actor = ActorConfig(model_path=path, lora_rank=4, lora_target_modules=["q_proj", "experts"])
    model = loading.load_sharded(path, torch.device("cpu"), "sdpa", lora=lora.lora_config(actor))
    wrapped = {n: m for n, m in lora.lora_layers(model).items() if hasattr(m, "parameter_name")}
    layers = model.config.text_config.num_hidden_layers
    assert sorted(lora.base_name(n) + "." + m.parameter_name for n, m in wrapped.items()) == sorted(
        f"model.language_model.layers.{i}.mlp.experts.{p}" for i in range(layers) for p in moe.PARTS
    )
    assert all(p.requires_grad == lora.is_lora_factor(n) for n, p in model.named_parameters())
    assert all(not m.lora_B["default"].weight.full_tensor().any() for m in wrapped.values())  # B = 0 at init
    g = torch.Generator().manual_seed(0)
    for layer in lora.lora_layers(model).values():
        b = layer.lora_B[lora.LORA_ADAPTER].weight
        lora.copy_own_rows(b, torch.randn(b.shape, generator=g) * 0.3)

    prompts, responses = _mixed_batch(processor, model.config.image_token_id)
    inputs, ids, mask = batching.pack(prompts, responses, model.config.image_token_id)
    logp = logprobs.forward_logprobs(model, inputs, ids, 1.0)[0]
    (logp * mask).sum().backward()
    for layer in wrapped.values():
        for factor in (layer.lora_A, layer.lora_B):
            assert factor[lora.LORA_ADAPTER].weight.grad.full_tensor().abs().sum() > 0
    with torch.no_grad(), lora.adapters_disabled(model):
        ref_logp = logprobs.forward_logprobs(model, inputs, ids, 1.0)[0]
    with torch.no_grad():
        calls = []
        monkeypatch.setattr(
            torch.nn.functional, "grouped_mm", lambda *a, **k: [calls.append(1), reference_grouped_mm(*a, **k)][1]
        )
        model.set_experts_implementation("grouped_mm")
        grouped_logp = logprobs.forward_logprobs(model, inputs, ids, 1.0)[0]
        model.set_experts_implementation("eager")
    assert len(calls) == 2 * layers  # the adapted experts did go through grouped_mm
    loading.reshard(model)

    merged = {}  # the plain model's weights with the adapters merged, as the sync and the export compute them
    for name, p, layer in lora.merged_parameters(model):
        merged[name] = lora.full_tensor(p.detach()) + (lora.lora_delta(layer) if layer is not None else 0)
        if moe.EXPERT_PARAM.match(name):  # the sync's stream: each expert merged on its own
            assert layer is not None
            stream = dict(moe.stream_experts(name, p.detach(), torch.float32, lora.expert_deltas(layer)))
            for key, _, cut in moe.export_pieces(name, "per_expert", p.shape):
                torch.testing.assert_close(stream[key], cut(merged[name]), rtol=1e-6, atol=1e-6, msg=key)
    checkpoint.save_hf(model, processor, str(tmp_path / "hf"))
    checkpoint.save_adapter(model, str(tmp_path / "adapter"))

    plain = loading.load_model(path, torch.device("cpu"), "sdpa")
    base_logp = logprobs.forward_logprobs(plain, inputs, ids, 1.0)[0].detach()
    peft_merged = PeftModel.from_pretrained(plain, str(tmp_path / "adapter")).merge_and_unload()
    peft_state = peft_merged.state_dict()
    for name, t in merged.items():
        torch.testing.assert_close(peft_state[name], t, rtol=1e-6, atol=1e-6, msg=name)
    exported = loading.load_model(str(tmp_path / "hf"), torch.device("cpu"), "sdpa")
    assert load_file(f"{path}/model.safetensors").keys() == load_file(tmp_path / "hf/model.safetensors").keys()
    exported_logp = logprobs.forward_logprobs(exported, inputs, ids, 1.0)[0].detach()
    for other in (exported_logp, grouped_logp):
        torch.testing.assert_close(other * mask, logp.detach() * mask, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref_logp * mask, base_logp * mask, rtol=1e-6, atol=1e-6)
    assert ((logp.detach() - base_logp) * mask).abs().max() > 0.1  # the expert adapters do act


def test_expert_adapters_are_refused_where_they_cannot_be(tiny_model_dir):
    """Guards against the `experts` target passing silently where it adapts nothing (a dense family: the run would
    train attention alone while the config says experts) or where PEFT's expert adapter cannot do what the config
    asks (dropout: the update is added to the weight, there is no adapter input to drop)."""
    from grpo import lora

    actor = ActorConfig(model_path=tiny_model_dir, lora_rank=4, lora_target_modules=["q_proj", "experts"])
    model = loading.load_model(tiny_model_dir, torch.device("cpu"), "sdpa", meta=True)
    with pytest.raises(ValueError, match="qwen2_5_vl has none"):
        lora.add_lora(model, lora.lora_config(actor))
    actor.lora_dropout = 0.1
    with pytest.raises(ValueError, match="experts needs actor.lora_dropout=0"):
        lora.lora_config(actor)
