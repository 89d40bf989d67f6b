"""Datasets as users bring them, end to end under torchrun (2 ranks, gloo): text-only rows mixed with image rows,
and text-only datasets; and the vision tower's dummy pass that keeps the ranks in step, in every model family."""

import json
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.launch import torchrun

HF, VLLM = "rollout.engine=hf", "rollout.engine=vllm"
PADDED = ["actor.padding_free=false", "actor.max_tokens_per_micro_batch=0",
          "actor.max_tokens_per_micro_batch_no_grad=0", "actor.micro_batch_size=4",
          "actor.micro_batch_size_no_grad=4"]  # fmt: skip
LORA = ["actor.lora_rank=8", "actor.lora_alpha=16"]


def _run(model_dir, tmp_path, train, val, *overrides, steps=2):
    """`steps` steps of configs/tiny.yaml with validation before and after; the wall time, the training rows and the
    ranks' output."""
    out_dir = tmp_path / "run"
    t0 = time.perf_counter()
    stdout = torchrun(
        2, "train_grpo.py", "configs/tiny.yaml", f"actor.model_path={model_dir}", f"data.train_files={train}",
        f"data.val_files={val}", f"trainer.output_dir={out_dir}", f"trainer.max_steps={steps}",
        f"trainer.val_freq={steps}", *overrides, timeout=300,
    )  # fmt: skip
    seconds = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return seconds, rows, stdout


def add_dirty_rows(path: str) -> int:
    """Append to a geo3k-like file one image row per tests/test_data.py's DIRTY_TEXTS (the model's special tokens
    written in the problem, as rows scraped from chat logs hold them); returns how many."""
    from tests.test_data import DIRTY_TEXTS

    table = pq.read_table(path)
    image = next(i for i in table["images"].to_pylist() if i)
    rows = [{"problem": f"<image>{text}", "answer": "3", "images": image} for text in DIRTY_TEXTS]
    pq.write_table(pa.concat_tables([table, pa.Table.from_pylist(rows, schema=table.schema)]), path)
    return len(rows)


@pytest.mark.parametrize(
    "layout, overrides",
    [
        ("half", [HF, *LORA]),  # packed, shared prefixes
        ("half", [HF, *PADDED]),
        ("rank1_text", [VLLM, "actor.shared_prefix=false", *LORA]),  # token budget, rank balancing
        ("rank1_text", [VLLM, *PADDED]),
    ],
)
def test_mixed_text_and_image_rows_run_to_the_end(tiny_model_dir, tmp_path, layout, overrides):
    """Guards against the mixed-batch deadlock: a rank whose micro-batch, log-prob forward or generate call has no
    image skips the vision tower's FSDP2 all-gather that a rank with images makes (gloo aborts with a collective
    mismatch, NCCL hangs until its timeout). Half the rows text-only, or (unshuffled) rank 1's whole share; the
    validation set is strided so that rank 0 gets only text-only rows. Each run must finish, in bounded time.
    Both files also hold rows with the model's special tokens in their text, as users' files do: skipped at load,
    counted in the load line, they never reach a rollout."""
    from scripts.make_synthetic_data import make_geo3k_like

    train = make_geo3k_like(str(tmp_path / "train.parquet"), n_rows=32, seed=0, text_only_every=2)
    val = make_geo3k_like(str(tmp_path / "val.parquet"), n_rows=8, seed=1, text_only_every=2)
    dirty = add_dirty_rows(train)
    add_dirty_rows(val)
    extra = []
    if layout == "rank1_text":  # image rows first: unshuffled, rank 0 takes the first half, rank 1 the second
        table = pq.read_table(train)
        order = sorted(range(table.num_rows), key=lambda i: not table["images"][i].as_py())
        pq.write_table(table.take(order), train)
        extra = ["data.shuffle=false"]
    seconds, rows, stdout = _run(tiny_model_dir, tmp_path, train, val, *overrides, *extra)
    assert [r["step"] for r in rows if r["step"] > 0] == [1, 2]
    assert f"train: 32 prompts ({dirty} bad rows skipped" in stdout, stdout[-3000:]
    assert seconds < 240, seconds


def test_dataset_without_an_images_column_trains(tiny_model_dir, tmp_path):
    """Guards against a data path or trainer that assumes images: a file with no `images` column at all (a
    text-only math set, as EasyR1 trains the VL model on math12k) must train end to end on both ranks."""
    from scripts.make_synthetic_data import make_geo3k_like

    for name, seed in (("train", 0), ("val", 1)):
        path = make_geo3k_like(str(tmp_path / f"{name}.parquet"), n_rows=32 if name == "train" else 8, seed=seed,
                               text_only_every=1)  # fmt: skip
        pq.write_table(pq.read_table(path).drop_columns(["images"]), path)
        assert "images" not in pq.read_table(path).column_names
    _, rows, _ = _run(tiny_model_dir, tmp_path, tmp_path / "train.parquet", tmp_path / "val.parquet", HF)
    assert [r["step"] for r in rows if r["step"] > 0] == [1, 2]
    assert "val/accuracy" in rows[0]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_vision_dummy_changes_no_logprob_and_no_gradient(tiny_family_dir, family):
    """Guards against the mixed-batch fix leaking into the numbers: on a text-only forward the dummy tower pass must
    run (the tower's parameters get a gradient, all exactly zero, so FSDP2 reduce-scatters them on every rank) and
    leave the log-probs and every other gradient bitwise as they are without it, in every model family."""
    import torch

    from grpo import loading, logprobs

    def grads(with_dummy):
        model = loading.load_model(tiny_family_dir(family), torch.device("cpu"), "sdpa")
        if with_dummy:
            logprobs.add_vision_dummy(model)
        ids = torch.arange(5, 25)[None]  # (1, 20) plain text tokens
        logp, _ = logprobs.forward_logprobs(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                          ids[:, -6:], 1.0)  # fmt: skip
        logp.sum().backward()
        return logp.detach(), {n: p.grad for n, p in model.named_parameters()}

    logp, plain = grads(False)
    logp_dummy, dummy = grads(True)
    assert torch.equal(logp, logp_dummy)
    tower = [n for n in dummy if ".visual." in n]
    assert tower and all(plain[n] is None for n in tower)
    assert all(dummy[n] is not None and not dummy[n].any() for n in tower)
    assert all(torch.equal(plain[n], dummy[n]) for n in plain if n not in tower)
