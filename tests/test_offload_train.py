"""End to end on 2 CPU ranks with vLLM: actor.offload_params / offload_optimizer and actor.master_dtype=bf16 in the
training loop (offload.py, optim.py). Offload on CPU copies the state to fresh host tensors and back, the GPU's code
path minus pinning."""

import shutil

import pytest

from tests.launch import torchrun
from tests.test_checkpoint import DETERMINISTIC_KEYS, FILTER, PARTIAL, PARTIAL_KEYS, metrics, run_args
from tests.test_vllm import first_and_last, toy_run

OFFLOAD = ["actor.offload_params=true", "actor.offload_optimizer=true"]
BF16_OFFLOAD = ["actor.master_dtype=bf16", *OFFLOAD]
# Partial rollouts ride along (partial.py), with the two ranks as one TP 2 engine group (they pool their requests):
# at most 36 answers decode together, so the step's quota of complete groups is met while some answers wait or are
# cut (36 is no multiple of the 8 answers of a group), and answers are in flight at the step-17 checkpoint. Dynamic
# sampling too: its filter drops the groups that score nothing (early on) or nearly full marks (at the end), and
# those steps take a second round
PARTIAL_TP = [*PARTIAL, "rollout.max_num_seqs=36", *FILTER]


@pytest.fixture(scope="module")
def bf16_offload_run(tiny_model_dir, tmp_path_factory):
    """20 toy-reward steps with bf16 masters and everything offloaded, and partial rollouts on one TP 2 engine,
    validating at steps 0, 10 and 20 (the engine wakes there too), checkpoints at steps 17 and 20: (tmp dir, metrics
    rows of the training steps)."""
    tmp = tmp_path_factory.mktemp("bf16_offload")
    args = [*BF16_OFFLOAD, *PARTIAL_TP, "rollout.tensor_parallel_size=2", "trainer.val_freq=10",
            "trainer.save_freq=17", "trainer.export_hf=false"]  # fmt: skip
    return tmp, args, toy_run(tiny_model_dir, tmp, *args)


def test_bf16_masters_with_offload_learn_the_toy_reward(bf16_offload_run):
    """Guards against bf16 master weights that stop learning (updates lost to bf16 rounding: lr 3e-3 AdamW steps are
    far below one bf16 step of many weights), an offload that breaks the loop and partial rollouts that do (stale
    answers mistrained, groups trained incomplete or, with dynamic sampling, thrown away, a continued answer whose
    prompt vLLM saw otherwise, which raises):
    the same criterion as the fp32 run of test_vllm.py, the engine still sampling the trainer's policy, answers
    carried over and cut ones continued, and the transfers timed every step."""
    _, _, rows = bf16_offload_run
    first, last = first_and_last(rows)
    print(f"bf16 masters, offload, partial rollouts: toy reward first 5 steps {first:.3f}, last 5 {last:.3f}")
    assert last >= first + 0.2, (first, last)
    assert all(r["rollout/logprob_diff_mean"] <= 0.05 for r in rows)
    assert all(r["rollout/partial_carried"] > 0 and r["rollout/off_policy_share"] > 0 for r in rows[1:])
    assert any(r["rollout/partial_continued"] > 0 for r in rows)  # answers cut mid-way, continued from their tokens
    assert all(r["rollout/staleness_max"] <= 4 and r["rollout/partial_dropped"] == 0 for r in rows)
    # every group the rounds return trains or is filtered out (16 prompts a step), and some steps filter
    assert all(r["rollout/prompts_drawn"] == 16 + r["rollout/filtered_groups"] for r in rows)
    assert any(r["rollout/filter_rounds"] > 1 for r in rows)
    assert all(r["time/offload"] > 0 and r["time/onload"] > 0 for r in rows)


def test_resume_with_bf16_masters_and_offload_is_exact(tiny_model_dir, bf16_offload_run):
    """Guards against state that offload or bf16 masters keep outside the checkpoint: the bf16 moments saved while in
    host memory, the stochastic rounding's random stream, a resumed run whose moments come back elsewhere. Steps
    18-20 rerun from the step-17 checkpoint must equal the uninterrupted run's bitwise."""
    tmp, args, rows = bf16_offload_run
    run = tmp / "run"
    shutil.rmtree(run / "checkpoints" / "step_20")
    resumed = toy_run(tiny_model_dir, tmp, *args)
    assert resumed[:17] == rows[:17]  # kept as logged, timings included: steps 1-17 were not run again
    keys = DETERMINISTIC_KEYS + PARTIAL_KEYS  # the answers in flight at step 17 came back as they were
    for got, want in zip(resumed[17:], rows[17:], strict=True):
        assert {k: got[k] for k in keys} == {k: want[k] for k in keys}, got["step"]


def test_offload_leaves_three_demo_steps_bitwise_unchanged(tiny_model_dir, tmp_path):
    """Guards against an offload round trip that changes anything the run computes (a parameter or moment back in
    another dtype or from a stale copy, the reference left behind, FSDP2 gathering an old shard): 3 steps with the
    policy, reference and AdamW moments offloaded at every rollout give exactly the metrics of 3 steps without."""
    from scripts.make_synthetic_data import make_geo3k_like

    data = make_geo3k_like(str(tmp_path / "train.parquet"), n_rows=16, seed=0)
    runs = {}
    for name, extra in (("plain", []), ("offload", OFFLOAD)):
        out = tmp_path / name
        torchrun(2, *run_args(tiny_model_dir, data, out, "trainer.max_steps=3", *extra, engine="vllm"))
        runs[name] = metrics(out)
    assert len(runs["plain"]) == 3
    for got, want in zip(runs["offload"], runs["plain"], strict=True):
        assert {k: got[k] for k in DETERMINISTIC_KEYS} == {k: want[k] for k in DETERMINISTIC_KEYS}, got["step"]
        assert got["time/offload"] > 0 and "time/offload" not in want
