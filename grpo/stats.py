"""A step's statistics, each recorded in one line where it is computed, saying there how it reduces over
micro-batches and ranks. Nothing is declared elsewhere: a new loss term's statistic is one `stats.share(...)` line,
and it reaches metrics.jsonl.

    stats.share("actor/kl", kl_term.item())        # this rank's share of the step's mean over all ranks' tokens
    stats.count("actor/micro_batches")             # counted on this rank, over the whole step
    stats.last("actor/grad_norm", grad_norm.item())  # the latest value (every rank's is the same)

Raw running sums that a module reduces itself (grpo/mismatch.py's) use the object as a dict: a key starts at 0."""

from __future__ import annotations

import torch
import torch.distributed as dist

SHARE, COUNT, LAST = "share", "count", "last"


class StepStats(dict):
    def __init__(self):
        super().__init__()
        self.kinds: dict[str, str] = {}  # key -> how it reduces (SHARE, COUNT, LAST); raw sums have none
        self.copies = 1  # ranks that record the same shares (a sequence-parallel group's): counted once

    def __missing__(self, key):  # a running sum starts at 0 (read without being stored)
        return 0.0

    def _record(self, key: str, kind: str, value: float, add: bool):
        if self.kinds.setdefault(key, kind) != kind:
            raise ValueError(f"statistic {key!r} recorded as {kind} and as {self.kinds[key]}")
        self[key] = self[key] + float(value) if add else float(value)

    def share(self, key: str, value: float):
        """A term of a mean over all the optimizer step's tokens on all ranks (aggregate_loss's exact shares): summed
        over micro-batches and ranks, then averaged over the step's optimizer steps."""
        self._record(key, SHARE, value, add=True)

    def count(self, key: str, value: float = 1.0):
        """Counted on this rank over the whole step (micro-batches, moved sequences, skipped optimizer steps)."""
        self._record(key, COUNT, value, add=True)

    def last(self, key: str, value: float):
        """The latest value: a figure every rank computes the same (the clipped gradient's norm)."""
        self._record(key, LAST, value, add=False)

    def metrics(self, optimizer_steps: float) -> dict[str, float]:
        """The recorded statistics as the step's metrics. Collective: every rank calls it (an all_gather of the
        shared keys, so a key one rank never recorded counts 0 there, then one all_reduce)."""
        mine = sorted(k for k, kind in self.kinds.items() if kind == SHARE)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        shared = sorted(set().union(*every))
        totals = torch.tensor([self.get(k, 0.0) for k in shared], dtype=torch.float64)  # (K,)
        dist.all_reduce(totals)
        out = {k: v / max(optimizer_steps, 1.0) / self.copies for k, v in zip(shared, totals.tolist())}
        out.update({k: self[k] for k, kind in self.kinds.items() if kind != SHARE})
        return out
