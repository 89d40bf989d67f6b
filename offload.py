"""The trainer's state off the GPU while the rollout engine generates (actor.offload_params, actor.offload_optimizer).

During the rollout the policy's shards (and the reference's) and AdamW's moments are idle, yet on the GPU they
would sit beside vLLM's KV cache: 16 bytes a parameter / world with fp32 masters (15.5 GiB per GPU for 7B on 8).
`TrainerOffload.offload` copies them to pinned host memory right after the weight sync, before vLLM wakes its KV
cache (the sync itself reads the policy's shards on the GPU), and `onload` copies the parameters back after vLLM
sleeps, before the log-prob and update phases; the moments come to the GPU for each optimizer step alone. The GPU
memory they free is vLLM's to take (rollout.gpu_memory_utilization; memory_plan.py says how far it can rise).

Parameters move through FSDP2's own `_apply` path (as `module.to()` does): it re-registers each moved shard as the
unit's sharded parameter, so later all-gathers read the moved copy and the old storage is freed. The optimizer's
moments are replaced in its state dict by their copies. Copies go out and back on the current CUDA stream with
non_blocking=True into pinned memory, so each direction is one stream of transfers the host does not wait on
tensor by tensor; one synchronize at the end makes `time/offload` and `time/onload` the transfer's real time. (A
shard whose rows do not split evenly over the ranks is re-padded by FSDP2 into pageable memory; its copy back then
waits for the host.)

On a machine without CUDA the compute device IS the host: the state is still copied out to fresh host tensors and
back (the same code path, minus pinning), so a CPU run exercises every step of the round trip, at the cost of
copying memory that frees nothing. FSDP2's CPUOffloadPolicy (actor.ref_offload, for the reference) is the other
tool: the shards live in host memory for good and every forward copies them in; see docs/memory.md for which to choose.
"""

from __future__ import annotations

import time

import torch
from torch.distributed.tensor import DTensor

import models


def moved(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of `t` on `device`, never `t` itself (pinned host memory when copying off a CUDA device). A DTensor
    stays a DTensor of the same mesh and placements, its local shard moved."""
    if isinstance(t, DTensor):
        # Built as FSDP2 builds its own CPU-offloaded shards (_fsdp_common._from_local_no_grad): DTensor.from_local
        # would move a host copy straight back to the mesh's device (torch 2.11-2.14 convert to its device_type)
        return DTensor(moved(t.to_local(), device), t._spec, requires_grad=t.requires_grad)
    pin = device.type == "cpu" and t.device.type == "cuda"
    out = torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin)
    out.copy_(t, non_blocking=pin or device.type == "cuda")
    return out


def move_parameters(model, device: torch.device) -> None:
    """Every parameter of an FSDP2 `model` (its shards) copied to `device`. FSDPModule._apply reshards first and
    then re-registers the moved shards with FSDP2 (reset_sharded_param), as model.to(device) would, but only
    parameters move: buffers such as the rotary tables stay where the forward needs them."""
    params = {id(p) for p in model.parameters()}
    with torch.no_grad():
        model._apply(lambda t: moved(t, device) if id(t) in params else t)


def move_optimizer_state(optimizer, device_of) -> None:
    """AdamW's moments copied to `device_of(param)`; the step counts stay where AdamW keeps them (host scalars)."""
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor):
                state[key] = moved(value, device_of(p))


def _local_device(p: torch.Tensor) -> torch.device:
    return p.to_local().device if isinstance(p, DTensor) else p.device


class TrainerOffload:
    """What actor.offload_params / actor.offload_optimizer move off the GPU during a rollout, and back.

    AdamW's moments are needed only inside optimizer.step(), so with offload_optimizer they live in host memory
    throughout and come to the GPU for each step alone (optimizer step hooks): the rollout, the log-prob forwards
    and the update's forwards and backwards all run without them, which is what fits 3B on one 40 GB GPU. The price
    is one round trip of the moments per optimizer step (geo3k: 4 a step), counted in time/train; time/offload and
    time/onload are the moves at the rollout's boundaries."""

    def __init__(self, model, ref_model, optimizer, actor):
        self.device = models.compute_device(model)
        self.models = []
        if actor.offload_params:
            self.models.append(model)
            # the reference too, unless CPUOffloadPolicy keeps it in host memory already (actor.ref_offload); with
            # LoRA it is the policy itself
            if ref_model is not None and ref_model is not model and not actor.ref_offload:
                self.models.append(ref_model)
        self.optimizer = optimizer if actor.offload_optimizer else None
        self.host = torch.device("cpu")
        self.on_host = False  # a step's several generate calls (filtering rounds, validation batches) offload once
        self.moments_on_host = False
        if self.optimizer is not None:
            optimizer.register_step_pre_hook(lambda *_: self._moments_to(_local_device))
            optimizer.register_step_post_hook(lambda *_: self._moments_to(lambda p: self.host))

    def _moments_to(self, device_of):
        to_host = device_of is not _local_device
        if self.moments_on_host != to_host:
            move_optimizer_state(self.optimizer, device_of)
            self.moments_on_host = to_host

    def _sync(self, timings, key, t0):
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        timings[key] = time.perf_counter() - t0

    def offload(self, timings: dict) -> None:
        """Policy, reference and AdamW moments to host memory (after the weight sync, before generating)."""
        if self.on_host or (not self.models and self.optimizer is None):
            return
        self.on_host = True
        t0 = time.perf_counter()
        for m in self.models:
            move_parameters(m, self.host)
        if self.optimizer is not None:  # (after a step they are there already)
            self._moments_to(lambda p: self.host)
        self._sync(timings, "time/offload", t0)

    def onload(self, timings: dict) -> None:
        """The parameters back to the compute device (after the engine sleeps, before the log-prob and update
        phases); the moments stay in host memory until the optimizer steps."""
        if not self.on_host:
            return
        self.on_host = False
        t0 = time.perf_counter()
        for m in self.models:
            move_parameters(m, self.device)
        self._sync(timings, "time/onload", t0)
