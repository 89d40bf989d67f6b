"""Pairs of the trainer's switches (scripts/switch_matrix.py): every pair the config check refuses names a key of
each switch, and the pairs whose parts meet in one code path train two steps after their dry run passed."""

import itertools
import json

import pytest

from scripts import switch_matrix
from scripts.switch_matrix import SWITCHES, switch_overrides


def test_every_pair_the_config_check_refuses_names_both_switches():
    """Guards against a refusal that leaves the user guessing which of two keys to change (a message naming one
    switch, or none). Every switch alone passes the check: a refusal is about the pair."""
    from train_grpo import ConfigError, check_config, load_config

    for names in [(n,) for n in SWITCHES] + list(itertools.combinations(SWITCHES, 2)):
        overrides = switch_overrides(names)
        if any(SWITCHES[n].teacher for n in names):
            overrides.append("distill.model_path=teacher")
        try:
            check_config(load_config("configs/tiny.yaml", overrides), 2)
        except ConfigError as e:
            assert len(names) == 2, f"{names[0]} alone is refused: {e}"
            assert switch_matrix.names_both(str(e), names), f"{names}: {e}"


@pytest.fixture(scope="module")
def matrix_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("switch_matrix")


@pytest.mark.parametrize("pair", [("sp", "hf"), ("tools", "video")])
def test_pairs_that_meet_in_one_path_train_after_their_dry_run(matrix_dir, pair):
    """Guards against a pair the dry run passes and that then fails after loading: sequence parallelism with the HF
    engine (which scores each rank's own answers: a forward cut over the group misaligned the ranks' collectives,
    gloo's "Received data size doesn't match expected size" at the first generation), and a tool turn's picture in a
    prompt that holds a clip. Two steps each, validated at the second, on 2 ranks."""
    from tests.launch import torchrun

    result = switch_matrix.run_pair(
        pair, matrix_dir, launch=lambda args, timeout: torchrun(2, "train_grpo.py", *args, timeout=timeout)
    )
    assert result["outcome"] == "trains", result


def test_tensor_parallelism_over_heads_vllm_cannot_split_is_refused_at_the_dry_run(matrix_dir):
    """Guards against a tensor-parallel engine over a model whose heads vLLM cannot split whole: the tiny
    Qwen3.5-MoE's one linear-attention key head over 2 ranks passed the dry run, and then every rank failed in vLLM's
    first prefill (a view of the gated DeltaNet's heads), after the trainer's load. Refused at the dry run, naming both
    keys; the known checkpoints split at 2 and 4 ranks, and Qwen2.5-VL-7B's 28 query heads not at 8."""
    from grpo.model_shape import KNOWN_SHAPES
    from grpo.preflight import tensor_parallel_problem

    result = switch_matrix.run_pair(("tp2", "r3"), matrix_dir, train=False)
    assert result["outcome"] == "refused", result
    assert "1 linear-attention key heads" in result["detail"]
    assert all(tensor_parallel_problem(name, tp) is None for name in KNOWN_SHAPES for tp in (2, 4))
    assert tensor_parallel_problem("Qwen/Qwen2.5-VL-7B-Instruct", 8) == "28 query heads"
    # KV heads are split whole, or replicated when the ranks are a multiple of them: 3 of them neither at 2 ranks
    config = json.loads((matrix_dir / "assets" / "moe" / "config.json").read_text())
    config["text_config"].update(num_attention_heads=6, num_key_value_heads=3, linear_num_key_heads=2)
    (matrix_dir / "kv3").mkdir()
    (matrix_dir / "kv3" / "config.json").write_text(json.dumps(config))
    assert tensor_parallel_problem(str(matrix_dir / "kv3"), 2) == "3 KV heads"
    assert tensor_parallel_problem(str(matrix_dir / "kv3"), 3) == "2 linear-attention key heads"
