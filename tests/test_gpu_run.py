"""bench/gpu_run.sh, the next GPU run as one script, and its pass conditions (bench/gpu_run_verdict.py), checked here
so that a GPU's minutes go to measuring: the dry run lists the steps in order with their conditions, every trainer
command it would run is a config the trainer takes, and each verdict reads what its step writes."""

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

from tests.launch import REPO
from train_grpo import check_config, load_config

STEPS = ["replay", "qwen3_5", "distill", "linear_attention", "gpu_check_qwen3_5", "gpu_check_moe"]


def load_verdicts():
    spec = importlib.util.spec_from_file_location("gpu_run_verdict", os.path.join(REPO, "bench", "gpu_run_verdict.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dry_run() -> str:
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", "bench/gpu_run.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_dry_run_lists_the_steps_in_order_with_their_pass_conditions():
    """Guards against a GPU run whose steps are not the ones planned, in another order than their value, or whose
    pass conditions are not said before it starts: without a GPU, --dry-run lists each step with its limit, its
    command and its condition, as the verdicts state them."""
    verdicts = load_verdicts()
    out = dry_run()
    listed = re.findall(r"^(\d+)\. (\w+) \(at most (\d+) s\): ", out, flags=re.M)
    assert [name for _, name, _ in listed] == STEPS and [int(i) for i, _, _ in listed] == list(range(1, 7))
    assert sum(int(s) for _, name, s in listed[:4]) <= 600  # (a)-(d) fit one device call of 10 minutes
    conditions = re.findall(r"^   pass: (.+)$", out, flags=re.M)
    assert conditions == [verdicts.CONDITIONS[name] for name in STEPS]
    assert set(verdicts.VERDICTS) == set(STEPS)


def test_every_trainer_command_of_the_run_is_a_valid_config(tmp_path):
    """Guards against a step that fails at its config check after the machine has started (a renamed key, a value the
    trainer refuses): each train_grpo.py command the dry run lists loads and passes the checks on one rank, and
    says what its step is about (routing replay, CUDA graphs, the teacher offloaded or not)."""
    commands = re.findall(r"train_grpo\.py (configs/\S+\.yaml)((?: [\w.]+=[^\s;]*)*)", dry_run())
    assert len(commands) == 4  # replay, qwen3_5, distill with the teacher offloaded and not
    cfgs = []
    for config, overrides in commands:
        args = [a.replace("$W", str(tmp_path)).replace("$DATA", str(tmp_path / "train.parquet"))
                for a in shlex.split(overrides)]  # fmt: skip
        cfg = load_config(os.path.join(REPO, config), args)
        check_config(cfg, world_size=1)
        assert cfg.rollout.engine == "vllm" and not cfg.rollout.enforce_eager and cfg.trainer.n_gpus_per_node == 1
        assert not cfg.trainer.export_hf and cfg.actor.lora_rank == 0  # full fine-tuning: sleep level 2
        cfgs.append(cfg)
    replay, qwen3_5, on, off = cfgs
    assert replay.algorithm.routing_replay == "r3" and replay.trainer.max_steps == 3
    assert qwen3_5.trainer.max_steps == 2 and qwen3_5.actor.model_path.endswith("tiny_qwen3_5")
    assert on.distill.offload and not off.distill.offload and on.distill.model_path == off.distill.model_path != ""


def _rows(path, rows):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps({"step": i, **r}) + "\n" for i, r in enumerate(rows)))


def test_replay_and_distill_verdicts(tmp_path):
    """Guards against conditions that pass what they should not: no replayed token at a step, a mismatch that grows
    past 3x of step 1 by step 3, a run that stopped early, a reverse KL that offloading changed by more than 1 %."""
    verdicts = load_verdicts()
    good = [{"moe/replayed_tokens": 900, "rollout/mismatch_kl": k} for k in (1e-3, 2e-3, 2.9e-3)]
    _rows(tmp_path / "a" / "replay", [{}, *good])
    assert verdicts.replay(str(tmp_path / "a"), "")[0]
    for bad in ([*good[:2], {**good[2], "rollout/mismatch_kl": 3.5e-3}], [{**good[0], "moe/replayed_tokens": 0},
                *good[1:]], good[:2]):  # fmt: skip
        _rows(tmp_path / "b" / "replay", [{}, *bad])
        assert not verdicts.replay(str(tmp_path / "b"), "")[0]
        (tmp_path / "b" / "replay" / "metrics.jsonl").unlink()
        (tmp_path / "b" / "replay").rmdir()
    for kl_off, passes in ((0.2010, True), (0.2030, False)):
        run = tmp_path / f"d{kl_off}"
        _rows(run / "distill_offload_on", [{}, {"distill/reverse_kl": 0.2}])
        _rows(run / "distill_offload_off", [{}, {"distill/reverse_kl": kl_off}])
        assert verdicts.distill(str(run), "")[0] is passes
    assert not verdicts.distill(str(tmp_path / "nothing"), "")[0]  # a run that never reached step 1


def test_qwen3_5_and_linear_attention_verdicts_read_what_the_code_prints(monkeypatch, capsys, tiny_family_dir,
                                                                         tmp_path):  # fmt: skip
    """Guards against a verdict whose pattern misses the line it looks for (a FAIL on a GPU run that passed): the
    warm-up's own line (linear_attention.warm_up, here with a stand-in of fla's kernel under fla's module name) and
    bench_linear_attention.py's own rows (run small on CPU)."""
    from grpo import linear_attention, loading
    from tests.test_linear_attention import fla_stand_in

    verdicts = load_verdicts()
    kernel = fla_stand_in([])
    kernel.__module__ = "fla.ops.gated_delta_rule.chunk"
    monkeypatch.setattr(linear_attention, "delta_rule_kernel", lambda device_type: kernel)
    model = loading.load_model(tiny_family_dir("qwen3_5"), torch.device("cpu"), "sdpa")
    seconds = linear_attention.warm_up(model, torch.device("cpu"))
    log = capsys.readouterr().out
    _rows(tmp_path / "qwen3_5", [{}, {"time/step": 30.0}, {"time/step": 2.0}])
    ok, figures = verdicts.qwen3_5(str(tmp_path), log)
    assert ok and figures["tuning_s"] == round(seconds, 1) and figures["kernel"].startswith("fla.ops")
    assert figures["step_s"] == [30.0, 2.0]
    assert not verdicts.qwen3_5(str(tmp_path), log.replace("fla.ops", "grpo.linear_attention"))[0]  # not fla's
    bench = subprocess.run([sys.executable, "bench/bench_linear_attention.py", "--width", "16", "--groups", "1", "--n",
                            "2", "--prompt", "24", "--answer", "8", "--repeats", "1"], cwd=REPO, capture_output=True,
                           text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert bench.returncode == 0, bench.stderr[-2000:]
    ok, rows = verdicts.linear_attention("", bench.stdout)
    assert ok and rows["shared prefixes"]["packed_ms"] > 0 and rows["no sharing"]["packed_first_call_s"] >= 0


@pytest.mark.parametrize("peak_vs_plan, passes", [(0.05, True), (0.2, False)])
def test_gpu_check_verdicts_read_its_json(tmp_path, monkeypatch, peak_vs_plan, passes):
    """Guards against a GPU-check step that passes without its JSON or with a peak well above the plan."""
    verdicts = load_verdicts()
    monkeypatch.setenv("OUT", str(tmp_path))
    assert not verdicts.VERDICTS["gpu_check_moe"]("", "")[0]
    for tag in ("lora_qwen3_vl_moe_12layers", "lora_qwen3_5_moe_8layers", "lora_qwen3_5"):
        (tmp_path / f"gpu_check_{tag}.json").write_text(json.dumps({"peak_vs_plan": peak_vs_plan, "step_s": 9.0}))
    assert verdicts.VERDICTS["gpu_check_moe"]("", "")[0] is passes
    assert verdicts.VERDICTS["gpu_check_qwen3_5"]("", "")[0] is passes
