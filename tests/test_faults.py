"""Fault drills outside checkpoints, each a short 2-rank torchrun on CPU with the tiny Qwen2.5-VL: a reward function
that raises or kills its worker process, and a rank that stops taking part in the collectives.

(The drills of killed ranks, killed saves and a full disk are in tests/test_checkpoint.py, next to the run they
are compared with.)
"""

import json
import os
import re
import subprocess
import sys
import time

from tests.launch import REPO, torchrun
from tests.test_checkpoint import metrics, run_args

# A reward function from the test's tmp dir: every worker process grades answers 1, 2, 4 of its life normally
# (overall 1), raises on its 3rd and SIGKILLs itself on its 5th; its replacement starts counting again. Each call
# first appends its verdict to a file of its own, so the test knows how many of each there were.
FAULTY_REWARD = """
import os, signal

calls = 0

def reward(response, ground_truth):
    global calls
    calls += 1
    verdict = {3: "raise", 5: "kill"}.get(calls, "ok")
    with open(os.path.join(LOG_DIR, f"{os.getpid()}.log"), "a") as f:
        f.write(verdict + "\\n")
    if verdict == "raise":
        raise ValueError("a bug in the reward function")
    if verdict == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    return {"overall": 1.0, "bonus": 0.5}
"""

# Rank 1 stops taking part: in its first reward call (graded in the rank itself, reward.timeout=0) it sleeps far
# longer than the collective timeout, as a rank stuck in a hung grader, a dead filesystem or a deadlock would.
STALLING_REWARD = """
import os, time

def reward(response, ground_truth):
    if os.environ["RANK"] == "1":
        time.sleep(STALL_S)
    return {"overall": 1.0}
"""


def test_reward_that_raises_or_kills_its_worker_scores_zero_and_is_counted(tiny_model_dir, tmp_path):
    """Guards against a reward exception or a dead grading process stopping the step, scoring its answer anything
    but 0, or going uncounted (reward/errors must count every rank's failures, not rank 0's alone), and against the
    failures going unsaid (the step's first error is printed once) or the reward's own keys being dropped."""
    from scripts.make_synthetic_data import make_geo3k_like

    data = make_geo3k_like(str(tmp_path / "train.parquet"), n_rows=16, seed=0)
    logs = tmp_path / "verdicts"
    logs.mkdir()
    (tmp_path / "faulty.py").write_text(f"LOG_DIR = {str(logs)!r}\n" + FAULTY_REWARD)
    out = tmp_path / "out"
    overrides = ["trainer.max_steps=2", "trainer.save_freq=0", f"reward.reward_fn={tmp_path / 'faulty.py'}:reward",
                 "reward.num_workers=1", "reward.timeout=30"]  # fmt: skip
    stdout = torchrun(2, *run_args(tiny_model_dir, data, out, *overrides))  # exit 0: both steps went on

    verdicts = [v for log in logs.iterdir() for v in log.read_text().split()]
    n_answers = 2 * 4 * 4  # steps x prompts x answers
    assert len(verdicts) == n_answers and verdicts.count("kill") >= 2 and verdicts.count("raise") >= 2
    logged = metrics(out)
    assert logged[-1]["reward/errors"] == verdicts.count("raise") + verdicts.count("kill")
    assert logged[-1]["reward/timeouts"] == 0
    # each answer that graded scores 1, each failed one 0: the batch means add up to the answers that graded
    assert sum(m["reward/overall"] * 16 for m in logged) == verdicts.count("ok")
    assert sum(m["reward/bonus"] * 16 for m in logged) == 0.5 * verdicts.count("ok")  # the reward's own key, logged
    # the first error of a step, printed once (by the first rank that had one), with the answer it failed on
    assert stdout.count("reward: step 1: ") == 1 and "ValueError: a bug in the reward function (on the answer" in stdout


def test_a_rank_that_stops_ends_the_run_naming_the_phase(tiny_model_dir, tmp_path):
    """Guards against a rank that stops taking part hanging the others forever (torch's default waits 30 minutes on
    gloo), against the error not saying which phase the run was in or which setting bounds the wait, and against the
    stalled rank waiting out torchrun's SIGTERM for a step that can no longer finish (it is SIGKILLed 30 s later,
    without its exit's teardown)."""
    from scripts.make_synthetic_data import make_geo3k_like

    data = make_geo3k_like(str(tmp_path / "train.parquet"), n_rows=16, seed=0)
    timeout_s, stall_s = 20, 600
    (tmp_path / "stalling.py").write_text(f"STALL_S = {stall_s}\n" + STALLING_REWARD)
    overrides = ["trainer.max_steps=2", "trainer.save_freq=0", f"reward.reward_fn={tmp_path / 'stalling.py'}:reward",
                 "reward.timeout=0", f"trainer.collective_timeout_s={timeout_s}"]  # fmt: skip
    args = run_args(tiny_model_dir, data, tmp_path / "out", *overrides)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    # start-up and the timeout: far from the stall, which only torchrun's SIGKILL, 30 s after its SIGTERM, would end
    assert time.monotonic() - start < 200, output[-3000:]
    expected = "rank 0: failed in phase 'rollout': a collective waited longer than trainer.collective_timeout_s="
    assert f"{expected}{timeout_s}s" in output, output[-5000:]
    # the stalled rank stops at torchrun's SIGTERM, where it is, instead of waiting for a step that cannot finish
    assert re.search(r"rank 1: stopped by SIGTERM in phase '[^']+': rank 0 ended the run", output), output[-5000:]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["trainer"]["collective_timeout_s"] == timeout_s


def test_both_process_group_branches_get_the_timeout(monkeypatch):
    """Guards against the timeout reaching the CPU run's group but not the GPU run's (NCCL's own default is 10
    minutes), or a call torch's init_process_group signature does not take. The CUDA branch runs here on CPU, with
    init_process_group replaced by a stand-in that binds its arguments to torch's real signature."""
    import datetime
    import inspect

    import torch
    import torch.distributed as dist

    from grpo import distributed

    calls, real = [], dist.init_process_group

    def init_process_group(*args, **kwargs):
        inspect.signature(real).bind(*args, **kwargs)
        calls.append((args, kwargs))

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # setup_distributed wraps it: restored after the test
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    for cuda in (True, False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        distributed.setup_distributed(42)
    timeout = datetime.timedelta(seconds=42)
    assert calls == [
        (("cpu:gloo,cuda:nccl",), {"device_id": torch.device("cuda", 0), "timeout": timeout}),
        (("gloo",), {"timeout": timeout}),
    ]
