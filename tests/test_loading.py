"""Loading that scales: loading.load_sharded builds the model on the meta
device, shards it and reads each rank's rows from the safetensors; checkpoint.save_hf writes weight by weight. Both
must give exactly what from_pretrained and save_pretrained give."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from grpo import loading, logprobs, lora
from grpo.config import ActorConfig
from tests.launch import REPO, free_port, torchrun


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory):
    """The tiny model's weights in bf16 split over several files with an index (as released checkpoints are), and a
    tiny model with tied embeddings (as the 3B: no lm_head.weight in its file)."""
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    tmp = tmp_path_factory.mktemp("loading")
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    model.save_pretrained(tmp / "bf16_sharded", max_shard_size="1MB")
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.tie_word_embeddings = True
    torch.manual_seed(1)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(tmp / "tied")
    return str(tmp / "bf16_sharded"), str(tmp / "tied")


@pytest.mark.parametrize("world", [1, 2])
def test_sharded_load_and_export_equal_from_pretrained(tiny_model_dir, checkpoints, tmp_path, world):
    """Guards against a rank reading another rank's rows (FSDP2's torch.chunk layout, the uneven last shard),
    checkpoint names mapped to the wrong parameters, a dtype conversion that rounds differently from
    from_pretrained's, the tied LM head left untied or random, rotary inv_freq buffers (text and vision: not in the
    files) left as to_empty's garbage, and an export in other names or values than the checkpoint's."""
    from safetensors import safe_open

    bf16_sharded, tied = checkpoints
    torchrun(world, "tests/load_check.py", tiny_model_dir, bf16_sharded, tied, str(tmp_path))
    facts = json.loads((tmp_path / "facts.json").read_text())
    assert len(loading._safetensors_files(bf16_sharded)) > 1
    assert "lm_head.weight" not in safe_open(loading._safetensors_files(tied)[0], "pt").keys()
    for label in ("tiny", "bf16_sharded", "tied"):
        for dtype in ("float32", "bfloat16"):
            assert facts[f"{label}/{dtype}/mismatches"] == [], (label, dtype)
        assert facts[f"{label}/tied"] == (label == "tied")
        for split in ("one", "split"):
            assert facts[f"{label}/export_{split}/same_names"], (label, split)
            assert facts[f"{label}/export_{split}/mismatches"] == [], (label, split)
        assert facts[f"{label}/export_one/files"] == 1 and facts[f"{label}/export_split/files"] > 1
    # the same weights and buffers run the same ops: the packed log-probs are bitwise those of the old loader
    assert facts["packed_logp_max_abs_diff"] == 0.0 and facts["packed_logp_nonzero"] > 10
    assert facts["policy_dtypes"] == ["torch.float32"] and facts["ref_dtypes"] == ["torch.float32"]  # CPU: fp32
    assert facts["policy_trainable"] == {"visual": [False], "language_model": [True], "lm_head": [True]}
    assert facts["ref_trainable"] == []
    # LoRA, rank 8 on the default targets (the language model's 7 projections per decoder layer) and lm_head
    assert facts["lora/ref_is_policy"]  # no second model
    assert facts["lora/trainable_not_adapters"] == [] and facts["lora/trainable_after_ref"]
    assert facts["lora/adapters_without_grad"] == []
    text = json.loads(open(f"{tiny_model_dir}/config.json").read())["text_config"]
    h, inter, layers = text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"]
    q = text["num_attention_heads"] * (text.get("head_dim") or h // text["num_attention_heads"])
    kv = text["num_key_value_heads"] * (q // text["num_attention_heads"])
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + inter) + (inter + h)  # rank x (in + out) per projection
    head = h + text["vocab_size"]
    assert facts["lora/trainable_params"] == 8 * (per_layer * layers + head)  # none in the vision tower (its MLP too)
    assert facts["lora/initial_vs_base_max_abs_diff"] == 0.0  # B = 0: the adapted model starts as the base
    assert facts["lora/adapted_vs_base_max_abs_diff"] > 1e-2  # the adapters do change the policy...
    assert facts["lora/ref_vs_base_max_abs_diff"] <= 1e-6  # ...and the reference is the base without them
    assert facts["lora/export_names_equal_base"]  # merged, in the checkpoint's naming, no LoRA names
    assert facts["lora/export_vs_adapted_max_abs_diff"] <= 1e-5
    assert facts["lora/peft_merge_names_equal"] and facts["lora/peft_merge_max_abs_diff"] <= 1e-6
    assert facts["lora/adapter_files"] == ["adapter_config.json", "adapter_model.safetensors"]
    # a distillation teacher of the policy's own checkpoint: a whole, frozen model whose term is 0 for every token,
    # in the log-prob phase and in the update's own forward (old log-probs left to it); beside LoRA, still the base
    assert facts["distill/teacher_trainable"] == [] and facts["distill/lengths"]
    assert facts["distill/term_max_abs"] == 0.0
    assert abs(facts["distill/reverse_kl"]) <= 1e-6 and abs(facts["distill/advantage"]) <= 1e-6
    assert facts["actor/grad_norm"] <= 1e-5  # zero reward, zero term: nothing to learn
    assert facts["distill/lora_teacher_names"] == [] and facts["distill/lora_initial_term_max_abs"] == 0.0
    assert facts["distill/lora_teacher_vs_base_max_abs_diff"] <= 1e-6 and facts["distill/time_teacher"] > 0


def test_loading_holds_a_ranks_shards_and_one_gathered_unit_at_a_time():
    """Guards against loading that takes more host memory per rank than its shards and the units FSDP2 gathers one
    at a time: the root forward once ran the vision dummy, all-gathering the whole tower beside the root's embedding
    and LM head, and bench/bench_load.py's figure rose from 0.69 to 0.97 model sizes unnoticed. The bench itself
    (so that it keeps running), on 2 ranks and 2 decoder layers, with glibc's mmap threshold fixed: each figure is
    the same to 0.003 run to run. Measured, worst rank, x the fp32 model: 2.04 full fine-tuning, 1.79 with bf16
    masters and offloading (the policy alone 0.69 and 0.44); with the tower's all-gather 2.70 and 2.45."""
    cmd = [sys.executable, "bench/bench_load.py", "--ranks", "2", "--layers", "2", "--variants", "new,bf16_offload"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    peaks = json.loads(out.stdout.strip().splitlines()[-1])  # x the fp32 model, growth of the worst rank's peak
    assert peaks["new_load_peak_x"] <= 2.15 and peaks["bf16_offload_load_peak_x"] <= 1.9, peaks
    assert peaks["new_policy_peak_x"] <= 0.75 and peaks["bf16_offload_policy_peak_x"] <= 0.5, peaks


def test_missing_or_misshapen_tensor_fails_naming_it(tiny_model_dir, tmp_path, one_rank_group):
    """Guards against loading a checkpoint that lacks a weight (or holds one of another shape) into a model that
    then runs with that weight uninitialised: the error must name it."""
    from safetensors.torch import load_file, save_file

    weights = load_file(f"{tiny_model_dir}/model.safetensors")
    for name, change in (("missing", "drop"), ("misshapen", "reshape")):
        broken = tmp_path / name
        shutil.copytree(tiny_model_dir, broken)
        edited = dict(weights)
        if change == "drop":
            del edited["model.layers.1.mlp.up_proj.weight"]
        else:
            edited["model.layers.1.mlp.up_proj.weight"] = edited["model.layers.1.mlp.up_proj.weight"][:-1]
        save_file(edited, broken / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError, match=r"layers\.1\.mlp\.up_proj\.weight"):
            loading.load_sharded(str(broken), torch.device("cpu"), "sdpa")


def test_lora_on_a_head_tied_to_the_embeddings_is_refused(checkpoints, one_rank_group):
    """Guards against an adapter on a tied LM head (the 3B's), whose update a merged export of the one shared tensor
    could not hold: lost silently, or applied to the input embeddings too."""
    from types import SimpleNamespace

    _, tied = checkpoints
    actor = SimpleNamespace(lora_rank=8, lora_alpha=16, lora_dropout=0.0, lora_target_modules=["q_proj", "lm_head"],
                            model_path=tied)  # fmt: skip
    with pytest.raises(ValueError, match="lm_head is tied"):
        loading.load_sharded(tied, torch.device("cpu"), "sdpa", lora=lora.lora_config(actor))
    actor.lora_target_modules = ["q_proj"]  # the decoder layers alone are fine
    model = loading.load_sharded(tied, torch.device("cpu"), "sdpa", lora=lora.lora_config(actor))
    assert sorted({n.rsplit(".", 4)[-4] for n, p in model.named_parameters() if p.requires_grad}) == ["q_proj"]


def test_lora_base_in_bf16_computes_what_fp32_masters_compute(tiny_model_dir, tmp_path, monkeypatch):
    """The GPU's dtype path, run on CPU (FSDP2's bf16 mixed precision over gloo): with LoRA the frozen base is kept
    in bf16 (nothing updates it) and only the adapters in fp32. Guards against that changing what is computed --
    log-probs, reference log-probs (adapters off) and the adapters' gradients must be bitwise those of the fp32-master
    base, which FSDP2 casts to the same bf16 -- against adapters left in bf16 (an AdamW update of lr 1e-6 would
    vanish) or gradients reduced in bf16, and against an export whose merged weights' bytes disagree with its header
    (the merge computes in fp32 on a bf16 base)."""
    from safetensors.torch import load_file
    from transformers import AutoProcessor

    from grpo import batching, checkpoint
    from tests.test_packing import _mixed_batch

    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    targets = ["q_proj", "v_proj", "down_proj", "visual.qkv", "lm_head"]
    actor = ActorConfig(model_path=tiny_model_dir, lora_rank=8, attn_implementation="sdpa",
                                   lora_target_modules=targets)  # fmt: skip
    cpu, load_sharded = torch.device("cpu"), loading.load_sharded
    monkeypatch.setattr(loading, "mixed_precision", lambda device: True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    results = {}
    try:
        for base in (torch.float32, torch.bfloat16):
            if base == torch.float32:  # what LoRA loaded before: fp32 masters of the frozen base
                monkeypatch.setattr(loading, "load_sharded", lambda *a, dtype, **k: load_sharded(*a, **k))
            model, ref = loading.load_policy_and_reference(actor, cpu, True, processor.tokenizer.pad_token_id)
            monkeypatch.setattr(loading, "load_sharded", load_sharded)
            assert ref is model
            dtypes = {(lora.is_lora_factor(n), p.dtype) for n, p in model.named_parameters()}
            assert dtypes == {(False, base), (True, torch.float32)}
            g = torch.Generator().manual_seed(1)  # adapters that do something (B = 0 at init)
            for layer in lora.lora_layers(model).values():
                b = layer.lora_B[lora.LORA_ADAPTER].weight
                lora.copy_own_rows(b, torch.randn(b.shape, generator=g) * 0.1)
            inputs, ids, mask = batching.pack(*_mixed_batch(processor, model.config.image_token_id),
                                             model.config.image_token_id)  # fmt: skip
            logp = logprobs.forward_logprobs(model, inputs, ids, 1.0)[0]
            (logp * mask).sum().backward()
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
            assert grads and {g.dtype for g in grads.values()} == {torch.float32}
            with torch.no_grad(), lora.adapters_disabled(model):
                ref_logp = logprobs.forward_logprobs(model, inputs, ids, 1.0)[0]
            loading.reshard(model)
            checkpoint.save_hf(model, processor, str(tmp_path / str(base)))
            results[base] = logp.detach(), ref_logp, grads
    finally:
        dist.destroy_process_group()
    (logp32, ref32, grads32), (logp16, ref16, grads16) = results[torch.float32], results[torch.bfloat16]
    assert not torch.equal(logp16, ref16)  # the adapters act
    assert torch.equal(logp16, logp32) and torch.equal(ref16, ref32)
    assert grads16.keys() == grads32.keys() and all(torch.equal(grads16[n], grads32[n]) for n in grads32)
    # the merged export: the fp32 base's is the base + delta in fp32; the bf16 base's the same rounded to bf16
    merged32 = load_file(tmp_path / str(torch.float32) / "model.safetensors")
    merged16 = load_file(tmp_path / str(torch.bfloat16) / "model.safetensors")
    base = load_file(f"{tiny_model_dir}/model.safetensors")
    for key in ("model.layers.0.self_attn.q_proj.weight", "lm_head.weight", "model.layers.0.input_layernorm.weight"):
        assert merged16[key].dtype == torch.bfloat16, key
        torch.testing.assert_close(merged16[key], merged32[key].to(torch.bfloat16), rtol=0, atol=1e-2, msg=key)
        assert torch.equal(merged32[key], base[key]) == key.endswith("layernorm.weight"), key  # merged where adapted
