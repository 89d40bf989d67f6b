"""The step's statistics: each recorded in one line where it is computed, reduced over ranks as that line says."""

import pytest
import torch.multiprocessing as mp

from grpo.stats import StepStats
from tests.launch import spawn_ranks


def _two_ranks(rank, out):
    stats = StepStats()
    for _ in range(2):  # two optimizer steps of two micro-batches each
        for mb in range(2):
            stats.share("actor/pg_loss", 0.25 * (rank + 1) + mb)
            stats.count("actor/micro_batches", per_rank=True)
        stats.last("actor/grad_norm", 1.5 + rank)
        stats.count("actor/optimizer_steps", per_rank=True)
    stats.count("rollout/my_count", rank + 1)  # a count: 1 on rank 0, 2 on rank 1
    if rank == 1:  # a term only one rank computed (a branch the other did not take) still reaches the metrics
        stats.share("actor/only_rank_1", 3.0)
        stats.count("rollout/only_rank_1")
    stats["mismatch/tokens"] += 7  # a raw running sum: starts at 0, is no metric
    out[rank] = stats.metrics(stats["actor/optimizer_steps"])


def test_statistics_reduce_as_recorded_over_two_ranks():
    """Guards against a statistic that must be declared apart from where it is computed (forgotten: a KeyError, or
    a metric silently missing from metrics.jsonl), against shares averaged instead of summed over ranks, and against
    a count that logs rank 0's figure as the step's (1 and 2 logged as 1)."""
    out = mp.Manager().dict()
    spawn_ranks(_two_ranks, out)
    for rank in (0, 1):
        m = out[rank]
        # shares: summed over micro-batches and ranks, averaged over the 2 optimizer steps
        assert m["actor/pg_loss"] == pytest.approx((2 * (0.25 + 0 + 0.25 + 1) + 2 * (0.5 + 0 + 0.5 + 1)) / 2)
        assert m["actor/only_rank_1"] == pytest.approx(3.0 / 2)
        assert m["actor/micro_batches"] == 4 and m["actor/optimizer_steps"] == 2  # counted alike: one rank's
        assert m["rollout/my_count"] == 3 and m["rollout/only_rank_1"] == 1  # the step's totals over both ranks
        assert m["actor/grad_norm"] == 1.5 + rank  # the latest value
        assert "mismatch/tokens" not in m


def test_a_statistic_keeps_one_reduction():
    """Guards against two call sites recording one key with different reductions (the metric would mean neither)."""
    stats = StepStats()
    stats.share("actor/kl", 0.1)
    with pytest.raises(ValueError, match="actor/kl"):
        stats.count("actor/kl")
    assert stats["never/recorded"] == 0.0 and "never/recorded" not in stats


def test_a_statistic_no_reduction_takes_is_an_error():
    """Guards against a statistic silently dropped: a raw running sum that no module took out (turns.step_metrics
    takes tool/*, partial.step_metrics rollout/partial_*) names itself when the step's metrics are made."""
    stats = StepStats()
    stats["rollout/my_raw_sum"] += 1
    with pytest.raises(ValueError, match="rollout/my_raw_sum"):
        stats.metrics()
