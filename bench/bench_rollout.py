"""Rollout throughput of the vLLM engine vs the training-model (HF) engine on the same prompts, and the seconds of one
streamed weight sync, side by side in one run.

Takes the trainer's config (and overrides): prompts are the first `data.rollout_batch_size` of the train set, split
over ranks as in training, each sampled `rollout.n` times up to `data.max_response_length` tokens at
`rollout.temperature`. Every engine gets one warm-up call, then `--repeats` timed calls.

    torchrun --nproc_per_node=2 bench/bench_rollout.py configs/tiny.yaml data.max_response_length=128
    torchrun --nproc_per_node=8 bench/bench_rollout.py configs/geo3k.yaml data.rollout_batch_size=64 --repeats 2

tokens/s counts generated tokens of all ranks per second of the slowest rank's generate call.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rollout  # noqa: E402
import train_grpo  # noqa: E402
from grpo import distributed, loading, startup  # noqa: E402


def timed(fn):
    """Seconds of fn() on the slowest rank, and its result."""
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item(), out


def total(value):
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


def bench_generate(engine, model, prompts, params, n, seed, repeats):
    engine.wake()
    engine.sync_weights(model)
    engine.generate(prompts, n, params, seed=seed)  # warm-up: lazy initialisation, first-call allocations
    seconds, tokens = 0.0, 0.0
    for i in range(repeats):
        s, samples = timed(lambda i=i: engine.generate(prompts, n, params, seed=seed + 1 + i))
        seconds += s
        tokens += total(sum(len(x.response_ids) for x in samples))
    engine.sleep()
    loading.reshard(model)
    return {"tokens": tokens / repeats, "seconds": seconds / repeats, "tokens_per_s": tokens / seconds}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="", help="also write the results as JSON here")
    args = parser.parse_args()

    cfg = train_grpo.load_config(args.config, args.overrides)
    cfg.rollout.engine = "vllm"
    rank, world, device = distributed.setup_distributed()
    train_grpo.check_config(cfg, world)
    from transformers import AutoProcessor

    from data import PromptDataset
    from grpo.hf_engine import HFEngine

    d, r = cfg.data, cfg.rollout
    processor = AutoProcessor.from_pretrained(cfg.actor.model_path)
    dataset = PromptDataset(
        d.train_files, processor, prompt_key=d.prompt_key, answer_key=d.answer_key, image_key=d.image_key,
        format_prompt=startup.resolve_path(d.format_prompt) or None, min_pixels=d.min_pixels,
        max_pixels=d.max_pixels, max_prompt_length=d.max_prompt_length,
    )  # fmt: skip
    rollout.check_prompt_limits(r, [dataset])  # the engine's images and videos per prompt, as in training
    t_start, vllm_engine = timed(lambda: rollout.make_engine(cfg, processor))  # before the model, as in training
    per_rank = d.rollout_batch_size // world
    prompts = [rollout.encode_prompt(processor, dataset[i]) for i in range(rank * per_rank, (rank + 1) * per_rank)]

    model = loading.load_model(cfg.actor.model_path, device, cfg.actor.attn_implementation)
    loading.apply_fsdp(model, device)
    loading.root_forward(model, processor.tokenizer.pad_token_id)
    model.eval()
    params = rollout.SamplingParams(r.temperature, r.top_p, d.max_response_length)
    seed = cfg.trainer.seed * 1_000_003 + rank

    results = {"world_size": world, "device": device.type, "prompts": d.rollout_batch_size, "n": r.n,
               "max_tokens": d.max_response_length, "vllm_start_s": t_start}  # fmt: skip
    results["vllm"] = bench_generate(vllm_engine, model, prompts, params, r.n, seed, args.repeats)
    results["hf"] = bench_generate(HFEngine(cfg, processor), model, prompts, params, r.n, seed, args.repeats)
    syncs = []
    for _ in range(args.repeats):
        vllm_engine.wake()
        syncs.append(timed(lambda: vllm_engine.sync_weights(model))[0])
        vllm_engine.sleep()
    results["weight_sync_s"] = sum(syncs) / len(syncs)
    results["parameters"] = sum(p.numel() for p in model.parameters())

    if rank == 0:
        v, h = results["vllm"], results["hf"]
        print(f"{world} ranks on {device.type}: {d.rollout_batch_size} prompts x n={r.n}, <= {d.max_response_length} "
              f"new tokens, {results['parameters'] / 1e6:.1f}M parameters")  # fmt: skip
        print("| engine | generated tokens | seconds | tokens/s |")
        print("|---|---|---|---|")
        for name, x in (("vllm", v), ("hf", h)):
            print(f"| {name} | {x['tokens']:.0f} | {x['seconds']:.2f} | {x['tokens_per_s']:.0f} |")
        speedup = v["tokens_per_s"] / h["tokens_per_s"]
        sync = results["weight_sync_s"]
        print(f"vLLM {speedup:.1f}x the HF engine; weight sync {sync:.3f} s; vLLM start {t_start:.1f} s")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=2)
    distributed.shut_down(vllm_engine)  # the engine, then the process group, as the trainer ends


if __name__ == "__main__":
    main()
    distributed.exit_rank(0)
