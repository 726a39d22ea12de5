"""Issue 15, item 5: media that expand past what the transport carries are the caller's 413, never a retryable 503.

A 26 KB clip of ten 3840x2160 frames and a 10-minute 64x64 clip (30 fps, 18000 frames) are made here
with PyAV and sent with ``mm_processor_kwargs: {"do_sample_frames": false}``: Qwen2-VL then keeps every
frame of a clip (the transformers default; by default mmgate samples 2 fps as a vLLM worker, which keeps
the 10-minute clip to 768 frames), so their
``pixel_values`` would be, by the reference's arithmetic written out below, 992 MB and 677 MB of
float32: more than the 512 MiB gRPC message limit of the engine channel.  The gateway refuses them
with 413 ``multimodal_payload_too_large`` from the clip's header, before decoding (its memory does not
grow by the +1-2 GB that decoding and preprocessing take).  Where sizes are only known after
decoding (an image), the request is refused after decoding and before preprocessing.  A
``RESOURCE_EXHAUSTED`` for an oversized gRPC message (a real channel on loopback) maps to 413; any
other ``RESOURCE_EXHAUSTED`` stays a retryable 503.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import replace

import av
import grpc
import httpx
import numpy as np
import pytest
from PIL import Image

from mmgate.request.parse import parse_chat_request
from mmgate.engines.vllm import map_rpc_error
from mmgate.errors import ErrorCode, GatewayError
from mmgate.pipeline.prepare import Pipeline
from mmgate.config.settings import TensorTransport, TransportSettings
from mmgate.transport.limits import GRPC_MAX_MESSAGE_BYTES
from mmgate.types import Modality, PreparedRequest
from tests.abuse.support import HealthWatch, Stack, after_attack, rss_mb, running_stack, shm_segments
from tests.video.video_support import pipeline

MODEL = "Qwen/Qwen2-VL-2B-Instruct"
#: Qwen2-VL-2B preprocessor_config.json: patch 14, merge 2 (factor 28), temporal patch 2, 3 channels,
#: min_pixels 3136, max_pixels 12845056; a pixel_values row holds 3 * 2 * 14 * 14 = 1176 float32 values.
ROW_BYTES = 3 * 2 * 14 * 14 * 4
#: how much the gateway's memory may grow while refusing (decoding ten 4K frames alone takes 249 MB)
RSS_GROWTH_MB = 200.0


def encode_clip(frames: int, width: int, height: int, fps: int) -> bytes:
    """An mp4 (libx264, ultrafast, crf 51) of ``frames`` black frames: a tiny file."""
    buf = io.BytesIO()
    container = av.open(buf, "w", format="mp4")
    stream = container.add_stream("libx264", rate=fps)
    stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
    stream.options = {"preset": "ultrafast", "crf": "51"}
    frame = av.VideoFrame.from_ndarray(np.zeros((height, width, 3), dtype=np.uint8), format="rgb24")
    for i in range(frames):
        frame.pts = i
        for packet in stream.encode(frame):
            container.mux(packet)
    for packet in stream.encode():
        container.mux(packet)
    container.close()
    return buf.getvalue()


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def video_body(*parts: dict) -> dict:
    return {"model": MODEL, "max_tokens": 1, "mm_processor_kwargs": {"do_sample_frames": False},
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What happens?"}]}]}


def video_part(data: bytes) -> dict:
    return {"type": "video_url", "video_url": {"url": data_url("video/mp4", data)}}


def hwm_mb(pid: int) -> float:
    """Peak resident memory of ``pid`` in MiB (``/proc/PID/status`` VmHWM)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmHWM")


class PeakRss:
    """Samples a process's RSS every 5 ms in a thread; ``peak`` is the largest seen."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = rss_mb(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_mb(self.pid))

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Engine + gateway with the default (inline) transport: the gRPC message limit bounds the tensors."""
    with running_stack(tmp_path_factory.mktemp("video-size-logs"), MODEL) as running:
        yield running


def assert_payload_413(r: httpx.Response, param: str) -> None:
    assert r.status_code == 413, r.text
    assert r.headers["X-SMG-Error-Code"] == ErrorCode.MULTIMODAL_PAYLOAD_TOO_LARGE.value
    assert "Retry-After" not in r.headers
    error = r.json()["error"]
    assert error["code"] == "multimodal_payload_too_large" and error["param"] == param
    assert "base64" not in error["message"]


#: (name, clip maker, planned pixel_values bytes from the reference's arithmetic)
CLIPS: list[tuple[str, Callable[[], bytes], int]] = [
    # smart_resize(2160, 3840, 28, 3136, 12845056) = (77*28, 137*28) = (2156, 3836): under max_pixels, kept;
    # grid (ceil(10/2), 2156/14, 3836/14) = (5, 154, 274) -> 210980 rows.
    ("ten_4k_frames", lambda: encode_clip(10, 3840, 2160, 1), 5 * 154 * 274 * ROW_BYTES),
    # 64x64 -> (56, 56) (round(64/28) * 28; 3136 = min_pixels); grid (9000, 4, 4) -> 144000 rows.
    ("ten_minutes_tiny", lambda: encode_clip(18000, 64, 64, 30), 9000 * 4 * 4 * ROW_BYTES),
]


@pytest.mark.parametrize(("name", "make", "planned"), CLIPS, ids=[c[0] for c in CLIPS])
def test_clip_expanding_past_the_grpc_message_limit_is_413_before_decoding(
        stack: Stack, name: str, make: Callable[[], bytes], planned: int) -> None:
    clip = make()
    assert len(clip) < 300_000 and planned > GRPC_MAX_MESSAGE_BYTES
    shm_before = shm_segments()
    pid = stack.gateway.proc.pid
    idle, hwm_before = rss_mb(pid), hwm_mb(pid)
    statuses = []
    with HealthWatch(stack.base) as watch, PeakRss(pid) as peak:
        for _ in range(3):
            r = httpx.post(f"{stack.base}/v1/chat/completions", json=video_body(video_part(clip)), timeout=60)
            statuses.append(r.status_code)
            assert_payload_413(r, "messages[0].content[0]")
            assert str(planned) in r.json()["error"]["message"]  # the plan's bytes, as computed above
    assert peak.peak - idle < RSS_GROWTH_MB, f"gateway RSS rose {peak.peak - idle:.0f} MiB while refusing"
    assert hwm_mb(pid) - max(hwm_before, idle) < RSS_GROWTH_MB
    after_attack(stack, watch, statuses, shm_before, idle_rss_mb=idle)


def test_image_and_clip_over_the_budget_are_413_after_decoding() -> None:
    """With shared memory the message limit is out of the way and the in-flight budget (8 MB here) bounds
    the request.  The clip alone fits (planned from its header); the 1000x1000 image is only sized once
    decoded: smart_resize(1000, 1000) = (1008, 1008), 72 x 72 = 5184 rows of 4704 bytes = 24.4 MB; so the
    request is refused after decoding (before any preprocessing), naming the larger item, the image.
    The gateway's pipeline runs in process here, with the callback through which it chooses a worker."""
    budget = 8_000_000
    clip = encode_clip(8, 64, 48, 4)  # 56x56, grid (4, 4, 4): 64 rows, 301056 bytes
    png = io.BytesIO()
    Image.fromarray(np.full((1000, 1000, 3), 90, dtype=np.uint8)).save(png, format="PNG")
    image = {"type": "image_url", "image_url": {"url": data_url("image/png", png.getvalue())}}
    base = pipeline(MODEL)
    settings = replace(base.settings, transport=TransportSettings(tensor_transport=TensorTransport.SHM,
                                                                  max_inflight_bytes=budget))
    pipe = Pipeline(base.runtime, settings, base.fetcher, base.executor)
    chosen: list[frozenset[Modality]] = []

    def prepare(body: dict) -> PreparedRequest:
        request = parse_chat_request(json.dumps(body).encode())
        return asyncio.run(pipe.prepare(request, choose_worker=lambda m, key: chosen.append(m) or False))

    small = prepare(video_body(video_part(clip)))
    assert small.batches[0].tensors["pixel_values"].nbytes == 64 * ROW_BYTES
    with pytest.raises(GatewayError) as err:
        prepare(video_body(video_part(clip), image))
    assert err.value.code is ErrorCode.MULTIMODAL_PAYLOAD_TOO_LARGE and err.value.status == 413
    assert err.value.param == "messages[0].content[1]" and not err.value.spec.retryable
    assert str(64 * ROW_BYTES + 5184 * ROW_BYTES) in err.value.message
    assert len(chosen) == 2  # decoded and planned, a worker chosen, then refused


# ---------------------------------------------------------------- RESOURCE_EXHAUSTED from a real channel


def _echo_server(max_receive: int) -> tuple[grpc.Server, int]:
    """A loopback gRPC server: ``/t.T/Echo`` echoes; ``/t.T/Busy`` aborts with RESOURCE_EXHAUSTED."""

    def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
        return request

    def busy(request: bytes, context: grpc.ServicerContext) -> bytes:
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV cache blocks")
        raise AssertionError("abort returns only by raising")

    handlers = {"Echo": grpc.unary_unary_rpc_method_handler(echo), "Busy": grpc.unary_unary_rpc_method_handler(busy)}
    server = grpc.server(futures.ThreadPoolExecutor(2), options=[("grpc.max_receive_message_length", max_receive)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def _call_error(port: int, method: str, payload: bytes, options: list[tuple[str, int]] | None = None) -> grpc.RpcError:
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options or []) as channel:
        call = channel.unary_unary(f"/t.T/{method}")
        with pytest.raises(grpc.RpcError) as err:
            call(payload, timeout=10)
    return err.value


def test_message_size_resource_exhausted_is_the_callers_413_other_exhaustion_stays_retryable() -> None:
    server, port = _echo_server(max_receive=1024)
    try:
        received = _call_error(port, "Echo", b"x" * 4096)  # over the server's receive limit
        sent = _call_error(port, "Echo", b"x" * 4096, [("grpc.max_send_message_length", 1024)])  # over our send limit
        busy = _call_error(port, "Busy", b"x")
    finally:
        server.stop(None)
    for exc in (received, sent):
        assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        mapped = map_rpc_error(exc)
        assert mapped.code is ErrorCode.MULTIMODAL_PAYLOAD_TOO_LARGE
        assert mapped.status == 413 and not mapped.spec.retryable
    assert busy.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    mapped = map_rpc_error(busy)
    assert mapped.code is ErrorCode.ENGINE_UNAVAILABLE and mapped.status == 503 and mapped.spec.retryable
