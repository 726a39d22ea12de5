"""Video refusals, each with its stable code: through the HTTP API where the default limits apply,
in process (the same pipeline) where a test needs other limits.

The gateway's worker address points at a closed port: every refusal here must
happen before an engine is needed.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import av
import httpx
import numpy as np
import pytest

from mmgate.request.parse import parse_chat_request
from mmgate.errors import ErrorCode, GatewayError
from mmgate.cli.launch import free_port
from mmgate.pipeline.prepare import Pipeline
from mmgate.config.settings import FetchSettings, Settings, VideoSettings
from mmgate.models.backend import FrameSampling
from tests.conftest import bundle_dir
from tests.support.servers import gateway_in_thread, media_origin
from tests.video.video_support import QWEN2_5, QWEN3, data_url, loopback_gateway, pipeline, video_part


def audio_only_mp4() -> bytes:
    buf = io.BytesIO()
    container = av.open(buf, "w", format="mp4")
    stream = container.add_stream("aac", rate=16000)
    for i in range(4):
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate, frame.pts = 16000, i * 1024
        for packet in stream.encode(frame):
            container.mux(packet)
    for packet in stream.encode():
        container.mux(packet)
    container.close()
    return buf.getvalue()


def zero_frame_mp4() -> bytes:
    """A fragmented MP4 cut after its ``moov``: a video track with no samples."""
    buf = io.BytesIO()
    container = av.open(buf, "w", format="mp4", options={"movflags": "empty_moov+frag_keyframe"})
    stream = container.add_stream("libx264", rate=24)
    stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
    for i in range(4):
        for packet in stream.encode(av.VideoFrame.from_ndarray(np.full((48, 64, 3), i * 20, np.uint8), "rgb24")):
            container.mux(packet)
    for packet in stream.encode():
        container.mux(packet)
    container.close()
    data = buf.getvalue()
    return data[:data.index(b"moof") - 4]


def b64_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    with loopback_gateway(QWEN3) as base:
        yield base


def post(base: str, parts: list[dict], text: str = "What happens?") -> httpx.Response:
    body = {"model": QWEN3, "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]}
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=60)


def assert_refused(resp: httpx.Response, status: int, code: str, param: str | None = "messages[0].content[0]") -> None:
    assert resp.status_code == status, resp.text
    assert resp.headers["X-SMG-Error-Code"] == code
    err = resp.json()["error"]
    assert err["code"] == code and "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param


@pytest.mark.parametrize("payload,why", [
    (b"this is not a video at all" * 40, "not a supported container"),
    (audio_only_mp4(), "no video stream"),
    (zero_frame_mp4(), "no frames"),
    (b"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\nfile:///etc/hostname\n#EXT-X-ENDLIST\n",
     "not a supported container"),
    (b"ffconcat version 1.0\nfile /etc/hostname\n", "not a supported container"),
], ids=["garbage", "audio-only", "zero-frames", "hls-playlist", "ffconcat"])
def test_clip_without_decodable_frames_is_400_media_decode_failed(gateway: str, payload: bytes, why: str) -> None:
    resp = post(gateway, [{"type": "video_url", "video_url": {"url": b64_url(payload)}}])
    assert_refused(resp, 400, "media_decode_failed")
    assert "video" in resp.json()["error"]["message"] and why in resp.json()["error"]["message"]


def test_one_frame_clip_on_qwen3_is_400_invalid_request(gateway: str, clips: dict[str, Path]) -> None:
    resp = post(gateway, [{"type": "video_url", "video_url": {"url": data_url(clips["f1_24fps"])}}])
    assert_refused(resp, 400, "invalid_request")


def test_more_clips_than_the_video_limit_is_400_before_any_fetch(gateway: str) -> None:
    with media_origin() as origin:
        urls = [origin.add(f"/c{i}.mp4", b"never fetched", "video/mp4") for i in range(5)]
        resp = post(gateway, [{"type": "video_url", "video_url": {"url": u}} for u in urls])
        assert_refused(resp, 400, "mm_item_limit_exceeded", param=None)
        assert sum(origin.settled().values()) == 0


def test_clip_over_the_byte_cap_is_413_before_decoding(gateway: str, clips: dict[str, Path]) -> None:
    with media_origin() as origin:
        url = origin.add("/big.mp4", clips["f60_30fps"].read_bytes(), "video/mp4")
        settings = Settings(model=str(bundle_dir(QWEN3)), served_model_name=QWEN3,
                            worker_urls=(f"grpc://127.0.0.1:{free_port()}",),
                            fetch=FetchSettings(allow_private_hosts=True, video_max_bytes=1000))
        with gateway_in_thread(settings) as base:
            assert_refused(post(base, [{"type": "video_url", "video_url": {"url": url}}]), 413, "media_too_large")


def run_with(model: str, video: VideoSettings, parts: list[dict]) -> None:
    base = pipeline(model, video.frame_sampling)
    settings = replace(base.settings, video=video)
    pipe = Pipeline(base.runtime, settings, base.fetcher, base.executor)
    body = {"model": model, "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}]}
    asyncio.run(pipe.prepare(parse_chat_request(json.dumps(body).encode())))


def test_decoded_pixel_cap_counts_every_clip_of_the_request(clips: dict[str, Path]) -> None:
    """f60_30fps on Qwen2.5-VL under ``--video-frame-sampling transformers`` keeps all 60 frames of 160x90:
    864,000 pixels per clip."""
    clip = clips["f60_30fps"]
    every_frame = VideoSettings(max_decoded_pixels=864_000, frame_sampling=FrameSampling.TRANSFORMERS)
    run_with(QWEN2_5, every_frame, [video_part(clip)])
    with pytest.raises(GatewayError) as err:
        run_with(QWEN2_5, every_frame, [video_part(clip), video_part(clip, fps=5.0)])
    assert err.value.code is ErrorCode.MEDIA_TOO_LARGE and err.value.status == 413
    assert err.value.param in ("messages[0].content[0]", "messages[0].content[1]")


def test_decode_deadline_is_413_media_too_large(clips: dict[str, Path]) -> None:
    with pytest.raises(GatewayError) as err:
        run_with(QWEN3, VideoSettings(decode_timeout_s=1e-9), [video_part(clips["f60_30fps"])])
    assert err.value.code is ErrorCode.MEDIA_TOO_LARGE and "exceeded" in err.value.message


def test_a_request_that_fails_stops_its_video_decoding(clips: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Another item's refusal ends the request: the clip's decoding thread is told to stop (it would
    otherwise run on to its deadline), and a decode told to stop refuses at its next frame."""
    import threading

    from mmgate.pipeline import sources as pipeline_module  # the media sources call the decoders
    from mmgate.media.video import decode_video

    clip = clips["f60_30fps"]
    started = threading.Event()
    stopped = threading.Event()
    seen: list[bool] = []
    real = pipeline_module.decode_video
    real_image = pipeline_module.decode_image

    def watching(data: bytes, sample: object, allowance: object, timeout_s: float, stop: threading.Event,
                 **options: bool) -> object:
        started.set()
        seen.append(stop.wait(timeout=20))  # the request's stop signal, set when the request ends
        stopped.set()
        return real(data, sample, allowance, timeout_s, stop, **options)  # type: ignore[arg-type]

    def image_after_clip_started(*args: object, **kwargs: object) -> object:
        started.wait(timeout=20)  # fail the image only once the clip is decoding (else nothing to stop)
        return real_image(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pipeline_module, "decode_video", watching)
    monkeypatch.setattr(pipeline_module, "decode_image", image_after_clip_started)
    broken_image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgoAAAAN"}}
    with pytest.raises(GatewayError) as err:
        run_with(QWEN3, VideoSettings(), [video_part(clip), broken_image])
    assert err.value.code is ErrorCode.MEDIA_DECODE_FAILED and err.value.param == "messages[0].content[1]"
    assert stopped.wait(timeout=30) and seen == [True]

    already = threading.Event()
    already.set()
    with pytest.raises(GatewayError) as err:
        decode_video(clip.read_bytes(), lambda meta: list(range(meta.total_frames)), None, 60.0, already)
    assert err.value.code is ErrorCode.MEDIA_DECODE_FAILED and "stopped" in err.value.message
