"""Qwen3.5's linear-attention layer over a packed row: the old segment-at-a-time path against linear_attention.py,
side by side in one run, forward + backward of one layer.

    python bench/bench_linear_attention.py                  # CPU: a quarter of Qwen3.5-9B's layer width
    python bench/bench_linear_attention.py --width 1        # the real width (on a GPU; fla's kernel if installed)

- segments: what the trainer did before: transformers' own forward once per sequence, an answer of a shared-prefix
  group as [its prompt | itself] (the prompt recomputed once per answer), a Python loop over the row;
- packed: linear_attention.packed_linear_attention, the kernel it picks for the device (fla's chunk_gated_delta_rule
  on CUDA where installed, else transformers' torch code a sequence at a time), with and without shared prefixes.

The row is a geo3k-like micro-batch: `--groups` prompts of `--prompt` tokens, each with `--n` answers of
`--answer` tokens. Prints milliseconds per forward + backward (median of `--repeats`, the two paths taking turns),
the speedups and the largest difference between the two paths' outputs, and the first call's seconds apart (on a
GPU: Triton compiling and fla tuning its kernels, which the trainer pays before step 1, linear_attention.warm_up).
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpo import attention, linear_attention  # noqa: E402


def layer(width, device, dtype):
    """One gated-DeltaNet layer of Qwen3.5-9B's shape (hidden 4096, 16 key heads and 32 value heads of 128, conv 4),
    every width divided by `width`."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = Qwen3_5TextConfig(
        hidden_size=4096 // width, linear_num_key_heads=16 // width, linear_num_value_heads=32 // width,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        layer_types=["linear_attention"], num_hidden_layers=1,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3_5GatedDeltaNet(config, 0).to(device, dtype)


def rows(args, share):
    """The packed row's segments: per group [prompt | answer 1 | ... | answer n] (shared) or n times
    [prompt | answer] (not shared)."""
    segments, at = [], 0
    for _ in range(args.groups):
        if share:
            prompt = (at, at + args.prompt)
            segments.append((*prompt, 0, 0))
            at += args.prompt
            for _ in range(args.n):
                segments.append((at, at + args.answer, *prompt))
                at += args.answer
        else:
            for _ in range(args.n):
                segments.append((at, at + args.prompt + args.answer, 0, 0))
                at += args.prompt + args.answer
    return segments, at


def by_segments(module, hidden, segments):
    """The old path: transformers' forward on each sequence, an answer after its whole prompt."""
    outs = []
    for s, e, ps, pe in segments:
        x = hidden[:, s:e] if pe == ps else torch.cat([hidden[:, ps:pe], hidden[:, s:e]], dim=1)
        outs.append(module(x)[:, x.shape[1] - (e - s) :])
    return torch.cat(outs, dim=1)


def timed(fns, repeats, device):
    """Seconds of each function, the calls alternating so that a busy machine slows both alike; the first round is
    a warm-up (and Triton's compile on a GPU)."""
    times = {name: [] for name in fns}
    for _ in range(repeats + 1):
        for name, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t[1:]) * 1e3 for name, t in times.items()} | {
        f"{name}_first": t[0] * 1e3 for name, t in times.items()
    }


def compare(module, args, share, device, dtype):
    """Milliseconds per forward + backward of the old path and of the packed one on the same row."""
    segments, length = rows(args, share)
    hidden = torch.randn(1, length, module.hidden_size, device=device, dtype=dtype, requires_grad=True)
    layout = attention.PackedLayout(segments, length, device)

    def step(forward):
        module.zero_grad(set_to_none=True)
        hidden.grad = None
        forward().float().square().mean().backward()

    packed = linear_attention.packed_linear_attention
    result = timed(  # first: the kernels' first calls (their compile and tuning) are the timed warm-up round's
        {
            "segments": lambda: step(lambda: by_segments(module, hidden, segments)),
            "packed": lambda: step(lambda: packed(module, hidden, layout)),
        },
        args.repeats,
        device,
    )
    with torch.no_grad():  # the two paths agree (bf16 rounding on a GPU)
        diff = (packed(module, hidden, layout) - by_segments(module, hidden, segments)).abs().max().item()
    print(f"{'shared prefixes' if share else 'no sharing'}: row of {length} tokens, {len(segments)} segments | "
          f"segments {result['segments']:.1f} ms | packed {result['packed']:.1f} ms | "
          f"speedup {result['segments'] / result['packed']:.2f}x | max |diff| {diff:.1e} | first call (Triton's "
          f"compile and fla's tuning on a GPU) packed {result['packed_first'] / 1e3:.1f} s")  # fmt: skip
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=0, help="divide the layer's widths by this (default 4 on CPU)")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--n", type=int, default=5, help="answers per prompt")
    parser.add_argument("--prompt", type=int, default=400, help="prompt tokens")
    parser.add_argument("--answer", type=int, default=300, help="answer tokens")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    width = args.width or (1 if device.type == "cuda" else 4)
    module = layer(width, device, dtype)
    kernel = linear_attention.delta_rule_kernel(device.type)
    print(f"{device.type}, {dtype}, hidden {module.hidden_size}, heads {module.num_k_heads}/{module.num_v_heads} "
          f"x 128, kernel {kernel.__module__}.{kernel.__name__}, {torch.get_num_threads()} threads")  # fmt: skip

    results = {share: compare(module, args, share, device, dtype) for share in (False, True)}
    print(f"shared-prefix packed vs the old path without sharing: "
          f"{results[False]['segments'] / results[True]['packed']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
