"""Sequence parallelism (actor.sequence_parallel_size): groups of that many ranks share each packed sequence of the
training forward (old and reference log-probs, the update), so a sequence longer than one GPU's activations hold
still trains. Ulysses (arXiv:2309.14509): each rank of a group holds a contiguous 1/size of the row; around every
attention call an all-to-all turns [its tokens, all heads] into [all tokens, its heads] and back, so attention itself
(the packed varlen/sdpa of attention.py, shared prefixes included) runs unchanged on whole sequences.

What is cut, and where:
- the row after the vision merge: a pre-hook on the language model cuts the merged embeddings, the mRoPE position
  ids (4, 1, L) and Qwen3-VL's deepstack inputs (the rows of the vision tokens in the slice), and swaps the packed
  layout for the padded whole-row one (padding to a multiple of size is its own segment, never attended to by a
  real token); Qwen3.5's linear-attention layers, whose state runs through the sequence, gather the row back
  (whole_sequence);
- the LM head and log-probs: each rank keeps only the hidden states of its own slice (logits_to_keep), so the
  chunked head runs on its share; the (log-prob, entropy) rows are all-gathered in the order forward_logprobs wants,
  their backward keeping each rank's own rows (every rank of a group computes the same loss from them);
- the vision tower split by temporal patch: each rank encodes a contiguous run of about 1/size of the forward's
  patches in one tower pass, a clip cut between its temporal patches (each its own attention segment in the
  towers, so the pieces encode as the whole clip does), an image whole; the group all-gathers the embeddings, whose
  backward sums the group's gradients and hands each rank its own pieces' (so nothing is encoded twice, and each
  patch's encoder gets its whole gradient).

Data: every rank of a group must run the same micro-batches, so the group's samples are gathered onto each of its
ranks (share_group); data parallelism is over groups. A token then sits on size ranks' lists but in one rank's
slice, so the loss is still the sum over all tokens once: the trainer's normalisation (token totals divided by size)
and FSDP2's gradient average over all ranks give the gradient of size 1.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as dist

from grpo.attention import PackedLayout

_GROUPS: dict[int, tuple] = {}  # size -> (this rank's group, the group of ranks at its place in every group)


def groups(size: int):
    """(group, across): this rank's sequence-parallel group (ranks [g*size, (g+1)*size)) and the ranks at the same
    place in every group (the data-parallel peers). Collective the first time for a size: every rank creates every
    group, in the same order."""
    if size not in _GROUPS:
        world, rank = dist.get_world_size(), dist.get_rank()
        mine = across = None
        for g in range(world // size):
            group = dist.new_group(list(range(g * size, (g + 1) * size)))
            mine = group if rank // size == g else mine
        for j in range(size):
            group = dist.new_group(list(range(j, world, size)))
            across = group if rank % size == j else across
        _GROUPS[size] = (mine, across)
    return _GROUPS[size]


class SequenceParallel:
    """What a model's forward needs to cut its sequences over a group: attached to the model as
    `model.sequence_parallel` (attach), read by logprobs.forward_logprobs."""

    def __init__(self, size: int):
        self.size = size
        self.group, self.across = groups(size)
        self.rank = dist.get_rank(self.group)


def attach(model, size: int) -> None:
    """Give `model` its sequence-parallel group (size > 1) and the hooks that cut its language model's input."""
    if size <= 1:
        return
    model.sequence_parallel = SequenceParallel(size)
    model.model.language_model.register_forward_pre_hook(_cut_input, with_kwargs=True)


def of(model) -> SequenceParallel | None:
    return getattr(model, "sequence_parallel", None)


# ----------------------------------------------------------------------------------------------------------------------
# Collectives with their autograd.


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Split `x` into size chunks along scatter_dim, send chunk j to rank j, concatenate what comes back along
    gather_dim (in rank order). Its backward is the reverse all-to-all."""
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _exchange(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def _exchange(x, scatter_dim, gather_dim, group):
    size = dist.get_world_size(group)
    chunks = [c.contiguous() for c in x.chunk(size, scatter_dim)]
    out = [torch.empty_like(chunks[0]) for _ in range(size)]
    dist.all_to_all(out, chunks, group=group)
    return torch.cat(out, gather_dim)


def gather_rows(x: torch.Tensor, counts: list[int], group, sum_grads: bool) -> torch.Tensor:
    """All-gather each rank's rows x (counts[rank], ...) into (sum(counts), ...), in rank order. Backward: a rank
    keeps the gradient of its own rows, after summing it over the group when `sum_grads` (each rank used the gathered
    rows for its own slice only: the vision embeddings) or as it is (every rank computed the same loss from them:
    the head's output)."""
    return _GatherRows.apply(x, counts, group, sum_grads)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts, group, sum_grads):
        rank = dist.get_rank(group)
        ctx.group, ctx.sum_grads, ctx.rows = group, sum_grads, (sum(counts[:rank]), sum(counts[: rank + 1]))
        width = max(max(counts), 1)  # all_gather wants equal shapes: pad to the longest
        padded = x.new_zeros(width, *x.shape[1:])
        padded[: len(x)] = x
        out = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(out, padded, group=group)
        return torch.cat([o[:c] for o, c in zip(out, counts)])

    @staticmethod
    def backward(ctx, grad):
        if ctx.sum_grads:
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rows[0] : ctx.rows[1]], None, None, None


# ----------------------------------------------------------------------------------------------------------------------
# The cut of a packed row, and attention over it.


def slice_bounds(length: int, size: int, rank: int) -> tuple[int, int, int]:
    """(padded length, start, end) of rank's slice of a row of `length` tokens padded to a multiple of size."""
    padded = math.ceil(length / size) * size
    step = padded // size
    return padded, rank * step, (rank + 1) * step


def split_layout(layout: PackedLayout, size: int) -> PackedLayout:
    """The whole row's layout padded to a multiple of size: the padding is one more segment of its own."""
    padded = math.ceil(layout.length / size) * size
    segments = list(layout.segments) + ([(layout.length, padded, 0, 0)] if padded > layout.length else [])
    out = PackedLayout(segments, padded, layout.device)
    out.around = ulysses_attention  # attention.py's packed attentions run through it
    return out


def cut_positions(position_ids: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    """position_ids (..., L) -> this rank's slice of them padded to a multiple of size (the padding at position 0)."""
    padded, start, end = slice_bounds(position_ids.shape[-1], size, rank)
    pad = position_ids.new_zeros(*position_ids.shape[:-1], padded - position_ids.shape[-1])
    return torch.cat([position_ids, pad], -1)[..., start:end]


def _cut_input(module, args, kwargs):
    """Pre-hook of the language model: inputs_embeds (1, L, H) and position_ids (4, 1, L) of the whole merged row ->
    this rank's slice, and the whole row's padded layout, whose ulysses attention gathers the heads' full sequences."""
    layout = kwargs.get("packed_layout")
    sp = getattr(layout, "sequence_parallel", None)
    if sp is None:  # not a packed training forward (generate never runs a cut model)
        return args, kwargs
    embeds = kwargs["inputs_embeds"]  # (1, L, H)
    padded, start, end = slice_bounds(embeds.shape[1], sp.size, sp.rank)
    embeds = torch.cat([embeds, embeds.new_zeros(1, padded - embeds.shape[1], embeds.shape[2])], 1)
    kwargs["inputs_embeds"] = embeds[:, start:end]  # (1, L / size, H)
    kwargs["position_ids"] = cut_positions(kwargs["position_ids"], sp.size, sp.rank)  # (4, 1, L / size)
    if kwargs.get("deepstack_visual_embeds") is not None:  # Qwen3-VL: the vision tokens' rows in this slice
        mask = kwargs["visual_pos_masks"]  # (1, L)
        mask = torch.cat([mask, mask.new_zeros(1, padded - mask.shape[1])], 1)
        before, inside = int(mask[:, :start].sum()), int(mask[:, start:end].sum())
        kwargs["visual_pos_masks"] = mask[:, start:end]
        kwargs["deepstack_visual_embeds"] = [e[before : before + inside] for e in kwargs["deepstack_visual_embeds"]]
    split = split_layout(layout, sp.size)
    split.sequence_parallel = sp
    kwargs["packed_layout"] = split
    return args, kwargs


def kv_repeats(kv_heads: int, size: int) -> int:
    """How many times each key/value head is repeated before the all-to-all so that each of size ranks gets whole
    key/value heads for its 1/size of the query heads: the fewest r with size dividing kv_heads x r,
    size / gcd(kv_heads, size). (size divides the query heads, and so do the key/value heads: their lcm, kv_heads x r,
    does too, and a repeated head still serves a contiguous run of query heads.) 1 when size divides them; for
    4 key/value heads at size 8, 2: 8 heads sent where repeating up to the 32 query heads would send four times as
    many."""
    return size // math.gcd(kv_heads, size)


def ulysses_attention(fn, module, query, key, value, attention_mask, **kwargs):
    """`fn` (a packed attention of attention.py) over the whole row for 1/size of the heads: query (1, Hq, L/size, D)
    and key/value (1, Hkv, L/size, D) of this rank's slice -> (1, L/size, Hq, D). Key/value heads that size does not
    divide are repeated only as far as each rank needs whole ones for its query heads (kv_repeats)."""
    sp = kwargs["packed_layout"].sequence_parallel
    groups_kv = getattr(module, "num_key_value_groups", 1)
    if query.shape[1] % sp.size:
        raise ValueError(f"actor.sequence_parallel_size={sp.size} must divide the {query.shape[1]} attention heads")
    repeats = kv_repeats(key.shape[1], sp.size)
    if repeats > 1:  # (1, Hkv x repeats, L/size, D), each head beside its copies: query heads per head / repeats
        key, value = (t.repeat_interleave(repeats, dim=1) for t in (key, value))
        groups_kv //= repeats
    q, k, v = (all_to_all(t, 1, 2, sp.group) for t in (query, key, value))  # (1, heads / size, L, D)
    saved = getattr(module, "num_key_value_groups", None)
    if saved is not None:  # the query heads per key/value head this rank now holds
        module.num_key_value_groups = groups_kv
    try:
        out, _ = fn(module, q, k, v, attention_mask, **kwargs)  # (1, L, Hq / size, D)
    finally:
        if saved is not None:
            module.num_key_value_groups = saved
    return all_to_all(out, 1, 2, sp.group), None  # (1, L / size, Hq, D)


def whole_sequence(fn, module, hidden_states, layout):
    """A linear-attention layer (Qwen3.5's gated delta net) on a cut row: its recurrent state runs through the whole
    sequence, so the group all-gathers the row, each rank runs `fn` (linear_attention.packed_linear_attention) over
    all of it and keeps its own slice of the output. Exact and simple, at the price of these layers' activations and
    compute at full length on every rank (the full-attention layers, most of the memory at long lengths in a hybrid
    model's 1-in-4, stay split). Passing the state along the ranks instead would split them too, but serialises
    the group (rank r waits for rank r-1's final state) and needs the convolution's last tokens and the state's
    gradient passed back the same way. The gather's backward sums the group's gradients: each rank's output slice
    depends on every rank's input. hidden_states (1, L/size, H) -> (1, L/size, H)."""
    sp = layout.sequence_parallel
    step = hidden_states.shape[1]
    whole = gather_rows(hidden_states[0], [step] * sp.size, sp.group, sum_grads=True)[None]  # (1, L, H)
    out = fn(module, whole, layout)  # (1, L, H)
    return out[:, sp.rank * step : (sp.rank + 1) * step]


def head_rows(keep: torch.Tensor, length: int, sp: SequenceParallel):
    """Which of the row positions `keep` (R,) fall in each rank's slice: (this rank's positions in its slice,
    which of the R are its rows, the permutation that puts the group's gathered rows back in keep's order,
    each rank's count)."""
    _, start, end = slice_bounds(length, sp.size, sp.rank)
    step = end - start
    owner = keep // step  # (R,)
    order = torch.argsort(owner, stable=True)  # rank order, keep's order within a rank: as gather_rows returns them
    counts = torch.bincount(owner, minlength=sp.size).tolist()
    mine = owner == sp.rank
    return keep[mine] - start, mine, torch.argsort(order), counts


def call_with_head(call, model, inputs, labels, keep, layout, extra, blank):
    """forward_logprobs's packed call under sequence parallelism: `call(labels, keep, extra)` runs the model with the
    head on this rank's rows only; returns the group's rows (1, R, 1 or 2) in keep's order. `blank()`: a vision
    tower pass on a blank image, as 0 tied into autograd (for a rank that has no image of its own to encode)."""
    sp = model.sequence_parallel
    local_keep, mine, back, counts = head_rows(keep, layout.length, sp)
    layout.sequence_parallel = sp
    with split_vision(model, inputs, sp, blank):
        out = call(labels[:, mine], local_keep, extra)  # (1, R_rank, 1 or 2)
    rows = gather_rows(out[0], counts, sp.group, sum_grads=False)  # (R, 1 or 2), in rank order
    return rows[back][None]


# ----------------------------------------------------------------------------------------------------------------------
# The vision tower split by temporal patch.


def cut_items(grids: list[list[int]], size: int) -> list[list[tuple[int, int, int]]]:
    """Each rank's pieces of a forward's images and clips (grids: each one's (t, h, w), t temporal patches of h x w
    patches), as (item, first temporal patch, temporal patches): contiguous runs of temporal patches balanced by
    patches, each temporal patch to the rank whose share of the total holds its middle. The towers attend within one
    temporal patch only (their attention segments, windows, rotary and interpolated positions are per frame group of
    grid_thw), so a clip cut between temporal patches is encoded exactly as it is whole; an image (t = 1) is one
    temporal patch and stays whole. Contiguous and in order, so a rank's pixels are one slice of the forward's and the
    group's gathered embeddings are in the forward's order."""
    total = max(sum(t * h * w for t, h, w in grids), 1)
    pieces, before = [[] for _ in range(size)], 0
    for item, (t, h, w) in enumerate(grids):
        for frame in range(t):
            rank = min(size - 1, (2 * before + h * w) * size // (2 * total))  # the share holding its middle
            if pieces[rank] and pieces[rank][-1][0] == item:
                pieces[rank][-1] = (item, pieces[rank][-1][1], pieces[rank][-1][2] + 1)
            else:
                pieces[rank].append((item, frame, 1))
            before += h * w
    return pieces


class split_vision:
    """Within it, the model's get_image_features/get_video_features return this forward's images and videos encoded
    by the group, each temporal patch by one rank (one tower pass per rank, as add_vision_dummy requires)."""

    def __init__(self, model, inputs, sp, blank):
        self.model, self.inputs, self.sp, self.blank, self.encoded = model, inputs, sp, blank, None

    def __enter__(self):
        inner, inputs = self.model.model, self.inputs
        if inputs.get("pixel_values") is None and inputs.get("pixel_values_videos") is None:
            return self  # text only: add_vision_dummy runs the tower

        def get(kind):
            if self.encoded is None:
                self.encoded = encode_split(self.model, inputs, self.sp, self.blank)
            return self.encoded[kind]

        inner.get_image_features = lambda pixel_values=None, image_grid_thw=None, **kwargs: get("image")
        inner.get_video_features = lambda pixel_values_videos=None, video_grid_thw=None, **kwargs: get("video")
        return self

    def __exit__(self, *exc):
        for name in ("get_image_features", "get_video_features"):
            vars(self.model.model).pop(name, None)


def encode_split(model, inputs, sp, blank) -> dict:
    """{"image": ..., "video": ...} as get_image_features/get_video_features return them, from this rank's pieces of
    the items (cut_items), each encoded under its own grid row (its temporal patches, h, w), and the group's
    all-gather of every rank's embeddings."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    inner = model.model
    merge = inner.visual.spatial_merge_size**2
    pixels, grids = [], []
    for key, grid_key in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        if inputs.get(key) is not None:
            pixels.append(inputs[key])
            grids.append(inputs[grid_key])
    n_images = len(inputs["image_grid_thw"]) if inputs.get("pixel_values") is not None else 0
    pixels = pixels[0] if len(pixels) == 1 else torch.cat(pixels)  # (patches, C*T*P*P) (one kind: no copy)
    grid_rows = torch.cat(grids).tolist()  # (items, 3)
    pieces = cut_items(grid_rows, sp.size)
    frame = [h * w for _, h, w in grid_rows]  # patches of one temporal patch of each item
    starts = [0, *itertools.accumulate(t * h * w for t, h, w in grid_rows)]  # each item's first patch
    hidden = inner.config.text_config.hidden_size
    deep = len(getattr(inner.visual, "deepstack_visual_indexes", ()))  # Qwen3-VL: features for the first layers too
    mine = pieces[sp.rank]
    if mine:  # (contiguous: a view of the forward's pixels)
        (first, t0, _), (last, t1, n) = mine[0], mine[-1]
        rows = slice(starts[first] + t0 * frame[first], starts[last] + (t1 + n) * frame[last])
        grid = torch.tensor([[t, *grid_rows[i][1:]] for i, _, t in mine], dtype=grids[0].dtype, device=grids[0].device)
        out = type(inner).get_image_features(inner, pixels[rows], grid, return_dict=True)
        # (tokens of my pieces, H x (1 + deep)): the embeddings and each deepstack layer's, side by side, so the
        # group exchanges them in one gather
        deep_features = getattr(out, "deepstack_features", None) or []
        local = torch.cat([torch.cat(out.pooler_output), *(torch.cat(f) for f in deep_features)], -1)
    else:  # no piece for this rank: the tower still runs once (its FSDP2 collectives), on a blank image, and its
        # backward must come after the gather's, as on the other ranks: the dummy reaches autograd through `local`
        zero = blank().to(inputs_dtype(model))
        local = torch.zeros(0, hidden * (1 + deep), device=pixels.device, dtype=inputs_dtype(model)) * zero
    counts = [sum(n * frame[i] for i, _, n in part) // merge for part in pieces]
    gathered = gather_rows(local, counts, sp.group, sum_grads=True)  # (all tokens, H x (1 + deep)), in items' order
    tokens = [(starts[i + 1] - starts[i]) // merge for i in range(len(grid_rows))]
    items = [x.split(hidden, -1) for x in gathered.split(tokens)]  # each item's (embeddings, *deepstack layers')
    split = {}
    for kind, part in (("image", items[:n_images]), ("video", items[n_images:])):
        split[kind] = BaseModelOutputWithPooling(pooler_output=tuple(x[0] for x in part))
        if deep:  # per layer, per item, as get_image_features gives them
            split[kind].deepstack_features = [tuple(x[1 + j] for x in part) for j in range(deep)]
    return split


def inputs_dtype(model) -> torch.dtype:
    return model.model.language_model.embed_tokens.weight.dtype


# ----------------------------------------------------------------------------------------------------------------------
# The group's data: every rank of a group runs the same micro-batches.


def share_group(prompts: list, samples: list, size: int):
    """Every rank's prompts and samples of this rank's group, on each of its ranks: (prompts, samples, mine) with
    samples' prompt_index pointing into the gathered prompts and `mine` the slice of this rank's own samples."""
    if size <= 1:
        return prompts, samples, slice(0, len(samples))
    import dataclasses

    group = groups(size)[0]
    every = [None] * size
    dist.all_gather_object(every, (prompts, samples), group=group)
    all_prompts, all_samples, start = [], [], 0
    for r, (p, s) in enumerate(every):
        if r == dist.get_rank(group):
            start = len(all_samples)
        all_samples += [dataclasses.replace(x, prompt_index=x.prompt_index + len(all_prompts)) for x in s]
        all_prompts += p
    return all_prompts, all_samples, slice(start, start + len(samples))


def share_items(items: list, size: int) -> list:
    """The group's items (an optimizer step's sequences), the same list on each of its ranks."""
    if size <= 1:
        return items
    every = [None] * size
    dist.all_gather_object(every, items, group=groups(size)[0])
    return [x for part in every for x in part]
