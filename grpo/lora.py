"""LoRA adapters (actor.lora_rank > 0) with PEFT: which modules get them, injecting and initialising them, switching
them off (the reference policy), and the weights as a plain model names them with the adapters merged in, for the
weight sync to vLLM and the export. loading.py loads a model with them (load_sharded), nothing here imports the
project's other modules.

The adapters go into the model in place (inject_adapter_in_model, no PeftModel
wrapper), so the model keeps its class, config and module paths, and FSDP2 wraps the same units as without them.
PEFT renames a wrapped linear's weight `q_proj.weight` -> `q_proj.base_layer.weight` and adds
`q_proj.lora_A.default.weight` (r, in) and `q_proj.lora_B.default.weight` (out, r); its output is
base(x) + scale * B(A(dropout(x))), scale = lora_alpha / lora_rank.

The routed experts of the MoE families are 3-D parameters, not Linear modules: the target `experts` (opt-in) puts
PEFT's ParamWrapper (LoraConfig.target_parameters) on `mlp.experts.gate_up_proj` (E, 2I, H) and `down_proj`
(E, H, I). PEFT reads them as transformers holds them, (E, out, in), and gives each one adapter of rank r per expert
in two Linear factors: lora_A (E * r, in), rows expert-major (expert e's A_e = rows [e r, (e + 1) r)), and lora_B
(out, r * E), columns expert-minor (B_e = columns e, e + E, ...); expert e's update is scale * B_e A_e (out, in).
Its forward adds that update to the parameter itself for the call (a torch parametrization), so transformers'
experts forward, eager or grouped_mm, runs unchanged. The two wrappers nest on one experts module
(`experts.base_layer.base_layer.gate_up_proj`). PEFT refuses dropout there: B A is added to the weight, which
leaves no input of the adapter's own to drop.
"""

from __future__ import annotations

import contextlib
import re

import torch

LORA_ADAPTER = "default"  # PEFT's name of the one adapter
EXPERTS = "experts"  # the target that adapts an MoE's routed experts
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # what PEFT wraps for it (name suffixes)


def lora_target_regex(targets) -> str:
    """actor.lora_target_modules -> the regex PEFT matches against whole module names. A plain name (`q_proj`) is a
    module of the language model's decoder layers; `visual.NAME` one of the vision tower (`visual.qkv`): the tower
    has modules named like the language model's (its MLP's gate_proj/up_proj/down_proj) and stays frozen unless
    named this way; `lm_head` the output head. (`experts` is no module: lora_config adapts those parameters.)"""
    text = [re.escape(t) for t in targets if not t.startswith("visual.") and t not in ("lm_head", EXPERTS)]
    vision = [re.escape(t[len("visual.") :]) for t in targets if t.startswith("visual.")]
    parts = [rf"model\.language_model\.layers\.\d+\.(?:.*\.)?(?:{'|'.join(text)})"] if text else []
    parts += [rf"model\.visual\.(?:.*\.)?(?:{'|'.join(vision)})"] if vision else []
    parts += ["lm_head"] if "lm_head" in targets else []
    return "|".join(parts)


def lora_config(actor):
    """The peft LoraConfig of the config's actor section."""
    from peft import LoraConfig

    experts = EXPERTS in actor.lora_target_modules
    if experts and actor.lora_dropout:
        why = "PEFT adds an expert's B A to its weight: no adapter input to drop"
        raise ValueError(f"actor.lora_target_modules: {EXPERTS} needs actor.lora_dropout=0 ({why})")
    return LoraConfig(
        r=actor.lora_rank, lora_alpha=actor.lora_alpha, lora_dropout=actor.lora_dropout,
        target_modules=lora_target_regex(actor.lora_target_modules) or None,
        target_parameters=EXPERT_PARAMS if experts else None, base_model_name_or_path=actor.model_path,
    )  # fmt: skip


def add_lora(model, config):
    """Inject the adapters (on the meta device too: init_lora fills them after loading) and freeze all else."""
    from peft import inject_adapter_in_model

    if config.target_parameters and not any(n.endswith(tuple(EXPERT_PARAMS)) for n, _ in model.named_parameters()):
        raise ValueError(f"actor.lora_target_modules: {EXPERTS} adapts the routed experts of a mixture-of-experts "
                         f"family, and {model.config.model_type} has none")  # fmt: skip
    head = config.target_modules and re.fullmatch(config.target_modules, "lm_head")
    if head and model.lm_head.weight is model.get_input_embeddings().weight:
        # the head is the embedding: a merged export (one tensor for both) could not hold the head's update alone
        raise ValueError("actor.lora_target_modules: lm_head is tied to the input embeddings in this model")

    inject_adapter_in_model(config, model, adapter_name=LORA_ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(is_lora_factor(name))
    return model


def is_lora_factor(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """A parameter's (or module's) name in the plain model: PEFT's `.base_layer`s dropped (nested ones too: the
    experts' two wrappers)."""
    return re.sub(r"(?:\.base_layer)+(?=\.|$)", "", name)


def lora_layers(model) -> dict:
    """{module name: PEFT LoRA layer} of the model; empty without LoRA."""
    return {name: m for name, m in model.named_modules() if hasattr(m, "lora_A") and LORA_ADAPTER in m.lora_A}


@torch.no_grad()
def init_lora(model, seed=0):
    """LoRA's initialisation, the same on every rank and in every run: A uniform in +-1/sqrt(in) (PEFT's default,
    kaiming-uniform with a = sqrt(5)) from one seeded generator walked in module order, B zero, so the adapted
    model starts as the base. Each rank copies its own rows of the full A (FSDP2's dim-0 shards)."""
    g = torch.Generator().manual_seed(seed)
    for layer in lora_layers(model).values():
        a, b = layer.lora_A[LORA_ADAPTER].weight, layer.lora_B[LORA_ADAPTER].weight
        bound = a.shape[1] ** -0.5
        copy_own_rows(a, torch.empty(a.shape).uniform_(-bound, bound, generator=g))
        copy_own_rows(b, torch.zeros(b.shape))


@torch.no_grad()
def copy_own_rows(p, full):
    """Copy a full tensor's value into a parameter, sharded (FSDP2: this rank's dim-0 rows) or not."""
    from torch.distributed.tensor import DTensor

    local, start = p, 0
    if isinstance(p, DTensor):
        local = p.to_local()
        start = min(p.device_mesh.get_local_rank() * -(-p.shape[0] // p.device_mesh.size()), p.shape[0])
    local.copy_(full[start : start + local.shape[0]])


@contextlib.contextmanager
def adapters_disabled(model):
    """The model with its LoRA adapters switched off: the frozen base, i.e. the reference policy."""
    # PEFT's own switch, enable_adapters(), also sets requires_grad on the adapters, which FSDP2 copies into the
    # unsharded parameters it reuses: after one reference forward the adapters of the root unit (lm_head) got no
    # gradient any more. So flip only the flag PEFT's forward reads.
    layers = lora_layers(model).values()
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield model
    finally:
        for layer in layers:
            layer._disable_adapters = False


def full_tensor(t):
    """The whole of a tensor that may be an FSDP2 shard (a DTensor): collective then, every rank must call it.

    On CPU (gloo) a dim-0 shard is gathered by all_gather_rows, not by DTensor.full_tensor(): that one goes through
    the functional collectives, which gloo runs as allgather_into_tensor_coalesced, and a stream of those (the weight
    sync's, the export's) corrupts the heap now and then. Each of a gloo group's two worker threads stores the name
    of the op it just finished in the group's status without a lock (ProcessGroupGloo::runLoop,
    `pgStatus_->lastCompletedWorkName`, torch 2.13); "ALLGATHER_COALESCED" is too long for std::string's inline
    buffer, so two such ops finishing together free the same buffer twice. all_gather_single runs as "ALLGATHER",
    which is stored in place: nothing is freed. Elsewhere (NCCL, other placements) DTensor.full_tensor()."""
    if not hasattr(t, "full_tensor"):
        return t
    from torch.distributed.tensor import Replicate, Shard

    sharded = [(i, p) for i, p in enumerate(t.placements) if not isinstance(p, Replicate)]
    if t.device.type != "cpu" or len(sharded) != 1 or type(sharded[0][1]) is not Shard or sharded[0][1].dim != 0:
        return t.full_tensor()
    return all_gather_rows(t.to_local(), t.shape[0], t.device_mesh.get_group(sharded[0][0]))[0]


def all_gather_rows(local, n, group, async_op=False):
    """(the whole (n, ...) tensor, the work or None) from every rank's dim-0 share of it, split as torch.chunk splits
    (DTensor's Shard(0): ceil(n / world) rows each, the last shares short or empty), with all_gather_single. Collective;
    with async_op the tensor holds the gathered rows once work.wait() has returned."""
    dist = torch.distributed
    world = dist.get_world_size(group)
    rows = -(-n // world)  # a share, padded
    if local.shape[0] < rows:
        local = torch.cat([local, local.new_zeros(rows - local.shape[0], *local.shape[1:])])
    out = local.new_empty(rows * world, *local.shape[1:])
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the former from torch 2.13
    work = gather(out, local.contiguous(), group=group, async_op=async_op)
    return out[:n], work


@torch.no_grad()
def lora_delta(layer) -> torch.Tensor:
    """scale * B @ A of a LoRA layer, the full (out, in) update of its base weight, or (E, out, in) of an experts
    parameter's. Collective under FSDP2 (it all-gathers both factors: small, rank x (in + out), E times that)."""
    if hasattr(layer, "parameter_name"):
        a, b = expert_factors(layer)
        return torch.bmm(b, a) * layer.scaling[LORA_ADAPTER]  # (E, out, in)
    a, b = full_tensor(layer.lora_A[LORA_ADAPTER].weight), full_tensor(layer.lora_B[LORA_ADAPTER].weight)
    return (b @ a) * layer.scaling[LORA_ADAPTER]


@torch.no_grad()
def expert_deltas(layer):
    """e -> scale * B_e @ A_e (out, in), expert e's update, of PEFT's adapter on an experts parameter: for the sync,
    which sends one expert at a time and must not build all E updates at once (as large as the parameter).
    Collective under FSDP2: it all-gathers the factors, once."""
    a, b = expert_factors(layer)
    return lambda e: (b[e] @ a[e]) * layer.scaling[LORA_ADAPTER]


def expert_factors(layer):
    """(A (E, r, in), B (E, out, r)), whole, of PEFT's adapter on an experts parameter, from its Linear factors
    lora_A (E * r, in) and lora_B (out, r * E) (the layout in the module docstring). Collective under FSDP2."""
    a, b = full_tensor(layer.lora_A[LORA_ADAPTER].weight), full_tensor(layer.lora_B[LORA_ADAPTER].weight)
    e = layer.num_experts
    return a.reshape(e, -1, a.shape[-1]), b.reshape(b.shape[0], -1, e).permute(2, 0, 1)


def merged_parameters(model):
    """[(name, parameter, LoRA layer or None)]: the model's parameters under the plain model's names (PEFT's
    `.base_layer` dropped, the LoRA factors left out). A LoRA-adapted weight comes with its layer: its value is the
    parameter plus lora_delta(layer). Without LoRA: named_parameters() with None."""
    # the plain name of the parameter each layer adapts: a Linear's weight, or the one an experts wrapper names
    layers = {f"{base_name(n)}.{getattr(m, 'parameter_name', 'weight')}": m for n, m in lora_layers(model).items()}
    return [(base_name(name), p, layers.get(base_name(name))) for name, p in model.named_parameters()
            if not is_lora_factor(name)]  # fmt: skip
