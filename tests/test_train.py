"""The training step and the whole loop, under torchrun on CPU (gloo) with the tiny Qwen2.5-VL."""

import json
import os
import time

import pytest
import torch

from tests.launch import torchrun

# dist_update_check's results by their launch's arguments and the environment it reads: several tests compare with the
# same one-rank step, and a launch's start costs far more than its step
_DONE = {}


def _updates(tiny_model_dir, tmp_path, world, micro, mode, *override_sets):
    """dist_update_check's step under each set of overrides; those not run yet in one launch."""
    env = tuple(os.environ.get(k, "") for k in ("EXTRA_EMPTY_MICRO_BATCH", "NO_VISION_DUMMY", "TEXT_ONLY", "VIDEO"))
    keys = [(tiny_model_dir, world, micro, mode, tuple(overrides), env) for overrides in override_sets]
    todo = list(dict.fromkeys(k for k in keys if k not in _DONE))
    if todo:
        out = tmp_path / f"w{world}_m{micro}_{mode}_{len(_DONE)}.pt"
        args = [a for i, k in enumerate(todo) for a in ([] if i == 0 else ["--then"]) + list(k[4])]
        torchrun(world, "tests/dist_update_check.py", tiny_model_dir, str(out), str(micro), mode, *args)
        for i, k in enumerate(todo):
            _DONE[k] = torch.load(out if i == 0 else out.with_name(f"{out.stem}.{i}.pt"))
    return [_DONE[k] for k in keys]


def _update(tiny_model_dir, tmp_path, world, micro, mode, *overrides):
    return _updates(tiny_model_dir, tmp_path, world, micro, mode, overrides)[0]


def _assert_same_weights(a, b):
    assert sorted(a["state"]) == sorted(b["state"])
    for name, value in a["state"].items():
        torch.testing.assert_close(b["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_update_is_identical_over_ranks_and_micro_batches(tiny_model_dir, tmp_path, mode):
    """Guards against per-micro-batch or per-rank averaging (and FSDP's gradient average) biasing the update, and
    against the packed layout changing it: one rank with the whole batch in one PADDED micro-batch must match two
    ranks with one PACKED sequence per micro-batch."""
    from safetensors.torch import load_file

    full = _update(tiny_model_dir, tmp_path, 1, 8, mode, "actor.padding_free=false")
    split = _update(tiny_model_dir, tmp_path, 2, 1, mode)
    _assert_same_weights(full, split)
    initial = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    # the step really moved the weights, including the root-level ones FSDP2 keeps outside the layer units
    assert (full["state"]["lm_head.weight"] - initial["lm_head.weight"]).abs().max() > 1e-4


def test_token_budget_micro_batches_keep_the_update_and_agree_over_ranks(tiny_model_dir, tmp_path):
    """Guards against token-budget micro-batches (several packed sequences each) changing the token-mean update, and
    against ranks running different numbers of micro-batches: without rebalancing, rank 0's 4 short sequences fit a
    160-token budget in 2 micro-batches and rank 1's longer ones need 4; unequal counts would deadlock FSDP2 (the
    launch times out). With rebalancing (the default) sequences move from rank 1 to rank 0, and the update must
    still be the same: a sequence lost, doubled, or moved without its advantage or reference log-probs changes it."""
    full = _update(tiny_model_dir, tmp_path, 1, 8, "token-mean", "actor.padding_free=false")
    budget = ["actor.max_tokens_per_micro_batch=160", "actor.shared_prefix=false"]
    fixed, balanced = _updates(
        tiny_model_dir, tmp_path, 2, 1, "token-mean", [*budget, "actor.balance_ranks=false"], budget
    )
    assert fixed["micro_batches"] == [4.0, 4.0] and fixed["stats"]["actor/moved_sequences"] == 0
    _assert_same_weights(full, fixed)
    assert balanced["stats"]["actor/moved_sequences"] >= 1
    assert balanced["micro_batches"][0] == balanced["micro_batches"][1]
    _assert_same_weights(full, balanced)


def test_shared_prefix_keeps_the_update_over_ranks(tiny_model_dir, tmp_path):
    """Guards against the shared-prefix layout (the default) changing the update: a group's prompt once per
    micro-batch part, groups split over micro-batches by the budget, answers moved to the other rank without
    their siblings -- the weights must equal one rank's padded step, in fewer micro-batches than unshared."""
    full = _update(tiny_model_dir, tmp_path, 1, 8, "token-mean", "actor.padding_free=false")
    budget = "actor.max_tokens_per_micro_batch=160"
    sets = [[budget, "actor.shared_prefix=false"]] + [[budget, f"actor.balance_ranks={b}"] for b in ("false", "true")]
    unshared, *shared_runs = _updates(tiny_model_dir, tmp_path, 2, 1, "token-mean", *sets)
    for shared in shared_runs:
        assert shared["micro_batches"][0] == shared["micro_batches"][1]
        assert sum(shared["micro_batches"]) < sum(unshared["micro_batches"])
        _assert_same_weights(full, shared)


@pytest.mark.parametrize("case", ["image", "video", "qwen3_5", "qwen3_vl"])
def test_sequence_parallel_keeps_the_step(tiny_model_dir, tiny_family_dir, tmp_path, case):
    """Guards against sequence parallelism changing the step: 2 ranks as one group (each sequence cut in two,
    Ulysses attention, the vision tower split by temporal patch) must give the weights, loss, KL, entropy, gradient
    norm and trainer/engine gap of 2 data-parallel ranks -- with shared prefixes and a token budget (counted per
    group), on the image prompts (also with a distillation teacher, whose rows are cut like the policy's) and on the
    video demo's clips (one a prompt), and on both for Qwen3.5 (its linear-attention layers run the whole row) and
    Qwen3-VL (its deepstack inputs cut with their tokens). A token
    counted on both ranks of the group, a gradient lost in an all-to-all, an image's embedding sent back without its
    gradient or a clip cut inside a temporal patch changes them. And each image or clip is encoded once per group,
    both ranks encoding a part: the group's tower passes together see each forward's patches exactly once, each
    rank some and not all (a clip alone in its micro-batch is cut between the ranks)."""
    from scripts.make_tiny_model import build_tiny_model

    model = tiny_family_dir(case) if case.startswith("qwen") else tiny_model_dir
    plain = ["actor.max_tokens_per_micro_batch=160", "actor.balance_ranks=true"]  # (test_shared_prefix's launch)
    clips = ["VIDEO=0,1,2,3"]  # (dist_update_check: the step's prompts are the video demo's)
    media = {"image": [[]], "video": [clips]}.get(case, [[], clips])
    if case == "image":  # and with a distillation teacher (the tiny model with its digits raised), cut like the policy
        media.append([f"distill.model_path={build_tiny_model(str(tmp_path / 'teacher'), seed=0, digit_logit=5.0)}"])
    sets = [s for m in media for s in ([*plain, *m], [*plain, *m, "actor.sequence_parallel_size=2"])]
    runs = _updates(model, tmp_path, 2, 1, "token-mean", *sets)
    for plain_run, split in zip(runs[::2], runs[1::2]):
        _assert_same_weights(plain_run, split)
        keys = ["actor/pg_loss", "actor/kl", "actor/entropy", "actor/grad_norm", "rollout/logprob_diff_mean"]
        if "distill/reverse_kl" in plain_run["metrics"]:
            keys += ["distill/reverse_kl", "distill/advantage"]
            assert abs(plain_run["metrics"]["distill/reverse_kl"]) > 1e-2  # (a teacher other than the policy)
            taught = [p["teacher"] for p in split["vision_patches"]]  # its group's images shared as the policy's
            assert taught[0]["inputs"] == taught[1]["inputs"] == sum(p["real"] for p in taught)
            assert all(0 < p["real"] < p["inputs"] for p in taught)
        for key in keys:
            assert split["metrics"][key] == pytest.approx(plain_run["metrics"][key], rel=1e-5), key
        # the group's two ranks run the same micro-batches, and each its own share of their images or clips
        inputs = [p["inputs"] for p in split["vision_patches"]]
        assert inputs[0] == inputs[1] > 0
        assert sum(p["real"] for p in split["vision_patches"]) == inputs[0]
        assert all(0 < p["real"] < inputs[0] for p in split["vision_patches"])
        assert all(p["passes"] == p["forwards"] for p in split["vision_patches"])  # one tower pass per forward
        for p in plain_run["vision_patches"]:  # data-parallel: each rank encodes what it holds
            assert p["real"] == p["inputs"]


def test_surplus_micro_batch_adds_nothing(tiny_model_dir, tmp_path, monkeypatch):
    """Guards against the filler micro-batch of a rank short of sequences (it re-runs one only to keep FSDP2's
    collectives in step) adding its loss or gradient a second time."""
    budget = "actor.max_tokens_per_micro_batch=160"
    plain = _update(tiny_model_dir, tmp_path, 1, 1, "seq-mean-token-mean", budget)
    monkeypatch.setenv("EXTRA_EMPTY_MICRO_BATCH", "1")
    (tmp_path / "x").mkdir()
    padded = _update(tiny_model_dir, tmp_path / "x", 1, 1, "seq-mean-token-mean", budget)
    assert padded["micro_batches"] == [plain["micro_batches"][0] + 1]
    _assert_same_weights(plain, padded)
    for key in ("actor/pg_loss", "actor/kl", "actor/entropy", "actor/clip_frac"):
        assert padded["stats"][key] == pytest.approx(plain["stats"][key], rel=1e-5), key


# The demo's toy reward as a user would write it: a float (TRL's kind), asking for the row's question and images by
# keyword. If they do not arrive, the assert fails on every answer and the run stops at step 1.
FLOAT_REWARD = """
def digits(response, ground_truth, question, images):
    assert "<image>" in question and images[0]["bytes"], "the row's question and images reach the reward"
    chars = [c for c in response if not c.isspace()]
    return sum(c in "0123456789" for c in chars) / len(chars) if chars else 0.0
"""


def test_end_to_end_two_ranks_learns_toy_reward(tiny_model_dir, tmp_path):
    """Guards against a loop that runs but does not learn: 2 ranks, HF rollout, FSDP2 over gloo, validation and the
    final export; the reward must rise, every loss be finite and every weight change. The reward returns a float and
    takes the row's columns by keyword (a float once scored 0 on every answer, silently, to the end of the run).
    With gradient checkpointing, which the tiny configs leave off and the recipes turn on."""
    from safetensors.torch import load_file

    from scripts.make_synthetic_data import make_geo3k_like

    train = make_geo3k_like(str(tmp_path / "train.parquet"), n_rows=96, seed=0)
    val = make_geo3k_like(str(tmp_path / "val.parquet"), n_rows=8, seed=1)
    (tmp_path / "float_reward.py").write_text(FLOAT_REWARD)
    out_dir = tmp_path / "run"
    stdout = torchrun(
        2, "train_grpo.py", "configs/tiny.yaml", "rollout.engine=hf", f"actor.model_path={tiny_model_dir}",
        f"data.train_files={train}", f"data.val_files={val}", f"trainer.output_dir={out_dir}", "trainer.max_steps=20",
        "trainer.val_freq=10", "actor.lr=3e-3", f"reward.reward_fn={tmp_path / 'float_reward.py'}:digits",
        "actor.gradient_checkpointing=true", real=True,  # torchrun itself: the launch users make, end to end
    )  # fmt: skip
    assert "step 20/20" in stdout
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in train_rows] == list(range(1, 21))
    required = ["epoch", "reward/overall", "reward/accuracy", "reward/format", "actor/pg_loss", "actor/kl",
                "actor/entropy", "actor/clip_frac", "actor/grad_norm", "response_length/mean",
                "response_length/clip_ratio", "time/rollout", "time/train", "time/step",
                "perf/tokens_per_s_per_device", "reward/timeouts_step"]  # fmt: skip
    for r in train_rows:
        missing = [k for k in required if k not in r]
        assert not missing, missing
        assert all(torch.isfinite(torch.tensor(r[k])) for k in required)
    assert "val/accuracy" in rows[0] and "val/accuracy" in train_rows[9] and "val/accuracy" in train_rows[19]
    assert all(r["reward/timeouts_step"] == 0 for r in train_rows)  # the toy reward never hangs
    # the share of the step's 16 groups (8 a rank) whose rewards are all equal: whole groups over both ranks
    shares = [r["reward/zero_std_groups"] for r in train_rows]
    assert all(0 <= share <= 1 and (share * 16).is_integer() for share in shares), shares
    assert all(r["reward/errors"] == 0 for r in train_rows) and "failed to grade" not in stdout
    first = sum(r["reward/overall"] for r in train_rows[:5]) / 5
    last = sum(r["reward/overall"] for r in train_rows[-5:]) / 5
    print(f"HF engine: toy reward first 5 steps {first:.3f}, last 5 {last:.3f}")
    assert last > first + 0.1, (first, last)
    assert json.loads((out_dir / "config.json").read_text())["trainer"]["max_steps"] == 20

    final = load_file(str(out_dir / "hf" / "model.safetensors"))
    initial = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    assert sorted(final) == sorted(initial)  # the export keeps the checkpoint's own naming
    unchanged = [k for k in initial if torch.equal(final[k], initial[k])]
    assert not unchanged, unchanged


@pytest.mark.parametrize(
    "text_only, overrides",
    [
        ("2,3", ["actor.micro_batch_size=1"]),  # rank 1's whole share text-only; packed, shared prefixes
        ("1,3", ["actor.padding_free=false"]),  # half the rows text-only, padded
        ("1,3", ["actor.max_tokens_per_micro_batch=160", "actor.shared_prefix=false"]),  # budget, rebalanced
    ],
)
def test_mixed_text_and_image_batches_neither_hang_nor_change_the_update(
    tiny_model_dir, tmp_path, monkeypatch, text_only, overrides
):
    """Guards against the vision-tower deadlock of mixed batches (EasyR1 #468): a rank whose micro-batch has no image
    never all-gathers the tower's FSDP2 shards while a rank with images does, and gloo aborts with a collective
    mismatch (NCCL hangs); the launch is bounded, so a hang fails too. And against the dummy tower pass that fixes it
    leaking into the result: the 2-rank update must equal one rank's step over the same sequences with NO dummy."""
    monkeypatch.setenv("TEXT_ONLY", text_only)
    monkeypatch.setenv("NO_VISION_DUMMY", "1")
    full = _update(tiny_model_dir, tmp_path, 1, 8, "token-mean", "actor.padding_free=false")
    monkeypatch.delenv("NO_VISION_DUMMY")
    t0 = time.perf_counter()
    split = _update(tiny_model_dir, tmp_path, 2, 1, "token-mean", *overrides)
    assert time.perf_counter() - t0 < 120
    assert split["micro_batches"][0] == split["micro_batches"][1] >= 2
    _assert_same_weights(full, split)
