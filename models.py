"""The policy as a network: loading, FSDP2 wrapping, packed attention and the log-prob forward.

- load_sharded (load_model(meta=True) / apply_fsdp / load_weights): a Qwen2.5-VL built on the meta device, sharded
  with FSDP2 (vision tower as one unit, each decoder layer, the root), and each rank's shards read from the
  safetensors, so no rank ever holds the whole model; root_forward / reshard: the two FSDP2 quirks the loop has to
  work around. load_model alone is from_pretrained, for tests and benches.
- load_policy_and_reference: the trainable policy (fp32 master weights) and the frozen reference (compute dtype),
  ready for the loop.
- sdpa_packed and packed_position_ids: attention and mRoPE positions that keep a packed row's sequences apart.
- forward_logprobs: log-probs (and entropy) of the response tokens, with the LM head run in chunks
  (chunked_logprobs) so the full (B, T, vocab) logits never exist.

A micro-batch comes from rollout.collate ([left-padded prompt | right-padded response] per row) or, with
actor.padding_free, from rollout.pack (all sequences back to back in one row).
"""

from __future__ import annotations

import json
import os

import torch

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
    instead of keeping them. Peak memory O(chunk_size x V) instead of O(B x T x V) (issue 6)."""
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

PACKED_ATTENTION = ("auto", "sdpa", "sdpa_packed", "flash_attention_2", "flash_attention_3")


def sdpa_packed(module, query, key, value, attention_mask, position_ids=None, **kwargs):
    """PyTorch sdpa that keeps a packed row's sequences apart: the CPU stand-in for flash-attn's varlen kernel.

    A packed forward passes no mask and text positions (1, L) that restart at 0 where each sequence starts; this
    runs causal sdpa on each sequence's slice (cost sum(n_i^2), where one block-diagonal mask would cost L^2 and
    L^2 bytes). Every other call (padded batches, generate, the vision tower) is plain transformers sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len = query.shape[2]
    packed = attention_mask is None and position_ids is not None and query.shape[0] == 1 and key.shape[2] == q_len
    if not packed or q_len == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    starts = (position_ids[0] == 0).nonzero().flatten().tolist()  # query (1, heads, L, D)
    if starts[:1] != [0]:
        starts.insert(0, 0)
    bounds = list(zip(starts, starts[1:] + [q_len]))
    outs = [
        sdpa_attention_forward(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None, **kwargs)[0]
        for s, e in bounds
    ]  # each (1, n_i, heads, D)
    return torch.cat(outs, dim=1), None


def _register_attention():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register("sdpa_packed", sdpa_packed)
    ALL_MASK_ATTENTION_FUNCTIONS.register("sdpa_packed", sdpa_mask)  # padded batches get sdpa's own masks


def packed_position_ids(model, input_ids, mm_token_type_ids, image_grid_thw, seq_lens):
    """Position ids (4, 1, L) for a packed row. Rows 1-3 are each sequence's own mRoPE (temporal, height, width)
    positions from the model's get_rope_index, as if it were alone; row 0 counts 0, 1, ... within each sequence,
    which is how transformers (and sdpa_packed) find where sequences start."""
    b, longest = len(seq_lens), int(seq_lens.max())
    valid = torch.arange(longest, device=input_ids.device)[None] < seq_lens.to(input_ids.device)[:, None]  # (B, Lmax)
    padded_ids = torch.zeros(b, longest, dtype=input_ids.dtype, device=input_ids.device)
    padded_ids[valid] = input_ids[0]
    padded_types = torch.zeros_like(padded_ids)
    padded_types[valid] = mm_token_type_ids[0]
    mrope, _ = model.model.get_rope_index(padded_ids, padded_types, image_grid_thw, attention_mask=valid.long())
    text = torch.arange(longest, device=input_ids.device).expand(b, -1)[valid]  # (L,)
    return torch.cat([text[None], mrope[:, valid]])[:, None]  # (4, 1, L)


def _call_with_head(model, inputs, labels, temperature, with_entropy, entropy_grad, logits_to_keep, **extra):
    """The model's forward with lm_head swapped for chunked_logprobs against `labels` (see forward_logprobs)."""
    head = model.lm_head

    def head_forward(hidden):  # hidden (B, >= T, H): the state at position t predicts label t
        hidden = hidden[:, : labels.shape[1]]  # (B, T, H)
        logp, entropy = chunked_logprobs(hidden, head.weight, labels, temperature, with_entropy=with_entropy)
        if entropy is not None and not entropy_grad:
            entropy = entropy.detach()
        return torch.stack([logp] if entropy is None else [logp, entropy], -1)  # (B, T, 1 or 2)

    head.forward = head_forward
    try:
        return model(**inputs, **extra, use_cache=False, logits_to_keep=logits_to_keep).logits  # (B, T, 1 or 2)
    finally:
        del head.forward  # back to the class's nn.Linear.forward


def forward_logprobs(model, batch_inputs, response_ids, temperature, with_entropy=False, entropy_grad=False):
    """Log-probs (B, T) of the response tokens under `model`, and their entropy (B, T) when asked.

    The full logits would be (B, T, 151936) fp32, 0.6 MB a token, so the LM head runs chunked (chunked_logprobs).
    It must still run inside the root module's forward: under FSDP2 the root owns lm_head, and its weight is
    all-gathered only between the root's pre- and post-forward hooks. So for this one call we swap lm_head's forward
    for one that takes the hidden states that predict response tokens and returns the stack of log-prob and entropy
    as `.logits`; being the root's output, it carries FSDP2's pre-backward hook as the logits did.

    A packed micro-batch (rollout.pack) goes through the model as one row with per-sequence positions and no mask
    (flash-attn varlen or sdpa_packed keep attention inside each sequence); its response log-probs come back in the
    same padded (B, T) layout as the padded path's."""
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in batch_inputs.items()}
    labels = response_ids.to(device)  # (B, T)
    if "seq_lens" not in inputs:  # padded: every response starts at the same column, keep the last T + 1 positions
        # (the state at the last position predicts nothing we sampled; the head drops it)
        out = _call_with_head(model, inputs, labels, temperature, with_entropy, entropy_grad, labels.shape[1] + 1)
    else:
        seq_lens, response_lens = inputs.pop("seq_lens"), inputs.pop("response_lens").to(device)  # (B,), (B,)
        position_ids = packed_position_ids(
            model, inputs["input_ids"], inputs["mm_token_type_ids"], inputs.get("image_grid_thw"), seq_lens
        )
        # response token j of sequence i sits at end_i - len_i + j and is predicted by the position before it
        ends = seq_lens.to(device).cumsum(0)  # (B,)
        keep = torch.cat([torch.arange(e - n - 1, e - 1, device=device) for e, n in zip(ends, response_lens)])
        flat_labels = inputs["input_ids"][:, keep + 1]  # (1, R), R = all response tokens
        no_mask = dict.fromkeys(model.config.text_config.layer_types)  # prepared "masks": none, the row is packed
        extra = {"position_ids": position_ids, "attention_mask": no_mask}
        flat = _call_with_head(model, inputs, flat_labels, temperature, with_entropy, entropy_grad, keep, **extra)
        flat = flat[0]  # (R, 1 or 2)
        valid = torch.arange(labels.shape[1], device=device)[None] < response_lens[:, None]  # (B, T)
        out = flat.new_zeros(*labels.shape, flat.shape[-1]).masked_scatter(valid[..., None], flat)  # (B, T, 1 or 2)
    logp = out[..., 0]  # (B, T)
    entropy = None
    if with_entropy:
        entropy = out[..., 1] if entropy_grad and torch.is_grad_enabled() else out[..., 1].detach()  # (B, T)
    return logp, entropy


# ----------------------------------------------------------------------------------------------------------------------
# Loading and FSDP2.


def load_model(path, device, attn_implementation, gradient_checkpointing=False, dtype=torch.float32, meta=False):
    """The Qwen2.5-VL in `path` with every weight read (from_pretrained), or with meta=True its bare structure: built
    from the config on the meta device, no weight read, no memory taken; load_sharded then shards it and reads only
    this rank's part of each weight."""
    from transformers import AutoConfig, GenerationConfig, Qwen2_5_VLForConditionalGeneration

    if attn_implementation == "auto":
        attn_implementation = "flash_attention_2" if device.type == "cuda" else "sdpa"
    _register_attention()
    if attn_implementation == "sdpa":  # the same for padded batches, and it also runs packed ones correctly
        attn_implementation = "sdpa_packed"
    if meta:
        with torch.device("meta"):
            model = Qwen2_5_VLForConditionalGeneration._from_config(
                AutoConfig.from_pretrained(path), dtype=dtype, attn_implementation=attn_implementation
            )
        try:  # the stop tokens, which from_pretrained reads too (and likewise goes on without)
            model.generation_config = GenerationConfig.from_pretrained(path)
        except OSError:
            pass
        _keep_checkpoint_renaming(model, path)
    else:
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation
        )
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
    if not all(isinstance(t, WeightRenaming) for t in transforms):  # e.g. fused experts: not renames, reshapes
        raise NotImplementedError(f"{type(model).__name__}: its checkpoint needs conversions beyond renaming")
    for file in _safetensors_files(path):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                rename_source_key(key, transforms, [])  # marks the renamings that apply
    model._weight_conversions = [t for t in transforms if t.was_used()]


def _safetensors_files(path):
    """The weight files from_pretrained reads: those model.safetensors.index.json names, or model.safetensors."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return sorted({os.path.join(path, name) for name in json.load(f)["weight_map"].values()})
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    return [os.path.join(path, "model.safetensors")]


def apply_fsdp(model, device, offload=False):
    """FSDP2: the vision tower as one unit, then each decoder layer, then the root. A model built on the meta
    device (load_model(meta=True)) gets only this rank's shards allocated, uninitialised: load_weights fills them."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs = {}
    if device.type == "cuda":
        # bf16 compute, fp32 gradient reduction: the update of lr 1e-6 would vanish in bf16 sums
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    fully_shard(model.model.visual, **kwargs)
    for layer in model.model.language_model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if next(model.parameters()).is_meta:
        model.to_empty(device="cpu" if offload else device)
    elif not offload:
        model.to(device)
    return model


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
    params = dict(model.named_parameters())  # tied weights once: 3B's lm_head is embed_tokens, not in its files
    missing = [name for name in params if name not in where]
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
            file, key = where[name]
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
                 freeze_vision_tower=False):  # fmt: skip
    """The model in `path`, sharded with FSDP2, without any rank ever holding all of it: built on the meta device,
    wrapped by apply_fsdp (only this rank's shards allocated), then filled from the safetensors (load_weights)."""
    model = load_model(path, device, attn_implementation, gradient_checkpointing, dtype, meta=True)
    if freeze_vision_tower:
        model.model.visual.requires_grad_(False)
    apply_fsdp(model, device, offload)
    return load_weights(model, path, device)


def root_forward(model, pad_id):
    """FSDP2 initialises lazily at the first forward of the root; generate() calls model.visual first, which would
    make the tower its own root ("FSDP state has already been lazily initialized"). One tiny root forward fixes it."""
    device = next(model.parameters()).device
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
    """The trainable policy (fp32 master weights) and, when the KL needs one, the frozen reference (the same
    checkpoint, in the compute dtype: bf16 on GPU, fp32 on CPU; it is never updated, so it needs no fp32 copy), both
    sharded and past their first root forward. `actor` is the config's actor section. Each rank holds its shards of
    the two models and, while loading, one slice of a weight at a time (load_sharded)."""
    model = load_sharded(
        actor.model_path, device, actor.attn_implementation, actor.gradient_checkpointing,
        freeze_vision_tower=actor.freeze_vision_tower,
    )  # fmt: skip
    root_forward(model, pad_id)
    ref_model = None
    if with_reference:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        ref_model = load_sharded(
            actor.model_path, device, actor.attn_implementation, dtype=dtype, offload=actor.ref_offload
        )
        ref_model.requires_grad_(False).eval()
        root_forward(ref_model, pad_id)
    return model, ref_model
