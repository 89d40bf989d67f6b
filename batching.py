"""Micro-batch planning: which sequences go into each forward/backward, and which rank trains them.

- token_budget_micro_batches / plan_micro_batches: the fewest balanced bins under actor.max_tokens_per_micro_batch,
  as many on every rank (FSDP2's forwards and backwards are collectives).
- rebalance_moves / balance_over_ranks: even out the ranks' token totals of an optimizer step by moving a few
  sequences, so no rank waits for the fullest one (actor.balance_ranks).
- stack_padded: per-sequence rows (log-probs) as one zero-padded micro-batch tensor.

The functions work on token counts and lists of items; the loop in train_grpo.py builds the micro-batches from them.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def balanced_bins(lengths: list[int], k: int) -> list[list[int]]:
    """Indices of `lengths` split into k bins of near-equal sums: longest first, each into the lightest bin so far
    (LPT). Each bin lists its indices in ascending order."""
    bins, loads = [[] for _ in range(k)], [0] * k
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        j = loads.index(min(loads))
        bins[j].append(i)
        loads[j] += lengths[i]
    return [sorted(b) for b in bins]


def fits(bins, lengths, budget):
    """Every bin within the token budget (a bin of one sequence always fits: it cannot be split)."""
    return all(len(b) <= 1 or sum(lengths[i] for i in b) <= budget for b in bins)


def token_budget_micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Token-budget micro-batches for ONE rank: the fewest balanced bins that each hold at most `budget` tokens.
    The loop calls plan_micro_batches, which also makes every rank agree on the count."""
    k = max(1, math.ceil(sum(lengths) / budget))
    while not fits(bins := balanced_bins(lengths, k), lengths, budget):
        k += 1
    return bins


def plan_micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """token_budget_micro_batches, with the SAME number of micro-batches on every rank: under FSDP2 every forward
    and backward is a collective, so a rank with one micro-batch fewer would leave the others waiting forever. The
    count is the largest any rank needs; a rank rebalances into it (more bins than it needs fit more easily; the
    loop takes one more bin in the rare case where rebalancing into the agreed count overflows on some rank)."""
    k = torch.tensor(len(token_budget_micro_batches(lengths, budget)))
    while True:
        dist.all_reduce(k, op=dist.ReduceOp.MAX)
        bins = balanced_bins(lengths, int(k))
        ok = torch.tensor(int(fits(bins, lengths, budget)))
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok:
            return bins
        k += 1


def rebalance_moves(lengths_per_rank: list[list[int]]) -> list[tuple[int, int, int]]:
    """Moves (from_rank, index there, to_rank) that even out the ranks' token totals with few sequences moved: the
    fullest rank repeatedly gives the emptiest the sequence closest to half their gap, while one is shorter than
    the gap (so every move narrows it). Deterministic: every rank computes the same plan from the same lengths."""
    items = [[(r, i, n) for i, n in enumerate(lengths)] for r, lengths in enumerate(lengths_per_rank)]
    loads = [sum(lengths) for lengths in lengths_per_rank]
    while True:
        hi, lo = loads.index(max(loads)), loads.index(min(loads))
        gap = loads[hi] - loads[lo]
        fitting = [j for j, (_, _, n) in enumerate(items[hi]) if n < gap]
        if not fitting:
            break
        j = min(fitting, key=lambda j: (abs(2 * items[hi][j][2] - gap), j))
        item = items[hi].pop(j)
        items[lo].append(item)
        loads[hi] -= item[2]
        loads[lo] += item[2]
    return sorted((r, i, dst) for dst, held in enumerate(items) for r, i, _ in held if r != dst)


def balance_over_ranks(items: list, lengths: list[int]) -> tuple[list, int]:
    """This rank's share of one optimizer step after evening out token totals over the ranks (rebalance_moves):
    its own items minus those it gives away, plus those it receives. Under FSDP2 the ranks move in lockstep, so a
    step lasts as long as its fullest rank takes; a group's samples need not stay together, as advantages are final
    by now. Collective: the moves go as pickled objects over the process group, in one global order of (from, to)
    pairs, which every rank walks in the same sequence (no deadlock). Also returns how many sequences moved."""
    rank = dist.get_rank()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, lengths)
    moves = rebalance_moves(gathered)
    given = {i for src, i, _ in moves if src == rank}
    mine = [item for i, item in enumerate(items) if i not in given]
    for src, dst in sorted({(src, dst) for src, _, dst in moves}):
        if rank == src:
            dist.send_object_list([[items[i] for s, i, d in moves if (s, d) == (src, dst)]], dst=dst)
        elif rank == dst:
            received = [None]
            dist.recv_object_list(received, src=src)
            mine += received[0]
    return mine, len(moves)


def shared_prefix_parts(groups: list[list[int]], prompt_lens: list[int], lengths: list[int], budget: int):
    """Split groups of answers that share a prompt into parts that fit the token budget, each part costing its
    prompt once plus its answers (the shared-prefix layout lays a part out as [prompt | answer 1 | ... | answer k]).
    groups: answer indices per group, prompt_lens: per group, lengths: per answer. Answers keep their order; a part
    of one answer always fits (it cannot be split). Returns (parts, costs)."""
    parts, costs = [], []
    for group, p_len in zip(groups, prompt_lens):
        part, cost = [], p_len
        for i in group:
            if part and cost + lengths[i] > budget:
                parts.append(part)
                costs.append(cost)
                part, cost = [], p_len
            part.append(i)
            cost += lengths[i]
        parts.append(part)
        costs.append(cost)
    return parts, costs


def stack_padded(rows, t_len, device):
    """1-D tensors as the rows of a (len(rows), t_len) tensor on `device`, zero-padded on the right."""
    out = torch.zeros(len(rows), t_len, device=device)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row.to(device)
    return out
