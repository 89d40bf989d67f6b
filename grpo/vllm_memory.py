"""What vLLM holds beside its weights, in bytes, as torch's allocators take it: its level-1 sleep's pinned host copy
of the weights, the pools its sleep copies to host memory from 0.32.0 on, and what the weight sync's layer reload
holds on the GPU.

- The sleep copy (vllm_sleep_copy): torch's power-of-two rounding of each pinned block exactly (pinned_block), vLLM's
  allocations modelled from the model's tensors (vllm_tensors, pinned_copy).
- The pools: from vLLM 0.32.0 on its sleep also copies its "runtime" and "cudagraph" pools to pinned host memory, at
  every level (sleep_backs_up_pools). The first holds the runner's block tables, slot mappings and sampling vectors,
  sized from rollout.max_num_seqs and the sequence length (vllm_runtime_pool; its attention builders' few buffers
  estimated), the second only CUDA graphs vLLM is asked to copy, which the engine does not ask: empty.
- The reload (reload_peak): vLLM's largest layer, whole as sent and again as materialised.

Read in vLLM 0.26-0.33's and torch's source. The host plan (host_plan.py) and the device plan (device_plan.py)
count them.
"""

from __future__ import annotations

import re

from grpo.model_shape import ModelShape, count_params, decoder_linears, gemma_layers, tower_linears


def pinned_block(n: int) -> int:
    """Bytes torch's pinned-memory allocator takes for a request of n: the next power of two (CachingHostAllocator
    .allocate, torch 2.11-2.14: c10::llvm::PowerOf2Ceil; 2.14's pinned_max_round_threshold is unlimited by default).
    A freed block stays cached for the next request of its power of two, never given back."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def pinned_copy(n: int) -> float:
    """Bytes of vLLM's level-1 sleep copy for a tensor of n bytes: CuMemAllocator.sleep (vLLM 0.26-0.33) pins one
    host tensor per allocation of its pool, and an allocation is a segment of torch's CUDA caching allocator: a tensor
    over 10 MiB its own, rounded up to 2 MiB; one of 1-10 MiB a share of a 20 MiB segment; a smaller one of a 2 MiB
    segment (c10/cuda/CUDACachingAllocator.cpp: kMinLargeAlloc, kLargeBuffer, kSmallBuffer, kRoundLarge)."""
    mib = 2**20
    if n >= 10 * mib:
        return pinned_block(-(-n // (2 * mib)) * 2 * mib)
    return n * pinned_block(20 * mib) / (20 * mib) if n > mib else n  # (2 MiB is a power of two already)


def vllm_tensors(s: ModelShape) -> list[int]:
    """Elements of the tensors vLLM holds for the model (before its TP split), its fusions applied: q, k, v as one;
    gate and up as one (the vision tower's too); Qwen3.5's in_proj_qkv and in_proj_z, in_proj_b and in_proj_a; a
    layer's experts as w13 and w2. Last, the parameters in none of these (norms, biases, routers, convolutions,
    position tables): small tensors, whose segments cost what they hold."""
    fused = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("in_proj_qkv", "in_proj_z"),
             ("in_proj_b", "in_proj_a")]  # fmt: skip
    out = [s.vocab * s.hidden] * (1 if s.tied else 2)
    if s.per_layer_hidden:  # Gemma 4's per-layer inputs: their embedding table and the projection into them
        out += [s.per_layer_vocab * s.layers * s.per_layer_hidden, s.hidden * s.layers * s.per_layer_hidden]
    for layer in decoder_linears(s):
        alone = set(layer) - {name for group in fused if set(group) <= set(layer) for name in group}
        out += [sum(layer[g][0] * layer[g][1] for g in group) for group in fused if set(group) <= set(layer)]
        out += [a * b for name, (a, b) in layer.items() if name in alone]
    experts = s.experts * s.hidden * s.expert_intermediate
    out += [2 * experts, experts] * (s.layers if s.experts else 0)
    tower = [a * b for _, (a, b) in tower_linears(s)]
    names = [name for name, _ in tower_linears(s)]
    for i, name in enumerate(names):
        if name == "gate_proj":  # (followed by its up_proj)
            tower[i], tower[i + 1] = tower[i] + tower[i + 1], 0
    out += [n for n in tower if n]
    return out + [count_params(s)["total"] - sum(out)]


def vllm_sleep_copy(s: ModelShape, tp: int) -> float:
    """Pinned host bytes of vLLM's level-1 sleep: every tensor's TP slice in bf16, as its segment, rounded up to a
    power of two by torch's pinned allocator. Up to twice the weights (Qwen2.5-VL-7B at TP 2: 14.3 GiB for 7.7)."""
    *big, rest = vllm_tensors(s)
    return sum(pinned_copy(2 * n // tp) for n in big) + 2 * rest / tp


# vLLM's sleep (device_allocator/sleep_mode_backend.py, CuMemBackend.suspend) backs up its "runtime" and "cudagraph"
# pools to pinned host memory at every level from 0.32.0 on, beside the weights at level 1; 0.26.0 to 0.31.0 back up
# only the weights, at level 1 (read in each release's wheel)
SLEEP_POOLS_SINCE = (0, 32)
VLLM_BLOCK = 16  # tokens of vLLM's KV-cache block on CUDA (its default; hybrid models' attention blocks are larger)
VLLM_BATCHED_TOKENS = 16384  # vLLM's LLM-class max_num_batched_tokens on an H100/H200 or larger (8192 on smaller GPUs)


def sleep_backs_up_pools(vllm_version: str) -> bool:
    """Whether this vLLM's sleep copies its "runtime" and "cudagraph" pools to host memory: from 0.32.0 on."""
    major, minor = re.match(r"(\d+)\.(\d+)", vllm_version).groups()
    return (int(major), int(minor)) >= SLEEP_POOLS_SINCE


def pool_segments(sizes: list[int]) -> list[int]:
    """The segments torch's CUDA caching allocator takes from a fresh pool for tensors of these sizes, in bytes: one
    CuMemAllocator allocation each (c10/cuda/CUDACachingAllocator.cpp): tensors of up to 1 MiB share 2 MiB segments,
    of 1-10 MiB 20 MiB ones, a larger one has its own, rounded up to 2 MiB. Packed as if nothing were freed between."""
    mib = 2**20
    small = sum(-(-n // 512) * 512 for n in sizes if n <= mib)  # (blocks of 512 B)
    medium = sum(-(-n // 512) * 512 for n in sizes if mib < n < 10 * mib)
    large = [-(-n // (2 * mib)) * 2 * mib for n in sizes if n >= 10 * mib]
    return [2 * mib] * -(-small // (2 * mib)) + [20 * mib] * -(-medium // (20 * mib)) + large


def vllm_runtime_pool(s: ModelShape, x) -> list[int]:
    """Bytes of each allocation of vLLM's "runtime" pool on one rank (`x`: the plan's device_plan.Settings): what its
    V1 runner (the one the engine picks) builds while the worker sets up the KV cache, which
    gpu_worker.initialize_from_config (0.32-0.33) wraps in that pool (the cache itself is tagged "kv_cache", the
    activations' scratch "workspace": both discarded by a sleep, not copied). Per KV-cache group the input batch's
    block table (int32, max_num_seqs x max_model_len / VLLM_BLOCK) and slot mapping (int64, VLLM_BATCHED_TOKENS or
    max_model_len), and the attention builder's buffers (FlashAttention 3's scheduler metadata, Qwen3.5's GDN state
    indices: a few int32 per sequence, counted as 64 KiB, an estimate); six sampling-parameter vectors (4 B per
    sequence). A hybrid model's layers go in groups of as many as it has full-attention layers, each counted as full
    attention (its linear groups' tables are one block a row): an upper bound. A few MiB: everything fits in 2 MiB
    segments unless max_num_seqs x max_model_len is in the millions."""
    other, full = s.linear_layers, s.layers - s.linear_layers
    if s.family == "gemma4":  # its sliding layers likewise, beside its full ones (kv-shared layers keep no cache)
        own = [is_full for is_full, shared, *_ in gemma_layers(s) if not shared]
        other, full = own.count(False), own.count(True)
    groups = 1 + (-(-other // full) if other else 0)
    table = 4 * x.max_num_seqs * -(-x.seq_len // VLLM_BLOCK)
    per_group = [table, 8 * max(VLLM_BATCHED_TOKENS, x.seq_len), 64 * 2**10]
    return pool_segments(per_group * groups + [4 * x.max_num_seqs] * 6)


def reload_peak(s: ModelShape, tp: int) -> float:
    """What vLLM's weight sync holds beside its weights. Its layer-wise reload (model_loader/reload/layerwise.py,
    0.26-0.33) keeps every tensor the sync sends a layer (full, bf16) until the layer has them all, then materialises
    the layer's own copy (its TP slice) to load them into, before copying that into the weights in place: the largest
    layer's bf16 weights, once whole and once split. A fused-MoE layer is all its experts, though they come one at a
    time (1.2 GB for Qwen3-VL-30B-A3B, 1.6 GB for Qwen3.5-35B-A3B); a dense model's largest is its embedding (Gemma
    4 E2B's and E4B's their per-layer inputs' table)."""
    largest = max(s.largest_table, 3 * s.experts * s.hidden * s.expert_intermediate, 2 * s.hidden * s.intermediate)
    return 2 * largest * (1 + 1 / tp)
