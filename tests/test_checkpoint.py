"""Checkpoints: exact resume, saves killed midway, save_limit, epoch boundaries, stop signals, Hugging Face export.

The runs are 2 ranks under torchrun on CPU with the tiny Qwen2.5-VL: 16 synthetic prompts and 4 prompts per step make
4 steps per epoch, so a 6-step run crosses an epoch boundary after step 4.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from grpo import checkpoint
from tests.launch import REPO, torchrun

# The metrics a resumed run must reproduce exactly. Every one of them is a function of the weights, optimizer state,
# LR schedule, data position and sampling seeds, computed on CPU with the same ops in the same order, so they are
# bitwise equal unless some state was lost. Timings and throughput (time/*, perf/*) are not deterministic.
DETERMINISTIC_KEYS = [
    "epoch", "reward/overall", "reward/accuracy", "reward/format", "actor/pg_loss", "actor/kl", "actor/entropy",
    "actor/clip_frac", "actor/grad_norm", "actor/lr", "actor/skipped_steps", "response_length/mean",
    "response_length/max", "response_length/clip_ratio", "reward/timeouts", "reward/errors", "reward/zero_std_groups",
]  # fmt: skip


# Partial rollouts with the correction they need, and the metrics of what they carry from step to step, which a
# resumed run must reproduce as exactly
PARTIAL = ["rollout.partial=true", "algorithm.rollout_is=token"]
# Dynamic sampling whose filter drops the tiny model's groups that score nothing (and those at nearly full marks)
FILTER = ["algorithm.online_filtering=true", "algorithm.filter_key=overall", "algorithm.filter_low=0.001"]
PARTIAL_KEYS = ["rollout/partial_carried", "rollout/partial_dropped", "rollout/partial_generated",
                "rollout/partial_in_flight", "rollout/partial_continued", "rollout/staleness_mean",
                "rollout/staleness_max", "rollout/off_policy_share"]  # fmt: skip


# LoRA on: the same runs must resume as exactly from checkpoints that hold only the adapters and their
# optimizer state
LORA = ["actor.lora_rank=8", "actor.lora_alpha=16", "actor.lr=1e-2"]


def run_args(model_dir, data, out_dir, *overrides, engine="hf"):
    # warmup over 8 optimizer steps makes the LR change every step, so a schedule that is not restored shows up
    return [
        "train_grpo.py", "configs/tiny.yaml", f"rollout.engine={engine}", f"actor.model_path={model_dir}",
        f"data.train_files={data}", "data.val_files=", "data.rollout_batch_size=4", "rollout.n=4",
        "actor.global_batch_size=4", "actor.micro_batch_size=8", "actor.micro_batch_size_no_grad=8",
        "actor.lr_warmup_steps=8", f"trainer.output_dir={out_dir}", *overrides,
    ]  # fmt: skip


def metrics(out_dir):
    return [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]


def checkpoints(out_dir):
    return sorted(os.listdir(os.path.join(out_dir, "checkpoints")))


def checkpoint_keys(path):
    """The names of the tensors a checkpoint holds (torch.distributed.checkpoint's metadata)."""
    import torch.distributed.checkpoint as dcp

    return list(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def _uninterrupted(tiny_model_dir, tmp_path_factory, *extra):
    from scripts.make_synthetic_data import make_geo3k_like

    tmp = tmp_path_factory.mktemp("ckpt")
    data = make_geo3k_like(str(tmp / "train.parquet"), n_rows=16, seed=0)
    out = tmp / "uninterrupted"
    overrides = ["trainer.max_steps=6", "trainer.save_freq=2", "trainer.save_limit=2", *extra]
    torchrun(2, *run_args(tiny_model_dir, data, out, *overrides))
    return data, str(out)


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    """6 uninterrupted steps, a checkpoint every 2, keeping 2: the reference the other runs are compared with."""
    return _uninterrupted(tiny_model_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def uninterrupted_lora(tiny_model_dir, tmp_path_factory):
    """The same with LoRA adapters."""
    return _uninterrupted(tiny_model_dir, tmp_path_factory, *LORA)


def reference_run(request, lora):
    return request.getfixturevalue("uninterrupted_lora" if lora else "uninterrupted"), LORA if lora else []


def test_save_limit_keeps_the_newest_n(uninterrupted):
    """Guards against pruning that keeps too many checkpoints, too few, or the wrong ones."""
    _, out = uninterrupted
    assert checkpoints(out) == ["step_4", "step_6"]


def test_prune_never_deletes_the_checkpoint_just_written(tmp_path):
    """Guards against a save into a directory holding newer checkpoints (resume=PATH/none) deleting itself."""
    root = tmp_path / "checkpoints"
    for name in ["step_2", "step_8", "step_10", "step_4", ".tmp-step_3"]:
        (root / name).mkdir(parents=True)
        if not name.startswith(".tmp"):
            (root / name / ".metadata").touch()
            (root / name / "trainer_state.json").touch()
    checkpoint.prune_checkpoints(str(root), limit=2, keep=str(root / "step_4"))
    assert sorted(os.listdir(root)) == ["step_10", "step_4"]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_resume_after_a_killed_save_matches_uninterrupted_run(tiny_model_dir, tmp_path, request, lora):
    """Guards against any state (weights, optimizer, LR schedule, data position, RNG, metrics file) not surviving a
    stop, and against auto-resume loading a save that was killed before it completed. With LoRA: against a
    checkpoint that drops the adapters' optimizer state, or holds the frozen base besides them."""
    (data, reference), lora_args = reference_run(request, lora)
    out = tmp_path / "stopped"
    torchrun(2, *run_args(tiny_model_dir, data, out, "trainer.max_steps=5", "trainer.save_freq=3", *lora_args))
    # A kill during the save of step 5 leaves its temp directory with some shards and no trainer state. The run had
    # also logged steps 4 and 5, past the last complete checkpoint (step 3).
    root = out / "checkpoints"
    os.rename(root / "step_5", root / ".tmp-step_5")
    os.remove(root / ".tmp-step_5" / "trainer_state.json")
    os.remove(root / ".tmp-step_5" / "__1_0.distcp")

    stdout = torchrun(2, *run_args(tiny_model_dir, data, out, "trainer.max_steps=6", "trainer.save_freq=3", *lora_args))
    assert "skipping incomplete checkpoint" in stdout and ".tmp-step_5" in stdout
    assert f"resumed from {root / 'step_3'}" in stdout and "step 3, epoch 0, index 6" in stdout
    resumed, expected = metrics(out), metrics(reference)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]  # the stale lines of steps 4-5 were replaced
    for got, want in zip(resumed, expected):
        assert {k: got[k] for k in DETERMINISTIC_KEYS} == {k: want[k] for k in DETERMINISTIC_KEYS}, got["step"]
    assert checkpoints(out) == ["step_3", "step_6"]  # the killed save's leftovers are gone
    keys = checkpoint_keys(root / "step_6")
    adapters = [k for k in keys if ".lora_A." in k or ".lora_B." in k]
    if lora:  # the adapters, their AdamW moments, nothing of the frozen base
        assert {k for k in keys if k.startswith(("model.", "optim.state."))} == set(adapters)
        assert any(k.startswith("optim.state.") and k.endswith("exp_avg_sq") for k in adapters)
    else:
        assert not adapters and "model.lm_head.weight" in keys


def test_resume_exactly_at_an_epoch_boundary(tiny_model_dir, uninterrupted, tmp_path):
    """Guards against a resume after an epoch's last step skipping an epoch, repeating one, or stopping early."""
    data, reference = uninterrupted
    checkpoint = os.path.join(reference, "checkpoints", "step_4")  # after step 4 of 4 in epoch 0
    out = tmp_path / "from_step_4"
    stdout = torchrun(2, *run_args(tiny_model_dir, data, out, "trainer.max_steps=6", f"trainer.resume={checkpoint}"))
    assert "step 4, epoch 0, index 8" in stdout
    resumed, expected = metrics(out), metrics(reference)[4:]
    assert [r["step"] for r in resumed] == [5, 6] and [r["epoch"] for r in resumed] == [1, 1]
    for got, want in zip(resumed, expected):
        assert {k: got[k] for k in DETERMINISTIC_KEYS} == {k: want[k] for k in DETERMINISTIC_KEYS}, got["step"]


def test_resume_from_a_checkpoint_of_the_format_before(tiny_model_dir, uninterrupted, tmp_path):
    """Guards against checkpoints written before rank files held only tensors failing to load (their rank_R.pt holds
    numpy's RNG state as an array, which weights_only=True refuses), or resuming other than the uninterrupted run.
    (test_checkpoint_safety.py checks each random stream of such a file.)"""
    import shutil

    import numpy as np

    data, reference = uninterrupted
    old = tmp_path / "step_4"
    shutil.copytree(os.path.join(reference, "checkpoints", "step_4"), old)
    for rank in (0, 1):  # rewritten exactly as the save of the format before wrote them
        new = torch.load(old / f"rank_{rank}.pt", weights_only=True)
        torch.save({
            "python_rng": (new["python_rng_version"], tuple(new["python_rng"].tolist()), new["python_gauss"]),
            "numpy_rng": ("MT19937", new["numpy_rng"].numpy().astype(np.uint32), new["numpy_rng_pos"],
                          *new["numpy_gauss"]),
            "torch_rng": new["torch_rng"], "cuda_rng": new["cuda_rng"], "reward_counters": new["reward_counters"],
        }, old / f"rank_{rank}.pt")  # fmt: skip
    out = tmp_path / "from_old_format"
    stdout = torchrun(2, *run_args(tiny_model_dir, data, out, "trainer.max_steps=6", f"trainer.resume={old}"))
    assert f"resumed from {old}" in stdout
    resumed, expected = metrics(out), metrics(reference)[4:]
    assert [r["step"] for r in resumed] == [5, 6]
    for got, want in zip(resumed, expected):
        assert {k: got[k] for k in DETERMINISTIC_KEYS} == {k: want[k] for k in DETERMINISTIC_KEYS}, got["step"]


def test_partial_rollouts_with_dynamic_sampling_resume_exactly(tiny_family_dir, tmp_path):
    """Guards against a resume that loses what partial rollouts and dynamic sampling leave between steps: the answers
    in flight, and each rank's own data position (a round takes only the groups its rank still lacks, so the ranks
    draw different numbers of prompts); and, on an MoE replaying the engine's routes (algorithm.routing_replay=r3),
    against carried answers whose routes a resume would not reproduce (they are recorded when an answer completes,
    by a re-prefill under that step's weights). 2 ranks with vLLM, a filter that drops some groups; steps 3-4 rerun
    from the step-2 checkpoint must equal the uninterrupted run's."""
    from scripts.make_synthetic_data import make_geo3k_like

    data = make_geo3k_like(str(tmp_path / "train.parquet"), n_rows=32, seed=0)
    out = tmp_path / "run"
    args = run_args(tiny_family_dir("qwen3_vl_moe"), data, out, "trainer.max_steps=4", "trainer.save_freq=2",
                    *PARTIAL, *FILTER, "algorithm.routing_replay=r3", engine="vllm")  # fmt: skip
    torchrun(2, *args)
    rows = metrics(out)
    # a group filtered out before the checkpoint: the rank that lacked it took more in the next round, and from there
    # the ranks' positions in the data differ
    assert any(r["rollout/filtered_groups"] > 0 for r in rows[:2])
    # every group the rounds return trains or is filtered out (4 prompts a step): complete groups past a round's
    # quota wait in flight
    assert all(r["rollout/prompts_drawn"] == 4 + r["rollout/filtered_groups"] for r in rows)
    shutil.rmtree(out / "checkpoints" / "step_4")
    stdout = torchrun(2, *args)
    assert f"resumed from {out / 'checkpoints' / 'step_2'}" in stdout
    keys = DETERMINISTIC_KEYS + PARTIAL_KEYS + ["rollout/prompts_drawn", "rollout/filtered_groups"]
    keys += ["moe/routing_disagreement", "moe/replayed_tokens", "moe/own_routed_tokens"]
    assert all(r["moe/replayed_tokens"] > 0 for r in rows) and any(r["rollout/partial_carried"] > 0 for r in rows)
    resumed = metrics(out)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for got, want in zip(resumed[2:], rows[2:], strict=True):
        assert {k: got[k] for k in keys} == {k: want[k] for k in keys}, got["step"]


def test_sigterm_finishes_the_step_saves_and_exits(tiny_model_dir, tmp_path):
    """Guards against a stop signal killing the run mid-step, losing the steps since the last save, or ranks
    disagreeing on the step to stop at (a hang); and against the rerun of a preempted job (Slurm's requeue) starting
    a new wandb run instead of continuing the stopped one (wandb: a stand-in with wandb.init's signature)."""
    from scripts.make_synthetic_data import make_geo3k_like
    from tests.test_logging import wandb_records

    data = make_geo3k_like(str(tmp_path / "train.parquet"), n_rows=16, seed=0)
    out = tmp_path / "signalled"
    # default reward settings: the grading worker processes must survive the signal torchrun sends the rank's group
    logger = "trainer.logger=[console,jsonl,wandb]"
    args = run_args(tiny_model_dir, data, out, "trainer.max_steps=50", "trainer.save_freq=100", logger)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    standin = os.path.join(REPO, "tests", "wandb_standin")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([standin, REPO])}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 2/"):
            proc.send_signal(signal.SIGTERM)  # to torchrun, which forwards it to every rank, as on Ctrl-C or scancel
    proc.wait(timeout=120)
    stdout = "".join(lines)
    stopped = [line for line in lines if line.startswith("stopped by SIGTERM after step")]
    assert stopped and "saved its checkpoint" in stopped[0] and "exit code 143" in stopped[0], stdout[-3000:]
    assert proc.returncode != 0
    step = int(stopped[0].split()[5].rstrip(":"))  # "stopped by SIGTERM after step 3: ..."
    assert 2 <= step < 50
    assert checkpoints(out) == [f"step_{step}"]
    assert checkpoint.is_complete_checkpoint(str(out / "checkpoints" / f"step_{step}"))
    assert [r["step"] for r in metrics(out)] == list(range(1, step + 1))

    # the rerun (a requeued job runs the same command) resumes, and logs its step to the same wandb run
    args[args.index("trainer.max_steps=50")] = f"trainer.max_steps={step + 1}"
    rerun = subprocess.run(cmd[:5] + args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0 and f"resumed from {out / 'checkpoints' / f'step_{step}'}" in rerun.stdout, (
        rerun.stdout[-2000:] + rerun.stderr[-3000:])  # fmt: skip
    records = wandb_records(out)
    inits = [r for r in records if r["call"] == "init"]
    assert len(inits) == 2 and inits[0]["id"] == inits[1]["id"] and inits[1]["resume"] == "allow"
    assert [r["step"] for r in records if r["call"] == "log"] == list(range(1, step + 2))
    assert [r["step"] for r in metrics(out)] == list(range(1, step + 2))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_export_equals_final_model_and_loads_with_transformers(tiny_model_dir, tmp_path, request, lora):
    """Guards against an export that renames weights, misses the processor or chat template, or exports weights other
    than the checkpoint's: exporting the last checkpoint must give the files training wrote to <output_dir>/hf. With
    LoRA: against an export with adapter names in it or the adapters not merged, and an <output_dir>/adapter that
    PEFT cannot load or that differs from the merged model."""
    from safetensors.torch import load_file
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    from grpo.checkpoint import export_checkpoint

    (_, reference), _ = reference_run(request, lora)
    out = export_checkpoint(os.path.join(reference, "checkpoints", "step_6"), str(tmp_path / "hf"))
    final = os.path.join(reference, "hf")
    assert sorted(os.listdir(out)) == sorted(os.listdir(final))
    for name in os.listdir(final):
        with open(os.path.join(out, name), "rb") as a, open(os.path.join(final, name), "rb") as b:
            assert a.read() == b.read(), name
    exported = load_file(os.path.join(out, "model.safetensors"))
    initial = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    assert sorted(exported) == sorted(initial)  # the original checkpoint's naming
    trained = "model.layers.0.self_attn.q_proj.weight" if lora else "lm_head.weight"  # (default LoRA targets)
    assert not torch.equal(exported[trained], initial[trained])  # trained weights, not the base's
    if lora:  # the frozen rest is the base's, and PEFT merges the adapter directory into the same model
        from peft import PeftModel

        assert torch.equal(exported["lm_head.weight"], initial["lm_head.weight"])
        base = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_model_dir)
        merged = PeftModel.from_pretrained(base, os.path.join(reference, "adapter")).merge_and_unload().state_dict()
        mine = Qwen2_5_VLForConditionalGeneration.from_pretrained(out).state_dict()
        assert sorted(merged) == sorted(mine)
        for key in mine:
            torch.testing.assert_close(merged[key], mine[key], rtol=0, atol=1e-6, msg=key)

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(out)
    processor = AutoProcessor.from_pretrained(out)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Find x."}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[prompt], return_tensors="pt")
    generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 4


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_export_loads_with_vllm(tmp_path, request, lora):
    """Guards against an export vLLM cannot load as is (with LoRA: adapter names in it), or loads with different
    weights than transformers."""
    pytest.importorskip("vllm")
    from transformers import Qwen2_5_VLForConditionalGeneration

    from grpo.checkpoint import export_checkpoint

    (_, reference), _ = reference_run(request, lora)
    out = export_checkpoint(os.path.join(reference, "checkpoints", "step_6"), str(tmp_path / "hf"))
    result_path = tmp_path / "vllm.json"
    proc = subprocess.run(
        [sys.executable, "tests/export_vllm_check.py", out, str(result_path)], cwd=REPO, capture_output=True,
        text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "2"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(result_path.read_text())
    assert len(result["text_tokens"]) == 8 and len(result["image_tokens"]) == 8

    # transformers scores vLLM's tokens with the same weights: the log-probs must agree (fp32, text only)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(out)
    ids = torch.tensor([result["prompt_ids"] + result["text_tokens"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(result["prompt_ids"]) - 1 : -1]  # (8, V)
    logp = logits.log_softmax(-1).gather(-1, torch.tensor(result["text_tokens"])[:, None])[:, 0]  # (8,)
    torch.testing.assert_close(logp, torch.tensor(result["text_logprobs"]), rtol=0, atol=1e-4)


# ----------------------------------------------------------------------------------------------------------------------
# Fault drills: a full disk, a rank killed in a save, a rank killed in a step, each a real launch that fails, then the
# same command again. Chained on one output directory, so that 4 short launches cover the 3 drills and end with the
# whole run equal to the uninterrupted one.

DRILL_BOUND_S = 90  # from the fault to torchrun's exit: no rank may wait for a dead one


def launch(args, fault="", kill_rank_after=None):
    """torchrun of tests/fault_drill.py with FAULT_DRILL=fault; with kill_rank_after=(line start, rank), that rank is
    sent SIGKILL as soon as the line appears. Returns (exit code, output, seconds from the fault to the exit)."""
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1", "FAULT_DRILL": fault}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "tests/fault_drill.py", *args[1:]]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, faulted = [], None
    for line in proc.stdout:
        lines.append(line)
        if fault and faulted is None and ("Traceback" in line or "error:" in line):
            faulted = time.monotonic()  # (roughly: the first sign of it in the output)
        if kill_rank_after and faulted is None and line.startswith(kill_rank_after[0]):
            os.kill(rank_pid(proc.pid, kill_rank_after[1]), signal.SIGKILL)
            faulted = time.monotonic()
    proc.wait(timeout=300)
    return proc.returncode, "".join(lines), time.monotonic() - (faulted or time.monotonic())


def rank_pid(torchrun_pid, rank):
    """The pid of torchrun's worker with RANK=rank (its children are the ranks)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if ppid == torchrun_pid and f"RANK={rank}".encode() in env:
            return int(pid)
    raise AssertionError(f"no rank {rank} under torchrun {torchrun_pid}")


def test_fault_drills_full_disk_killed_save_killed_step(tiny_model_dir, uninterrupted, tmp_path):
    """Guards against a save that fails on one rank hanging the others or damaging the last complete checkpoint,
    against a partial checkpoint of a killed rank being taken for a whole one or left behind, against ranks waiting
    forever for a killed one, and against a rerun after any of these not resuming exactly."""
    data, reference = uninterrupted
    out = tmp_path / "drills"
    root = out / "checkpoints"
    args = run_args(tiny_model_dir, data, out, "trainer.max_steps=6", "trainer.save_freq=2", "trainer.save_limit=2")

    # 1. Rank 1's disk fills up in the save of step 4: one clear error, step_2 untouched, the partial save removed.
    code, output, seconds = launch(args, fault="disk_full:4:1")
    assert code != 0 and seconds < DRILL_BOUND_S, output[-3000:]
    assert "error: saving the checkpoint of step 4" in output and "(no space left on device)" in output, output[-3000:]
    assert f"the last complete checkpoint, {root / 'step_2'}, is intact" in output
    assert checkpoints(out) == ["step_2"]

    # 2. The same command resumes from step_2; rank 1 is killed in the save of step 4 after writing its shards.
    code, output, seconds = launch(args, fault="kill_in_save:4:1")
    assert f"resumed from {root / 'step_2'}" in output, output[-3000:]
    assert code != 0 and seconds < DRILL_BOUND_S, output[-3000:]
    assert checkpoints(out) == [".tmp-step_4", "step_2"]
    assert not checkpoint.is_complete_checkpoint(str(root / ".tmp-step_4"))
    assert "__1_0.distcp" in os.listdir(root / ".tmp-step_4")  # a real partial save: the shards were written

    # 3. Again: the partial save is skipped, and said so; rank 1 is killed in step 6, after step 4 was saved.
    code, output, seconds = launch(args, kill_rank_after=("step 5/", 1))
    assert "skipping incomplete checkpoint" in output and ".tmp-step_4" in output, output[-3000:]
    assert f"resumed from {root / 'step_2'}" in output
    assert code != 0 and seconds < DRILL_BOUND_S, output[-3000:]
    assert checkpoints(out) == ["step_2", "step_4"]  # the partial directory is gone

    # 4. Again, with no fault: it resumes from step_4 and the run's metrics are the uninterrupted run's.
    code, output, _ = launch(args)
    assert code == 0, output[-3000:]
    assert f"resumed from {root / 'step_4'}" in output
    resumed, expected = metrics(out), metrics(reference)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    for got, want in zip(resumed, expected):
        assert {k: got[k] for k in DETERMINISTIC_KEYS} == {k: want[k] for k in DETERMINISTIC_KEYS}, got["step"]
    assert checkpoints(out) == ["step_4", "step_6"]
