"""Operating a run: the logging backends, the plot script, the startup banner and the errors stated at start."""

import importlib.util
import json
import os
import subprocess
import sys
import time
import types

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from grpo.logger import MetricsLogger, format_duration
from grpo.startup import version_mismatch
from tests.launch import torchrun
from train_grpo import ConfigError, check_config, load_config, main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = {1: {"reward/overall": 0.25, "actor/kl": 1e-3, "time/step": 2.0}, 2: {"reward/overall": 0.5, "actor/kl": 2e-3}}


def tensorboard_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_jsonl_console_and_tensorboard_write_what_was_logged(tmp_path, capsys):
    """Guards against a backend that drops metrics or files them under the wrong step."""
    logger = MetricsLogger(str(tmp_path), 2, ["console", "jsonl", "tensorboard"], enabled=True)
    for step, metrics in STEPS.items():
        logger.log(step, metrics)
    logger.close()

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": s, **m} for s, m in STEPS.items()]
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert [s for s, _ in scalars["reward/overall"]] == [1, 2]
    assert [v for _, v in scalars["reward/overall"]] == pytest.approx([0.25, 0.5])
    assert [v for _, v in scalars["actor/kl"]] == pytest.approx([1e-3, 2e-3])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step 1/2 | reward 0.250 | kl 1.0e-03") and "eta 2s" in lines[0]
    assert lines[1].startswith("step 2/2 | reward 0.500") and lines[1].endswith("eta 0s")


def test_other_ranks_write_nothing(tmp_path, capsys):
    """Guards against ranks other than 0 clobbering rank 0's files or repeating its console lines."""
    logger = MetricsLogger(str(tmp_path), 2, ["console", "jsonl", "tensorboard"], enabled=False)
    logger.add_val_samples([{"response": "x"}])
    logger.log(1, STEPS[1])
    logger.close()
    assert os.listdir(tmp_path) == [] and capsys.readouterr().out == ""


def test_eta_is_remaining_steps_times_mean_step_time(monkeypatch, capsys):
    """Guards against an ETA that counts the steps done instead of those left, or only the last step's time."""
    clock = iter([100.0, 110.0, 130.0])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    logger = MetricsLogger(".", 10, ["console"], enabled=False)
    assert logger.eta(1, {"time/step": 10.0}) == pytest.approx(9 * 10.0)  # the first step: its own time
    assert logger.eta(2, {}) == pytest.approx(8 * 10.0)
    assert logger.eta(3, {}) == pytest.approx(7 * (10 + 10 + 20) / 3)
    assert format_duration(7 * 40 / 3) == "1m33s" and format_duration(3725) == "1h02m"


def test_resume_drops_rerun_steps_everywhere(tmp_path):
    """Guards against a resumed run leaving two values for a rerun step in metrics, samples or TensorBoard."""
    logger = MetricsLogger(str(tmp_path), 3, ["jsonl", "tensorboard"], enabled=True)
    for step in (1, 2, 3):
        logger.add_val_samples([{"response": f"old {step}"}])
        logger.log(step, {"reward/overall": float(step)})
    logger.close()

    resumed = MetricsLogger(str(tmp_path), 3, ["jsonl", "tensorboard"], enabled=True)
    resumed.drop_steps_after(1)  # the checkpoint was taken after step 1
    for step in (2, 3):
        resumed.add_val_samples([{"response": f"new {step}"}])
        resumed.log(step, {"reward/overall": 10.0 * step})
    resumed.close()

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward/overall"]) for r in rows] == [(1, 1.0), (2, 20.0), (3, 30.0)]
    samples = [json.loads(line) for line in (tmp_path / "val_samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["response"]) for s in samples] == [(1, "old 1"), (2, "new 2"), (3, "new 3")]
    assert tensorboard_scalars(tmp_path / "tensorboard")["reward/overall"] == [(1, 1.0), (2, 20.0), (3, 30.0)]


def test_wandb_gets_every_metric_with_its_step(tmp_path, monkeypatch):
    """Guards against wandb steps that drift from metrics.jsonl (wandb's own counter) or a run never finished."""
    calls = []
    fake_run = types.SimpleNamespace(log=lambda m, step: calls.append(("log", step, m)),
                                     finish=lambda: calls.append(("finish",)))  # fmt: skip
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or fake_run)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = load_config(None, [f"trainer.output_dir={tmp_path}", "trainer.wandb_project=proj"])
    logger = MetricsLogger(str(tmp_path), 2, ["wandb"], enabled=True, cfg=cfg)
    for step, metrics in STEPS.items():
        logger.log(step, metrics)
    logger.close()
    init = calls[0][1]
    assert init["project"] == "proj" and init["dir"] == str(tmp_path) and init["config"]["trainer"]["max_steps"] == 0
    assert calls[1:] == [("log", 1, STEPS[1]), ("log", 2, STEPS[2]), ("finish",)]


def wandb_standin():
    """tests/wandb_standin: wandb.init's exact signature, recording to <dir>/wandb-standin.jsonl."""
    spec = importlib.util.spec_from_file_location("wandb", os.path.join(REPO, "tests/wandb_standin/wandb/__init__.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wandb_records(output_dir):
    return [json.loads(line) for line in open(os.path.join(output_dir, "wandb-standin.jsonl"))]


def test_a_resumed_run_continues_its_wandb_run(tmp_path, monkeypatch):
    """Guards against a resumed run (a requeued Slurm job) starting a new wandb run, which splits the curves at every
    preemption, and against a fresh start in an old output_dir continuing the old run."""
    monkeypatch.setitem(sys.modules, "wandb", wandb_standin())
    cfg = load_config(None, [f"trainer.output_dir={tmp_path}"])

    def launch(resumed_at, steps):
        logger = MetricsLogger(str(tmp_path), 4, ["wandb"], enabled=True, cfg=cfg)
        logger.drop_steps_after(resumed_at)  # -1: no checkpoint to resume
        for step in steps:
            logger.log(step, {"reward/overall": step / 10})
        logger.close()

    launch(-1, [1, 2, 3])  # stopped after step 3, its checkpoint at step 2
    launch(2, [3, 4])  # resumed: step 3 again, then 4
    launch(-1, [1])  # a fresh start into the same output_dir
    records = wandb_records(tmp_path)
    inits = [r for r in records if r["call"] == "init"]
    first, fresh = inits[0]["id"], inits[2]["id"]
    assert inits[1]["id"] == first != fresh and {r["resume"] for r in inits} == {"allow"}
    logged = [(r["id"], r["step"]) for r in records if r["call"] == "log"]
    assert logged == [(first, 1), (first, 2), (first, 3), (first, 4), (fresh, 1)]
    assert (tmp_path / "wandb_id").read_text().strip() == fresh


def test_wandb_logger_without_wandb_fails_at_config_check(monkeypatch):
    """Guards against a run that loads models for minutes and then dies on `import wandb`."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else real_find_spec(name))
    cfg = load_config(None, ["trainer.logger=[console,jsonl,wandb]"])
    with pytest.raises(ConfigError, match=r"wandb is not installed: pip install wandb \(WANDB_MODE=offline"):
        check_config(cfg, world_size=8)
    with pytest.raises(ConfigError, match="unknown.*'mlflow'.*valid: console, jsonl, tensorboard, wandb"):
        check_config(load_config(None, ["trainer.logger=[mlflow]"]), world_size=8)


def test_version_mismatch_names_installed_and_supported_sets():
    """Guards against a silent run on an untested torch/transformers/vLLM combination (or a false alarm)."""
    fits = {"torch": "2.14.0+cu128", "transformers": "5.19.0", "vllm": "0.33.0", "flash-attn": "2.8.3"}
    assert version_mismatch(fits) is None
    assert version_mismatch({**fits, "vllm": "not installed"}) is None  # rollout.engine=hf needs no vLLM
    warning = version_mismatch({**fits, "transformers": "5.21.0"})
    assert "torch 2.14.0+cu128, transformers 5.21.0, vllm 0.33.0" in warning
    assert "GPU: torch 2.14.0, transformers 5.19.0, vllm 0.33.0" in warning
    assert "torch 2.11: torch 2.11.0, transformers 5.17.0, vllm 0.26.0" in warning
    torch_2_11 = {"torch": "2.11.0+cu130", "transformers": "5.17.0", "vllm": "0.26.0", "flash-attn": "not installed"}
    assert version_mismatch(torch_2_11) is None  # a torch 2.11 node image with vLLM 0.26
    assert version_mismatch({**torch_2_11, "vllm": "0.33.0"}) is not None  # vLLM 0.33 never ran on torch 2.11


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("actor.model_path=/nonexistent/model", "actor.model_path='/nonexistent/model' does not exist"),
        ("actor.model_path=nobody-here/no-such-model", "not in the hub cache"),  # HF_HUB_OFFLINE=1 in the tests
        ("data.train_files=/nonexistent/train.parquet", "data.train_files: data path '/nonexistent/train.parquet'"),
        ("data.val_files={empty}", "data.val_files: no .parquet/.jsonl/.json files in directory '{empty}'"),
    ],
)
def test_missing_model_or_data_fails_at_once_naming_the_key(override, message, tiny_model_dir, tmp_path, capsys):
    """Guards against a typo in a path surfacing as a stack trace from deep inside the model or data loader."""
    from scripts.make_synthetic_data import make_geo3k_like

    empty = tmp_path / "empty"
    empty.mkdir()
    override, message = override.format(empty=empty), message.format(empty=empty)
    # every other path valid (a fresh checkout has no outputs/), so the one error is the override's;
    # the output_dir keeps a run that wrongly got past the checks out of the repository's outputs/
    data = make_geo3k_like(str(tmp_path / "data.parquet"), n_rows=2, seed=0)
    valid = [f"actor.model_path={tiny_model_dir}", f"data.train_files={data}", f"data.val_files={data}"]
    assert main(["configs/tiny.yaml", "rollout.engine=hf", f"trainer.output_dir={tmp_path}", *valid, override]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


# ---------------------------------------------------------------------------------------------------------------------
# A real 2-step run (1 rank, HF rollout) with TensorBoard on and validation every step, shared by the tests below.


@pytest.fixture(scope="module")
def real_run(tiny_model_dir, tmp_path_factory):
    from scripts.make_synthetic_data import make_geo3k_like

    tmp = tmp_path_factory.mktemp("logged_run")
    train = make_geo3k_like(str(tmp / "train.parquet"), n_rows=16, seed=0)
    val = make_geo3k_like(str(tmp / "val.parquet"), n_rows=4, seed=1)
    out_dir = tmp / "run"
    stdout = torchrun(
        1, "train_grpo.py", "configs/tiny.yaml", "rollout.engine=hf", f"actor.model_path={tiny_model_dir}",
        f"data.train_files={train}", f"data.val_files={val}", f"trainer.output_dir={out_dir}", "trainer.max_steps=2",
        "trainer.val_freq=1", "trainer.logger=[console,jsonl,tensorboard]", "trainer.val_samples=2",
        "data.rollout_batch_size=4", "actor.global_batch_size=4", "actor.micro_batch_size=8", "rollout.n=4",
        timeout=300,
    )  # fmt: skip
    return out_dir, stdout


def test_plot_script_writes_pngs_from_a_real_run(real_run):
    """Guards against a plot script that breaks on the keys a real run writes (or writes empty files)."""
    out_dir, _ = real_run
    proc = subprocess.run([sys.executable, "scripts/plot_metrics.py", str(out_dir)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    names = sorted(os.listdir(out_dir / "plots"))
    expected = ["accuracy", "entropy", "grad_norm", "kl", "overview", "response_length", "reward", "throughput"]
    assert names == [f"{n}.png" for n in expected]
    for name in names:
        data = (out_dir / "plots" / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000, name


def test_real_run_logs_banner_samples_and_events(real_run):
    """Guards against a log that cannot reproduce its run, samples that lose their step or source, and TensorBoard
    values that differ from metrics.jsonl."""
    import torch

    out_dir, stdout = real_run
    info = json.loads((out_dir / "run_info.json").read_text())
    assert info["world_size"] == 1 and info["versions"]["torch"] == torch.__version__
    assert info["git_commit"] == "unknown" or len(info["git_commit"].removesuffix("-dirty")) == 40
    assert f"run: commit {info['git_commit']}" in stdout and "versions: python" in stdout
    assert stdout.index("config: {") < stdout.index("run: commit")  # the resolved config stays first

    step_lines = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert [line.split(" |")[0] for line in step_lines] == ["step 0/2", "step 1/2", "step 2/2"]  # no bar in a log
    assert "eta" in step_lines[1]

    samples = [json.loads(line) for line in (out_dir / "val_samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0, 0, 1, 1, 2, 2]
    assert samples[0]["source"].endswith("val.parquet:0") and "<image>" in samples[0]["problem"]
    assert {"answer", "response", "reward", "accuracy"} <= set(samples[0])

    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    scalars = tensorboard_scalars(out_dir / "tensorboard")
    for key in ("reward/overall", "actor/grad_norm", "val/accuracy"):
        logged = [(r["step"], r[key]) for r in rows if key in r]
        assert [s for s, _ in scalars[key]] == [s for s, _ in logged]
        assert [v for _, v in scalars[key]] == pytest.approx([v for _, v in logged], rel=1e-6)
