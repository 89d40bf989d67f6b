"""Qwen3.5's linear-attention layers over a packed row (linear_attention.py), on CPU with the GPU's kernel swapped for
a stand-in with flash-linear-attention 0.6's exact signature and argument checks: everything around the kernel -- the
gathered convolution, which sequences go into which call, their cu_seqlens, the states handed from prompts to answers,
the reordering back into the row -- is the code that runs on the GPU."""

import sys
import types

import pytest
import torch

from grpo import attention, batching, linear_attention, loading, logprobs
from tests.test_packing import _mixed_batch
from tests.test_shared_prefix import _groups

# the keywords fla 0.6's chunk_gated_delta_rule reads from its **kwargs; any other keyword it would silently drop
FLA_KWARGS = {"transpose_state_layout", "head_first", "chunk_size", "use_gate_in_kernel", "A_log", "dt_bias"}


def fla_stand_in(calls):
    """A CPU kernel with the signature of fla 0.6's fla.ops.gated_delta_rule.chunk_gated_delta_rule, its argument
    checks, and those its Triton kernels make implicitly (cu_seqlens int64 on the inputs' device); the arithmetic is
    linear_attention.by_sequence's."""

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                               state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                               cp_context=None, **kwargs):  # fmt: skip
        assert not set(kwargs) - FLA_KWARGS, f"fla would ignore {set(kwargs) - FLA_KWARGS}"
        assert q.shape[2] == k.shape[2] and v.shape[2] % q.shape[2] == 0  # fla: same q/k heads, HV a multiple
        assert q.shape[:2] == k.shape[:2] == v.shape[:2] == g.shape[:2] == beta.shape[:2]
        assert cu_seqlens is not None and q.shape[0] == 1  # fla: batch 1 with cu_seqlens
        assert cu_seqlens.dtype == torch.int64 and cu_seqlens.device == q.device
        assert cu_seqlens_cpu.device.type == "cpu" and torch.equal(cu_seqlens_cpu, cu_seqlens.cpu())
        assert cu_seqlens_cpu[0] == 0 and cu_seqlens_cpu[-1] == q.shape[1]
        if initial_state is not None:  # fla: one state per sequence, (N, HV, K, V)
            assert initial_state.shape == (len(cu_seqlens) - 1, v.shape[2], k.shape[3], v.shape[3])
        calls.append({"sequences": len(cu_seqlens) - 1, "tokens": q.shape[1], "initial": initial_state is not None,
                      "final": output_final_state})  # fmt: skip
        return linear_attention.by_sequence(q, k, v, g, beta, scale, initial_state, output_final_state,
                                            use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu)  # fmt: skip

    return chunk_gated_delta_rule


@pytest.fixture
def fla_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(linear_attention, "delta_rule_kernel", lambda device_type: fla_stand_in(calls))
    return calls


@pytest.fixture(scope="module")
def qwen3_5(tiny_family_dir):
    from transformers import AutoProcessor

    path = tiny_family_dir("qwen3_5")
    torch.manual_seed(0)
    return loading.load_model(path, torch.device("cpu"), "sdpa"), AutoProcessor.from_pretrained(path)


def _linear_layer(model):
    return next(layer.linear_attn for layer in model.model.language_model.layers if hasattr(layer, "linear_attn"))


@pytest.mark.parametrize("kernel", ["fla", "by_sequence"])
def test_packed_layer_equals_its_own_forward_per_sequence(qwen3_5, fla_calls, kernel, monkeypatch):
    """Guards against a packed row whose sequences leak into each other through the convolution's window or the
    recurrent state, an answer that does not continue its prompt's state (or its prompt's last tokens in the
    convolution, also for a prompt shorter than the window), a row put back in the wrong order, and a backward that
    does not reach the prompt through the states. The reference is transformers' own forward on each whole sequence
    ([prompt | answer] for an answer), outputs and gradients, fp32."""
    if kernel == "by_sequence":
        monkeypatch.setattr(linear_attention, "delta_rule_kernel", lambda device_type: linear_attention.by_sequence)
    model, _ = qwen3_5
    layer = _linear_layer(model)
    assert layer.conv_kernel_size == 4  # the real model's window, so a 2-token prompt is shorter than its context
    torch.manual_seed(1)
    # [plain 5 | prompt 2 | answer 3 | answer 4 | prompt 70 | answer 66]: 70 and 66 span more than one 64-token chunk
    segments = [(0, 5, 0, 0), (5, 7, 0, 0), (7, 10, 5, 7), (10, 14, 5, 7), (14, 84, 0, 0), (84, 150, 14, 84)]
    hidden = torch.randn(1, 150, model.config.text_config.hidden_size, requires_grad=True)  # (1, L, H)
    layout = attention.PackedLayout(segments, 150, torch.device("cpu"))
    weight = torch.randn(1, 150, hidden.shape[-1])  # (1, L, H), a random cotangent
    layer.zero_grad(set_to_none=True)
    out = layer(hidden, packed_layout=layout)  # (1, L, H)
    (out * weight).sum().backward()
    got = (out.detach(), hidden.grad.clone(), {n: p.grad.clone() for n, p in layer.named_parameters()})

    layer.zero_grad(set_to_none=True)
    hidden.grad = None
    want_out, loss = torch.zeros_like(out), 0.0
    for s, e, ps, pe in segments:
        x = hidden[:, s:e] if pe == ps else torch.cat([hidden[:, ps:pe], hidden[:, s:e]], dim=1)
        y = layer(x)[:, x.shape[1] - (e - s) :]  # no layout: transformers' own forward on the whole sequence
        want_out[:, s:e] = y.detach()
        loss = loss + (y * weight[:, s:e]).sum()
    loss.backward()
    want = (want_out, hidden.grad.clone(), {n: p.grad.clone() for n, p in layer.named_parameters()})

    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert got[2].keys() == want[2].keys() and "conv1d.weight" in got[2] and "A_log" in got[2]
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-5, atol=1e-4, msg=name)
    if kernel == "fla":  # one call for the plain sequences and prompts, one for the answers started from them
        assert [(c["sequences"], c["tokens"], c["initial"], c["final"]) for c in fla_calls] == [
            (3, 77, False, True),
            (3, 73, True, False),
        ]


@pytest.mark.parametrize("share", [False, True])
def test_packed_model_with_the_fla_signature_equals_padded(qwen3_5, fla_calls, share):
    """Guards against the GPU's path through the whole model (the fla stand-in in place of by_sequence) differing from
    the padded batch through transformers' own forward (log-probs and every gradient, 1e-5 fp32), and against a
    Python loop or a recomputed prompt creeping back: one kernel call per linear layer and forward without shared
    prefixes, two with them (the answers' call starting from one state per answer)."""
    model, processor = qwen3_5
    pad_id, image_token_id = processor.tokenizer.pad_token_id, model.config.image_token_id
    prompts, responses = _groups(processor) if share else _mixed_batch(processor, image_token_id)
    linear_layers = sum(hasattr(layer, "linear_attn") for layer in model.model.language_model.layers)
    results = {}
    for name, (inputs, response_ids, mask) in (
        ("padded", batching.collate(prompts, responses, pad_id, image_token_id)),
        ("packed", batching.pack(prompts, responses, image_token_id, share)),
    ):
        model.zero_grad(set_to_none=True)
        fla_calls.clear()
        logp, ent = logprobs.forward_logprobs(model, inputs, response_ids, 0.9, True, True)
        ((logp * mask).sum() + 0.1 * (ent * mask).sum()).backward()
        results[name] = (logp.detach() * mask, {n: p.grad.clone() for n, p in model.named_parameters()
                                                  if p.grad is not None}, list(fla_calls))  # fmt: skip
    (logp_a, grads_a, calls_a), (logp_b, grads_b, calls_b) = results["padded"], results["packed"]
    torch.testing.assert_close(logp_b, logp_a, rtol=1e-5, atol=1e-5)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-5, msg=name)
    assert calls_a == []  # padded batches keep transformers' forward
    sizes = batching.pack(prompts, responses, image_token_id, share)[0]["group_sizes"].tolist()  # answers per part
    if not share:
        assert [(c["sequences"], c["initial"]) for c in calls_b] == [(len(prompts), False)] * linear_layers
    else:  # parts of one answer are plain sequences; a group's answers continue its prompt
        first, second = (len(sizes), False, True), (sum(k for k in sizes if k > 1), True, False)
        assert max(sizes) > 1 and min(sizes) == 1
        assert [(c["sequences"], c["initial"], c["final"]) for c in calls_b] == [first, second] * linear_layers


def test_by_sequence_hands_the_state_on_like_the_recurrence():
    """Guards against by_sequence (the CPU kernel, and the reference of the stand-in) mishandling initial states:
    two sequences of which the second starts from a given state, against the token-by-token recurrence (transformers'
    torch_recurrent_gated_delta_rule, a second formula), outputs and final states."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    torch.manual_seed(0)
    heads, dk, dv, lens = 2, 8, 6, [70, 5]
    q, k = torch.randn(1, sum(lens), heads, dk), torch.randn(1, sum(lens), heads, dk)  # (1, T, H, Dk)
    v = torch.randn(1, sum(lens), heads, dv)  # (1, T, H, Dv)
    g = -torch.rand(1, sum(lens), heads)  # (1, T, H), log decay
    beta = torch.rand(1, sum(lens), heads)  # (1, T, H)
    h0 = torch.randn(2, heads, dk, dv)  # (N, H, Dk, Dv)
    cu = torch.tensor([0, lens[0], sum(lens)])
    out, final = linear_attention.by_sequence(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                              use_qk_l2norm_in_kernel=True, cu_seqlens=cu)  # fmt: skip
    for i, (s, e) in enumerate([(0, lens[0]), (lens[0], sum(lens))]):
        want, want_final = torch_recurrent_gated_delta_rule(
            q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e], initial_state=h0[i : i + 1],
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        torch.testing.assert_close(out[:, s:e], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final[i : i + 1], want_final, rtol=1e-5, atol=1e-5)


def test_the_kernel_is_flas_on_cuda_and_by_sequence_elsewhere(monkeypatch):
    """Guards against the GPU never reaching fla (a wrong import path: fla keeps the op in fla.ops.gated_delta_rule),
    the CPU lane trying a Triton kernel, and a GPU without fla failing instead of falling back with a warning."""
    stand_in = fla_stand_in([])
    ops = types.ModuleType("fla.ops.gated_delta_rule")
    ops.chunk_gated_delta_rule = stand_in
    for name, module in (("fla", types.ModuleType("fla")), ("fla.ops", types.ModuleType("fla.ops")),
                         ("fla.ops.gated_delta_rule", ops)):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, module)
    linear_attention.delta_rule_kernel.cache_clear()
    try:
        assert linear_attention.delta_rule_kernel("cuda") is stand_in
        assert linear_attention.delta_rule_kernel("cpu") is linear_attention.by_sequence
        linear_attention.delta_rule_kernel.cache_clear()
        monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", None)  # not installed: the import fails
        with pytest.warns(UserWarning, match="flash-linear-attention is not installed"):
            assert linear_attention.delta_rule_kernel("cuda") is linear_attention.by_sequence
    finally:
        linear_attention.delta_rule_kernel.cache_clear()


def test_plan_of_a_short_prompt():
    """Guards against the convolution's context being taken from the wrong tokens: hand-worked indices for a row
    [plain 2 | prompt 2 | answer 3 | answer 1] and a window of 4 (context 3: zeros, or the prompt's last tokens with
    zeros before them when it is shorter)."""
    layout = attention.PackedLayout([(0, 2, 0, 0), (2, 4, 0, 0), (4, 7, 2, 4), (7, 8, 2, 4)], 8, torch.device("cpu"))
    p = linear_attention.plan(layout, 4)
    z = 8  # the zero slot
    assert p.conv_index.tolist() == [z, z, z, 0, 1, z, z, z, 2, 3, z, 2, 3, 4, 5, 6, z, 2, 3, 7]
    assert p.conv_keep.tolist() == [0, 1, 5, 6, 10, 11, 12, 16]
    assert p.first.tolist() == [0, 1, 2, 3] and p.second.tolist() == [4, 5, 6, 7]
    assert p.cu_first[1].tolist() == [0, 2, 4] and p.cu_second[1].tolist() == [0, 3, 4]
    assert p.state_index.tolist() == [1, 1] and p.unpermute.tolist() == list(range(8))
    assert linear_attention.plan(layout, 4) is p  # built once per micro-batch, shared by every layer


def test_warm_up_tunes_the_kernel_before_step_one_and_says_how_long(monkeypatch, capsys, tiny_family_dir):
    """Guards against fla's first-call tuning (minutes on an H100: fla 0.6.0 ships no tuned configurations) falling
    unnamed inside the first step: the warm-up calls the kernel both ways the packed forward does (plain sequences
    keeping their states, answers starting from them) at the model's own head counts and dimensions, runs the
    backward too (whose kernels tune as well), and prints the seconds it took; with the torch reference (CPU, no fla)
    or a model without linear attention, which tune nothing, it does nothing."""
    path = tiny_family_dir("qwen3_5")
    model = loading.load_model(path, torch.device("cpu"), "sdpa")
    m = next(layer.linear_attn for layer in model.model.language_model.layers if hasattr(layer, "linear_attn"))
    assert linear_attention.warm_up(model, torch.device("cpu")) is None  # by_sequence: nothing tunes
    assert capsys.readouterr().out == ""
    calls, shapes = [], []
    fla = fla_stand_in(calls)

    def kernel(q, k, v, g, beta, **kwargs):
        shapes.append((q.shape[2:], v.shape[2:], q.dtype, g.dtype))
        out = fla(q, k, v, g, beta, **kwargs)
        out[0].register_hook(lambda grad: calls.append("backward"))
        return out

    monkeypatch.setattr(linear_attention, "delta_rule_kernel", lambda device_type: kernel)
    seconds = linear_attention.warm_up(model, torch.device("cpu"))
    assert seconds > 0
    forward = [{"sequences": 2, "tokens": 160, "initial": False, "final": True},
               {"sequences": 1, "tokens": 32, "initial": True, "final": False}]  # fmt: skip
    assert calls == [*forward, "backward", "backward"]
    heads = m.num_v_heads
    assert shapes == [((heads, m.head_k_dim), (heads, m.head_v_dim), torch.float32, torch.float32)] * 2
    out = capsys.readouterr().out
    assert f"tuned for this model's shapes in {seconds:.1f}s before step 1" in out
    dense = loading.load_model(tiny_family_dir("qwen2_5_vl"), torch.device("cpu"), "sdpa")
    assert linear_attention.warm_up(dense, torch.device("cpu")) is None
