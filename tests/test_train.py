"""The training step and the whole loop, under torchrun on CPU (gloo) with the tiny Qwen2.5-VL."""

import json
import os

import pytest
import torch

from tests.launch import torchrun


def _update(tiny_model_dir, tmp_path, world, micro, mode):
    out = tmp_path / f"w{world}_m{micro}_{mode}.pt"
    torchrun(world, "tests/dist_update_check.py", tiny_model_dir, str(out), str(micro), mode)
    return torch.load(out)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_update_is_identical_over_ranks_and_micro_batches(tiny_model_dir, tmp_path, mode):
    """Guards against per-micro-batch or per-rank averaging (and FSDP's gradient average) biasing the update: one
    rank with the whole batch in one micro-batch must match two ranks with one sequence per micro-batch."""
    from safetensors.torch import load_file

    full = _update(tiny_model_dir, tmp_path, world=1, micro=8, mode=mode)
    split = _update(tiny_model_dir, tmp_path, world=2, micro=1, mode=mode)
    assert sorted(full["state"]) == sorted(split["state"])
    for name, value in full["state"].items():
        torch.testing.assert_close(split["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    initial = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    # the step really moved the weights, including the root-level ones FSDP2 keeps outside the layer units
    assert (full["state"]["lm_head.weight"] - initial["lm_head.weight"]).abs().max() > 1e-4


def test_end_to_end_two_ranks_learns_toy_reward(tiny_model_dir, tmp_path):
    """Guards against a loop that runs but does not learn: 2 ranks, HF rollout, FSDP2 over gloo, validation and the
    final export; the reward must rise, every loss be finite and every weight change."""
    from safetensors.torch import load_file

    from scripts.make_synthetic_data import make_geo3k_like

    train = make_geo3k_like(str(tmp_path / "train.parquet"), n_rows=96, seed=0)
    val = make_geo3k_like(str(tmp_path / "val.parquet"), n_rows=8, seed=1)
    out_dir = tmp_path / "run"
    stdout = torchrun(
        2, "train_grpo.py", "configs/tiny.yaml", "rollout.engine=hf", f"actor.model_path={tiny_model_dir}",
        f"data.train_files={train}", f"data.val_files={val}", f"trainer.output_dir={out_dir}", "trainer.max_steps=20",
        "trainer.val_freq=10", "actor.lr=3e-3",
    )  # fmt: skip
    assert "step 20/20" in stdout
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in train_rows] == list(range(1, 21))
    required = ["epoch", "reward/overall", "reward/accuracy", "reward/format", "actor/pg_loss", "actor/kl",
                "actor/entropy", "actor/clip_frac", "actor/grad_norm", "response_length/mean",
                "response_length/clip_ratio", "time/rollout", "time/train", "time/step",
                "perf/tokens_per_s_per_device"]  # fmt: skip
    for r in train_rows:
        missing = [k for k in required if k not in r]
        assert not missing, missing
        assert all(torch.isfinite(torch.tensor(r[k])) for k in required)
    assert "val/accuracy" in rows[0] and "val/accuracy" in train_rows[9] and "val/accuracy" in train_rows[19]
    first = sum(r["reward/overall"] for r in train_rows[:5]) / 5
    last = sum(r["reward/overall"] for r in train_rows[-5:]) / 5
    assert last > first + 0.1, (first, last)
    assert json.loads((out_dir / "config.json").read_text())["trainer"]["max_steps"] == 20

    final = load_file(str(out_dir / "hf" / "model.safetensors"))
    initial = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    assert sorted(final) == sorted(initial)  # the export keeps the checkpoint's own naming
    unchanged = [k for k in initial if torch.equal(final[k], initial[k])]
    assert not unchanged, unchanged
