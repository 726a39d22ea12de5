"""Intake settings seen through the HTTP API: EXIF orientation flag, per-modality byte cap.

In-thread gateways whose worker is the corpus stack's recording proxy in
front of a real reference engine, so the grid that reached the engine can be
read back per request id.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import httpx
import numpy as np
from PIL import Image

from mmgate.config.settings import FetchSettings, Settings
from tests.corpus.conftest import CorpusStack
from tests.media.origin import Behavior
from tests.support.servers import gateway_in_thread


@contextmanager
def _gateway(stack: CorpusStack, fetch: FetchSettings) -> Iterator[tuple[str, str]]:
    profile = stack.profiles["qwen2_vl"]
    settings = Settings(model=str(profile.bundle), served_model_name=profile.served_name,
                        worker_urls=(f"grpc://127.0.0.1:{profile.proxy.port}",), fetch=fetch)
    with gateway_in_thread(settings) as base:
        yield base, profile.served_name


def _exif_jpeg(width: int, height: int, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), 90, np.uint8)).save(buf, "JPEG", exif=exif.tobytes())
    return buf.getvalue()


def _grid(stack: CorpusStack, base: str, served: str, url: str) -> list[int]:
    body = {"model": served, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}]}
    resp = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    wire = stack.profiles["qwen2_vl"].proxy.get(resp.headers["X-Request-Id"])
    assert wire is not None
    batch = wire.batch("image_grid_thw")
    assert batch is not None
    return batch.tensors["image_grid_thw"].array.astype(int)[0].tolist()


# A 64x32 (w x h) JPEG tagged "rotate 90 CW" (6). Stored 32 high: smart_resize(32, 64, 28, 3136, 1003520) ->
# 28x56 = 1568 < 3136 -> beta = sqrt(3136 / 2048) -> (ceil(1.414)*28, ceil(2.828)*28) = (56, 84) -> grid (1, 4, 6).
# Upright it is 64 high, 32 wide -> (84, 56) -> grid (1, 6, 4).
EXIF_URL = "data:image/jpeg;base64," + base64.b64encode(_exif_jpeg(64, 32, 6)).decode()


def test_exif_orientation_is_not_applied_by_default(corpus_stack: CorpusStack) -> None:
    with _gateway(corpus_stack, FetchSettings(allow_private_hosts=True)) as (base, served):
        assert _grid(corpus_stack, base, served, EXIF_URL) == [1, 4, 6]


def test_exif_orientation_flag_transposes_before_preprocessing(corpus_stack: CorpusStack) -> None:
    fetch = FetchSettings(allow_private_hosts=True, image_apply_exif_orientation=True)
    with _gateway(corpus_stack, fetch) as (base, served):
        assert _grid(corpus_stack, base, served, EXIF_URL) == [1, 6, 4]


def test_image_byte_cap_is_413_for_data_and_http_urls(corpus_stack: CorpusStack) -> None:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (80, 80, 3), dtype=np.uint8)).save(buf, "PNG")
    png = buf.getvalue()
    assert len(png) > 10_000
    url = corpus_stack.origin.add("/cap/big.png", Behavior(body=png))
    fetch = replace(FetchSettings(allow_private_hosts=True), image_max_bytes=10_000)
    with _gateway(corpus_stack, fetch) as (base, served):
        for media in ("data:image/png;base64," + base64.b64encode(png).decode(), url):
            body = {"model": served, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": media}}]}]}
            resp = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
            assert resp.status_code == 413 and resp.json()["error"]["code"] == "media_too_large"
