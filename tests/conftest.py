"""Shared pytest setup: offline CPU defaults and a tiny Qwen2.5-VL checkpoint built once per session."""

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # so tests import the trainer modules and scripts.* without installing

# Tests never touch the network, and tokenizer thread pools deadlock in forked workers.
for _key, _value in {
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    # Run vLLM's engine in the test process, as the trainer does with external_launcher; a spawned engine
    # process would re-import the test module and costs seconds per LLM().
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}.items():
    os.environ.setdefault(_key, _value)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """Path of a freshly built tiny random Qwen2.5-VL (tokenizer, processor, fp32 weights); read-only."""
    from scripts.make_tiny_model import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_qwen2_5_vl")), seed=0)


@pytest.fixture(scope="session")
def tiny_tools_model_dir(tmp_path_factory) -> str:
    """The tiny Qwen2.5-VL with the <tool_call> </tool_call> tokens (a vocabulary of its own); read-only."""
    from scripts.make_tiny_model import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_tools")), seed=0, tools=True)


@pytest.fixture(scope="session")
def tiny_processor(tiny_model_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_family_dir(tmp_path_factory, tiny_model_dir):
    """family -> path of a tiny random model of that family (scripts/make_tiny_model.py --family), each built once
    per session on first use; qwen2_5_vl is tiny_model_dir."""
    from scripts.make_tiny_model import build_tiny_model

    built = {"qwen2_5_vl": tiny_model_dir}

    def get(family: str) -> str:
        if family not in built:
            built[family] = build_tiny_model(str(tmp_path_factory.mktemp(f"tiny_{family}")), seed=0, family=family)
        return built[family]

    return get


@pytest.fixture
def one_rank_group():
    """A one-process gloo group, for code that needs torch.distributed (FSDP2, DCP) outside torchrun."""
    import torch.distributed as dist

    from tests.launch import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
