"""Mixture-of-experts models (Qwen3-VL-MoE, Qwen3.5-MoE, Gemma 4's 26B-A4B): where their experts lie in a
checkpoint, how they compute, and their routers (what the load-balancing loss and routing replay hook).

transformers 5 holds a layer's routed experts as two 3-D parameters, `experts.gate_up_proj` (E, 2I, H) and
`experts.down_proj` (E, H, I), E the number of experts; FSDP2 shards their dim 0, so a rank holds whole experts.
Checkpoints store them in one of three layouts, and from_pretrained converts whichever it finds:
- fused: the same two tensors, as transformers holds them;
- transposed: the same two names with their last two dims swapped, (E, H, 2I) and (E, I, H) -- Qwen3-VL-MoE's
  checkpoints (Qwen3-VL-30B-A3B), and what vLLM's Qwen3-VL-MoE loader takes under those names;
- per_expert: one 2-D tensor per expert and projection, `experts.{e}.gate_proj.weight` (I, H), `up_proj` (I, H),
  `down_proj` (H, I) -- Qwen3.5-MoE's checkpoints (Qwen3.5-35B-A3B), and what transformers' save_pretrained writes
  for it.
loading.load_weights reads a rank's experts from any of them (read_experts), and checkpoint.save_hf writes them back
in the layout the checkpoint had (export_pieces), so that from_pretrained and vLLM load an export as they loaded the
original. The weight sync streams them to vLLM one expert at a time (stream_experts), in the per-expert names, which
vLLM's loaders take for both families (vLLM still holds a whole layer's experts, twice, until the layer is loaded).

The experts' forward is transformers' own (`experts_implementation`), chosen per device by experts_implementation:
its grouped GEMM on CUDA, its loop over the experts on CPU.
"""

from __future__ import annotations

import re

import torch

# a model's expert parameter: (the layer's prefix, which of the two)
EXPERT_PARAM = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
# a per-expert checkpoint tensor: (the layer's prefix, the expert, its projection)
PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
# which per-expert projections make up each fused parameter, in the order transformers concatenates them (dim 1)
PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
LAYOUTS = ("fused", "transposed", "per_expert")


def model_name(key: str) -> str:
    """The model's parameter that a checkpoint tensor belongs to: a per-expert tensor's fused parameter, any other
    name unchanged."""
    m = PER_EXPERT.match(key)
    if m is None:
        return key
    proj = "down_proj" if m["proj"] == "down_proj" else "gate_up_proj"
    return f"{m['prefix']}.{proj}"


def layout(name: str, shape, where: dict) -> str | None:
    """How the checkpoint stores the model's expert parameter `name` of `shape` (E, out, in): one of LAYOUTS, or
    None if it lacks it (or holds it in another shape). `where` maps the checkpoint's tensor names (after
    transformers' renamings) to their shapes."""
    shape = tuple(shape)
    if name in where:
        found = tuple(where[name])
        if found == shape:
            return "fused"
        if found == (shape[0], shape[2], shape[1]):
            return "transposed"
        return None
    m = EXPERT_PARAM.match(name)
    keys = [f"{m['prefix']}.{e}.{part}.weight" for e in range(shape[0]) for part in PARTS[m["proj"]]]
    rows = shape[1] // len(PARTS[m["proj"]])
    if all(tuple(where.get(k, ())) == (rows, shape[2]) for k in keys):
        return "per_expert"
    return None


def read_experts(name: str, kind: str, read, start: int, stop: int) -> torch.Tensor:
    """Experts [start, stop) of the model's parameter `name`, (stop - start, out, in), from a checkpoint of layout
    `kind`; read(key, start, stop) gives rows [start, stop) of the checkpoint's tensor `key` (a slice of a memory-
    mapped file), read(key) all of it. Only this rank's experts are read."""
    if kind == "fused":
        return read(name, start, stop)
    if kind == "transposed":
        return read(name, start, stop).transpose(1, 2)
    m = EXPERT_PARAM.match(name)
    parts = PARTS[m["proj"]]
    experts = [torch.cat([read(f"{m['prefix']}.{e}.{part}.weight") for part in parts]) for e in range(start, stop)]
    return torch.stack(experts) if experts else None


def export_pieces(name: str, kind: str, shape) -> list[tuple[str, tuple, callable]]:
    """The checkpoint tensors (name, shape, piece) that the model's expert parameter `name` is written as in layout
    `kind`; piece(full) cuts one out of the gathered parameter."""
    e, out, inp = shape
    if kind == "fused":
        return [(name, (e, out, inp), lambda full: full)]
    if kind == "transposed":
        return [(name, (e, inp, out), lambda full: full.transpose(1, 2))]
    m = EXPERT_PARAM.match(name)
    parts = PARTS[m["proj"]]
    rows = out // len(parts)
    return [
        (f"{m['prefix']}.{i}.{part}.weight", (rows, inp), lambda full, i=i, j=j: full[i, j * rows : (j + 1) * rows])
        for i in range(e)
        for j, part in enumerate(parts)
    ]


def stream_experts(name: str, param, dtype, delta=None):
    """Yield (vLLM's name, tensor) for every expert of the model's expert parameter `name`, one expert at a time, as
    the per-expert checkpoint tensors (`experts.{e}.gate_proj.weight` (I, H), `up_proj`, `down_proj` (H, I)), in
    `dtype`; with `delta` (e -> expert e's LoRA update (out, in), lora.expert_deltas) each merged into its expert in
    fp32 first. Collective under FSDP2: every rank of the shard group must iterate it to the end. Each expert is
    broadcast from the rank whose dim-0 shard holds it, so the trainer never gathers the whole parameter; but vLLM's
    layer-wise reload (model_loader/reload/layerwise.py, 0.26-0.33) keeps every tensor it is sent until the layer is
    whole and then materialises the layer's own copy to load them into: while a layer syncs, vLLM holds all its
    experts twice beside its weights (1.2 GB of bf16 each time per layer of Qwen3-VL-30B-A3B, 1.6 GB of
    Qwen3.5-35B-A3B; vllm_memory.reload_peak counts it)."""
    import torch.distributed as dist

    m = EXPERT_PARAM.match(name)
    parts = PARTS[m["proj"]]
    mesh = getattr(param, "device_mesh", None)
    local = param.to_local() if mesh is not None else param
    group = mesh.get_group(0) if mesh is not None else None
    per_rank = -(-param.shape[0] // mesh.size()) if mesh is not None else param.shape[0]  # torch.chunk's split

    def merged(e, row):  # (out, in) in `dtype`
        return (local[row] if delta is None else local[row] + delta(e)).to(dtype).contiguous()

    for e in range(param.shape[0]):
        owner, row = divmod(e, per_rank)
        if mesh is None:
            expert = merged(e, e)
        else:
            mine = mesh.get_local_rank() == owner
            expert = merged(e, row) if mine else local.new_empty(param.shape[1:], dtype=dtype)
            dist.broadcast(expert, src=dist.get_global_rank(group, owner), group=group)
        rows = expert.shape[0] // len(parts)
        for j, part in enumerate(parts):
            yield f"{m['prefix']}.{e}.{part}.weight", expert[j * rows : (j + 1) * rows]


def experts_implementation(device) -> str:
    """transformers' experts forward for `device`. On CUDA "grouped_mm": the tokens sorted by expert and every
    expert's GEMM in one torch.nn.functional.grouped_mm call a projection (bf16, SM80+; transformers falls back to a
    loop of its own on older GPUs), instead of the default forward's Python loop of two small GEMMs per expert that
    has tokens (128 experts a layer in Qwen3-VL-30B-A3B). On CPU "eager", that loop: transformers' reference, as fast
    as torch's CPU grouped kernel at the CPU lane's sizes (44 vs 43 ms for a tiny model's forward and backward),
    and it needs no kernel of a particular torch version (the CPU kernel's backward rejects a broadcast gradient
    on torch 2.11 and 2.13). "batched_mm" copies each token's experts' weights: 20x slower here."""
    return "grouped_mm" if device.type == "cuda" else "eager"


def top_k(text_config) -> int:
    """How many experts each token is routed to (Gemma 4 names it top_k_experts); None for a model without."""
    return getattr(text_config, "num_experts_per_tok", None) or getattr(text_config, "top_k_experts", None)


def describe(model) -> str:
    """One log line: the experts' shape and how they compute."""
    c = model.config.get_text_config()
    impl = model.model.language_model.config._experts_implementation
    return (f"experts: {c.num_experts} a layer, top-{top_k(c)} routed, intermediate "
            f"{c.moe_intermediate_size}; forward {impl} (transformers' experts_implementation)")  # fmt: skip


# a decoder layer's router, as transformers 5 and vLLM 0.26 to 0.33 name it. Qwen's `layers.N.mlp.gate`:
# transformers' TopKRouter returns (logits (N, E), top-k weights, chosen experts), vLLM's is a linear layer returning
# (logits, bias). Gemma 4's `layers.N.router` (a weightless RMSNorm, times hidden^-0.5 and a learned `scale`, then
# `proj`): transformers' returns (probabilities (N, E) in fp32, top-k weights times the chosen experts'
# per_expert_scale, chosen experts), vLLM's the logits alone. vLLM takes the top-k of the logits on both: the same
# experts as the probabilities' top-k.
ROUTER = re.compile(r"layers\.(\d+)\.(?:mlp\.gate|router)$")


def routers(model) -> list:
    """The router of every MoE layer of `model` (the trainer's or vLLM's), in layer order."""
    found = {int(m[1]): module for name, module in model.named_modules() if (m := ROUTER.search(name))}
    return [found[i] for i in sorted(found)]


def probabilities(router, out) -> torch.Tensor:
    """The softmax over all experts (N, E), fp32, of a transformers router's output `out`: Qwen's router returns its
    logits, Gemma 4's (the one with a per_expert_scale) the probabilities themselves, which a second softmax would
    flatten towards uniform."""
    first = out[0].float()  # (N, E)
    return first if hasattr(router, "per_expert_scale") else torch.softmax(first, dim=-1)


def combine_weights(router, probs: torch.Tensor, chosen: torch.Tensor, dtype) -> torch.Tensor:
    """The weights (N, k) the router gives the experts `chosen` (N, k), as its own forward computes them for its
    top-k: their probabilities (N, E) renormalised over the k, times each one's per_expert_scale on Gemma 4; in
    `dtype`, that of the router's own weights (Qwen's: its logits'; Gemma's: fp32)."""
    weights = probs.gather(-1, chosen)  # (N, k)
    weights = weights / weights.sum(-1, keepdim=True)
    scale = getattr(router, "per_expert_scale", None)  # (E,)
    if scale is not None:
        weights = weights * scale[chosen]
    return weights.to(dtype)


class RouterBalance:
    """The routed experts' load-balancing loss of a training forward (actor.router_aux_loss_coef): Switch
    Transformer's (https://arxiv.org/abs/2101.03961, eqs. 4-6) as transformers computes it for these models
    (load_balancing_loss_func): E * sum_e f_e P_e, f_e the share of top-k picks expert e got and P_e its mean router
    probability, both over every token the forward computed (pads left out) of all layers together. Gemma 4's
    routers give their probabilities, Qwen's their logits (probabilities): the loss is the same function of them.

    Hooks on the routers add up each layer's counts and probabilities while the forward runs, so only (E,) sums are
    kept, never every layer's (tokens, E) logits. Only forwards with gradients count (not the old/reference log-probs
    nor generation). Under activation checkpointing the backward re-runs each layer's forward, hooks included; those
    re-runs must repeat the same operations (checkpointing checks what they save), so they compute and then drop
    their sums: the loss was taken before the backward began."""

    def __init__(self, model):
        self.num_experts = model.config.get_text_config().num_experts
        self.top_k = top_k(model.config.get_text_config())
        self.open = False
        model.register_forward_pre_hook(self._start, with_kwargs=True)
        for router in routers(model):
            router.register_forward_hook(self._add)

    def _start(self, model, args, kwargs):
        mask = kwargs.get("attention_mask")  # (B, L) padded; None packed, which has no pads
        self.mask = None if mask is None else mask.reshape(-1)  # (N,), the routers' rows
        self.counts, self.probs, self.rows = 0.0, 0.0, 0.0
        self.open = torch.is_grad_enabled()

    def _add(self, router, args, out):
        if not torch.is_grad_enabled():
            return
        probs = probabilities(router, out)  # (N, E)
        weight = probs.new_ones(len(probs)) if self.mask is None else self.mask.to(probs)  # (N,)
        with torch.no_grad():  # which experts a token picked carries no gradient
            top = probs.topk(self.top_k, dim=-1).indices.reshape(-1)  # (N k,)
            counts = probs.new_zeros(self.num_experts).scatter_add_(0, top, weight.repeat_interleave(self.top_k))
        prob_sums = (probs * weight[:, None]).sum(0)  # (E,)
        if self.open:
            self.counts, self.probs, self.rows = self.counts + counts, self.probs + prob_sums, self.rows + weight.sum()

    def loss(self) -> torch.Tensor:
        """The loss of the last training forward, a scalar in its graph; taken once, before its backward."""
        if not self.open:
            raise RuntimeError("RouterBalance.loss: no forward with gradients since the last loss was taken")
        self.open = False
        rows = max(float(self.rows), 1.0)
        return self.num_experts * (self.counts / rows * self.probs / rows).sum()
