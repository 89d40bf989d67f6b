"""Micro-batches: which sequences go into each forward/backward, which rank trains them, and how they are laid out.

- token_budget_micro_batches / plan_micro_batches: the fewest balanced bins under actor.max_tokens_per_micro_batch,
  as many on every rank (FSDP2's forwards and backwards are collectives).
- rebalance_moves / balance_over_ranks: even out the ranks' token totals of an optimizer step by moving a few
  sequences, so no rank waits for the fullest one (actor.balance_ranks).
- stack_padded: per-sequence rows (log-probs) as one zero-padded micro-batch tensor.
- collate / pack: lay a micro-batch of prompts and answers out for the model's forward, padded
  ([left-padded prompt | right-padded answer] per row) or packed (all sequences back to back in one row, optionally
  each prompt once before its group's answers); padded_routes / packed_routes: routing replay's recorded experts
  (replay.py) in the same two layouts.

The planning functions work on token counts and lists of items; the loop in train_grpo.py builds the micro-batches
from them with collate or pack.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

NO_ROUTE = -1  # routing replay: a token the engine recorded no experts for; the trainer's router routes it
# what the model's forward takes of a prompt's images and videos, concatenated over the prompts that have them
VISION_INPUTS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
                 "image_position_ids")  # fmt: skip


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


def balance_over_ranks(items: list, lengths: list[int], group=None) -> tuple[list, int]:
    """This rank's share of one optimizer step after evening out token totals over the ranks (rebalance_moves):
    its own items minus those it gives away, plus those it receives. Under FSDP2 the ranks move in lockstep, so a
    step lasts as long as its fullest rank takes; a group's samples need not stay together, as advantages are final
    by now. Collective: the moves go as pickled objects over the process group, in one global order of (from, to)
    pairs, which every rank walks in the same sequence (no deadlock). Also returns how many sequences moved.
    `group`: balance over its ranks only (sequence parallelism: each rank with its peers of the other groups, whose
    lists are the same in every place, so every rank of a group ends with the same list)."""
    rank = dist.get_rank(group)
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, lengths, group=group)
    moves = rebalance_moves(gathered)
    given = {i for src, i, _ in moves if src == rank}
    mine = [item for i, item in enumerate(items) if i not in given]
    peer = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)  # noqa: E731
    for src, dst in sorted({(src, dst) for src, _, dst in moves}):
        if rank == src:
            dist.send_object_list([[items[i] for s, i, d in moves if (s, d) == (src, dst)]], dst=peer(dst))
        elif rank == dst:
            received = [None]
            dist.recv_object_list(received, src=peer(src))
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


def token_types(prompt, image_token_id: int) -> torch.Tensor:
    """(P,) 0 text, 1 image, 2 video token: transformers 5.x builds the 3-D (mRoPE) positions only when told which
    tokens are which, and spaces a video's temporal positions differently from an image's."""
    if prompt.token_types is not None:
        return prompt.token_types.long()
    return (prompt.input_ids == image_token_id).long()


def answer_types(length: int, turns) -> torch.Tensor:
    """(R,) token types of an answer: text (0), except the image tokens of its tool turns (turns.ToolTurn)."""
    types = torch.zeros(length, dtype=torch.long)
    for turn in turns:
        types[turn.start : turn.start + len(turn.input_ids)] = turn.token_types
    return types


def mask_tool_turns(mask_row: torch.Tensor, turns) -> None:
    """Zero an answer's (T,) response-mask row over its tool turns: context, not the model's tokens, so no loss."""
    for turn in turns:
        mask_row[turn.start : turn.start + len(turn.input_ids)] = 0


def collate(prompts, responses, pad_id, image_token_id, turns=None, routes=None):
    """Lay each sequence out as [left-padded prompt | right-padded response]: every response starts at the same
    column, so the model needs logits only for the last T + 1 positions. `turns`: per response, the tool turns inside
    it (turns.ToolTurn; None: none): their image tokens are typed, their pixels follow the prompt's, their tokens are
    out of the response mask. `routes`: per response, its recorded experts (Sample.routes) or None; when any has
    some, the inputs carry `routes` laid out as the tokens are (padded_routes), for forward_logprobs.

    Returns the model inputs, `response_ids` (B, T) and `response_mask` (B, T).
    """
    turns = turns or [[] for _ in responses]
    p_len = max(len(p.input_ids) for p in prompts)
    t_len = max(len(r) for r in responses)
    batch = len(prompts)
    input_ids = torch.full((batch, p_len + t_len), pad_id, dtype=torch.long)  # (B, L)
    types = torch.zeros((batch, p_len + t_len), dtype=torch.long)  # (B, L)
    attention_mask = torch.zeros((batch, p_len + t_len), dtype=torch.long)  # (B, L)
    response_mask = torch.zeros((batch, t_len), dtype=torch.float32)  # (B, T)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        start = p_len - len(p.input_ids)
        input_ids[i, start:p_len] = p.input_ids
        types[i, start:p_len] = token_types(p, image_token_id)
        input_ids[i, p_len : p_len + len(r)] = torch.as_tensor(r, dtype=torch.long)
        types[i, p_len : p_len + len(r)] = answer_types(len(r), turns[i])
        attention_mask[i, start : p_len + len(r)] = 1
        response_mask[i, : len(r)] = 1
        mask_tool_turns(response_mask[i], turns[i])
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "mm_token_type_ids": types}
    if routes is not None and routes_shape(routes) is not None:
        inputs["routes"] = padded_routes(routes, [len(p.input_ids) for p in prompts],
                                                [len(r) for r in responses], p_len, t_len)  # fmt: skip
    vision = [x for p, ts in zip(prompts, turns) for x in (p, *ts)]  # in token order: a prompt, its answer's turns
    return {**inputs, **stacked_images(vision)}, input_ids[:, p_len:], response_mask


def stacked_images(prompts) -> dict:
    """The VISION_INPUTS of all the prompts' (and tool turns') images and videos, each in the order given (the order
    their tokens take in the batch); an input none has is left out."""
    stacked = {}
    for key in VISION_INPUTS:
        values = [getattr(p, key) for p in prompts if getattr(p, key, None) is not None]
        if values:
            stacked[key] = torch.cat(values)
    return stacked


def pack(prompts, responses, image_token_id, share_prompts=False, turns=None, routes=None):
    """Padding-free layout: every [prompt | response] back to back in ONE row, no pad token anywhere. With
    `share_prompts`, consecutive sequences with the same prompt (the same Prompt object) become one part
    [prompt | response 1 | ... | response k]: the prompt and its images are in the row once, and the attention lets
    each response see the prompt but not the other responses (attention.PackedLayout).

    `turns` as in `collate`: a part's images are its prompt's, then each of its answers' tool turns', in row order.
    `routes` as in `collate`, packed as the tokens are (packed_routes): a shared prompt's routes once, its
    first answer's record's (the answers of a group were prefilled from the same prompt).

    Returns the same triple as `collate`, so the loss code does not care which layout it got: `response_ids` and
    `response_mask` (B, T) stay padded (they are small), only the model input is packed. The inputs carry three
    extra host-side entries from which logprobs.forward_logprobs works out positions, attention and the logits it
    needs: `prompt_lens` (G,) and `group_sizes` (G,) of the row's parts, `response_lens` (B,).
    """
    t_len = max(len(r) for r in responses)
    turns = turns or [[] for _ in responses]
    response_ids = torch.zeros((len(prompts), t_len), dtype=torch.long)  # (B, T)
    response_mask = torch.zeros((len(prompts), t_len), dtype=torch.float32)  # (B, T)
    pieces, types, part_prompts, group_sizes, vision, starts_part = [], [], [], [], [], []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        r = torch.as_tensor(r, dtype=torch.long)
        starts_part.append(not (share_prompts and i > 0 and p is prompts[i - 1]))
        if starts_part[-1]:
            pieces.append(p.input_ids)
            types.append(token_types(p, image_token_id))
            part_prompts.append(p)
            vision.append(p)
            group_sizes.append(0)
        pieces.append(r)
        types.append(answer_types(len(r), turns[i]))  # the model writes text: images come only in tool turns
        vision += turns[i]
        group_sizes[-1] += 1
        response_ids[i, : len(r)] = r
        response_mask[i, : len(r)] = 1
        mask_tool_turns(response_mask[i], turns[i])
    input_ids = torch.cat(pieces)[None]  # (1, L)
    inputs = {
        "input_ids": input_ids,
        "mm_token_type_ids": torch.cat(types)[None],  # (1, L)
        "prompt_lens": torch.tensor([len(p.input_ids) for p in part_prompts]),  # (G,)
        "group_sizes": torch.tensor(group_sizes),  # (G,)
        "response_lens": torch.tensor([len(r) for r in responses]),  # (B,)
    }
    if routes is not None and routes_shape(routes) is not None:
        inputs["routes"] = packed_routes(routes, [len(p.input_ids) for p in prompts],
                                                [len(r) for r in responses], starts_part)  # fmt: skip
    return {**inputs, **stacked_images(vision)}, response_ids, response_mask


def stack_padded(rows, t_len, device):
    """Per-sequence 1-D tensors as one (B, T) tensor, zero past each one's end."""
    out = torch.zeros(len(rows), t_len, device=device)  # (B, T)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row.to(device)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Routing replay's routes (replay.py) laid out as the tokens are.


def _part(routes, start: int, stop: int, shape, dtype) -> torch.Tensor:
    """Rows [start, stop) of a sample's routes, NO_ROUTE where it has none (or no record at all)."""
    have = None if routes is None else routes[start:stop].to(dtype)
    if have is not None and len(have) == stop - start:
        return have  # (a view: the caller's cat or copy is the only copy)
    out = torch.full((stop - start, *shape), NO_ROUTE, dtype=dtype)
    if have is not None:
        out[: len(have)] = have
    return out


def routes_shape(routes) -> tuple | None:
    """(layers, k) of the first record, or None when no sample has one (nothing to replay)."""
    return next((tuple(r.shape[1:]) for r in routes if r is not None), None)


def _dtype(routes) -> torch.dtype:
    """The records' integer type (int8 or int16, route_dtype), kept in the micro-batch: it goes to the device."""
    return next(r.dtype for r in routes if r is not None)


def padded_routes(routes, prompt_lens, response_lens, p_len: int, t_len: int) -> torch.Tensor:
    """batching.collate's layout: (B * (p_len + t_len), layers, k), each row's prompt right-aligned at p_len and its
    answer after it, NO_ROUTE on the pads."""
    shape, dtype = routes_shape(routes), _dtype(routes)
    out = torch.full((len(routes), p_len + t_len, *shape), NO_ROUTE, dtype=dtype)
    for i, (r, p, n) in enumerate(zip(routes, prompt_lens, response_lens)):
        out[i, p_len - p : p_len + n] = _part(r, 0, p + n, shape, dtype)
    return out.flatten(0, 1)


def packed_routes(routes, prompt_lens, response_lens, starts_part) -> torch.Tensor:
    """batching.pack's layout: (L, layers, k), the sequences back to back; a sample that starts a part brings its
    prompt's routes, the others of a shared-prefix part only their answers' (the prompt is in the row once)."""
    shape, dtype = routes_shape(routes), _dtype(routes)
    pieces = []
    for r, p, n, first in zip(routes, prompt_lens, response_lens, starts_part):
        pieces.append(_part(r, 0 if first else p, p + n, shape, dtype))
    return torch.cat(pieces)
