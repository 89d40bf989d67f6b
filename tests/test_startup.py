"""What a new user on a GPU node hits first, stopped before anything loads: GPUs that torch cannot use, a Slurm task
that sees one GPU, a checkpoint of another architecture, vLLM's log noise. And what they see last: a finished run's
ranks ending with exit code 0."""

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest

from grpo import distributed, machine, quiet
from tests.launch import REPO, torchrun
from train_grpo import load_config, main


def test_gpus_that_torch_cannot_use_stop_the_run():
    """Guards against the silent fallback: an 8-GPU node whose driver is older than torch's CUDA build makes
    torch.cuda.is_available() False, and the trainer would train on the CPU (gloo, fp32) without a word."""
    old_driver = machine.cuda_problem(False, 8, "550.54.15", "13.0")
    assert "8 NVIDIA GPUs" in old_driver and "driver 550.54.15" in old_driver and ">= 580" in old_driver
    no_driver = machine.cuda_problem(False, 1, None, "12.8")
    assert "no NVIDIA driver loaded" in no_driver and ">= 525" in no_driver
    assert "CPU-only build" in machine.cuda_problem(False, 2, "580.65.06", None)
    assert "new enough" in machine.cuda_problem(False, 2, "580.65.06", "13.0")
    assert machine.cuda_problem(True, 8, "580.65.06", "13.0") is None  # CUDA works
    assert machine.cuda_problem(False, 0, None, "13.0") is None  # a CPU machine: nothing to warn about


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
        assert machine.nvidia_driver_version() == want
    monkeypatch.setattr(builtins, "open", real_open)
    monkeypatch.setattr(os, "listdir", lambda d: ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "null"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert machine.visible_nvidia_gpus() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert machine.visible_nvidia_gpus() == 0


def test_one_gpu_per_task_uses_it_whatever_the_local_rank():
    """Guards against `srun --ntasks-per-node=8 --gpus-per-task=1`: each task sees its one GPU as device 0, and
    asking for cuda:LOCAL_RANK fails on all but the first."""
    assert distributed.cuda_index(5, 1) == 0
    assert distributed.cuda_index(5, 8) == 5
    with pytest.raises(SystemExit, match="local rank 5 but it sees 4 GPUs"):
        distributed.cuda_index(5, 4)


def vllm_launcher_device(env, device_count: int) -> int:
    """The CUDA device vLLM's external_launcher opens, as 0.26.0 and 0.33.0 pick it (the same code in both):
    ExecutorWithExternalLauncher._distributed_args reads int(os.environ["LOCAL_RANK"]); get_local_gpu_index (0.33;
    0.26 inline in Worker.init_device) leaves it as it is for external_launcher; with no assigned_physical_gpu_ids the
    worker asserts it is below torch.accelerator.device_count(); logical_device_id_to_visible_device_id maps it
    through CUDA_VISIBLE_DEVICES (the physical id at that position, then that id's visible index)."""
    local_rank = int(env["LOCAL_RANK"])
    assert local_rank < device_count, (
        f"DP adjusted local rank {local_rank} is out of bounds for {device_count} devices."
    )
    visible = env.get("CUDA_VISIBLE_DEVICES", "")
    if not visible:
        return local_rank
    ids = [int(x) for x in visible.split(",")]
    return ids.index(ids[local_rank])


@pytest.mark.parametrize("layout", ["torchrun", "srun one GPU per task", "srun all GPUs visible"])
def test_vllm_opens_the_gpu_the_trainer_chose(monkeypatch, layout):
    """Guards against `srun --ntasks-per-node=8 --gpus-per-task=1`: the trainer rightly takes each task's one GPU as
    cuda:0, but vLLM's external_launcher takes cuda:LOCAL_RANK, and LOCAL_RANK was the task's Slurm local id, so every
    task but the first died at engine start ("local rank 5 is out of bounds for 1 devices"). For each launch layout
    of an 8-GPU node: setup_distributed's CUDA branch (init_process_group a stand-in), then vLLM's own choice."""
    import torch
    import torch.distributed as dist

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.setenv(key, "")  # recorded, so that what setup_distributed sets is undone after the test
        monkeypatch.delenv(key)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # setup_distributed wraps it: restored after the test
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    for local_id in (0, 5):
        if layout == "torchrun":  # torchrun's variables, every GPU of the node visible
            env, gpus = {"RANK": str(8 + local_id), "WORLD_SIZE": "16", "LOCAL_RANK": str(local_id)}, 8
        else:  # Slurm's: --gpus-per-task=1 makes CUDA_VISIBLE_DEVICES the task's own GPU
            env = {"SLURM_PROCID": str(8 + local_id), "SLURM_NTASKS": "16", "SLURM_LOCALID": str(local_id)}
            one = layout == "srun one GPU per task"
            env["CUDA_VISIBLE_DEVICES"], gpus = (str(local_id), 1) if one else (",".join(map(str, range(8))), 8)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setattr(torch.cuda, "device_count", lambda n=gpus: n)
        _, _, device = distributed.setup_distributed()
        assert vllm_launcher_device(os.environ, gpus) == device.index
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        physical = int(visible.split(",")[device.index]) if visible else device.index
        assert physical == local_id  # each task on its own GPU of the node
        monkeypatch.delenv("RANK", raising=False)
        monkeypatch.delenv("LOCAL_RANK", raising=False)


def test_checkpoint_of_another_architecture_stops_before_loading(tmp_path, tiny_model_dir, capsys):
    """Guards against loading a checkpoint of a family we do not support (here Qwen3-Omni's MoE) into one we do:
    transformers warns about the weights it leaves random, and the run trains the half-random model and exits 0."""
    other = tmp_path / "qwen3omnimoe"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "qwen3_omni_moe", "architectures": ["X"]}))
    code = main(["configs/tiny.yaml", f"actor.model_path={other}", "data.train_files=configs", "data.val_files="])
    err = capsys.readouterr().err
    assert code == 2 and "model_type 'qwen3_omni_moe' is not supported" in err and str(other) in err
    assert "supported: qwen2_5_vl, qwen3_vl, qwen3_5, qwen3_vl_moe, qwen3_5_moe" in err
    (tmp_path / "empty").mkdir()
    code = main(["configs/tiny.yaml", f"actor.model_path={tmp_path / 'empty'}", "data.val_files="])
    assert code == 2 and "no config.json" in capsys.readouterr().err
    from grpo.loading import unsupported_model

    assert unsupported_model(tiny_model_dir) is None


def test_library_noise_is_filtered_but_not_other_warnings(monkeypatch):
    """Guards against a demo log buried in library noise (1,751 lines for 30 steps once, then 77): vLLM's INFO lines,
    a 'Failed to load weights' warning per layer at every weight sync that looks like a broken sync, start-up notes
    about Triton, CUDA_HOME, seeds and CPU tips. Each row of quiet.py's tables must be dropped, every other message
    of the same loggers and categories must still show, and a second engine must not add a second filter."""
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setattr(quiet, "_level_set_here", False)
    os.environ.pop("VLLM_LOGGING_LEVEL", None)
    loggers = {name for name, _, _ in quiet.LOGGED}
    for name in loggers:  # (filters added here are gone after the test)
        monkeypatch.setattr(logging.getLogger(name), "filters", [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert quiet.quiet_logs(verbose=False)
        assert quiet.quiet_logs(verbose=False)  # a second engine in the same process: still quiet, no second filter
        assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
        assert all(len(logging.getLogger(name).filters) == 1 for name in loggers)

        seen = []
        handler = logging.Handler()
        handler.emit = lambda record: seen.append(record.getMessage())
        for name, text, reason in quiet.LOGGED:
            assert reason, name  # every row says why it is harmless
            logger = logging.getLogger(name)
            logger.addHandler(handler)
            try:
                logger.warning("%s: %s", "QKVParallelLinear", text)
                logger.warning("out of KV-cache blocks")
            finally:
                logger.removeHandler(handler)
        assert seen == ["out of KV-cache blocks"] * len(quiet.LOGGED)
        for category, message, _ in quiet.WARNED:
            warnings.warn(message, category, stacklevel=1)
            warnings.warn("something else is deprecated", category, stacklevel=1)
    assert [str(w.message) for w in caught] == ["something else is deprecated"] * len(quiet.WARNED)


def test_verbose_or_a_users_vllm_level_shows_everything(monkeypatch):
    """Guards against a switch that cannot bring the filtered messages back: trainer.verbose, or a VLLM_LOGGING_LEVEL
    the user set, must leave vLLM's level and every logger unfiltered."""
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setattr(quiet, "_level_set_here", False)
    for name, _, _ in quiet.LOGGED:
        monkeypatch.setattr(logging.getLogger(name), "filters", [])
    os.environ.pop("VLLM_LOGGING_LEVEL", None)
    assert not quiet.quiet_logs(verbose=True)
    assert "VLLM_LOGGING_LEVEL" not in os.environ  # vLLM's own default, INFO
    os.environ["VLLM_LOGGING_LEVEL"] = "DEBUG"
    assert not quiet.quiet_logs(verbose=False)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"  # the user's choice stands
    assert all(not logging.getLogger(name).filters for name, _, _ in quiet.LOGGED)
    assert load_config(None, ["trainer.verbose=true"]).trainer.verbose


def test_stderr_filter_drops_only_the_named_cpp_lines(capfd):
    """Guards against C++ warnings (written to file descriptor 2, past Python) still reaching the log, and against
    the filter swallowing anything else or leaving file descriptor 2 redirected after the block."""
    import ctypes

    libc = ctypes.CDLL(None)
    noise = quiet.PRINTED[0][0]
    with quiet.filtered_stderr(True):
        os.write(2, f"[W utils.cpp:68] Warning: {noise} (0)\nkept line\n".encode())
        libc.fflush(None)
    os.write(2, b"after\n")
    with quiet.filtered_stderr(False):  # verbose: nothing dropped
        os.write(2, f"{noise} shown\n".encode())
    assert capfd.readouterr().err == f"kept line\nafter\n{noise} shown\n"


def test_stderr_filter_ends_with_its_block_while_a_child_started_inside_lives_on(capfd, tmp_path):
    """Guards against the block waiting for the pipe's end, which a process started inside it holds for as long as
    it lives (vLLM's start leaves multiprocessing's resource tracker so: every engine start waited 10 s), and against
    losing that child's lines or the block's last ones. The child writes only once the block is over."""
    import time

    go = tmp_path / "go"
    with quiet.filtered_stderr(True):
        child = subprocess.Popen([sys.executable, "-c", "import os, sys, time\n"
                                  "while not os.path.exists(sys.argv[1]): time.sleep(0.05)\n"
                                  "os.write(2, b'child line\\n'); time.sleep(60)", str(go)])  # fmt: skip
        os.write(2, b"last line of the block\n")
        t0 = time.perf_counter()
    left = time.perf_counter() - t0
    try:
        assert left < 1.0, f"the block waited {left:.1f} s for a pipe its child holds"
        assert capfd.readouterr().err == "last line of the block\n"  # (no marker)
        go.touch()  # the child's line, written after the block, still reaches stderr
        err = ""
        for _ in range(200):
            err += capfd.readouterr().err
            if err:
                break
            time.sleep(0.05)
        assert err == "child line\n"
    finally:
        child.kill()
        child.wait()
    # the tracker that vLLM's shared memory starts inside the block was started before it, with the real stderr
    # (in a fresh interpreter: this one's tracker may be older than the test)
    script = ("import os; from grpo import quiet; from multiprocessing import resource_tracker, shared_memory\n"
              "with quiet.filtered_stderr(True):\n"
              "    shm = shared_memory.SharedMemory(create=True, size=64); shm.close(); shm.unlink()\n"
              "tracker = resource_tracker._resource_tracker._pid\n"
              "print(os.readlink(f'/proc/{tracker}/fd/2'), os.readlink('/proc/self/fd/2'))")  # fmt: skip
    with open(os.devnull, "w") as devnull:
        out = subprocess.run([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=devnull,
                             text=True, check=True).stdout.split()  # fmt: skip
    assert out == ["/dev/null", "/dev/null"], out


def test_a_runs_whole_log_is_the_header_and_one_line_per_step(tiny_model_dir, tmp_path):
    """Guards against the libraries' notes coming back into a run's log (a filter installed after vLLM is imported,
    the C++ NUMA line escaping the stderr filter, a progress bar): a 2-step vLLM run on one rank, everything it
    writes to stdout and stderr, must hold none of quiet.py's messages and nothing but the header, the data lines,
    the first step's mismatch figures (the start guard) and one line per step (the demo's 30 steps make 46 lines
    so)."""
    from scripts.make_synthetic_data import make_geo3k_like

    data = make_geo3k_like(str(tmp_path / "train.parquet"), n_rows=16, seed=0)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train_grpo.py",
           "configs/tiny.yaml", f"actor.model_path={tiny_model_dir}", f"data.train_files={data}", "data.val_files=",
           f"trainer.output_dir={tmp_path / 'run'}", "trainer.max_steps=2", "trainer.export_hf=false"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("VLLM_LOGGING_LEVEL", None)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (proc.stdout + proc.stderr).splitlines()
    texts = [text for _, text, _ in quiet.LOGGED] + [message for _, message, _ in quiet.WARNED]
    texts += [text for text, _ in quiet.PRINTED] + ["Loading safetensors checkpoint shards"]
    assert [line for line in lines if any(text in line for text in texts)] == []
    heads = ("config: ", "run: ", "versions: ", "memory plan", "  ", "host memory", "train: ", "trainable", "step ")
    heads += ("mismatch KL at step 1 ",)
    assert [line for line in lines if not line.startswith(heads)] == [], lines
    assert sum(line.startswith("step ") for line in lines) == 2
    assert sum(line.startswith("mismatch KL") for line in lines) == 1  # once a run, not once a rank or a step


def test_exit_rank_survives_a_gloo_worker_still_holding_a_tensor():
    """Guards against a finished run aborting at exit (SIGABRT, "terminate called without an active exception", so
    torchrun and Slurm report it failed): a gloo worker thread that drops its last collective's tensor while the
    interpreter finalizes kills the process. tests/exit_check.py makes that happen on rank 1; ending by returning
    aborted in 7 of 10 launches on this machine, and distributed.exit_rank must end it cleanly every time."""
    out = torchrun(2, "tests/exit_check.py", "exit_rank", timeout=120)
    assert "rank 1: main returned" in out and "rank 1: exit handlers ran" in out  # its output, its exit handlers


def test_exit_rank_keeps_the_exit_code_handlers_and_output():
    """Guards against exit_rank losing what a normal exit does: the code, exit handlers, Python's buffered output, and
    the C libraries' teardown (here C stdio's buffer, written only by C's exit(); os._exit would drop it)."""
    code = (
        "import atexit, ctypes; from grpo import distributed; atexit.register(print, 'handler'); print('buffered'); "
        "ctypes.CDLL(None).printf(b'c stdio'); distributed.exit_rank(3)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # (which unbuffers C stdio too)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "c stdio" in proc.stdout and proc.stdout.replace("c stdio", "") == "buffered\nhandler\n"  # two buffers


def test_exit_rank_ends_while_an_exit_handler_waits_on_a_stopped_compile_worker():
    """Guards against a finished run that does not end: torch inductor's compile-worker pool (CUDA graphs on) waits
    up to 300 s for its worker in an exit handler (SubprocPool.shutdown: process.wait(300) in torch 2.13), and a
    worker that does not answer holds the rank there, with Slurm's time running. Here the pool's worker is stopped
    (SIGSTOP); exit_rank must end the process with its code within 10 s of its last line, saying which handler it
    left waiting."""
    code = (
        "import os, signal, sys\n"
        "import torch._inductor.config as config\n"
        "config.compile_threads, config.worker_start_method = 2, 'subprocess'\n"
        "from torch._inductor.async_compile import AsyncCompile\n"
        "pool = AsyncCompile.process_pool()  # the sidecar process vLLM's compile starts\n"
        "print(pool.process.pid, flush=True)\n"
        "os.kill(pool.process.pid, signal.SIGSTOP)\n"
        "from grpo import distributed\n"
        "print('last line', flush=True)\n"
        "distributed.exit_rank(4)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    worker = int(proc.stdout.readline())
    try:
        assert proc.stdout.readline() == "last line\n"
        last = time.monotonic()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        ended = time.monotonic() - last
        assert proc.returncode == 4, proc.stderr.read()
        assert ended < 10, ended
        assert "shutdown_compile_workers" in proc.stderr.read()  # the handler it left waiting, named
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, sig)


def test_a_stop_is_said_once_by_rank_0_without_a_traceback(monkeypatch, capsys):
    """Guards against the line that says why a run stopped being printed by every rank (16 copies on 2 nodes, each
    with a traceback) or by none: rank 0 prints a Stop as is, the other ranks nothing; a stop of one rank alone names
    that rank; a SystemExit with a message counts as a Stop; exit codes are kept, and faults are left to the
    excepthook. (The 2-rank launch is in tests/test_mismatch.py: the start guard's stop.)"""
    codes = []

    class Exited(Exception):
        pass

    def exit_rank(code):
        codes.append(code)
        raise Exited

    monkeypatch.setattr(distributed, "exit_rank", exit_rank)
    monkeypatch.setattr(distributed, "PRE_GROUP_WAIT_S", 0.0)

    def run(rank, error):
        monkeypatch.setenv("RANK", str(rank))

        def main():
            raise error

        with pytest.raises(Exited):
            distributed.run_rank(main)
        return codes[-1], capsys.readouterr().err

    assert run(0, distributed.Stop("error: change x", code=3)) == (3, "error: change x\n")
    assert run(1, distributed.Stop("error: change x", code=3)) == (3, "")
    assert run(1, distributed.Stop("error: my GPU is busy", every_rank=False)) == (1, "rank 1: error: my GPU is busy\n")
    assert run(0, SystemExit("error: a plain one")) == (1, "error: a plain one\n")
    assert run(1, SystemExit("error: a plain one")) == (1, "")
    monkeypatch.setenv("RANK", "0")
    assert run(0, SystemExit(4)) == (4, "")
    assert run(0, SystemExit()) == (0, "")
    hooked = []
    monkeypatch.setattr(sys, "excepthook", lambda *exc: hooked.append(exc[0]))
    assert run(0, ValueError("a bug")) == (1, "")  # the excepthook says it (report_failure: traceback and phase)
    assert hooked == [ValueError] and len(codes) == 8


def test_a_rank_that_crashed_ends_while_a_thread_lives_on():
    """Guards against a crashed rank hanging instead of ending: the interpreter's teardown waits for every thread
    that is not a daemon (a library's worker), so a fault left to it can keep the rank alive until its peers'
    collectives time out. run_rank must print the fault (traceback, the phase) and end with 1 at once."""
    code = (
        "import sys, threading, time\n"
        "from grpo import distributed\n"
        "sys.excepthook = distributed.report_failure(sys.excepthook, 60)\n"
        "def main():\n"
        "    threading.Thread(target=time.sleep, args=(300,)).start()  # not a daemon\n"
        "    distributed.phase('rollout')\n"
        "    raise ValueError('a bug')\n"
        "distributed.run_rank(main)\n"
    )
    start = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert time.monotonic() - start < 60  # not the thread's 300 s
    assert "ValueError: a bug" in proc.stderr and "rank ?: failed in phase 'rollout'" in proc.stderr, proc.stderr


def test_a_rank_that_lost_a_peer_says_so_in_one_line(monkeypatch, capsys):
    """Guards against every surviving rank burying the failed rank's traceback under its own (the collective it
    waited in: no news), while a fault of the rank itself must keep its whole traceback."""
    seen = []
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(distributed, "_verbose", False)
    monkeypatch.setattr(distributed, "_phase", "start-up")
    report = distributed.report_failure(lambda *exc: seen.append(exc[0]), 20)
    report(RuntimeError, RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234\nmore"), None)
    line = "rank 1: failed in phase 'start-up': another rank left a collective (it died: see its output) "
    assert capsys.readouterr().err == line + "(RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1234)\n"
    assert seen == []
    report(ValueError, ValueError("a bug"), None)
    assert seen == [ValueError] and capsys.readouterr().err == "rank 1: failed in phase 'start-up'\n"
