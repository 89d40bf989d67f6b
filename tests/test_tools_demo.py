"""The tool demo (configs/tiny_tools.yaml, `make demo-tools`): a task only a tool's picture answers must be learnt,
and learnt by calling the tool."""

import json

from tests.launch import torchrun

COLOURS = 4  # a model that answers without the tool's picture is right 1 time in 4 at best


def test_tool_demo_learns_to_call_for_the_picture(tiny_tools_model_dir, tmp_path):
    """Guards against a tool loop whose images never reach the model (the engine's continuation, the trainer's tool
    turns: accuracy would stay at the blind 1/4), tool turns trained on as the model's own tokens, faults that crash a
    step, and a loop that runs under torchrun with vLLM, shared prefixes, token budgets and rank balancing but does not
    learn: the share of answers that call the tool and the accuracy both rise, the accuracy well above the ceiling of
    answering without the tool."""
    from scripts.make_synthetic_data import make_tool_task

    train = make_tool_task(str(tmp_path / "train.parquet"), n_rows=128, seed=0)
    val = make_tool_task(str(tmp_path / "val.parquet"), n_rows=32, seed=1)
    out_dir = tmp_path / "run"
    torchrun(
        2, "train_grpo.py", "configs/tiny_tools.yaml", f"actor.model_path={tiny_tools_model_dir}",
        f"data.train_files={train}", f"data.val_files={val}", f"trainer.output_dir={out_dir}", timeout=1200,
    )  # fmt: skip
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["step"] > 0]
    mean = lambda key, part: sum(r[key] for r in part) / len(part)  # noqa: E731
    first, last = train_rows[:5], train_rows[-5:]
    print(f"tool demo: accuracy {mean('reward/accuracy', first):.3f} -> {mean('reward/accuracy', last):.3f}, "
          f"call share {mean('tool/call_share', first):.3f} -> {mean('tool/call_share', last):.3f}, "
          f"val {train_rows[-1]['val/accuracy']}")  # fmt: skip
    assert mean("reward/accuracy", first) < 1 / COLOURS, first  # the start is blind
    assert mean("reward/accuracy", last) >= 1 / COLOURS + 0.2
    assert train_rows[-1]["val/accuracy"] >= 1 / COLOURS + 0.2
    assert mean("tool/call_share", last) >= 0.8  # it answers by calling the tool
    assert all(r["tool/error"] == r["tool/timeout"] == 0 for r in train_rows)
