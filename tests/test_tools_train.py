"""The trainer with tools end to end (configs/tiny_tools.yaml under torchrun: 2 ranks, vLLM, shared prefixes,
token-budget micro-batches, rank balancing, partial rollouts), two steps."""

import json

from tests.launch import torchrun


def test_tool_rollouts_train_and_engine_matches_trainer(tiny_tools_model_dir, tmp_path):
    """Guards against the pieces of a tool run failing together where each alone passes: the turn loop inside the
    step (tool counts summed over ranks into the metrics), interleaved answers through the shared-prefix packing,
    the token budgets and the ranks' rebalancing (tool turns pickled with their images), and the engine's and the
    trainer's log-probs of the model's tokens disagreeing once tool turns and their pictures sit between them (vLLM
    continued from its own ids with the tool's image; the trainer sees the image in the tool turn). With partial
    rollouts on, as the pieces meet there too: answers pause at their calls and go on after their turns in a second
    engine call of the step, and the groups finished beyond the quota wait, tool turns and all, for step 2."""
    from scripts.make_synthetic_data import make_tool_task

    train = make_tool_task(str(tmp_path / "train.parquet"), n_rows=32, seed=0)
    out_dir = tmp_path / "run"
    torchrun(
        2, "train_grpo.py", "configs/tiny_tools.yaml", f"actor.model_path={tiny_tools_model_dir}",
        f"data.train_files={train}", "data.val_files=", f"trainer.output_dir={out_dir}", "trainer.max_steps=2",
        "trainer.val_before_train=false", "trainer.export_hf=false", "rollout.partial=true",
        "algorithm.rollout_is=token", timeout=600,
    )  # fmt: skip
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in train_rows] == [1, 2]
    first = train_rows[0]
    assert first["tool/call_share"] > 0.5 and first["tool/calls"] >= 0.5 * 16 * 8, first  # the model calls at first
    assert train_rows[1]["rollout/partial_carried"] > 0  # answers of step 1, tool turns and all, trained at step 2
    for r in train_rows:
        assert r["tool/error"] == r["tool/timeout"] == 0, r
        assert 0 < r["tool/call_share"] <= 1, r["tool/call_share"]  # of the trained answers, not of all in flight
        assert r["rollout/logprob_diff_max"] <= 1e-4, r["rollout/logprob_diff_max"]  # fp32 engine and trainer
        assert r["actor/micro_batches"] >= 2
