"""What a new user on a GPU node hits first, stopped before anything loads: GPUs that torch cannot use, a Slurm task
that sees one GPU, a checkpoint of another architecture, vLLM's log noise. And what they see last: a finished run's
ranks ending with exit code 0."""

import json
import logging
import os
import subprocess
import sys

import pytest

import rollout
import runtime
from tests.launch import REPO, torchrun
from train_grpo import main


def test_gpus_that_torch_cannot_use_stop_the_run():
    """Guards against the silent fallback: an 8-GPU node whose driver is older than torch's CUDA build makes
    torch.cuda.is_available() False, and the trainer would train on the CPU (gloo, fp32) without a word."""
    old_driver = runtime.cuda_problem(False, 8, "550.54.15", "13.0")
    assert "8 NVIDIA GPUs" in old_driver and "driver 550.54.15" in old_driver and ">= 580" in old_driver
    no_driver = runtime.cuda_problem(False, 1, None, "12.8")
    assert "no NVIDIA driver loaded" in no_driver and ">= 525" in no_driver
    assert "CPU-only build" in runtime.cuda_problem(False, 2, "580.65.06", None)
    assert "new enough" in runtime.cuda_problem(False, 2, "580.65.06", "13.0")
    assert runtime.cuda_problem(True, 8, "580.65.06", "13.0") is None  # CUDA works
    assert runtime.cuda_problem(False, 0, None, "13.0") is None  # a CPU machine: nothing to warn about


def test_driver_version_and_gpu_files(monkeypatch, tmp_path):
    """Guards against misreading /proc/driver/nvidia/version (the open kernel module writes 'for x86_64' before
    the version), and against counting GPUs that CUDA_VISIBLE_DEVICES='' hides on purpose."""
    import builtins

    texts = {
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n": "550.54.15",
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build\n": "580.65.06",
    }
    real_open, path = builtins.open, tmp_path / "version"
    monkeypatch.setattr(builtins, "open", lambda p, *a, **k: real_open(path if "nvidia" in str(p) else p, *a, **k))
    for text, want in texts.items():
        path.write_text(text)
        assert runtime.nvidia_driver_version() == want
    monkeypatch.setattr(builtins, "open", real_open)
    monkeypatch.setattr(os, "listdir", lambda d: ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "null"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert runtime.visible_nvidia_gpus() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert runtime.visible_nvidia_gpus() == 0


def test_one_gpu_per_task_uses_it_whatever_the_local_rank():
    """Guards against `srun --ntasks-per-node=8 --gpus-per-task=1`: each task sees its one GPU as device 0, and
    asking for cuda:LOCAL_RANK fails on all but the first."""
    assert runtime.cuda_index(5, 1) == 0
    assert runtime.cuda_index(5, 8) == 5
    with pytest.raises(SystemExit, match="local rank 5 but it sees 4 GPUs"):
        runtime.cuda_index(5, 4)


def test_checkpoint_of_another_architecture_stops_before_loading(tmp_path, tiny_model_dir, capsys):
    """Guards against loading a checkpoint of a family we do not support (here Qwen3-VL's MoE) into one we do:
    transformers warns about the weights it leaves random, and the run trains the half-random model and exits 0."""
    other = tmp_path / "qwen3vlmoe"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "qwen3_vl_moe", "architectures": ["X"]}))
    code = main(["configs/tiny.yaml", f"actor.model_path={other}", "data.train_files=configs", "data.val_files="])
    err = capsys.readouterr().err
    assert code == 2 and "model_type 'qwen3_vl_moe' is not supported" in err and str(other) in err
    assert "supported: qwen2_5_vl, qwen3_vl, qwen3_5" in err
    (tmp_path / "empty").mkdir()
    code = main(["configs/tiny.yaml", f"actor.model_path={tmp_path / 'empty'}", "data.val_files="])
    assert code == 2 and "no config.json" in capsys.readouterr().err
    from models import unsupported_model

    assert unsupported_model(tiny_model_dir) is None


def test_vllm_logs_quiet_but_not_silent(monkeypatch):
    """Guards against a demo log of 1,751 lines for 30 steps: vLLM's INFO lines, and a 'Failed to load weights'
    warning per layer at every weight sync that looks like a broken sync. Other warnings must still show."""
    monkeypatch.setattr(os, "environ", dict(os.environ))
    os.environ.pop("VLLM_LOGGING_LEVEL", None)
    rollout.quiet_vllm_logs()
    rollout.quiet_vllm_logs()  # a second engine in the same process adds no second filter
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    os.environ["VLLM_LOGGING_LEVEL"] = "DEBUG"
    rollout.quiet_vllm_logs()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"  # the user's choice stands

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    for name, noise in rollout.VLLM_NOISE.items():
        logger = logging.getLogger(name)
        assert len(logger.filters) == 1
        logger.addHandler(handler)
        try:
            logger.warning("%s: %s", "QKVParallelLinear", noise)
            logger.warning("out of KV-cache blocks")
        finally:
            logger.removeHandler(handler)
    assert seen == ["out of KV-cache blocks"] * len(rollout.VLLM_NOISE)


def test_exit_rank_survives_a_gloo_worker_still_holding_a_tensor():
    """Guards against a finished run aborting at exit (SIGABRT, "terminate called without an active exception", so
    torchrun and Slurm report it failed): a gloo worker thread that drops its last collective's tensor while the
    interpreter finalizes kills the process. tests/exit_check.py makes that happen on rank 1; ending by returning
    aborted in 7 of 10 launches on this machine, and runtime.exit_rank must end it cleanly every time."""
    out = torchrun(2, "tests/exit_check.py", "exit_rank", timeout=120)
    assert "rank 1: main returned" in out and "rank 1: exit handlers ran" in out  # its output, its exit handlers


def test_exit_rank_keeps_the_exit_code_handlers_and_output():
    """Guards against exit_rank losing what a normal exit does: the code, exit handlers, Python's buffered output, and
    the C libraries' teardown (here C stdio's buffer, written only by C's exit(); os._exit would drop it)."""
    code = (
        "import atexit, ctypes, runtime; atexit.register(print, 'handler'); print('buffered'); "
        "ctypes.CDLL(None).printf(b'c stdio'); runtime.exit_rank(3)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # (which unbuffers C stdio too)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "c stdio" in proc.stdout and proc.stdout.replace("c stdio", "") == "buffered\nhandler\n"  # two buffers
