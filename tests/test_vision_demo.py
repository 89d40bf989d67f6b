"""The vision demo (configs/tiny_vision.yaml, `make demo-vision`): a task only the image answers must be learnt."""

import json

from tests.launch import torchrun

COLOURS = 4  # scripts/make_synthetic_data.py COLOURS: a model blind to the image is right 1 time in 4 at best


def test_vision_demo_learns_what_only_the_image_says(tiny_model_dir, tmp_path):
    """Guards against a pipeline that hands a prompt the wrong images, or none (packing, shared prefixes, rank
    balancing, group splitting, shuffling, the vLLM request, the weight sync of the tower): every prompt's text is
    the same and the answer is the picture's colour, so reward above 1/4 needs the right image. One run of the
    demo's config (2 ranks, vLLM, shared prefixes, token-budget micro-batches, rank balancing), shared by the
    assertions: last-5-step training accuracy and greedy validation accuracy clearly above the blind ceiling."""
    from scripts.make_synthetic_data import COLOURS as colours
    from scripts.make_synthetic_data import make_colour_task

    assert len(colours) == COLOURS
    assert_demo_learns("configs/tiny_vision.yaml", make_colour_task, 60, 1 / COLOURS, tiny_model_dir, tmp_path)


def assert_demo_learns(config, make_task, steps, ceiling, model_dir, tmp_path, timeout=400):
    """Run a demo config on 2 ranks with make_task's train (128 rows) and validation (32) sets, and assert what its
    test promises: every step ran, the random model starts blind (first-5-step accuracy below ceiling + 0.1), the
    last 5 steps and the final greedy validation are at least 0.2 above the ceiling, and the token budget splits
    each rank's share into micro-batches. Returns the training steps' metrics rows."""
    train = make_task(str(tmp_path / "train.parquet"), n_rows=128, seed=0)
    val = make_task(str(tmp_path / "val.parquet"), n_rows=32, seed=1)
    out_dir = tmp_path / "run"
    torchrun(
        2, "train_grpo.py", config, f"actor.model_path={model_dir}",
        f"data.train_files={train}", f"data.val_files={val}", f"trainer.output_dir={out_dir}", timeout=timeout,
    )  # fmt: skip
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in train_rows] == list(range(1, steps + 1))
    first = sum(r["reward/accuracy"] for r in train_rows[:5]) / 5
    last = sum(r["reward/accuracy"] for r in train_rows[-5:]) / 5
    print(f"{config}: accuracy first 5 steps {first:.3f} -> last 5 {last:.3f}, val {train_rows[-1]['val/accuracy']}")
    assert first < ceiling + 0.1, first  # the random model starts blind
    assert last >= ceiling + 0.2, (first, last)
    assert train_rows[-1]["val/accuracy"] >= ceiling + 0.2, train_rows[-1]["val/accuracy"]
    assert all(r["actor/micro_batches"] >= 2 for r in train_rows)  # the token budget splits each rank's share
    return train_rows


def test_colour_task_hides_the_answer_from_the_text(tmp_path):
    """Guards against a demo a blind model could solve: every row's text must be the same, the answers balanced
    over the colours, and the reward must score the first digit only (naming every colour earns nothing)."""
    import pyarrow.parquet as pq

    from reward import first_digit
    from scripts.make_synthetic_data import make_colour_task

    rows = pq.read_table(make_colour_task(str(tmp_path / "t.parquet"), n_rows=40, seed=0)).to_pylist()
    assert len({r["problem"] for r in rows}) == 1
    assert sorted({r["answer"] for r in rows}) == ["1", "2", "3", "4"]
    assert all(sum(r["answer"] == a for r in rows) == 10 for a in "1234")
    assert first_digit("It is 3, not 1", "3")["accuracy"] == 1.0
    assert first_digit("1 2 3 4", "3")["accuracy"] == 0.0 and first_digit("blue", "3")["overall"] == 0.0
