"""Reading a row's images and video files: the decoding both data paths share (data.py's images, video.py's frames
and files), below both so neither imports the other.

    src = image_source(row_value, base_dir)   # bytes, a path resolved against the data file's directory, or PIL
    img = to_rgb(open_image(src))             # fully decoded, RGB on white
"""

import io
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
