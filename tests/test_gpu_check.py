"""The parts of bench/gpu_check.py that do not need a GPU, so that a session that is lent one spends it measuring,
not fixing the script: the 3B architecture it builds, and the trainer command line it runs."""

import importlib.util
import os

import torch

from tests.launch import REPO
from train_grpo import check_config, load_config


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(REPO, "bench", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_builds_the_real_3b_shape():
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


def test_gpu_check_command_line_is_a_valid_config(tmp_path):
    """Guards against overrides that the trainer rejects (a renamed key, a batch that does not divide) surfacing
    only after minutes of model building on a lent GPU."""
    gpu_check = load_gpu_check()
    for argv in ([], ["--engine", "hf", "--prompts", "8", "--n", "4", "--ref-offload"]):
        args = gpu_check.parse_args(argv)
        path, *overrides = gpu_check.trainer_argv(str(tmp_path / "m"), str(tmp_path / "d"), str(tmp_path / "o"), args)
        cfg = load_config(path, overrides)
        check_config(cfg, world_size=1)
        assert cfg.rollout.tensor_parallel_size == 1 and cfg.trainer.max_steps == args.steps
        assert cfg.actor.max_tokens_per_micro_batch > 0 and cfg.actor.padding_free  # the packed path is what runs


def test_gpu_check_logprob_agreement_runs_on_cpu(tiny_model_dir, tmp_path):
    """Guards against the agreement check itself being broken (it only runs at the end of a GPU session): on CPU in
    fp32 both the packed and the shared-prefix layouts must equal the padded one."""
    from scripts.make_synthetic_data import make_geo3k_like

    gpu_check = load_gpu_check()
    make_geo3k_like(str(tmp_path / "train.parquet"), n_rows=4, seed=0)
    diffs = gpu_check.packed_vs_padded(tiny_model_dir, str(tmp_path), 24, device=torch.device("cpu"))
    assert diffs["attention"] == "sdpa_packed"
    for name in ("packed", "shared_prefix"):
        assert diffs[name]["max"] < 1e-4, (name, diffs[name])
