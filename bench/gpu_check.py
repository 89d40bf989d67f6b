"""The trainer on one GPU with a model of the real Qwen2.5-VL-3B shape, nothing downloaded: is the GPU path sound,
and how fast is it?

    python bench/gpu_check.py                   # one GPU, about 5-10 minutes; vLLM if importable, else the HF engine
    python bench/gpu_check.py --engine hf --steps 2 --prompts 8

1. Builds a random Qwen2.5-VL with the 3B shape (36 layers of width 2048, the 32-block vision tower, the 151,936-row
   vocabulary) from a config written here, with the tiny test tokenizer padded to the real token count, and saves
   it in bf16 as real checkpoints are; writes Geometry3K-shaped data (scripts/make_synthetic_data.py).
2. Runs train_grpo.main on it, one rank: the geo3k recipe's phases (rollout, reward, reference log-probs, clipped
   update with KL, weight sync) with FSDP2 in bf16, packed token-budget micro-batches through native varlen
   attention, chunked LM-head log-probs and gradient checkpointing. The toy digit reward: a random model never
   writes \\boxed{}, and the check is about the machinery, not learning.
3. Compares log-probs of one packed micro-batch, plain and with shared prefixes, with the same batch padded
   (sdpa), all in bf16.

Prints and writes (to $OUT, else outputs/gpu_check/) tokens/s per GPU (prompt incl. image tokens + response tokens
of a step / step seconds, the definition of REFERENCE.md §1), model FLOPs utilisation of the training phases, peak
GPU memory, and the packed-vs-padded agreements. Needs torch >= 2.11, transformers 5.17-5.19, safetensors, pillow,
pyyaml, jinja2, pyarrow, mathruler and math-verify (reward.py imports them); vLLM is optional.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import models  # noqa: E402
import rollout  # noqa: E402
import train_grpo  # noqa: E402
from scripts.make_synthetic_data import make_geo3k_like  # noqa: E402
from scripts.make_tiny_model import QWEN_SPECIAL_TOKENS, build_generation_config, build_processor, build_tokenizer  # noqa: E402

REAL_TOKENS, REAL_VOCAB = 151_665, 151_936  # Qwen2.5-VL's tokenizer size and embedding rows
# Dense bf16 peak of the GPUs this is likely to meet, TFLOP/s (vendor data sheets, without sparsity)
PEAK_TFLOPS = {"H200": 989.0, "H100 80GB HBM3": 989.0, "H100 NVL": 835.0, "H100 PCIe": 756.0, "A100": 312.0}


def qwen2_5_vl_3b_config(tokenizer):
    """Qwen2.5-VL-3B-Instruct's architecture (its published config.json), with token ids from our tokenizer."""
    from transformers import Qwen2_5_VLConfig

    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in QWEN_SPECIAL_TOKENS}
    text = dict(
        vocab_size=REAL_VOCAB, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=2, hidden_act="silu", max_position_embeddings=128000,
        rms_norm_eps=1e-6, use_sliding_window=False, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )  # fmt: skip
    vision = dict(
        depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_channels=3, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
        out_hidden_size=2048, tokens_per_second=2, hidden_act="silu",
    )  # fmt: skip
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=True, dtype="bfloat16",
    )  # fmt: skip


def build_model(out_dir):
    """A random 3B-shaped checkpoint (bf16 safetensors, tokenizer, processor) in out_dir; returns its parameter
    count, and that of the language model alone (with its LM head). The tokenizer is the tests' tiny BPE plus
    placeholder tokens up to Qwen's real count, so the vocabulary, and with it the LM head and the sampling cost,
    are the real ones."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    tokenizer = build_tokenizer(seed=0, vocab_size=400)
    tokenizer.add_tokens([f"<|filler_{i}|>" for i in range(REAL_TOKENS - len(tokenizer))])
    config = qwen2_5_vl_3b_config(tokenizer)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    model.generation_config = build_generation_config(tokenizer)
    model.save_pretrained(out_dir)
    build_processor(tokenizer).save_pretrained(out_dir)
    total = sum(p.numel() for p in model.parameters())  # the tied embedding / LM head counted once
    vision = sum(p.numel() for p in model.model.visual.parameters())
    del model
    torch.cuda.empty_cache()
    return total, total - vision


def trainer_argv(model_dir, data_dir, out_dir, args):
    """train_grpo's command line: the geo3k 3B recipe, scaled to one GPU and a few steps."""
    overrides = [
        f"actor.model_path={model_dir}", f"data.train_files={data_dir}/train.parquet", "data.val_files=",
        f"data.rollout_batch_size={args.prompts}", f"actor.global_batch_size={args.prompts}", f"rollout.n={args.n}",
        f"data.max_response_length={args.response_tokens}", "data.max_prompt_length=2048",
        f"rollout.engine={args.engine}", "rollout.tensor_parallel_size=1", "rollout.enforce_eager=true",
        f"rollout.gpu_memory_utilization={args.gpu_memory_utilization}",
        f"rollout.max_num_seqs={args.prompts * args.n}",
        "reward.reward_fn=reward.py:digit_fraction", "reward.num_workers=2",
        f"actor.ref_offload={str(args.ref_offload).lower()}", f"trainer.max_steps={args.steps}",
        "trainer.val_before_train=false", "trainer.val_freq=0", "trainer.save_freq=0", "trainer.resume=none",
        f"trainer.output_dir={out_dir}", "trainer.logger=[console,jsonl]",
    ]  # fmt: skip
    return [os.path.join(REPO, "configs/geo3k_3b.yaml"), *overrides]


def run_trainer(model_dir, data_dir, out_dir, args):
    """train_grpo.main, one rank in this process; returns the metrics of each step."""
    code = train_grpo.main(trainer_argv(model_dir, data_dir, out_dir, args))
    if code != 0:
        raise SystemExit(f"the trainer exited with {code}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def packed_vs_padded(model_dir, data_dir, response_tokens, device=None):
    """Max and mean |log p packed - log p padded| of answers to image prompts, bf16 on the GPU: plain packing, and the
    shared-prefix layout (two answers per prompt, the prompt once; it relies on the kernel's bottom-right causal
    alignment, which this checks: the wrong alignment would hide most of the prompt from the answers)."""
    import torch.distributed as dist
    from transformers import AutoProcessor

    from data import PromptDataset

    device = device or torch.device("cuda", torch.cuda.current_device())
    backend, device_id = ("nccl", device) if device.type == "cuda" else ("gloo", None)  # CPU: its test
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id)
    try:
        processor = AutoProcessor.from_pretrained(model_dir)
        dataset = PromptDataset(f"{data_dir}/train.parquet", processor, min_pixels=262144, max_pixels=4194304,
                                format_prompt=os.path.join(REPO, "configs/format_prompt/geo3k.jinja"))  # fmt: skip
        two = [rollout.encode_prompt(processor, dataset[i]) for i in range(2)]
        prompts = [two[0], two[0], two[1], two[1]]  # each prompt twice, the same object: a group of two answers
        model = models.load_model(model_dir, device, "auto")
        models.apply_fsdp(model, device)
        pad_id, image_token_id = processor.tokenizer.pad_token_id, model.config.image_token_id
        models.root_forward(model, pad_id)
        g = torch.Generator().manual_seed(0)
        # ordinary text tokens (the low ids of the BPE), never a vision special token
        responses = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (response_tokens, 37, 300, 5)]
        diffs = {"attention": model.config._attn_implementation}
        with torch.no_grad():
            padded, response_ids, mask = rollout.collate(prompts, responses, pad_id, image_token_id)
            want = models.forward_logprobs(model, padded, response_ids, 1.0)[0]
            for name, shared in (("packed", False), ("shared_prefix", True)):
                packed = rollout.pack(prompts, responses, image_token_id, share_prompts=shared)[0]
                got = models.forward_logprobs(model, packed, response_ids, 1.0)[0]
                diff = (got - want).abs()[mask.to(device).bool()]
                diffs[name] = {"max": diff.max().item(), "mean": diff.mean().item()}
        return diffs
    finally:
        dist.destroy_process_group()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="answers per prompt")
    parser.add_argument("--response-tokens", type=int, default=512)
    default_engine = "vllm" if __import__("importlib").util.find_spec("vllm") else "hf"
    parser.add_argument("--engine", default=default_engine, choices=["vllm", "hf"])
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.2, help="vLLM's share while awake")
    parser.add_argument("--ref-offload", action="store_true", help="keep the reference model in host memory")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="the GPU's dense bf16 peak (default: known)")
    return parser.parse_args(argv)


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_check.py needs a CUDA GPU")
    out = os.environ.get("OUT") or os.path.join(REPO, "outputs", "gpu_check")
    os.makedirs(out, exist_ok=True)
    name = torch.cuda.get_device_name()
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data_dir = os.path.join(tmp, "model"), os.path.join(tmp, "data")
        t0 = time.perf_counter()
        n_params, n_text = build_model(model_dir)
        make_geo3k_like(f"{data_dir}/train.parquet", n_rows=max(64, args.prompts * (args.steps + 1)), seed=0,
                        image_size=(400, 700))  # fmt: skip
        print(f"built a random {n_params / 1e9:.2f} B-parameter Qwen2.5-VL in {time.perf_counter() - t0:.0f}s")
        torch.cuda.reset_peak_memory_stats()
        steps = run_trainer(model_dir, data_dir, os.path.join(tmp, "run"), args)
        peak_gib = torch.cuda.max_memory_allocated() / 2**30
        agreement = packed_vs_padded(model_dir, data_dir, args.response_tokens)

    timed = steps[1:] or steps  # the first step pays for warm-up (allocator, kernels)
    keys = ("perf/tokens_per_s_per_device", "time/step", "time/rollout", "time/logprobs", "time/train")
    med = {k: statistics.median(s[k] for s in timed) for k in keys}
    med["tokens"] = med["perf/tokens_per_s_per_device"] * med["time/step"]  # one rank: the step's tokens
    # Model FLOPs of the training side per step: forward + backward of the update (6 N per token) and the
    # reference forward (2 N per token), N = the language model's parameters (its tied embedding counted once, as
    # the LM head's matmul). Left out, so the figure errs low: the vision tower (it sees image patches only),
    # attention's own FLOPs, and the recompute of gradient checkpointing (not model FLOPs by definition).
    flops = med["tokens"] * (6 + 2) * n_text
    train_seconds = med["time/logprobs"] + med["time/train"]
    result = {
        "device": name,
        "engine": args.engine,
        "params": n_params,
        "steps": len(steps),
        "tokens_per_step": med["tokens"],
        "tokens_per_s_per_gpu": med["perf/tokens_per_s_per_device"],
        "step_s": med["time/step"],
        "rollout_s": med["time/rollout"],
        "logprobs_s": med["time/logprobs"],
        "train_s": med["time/train"],
        "mfu_training_phases": flops / train_seconds / (peak * 1e12) if peak else None,
        "peak_gpu_memory_gib": peak_gib,
        "packed_vs_padded_logprob_diff": agreement,
    }
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump({**result, "metrics": steps}, f, indent=2)
    mfu = f"{result['mfu_training_phases']:.1%}" if peak else "n/a (pass --peak-tflops)"
    print(
        f"gpu check on {name} ({args.engine} engine, {len(steps)} steps of {args.prompts} x {args.n}):\n"
        f"  tokens/s per GPU {result['tokens_per_s_per_gpu']:.0f} | step {med['time/step']:.1f}s (rollout "
        f"{med['time/rollout']:.1f}s, ref log-probs {med['time/logprobs']:.1f}s, update {med['time/train']:.1f}s)\n"
        f"  MFU of the training phases {mfu} | peak GPU memory (torch allocator) {peak_gib:.1f} GiB\n"
        f"  log-probs vs padded ({agreement['attention']}, bf16): packed max |diff| "
        f"{agreement['packed']['max']:.3f} (mean {agreement['packed']['mean']:.4f}), shared prefix max |diff| "
        f"{agreement['shared_prefix']['max']:.3f} (mean {agreement['shared_prefix']['mean']:.4f})"
    )


if __name__ == "__main__":
    main()
