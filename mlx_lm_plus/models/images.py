"""A request's images, decoded and fingerprinted.

The CPU work done on a request's images before it reaches the generation
thread (the HTTP side runs it in an executor): each data URL decoded to
RGB pixels, scaled down to the model's processor limit, and given a
fingerprint. A room of its own because the HTTP intake, the sequential
mlx-vlm path (vlm_generation.py) and the batched one (vision.py) all take
decoded images, and none of them needs the others' model code for it; and
DecodedImage is part of what a request hands the other ranks of
mx.distributed (engine/distributed.py's unpickle allowlist names it here).

Cache keys: each image's placeholder tokens are replaced by one negative id
derived from an xxh3 fingerprint of the decoded pixels (with size and
mode), so the same picture sent again (even re-encoded) hits, and two
different pictures never share a key past the first of them.
"""

import io
from dataclasses import dataclass
from typing import Any, List, Optional

from mlx_lm_plus.codec import b64decode


def decode_image(url: str, max_pixels: Optional[int] = None):
    """A PIL RGB image from a data URL (validation already checked it),
    scaled down to at most `max_pixels` (the model's processor would scale it
    down to that anyway; doing it here bounds what a request holds)."""
    from PIL import Image, ImageOps

    data = b64decode(url.partition(",")[2])
    with Image.open(io.BytesIO(data)) as image:
        image.seek(0)  # GIF: the first frame
        # A photo's EXIF orientation applied (as mlx-vlm's load_image does;
        # only then: it decodes the whole picture, a JPEG draft can't follow).
        if image.getexif().get(0x0112, 1) != 1:
            image = ImageOps.exif_transpose(image)
        width, height = image.size
        if max_pixels and width * height > max_pixels:
            scale = (max_pixels / (width * height)) ** 0.5
            size = (max(1, int(width * scale)), max(1, int(height * scale)))
            image.draft("RGB", size)  # JPEG: decode at a reduced scale
            out = image.convert("RGB").resize(size, Image.Resampling.BICUBIC)
        else:
            out = image.convert("RGB")
    # The pixels only: the file's metadata (EXIF rationals, PNG text chunks)
    # serves nothing past here, and is no part of a request the other ranks
    # of mx.distributed unpickle.
    out.info = {}
    return out


@dataclass
class DecodedImage:
    image: Any  # PIL RGB
    fingerprint: int


def decode_images(urls: List[str], max_pixels: Optional[int] = None) -> List[DecodedImage]:
    """Decode and fingerprint a request's images: CPU work done before the
    request reaches the generation thread (the API runs it in an executor)."""
    decoded = []
    for url in urls:
        image = decode_image(url, max_pixels)
        decoded.append(DecodedImage(image, fingerprint(image)))
    return decoded


def fingerprint(image) -> int:
    """xxh3-64 of the decoded pixels, size and mode: a negative cache id."""
    import xxhash

    h = xxhash.xxh3_64()
    h.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    h.update(image.tobytes())
    return -1 - (h.intdigest() >> 1)
