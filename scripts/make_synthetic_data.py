"""Write a small parquet file shaped like `hiyouga/geometry3k`, for tests and smoke runs without network.

Columns: `problem` (text with `<image>` marks), `answer` (geo3k-style strings such as `48`, `12.5`,
`\\frac{7}{2}`, `2 \\sqrt { 221 }`) and `images` (a list of `{"bytes": png, "path": name | None}` structs, the
layout `datasets` writes for a `List(Image())` column). The figures are simple PIL drawings (a triangle or a
circle with a number on it), 64-200 px, and every byte is a function of the seed.

    python scripts/make_synthetic_data.py data/synthetic/train.parquet --rows 64 --seed 0
"""

import argparse
import io
import json
import math
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw, ImageFont

QUESTIONS = [
    "Find x. Round to the nearest tenth.",
    "Find x.",
    "Find the area of the figure. Round to the nearest tenth if necessary.",
    "Find the perimeter of the triangle.",
    "Find m \\angle 2.",
    "Find the length of the arc. Round to the nearest hundredth.",
]

# The `datasets` feature metadata, so `datasets.load_dataset("parquet", ...)` sees an image column as it does
# for the real file; our own loader reads the raw structs either way.
HF_METADATA = {
    "info": {
        "features": {
            "problem": {"dtype": "string", "_type": "Value"},
            "answer": {"dtype": "string", "_type": "Value"},
            "images": {"feature": {"_type": "Image"}, "_type": "List"},
        }
    }
}


def random_answer(rng: random.Random) -> str:
    """One answer in one of the four styles found in geo3k."""
    style = rng.randrange(4)
    if style == 0:
        return str(rng.randint(1, 180))
    if style == 1:
        return f"{rng.randint(1, 99)}.{rng.randint(1, 9)}"
    if style == 2:
        return f"\\frac{{{rng.randint(1, 20)}}}{{{rng.randint(2, 9)}}}"
    return f"{rng.randint(2, 9)} \\sqrt {{ {rng.randint(2, 300)} }}"


def draw_figure(rng: random.Random, label: str, image_size: tuple[int, int]) -> bytes:
    """A triangle or a circle with a number label, as PNG bytes; each side drawn from `image_size` (min, max)."""
    w, h = rng.randint(*image_size), rng.randint(*image_size)
    img = Image.new("RGB", (w, h), "white")
    draw = ImageDraw.Draw(img)
    if rng.random() < 0.5:
        points = [(rng.randint(4, w - 4), rng.randint(4, h - 4)) for _ in range(3)]
        draw.polygon(points, outline="black")
    else:
        r = rng.randint(min(w, h) // 4, min(w, h) // 2 - 2)
        cx, cy = w // 2, h // 2
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], outline="black")
        angle = rng.uniform(0, 2 * math.pi)
        draw.line([(cx, cy), (cx + r * math.cos(angle), cy + r * math.sin(angle))], fill="black")
    draw.text((rng.randint(2, w // 2), rng.randint(2, h // 2)), label, fill="black", font=ImageFont.load_default())
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def random_row(rng: random.Random, index: int, image_size: tuple[int, int], text_only: bool = False) -> dict:
    """One geo3k-like row; about one in eight has two figures. A text-only row has no figure and an empty list."""
    question = rng.choice(QUESTIONS)
    if text_only:
        return {"problem": f"{question} x = {rng.randint(2, 99)}.", "answer": random_answer(rng), "images": []}
    if rng.random() < 0.125:
        problem = f"<image>Figure A. <image>Figure B. {question}"
        n_images = 2
    else:
        problem = f"<image>{question}"
        n_images = 1
    images = []
    for k in range(n_images):
        path = f"{index:05d}_{k}.png" if rng.random() < 0.5 else None  # geo3k stores some names, some nulls
        images.append({"bytes": draw_figure(rng, str(rng.randint(2, 99)), image_size), "path": path})
    return {"problem": problem, "answer": random_answer(rng), "images": images}


def make_geo3k_like(
    out_path: str, n_rows: int = 64, seed: int = 0, image_size: tuple[int, int] = (64, 200), text_only_every: int = 0
) -> str:
    """Write `n_rows` geo3k-like rows to `out_path` (parquet) and return the path.

    `image_size` bounds each figure side in pixels (min, max). `text_only_every=k` makes every k-th row (0, k, 2k,
    ...) text-only, as in a mixture of geometry with figures and text-only math."""
    if not 16 <= image_size[0] <= image_size[1]:
        raise ValueError(f"image_size must be (min, max) with 16 <= min <= max, got {image_size}")
    rng = random.Random(seed)
    rows = [random_row(rng, i, image_size, text_only_every > 0 and i % text_only_every == 0) for i in range(n_rows)]
    image_struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema(
        [("problem", pa.string()), ("answer", pa.string()), ("images", pa.list_(image_struct))],
        metadata={"huggingface": json.dumps(HF_METADATA)},
    )
    table = pa.Table.from_pylist(rows, schema=schema)
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out_path)
    return str(out_path)


# The vision demo's task: the answer is only in the image. Every row asks the same question; the image is one
# colour of COLOURS, and the answer is its number. A model that ignores the image can be right 1 time in K at best.
# 112 x 112 pictures (16 image tokens): with 56 x 56 (4) the answers settled at some seeds on one digit for two
# colours before the colours were told apart, and stayed there (every group's answers equal: no signal left).
COLOURS = {"1": (220, 30, 30), "2": (30, 180, 30), "3": (30, 60, 220), "4": (240, 220, 20)}
COLOUR_QUESTION = "<image>Which colour is the picture? Answer with its number: 1 red, 2 green, 3 blue, 4 yellow."


def make_colour_task(out_path: str, n_rows: int = 64, seed: int = 0, size: int = 112) -> str:
    """Write `n_rows` rows of the colour task (answers balanced and shuffled, colours jittered a little so no two
    images are equal) to `out_path` (parquet) and return the path."""
    rng = random.Random(seed)
    answers = [list(COLOURS)[i % len(COLOURS)] for i in range(n_rows)]
    rng.shuffle(answers)
    rows = []
    for answer in answers:
        colour = tuple(min(255, max(0, c + rng.randint(-20, 20))) for c in COLOURS[answer])
        buf = io.BytesIO()
        Image.new("RGB", (size, size), colour).save(buf, format="PNG")
        rows.append({"problem": COLOUR_QUESTION, "answer": answer, "images": [{"bytes": buf.getvalue(), "path": None}]})
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out_path)
    return str(out_path)


# The tool demo's task: the colour task, except that the prompt's picture is blank and only the tool `reveal` shows
# the colour. The blank is a grey whose level says which picture the tool returns (BLANK_GREY - k for colour k + 1):
# 1/255 apart, nothing a model can read (the demo's test checks the start is blind), so a model that answers without
# calling the tool is right 1 time in 4 at best, and one that calls it sees the picture in the tool's turn.
BLANK_GREY = 200
TOOL_QUESTION = "<image>Which colour is the picture? Answer with its number: 1 red, 2 green, 3 blue, 4 yellow."


def make_tool_task(out_path: str, n_rows: int = 64, seed: int = 0, size: int = 112) -> str:
    """Write `n_rows` rows of the tool task (answers balanced and shuffled) to `out_path` (parquet); the path."""
    rng = random.Random(seed)
    answers = [list(COLOURS)[i % len(COLOURS)] for i in range(n_rows)]
    rng.shuffle(answers)
    rows = []
    for answer in answers:
        grey = BLANK_GREY - list(COLOURS).index(answer)
        buf = io.BytesIO()
        Image.new("RGB", (size, size), (grey, grey, grey)).save(buf, format="PNG")
        rows.append({"problem": TOOL_QUESTION, "answer": answer, "images": [{"bytes": buf.getvalue(), "path": None}]})
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out_path)
    return str(out_path)


# The revealed picture's sides, in the blank's: 2 gives 4 times its image tokens (16 at the demo's 56 x 56 blank,
# within data.max_pixels). The tiny random model's attention spreads over the ~100 tokens before the answer, and 4
# image tokens among them left the colour a faint signal: at some seeds the answers settled on one or two digits
# before the picture was read (issue 58, docs/tools.md). The vision demo's pictures are 112 x 112 for the same reason.
REVEAL_SCALE = 2


def reveal(arguments: dict, images: list):
    """The tool demo's tool: the picture behind the prompt's blank (its grey level names the colour), REVEAL_SCALE
    times its sides."""
    k = BLANK_GREY - images[0].getpixel((0, 0))[0]
    if not 0 <= k < len(COLOURS):
        raise ValueError("the first image is not a tool-demo blank")
    width, height = images[0].size
    return Image.new("RGB", (REVEAL_SCALE * width, REVEAL_SCALE * height), list(COLOURS.values())[k])


reveal.schema = {"name": "reveal", "description": "Shows the picture behind the blank image.",
                 "parameters": {"type": "object", "properties": {}}}  # fmt: skip


# The video demo's task: a clip of SECONDS seconds at 2 frames a second, of which 1 to SECONDS are red and the rest
# white, in a random order; the answer is in how many seconds it is red. Every row's text is the same: a model that
# ignores the frames is right 1 time in SECONDS at best. Qwen's towers merge frames in pairs, so each of the clip's
# temporal tokens shows one second, one colour, and the count is how many of them are red. (With one frame per
# colour, a token could hold red-white, white-red or both: the tiny tower had to learn to add within a token, and
# runs settled with counts confused, 2 red frames read as 3 in most: docs/tests.md.)
SECONDS = 4
FRAMES_PER_SECOND = 2  # = the towers' temporal patch, and configs/tiny_video.yaml's video_fps
MARK, BLANK = (220, 30, 30), (255, 255, 255)
VIDEO_QUESTION = "<video>In how many of the video's 4 seconds is it red? Answer with a number from 1 to 4."


def png(colour, size: int) -> dict:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buf, format="PNG")
    return {"bytes": buf.getvalue(), "path": None}


def video_count_row(rng: random.Random, answer: int, size: int) -> list[dict]:
    """One clip (a list of frame structs, FRAMES_PER_SECOND equal frames a second) red in `answer` of its SECONDS
    seconds, each second's colour jittered so no two clips are equal."""
    marked = set(rng.sample(range(SECONDS), answer))
    jitter = lambda c: tuple(min(255, max(0, v + rng.randint(-15, 15))) for v in c)  # noqa: E731
    seconds = [png(jitter(MARK if i in marked else BLANK), size) for i in range(SECONDS)]
    return [frame for frame in seconds for _ in range(FRAMES_PER_SECOND)]


def make_video_count_task(out_path: str, n_rows: int = 64, seed: int = 0, size: int = 112) -> str:
    """Write `n_rows` rows of the red-seconds counting task (answers balanced and shuffled) to `out_path` (parquet)."""
    rng = random.Random(seed)
    answers = [1 + i % SECONDS for i in range(n_rows)]
    rng.shuffle(answers)
    rows = [{"problem": VIDEO_QUESTION, "answer": str(a), "videos": [video_count_row(rng, a, size)]} for a in answers]
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out_path)
    return str(out_path)


def make_mixed_media(out_path: str, n_rows: int = 32, seed: int = 0, size: int = 112) -> str:
    """Rows of four kinds in turn -- an image (the colour task), a video (the counting task), an image and a video,
    text only -- in one file: `images` and `videos` columns with empty lists where a row has none."""
    rng = random.Random(seed)
    rows = []
    for i in range(n_rows):
        kind, answer = i % 4, rng.randint(1, SECONDS)
        images = [png(COLOURS[str(answer)], size)] if kind in (0, 2) else []
        videos = [video_count_row(rng, answer, size)] if kind in (1, 2) else []
        problem = {0: COLOUR_QUESTION, 1: VIDEO_QUESTION, 2: "<image>" + VIDEO_QUESTION, 3: "What is 2 + 2?"}[kind]
        rows.append({"problem": problem, "answer": str(answer), "images": images, "videos": videos})
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out_path)
    return str(out_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="output .parquet path")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make_geo3k_like(args.out, n_rows=args.rows, seed=args.seed))


if __name__ == "__main__":
    main()
