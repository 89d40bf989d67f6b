"""Training-side throughput mechanisms (packing, token budgets, chunked log-probs, shared prefixes), measured
side by side in one run.

1. Step time, padded vs packed: forward (the trainer's forward_logprobs) + backward of a token-mean loss over one
   rank's rollout batch. Padded = micro-batches of `--micro-batch-size` sequences laid out by batching.collate, each
   padded to its longest prompt and response; packed = token-budget micro-batches (batching.plan_micro_batches's
   partition) laid out by batching.pack, no pad tokens, attention kept inside each sequence.
2. Peak memory, naive vs chunked log-probs: the full (B, T, V) fp32 logits then log_softmax, against the trainer's
   chunked LM head, on one padded micro-batch.
3. Step time, packed vs shared prefix: the same token budget, but each group's prompt once per
   micro-batch part [prompt | answer 1 | ... | answer k] (batching.shared_prefix_parts), attention letting each
   answer see its prompt and not its siblings. Prints the step-time ratio and the processed-token ratio.
4. Packing efficiency = real tokens / processed tokens, for a geo3k-sized step on `--ranks` ranks in lockstep
   (under FSDP2 every micro-batch is a collective, so each micro-batch step costs every rank as much as the
   fullest rank's): token-budget packing against padded micro-batches, from the same sampled lengths.

The model is a random Qwen2.5-VL built from config classes (no download) with the REAL vocabulary, 151,936, and a
small body, so on CPU the LM head dominates as the logits dominate memory on the real model (--vocab and --hidden
/ --layers set other proportions). Lengths are drawn to
look like a Geometry3K step: prompts of 330-620 tokens (a diagram resized to at least 262,144 pixels is 334 image
tokens, plus ~100 text tokens), n = 5 responses per prompt with a log-normal spread (median 300, a tail cut at
2,048). Image tokens are stood in for by text tokens: the vision tower costs the same in both layouts.

Each timed variant runs in a fresh subprocess (peak memory is the process's peak resident set on CPU, VmHWM reset
just before the step, minus the resident set then; torch.cuda.max_memory_allocated with --gpu).

    .venv/bin/python bench/bench_train.py            # CPU, a few minutes on 2 cores
    # shared vs unshared with the 7B's body-to-LM-head ratio (about 12:1 in parameters): a real-vocabulary head
    # would dominate a body small enough for a CPU, and that head costs the same in both layouts
    .venv/bin/python bench/bench_train.py --variants packed,shared --hidden 512 --layers 8 --vocab 4096
    python bench/bench_train.py --gpu --hidden 3584 --layers 4 --prompts 8   # CUDA: bf16, torch's varlen kernel

The last line of output is one JSON object with the results.
"""

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rollout  # noqa: E402
import train_grpo  # noqa: E402
from grpo import attention, batching, logprobs  # noqa: E402

VOCAB = 151936  # Qwen2.5-VL's real vocabulary (embedding rows); --vocab changes it for the whole run
IMAGE_TOKEN = VOCAB - 1


def use_vocab(n):
    global VOCAB, IMAGE_TOKEN
    VOCAB, IMAGE_TOKEN = n, n - 1


def sample_lengths(prompts, n, seed, max_response=2048):
    """(prompt_len, response_len) for `prompts` x n sequences, prompt-major as the rollout returns them."""
    rng = random.Random(seed)
    out = []
    for _ in range(prompts):
        p = rng.randint(330, 620)
        out += [(p, min(max_response, max(16, int(rng.lognormvariate(5.7, 0.7))))) for _ in range(n)]
    return out


def build_model(hidden, layers, device, attn):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    head_dim = 64 if hidden <= 1024 else 128
    text = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=hidden // head_dim, num_key_value_heads=1, max_position_embeddings=32768,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                 "mrope_section": [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]},
                pad_token_id=0)  # fmt: skip
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=1, out_hidden_size=hidden)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN,
                              video_token_id=VOCAB - 2, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    if attn == "sdpa_packed":
        attention._register_attention()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = Qwen2_5_VLForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(device).train()


def build_rollout(lengths, seed=0):
    """Prompts and samples with random token ids of the given (prompt, response) lengths."""
    g = torch.Generator().manual_seed(seed)
    prompts, samples, n_seen = [], [], {}
    for p_len, r_len in lengths:
        if p_len not in n_seen:  # consecutive sequences with the same prompt length share the prompt
            n_seen[p_len] = len(prompts)
            prompts.append(rollout.Prompt(torch.randint(1, VOCAB - 2, (p_len,), generator=g), None, None, []))
        ids = torch.randint(1, VOCAB - 2, (r_len,), generator=g).tolist()
        samples.append(rollout.Sample(n_seen[p_len], ids, [0.0] * r_len, "", False))
    return prompts, samples


def padded_groups(lengths, size):
    return [list(range(i, min(i + size, len(lengths)))) for i in range(0, len(lengths), size)]


def padded_tokens(lengths, group):
    return len(group) * (max(lengths[i][0] for i in group) + max(lengths[i][1] for i in group))


def micro_batches(variant, lengths, args, samples=None):
    if variant == "packed":
        return batching.token_budget_micro_batches([p + r for p, r in lengths], args.budget)
    if variant == "shared":  # as train_grpo.micro_batches plans them with actor.shared_prefix
        groups = {}
        for i, s in enumerate(samples):
            groups.setdefault(s.prompt_index, []).append(i)
        groups = list(groups.values())
        response_lens = {i: r for i, (_, r) in enumerate(lengths)}
        parts, costs = batching.shared_prefix_parts(groups, [lengths[g[0]][0] for g in groups], response_lens,
                                                    args.budget)  # fmt: skip
        return [[i for j in b for i in parts[j]] for b in batching.token_budget_micro_batches(costs, args.budget)]
    return padded_groups(lengths, args.micro_batch_size)


def lockstep_efficiency(ranks_lengths, variant, args):
    """Real tokens / processed tokens of one optimizer step on len(ranks_lengths) ranks moving in lockstep."""
    real = sum(p + r for lengths in ranks_lengths for p, r in lengths)
    if variant == "packed":
        totals = [[p + r for p, r in lengths] for lengths in ranks_lengths]
        if args.balance_ranks:  # the trainer's actor.balance_ranks: move a few sequences to even out the ranks
            moves = batching.rebalance_moves(totals)
            gone = {(src, i) for src, i, _ in moves}
            moved = [[] for _ in totals]
            for src, i, dst in moves:
                moved[dst].append(totals[src][i])
            totals = [[n for i, n in enumerate(t) if (r, i) not in gone] + moved[r] for r, t in enumerate(totals)]
        k = max(len(batching.token_budget_micro_batches(t, args.budget)) for t in totals)  # the ranks agree on k
        loads = [sorted((sum(t[i] for i in b) for b in batching.balanced_bins(t, k)), reverse=True) for t in totals]
    else:
        loads = [[padded_tokens(lengths, g) for g in padded_groups(lengths, args.micro_batch_size)]
                 for lengths in ranks_lengths]  # fmt: skip
    steps = max(len(x) for x in loads)
    processed = sum(max(x[j] if j < len(x) else 0 for x in loads) for j in range(steps)) * len(ranks_lengths)
    return real / processed


def naive_logprobs(model, batch_inputs, response_ids, temperature):
    """Full (B, T, V) logits, fp32 log_softmax gather, no-grad entropy on the same: the trainer before
    chunked log-probs."""
    logits = model(**batch_inputs, use_cache=False, logits_to_keep=response_ids.shape[1] + 1).logits[:, :-1]
    logp = logprobs.token_logprobs(logits, response_ids, temperature)  # (B, T)
    with torch.no_grad():
        entropy = logprobs.entropy_from_logits(logits, temperature)  # (B, T)
    return logp, entropy


def rss_kib(field):
    return int(re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read()).group(1))


class Peak:
    """Peak memory of a block, in MiB, above what was held when it began."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak resident set (VmHWM) to the current one
            self.before = rss_kib("VmRSS") * 1024
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.mib = (torch.cuda.max_memory_allocated() - self.before) / 2**20
        else:
            self.mib = (rss_kib("VmHWM") * 1024 - self.before) / 2**20
        self.seconds = time.perf_counter() - self.t0


def run_variant(args):
    """One variant in this (fresh) process; prints one JSON line."""
    use_vocab(args.vocab)
    device = torch.device("cuda" if args.gpu else "cpu")
    packed, shared = args.variant in ("packed", "shared"), args.variant == "shared"
    # as the trainer runs them: on CUDA varlen_packed (packed rows through the varlen kernel, padded ones through sdpa)
    attn = "varlen_packed" if args.gpu else ("sdpa_packed" if packed else "sdpa")
    model = build_model(args.hidden, args.layers, device, attn)
    times, peak, extra = [], None, {}
    if args.variant in ("naive", "chunked"):  # one padded micro-batch, as the trainer pads it
        lengths = sample_lengths(-(-args.mem_rows // args.n), args.n, args.seed)[: args.mem_rows]
        prompts, samples = build_rollout(lengths)
        batch = batching.collate([prompts[s.prompt_index] for s in samples], [s.response_ids for s in samples], 0,
                                IMAGE_TOKEN)  # fmt: skip
        for _ in range(args.repeats):
            model.zero_grad(set_to_none=True)
            with Peak(device) as m:
                inputs, response_ids, mask = batch
                if args.variant == "naive":
                    logp, _ = naive_logprobs(model, {k: v.to(device) for k, v in inputs.items()},
                                             response_ids.to(device), 1.0)  # fmt: skip
                else:
                    logp, _ = logprobs.forward_logprobs(model, inputs, response_ids, 1.0, with_entropy=True)
                mask = mask.to(device)
                ((logp * mask).sum() / mask.sum()).backward()
            times.append(m.seconds)
            peak = m.mib if peak is None else peak
            del logp
        extra["padded_tokens"] = padded_tokens(lengths, list(range(len(lengths))))
    else:  # one rank's batch, over all its micro-batches
        lengths = sample_lengths(args.prompts, args.n, args.seed)
        prompts, samples = build_rollout(lengths)
        groups = micro_batches(args.variant, lengths, args, samples)
        batches = [train_grpo.make_micro_batch(prompts, samples, g, (0, IMAGE_TOKEN), packed, shared) for g in groups]
        total = sum(r for _, r in lengths)
        for _ in range(args.repeats):
            model.zero_grad(set_to_none=True)
            with Peak(device) as m:
                for inputs, response_ids, mask in batches:
                    logp, _ = logprobs.forward_logprobs(model, inputs, response_ids, 1.0, with_entropy=True)
                    ((logp * mask.to(device)).sum() / total).backward()
            times.append(m.seconds)
            peak = m.mib if peak is None else peak
        real = sum(p + r for p, r in lengths)
        processed = (
            sum(b[0]["input_ids"].shape[1] for b in batches)
            if packed
            else sum(padded_tokens(lengths, g) for g in groups)
        )
        extra.update(micro_batches=len(groups), real_tokens=real, processed_tokens=processed)
    grad = model.lm_head.weight.grad.float().norm().item()
    result = {"variant": args.variant, "peak_mib": peak, "seconds": min(times), "head_grad_norm": grad, **extra}
    print(json.dumps(result))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpu", action="store_true", help="run on CUDA (bf16, varlen_packed attention)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=VOCAB, help="embedding rows (the real 151,936 by default)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prompts", type=int, default=2, help="prompts in the timed batch (x n sequences)")
    p.add_argument("--n", type=int, default=5, help="responses per prompt")
    p.add_argument("--micro-batch-size", type=int, default=4, help="padded path: sequences per micro-batch")
    p.add_argument("--budget", type=int, default=4096, help="packed path: tokens per micro-batch (>= 2048 + 2048)")
    p.add_argument("--ranks", type=int, default=8, help="ranks of the simulated lockstep step (efficiency)")
    p.add_argument("--seqs-per-rank", type=int, default=80, help="sequences per rank per optimizer step (geo3k: 80)")
    p.add_argument("--step-budget", type=int, default=16384, help="token budget of the simulated step (geo3k.yaml)")
    p.add_argument("--mem-rows", type=int, default=4, help="sequences in the padded micro-batch of the memory test")
    p.add_argument(
        "--no-balance-ranks",
        dest="balance_ranks",
        action="store_false",
        help="simulate actor.balance_ranks=false (no sequences move between ranks)",
    )
    p.add_argument("--variants", default="padded,packed,shared,naive,chunked", help="which to run (comma-separated)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--variant", choices=["naive", "chunked", "padded", "packed", "shared"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        return run_variant(args)

    use_vocab(args.vocab)
    device = "cuda" if args.gpu else "cpu"
    print(f"vocab {VOCAB} | hidden {args.hidden} x {args.layers} layers | {device} | torch {torch.__version__} | "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    results = {}
    for variant in ("padded", "packed", "shared", "naive", "chunked"):
        if variant not in args.variants:
            continue
        cmd = [sys.executable, __file__, "--variant", variant, *sys.argv[1:]]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{variant} failed:\n{out.stderr[-3000:]}")
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"  {variant:<8} {results[variant]['seconds']:8.2f} s  peak {results[variant]['peak_mib']:8.0f} MiB")
    r, out = results, {"device": device, "hidden": args.hidden, "layers": args.layers, "vocab": VOCAB}
    if "padded" in r or "packed" in r or "shared" in r:
        any_batch = next(r[k] for k in ("padded", "packed", "shared") if k in r)
        print(f"\nstep time, one rank's batch ({any_batch['real_tokens']} tokens, {args.prompts} prompts x {args.n}):")
    rows = {"padded": f"micro-batches of {args.micro_batch_size}", "packed": f"micro-batches <= {args.budget} tokens",
            "shared": f"micro-batches <= {args.budget} tokens, each prompt once per micro-batch part"}  # fmt: skip
    for k, what in rows.items():
        if k in r:
            print(f"  {k:<7} {r[k]['micro_batches']:3d} {what}: {r[k]['seconds']:7.2f} s, "
                  f"{r[k]['processed_tokens']} processed tokens")  # fmt: skip
            out.update({f"{k}_seconds": round(r[k]["seconds"], 3), f"head_grad_norm_{k}": r[k]["head_grad_norm"]})
    if "padded" in r and "packed" in r:
        out["packed_vs_padded_speedup"] = round(r["padded"]["seconds"] / r["packed"]["seconds"], 3)
        out["timed_batch_padded_efficiency"] = round(r["padded"]["real_tokens"] / r["padded"]["processed_tokens"], 4)
    if "packed" in r and "shared" in r:
        out["shared_vs_unshared_speedup"] = round(r["packed"]["seconds"] / r["shared"]["seconds"], 3)
        processed = r["shared"]["processed_tokens"] / r["packed"]["processed_tokens"]
        out["shared_vs_unshared_processed_tokens"] = round(processed, 4)
    if "naive" in r and "chunked" in r:
        print(f"peak memory of one padded micro-batch's log-prob step ({r['naive']['padded_tokens']} tokens):")
        print(f"  naive {r['naive']['peak_mib']:.0f} MiB, chunked {r['chunked']['peak_mib']:.0f} MiB")
        out["chunked_vs_naive_peak_mem_ratio"] = round(r["chunked"]["peak_mib"] / r["naive"]["peak_mib"], 4)
        out.update(naive_peak_mib=round(r["naive"]["peak_mib"], 1), chunked_peak_mib=round(r["chunked"]["peak_mib"], 1))

    # the lockstep efficiency of a geo3k-sized step: seqs_per_rank sequences on each of `ranks` ranks
    n_prompts = -(-args.seqs_per_rank // args.n)
    ranks = [sample_lengths(n_prompts, args.n, args.seed + 1 + r)[: args.seqs_per_rank] for r in range(args.ranks)]
    step_args = argparse.Namespace(budget=args.step_budget, micro_batch_size=args.micro_batch_size,
                                   balance_ranks=args.balance_ranks)  # fmt: skip
    out["packing_efficiency"] = round(lockstep_efficiency(ranks, "packed", step_args), 4)
    out["padded_efficiency"] = round(lockstep_efficiency(ranks, "padded", step_args), 4)
    print(f"lockstep efficiency, {args.ranks} ranks x {args.seqs_per_rank} sequences, budget {args.step_budget}: "
          f"packed {out['packing_efficiency']:.3f}, padded (micro-batch {args.micro_batch_size}) "
          f"{out['padded_efficiency']:.3f}")  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
