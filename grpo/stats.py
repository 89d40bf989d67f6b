"""A step's statistics, each recorded in one line where it is computed, saying there how it reduces over
micro-batches and ranks. Nothing is declared elsewhere: a new statistic is one line, in the update (StepStats) or in
the rollout (collect_rollouts keeps one StepStats of its own), and it reaches metrics.jsonl.

    stats.share("actor/kl", kl_term.item())        # this rank's share of the step's mean over all ranks' tokens
    stats.count("rollout/prompts_drawn", len(batch))  # summed over the step and over ranks: the step's total
    stats.count("actor/micro_batches", per_rank=True)  # every rank counts the same: logged once, not summed
    stats.last("actor/grad_norm", grad_norm.item())  # the latest value (every rank's is the same)

Raw running sums that a module reduces itself use the object as a dict: a key starts at 0. The module takes them
out before metrics() (turns.step_metrics takes tool/*, partial.step_metrics rollout/partial_*), or they are
grpo/mismatch.py's (mismatch/*, read by mismatch.step_metrics). Any other raw key makes metrics() raise: a statistic
that no reduction takes is an error at the first step, not a metric silently missing."""

from __future__ import annotations

import torch
import torch.distributed as dist

SHARE, COUNT, RANK_COUNT, LAST = "share", "count", "rank_count", "last"
MODULE_SUMS = ("mismatch/",)  # raw running sums their module reduces (mismatch.step_metrics), no metrics of their own


class StepStats(dict):
    def __init__(self):
        super().__init__()
        self.kinds: dict[str, str] = {}  # key -> how it reduces (SHARE, COUNT, RANK_COUNT, LAST); raw sums have none
        self.copies = 1  # ranks that record the same statistics (a sequence-parallel group's): counted once

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

    def count(self, key: str, value: float = 1.0, per_rank: bool = False):
        """Counted over the whole step (micro-batches, rounds) and summed over ranks: the step's total (prompts drawn,
        groups dropped, timeouts). per_rank=True: a count every rank makes alike (the micro-batches and optimizer
        steps the collectives keep in step), logged as one rank's."""
        self._record(key, RANK_COUNT if per_rank else COUNT, value, add=True)

    def last(self, key: str, value: float):
        """The latest value: a figure every rank computes the same (the clipped gradient's norm)."""
        self._record(key, LAST, value, add=False)

    def metrics(self, optimizer_steps: float = 1.0) -> dict[str, float]:
        """The recorded statistics as the step's metrics. Collective: every rank calls it (an all_gather of the keys
        summed over ranks, so a key one rank never recorded counts 0 there, then one all_reduce). Raises ValueError
        for a raw key no module took (see the module's docstring)."""
        raw = sorted(k for k in self if k not in self.kinds and not k.startswith(MODULE_SUMS))
        if raw:
            raise ValueError(f"statistics {raw} have no reduction: record them with stats.share, stats.count or "
                             "stats.last (grpo/stats.py), or reduce them in their module")  # fmt: skip
        mine = sorted((k, kind) for k, kind in self.kinds.items() if kind in (SHARE, COUNT))
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        summed = dict(sorted(set().union(*every)))  # key -> its kind, as whichever ranks recorded it
        totals = torch.tensor([self.get(k, 0.0) for k in summed], dtype=torch.float64)  # (K,)
        dist.all_reduce(totals)
        steps = max(optimizer_steps, 1.0)
        out = {k: v / self.copies / (steps if summed[k] == SHARE else 1.0) for k, v in zip(summed, totals.tolist())}
        out.update({k: self[k] for k, kind in self.kinds.items() if kind in (RANK_COUNT, LAST)})
        return out
