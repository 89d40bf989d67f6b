"""The optimizer: AdamW on fp32 master weights (torch's), or on bf16 ones with stochastic rounding.

`actor.master_dtype=bf16` keeps the trainable weights, their gradients and AdamW's two moments in bf16: 8 bytes a
parameter instead of fp32's 16. Plain round-to-nearest would lose the update: bf16 keeps 8 significant bits, so a
weight of 0.02 moves only by steps of 2^-13 (1.2e-4), and an AdamW step of lr 1e-6 is about 1e-6, 1/100 of one, which
round-to-nearest throws away every time. Stochastic rounding rounds up with probability equal to the remainder's
share of the step, so the stored value is right on average: E[round(x)] = x, and the small updates accumulate as
they would in fp32, with noise of at most one bf16 step on each element. Kahan-compensated summation would also keep
them, but needs a third bf16 buffer (10 bytes a parameter); stochastic rounding needs only random bits, drawn from the
device's default generator so that checkpoints (which save the RNG states) resume exactly.

The bound (tests/test_offload.py checks it against an fp64 AdamW): each step computes the update in fp32 from the
bf16 state, then rounds the new weight and each moment once, so every stored value is within one bf16 step (ulp) of
the exact result, plus fp32's own rounding of the terms it sums: |w - w_exact| <= ulp(w_exact) + 2^-22 x (sum of the
terms' magnitudes), ulp(x) = 2^(floor(log2 |x|) - 7); the same for the moments. (The second part matters only where
the terms cancel to near 0, as a moment does when the gradient changes sign.) Unlike round-to-nearest the error is
unbiased, so over many steps the weights follow the fp32 trajectory up to noise of about one ulp.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter, gradient or moment (the tensor itself when it is not a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def stochastic_round_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, rounding up or down at random with the probabilities that make the result unbiased: a random
    16-bit integer is added to the 16 bits that bf16 drops, which carries into the kept bits with probability equal
    to their value / 2^16; the kept bits are then exact in bf16. (Sign and magnitude are separate in the float
    format, so this rounds the magnitude, symmetrically for negative values.)"""
    bits = x.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)


class AdamWBF16(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments: torch.optim.AdamW's update) for bf16 parameters with
    bf16 moments. The arithmetic is fp32; weights and moments are stored with stochastic rounding. The state has
    torch's names (step, exp_avg, exp_avg_sq), so torch.distributed.checkpoint saves and loads it as AdamW's."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
                state["step"] += 1
                t = state["step"].item()
                w, g = _local(p), _local(p.grad).float()
                m_store, v_store = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
                m = m_store.float().mul_(beta1).add_(g, alpha=1 - beta1)
                v = v_store.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (v.sqrt() / (1 - beta2**t) ** 0.5).add_(eps)
                new_w = w.float().mul_(1 - lr * wd).addcdiv_(m, denom, value=-lr / (1 - beta1**t))
                w.copy_(stochastic_round_bf16(new_w))
                m_store.copy_(stochastic_round_bf16(m))
                v_store.copy_(stochastic_round_bf16(v))


def config_problem(actor, engine: str) -> str | None:
    """What is wrong with the actor's precision, offload and loss-weight settings for `engine`, before anything
    loads."""
    if actor.master_dtype not in ("fp32", "bf16"):
        return f"actor.master_dtype={actor.master_dtype!r}; valid: fp32, bf16"
    if actor.master_dtype == "bf16" and actor.lora_rank:
        return (f"actor.master_dtype=bf16 is for full fine-tuning, not with actor.lora_rank={actor.lora_rank}: LoRA's "
                "adapters are small and train in fp32")  # fmt: skip
    if actor.router_aux_loss_coef < 0:
        return f"actor.router_aux_loss_coef={actor.router_aux_loss_coef} must be >= 0 (0 = no load-balancing loss)"
    if actor.offload_params and engine != "vllm":
        return f"actor.offload_params needs rollout.engine=vllm: the {engine} engine generates with the policy itself"
    return None


def make_optimizer(model, actor):
    """AdamW over the model's trainable parameters (torch's on fp32 masters, AdamWBF16 on bf16 ones) and its LR
    schedule: linear warmup over actor.lr_warmup_steps optimizer steps, then constant."""
    params = [p for p in model.parameters() if p.requires_grad]
    kind = AdamWBF16 if actor.master_dtype == "bf16" else torch.optim.AdamW
    optimizer = kind(params, lr=actor.lr, betas=tuple(actor.betas), weight_decay=actor.weight_decay)
    warmup = max(1, actor.lr_warmup_steps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
