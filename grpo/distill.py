"""On-policy distillation: a frozen teacher scores the policy's own answers token by token.

The teacher (distill.model_path) is a checkpoint of a supported family with the policy's tokenizer and processor,
held as the frozen reference is: an FSDP2 shard in the compute dtype (bf16 on GPU), no gradients, in host memory
between its forwards with distill.offload (FSDP2's CPU offload, as actor.ref_offload does for the reference), moved
off the GPU while the engine generates with actor.offload_params (offload.py), its rows cut over the ranks of a
sequence-parallel group as the policy's are. It may be larger than the policy (a Qwen3-VL-32B teaching a
Qwen3-VL-8B): only the token ids and the images' patches must mean the same to both. With LoRA the teacher is a
whole model beside the adapters' frozen base.

Its log-probs of the sampled answer tokens come from the same no-grad forward as the reference's
(train_grpo.compute_old_and_ref_logprobs), at the rollout temperature as the policy's are. Each answer token's
advantage then gets

    coef x (log p_teacher - log p_old)

on top of the reward's (teacher_advantage): the per-token reverse KL to the teacher as a reward to the token, as
Tinker's on-policy distillation recipe folds it into the advantage. `log p_old` is the log-prob under the policy
that sampled (the trainer's old log-probs; the engine's under algorithm.rollout_bypass), so the term is a fixed
per-token advantage inside the clipped loss: the clip and the mismatch corrections' weights apply to the whole token
advantage. With a zero reward it is pure distillation, the reverse KL minimised on the policy's own samples
(https://thinkingmachines.ai/blog/on-policy-distillation/; Agarwal et al. 2024, https://arxiv.org/abs/2306.13649).
Tool-returned tokens are context, not the policy's: the loss mask leaves them out, with their term.
"""

from __future__ import annotations

import torch

# ----------------------------------------------------------------------------------------------------------------------
# The math


def teacher_advantage(old_logp: torch.Tensor, teacher_logp: torch.Tensor, coef: float) -> torch.Tensor:
    """The teacher's per-token term: coef x (log p_teacher - log p_old). (B, T) -> (B, T); 0 where they agree."""
    return coef * (teacher_logp - old_logp)  # (B, T)


def token_terms(adv, old_logp, teacher_logp, mask, coef, num_tokens):
    """The reward's advantage (B, 1) plus the teacher's term (B, T) -> (B, T), and its named terms as shares of the
    step's mean over its answer tokens (`mask`, `num_tokens`: those the loss trains, over every rank):
    distill/reverse_kl, the mean of log p_old - log p_teacher, and distill/advantage, the term's mean."""
    term = teacher_advantage(old_logp, teacher_logp, coef) * mask  # (B, T), none on tool turns and padding
    terms = {"distill/reverse_kl": ((old_logp - teacher_logp) * mask).sum() / num_tokens,
             "distill/advantage": term.sum() / num_tokens}  # fmt: skip
    return adv + term, terms  # (B, T), {name: scalar}


def token_advantages(adv, old_logp, teacher_logp, mask, coef, num_tokens, stats):
    """token_terms with its terms recorded in `stats` (grpo/stats.py) as shares."""
    adv, terms = token_terms(adv, old_logp, teacher_logp, mask, coef, num_tokens)
    for name, value in terms.items():
        stats.share(name, value.item())
    return adv  # (B, T)


# ----------------------------------------------------------------------------------------------------------------------
# The teacher: whether it can teach this policy, and loading it


def _vision_numbers(processor) -> dict:
    """What turns an image or a video into tokens and patches: both models must read a prompt's pixels alike."""
    out = {}
    for part in ("image_processor", "video_processor"):
        proc = getattr(processor, part, None)
        for key in ("patch_size", "merge_size", "temporal_patch_size"):
            out[f"{part}.{key}"] = getattr(proc, key, None)
    return out


def teacher_problem(policy_path: str, teacher_path: str) -> str | None:
    """Why the checkpoint at `teacher_path` cannot score the policy's tokens, or None: its tokenizer must map every
    token to the same id (else its log-probs are of other tokens), its special token ids (image, video, vision
    bounds) and its processor's patching must match (else the packed prompt's image tokens and pixels mean other
    things to it), and its LM head must cover the vocabulary. Reads tokenizers, processors and configs, no weights."""
    from transformers import AutoConfig, AutoProcessor

    policy, teacher = AutoProcessor.from_pretrained(policy_path), AutoProcessor.from_pretrained(teacher_path)
    mine, theirs = policy.tokenizer.get_vocab(), teacher.tokenizer.get_vocab()
    if mine != theirs:
        differ = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda kv: kv[1])
        shown = ", ".join(f"{token!r}: {i}" for token, i in differ[:4])
        return (f"its tokenizer differs from the policy's (actor.model_path={policy_path!r}): {len(theirs)} tokens "
                f"against {len(mine)}, {len(differ)} (token, id) pairs in one only ({shown}); a teacher must share "
                "the policy's tokenizer to score its tokens")  # fmt: skip
    mine, theirs = _vision_numbers(policy), _vision_numbers(teacher)
    if mine != theirs:
        differ = [f"{k} {theirs[k]} (policy {mine[k]})" for k in mine if mine[k] != theirs[k]]
        return f"its processor cuts images and videos otherwise than the policy's: {', '.join(differ)}"
    configs = AutoConfig.from_pretrained(policy_path), AutoConfig.from_pretrained(teacher_path)
    keys = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    differ = [f"{k} {getattr(configs[1], k, None)} (policy {getattr(configs[0], k, None)})" for k in keys
              if getattr(configs[0], k, None) != getattr(configs[1], k, None)]  # fmt: skip
    if differ:
        return f"its config's vision tokens differ from the policy's: {', '.join(differ)}"
    vocab = configs[1].get_text_config().vocab_size
    if vocab < len(teacher.tokenizer):
        return f"its LM head has {vocab} rows for a tokenizer of {len(teacher.tokenizer)} tokens"
    return None


def load_teacher(distill, actor, device, pad_id):
    """The teacher, frozen and sharded as the reference is (loading.load_sharded: each rank reads its own shards),
    past its first root forward, its sequences cut over the policy's sequence-parallel groups as the policy's are;
    None when distill.model_path is empty. A teacher that cannot score the policy's
    tokens (teacher_problem) stops here, also when the dry run could not read it (a hub id not yet downloaded)."""
    from grpo import sequence_parallel
    from grpo.loading import load_sharded, mixed_precision, root_forward

    if not distill.model_path:
        return None
    problem = teacher_problem(actor.model_path, distill.model_path)
    if problem:
        raise ValueError(f"distill.model_path={distill.model_path!r}: {problem}")
    dtype = torch.bfloat16 if mixed_precision(device) else torch.float32  # never updated: no fp32 master copy
    teacher = load_sharded(distill.model_path, device, actor.attn_implementation, dtype=dtype, offload=distill.offload)
    teacher.requires_grad_(False).eval()
    root_forward(teacher, pad_id)
    # cut like the policy: under sequence parallelism each rank of a group runs its share of the group's rows (and of
    # their images' patches), where the teacher, usually the larger model, needs the memory most
    sequence_parallel.attach(teacher, actor.sequence_parallel_size)
    return teacher
