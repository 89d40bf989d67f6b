"""torchrun script: train_grpo.main with a fault injected into the rollout engine, for tests/test_mismatch.py.

Usage: torchrun --nproc_per_node=2 tests/mismatch_check.py FAULT CONFIG [key=value ...], FAULT one of
  none         the engine as configured
  blank_image  rank 0's first prompt with images reaches the engine with blank images (the trainer keeps them):
               images dropped on the way to the engine, as in the field's silent failures
  noise        the engine's log-probs come back with Gaussian noise (std 0.1): a mismatch for the corrections
"""

import dataclasses
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])

import rollout  # noqa: E402
import runtime  # noqa: E402
import train_grpo  # noqa: E402


def blank(prompt):
    from PIL import Image

    images = [Image.new("RGB", im.size) for im in prompt.images]  # vLLM's input: same size, so the same tokens
    pixels = None if prompt.pixel_values is None else torch.zeros_like(prompt.pixel_values)  # the HF engine's
    return dataclasses.replace(prompt, images=images, pixel_values=pixels)


def faulty(engine_class, fault):
    class Faulty(engine_class):
        def generate(self, prompts, n, params, seed):
            if fault == "blank_image" and dist.get_rank() == 0:
                first = next((i for i, p in enumerate(prompts) if p.image_grid_thw is not None), None)
                if first is not None:
                    prompts = [blank(p) if i == first else p for i, p in enumerate(prompts)]
            samples = super().generate(prompts, n, params, seed)
            if fault == "noise":
                g = torch.Generator().manual_seed(seed)
                for s in samples:
                    s.logprobs = (torch.tensor(s.logprobs) + 0.1 * torch.randn(len(s.logprobs), generator=g)).tolist()
            return samples

    return Faulty


if __name__ == "__main__":
    fault, argv = sys.argv[1], sys.argv[2:]
    if fault != "none":
        rollout.ENGINES = {name: faulty(cls, fault) for name, cls in rollout.ENGINES.items()}
    runtime.run_rank(lambda: train_grpo.main(argv))
