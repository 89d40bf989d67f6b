"""The parts of bench/gpu_check.py that do not need a GPU, so that time on a GPU is spent measuring,
not fixing the script: the 3B and Qwen3.5-9B architectures it builds, the trainer command line it runs, and its
comparisons."""

import importlib.util
import os

import pytest
import torch
from transformers import AutoConfig

from grpo import attention
from tests.launch import REPO
from train_grpo import check_config, load_config


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(REPO, "bench", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_builds_the_real_3b_shape(tmp_path):
    """Guards against a check that measures some other model: the config written in the script must give
    Qwen2.5-VL-3B-Instruct's exact parameter count (3,754,622,976, tied embeddings) and its 669 M vision tower."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from scripts.make_tiny_model import build_tokenizer

    gpu_check = load_gpu_check()
    config = gpu_check.qwen2_5_vl_3b_config(build_tokenizer(seed=0, vocab_size=400))
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(config)
    assert sum(p.numel() for p in model.parameters()) == 3_754_622_976
    assert sum(p.numel() for p in model.model.visual.parameters()) == 668_684_288
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    (tmp_path / "model.safetensors.index.json").write_text("{}")  # build_model's counts of a reused checkpoint
    assert gpu_check.build_model(str(tmp_path)) == (3_754_622_976, 3_754_622_976 - 668_684_288, 668_684_288)


def test_gpu_check_builds_the_real_qwen3_5_9b_shape(tmp_path):
    """Guards against a Qwen3.5 check that measures some other model: --family qwen3_5's config must give Qwen3.5-9B's
    exact parameter count as transformers loads it (9,409,813,744; model_shape's known shape), 24 linear-attention
    layers of 32, and untied embeddings."""
    from transformers import Qwen3_5ForConditionalGeneration

    gpu_check = load_gpu_check()
    config = gpu_check.qwen3_5_9b_config(gpu_check.real_size_tokenizer("qwen3_5"))
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(config)
    assert sum(p.numel() for p in model.parameters()) == 9_409_813_744
    layers = model.model.language_model.layers
    assert sum(hasattr(layer, "linear_attn") for layer in layers) == 24 and len(layers) == 32
    assert model.lm_head.weight is not model.model.language_model.embed_tokens.weight
    # build_model's own counts for the family (a built checkpoint is reused: only its meta-device copy is counted)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    total, text, vision = gpu_check.build_model(str(tmp_path), "qwen3_5")
    assert total == 9_409_813_744 and vision == sum(p.numel() for p in model.model.visual.parameters())
    assert text == total - vision


def test_gpu_check_builds_the_real_qwen3_vl_30b_a3b_shape(tmp_path):
    """Guards against an MoE check that measures some other model: --family qwen3_vl_moe's config must give
    Qwen3-VL-30B-A3B's parameter count (31,070,754,032, model_shape's known shape, 3.89 B active) with 128 experts a
    layer, 8 routed, in all 48 layers."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    from grpo.model_shape import KNOWN_SHAPES, count_params

    gpu_check = load_gpu_check()
    config = gpu_check.qwen3_vl_30b_a3b_config(gpu_check.real_size_tokenizer("qwen3_vl_moe"))
    with torch.device("meta"):
        model = Qwen3VLMoeForConditionalGeneration(config)
    counts = count_params(KNOWN_SHAPES["Qwen/Qwen3-VL-30B-A3B-Instruct"])
    assert sum(p.numel() for p in model.parameters()) == counts["total"] == 31_070_754_032
    assert sum(p.numel() for p in model.model.visual.parameters()) == counts["vision"]
    experts = [layer.mlp.experts.gate_up_proj.shape[0] for layer in model.model.language_model.layers]
    assert experts == [128] * 48 and config.text_config.num_experts_per_tok == 8
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    assert gpu_check.build_model(str(tmp_path), "qwen3_vl_moe")[0] == counts["total"]


def test_gpu_check_builds_the_real_qwen3_5_35b_a3b_shape(tmp_path):
    """Guards against a Qwen3.5-MoE check that measures some other model: --family qwen3_5_moe's config must give
    Qwen3.5-35B-A3B's parameter count (35.11 B, model_shape's known shape, as transformers loads it) with 256 experts
    a layer, 8 routed, in all 40 layers, 30 of them linear attention."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    from grpo.model_shape import KNOWN_SHAPES, count_params

    gpu_check = load_gpu_check()
    config = gpu_check.qwen3_5_35b_a3b_config(gpu_check.real_size_tokenizer("qwen3_5_moe"))
    with torch.device("meta"):
        model = Qwen3_5MoeForConditionalGeneration(config)
    counts = count_params(KNOWN_SHAPES["Qwen/Qwen3.5-35B-A3B"])
    assert sum(p.numel() for p in model.parameters()) == counts["total"] > 35.1e9
    assert sum(p.numel() for p in model.model.visual.parameters()) == counts["vision"]
    layers = model.model.language_model.layers
    assert [layer.mlp.experts.gate_up_proj.shape[0] for layer in layers] == [256] * 40
    assert sum(hasattr(layer, "linear_attn") for layer in layers) == 30 and config.text_config.num_experts_per_tok == 8
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    assert gpu_check.build_model(str(tmp_path), "qwen3_5_moe")[0] == counts["total"]


# the lent GPU machine: its disk and its host memory, GiB
LENT_DISK_GIB, LENT_HOST_GIB = 64, 128


@pytest.mark.parametrize(("family", "known", "layers"), [("qwen3_vl_moe", "Qwen/Qwen3-VL-30B-A3B-Instruct", 12),
                                                         ("qwen3_5_moe", "Qwen/Qwen3.5-35B-A3B", 8)])  # fmt: skip
def test_gpu_check_layers_make_an_moe_shape_that_fits_the_lent_machine(tmp_path, family, known, layers):
    """Guards against an MoE check that cannot run on the machine lent for it (64 GiB disk, 128 GiB host memory):
    whole, Qwen3-VL-30B-A3B's bf16 checkpoint is 57.9 GiB and Qwen3.5-35B-A3B's 65.4 GiB, which the check refuses to
    write there; with --layers N the shape is its first N layers, each layer, the vocabulary and the tower exactly
    the real ones (model_shape's count of the known shape with N layers), and fits with room, LoRA's pinned host copy
    included. Layer counts that Qwen3.5's 3:1 pattern does not take, or that the shape has not, stop at the command
    line."""
    import dataclasses

    from grpo.model_shape import KNOWN_SHAPES, count_params

    gpu_check = load_gpu_check()
    whole = KNOWN_SHAPES[known]
    full_gib = gpu_check.checkpoint_gib(family)
    assert full_gib == pytest.approx(2 * count_params(whole)["total"] / 2**30)
    problem = gpu_check.machine_problem(full_gib, LENT_DISK_GIB, LENT_HOST_GIB, lora=True)
    assert problem and "disk" in problem
    linear = whole.linear_layers * layers // whole.layers
    reduced = count_params(dataclasses.replace(whole, layers=layers, linear_layers=linear))["total"]
    args = gpu_check.parse_args(["--family", family, "--lora", "--layers", str(layers)])
    gib = gpu_check.checkpoint_gib(family, args.layers)
    assert gib == pytest.approx(2 * reduced / 2**30) and gib < 17
    assert gpu_check.machine_problem(gib, LENT_DISK_GIB, LENT_HOST_GIB, lora=True) is None
    assert "host memory" in gpu_check.machine_problem(gib, 4 * LENT_DISK_GIB, 1.5 * gib, lora=True)
    assert gpu_check.machine_problem(gib, 4 * LENT_DISK_GIB, 1.5 * gib, lora=False) is None  # level 2: no host copy
    gpu_check.write_config_only(str(tmp_path), family, args.layers)  # what the memory plan reads
    assert AutoConfig.from_pretrained(tmp_path).get_text_config().num_hidden_layers == layers
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    assert gpu_check.build_model(str(tmp_path), family, args.layers)[0] == reduced
    path, *overrides = gpu_check.trainer_argv(str(tmp_path / "m"), str(tmp_path / "d"), str(tmp_path / "o"), args)
    check_config(load_config(path, overrides), world_size=1)
    for bad in (["--layers", "49"], ["--family", "qwen3_5_moe", "--lora", "--layers", "6"], ["--family", family]):
        with pytest.raises(SystemExit):
            gpu_check.parse_args(["--family", family, "--lora", *bad] if bad[0] == "--layers" else bad)


def test_gpu_check_command_line_is_a_valid_config(tmp_path):
    """Guards against overrides that the trainer rejects (a renamed key, a batch that does not divide) surfacing
    only after minutes of model building on a GPU."""
    gpu_check = load_gpu_check()
    for argv in ([], ["--engine", "hf", "--prompts", "8", "--n", "4", "--ref-offload"], ["--lora"],
                 ["--family", "qwen3_5", "--lora"], ["--family", "qwen3_vl_moe", "--lora"],
                 ["--family", "qwen3_5_moe", "--lora", "--layers", "8"],
                 ["--set", "actor.ref_offload=true", "--set", "data.max_response_length=64"]):  # fmt: skip
        args = gpu_check.parse_args(argv)
        path, *overrides = gpu_check.trainer_argv(str(tmp_path / "m"), str(tmp_path / "d"), str(tmp_path / "o"), args)
        cfg = load_config(path, overrides)
        check_config(cfg, world_size=1)
        assert cfg.rollout.tensor_parallel_size == 1 and cfg.trainer.max_steps == args.steps
        assert cfg.actor.max_tokens_per_micro_batch > 0 and cfg.actor.padding_free  # the packed path is what runs
        assert not cfg.trainer.export_hf  # no 15 GB fp32 export written for nothing
        assert cfg.actor.lora_rank == (8 if args.lora else 0) and cfg.trainer.n_gpus_per_node == 1
        share = {"qwen3_5": 0.4, "qwen3_vl_moe": 0.5, "qwen3_5_moe": 0.5}.get(args.family, 0.2)
        assert cfg.rollout.gpu_memory_utilization == share
        assert cfg.rollout.enforce_eager is False  # CUDA graphs on, as a real run has them
    assert cfg.actor.ref_offload and cfg.data.max_response_length == 64  # --set comes last, and wins
    args = gpu_check.parse_args(["--enforce-eager"])
    path, *overrides = gpu_check.trainer_argv(str(tmp_path / "m"), str(tmp_path / "d"), str(tmp_path / "o"), args)
    assert load_config(path, overrides).rollout.enforce_eager
    for family in ("qwen3_5", "qwen3_vl_moe", "qwen3_5_moe"):  # full fine-tuning: 140, 460, 520 GiB of fp32 state
        with pytest.raises(SystemExit):
            gpu_check.parse_args(["--family", family])
    # another recipe keeps its precision, offloading, tower and vLLM share; the check's batch and steps still apply
    recipe = os.path.join(REPO, "configs", "geo3k_3b_1x40gb.yaml")
    for extra, share in (([], 0.85), (["--gpu-memory-utilization", "0.43"], 0.43)):
        args = gpu_check.parse_args(["--config", recipe, "--steps", "2", *extra])
        path, *overrides = gpu_check.trainer_argv(str(tmp_path / "m"), str(tmp_path / "d"), str(tmp_path / "o"), args)
        cfg = load_config(path, overrides)
        check_config(cfg, world_size=1)
        assert path == recipe and cfg.rollout.gpu_memory_utilization == share and cfg.trainer.max_steps == 2
        assert cfg.actor.master_dtype == "bf16" and cfg.actor.offload_params and not cfg.actor.freeze_vision_tower
        assert cfg.data.rollout_batch_size == 16 and cfg.rollout.n == 8 and cfg.trainer.gpu_memory_gib == 40
        assert gpu_check.training_mode(cfg) == ("full fine-tuning with bf16 masters, offloaded while vLLM generates, "
                                                "the vision tower trained")  # fmt: skip


@pytest.mark.parametrize(
    "argv",
    [[], ["--engine", "hf"], ["--lora"], ["--engine", "hf", "--lora"], ["--family", "qwen3_5", "--lora"],
     ["--family", "qwen3_5", "--lora", "--engine", "hf"]],
)  # fmt: skip
def test_gpu_check_dry_run_fits_one_80gb_gpu(argv, capsys, monkeypatch):
    """Guards against a GPU check that its own trainer refuses on the GPU it is meant for (the plan once counted
    every decode step's logits: 101 GiB for one 80 GiB GPU): the dry run, on this GPU-less machine, plans exactly
    the run's config on one assumed 80 GiB GPU and says it fits."""
    for key in ("WORLD_SIZE", "SLURM_NTASKS", "LOCAL_WORLD_SIZE", "SLURM_MEM_PER_NODE"):
        monkeypatch.delenv(key, raising=False)
    assert load_gpu_check().main(["--dry-run", *argv]) == 0
    out = capsys.readouterr().out
    assert "world 1, 1 x 80.0 GiB per node (no GPU here: assumed)" in out and "-> fits" in out
    assert "fits one GPU" in out and ("LoRA" in out) == ("--lora" in argv)
    assert ("Qwen3.5-9B" in out) == ("qwen3_5" in argv) and ("9.41 B" in out) == ("qwen3_5" in argv)
    # and a run that cannot fit says so and exits non-zero
    assert load_gpu_check().main(["--dry-run", "--set", "actor.freeze_vision_tower=false"]) == 1
    assert "does not fit" in capsys.readouterr().out


def test_gpu_check_dry_run_of_the_moe_plans_an_h200(capsys, monkeypatch):
    """Guards against an MoE check that starts minutes of model building on a GPU it cannot fit: Qwen3-VL-30B-A3B's
    bf16 weights are held twice while vLLM generates (trainer and engine, 57.9 GiB each), so the dry run says one
    80 GiB GPU does not fit and one H200 (141 GiB) does."""
    for key in ("WORLD_SIZE", "SLURM_NTASKS", "LOCAL_WORLD_SIZE", "SLURM_MEM_PER_NODE"):
        monkeypatch.delenv(key, raising=False)
    argv = ["--dry-run", "--family", "qwen3_vl_moe", "--lora"]
    assert load_gpu_check().main(argv) == 1
    assert "does not fit" in capsys.readouterr().out
    assert load_gpu_check().main([*argv, "--set", "trainer.gpu_memory_gib=141"]) == 0
    out = capsys.readouterr().out
    assert "31.07 B, 3.89 B active" in out and "fits one GPU (Qwen3-VL-30B-A3B, LoRA rank 8)" in out


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5"])
def test_gpu_check_tower_comparison_runs_on_cpu(tiny_family_dir, tmp_path, monkeypatch, family):
    """Guards against the tower comparison itself being broken, or comparing a path with itself: on CPU with the
    varlen kernel swapped for the per-sequence reference, the tower's one-call-per-block varlen path equals its sdpa
    loop over images and windows (fp32), and the kernel really ran, once per block, non-causal."""
    from scripts.make_synthetic_data import make_geo3k_like
    from tests.test_varlen import reference_varlen

    calls = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=None):
        calls.append(causal)
        return reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window)

    monkeypatch.setattr(attention, "varlen_kernel", kernel)
    make_geo3k_like(str(tmp_path / "train.parquet"), n_rows=4, seed=0)
    gpu_check = load_gpu_check()
    path = tiny_family_dir(family)
    diff = gpu_check.tower_varlen_vs_sdpa(path, str(tmp_path), torch.device("cpu"), "varlen_packed")
    assert diff["max"] < 1e-5 and diff["mean_abs_feature"] > 1e-3 and diff["tokens"] > 4
    depth = AutoConfig.from_pretrained(path).vision_config.depth
    assert calls == [False] * depth


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5"])
def test_gpu_check_logprob_agreement_runs_on_cpu(tiny_family_dir, tmp_path, family):
    """Guards against the agreement check itself being broken (it only runs at the end of a GPU session): on CPU in
    fp32 both the packed and the shared-prefix layouts must equal the padded one."""
    from scripts.make_synthetic_data import make_geo3k_like

    gpu_check = load_gpu_check()
    make_geo3k_like(str(tmp_path / "train.parquet"), n_rows=4, seed=0)
    diffs = gpu_check.packed_vs_padded(tiny_family_dir(family), str(tmp_path), 24, device=torch.device("cpu"))
    assert diffs["attention"] == "sdpa_packed"
    for name in ("packed", "shared_prefix"):
        assert diffs[name]["max"] < 1e-4, (name, diffs[name])


def test_gpu_check_sets_the_devices_rollout_memory_beside_the_plan():
    """Guards against comparing the plan with the wrong reading: the engine's own sleep at start (before the trainer's
    model loads) must not count, the device's use is total - free right before a loop's sleep (the most of them), and
    the deviation is the plan's relative to the device."""
    gpu_check = load_gpu_check()
    sleeps = [
        {"before": 60.0, "after": 78.0, "total": 80.0},  # at start: vLLM awake alone
        {"before": 10.0, "after": 28.0, "total": 80.0},
        {"before": 12.0, "after": 29.0, "total": 80.0},
    ]
    memory = gpu_check.rollout_memory(sleeps, planned_gib=77.0)
    assert memory["device_used_gib_awake"] == 70.0 and memory["planned_rollout_gib"] == 77.0
    assert abs(memory["plan_vs_device"] - 0.10) < 1e-9 and memory["freed_by_sleep_gib"] == 17.5
    assert gpu_check.rollout_memory(sleeps[:1], 77.0) == {}  # no loop sleep: nothing to compare


def test_gpu_check_engine_vs_trainer_runs_on_cpu(tiny_model_dir, tmp_path):
    """Guards against the per-modality comparison of vLLM's log-probs with the trainer's being broken (it runs only at
    the end of a GPU session): on CPU in fp32, in the fresh process main() starts for it, after a weight sync, text
    and image answers both agree within tests/test_vllm.py's bounds; the engine's speed with and without request
    seeds is measured."""
    import json
    import subprocess
    import sys

    from scripts.make_synthetic_data import make_geo3k_like

    make_geo3k_like(str(tmp_path / "train.parquet"), n_rows=8, seed=0)
    cmd = [sys.executable, os.path.join(REPO, "bench", "gpu_check.py"), "--engine-vs-trainer", tiny_model_dir,
           str(tmp_path), "--response-tokens", "16"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": "29571"}
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "engine_vs_trainer.json").read_text())
    assert result["dtype"] == "float32"
    assert result["text"]["max"] <= 1e-4 and result["image"]["max"] <= 0.05, result
    assert result["text"]["tokens"] > 0 and result["image"]["tokens"] > 0
    seeding = result["seeding"]  # generation with and without request seeds, 8 prompts x 16 answers
    assert seeding["answers"] == 128 and seeding["seeded_tokens_per_s"] > 0 and seeding["unseeded_tokens_per_s"] > 0


def test_gpu_check_leaves_vllms_sleeping_pool_out_of_the_trainers_phases(monkeypatch):
    """Guards against the per-phase peaks counting vLLM's sleep-mode pool: torch's allocator keeps its blocks as
    allocated while vLLM sleeps (an H100's update phase read 81.2 GiB, more than the device has). The stand-in has
    the exact structure of vLLM's CuMemAllocator (0.26 to 0.33): a class attribute `instance`, `pointer_to_data`
    mapping a pointer to vllm.device_allocator.AllocationData, whose handle is (device, size, pointer, handle)."""
    import sys
    import types

    from vllm.device_allocator import AllocationData

    gpu_check = load_gpu_check()
    cumem = types.ModuleType("vllm.device_allocator.cumem")
    cumem.CuMemAllocator = type("CuMemAllocator", (), {"instance": None})
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", cumem)
    assert gpu_check.engine_pool_gib() == 0.0  # no engine with sleep mode in this process
    pool = cumem.CuMemAllocator()
    pool.pointer_to_data = {
        ptr: AllocationData((0, size, ptr, 0), tag)
        for ptr, size, tag in ((1 << 30, 7 << 30, "weights"), (9 << 30, (35 << 29), "kv_cache"))
    }
    cumem.CuMemAllocator.instance = pool
    assert gpu_check.engine_pool_gib() == 24.5
    monkeypatch.delitem(sys.modules, "vllm.device_allocator.cumem")
    assert gpu_check.engine_pool_gib() == 0.0  # vLLM's allocator never imported
    line = gpu_check.phase_memory({"update": 65.4, "rollout": 61.0}, {"update": 65.4, "weight sync": 54.1}, 15.9)
    assert "update 65.4 / 65.4" in line and "weight sync - / 54.1" in line and "15.9 GiB" in line


def test_gpu_check_comparison_process_starts_clean_and_says_how_it_failed(monkeypatch, tmp_path, capsys):
    """Guards against the comparison's fresh process inheriting what the trainer's run set in this one (on an H100
    it died silently that way, and ran when started alone), and against a failure that does not say how it ended."""
    import subprocess
    import types

    gpu_check = load_gpu_check()
    calls = []

    def run(cmd, env):
        calls.append((cmd, env))
        return subprocess.CompletedProcess(cmd, -9)

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(gpu_check.families, "family_of", lambda path: types.SimpleNamespace(moe=False))
    monkeypatch.setenv("SET_BY_THE_RUN", "1")
    args = types.SimpleNamespace(enforce_eager=False, response_tokens=64)
    assert gpu_check.engine_vs_trainer_process(str(tmp_path), str(tmp_path), args) == {}
    ((cmd, env),) = calls
    assert "--engine-vs-trainer" in cmd and "--enforce-eager" not in cmd
    assert "SET_BY_THE_RUN" not in env and env["MASTER_PORT"] != os.environ.get("MASTER_PORT", "29500")
    assert "failed (killed by SIGKILL;" in capsys.readouterr().out
