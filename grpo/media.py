"""Reading a row's images and video files and sizing images for the model: the decoding both data paths share
(data.py's images, video.py's frames and files) and the pixel budget the trainer, vLLM and tool turns all apply,
below every one of them so none imports another.

    src = image_source(row_value, base_dir)   # bytes, a path resolved against the data file's directory, or PIL
    img = to_rgb(open_image(src))             # fully decoded, RGB on white
"""

import io
import math
import os

from PIL import Image


def file_source(value, base_dir: str | None, what: str) -> bytes | str:
    """What to read a file from: its bytes, or its path resolved against the data file's directory; a `{bytes, path}`
    struct gives its bytes, else its path. `what` names the item in errors ("an image", "a video")."""
    if isinstance(value, dict):
        if value.get("bytes"):
            return value["bytes"]
        value = value.get("path")
        if not value:
            raise ValueError(f"{what} struct has neither bytes nor path")
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value if os.path.isabs(value) or base_dir is None else os.path.join(base_dir, value)
    raise ValueError(f"cannot read {what} from {type(value).__name__}")


def image_source(value, base_dir: str | None) -> bytes | str | Image.Image:
    """What to decode an image from: a PIL image as it is, else file_source's bytes or path."""
    return value if isinstance(value, Image.Image) else file_source(value, base_dir, "an image")


def open_image(source: bytes | str | Image.Image) -> Image.Image:
    """Decode fully (`load`), so truncated data fails here and file handles are released."""
    if isinstance(source, Image.Image):
        return source
    img = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
    img.load()
    return img


def to_rgb(img: Image.Image) -> Image.Image:
    if img.mode.startswith("I"):  # 16/32-bit grey: convert("RGB") would clip everything above 255 to white
        img = img.convert("I").point(lambda v: v / 257).convert("L")
    if img.has_transparency_data:  # transparent backgrounds would turn black; diagrams are drawn on white
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", img.size, "white"), rgba).convert("RGB")
    return img.convert("RGB")


# The vision tower needs each side >= one merged token's side (patch x merge: 14 x 2 = 28 px for Qwen2.5-VL, the
# default here; 16 x 2 = 32 px for Qwen3-VL and Qwen3.5, see image_side) and rejects aspect ratios >= 200.
# We pad to ratio 100, well inside the limit, so rounding in our resize and in the processor cannot cross it.
MIN_SIDE = 28
MAX_ASPECT_RATIO = 100


def fitted_size(
    width: int, height: int, min_pixels: int, max_pixels: int, min_side: int = MIN_SIDE
) -> tuple[tuple[int, int], tuple[int, int]]:
    """(image size, canvas size) that a width x height image becomes in `fit_image`.

    The canvas is the image padded (right/bottom, white) to an aspect ratio Qwen accepts, then scaled by
    sqrt(budget / area) when its area is outside [min_pixels, max_pixels], then padded to sides >= min_side (the
    model's image_side).
    Images of ordinary shape are only scaled: canvas == image.
    Rounding goes down when shrinking and up when growing, so the area lands inside the budget.
    """
    # An area >= min_pixels at ratio <= min_pixels / min_side² has sides >= min_side, so the last padding step
    # only fires for budgets below min_side² (where it may overshoot max_pixels by a few rows).
    max_ratio = max(1.0, min(MAX_ASPECT_RATIO, min_pixels / min_side**2))
    canvas_w = max(width, math.ceil(height / max_ratio))
    canvas_h = max(height, math.ceil(width / max_ratio))
    area = canvas_w * canvas_h
    if area > max_pixels:
        scale, rnd = math.sqrt(max_pixels / area), math.floor
    elif area < min_pixels:
        scale, rnd = math.sqrt(min_pixels / area), math.ceil
    else:
        scale, rnd = 1.0, round
    image = (max(1, rnd(width * scale)), max(1, rnd(height * scale)))
    canvas = (max(min_side, image[0], rnd(canvas_w * scale)), max(min_side, image[1], rnd(canvas_h * scale)))
    return image, canvas


def fit_image(img: Image.Image, min_pixels: int, max_pixels: int, min_side: int = MIN_SIDE) -> Image.Image:
    """RGB, scaled into the pixel budget, padded only when Qwen would reject the shape (see `fitted_size`)."""
    img = to_rgb(img)
    size, canvas_size = fitted_size(*img.size, min_pixels, max_pixels, min_side)
    if size != img.size:
        img = img.resize(size, Image.Resampling.BICUBIC)
    if canvas_size != size:
        canvas = Image.new("RGB", canvas_size, "white")
        canvas.paste(img, (0, 0))
        img = canvas
    return img


def set_pixel_range(processor, min_pixels: int, max_pixels: int) -> None:
    """Make the processor resize images with the same budget as the dataset (and as vLLM must). Gemma 4's resizes to
    its soft-token budget instead and has no size to set."""
    if processor.image_processor.size is None:
        return
    size_type = type(processor.image_processor.size)  # transformers' SizeDict; built like this to skip a slow import
    processor.image_processor.size = size_type(shortest_edge=min_pixels, longest_edge=max_pixels)


# the budgets Gemma 4's image processor and vLLM's gemma4_mm take
SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)


def set_soft_tokens(processor, max_soft_tokens: int) -> None:
    """data.max_soft_tokens onto the processor (0: leave its own). Only Gemma 4's processor has a soft-token budget;
    asked of another, or with a budget it does not take, a ValueError naming the key."""
    if not max_soft_tokens:
        return
    if not hasattr(processor.image_processor, "max_soft_tokens"):
        raise ValueError(f"data.max_soft_tokens={max_soft_tokens}: only a Gemma 4 checkpoint's processor has a "
                         "soft-token budget (the others' images are sized by data.min_pixels/max_pixels)")  # fmt: skip
    if max_soft_tokens not in SOFT_TOKEN_BUDGETS:
        raise ValueError(f"data.max_soft_tokens={max_soft_tokens}: Gemma 4 takes one of {SOFT_TOKEN_BUDGETS}")
    processor.image_processor.max_soft_tokens = max_soft_tokens


def image_side(image_processor) -> int:
    """Side in pixels of one merged image token, patch x merge: 28 for Qwen2.5-VL (14 x 2), 32 for Qwen3-VL and
    Qwen3.5 (16 x 2), 48 for Gemma 4 (16 px patches pooled 3 x 3 into a soft token). Taken from the checkpoint's own
    processor, which resizes every side to a multiple of it and cannot make a side shorter than it."""
    merge = getattr(image_processor, "merge_size", None) or image_processor.pooling_kernel_size
    return image_processor.patch_size * merge


def image_token_count(image_processor, width: int, height: int, min_pixels: int, max_pixels: int) -> int:
    """Tokens the processor expands one `<|image_pad|>` into for an image fitted from width x height. Gemma 4's
    resizes every image, aspect kept, to fill its soft-token budget (whatever min/max_pixels say): its soft tokens
    at that size, and the begin and end markers around them."""
    _, (w, h) = fitted_size(width, height, min_pixels, max_pixels, image_side(image_processor))
    if hasattr(image_processor, "max_soft_tokens"):
        from transformers.models.gemma4.image_processing_gemma4 import get_aspect_ratio_preserving_size

        k, patch = image_processor.pooling_kernel_size, image_processor.patch_size
        th, tw = get_aspect_ratio_preserving_size(height=h, width=w, patch_size=patch,
                                                  max_patches=image_processor.max_soft_tokens * k**2,
                                                  pooling_kernel_size=k)  # fmt: skip
        return (th // (patch * k)) * (tw // (patch * k)) + 2
    budget = {"min_pixels": min_pixels, "max_pixels": max_pixels}
    patches = image_processor.get_number_of_image_patches(h, w, budget)
    return patches // image_processor.merge_size**2
