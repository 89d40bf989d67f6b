"""The data path: reading rows, validating them, images, prompts, token counts and sharding."""

import copy
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import data
import rollout
from data import PromptDataset, ShardSampler, batches_per_epoch, load_rows
from grpo import media
from grpo.media import fit_image, fitted_size, to_rgb
from scripts.make_synthetic_data import main as synthetic_main
from scripts.make_synthetic_data import make_geo3k_like

ROOT = Path(__file__).resolve().parents[1]

GEO3K_PROMPT = str(ROOT / "configs" / "format_prompt" / "geo3k.jinja")
SUFFIX = (
    " You FIRST think about the reasoning process as an internal monologue and then provide the final answer."
    " The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in \\boxed{}."
)
VISION = "<|vision_start|><|image_pad|><|vision_end|>"
TINY = dict(min_pixels=56 * 56, max_pixels=112 * 112)  # few image tokens, so the processor runs fast


@pytest.fixture
def processor(tiny_processor):
    """A private copy: PromptDataset sets its pixel range on the processor it is given."""
    return copy.deepcopy(tiny_processor)


def png(size=(40, 30), mode="RGB", color="white") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format="PNG")
    return buf.getvalue()


def write_parquet(path: Path, rows: list[dict]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def good_row(problem="<image>Find x.", answer="48", n_images=1) -> dict:
    return {"problem": problem, "answer": answer, "images": [{"bytes": png(), "path": None}] * n_images}


def bad_row_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "skipped" in str(w.message)]


# ----------------------------------------------------------------------------------------------------------------
# Reading rows
# ----------------------------------------------------------------------------------------------------------------


def test_synthetic_file_round_trips(tmp_path, processor):
    """Guards against a synthetic file that differs from geo3k's schema or changes between runs with one seed."""
    path = make_geo3k_like(str(tmp_path / "train.parquet"), n_rows=32, seed=3)
    assert Path(path).read_bytes() == Path(make_geo3k_like(str(tmp_path / "again.parquet"), 32, seed=3)).read_bytes()
    assert Path(path).read_bytes() != Path(make_geo3k_like(str(tmp_path / "other.parquet"), 32, seed=4)).read_bytes()

    rows, name = load_rows(path)
    assert name == path and len(rows) == 32
    assert set(rows[0]) == {"problem", "answer", "images"}
    for row in rows:
        assert row["problem"].count("<image>") == len(row["images"]) >= 1
        for image in row["images"]:
            assert set(image) == {"bytes", "path"} and image["bytes"].startswith(b"\x89PNG")
            assert 64 <= min(Image.open(io.BytesIO(image["bytes"])).size)
    assert any(len(row["images"]) == 2 for row in rows)
    assert any("\\frac" in row["answer"] for row in rows) and any("\\sqrt" in row["answer"] for row in rows)

    ds = PromptDataset(path, processor, format_prompt=GEO3K_PROMPT, **TINY)
    assert len(ds) == 32 and ds.n_skipped == 0 and ds.n_overlong == 0
    assert all(isinstance(s, bytes) for sources in ds.image_sources for s in sources)  # nothing decoded is kept
    ex = ds[5]
    assert ex.answer == rows[5]["answer"] and ex.source == f"{path}:5"
    assert all(img.mode == "RGB" for img in ex.images)


def test_synthetic_cli_writes_rows(tmp_path, monkeypatch, capsys):
    """Guards against a CLI whose flags are ignored (wrong row count or seed)."""
    out = tmp_path / "cli.parquet"
    monkeypatch.setattr(sys, "argv", ["make_synthetic_data.py", str(out), "--rows", "5", "--seed", "7"])
    synthetic_main()
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes() == Path(make_geo3k_like(str(tmp_path / "api.parquet"), n_rows=5, seed=7)).read_bytes()


def test_jsonl_with_relative_paths_and_custom_keys(tmp_path, monkeypatch, processor):
    """Guards against image paths resolved against the working directory instead of the data file's directory."""
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(png((50, 20), color="red"))
    rows = [
        {"question": "<image>Find y.", "solution": 3, "pics": ["imgs/a.png"]},
        {"question": "<image>Find z.", "solution": "\\frac{7}{2}", "pics": [{"bytes": None, "path": "imgs/a.png"}]},
        {"question": "What is 2+2?", "solution": "4"},  # text-only row: no image field at all
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    monkeypatch.chdir(tmp_path / "imgs")  # relative paths must not depend on the working directory

    ds = PromptDataset(str(path), processor, prompt_key="question", answer_key="solution", image_key="pics", **TINY)
    assert len(ds) == 3 and ds.n_skipped == 0
    assert [ds[i].answer for i in range(3)] == ["3", "\\frac{7}{2}", "4"]
    assert ds[0].images[0].getpixel((0, 0)) == (255, 0, 0)
    assert ds[2].images == [] and VISION not in ds[2].prompt


def test_json_list_and_json_lines(tmp_path, processor):
    """Guards against `.json` files written by `datasets.to_json` (JSON lines) failing to load."""
    rows = [{"problem": "Find x.", "answer": "1"}, {"problem": "Find y.", "answer": "2"}]
    (tmp_path / "list.json").write_text(json.dumps(rows))
    (tmp_path / "lines.json").write_text("\n".join(json.dumps(r) for r in rows))
    assert load_rows(str(tmp_path / "list.json"))[0] == rows
    assert load_rows(str(tmp_path / "lines.json"))[0] == rows


def test_directory_reads_sorted_files_and_split_prefix(tmp_path, processor):
    """Guards against a directory spec reading files in filesystem order or mixing splits."""
    write_parquet(tmp_path / "train-00001.parquet", [good_row(answer="2")])
    write_parquet(tmp_path / "train-00000.parquet", [good_row(answer="1")])
    (tmp_path / "train-00002.jsonl").write_text(json.dumps({"problem": "Find x.", "answer": "3"}) + "\n")
    write_parquet(tmp_path / "test-00000.parquet", [good_row(answer="9")])
    (tmp_path / "README.md").write_text("not data")

    rows, _ = load_rows(str(tmp_path))
    assert [r["answer"] for r in rows] == ["9", "1", "2", "3"]
    ds = PromptDataset(f"{tmp_path}@train", processor, **TINY)
    assert [ds.examples[i].answer for i in range(len(ds))] == ["1", "2", "3"]
    assert ds.examples[1].source == f"{tmp_path / 'train-00001.parquet'}:0"  # names the file, not the directory
    both = PromptDataset([f"{tmp_path}@test", f"{tmp_path}@train"], processor, **TINY)
    assert [ex.answer for ex in both.examples] == ["9", "1", "2", "3"]


def test_hub_spec_reads_raw_image_structs(monkeypatch, processor):
    """Guards against `name@split` being misparsed, or the hub path decoding every image into memory up front."""
    import datasets

    features = datasets.Features(
        {
            "problem": datasets.Value("string"),
            "answer": datasets.Value("string"),
            "images": datasets.List(datasets.Image()),
        }
    )
    hub = datasets.Dataset.from_list([good_row(answer="11"), good_row(answer="12")], features=features)
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split: calls.append((name, split)) or hub)

    rows, name = load_rows("someone/geo@test")
    assert calls == [("someone/geo", "test")] and name == "someone/geo@test"
    assert isinstance(rows[0]["images"][0]["bytes"], bytes)
    ds = PromptDataset("someone/geo@test", processor, **TINY)
    assert [ex.source for ex in ds.examples] == ["someone/geo@test:0", "someone/geo@test:1"]
    assert ds[1].answer == "12" and ds[1].images[0].mode == "RGB"


def test_unknown_paths_fail_clearly(tmp_path):
    """Guards against a typo in a local path silently becoming a hub download or an empty dataset."""
    with pytest.raises(FileNotFoundError, match="no_such_file.parquet"):
        load_rows(str(tmp_path / "no_such_file.parquet"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        load_rows(str(tmp_path / "empty"))
    path = write_parquet(tmp_path / "a.parquet", [good_row()])
    with pytest.raises(ValueError, match="@split"):
        load_rows(f"{path}@test")
    (tmp_path / "a.csv").write_text("problem,answer\n")
    with pytest.raises(ValueError, match="a.csv"):
        load_rows(str(tmp_path / "a.csv"))


# ----------------------------------------------------------------------------------------------------------------
# Bad rows
# ----------------------------------------------------------------------------------------------------------------


def test_bad_rows_skipped_with_warning(tmp_path, processor):
    """Guards against one broken row crashing a run, or being dropped without saying which and why."""
    rows = [
        good_row(answer="1"),
        {"problem": "<image>Find x.", "answer": "2", "images": [{"bytes": b"not an image", "path": None}]},
        {"problem": "<image>Find x.", "answer": None, "images": [{"bytes": png(), "path": None}]},
        {"problem": "   ", "answer": "4", "images": []},
        {"problem": "<image>a <image>b", "answer": "5", "images": [{"bytes": png(), "path": None}]},
        {"problem": "<image>Find x.", "answer": "6", "images": [{"bytes": None, "path": "missing.png"}]},
        good_row(answer="7", problem="<image>c <image>d", n_images=2),
    ]
    path = write_parquet(tmp_path / "mixed.parquet", rows)
    with pytest.warns(UserWarning) as record:
        ds = PromptDataset(path, processor, **TINY)
    assert [ex.answer for ex in ds.examples] == ["1", "7"] and ds.n_skipped == 5
    assert [ex.source for ex in ds.examples] == [f"{path}:0", f"{path}:6"]
    messages = bad_row_warnings(record)
    expected = {1: "does not decode", 2: "missing 'answer'", 3: "empty 'problem'", 4: "2 <image> marks but 1 images"}
    expected[5] = "does not decode"
    assert len(messages) == 5
    for (row, reason), message in zip(expected.items(), messages, strict=True):
        assert message.startswith(f"{path}: skipped row {row}: ") and reason in message


def test_row_without_marks_gets_one_per_image(tmp_path, processor):
    """Guards against dropping geo3k-style rows whose text omits the `<image>` mark."""
    path = write_parquet(tmp_path / "nomark.parquet", [good_row(problem="Find x.", n_images=2)])
    ex = PromptDataset(path, processor, **TINY)[0]
    assert ex.problem == "<image><image>Find x."
    assert ex.messages[-1]["content"] == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Find x."}]


def test_all_bad_file_raises_naming_it(tmp_path, processor):
    """Guards against a file of bad rows yielding an empty dataset, or a warning flood instead of one error."""
    rows = [{"problem": "<image>x", "answer": " ", "images": [{"bytes": png(), "path": None}]} for i in range(15)]
    path = write_parquet(tmp_path / "allbad.parquet", rows)
    with pytest.warns(UserWarning) as record, pytest.raises(ValueError, match="allbad.parquet.*empty 'answer'"):
        PromptDataset(path, processor, **TINY)
    messages = bad_row_warnings(record)
    assert len(messages) == data.WARNINGS_PER_FILE + 1 and "5 more bad rows" in messages[-1]


@pytest.mark.parametrize(
    "keys, message",
    [
        # every key the file lacks, in one message: here the images' default key too
        (
            {"prompt_key": "question"},
            "no row has data.prompt_key='question'; no row has data.image_key='images', but column 'image' holds "
            "images: set data.image_key=image (the file's columns: ['answer', 'image', ",
        ),
        (
            {"answer_key": "solution", "image_key": "image"},
            "no row has data.answer_key='solution'; the file's columns: ['answer', 'image', ",
        ),
        (  # a misspelled key, the column with images named
            {"image_key": "figure"},
            "no row has data.image_key='figure', but column 'image' holds images: set data.image_key=image (the "
            "file's columns: ['answer', 'image', ",
        ),
        (
            {"video_key": "clips", "image_key": "image"},
            "no row has data.video_key='clips'; the file's columns: ['answer', 'image', ",
        ),
        # the default key, forgotten: the images are in another column, and would silently be left out
        ({}, "no row has data.image_key='images', but column 'image' holds images: set data.image_key=image"),
    ],
)
def test_a_key_no_row_has_stops_naming_file_key_and_columns(tmp_path, processor, keys, message):
    """Guards against a wrong or forgotten key turning every row bad (a warning per row, a traceback) or, for the
    images, training text-only in silence: one error names the file, the key and the columns the file has."""
    rows = [{"problem": "Find x.", "answer": "1", "image": [{"bytes": png(), "path": None}]}] * 3
    path = write_parquet(tmp_path / "mine.parquet", rows)
    with pytest.raises(data.MissingColumn, match=re.escape(f"{path}: {message}")):
        PromptDataset(path, processor, **TINY, **keys)
    ds = PromptDataset(path, processor, **TINY, image_key="image", columns=True)  # the right key: images read
    assert len(ds.image_sources[0]) == 1 and ds.examples[0].columns == rows[0]
    assert rollout.data_media([ds]) == "images in 3 prompts (at most 1 a prompt), no videos"
    text = write_parquet(tmp_path / "text.parquet", [{"problem": "Find x.", "answer": "1", "level": 2}])
    ds = PromptDataset(text, processor, **TINY, columns={"level"})  # text-only data: the default keys may be absent
    assert ds.examples[0].columns == {"level": 2} and rollout.data_media([ds]) == "no images, no videos"


def test_a_peer_layout_names_the_keys_and_a_repeated_instruction_stops(tmp_path, processor):
    """Guards against a verl-preprocessed file read with the default keys failing one key at a time without saying
    which columns hold the prompt and the answer, and, once read, training on prompts that carry the format prompt's
    instruction twice (verl's rows end with it, and the template adds it again)."""
    rows = verl_geo3k_rows([good_row(problem="<image>Find x.") for _ in range(3)])
    path = write_parquet(tmp_path / "verl.parquet", rows)
    with pytest.raises(data.MissingColumn, match=re.escape(
        f"{path}: no row has data.prompt_key='problem', but column 'prompt' holds chat messages: set "
        "data.prompt_key=prompt; no row has data.answer_key='answer', but column 'reward_model' holds a "
        "ground_truth: set data.answer_key=reward_model.ground_truth (the file's columns: ['ability', "
    )):  # fmt: skip
        PromptDataset(path, processor, **TINY)
    keys = {"prompt_key": "prompt", "answer_key": "reward_model.ground_truth"}
    with pytest.raises(data.RepeatedInstruction, match=re.escape(
        f"{path}: 3 of 3 prompts already hold data.format_prompt's instruction ({GEO3K_PROMPT}), as preprocessed "
        f"files often do ({path}:0): it would be given twice; set data.format_prompt= (empty) for these files"
    )):  # fmt: skip
        PromptDataset(path, processor, **TINY, **keys, format_prompt=GEO3K_PROMPT)
    assert PromptDataset(path, processor, **TINY, **keys).examples[0].problem.endswith(SUFFIX.strip())
    plain = write_parquet(tmp_path / "plain.parquet", [good_row(problem="<image>Find x.")])
    assert "MUST BE" in PromptDataset(plain, processor, **TINY, format_prompt=GEO3K_PROMPT).examples[0].prompt


def test_a_forgotten_default_key_of_media_as_paths_names_the_column(tmp_path, processor):
    """Guards against a JSON file whose images or videos are paths, in a column other than the default key, reading
    as text-only data (rows without marks would train blind) or failing row by row on the marks: the path's suffix
    names the column, images before videos, and the right keys read them."""
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(png(color="red"))
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"problem": "<image>Find x.", "answer": "1", "image": "imgs/a.png"}) + "\n")
    with pytest.raises(data.MissingColumn, match="column 'image' holds images: set data.image_key=image"):
        PromptDataset(str(path), processor, **TINY)
    ds = PromptDataset(str(path), processor, **TINY, image_key="image")
    assert ds[0].images[0].getpixel((0, 0)) == (255, 0, 0)

    (tmp_path / "imgs" / "clip.MP4").write_bytes(b"")  # (only found, not read)
    row = {"problem": "Find x.", "answer": "1", "image": "imgs/a.png", "clip": ["imgs/clip.MP4"], "note": "see a.txt"}
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(data.MissingColumn, match="column 'clip' holds videos: set data.video_key=clip"):
        PromptDataset(str(path), processor, **TINY, image_key="image")
    # file names that name no file are text (metadata): text and images only, as without them
    path.write_text(json.dumps({**row, "clip": "clips/gone.mp4"}) + "\n")
    ds = PromptDataset(str(path), processor, **TINY, image_key="image")
    assert rollout.data_media([ds]) == "images in 1 prompts (at most 1 a prompt), no videos"
    path.write_text(json.dumps({"problem": "Find x.", "answer": "1", "source": "figures/gone.png"}) + "\n")
    assert rollout.data_media([PromptDataset(str(path), processor, **TINY)]) == "no images, no videos"


# ----------------------------------------------------------------------------------------------------------------
# Images
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [(1, 1), (5, 3), (1, 300), (300, 1), (1, 100_000), (3000, 2000), (200, 100)])
def test_fit_image_lands_in_budget_and_processor_accepts_it(size, processor):
    """Guards against huge images blowing the token budget and tiny or strip images crashing Qwen's resize."""
    min_pixels, max_pixels = TINY["min_pixels"], TINY["max_pixels"]
    img = fit_image(Image.new("L", size, 128), min_pixels, max_pixels)
    w, h = img.size
    assert img.mode == "RGB" and (w, h) == fitted_size(*size, min_pixels, max_pixels)[1]
    assert min_pixels <= w * h <= max_pixels and min(w, h) >= media.MIN_SIDE and max(w, h) / min(w, h) < 200
    media.set_pixel_range(processor, min_pixels, max_pixels)
    grid = processor.image_processor(images=[img])["image_grid_thw"]
    assert grid.shape == (1, 3)


def test_fit_image_keeps_in_budget_images_and_real_defaults():
    """Guards against resizing images already inside the budget, and against the geo3k defaults going out of it."""
    assert fit_image(Image.new("RGB", (600, 500)), 262144, 4194304).size == (600, 500)
    for size in [(100, 80), (4000, 3000)]:
        (w, h), canvas = fitted_size(*size, 262144, 4194304)
        assert canvas == (w, h) and 262144 <= w * h <= 4194304 and abs(w / h - size[0] / size[1]) < 0.01


def test_to_rgb_modes():
    """Guards against transparent backgrounds turning black and 16-bit grey clipping to white."""
    assert to_rgb(Image.new("L", (2, 2), 7)).getpixel((0, 0)) == (7, 7, 7)
    assert to_rgb(Image.new("RGBA", (2, 2), (0, 0, 0, 0))).getpixel((0, 0)) == (255, 255, 255)
    assert to_rgb(Image.new("LA", (2, 2), (0, 0))).getpixel((0, 0)) == (255, 255, 255)
    palette = Image.new("P", (2, 2), 1)
    palette.putpalette([0, 0, 0, 10, 20, 30] + [0] * 762)
    assert to_rgb(palette).getpixel((0, 0)) == (10, 20, 30)
    assert to_rgb(Image.new("CMYK", (2, 2), (0, 0, 0, 0))).getpixel((0, 0)) == (255, 255, 255)
    grey16 = Image.fromarray(np.full((2, 2), 257 * 100, dtype=np.uint16))
    assert grey16.mode.startswith("I") and to_rgb(grey16).getpixel((0, 0)) == (100, 100, 100)


def test_odd_images_in_files_are_converted_not_dropped(tmp_path, processor):
    """Guards against valid but unusual images (palette, 16-bit, 1-px, huge) being skipped as bad rows."""
    grey16 = io.BytesIO()
    Image.fromarray(np.full((30, 40), 60000, dtype=np.uint16)).save(grey16, format="PNG")
    images = [png((20, 20), "P"), png((1, 1), "RGBA"), grey16.getvalue(), png((2500, 2000))]
    rows = [{"problem": "<image>x", "answer": "1", "images": [{"bytes": b, "path": None}]} for b in images]
    ds = PromptDataset(write_parquet(tmp_path / "odd.parquet", rows), processor, **TINY)
    assert len(ds) == 4 and ds.n_skipped == 0
    for i in range(4):
        (img,) = ds[i].images
        assert img.mode == "RGB" and TINY["min_pixels"] <= img.width * img.height <= TINY["max_pixels"]


# ----------------------------------------------------------------------------------------------------------------
# Prompts and token counts
# ----------------------------------------------------------------------------------------------------------------


def test_two_image_prompt_is_exact_chat_text(tmp_path, processor):
    """Guards against a prompt that differs from Qwen's chat format (missing newlines, marks, suffix, system turn)."""
    path = write_parquet(tmp_path / "two.parquet", [good_row(problem="<image>Figure A. <image>Find x.  ", n_images=2)])
    ex = PromptDataset(path, processor, format_prompt=GEO3K_PROMPT, **TINY)[0]
    assert ex.messages == [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "Figure A. "},
                {"type": "image"},
                {"type": "text", "text": "Find x." + SUFFIX},
            ],
        }
    ]
    assert ex.prompt == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{VISION}Figure A. {VISION}Find x.{SUFFIX}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    custom = PromptDataset(path, processor, system_prompt="Be brief.", **TINY)[0]
    assert custom.messages[0] == {"role": "system", "content": "Be brief."}
    assert custom.prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


@pytest.mark.parametrize("pixels", [TINY, dict(min_pixels=28 * 28 * 16, max_pixels=28 * 28 * 400)])
def test_num_prompt_tokens_matches_processor(tmp_path, processor, pixels):
    """Guards against the length filter and token accounting disagreeing with what the model actually sees."""
    sizes = [[(64, 64)], [(1, 1)], [(3, 700)], [(1500, 1100)], [(97, 45), (45, 97)], []]
    rows = [
        {"problem": "<image>" * len(s) + f"Find x{i}.", "answer": "1", "images": [png(size) for size in s]}
        for i, s in enumerate(sizes)
    ]
    ds = PromptDataset(write_parquet(tmp_path / "sizes.parquet", rows), processor, format_prompt=GEO3K_PROMPT, **pixels)
    counts = set()
    for i in range(len(ds)):
        ex = ds[i]
        ids = processor(text=[ex.prompt], images=ex.images or None)["input_ids"][0]
        assert ex.num_prompt_tokens == len(ids), ex.source
        counts.add(ex.num_prompt_tokens)
    assert len(counts) > 3  # the image sizes really changed the counts


def test_overlong_prompts_dropped_and_counted(tmp_path, processor):
    """Guards against prompts longer than max_prompt_length reaching the rollout, or vanishing uncounted."""
    rows = [good_row(problem="<image>short"), good_row(problem="<image>" + "long words " * 40)]
    path = write_parquet(tmp_path / "len.parquet", rows)
    full = PromptDataset(path, processor, **TINY)
    short_len, long_len = (ex.num_prompt_tokens for ex in full.examples)
    limit = (short_len + long_len) // 2
    with pytest.warns(UserWarning, match="dropped 1 prompts over"):
        ds = PromptDataset(path, processor, max_prompt_length=limit, **TINY)
    assert len(ds) == 1 and ds.n_overlong == 1 and ds[0].num_prompt_tokens == short_len
    kept = PromptDataset(path, processor, max_prompt_length=limit, filter_overlong_prompts=False, **TINY)
    assert len(kept) == 2 and kept.n_overlong == 1
    with pytest.raises(ValueError, match="max_prompt_length=5"), pytest.warns(UserWarning):
        PromptDataset(path, processor, max_prompt_length=5, **TINY)


def test_dataset_sets_processor_pixel_range(tmp_path, processor):
    """Guards against the trainer's processor resizing images differently from the dataset's token count."""
    PromptDataset(write_parquet(tmp_path / "a.parquet", [good_row()]), processor, min_pixels=1000, max_pixels=9000)
    size = processor.image_processor.size
    assert (size["shortest_edge"], size["longest_edge"]) == (1000, 9000)


# ----------------------------------------------------------------------------------------------------------------
# Sharding
# ----------------------------------------------------------------------------------------------------------------


def test_shards_disjoint_equal_and_cover_all_but_remainder():
    """Guards against ranks sharing prompts, or running different step counts and hanging in a collective."""
    for n, world in [(10, 3), (12, 4), (7, 7), (100, 8)]:
        shards = [ShardSampler(n, r, world, seed=5).indices(epoch=2) for r in range(world)]
        assert all(len(s) == n // world for s in shards)
        flat = [i for s in shards for i in s]
        assert len(set(flat)) == len(flat) == n - n % world and set(flat) <= set(range(n))


def test_batches_per_epoch_counts_the_samplers_batches():
    """Guards the steps an epoch (and the dry run's "fewer than one rollout batch"): the count must be the batches
    each rank's sampler gives before its epoch turns, 0 where the shard is short of one."""
    # (14, 4, 6) and (9, 2, 5): where the prompts over the batch (2, 1) would count otherwise
    for n, world, batch in [(10, 3, 3), (12, 4, 8), (7, 7, 7), (100, 8, 16), (15, 2, 16), (14, 4, 6), (9, 2, 5)]:
        sampler, epoch, position, full = ShardSampler(n, world - 1, world, seed=5), 0, 0, 0
        while True:
            _, epoch, position = sampler.next_indices(epoch, position, batch // world)
            if epoch:
                break
            full += 1
        assert batches_per_epoch(n, world, batch) == full, (n, world, batch)


def test_shards_deterministic_and_reshuffled_per_epoch():
    """Guards against ranks drawing different permutations, and against replaying one order every epoch."""
    a, b = ShardSampler(50, 1, 2, seed=3), ShardSampler(50, 1, 2, seed=3)
    assert a.indices(4) == b.indices(4)
    assert a.indices(0) != a.indices(1) and a.indices(0) != ShardSampler(50, 1, 2, seed=4).indices(0)
    assert ShardSampler(10, 1, 2, shuffle=False).indices(9) == [5, 6, 7, 8, 9]
    # Same order in a fresh process with another hash seed (ranks are separate processes).
    code = "import data; print(data.ShardSampler(50, 1, 2, seed=3).indices(4))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(a.indices(4))
    with pytest.raises(ValueError):
        ShardSampler(3, 0, 4)
    with pytest.raises(ValueError):
        ShardSampler(10, 2, 2)


def verl_geo3k_rows(easyr1_rows: list[dict], split: str = "train") -> list[dict]:
    """Rows as verl's examples/data_preprocess/geo3k.py writes them from hiyouga/geometry3k (= EasyR1's layout): the
    instruction appended to the problem inside a one-turn chat, the answer inside reward_model."""
    rows = []
    for i, r in enumerate(easyr1_rows):
        rows.append({
            "data_source": "hiyouga/geometry3k",
            "prompt": [{"role": "user", "content": r["problem"] + SUFFIX}],
            "images": r["images"],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": r["answer"]},
            "extra_info": {"split": split, "index": i, "answer": r["answer"], "question": r["problem"]},
        })  # fmt: skip
    return rows


def test_peer_files_load_without_conversion(tmp_path, processor):
    """Guards against users having to convert the peers' files: verl's geo3k parquet (chat-list `prompt`, answer in
    the `reward_model` struct) with data.prompt_key=prompt, data.answer_key=reward_model.ground_truth and no format
    prompt (verl's rows already carry the instruction) must give exactly the prompts, answers and images that the
    EasyR1 / hiyouga layout of the same rows gives with the defaults; EasyR1's text-only math12k (problem/answer,
    no images column) loads with the defaults."""
    easyr1 = make_geo3k_like(str(tmp_path / "easyr1.parquet"), n_rows=12, seed=3)
    verl = write_parquet(tmp_path / "verl.parquet", verl_geo3k_rows(pq.read_table(easyr1).to_pylist()))
    assert pq.read_table(verl).schema.field("prompt").type.value_type.num_fields == 2  # list<struct<content, role>>
    ours = PromptDataset(easyr1, processor, format_prompt=GEO3K_PROMPT, **TINY)
    theirs = PromptDataset(verl, processor, prompt_key="prompt", answer_key="reward_model.ground_truth", **TINY)
    assert len(ours) == len(theirs) == 12 and theirs.n_skipped == 0
    for i in range(12):
        a, b = ours[i], theirs[i]
        assert (b.prompt, b.answer, b.num_prompt_tokens) == (a.prompt, a.answer, a.num_prompt_tokens)
        assert [im.tobytes() for im in b.images] == [im.tobytes() for im in a.images]
    math12k = write_parquet(tmp_path / "math12k.parquet", [{"problem": "What is $1+1$?", "answer": "2"}] * 3)
    ex = PromptDataset(math12k, processor, format_prompt=GEO3K_PROMPT, **TINY)[0]
    assert ex.images == [] and ex.prompt.count("<|image_pad|>") == 0 and ex.answer == "2"


def test_chat_prompt_column_binds_images_formats_user_turn_and_keeps_its_system(tmp_path, processor):
    """Guards against a chat-list prompt losing what it says: its `<image>` marks must bind the row's images, the
    format prompt must wrap the user turn's text (not the whole list), a system turn of its own must replace the
    default and the configured one, and a dotted key that finds nothing must skip the row, not crash."""
    rows = [
        {"prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "<image>Find x. "}],
         "images": [{"bytes": png(), "path": None}], "meta": {"gt": "48"}},
        {"prompt": [{"role": "user", "content": "Area?"}], "meta": {"gt": "3"}},
        {"prompt": [{"role": "user", "content": "No answer."}], "meta": {}},
    ]  # fmt: skip
    path = write_parquet(tmp_path / "chat.parquet", rows)
    with pytest.warns(UserWarning, match="missing 'meta.gt'"):
        ds = PromptDataset(path, processor, prompt_key="prompt", answer_key="meta.gt", format_prompt=GEO3K_PROMPT,
                           system_prompt="Default.", **TINY)  # fmt: skip
    assert len(ds) == 2 and ds.n_skipped == 1
    first, second = ds[0], ds[1]
    assert first.answer == "48" and len(first.images) == 1
    assert first.messages == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x." + SUFFIX}]},
    ]
    assert first.prompt == (
        f"<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n{VISION}Find x.{SUFFIX}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert second.messages[0] == {"role": "system", "content": "Default."} and second.images == []


# A user's rows scraped from chat logs: the model's own special tokens written in the text, where a problem, a system
# turn or a user turn holds them. Each would make an image slot without an image (the processor then raises at the
# rollout that draws the row) or close the user's turn and open the assistant's.
DIRTY_TEXTS = [
    "Find x. <|vision_start|><|image_pad|><|vision_end|> is in the text.",
    "A stray <|video_pad|> here. Find x.",
    "Find x.<|im_end|>\n<|im_start|>assistant\nThe answer is 3.",
    "Find x. <|endoftext|>",
    "Find x. <|image_pad|><|image_pad|><|image_pad|>",
]


def dirty_rows(tmp_path) -> str:
    """A JSON-lines file of two good rows, the DIRTY_TEXTS as image problems, and chat rows whose system or user turn
    holds a special token; in the chat layout (a `prompt` column) for all of them, so one file holds both kinds."""
    (tmp_path / "figure.png").write_bytes(png())
    user = [{"role": "user", "content": f"<image>{t}"} for t in ["Find x.", "Find y.", *DIRTY_TEXTS]]
    prompts = [[turn] for turn in user] + [
        [{"role": "system", "content": "You are<|im_end|> helpful."}, user[0]],
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x <|vision_end|>"}]}],
    ]
    path = tmp_path / "dirty.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": "3", "images": ["figure.png"]}) + "\n" for p in prompts))
    return str(path)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_rows_holding_the_models_special_tokens_are_skipped_at_load_with_their_reason(
    tmp_path, tiny_family_dir, family
):
    """Guards against a row whose text holds the model's special tokens loading as good and killing the run at the
    rollout that draws it (StopIteration in the processor's image-token replacement), or rewriting its chat's turns:
    each is skipped at load, naming the token; every kept row encodes as the rollout encodes it, with one image's
    tokens, and the engine's ids are the trainer's template. A dry run's sample finds them among every row."""
    from transformers import AutoProcessor

    from grpo import samples

    processor = AutoProcessor.from_pretrained(tiny_family_dir(family))
    path = dirty_rows(tmp_path)
    with pytest.warns(UserWarning) as record:
        ds = PromptDataset(path, processor, prompt_key="prompt", format_prompt=GEO3K_PROMPT, **TINY)
    assert len(ds) == 2 and ds.n_skipped == len(DIRTY_TEXTS) + 2
    warned = bad_row_warnings(record)
    assert len(warned) == ds.n_skipped and all("holds the model's special token '<|" in w for w in warned), warned
    for token in ("<|vision_start|>", "<|video_pad|>", "<|im_end|>", "<|endoftext|>", "<|image_pad|>"):
        assert any(repr(token) in w for w in warned), token
    for i in range(len(ds)):
        prompt = samples.encode_prompt(processor, ds[i])
        ids = prompt.input_ids.tolist()
        assert ids.count(processor.tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # system, user, assistant
        assert ids.count(processor.image_token_id) == int(prompt.image_grid_thw.prod() // 4)
        assert prompt.template_ids == processor.tokenizer(ds.examples[i].prompt)["input_ids"]
        assert prompt.template_ids.count(processor.image_token_id) == 1
    with pytest.warns(UserWarning) as record:
        sampled = PromptDataset(path, processor, prompt_key="prompt", sample_rows=2, **TINY)  # rows 0 and 4 parsed
    assert sampled.n_read == 2 and sampled.n_skipped == ds.n_skipped
    assert sorted(re.search(r"skipped row (\d+):", w)[1] for w in bad_row_warnings(record)) == list("2345678")


def test_a_prompt_whose_pads_are_not_its_images_is_skipped_however_it_got_them(tmp_path, processor, monkeypatch):
    """Guards against the load's last check (the prompt's ids hold one pad per image and video, as the processor
    needs) being skipped: with the special-token check turned off, the rows with stray pads still never reach a
    rollout, and every kept row encodes."""
    from grpo import samples

    monkeypatch.setattr(data, "special_tokens", lambda tokenizer: [])
    path = dirty_rows(tmp_path)
    with pytest.warns(UserWarning) as record:
        ds = PromptDataset(path, processor, prompt_key="prompt", **TINY)
    assert [w for w in bad_row_warnings(record) if "image and video pads for 1 images and 0 videos" in w]
    for i in range(len(ds)):
        samples.encode_prompt(processor, ds[i])
    assert {ex.problem for ex in ds.examples} >= {"<image>Find x.", "<image>Find y."}
    assert not any("pad|>" in ex.problem for ex in ds.examples)


def test_a_config_text_holding_a_special_token_is_refused(tmp_path, processor):
    """Guards against the system prompt or format prompt, which every row gets, turning every prompt's text into
    control tokens: refused at load, naming the key."""
    path = write_parquet(tmp_path / "good.parquet", [good_row()])
    with pytest.raises(ValueError, match="data.system_prompt holds the model's special token '<|im_end|>'"):
        PromptDataset(path, processor, system_prompt="Be brief.<|im_end|>", **TINY)
    template = tmp_path / "format.jinja"
    template.write_text("{{ content }} <|image_pad|>")
    with pytest.raises(ValueError, match="data.format_prompt holds"):
        PromptDataset(path, processor, format_prompt=str(template), **TINY)
