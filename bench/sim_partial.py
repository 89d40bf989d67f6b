"""Partial rollouts on paper: the geo3k recipe's rollout simulated decode step by decode step, partial off and on.

    python bench/sim_partial.py                           # the table in docs/performance.md#partial-rollouts
    python bench/sim_partial.py --median 250 --sigma 0.9  # another length distribution
    python bench/sim_partial.py --ranks 8                 # 8 ranks, and a bound on stopping them together

What the CPU bench (bench/bench_partial.py) cannot show is a GPU's cost of a decode step, which is what decides the
gain: partial rollouts save the steps spent on the last few long answers, and on a GPU such a step costs nearly as
much as one at a full batch. Assumed, for Qwen2.5-VL-7B in bf16 on one H100 (the recipe: 512 prompts x 5 answers on
8 GPUs, 64 groups a rank, answers up to 2,048 tokens, prompts of ~800 tokens with the image):
- a decode step reads the weights (15 GB at ~3 TB/s: 5 ms) and each running answer's KV cache (57 KB a token: 28
  layers x 2 x 4 KV heads x 128 x 2 bytes, 19 ns a token at that bandwidth);
- a prefilled token costs 35 us (14 GFLOP at ~400 TFLOPS); a group's prompt is prefilled once a step (its answers
  share it through the prefix cache), and a continued answer's tokens again, under the new weights;
- answer lengths are log-normal (median 400 tokens, sigma 0.6: a right-skewed tail that reaches the limit in 0.3 %
  of answers), clipped to 1 .. the limit.
Every answer gains one token a decode step. Without partial a step runs its groups to the end; with it the rank
keeps partial_reserve x 64 groups more in flight and stops when 64 are complete (all their answers finished), unless
a group is at max_staleness (4), whose answers then finish first; the rest continue at the next step. The lengths of
a group are drawn from its own seed, so both runs see the same data. Throughput: generated tokens per second of
rollout (prefill and decode), over the steps after the first `--warmup`.
"""

import argparse
import math

import numpy as np

WEIGHTS_S = 15e9 / 3e12  # a decode step's read of the weights
KV_S = 28 * 2 * 4 * 128 * 2 / 3e12  # and of one token of a running answer's KV cache
PREFILL_S = 35e-6  # a prefilled token


def decode_cost(steps, answers, context) -> float:
    """Seconds of `steps` decode steps of `answers` answers whose contexts hold `context` tokens at the first."""
    return steps * WEIGHTS_S + KV_S * (steps * context + answers * steps * (steps - 1) / 2)


class Rank:
    """One rank's groups in flight: each answer's drawn length, its tokens so far, the step of its first token."""

    def __init__(self, args, rank):
        self.args, self.rank, self.drawn = args, rank, 0
        self.length = np.zeros((0, args.n), int)
        self.got = np.zeros((0, args.n), int)
        self.born = np.zeros((0, args.n), int)

    def refill(self, groups):
        a = self.args
        new = []
        for _ in range(max(0, groups - len(self.length))):
            rng = np.random.default_rng([a.seed, self.rank, self.drawn])  # the group's own lengths
            new.append(np.clip(rng.lognormal(math.log(a.median), a.sigma, a.n).round(), 1, a.limit).astype(int))
            self.drawn += 1
        if new:
            self.length = np.concatenate([self.length, np.array(new)])
            self.got = np.concatenate([self.got, np.zeros_like(new)])
            self.born = np.concatenate([self.born, np.full_like(new, -1)])

    def prefill(self) -> float:
        """Seconds to prefill the open groups' prompts and the continued answers' tokens."""
        open_ = self.got < self.length
        return PREFILL_S * (self.args.prompt * open_.any(1).sum() + self.got[open_].sum())

    def decode(self, step, quota, until=math.inf) -> tuple[float, int]:
        """Decode steps until `quota` groups are complete and no group at the staleness bound is open (or, with
        `until`, for that many seconds); returns (seconds, tokens)."""
        a, seconds, tokens = self.args, 0.0, 0
        pinned = ((self.born >= 0) & (self.born <= step - a.max_staleness)).any(1)
        while seconds < until:
            open_ = self.got < self.length
            complete = ~open_.any(1)
            if not open_.any() or (until == math.inf and complete.sum() >= quota and not (pinned & ~complete).any()):
                break
            # up to the next answer's end every open answer gains a token a step: k steps at once
            count, context = int(open_.sum()), int((a.prompt + self.got[open_]).sum())
            k = int((self.length - self.got)[open_].min())
            if seconds + decode_cost(k, count, context) > until:  # the steps that take it past `until`, the last too
                k = next(j for j in range(1, k + 1) if seconds + decode_cost(j, count, context) >= until)
            seconds += decode_cost(k, count, context)
            self.born[open_ & (self.born < 0)] = step
            self.got[open_] += k
            tokens += count * k
        return seconds, tokens

    def take(self, quota):
        """The first `quota` complete groups (oldest first) train and leave."""
        complete = np.flatnonzero(~(self.got < self.length).any(1))[:quota]
        keep = np.setdiff1d(np.arange(len(self.length)), complete)
        self.length, self.got, self.born = self.length[keep], self.got[keep], self.born[keep]


def run(args, reserve, together=False) -> float:
    """Tokens per second of rollout per GPU over the steps after the warm-up. With several ranks the step waits for
    the slowest; `together`: every rank decodes on at its own pace until the slowest has its groups, an upper bound
    on what a joint stop could win (the trainer stops each rank at its own quota: a joint stop that a resume repeats
    exactly steps the ranks in lockstep, which 2 CPU ranks ran about 8 % slower a step)."""
    ranks = [Rank(args, r) for r in range(args.ranks)]
    quota = args.groups
    seconds = tokens = 0.0
    for step in range(args.warmup + args.steps):
        spent, made = [], []
        for r in ranks:
            r.refill(quota + math.ceil(reserve * quota))
            t = r.prefill()
            dt, k = r.decode(step, quota)
            spent.append(t + dt)
            made.append(k)
        if together:  # the ranks that are done go on decoding their open answers for as long as the slowest takes
            slowest = max(spent)
            for i, r in enumerate(ranks):
                dt, k = r.decode(step, quota, until=slowest - spent[i])
                spent[i], made[i] = spent[i] + dt, made[i] + k
        for r in ranks:
            r.take(quota)
        if step >= args.warmup:
            seconds += max(spent) * len(ranks)
            tokens += sum(made)
    return tokens / seconds


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--median", type=float, help="answer length median (default: the three distributions below)")
    p.add_argument("--sigma", type=float, default=0.6, help="log-normal sigma of the answer lengths")
    p.add_argument("--reserves", default="0.25,0.5,1.0", help="partial_reserve values, comma-separated")
    p.add_argument("--ranks", type=int, default=1, help="ranks, each with its own groups (one GPU each)")
    p.add_argument("--groups", type=int, default=64, help="groups a rank trains a step")
    p.add_argument("--n", type=int, default=5, help="answers a prompt")
    p.add_argument("--limit", type=int, default=2048, help="data.max_response_length")
    p.add_argument("--prompt", type=int, default=800, help="prompt tokens, the image's included")
    p.add_argument("--max-staleness", type=int, default=4)
    p.add_argument("--steps", type=int, default=20, help="steps measured, after the warm-up")
    p.add_argument("--warmup", type=int, default=5, help="steps left out while the groups in flight build up")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    shapes = [(args.median, args.sigma)] if args.median else [(400, 0.6), (400, 0.8), (250, 0.9)]
    reserves = [float(x) for x in args.reserves.split(",")]
    print(f"{args.ranks} rank(s) x {args.groups} groups x {args.n} answers, answers up to {args.limit} tokens, "
          f"{args.steps} steps after {args.warmup}: rollout throughput, partial on / off")  # fmt: skip
    for median, sigma in shapes:
        args.median, args.sigma = median, sigma
        whole = run(args, 0.0)
        line = " / ".join(f"{run(args, r) / whole:.2f}x" for r in reserves)
        print(f"median {median:g}, sigma {sigma:g}: whole {whole:,.0f} tokens/s a GPU; partial_reserve "
              f"{' / '.join(f'{r:g}' for r in reserves)}: {line}")  # fmt: skip
        if args.ranks > 1:
            line = " / ".join(f"{run(args, r, together=True) / whole:.2f}x" for r in reserves)
            print(f"  bound: every rank decoding on until the slowest has its groups: {line}")


if __name__ == "__main__":
    main()
