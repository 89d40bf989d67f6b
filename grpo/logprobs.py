"""The forward that gives the response tokens' log-probs (and entropy): forward_logprobs, with the LM head run in chunks
(chunked_logprobs) so the full (B, T, vocab) logits never exist, and the positions it runs with (packed mRoPE
positions, the text after an image or video). Also what every forward that starts sequences needs of the vision
tower, whoever calls it (the log-prob forward, the training forward, a generate prefill): exactly one tower pass on
every rank (add_vision_dummy, one_vision_pass), or FSDP2's collectives fall out of step.

A micro-batch comes from batching.collate ([left-padded prompt | right-padded response] per row) or, with
actor.padding_free, from batching.pack (all sequences back to back in one row).
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from grpo import replay, sequence_parallel
from grpo.attention import PackedLayout
from grpo.lora import LORA_ADAPTER

# ----------------------------------------------------------------------------------------------------------------------
# Log-probs of sampled tokens from logits or, chunk by chunk, from the last hidden states and the LM head weight.


def scaled_logits(logits: torch.Tensor, temperature: float = 1.0, forbidden: torch.Tensor | None = None):
    """logits (..., V) -> fp32 logits / temperature, the `forbidden` token ids (K,) at the lowest finite value: out
    of the softmax, as the engines leave them out of sampling (a finite value, so entropy's p log p is 0, not NaN)."""
    logits = logits.float() / temperature  # (..., V)
    if forbidden is not None and forbidden.numel():
        logits = logits.index_fill(-1, forbidden.to(logits.device), torch.finfo(torch.float32).min)
    return logits


def _logp(scaled: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return scaled.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - scaled.logsumexp(-1)  # (...)


def _entropy(scaled: torch.Tensor) -> torch.Tensor:
    return scaled.logsumexp(-1) - (scaled.softmax(-1) * scaled).sum(-1)  # (...)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, forbidden=None):
    """logits (B, T, V), labels (B, T) -> log p(label) (B, T), in fp32, over the vocabulary less `forbidden`."""
    return _logp(scaled_logits(logits, temperature, forbidden), labels)  # (B, T)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0, forbidden=None) -> torch.Tensor:
    return _entropy(scaled_logits(logits, temperature, forbidden))  # (B, T)


def soft_capped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap), as a model with final_logit_softcapping (Gemma's) applies it after its LM head, in
    the same dtype and order of operations; `cap` None: the logits as they are."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def logit_softcap(model) -> float | None:
    """The model's final_logit_softcapping (Gemma 4's 30), or None (Qwen's and GLM's have none)."""
    return getattr(model.config.get_text_config(), "final_logit_softcapping", None)


def _head_chunk(hidden, weight, labels, temperature, with_entropy, forbidden, softcap=None):
    logits = torch.nn.functional.linear(hidden, weight)  # (C, V), in the compute dtype, as the HF lm_head gives it
    logits = soft_capped(logits, softcap)  # (C, V), what the model's forward makes of its head's output
    scaled = scaled_logits(logits, temperature, forbidden)  # (C, V) fp32, one copy for both
    return _logp(scaled, labels), _entropy(scaled) if with_entropy else None  # (C,)


def chunked_logprobs(hidden, weight, labels, temperature=1.0, chunk_size=512, with_entropy=True, forbidden=None,
                     softcap=None):  # fmt: skip
    """hidden (B, T, H), LM head weight (V, H), labels (B, T) -> log p(label) (B, T) and entropy (B, T) or None,
    equal to token_logprobs/entropy_from_logits on the full logits, without ever holding (B, T, V) of them: the
    head runs `chunk_size` tokens at a time, and each chunk is checkpointed so backward recomputes its logits
    instead of keeping them. Peak memory O(chunk_size x V) instead of O(B x T x V). `forbidden` (K,): token ids left
    out of the softmax (forbid_sampling). `softcap`: the model's final_logit_softcapping, applied to the head's
    logits before the temperature, as the model's forward applies it (logit_softcap)."""
    h, y = hidden.flatten(0, 1), labels.flatten()  # (B*T, H), (B*T,)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    logps, entropies = [], []
    for i in range(0, max(h.shape[0], 1), chunk_size):  # (no tokens: one empty chunk, so the weight gets its grad)
        args = (h[i : i + chunk_size], weight, y[i : i + chunk_size], temperature, with_entropy, forbidden, softcap)
        if grad:
            logp, entropy = torch.utils.checkpoint.checkpoint(_head_chunk, *args, use_reentrant=False)
        else:
            logp, entropy = _head_chunk(*args)
        logps.append(logp)
        entropies.append(entropy)
    logp = torch.cat(logps).view_as(labels)  # (B, T)
    return logp, torch.cat(entropies).view_as(labels) if with_entropy else None  # (B, T)


def forbid_sampling(model, token_ids) -> None:
    """Leave `token_ids` out of the softmax of every log-prob forward of `model` (policy, reference, teacher): the
    tokens both engines forbid (samples.vision_token_ids: vLLM's logit bias, the HF engine's suppress_tokens), so the
    trainer's distribution is the one the engine samples from. Over the whole vocabulary every sampled token's
    log-prob would be lower by log(1 - p(forbidden)), and since nothing ever samples those tokens, nothing would push
    their mass back down: a loss whose advantages do not sum to zero over tokens lets it grow."""
    model.forbidden_token_ids = torch.tensor(sorted(token_ids), dtype=torch.long)  # (K,)


# ----------------------------------------------------------------------------------------------------------------------
# The forward that gives the response tokens' log-probs, and the positions it runs with.


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


def text_after_vision_continues(model):
    """Make the model's get_rope_index start the text after an image or video at 1 + the largest position so far, as
    Qwen's reference code and vLLM do (st_idx = max + 1). transformers 5.17-5.19 start it at the vision block's first
    position + its larger spatial side instead, which is the same for an image but not for a Qwen2.5-VL video whose
    temporal positions (frame pairs x tokens_per_second x seconds per pair) run past its spatial ones: the text after
    it would overlap the video's positions, and the trainer's log-probs would differ from vLLM's (measured: 0.06 on a
    tiny model). Qwen3-VL and Qwen3.5 give every frame pair its own block at one temporal position: no change there.
    Wrapped on the instance, so the padded forward, packed_positions and generate all get it. (A family with 1-D
    positions, Gemma 4, has no get_rope_index: nothing to wrap.)"""
    inner = getattr(model.model, "get_rope_index", None)
    if inner is None:
        return

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
    - positions (4, 1, L): row 0 the text position, rows 1-3 mRoPE (temporal, height, width); (1, L) the text
      positions alone for a model with 1-D positions (Gemma 4). Every answer gets the
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
    # videos that end before each position, by their token counts (Qwen3-VL writes a clip as several runs, split by
    # its timestamps; videos sit only in prompts, a tool turn brings images)
    video_ends = torch.zeros(0, dtype=torch.long)
    if video_grid_thw is not None:
        merge = model.config.vision_config.spatial_merge_size
        video_ends = (video_grid_thw.prod(-1) // merge**2).cumsum(0).cpu()  # (videos,)
    video_tokens = torch.cat([host_types.new_zeros(1), (host_types == 2).long().cumsum(0)]).cpu()  # (L + 1,)

    def videos_before(position: int) -> int:
        return int(torch.searchsorted(video_ends, video_tokens[position], right=True))

    parts, part_types, keep, targets, segments, column, part, grid_rows = [], [], [], [], [], [], [], []
    video_rows = []
    offset, r = 0, 0
    for p_len, k in zip(prompt_lens.tolist(), group_sizes.tolist()):
        lens = response_lens[r : r + k].tolist()
        prompt_end = a = offset + p_len
        starts = [prompt_end + sum(lens[:j]) for j in range(k)]
        per_answer = any(host_types[s : s + n].any() for s, n in zip(starts, lens))  # tool turns' images
        chosen = range(k) if per_answer else [max(range(k), key=lambda j: lens[j])]
        first_row = len(parts)
        for j in chosen:
            for rows, out in ((host_ids, parts), (host_types, part_types)):
                out.append(torch.cat([rows[offset:prompt_end], rows[starts[j] : starts[j] + lens[j]]]))
            grid_rows.append([*range(before[offset], before[prompt_end]),
                              *range(before[starts[j]], before[starts[j] + lens[j]])])  # fmt: skip
            video_rows.append(range(videos_before(offset), videos_before(prompt_end)))
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
    device = compute_device(model)
    layout = PackedLayout(segments, offset, device, bidirectional_blocks(model, host_types))
    keep, targets = torch.tensor(keep, device=device), torch.tensor(targets, device=device)
    if getattr(model.model, "get_rope_index", None) is None:  # 1-D positions (Gemma 4): each part's own columns
        return torch.tensor(column, device=device)[None], keep, targets, layout  # (1, L)
    if image_grid_thw is not None:  # each row's images, a prompt's again in each row it starts
        image_grid_thw = image_grid_thw[[i for row in grid_rows for i in row]]
    if video_grid_thw is not None:  # and its videos (a shared prompt with a row per answer: again in each)
        rows = [i for row in video_rows for i in row]
        video_grid_thw = video_grid_thw[rows]
        second_per_grid_ts = None if second_per_grid_ts is None else second_per_grid_ts[rows]
    # the rows (a part's prompt with its longest answer, or with each answer) as a padded batch for get_rope_index
    width = max(len(x) for x in parts)
    ids = torch.zeros(len(parts), width, dtype=host_ids.dtype)  # (G, W)
    types = torch.zeros(len(parts), width, dtype=torch.long)  # (G, W): 0 text, 1 image, 2 video
    valid = torch.arange(width)[None] < torch.tensor([len(x) for x in parts])[:, None]  # (G, W)
    ids[valid], types[valid] = torch.cat(parts), torch.cat(part_types).long()
    grids = {"image_grid_thw": image_grid_thw, "video_grid_thw": video_grid_thw}
    if second_per_grid_ts is not None:  # Qwen2.5-VL: the video's temporal positions are spaced by its frame rate
        grids["second_per_grid_ts"] = second_per_grid_ts
    grids = {k: v.to(device) for k, v in grids.items() if v is not None}
    valid = valid.to(device).long()
    mrope, _ = model.model.get_rope_index(ids.to(device), types.to(device), attention_mask=valid, **grids)  # (3, G, W)
    column, part = torch.tensor(column, device=device), torch.tensor(part, device=device)  # (L,), (L,)
    positions = torch.cat([column[None], mrope[:, part, column]])[:, None]  # (4, 1, L)
    return positions, keep, targets, layout


def bidirectional_blocks(model, host_types):
    """(L,) each token's image block (a run of image or video tokens, numbered in row order; -1 for text), for a
    model whose sliding-window layers let an image's tokens see each other both ways (Gemma 4's text_config
    use_bidirectional_attention="vision"); None for every other. Numbered by transformers' own function, the one its
    padded forward builds the masks from (transformers 5.17 to 5.19)."""
    if getattr(model.config.get_text_config(), "use_bidirectional_attention", None) != "vision":
        return None
    from transformers.models.gemma4.modeling_gemma4 import get_block_sequence_ids_for_mask

    return get_block_sequence_ids_for_mask(host_types[None], host_types.device)[0]


def _call_with_head(model, inputs, labels, temperature, with_entropy, entropy_grad, logits_to_keep, **extra):
    """The model's forward with lm_head swapped for chunked_logprobs against `labels` (see forward_logprobs)."""
    head = model.lm_head
    forbidden = getattr(model, "forbidden_token_ids", None)  # (K,), forbid_sampling
    # A soft-capping model (Gemma 4) caps whatever its head returns: here log-probs, which it must not touch. So the
    # cap moves into the head, on the logits, and the config says none for this one call.
    text_config, softcap = model.config.get_text_config(), logit_softcap(model)

    def head_forward(hidden):  # hidden (B, >= T, H): the state at position t predicts label t
        hidden = hidden[:, : labels.shape[1]]  # (B, T, H)
        logp, entropy = chunked_logprobs(hidden, _head_weight(head), labels, temperature, with_entropy=with_entropy,
                                         forbidden=forbidden, softcap=softcap)  # fmt: skip
        if entropy is not None and not entropy_grad:
            entropy = entropy.detach()
        return torch.stack([logp] if entropy is None else [logp, entropy], -1)  # (B, T, 1 or 2)

    head.forward = head_forward
    if softcap is not None:
        text_config.final_logit_softcapping = None
    try:
        return model(**inputs, **extra, use_cache=False, logits_to_keep=logits_to_keep).logits  # (B, T, 1 or 2)
    finally:
        del head.forward  # back to the class's nn.Linear.forward
        if softcap is not None:
            text_config.final_logit_softcapping = softcap


def _head_weight(head):
    """The LM head's weight, plus its LoRA update when it has an adapter that is on (lm_head in
    actor.lora_target_modules): chunked_logprobs takes the weight, never the module's forward. (Inside the root's
    forward, so FSDP2 has gathered the factors; that adapter gets no dropout.)"""
    if LORA_ADAPTER not in getattr(head, "lora_A", {}) or head.disable_adapters:
        return head.weight
    a, b = head.lora_A[LORA_ADAPTER].weight, head.lora_B[LORA_ADAPTER].weight
    return head.weight + (b @ a) * head.scaling[LORA_ADAPTER]  # (V, H)


def forward_logprobs(
    model, batch_inputs, response_ids, temperature, with_entropy=False, entropy_grad=False, split_over_group=True
):
    """Log-probs (B, T) of the response tokens under `model`, and their entropy (B, T) when asked.

    Under sequence parallelism each packed row is cut over the group, whose ranks must pass the same batch; with
    split_over_group=False each rank runs its own batch whole (the HF engine scoring each rank's own answers).

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
    routes = inputs.pop("routes", None)  # the engine's recorded experts of every token (replay.py), or None
    labels = response_ids.to(device)  # (B, T)
    sp = sequence_parallel.of(model) if split_over_group else None
    with replay.replaying(model, routes):
        out = _forward(model, inputs, batch_inputs, labels, temperature, with_entropy, entropy_grad, device, sp)
    logp = out[..., 0]  # (B, T)
    entropy = None
    if with_entropy:
        entropy = out[..., 1] if entropy_grad and torch.is_grad_enabled() else out[..., 1].detach()  # (B, T)
    return logp, entropy


def _forward(model, inputs, batch_inputs, labels, temperature, with_entropy, entropy_grad, device, sp):
    """forward_logprobs' forward: (B, T, 1 or 2) log-probs (and entropies) in the padded layout; `sp`: the
    sequence-parallel group to cut each packed row over, or None."""
    if "response_lens" not in inputs:  # padded: every response starts at the same column, keep the last T + 1 positions
        # (the state at the last position predicts nothing we sampled; the head drops it)
        extra = {}
        if getattr(model.model, "get_rope_index", None) is None and inputs.get("attention_mask") is not None:
            # 1-D positions (Gemma 4), which the model would count from the row's first column, left pads included:
            # from each sequence's first token instead, as it has them alone (and as the engines do)
            extra["position_ids"] = (inputs["attention_mask"].long().cumsum(-1) - 1).clamp(min=0)  # (B, L)
        out = _call_with_head(model, inputs, labels, temperature, with_entropy, entropy_grad, labels.shape[1] + 1,
                              **extra)  # fmt: skip
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
        # no mask: for one unpadded row attention.py's attentions build none (_register_attention), which leaves the
        # row to the PackedLayout; flash-attention builds none either (it finds the sequences in the text positions)
        extra = {"position_ids": position_ids, "attention_mask": None, "packed_layout": layout}

        def call(y, rows, ex):  # the forward, its head on the hidden states at `rows` predicting labels y
            return _call_with_head(model, inputs, y, temperature, with_entropy, entropy_grad, rows, **ex)

        if sp is None:
            flat = call(flat_labels, keep, extra)
        else:  # the row cut over the group's ranks, the head on each rank's rows (and a rank without images of its
            # own runs the tower on the blank one)
            flat = sequence_parallel.call_with_head(
                call, model, inputs, flat_labels, keep, layout, extra, lambda: _zero_of(vision_dummy(model))
            )
        flat = flat[0]  # (R, 1 or 2)
        valid = torch.arange(labels.shape[1], device=device)[None] < response_lens.to(device)[:, None]  # (B, T)
        out = flat.new_zeros(*labels.shape, flat.shape[-1]).masked_scatter(valid[..., None], flat)  # (B, T, 1 or 2)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# The vision tower: one pass in every forward that starts sequences, on every rank.


def _tensors(out) -> list[torch.Tensor]:
    """Every tensor in a vision tower's output (Qwen3-VL's holds deepstack feature lists beside the embeds)."""
    if isinstance(out, torch.Tensor):
        return [out]
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (list, tuple)) else []
    return [t for v in values for t in _tensors(v)]


def _zero_of(out) -> torch.Tensor:
    """0, as a function of every tensor of a vision tower's output: what ties a dummy pass into autograd."""
    return sum(t.float().sum() for t in _tensors(out)) * 0.0


def vision_dummy(model):
    """The vision tower's output for one minimal blank image (one merged token): see add_vision_dummy. Gemma 4's
    through its projection into the text model too (its own FSDP2 unit, which the image path runs)."""
    if hasattr(model.model, "vision_tower"):  # Gemma 4: k x k patches, pooled into one soft token
        tower = model.model.vision_tower
        k, patch = tower.config.pooling_kernel_size, tower.config.patch_size
        device = compute_device(model)
        pixels = torch.zeros(1, k * k, 3 * patch**2, device=device)  # (1, patches, C * P * P)
        ys, xs = torch.meshgrid(torch.arange(k), torch.arange(k), indexing="ij")
        positions = torch.stack([xs.flatten(), ys.flatten()], -1)[None].to(device)  # (1, patches, 2): (x, y)
        return model.model.get_image_features(pixels, positions, return_dict=True)
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
    hf_engine.HFEngine runs vision_dummy itself before such a generate call, where generate would run the tower."""
    pending, passes = [], []

    def before(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        starts = cache is None or cache.get_seq_length() == 0
        images, videos = kwargs.get("pixel_values"), kwargs.get("pixel_values_videos")
        if images is not None and videos is not None and "get_image_features" not in vars(model.model):
            one_pass = one_vision_pass(model, images, kwargs["image_grid_thw"], videos, kwargs["video_grid_thw"])
            one_pass.__enter__()
            passes.append(one_pass)
        alike = getattr(module, "alike_on_every_rank", False)  # (without_vision_dummy)
        if images is None and videos is None and kwargs.get("mm_encoder_outputs") is None and starts and not alike:
            pending.append(vision_dummy(model))

    def after(module, args, kwargs, out):
        if passes:
            passes.pop().__exit__(None, None, None)
        if pending:
            hidden = out.last_hidden_state
            zero = _zero_of(pending.pop())
            out.last_hidden_state = hidden + zero.to(hidden.device, hidden.dtype)
        return out

    model.model.register_forward_pre_hook(before, with_kwargs=True)
    model.model.register_forward_hook(after, with_kwargs=True)


@contextlib.contextmanager
def without_vision_dummy(model):
    """Within it, a forward without images or videos runs no dummy tower pass (add_vision_dummy). Only for a forward
    that every rank makes with the same text-only inputs, so that no rank runs the tower and the collectives stay in
    step without it: loading.root_forward's one token, where the pass would only all-gather the whole tower beside
    the root's embedding and LM head (docs/memory.md, Loading and host memory)."""
    model.model.alike_on_every_rank = True
    try:
        yield
    finally:
        del model.model.alike_on_every_rank
