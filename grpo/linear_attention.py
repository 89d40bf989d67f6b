"""Qwen3.5's linear-attention layers (gated DeltaNet) over a packed row.

Each such layer is a causal depthwise convolution over the tokens, then a recurrence (the gated delta rule) whose state
carries every earlier token forward. In a packed row (batching.pack: sequences back to back, or a prompt followed by its
answers) both must restart at every sequence, and an answer must start from exactly the state its prompt leaves, the
one it would have in [prompt | answer]. transformers' own forward sees one long sequence (its torch convolution takes
no sequence bounds), so on a packed call use_packed_forward's forward replaces it:

1. the projections, over the whole row at once;
2. the convolution, once, over a gathered row in which every sequence is preceded by its context: the last
   kernel - 1 tokens of its prompt for an answer, zeros for anything else;
3. the delta rule in at most two kernel calls: the plain sequences and prompts (keeping their final states), then the
   answers, each started from its prompt's final state. No prompt is recomputed, and backward carries the answers'
   gradients into their prompt through those states.

The kernel is flash-linear-attention's chunk_gated_delta_rule (Triton, with a backward; one launch for every sequence
of a call, through cu_seqlens) on CUDA where fla is installed, else by_sequence: the same call answered by
transformers' torch reference a sequence at a time (the CPU lane, and a GPU without fla). Padded batches and generate
(which carries a cache) keep transformers' own forward.
"""

from __future__ import annotations

import functools
import inspect
import time
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpo import sequence_parallel
from grpo.attention import PackedLayout


def use_packed_forward(model):
    """Give every linear-attention layer of a Qwen3.5 model the packed forward of this module for the calls that
    carry a PackedLayout (logprobs.forward_logprobs passes one with each packed micro-batch)."""
    for layer in model.model.language_model.layers:
        module = getattr(layer, "linear_attn", None)
        if module is not None:
            module.forward = _packed_or_own(module, module.forward)


def _packed_or_own(module, own_forward):
    def forward(hidden_states, cache_params=None, attention_mask=None, **kwargs):
        layout = kwargs.pop("packed_layout", None)
        if layout is None or cache_params is not None or hidden_states.shape[0] != 1:
            return own_forward(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
        if getattr(layout, "sequence_parallel", None) is not None:  # a row cut over ranks: run it whole
            return sequence_parallel.whole_sequence(packed_linear_attention, module, hidden_states, layout)
        return packed_linear_attention(module, hidden_states, layout)

    return forward


@dataclass
class Plan:
    """Index tensors for one PackedLayout, built once on the host and shared by every layer and by the recompute of
    gradient checkpointing (so no layer re-derives bounds with host syncs)."""

    conv_index: torch.Tensor  # (L + S * (K - 1),) row positions gathered for the convolution; L is the zero slot
    conv_keep: torch.Tensor  # (L,) the convolution's outputs that belong to the row's tokens, in row order
    first: torch.Tensor | None  # (L1,) rows of the plain sequences and prompts; None when that is the whole row
    cu_first: tuple[torch.Tensor, torch.Tensor]  # their cu_seqlens, on the device and on the host
    second: torch.Tensor | None  # (L2,) rows of the answers that continue a prompt; None when there are none
    cu_second: tuple[torch.Tensor, torch.Tensor] | None
    state_index: torch.Tensor | None  # (answers,) which first-call sequence is each answer's prompt
    unpermute: torch.Tensor | None  # (L,) cat(first-call rows, second-call rows) -> row order


def plan(layout, kernel_size: int) -> Plan:
    """The Plan of a PackedLayout (its segments [(start, end, prefix_start, prefix_end)] cover the row in order; an
    answer's prefix is its prompt, itself a segment without a prefix), cached on the layout."""
    if layout._linear is not None:
        return layout._linear
    width = kernel_size - 1
    zero = layout.length  # the index of an all-zero row appended to the row
    conv_index, conv_keep, firsts, seconds, state_index = [], [], [], [], []
    prompt_of = {}  # (start, end) of a plain segment -> its index among the first call's sequences
    offset = 0
    for s, e, ps, pe in layout.segments:
        if pe > ps:  # an answer: its context is the end of its prompt (zeros where the prompt is shorter)
            context = [zero] * max(width - (pe - ps), 0) + list(range(max(ps, pe - width), pe))
            if (ps, pe) not in prompt_of:
                raise ValueError(f"answer [{s}, {e}) continues [{ps}, {pe}), which is not a prompt of this row")
            state_index.append(prompt_of[(ps, pe)])
            seconds.append((s, e))
        else:
            context = [zero] * width
            prompt_of[(s, e)] = len(firsts)
            firsts.append((s, e))
        conv_index += [*context, *range(s, e)]
        conv_keep += range(offset, offset + e - s)  # the window of output j ends at gathered position j + width
        offset += width + e - s

    def rows(segments):
        return torch.cat([torch.arange(s, e) for s, e in segments])

    def cu(segments):
        host = torch.tensor([0, *(e - s for s, e in segments)]).cumsum(0)  # int64, as fla takes them
        return host.to(layout.device), host

    device = layout.device
    first, second = rows(firsts), rows(seconds) if seconds else None
    layout._linear = Plan(
        conv_index=torch.tensor(conv_index, device=device),
        conv_keep=torch.tensor(conv_keep, device=device),
        first=first.to(device) if seconds else None,
        cu_first=cu(firsts),
        second=second.to(device) if seconds else None,
        cu_second=cu(seconds) if seconds else None,
        state_index=torch.tensor(state_index, device=device) if seconds else None,
        unpermute=torch.cat([first, second]).argsort().to(device) if seconds else None,
    )
    return layout._linear


def packed_linear_attention(m, hidden_states, layout):
    """hidden_states (1, L, H) of a packed row -> the gated-DeltaNet layer `m`'s output (1, L, H), every sequence on
    its own and every answer continuing its prompt: the arithmetic of transformers' Qwen3_5GatedDeltaNet.forward
    (5.17 to 5.19) without a cache, over the bounds of the row's PackedLayout."""
    from transformers.activations import ACT2FN

    length = hidden_states.shape[1]
    p = plan(layout, m.conv_kernel_size)
    qkv = m.in_proj_qkv(hidden_states)  # (1, L, C), C = 2 key_dim + value_dim
    z = m.in_proj_z(hidden_states).reshape(1, length, -1, m.head_v_dim)  # (1, L, HV, Dv)
    beta = m.in_proj_b(hidden_states).sigmoid()  # (1, L, HV)
    g = -m.A_log.float().exp() * F.softplus(m.in_proj_a(hidden_states).float() + m.dt_bias)  # (1, L, HV), log decay

    # the causal conv, each sequence after its own context: one depthwise conv over the gathered row
    weight = m.conv1d.weight  # (C, 1, K)
    rows = torch.cat([qkv, qkv.new_zeros(1, 1, qkv.shape[-1])], dim=1).index_select(1, p.conv_index)  # (1, L', C)
    conv = F.conv1d(rows.transpose(1, 2).to(weight.dtype), weight, m.conv1d.bias, groups=weight.shape[0])
    qkv = ACT2FN[m.activation](conv.index_select(2, p.conv_keep)).to(qkv.dtype).transpose(1, 2)  # (1, L, C)

    q, k, v = qkv.split([m.key_dim, m.key_dim, m.value_dim], dim=-1)
    q = q.reshape(1, length, -1, m.head_k_dim)  # (1, L, HK, Dk)
    k = k.reshape(1, length, -1, m.head_k_dim)  # (1, L, HK, Dk)
    v = v.reshape(1, length, -1, m.head_v_dim)  # (1, L, HV, Dv)
    if m.num_v_heads // m.num_k_heads > 1:  # as transformers does, so both kernels see equal q/k/v heads
        q = q.repeat_interleave(m.num_v_heads // m.num_k_heads, dim=2)  # (1, L, HV, Dk)
        k = k.repeat_interleave(m.num_v_heads // m.num_k_heads, dim=2)  # (1, L, HV, Dk)

    out = delta_rule(q, k, v, g, beta, p)  # (1, L, HV, Dv)
    out = m.norm(out.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim))  # (L * HV, Dv), gated by z
    return m.out_proj(out.reshape(1, length, -1))  # (1, L, H)


def delta_rule(q, k, v, g, beta, p: Plan):
    """The gated delta rule over the row's sequences: q, k (1, L, HV, Dk), v (1, L, HV, Dv), g and beta (1, L, HV)
    -> (1, L, HV, Dv). One kernel call when no sequence continues another; else one for the plain sequences and
    prompts, whose final states (N, HV, Dk, Dv) start the answers' call."""
    kernel = delta_rule_kernel(q.device.type)
    common = {"use_qk_l2norm_in_kernel": True}
    if p.second is None:
        cu, cu_host = p.cu_first
        return kernel(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=cu_host, **common)[0]
    first = [t[:, p.first] for t in (q, k, v, g, beta)]
    cu, cu_host = p.cu_first
    out_first, states = kernel(*first, output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu_host, **common)
    second = [t[:, p.second] for t in (q, k, v, g, beta)]
    cu, cu_host = p.cu_second
    initial = states[p.state_index]  # (answers, HV, Dk, Dv): each answer starts where its prompt ended
    out_second = kernel(*second, initial_state=initial, cu_seqlens=cu, cu_seqlens_cpu=cu_host, **common)[0]
    return torch.cat([out_first, out_second], dim=1)[:, p.unpermute]  # (1, L, HV, Dv)


def warm_up(model, device) -> float | None:
    """Tune fla's kernels before the first step, timed and said; returns the seconds, or None where nothing tunes.

    fla's Triton kernels pick their launch configuration at their first call for each tuning key by timing every
    candidate (fla 0.6.0 ships no tuned configurations, and its configuration cache is off unless FLA_CACHE_MODE is
    set: fla/ops/utils/cache.py line 52): on SM90 about 120 configurations for the packed forward and backward, and
    minutes that would otherwise fall, unnamed, inside the first step's log-probs and update on every rank. The keys
    hold the head counts and dimensions and the dtypes, not the row's length (but for l2norm's bucket of 65,536
    rows, 2,048 tokens at 32 heads: a few configurations more when a longer row first comes). So one forward and
    backward of the delta rule at the model's shapes, over a small row of both kinds of call the packed forward
    makes (plain sequences and prompts keeping their final states, then answers starting from them), tunes what the
    steps will call. Triton keeps each choice on disk (fla passes cache_results=True unless FLA_CACHE_RESULTS=0:
    fla/utils/env.py lines 26 and 112), under TRITON_CACHE_DIR (default ~/.triton/cache): a later run on the same
    machine reads them and this takes seconds. Nothing to do without linear-attention layers, or where the kernel is
    by_sequence (CPU, or no fla), which does not tune."""
    layers = [layer.linear_attn for layer in model.model.language_model.layers if hasattr(layer, "linear_attn")]
    kernel = delta_rule_kernel(device.type)
    if not layers or kernel is by_sequence:
        return None
    from grpo.distributed import print0

    m = layers[0]  # every linear-attention layer of a model has the same shapes
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # what the packed forward computes in
    length = 192  # a prompt of 64 tokens with an answer of 32 after it, and a plain sequence of 96
    layout = PackedLayout([(0, 64, 0, 0), (64, 96, 0, 64), (96, 192, 0, 0)], length, device)

    def leaf(*shape, dtype=dtype, rand=torch.randn):
        return rand(1, length, m.num_v_heads, *shape, device=device, dtype=dtype).requires_grad_()

    q, k, v = leaf(m.head_k_dim), leaf(m.head_k_dim), leaf(m.head_v_dim)  # (1, L, HV, D)
    g = (-leaf(dtype=torch.float32, rand=torch.rand)).detach().requires_grad_()  # (1, L, HV) log decay < 0, in fp32
    beta = leaf(rand=torch.rand)  # (1, L, HV) in (0, 1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.enable_grad():
        delta_rule(q, k, v, g, beta, plan(layout, m.conv_kernel_size)).float().sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    print0(
        f"linear attention: {kernel.__module__}.{kernel.__name__} tuned for this model's shapes in {seconds:.1f}s "
        "before step 1 (its choices kept in Triton's cache directory, TRITON_CACHE_DIR, for later runs)"
    )
    return seconds


@functools.cache
def delta_rule_kernel(device_type: str):
    """The chunked gated-delta-rule kernel for a device: flash-linear-attention's on CUDA where it is installed
    (requirements.txt), by_sequence otherwise -- on a GPU with a warning, as it is a Python loop of slow torch code."""
    if device_type == "cuda":
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        except ImportError:
            warnings.warn(
                "flash-linear-attention is not installed: Qwen3.5's linear-attention layers run one sequence at a "
                "time in PyTorch (correct, much slower); pip install flash-linear-attention",
                stacklevel=2,
            )
        else:
            return chunk_gated_delta_rule
    return by_sequence


def by_sequence(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):  # fmt: skip
    """fla's chunk_gated_delta_rule (the arguments this module passes, in fla's names and layout: q, k (1, T, H, Dk),
    v (1, T, H, Dv), g and beta (1, T, H), initial_state (N, H, Dk, Dv) -> output (1, T, H, Dv) and the final states
    (N, H, Dk, Dv) or None) computed by transformers' torch reference, the code its own forward runs without fla,
    one sequence at a time."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    if scale is not None and scale != q.shape[-1] ** -0.5:
        raise NotImplementedError("transformers' torch reference scales queries by 1/sqrt(Dk) only")
    chunk = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)  # the torch code, not a kernel it may wrap
    bounds = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
    lens = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    # split, not slices: a slice's backward writes a zero tensor of the whole row, per slice and tensor
    pieces = zip(*(t.split(lens, dim=1) for t in (q, k, v, g, beta)))
    outs, states = [], []
    for i, (q_i, k_i, v_i, g_i, beta_i) in enumerate(pieces):
        state_i = None if initial_state is None else initial_state[i : i + 1]  # (1, H, Dk, Dv)
        out, state = chunk(
            q_i, k_i, v_i, g=g_i, beta=beta_i, initial_state=state_i, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )  # fmt: skip
        outs.append(out)  # (1, n, H, Dv)
        states.append(state)  # (1, H, Dk, Dv) or None
    return torch.cat(outs, dim=1), torch.cat(states) if output_final_state else None
