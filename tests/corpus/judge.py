"""Checks of one corpus case's answer against its ``expected`` block.

Outcome policy of mmgate for the corpus's alternatives (docs/media-intake.md):
``http_400_or_413`` / ``http_400_or_403`` / ``http_400_or_501`` / ``http_4xx``
-> the status the error table gives (400 or 413); ``ok_or_http_400`` -> mmgate
accepts every lenient data-URL variant, so ``ok``; ``timeout_error`` -> the
issue's status discipline: a retryable 503 ``media_fetch_timeout`` within the
total fetch timeout + 2 s (the corpus lists 400/408/422/504 as acceptable; a
timeout is transient, so mmgate answers 503).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from PIL import Image

from mmgate.errors import ERROR_TABLE, ErrorCode
from mmgate.media.image import decode_image
from tests.corpus.stack import WireRequest

STATUS_OF_OUTCOME = {
    "http_400": {400}, "http_400_or_413": {400, 413}, "http_400_or_403": {400, 403}, "http_400_or_501": {400, 501},
}
_CODES = {c.value for c in ErrorCode}


@dataclass
class Answer:
    """What one request got back, and what the test knows about how it got there."""

    response: httpx.Response | None
    elapsed_s: float
    error: str | None = None  # transport-level failure of the test's own client (a hang)
    wire: WireRequest | None = None
    stream_text: str | None = None  # the same request with stream=True, when the case asks about SSE
    payload_fragments: list[str] = field(default_factory=list)


def _fail(case: dict[str, Any], what: str) -> AssertionError:
    return AssertionError(f"{case['id']}: {what}")


def check_error_body(case: dict[str, Any], resp: httpx.Response, answer: Answer) -> dict[str, Any]:
    body = resp.json()
    err = body.get("error")
    if not isinstance(err, dict) or set(err) != {"type", "code", "message", "param"}:
        raise _fail(case, f"error body is not the table shape: {resp.text[:300]}")
    if err["code"] not in _CODES or resp.headers.get("X-SMG-Error-Code") != err["code"]:
        raise _fail(case, f"unstable error code {err['code']!r}")
    if ERROR_TABLE[ErrorCode(err["code"])].status != resp.status_code:
        raise _fail(case, f"status {resp.status_code} disagrees with the table for {err['code']}")
    limit = case["expected"].get("error_message_max_chars", 300)
    if len(err["message"]) > limit:
        raise _fail(case, f"error message longer than {limit} chars")
    for fragment in answer.payload_fragments:
        if fragment in resp.text:
            raise _fail(case, "the error echoes the request payload")
    return err


def check_status(case: dict[str, Any], answer: Answer, allowed: set[int]) -> None:
    resp = answer.response
    assert resp is not None
    if resp.status_code not in allowed:
        raise _fail(case, f"status {resp.status_code} not in {sorted(allowed)}: {resp.text[:300]}")
    if resp.status_code >= 400:
        check_error_body(case, resp, answer)


def check_timeout(case: dict[str, Any], answer: Answer, total_timeout_s: float) -> None:
    resp = answer.response
    assert resp is not None
    if resp.status_code != 503 or resp.json()["error"]["code"] != ErrorCode.MEDIA_FETCH_TIMEOUT.value:
        raise _fail(case, f"expected a retryable 503 media_fetch_timeout, got {resp.status_code}: {resp.text[:200]}")
    if resp.headers.get("Retry-After") is None:
        raise _fail(case, "a retryable refusal without Retry-After")
    if answer.elapsed_s > total_timeout_s + 2:
        raise _fail(case, f"took {answer.elapsed_s:.1f}s, more than the fetch timeout + 2 s")


def _reference_image(data: bytes, processor: Any) -> dict[str, np.ndarray]:
    return processor(images=[Image.open(io.BytesIO(data))], return_tensors="np")


def _as_float(tensor_dtype: str, array: np.ndarray) -> np.ndarray:
    if tensor_dtype == "bfloat16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


def _same_as_wire(reference: np.ndarray, wire_dtype: str, wire: np.ndarray) -> bool:
    if wire_dtype == "float32":
        return bool(np.array_equal(reference.astype(np.float32), wire))
    import torch

    cast = torch.from_numpy(np.ascontiguousarray(reference, dtype=np.float32)).to(getattr(torch, wire_dtype)).float()
    return bool(np.array_equal(cast.numpy(), _as_float(wire_dtype, wire)))


def check_ok_image(case: dict[str, Any], answer: Answer, image_bytes: bytes | None, patch_size: int,
                   reference_processor: Any, same_as_bytes: bytes | None) -> None:
    """200, and the wire carries the expected grid, pixel_values shape and placeholder run."""
    exp = case["expected"]
    resp = answer.response
    assert resp is not None
    if resp.status_code != 200:
        raise _fail(case, f"expected 200, got {resp.status_code}: {resp.text[:300]}")
    usage = resp.json()["usage"]
    wire = answer.wire
    if wire is None:
        raise _fail(case, "no request reached the engine")
    if usage["prompt_tokens"] != len(wire.input_ids):
        raise _fail(case, "usage.prompt_tokens differs from the expanded prompt sent to the engine")
    batch = wire.batch("image_grid_thw")
    if batch is None:
        raise _fail(case, "no image batch on the wire")
    grid = batch.tensors["image_grid_thw"].array.astype(np.int64).tolist()
    pixel_values = batch.tensors["pixel_values"]
    if "image_grid_thw" in exp and grid != exp["image_grid_thw"]:
        raise _fail(case, f"image_grid_thw {grid} != {exp['image_grid_thw']}")
    if "resized_hw" in exp and [grid[0][1] * patch_size, grid[0][2] * patch_size] != exp["resized_hw"]:
        raise _fail(case, f"resized to {grid[0][1] * patch_size}x{grid[0][2] * patch_size}, expected {exp['resized_hw']}")
    if "pixel_values_shape" in exp and list(pixel_values.array.shape) != exp["pixel_values_shape"]:
        raise _fail(case, f"pixel_values shape {list(pixel_values.array.shape)} != {exp['pixel_values_shape']}")
    if "num_image_tokens" in exp and [length for _, length in batch.placeholders] != [exp["num_image_tokens"]]:
        raise _fail(case, f"placeholder runs {batch.placeholders} != [{exp['num_image_tokens']}]")
    for source in (image_bytes, same_as_bytes):
        if source is None or pixel_values.array.dtype == np.uint8:
            continue  # uint8 on the wire: the worker normalizes; the grid checks above still hold
        ref = _reference_image(source, reference_processor)
        if ref["image_grid_thw"].tolist() != grid or not _same_as_wire(ref["pixel_values"], pixel_values.dtype,
                                                                       pixel_values.array):
            raise _fail(case, "pixel_values differ from the transformers reference processor")
    if image_bytes is not None and "decoded_rgb_at" in exp:
        check_decoded_pixels(case, image_bytes)


def check_ok_crop_image(case: dict[str, Any], answer: Answer, num_images: int, images: list[bytes],
                        profile: dict[str, Any], reference_processor: Any, image_token_id: int,
                        same_as_bytes: bytes | None) -> None:
    """200, and the wire carries one ``crop x crop`` image per item (``num_images`` image parts; ``images``:
    their bytes where the test sent them itself, empty for a verbatim URL) and one placeholder run of
    ``tokens_per_image`` ``image_token_id`` tokens each (LLaVA-1.5: the case's ``pixel_values_shape`` /
    ``num_image_tokens`` where it lists them, else the profile's ``crop`` and ``tokens_per_image``;
    ``image_token_id``: the bundle's ``image_token_index``), and ``pixel_values`` equal the bundle's ``CLIPImageProcessor`` on the same bytes (on the bytes
    of ``same_pixels_as`` too)."""
    exp = case["expected"]
    resp = answer.response
    assert resp is not None
    if resp.status_code != 200:
        raise _fail(case, f"expected 200, got {resp.status_code}: {resp.text[:300]}")
    wire = answer.wire
    if wire is None:
        raise _fail(case, "no request reached the engine")
    if resp.json()["usage"]["prompt_tokens"] != len(wire.input_ids):
        raise _fail(case, "usage.prompt_tokens differs from the expanded prompt sent to the engine")
    batch = wire.batch("pixel_values")
    if batch is None:
        raise _fail(case, "no image batch on the wire")
    pixel_values = batch.tensors["pixel_values"]
    crop = profile["crop"]
    want_shape = exp.get("pixel_values_shape", [num_images, 3, crop, crop])
    if list(pixel_values.array.shape) != want_shape:
        raise _fail(case, f"pixel_values shape {list(pixel_values.array.shape)} != {want_shape}")
    tokens = exp.get("num_image_tokens", profile["tokens_per_image"])
    if [length for _, length in batch.placeholders] != [tokens] * num_images:
        raise _fail(case, f"placeholder runs {batch.placeholders} != {num_images} x {tokens}")
    if batch.im_token_id != image_token_id:
        raise _fail(case, f"im_token_id {batch.im_token_id} != the bundle's image token {image_token_id}")
    for offset, length in batch.placeholders:
        if set(wire.input_ids[offset:offset + length]) != {image_token_id}:
            raise _fail(case, f"placeholder run at {offset} is not all image tokens")
    sources = ([images] if images else []) + ([[same_as_bytes] * num_images] if same_as_bytes is not None else [])
    for source in sources:
        if pixel_values.array.dtype == np.uint8:
            break  # uint8 on the wire: the worker normalizes; the shape checks above still hold
        ref = reference_processor(images=[Image.open(io.BytesIO(b)) for b in source], return_tensors="np")
        if not _same_as_wire(ref["pixel_values"], pixel_values.dtype, pixel_values.array):
            raise _fail(case, "pixel_values differ from the transformers reference processor")
    if images and "decoded_rgb_at" in exp:
        check_decoded_pixels(case, images[0])


def check_decoded_pixels(case: dict[str, Any], image_bytes: bytes) -> None:
    exp = case["expected"]
    pixels = decode_image(image_bytes, 10**9).pixels.astype(int)
    tolerance = exp.get("tolerance", 0)
    for where, rgb in exp["decoded_rgb_at"].items():
        x, y = (int(v[1:]) for v in where.split("_"))
        got = pixels[y, x].tolist()
        if max(abs(a - b) for a, b in zip(got, rgb)) > tolerance:
            raise _fail(case, f"decoded pixel at {where} is {got}, expected {rgb} +/- {tolerance}")


def check_ok_video(case: dict[str, Any], answer: Answer) -> None:
    """200, and the wire's video batch carries the expected grid and token run."""
    exp = case["expected"]
    resp = answer.response
    assert resp is not None
    if resp.status_code != 200:
        raise _fail(case, f"expected 200, got {resp.status_code}: {resp.text[:300]}")
    wire = answer.wire
    batch = wire.batch("video_grid_thw") if wire else None
    if batch is None:
        raise _fail(case, "no video batch on the wire")
    grid = batch.tensors["video_grid_thw"].array.astype(np.int64).tolist()
    if "video_grid_thw" in exp and grid != exp["video_grid_thw"]:
        raise _fail(case, f"video_grid_thw {grid} != {exp['video_grid_thw']}")
    if "num_video_tokens" in exp and sum(length for _, length in batch.placeholders) != exp["num_video_tokens"]:
        raise _fail(case, f"video placeholder runs {batch.placeholders} != {exp['num_video_tokens']} tokens")
    if "image_grid_thw" in exp:
        image = wire.batch("image_grid_thw") if wire else None
        if image is None or image.tensors["image_grid_thw"].array.astype(np.int64).tolist() != exp["image_grid_thw"]:
            raise _fail(case, "image grid of the mixed request differs")
    if "order" in exp and wire is not None:
        firsts = sorted((b.placeholders[0][0], "video" if "video_grid_thw" in b.tensors else "image")
                        for b in wire.batches if b.placeholders)
        if [kind for _, kind in firsts] != exp["order"]:
            raise _fail(case, f"placeholder order {firsts} != {exp['order']}")


def check_stream(case: dict[str, Any], answer: Answer) -> None:
    """A streamed request is refused before the stream, or the stream ends with ``[DONE]``."""
    text = answer.stream_text
    if text is None:
        return
    if text.startswith("data:") and not text.rstrip().endswith("data: [DONE]"):
        raise _fail(case, "truncated SSE stream")
