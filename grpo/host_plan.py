"""One node's host memory: what each rank holds at load (its policy and reference shards, the read buffer, vLLM's
pinned sleep copies), what stays there as the run goes on (the offloaded state, routing replay's routes), the node's
total that Slurm's --mem must cover, and this machine's memory per rank (what a CPU run's plan is of).

A job over its --mem is killed by the cgroup without a traceback (docs/memory.md): the dry run says it first
(plan_advice.plan_problem).
"""

from __future__ import annotations

import os

from grpo.device_plan import Settings
from grpo.model_shape import ModelShape, count_params, lora_params
from grpo.vllm_memory import pinned_block, sleep_backs_up_pools, vllm_runtime_pool, vllm_sleep_copy


def plan_host(s: ModelShape, x: Settings) -> dict:
    """Host bytes per rank at load, part by part; the allocations of the pools vLLM's sleep copies besides the weights
    (bytes each); and routing replay's routes, held from each rollout to its step's end."""
    n = count_params(s)
    nt = count_params(x.teacher) if x.teacher else None
    adapters = lora_params(s, x.lora_rank, x.lora_targets)["total"] if x.lora_rank else 0
    reference = x.reference and not x.lora_rank  # with LoRA the reference is the base itself
    with_vllm = x.engine == "vllm"
    # What vLLM 0.32+ copies to pinned host memory at every sleep besides the weights, as CuMemAllocator allocations
    # (sleep needs CUDA). The "cudagraph" pool holds the CUDA graphs only with sleep_mode_offload_cudagraph, which the
    # engine leaves off (vLLM's default): they stay on the GPU in vLLM's own graph pool (RUNTIME), and it is empty.
    sleeps = with_vllm and not x.vllm_bytes and x.sleep_level > 0
    copied = sleeps and sleep_backs_up_pools(x.vllm_version)
    pools = {"runtime": vllm_runtime_pool(s, x) if copied else [], "cudagraph": []}
    # host memory per rank while loading: this rank's policy shard (fp32; with LoRA a bf16 base) and bf16 reference
    # shard, read through a buffer of up to the largest tensor (the embedding or Gemma 4's per-layer table, bf16),
    # beside vLLM's level-1 sleep copy (pinned, bf16, its TP slice, each block a power of two), which the engine made
    # before the trainer's model loads and which torch's pinned allocator keeps cached from then on (a level-2 sleep
    # keeps only the buffers), and the pools vLLM 0.32+ copies at every level, the same way
    host = {
        "policy": (2 * n["total"] + 4 * adapters if x.lora_rank else x.master_bytes * n["total"]) / x.world,
        "reference": 2 * n["total"] / x.world if reference else 0,
        "read buffer": 2 * max(s.largest_table, x.teacher.largest_table if nt else 0),
        "vllm sleep copy": vllm_sleep_copy(s, x.tp) if with_vllm and x.sleep_level == 1 else 0,
        "vllm sleep pools": sum(pinned_block(n) for n in pools["runtime"] + pools["cudagraph"]),
    }
    if nt:  # the teacher's bf16 shard, read as the reference's is (in host memory for good with distill.offload)
        host["teacher"] = 2 * nt["total"] / x.world
    return {
        "host": host,
        "vllm pools": pools,
        # routing replay: each sample's experts per token and MoE layer, held from the rollout to the step's end
        "routes": x.route_tokens * s.layers * s.experts_per_token * (1 if s.experts <= 128 else 2),  # int8 or int16
    }


def host_per_node(numbers: dict, x: Settings) -> float:
    """The host bytes per node the plan compares with Slurm's --mem: at load, or from the first offload on (the
    arenas, beside vLLM's sleep copies, which torch's pinned allocator keeps cached, and routing replay's routes),
    whichever is more."""
    host = numbers["host"]
    running = sum(numbers["offloaded"].values()) + host["vllm sleep copy"] + host["vllm sleep pools"]
    running += numbers["routes"]  # routing replay's routes, from each rollout to its step's end
    return x.ranks_per_node * max(sum(host.values()), running)


def host_bytes_per_rank(ranks: int) -> float:
    """This machine's physical memory over the ranks that share it."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, ranks)
