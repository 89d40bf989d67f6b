"""Model families: Qwen2.5-VL, Qwen3-VL, Qwen3.5, the mixture-of-experts Qwen3-VL-MoE and Qwen3.5-MoE, and
GLM-4.1V through the same loading, packing and shared-prefix code, each held to a reference computation on a tiny
random model of its own family (real config, processor and tokenizer classes, scripts/make_tiny_model.py --family)."""

import json
import math
import os
import re
import shutil

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from grpo import batching, families, loading, logprobs, moe
from tests.launch import REPO, free_port, torchrun
from tests.test_packing import _mixed_batch
from tests.test_shared_prefix import _groups

FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe", "glm4v"]
SUPPORTED = "supported: qwen2_5_vl, qwen3_vl, qwen3_5, qwen3_vl_moe, qwen3_5_moe, glm4v, gemma4"


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_equals_padded(tiny_family_dir, family):
    """Guards against a family whose packed row mixes its sequences: attention that crosses sequences (a mask built
    from Qwen3-VL's positions would override the layout), mRoPE positions of the wrong family (Qwen3-VL's and
    Qwen3.5's interleaved sections), Qwen3.5's linear-attention state carried from one sequence into the next, and
    a packed backward that differs from the padded one, and, in an MoE family, tokens routed differently packed than
    padded (the router sees each token alone, so a pad or a neighbour must not change its experts). The padded batch
    is the reference."""
    from transformers import AutoProcessor

    path = tiny_family_dir(family)
    processor = AutoProcessor.from_pretrained(path)
    torch.manual_seed(0)
    model = loading.load_model(path, torch.device("cpu"), "sdpa")
    assert model.config.model_type == family
    pad_id, image_token_id = processor.tokenizer.pad_token_id, model.config.image_token_id
    prompts, responses = _mixed_batch(processor, image_token_id)
    padded = batching.collate(prompts, responses, pad_id, image_token_id)
    packed = batching.pack(prompts, responses, image_token_id)
    results = {}
    for name, (inputs, response_ids, mask) in (("padded", padded), ("packed", packed)):
        model.zero_grad(set_to_none=True)
        logp, ent = logprobs.forward_logprobs(model, inputs, response_ids, 0.9, True, True)
        ((logp * mask).sum() + 0.1 * (ent * mask).sum()).backward()
        results[name] = (logp.detach() * mask, ent.detach() * mask, _grads(model))
    (logp_a, ent_a, grads_a), (logp_b, ent_b, grads_b) = results["padded"], results["packed"]
    torch.testing.assert_close(logp_b, logp_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_b, ent_a, rtol=1e-5, atol=1e-5)
    assert grads_a.keys() == grads_b.keys() and any("visual" in n for n in grads_a)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-5, msg=name)
    print(f"{family}: packed vs padded max |dlogp| {(logp_b - logp_a).abs().max():.1e}, max |dgrad| "
          f"{max((grads_b[n] - grads_a[n]).abs().max().item() for n in grads_a):.1e}")  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prefix_equals_unshared(tiny_family_dir, family):
    """Guards against shared-prefix training that is not exact for a family: above all Qwen3.5's linear-attention
    layers, where an answer must start from the state its prompt leaves, not from zero nor from its sibling's."""
    from transformers import AutoProcessor

    path = tiny_family_dir(family)
    processor = AutoProcessor.from_pretrained(path)
    torch.manual_seed(0)
    model = loading.load_model(path, torch.device("cpu"), "sdpa")
    prompts, responses = _groups(processor)
    results = {}
    for share in (False, True):
        inputs, response_ids, mask = batching.pack(prompts, responses, model.config.image_token_id, share)
        model.zero_grad(set_to_none=True)
        logp, ent = logprobs.forward_logprobs(model, inputs, response_ids, 0.9, True, True)
        ((logp * mask).sum() + 0.1 * (ent * mask).sum()).backward()
        results[share] = (logp.detach() * mask, _grads(model))
    (logp_u, grads_u), (logp_s, grads_s) = results[False], results[True]
    torch.testing.assert_close(logp_s, logp_u, rtol=1e-5, atol=1e-5)
    assert grads_s.keys() == grads_u.keys()
    for name in grads_u:
        torch.testing.assert_close(grads_s[name], grads_u[name], rtol=1e-5, atol=1e-5, msg=name)


def test_linear_attention_restarts_per_sequence(tiny_family_dir):
    """Guards against the segment-wise linear attention being a no-op: without it the packed row's second sequence
    would start from the first one's recurrent state and its log-probs would move."""
    from transformers import AutoProcessor

    path = tiny_family_dir("qwen3_5")
    processor = AutoProcessor.from_pretrained(path)
    model = loading.load_model(path, torch.device("cpu"), "sdpa")
    prompts, responses = _mixed_batch(processor, model.config.image_token_id)
    inputs, response_ids, mask = batching.pack(prompts, responses, model.config.image_token_id)
    with torch.no_grad():
        segmentwise = logprobs.forward_logprobs(model, inputs, response_ids, 1.0)[0]
        for layer in model.model.language_model.layers:
            if hasattr(layer, "linear_attn"):
                del layer.linear_attn.forward  # back to transformers' own forward over the whole row
        whole_row = logprobs.forward_logprobs(model, inputs, response_ids, 1.0)[0]
    assert ((segmentwise - whole_row) * mask)[1:].abs().max() > 1e-3  # the first sequence has nothing before it


@pytest.mark.parametrize(
    "family", ["qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe", "glm4v", "gemma4", "gemma4_moe"]
)
def test_sharded_load_and_export_equal_from_pretrained(tiny_family_dir, tmp_path, family):
    """Guards against the meta-device load of a new family differing from from_pretrained (a parameter read under
    the wrong name, a buffer such as a rotary table left as to_empty's garbage, Qwen3.5's A_log / dt_bias / conv1d
    left uninitialised, an MoE's experts read untransposed or from the wrong experts) and against an export in other
    names or shapes than the checkpoint's (Qwen3-VL-MoE's experts transposed, Qwen3.5-MoE's one tensor per expert,
    as vLLM's loaders take them)."""
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from grpo import checkpoint
    from tests.load_check import mismatches

    path = tiny_family_dir(family)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = loading.load_sharded(path, torch.device("cpu"), "sdpa")
        assert mismatches(model, AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)) == []
        export = tmp_path / "export"
        checkpoint.save_hf(model, AutoProcessor.from_pretrained(path), str(export))
    finally:
        dist.destroy_process_group()

    def shapes(d):
        return {k: safe_open(f, "pt").get_slice(k).get_shape() for f in loading._safetensors_files(d)
                for k in safe_open(f, "pt").keys()}  # fmt: skip

    assert shapes(str(export)) == shapes(path)
    assert loading.unsupported_model(str(export)) is None
    if family.endswith("_moe"):  # the export's experts are the checkpoint's, in its layout
        assert mismatches(AutoModelForImageTextToText.from_pretrained(str(export), dtype=torch.float32),
                          AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)) == []  # fmt: skip


def _copy_checkpoint(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


@pytest.mark.parametrize("meta", [False, True])
def test_weights_missing_or_unexpected_stop_at_start(tiny_family_dir, tmp_path, meta):
    """Guards against training a half-random model: a checkpoint with a tensor the model lacks, or lacking one it
    has, stops at load naming the tensor and the supported families -- while Qwen3.5's `mtp.*` tensors, which its
    class declares ignorable, do not."""
    path = tiny_family_dir("qwen3_5")
    cpu = torch.device("cpu")

    def extra(t):
        t["model.language_model.layers.0.self_attn.q_norm.weight"] = torch.ones(64)

    def lacking(t):
        del t["model.visual.merger.linear_fc1.weight"]

    def mtp(t):
        t["mtp.fc.weight"] = torch.zeros(4, 4)

    for name, edit, message in (("extra", extra, "unexpected"), ("lacking", lacking, "missing")):
        bad = _copy_checkpoint(path, tmp_path / name, edit)
        with pytest.raises(ValueError, match=f"1 {message} tensors.*{SUPPORTED}"):
            loading.load_model(bad, cpu, "sdpa", meta=meta)
        if meta:  # the start-up check (train_grpo.check_paths) says the same before anything loads
            assert f"1 {message} tensors" in loading.unsupported_model(bad)
    ok = _copy_checkpoint(path, tmp_path / "mtp", mtp)
    loading.load_model(ok, cpu, "sdpa", meta=meta)
    assert loading.unsupported_model(ok) is None


def test_unsupported_model_type_stops_at_start(tiny_family_dir, tmp_path):
    """Guards against loading a checkpoint of another family into one of ours: one line naming its model_type and
    the supported list (the MoE families in it), from both the start-up check and the loader."""
    path = shutil.copytree(tiny_family_dir("qwen3_vl"), tmp_path / "omni")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "qwen3_omni_moe"
    (path / "config.json").write_text(json.dumps(config))
    message = f"model_type 'qwen3_omni_moe' is not supported; {SUPPORTED}"
    assert loading.unsupported_model(str(path)) == message
    with pytest.raises(ValueError, match=message):
        loading.load_model(str(path), torch.device("cpu"), "sdpa")
    for family in FAMILIES:
        assert loading.unsupported_model(tiny_family_dir(family)) is None


def test_image_processor_of_another_family_stops_at_start(tiny_family_dir, tmp_path):
    """Guards against fitting images to another family's side: Qwen3-VL weights beside Qwen2.5-VL's image processor
    (28 px tokens for a 32 px tower) stop at start, naming both sides."""
    path = shutil.copytree(tiny_family_dir("qwen3_vl"), tmp_path / "mixed")
    config = json.loads((path / "processor_config.json").read_text())
    with open(os.path.join(tiny_family_dir("qwen2_5_vl"), "processor_config.json")) as f:
        config["image_processor"] = json.load(f)["image_processor"]
    (path / "processor_config.json").write_text(json.dumps(config))
    problem = loading.unsupported_model(str(path))
    assert problem == "its image processor fits images to 28 px (patch x merge), its model family's tower to 32"


# |vLLM log-prob - trainer log-prob| after a sync, text-only and with an image. The engine runs in fp32 on CPU, as
# the trainer does, except for Qwen3.5: vLLM 0.32's CPU gated-delta-net kernel asserts bf16 ("CPU GDN attention
# requires BF16"), so its engine samples in bf16 and the text bound is bf16 rounding's (measured 0.028; a sync that
# did not arrive leaves ~2). Qwen3-VL-MoE's are Qwen3-VL's. Qwen3.5-MoE's engine is in bf16 too, and there bf16
# also moves some tokens to other experts (0.5% of a layer's tokens, on the perturbed weights the check syncs; the
# trainer's own fp32-vs-bf16 gap on those weights is 0.47), which moves them and the tokens after them by up to
# 0.7: a max cannot tell that from a sync that did not arrive (~2). What does is the share of tokens beyond bf16
# rounding (0.05): at most 4% after the sync (measured), 95% before it. GLM-4.1V's engine is fp32 (measured 1e-6 text
# and image; a sync that dropped the q/k/v biases, as vLLM does for a config without attention_bias, leaves ~1); it
# takes no videos (families.Family.videos), and vllm_check gives it none.
VLLM_BOUNDS = {"qwen3_vl": (1e-4, 0.05), "qwen3_5": (0.05, 0.05), "qwen3_vl_moe": (1e-4, 0.05),
               "qwen3_5_moe": (1.0, 1.0), "glm4v": (1e-4, 1e-4)}  # fmt: skip


# The share of (token, layer) pairs whose experts (the router's top-k set) differ between vLLM and the trainer over
# the same sequences after the sync (routing.agreement; text tokens, vision tokens, the answers' tokens). fp32 on both
# sides routes every token alike (measured 0 of ~1,400 pairs each); Qwen3.5-MoE's bf16 engine routes ~1% of text
# pairs and up to 1.8% of an answer's otherwise (0 of the vision tokens'). Before the sync the trainer's perturbed
# routers pick other experts for 73-96% of them: the measure does see a mismatch.
ROUTING_BOUNDS = {"qwen3_vl_moe": 0.01, "qwen3_5_moe": 0.05}


@pytest.fixture(scope="module", params=sorted(VLLM_BOUNDS))
def vllm_run(request, tiny_family_dir, tmp_path_factory):
    family = request.param
    out = tmp_path_factory.mktemp(f"vllm_{family}")
    torchrun(2, "tests/vllm_check.py", tiny_family_dir(family), str(out), "1")
    return family, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_vllm_logprobs_equal_the_trainers_after_sync(vllm_run):
    """Guards against a family whose weights vLLM's loader does not take under transformers' in-memory names (the
    sync would leave the engine on the checkpoint's weights), whose vision tower or deepstack mergers differ between
    the two, or whose vision tokens are not forbidden: vLLM's log-probs of its own samples after a sync of perturbed
    weights must be the trainer's, and no vision token is ever sampled. An MoE's experts must reach vLLM one expert
    at a time (per-expert tensors, from the rank that holds each), never as a gathered 3-D parameter, and land in the
    right experts: a transposed or misplaced expert moves the log-probs by far more than the bounds. An MoE engine
    must pick the trainer's experts for the same token (ROUTING_BOUNDS), and, for the measure to mean anything, most
    of its picks must differ from the perturbed trainer's before the sync. An fp32 engine keeps its linear layers'
    weights for torch's matmul (vllm_compat.torch_cpu_linear). And a weight the sync does not reach (after a level-2
    sleep, uninitialised memory) is caught: before the first sync every engine parameter was NaN and every layer's
    matmul returned NaN (vllm_check.discard_weights), the buffers left alone; the log-probs after it are finite."""
    family, ranks = vllm_run
    text_bound, image_bound = VLLM_BOUNDS[family]
    fp32 = families.FAMILIES[family].vllm_cpu_dtype == torch.float32
    kinds = ("text", "image", "video") if families.FAMILIES[family].videos else ("text", "image")
    for rank in ranks:
        floating, other, kernels = rank["discarded"]
        assert floating > 40 and other == 0 and kernels >= 10, rank["discarded"]
        assert all(math.isfinite(rank[f"diff_{k}"]) for k in kinds), rank
        layers, packed = rank["linear_kernels_after_sync"]
        assert layers >= 10 and (packed == 0 or not fp32), (layers, packed)
        if family.endswith("_moe"):  # 2 layers x 4 experts x (gate, up, down)
            assert (rank["synced_per_expert"], rank["synced_fused_experts"]) == (2 * 4 * 3, 0)
        else:
            assert rank["synced_per_expert"] == rank["synced_fused_experts"] == 0
        assert rank["over_text"] <= 0.1 and rank["over_image"] <= 0.1, (rank["over_text"], rank["over_image"])
        assert rank["over_before_sync"] > 0.5, rank["over_before_sync"]
        assert rank["diff_before_sync"] > 0.5  # the perturbation is visible before the sync
        assert rank["diff_text"] <= text_bound, rank["diff_text"]
        assert rank["diff_image"] <= image_bound, rank["diff_image"]
        assert "video" not in kinds or rank["diff_video"] <= image_bound, rank["diff_video"]
        assert rank["vision_tokens_unbiased"] > 5 and rank["vision_tokens"] == 0
        assert rank["prompt_index"] == [p for p in range(4) for _ in range(4)]
        assert rank["repeat_equal"] and not rank["other_seed_equal"]
    if family.endswith("_moe"):
        routing_mismatch(family, ranks)
    most = {k: max(r[f"diff_{k}"] for r in ranks) for k in kinds}
    over = max(max(r["over_text"], r["over_image"]) for r in ranks)
    before = min(r["over_before_sync"] for r in ranks)
    print(f"{family}: vLLM (its weights NaN before the first sync) vs trainer max |dlogp| "
          + ", ".join(f"{k} {v:.1e}" for k, v in most.items())
          + f"; share of tokens over 0.05: {over:.3f} (before the sync {before:.2f})")  # fmt: skip


def routing_mismatch(family, ranks):
    kinds = ("text", "vision", "answer")
    for rank in ranks:
        after, before = rank["routing"], rank["routing_before_sync"]
        assert min(after[f"{k}_tokens"] for k in kinds) > 50, after  # every kind of token is in the sequences
        assert max(after[k] for k in kinds) <= ROUTING_BOUNDS[family], after
        assert min(before[k] for k in kinds) > 0.5, before
    after = {k: max(r["routing"][k] for r in ranks) for k in kinds}
    before = {k: min(r["routing_before_sync"][k] for r in ranks) for k in kinds}
    print(f"{family}: share of (token, layer) pairs routed to other experts by vLLM than by the trainer: "
          + ", ".join(f"{k} {v:.4f}" for k, v in after.items())
          + " (before the sync " + ", ".join(f"{k} {v:.2f}" for k, v in before.items()) + ")")  # fmt: skip


@pytest.fixture(scope="module")
def lora_moe_run(tiny_family_dir, tmp_path_factory):
    """tests/vllm_check.py's `lora` mode on the tiny Qwen3.5-MoE (one launch for both tests below)."""
    out = tmp_path_factory.mktemp("vllm_lora_moe")
    torchrun(2, "tests/vllm_check.py", tiny_family_dir("qwen3_5_moe"), str(out), "1", "lora")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_lora_resync_of_an_moe_leaves_its_experts_as_they_are(lora_moe_run):
    """Guards against a LoRA resync that breaks an MoE engine: with adapters on attention, Qwen3.5-MoE's shared
    expert (down_proj) and the tower, a resync sends those modules only, never the experts, and the engine's MoE
    layers, which get nothing, must keep their CPU kernels (one dropped for a reload that sends nothing would leave
    the layer without one). The log-probs after the resync are the trainer's, to bf16 with its routing flips."""
    for rank in lora_moe_run:
        assert rank["resynced"] and not any(".experts." in n for n in rank["resynced"])
        assert any(".shared_expert.down_proj." in n for n in rank["resynced"])
        assert "forget_cpu_moe_kernels" not in rank["resync_applied"]
        assert rank["over_before_sync"] > 0.5 and rank["over_text"] <= 0.1 and rank["over_image"] <= 0.1
        assert max(rank["diff_text"], rank["diff_image"], rank["diff_video"]) <= VLLM_BOUNDS["qwen3_5_moe"][0]


def test_lora_on_the_experts_resyncs_them_one_expert_at_a_time(lora_moe_run):
    """Guards against adapters on the routed experts (target `experts`) that the engine never sees, or sees wrong: a
    resync must send the MLPs that hold them, the experts merged and one expert at a time (per-expert names, never a
    gathered 3-D parameter), drop the engine's CPU MoE kernels first, and leave the engine's log-probs the
    trainer's, to the family's bound, where before the resync they were not."""
    text_bound, image_bound = VLLM_BOUNDS["qwen3_5_moe"]
    for rank in lora_moe_run:
        sent = rank["experts/resynced"]
        assert sum(bool(moe.PER_EXPERT.match(n)) for n in sent) == 2 * 4 * 3  # 2 layers x 4 experts x gate, up, down
        assert not any(moe.EXPERT_PARAM.match(n) for n in sent)
        assert any(n.endswith(".mlp.gate.weight") for n in sent)  # the rest of each adapted MLP goes with them
        assert "forget_cpu_moe_kernels" in rank["experts/applied"]
        assert rank["experts/over_before_sync"] > 0.5
        assert rank["experts/over_text"] <= 0.1 and rank["experts/over_image"] <= 0.1
        assert rank["experts/diff_text"] <= text_bound and rank["experts/diff_image"] <= image_bound
    print("qwen3_5_moe, LoRA on the experts: vLLM vs trainer max |dlogp| "
          + ", ".join(f"{k} {max(r[f'experts/diff_{k}'] for r in lora_moe_run):.1e}" for k in ("text", "image"))
          + "; share of tokens over 0.05: "
          + f"{max(max(r['experts/over_text'], r['experts/over_image']) for r in lora_moe_run):.3f} "
          + f"(before the resync {min(r['experts/over_before_sync'] for r in lora_moe_run):.2f})")  # fmt: skip


# (Of the MoE families only Qwen3.5-MoE, whose path has the most of its own -- linear attention, a shared expert, an
# engine in bf16 that routes some tokens otherwise -- to keep the suite's time: Qwen3-VL-MoE learns as well when run,
# 0.029 -> 0.881.)
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5", "qwen3_5_moe"])
def test_two_ranks_with_vllm_learn_toy_reward(tiny_family_dir, tmp_path, family):
    """Guards against a family that loads, shards and samples but does not learn: FSDP2 units that leave a part
    unsharded or untrained, a sync that silently fails (the engine keeps sampling from the initial model), packed
    positions or linear-attention state that make the trainer's log-probs of the samples wrong. The MoE run adds the
    experts' load-balancing loss, which must reach the update under FSDP2 and activation checkpointing and be logged
    (at perfect balance it is top-k = 2; it cannot exceed the 4 experts). With activation checkpointing, as the
    family's recipe runs (the tiny configs leave it off): the recompute of linear attention and of the experts."""
    from tests.test_vllm import first_and_last, toy_run

    moe_args = ["actor.router_aux_loss_coef=1e-3", "algorithm.routing_replay=r3"] if family.endswith("_moe") else []
    rows = toy_run(
        tiny_family_dir(family), tmp_path, "trainer.val_freq=0", "actor.gradient_checkpointing=true", *moe_args
    )
    first, last = first_and_last(rows)
    print(f"{family}: toy reward first 5 steps {first:.3f}, last 5 {last:.3f}")
    assert last >= first + 0.2, (first, last)
    # the engine/trainer mismatch of the image prompts is logged per modality for every family, MoE included
    assert all(math.isfinite(r["rollout/mismatch_kl/image"]) for r in rows)
    aux = [r.get("actor/router_aux_loss") for r in rows]
    print(f"{family}: actor/router_aux_loss {aux}")
    assert all(0.5 < x <= 4.0 for x in aux) if moe_args else aux == [None] * len(rows), aux
    if moe_args:  # routing replay: every token but each answer's last routed as the engine recorded
        disagree = [r["moe/routing_disagreement"] for r in rows]
        print(f"{family}: moe/routing_disagreement {min(disagree):.4f} to {max(disagree):.4f} (bf16 engine)")
        assert all(r["moe/replayed_tokens"] > 0 for r in rows) and max(disagree) < 0.1, disagree
        assert all(r["moe/own_routed_tokens"] == 0 for r in rows)  # the re-prefill forwards every token


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("size", [(1, 1), (5, 3), (1, 300), (1, 100_000), (3000, 2000)])
def test_images_are_fitted_to_the_familys_patch(tiny_family_dir, family, size):
    """Guards against fitting images to Qwen2.5-VL's 28 px for a family whose merged token is 32 px (patch 16 x
    merge 2): a strip padded to 28 px is below one token of Qwen3-VL/Qwen3.5, and the processor then stretches it.
    The prompt-length filter's token count must also be what the processor makes of the fitted image."""
    from PIL import Image
    from transformers import AutoProcessor

    from grpo import media

    processor = AutoProcessor.from_pretrained(tiny_family_dir(family))
    side = media.image_side(processor.image_processor)
    assert side == families.FAMILIES[family].image_side == (28 if family in ("qwen2_5_vl", "glm4v") else 32)
    min_pixels, max_pixels = 56 * 56, 112 * 112
    media.set_pixel_range(processor, min_pixels, max_pixels)
    img = media.fit_image(Image.new("L", size, 128), min_pixels, max_pixels, side)
    assert min(img.size) >= side and max(img.size) / min(img.size) < 200
    grid = processor.image_processor(images=[img])["image_grid_thw"][0]
    counted = media.image_token_count(processor.image_processor, *size, min_pixels, max_pixels)
    assert int(grid.prod()) // processor.image_processor.merge_size**2 == counted


def test_what_glm4v_cannot_do_yet_is_refused_at_the_dry_run(tiny_family_dir, tmp_path, capsys, monkeypatch):
    """Guards against a GLM-4.1V run that starts and fails later (or trains wrong) on what the family does not have
    yet: sequence parallelism, tool turns (written in Qwen's chat format), videos (GLM writes a video as timestamped
    image blocks, which the trainer's video path does not build) -- asked by the config, or brought by the data with
    rollout.max_videos_per_prompt at -1. Each stops the dry run in one line naming its key; the same run without them
    passes every check."""
    import train_grpo
    from scripts.make_synthetic_data import make_geo3k_like, make_mixed_media

    images = make_geo3k_like(str(tmp_path / "images.parquet"), n_rows=32, seed=0)
    mixed = make_mixed_media(str(tmp_path / "mixed.parquet"), n_rows=32, seed=0)
    monkeypatch.setattr(train_grpo, "setup_distributed", lambda *a: pytest.fail("a dry run formed a process group"))

    def dry_run(data, *overrides):
        args = ["configs/tiny.yaml", f"actor.model_path={tiny_family_dir('glm4v')}", f"data.train_files={data}",
                f"data.val_files={data}", *overrides, "--dry-run"]  # fmt: skip
        code = train_grpo.main(args)
        out = capsys.readouterr()
        return code, out.out + out.err

    code, out = dry_run(images)
    assert code == 0 and "dry run: 6 of 6 checks passed" in out, out
    asks = [
        (images, "actor.sequence_parallel_size=2", "actor.sequence_parallel_size=2"),
        (images, "rollout.tools=[grpo/tools.py:crop]", "rollout.tools=['grpo/tools.py:crop']"),
        (images, "rollout.max_videos_per_prompt=1", "rollout.max_videos_per_prompt=1"),
        (mixed, "rollout.max_videos_per_prompt=-1", "rollout.max_videos_per_prompt=1"),  # (-1: the data's most)
    ]
    for data, override, key in asks:
        code, out = dry_run(data, override)
        assert code != 0 and f"{key}: a glm4v model cannot train with" in out, (override, out)
    # a checkpoint whose config.json lacks attention_bias: vLLM would load and sync it without its q/k/v biases
    # (vllm_check measured 0.9 after the sync), while transformers' model, and so the HF engine, has them
    unbiased = shutil.copytree(tiny_family_dir("glm4v"), tmp_path / "unbiased")
    config = json.loads((unbiased / "config.json").read_text())
    del config["text_config"]["attention_bias"]
    (unbiased / "config.json").write_text(json.dumps(config))
    code, out = dry_run(images, f"actor.model_path={unbiased}")
    assert code != 0 and "rollout.engine=vllm: the checkpoint's text_config has attention_bias=None" in out, out
    code, out = dry_run(images, f"actor.model_path={unbiased}", "rollout.engine=hf")
    assert code == 0, out


def test_glm4v_with_lora_and_vllm_learns_toy_reward(tiny_family_dir, tmp_path):
    """Guards against a GLM-4.1V loop that runs but does not learn: adapters on its fused gate_up_proj that the
    engine never sees (the merged resync sends the modules LoRA changes, under names vLLM's glm4_1v loader takes), a
    packed forward or an image token of the wrong family (the engine's log-probs would drift from the trainer's), and
    a final export in other names than the checkpoint's. Two ranks, vLLM, packed micro-batches, activation
    checkpointing."""
    from safetensors.torch import load_file

    from tests.test_vllm import first_and_last, toy_run

    path = tiny_family_dir("glm4v")
    targets = "actor.lora_target_modules=[q_proj,k_proj,v_proj,o_proj,gate_up_proj,down_proj,lm_head]"
    rows = toy_run(path, tmp_path, "trainer.val_freq=0", "actor.gradient_checkpointing=true", "actor.lora_rank=8",
                   "actor.lora_alpha=16", "actor.lr=1e-2", targets)  # fmt: skip
    first, last = first_and_last(rows)
    diff = max(r["rollout/logprob_diff_max"] for r in rows)
    print(f"glm4v LoRA: toy reward first 5 steps {first:.3f}, last 5 {last:.3f}; engine vs trainer max |dlogp| {diff}")
    assert last >= first + 0.2, (first, last)
    assert diff <= 1e-3, diff  # fp32 on both sides: each step's samples scored alike after each resync
    final, initial = (
        load_file(str(tmp_path / "run" / "hf" / "model.safetensors")),
        load_file(f"{path}/model.safetensors"),
    )
    assert sorted(final) == sorted(initial)
    layer = "model.language_model.layers.1"
    for key in (f"{layer}.mlp.gate_up_proj.weight", f"{layer}.self_attn.q_proj.weight", "lm_head.weight"):
        assert not torch.equal(final[key], initial[key]), key
    assert torch.equal(final[f"{layer}.input_layernorm.weight"], initial[f"{layer}.input_layernorm.weight"])


def _gemma4_batch(processor):
    """Two prompts, one with an image (its soft tokens and the text after them past the tiny model's 32-token sliding
    window) and one text-only, and answers of uneven lengths, as samples.Prompt."""
    from PIL import Image, ImageDraw

    from grpo.samples import Prompt

    prompts = []
    for i, with_image in enumerate((True, False)):
        content = [{"type": "text", "text": "Find x. " * (2 + 3 * i)}]
        images = []
        if with_image:
            img = Image.new("RGB", (150, 90), "white")
            ImageDraw.Draw(img).line((0, 0, 80, 60), fill="black", width=5)
            content.insert(0, {"type": "image"})
            images = [img]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        out = processor(text=[text], images=images or None, return_tensors="pt")
        prompts.append(Prompt(out["input_ids"][0], out.get("pixel_values"), None, images,
                              token_types=out["mm_token_type_ids"][0],
                              image_position_ids=out.get("image_position_ids")))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(5, 400, (n,), generator=g).tolist() for n in (11, 4)]
    return prompts, responses


@pytest.mark.parametrize("family, cap", [("gemma4", None), ("gemma4", 0.5), ("gemma4_moe", None)])
def test_gemma4_padded_logprobs_equal_transformers_forward(tiny_family_dir, family, cap):
    """Guards against the trainer's log-prob head leaving out Gemma 4's final logit soft-capping, or capping the
    log-probs it returns (the model's forward caps whatever its LM head gives), and against the padded batch
    (left-padded prompts, per-layer input embeddings from the ids, the image's soft tokens, a sliding window) giving
    other log-probs than transformers' own forward of each sequence alone: log_softmax of its logits / temperature.
    At the checkpoint's cap (30) and at 0.5, where capping moves every logit. The reference runs transformers' own
    sdpa, with its own sliding-window masks (the packed rows are held to this padded batch in
    test_gemma4_packed_and_shared_prefixes_equal_padded). The mixture of experts (26B-A4B's block beside each MLP)
    loads as an MoE: its experts computed by the experts_implementation the trainer picks for the device (the loop on
    CPU)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = tiny_family_dir(family)
    processor = AutoProcessor.from_pretrained(path)
    model = loading.load_model(path, torch.device("cpu"), "sdpa")
    if family == "gemma4_moe":
        assert families.family(model).moe and model.model.language_model.config._experts_implementation == "eager"
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    if cap is not None:
        model.config.text_config.final_logit_softcapping = cap
        reference.config.text_config.final_logit_softcapping = cap
    cap = model.config.text_config.final_logit_softcapping
    assert model.config.model_type == "gemma4" and cap is not None
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied, as the real checkpoints'
    forbidden = torch.tensor(processor.tokenizer.convert_tokens_to_ids(list(families.GEMMA_VISION_TOKENS)))
    assert sorted(model.forbidden_token_ids.tolist()) == sorted(forbidden.tolist())
    prompts, responses = _gemma4_batch(processor)
    assert prompts[0].image_position_ids is not None and len(prompts[0].input_ids) > 32  # the window is exercised
    inputs, response_ids, mask = batching.collate(prompts, responses, processor.tokenizer.pad_token_id,
                                                  model.config.image_token_id)  # fmt: skip
    temperature = 0.9
    with torch.no_grad():
        logp, ent = logprobs.forward_logprobs(model, inputs, response_ids, temperature, with_entropy=True)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            ids = torch.cat([p.input_ids, torch.tensor(r)])[None]  # (1, P + R)
            vision = {"pixel_values": p.pixel_values, "image_position_ids": p.image_position_ids}
            vision = {k: v for k, v in vision.items() if v is not None}
            types = torch.cat([p.token_types, torch.zeros(len(r), dtype=torch.long)])[None]  # (1, P + R)
            out = reference(input_ids=ids, mm_token_type_ids=types, **vision)
            logits = out.logits[0, len(p.input_ids) - 1 : -1]  # (R, V), capped by the model
            # the image, video and audio markers are out of the softmax, as both engines leave them out of sampling
            ref = (logits.float() / temperature).index_fill(-1, forbidden, -torch.inf).log_softmax(-1)  # (R, V)
            want = ref.gather(-1, torch.tensor(r)[:, None])[:, 0]  # (R,)
            torch.testing.assert_close(logp[i, : len(r)], want, rtol=1e-5, atol=1e-5)
            entropy = -(ref.exp() * ref.clamp(min=torch.finfo(torch.float32).min)).sum(-1)  # (R,)
            torch.testing.assert_close(ent[i, : len(r)], entropy, rtol=1e-5, atol=1e-5)
            assert (logits.abs() <= cap).all()
    assert mask.sum() == sum(map(len, responses))


def _flat_relative(got: dict, want: dict) -> float:
    """|got - want| / |want| over all the gradients as one vector."""
    diff = sum(((got[n] - want[n]) ** 2).sum() for n in want) ** 0.5
    return (diff / sum((want[n] ** 2).sum() for n in want) ** 0.5).item()


@pytest.mark.parametrize("attn_implementation", ["sdpa", "varlen_packed"])
@pytest.mark.parametrize("bidirectional", [None, "vision"])
@pytest.mark.parametrize("family", ["gemma4", "gemma4_moe"])
def test_gemma4_packed_and_shared_prefixes_equal_padded(tiny_family_dir, monkeypatch, family, bidirectional,
                                                        attn_implementation):  # fmt: skip
    """Guards against Gemma 4's packed rows attending other than its padded batch does: a sliding-window layer that
    sees past its window (the tiny model's is 32 tokens; its image prompt is 82 and answers run to 40, so windows
    reach back into a shared prompt), an image's soft tokens that do not see each other both ways in the sliding
    layers of a checkpoint asking use_bidirectional_attention="vision" (the 26B-A4B's and 31B's; transformers' own
    padded masks are the reference), or do so in its full-attention layers, and 1-D positions that do not restart
    per sequence or continue a shared prompt. Unshared and shared-prefix packing, log-probs, entropies and
    gradients, on CPU and on the CUDA path with torch 2.14's varlen_attn signature: its sliding layers ask the
    kernel for the window, and with image blocks go a segment at a time (the kernel has no such mask)."""
    import torch.nn.attention.varlen
    from transformers import AutoProcessor

    from tests.test_varlen import _varlen_attn_2_14

    windows = []

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None,
                    num_splits=None):  # fmt: skip
        windows.append(tuple(window_size))
        return _varlen_attn_2_14(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                 window_size=window_size, enable_gqa=enable_gqa)  # fmt: skip

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", varlen_attn)
    path = tiny_family_dir(family)
    processor = AutoProcessor.from_pretrained(path)
    # in float64: float32's own rounding moves these gradients by 2e-5 (1.6e-4 from float64's), float64's by 1e-7
    model = loading.load_model(path, torch.device("cpu"), attn_implementation).to(torch.float64)
    text_config = model.config.text_config
    window = text_config.sliding_window
    assert window == 32 and "full_attention" in text_config.layer_types
    a, b = _gemma4_batch(processor)[0]
    order = [a, a, a, b, b, a]  # a group of three answers, one of two, and an answer of the first prompt alone
    g = torch.Generator().manual_seed(1)
    responses = [torch.randint(5, 400, (n,), generator=g).tolist() for n in (40, 1, 25, 37, 3, 6)]
    image_token_id = model.config.image_token_id
    layouts = {
        "padded": batching.collate(order, responses, processor.tokenizer.pad_token_id, image_token_id),
        "packed": batching.pack(order, responses, image_token_id),
        "shared": batching.pack(order, responses, image_token_id, share_prompts=True),
    }
    for inputs, _, _ in layouts.values():
        inputs["pixel_values"] = inputs["pixel_values"].double()
    results = {}
    for causal_check in (False, True) if bidirectional else (False,):
        text_config.use_bidirectional_attention = None if causal_check else bidirectional
        for name, (inputs, response_ids, mask) in layouts.items():
            if causal_check and name != "padded":
                continue
            windows.clear()
            model.zero_grad(set_to_none=True)
            logp, ent = logprobs.forward_logprobs(model, inputs, response_ids, 0.9, True, True)
            ((logp * mask).sum() + 0.1 * (ent * mask).sum()).backward()
            results["causal" if causal_check else name] = (logp.detach() * mask, ent.detach() * mask, _grads(model))
            if name != "padded" and attn_implementation == "varlen_packed":
                # two sliding layers, two full ones; forward and the recompute-free backward: one call a layer
                sliding = [] if bidirectional else [(window - 1, 0)] * 2
                assert sorted(windows) == sorted([(-1, 0)] * 2 + sliding), windows
    logp_ref, ent_ref, grads_ref = results["padded"]
    for name in ("packed", "shared"):
        logp, ent, grads = results[name]
        torch.testing.assert_close(logp, logp_ref, rtol=1e-7, atol=1e-7, msg=name)
        torch.testing.assert_close(ent, ent_ref, rtol=1e-7, atol=1e-7, msg=name)
        assert grads.keys() == grads_ref.keys() and any("vision_tower" in n for n in grads), name
        relative = _flat_relative(grads, grads_ref)
        assert relative <= 1e-6, (name, relative)  # the head's float32 log-softmax: 1e-7; a wrong mask: 1e-2
        print(f"{family} {bidirectional} {attn_implementation} {name} vs padded: max |dlogp| "
              f"{(logp - logp_ref).abs().max():.1e}, gradients {relative:.1e} relative")  # fmt: skip
    if bidirectional:  # the image block moves this batch's log-probs: the comparison above saw it
        assert (results["causal"][0] - logp_ref).abs().max() > 1e-2


def test_gemma4_soft_token_budget_is_data_max_soft_tokens(tiny_family_dir, tmp_path):
    """Guards against data.max_soft_tokens that does not reach Gemma 4's processor (every image would stay at the
    checkpoint's budget whatever the config says), a prompt-length count that misses it (each row would be counted at
    one budget and encoded at another: every one skipped as a bad row), and a budget the processor cannot take, or
    one asked of a family that has none, passing silently."""
    from transformers import AutoProcessor

    from data import PromptDataset
    from grpo.samples import encode_prompt
    from scripts.make_synthetic_data import make_geo3k_like

    rows = make_geo3k_like(str(tmp_path / "rows.parquet"), n_rows=4, seed=0)
    image_tokens = {}
    for budget in (0, 140):
        processor = AutoProcessor.from_pretrained(tiny_family_dir("gemma4"))
        dataset = PromptDataset(rows, processor, max_soft_tokens=budget)
        assert dataset.n_skipped == 0 and len(dataset) == 4
        prompt = encode_prompt(processor, dataset[0])
        assert len(prompt.input_ids) == dataset[0].num_prompt_tokens
        image_tokens[budget] = int((prompt.token_types == 1).sum())
    assert processor.image_processor.max_soft_tokens == 140
    # the checkpoint's own is 70: a budget twice that gives each image about twice the soft tokens
    assert 1.5 * image_tokens[0] < image_tokens[140] <= 140, image_tokens
    refusals = ((tiny_family_dir("gemma4"), 100, "Gemma 4 takes one of (70, 140, 280, 560, 1120)"),
                (tiny_family_dir("qwen2_5_vl"), 70, "only a Gemma 4 checkpoint's processor"))  # fmt: skip
    for path, budget, message in refusals:
        with pytest.raises(ValueError, match=rf"data\.max_soft_tokens={budget}: {re.escape(message)}"):
            PromptDataset(rows, AutoProcessor.from_pretrained(path), max_soft_tokens=budget)


def test_what_gemma4_cannot_do_yet_is_refused_at_the_dry_run(tiny_family_dir, tmp_path, capsys, monkeypatch):
    """Guards against a Gemma 4 run that starts and fails later, or trains wrong, on what the family does not have
    yet: sequence parallelism, tool turns, videos, LoRA in its vision tower. Each stops the dry run in one line naming
    its key, before anything loads; otherwise the dry run plans (the memory plan counts the family) and passes, with
    either engine, packed or padded. The load-balancing loss and routing replay are refused on the dense model and
    plan and pass on the mixture of experts, whose LoRA on its routed experts is refused."""
    import train_grpo
    from scripts.make_synthetic_data import make_geo3k_like

    images = make_geo3k_like(str(tmp_path / "images.parquet"), n_rows=32, seed=0)
    monkeypatch.setattr(train_grpo, "setup_distributed", lambda *a: pytest.fail("a dry run formed a process group"))
    path = tiny_family_dir("gemma4")

    def dry_run(*overrides):
        args = ["configs/tiny.yaml", f"actor.model_path={path}", f"data.train_files={images}",
                f"data.val_files={images}", *overrides, "--dry-run"]  # fmt: skip
        code = train_grpo.main(args)
        out = capsys.readouterr()
        return code, out.out + out.err

    asks = [
        (("actor.sequence_parallel_size=2",), "actor.sequence_parallel_size=2: a gemma4 model cannot"),
        (("rollout.tools=[grpo/tools.py:crop]",), "rollout.tools=['grpo/tools.py:crop']: a gemma4 model cannot"),
        (("rollout.max_videos_per_prompt=1",), "rollout.max_videos_per_prompt=1: a gemma4 model cannot"),
        (
            ("actor.lora_rank=8", "actor.lora_target_modules=[q_proj,visual.q_proj]"),
            "actor.lora_target_modules=['q_proj', 'visual.q_proj']: a gemma4 model cannot train with adapters in its "
            "vision tower",
        ),
    ]
    for ask in ("actor.router_aux_loss_coef=1e-3", "algorithm.routing_replay=r3"):  # the dense model has no experts
        asks.append(((ask,), "routed experts; a gemma4 model has none"))
    moe = (f"actor.model_path={tiny_family_dir('gemma4_moe')}",)
    experts = ("actor.lora_rank=8", "actor.lora_target_modules=[q_proj,experts]", "actor.lora_dropout=0")
    asks.append(((*moe, *experts), "a gemma4 model cannot train with adapters on its routed experts"))
    for overrides, refusal in asks:
        code, out = dry_run(*overrides)
        assert code != 0 and refusal in out, (overrides, out)
    # packed or padded, either engine: the plan counts the family, and every check passes
    padded = (
        "actor.padding_free=false",
        "actor.max_tokens_per_micro_batch=0",
        "actor.max_tokens_per_micro_batch_no_grad=0",
    )
    balanced = ("actor.router_aux_loss_coef=1e-3", "algorithm.routing_replay=r3")
    for overrides in (("rollout.engine=hf",), ("rollout.engine=vllm", *padded), (*moe, "rollout.engine=vllm"),
                      (*moe, *balanced, "rollout.engine=vllm"), (*moe, *balanced, "rollout.engine=hf")):  # fmt: skip
        code, out = dry_run(*overrides)
        assert code == 0 and "memory plan, GiB per GPU" in out and "-> fits" in out, (overrides, out)


@pytest.mark.parametrize("family", ["gemma4", "gemma4_moe"])
def test_gemma4_vllm_logprobs_equal_the_trainers_after_sync(tiny_family_dir, family):
    """What the trainer's vLLM engine would need of vLLM 0.32's gemma4_mm, held before the engine takes the family:
    it loads the tiny model (its vision_config's default_output_length, which transformers' class lacks, sizes its
    encoder budget), takes the trainer's parameters under transformers' in-memory names (tied LM head, per-layer
    embeddings, the tower and its projection; reload_weights, as vllm_engine.sync_weights sends them), and its
    log-probs of its own samples, with the family's vision tokens forbidden, then equal the trainer's padded forward
    (soft-capped logits, text and image rows, fp32): 1e-4. Before the sync the perturbed trainer is far from it.
    The mixture of experts: its routers (scale, per-expert scale) and experts, sent one expert at a time under the
    per-expert names vLLM's fused-MoE loader takes, its CPU kernels forgotten first (without that, the reloaded
    experts were read as if prepacked: 0.54 off)."""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "tests/gemma4_vllm_check.py", tiny_family_dir(family)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    gaps = json.loads(proc.stdout.strip().splitlines()[-1])
    before, text, image = gaps["before"], gaps["text"], gaps["image"]
    print(f"{family}: vLLM vs trainer after a sync: text {text:.1e}, image {image:.1e}; before it {min(before):.2f}")
    assert min(before) > 0.1 and text <= 1e-4 and image <= 1e-4, (before, text, image)


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_gemma4_trains_on_two_ranks(tiny_family_dir, tmp_path, engine):
    """Guards against a Gemma 4 run that fails or scores wrong on two ranks: prompts without their
    image_position_ids, a rank without images whose blank tower pass is Qwen's or skips the soft-token projection
    (its own FSDP2 unit, which generate runs before the prefill: the collectives fall out of step or a parameter is
    read unsharded), and an export in other names than the checkpoint's. (Left pads that shifted the 1-D positions
    made the engine's log-probs drift from the trainer's by 1.7e-4 in a full fine-tuning run by hand, 6.2e-6 since
    the positions count from each sequence's first token; here both score the same micro-batches.) With vLLM: a
    sync that does not reach its gemma4_mm (the engine's log-probs at step 2 would be the first step's weights'), an
    image sent other than as the template's one <|image|> (its markers would come twice). The HF engine two steps
    with LoRA on the decoder (whose shared-k/v layers have no k_proj / v_proj), packed rows with shared prefixes;
    vLLM 15 steps of full fine-tuning on padded micro-batches, which must learn the toy reward, as the other
    families' vLLM runs do (LoRA, which cannot reach the tied head, stayed at the first steps' reward over 20 steps by
    hand, at lr 1e-2 and 5e-2)."""
    from safetensors.torch import load_file

    from scripts.make_synthetic_data import make_geo3k_like

    path = tiny_family_dir("gemma4")
    train = make_geo3k_like(str(tmp_path / "train.parquet"), n_rows=16, seed=0)
    out_dir = tmp_path / "run"
    unpacked = ("actor.padding_free=false", "actor.shared_prefix=false", "actor.max_tokens_per_micro_batch=0",
                "actor.max_tokens_per_micro_batch_no_grad=0")  # fmt: skip
    # (vLLM: seeds 1-3 by hand learnt in 15 steps at 2e-2; at 1e-2 seed 2 needed 18 steps to pass half the reward)
    steps, tuning = (
        (2, ("actor.lora_rank=8", "actor.lr=1e-2")) if engine == "hf" else (15, ("actor.lr=2e-2", *unpacked))
    )
    torchrun(2, "train_grpo.py", "configs/tiny.yaml", f"rollout.engine={engine}", f"actor.model_path={path}",
             f"data.train_files={train}", "data.val_files=", f"trainer.output_dir={out_dir}",
             f"trainer.max_steps={steps}", "data.rollout_batch_size=4", "rollout.n=4", "actor.global_batch_size=4",
             "actor.micro_batch_size=8", *tuning)  # fmt: skip
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    diff = max(r["rollout/logprob_diff_max/image"] for r in rows)  # every prompt has an image
    print(f"gemma4 {engine} engine, 2 ranks: engine vs trainer max |dlogp| {diff:.1e}")
    assert diff <= 1e-4, diff
    if engine == "vllm":
        from tests.test_vllm import first_and_last

        first, last = first_and_last(rows)
        print(f"gemma4: toy reward first 5 steps {first:.3f}, last 5 {last:.3f}")
        assert last >= first + 0.2, (first, last)
    final, initial = load_file(str(out_dir / "hf" / "model.safetensors")), load_file(f"{path}/model.safetensors")
    assert sorted(final) == sorted(initial)
    layer = "model.language_model.layers.0"
    assert not torch.equal(final[f"{layer}.self_attn.q_proj.weight"], initial[f"{layer}.self_attn.q_proj.weight"])


def test_gemma4_freeze_vision_tower_freezes_its_tower_and_projection(tiny_family_dir, one_rank_group):
    """Guards against actor.freeze_vision_tower reaching for Qwen's model.visual on Gemma 4 (an AttributeError at
    load), or freezing its tower but training the soft-token projection beside it (embed_vision, Qwen's merger's
    part), or freezing a decoder layer."""
    model = loading.load_sharded(tiny_family_dir("gemma4"), torch.device("cpu"), "sdpa", freeze_vision_tower=True)
    vision = ("model.vision_tower.", "model.embed_vision.")
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in model.named_parameters() if n.startswith(vision)}, frozen
    assert any(n.startswith("model.embed_vision.") for n in frozen)
