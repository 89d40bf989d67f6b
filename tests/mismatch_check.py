"""torchrun script: train_grpo.main with a fault injected into the rollout engine, for tests/test_mismatch.py.

Usage: torchrun --nproc_per_node=2 tests/mismatch_check.py FAULT CONFIG [key=value ...], FAULT one or several of
these joined by "+":
  none         the engine as configured
  blank_image  rank 0's first prompt with images reaches the engine with blank images (the trainer keeps them):
               images dropped on the way to the engine, as in the field's silent failures
  noise        the engine's log-probs come back with Gaussian noise (std 0.1): a mismatch for the corrections
  weights@K    vLLM's weights get noise right after step K's weight sync, on every rank (the next sync overwrites
               them): an engine whose state goes bad mid-run, as a stale cache or a state restored as garbage
Each weight sync prints (rank 0) "sync N: weights sum S", the sum of the trainer's local shards, so a test can tell
whether an optimizer step changed them.
"""

import dataclasses
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])

import rollout  # noqa: E402
import train_grpo  # noqa: E402
from grpo import runtime  # noqa: E402


def blank(prompt):
    from PIL import Image

    images = [Image.new("RGB", im.size) for im in prompt.images]  # vLLM's input: same size, so the same tokens
    pixels = None if prompt.pixel_values is None else torch.zeros_like(prompt.pixel_values)  # the HF engine's
    return dataclasses.replace(prompt, images=images, pixel_values=pixels)


def perturb(model):
    """Gaussian noise of 3x each parameter's root mean square: the tiny model's mismatch KL goes to ~0.1."""
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.data.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 3 * p.data.float().square().mean().sqrt().item())


def faulty(engine_class, faults):
    class Faulty(engine_class):
        syncs = 0

        def sync_weights(self, model):
            super().sync_weights(model)
            Faulty.syncs += 1
            total = sum(p.to_local().double().sum().item() for p in model.parameters() if hasattr(p, "to_local"))
            runtime.print0(f"sync {Faulty.syncs}: weights sum {total!r}")
            if f"weights@{Faulty.syncs}" in faults:
                self.llm.apply_model(perturb)

        def generate(self, prompts, n, params, seed):
            if "blank_image" in faults and dist.get_rank() == 0:
                first = next((i for i, p in enumerate(prompts) if p.image_grid_thw is not None), None)
                if first is not None:
                    prompts = [blank(p) if i == first else p for i, p in enumerate(prompts)]
            samples = super().generate(prompts, n, params, seed)
            if "noise" in faults:
                g = torch.Generator().manual_seed(seed)
                for s in samples:
                    s.logprobs = (torch.tensor(s.logprobs) + 0.1 * torch.randn(len(s.logprobs), generator=g)).tolist()
            return samples

    return Faulty


if __name__ == "__main__":
    faults, argv = sys.argv[1].split("+"), sys.argv[2:]
    rollout.ENGINES = {name: faulty(cls, faults) for name, cls in rollout.ENGINES.items()}
    runtime.run_rank(lambda: train_grpo.main(argv))
