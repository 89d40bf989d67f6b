"""Packed attention: attention functions that keep a packed row's sequences apart, shared prefixes included, so a
micro-batch can run as one row without padding. One PackedLayout per micro-batch says where the segments lie;
sdpa_packed runs over it on CPU, varlen_packed (PyTorch's flash varlen kernel, no flash-attn build) on CUDA, also for
the vision tower's images and windows. They are registered with transformers under their names (resolve_attention
picks one), so the model's own forward calls them. Qwen3.5's linear-attention layers are in linear_attention.py.
"""

from __future__ import annotations

import functools
import inspect

import torch

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
    when a segment has no prefix. A segment's positions count from its prefix's start (from its own without one), as
    the sequence has them alone. blocks: None, or (length,) the bidirectional block of each row token (-1: none):
    in a sliding-window layer a query of a block also sees the block's later tokens (Gemma 4's images, with
    use_bidirectional_attention="vision"; its full-attention layers stay causal)."""

    def __init__(self, segments, length, device, blocks=None):
        self.segments, self.length, self.device = segments, length, device
        self.blocks = None if blocks is None or not (blocks >= 0).any() else blocks
        self._masks, self._varlen = {}, None  # the masks per sliding window (None: none)
        self._linear = None  # linear_attention.plan
        # (fn, module, query, key, value, mask, **kwargs) -> attention output: what a packed attention call runs
        # instead of `fn` itself, when the row is cut over ranks (sequence_parallel.ulysses_attention); None: `fn`
        self.around = None

    @classmethod
    def sequences(cls, seq_lens, device):
        """The plain packed layout: whole sequences back to back, no prefixes."""
        bounds = [0, *torch.as_tensor(seq_lens).cumsum(0).tolist()]
        return cls([(s, e, 0, 0) for s, e in zip(bounds[:-1], bounds[1:])], bounds[-1], device)

    def bidirectional(self, window) -> bool:
        """Whether a layer with this sliding window (None: a full-attention layer) has bidirectional blocks here."""
        return window is not None and self.blocks is not None

    def prefix_masks(self, window=None):
        """Per segment, None (plain causal attention over itself) or the (1, 1, n, prefix + n) bool mask of its
        queries over [its prefix | itself]: the whole prefix, then causal -- the bottom-right-aligned causal mask --
        within `window` tokens of each query's position (kv > q - window, transformers' sliding window), and, in a
        sliding layer, a block's queries over the rest of their block."""
        if window not in self._masks:
            masks = []
            for s, e, ps, pe in self.segments:
                n, p = e - s, pe - ps
                q_pos, k_pos = torch.arange(p, p + n)[:, None], torch.arange(p + n)[None]  # (n, 1), (1, p + n)
                mask, plain = k_pos <= q_pos, not p  # (n, p + n)
                if window is not None and p + n > window:
                    mask, plain = mask & (k_pos > q_pos - window), False
                if self.bidirectional(window):
                    own = self.blocks[s:e]
                    keys = torch.cat([self.blocks[ps:pe], own])
                    block = (own[:, None] == keys[None]) & (own[:, None] >= 0)
                    if block.any():
                        mask = mask | (block & (k_pos > q_pos - (window or n + p)))
                        plain = False
                masks.append(None if plain else mask.to(self.device)[None, None])
            self._masks[window] = masks
        return self._masks[window]

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
    [its prompt | itself] through its PackedLayout.prefix_masks mask, the keys the varlen kernel gets on CUDA; a
    sliding-window layer (transformers passes its `sliding_window`) within its window. One call with a mask over the
    whole row would cost L^2 instead of the sum over segments: 3-5x slower at the CPU demo's sizes, Python's loop
    included. Every other call (padded batches, generate, the vision tower) is plain transformers sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layout = packed_layout(module, attention_mask, query, key, position_ids, kwargs)
    if layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return _segments_sdpa(module, query, key, value, layout, **kwargs)


def _segments_sdpa(module, query, key, value, layout, sliding_window=None, **kwargs):
    """A packed row's attention a segment at a time, each with its PackedLayout mask: (1, L, Hq, D)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    outs = []
    for (s, e, ps, pe), mask in zip(layout.segments, layout.prefix_masks(sliding_window)):
        k, v = key[:, :, s:e], value[:, :, s:e]
        if pe > ps:
            k, v = torch.cat([key[:, :, ps:pe], k], dim=2), torch.cat([value[:, :, ps:pe], v], dim=2)
        outs.append(sdpa_attention_forward(module, query[:, :, s:e], k, v, mask, **kwargs)[0])  # (1, n, heads, D)
    return torch.cat(outs, dim=1), None


# Flash-attention's kernels, PyTorch's varlen one among them, take heads of at most 256 dims: Gemma 4's full-attention
# layers have 512 (global_head_dim), which go through sdpa a segment at a time instead.
FLASH_MAX_HEAD_DIM = 256


def varlen_kernel(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=None):
    """PyTorch's flash-attention varlen kernel, forward and backward (CUDA only; bf16/fp16). q (Lq, Hq, D), k and v
    (Lk, Hkv, D); sequence i is q rows cu_q[i]:cu_q[i+1] against k rows cu_k[i]:cu_k[i+1]. Grouped-query heads are
    handled by the kernel itself, without repeating k and v. `window` (causal only): a query sees the keys less than
    `window` positions before its own, as transformers' sliding window does. Tests swap in a CPU reference."""
    from torch.nn.attention.varlen import varlen_attn

    # (-1, 0) is how varlen_attn spells causal (bottom-right aligned); (W - 1, 0) keeps W keys, the query's own
    # included (flash-attention's left window counts the keys before the query's)
    window_size = ((-1 if window is None else window - 1), 0) if causal else (-1, -1)
    kwargs = {"scale": scale, "window_size": window_size}
    # torch 2.13 added enable_gqa; 2.11 has no such keyword (a TypeError at the first call). Flash-attention's varlen
    # kernel needs only that the query heads be a multiple of the key/value heads, so without it GQA is still right.
    if _varlen_takes_gqa(varlen_attn):
        kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


@functools.cache
def _varlen_takes_gqa(fn) -> bool:
    return "enable_gqa" in inspect.signature(fn).parameters


def varlen_packed(module, query, key, value, attention_mask, position_ids=None, **kwargs):
    """Attention for CUDA without flash-attn: packed rows (the decoder, causal, shared prefixes and sliding windows
    included) and the vision tower's images and windows (full attention, bounds from the tower) through one varlen
    kernel call per layer; every other call (padded batches, generate) is plain sdpa, and so, a segment at a time, is
    a packed layer the kernel cannot take (heads over FLASH_MAX_HEAD_DIM, or bidirectional image blocks).
    query (1, Hq, L, D), key/value (1, Hkv, L, D) -> (1, L, Hq, D)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    scale = kwargs.get("scaling")
    if kwargs.get("cu_seq_lens_q") is not None:  # the vision tower (under VISION_VARLEN): full attention per chunk
        # Contiguous (L, heads, D), what every backend of varlen_attn takes: torch 2.14 sends full attention with
        # equal heads and max_q > 128 on sm90/sm100 to cuDNN (varlen.py _can_use_cudnn), and the vision tower's v is
        # a strided view of its fused qkv there
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
        cu, max_len = kwargs["cu_seq_lens_q"].to(torch.int32), int(kwargs["max_length_q"])
        return varlen_kernel(q, k, v, cu, cu, max_len, max_len, False, scale).unsqueeze(0), None
    layout = packed_layout(module, attention_mask, query, key, position_ids, kwargs)
    if layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    window = kwargs.get("sliding_window")
    if query.shape[-1] > FLASH_MAX_HEAD_DIM or layout.bidirectional(window):
        return _segments_sdpa(module, query, key, value, layout, **kwargs)
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # (L, heads, D); the decoder's: no copy
    key_index, cu_q, cu_k, max_q, max_k = layout.varlen_args()
    if key_index is not None:  # each answer's keys: its group's prompt, then itself
        k, v = k[key_index], v[key_index]  # (K, Hkv, D); backward adds the prompt's key gradients up
    out = varlen_kernel(q, k, v, cu_q, cu_k, max_q, max_k, True, scale, window)
    return out.unsqueeze(0), None  # (1, L, Hq, D)


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
        AttentionInterface.register(name, _around(fn))
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, own_mask)


def _around(fn):
    """`fn`, or its layout's `around` of it: a row cut over sequence-parallel ranks needs an all-to-all on each side."""

    @functools.wraps(fn)
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        around = getattr(kwargs.get("packed_layout"), "around", None)
        if around is not None:
            return around(fn, module, query, key, value, attention_mask, *args, **kwargs)
        return fn(module, query, key, value, attention_mask, *args, **kwargs)

    return attention


def use_varlen_in_vision_tower(model):
    """Point the vision tower at varlen_packed under its flash-style name (see VISION_VARLEN), so it makes one
    kernel call per layer for all images and windows instead of a Python loop over them."""
    # (Qwen's and GLM's towers, model.visual; Gemma 4's keeps its own attention over its padded patches)
    if model.config._attn_implementation == "varlen_packed" and hasattr(model.model, "visual"):
        model.model.visual.config._attn_implementation = VISION_VARLEN
