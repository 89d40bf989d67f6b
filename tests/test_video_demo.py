"""The video demo (configs/tiny_video.yaml, `make demo-video`): a task only the frames answer must be learnt; and a
dataset mixing image, video, image-and-video and text-only rows trains on 2 ranks with vLLM."""

import json

import pyarrow.parquet as pq
import pytest

from tests.launch import torchrun
from tests.test_checkpoint import PARTIAL
from tests.test_mixed_data import PADDED
from tests.test_vision_demo import assert_demo_learns

SECONDS = 4  # scripts/make_synthetic_data.py SECONDS: a model blind to the frames is right 1 time in 4 at best


def _rows(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_video_demo_learns_what_only_the_frames_say(tiny_model_dir, tmp_path):
    """Guards against a pipeline that hands a prompt the wrong video, or none, or its frames out of place (packing,
    shared prefixes, rank balancing, the vLLM request and its frame timing, the sync of the tower): every prompt's
    text is the same and the answer is in how many of the clip's seconds it is red, so reward above 1/4 needs the
    right frames. One run of the demo's config (2 ranks, vLLM, shared prefixes, token-budget micro-batches, rank
    balancing): last-5-step training accuracy and greedy validation accuracy clearly above the blind ceiling."""
    from scripts.make_synthetic_data import make_video_count_task

    assert_demo_learns("configs/tiny_video.yaml", make_video_count_task, 80, 1 / SECONDS, tiny_model_dir, tmp_path)


def test_video_count_task_hides_the_answer_from_the_text(tmp_path):
    """Guards against a demo a blind model could solve: every row's text is the same, the answers balanced, and
    each clip red in exactly `answer` of its SECONDS seconds, in no fixed place; a second is two equal frames, the
    pair the tower merges into one temporal token (configs/tiny_video.yaml's 2 frames a second)."""
    import io

    from PIL import Image

    from scripts.make_synthetic_data import make_video_count_task

    rows = pq.read_table(make_video_count_task(str(tmp_path / "t.parquet"), n_rows=40, seed=0)).to_pylist()
    assert len({r["problem"] for r in rows}) == 1 and rows[0]["problem"].startswith("<video>")
    assert all(sum(r["answer"] == str(a) for r in rows) == 10 for a in range(1, SECONDS + 1))
    places = set()
    for r in rows:
        (clip,) = r["videos"]
        assert len(clip) == 2 * SECONDS and all(clip[i] == clip[i + 1] for i in range(0, len(clip), 2))
        red = [Image.open(io.BytesIO(f["bytes"])).getpixel((0, 0))[1] < 100 for f in clip[::2]]
        assert sum(red) == int(r["answer"])
        places.add(tuple(red))
    assert len(places) > 8


# Partial rollouts (tests/test_checkpoint.py) stopped mid-answer at step 1 and continued at step 2 (validation, never
# partial, still runs the engine's generate of whole answers): answers of up to 16 tokens, of which the engine decodes
# 12 at a time, so that answers start at different times and a rank's quota is met while some are half done
MIDWAY = [*PARTIAL, "data.max_response_length=16", "rollout.max_num_seqs=12"]


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("qwen2_5_vl", []),  # vLLM, packed, shared prefixes, token budgets, rank balancing
        ("qwen2_5_vl", [*PADDED, "data.shuffle=false", *MIDWAY]),  # vLLM, padded, unshuffled halves, partial
        ("qwen2_5_vl", ["rollout.engine=hf", "rollout.max_num_seqs=4", "data.shuffle=false"]),  # FSDP2 generate
        ("qwen3_vl", []),  # timestamps in the prompt, deepstack features split between images and videos
        ("qwen3_vl", MIDWAY),  # the same with partial rollouts
    ],
)
def test_mixed_image_video_and_text_rows_train_on_two_ranks(tiny_family_dir, tmp_path, family, overrides):
    """Guards against a batch that mixes media breaking a rank or the collectives: rows with an image, a video,
    both, or neither in one dataset (strided so each rank gets every kind; unshuffled, rank 1's micro-batches and
    generate calls hold other media than rank 0's), through vLLM or the HF engine, packing or padding, shared
    prefixes and the vision tower's one pass per forward. The runs must finish, and with vLLM its log-probs must be
    the trainer's in the training loop itself (fp32 on both sides: 9.5e-7 seen, 1e-4 asserted). With partial
    rollouts, answers stopped at step 1 are continued at step 2 from prompt, media and their tokens: vLLM must see
    the trainer's prompt (rollout.generate_until checks it token for token) and the tokens they add must have the
    trainer's log-probs to the same bound."""
    from scripts.make_synthetic_data import make_mixed_media

    train = make_mixed_media(str(tmp_path / "train.parquet"), n_rows=32, seed=0)
    val = make_mixed_media(str(tmp_path / "val.parquet"), n_rows=8, seed=1)
    out_dir = tmp_path / "run"
    stdout = torchrun(
        2, "train_grpo.py", "configs/tiny_video.yaml", f"actor.model_path={tiny_family_dir(family)}",
        f"data.train_files={train}", f"data.val_files={val}", f"trainer.output_dir={out_dir}",
        "trainer.max_steps=2", "trainer.val_freq=2", "rollout.n=4", *overrides,
        timeout=300,
    )  # fmt: skip
    # every row kept: a prompt over data.max_prompt_length is dropped with a warning, and a run without its videos
    # (Qwen3-VL's timestamps make its prompts the longest) would pass the rest
    assert "train: 32 prompts (0 bad rows skipped, 0 longer than" in stdout, stdout[-3000:]
    rows = _rows(out_dir)
    assert [r["step"] for r in rows if r["step"] > 0] == [1, 2]
    assert "val/accuracy" in rows[-1]
    if "rollout.engine=hf" not in overrides:
        assert all(r["rollout/logprob_diff_max"] <= 1e-4 for r in rows if r["step"] > 0), rows
    if PARTIAL[0] in overrides:  # (a rank mean: answers stopped at step 1 on some rank went on at step 2)
        assert rows[-1]["rollout/partial_continued"] > 0, rows
