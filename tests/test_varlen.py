"""The CUDA attention path (actor.attn_implementation=auto on a GPU: PyTorch's varlen flash kernel, no flash-attn) run
on CPU with the kernel swapped for a per-sequence sdpa reference: everything around the kernel -- which calls take
it, the sequence bounds it gets, the (L, heads, D) layout, grouped-query heads, the vision tower's images and
windows, causal or not -- is the code that runs on the GPU."""

import pytest
import torch
import torch.nn.functional as F

from grpo import attention, batching, loading, logprobs
from tests.test_packing import _mixed_batch


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=None):
    """What torch.nn.attention.varlen.varlen_attn computes, one sequence at a time with sdpa (CPU, any dtype). With
    more keys than queries its causal mask is aligned to the bottom right, as flash-attention's kernels align it:
    query j of a sequence sees keys up to j + (keys - queries), and with a `window` (causal) only the last `window`
    of those. Inputs must be contiguous: torch 2.14 hands full attention (max_q > 128, equal heads, sm90) to cuDNN,
    which is not known to honour other strides."""
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous(), [t.stride() for t in (q, k, v)]
    q_bounds, k_bounds = cu_q.tolist(), cu_k.tolist()
    assert cu_q.dtype == cu_k.dtype == torch.int32 and q_bounds[0] == k_bounds[0] == 0
    assert q_bounds[-1] == q.shape[0] and k_bounds[-1] == k.shape[0] and len(q_bounds) == len(k_bounds)
    assert max_q == max(e - s for s, e in zip(q_bounds[:-1], q_bounds[1:]))
    assert max_k == max(e - s for s, e in zip(k_bounds[:-1], k_bounds[1:]))
    outs = []
    for qs, qe, ks, ke in zip(q_bounds[:-1], q_bounds[1:], k_bounds[:-1], k_bounds[1:]):
        mask = torch.ones(qe - qs, ke - ks, dtype=torch.bool)
        if causal:
            mask = mask.tril(diagonal=(ke - ks) - (qe - qs))
        if causal and window is not None:
            mask = mask & ~mask.tril(diagonal=(ke - ks) - (qe - qs) - window)
        qh, kh, vh = q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1)  # (heads, n, D)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(o.transpose(0, 1))  # (n, Hq, D)
    return torch.cat(outs)


@pytest.fixture
def recorded_kernel(monkeypatch):
    calls = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=None):
        calls.append({"causal": causal, "n": len(cu_q) - 1, "heads": (q.shape[1], k.shape[1]), "keys": k.shape[0],
                      "window": window})  # fmt: skip
        return reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window)

    monkeypatch.setattr(attention, "varlen_kernel", kernel)
    return calls


def test_auto_picks_varlen_on_cuda_only():
    """Guards against auto still asking for flash_attention_2 on CUDA (a flash-attn build that has no wheel for
    torch 2.14 / CUDA 13), or taking the CUDA kernel on CPU."""
    assert attention.resolve_attention("auto", torch.device("cuda", 0)) == "varlen_packed"
    assert attention.resolve_attention("auto", torch.device("cpu")) == "sdpa_packed"
    assert attention.resolve_attention("sdpa", torch.device("cuda", 0)) == "sdpa_packed"
    assert attention.resolve_attention("flash_attention_2", torch.device("cuda", 0)) == "flash_attention_2"


def test_varlen_packed_equals_padded_sdpa(tiny_model_dir, tiny_processor, recorded_kernel):
    """Guards against the varlen path mixing packed sequences (wrong or missing bounds), a transposed layout, grouped
    kv heads mapped to the wrong query heads, a vision tower that loops over its images and windows instead of one
    kernel call per layer (or attends causally), gradients that differ from the padded sdpa model's, and a strided
    input reaching the kernel (the vision tower's v, a view of its fused qkv: torch 2.14 may route it to cuDNN)."""
    torch.manual_seed(0)
    ref = loading.load_model(tiny_model_dir, torch.device("cpu"), "sdpa")
    model = loading.load_model(tiny_model_dir, torch.device("cpu"), "varlen_packed")
    assert model.config._attn_implementation == "varlen_packed"
    assert model.model.visual.config._attn_implementation == attention.VISION_VARLEN
    pad_id, image_token_id = tiny_processor.tokenizer.pad_token_id, model.config.image_token_id
    prompts, responses = _mixed_batch(tiny_processor, image_token_id)
    padded_inputs, response_ids, mask = batching.collate(prompts, responses, pad_id, image_token_id)
    packed_inputs, _, _ = batching.pack(prompts, responses, image_token_id)

    want, got = {}, {}
    for out, m, inputs in ((want, ref, padded_inputs), (got, model, packed_inputs)):
        logp, ent = logprobs.forward_logprobs(m, inputs, response_ids, 0.9, True, True)
        ((logp * mask).sum() + 0.1 * (ent * mask).sum()).backward()
        out["logp"] = logp.detach() * mask
        out["grads"] = [
            m.lm_head.weight.grad,
            m.model.language_model.layers[0].self_attn.k_proj.weight.grad,
            m.model.visual.blocks[0].attn.qkv.weight.grad,
            m.model.visual.blocks[1].attn.qkv.weight.grad,
        ]
    torch.testing.assert_close(got["logp"], want["logp"], rtol=1e-5, atol=1e-5)
    for g, w in zip(got["grads"], want["grads"]):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)

    text_layers, vision_blocks = model.config.text_config.num_hidden_layers, model.config.vision_config.depth
    decoder = [c for c in recorded_kernel if c["causal"]]
    vision = [c for c in recorded_kernel if not c["causal"]]
    # forward and the recompute of gradient checkpointing may call again; at least one call per layer, none looped
    assert len(decoder) >= text_layers and all(c["n"] == len(prompts) for c in decoder)
    assert all(c["heads"] == (2, 1) for c in decoder)  # grouped-query heads reach the kernel as they are
    assert len(vision) == vision_blocks  # one call per block for all images (or windows), not one per image
    # block 1 attends over whole images (two in the batch), block 0 over windows of them (at least one per image)
    assert vision[1]["n"] == 2 and vision[0]["n"] >= 2


def test_varlen_packed_is_sdpa_off_the_packed_path(recorded_kernel):
    """Guards against the kernel being used where it would be wrong: a padded batch with its mask, a KV-cache step
    (keys longer than queries) -- those must be transformers' sdpa exactly, and never reach the kernel."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(0)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 1
    q, k, v = (torch.randn(2, 2, 6, 8, generator=g) for _ in range(3))
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    for args in ((q, k, v, mask), (q[:1, :, -1:], k[:1], v[:1], None)):
        want = sdpa_attention_forward(module, *args)[0]
        torch.testing.assert_close(attention.varlen_packed(module, *args)[0], want)
    assert recorded_kernel == []
    # a packed row with bounds: each sequence equals itself alone
    layout = attention.PackedLayout.sequences([2, 4], torch.device("cpu"))
    got = attention.varlen_packed(module, q[:1], k[:1], v[:1], None, packed_layout=layout)[0]
    for s, e in ((0, 2), (2, 6)):
        alone = sdpa_attention_forward(module, q[:1, :, s:e], k[:1, :, s:e], v[:1, :, s:e], None)[0]
        torch.testing.assert_close(got[:, s:e], alone)


def test_varlen_packed_takes_heads_the_kernel_cannot_through_sdpa(recorded_kernel):
    """Guards against a packed layer reaching the flash kernel with heads over 256 dims (Gemma 4's full-attention
    layers have 512; flash-attention's kernels stop at 256) or with a sliding layer's image blocks (no kernel mask
    holds them): both go through sdpa a segment at a time, and give what the CPU path gives, a shared prefix, the
    window and the block included."""
    g = torch.Generator().manual_seed(0)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    layout = attention.PackedLayout([(0, 6, 0, 0), (6, 9, 0, 6), (9, 11, 0, 6)], 11, torch.device("cpu"),
                                    blocks=torch.tensor([-1, 0, 0, 0, -1, -1, -1, -1, -1, -1, -1]))  # fmt: skip
    for dim, window in ((attention.FLASH_MAX_HEAD_DIM + 8, None), (16, 4)):
        q = torch.randn(1, 4, 11, dim, generator=g)
        k, v = torch.randn(1, 2, 11, dim, generator=g), torch.randn(1, 2, 11, dim, generator=g)
        got = attention.varlen_packed(module, q, k, v, None, packed_layout=layout, sliding_window=window)[0]
        want = attention.sdpa_packed(module, q, k, v, None, packed_layout=layout, sliding_window=window)[0]
        torch.testing.assert_close(got, want)
    assert recorded_kernel == []
    # the window and the block, by hand: the prompt's image token 1 sees 0-3 (its block: ahead of itself too), the
    # second answer's last token (position 6 + 1) the prompt from position 4 on and itself, with a window of 4
    masks = layout.prefix_masks(4)
    assert masks[0][0, 0, 1].tolist() == [True, True, True, True, False, False]
    assert masks[2][0, 0, 1].tolist() == [False, False, False, False, True, True, True, True]


def _varlen_attn_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                      window_size=(-1, -1)):  # fmt: skip
    """torch 2.11's varlen_attn signature exactly (no enable_gqa); GQA as flash-attention does it, by head groups."""
    causal, window = _window(window_size)
    return reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal, scale, window)


def _window(window_size):
    """varlen_attn's (left, right) window -> reference_varlen's (causal, window): (-1, -1) full, (-1, 0) causal,
    (W - 1, 0) causal over the last W keys (flash-attention's left window counts the keys before the query's own)."""
    left, right = window_size
    assert right in (-1, 0) and (left == -1 or right == 0), window_size  # what varlen_kernel may ask
    return right == 0, (None if left == -1 else left + 1)


def _varlen_attn_2_14(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                      window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None,
                      num_splits=None):  # fmt: skip
    """torch 2.13 / 2.14's signature exactly: grouped heads need enable_gqa=True."""
    assert enable_gqa == (query.shape[1] != key.shape[1])
    causal, window = _window(window_size)
    return reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal, scale, window)


@pytest.mark.parametrize("stand_in", [_varlen_attn_2_11, _varlen_attn_2_14], ids=["torch2.11", "torch2.14"])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_kernel_calls_each_torch_versions_signature(monkeypatch, stand_in, causal):
    """Guards against a keyword one supported torch lacks: torch 2.11's varlen_attn has no enable_gqa, so passing it
    raised TypeError at the first vision-tower call of the first GPU run; and a sliding window spelt other than
    window_size=(W - 1, 0) in either. attention.varlen_kernel (its own name and
    arguments are an interface) must call each version's exact signature and get the right grouped-query result."""
    import torch.nn.attention.varlen

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", stand_in)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(7, 4, 8, generator=g), torch.randn(9, 2, 8, generator=g), torch.randn(9, 2, 8, generator=g)
    cu_q, cu_k = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    got = attention.varlen_kernel(q, k, v, cu_q, cu_k, 4, 5, causal, 0.3)
    # the grouped heads by hand: query heads 0-1 read key/value head 0, heads 2-3 head 1
    k2, v2 = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    torch.testing.assert_close(got, reference_varlen(q, k2, v2, cu_q, cu_k, 4, 5, causal, 0.3))
    if causal:  # a sliding window (Gemma 4's sliding layers): the last 2 keys of each query, as window_size (1, 0)
        got = attention.varlen_kernel(q, k, v, cu_q, cu_k, 4, 5, True, 0.3, window=2)
        want = reference_varlen(q, k2, v2, cu_q, cu_k, 4, 5, True, 0.3, window=2)
        torch.testing.assert_close(got, want)
        assert not torch.allclose(got, reference_varlen(q, k2, v2, cu_q, cu_k, 4, 5, True, 0.3))


def test_compute_device_is_the_meshs_not_the_offloaded_shards(monkeypatch, tiny_model_dir, tiny_processor):
    """Guards against taking a model's compute device from its parameters: FSDP2's CPUOffloadPolicy
    (actor.ref_offload) keeps the shards in host memory while the forward runs on the mesh's GPU, and FSDP2 moves
    only a forward's tensor arguments there, so labels, sequence bounds and index tensors built on the parameters'
    device stopped the first offloaded GPU run. A stand-in parameter with the DTensor attributes of an offloaded
    CUDA shard; and the packed log-prob forward takes its device from compute_device alone."""
    from types import SimpleNamespace

    offloaded = SimpleNamespace(device=torch.device("cpu"), device_mesh=SimpleNamespace(device_type="cuda"))
    model = SimpleNamespace(parameters=lambda: iter([offloaded]))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert logprobs.compute_device(model) == torch.device("cuda", 1)
    on_cpu_mesh = SimpleNamespace(device=torch.device("cpu"), device_mesh=SimpleNamespace(device_type="cpu"))
    assert logprobs.compute_device(SimpleNamespace(parameters=lambda: iter([on_cpu_mesh]))) == torch.device("cpu")
    assert logprobs.compute_device(torch.nn.Linear(2, 2)) == torch.device("cpu")  # not sharded: where it lives

    asked = []
    monkeypatch.setattr(logprobs, "compute_device", lambda m: asked.append(m) or torch.device("cpu"))
    tiny = loading.load_model(tiny_model_dir, torch.device("cpu"), "sdpa")
    prompts, responses = _mixed_batch(tiny_processor, tiny.config.image_token_id)
    packed, response_ids, _ = batching.pack(prompts, responses, tiny.config.image_token_id)
    with torch.no_grad():
        logprobs.forward_logprobs(tiny, packed, response_ids, 1.0)
    assert asked and all(m is tiny for m in asked)  # forward_logprobs and packed_positions
