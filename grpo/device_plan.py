"""One GPU's bytes in each phase of a step (update, log-probs, the optimizer step with offloaded moments, the weight
sync, the rollout): pure arithmetic on the model's shape (model_shape.py) and the run's Settings, which
memory_plan.plan_memory takes from the config. Every start prints it (plan_advice.format_plan), and on CUDA a phase
over the limit stops the run with the config key to change.

What is exact and what is estimated:
- Exact: the sharded states, from the exact parameter counts: FSDP2 shards every parameter over all ranks, each rank
  keeps 1/world of the fp32 master weights, their fp32 gradients and AdamW's two fp32 moments (trainable parameters
  only; all three bf16 with actor.master_dtype=bf16), and of the reference model in the compute dtype (bf16). What
  actor.offload_params and actor.offload_optimizer move to host memory leaves the phases it is away from (offload.py).
- Estimated: everything that depends on kernels and the allocator. The all-gathered bf16 units (the root's
  embedding and LM head stay gathered through forward and backward, one block plus the prefetched next), the
  gradients in flight (FSDP2 reduce-scatters them in fp32), the activations of one micro-batch (as if every token
  of the budget were an image token: the worst case the config allows), the chunked LM head, vLLM's share while
  awake (exactly what it takes: rollout.gpu_memory_utilization of the device) and a fixed RUNTIME for the CUDA
  context, NCCL buffers and what vLLM keeps while asleep. Fragmentation is what plan_advice.FIT_SHARE leaves free.
  The weight sync's layer reload: vllm_memory.reload_peak.

Videos cost what images cost per token: an LM token of a clip is merge^2 patches (each of temporal_patch frames),
as an image's is, so the activation terms' worst case (every token of the budget a vision token) covers them, and the
KV caches count a prompt's video tokens with the rest of it. vLLM's vision encoder runs inside its share of the GPU
while awake: vLLM profiles its largest image and clip (rollout.max_images_per_prompt / max_videos_per_prompt at the
data's budgets) at start and stops there if they do not fit.

Tool rollouts (rollout.tools, turns.py) add no term of their own: an answer's tool turns, their images' tokens with
them, count inside data.max_response_length (the turn loop stops an answer whose next tool turn would not fit), so
every sequence stays within seq_len and every micro-batch within its token budget, whose worst case is already all
vision tokens; each continuation turn is one more prompt of at most seq_len tokens to vLLM's KV cache or the HF
engine's, as the first turn's was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from grpo.model_shape import ModelShape, count_params, lora_params
from grpo.vllm_memory import reload_peak

GIB = 2**30
# CUDA context and kernels, NCCL buffers, vLLM's CUDA graphs and buffers while asleep, and the few MiB of its "runtime"
# pool and its scratch that 0.32+ maps again with the weights, before the sync (estimate)
RUNTIME = 2 * GIB
HEAD_CHUNK = 512  # tokens per LM-head chunk (logprobs.chunked_logprobs)


@dataclass(frozen=True)
class Settings:
    """What the plan depends on, the device's and the host's, taken from the config by memory_plan.plan_memory;
    plan_advice's levers try changes to it."""

    world: int  # ranks FSDP2 shards over
    gpus_per_node: int
    ranks_per_node: int
    gpu_bytes: float
    train_tokens: int  # tokens of one training micro-batch
    nograd_tokens: int  # tokens of one old/ref log-prob micro-batch
    checkpointing: bool
    freeze_vision: bool
    reference: bool  # algorithm.kl_coef > 0
    ref_offload: bool
    engine: str
    vllm_util: float
    sleep_level: int
    tp: int
    seq_len: int  # max_prompt_length + max_response_length
    response_len: int
    hf_rows: int  # sequences one HF generate call decodes at once
    max_num_seqs: int  # rollout.max_num_seqs: sequences one vLLM engine decodes together
    vllm_version: str  # the vLLM release planned for (what its sleep copies to host memory depends on it)
    lora_rank: int = 0  # actor.lora_rank: > 0 trains adapters only, and the reference is the base itself
    lora_targets: tuple[str, ...] = ()  # actor.lora_target_modules
    master_bytes: int = 4  # actor.master_dtype: 4 (fp32) or 2 (bf16) bytes a trainable weight, gradient, moment
    offload_params: bool = False  # actor.offload_params: policy and reference shards in host memory while generating
    offload_optimizer: bool = False  # actor.offload_optimizer: AdamW's moments in host memory while generating
    vllm_bytes: float = 0.0  # a CPU run: vLLM's weights and KV cache in bytes (there is no GPU share to take)
    video_clip_tokens: int = 0  # most vision tokens of one video at data.max_frames and data.video_max_pixels
    video_pair_tokens: int = 0  # ... of one pair of its frames (one temporal token): a second of video at 2 fps
    tool_turns: int = 0  # rollout.max_turns - 1 with rollout.tools: tool turns an answer may hold, inside response_len
    max_images: int = 1  # rollout.max_images_per_prompt: images one vLLM request may carry, the tool turns' included
    teacher: ModelShape | None = None  # distill.model_path's shape: a frozen bf16 shard, as the reference's
    teacher_offload: bool = False  # distill.offload: its shards in host memory, on the GPU for its forwards only
    mm_cache_gb: float = 0.0  # rollout.mm_cache_gb: vLLM's cache of processed images and videos, host memory per rank
    sp: int = 1  # actor.sequence_parallel_size: ranks that share each micro-batch's tokens (and its images' patches)
    route_tokens: int = 0  # algorithm.routing_replay=r3: tokens whose routes a rank holds (its samples x seq_len)
    act_bytes: int = 2  # bytes an activation element: 2 in bf16 (a GPU run); 4 in fp32 (bench/bench_sp.py on CPU)


def layer_elems(h, kv, i, checkpointing, fused_qkv=False, rope=0, q=0):
    """Activation elements per token of one transformer block: (kept until its backward, extra while its backward
    runs). A block's forward keeps 8h + 4kv + 4i: each RMSNorm its fp32 input and bf16 output, the projections'
    inputs, q, k, v, rotated q and k, the attention output, and the MLP's gate, up, act(gate) and product; a vision
    block also its fused qkv output (3h), a decoder layer the cos and sin it rebuilds from the mRoPE sections
    (`rope` = 2 x head_dim). Counted with saved_tensors_hooks on transformers 5.19's layers in bf16
    (tests/test_memory_plan.py). Backward adds their gradients in flight (~2h + 2i, an estimate). With
    checkpointing only the block's input stays, and its backward first recomputes the rest. `q`: the queries' width
    where it is more than h (Gemma 4's full layers), whose q, rotated q and attention output are that much wider."""
    kept, grads = 8 * h + 4 * kv + 4 * i + (3 * h if fused_qkv else 0) + rope + 3 * max(0, q - h), 2 * h + 2 * i
    return (h, kept + grads) if checkpointing else (kept, grads)


def plan_device(s: ModelShape, x: Settings) -> dict:
    """Bytes per GPU in each phase of a step, the parts of each phase in order; the sharded states, what offloading
    moves to host memory while the engine generates, and the least vLLM needs of its share."""
    n = count_params(s)
    kv = s.kv_width  # (Gemma 4: its widest layer's, as every layer's activations below are its widest layer's)
    # What trains, per FSDP2 unit: every parameter (but a frozen tower's), or with LoRA the adapters alone (fp32)
    # beside the frozen base, kept in bf16 like a reference; the reference is then that base with the adapters off
    tower = 0 if x.freeze_vision else n["vision"]
    trains = {"layer": n["layer"], "vision": tower, "root": n["root"], "total": n["total"] - n["vision"] + tower}
    if x.lora_rank:
        trains = lora_params(s, x.lora_rank, x.lora_targets)
    adapters, frozen_tower = trains["total"] if x.lora_rank else 0, trains["vision"] == 0
    reference = x.reference and not x.lora_rank  # a second model to hold
    with_vllm = x.engine == "vllm"
    b = x.master_bytes  # 4, or 2 with bf16 masters (optim.AdamWBF16: weights, gradients and moments in bf16)
    # A distillation teacher: a frozen bf16 shard of its own shape (it may be larger than the policy), used in the
    # log-prob phase only; its units are gathered there as the reference's are
    nt = count_params(x.teacher) if x.teacher else None
    states = {
        # master weights (the whole model in their dtype), or with LoRA the bf16 base and fp32 adapters
        "params": (2 * n["total"] + 4 * adapters if x.lora_rank else b * n["total"]) / x.world,
        "grads": b * trains["total"] / x.world,  # freed by zero_grad(set_to_none) after each optimizer step
        "adam": 2 * b * trains["total"] / x.world,  # exp_avg and exp_avg_sq
        "reference": 0 if x.ref_offload or not reference else 2 * n["total"] / x.world,  # bf16 shards
    }
    if nt:
        states["teacher"] = 0 if x.teacher_offload else 2 * nt["total"] / x.world
    # what actor.offload_params / offload_optimizer move to host memory while the engine generates (offload.py's
    # arenas, their exact size; pinned on CUDA); the moments stay there but for each optimizer step
    offloaded = {
        "params": states["params"] if x.offload_params and with_vllm else 0,  # the hf engine generates with them
        "reference": states["reference"] if x.offload_params and with_vllm else 0,
        "adam": states["adam"] if x.offload_optimizer else 0,
    }
    if nt:
        offloaded["teacher"] = states["teacher"] if x.offload_params and with_vllm else 0
    # FSDP2 units all-gathered in bf16: the root's stay gathered from the root's forward to the end of its backward,
    # beside one block and the one prefetched next to it (the vision tower is followed by decoder layer 0)
    pair = n["layer"] + max(n["vision"], n["layer"])
    gathered = 2 * (n["root"] + pair)
    # LoRA on the experts: PEFT's forward adds B A to a layer's whole experts parameters, a bf16 copy of them that the
    # backward keeps (the experts' matmuls saved it) unless the layer is recomputed: one layer's, or every layer's
    adapted = 2 * 3 * s.experts * s.hidden * s.expert_intermediate if x.lora_rank and "experts" in x.lora_targets else 0

    e = x.act_bytes  # 2: bf16

    def head(tokens, grad):  # one chunk's logits: bf16, fp32 upcast, /temperature, softmax (+ their grads backward)
        per_logit = 20 if grad else 14
        return HEAD_CHUNK * s.vocab * per_logit + (2 if grad else 1) * e * tokens * s.hidden  # + final hidden states

    # Activations of one training micro-batch (bf16, 2 B an element). Its images can have at most merge^2 patches per
    # LM token, all in the vision tower at once; the tower's blocks are checkpointed like the decoder layers.
    # Sequence parallelism: a rank holds 1/sp of the tokens and encodes 1/sp of the patches, a long clip's too (the
    # tower split by temporal patch, sequence_parallel.py: to within one temporal patch; an image is never cut),
    # beside the whole row's merged embeddings and the group's gathered vision embeddings, before the cut (bf16)
    whole = 2 * e * x.train_tokens * s.hidden if x.sp > 1 else 0
    t, patches = math.ceil(x.train_tokens / x.sp), math.ceil(x.train_tokens / x.sp) * s.merge**2
    # (an MoE token's activations are those of its top-k experts: the MLP width it goes through)
    lm_kept, lm_extra = layer_elems(
        s.hidden, kv, s.mlp_width, x.checkpointing, rope=2 * s.widest_head, q=s.heads * s.widest_head
    )
    vis_kept, vis_extra = layer_elems(s.vision_hidden, s.vision_hidden, s.vision_intermediate, x.checkpointing, True)
    vis_saved = 0 if frozen_tower else e * patches * vis_kept * s.vision_depth  # a frozen tower builds no graph
    lm_saved = e * t * lm_kept * s.layers
    # Gradients in flight: the root's (bf16) live through the whole backward, beside the bf16 gradients of the unit
    # whose backward runs and the fp32 copy FSDP2 reduce-scatters them in (MixedPrecisionPolicy reduce_dtype).
    # The peak is at the top of the LM's backward (every layer's saved activations, and the head or one layer's
    # backward) or later at the vision tower's (the LM's activations are freed by then): (grads, activations).
    # (With LoRA only the adapters have gradients: a frozen base still passes them down, so activations are the same.)
    top = (2 * trains["root"] + 6 * trains["layer"],
           whole + lm_saved + vis_saved + max(head(t, True), e * t * lm_extra))  # fmt: skip
    bottom = (2 * trains["root"] + 6 * trains["vision"], whole + vis_saved + e * patches * vis_extra)
    unit_grads, activations = top if frozen_tower or sum(top) >= sum(bottom) else bottom

    # The no-grad log-prob forwards: residual stream in and out plus the MLP's gate, up and product of one layer at a
    # time (or one vision block's), and a chunk of the head. Policy and reference run in turn and FSDP2 leaves both
    # roots gathered after a forward without backward, until the phase reshards them.
    # (sequence parallelism: a rank's 1/sp of the tokens, beside the whole row's merged embeddings; a teacher's too,
    # cut like the policy)
    def nograd_activations(m: ModelShape, tn: int) -> float:
        layer = e * tn * (4 * m.hidden + 3 * m.mlp_width)
        tower = e * tn * m.merge**2 * (2 * m.vision_hidden + 3 * m.vision_intermediate)
        return max(layer, tower) + HEAD_CHUNK * m.vocab * 14 + e * tn * m.hidden  # + a chunk of its head, no grad

    whole_nograd = 2 * e * x.nograd_tokens * s.hidden if x.sp > 1 else 0
    nograd = whole_nograd + nograd_activations(s, math.ceil(x.nograd_tokens / x.sp))
    # the teacher runs last: every root stays gathered, beside its own block pair (its own width, its own head)
    teacher_gathered = 0
    if nt:
        whole_teacher = 2 * e * x.nograd_tokens * x.teacher.hidden if x.sp > 1 else 0
        nograd = max(nograd, whole_teacher + nograd_activations(x.teacher, math.ceil(x.nograd_tokens / x.sp)))
        teacher_gathered = 2 * nt["root"] + max(0, 2 * (nt["layer"] + max(nt["vision"], nt["layer"])) - 2 * pair)
    resident = {**states, "adam": 0} if x.offload_optimizer else states  # on the device outside optimizer steps
    awake = (x.vllm_bytes or x.vllm_util * x.gpu_bytes) if with_vllm else 0.0  # vLLM takes its share of the device
    never_sleeps = {"vllm awake": awake} if with_vllm and x.sleep_level == 0 else {}
    phases = {
        "update": {
            **resident,
            "gathered": gathered + adapted * (1 if x.checkpointing else s.layers),
            "grads in flight": unit_grads,
            "activations": activations,
            **never_sleeps,
            "runtime": RUNTIME,
        },
        "log-probs": {
            **resident,
            "grads": 0,
            "gathered": gathered + adapted + (2 * n["root"] if reference else 0) + teacher_gathered,
            "activations": nograd,
            **never_sleeps,
            "runtime": RUNTIME,
        },
    }
    if x.offload_optimizer:  # the moments come in for the step, the gradients are still there
        phases["optimizer step"] = {**states, "runtime": RUNTIME}
    generating = {k: v - offloaded.get(k, 0) for k, v in states.items()}
    if with_vllm:
        if any(offloaded.values()) or not x.vllm_bytes:
            # the sync reads the policy's shards before they leave: vLLM's weights (its KV cache still asleep, unless
            # it never sleeps) beside the whole state and what the reload of one layer holds (the full tensors sent,
            # its materialised copy). (A CPU run's engine holds its weights and KV cache in one figure: only with
            # offloading, as before.)
            vllm = {"vllm awake": awake} if x.sleep_level == 0 else {"vllm weights": 2 * n["total"] / x.tp}
            phases["weight sync"] = {
                **resident,
                "grads": 0,
                **vllm,
                "layer reload": reload_peak(s, x.tp),
                "runtime": RUNTIME,
            }
        phases["rollout"] = {**generating, "grads": 0, "vllm awake": awake, "runtime": RUNTIME}
    else:  # HF generate with the training model: its KV cache, and the logits of the one decoding step at hand
        phases["rollout"] = {
            **generating,
            "grads": 0,
            "gathered": gathered,
            "kv cache": x.hf_rows * x.seq_len * s.kv_cache_elems * 2,
            # generate keeps no per-step logits unless asked (output_logits / output_scores; the HF engine asks for
            # neither): one step's bf16 logits, their fp32 copy and the sampling probabilities, 10 bytes a logit
            "logits": x.hf_rows * s.vocab * 10,
            "runtime": RUNTIME,
        }
    # its weights and one sequence's KV cache (Qwen3.5's linear layers keep a fixed-size state instead: left out;
    # Gemma 4's sliding layers counted as if they kept the whole sequence, as vLLM keeps only their window's: more)
    vllm_min = 2 * n["total"] / x.tp + x.seq_len * s.kv_cache_elems * 2 / x.tp
    return {
        "params": n,
        "teacher_params": nt,
        "phases": phases,
        "vllm_min": vllm_min if with_vllm else 0.0,
        "offloaded": offloaded,  # host bytes per rank while generating (pinned on CUDA)
        "states": states,
    }
