"""A 2,000-request mixed good/bad run through the HTTP API of a gateway process whose worker is a real
reference engine: no 500 (answers, log, metrics), RSS growth of the gateway under 50 MB after warm-up,
no new mmgate segment in ``/dev/shm`` (``tests/support/shm_scope.py``), the engine alive at the end.

About half the requests are good (small images as ``data:`` URLs or from the loopback origin, and
text-only); the rest are the refusals a hostile client produces (garbage and truncated bytes, a
decompression bomb, an aspect ratio over 200, bad base64, unsupported schemes, origin 404/503, an
unknown model, malformed JSON, too many images).
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import random
import struct
import time
import zlib
from collections import Counter
from typing import Any

import httpx
import numpy as np
from PIL import Image

from tests.corpus.conftest import CorpusStack
from tests.media.origin import Behavior
from tests.support.shm_scope import leftover_segments, own_segments

TOTAL = 2000
WARMUP = 200
CONCURRENCY = 4
RSS_GROWTH_LIMIT_MB = 50


def _png(w: int, h: int, seed: int, mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}[mode]
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, channels), dtype=np.uint8), mode).save(buf, format="PNG")
    return buf.getvalue()


def _jpeg(w: int, h: int, seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def _bomb() -> bytes:
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", 30000, 30000, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 30001)) + chunk(
        b"IEND", b"")


def _data(b: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(b).decode()


def _request_kinds(stack: CorpusStack) -> list[tuple[str, int, Any]]:
    """(kind, expected status, body or raw bytes) - ``kind`` starting with ``good`` expects 200."""
    served = stack.profiles["qwen2_vl"].served_name
    origin = stack.origin
    good_images = [_png(w, h, i) for i, (w, h) in enumerate([(56, 56), (30, 40), (64, 20), (12, 90), (1, 1)])]
    good_images += [_jpeg(48, 48, 7), _png(40, 40, 8, "RGBA")]
    http_urls = [origin.add(f"/soak/good{i}.png", Behavior(body=b)) for i, b in enumerate(good_images[:3])]
    url_404 = origin.url("/soak/missing.png")
    url_503 = origin.add("/soak/down.png", Behavior(status=503, body=b"down"))
    truncated = good_images[0][: len(good_images[0]) // 2]

    def chat(*urls: str, model: str = served) -> dict[str, Any]:
        content = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": "hi"}]
        return {"model": model, "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": content}]}

    kinds: list[tuple[str, int, Any]] = []
    kinds += [(f"good-data-{i}", 200, chat(_data(b))) for i, b in enumerate(good_images)]
    kinds += [(f"good-http-{i}", 200, chat(u)) for i, u in enumerate(http_urls)]
    kinds += [("good-text", 200, {"model": served, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})]
    kinds += [("good-two-images", 200, chat(_data(good_images[1]), http_urls[0]))]
    kinds += [
        ("garbage-bytes", 400, chat(_data(os.urandom(300)))),
        ("truncated-png", 400, chat(_data(truncated))),
        ("bomb", 413, chat(_data(_bomb()))),
        ("aspect-ratio", 400, chat(_data(_png(300, 1, 9)))),
        ("bad-base64", 400, chat("data:image/png;base64,@@not-base64@@")),
        ("empty-payload", 400, chat("data:image/png;base64,")),
        ("file-scheme", 400, chat("file:///etc/passwd")),
        ("gopher-scheme", 400, chat("gopher://127.0.0.1:1/_x")),
        ("userinfo", 400, chat(f"http://a@127.0.0.1:{origin.port}/soak/good0.png")),
        ("origin-404", 400, chat(url_404)),
        ("origin-503", 503, chat(url_503)),
        ("unknown-model", 404, chat(_data(good_images[0]), model="no/such-model")),
        ("malformed-json", 400, b"{not json"),
        ("too-many-images", 400, chat(*([_data(good_images[4])] * 17))),
    ]
    return kinds


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


async def _run(base: str, plan: list[tuple[str, int, Any]], on_progress: Any) -> list[tuple[str, int, int]]:
    results: list[tuple[str, int, int]] = []
    sem = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=base, timeout=60.0) as client:
        async def one(i: int, kind: str, want: int, body: Any) -> None:
            async with sem:
                if isinstance(body, bytes):
                    resp = await client.post("/v1/chat/completions", content=body,
                                             headers={"content-type": "application/json"})
                else:
                    resp = await client.post("/v1/chat/completions", json=body)
                results.append((kind, want, resp.status_code))
                on_progress(i)

        await asyncio.gather(*(one(i, *item) for i, item in enumerate(plan)))
    return results


def test_mixed_run_leaves_no_500_no_leak_and_no_shm_files(corpus_stack: CorpusStack) -> None:
    profile = corpus_stack.profiles["qwen2_vl"]
    pid = profile.gateway.proc.pid
    kinds = _request_kinds(corpus_stack)
    goods = [k for k in kinds if k[0].startswith("good")]
    bads = [k for k in kinds if not k[0].startswith("good")]
    rng = random.Random(2024)
    plan = [rng.choice(goods if rng.random() < 0.5 else bads) for _ in range(TOTAL)]
    shm_before = own_segments()
    samples: dict[str, float] = {}

    def progress(i: int) -> None:
        if i == WARMUP:
            samples["after_warmup"] = _rss_mb(pid)

    start = time.monotonic()
    warm = asyncio.run(_run(profile.base, plan[:WARMUP], lambda i: None))
    samples["after_warmup"] = _rss_mb(pid)
    rest = asyncio.run(_run(profile.base, plan[WARMUP:], progress))
    elapsed = time.monotonic() - start
    time.sleep(0.5)
    samples["end"] = _rss_mb(pid)

    results = warm + rest
    statuses = Counter(status for _, _, status in results)
    wrong = Counter((kind, want, got) for kind, want, got in results if got != want)
    growth = samples["end"] - samples["after_warmup"]
    print(f"\n[soak] {len(results)} requests in {elapsed:.1f}s, statuses {dict(statuses)}, "
          f"gateway RSS {samples['after_warmup']:.0f} -> {samples['end']:.0f} MB (+{growth:.1f} MB)")
    assert len(results) == TOTAL
    assert statuses[500] == 0
    assert not wrong, f"unexpected statuses: {dict(wrong)}"
    assert growth < RSS_GROWTH_LIMIT_MB
    assert leftover_segments(shm_before) == set()
    log = profile.gateway.log_tail(1_000_000)
    assert "Traceback" not in log and "internal error" not in log and " 500 " not in log
    metrics = httpx.get(profile.base + "/metrics", timeout=10).text
    assert 'code="internal_error"' not in metrics
    assert profile.engine.proc.poll() is None and profile.gateway.proc.poll() is None
