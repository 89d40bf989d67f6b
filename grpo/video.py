"""Videos: frame lists and video files -> sampled, equally sized RGB frames with their timing, and their token count.

    video = load_video(value, base_dir, fps=2.0, max_frames=32, min_pixels=16384, max_pixels=65536, side=28)
    video.frames      # list of PIL RGB frames, all of one size, sides multiples of `side`, an even count
    video.metadata()  # transformers.VideoMetadata: the frames' source indices and frame rate (the time the model sees)

A video is a list of frames (each anything an image may be: a `{bytes, path}` struct, a path, bytes, a PIL image),
taken as already sampled at `fps`, or a video file (a path, or a `{bytes, path}` struct / bytes holding one), decoded
with PyAV (pip's `av` wheels carry their own FFmpeg) and sampled at `fps`. Either way at most `max_frames` frames are
kept (evenly spread), and the count is made even by repeating the last frame: Qwen's vision towers take frames in
pairs (temporal_patch_size 2), and the processors pad an odd count the same way, so the padding is done once here,
where the trainer and vLLM both see it.

Frames are resized here, all to one size, each side a multiple of the merged-token side (28 px for Qwen2.5-VL, 32 px
for Qwen3-VL and Qwen3.5) and the area within [min_pixels, max_pixels] per frame (Qwen's smart_resize rule). The
processors then have nothing left to resize (set_video_range tells them a budget these frames already meet), so a
video's token count follows from its frame count and size alone, without running the processor on pixels.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

from PIL import Image

from grpo.media import file_source, image_source, open_image, to_rgb

VIDEO_MARK = "<video>"
MAX_ASPECT_RATIO = 100  # as data.py pads images to: Qwen's towers reject ratios >= 200


@dataclass
class Video:
    frames: list  # PIL RGB frames, one size, an even count
    fps: float  # frame rate of the source the indices count in
    indices: list[int]  # each frame's index in its source (a repeated last frame repeats its index)
    total: int  # frames in the source
    sampled: int  # frames sampled, before the last one was repeated to make the count even

    def metadata(self):
        """What the processors need to place the frames in time: Qwen2.5-VL's mRoPE spaces the temporal positions by
        the sampled frame rate (second_per_grid_ts), Qwen3-VL and Qwen3.5 write each frame pair's time into the
        prompt (`<1.2 seconds>`). The indices are those sampled, without the repeated last frame: the frame rate
        the processors derive from them (sampled / total x fps) is then the true one, and they pad the indices to
        pairs for the timestamps themselves, as they pad the frames."""
        from transformers.video_utils import VideoMetadata

        width, height = self.frames[0].size
        return VideoMetadata(total_num_frames=self.total, fps=self.fps, width=width, height=height,
                             duration=self.total / self.fps, frames_indices=self.indices[: self.sampled])  # fmt: skip


def is_frame_list(value) -> bool:
    return isinstance(value, (list, tuple)) or type(value).__name__ == "ndarray"


def evenly(n: int, k: int) -> list[int]:
    """k indices spread evenly over range(n), first and last included (k <= n)."""
    if k <= 1:
        return [0]
    return [round(i * (n - 1) / (k - 1)) for i in range(k)]


def sampled_count(total: int, src_fps: float, fps: float, max_frames: int) -> int:
    """Frames to take from a `total`-frame source at `src_fps` to sample it at `fps`: at least one, at most the
    source's and max_frames."""
    return max(1, min(total, max_frames, round(total / src_fps * fps)))


def decode_file(source: bytes | str, fps: float, max_frames: int) -> tuple[dict, list[int], int, float]:
    """The frames of a video file (path or bytes) sampled at `fps` (at most max_frames): {index: PIL image}, the
    sampled indices, the file's frame count and its frame rate. Two passes: the first counts the frames (a
    container's own count can be missing or wrong), the second converts only the sampled ones, so a long video never
    sits in memory decoded."""
    import av  # only here: the trainer imports without PyAV when no video file is read

    def open_stream():
        container = av.open(io.BytesIO(source) if isinstance(source, bytes) else source)
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        if not rate or float(rate) <= 0:
            container.close()
            raise ValueError("the video stream has no frame rate")
        return container, stream, float(rate)

    container, stream, rate = open_stream()
    with container:
        total = sum(1 for _ in container.decode(stream))
    if total == 0:
        return {}, [], 0, rate
    indices = evenly(total, sampled_count(total, rate, fps, max_frames))
    wanted, picked = set(indices), {}
    container, stream, _ = open_stream()
    with container:
        for i, frame in enumerate(container.decode(stream)):
            if i in wanted:
                picked[i] = frame.to_image()
            if len(picked) == len(wanted):
                break
    return picked, indices, total, rate


def frame_size(width: int, height: int, min_pixels: int, max_pixels: int, side: int) -> tuple[int, int]:
    """(width, height) a frame is resized to: each side a multiple of `side`, the area in [min_pixels, max_pixels]
    (Qwen's smart_resize rule: round to the grid, then scale down or up by sqrt(budget / area) when outside)."""
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise ValueError(f"aspect ratio of {width}x{height} is over {MAX_ASPECT_RATIO}")
    w, h = max(side, round(width / side) * side), max(side, round(height / side) * side)
    if w * h > max_pixels:
        beta = math.sqrt(width * height / max_pixels)
        w, h = max(side, math.floor(width / beta / side) * side), max(side, math.floor(height / beta / side) * side)
    elif w * h < min_pixels:
        beta = math.sqrt(min_pixels / (width * height))
        w, h = math.ceil(width * beta / side) * side, math.ceil(height * beta / side) * side
    return w, h


def video_source(value, base_dir: str | None):
    """What to read a video from: a list of frame sources (see media.image_source), or a file's bytes or path."""
    if is_frame_list(value):
        return [image_source(frame, base_dir) for frame in value]
    return file_source(value, base_dir, "a video")


def load_video(source, fps: float, max_frames: int, min_pixels: int, max_pixels: int, side: int) -> Video:
    """The sampled, resized frames of a video_source (see the module docstring). Raises on a video that does not
    decode or has no frame."""
    if isinstance(source, list):  # frames: already sampled at `fps`, thinned to max_frames
        total, src_fps = len(source), fps
        indices = evenly(total, sampled_count(total, src_fps, fps, max_frames)) if total else []
        frames = {i: open_image(source[i]) for i in set(indices)}
    else:
        frames, indices, total, src_fps = decode_file(source, fps, max_frames)
    if not indices:
        raise ValueError("no frames")
    sampled = len(indices)
    if len(indices) % 2:  # the towers take frames in pairs: repeat the last, as the processors would
        indices.append(indices[-1])
    size = frame_size(*frames[indices[0]].size, min_pixels, max_pixels, side)
    picked = {}
    for i in set(indices):
        frame = to_rgb(frames[i])
        picked[i] = frame if frame.size == size else frame.resize(size, Image.Resampling.BICUBIC)
    return Video([picked[i] for i in indices], src_fps, indices, total, sampled)


def video_processor_size(video_processor, min_pixels: int, max_pixels: int, max_frames: int) -> dict:
    """The `size` budget under which the processor leaves load_video's frames exactly as they are. Qwen2-VL's video
    processor (Qwen2.5-VL's) budgets each frame; Qwen3-VL's (Qwen3-VL's and Qwen3.5's) the whole clip, frames x
    pixels, so its bounds are those of the shortest and the longest clip load_video makes."""
    per_clip = "num_frames" in _smart_resize_params(video_processor)
    if per_clip:
        max_frames = max_frames + max_frames % 2
        return {"shortest_edge": 2 * min_pixels, "longest_edge": max_frames * max_pixels}
    return {"shortest_edge": min_pixels, "longest_edge": max_pixels}


def _smart_resize_params(video_processor) -> set[str]:
    import importlib
    import inspect

    module = importlib.import_module(type(video_processor).__module__)
    return set(inspect.signature(module.smart_resize).parameters)


def set_video_range(processor, min_pixels: int, max_pixels: int, max_frames: int) -> None:
    """Make the processor take load_video's frames as they are: no resampling in time (they are sampled already),
    no resizing (they fit video_processor_size), no per-frame pixel cap of its own."""
    vp = processor.video_processor
    if vp.size is None:  # Gemma 4's: frames resized to its soft-token budget, no size (its videos are refused here)
        return
    size_type = type(vp.size)
    vp.size = size_type(**video_processor_size(vp, min_pixels, max_pixels, max_frames))
    vp.do_sample_frames = False
    vp.cap_pixels_per_frame = False  # transformers >= 5.17 warns when unset; the frames here are sized already


def video_grid(video_processor, frames: int, width: int, height: int) -> list[int]:
    """(t, h, w) in patches of a video of `frames` frames (even) of width x height (multiples of the merged side)."""
    patch = video_processor.patch_size
    return [frames // video_processor.temporal_patch_size, height // patch, width // patch]


def video_token_count(processor, video: Video) -> int:
    """Tokens the processor puts in place of one `<|video_pad|>` for this video: the pads (t x h x w / merge^2), plus
    for Qwen3-VL and Qwen3.5 a `<t seconds>` text and vision start/end tokens around each frame pair. Taken from the
    processor's own replacement text, tokenized: it is bounded by special tokens on both sides, so it tokenizes in
    the prompt exactly as alone."""
    import torch

    width, height = video.frames[0].size
    grid = torch.tensor([video_grid(processor.video_processor, len(video.frames), width, height)])
    text = processor.replace_video_token({"video_grid_thw": grid, "video_metadata": [video.metadata()]}, 0)
    return len(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
