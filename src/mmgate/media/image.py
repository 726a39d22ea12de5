"""Image decode: encoded bytes -> RGB uint8 array, as the reference loads it.

Stage: decode.  In: the fetched bytes of one ``image_url`` part; out: a
:class:`~mmgate.types.DecodedImage`.

"The reference" is a transformers 5.24 processor handed
``PIL.Image.open(BytesIO(bytes))``: both image-processor backends
(``TorchvisionBackend.process_image`` and ``PilBackend.process_image`` in
``image_processing_backends.py``) convert a PIL image with
``image_transforms.convert_to_rgb`` when ``do_convert_rgb`` (Qwen-VL: True),
which this module ports as :func:`to_rgb`:

* an image with an alpha band (RGBA, LA, PA, La, RGBa) or a ``transparency``
  entry (palette or grey PNG/GIF with tRNS) is converted to RGBA and
  alpha-composited on opaque white;
* every other mode is ``Image.convert("RGB")``: L and 1 replicate the grey
  value, P looks up the palette, CMYK and YCbCr use Pillow's conversions
  (Adobe-inverted CMYK JPEGs are already un-inverted by the JPEG decoder),
  I;16 and I clip at 255 and F truncates, as Pillow does.

Multi-frame files (animated GIF/WebP/PNG, MPO, multi-page TIFF) give their
first frame, which is where ``Image.open`` leaves them.

EXIF orientation is *not* applied by default: the reference processors do
not transpose a PIL image they are handed (only ``image_utils.load_image``
and ``load_image_as_tensor``, used when a processor is given a URL or path
string, apply it).  ``apply_exif_orientation=True``
(``--mm-image-apply-exif-orientation``) applies ``ImageOps.exif_transpose``
first; the content hash then changes too, so a cache never mixes the two.

Hostile input: only the formats in :data:`ACCEPTED_FORMATS` are opened (no
EPS, which would run Ghostscript); the pixel count is checked from the header
before any pixel is decoded (decompression bombs); any failure inside Pillow
is the caller's bytes and becomes ``media_decode_failed`` (400), never a 500.
No warning filters are touched: ``warnings.catch_warnings`` is not thread-safe
and decoding runs in a thread pool.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageOps

from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.hashing import content_hash
from mmgate.types import DecodedImage

#: Pillow format ids the decoder opens (``Image.open(..., formats=...)``); JPEG covers MPO, PNG covers APNG.
ACCEPTED_FORMATS = ("JPEG", "PNG", "GIF", "WEBP", "BMP", "DIB", "TIFF", "ICO", "AVIF", "JPEG2000", "PPM", "QOI")

_EXIF_ORIENTATION = 0x0112


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers ``image_transforms.convert_to_rgb`` for PIL images (5.24)."""
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if image.mode == "RGB":
        return image  # convert("RGB") would return a copy of the same pixels
    return image.convert("RGB")


def _open_checked(data: bytes, max_pixels: int) -> Image.Image:
    """``Image.open`` limited to :data:`ACCEPTED_FORMATS`, refusing oversize headers before decoding."""
    image = Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
    width, height = image.size
    if width <= 0 or height <= 0:
        raise GatewayError(ErrorCode.MEDIA_DECODE_FAILED, "image has a zero-sized side")
    if width * height > max_pixels:
        raise GatewayError(ErrorCode.MEDIA_TOO_LARGE,
                           f"image of {width}x{height} pixels exceeds the limit of {max_pixels} pixels")
    return image


def _orient(image: Image.Image) -> tuple[Image.Image, bool]:
    """``ImageOps.exif_transpose`` and whether it changed anything."""
    orientation = image.getexif().get(_EXIF_ORIENTATION, 1)
    if orientation in (None, 1):
        return image, False
    transposed = ImageOps.exif_transpose(image)
    return (transposed if transposed is not None else image), True


def decode_image(data: bytes, max_pixels: int, apply_exif_orientation: bool = False) -> DecodedImage:
    """Decode ``data`` into RGB pixels.

    Args:
        data: the encoded image bytes (one of :data:`ACCEPTED_FORMATS`).
        max_pixels: refuse images whose header declares more pixels.
        apply_exif_orientation: transpose by the EXIF orientation tag first
            (off by default, as the reference).

    Returns:
        DecodedImage with uint8 ``[H, W, 3]`` pixels and the blake3 hash of ``data``
        (of ``data`` with a marker when an EXIF transpose changed the pixels).

    Raises:
        GatewayError(MEDIA_DECODE_FAILED): not an image, a refused format, truncated, or corrupt.
        GatewayError(MEDIA_TOO_LARGE): the header declares more than ``max_pixels``.
    """
    oriented = False
    try:
        image = _open_checked(data, max_pixels)
        image.seek(0)
        image.load()
        if apply_exif_orientation:
            image, oriented = _orient(image)
        pixels = np.array(to_rgb(image), dtype=np.uint8)  # writable copy (torch.from_numpy needs one)
    except GatewayError:
        raise
    except Image.DecompressionBombError:
        raise GatewayError(ErrorCode.MEDIA_TOO_LARGE, "image exceeds Pillow's decompression-bomb limit") from None
    except MemoryError:
        raise GatewayError(ErrorCode.MEDIA_TOO_LARGE, "image is too large to decode") from None
    except Exception as exc:  # noqa: BLE001 - any failure inside Pillow is the caller's bytes
        raise GatewayError(ErrorCode.MEDIA_DECODE_FAILED, f"image could not be decoded ({type(exc).__name__})") from None
    if pixels.ndim != 3 or pixels.shape[2] != 3 or 0 in pixels.shape:
        raise GatewayError(ErrorCode.MEDIA_DECODE_FAILED, "image did not convert to RGB")
    digest = content_hash(b"mmgate-exif-transposed:" + data if oriented else data)
    return DecodedImage(pixels=np.ascontiguousarray(pixels), content_hash=digest, num_bytes=len(data))
