"""The plan's verdict and its words: whether every phase fits in FIT_SHARE of the GPU, the plan as the dry run and
every start print it (format_plan), and, when it does not fit, why, naming the single config change that would make
it fit, or what shrinks each part when none does (plan_problem).
"""

from __future__ import annotations

import dataclasses
import math

from grpo.device_plan import GIB, Settings, plan_device
from grpo.host_plan import host_per_node
from grpo.memory_plan import Plan
from grpo.model_shape import ModelShape, lora_params

FIT_SHARE = 0.95  # a phase fits when it needs at most this share of the GPU; the rest is for fragmentation
LORA_LEVER_RANK = 8  # the adapter rank a plan that does not fit suggests


def _phase_over(shape: ModelShape, x: Settings) -> tuple[str, float] | None:
    """The phase that needs the most and its bytes, when it is over the limit; None when every phase fits."""
    phases = plan_device(shape, x)["phases"]
    totals = {name: sum(parts.values()) for name, parts in phases.items()}
    worst = max(totals, key=totals.get)
    return (worst, totals[worst]) if totals[worst] > FIT_SHARE * x.gpu_bytes else None


def _largest(lo: int, hi: int, ok) -> int | None:
    """The largest v in [lo, hi] with ok(v), for ok true up to some point and false above it; None if not ok(lo)."""
    if not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _levers(shape: ModelShape, x: Settings, keys: dict[str, str]) -> list[tuple[str, str]]:
    """Single config changes that make every phase fit, as (the part of the plan it shrinks, advice naming the key).
    `keys` names the config keys the token counts came from (a token budget, or a sequence count)."""
    fits = lambda **change: _phase_over(shape, dataclasses.replace(x, **change)) is None  # noqa: E731
    out = []
    for field, part in (("train_tokens", "activations"), ("nograd_tokens", "activations")):
        key, now = keys[field], getattr(x, field)
        if key.endswith("size"):  # a sequence count: micro-batches of that many full-length sequences
            best = _largest(1, now // x.seq_len, lambda v, f=field: fits(**{f: v * x.seq_len}))
            if best is not None and best < now // x.seq_len:
                out.append((part, f"lower {key} from {now // x.seq_len} to {best}"))
        else:
            best = _largest(x.seq_len, now, lambda v, f=field: fits(**{f: v}))
            if best is not None and best < now:
                best = max(x.seq_len, best // 1024 * 1024) if best >= 1024 else best
                out.append((part, f"lower {key} from {now} to {best}"))
    if x.engine == "vllm":
        least = math.ceil(plan_device(shape, x)["vllm_min"] / x.gpu_bytes * 100)  # its weights must still fit
        best = _largest(least, round(x.vllm_util * 100), lambda v: fits(vllm_util=v / 100))
        if best is not None and best < round(x.vllm_util * 100):
            out.append(("vllm awake", f"lower rollout.gpu_memory_utilization from {x.vllm_util} to {best / 100}"))
    if not (x.offload_params and x.offload_optimizer) and x.engine == "vllm":
        if not x.offload_optimizer and fits(offload_optimizer=True):
            out.append(("adam", "set actor.offload_optimizer=true (AdamW's moments in host memory while generating)"))
        elif fits(offload_params=True, offload_optimizer=True):
            out.append(("adam", "set actor.offload_params=true and actor.offload_optimizer=true (weights and AdamW "
                                "moments in host memory while vLLM generates)"))  # fmt: skip
    if x.master_bytes == 4 and not x.lora_rank and fits(master_bytes=2):
        out.append(("adam", "set actor.master_dtype=bf16 (weights, gradients and AdamW moments in bf16: half of each)"))
    if x.reference and not x.ref_offload and fits(ref_offload=True):
        out.append(("reference", "set actor.ref_offload=true (the reference's shards in host memory)"))
    if x.teacher and not x.teacher_offload and fits(teacher_offload=True):
        out.append(("teacher", "set distill.offload=true (the teacher's shards in host memory)"))
    if not x.freeze_vision and not x.lora_rank and fits(freeze_vision=True):
        out.append(("adam", "set actor.freeze_vision_tower=true"))
    if not x.lora_rank and x.lora_targets and fits(lora_rank=LORA_LEVER_RANK):
        out.append(("adam", f"train LoRA adapters: actor.lora_rank={LORA_LEVER_RANK} (no reference model, AdamW "
                            "moments for the adapters only)"))  # fmt: skip
    if not x.checkpointing and fits(checkpointing=True):
        out.append(("activations", "set actor.gradient_checkpointing=true"))
    # a sequence too long for one GPU's activations: share it over a group of ranks (Ulysses needs the group to
    # divide the attention heads, and the ranks)
    groups = [k for k in (2, 4, 8, 16, 32) if k > x.sp and x.world % k == 0 and shape.heads % k == 0]
    if best := next((k for k in groups if fits(sp=k)), None):
        out.append(("activations", f"set actor.sequence_parallel_size={best} (each sequence shared by {best} ranks)"))
    if x.engine == "vllm" and x.sleep_level == 0 and fits(sleep_level=1):
        out.append(("vllm awake", "set rollout.sleep_level=-1 (vLLM gives its memory back while the trainer works)"))
    if x.engine == "hf" and fits(engine="vllm"):
        out.append(("kv cache", "set rollout.engine=vllm"))
    world = _largest(x.world, 1 << 16, lambda v: not fits(world=v))  # the largest world that still does not fit
    if world is not None and world < 1 << 16:
        out.append(("adam", f"shard over at least {world + 1} GPUs (more nodes; now {x.world})"))
    return out


def _gib(b: float) -> str:
    return f"{b / GIB:.1f}"


def format_plan(plan: Plan) -> str:
    """A few lines: the sharded states, each phase's further parts and total, the verdict, host memory at load."""
    x, numbers = plan.settings, plan.numbers
    phases, host, n = numbers["phases"], numbers["host"], numbers["params"]
    states = ("params", "grads", "adam", "reference", "teacher")
    size = f"{n['total'] / 1e9:.2f} B" if n["total"] >= 1e8 else f"{n['total'] / 1e6:.2f} M"
    if plan.shape.experts:  # a mixture of experts: all stored, the top-k computed
        size += f", {n['active'] / 1e9:.2f} B active" if n["active"] >= 1e8 else f", {n['active'] / 1e6:.2f} M active"
    if x.lora_rank:
        adapters = lora_params(plan.shape, x.lora_rank, x.lora_targets)["total"]
        size += f", LoRA rank {x.lora_rank}: " + (f"{adapters / 1e6:.1f} M" if adapters >= 1e6 else f"{adapters:,}")
        size += " trainable"
    device = "rank (host memory)" if x.vllm_bytes else "GPU"
    lines = [
        f"memory plan, GiB per {device}: {plan.model} ({size} parameters), world {x.world}, "
        f"{x.gpus_per_node} x {_gib(x.gpu_bytes)} GiB per node ({plan.gpu_source})",
        "  sharded    "
        + " | ".join(f"{k} {_gib(numbers['states'][k])}" for k in states if k != "teacher" or x.teacher)
        + "  (exact; the rest estimated)",
    ]
    tokens = {"update": x.train_tokens, "log-probs": x.nograd_tokens}
    for name, parts in phases.items():
        extra = [f"{k} {_gib(v)}" + (f" ({tokens[name]} tokens)" if k == "activations" else "")
                 for k, v in parts.items() if k not in states]  # fmt: skip
        # sharded states that are in host memory during this phase (offload), not on the GPU
        away = [k for k in ("params", "adam", "reference", "teacher") if numbers["states"].get(k) and not parts.get(k)]
        without = f"(without {', '.join(away)}) " if away else ""
        lines.append(f"  {name:<10} {without}+ " + " | ".join(extra) + f" = {_gib(sum(parts.values()))}")
    if x.teacher:  # what distillation costs, beside the reference's when the KL to it is on too
        nt = numbers["teacher_params"]
        kind = "its shards in host memory, distill.offload" if x.teacher_offload else "its shard on the GPU"
        ref = (f"; the reference {_gib(numbers['states']['reference'])} GiB beside it"
               if x.reference and not x.lora_rank else "")  # fmt: skip
        size_t = f"{nt['total'] / 1e9:.2f} B" if nt["total"] >= 1e8 else f"{nt['total'] / 1e6:.2f} M"
        lines.insert(2, f"  teacher    {plan.teacher} ({size_t} parameters, {x.teacher.family}, bf16): "
                        f"{_gib(2 * nt['total'] / x.world)} GiB a shard ({kind}){ref}; in the log-prob phase its "
                        "root and blocks gathered and its activations, counted above")  # fmt: skip
    totals = {name: sum(parts.values()) for name, parts in phases.items()}
    worst = max(totals, key=totals.get)
    verdict = "fits" if _phase_over(plan.shape, x) is None else "DOES NOT FIT"
    lines.append(
        f"  peak       {_gib(totals[worst])} ({worst}) of {_gib(FIT_SHARE * x.gpu_bytes)} usable "
        f"({FIT_SHARE} x {_gib(x.gpu_bytes)}) -> {verdict}"
    )
    if x.engine == "vllm" and not x.vllm_bytes:
        # how far vLLM's share may rise with everything else as it is (offloading is what frees the most)
        fits = lambda v: _phase_over(plan.shape, dataclasses.replace(x, vllm_util=v / 100)) is None  # noqa: E731
        best = _largest(math.ceil(numbers["vllm_min"] / x.gpu_bytes * 100), 99, fits)
        if best is not None:
            lines.append(f"  vllm share up to {best / 100} of the GPU fits (rollout.gpu_memory_utilization, now "
                         f"{x.vllm_util})")  # fmt: skip
    if x.video_clip_tokens:
        lines.append(f"  videos     up to {x.video_clip_tokens} tokens a clip (data.max_frames, video_max_pixels), "
                     f"{x.video_pair_tokens} per pair of frames: counted above as vision tokens")  # fmt: skip
    if x.tool_turns:
        images = x.max_images if x.max_images >= 0 else "the data's most + 1 a tool turn:"
        lines.append(f"  tools      up to {x.tool_turns} tool turns an answer, within its {x.response_len} tokens "
                     f"(data.max_response_length); {images} images a request "
                     "(rollout.max_images_per_prompt)")  # fmt: skip
    offloaded = {k: v for k, v in numbers["offloaded"].items() if v}
    if offloaded:
        moved = " + ".join(f"{k} {_gib(v)}" for k, v in offloaded.items())
        lines.append(f"offloaded to host memory while generating, GiB: {x.ranks_per_node} x ({moved}) = "
                     f"{_gib(x.ranks_per_node * sum(offloaded.values()))} per node, pinned")  # fmt: skip
    # (vLLM's pools are a few MiB: shown to the MiB rather than as 0.0)
    per_rank = " + ".join(f"{k} {_gib(v) if v >= 0.05 * GIB else f'{v / GIB:.3f}'}" for k, v in host.items() if v)
    limit = f" of the {_gib(plan.host_limit)} Slurm allows" if plan.host_limit else ""
    ranks = f"{x.ranks_per_node} rank{'s' if x.ranks_per_node > 1 else ''}"
    lines.append(
        f"host memory per node at load, GiB: {ranks} x ({per_rank}) = "
        f"{_gib(x.ranks_per_node * sum(host.values()))}{limit}, plus each process's own"
    )
    if host["vllm sleep pools"]:
        lines.append(f"  vllm sleep pools: vLLM {x.vllm_version} copies its \"runtime\" pool (block tables, sampling "
                     f"parameters: {host['vllm sleep pools'] / 2**20:.0f} MiB a rank, pinned) to host memory at every "
                     "sleep, level 2 too (0.26-0.31: none)")  # fmt: skip
    if numbers["routes"]:
        lines.append(f"  + from each rollout to its step's end: the routes replayed (algorithm.routing_replay=r3), "
                     f"{_gib(numbers['routes'])} GiB per rank at most ({x.route_tokens} tokens)")  # fmt: skip
    if x.engine == "vllm" and x.mm_cache_gb:  # the one cache that fills as a run goes on (docs/memory.md)
        lines.append(f"  + during the run: vLLM's processed images and videos, up to {x.mm_cache_gb:g} GiB per rank "
                     "(rollout.mm_cache_gb)")  # fmt: skip
    return "\n".join(lines)


def plan_problem(plan: Plan) -> str | None:
    """Why the plan cannot run, naming the config key to change (the change that shrinks the biggest part first);
    None when it fits."""
    x, numbers = plan.settings, plan.numbers
    if x.engine == "vllm" and x.vllm_util * x.gpu_bytes < numbers["vllm_min"]:
        need = math.ceil(numbers["vllm_min"] / x.gpu_bytes * 100) / 100
        return (
            f"rollout.gpu_memory_utilization={x.vllm_util} gives vLLM {_gib(x.vllm_util * x.gpu_bytes)} GiB, less "
            f"than its weights and one sequence's KV cache ({_gib(numbers['vllm_min'])} GiB): raise it to >= {need}"
        )
    host = host_per_node(numbers, x)
    if plan.host_limit and host > plan.host_limit:
        return (
            f"host memory, {_gib(host)} GiB per node (at load, or with the state offloaded), is over the "
            f"{_gib(plan.host_limit)} GiB this Slurm job may use (--mem): ask for more"
            + (
                f", or set rollout.sleep_level=2 (no host copy of vLLM's weights, "
                f"{_gib(x.ranks_per_node * numbers['host']['vllm sleep copy'])} GiB)"
                if numbers["host"]["vllm sleep copy"]
                else ""
            )
        )
    over = _phase_over(plan.shape, x)
    if over is None:
        return None
    phase, total = over
    parts = numbers["phases"][phase]
    head = (
        f"memory plan does not fit: the {phase} phase needs {_gib(total)} GiB per GPU, over the "
        f"{_gib(FIT_SHARE * x.gpu_bytes)} GiB usable ({FIT_SHARE} x {_gib(x.gpu_bytes)} GiB, {plan.gpu_source}); "
        + ", ".join(f"{k} {_gib(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v)
    )
    levers = sorted(_levers(plan.shape, x, plan.keys), key=lambda lever: -parts.get(lever[0], 0))
    if levers:
        return head + ": " + "; or ".join(advice for _, advice in levers)
    # no single change is enough: name what shrinks each part, biggest first
    shrinks = {
        "activations": plan.keys["train_tokens" if phase == "update" else "nograd_tokens"],
        "vllm awake": "rollout.gpu_memory_utilization",
        "reference": "actor.ref_offload=true",
        "teacher": "distill.offload=true",
        "adam": "more GPUs, actor.offload_optimizer=true, actor.master_dtype=bf16, actor.freeze_vision_tower=true or "
        "actor.lora_rank",
        "params": "actor.offload_params=true or actor.master_dtype=bf16",
        "kv cache": "rollout.engine=vllm or a lower rollout.max_num_seqs",
        "logits": "rollout.engine=vllm or a lower rollout.max_num_seqs",
    }
    named = [f"{shrinks[k]} ({k})" for k, _ in sorted(parts.items(), key=lambda kv: -kv[1]) if k in shrinks]
    return head + ": no single change fits it; combine: " + ", ".join(named)
