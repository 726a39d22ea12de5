"""Image decode: encoded bytes -> RGB uint8 array, as the reference loads it.

Stage: decode.  In: the fetched bytes of one ``image_url`` part; out: a
:class:`~mmgate.types.DecodedImage`.

Mirrors what a transformers processor sees when given ``PIL.Image.open(bytes)``:
the first frame of animated files, then ``image_transforms.convert_to_rgb``
(transformers 5.24): an image with an alpha band or a ``transparency`` entry is
converted to RGBA and alpha-composited on opaque white, any other mode is
``convert("RGB")``.  EXIF orientation is *not* applied, as the reference
processors do not apply it to a PIL image they are handed.

The pixel count is checked from the header before any pixel is decoded
(decompression bombs).
"""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image, UnidentifiedImageError

from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.hashing import content_hash
from mmgate.types import DecodedImage


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers ``image_transforms.convert_to_rgb`` for PIL images (5.24)."""
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def decode_image(data: bytes, max_pixels: int) -> DecodedImage:
    """Decode ``data`` into RGB pixels.

    Args:
        data: the encoded image bytes (any format Pillow reads).
        max_pixels: refuse images whose header declares more pixels.

    Returns:
        DecodedImage with uint8 ``[H, W, 3]`` pixels and the blake3 hash of ``data``.

    Raises:
        GatewayError(MEDIA_DECODE_FAILED): not an image, truncated, or corrupt.
        GatewayError(MEDIA_TOO_LARGE): the header declares more than ``max_pixels``.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width <= 0 or height <= 0:
                raise GatewayError(ErrorCode.MEDIA_DECODE_FAILED, "image has a zero-sized side")
            if width * height > max_pixels:
                raise GatewayError(
                    ErrorCode.MEDIA_TOO_LARGE, f"image of {width}x{height} pixels exceeds the limit of {max_pixels} pixels"
                )
            image.seek(0)
            image.load()
            rgb = to_rgb(image)
            pixels = np.array(rgb, dtype=np.uint8)  # writable copy (torch.from_numpy needs one)
    except GatewayError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as exc:
        raise GatewayError(ErrorCode.MEDIA_DECODE_FAILED, f"image could not be decoded ({type(exc).__name__})") from None
    if pixels.ndim != 3 or pixels.shape[2] != 3:
        raise GatewayError(ErrorCode.MEDIA_DECODE_FAILED, "image did not convert to RGB")
    return DecodedImage(pixels=np.ascontiguousarray(pixels), content_hash=content_hash(data), num_bytes=len(data))
