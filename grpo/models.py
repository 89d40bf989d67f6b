"""The policy as a network: loading, FSDP2 wrapping, packed attention and the log-prob forward.

- load_sharded (load_model(meta=True) / apply_fsdp / load_weights): the model built on the meta device, sharded
  with FSDP2 (vision tower as one unit, each decoder layer, the root), and each rank's shards read from the
  safetensors, so no rank ever holds the whole model; root_forward / reshard: the two FSDP2 quirks the loop has to
  work around. load_model alone is from_pretrained, for tests and benches.
- load_policy_and_reference: the trainable policy (master weights in actor.master_dtype) and the frozen reference,
  ready for the loop; with actor.lora_rank > 0 the policy carries PEFT LoRA adapters (lora.py) and the reference is
  the policy itself with its adapters switched off (lora.adapters_disabled), so no second model is loaded.
- FAMILIES: what differs between Qwen2.5-VL, Qwen3-VL, Qwen3.5 and the last two's mixtures of experts (one small
  table; the experts' own code in moe.py); the start-up checks that a checkpoint is one of them, whole
  (unsupported_model).
- sdpa_packed and packed_position_ids: attention and mRoPE positions that keep a packed row's sequences apart.
- forward_logprobs: log-probs (and entropy) of the response tokens, with the LM head run in chunks
  (chunked_logprobs) so the full (B, T, vocab) logits never exist.

A micro-batch comes from batching.collate ([left-padded prompt | right-padded response] per row) or, with
actor.padding_free, from batching.pack (all sequences back to back in one row).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from grpo import moe
from grpo.linear_attention import use_packed_forward
from grpo.lora import LORA_ADAPTER, add_lora, base_name, init_lora, is_lora_factor, lora_config, lora_layers

# ----------------------------------------------------------------------------------------------------------------------
# Log-probs of sampled tokens from logits or, chunk by chunk, from the last hidden states and the LM head weight.


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits (B, T, V), labels (B, T) -> log p(label) (B, T), in fp32."""
    logits = logits.float() / temperature  # (B, T, V)
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)  # (B, T)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    logits = logits.float() / temperature  # (B, T, V)
    return logits.logsumexp(-1) - (logits.softmax(-1) * logits).sum(-1)  # (B, T)


def _head_chunk(hidden, weight, labels, temperature, with_entropy):
    logits = torch.nn.functional.linear(hidden, weight)  # (C, V), in the compute dtype, as the HF lm_head gives it
    logp = token_logprobs(logits, labels, temperature)  # (C,)
    return logp, entropy_from_logits(logits, temperature) if with_entropy else None  # (C,)


def chunked_logprobs(hidden, weight, labels, temperature=1.0, chunk_size=512, with_entropy=True):
    """hidden (B, T, H), LM head weight (V, H), labels (B, T) -> log p(label) (B, T) and entropy (B, T) or None,
    equal to token_logprobs/entropy_from_logits on the full logits, without ever holding (B, T, V) of them: the
    head runs `chunk_size` tokens at a time, and each chunk is checkpointed so backward recomputes its logits
    instead of keeping them. Peak memory O(chunk_size x V) instead of O(B x T x V)."""
    h, y = hidden.flatten(0, 1), labels.flatten()  # (B*T, H), (B*T,)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    logps, entropies = [], []
    for i in range(0, h.shape[0], chunk_size):
        args = (h[i : i + chunk_size], weight, y[i : i + chunk_size], temperature, with_entropy)
        if grad:
            logp, entropy = torch.utils.checkpoint.checkpoint(_head_chunk, *args, use_reentrant=False)
        else:
            logp, entropy = _head_chunk(*args)
        logps.append(logp)
        entropies.append(entropy)
    logp = torch.cat(logps).view_as(labels)  # (B, T)
    return logp, torch.cat(entropies).view_as(labels) if with_entropy else None  # (B, T)


# ----------------------------------------------------------------------------------------------------------------------
# Packed attention and positions, and the forward that gives the response tokens' log-probs.

# attention this module implements over a PackedLayout (shared prefixes included), and all that keeps packed rows apart
OWN_PACKED_ATTENTION = ("auto", "sdpa", "sdpa_packed", "varlen_packed")
PACKED_ATTENTION = (*OWN_PACKED_ATTENTION, "flash_attention_2", "flash_attention_3")
# The vision tower passes its per-image (and per-window) bounds to the attention function only when the name of its
# attention says "flash"; anything else makes it loop over images and windows in Python (transformers 5.19). So on
# CUDA the tower's config names varlen_packed under this second name. It is set on the loaded model, never passed
# to from_pretrained, which would go looking for a flash-attn build or a hub kernel of that name.
VISION_VARLEN = "flash_varlen_packed"


def resolve_attention(requested: str, device) -> str:
    """actor.attn_implementation -> the name the model is loaded with. auto: PyTorch's own flash varlen kernel on
    CUDA (no flash-attn build needed), sdpa_packed elsewhere; sdpa also means sdpa_packed, which is sdpa for padded
    batches and keeps packed ones apart."""
    _register_attention()
    if requested == "auto":
        requested = "varlen_packed" if device.type == "cuda" and _has_varlen() else "sdpa"
    return "sdpa_packed" if requested == "sdpa" else requested


def _has_varlen() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401  (torch >= 2.10)
    except ImportError:
        return False
    return True


class PackedLayout:
    """Where the segments of a packed row lie and what each may attend to: causally to itself, and, for an answer of
    a shared-prefix group, also to the whole of its group's prompt (`prefix`). forward_logprobs builds one per
    micro-batch and hands it to every decoder layer's attention, which takes the form it needs: a segment at a time
    with small masks on CPU, the varlen kernel's arguments on CUDA. Both are built once and reused by every layer and
    by the recompute of gradient checkpointing, so no layer re-derives bounds with host syncs.

    segments: [(start, end, prefix_start, prefix_end)] in row order, covering the row; prefix_end == prefix_start
    when a segment has no prefix."""

    def __init__(self, segments, length, device):
        self.segments, self.length, self.device = segments, length, device
        self._masks = self._varlen = self._linear = None  # the last: linear_attention.plan

    @classmethod
    def sequences(cls, seq_lens, device):
        """The plain packed layout: whole sequences back to back, no prefixes."""
        bounds = [0, *torch.as_tensor(seq_lens).cumsum(0).tolist()]
        return cls([(s, e, 0, 0) for s, e in zip(bounds[:-1], bounds[1:])], bounds[-1], device)

    def prefix_masks(self):
        """Per segment, None (no prefix: plain causal attention) or the (1, 1, n, prefix + n) bool mask of its
        queries over [its prefix | itself]: the whole prefix, then causal -- the bottom-right-aligned causal mask."""
        if self._masks is None:
            self._masks = []
            for s, e, ps, pe in self.segments:
                n, p = e - s, pe - ps
                mask = torch.ones(n, p + n, dtype=torch.bool).tril(diagonal=p) if p else None
                self._masks.append(None if mask is None else mask.to(self.device)[None, None])
        return self._masks

    def varlen_args(self):
        """(key_index or None, cu_q, cu_k, max_q, max_k) for the varlen kernel. Queries are the row as it is, one
        sequence per segment; the keys of a segment are its prefix followed by itself, gathered by key_index (None
        when no segment has a prefix: the keys are then the row too). With more keys than queries, the kernel's
        causal mask is aligned to the bottom right (flash-attention's convention, varlen_attn's window (-1, 0)):
        query j of a segment sees the whole prefix and the segment up to j."""
        if self._varlen is None:
            q_lens = [e - s for s, e, _, _ in self.segments]
            k_lens = [e - s + pe - ps for s, e, ps, pe in self.segments]
            cu = lambda lens: torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)  # noqa: E731
            key_index = None
            if any(pe > ps for _, _, ps, pe in self.segments):
                key_index = torch.cat([torch.cat([torch.arange(ps, pe), torch.arange(s, e)])
                                       for s, e, ps, pe in self.segments]).to(self.device)  # fmt: skip
            self._varlen = (key_index, cu(q_lens).to(self.device), cu(k_lens).to(self.device), max(q_lens), max(k_lens))
        return self._varlen


def packed_layout(module, attention_mask, query, key, position_ids, kwargs):
    """The PackedLayout of this attention call, or None when it is not a packed one: the decoder's forward of a
    packed micro-batch comes as one row without a mask, with forward_logprobs's `packed_layout`. Padded batches,
    generate (its KV cache makes keys longer than queries) and the vision tower (not causal) are not packed; a
    packed row from elsewhere (a user's own forward) is recognised by text positions that restart at 0."""
    layout = kwargs.pop("packed_layout", None)
    causal = getattr(module, "is_causal", True)
    packed = attention_mask is None and query.shape[0] == 1 and key.shape[2] == query.shape[2] and causal
    if not packed or query.shape[2] == 1:
        return None
    if layout is None and position_ids is not None:
        starts = (position_ids[0] == 0).nonzero().flatten().tolist()
        bounds = [0, *(x for x in starts if x > 0), query.shape[2]]
        layout = PackedLayout.sequences(torch.tensor(bounds).diff(), query.device)
    return layout


def sdpa_packed(module, query, key, value, attention_mask, position_ids=None, **kwargs):
    """PyTorch sdpa that keeps a packed row's segments apart: the CPU stand-in for the varlen kernel, a segment at a
    time. A plain sequence or a prompt attends causally to itself; an answer of a shared-prefix group attends to
    [its prompt | itself] through its PackedLayout.prefix_masks mask, the keys the varlen kernel gets on CUDA. One
    call with a mask over the whole row would cost L^2 instead of the sum over segments: 3-5x slower at the CPU
    demo's sizes, Python's loop included. Every other call (padded batches, generate, the vision tower) is plain
    transformers sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layout = packed_layout(module, attention_mask, query, key, position_ids, kwargs)
    if layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outs = []
    for (s, e, ps, pe), mask in zip(layout.segments, layout.prefix_masks()):
        k, v = key[:, :, s:e], value[:, :, s:e]
        if mask is not None:
            k, v = torch.cat([key[:, :, ps:pe], k], dim=2), torch.cat([value[:, :, ps:pe], v], dim=2)
        outs.append(sdpa_attention_forward(module, query[:, :, s:e], k, v, mask, **kwargs)[0])  # (1, n, heads, D)
    return torch.cat(outs, dim=1), None


def varlen_kernel(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """PyTorch's flash-attention varlen kernel, forward and backward (CUDA only; bf16/fp16). q (Lq, Hq, D), k and v
    (Lk, Hkv, D); sequence i is q rows cu_q[i]:cu_q[i+1] against k rows cu_k[i]:cu_k[i+1]. Grouped-query heads are
    handled by the kernel itself, without repeating k and v. Tests swap in a CPU reference."""
    from torch.nn.attention.varlen import varlen_attn

    window = (-1, 0) if causal else (-1, -1)  # (-1, 0) is how varlen_attn spells causal (bottom-right aligned)
    kwargs = {"scale": scale, "window_size": window}
    # torch 2.13 added enable_gqa; 2.11 has no such keyword (a TypeError at the first call). Flash-attention's varlen
    # kernel needs only that the query heads be a multiple of the key/value heads, so without it GQA is still right.
    if _varlen_takes_gqa(varlen_attn):
        kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


@functools.cache
def _varlen_takes_gqa(fn) -> bool:
    return "enable_gqa" in inspect.signature(fn).parameters


def varlen_packed(module, query, key, value, attention_mask, position_ids=None, **kwargs):
    """Attention for CUDA without flash-attn: packed rows (the decoder, causal, shared prefixes included) and the
    vision tower's images and windows (full attention, bounds from the tower) through one varlen kernel call per
    layer; every other call (padded batches, generate) is plain sdpa.
    query (1, Hq, L, D), key/value (1, Hkv, L, D) -> (1, L, Hq, D)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # Contiguous (L, heads, D), what every backend of varlen_attn takes: torch 2.14 sends full attention with equal
    # heads and max_q > 128 on sm90/sm100 to cuDNN (varlen.py _can_use_cudnn), and the vision tower's v is a strided
    # view of its fused qkv there (the decoder's are contiguous already: no copy)
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    scale = kwargs.get("scaling")
    if kwargs.get("cu_seq_lens_q") is not None:  # the vision tower (under VISION_VARLEN): full attention per chunk
        cu, max_len = kwargs["cu_seq_lens_q"].to(torch.int32), int(kwargs["max_length_q"])
        return varlen_kernel(q, k, v, cu, cu, max_len, max_len, False, scale).unsqueeze(0), None
    layout = packed_layout(module, attention_mask, query, key, position_ids, kwargs)
    if layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    key_index, cu_q, cu_k, max_q, max_k = layout.varlen_args()
    if key_index is not None:  # each answer's keys: its group's prompt, then itself
        k, v = k[key_index], v[key_index]  # (K, Hkv, D); backward adds the prompt's key gradients up
    return varlen_kernel(q, k, v, cu_q, cu_k, max_q, max_k, True, scale).unsqueeze(0), None  # (1, L, Hq, D)


def _register_attention():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    def own_mask(*, batch_size, q_length, kv_length, attention_mask=None, **kwargs):
        """sdpa's own masks for padded batches; none for one unpadded row, which the attention above handles itself
        (causal, or packed through its PackedLayout). A model that always builds its mask (Qwen3-VL) would otherwise
        get a block mask from a packed row's text positions -- one that cannot express shared prefixes (a group's
        answers continue their prompt's positions, so it would let them see each other) and that overrides the
        layout."""
        if attention_mask is None and batch_size == 1 and q_length == kv_length:
            return None
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                         attention_mask=attention_mask, **kwargs)  # fmt: skip

    for name, fn in (("sdpa_packed", sdpa_packed), ("varlen_packed", varlen_packed), (VISION_VARLEN, varlen_packed)):
        AttentionInterface.register(name, fn)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, own_mask)


def use_varlen_in_vision_tower(model):
    """Point the vision tower at varlen_packed under its flash-style name (see VISION_VARLEN), so it makes one
    kernel call per layer for all images and windows instead of a Python loop over them."""
    if model.config._attn_implementation == "varlen_packed":
        model.model.visual.config._attn_implementation = VISION_VARLEN


def text_after_vision_continues(model):
    """Make the model's get_rope_index start the text after an image or video at 1 + the largest position so far, as
    Qwen's reference code and vLLM do (st_idx = max + 1). transformers 5.17-5.19 start it at the vision block's first
    position + its larger spatial side instead, which is the same for an image but not for a Qwen2.5-VL video whose
    temporal positions (frame pairs x tokens_per_second x seconds per pair) run past its spatial ones: the text after
    it would overlap the video's positions, and the trainer's log-probs would differ from vLLM's (measured: 0.06 on a
    tiny model). Qwen3-VL and Qwen3.5 give every frame pair its own block at one temporal position: no change there.
    Wrapped on the instance, so the padded forward, packed_positions and generate all get it."""
    inner = model.model.get_rope_index

    def get_rope_index(input_ids, mm_token_type_ids, *args, attention_mask=None, **kwargs):
        positions, _ = inner(input_ids, mm_token_type_ids, *args, attention_mask=attention_mask, **kwargs)  # (3, B, L)
        deltas = []
        for b in range(input_ids.shape[0]):
            keep = attention_mask[b].bool() if attention_mask is not None else torch.ones_like(input_ids[b]).bool()
            pos, types = positions[:, b, keep], mm_token_type_ids[b, keep]  # (3, n), (n,)
            # the first token after each vision block, found at once (this runs in every forward that starts
            # sequences, and a Python loop over every token of every row would be its cost)
            after = ((types[1:] != types[:-1]) & (types[:-1] != 0)).nonzero().flatten() + 1
            for i in after.tolist():
                pos[:, i:] += pos[:, :i].max() + 1 - pos[0, i]
            positions[:, b, keep] = pos
            deltas.append(pos.max() + 1 - len(types) if len(types) else 0)
        return positions, torch.tensor(deltas, device=input_ids.device).unsqueeze(1)

    model.model.get_rope_index = get_rope_index


def packed_positions(model, host_ids, image_grid_thw, prompt_lens, group_sizes, response_lens, host_types=None,
                     video_grid_thw=None, second_per_grid_ts=None):  # fmt: skip
    """What forward_logprobs needs of a packed row (batching.pack), worked out once per micro-batch on the host.
    `host_types` (L,) says which tokens are image (1) and video (2) tokens (batching.pack's mm_token_type_ids; without
    it, image tokens are found by their id); the videos' grids and, for Qwen2.5-VL, their seconds per temporal patch
    go to get_rope_index with the images'.

    The row holds parts [prompt | answer 1 | ... | answer k], k = group_sizes[g] (k = 1: a plain sequence). Returns
    - positions (4, 1, L): row 0 the text position, rows 1-3 mRoPE (temporal, height, width). Every answer gets the
      positions it would have right after its prompt, alone: each part's prompt with its longest answer goes
      through the model's own get_rope_index, and an answer's tokens take the columns after the prompt (text the
      model wrote -- vision tokens are never sampled -- whose positions run on from the prompt's). A part whose
      answers hold images (tool turns, turns.py) has one get_rope_index row per answer instead, as an image moves
      the positions of what follows it;
    - keep (R,): the row positions whose hidden states predict the R answer tokens (an answer's first token is
      predicted by its prompt's last position, shared by the group), and targets (R,): the answer tokens' positions;
    - the PackedLayout of the row's segments."""
    if host_types is None:
        host_types = (host_ids == model.config.image_token_id).long()
    # images that start before each position (an image is one run of image tokens): which grids a span's images own
    image = (host_types == 1).long()
    before = torch.cat([image.new_zeros(1), (image - torch.cat([image.new_zeros(1), image[:-1]])).clamp(min=0)])
    before = before.cumsum(0).tolist()  # (L + 1,)
    parts, part_types, keep, targets, segments, column, part, grid_rows = [], [], [], [], [], [], [], []
    offset, r = 0, 0
    for p_len, k in zip(prompt_lens.tolist(), group_sizes.tolist()):
        lens = response_lens[r : r + k].tolist()
        prompt_end = a = offset + p_len
        starts = [prompt_end + sum(lens[:j]) for j in range(k)]
        per_answer = any(host_types[s : s + n].any() for s, n in zip(starts, lens))  # tool turns' images
        chosen = range(k) if per_answer else [max(range(k), key=lambda j: lens[j])]
        if per_answer and k > 1 and host_types[offset:prompt_end].eq(2).any():
            raise NotImplementedError("a shared video prompt whose answers hold tool images")
        first_row = len(parts)
        for j in chosen:
            for rows, out in ((host_ids, parts), (host_types, part_types)):
                out.append(torch.cat([rows[offset:prompt_end], rows[starts[j] : starts[j] + lens[j]]]))
            grid_rows.append([*range(before[offset], before[prompt_end]),
                              *range(before[starts[j]], before[starts[j] + lens[j]])])  # fmt: skip
        segments.append((offset, prompt_end + lens[0] if k == 1 else prompt_end, 0, 0))
        column += range(p_len)
        part += [first_row] * p_len
        for j, n in enumerate(lens):
            keep += [prompt_end - 1, *range(a, a + n - 1)]
            targets += range(a, a + n)
            column += range(p_len, p_len + n)
            part += [first_row + j if per_answer else first_row] * n
            if k > 1:
                segments.append((a, a + n, offset, prompt_end))
            a += n
        offset, r = a, r + k
    if image_grid_thw is not None:  # each row's images, a prompt's again in each row it starts
        image_grid_thw = image_grid_thw[[i for row in grid_rows for i in row]]
    # the rows (a part's prompt with its longest answer, or with each answer) as a padded batch for get_rope_index
    width = max(len(x) for x in parts)
    ids = torch.zeros(len(parts), width, dtype=host_ids.dtype)  # (G, W)
    types = torch.zeros(len(parts), width, dtype=torch.long)  # (G, W): 0 text, 1 image, 2 video
    valid = torch.arange(width)[None] < torch.tensor([len(x) for x in parts])[:, None]  # (G, W)
    ids[valid], types[valid] = torch.cat(parts), torch.cat(part_types).long()
    device = compute_device(model)
    grids = {"image_grid_thw": image_grid_thw, "video_grid_thw": video_grid_thw}
    if second_per_grid_ts is not None:  # Qwen2.5-VL: the video's temporal positions are spaced by its frame rate
        grids["second_per_grid_ts"] = second_per_grid_ts
    grids = {k: v.to(device) for k, v in grids.items() if v is not None}
    valid = valid.to(device).long()
    mrope, _ = model.model.get_rope_index(ids.to(device), types.to(device), attention_mask=valid, **grids)  # (3, G, W)
    column, part = torch.tensor(column, device=device), torch.tensor(part, device=device)  # (L,), (L,)
    positions = torch.cat([column[None], mrope[:, part, column]])[:, None]  # (4, 1, L)
    layout = PackedLayout(segments, offset, device)
    return positions, torch.tensor(keep, device=device), torch.tensor(targets, device=device), layout


def _call_with_head(model, inputs, labels, temperature, with_entropy, entropy_grad, logits_to_keep, **extra):
    """The model's forward with lm_head swapped for chunked_logprobs against `labels` (see forward_logprobs)."""
    head = model.lm_head

    def head_forward(hidden):  # hidden (B, >= T, H): the state at position t predicts label t
        hidden = hidden[:, : labels.shape[1]]  # (B, T, H)
        logp, entropy = chunked_logprobs(hidden, _head_weight(head), labels, temperature, with_entropy=with_entropy)
        if entropy is not None and not entropy_grad:
            entropy = entropy.detach()
        return torch.stack([logp] if entropy is None else [logp, entropy], -1)  # (B, T, 1 or 2)

    head.forward = head_forward
    try:
        return model(**inputs, **extra, use_cache=False, logits_to_keep=logits_to_keep).logits  # (B, T, 1 or 2)
    finally:
        del head.forward  # back to the class's nn.Linear.forward


def _head_weight(head):
    """The LM head's weight, plus its LoRA update when it has an adapter that is on (lm_head in
    actor.lora_target_modules): chunked_logprobs takes the weight, never the module's forward. (Inside the root's
    forward, so FSDP2 has gathered the factors; that adapter gets no dropout.)"""
    if LORA_ADAPTER not in getattr(head, "lora_A", {}) or head.disable_adapters:
        return head.weight
    a, b = head.lora_A[LORA_ADAPTER].weight, head.lora_B[LORA_ADAPTER].weight
    return head.weight + (b @ a) * head.scaling[LORA_ADAPTER]  # (V, H)


def forward_logprobs(model, batch_inputs, response_ids, temperature, with_entropy=False, entropy_grad=False):
    """Log-probs (B, T) of the response tokens under `model`, and their entropy (B, T) when asked.

    The full logits would be (B, T, 151936) fp32, 0.6 MB a token, so the LM head runs chunked (chunked_logprobs).
    It must still run inside the root module's forward: under FSDP2 the root owns lm_head, and its weight is
    all-gathered only between the root's pre- and post-forward hooks. So for this one call we swap lm_head's forward
    for one that takes the hidden states that predict response tokens and returns the stack of log-prob and entropy
    as `.logits`; being the root's output, it carries FSDP2's pre-backward hook as the logits did.

    A packed micro-batch (batching.pack) goes through the model as one row with per-sequence positions and no mask
    (varlen_packed or sdpa_packed keep attention inside each sequence, and a shared prompt visible to each of its
    answers only); its response log-probs come back in the same padded (B, T) layout as the padded path's."""
    device = compute_device(model)
    inputs = {k: v.to(device) for k, v in batch_inputs.items()}
    labels = response_ids.to(device)  # (B, T)
    if "response_lens" not in inputs:  # padded: every response starts at the same column, keep the last T + 1 positions
        # (the state at the last position predicts nothing we sampled; the head drops it)
        out = _call_with_head(model, inputs, labels, temperature, with_entropy, entropy_grad, labels.shape[1] + 1)
    else:
        for key in ("prompt_lens", "group_sizes", "response_lens"):
            inputs.pop(key)
        response_lens = batch_inputs["response_lens"]  # (B,), on the host
        types = batch_inputs.get("mm_token_type_ids")
        position_ids, keep, targets, layout = packed_positions(
            model, batch_inputs["input_ids"][0], batch_inputs.get("image_grid_thw"), batch_inputs["prompt_lens"],
            batch_inputs["group_sizes"], response_lens, None if types is None else types[0],
            batch_inputs.get("video_grid_thw"), batch_inputs.get("second_per_grid_ts"),
        )  # fmt: skip
        flat_labels = inputs["input_ids"][:, targets]  # (1, R), R = all response tokens
        # no mask: for one unpadded row this module's attentions build none (_register_attention), which leaves the
        # row to the PackedLayout; flash-attention builds none either (it finds the sequences in the text positions)
        extra = {"position_ids": position_ids, "attention_mask": None, "packed_layout": layout}
        flat = _call_with_head(model, inputs, flat_labels, temperature, with_entropy, entropy_grad, keep, **extra)
        flat = flat[0]  # (R, 1 or 2)
        valid = torch.arange(labels.shape[1], device=device)[None] < response_lens.to(device)[:, None]  # (B, T)
        out = flat.new_zeros(*labels.shape, flat.shape[-1]).masked_scatter(valid[..., None], flat)  # (B, T, 1 or 2)
    logp = out[..., 0]  # (B, T)
    entropy = None
    if with_entropy:
        entropy = out[..., 1] if entropy_grad and torch.is_grad_enabled() else out[..., 1].detach()  # (B, T)
    return logp, entropy


# ----------------------------------------------------------------------------------------------------------------------
# Loading and FSDP2.


VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


def tower_and_layers(model):
    """The FSDP2 units below the root: the vision tower as one unit (Qwen3-VL's deepstack mergers and every patch
    merger live inside it), then each decoder layer (Qwen3.5's linear- and full-attention layers alike)."""
    return [model.model.visual, *model.model.language_model.layers]


@dataclass(frozen=True)
class Family:
    """What differs between the model families this trainer supports; everything else (loading, FSDP2, the packed
    forward, the weight sync) is one code path."""

    fsdp_units: Callable  # model -> the modules sharded as their own FSDP2 units, before the root
    # The side of one merged image token, vision patch x merge, to which data.py fits every image: 28 px for
    # Qwen2.5-VL (14 x 2), 32 px for Qwen3-VL and Qwen3.5 (16 x 2). data.py takes it from the checkpoint's processor,
    # which resizes by that factor; processor_problem stops (at start) a checkpoint whose processor says otherwise.
    image_side: int
    # Layers with a recurrent state (Qwen3.5's gated delta net) would carry it from one packed sequence into the
    # next: their packed forward restarts it per sequence (linear_attention.py).
    linear_attention: bool = False
    # vLLM options the family needs on CPU, where the engine runs without chunked prefill (see rollout.VLLMEngine):
    # vLLM caches Qwen3.5's recurrent state for prefix caching only with chunked prefill ("Chunked prefill is
    # required for mamba cache mode 'align'"), so there its prefix caching is off.
    vllm_cpu_kwargs: dict = field(default_factory=dict)
    # The engine's dtype on CPU, where the trainer computes in fp32. vLLM 0.32's CPU gated-delta-net kernel asserts
    # bf16 ("CPU GDN attention requires BF16"), so a Qwen3.5 engine on CPU samples in bf16 (on GPU all are bf16).
    vllm_cpu_dtype: torch.dtype = torch.float32
    # Sampling one would put an image placeholder into a response: "Image features and image tokens do not match".
    vision_tokens: tuple = VISION_TOKENS
    # Routed experts in every decoder layer (moe.py): 3-D expert parameters, stored in the checkpoint in a layout of
    # their own, computed by transformers' experts_implementation.
    moe: bool = False


# model_type (config.json) -> its Family: the families this trainer knows how to load, shard, pack and sync. The
# in-memory weight names transformers gives the dense three are the ones vLLM's loaders take (their
# hf_to_vllm_mapper maps `model.language_model.` / `model.visual.` / `lm_head.`), so no dense family needs a name
# mapping for the sync. The mixture-of-experts ones are their dense siblings with routed experts in every layer: the
# same FSDP2 units (a decoder layer's unit holds its experts, sharded by expert), positions and vision tokens.
# (Qwen3.5's CPU engine shares no prefix, and vLLM sizes a hybrid model's blocks to its linear-attention state's:
# it keeps vLLM's own block size, not rollout.py's 32)
_QWEN3_5 = dict(
    linear_attention=True,
    vllm_cpu_kwargs={"enable_prefix_caching": False, "block_size": None},
    vllm_cpu_dtype=torch.bfloat16,
)
FAMILIES = {
    "qwen2_5_vl": Family(tower_and_layers, 28),
    "qwen3_vl": Family(tower_and_layers, 32),
    "qwen3_5": Family(tower_and_layers, 32, **_QWEN3_5),
    "qwen3_vl_moe": Family(tower_and_layers, 32, moe=True),
    "qwen3_5_moe": Family(tower_and_layers, 32, **_QWEN3_5, moe=True),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def unsupported_type(model_type) -> str | None:
    """Why a checkpoint of this model_type cannot be trained here, or None."""
    if model_type in SUPPORTED_MODEL_TYPES:
        return None
    return f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"


def family(model) -> Family:
    """The Family of a loaded model (by its config's model_type)."""
    return FAMILIES[model.config.model_type]


def family_of(path: str) -> Family:
    """The Family of the checkpoint at `path` (its config.json only), for those that need it before the model loads:
    the rollout engines. An unsupported model_type stops here too."""
    from transformers import AutoConfig

    model_type = AutoConfig.from_pretrained(path).model_type
    problem = unsupported_type(model_type)
    if problem:
        raise ValueError(f"{path}: {problem}")
    return FAMILIES[model_type]


def processor_problem(path: str, want: int) -> str | None:
    """None if the checkpoint's processor fits images to its family's side (`want`, Family.image_side), else why not: a
    processor of another family beside the weights (a Qwen2.5-VL preprocessor_config.json with Qwen3-VL weights)
    would make image tokens that the vision tower cannot produce."""
    from transformers import AutoImageProcessor

    from data import image_side

    side = image_side(AutoImageProcessor.from_pretrained(path))
    if side != want:
        return f"its image processor fits images to {side} px (patch x merge), its model family's tower to {want}"
    return None


def unsupported_model(path: str, needs_experts: bool = False) -> str | None:
    """Why the checkpoint at `path` (a local directory, or a hub id in the local cache) cannot be trained here, or
    None. from_pretrained would load a checkpoint of another family into one of ours, warn about the weights it
    leaves random, and train the result: this stops first, naming the model_type, or, for a local directory of a
    supported type, the first tensors that are missing or unexpected (the model built on the meta device, the
    safetensors' headers read: seconds even for a large model), or an image processor of another family. A hub id
    not in the cache is checked by load_model, once its files are downloaded. `needs_experts`: the config asks for
    what only a mixture of experts has (actor.router_aux_loss_coef)."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        from huggingface_hub import try_to_load_from_cache

        config_file = try_to_load_from_cache(path, "config.json")
        if not isinstance(config_file, str):
            return None
    if not os.path.exists(config_file):
        return "no config.json: not a Hugging Face model directory"
    with open(config_file) as f:
        model_type = json.load(f).get("model_type")
    problem = unsupported_type(model_type)
    if not problem and needs_experts and not FAMILIES[model_type].moe:
        problem = f"actor.router_aux_loss_coef balances routed experts; a {model_type} model has none"
    if problem or not os.path.isdir(path):
        return problem
    from transformers import AutoConfig, AutoModelForImageTextToText

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path))
    _keep_checkpoint_renaming(model, path)
    return tensor_name_problem(model, path) or processor_problem(path, family(model).image_side)


def load_model(path, device, attn_implementation, gradient_checkpointing=False, dtype=torch.float32, meta=False):
    """The model in `path`, of the class its config.json's model_type names (AutoModelForImageTextToText), with every
    weight read (from_pretrained), or with meta=True its bare structure: built from the config on the meta device, no
    weight read, no memory taken; load_sharded then shards it and reads only this rank's part of each weight. A
    checkpoint whose tensors are not exactly the model's (missing or unexpected ones, the model's own ignore list
    aside) is an error either way: never a half-random model."""
    from transformers import AutoConfig, AutoModelForImageTextToText, GenerationConfig

    attn_implementation = resolve_attention(attn_implementation, device)
    config = AutoConfig.from_pretrained(path)  # (a hub model's config.json is downloaded here, if it was not cached)
    problem = unsupported_type(config.model_type)  # never load it into another class with weights left random
    if problem:
        raise ValueError(f"{path}: {problem}")
    if meta:
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(
                config, dtype=dtype, attn_implementation=attn_implementation
            )
        try:  # the stop tokens, which from_pretrained reads too (and likewise goes on without)
            model.generation_config = GenerationConfig.from_pretrained(path)
        except OSError:
            pass
        _keep_checkpoint_renaming(model, path)
    else:
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
        if family(model).moe:  # from_pretrained converted the experts; keep how they lie in the files, for the export
            _keep_checkpoint_renaming(model, path)
    problem = tensor_name_problem(model, path)
    if problem:
        raise ValueError(f"{path}: {problem}")
    if family(model).moe:
        model.set_experts_implementation(moe.experts_implementation(device))
    if family(model).linear_attention:
        use_packed_forward(model)
    text_after_vision_continues(model)
    use_varlen_in_vision_tower(model)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model


def _keep_checkpoint_renaming(model, path):
    """transformers 5 renames a checkpoint's tensors as it loads them (Qwen2.5-VL: `model.layers.*` ->
    `model.language_model.layers.*`, `visual.*` -> `model.visual.*`) and keeps the renamings that matched as
    `model._weight_conversions`, from which save_pretrained writes the original names back. Do the same for a model
    built on the meta device, while it still has its own class (fully_shard changes it, and the renamings are found
    by class name); load_weights and checkpoint.save_hf then use them in either direction."""
    from safetensors import safe_open
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    # an MoE's experts are converted too (transposed, or stacked from per-expert tensors): moe.py reads and writes
    # them itself, from a rank's own rows; any other conversion is a reshape this loader does not know
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    others = [t for t in transforms if not isinstance(t, WeightRenaming) and not _converts_experts(t)]
    if others:
        raise NotImplementedError(f"{type(model).__name__}: its checkpoint needs conversions beyond renaming")
    shapes = {}  # the checkpoint's tensors, renamed, -> their shapes
    for file in _safetensors_files(path):
        with safe_open(file, "pt") as f:
            for key in f.keys():  # (renaming marks the renamings that apply)
                shapes[rename_source_key(key, renamings, [])[0]] = tuple(f.get_slice(key).get_shape())
    model._weight_conversions = [t for t in renamings if t.was_used()]
    # an MoE's expert parameters -> how the files hold them (those the files lack, or hold in another shape, are
    # left out: tensor_name_problem or load_weights names them)
    layouts = {
        name: moe.layout(name, p.shape, shapes) for name, p in model.named_parameters() if moe.EXPERT_PARAM.match(name)
    }
    model._expert_layouts = {name: kind for name, kind in layouts.items() if kind is not None}


def _converts_experts(transform) -> bool:
    """Whether a transformers WeightConverter is one of those that build the 3-D expert parameters (their target
    is `experts.gate_up_proj` or `experts.down_proj`)."""
    return all(re.search(r"experts\.(gate_up_proj|down_proj)$", t) for t in transform.target_patterns)


def tensor_name_problem(model, path) -> str | None:
    """None if the checkpoint's tensors (renamed as transformers renames them) are exactly the model's, else why not:
    a missing one would stay random, an unexpected one means another architecture (a Qwen3-VL's deepstack mergers
    and q/k norms in a Qwen2.5-VL class). Tensors the model class itself declares ignorable are allowed: Qwen3.5
    checkpoints carry multi-token-prediction weights (`mtp.*`) that transformers does not use. Reads the files'
    headers only."""
    from safetensors import safe_open
    from transformers.core_model_loading import rename_source_key

    names = set()
    for file in _safetensors_files(path):
        with safe_open(file, "pt") as f:
            names.update(moe.model_name(rename_source_key(key, model._weight_conversions, [])[0]) for key in f.keys())
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    # state_dict names a tied weight under both its names; named_parameters once (3B's lm_head is embed_tokens, and
    # its files hold only the latter)
    unexpected = sorted(n for n in names - set(model.state_dict()) if not any(p.search(n) for p in ignored))
    missing = sorted(set(dict(model.named_parameters())) - names)
    for what, found in (("unexpected", unexpected), ("missing", missing)):
        if found:
            return (
                f"{len(found)} {what} tensors for {type(model).__name__} ({model.config.model_type}): "
                f"{', '.join(found[:5])}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
    return None


def _safetensors_files(path):
    """The weight files from_pretrained reads: those model.safetensors.index.json names, or model.safetensors."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return sorted({os.path.join(path, name) for name in json.load(f)["weight_map"].values()})
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    return [os.path.join(path, "model.safetensors")]


def mixed_precision(device) -> bool:
    """Whether FSDP2 computes in bf16 (and frozen weights are kept in it): on CUDA; the CPU lane computes in fp32.
    (One place, so a CPU test can run the GPU's dtype path.)"""
    return device.type == "cuda"


def apply_fsdp(model, device, offload=False):
    """FSDP2: the vision tower as one unit, then each decoder layer, then the root. A model built on the meta
    device (load_model(meta=True)) gets only this rank's shards allocated, uninitialised: load_weights fills them."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs = {}
    if mixed_precision(device):
        # bf16 compute, fp32 gradient reduction: the update of lr 1e-6 would vanish in bf16 sums (with bf16 master
        # weights, actor.master_dtype=bf16, FSDP2 then casts each reduced shard back to bf16)
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif any(p.requires_grad and p.dtype == torch.bfloat16 for p in model.parameters()):
        # bf16 masters on the CPU lane, which computes in fp32 (bf16 matmuls are slow on most CPUs): gathered into
        # fp32, gradients reduced in fp32, each shard's cast back to bf16
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for unit in family(model).fsdp_units(model):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    add_vision_dummy(model)
    if next(model.parameters()).is_meta:
        model.to_empty(device="cpu" if offload else device)
    elif not offload:
        model.to(device)
    return model


def _tensors(out) -> list[torch.Tensor]:
    """Every tensor in a vision tower's output (Qwen3-VL's holds deepstack feature lists beside the embeds)."""
    if isinstance(out, torch.Tensor):
        return [out]
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (list, tuple)) else []
    return [t for v in values for t in _tensors(v)]


def vision_dummy(model):
    """The vision tower's output for one minimal blank image (one merged token): see add_vision_dummy."""
    tower = model.model.visual
    side = tower.config.spatial_merge_size  # a grid of merge x merge patches: the smallest the merger accepts
    patch_dim = tower.config.in_channels * tower.config.temporal_patch_size * tower.config.patch_size**2
    device = compute_device(model)
    pixels = torch.zeros(side * side, patch_dim, device=device)  # (patches, C * T * P * P)
    return tower(pixels, grid_thw=torch.tensor([[1, side, side]], device=device))


def generate_encodes_images_first(model) -> bool:
    """Whether HF `generate` runs the vision tower before its prefill, outside the model's forward (transformers 5.19
    does for models whose forward takes `mm_encoder_outputs`), rather than inside the prefill's forward."""
    return "mm_encoder_outputs" in inspect.signature(model.forward).parameters


def encode_vision(model, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw) -> dict:
    """{"image": ..., "video": ...}: what the model's get_image_features and get_video_features return for a forward's
    images and videos, from ONE tower pass over both. The model's own forward runs the tower once for the images and
    once more for the videos: two FSDP2 all-gathers on a rank whose micro-batch has both, one on a rank with only
    either, and the collectives fall out of step (see add_vision_dummy). The tower treats every image and video as
    its own sequence (its attention is bounded by each one's grid), so one pass over all of them gives what two
    passes would."""
    inner = model.model
    grids = torch.cat([image_grid_thw, video_grid_thw])  # (images + videos, 3)
    out = type(inner).get_image_features(inner, torch.cat([pixel_values, pixel_values_videos]), grids, return_dict=True)
    n, tokens = len(image_grid_thw), int(image_grid_thw.prod(-1).sum()) // inner.visual.spatial_merge_size**2
    split = {}
    for name, items, rows in (("image", slice(0, n), slice(0, tokens)), ("video", slice(n, None), slice(tokens, None))):
        part = type(out)(**out)
        part.pooler_output = out.pooler_output[items]  # a tuple of per-item embeddings
        if getattr(out, "deepstack_features", None) is not None:  # Qwen3-VL: per layer, split per item (5.19) or not
            part.deepstack_features = [f[rows] if torch.is_tensor(f) else f[items] for f in out.deepstack_features]
        split[name] = part
    return split


@contextlib.contextmanager
def one_vision_pass(model, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw):
    """Within it, the model's get_image_features and get_video_features return the two halves of one tower pass over
    the images and videos (encode_vision) instead of running the tower each. Overriding the two methods on the
    instance leaves the model's forward and generate on their own paths, which differ between transformers 5.17 and
    5.19 (only 5.19 takes precomputed `mm_encoder_outputs`)."""
    inner = model.model
    encoded = encode_vision(model, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)
    # named as the methods' own arguments: 5.19's generate looks for them to decide what to encode before its prefill
    inner.get_image_features = lambda pixel_values=None, image_grid_thw=None, **kwargs: encoded["image"]
    inner.get_video_features = lambda pixel_values_videos=None, video_grid_thw=None, **kwargs: encoded["video"]
    try:
        yield
    finally:
        del inner.get_image_features, inner.get_video_features


def add_vision_dummy(model):
    """Make every forward that starts sequences (a training or log-prob forward, a prefill) run the vision tower
    exactly once, whatever it holds: images, videos, both or neither. The tower is its own FSDP2 unit: a forward with
    images all-gathers its shards (and its backward reduce-scatters its gradients), one without never does, so a rank
    whose micro-batch, log-prob chunk or generate call holds only text while another's holds images falls out of step
    in the collectives, and the job hangs (an abort, "collective mismatch", on gloo). EasyR1 #468, fixed the same way
    (#518/#530). A forward with images and videos gets both encoded in one tower pass (encode_vision); one with
    videos only runs the tower on them, as one with images only does.

    Without images or videos the tower runs on one minimal blank image (vision_dummy) and its output, times zero, is
    added to the decoder's output: log-probs are unchanged and autograd reaches the tower with zero gradients, so its
    backward (the gradient reduce-scatter) runs on every rank too, and the data-parallel mean is the one without the
    dummy.
    Decided locally, from the forward's own inputs, rather than by an all-reduce: no collective is added, and no
    dummy runs at all when every rank has images. The price is one small tower pass (and its all-gather) per
    text-only forward. Decode steps never run the tower (generate drops the pixels after the prefill), and a prefill
    whose images generate encoded beforehand (`mm_encoder_outputs` given, even empty) is left to the caller:
    rollout.HFEngine runs vision_dummy itself before such a generate call, where generate would run the tower."""
    pending, passes = [], []

    def before(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        starts = cache is None or cache.get_seq_length() == 0
        images, videos = kwargs.get("pixel_values"), kwargs.get("pixel_values_videos")
        if images is not None and videos is not None and "get_image_features" not in vars(model.model):
            one_pass = one_vision_pass(model, images, kwargs["image_grid_thw"], videos, kwargs["video_grid_thw"])
            one_pass.__enter__()
            passes.append(one_pass)
        if images is None and videos is None and kwargs.get("mm_encoder_outputs") is None and starts:
            pending.append(vision_dummy(model))

    def after(module, args, kwargs, out):
        if passes:
            passes.pop().__exit__(None, None, None)
        if pending:
            hidden = out.last_hidden_state
            zero = sum(t.float().sum() for t in _tensors(pending.pop())) * 0.0
            out.last_hidden_state = hidden + zero.to(hidden.device, hidden.dtype)
        return out

    model.model.register_forward_pre_hook(before, with_kwargs=True)
    model.model.register_forward_hook(after, with_kwargs=True)


def load_weights(model, path, device):
    """Fill a model from load_model(meta=True) + apply_fsdp with the weights in `path`'s safetensors (one file or an
    index of several). Each rank reads only the rows of its own shards, one weight at a time, converting them to the
    model's dtype as it copies them in: a rank never holds more than its shards plus one slice. A tensor the files
    lack, or of another shape, is an error: never a half-random model. Not collective: no rank waits for another.

    FSDP2 shards dim 0 as torch.chunk does: rank r holds rows [r * c, r * c + its length), c = ceil(rows / ranks),
    the last ranks fewer or none. The file is opened afresh for each weight: memory-mapped pages that stay mapped
    count in the rank's resident memory, and read-ahead would map most of a file kept open (torch.distributed
    .checkpoint's HuggingFaceStorageReader does the same slicing with each file open throughout: here its peak was
    0.35x the fp32 model higher)."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, Shard
    from transformers.core_model_loading import rename_source_key

    where = {}  # the model's name for each tensor -> (file, the tensor's name there)
    for file in _safetensors_files(path):
        with safe_open(file, "pt") as f:
            where.update({rename_source_key(key, model._weight_conversions, [])[0]: (file, key) for key in f.keys()})
    experts = getattr(model, "_expert_layouts", {})  # an MoE's expert parameters -> their checkpoint layout (moe.py)

    def read(key, start=None, stop=None):  # rows [start, stop) of the checkpoint's tensor `key`, or all of it
        file, name = where[key]
        with safe_open(file, "pt") as f:
            return f.get_slice(name)[start:stop]

    # tied weights once (3B's lm_head is embed_tokens, not in its files); LoRA factors are not in the files either:
    # init_lora fills them. A LoRA-wrapped layer's weight is its base_layer's (PEFT's name), the file's plain one.
    params = {name: p for name, p in model.named_parameters() if not is_lora_factor(name)}
    missing = [base_name(name) for name in params if base_name(name) not in where and base_name(name) not in experts]
    if missing:
        raise ValueError(
            f"{path}: the safetensors lack {len(missing)} of the model's tensors: {', '.join(missing[:5])}"
        )
    with torch.no_grad():
        for name, p in params.items():
            local, start = p, 0
            if isinstance(p, DTensor):
                assert p.placements == (Shard(0),), f"{name}: FSDP2 placement {p.placements}, expected (Shard(0),)"
                local = p.to_local()
                start = min(p.device_mesh.get_local_rank() * -(-p.shape[0] // p.device_mesh.size()), p.shape[0])
            if base_name(name) in experts:  # this rank's experts, whatever the checkpoint's layout
                if local.shape[0]:
                    local.copy_(moe.read_experts(base_name(name), experts[base_name(name)], read, start,
                                                 start + local.shape[0]))  # fmt: skip
                continue
            file, key = where[base_name(name)]
            with safe_open(file, "pt") as f:
                rows = f.get_slice(key)
                if tuple(rows.get_shape()) != tuple(p.shape):
                    raise ValueError(f"{file}: {key} has shape {rows.get_shape()}, the model's {name} {tuple(p.shape)}")
                local.copy_(rows[start : start + local.shape[0]])
    _recompute_buffers(model, device)
    return model


def _recompute_buffers(model, device):
    """Buffers that are not saved (the rotary inv_freq of the text model and of the vision tower) are computed when a
    module is built; on the meta device they were not, and to_empty left garbage. Build each module that owns one
    again, on the CPU from its config, and take its values (on the compute device, also when parameters are
    offloaded)."""
    for name, module in model.named_modules():
        buffers = [b for b in module._non_persistent_buffers_set if getattr(module, b, None) is not None]
        if not buffers:
            continue
        if not hasattr(module, "config"):
            raise NotImplementedError(f"{name} ({type(module).__name__}): cannot recompute buffers {buffers}")
        fresh = type(module)(module.config)
        for b in buffers:
            setattr(module, b, getattr(fresh, b).to(device=device, dtype=getattr(module, b).dtype))


def load_sharded(path, device, attn_implementation, gradient_checkpointing=False, dtype=torch.float32, offload=False,
                 freeze_vision_tower=False, lora=None):  # fmt: skip
    """The model in `path`, sharded with FSDP2, without any rank ever holding all of it: built on the meta device,
    wrapped by apply_fsdp (only this rank's shards allocated), then filled from the safetensors (load_weights).
    `lora` (a peft LoraConfig, lora_config()): adapters injected before sharding, so each lives in its layer's FSDP2
    unit and the units stay those of full fine-tuning; everything else frozen; the adapters initialised by init_lora
    and kept in fp32 whatever `dtype` the frozen base has."""
    model = load_model(path, device, attn_implementation, gradient_checkpointing, dtype, meta=True)
    if freeze_vision_tower:
        model.model.visual.requires_grad_(False)
    if lora is not None:
        add_lora(model, lora)
        # The adapters train in fp32 (AdamW steps of lr 1e-6 vanish in bf16) beside a base that may be bf16: FSDP2
        # asks one dtype of a unit's trainable parameters only, and gathers both in bf16 for compute on GPU
        for layer in lora_layers(model).values():
            layer.lora_A.float(), layer.lora_B.float()
    apply_fsdp(model, device, offload)
    load_weights(model, path, device)
    if lora is not None:
        init_lora(model)
    return model


def compute_device(model) -> torch.device:
    """The device `model`'s forwards run on. For an FSDP2 model that is its mesh's device, not where its parameters
    live: with CPUOffloadPolicy (actor.ref_offload) the shards sit in host memory and FSDP2 moves them, and a
    forward's tensor arguments, to the GPU; tensors a forward builds itself (labels, sequence bounds, index tensors)
    must be created there too."""
    p = next(model.parameters())
    mesh = getattr(p, "device_mesh", None)
    if mesh is None or mesh.device_type == "cpu":
        return p.device
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def root_forward(model, pad_id):
    """FSDP2 initialises lazily at the first forward of the root; generate() calls model.visual first, which would
    make the tower its own root ("FSDP state has already been lazily initialized"). One tiny root forward fixes it."""
    device = compute_device(model)
    with torch.no_grad():
        model(input_ids=torch.tensor([[pad_id]], device=device), use_cache=False)
    model.reshard()


def reshard(*models):
    """FSDP2 keeps the root module's parameters unsharded after a forward that has no backward (generate, no-grad
    log-probs). Until resharded, `model.parameters()` yields those temporary full tensors, not the DTensor shards the
    optimizer owns: an optimizer built then would update copies that the next all-gather throws away."""
    for m in models:
        if m is not None:
            m.reshard()


def load_policy_and_reference(actor, device, with_reference, pad_id):
    """The trainable policy (master weights in actor.master_dtype: fp32, or bf16 for optim.AdamWBF16) and, when the
    KL needs one, the frozen reference (the same checkpoint, in the compute dtype: bf16 on GPU, fp32 on CPU; it is
    never updated, so it needs no fp32 copy), both sharded and past their first root forward. `actor` is the config's
    actor section. Each rank holds its shards of the two models and, while loading, one slice of a weight at a time
    (load_sharded).

    With LoRA (actor.lora_rank > 0) the reference is the policy itself: its frozen base is the initial policy, so the
    reference log-probs are the policy's with the adapters switched off (adapters_disabled), and no second model is
    loaded. The caller tells the two apart by identity (`ref_model is model`). Nothing updates that base either, so
    it is kept in the compute dtype too, and only the adapters in fp32."""
    lora = lora_config(actor) if actor.lora_rank > 0 else None
    compute_dtype = torch.bfloat16 if mixed_precision(device) else torch.float32
    master_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[actor.master_dtype]  # AdamW's weights
    # With LoRA nothing updates the base: it needs no fp32 master copy, only the adapters do (half the weights' memory
    # on GPU; FSDP2 gathers both in bf16 for compute, as it gathers the fp32 masters of full fine-tuning)
    model = load_sharded(
        actor.model_path, device, actor.attn_implementation, actor.gradient_checkpointing,
        dtype=compute_dtype if lora is not None else master_dtype, freeze_vision_tower=actor.freeze_vision_tower,
        lora=lora,
    )  # fmt: skip
    root_forward(model, pad_id)
    if family(model).moe and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        print(moe.describe(model), flush=True)
    if actor.router_aux_loss_coef > 0:  # the update adds it: model.router_balance.loss() after each forward
        model.router_balance = moe.RouterBalance(model)
    ref_model = None
    if with_reference and lora is not None:
        ref_model = model
    elif with_reference:
        ref_model = load_sharded(
            actor.model_path, device, actor.attn_implementation, dtype=compute_dtype, offload=actor.ref_offload
        )
        ref_model.requires_grad_(False).eval()
        root_forward(ref_model, pad_id)
    return model, ref_model
