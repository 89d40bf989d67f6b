"""Loading and FSDP2: a checkpoint into a model sharded across the ranks, without any rank holding all of it.

- load_sharded (load_model(meta=True) / apply_fsdp / load_weights): the model built on the meta device, sharded
  with FSDP2 (vision tower as one unit, each decoder layer, the root), and each rank's shards read from the
  safetensors, so no rank ever holds the whole model; root_forward / reshard: the two FSDP2 quirks the loop has to
  work around. load_model alone is from_pretrained, for tests and benches.
- load_policy_and_reference: the trainable policy (master weights in actor.master_dtype) and the frozen reference,
  ready for the loop; with actor.lora_rank > 0 the policy carries PEFT LoRA adapters (lora.py) and the reference is
  the policy itself with its adapters switched off (lora.adapters_disabled), so no second model is loaded.
- unsupported_model: the start-up check that a checkpoint is of a supported family (families.py) and whole, with the
  loader's own reading of its tensors' names (tensor_name_problem), so a run stops before it loads one that
  from_pretrained would fill half at random.
"""

from __future__ import annotations

import json
import os
import re

import torch

from grpo import moe, sequence_parallel
from grpo.attention import resolve_attention, use_varlen_in_vision_tower
from grpo.families import SUPPORTED_MODEL_TYPES, experts_problem, family, processor_problem, unsupported_type
from grpo.linear_attention import use_packed_forward
from grpo.logprobs import (
    add_vision_dummy,
    compute_device,
    forbid_sampling,
    text_after_vision_continues,
    without_vision_dummy,
)
from grpo.lora import add_lora, base_name, init_lora, is_lora_factor, lora_config, lora_layers
from grpo.samples import vision_token_ids


def unsupported_model(path: str, needs_experts: str | None = None) -> str | None:
    """Why the checkpoint at `path` (a local directory, or a hub id in the local cache) cannot be trained here, or
    None. from_pretrained would load a checkpoint of another family into one of ours, warn about the weights it
    leaves random, and train the result: this stops first, naming the model_type, or, for a local directory of a
    supported type, the first tensors that are missing or unexpected (the model built on the meta device, the
    safetensors' headers read: seconds even for a large model), or an image processor of another family. A hub id
    not in the cache is checked by load_model, once its files are downloaded. `needs_experts`: the config key that
    asks for what only a mixture of experts has, and what it does ("actor.router_aux_loss_coef balances"), or None."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        from huggingface_hub import try_to_load_from_cache

        config_file = try_to_load_from_cache(path, "config.json")
        if not isinstance(config_file, str):
            return None
    if not os.path.exists(config_file):
        return "no config.json: not a Hugging Face model directory"
    with open(config_file) as f:
        config = json.load(f)
    model_type = config.get("model_type")
    problem = unsupported_type(model_type)
    if not problem and needs_experts:
        problem = experts_problem(model_type, config.get("text_config", config), needs_experts)
    if problem or not os.path.isdir(path):
        return problem
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(transformers_config(path))
    _keep_checkpoint_renaming(model, path)
    return tensor_name_problem(model, path) or processor_problem(path, family(model).image_side)


def transformers_config(path):
    """The checkpoint's config in transformers' own class for its model_type, whatever AutoConfig has been given
    since. vLLM 0.26 registers config classes of its own for qwen3_5 and qwen3_5_moe with AutoConfig when its engine
    reads such a checkpoint (transformers_utils/config.py: _CONFIG_REGISTRY, lines 126-127; AutoConfig.register(...,
    exist_ok=True), line 162), and the engine starts before the trainer loads its model. Their vision config keeps
    `num_heads` only, from which transformers 5.19's Qwen3.5 tower cannot be built (its rotary embedding reads
    num_attention_heads: "'Qwen3_5VisionConfig' object has no attribute 'num_attention_heads'")."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    config = AutoConfig.from_pretrained(path)
    own = getattr(transformers, CONFIG_MAPPING_NAMES.get(config.model_type, ""), None)
    return config if own is None or type(config) is own else own.from_pretrained(path)


def load_model(path, device, attn_implementation, gradient_checkpointing=False, dtype=torch.float32, meta=False):
    """The model in `path`, of the class its config.json's model_type names (AutoModelForImageTextToText), with every
    weight read (from_pretrained), or with meta=True its bare structure: built from the config on the meta device, no
    weight read, no memory taken; load_sharded then shards it and reads only this rank's part of each weight. A
    checkpoint whose tensors are not exactly the model's (missing or unexpected ones, the model's own ignore list
    aside) is an error either way: never a half-random model."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer, GenerationConfig

    attn_implementation = resolve_attention(attn_implementation, device)
    config = transformers_config(path)  # (a hub model's config.json is downloaded here, if it was not cached)
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
        model = AutoModelForImageTextToText.from_pretrained(
            path, config=config, dtype=dtype, attn_implementation=attn_implementation
        )
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
    forbid_sampling(model, never_sampled(model, AutoTokenizer.from_pretrained(path)))
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
        # buffers the checkpoint holds (Gemma 4's per-layer output scale, layer_scalar, and its clipped linears'
        # bounds): whole on every rank, as FSDP2 leaves buffers unsharded
        for name, b in _saved_buffers(model):
            if base_name(name) in where:  # (whole, and some are 0-d: a clipped linear's bounds, which no slice reads)
                file, key = where[base_name(name)]
                with safe_open(file, "pt") as f:
                    b.copy_(f.get_tensor(key))
    _recompute_buffers(model, device)
    return model


def _saved_buffers(model):
    """(name, buffer) of every buffer a checkpoint saves (the persistent ones)."""
    for prefix, module in model.named_modules():
        for b, value in module._buffers.items():
            if value is not None and b not in module._non_persistent_buffers_set:
                yield f"{prefix}.{b}" if prefix else b, value


def _recompute_buffers(model, device):
    """Buffers that are not saved (the rotary inv_freq of the text model and of the vision tower) are computed when a
    module is built; on the meta device they were not, and to_empty left garbage. Build each module that owns one
    again, on the CPU from its config, and take its values (on the compute device, also when parameters are
    offloaded). Gemma's scaled embeddings (no config) keep their scale as a number beside the buffer: it is set from
    that (sqrt(hidden) for the tokens' embedding, sqrt(hidden_size_per_layer_input) for the per-layer one)."""
    for name, module in model.named_modules():
        buffers = [b for b in module._non_persistent_buffers_set if getattr(module, b, None) is not None]
        if not buffers:
            continue
        if buffers == ["embed_scale"] and hasattr(module, "scalar_embed_scale"):
            module.embed_scale = torch.tensor(module.scalar_embed_scale, device=device, dtype=module.embed_scale.dtype)
            continue
        if not hasattr(module, "config"):
            raise NotImplementedError(f"{name} ({type(module).__name__}): cannot recompute buffers {buffers}")
        fresh = type(module)(module.config)
        for b in buffers:
            setattr(module, b, getattr(fresh, b).to(device=device, dtype=getattr(module, b).dtype))


def never_sampled(model, tokenizer) -> list[int]:
    """The ids both engines forbid (samples.vision_token_ids of the checkpoint's tokenizer), with the config's own
    vision token ids: a checkpoint saved without a tokenizer (a bench's) loads an empty one, and still has those."""
    keys = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    ids = {getattr(model.config, k, None) for k in keys} - {None}
    return sorted(ids | set(vision_token_ids(tokenizer, family(model).vision_tokens)))


def load_sharded(path, device, attn_implementation, gradient_checkpointing=False, dtype=torch.float32, offload=False,
                 freeze_vision_tower=False, lora=None):  # fmt: skip
    """The model in `path`, sharded with FSDP2, without any rank ever holding all of it: built on the meta device,
    wrapped by apply_fsdp (only this rank's shards allocated), then filled from the safetensors (load_weights).
    `lora` (a peft LoraConfig, lora_config()): adapters injected before sharding, so each lives in its layer's FSDP2
    unit and the units stay those of full fine-tuning; everything else frozen; the adapters initialised by init_lora
    and kept in fp32 whatever `dtype` the frozen base has."""
    model = load_model(path, device, attn_implementation, gradient_checkpointing, dtype, meta=True)
    if freeze_vision_tower:
        # the units before the decoder layers: the tower (Qwen's mergers inside it; Gemma 4's soft-token projection
        # beside it)
        units = family(model).fsdp_units(model)
        for unit in units[: len(units) - len(model.model.language_model.layers)]:
            unit.requires_grad_(False)
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


def root_forward(model, pad_id):
    """FSDP2 initialises lazily at the first forward of the root; generate() calls model.visual first, which would
    make the tower its own root ("FSDP state has already been lazily initialized"). One tiny root forward fixes it.
    Every rank makes it alike, text only, so it leaves out the vision dummy: the tower all-gathered whole beside the
    root's embedding and LM head raised a rank's peak at load (bench/bench_load.py) from 0.69 to 0.97 model sizes."""
    device = compute_device(model)
    with torch.no_grad(), without_vision_dummy(model):
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
    for m in {id(model): model, id(ref_model): ref_model}.values():
        if m is not None:  # its training forwards cut each sequence over a group of ranks (none: size 1)
            sequence_parallel.attach(m, actor.sequence_parallel_size)
    return model, ref_model
