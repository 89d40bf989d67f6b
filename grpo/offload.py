"""The trainer's state off the GPU while the rollout engine generates (actor.offload_params, actor.offload_optimizer).

During the rollout the policy's shards (and the reference's) and AdamW's moments are idle, yet on the GPU they
would sit beside vLLM's KV cache: 16 bytes a parameter / world with fp32 masters (15.5 GiB per GPU for 7B on 8).
`TrainerOffload.offload` copies them to pinned host memory right after the weight sync, before vLLM wakes its KV
cache (the sync itself reads the policy's shards on the GPU), and `onload` copies the parameters back after vLLM
sleeps, before the log-prob and update phases; the moments come to the GPU for each optimizer step alone. The GPU
memory they free is vLLM's to take (rollout.gpu_memory_utilization; the memory plan says how far it can rise).

Parameters move through FSDP2's own `_apply` path (as `module.to()` does): it re-registers each moved shard as the
unit's sharded parameter, so later all-gathers read the moved copy and the old storage is freed. Its
reset_sharded_param (torch 2.11-2.14) re-pads a shard shorter than FSDP2's padded size (a parameter whose rows do not
split evenly over the ranks: Qwen2.5-VL's vision MLP, 3,420 rows over 8) with a host-side copy of the moved shard,
into pageable memory; so every copy is first enqueued (non_blocking, one stream of transfers the host does not wait
on tensor by tensor), then the host waits for them all (`wait_for_copies`), and only then are the finished copies
handed to `_apply`. Handing it copies still in flight would re-pad rows not yet written: silent zeros or stale rows
in the policy or the reference. The optimizer's moments are replaced in its state dict by their copies, also waited
for (a checkpoint may read them from host memory next).

Host memory is one block per rank for the parameters and one for the moments (`HostArena`), allocated at the first
offload at exactly the bytes they need, sliced, and reused at every later one. Not torch's pinned allocator: its
CachingHostAllocator (torch 2.11-2.14) rounds every block up to the next power of two and keeps freed blocks cached
for reuse, so a tensor per shard would pin up to twice the state (device_plan.py plans what the arenas take). On
CUDA an arena is pinned by registering it with the driver (cudaHostRegister), which rounds nothing.

On a machine without CUDA the compute device IS the host: the state is still copied out to the arenas and back (the
same code path, minus pinning), so a CPU run exercises every step of the round trip, at the cost of copying memory
that frees nothing. FSDP2's CPUOffloadPolicy (actor.ref_offload, for the reference) is the other tool: the shards
live in host memory for good and every forward copies them in; see docs/memory.md for which to choose.
"""

from __future__ import annotations

import time

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from grpo import logprobs

ALIGN = 512  # each arena slice starts on a multiple of this, as the blocks of torch's CUDA allocator do
PAGE = 4096  # an arena starts on a page (cudaHostRegister locks whole pages)


class HostArena:
    """Host memory for a fixed list of tensors: one block at their exact size (plus ALIGN per slice), sliced into a
    view per tensor, allocated when the list's shapes first appear and reused while they stay the same."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.block, self.layout, self.offsets = None, None, []

    @staticmethod
    def bytes_for(sizes) -> int:
        """What an arena takes for tensors of `sizes` bytes (device_plan.py counts the same)."""
        return sum(-(-n // ALIGN) * ALIGN for n in sizes)

    def _allocate(self, layout) -> None:
        self.release()
        sizes = [torch.Size(shape).numel() * dtype.itemsize for shape, dtype in layout]
        self.offsets = [self.bytes_for(sizes[:i]) for i in range(len(sizes))]
        total = self.bytes_for(sizes)
        raw = torch.empty(total + PAGE, dtype=torch.uint8)
        start = -raw.data_ptr() % PAGE
        self.block = raw[start : start + total]
        if self.pin and total:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(self.block.data_ptr(), total, 0))
        self.layout = layout

    def release(self) -> None:
        if self.pin and self.block is not None and self.block.numel():
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self.block.data_ptr()))
        self.block, self.layout = None, None

    def views(self, tensors) -> list[torch.Tensor]:
        """One host tensor per tensor of `tensors`, of its shape and dtype, each a slice of the block."""
        layout = [(tuple(t.shape), t.dtype) for t in tensors]
        if layout != self.layout:
            self._allocate(layout)
        return [
            self.block[o : o + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)
            for o, (shape, dtype) in zip(self.offsets, layout)
        ]


def wait_for_copies() -> None:
    """The host waits until every copy enqueued on the current CUDA stream has landed (without CUDA every copy was
    synchronous)."""
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()


def moved(t: torch.Tensor, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """A copy of `t` on `device` (into `out`, a host tensor of its local shape, when given), never `t` itself;
    enqueued, not waited for. A DTensor stays a DTensor of the same mesh and placements, its local shard moved."""
    if isinstance(t, DTensor):
        # Built as FSDP2 builds its own CPU-offloaded shards (_fsdp_common._from_local_no_grad): DTensor.from_local
        # would move a host copy straight back to the mesh's device (torch 2.11-2.14 convert to its device_type)
        return DTensor(moved(t.to_local(), device, out), t._spec, requires_grad=t.requires_grad)
    if out is None:
        out = torch.empty(t.shape, dtype=t.dtype, device=device)
    out.copy_(t, non_blocking=t.device.type == "cuda" or device.type == "cuda")
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def move_parameters(model, device: torch.device, arena: HostArena | None = None) -> None:
    """Every parameter of an FSDP2 `model` (its shards) copied to `device` (into `arena` when given: host memory).
    FSDPModule._apply then re-registers the moved shards with FSDP2 (reset_sharded_param), as model.to(device)
    would, but only parameters move: buffers such as the rotary tables stay where the forward needs them. The copies
    have landed before _apply sees them: it re-pads an uneven shard by reading it on the host."""
    for m in model.modules():  # (_apply reshards only the module it is called on: every unit's shards, registered)
        if isinstance(m, FSDPModule):
            m.reshard()
    params = list({id(p): p for p in model.parameters()}.values())
    outs = arena.views([_local(p) for p in params]) if arena is not None else [None] * len(params)
    with torch.no_grad():
        copies = {id(p): moved(p, device, out) for p, out in zip(params, outs)}
        wait_for_copies()
        model._apply(lambda t: copies.get(id(t), t))


def move_optimizer_state(optimizer, device_of, arena: HostArena | None = None) -> None:
    """AdamW's moments copied to `device_of(param)` (all into `arena` when given: host memory), waited for; the step
    counts stay where AdamW keeps them (host scalars)."""
    moments = [(p, state, key) for p, state in optimizer.state.items() for key, value in state.items()
               if key != "step" and isinstance(value, torch.Tensor)]  # fmt: skip
    outs = arena.views([_local(state[key]) for _, state, key in moments]) if arena else [None] * len(moments)
    for (p, state, key), out in zip(moments, outs):
        state[key] = moved(state[key], device_of(p), out)
    wait_for_copies()


def _local_device(p: torch.Tensor) -> torch.device:
    return p.to_local().device if isinstance(p, DTensor) else p.device


class TrainerOffload:
    """What actor.offload_params / actor.offload_optimizer move off the GPU during a rollout, and back.

    AdamW's moments are needed only inside optimizer.step(), so with offload_optimizer they live in host memory
    throughout and come to the GPU for each step alone (optimizer step hooks): the rollout, the log-prob forwards
    and the update's forwards and backwards all run without them, which is what fits 3B on one 40 GB GPU. The price
    is one round trip of the moments per optimizer step (geo3k: 4 a step), counted in time/train; time/offload and
    time/onload are the moves at the rollout's boundaries."""

    def __init__(self):
        # Made before the models load, to be handed to the engine (rollout.make_engine), which starts first: until
        # `hold` it holds nothing, and offload and onload do nothing.
        self.models, self.optimizer, self.arenas, self.moments = [], None, [], None
        self.host = torch.device("cpu")
        self.on_host = False  # a step's several generate calls (filtering rounds, validation batches) offload once
        self.moments_on_host = False

    def hold(self, model, ref_model, optimizer, actor, teacher=None, teacher_offload=False) -> None:
        """What it moves from now on (once the models and the optimizer exist): the policy, the reference, the
        distillation teacher and the optimizer's moments, as actor.offload_params / offload_optimizer choose."""
        self.device = logprobs.compute_device(model)
        self.models = []
        if actor.offload_params:
            self.models.append(model)
            # the reference too, unless CPUOffloadPolicy keeps it in host memory already (actor.ref_offload); with
            # LoRA it is the policy itself. The teacher likewise (distill.offload)
            if ref_model is not None and ref_model is not model and not actor.ref_offload:
                self.models.append(ref_model)
            if teacher is not None and not teacher_offload:
                self.models.append(teacher)
        self.optimizer = optimizer if actor.offload_optimizer else None
        pin = self.device.type == "cuda"
        self.arenas = [HostArena(pin) for _ in self.models]  # one per model: policy, reference, teacher
        self.moments = HostArena(pin)
        if self.optimizer is not None:
            optimizer.register_step_pre_hook(lambda *_: self._moments_to(_local_device))
            optimizer.register_step_post_hook(lambda *_: self._moments_to(lambda p: self.host))

    def _moments_to(self, device_of):
        to_host = device_of is not _local_device
        if self.moments_on_host != to_host:
            move_optimizer_state(self.optimizer, device_of, self.moments if to_host else None)
            self.moments_on_host = to_host

    def offload(self, timings: dict) -> None:
        """Policy, reference and AdamW moments to host memory (after the weight sync, before generating)."""
        if self.on_host or (not self.models and self.optimizer is None):
            return
        self.on_host = True
        t0 = time.perf_counter()
        for m, arena in zip(self.models, self.arenas):
            move_parameters(m, self.host, arena)
        if self.optimizer is not None:  # (after a step they are there already)
            self._moments_to(lambda p: self.host)
        timings["time/offload"] = time.perf_counter() - t0  # (the moves waited for their copies)

    def onload(self, timings: dict) -> None:
        """The parameters back to the compute device (after the engine sleeps, before the log-prob and update
        phases); the moments stay in host memory until the optimizer steps."""
        if not self.on_host:
            return
        self.on_host = False
        t0 = time.perf_counter()
        for m in self.models:
            move_parameters(m, self.device)
        timings["time/onload"] = time.perf_counter() - t0
