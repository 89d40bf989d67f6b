"""The data path: rows on disk or on the hub -> validated prompts with images -> per-rank shards.

    rows, name = load_rows("data/geo3k/train.parquet")          # or "hiyouga/geometry3k@train"
    ds = PromptDataset("data/geo3k", processor, format_prompt="configs/format_prompt/geo3k.jinja")
    ex = ds[0]        # Example: problem, answer, RGB images, videos, chat messages, prompt text, source, token count
    for i in ShardSampler(len(ds), rank, world_size).indices(epoch): ...

Data specs. `name@split` that is not a local path is a hub dataset (`datasets.load_dataset(name, split=split)`).
Anything else is local: a `.parquet`, `.jsonl` or `.json` file (a JSON list of rows, or JSON lines), or a directory
whose such files are read in sorted order (not recursively). On a directory, `@split` keeps only the files whose
name starts with the split (the hub layout `train-00000-of-00001.parquet`), so a local copy of a hub dataset
answers to the same spec; on a single file `@split` is an error rather than silently ignored.

Rows. `problem` is text with one `<image>` mark per image (a problem with no mark but N images gets N marks
prepended, as EasyR1 does; any other mismatch is a bad row). `answer` is any non-empty value, kept as a string.
The three keys are configurable (data.prompt_key, answer_key, image_key) and a dotted key reaches into a struct
column (`reward_model.ground_truth`, verl's layout). A prompt column may instead hold chat messages
(`[{"role": "user", "content": "<image>..."}]`, verl's layout): they are the prompt, their `<image>` marks bind the
row's images in order, the format prompt goes around the last user turn's text, and a system turn of their own
replaces the default system prompt.
`images` is a list (or one) of `{"bytes", "path"}` structs (bytes preferred; a relative path is relative to the
data file's directory), path strings, raw bytes or PIL images; a missing `images` field means a text-only row.
`videos` (data.video_key) is a list of videos, one `<video>` mark each (prepended after the images' marks when the
problem has none): each a list of frames or a video file, sampled and resized by video.py to the video budget
(video_fps, max_frames, video_min_pixels, video_max_pixels), apart from the images' budget.
A bad row (missing or empty field, mark/image or mark/video mismatch, an image or video that does not decode, a video
without frames, text holding one of the model's special tokens, docs/data.md) is skipped with a warning naming file
and row; only when no row survives is it an error. A configured
key that no row of a file has is an error at once (MissingColumn, naming the file, the key and the columns it has):
the prompt or answer key always; the image or video key when it is not the default, or when the default is absent
but another column holds images (a forgotten data.image_key would otherwise train text-only).
A reward function may ask for the row's other columns (grading.keyword_columns): `columns` names those an Example
keeps (`True`: all of them), as the file has them.

Images are decoded once at construction to check them and to learn their size, then kept as bytes / paths and
decoded again in `__getitem__`, so eight ranks do not each hold every decoded image; videos likewise (decoded and
sampled at construction to check and count them, again for each use). They are decoded and converted to RGB by
media.py (alpha composited on white, 16-bit grey scaled to 8 bits), which video.py shares, and scaled here into
[min_pixels, max_pixels].

The processor. `PromptDataset` sets the processor's image pixel range to its own (`set_pixel_range`), because the
trainer's forward pass must expand each image to exactly the token count computed here; give vLLM the same values
in `mm_processor_kwargs`. It sets the video processor's too (video.set_video_range), so it takes the frames
video.py made as they are.
"""

import dataclasses
import json
import os
import random
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import pyarrow.parquet as pq
from PIL import Image

from grpo.distributed import Stop
from grpo.media import (
    file_source,
    fit_image,
    image_side,
    image_source,
    image_token_count,
    open_image,
    set_pixel_range,
    set_soft_tokens,
)
from grpo.video import VIDEO_MARK, Video, load_video, set_video_range, video_source, video_token_count

DATA_SUFFIXES = (".parquet", ".jsonl", ".json")
IMAGE_MARK = "<image>"
WARNINGS_PER_FILE = 10  # a wrong key name makes every row bad: say so ten times, then count the rest
DEFAULT_KEYS = {"image_key": "images", "video_key": "videos"}  # absent in text-only data: no error


# ----------------------------------------------------------------------------------------------------------------
# Reading rows
# ----------------------------------------------------------------------------------------------------------------


def split_spec(spec: str) -> tuple[str, str | None]:
    """`name@split` -> (name, split). A path that exists as written is never split: file names may contain '@'."""
    if os.path.exists(spec) or "@" not in spec:
        return spec, None
    name, split = spec.rsplit("@", 1)
    return name, split


def local_files(spec: str) -> list[str] | None:
    """The data files a local spec names, in read order; None when the spec names a hub dataset."""
    path, split = split_spec(spec)
    if not os.path.exists(path):
        if split is None:
            raise FileNotFoundError(f"data path {spec!r} does not exist (a hub dataset is written name@split)")
        return None
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.endswith(DATA_SUFFIXES) and n.startswith(split or ""))
        if not names:
            wanted = f"starting with {split!r} " if split else ""
            raise FileNotFoundError(f"no {'/'.join(DATA_SUFFIXES)} files {wanted}in directory {path!r}")
        return [os.path.join(path, n) for n in names]
    if split is not None:
        raise ValueError(f"data spec {spec!r}: @split selects a hub split or files in a directory, not part of a file")
    if not path.endswith(DATA_SUFFIXES):
        raise ValueError(f"data file {path!r} is not one of {DATA_SUFFIXES}")
    return [path]


def read_json(path: str) -> list[dict]:
    """A JSON list of rows, or JSON lines (`datasets.Dataset.to_json` writes lines even into `.json` files)."""
    text = Path(path).read_text()
    if path.endswith(".json"):
        try:
            rows = json.loads(text)
            return rows if isinstance(rows, list) else [rows]
        except json.JSONDecodeError:
            pass  # several JSON values: JSON lines
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def read_file(path: str) -> list[dict]:
    if path.endswith(".parquet"):
        return pq.read_table(path).to_pylist()
    return read_json(path)


def read_hub(name: str, split: str) -> list[dict]:
    import datasets  # slow import, and only this path needs it

    ds = datasets.load_dataset(name, split=split)
    # The arrow view keeps image columns as raw {bytes, path} structs instead of decoding every image up front.
    return ds.with_format("arrow")[:].to_pylist()


def load_rows(spec: str) -> tuple[list[dict], str]:
    """Rows of a data spec (see the module docstring) as plain dicts, and the spec as a display name."""
    files = local_files(spec)
    if files is None:
        return read_hub(*split_spec(spec)), spec
    return [row for f in files for row in read_file(f)], spec


# ----------------------------------------------------------------------------------------------------------------
# Images
# ----------------------------------------------------------------------------------------------------------------


def count_prompt_tokens(examples, image_sizes, processor, min_pixels: int, max_pixels: int, video_tokens=None):
    """Set each example's `num_prompt_tokens` without running the image processor on pixels: the prompt's text
    tokens (one <|image_pad|> per image, one <|video_pad|> per video) plus, per image or video, the tokens that
    placeholder expands into minus itself (`video_tokens`: per example, video.video_token_count of each video).
    Returns {index: why} for the examples whose prompt does not hold exactly one pad per image and video."""
    text_ids = processor.tokenizer([ex.prompt for ex in examples])["input_ids"]
    video_tokens = video_tokens or [[] for _ in examples]
    # the ids the rollout starts from (samples.encode_prompt): the processor expands the k-th image pad into the
    # k-th image's tokens, and fails on a prompt whose pads are not one per image and video
    pad_ids = [getattr(processor, f"{kind}_token_id", None) for kind in ("image", "video")]
    wrong = {}
    for i, (ex, ids, sizes, videos) in enumerate(zip(examples, text_ids, image_sizes, video_tokens, strict=True)):
        pads = [image_token_count(processor.image_processor, w, h, min_pixels, max_pixels) for w, h in sizes]
        ex.num_prompt_tokens = len(ids) + sum(n - 1 for n in pads) + sum(n - 1 for n in videos)
        counts = [ids.count(t) for t in pad_ids if t is not None]
        if counts != [len(sizes), len(videos)][: len(counts)]:
            wrong[i] = (f"{ex.source}: skipped: its prompt holds {counts} image and video pads for {len(sizes)} "
                        f"images and {len(videos)} videos")  # fmt: skip
    return wrong


# ----------------------------------------------------------------------------------------------------------------
# Prompts
# ----------------------------------------------------------------------------------------------------------------


MARKS = {IMAGE_MARK: "image", VIDEO_MARK: "video"}


def user_content(text: str) -> list[dict]:
    """A user turn's content: text, image and video parts in order, split on `<image>` and `<video>`; empty texts
    dropped."""
    content = []
    for piece in re.split(f"({IMAGE_MARK}|{VIDEO_MARK})", text):
        if piece in MARKS:
            content.append({"type": MARKS[piece]})
        elif piece:
            content.append({"type": "text", "text": piece})
    return content


def chat_turns(value) -> list[tuple[str, str]] | None:
    """A prompt column holding chat messages (verl writes `[{"role": "user", "content": "<image>..."}]`) as (role,
    text) pairs, a content given as parts turned back into text with `<image>` marks; None for any other value."""
    if not isinstance(value, (list, tuple)) or not value:
        return None
    if not all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        return None
    turns = []
    for m in value:
        content = m["content"]
        if isinstance(content, (list, tuple)):  # [{"type": "text", "text": ...}, {"type": "image"}, ...]
            mark = {"video": VIDEO_MARK}  # any other non-text part is an image
            content = "".join(p.get("text") or "" if p.get("type") == "text" else mark.get(p.get("type"), IMAGE_MARK)
                              for p in content)  # fmt: skip
        turns.append((str(m["role"]), str(content or "")))
    return turns


class BadRow(ValueError):
    pass


def special_tokens(tokenizer) -> list[str]:
    """The tokenizer's special tokens as they are written in text (`<|image_pad|>`, `<|im_end|>`, ...): a tokenizer
    reads each of them out of any text as its one id, which the processor then takes for an image slot or a turn."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return sorted({t.content for t in added.values() if t.special} | set(tokenizer.all_special_tokens))


def special_token_in(texts, pattern: re.Pattern | None) -> str | None:
    """The first special token (special_tokens, as one alternation) written in any of `texts`, or None."""
    if pattern is None:
        return None
    return next((m.group(0) for text in texts if (m := pattern.search(text))), None)


class MissingColumn(Stop):
    """A configured key that no row of a file has: every row would be bad, or every image silently left out. Every
    rank reads the same files and finds the same, so the run stops with this one line, said once."""

    def __init__(self, message: str):
        super().__init__(f"error: {message}")


class RepeatedInstruction(Stop):
    """Rows that already carry the format prompt's instruction (verl's and others' preprocessed files append it to
    the question): the template would give it twice, and the run would train on prompts its recipe never had."""

    def __init__(self, message: str):
        super().__init__(f"error: {message}")


IMAGE_FILES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff")
VIDEO_FILES = (".mp4", ".avi", ".mov", ".mkv", ".webm")


def looks_like_media(value, option: str, base_dir: str | None) -> bool:
    """A column value as the data's images (option image_key) or videos (video_key) are stored, or a list of them:
    for images an {"bytes", "path"} struct, raw bytes or the path of an image file that exists (relative to base_dir,
    the data file's directory); for videos the path of a video file that exists (a struct or bytes could be either,
    and an image column claims them). A path that names no file is taken for text, as a file name in metadata is."""
    if isinstance(value, (list, tuple)) and value:
        value = value[0]
    if isinstance(value, str):
        suffixes = IMAGE_FILES if option == "image_key" else VIDEO_FILES
        return value.lower().endswith(suffixes) and os.path.isfile(file_source(value, base_dir, "a file"))
    is_image = isinstance(value, (bytes, Image.Image)) or isinstance(value, dict) and "bytes" in value
    return option == "image_key" and is_image


def column_for(option: str, first: dict, base_dir: str | None) -> tuple[str, str] | None:
    """The column (key, what it holds) that data.{option} should name when the configured one is absent, from each
    other column's first value (`first`): chat messages for the prompt, a struct's `ground_truth` for the answer
    (verl's layout for both), images or videos for theirs (looks_like_media)."""
    for k, value in first.items():
        if option == "prompt_key" and chat_turns(value) is not None:
            return k, f"{k!r} holds chat messages"
        if option == "answer_key" and isinstance(value, dict) and value.get("ground_truth") is not None:
            return f"{k}.ground_truth", f"{k!r} holds a ground_truth"
        if option in ("image_key", "video_key") and looks_like_media(value, option, base_dir):
            return k, f"{k!r} holds {option[:5]}s"
    return None


def row_value(row: dict, key: str):
    """`row[key]`; a dotted key reaches into struct columns (`reward_model.ground_truth`, as verl stores the answer).
    A column whose own name has a dot is found first."""
    if key in row or "." not in key:
        return row.get(key)
    value = row
    for part in key.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def row_text(row: dict, key: str) -> str:
    value = row_value(row, key)
    if value is None:
        raise BadRow(f"missing {key!r}")
    text = str(value).strip()
    if not text:
        raise BadRow(f"empty {key!r}")
    return text


def row_images(row: dict, key: str) -> list:
    images = row_value(row, key)
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]


def row_videos(row: dict, key: str) -> list:
    """The row's videos: a list of them (each a frame list or a video file); a lone file (path, bytes, struct) is one
    video. A bare list is always a list of videos, never one video's frames: `[[f0, f1, ...]]` is one frame list."""
    videos = row_value(row, key)
    if videos is None:
        return []
    return list(videos) if isinstance(videos, (list, tuple)) or type(videos).__name__ == "ndarray" else [videos]


def warn_bad_rows(name: str, bad: list[str]) -> None:
    # stacklevel 4 points at the line that built the dataset
    for message in bad[:WARNINGS_PER_FILE]:
        warnings.warn(message, stacklevel=4)
    if len(bad) > WARNINGS_PER_FILE:
        warnings.warn(f"{name}: skipped {len(bad) - WARNINGS_PER_FILE} more bad rows", stacklevel=4)


@dataclass
class Example:
    problem: str  # the row's problem, with `<image>` marks prepended when it had none
    answer: str
    images: list[Image.Image]  # RGB, fitted to the pixel budget, one per `<image>` mark
    messages: list[dict]  # chat messages (images as {"type": "image"} parts)
    prompt: str  # chat template applied, generation prompt added: one <|image_pad|> per image, <|video_pad|> per video
    source: str  # "path/to/file.parquet:17" or "name@split:17"
    num_prompt_tokens: int  # after the processor expands each <|image_pad|> and <|video_pad|>
    videos: list[Video] = field(default_factory=list)  # sampled and resized, one per `<video>` mark
    columns: dict = field(default_factory=dict)  # the row's columns a reward function asks for, as the file has them


class PromptDataset:
    """Validated prompts from one or several data specs; images decoded lazily in `__getitem__`.

    `n_skipped` counts bad rows, `n_overlong` prompts longer than `max_prompt_length` tokens (dropped when
    `filter_overlong_prompts`). Sets `processor`'s pixel range to [min_pixels, max_pixels] (see module docstring).
    `columns`: the row's columns each Example keeps for the reward (True: all). `sample_rows` > 0 parses only that
    many rows of each file, spread evenly (a dry run's check); the key check still reads every row. `n_rows` counts
    the files' rows, every one, `n_read` those parsed (fewer with `sample_rows`).
    """

    def __init__(
        self,
        files: str | list[str],
        processor,
        *,
        prompt_key: str = "problem",
        answer_key: str = "answer",
        image_key: str = "images",
        video_key: str = "videos",
        format_prompt: str | None = None,
        system_prompt: str | None = None,
        tools: list[dict] | None = None,
        min_pixels: int = 262144,
        max_pixels: int = 4194304,
        max_soft_tokens: int = 0,
        video_fps: float = 2.0,
        max_frames: int = 32,
        video_min_pixels: int = 16384,
        video_max_pixels: int = 65536,
        max_prompt_length: int = 2048,
        filter_overlong_prompts: bool = True,
        columns: bool | frozenset[str] = frozenset(),
        sample_rows: int = 0,
    ):
        specs = [files] if isinstance(files, str) else list(files)
        self.processor = processor
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        set_pixel_range(processor, min_pixels, max_pixels)
        set_soft_tokens(processor, max_soft_tokens)
        self.video_budget = (video_fps, max_frames, video_min_pixels, video_max_pixels)
        if video_fps <= 0 or max_frames < 1 or not 0 < video_min_pixels <= video_max_pixels:
            raise ValueError(f"bad video budget: fps {video_fps}, max_frames {max_frames}, "
                             f"pixels [{video_min_pixels}, {video_max_pixels}]")  # fmt: skip
        set_video_range(processor, video_min_pixels, video_max_pixels, max_frames)
        self.template = jinja2.Template(Path(format_prompt).read_text()) if format_prompt else None
        self.prompt_key, self.answer_key, self.image_key, self.video_key = prompt_key, answer_key, image_key, video_key
        self.system_prompt = system_prompt
        self.tools = {"tools": tools} if tools else {}  # the tools' schemas, for a chat template that presents them
        self.columns, self.sample_rows = columns, sample_rows
        # A row's text is text: the model's special tokens written in it would become image slots (the processor
        # then fails at the rollout that draws the row) or turn boundaries (the row rewrites its chat). Such a row
        # is skipped at load (docs/data.md says why not encoded as text); the config's own texts must be clean.
        specials = [t for t in special_tokens(processor.tokenizer) if t not in MARKS]  # (the trainer's own marks)
        self.specials = re.compile("|".join(map(re.escape, specials))) if specials else None
        for key, text in (("data.system_prompt", system_prompt), ("data.format_prompt", self.template and
                          self.template.render(content=""))):  # fmt: skip
            if token := special_token_in([text or ""], self.specials):
                raise ValueError(f"{key} holds the model's special token {token!r}, which the tokenizer reads as "
                                 "a control token, not text: remove it")  # fmt: skip

        examples, sources, image_sizes, video_tokens = self.read_examples(specs)
        self.check_instruction(examples, format_prompt, specs)
        wrong = count_prompt_tokens(examples, image_sizes, processor, min_pixels, max_pixels, video_tokens)
        if wrong:  # (a special token in a row's text is caught before this; this is the last word on any other way)
            warn_bad_rows(", ".join(specs), list(wrong.values()))
            self.n_skipped += len(wrong)
            examples = [ex for i, ex in enumerate(examples) if i not in wrong]
            sources = [s for i, s in enumerate(sources) if i not in wrong]
            if not examples:
                raise ValueError(f"no usable rows in {', '.join(specs)}: {next(iter(wrong.values()))}")
        self.image_sources, self.video_sources = [s[0] for s in sources], [s[1] for s in sources]
        keep = [ex.num_prompt_tokens <= max_prompt_length for ex in examples]
        self.n_overlong = keep.count(False)
        if filter_overlong_prompts and self.n_overlong:
            message = f"{', '.join(specs)}: dropped {self.n_overlong} prompts over {max_prompt_length} tokens"
            warnings.warn(message, stacklevel=2)
            examples = [ex for ex, k in zip(examples, keep, strict=True) if k]
            self.image_sources = [s for s, k in zip(self.image_sources, keep, strict=True) if k]
            self.video_sources = [s for s, k in zip(self.video_sources, keep, strict=True) if k]
            if not examples:
                raise ValueError(f"no prompt in {', '.join(specs)} fits max_prompt_length={max_prompt_length}")
        self.examples = examples

    def check_instruction(self, examples: list[Example], format_prompt: str | None, specs: list[str]) -> None:
        """RepeatedInstruction when a problem already holds what the template adds around it (whitespace aside); a
        template that adds under 20 characters is no instruction to look for."""
        words = " ".join(self.template.render(content="").split()) if self.template else ""
        if len(words) < 20:
            return
        repeated = [ex for ex in examples if words in " ".join(ex.problem.split())]
        if repeated:
            raise RepeatedInstruction(
                f"{', '.join(specs)}: {len(repeated)} of {len(examples)} prompts already hold data.format_prompt's "
                f"instruction ({format_prompt}), as preprocessed files often do ({repeated[0].source}): it would be "
                f"given twice; set data.format_prompt= (empty) for these files"
            )

    def read_examples(self, specs: list[str]) -> tuple[list[Example], list, list, list[list[int]]]:
        """Parse every row of every spec; warn about and count the bad ones; raise if none is usable. Returns the
        examples and per example its (image, video) sources, image sizes and each video's token count."""
        examples, all_sources, image_sizes, video_tokens = [], [], [], []
        self.n_skipped, self.n_rows, self.n_read, first_bad = 0, 0, 0, None
        for spec in specs:
            for part in local_files(spec) or [spec]:
                rows, name = load_rows(part)
                base_dir = os.path.dirname(part) if os.path.exists(part) else None
                self.check_keys(rows, name, base_dir)
                self.n_rows += len(rows)
                bad, read = [], range(len(rows))
                if self.sample_rows and len(rows) > self.sample_rows:
                    read = read[:: len(rows) // self.sample_rows][: self.sample_rows]
                    # the text check is cheap: a dry run finds such rows among every row, not only its sample
                    bad = [f"{name}: skipped row {i}: {problem}" for i, row in enumerate(rows)
                           if i not in read and (problem := self.text_problem(row))]  # fmt: skip
                self.n_read += len(read)
                for i in read:
                    row = rows[i]
                    try:
                        example, sources, sizes, tokens = self.parse_row(row, f"{name}:{i}", base_dir)
                    except BadRow as e:
                        bad.append(f"{name}: skipped row {i}: {e}")
                        continue
                    examples.append(example)
                    all_sources.append(sources)
                    image_sizes.append(sizes)
                    video_tokens.append(tokens)
                warn_bad_rows(name, bad)
                self.n_skipped += len(bad)
                if bad and first_bad is None:
                    first_bad = f"{bad[0]} (row keys: {sorted(rows[0]) if isinstance(rows[0], dict) else None})"
        if not examples:
            raise ValueError(f"no usable rows in {', '.join(specs)}: {first_bad or 'no rows at all'}")
        return examples, all_sources, image_sizes, video_tokens

    def check_keys(self, rows: list, name: str, base_dir: str | None) -> None:
        """MissingColumn for the configured keys no row of the file has (see the module docstring), each with the
        column that holds what it should name, where one does: every fix in one message."""
        rows = [row for row in rows if isinstance(row, dict)]
        have = sorted({k for row in rows for k in row})
        keys = (self.prompt_key, self.answer_key, self.image_key, self.video_key)
        # as the file has it: a list or a struct reaches the reward as its text (the dry run says so)
        self.answer_value = next((v for v in (row_value(row, self.answer_key) for row in rows) if v is not None), None)
        clauses, first = [], None  # each other column's first value, read once a key is missing
        for option, key in zip(("prompt_key", "answer_key", "image_key", "video_key"), keys):
            if any(row_value(row, key) is not None for row in rows):
                continue
            if first is None:
                first = {k: next((r[k] for r in rows if r.get(k) is not None), None) for k in have if k not in keys}
            found = column_for(option, first, base_dir)
            if found is None and key == DEFAULT_KEYS.get(option):  # text-only data: no images (videos) anywhere
                continue
            clause = f"no row has data.{option}={key!r}"
            clauses.append(f"{clause}, but column {found[1]}: set data.{option}={found[0]}" if found else clause)
        if clauses:
            columns = f" (the file's columns: {have})" if ": set " in clauses[-1] else f"; the file's columns: {have}"
            raise MissingColumn(f"{name}: {'; '.join(clauses)}{columns}")

    def parse_row(self, row, source: str, base_dir: str | None) -> tuple[Example, tuple, list, list[int]]:
        """Check one row; return its Example (images and videos still empty), its (image, video) sources, original
        image sizes and video token counts. Each video is decoded and sampled once here, to check it and count it."""
        if not isinstance(row, dict):
            raise BadRow(f"row is a {type(row).__name__}, not an object")
        turns = chat_turns(row_value(row, self.prompt_key))
        if turns is None:
            turns = [("user", row_text(row, self.prompt_key))]
        answer = row_text(row, self.answer_key)
        if problem := self.text_problem(row, turns):
            raise BadRow(problem)
        users = [i for i, (role, _) in enumerate(turns) if role == "user"]
        if not users or not turns[users[-1]][1].strip():
            raise BadRow(f"{self.prompt_key!r} has no user turn with text")
        problem = turns[users[-1]][1].strip()  # the question: the format prompt goes around it
        images = row_images(row, self.image_key)
        videos = row_videos(row, self.video_key)
        for mark, items, what in ((VIDEO_MARK, videos, "videos"), (IMAGE_MARK, images, "images")):
            n_marks = sum(text.count(mark) for _, text in turns)
            if n_marks == 0 and items:  # images end up first, then videos, then the problem
                problem = mark * len(items) + problem
            elif n_marks != len(items):
                raise BadRow(f"{n_marks} {mark} marks but {len(items)} {what}")

        sources, sizes = [], []
        for k, value in enumerate(images):
            try:
                src = image_source(value, base_dir)
                sizes.append(open_image(src).size)
            except Exception as e:  # PIL raises many types (OSError, SyntaxError, DecompressionBombError, ...)
                raise BadRow(f"image {k} does not decode: {type(e).__name__}: {e}") from e
            sources.append(src)
        v_sources, v_tokens = [], []
        for k, value in enumerate(videos):
            try:
                src = video_source(value, base_dir)
                v_tokens.append(video_token_count(self.processor, self.load_video(src)))
            except Exception as e:  # PyAV and PIL raise many types
                raise BadRow(f"video {k} does not decode: {type(e).__name__}: {e}") from e
            v_sources.append(src)

        text = self.template.render(content=problem) if self.template else problem
        messages = [
            {"role": role, "content": user_content(text if i == users[-1] else t) if role == "user" else t}
            for i, (role, t) in enumerate(turns)
        ]
        if self.system_prompt and turns[0][0] != "system":  # a system turn in the data replaces the default one
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        prompt = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **self.tools)
        kept = {k: v for k, v in row.items() if self.columns is True or k in self.columns} if self.columns else {}
        example = Example(problem, answer, [], messages, prompt, source, num_prompt_tokens=0, columns=kept)
        return example, (sources, v_sources), sizes, v_tokens

    def text_problem(self, row, turns=None) -> str | None:
        """Why a row's text cannot be the model's input (a special token written in it), or None."""
        if turns is None:
            if not isinstance(row, dict):
                return None  # (parse_row says what is wrong with it)
            turns = chat_turns(row_value(row, self.prompt_key)) or [("", str(row_value(row, self.prompt_key) or ""))]
        token = special_token_in([text for _, text in turns], self.specials)
        if token is None:
            return None
        return (f"{self.prompt_key!r} holds the model's special token {token!r}: the tokenizer would read it as an "
                "image slot or a turn boundary, not as text")  # fmt: skip

    def load_video(self, source) -> Video:
        fps, max_frames, min_pixels, max_pixels = self.video_budget
        side = image_side(self.processor.video_processor)  # the video processor's own patch x merge
        return load_video(source, fps, max_frames, min_pixels, max_pixels, side)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> Example:
        side = image_side(self.processor.image_processor)
        images = [fit_image(open_image(s), self.min_pixels, self.max_pixels, side) for s in self.image_sources[i]]
        videos = [self.load_video(s) for s in self.video_sources[i]]
        return dataclasses.replace(self.examples[i], images=images, videos=videos)


# ----------------------------------------------------------------------------------------------------------------
# Sharding
# ----------------------------------------------------------------------------------------------------------------


class ShardSampler:
    """Each epoch, one permutation shared by all ranks; rank r takes the r-th of `world_size` equal slices.

    The remainder (num_examples % world_size) is dropped, and a different one each epoch, so every rank runs the
    same number of steps: a rank with one batch more would hang in the collectives.
    """

    def __init__(self, num_examples: int, rank: int, world_size: int, seed: int = 1, shuffle: bool = True):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")
        if num_examples < world_size:
            raise ValueError(f"{num_examples} examples cannot be split over {world_size} ranks")
        self.num_examples, self.rank, self.world_size = num_examples, rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.num_per_rank = num_examples // world_size

    def indices(self, epoch: int) -> list[int]:
        order = list(range(self.num_examples))
        if self.shuffle:
            # A string seed is hashed with SHA-512: the same in every process, and (1, 10) never meets (11, 0).
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        start = self.rank * self.num_per_rank
        return order[start : start + self.num_per_rank]

    def next_indices(self, epoch: int, position: int, count: int) -> tuple[list[int], int, int]:
        """The next `count` prompts of this rank's shard after `position` in `epoch`, and the new (epoch, position):
        a new epoch (a new permutation) starts when the shard runs out."""
        if position + count > len(self.indices(epoch)):
            epoch, position = epoch + 1, 0
        return self.indices(epoch)[position : position + count], epoch, position + count


def batches_per_epoch(num_examples: int, world_size: int, rollout_batch_size: int) -> int:
    """The rollout batches (rollout_batch_size // world_size prompts a rank) that each rank's ShardSampler slice of
    `num_examples` prompts fills: the run's steps an epoch, 0 when the data is short of one batch."""
    return (num_examples // world_size) // (rollout_batch_size // world_size)
