"""Load checkpoints with loading.load_sharded under torchrun and compare with from_pretrained; rank 0 writes the facts.

Used by test_loading.py, on 1 and 2 ranks:

    torchrun --nproc_per_node=W tests/load_check.py TINY_DIR BF16_SHARDED_DIR TIED_DIR OUT_DIR

For each checkpoint (the tiny fp32 one; the same weights in bf16 split over several files with an index; one with
tied embeddings): every parameter (gathered with full_tensor) and every buffer of the sharded model against
from_pretrained's, loaded in fp32 (the policy) and in bf16 (the reference's compute dtype on GPU). Then the packed
log-probs of the sharded policy against the old way (from_pretrained + apply_fsdp), load_policy_and_reference's
dtypes, and save_hf of each sharded model (one file, and split into several) read back. A distillation teacher of the
policy's own checkpoint: its log-probs, and so its per-token term, against the policy's, beside full fine-tuning (and
through one update_policy step) and beside LoRA adapters.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])

import rollout  # noqa: E402
import train_grpo  # noqa: E402
from grpo import batching, checkpoint, distill, distributed, loading, logprobs, lora  # noqa: E402
from grpo.config import ActorConfig, DistillConfig  # noqa: E402
from grpo.optim import make_optimizer  # noqa: E402
from grpo.stats import StepStats  # noqa: E402
from tests.test_packing import _mixed_batch  # noqa: E402


def mismatches(model, reference):
    """Names of parameters and buffers of `model` (sharded) that differ from `reference` (from_pretrained), or whose
    dtype differs."""
    want = dict(reference.named_parameters()) | dict(reference.named_buffers())
    bad = []
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        if full.dtype != want[name].dtype or not torch.equal(full, want[name]):
            bad.append(name)
    return bad + [name for name in want if name not in dict(model.named_parameters()) | dict(model.named_buffers())]


def packed_batch(processor):
    """tests/test_packing.py's mixed prompts (with and without images) and uneven responses, packed into one row."""
    image_token_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    inputs, response_ids, _ = batching.pack(*_mixed_batch(processor, image_token_id), image_token_id)
    return inputs, response_ids


def read_export(out_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(out_dir, dtype=torch.float32)


def lora_facts(tiny, base, processor, out_dir):
    """LoRA: what is trainable; the reference log-probs (compute_old_and_ref_logprobs, the policy with its
    adapters off) against those of `base`, the same checkpoint loaded separately; the merged export against the
    adapted policy; the adapter directory as PEFT loads and merges it, against the merged export."""
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import Qwen2_5_VLForConditionalGeneration

    rank, world, cpu = dist.get_rank(), dist.get_world_size(), torch.device("cpu")
    targets = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]"  # the defaults and the head
    overrides = ["actor.lora_rank=8", "actor.lora_alpha=32", f"actor.lora_target_modules={targets}"]
    cfg = train_grpo.load_config(None, [f"actor.model_path={tiny}", *overrides])
    pad_id = processor.tokenizer.pad_token_id
    policy, ref = loading.load_policy_and_reference(cfg.actor, cpu, True, pad_id)
    teacher = distill.load_teacher(DistillConfig(model_path=tiny), cfg.actor, cpu, pad_id)  # a whole model, no LoRA
    facts = {"lora/ref_is_policy": ref is policy}
    facts["distill/lora_teacher_names"] = sorted({n for n, _ in teacher.named_parameters() if lora.is_lora_factor(n)})
    trainable = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
    facts["lora/trainable_not_adapters"] = [n for n, _ in trainable if not lora.is_lora_factor(n)]
    facts["lora/trainable_params"] = sum(p.numel() for _, p in trainable)
    prompts, responses = _mixed_batch(processor, processor.tokenizer.convert_tokens_to_ids("<|image_pad|>"))
    samples = [rollout.Sample(i, r, [0.0] * len(r), "", False) for i, r in enumerate(responses)]
    ids = (pad_id, policy.config.image_token_id)
    policy.eval()
    base_logp, _, _ = train_grpo.compute_old_and_ref_logprobs(base, None, prompts, samples, cfg, ids, True)
    old, _, taught = train_grpo.compute_old_and_ref_logprobs(policy, None, prompts, samples, cfg, ids, True, teacher)
    facts["distill/lora_initial_term_max_abs"] = max(
        distill.teacher_advantage(o, t, 1.0).abs().max().item() for o, t in zip(old, taught)
    )
    facts["lora/initial_vs_base_max_abs_diff"] = max((o - b).abs().max().item() for o, b in zip(old, base_logp))
    g = torch.Generator().manual_seed(5)  # B = 0 makes the adapters a no-op: give them a value, the same on all ranks
    for layer in lora.lora_layers(policy).values():
        b = layer.lora_B[lora.LORA_ADAPTER].weight
        lora.copy_own_rows(b, torch.randn(b.shape, generator=g) * 0.1)
    timings = {}
    old, ref, taught = train_grpo.compute_old_and_ref_logprobs(
        policy, ref, prompts, samples, cfg, ids, True, teacher, timings
    )
    facts["distill/lora_teacher_vs_base_max_abs_diff"] = max(
        (t - b).abs().max().item() for t, b in zip(taught, base_logp)
    )
    facts["distill/time_teacher"] = timings.get("time/teacher", -1.0)
    facts["lora/ref_vs_base_max_abs_diff"] = max((r - b).abs().max().item() for r, b in zip(ref, base_logp))
    facts["lora/adapted_vs_base_max_abs_diff"] = max((o - b).abs().max().item() for o, b in zip(old, base_logp))
    facts["lora/trainable_after_ref"] = [n for n, p in policy.named_parameters() if p.requires_grad] == [
        n for n, _ in trainable
    ]
    # after the reference forwards (adapters off) every adapter still gets its gradient, the root's (lm_head) too
    policy.train()
    logp, _ = logprobs.forward_logprobs(policy, *packed_batch(processor), 1.0)
    logp.sum().backward()
    facts["lora/adapters_without_grad"] = [n for n, p in trainable if ".lora_B." in n and p.grad is None]
    policy.zero_grad(set_to_none=True)
    policy.eval()

    export, adapter = os.path.join(out_dir, f"lora_hf_{world}"), os.path.join(out_dir, f"lora_adapter_{world}")
    checkpoint.save_hf(policy, processor, export)
    checkpoint.save_adapter(policy, adapter)
    inputs, response_ids = packed_batch(processor)
    with torch.no_grad():
        adapted, _ = logprobs.forward_logprobs(policy, dict(inputs), response_ids, 0.9)  # collective
    policy.reshard()
    if rank == 0:
        names = lambda d: sorted(k for f in loading._safetensors_files(d) for k in safe_open(f, "pt").keys())  # noqa: E731
        facts["lora/export_names_equal_base"] = names(export) == names(tiny)
        merged = loading.load_model(export, cpu, "sdpa")  # from_pretrained, with the packed attention
        with torch.no_grad():
            logp, _ = logprobs.forward_logprobs(merged, dict(inputs), response_ids, 0.9)
        facts["lora/export_vs_adapted_max_abs_diff"] = (logp - adapted).abs().max().item()
        peft_model = PeftModel.from_pretrained(Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny), adapter)
        by_peft = peft_model.merge_and_unload().state_dict()
        mine = merged.state_dict()
        facts["lora/peft_merge_names_equal"] = sorted(by_peft) == sorted(mine)
        facts["lora/peft_merge_max_abs_diff"] = max((by_peft[k] - mine[k]).abs().max().item() for k in mine)
        facts["lora/adapter_files"] = sorted(os.listdir(adapter))
    return facts


def distill_facts(tiny, processor):
    """A teacher that is the policy's own checkpoint (full fine-tuning): its log-probs of the policy's tokens against
    the policy's (the same forward, so the term is 0 for every token), and one update_policy step on a zero reward
    with it, whose old log-probs are the update forward's own: the term, and so the gradient, must stay ~0 there too
    (a teacher log-prob paired with another token, sample or rank gives neither)."""
    cpu = torch.device("cpu")
    prompts, responses = _mixed_batch(processor, processor.tokenizer.convert_tokens_to_ids("<|image_pad|>"))
    samples = [rollout.Sample(i, r, [0.0] * len(r), "", False) for i, r in enumerate(responses)]
    world = dist.get_world_size()
    cfg = train_grpo.load_config(None, [f"actor.model_path={tiny}", f"distill.model_path={tiny}", "rollout.n=1",
                                        "algorithm.kl_coef=0", "algorithm.mismatch_guard=0", "actor.micro_batch_size=2",
                                        f"actor.global_batch_size={len(prompts) * world}",
                                        f"data.rollout_batch_size={len(prompts) * world}"])  # fmt: skip
    pad_id = processor.tokenizer.pad_token_id
    policy, _ = loading.load_policy_and_reference(cfg.actor, cpu, False, pad_id)
    teacher = distill.load_teacher(cfg.distill, cfg.actor, cpu, pad_id)
    ids = (pad_id, policy.config.image_token_id)
    policy.eval()
    old, _, taught = train_grpo.compute_old_and_ref_logprobs(policy, None, prompts, samples, cfg, ids, True, teacher)
    facts = {"distill/teacher_trainable": [n for n, p in teacher.named_parameters() if p.requires_grad]}
    facts["distill/term_max_abs"] = max(
        distill.teacher_advantage(o, t, 1.0).abs().max().item() for o, t in zip(old, taught)
    )
    facts["distill/lengths"] = [len(t) for t in taught] == [len(r) for r in responses]
    optimizer, scheduler = make_optimizer(policy, cfg.actor)
    stats = StepStats()
    policy.train()
    train_grpo.update_policy(policy, optimizer, scheduler, samples, prompts, torch.zeros(len(samples)), None, None,
                             cfg, ids, stats, 1, taught)  # fmt: skip
    for key in ("distill/reverse_kl", "distill/advantage", "actor/grad_norm"):
        facts[key] = stats[key]
    return facts


def main():
    from safetensors import safe_open
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    tiny, bf16_sharded, tied, out_dir = sys.argv[1:5]
    dist.init_process_group("gloo")
    rank, cpu = dist.get_rank(), torch.device("cpu")
    facts = {}
    for label, path in (("tiny", tiny), ("bf16_sharded", bf16_sharded), ("tied", tied)):
        for dtype in (torch.float32, torch.bfloat16):
            model = loading.load_sharded(path, cpu, "sdpa", dtype=dtype)
            reference = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=dtype)
            facts[f"{label}/{str(dtype)[6:]}/mismatches"] = mismatches(model, reference)
        # save_hf of the fp32 model: the checkpoint's own names, read back equal to the checkpoint (upcast)
        model = loading.load_sharded(path, cpu, "sdpa")
        facts[f"{label}/tied"] = model.lm_head.weight is model.model.language_model.embed_tokens.weight
        processor = AutoProcessor.from_pretrained(tiny)
        for split, max_bytes in (("one", 50 * 10**9), ("split", 100_000)):
            export = os.path.join(out_dir, f"{label}_{split}_{dist.get_world_size()}")
            checkpoint.save_hf(model, processor, export, max_shard_bytes=max_bytes)
            if rank == 0:
                names = lambda d: sorted(k for f in loading._safetensors_files(d) for k in safe_open(f, "pt").keys())  # noqa: E731
                facts[f"{label}/export_{split}/same_names"] = names(export) == names(path)
                facts[f"{label}/export_{split}/files"] = len(loading._safetensors_files(export))
                facts[f"{label}/export_{split}/mismatches"] = mismatches(read_export(export), read_export(path))

    # the packed log-probs of a model loaded the new way equal those of one loaded the old way
    processor = AutoProcessor.from_pretrained(tiny)
    inputs, response_ids = packed_batch(processor)
    old = loading.apply_fsdp(loading.load_model(tiny, cpu, "sdpa"), cpu)
    new = loading.load_sharded(tiny, cpu, "sdpa")
    with torch.no_grad():
        logp_old, _ = logprobs.forward_logprobs(old, dict(inputs), response_ids, 0.9)
        logp_new, _ = logprobs.forward_logprobs(new, dict(inputs), response_ids, 0.9)
    facts["packed_logp_max_abs_diff"] = (logp_new - logp_old).abs().max().item()
    facts["packed_logp_nonzero"] = int((logp_new != 0).sum())

    actor = ActorConfig(model_path=tiny, attn_implementation="auto", freeze_vision_tower=True)
    policy, ref = loading.load_policy_and_reference(actor, cpu, True, processor.tokenizer.pad_token_id)
    facts["policy_dtypes"] = sorted({str(p.dtype) for p in policy.parameters()})
    facts["policy_trainable"] = {part: sorted({p.requires_grad for n, p in policy.named_parameters() if part in n})
                                 for part in ("visual", "language_model", "lm_head")}  # fmt: skip
    facts["ref_dtypes"] = sorted({str(p.dtype) for p in ref.parameters()})
    facts["ref_trainable"] = [n for n, p in ref.named_parameters() if p.requires_grad]
    facts.update(distill_facts(tiny, processor))
    facts.update(lora_facts(tiny, new, processor, out_dir))
    if rank == 0:
        with open(os.path.join(out_dir, "facts.json"), "w") as f:
            json.dump(facts, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    distributed.exit_rank(0)
