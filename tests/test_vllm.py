"""The vLLM rollout engine (vLLM's CPU build, in-process under torchrun) against the FSDP2 trainer."""

import glob
import json
import math
import os

import pytest
import torch

from tests.launch import torchrun


def _check(tiny_model_dir, tmp_path_factory, tp, *extra):
    out = tmp_path_factory.mktemp(f"vllm_tp{tp}")
    torchrun(2, "tests/vllm_check.py", tiny_model_dir, str(out), str(tp), *extra)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def tp1(tiny_model_dir, tmp_path_factory):
    return _check(tiny_model_dir, tmp_path_factory, tp=1)


@pytest.fixture(scope="module")
def tp2(tiny_model_dir, tmp_path_factory):
    return _check(tiny_model_dir, tmp_path_factory, tp=2)


def test_collapsed_prompt_is_the_chat_template_prompt(tiny_processor):
    """Guards against sending vLLM processor-expanded image pads, which it expands again (a corrupted prompt)."""
    from PIL import Image

    from grpo.samples import collapse_image_pads

    text = tiny_processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}, {"type": "image"}]}],
        add_generation_prompt=True,
    )
    images = [Image.new("RGB", (100, 80), "white"), Image.new("RGB", (60, 60), "white")]
    expanded = tiny_processor(text=[text], images=images)["input_ids"][0]
    pad = tiny_processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert expanded.count(pad) > 2  # really expanded
    assert collapse_image_pads(expanded, pad) == tiny_processor.tokenizer(text)["input_ids"]


def test_synced_engine_logprobs_equal_the_trainers(tp1):
    """Guards against a weight sync that does not reach vLLM (e.g. reload_weights without an iterator reloads the
    checkpoint), stale vision-encoder outputs after a sync, wrong vision buffers, or log-probs of another distribution:
    after perturbing the trainer and syncing, vLLM's log-probs of its own samples are the trainer's (fp32), on text,
    image and video prompts (videos: vLLM must get the trainer's frames, timing and positions). And against a weight the
    sync does not reach, which after a level-2 sleep (full tuning's, on CUDA) holds uninitialised memory: before the
    first sync every parameter of the engine was NaN and every layer's matmul returned NaN (vllm_check.discard_weights),
    the buffers left as that sleep leaves them; the log-probs after it are finite and the trainer's."""
    for rank in tp1:
        floating, other, kernels = rank["discarded"]
        assert floating > 40 and other == 0 and kernels >= 10, rank["discarded"]
        assert all(math.isfinite(rank[f"diff_{k}"]) for k in ("text", "image", "video")), rank
        assert rank["diff_before_sync"] > 0.5  # the perturbation is visible before the sync
        assert rank["diff_text"] <= 1e-4 and rank["diff_text_t07"] <= 1e-4, rank
        assert rank["diff_image"] <= 0.05, rank["diff_image"]
        assert rank["diff_video"] <= 0.05, rank["diff_video"]  # the image bound; measured 1.4e-6


def test_the_engine_keeps_its_linear_weights_for_torchs_matmul(tp1, tp2):
    """Guards against vLLM's CPU build packing the fp32 engine's weights into oneDNN handlers (see
    vllm_compat.torch_cpu_linear): every weight sync builds them again, and each rollout then builds a matmul for each
    batch size anew. After the engine's load and after a sync, which sets every layer up again, each linear layer
    keeps its weights and computes with torch's matmul, as the trainer does."""
    for rank in tp1 + tp2:
        for key in ("linear_kernels_at_start", "linear_kernels_after_sync"):
            layers, packed = rank[key]
            assert layers >= 10 and packed == 0, (key, layers, packed)


def test_the_engines_image_cache_is_capped(tp1):
    """Guards against vLLM's default cache of processed images, up to 4 GiB of host memory per rank that epochs of
    images or a tool run's crops fill: the engine gets rollout.mm_cache_gb, which the memory plan counts."""
    assert [rank["mm_cache_gb"] for rank in tp1] == [1.0, 1.0]


def test_engine_is_shut_down_before_the_process_group(tp1, tp2):
    """Guards against a finished run leaving vLLM's engine alive when the process group goes: its groups, NCCL
    communicators and allocator pools would be torn down by exit hooks and destructors after what they use (a run that
    succeeded can abort). After distributed.shut_down, as the trainer ends, vLLM's model-parallel groups, its world
    group and the process group are all gone, at tensor parallel 1 and 2, and every rank exited 0."""
    for rank in tp1 + tp2:
        assert rank["after_shut_down"] == [False, False, False]


@pytest.fixture(scope="module")
def lora_tp1(tiny_model_dir, tmp_path_factory):
    return _check(tiny_model_dir, tmp_path_factory, 1, "lora")


def test_lora_sync_sends_merged_weights_and_only_what_changes(lora_tp1):
    """Guards against a LoRA sync that sends the base weights without the adapters (or unscaled, or PEFT's names that
    vLLM ignores), and against the later syncs, which skip weights LoRA cannot change, leaving part of a layer vLLM
    fuses (q/k/v, gate/up) uninitialised: adapters on q_proj, down_proj and the vision tower's qkv, perturbed and
    synced twice, then vLLM's log-probs of its own samples are the trainer's, with the tolerances of full tuning."""
    for rank in lora_tp1:
        assert rank["diff_before_sync"] > 0.5  # the adapters alone make the trainer differ from the checkpoint
        assert rank["diff_text"] <= 1e-4 and rank["diff_text_t07"] <= 1e-4, rank
        assert rank["diff_image"] <= 0.05, rank["diff_image"]
        resynced = set(rank["resynced"])
        assert not any("lora" in name or "base_layer" in name for name in resynced)
        # the second sync: the adapted modules with everything vLLM fuses them with, nothing else
        layer = "model.language_model.layers.0"
        for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.bias",
                     "mlp.down_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight"):  # fmt: skip
            assert f"{layer}.{name}" in resynced, name
        assert "model.visual.blocks.0.attn.qkv.weight" in resynced
        for name in (f"{layer}.input_layernorm.weight", "model.language_model.embed_tokens.weight",
                     "lm_head.weight", "model.visual.blocks.0.mlp.up_proj.weight"):  # fmt: skip
            assert name not in resynced, name


def test_vision_tokens_are_never_sampled(tp1):
    """Guards against sampling <|image_pad|> and friends, which breaks the next training forward ("Image features
    and image tokens do not match"). The tiny model's vocabulary is ~1.2% vision tokens, so the same requests
    without the bias do sample them."""
    for rank in tp1:
        assert rank["vision_tokens_unbiased"] > 5
        assert rank["vision_tokens"] == 0


def test_samples_are_prompt_major_and_reproducible_per_seed(tp1):
    """Guards against samples out of prompt order (advantages grouped over the wrong answers) and against sampling
    that a resumed run could not reproduce: same seed, same samples; another seed, others."""
    for rank in tp1:
        assert rank["prompt_index"] == [p for p in range(4) for _ in range(4)]
        assert rank["repeat_equal"] and not rank["other_seed_equal"]
    assert tp1[0]["image_samples"] != tp1[1]["image_samples"]


def test_tensor_parallel_group_keeps_each_ranks_own_samples(tp1, tp2):
    """Guards against the TP grouping (ranks pool their prompts, generate together, keep their own slice) handing a
    rank another rank's answers or seeds, and against a sync that breaks when vLLM shards the weights: with
    per-request seeds, TP=2 over 2 ranks must give each rank exactly what its own TP=1 engine gave it. And against
    ranks that end without the libraries' teardown: vLLM's CPU build then leaves its shared-memory segments, whose names
    repeat, and the next TP run on the machine fails to start (errno 17)."""
    assert not glob.glob("/dev/shm/*cpushm*")
    for single, grouped in zip(tp1, tp2):
        assert grouped["image_samples"] == single["image_samples"]
        assert grouped["diff_text"] <= 1e-4 and grouped["diff_image"] <= 0.05


# LoRA on the default targets and the LM head. With the tiny random model's head and final norm frozen, no hidden
# state gives its 10 digit tokens more than 6.4% of the probability (0.024 uniform; adapters on the decoder layers
# alone took the toy reward from 0.023 to 0.041 in 30 steps); the head's adapter learns it.
LORA = ["actor.lora_rank=8", "actor.lora_alpha=16", "actor.lr=1e-2",
        "actor.lora_target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]"]  # fmt: skip


def toy_run(model_dir, tmp_path, *overrides, real=False):
    """20 steps of configs/tiny.yaml (the toy reward) on 2 ranks with vLLM, into tmp_path/run (under torchrun itself
    with real=True); metrics.jsonl's rows of the 20 training steps."""
    from scripts.make_synthetic_data import make_geo3k_like

    train = make_geo3k_like(str(tmp_path / "train.parquet"), n_rows=96, seed=0)
    val = make_geo3k_like(str(tmp_path / "val.parquet"), n_rows=8, seed=1)
    out_dir = tmp_path / "run"
    torchrun(
        2, "train_grpo.py", "configs/tiny.yaml", "rollout.engine=vllm", f"actor.model_path={model_dir}",
        f"data.train_files={train}", f"data.val_files={val}", f"trainer.output_dir={out_dir}",
        "trainer.max_steps=20", "actor.lr=3e-3", *overrides, real=real,
    )  # fmt: skip
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in train_rows] == list(range(1, 21))
    return train_rows


def first_and_last(train_rows):
    """Mean reward/overall of the first and of the last 5 steps."""
    mean = lambda rows: sum(r["reward/overall"] for r in rows) / len(rows)  # noqa: E731
    return mean(train_rows[:5]), mean(train_rows[-5:])


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_end_to_end_two_ranks_with_vllm_learns_toy_reward(tiny_model_dir, tmp_path, lora):
    """Guards against a vLLM loop that runs but does not learn (a sync that silently fails leaves the engine
    sampling from the initial model) or whose samples are not the trainer's (logprob_diff). With LoRA: against
    adapters that stop learning (a gradient lost after the reference forwards), later syncs that skip what changed,
    and a final export that is not the merged model or has no adapter directory beside it, with gradient checkpointing
    (off in the tiny configs, on in the recipes) recomputing the adapted layers."""
    lora_args = [*LORA, "actor.gradient_checkpointing=true"] if lora else []
    # the full run under torchrun itself, the launch users make; the LoRA run forked by the rank server
    train_rows = toy_run(tiny_model_dir, tmp_path, "trainer.val_freq=10", *lora_args, real=not lora)
    for key in ("time/weight_sync", "time/wake", "time/sleep", "perf/rollout_tokens_per_s"):
        assert all(key in r for r in train_rows), key
    assert all(r["rollout/logprob_diff_mean"] <= 0.05 for r in train_rows)
    first, last = first_and_last(train_rows)
    print(f"vLLM {'LoRA' if lora else 'full'}: toy reward first 5 steps {first:.3f}, last 5 {last:.3f}")
    assert last >= first + 0.2, (first, last)
    out_dir = tmp_path / "run"
    if lora:  # the merged model in the checkpoint's names: the adapted weights moved, the frozen ones did not
        from safetensors.torch import load_file

        final = load_file(str(out_dir / "hf" / "model.safetensors"))
        initial = load_file(f"{tiny_model_dir}/model.safetensors")
        assert sorted(final) == sorted(initial)
        for key in ("lm_head.weight", "model.layers.1.mlp.down_proj.weight"):
            assert not torch.equal(final[key], initial[key]), key
        for key in ("model.embed_tokens.weight", "model.layers.1.input_layernorm.weight"):
            assert torch.equal(final[key], initial[key]), key
        assert sorted(os.listdir(out_dir / "adapter")) == ["adapter_config.json", "adapter_model.safetensors"]


def test_the_answers_of_a_prompt_share_its_prefill(tp1):
    """Guards against every answer prefilling its whole prompt again: prefix caching shares whole KV blocks only, and
    with vLLM's CPU default of 128-token blocks, longer than most prompts, the n answers of a prompt (and a partial
    rollout's continued answers) shared nothing. Each answer after the first of a prompt finds all the prompt's whole
    32-token blocks but the last token's in the cache (vLLM computes at least one token of a prompt)."""
    for rank in tp1:
        hits = rank["image_prefix_hits"]  # (prompt tokens, found in the cache) per request, in the order they start
        assert len(hits) == 16, hits  # 4 prompts x 4 answers, one request each
        for first in range(0, 16, 4):
            prompt_len = hits[first][0]
            assert prompt_len > 32 and all(n == prompt_len for n, _ in hits[first : first + 4]), hits
            assert all(hit == (prompt_len - 1) // 32 * 32 for _, hit in hits[first + 1 : first + 4]), hits


def test_a_request_of_several_answers_stops_as_its_answers_would_alone(tp1):
    """Guards the stop of a partial rollout's group sent as one request of n answers (rollout.generate_until): its
    finished answers wait in vLLM's ParentRequest and the others in child states that wait for the rest, so read
    wrongly an answer would lose its tokens, or one that finished would be continued past its end. Stopped after the
    same steps, each answer has the tokens, log-probs and finish reason it has as a request of its own."""
    for rank in tp1:
        assert rank["stopped_grouped"] == rank["stopped_alone"]
        reasons = [reason for _, _, reason in rank["stopped_grouped"]]
        assert None in reasons and "stop" in reasons, reasons  # both kinds of answer were stopped
        assert all(len(ids) > 1 for ids, _, reason in rank["stopped_grouped"] if reason is None)  # their tokens
        assert not rank["left_running"]  # every stopped answer was aborted


def test_the_stepped_stop_is_the_same_under_async_schedulings_batch_queue(tp1):
    """Guards partial rollouts under async scheduling (vLLM's default with CUDA, off on CPU): vLLM then keeps two
    batches in flight, a step that only fills the queue reports nothing, outputs come a step late, and at the stop a
    batch of the stopped answers is still in flight, delivered at the next call after sleep, wake and the weight
    sync. Stepped that way (vllm_check.batch_queue_steps), generate_until must cut each answer where the synchronous
    steps cut it, with the same tokens, log-probs and finish, and the next call must not see the stale batch."""
    for rank in tp1:
        assert rank["queue/empty_steps"] > 0 and rank["queue/in_flight_at_stop"] > 0  # (it stepped as a queue does)
        assert rank["queue/batch_queue"] == rank["queue/sync"]
        assert rank["queue/batch_queue_after"] == rank["queue/sync_after"]
        finished = [f for *_, f, _ in rank["queue/sync"]]
        assert finished[:4] == [True] * 4 and not any(finished[4:])  # group 0 ended, group 1 was cut
        assert all(len(ids) > 0 for ids, *_ in rank["queue/sync"][4:])  # with tokens


def test_an_answer_that_pauses_leaves_its_group_open(tp1, tp2):
    """Guards partial rollouts with tools (rollout.generate_until's pause_ids): an answer stopped at a tool call's
    end must come back unfinished with its tokens up to the call, and must not complete its group, or the step would
    stop other groups' answers on a quota it does not have and train an answer that ends at its call. In a TP group
    the members pool their requests and stop when each has its quota: each gets its own answers back."""
    for rank in tp1 + tp2:
        group0, group1 = rank["paused"][:4], rank["paused"][4:]
        paused = [ids for ids, finished, _ in group0 if not finished]
        assert paused, group0  # (half the tokens pause: some did)
        assert all(ids[-1] % 2 == 0 and ids[-1] < 400 and all(t % 2 or t >= 400 for t in ids[:-1]) for ids in paused)
        assert all(finished for _, finished, _ in group1), group1  # run to their end, not stopped
