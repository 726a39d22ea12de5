"""Image decode equals the reference: ``convert_to_rgb(PIL.Image.open(BytesIO(bytes)), return_numpy=True)``.

transformers 5.24 ``image_processing_backends.py`` (both backends) converts a
PIL image with ``image_transforms.convert_to_rgb`` when ``do_convert_rgb``;
these tests compare ``mmgate.media.image.decode_image`` with exactly that
call, for every Pillow mode a web image can arrive in, animated files,
truncated files and EXIF-rotated files.
"""

from __future__ import annotations

import io
import resource
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image, ImageOps
from transformers.image_transforms import convert_to_rgb
from transformers.image_utils import load_image

from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.image import decode_image
from mmgate.config.settings import FetchSettings

MAX_PIXELS = FetchSettings().max_image_pixels
RNG = np.random.default_rng(1234)


def reference_rgb(data: bytes) -> np.ndarray:
    """What a transformers 5.24 processor sees when handed ``PIL.Image.open(BytesIO(data))``."""
    return convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)


def encode(image: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def noise(mode: str, size: tuple[int, int] = (23, 17)) -> Image.Image:
    """A ``mode`` image of random content (alpha bands random too, so compositing matters)."""
    w, h = size
    if mode in ("I;16", "I;16B"):
        return Image.fromarray(RNG.integers(0, 65536, (h, w), dtype=np.uint16))  # mode I;16
    if mode == "I":
        return Image.fromarray(RNG.integers(-5000, 70000, (h, w)).astype(np.int32), "I")
    if mode == "F":
        return Image.fromarray((RNG.random((h, w)) * 400 - 50).astype(np.float32), "F")
    if mode == "1":
        return Image.fromarray(RNG.integers(0, 2, (h, w)).astype(bool))
    if mode == "P":
        img = Image.fromarray(RNG.integers(0, 16, (h, w), dtype=np.uint8), "L").convert("P")
        img.putpalette(RNG.integers(0, 256, 768, dtype=np.uint8).tolist())
        return img
    bands = len(Image.new(mode, (1, 1)).getbands())
    arr = RNG.integers(0, 256, (h, w, bands), dtype=np.uint8)
    return Image.frombytes(mode, (w, h), arr.tobytes())


# (case id, image factory, format, save kwargs)
MODE_CASES = [
    ("1-png", lambda: noise("1"), "PNG", {}),
    ("1-bmp", lambda: noise("1"), "BMP", {}),
    ("L-png", lambda: noise("L"), "PNG", {}),
    ("L-jpeg", lambda: noise("L"), "JPEG", {"quality": 90}),
    ("L-trns-png", lambda: noise("L"), "PNG", {"transparency": 7}),
    ("LA-png", lambda: noise("LA"), "PNG", {}),
    ("LA-tiff", lambda: noise("LA"), "TIFF", {}),
    ("P-png", lambda: noise("P"), "PNG", {}),
    ("P-trns-index-png", lambda: noise("P"), "PNG", {"transparency": 3}),
    ("P-trns-bytes-png", lambda: noise("P"), "PNG", {"transparency": bytes(range(0, 256, 16))}),
    ("P-gif", lambda: noise("P"), "GIF", {}),
    ("P-trns-gif", lambda: noise("P"), "GIF", {"transparency": 5}),
    ("P-bmp", lambda: noise("P"), "BMP", {}),
    ("PA-tiff", lambda: noise("PA"), "TIFF", {}),
    ("RGB-png", lambda: noise("RGB"), "PNG", {}),
    ("RGB-trns-png", lambda: noise("RGB"), "PNG", {"transparency": (1, 2, 3)}),
    ("RGB-jpeg", lambda: noise("RGB"), "JPEG", {"quality": 90}),
    ("RGB-webp", lambda: noise("RGB"), "WEBP", {"quality": 90}),
    ("RGB-bmp", lambda: noise("RGB"), "BMP", {}),
    ("RGB-tiff", lambda: noise("RGB"), "TIFF", {}),
    ("RGB-ppm", lambda: noise("RGB"), "PPM", {}),
    ("RGB-ico", lambda: noise("RGB", (32, 32)), "ICO", {}),
    ("RGBA-png", lambda: noise("RGBA"), "PNG", {}),
    ("RGBA-webp-lossless", lambda: noise("RGBA"), "WEBP", {"lossless": True}),
    ("RGBA-tiff", lambda: noise("RGBA"), "TIFF", {}),
    ("RGBX-tiff", lambda: noise("RGBX"), "TIFF", {}),
    ("CMYK-jpeg", lambda: noise("CMYK"), "JPEG", {"quality": 95}),
    ("CMYK-tiff", lambda: noise("CMYK"), "TIFF", {}),
    ("YCbCr-tiff", lambda: noise("YCbCr"), "TIFF", {}),
    ("LAB-tiff", lambda: noise("LAB"), "TIFF", {}),
    ("I;16-png", lambda: noise("I;16"), "PNG", {}),
    ("I;16-tiff", lambda: noise("I;16"), "TIFF", {}),
    ("I-tiff", lambda: noise("I"), "TIFF", {}),
    ("F-tiff", lambda: noise("F"), "TIFF", {}),
]


@pytest.mark.parametrize("case_id,make,fmt,kw", MODE_CASES, ids=[c[0] for c in MODE_CASES])
def test_decode_equals_transformers_convert_to_rgb(case_id: str, make, fmt: str, kw: dict) -> None:
    data = encode(make(), fmt, **kw)
    ours = decode_image(data, MAX_PIXELS)
    ref = reference_rgb(data)
    assert ours.pixels.dtype == np.uint8 and ours.pixels.shape == ref.shape
    assert np.array_equal(ours.pixels, ref), f"{case_id}: max diff {np.abs(ours.pixels.astype(int) - ref).max()}"


def test_alpha_is_composited_on_white_not_dropped() -> None:
    arr = np.zeros((8, 8, 4), np.uint8)
    arr[..., :3] = (10, 200, 30)  # hidden colour under alpha 0
    arr[4:, :, 3] = 255
    pixels = decode_image(encode(Image.fromarray(arr, "RGBA"), "PNG"), MAX_PIXELS).pixels
    assert (pixels[:4] == 255).all() and (pixels[4:] == (10, 200, 30)).all()


def test_sixteen_bit_grey_clips_at_255_as_pillow_does() -> None:
    img = Image.fromarray(np.array([[0, 200, 300, 65535]], dtype=np.uint16))
    data = encode(img, "PNG")
    assert Image.open(io.BytesIO(data)).mode == "I;16"
    assert decode_image(data, MAX_PIXELS).pixels[0, :, 0].tolist() == [0, 200, 255, 255]


def test_adobe_cmyk_jpeg_decodes_to_red() -> None:
    data = encode(Image.new("CMYK", (16, 16), (0, 255, 255, 0)), "JPEG", quality=95)
    assert np.abs(decode_image(data, MAX_PIXELS).pixels[8, 8].astype(int) - (255, 0, 0)).max() <= 8


def _frames(fmt: str) -> bytes:
    frames = [Image.new("RGB", (20, 12), c) for c in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    kw: dict[str, object] = {"save_all": True, "append_images": frames[1:], "duration": 100, "loop": 0}
    if fmt == "WEBP":
        kw["lossless"] = True
    return encode(frames[0], fmt, **kw)


@pytest.mark.parametrize("fmt", ["GIF", "WEBP", "PNG"])
def test_animated_file_gives_its_first_frame_as_the_reference(fmt: str) -> None:
    data = _frames(fmt)
    assert getattr(Image.open(io.BytesIO(data)), "n_frames", 1) == 3
    pixels = decode_image(data, MAX_PIXELS).pixels
    assert np.array_equal(pixels, reference_rgb(data))
    assert (np.abs(pixels.astype(int) - (255, 0, 0)) <= 2).all()


# --- EXIF orientation --------------------------------------------------------------------------------------------

def _exif_jpeg(orientation: int) -> bytes:
    arr = np.full((30, 40, 3), 128, np.uint8)
    arr[:, :6] = (255, 0, 0)  # red bar on the stored left edge
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(Image.fromarray(arr), "JPEG", quality=95, exif=exif.tobytes())


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_ignored_by_default_like_the_reference(orientation: int) -> None:
    data = _exif_jpeg(orientation)
    decoded = decode_image(data, MAX_PIXELS)
    assert decoded.pixels.shape == (30, 40, 3)
    assert np.array_equal(decoded.pixels, reference_rgb(data))


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_flag_applies_exif_transpose(orientation: int) -> None:
    data = _exif_jpeg(orientation)
    on = decode_image(data, MAX_PIXELS, apply_exif_orientation=True)
    upright = convert_to_rgb(ImageOps.exif_transpose(Image.open(io.BytesIO(data))), return_numpy=True)
    assert np.array_equal(on.pixels, upright)
    # transformers' load_image (the URL/path-string path) transposes too, then convert("RGB")
    assert np.array_equal(on.pixels, np.array(load_image(Image.open(io.BytesIO(data)))))
    off = decode_image(data, MAX_PIXELS)
    assert (on.content_hash == off.content_hash) == (orientation == 1)
    assert on.pixels.shape == ((40, 30, 3) if orientation >= 5 else (30, 40, 3))


# --- hostile files -----------------------------------------------------------------------------------------------

def _png_chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)


def bomb_png(width: int, height: int) -> bytes:
    """A valid greyscale PNG declaring ``width x height`` whose IDAT holds only the first rows."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\0" * (width + 1) * 4, 9)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("width,height,cap", [(20000, 20000, MAX_PIXELS), (4000, 4000, 1_000_000),
                                              (20000, 20000, 10**12)])
def test_pixel_cap_is_checked_from_the_header_before_decoding(width: int, height: int, cap: int) -> None:
    data = bomb_png(width, height)
    peak_before = _rss_mb()
    start = time.monotonic()
    with pytest.raises(GatewayError) as err:
        decode_image(data, cap)
    assert err.value.code is ErrorCode.MEDIA_TOO_LARGE and err.value.status == 413
    assert time.monotonic() - start < 0.5
    assert _rss_mb() - peak_before < 50  # a decoded 20000x20000 image would take 1.2 GB in RGB


def test_gif_declaring_a_huge_screen_is_refused_from_the_header() -> None:
    small = encode(Image.new("P", (4, 4)), "GIF")
    data = small[:6] + struct.pack("<HH", 65535, 65535) + small[10:]
    with pytest.raises(GatewayError) as err:
        decode_image(data, MAX_PIXELS)
    assert err.value.code in (ErrorCode.MEDIA_TOO_LARGE, ErrorCode.MEDIA_DECODE_FAILED)


TRUNCATION_SOURCES = {
    "png": encode(noise("RGB", (64, 48)), "PNG"),
    "jpeg": encode(noise("RGB", (64, 48)), "JPEG", quality=90),
    "progressive-jpeg": encode(noise("RGB", (64, 48)), "JPEG", quality=90, progressive=True),
    "gif": encode(noise("P", (64, 48)), "GIF"),
    "webp": encode(noise("RGB", (64, 48)), "WEBP", quality=80),
    "animated-gif": _frames("GIF"),
    "animated-webp": _frames("WEBP"),
}


@pytest.mark.parametrize("name", sorted(TRUNCATION_SOURCES))
@pytest.mark.parametrize("fraction", [0.0, 0.05, 0.3, 0.5, 0.9, 0.99])
def test_truncated_file_decodes_like_the_reference_or_is_refused_with_400(name: str, fraction: float) -> None:
    full = TRUNCATION_SOURCES[name]
    data = full[: max(1, int(len(full) * fraction))]
    try:
        ref = reference_rgb(data)
    except Exception:  # noqa: BLE001 - the reference refuses these bytes
        ref = None
    try:
        ours = decode_image(data, MAX_PIXELS).pixels
    except GatewayError as exc:
        assert exc.code is ErrorCode.MEDIA_DECODE_FAILED and exc.status == 400
        assert ref is None, "mmgate refused bytes the reference decodes"
        return
    assert ref is not None and np.array_equal(ours, ref)


@pytest.mark.parametrize("data", [
    b"", b"\0", b"GIF89a", b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"RIFF\0\0\0\0WEBPVP8 ",
    b"<!doctype html><html><body>Not found</body></html>",
    b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n",  # EPS: would run Ghostscript; not opened
    b"#define im_width 8\n#define im_height 8\nstatic char im_bits[] = {0,0,0,0,0,0,0,0};\n",  # XBM
])
def test_non_images_and_refused_formats_are_400_media_decode_failed(data: bytes) -> None:
    with pytest.raises(GatewayError) as err:
        decode_image(data, MAX_PIXELS)
    assert err.value.code is ErrorCode.MEDIA_DECODE_FAILED and err.value.status == 400
    assert len(err.value.message) < 200


def test_one_pixel_image_decodes_to_one_rgb_pixel() -> None:
    data = encode(Image.new("RGBA", (1, 1), (0, 0, 0, 0)), "PNG")
    assert decode_image(data, MAX_PIXELS).pixels.tolist() == [[[255, 255, 255]]]
