"""Peak memory and time of the training log-prob pass: full logits vs chunked LM head (issue 6), on CPU.

The model is a random Qwen2.5-VL built from config classes (no download) with the REAL vocabulary, 151,936, and a
small body (hidden 256, 2 layers): the logits then dominate memory, as they do on the real model. The batch is one
micro-batch of text-only rows with a spread of response lengths, padded to the longest as the trainer pads them.
Each variant runs in a fresh subprocess: forward (log-probs, and the entropy metric without grad, as update_policy
asks for it) + backward of a masked mean of the log-probs. Peak memory is the process's peak resident set (VmHWM,
reset just before the step through /proc/self/clear_refs) minus its resident set at that point: on CPU, PyTorch
tensors of this size are plain mmap'd pages, so this counts the tensor memory of the step, parameter grads included.

    .venv/bin/python bench/bench_train.py                         # 8 rows, responses 48..512 tokens
    .venv/bin/python bench/bench_train.py --lengths 1024,512,256,128 --chunk-size 256

The last line is one JSON object with the results.
"""

import argparse
import functools
import inspect
import json
import os
import re
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train_grpo  # noqa: E402

VOCAB = 151936  # Qwen2.5-VL's real vocabulary (embedding rows)


def build_model(hidden):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    head_dim = 64
    text = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                num_attention_heads=hidden // head_dim, num_key_value_heads=1, max_position_embeddings=32768,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]},
                pad_token_id=0)  # fmt: skip
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=1, out_hidden_size=hidden)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=VOCAB - 1,
                              video_token_id=VOCAB - 2, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(config).float()


def build_batch(lengths, prompt_len=64):
    """[left-padded prompt | right-padded response] rows, as rollout.collate lays them out (no images)."""
    g = torch.Generator().manual_seed(0)
    b, t = len(lengths), max(lengths)
    input_ids = torch.zeros(b, prompt_len + t, dtype=torch.long)  # (B, L)
    attention_mask = torch.zeros_like(input_ids)  # (B, L)
    mask = torch.zeros(b, t)  # (B, T)
    for i, n in enumerate(lengths):
        input_ids[i, : prompt_len + n] = torch.randint(1, VOCAB - 2, (prompt_len + n,), generator=g)
        attention_mask[i, : prompt_len + n] = 1
        mask[i, :n] = 1
    no_images = torch.zeros_like(input_ids)  # (B, L)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "mm_token_type_ids": no_images}
    return inputs, input_ids[:, prompt_len:], mask


def naive_logprobs(model, batch_inputs, response_ids, temperature):
    """The trainer before issue 6: full (B, T, V) logits, fp32 log_softmax gather, no-grad entropy on the same."""
    logits = model(**batch_inputs, use_cache=False, logits_to_keep=response_ids.shape[1] + 1).logits[:, :-1]
    logp = train_grpo.token_logprobs(logits, response_ids, temperature)  # (B, T)
    with torch.no_grad():
        entropy = train_grpo.entropy_from_logits(logits, temperature)  # (B, T)
    return logp, entropy


def chunked_logprobs(model, batch_inputs, response_ids, temperature):
    return train_grpo.forward_logprobs(model, batch_inputs, response_ids, temperature, with_entropy=True)


VARIANTS = {"naive": naive_logprobs, "chunked": chunked_logprobs}


def rss_kib(field):
    return int(re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read()).group(1))


def run_variant(args):
    """One variant in this (fresh) process: the first step's peak memory, then the best of `repeats` step times."""
    model = build_model(args.hidden)
    model.train()
    batch_inputs, response_ids, mask = build_batch([int(n) for n in args.lengths.split(",")])
    fn = VARIANTS[args.variant]
    times, peak_mib = [], None
    for _ in range(args.repeats):
        model.zero_grad(set_to_none=True)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak resident set (VmHWM) to the current one
        before = rss_kib("VmRSS")
        t0 = time.perf_counter()
        logp, entropy = fn(model, batch_inputs, response_ids, args.temperature)
        loss = (logp * mask).sum() / mask.sum()
        loss.backward()
        times.append(time.perf_counter() - t0)
        if peak_mib is None:
            peak_mib = (rss_kib("VmHWM") - before) / 1024
        del logp, entropy, loss
    grad = model.lm_head.weight.grad.norm().item()
    print(json.dumps({"variant": args.variant, "peak_mib": peak_mib, "seconds": min(times), "head_grad_norm": grad}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="512,400,320,256,192,128,96,48", help="response lengths of the micro-batch")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--chunk-size", type=int, default=None, help="tokens per LM-head chunk (default: the trainer's)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)  # set for the child processes
    args = p.parse_args()
    default_chunk = inspect.signature(train_grpo.chunked_logprobs).parameters["chunk_size"].default
    chunk = args.chunk_size or default_chunk
    if args.chunk_size:  # a bench knob only: forward_logprobs looks chunked_logprobs up in its module at each call
        train_grpo.chunked_logprobs = functools.partial(train_grpo.chunked_logprobs, chunk_size=args.chunk_size)
    if args.variant:
        return run_variant(args)

    lengths = [int(n) for n in args.lengths.split(",")]
    print(
        f"vocab {VOCAB} | hidden {args.hidden} | {len(lengths)} rows x {max(lengths)} padded response tokens "
        f"({sum(lengths)} real) | chunk {chunk} tokens | torch {torch.__version__} | {os.cpu_count()} CPUs"
    )
    results = {}
    for variant in VARIANTS:
        cmd = [sys.executable, __file__, "--variant", variant, *sys.argv[1:]]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
    full_logits_mib = len(lengths) * max(lengths) * VOCAB * 4 / 2**20
    print(f"{'variant':<10}{'peak MiB':>12}{'seconds':>10}{'lm_head grad norm':>20}")
    for name, r in results.items():
        print(f"{name:<10}{r['peak_mib']:>12.0f}{r['seconds']:>10.2f}{r['head_grad_norm']:>20.6f}")
    print(f"(one fp32 (B, T, V) logits tensor is {full_logits_mib:.0f} MiB)")
    n, c = results["naive"], results["chunked"]
    print(json.dumps({
        "chunked_vs_naive_peak_mem_ratio": round(c["peak_mib"] / n["peak_mib"], 4),
        "naive_peak_mib": round(n["peak_mib"], 1), "chunked_peak_mib": round(c["peak_mib"], 1),
        "naive_seconds": round(n["seconds"], 3), "chunked_seconds": round(c["seconds"], 3),
        "chunk_size": chunk, "rows": len(lengths), "padded_tokens": len(lengths) * max(lengths),
        "packed_vs_padded_speedup": None, "packing_efficiency": None,
        "note": "packing / padding-free batches are not implemented yet (issue 6): those two keys stay null",
    }))  # fmt: skip


if __name__ == "__main__":
    main()
