"""Fuzzing the intake for a bounded time: random bytes, truncated and mutated files, random data URLs.

In process: ``decode_data_url`` -> ``decode_image`` -> the Qwen-VL family's
``plan`` -> ``preprocess_one`` may only raise ``GatewayError`` with a 4xx
status; anything else (or a crash) fails.  Through the HTTP API of an
in-thread gateway (worker address closed: good requests end in a retryable
503 ``no_healthy_worker``): no 500 answer, no ``internal_error`` counted.
Memory stays flat: the process RSS after the run is within 50 MB of the RSS
after a warm-up.

Time budget: ``MMGATE_FUZZ_SECONDS`` (default 60) split 2:1 between the two
tiers; hypothesis runs in batches until the budget is spent.
"""

from __future__ import annotations

import base64
import ctypes
import gc
import io
import os
import random
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from mmgate.errors import GatewayError
from mmgate.cli.launch import free_port
from mmgate.media.data_url import decode_data_url
from mmgate.media.image import decode_image
from mmgate.models.qwen_vl import QwenVLFamily, QwenVLImage, image_params_from_config
from mmgate.config.settings import FetchSettings, Settings
from mmgate.models.backend import ImageBackend
from tests.conftest import bundle_dir
from tests.support.servers import gateway_in_thread

# Pillow warns (through ``warnings``) about the corrupt metadata the fuzzer makes; that is expected here.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::PIL.Image.DecompressionBombWarning")

BUDGET_S = float(os.environ.get("MMGATE_FUZZ_SECONDS", "60"))
MAX_BYTES = 1 << 20
MAX_PIXELS = 4_000_000  # keeps one fuzz decode small; the cap itself is tested in test_image_decode
RSS_GROWTH_LIMIT_MB = 50
MODEL = "Qwen/Qwen2-VL-2B-Instruct"


def _encode(img: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _seed_files() -> list[bytes]:
    rng = np.random.default_rng(7)
    rgb = Image.fromarray(rng.integers(0, 256, (37, 53, 3), dtype=np.uint8))
    rgba = Image.fromarray(rng.integers(0, 256, (20, 30, 4), dtype=np.uint8), "RGBA")
    frames = [Image.new("RGB", (16, 12), c) for c in ((255, 0, 0), (0, 255, 0))]
    anim = {"save_all": True, "append_images": frames[1:], "duration": 50, "loop": 0}
    return [
        _encode(rgb, "PNG"), _encode(rgba, "PNG"), _encode(rgb, "JPEG", quality=80),
        _encode(rgb, "JPEG", quality=80, progressive=True), _encode(rgb.convert("P"), "GIF"),
        _encode(frames[0], "GIF", **anim), _encode(rgb, "WEBP"), _encode(frames[0], "WEBP", lossless=True, **anim),
        _encode(frames[0], "PNG", **anim), _encode(rgb, "BMP"), _encode(rgb, "TIFF"), _encode(rgb.resize((32, 32)), "ICO"),
        _encode(Image.new("CMYK", (9, 9), (0, 255, 255, 0)), "JPEG"),
        _encode(Image.fromarray(rng.integers(0, 65535, (9, 11), dtype=np.uint16)), "PNG"),
    ]


SEEDS = _seed_files()


@st.composite
def media_bytes(draw: st.DrawFn) -> bytes:
    """Random bytes, or a seed file truncated and/or with a few bytes overwritten."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.binary(max_size=2048))
    data = bytearray(draw(st.sampled_from(SEEDS)))
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    for _ in range(draw(st.integers(0, 6))):
        if data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


@st.composite
def data_urls(draw: st.DrawFn) -> str:
    """A data URL around fuzzed bytes, with the header and base64 text perturbed the ways clients do."""
    payload = base64.b64encode(draw(media_bytes())).decode()
    edits = draw(st.lists(st.sampled_from(["wrap", "unpad", "urlsafe", "space", "junk", "percent", "cut"]),
                          max_size=3))
    for edit in edits:
        if edit == "wrap":
            payload = "\n".join(payload[i:i + 76] for i in range(0, len(payload), 76))
        elif edit == "unpad":
            payload = payload.rstrip("=")
        elif edit == "urlsafe":
            payload = payload.replace("+", "-").replace("/", "_")
        elif edit == "space":
            payload = " " + payload
        elif edit == "junk":
            at = draw(st.integers(0, len(payload)))
            payload = payload[:at] + draw(st.text(max_size=4)) + payload[at:]
        elif edit == "percent":
            payload = urllib.parse.quote(payload, safe="")
        elif payload:
            payload = payload[: draw(st.integers(0, len(payload)))]
    header = draw(st.sampled_from(["data:image/png;base64,", "data:image/jpeg;base64,", "DATA:image/png;BASE64,",
                                   "data:;base64,", "data:image/png;charset=utf-8;base64,", "data:image/png,",
                                   "data:image/png;base64", "data:video/mp4;base64,"]))
    if draw(st.integers(0, 9)) == 0:
        header = "data:" + draw(st.text(max_size=30))
    return header + payload


def _family() -> QwenVLFamily:
    cfg = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 3136, "max_pixels": 1003520}
    return QwenVLFamily("qwen2_vl", QwenVLImage("qwen2_vl", image_params_from_config(cfg), 151655, ImageBackend.TORCHVISION))


FAMILY = _family()
OUTCOMES: Counter[str] = Counter()


def _intake(url: str) -> None:
    """One item through the intake; only a 4xx GatewayError may come out."""
    try:
        data = decode_data_url(url, MAX_BYTES)
        image = decode_image(data, MAX_PIXELS)
        plan = FAMILY.image.plan(image.height, image.width)
        rows = FAMILY.image.preprocess(image, plan)
        assert rows.shape == (plan.primary_shape[0], 3 * 2 * 14 * 14)
        OUTCOMES["ok"] += 1
    except GatewayError as exc:
        assert 400 <= exc.status < 500, exc
        assert len(exc.message) < 300
        OUTCOMES[exc.code.value] += 1


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(st.one_of(data_urls(), media_bytes().map(lambda b: "data:image/png;base64," + base64.b64encode(b).decode())))
def _fuzz_once(url: str) -> None:
    _intake(url)


def _rss_mb() -> float:
    """Resident memory after a full collection and glibc's ``malloc_trim``: what is still held, not
    what the allocator keeps cached from the last burst (a leak shows here, a free-list does not)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _run_until(deadline: float, batch: Callable[[], None]) -> int:
    rounds = 0
    while time.monotonic() < deadline:
        batch()
        rounds += 1
    return rounds


def test_intake_fuzz_raises_only_4xx_gateway_errors_and_keeps_memory_flat() -> None:
    start = time.monotonic()
    budget = BUDGET_S * 2 / 3
    _run_until(start + min(5.0, budget / 4), _fuzz_once)  # warm-up: imports, caches, allocator pools
    warm = _rss_mb()
    rounds = _run_until(start + budget, _fuzz_once)
    growth = _rss_mb() - warm
    print(f"\n[fuzz intake] {rounds} rounds in {time.monotonic() - start:.0f}s, outcomes {dict(OUTCOMES)}, "
          f"RSS +{growth:.1f} MB")
    assert OUTCOMES["ok"] > 0 and sum(OUTCOMES.values()) > OUTCOMES["ok"]
    assert growth < RSS_GROWTH_LIMIT_MB


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    settings = Settings(model=str(bundle_dir(MODEL)), served_model_name=MODEL,
                        worker_urls=(f"grpc://127.0.0.1:{free_port()}",),
                        fetch=FetchSettings(image_max_bytes=MAX_BYTES, max_image_pixels=MAX_PIXELS))
    with gateway_in_thread(settings) as base:
        yield base


def _bodies(rng: random.Random, url: str) -> bytes | dict:
    """A chat body around ``url``, or (sometimes) a malformed body."""
    roll = rng.random()
    if roll < 0.05:
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 200)))
    if roll < 0.10:
        return {"model": MODEL, "messages": [{"role": "user", "content": [{"type": rng.choice(
            ["image_url", "video_url", "input_audio", "text", "bogus"]), "image_url": {"url": url[:100]}}]}]}
    content = [{"type": "image_url", "image_url": {"url": url}} for _ in range(rng.choice([1, 1, 1, 2, 17]))]
    return {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
        *content, {"type": "text", "text": "describe"}]}]}


def test_http_fuzz_never_answers_500(gateway: str) -> None:
    statuses: Counter[int] = Counter()
    rng = random.Random(11)
    client = httpx.Client(base_url=gateway, timeout=30)

    @settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(data_urls())
    def fuzz_http(url: str) -> None:
        body = _bodies(rng, url)
        if isinstance(body, bytes):
            resp = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        else:
            resp = client.post("/v1/chat/completions", json=body)
        statuses[resp.status_code] += 1
        assert resp.status_code != 500, resp.text
        assert resp.status_code in (400, 404, 413, 503), resp.text
        assert "Traceback" not in resp.text

    start = time.monotonic()
    fuzz_http()  # warm-up
    warm = _rss_mb()
    rounds = _run_until(start + BUDGET_S / 3, fuzz_http)
    growth = _rss_mb() - warm
    metrics = client.get("/metrics").text
    client.close()
    print(f"\n[fuzz http] {rounds} rounds in {time.monotonic() - start:.0f}s, statuses {dict(statuses)}, "
          f"RSS +{growth:.1f} MB")
    assert 'code="internal_error"' not in metrics
    assert statuses[503] > 0 and statuses[400] > 0
    assert growth < RSS_GROWTH_LIMIT_MB
