"""Peak memory of the log-prob forward and backward of one long video sequence, at sequence-parallel sizes 1 and 2,
on 2 CPU ranks (gloo, FSDP2, the tiny Qwen2.5-VL built here).

    python bench/bench_sp.py                       # 4 clips of 8 x 32 x 32 patches: 8,192 tokens in one sequence
    python bench/bench_sp.py --frames 16           # longer

At size 1 each rank trains the whole sequence; at size 2 the two ranks share it (actor.sequence_parallel_size=2:
each holds half of the decoder's tokens and encodes half of the clips). Each size runs in its own fresh pair of
processes. Memory is the process's resident set (/proc/self/statm), sampled every millisecond by a thread during
the measured forward + backward, minus its value just before (after a short warm-up pass, so FSDP2's lazy setup
and the thread pools are not counted), with glibc told to hand every allocation over 64 KiB straight back to the
system (MALLOC_MMAP_THRESHOLD_), so freed tensors leave the resident set at once. The tiny model's weights are a
few MB: what is measured is the activations. Prints each size's peak per rank (the larger of the two ranks) beside the
memory plan's activations per rank for the same sequence (planned_activations), and, last, the ratio of size 2 to
size 1.

    python bench/bench_sp.py --clips 1 --frames 64  # one long clip: cut between its temporal patches at size 2
"""

import argparse
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # before any worker starts: they inherit it
os.environ.setdefault("OMP_NUM_THREADS", "1")


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakSampler:
    """The largest resident set seen between start and stop, sampled by a thread."""

    def __enter__(self):
        self.base = self.peak = resident_bytes()
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self):
        while self.running:
            self.peak = max(self.peak, resident_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, resident_bytes())


def video_sequence(config, clips, frames, side, response):
    """One packed micro-batch: a prompt of `clips` video clips (each `frames` x side x side patches, random pixels)
    and one answer of `response` tokens, as batching.pack lays it out."""
    import torch

    from grpo.batching import pack
    from grpo.samples import Prompt

    g = torch.Generator().manual_seed(0)
    vision = config.vision_config
    merge = vision.spatial_merge_size**2
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    grid = torch.tensor([[frames, side, side]] * clips)  # (clips, 3)
    tokens = frames * side * side // merge
    ids, types = [1, 2, 3], [0, 0, 0]  # some text, then each clip between its start and end tokens
    for _ in range(clips):
        ids += [config.vision_start_token_id, *[config.video_token_id] * tokens, config.vision_end_token_id]
        types += [0, *[2] * tokens, 0]
    ids += [4, 5]
    types += [0, 0]
    prompt = Prompt(
        torch.tensor(ids), None, None, [], token_types=torch.tensor(types),
        pixel_values_videos=torch.randn(clips * frames * side * side, patch_dim, generator=g),
        video_grid_thw=grid, second_per_grid_ts=torch.ones(clips),
    )  # fmt: skip
    answer = torch.randint(10, 300, (response,), generator=g).tolist()
    return pack([prompt], [answer], config.image_token_id)


def planned_activations(model_dir: str, tokens: int, size: int) -> float:
    """The memory plan's activations per rank (grpo/device_plan.py, the update phase's) for one sequence of `tokens`
    at sequence-parallel `size`: the arithmetic of a GPU run's plan, in fp32 (4 bytes an element, as these CPU ranks
    compute) and without gradient checkpointing, as measured here. The plan counts every token as a vision token."""
    from grpo import device_plan, model_shape

    shape = model_shape.read_model_shape(model_dir)
    # (what the activations do not depend on takes any value)
    settings = device_plan.Settings(
        world=2, gpus_per_node=2, ranks_per_node=2, gpu_bytes=2**40, train_tokens=tokens, nograd_tokens=tokens,
        checkpointing=False, freeze_vision=False, reference=False, ref_offload=False, engine="hf", vllm_util=0.0,
        sleep_level=0, tp=1, seq_len=tokens, response_len=0, hf_rows=1, max_num_seqs=1, vllm_version="", sp=size,
        act_bytes=4,
    )  # fmt: skip
    return device_plan.plan_device(shape, settings)["phases"]["update"]["activations"]


def rank_main(rank, port, model_dir, size, args, out_dir):
    import torch
    import torch.distributed as dist

    from grpo import loading, sequence_parallel
    from grpo.logprobs import forward_logprobs

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    device = torch.device("cpu")
    model = loading.load_model(model_dir, device, "sdpa", gradient_checkpointing=False)
    loading.apply_fsdp(model, device)
    loading.root_forward(model, model.config.text_config.pad_token_id)
    sequence_parallel.attach(model, size)
    model.train()

    def step(batch_inputs, response_ids):
        logp, _ = forward_logprobs(model, batch_inputs, response_ids, 1.0)
        logp.sum().backward()
        model.zero_grad(set_to_none=True)

    step(*video_sequence(model.config, args.clips, 2, args.side, args.response)[:2])  # warm-up: FSDP2's lazy init,
    # the thread pools, the first allocations; then the measured sequence, built (its pixels) before the window
    inputs = video_sequence(model.config, args.clips, args.frames, args.side, args.response)[:2]
    dist.barrier()
    with PeakSampler() as sampler:
        step(*inputs)
    dist.barrier()
    with open(os.path.join(out_dir, f"{size}_{rank}"), "w") as f:
        f.write(str(sampler.peak - sampler.base))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clips", type=int, default=4, help="video clips in the sequence")
    parser.add_argument("--frames", type=int, default=8, help="temporal patches per clip")
    parser.add_argument("--side", type=int, default=32, help="patches per side of a frame")
    parser.add_argument("--response", type=int, default=16, help="answer tokens")
    args = parser.parse_args()

    import torch.multiprocessing as mp

    from scripts.make_tiny_model import build_tiny_model
    from tests.launch import free_port

    tokens = args.clips * args.frames * args.side * args.side // 4
    length = 3 + args.clips * (tokens // args.clips + 2) + 2 + args.response  # the packed row (video_sequence)
    print(f"one sequence: {args.clips} clips of {args.frames} x {args.side} x {args.side} patches, "
          f"{tokens:,} video tokens + {args.response} answer tokens; 2 ranks (gloo, FSDP2)")  # fmt: skip
    peaks = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(os.path.join(tmp, "model"), seed=0)
        for size in (1, 2):
            ranks = (free_port(), model_dir, size, args, tmp)
            mp.start_processes(rank_main, args=ranks, nprocs=2, start_method="spawn")
            per_rank = [int(open(os.path.join(tmp, f"{size}_{r}")).read()) for r in range(2)]
            peaks[size] = max(per_rank)
            plan = planned_activations(model_dir, length, size)
            print(f"sequence_parallel_size={size}: peak memory per rank {peaks[size] / 2**20:,.0f} MiB "
                  f"(ranks: {', '.join(f'{p / 2**20:,.0f}' for p in per_rank)} MiB); the plan's activations "
                  f"{plan / 2**20:,.0f} MiB ({plan / peaks[size] - 1:+.0%})")  # fmt: skip
    print(f"peak memory per rank, size 2 / size 1: {peaks[2] / peaks[1]:.2f}x")


if __name__ == "__main__":
    main()
