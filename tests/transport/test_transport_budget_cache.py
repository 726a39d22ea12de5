"""Shared memory, encoder dtypes, device normalization, in-flight budget, pixel cache and fetch-once.

Gateways run under uvicorn on loopback; the worker is a real gRPC server on
loopback (tests/support/fake_worker.py) that decodes tensors exactly as the
reference engine does (``mmgate.refengine.tensors.decode_tensor``: shared
memory read, then unlinked).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import threading
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from mmgate.pipeline.budget import InflightBudget
from mmgate.errors import ErrorCode, GatewayError
from mmgate.config.settings import FetchSettings, Settings, TensorTransport, TransportSettings
from mmgate.transport.dtypes import EncoderDtype, to_bfloat16_bits, to_float16
from mmgate.transport.shm import PREFIX, SHM_DIR
from tests.conftest import bundle_dir
from tests.support.fake_worker import FakeWorker, FakeWorkerState
from tests.support.servers import gateway_in_thread, media_origin

MODEL = "Qwen/Qwen2-VL-2B-Instruct"
# A 64x64 image: smart_resize -> 56x56, grid 4x4 = 16 patches of 3*2*14*14 = 1176 floats.
SMALL_PV_BYTES = 16 * 1176 * 4


def png(h: int, w: int, seed: int = 0) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat(urls: list[str], **extra: object) -> dict:
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": "hi"}]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1, **extra}


def mmgate_segments() -> set[str]:
    """The segments this process created (the gateway and the fake worker run in it)."""
    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"{PREFIX}{os.getpid()}-")}


def settings(worker: FakeWorker, **transport: object) -> Settings:
    return Settings(model=str(bundle_dir(MODEL)), worker_urls=(worker.url,),
                    fetch=FetchSettings(allow_private_hosts=True), transport=TransportSettings(**transport))


@pytest.fixture
def worker() -> Iterator[FakeWorker]:
    w = FakeWorker()
    yield w
    w.stop()


def post(base: str, body: dict, timeout: float = 30) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=timeout)


def test_shm_and_inline_deliver_bit_identical_tensors(worker: FakeWorker) -> None:
    body = chat([data_url(png(300, 200, 1)), data_url(png(64, 90, 2))])
    before = mmgate_segments()
    with gateway_in_thread(settings(worker, tensor_transport=TensorTransport.INLINE)) as base:
        assert post(base, body).status_code == 200
    with gateway_in_thread(settings(worker, tensor_transport=TensorTransport.SHM, shm_min_bytes=1024)) as base:
        assert post(base, body).status_code == 200
    inline, shm = worker.state.received
    assert inline.payloads["pixel_values"] == "inline" and shm.payloads["pixel_values"] == "shm"
    assert shm.payloads["image_grid_thw"] == "inline"  # 48 bytes, under shm_min_bytes
    assert inline.input_ids == shm.input_ids
    for name, array in inline.tensors.items():
        assert array.dtype == shm.tensors[name].dtype and np.array_equal(array, shm.tensors[name]), name
    assert mmgate_segments() == before


def test_auto_uses_shm_only_for_a_worker_in_our_shm_namespace() -> None:
    with open("/proc/sys/kernel/random/boot_id") as fh:
        ours = f"{fh.read().strip()}:{os.stat('/dev/shm').st_dev}"
    body = chat([data_url(png(120, 160))])
    for label, expected in ((ours, "shm"), ("other-host:1", "inline"), ("", "inline")):
        w = FakeWorker(FakeWorkerState(labels={"shm_namespace_id": label}))
        try:
            with gateway_in_thread(settings(w, tensor_transport=TensorTransport.AUTO)) as base:
                assert post(base, body).status_code == 200
            assert w.state.received[0].payloads["pixel_values"] == expected, label
        finally:
            w.stop()


def test_bfloat16_and_float16_conversions_equal_torch() -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(100_000).astype(np.float32) * 3,
                        np.array([0.0, -0.0, 1e-40, -1e-40, 3.4e38, -3.4e38, np.inf, -np.inf, 65504.0, 65520.0,
                                  1.00390625, 1.01171875, 2.0 ** -24, 2.0 ** -25], dtype=np.float32)])
    t = torch.from_numpy(x)
    assert np.array_equal(to_bfloat16_bits(x), t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
    assert np.array_equal(to_float16(x).view(np.uint16), t.to(torch.float16).numpy().view(np.uint16))
    nan = to_bfloat16_bits(np.array([np.nan], dtype=np.float32))
    assert torch.isnan(torch.from_numpy(nan.view(np.int16)).view(torch.bfloat16)).all()


@pytest.mark.parametrize("label,wire", [("bfloat16", "bfloat16"), ("float16", "float16"), ("", "float32")])
def test_encoder_dtype_follows_the_worker_label(label: str, wire: str) -> None:
    body = chat([data_url(png(100, 140))])
    w = FakeWorker(FakeWorkerState(labels={"multimodal_encoder_dtype": label}))
    try:
        with gateway_in_thread(settings(w)) as base:
            assert post(base, body).status_code == 200
        with gateway_in_thread(settings(w, encoder_dtype="float32")) as base:
            assert post(base, body).status_code == 200
    finally:
        w.stop()
    converted, reference = w.state.received
    assert converted.dtypes["pixel_values"] == wire and reference.dtypes["pixel_values"] == "float32"
    f32 = torch.from_numpy(reference.tensors["pixel_values"])
    if wire == "bfloat16":
        expected = f32.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    elif wire == "float16":
        expected = f32.to(torch.float16).numpy()
    else:
        expected = f32.numpy()
    assert np.array_equal(converted.tensors["pixel_values"], expected)


def test_device_normalize_worker_gets_uint8_that_normalizes_to_the_same_values() -> None:
    from mmgate.refengine.device_normalize import DeviceNormalizer

    body = chat([data_url(png(130, 250, 3))])
    w = FakeWorker(FakeWorkerState(labels={"mm_device_do_normalize": True}))
    plain = FakeWorker()
    try:
        with gateway_in_thread(settings(w)) as base:
            assert post(base, body).status_code == 200
        with gateway_in_thread(settings(plain)) as base:
            assert post(base, body).status_code == 200
    finally:
        w.stop()
        plain.stop()
    raw = w.state.received[0].tensors["pixel_values"]
    floats = plain.state.received[0].tensors["pixel_values"]
    assert raw.dtype == np.uint8 and floats.dtype == np.float32 and raw.shape == floats.shape
    normalized = DeviceNormalizer.from_bundle(bundle_dir(MODEL)).normalize(torch.from_numpy(raw.copy())).numpy()
    assert np.array_equal(normalized, floats)


def test_a_family_whose_reference_normalizes_in_bfloat16_sends_values_to_a_device_normalize_worker() -> None:
    """Llama 4's reference rescales and normalizes in bfloat16 (transformers 5.24 ``Llama4ImageProcessor``), which
    a worker's float32 device normalize would not reproduce: the gateway sends the normalized values, exactly the
    transformers processor's (bfloat16 values as float32), even to a worker advertising ``mm_device_do_normalize``."""
    from transformers import AutoProcessor

    llama4 = "meta-llama/Llama-4-Scout-17B-16E-Instruct"
    image = png(130, 250, 3)
    body = {"model": llama4, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image)}}]}]}
    w = FakeWorker(FakeWorkerState(labels={"mm_device_do_normalize": True}))
    try:
        with gateway_in_thread(Settings(model=str(bundle_dir(llama4)), worker_urls=(w.url,))) as base:
            assert post(base, body).status_code == 200
    finally:
        w.stop()
    sent = w.state.received[0].tensors["pixel_values"]
    ref = AutoProcessor.from_pretrained(bundle_dir(llama4)).image_processor(
        images=[Image.open(io.BytesIO(image))], return_tensors="pt")["pixel_values"]
    assert sent.dtype == np.float32 and np.array_equal(sent, ref.float().numpy())


def test_cache_hit_equals_miss_bit_for_bit_and_is_counted(worker: FakeWorker) -> None:
    body = chat([data_url(png(200, 300, 4)), data_url(png(90, 60, 5))])
    with gateway_in_thread(settings(worker, pixel_cache_bytes=64 * 1024 * 1024)) as base:
        before = httpx.get(base + "/metrics").text
        assert post(base, body).status_code == 200
        assert post(base, body).status_code == 200
        after = httpx.get(base + "/metrics").text
    miss, hit = worker.state.received
    for name in miss.tensors:
        assert np.array_equal(miss.tensors[name], hit.tensors[name]), name

    def count(text: str, name: str) -> float:  # the series of this model's images (the served name: --model's)
        from prometheus_client.parser import text_string_to_metric_families

        labels = {"model": "Qwen/Qwen2-VL-2B-Instruct", "modality": "image"}
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == name and s.labels == labels)

    assert count(after, "mmgate_mm_pixel_cache_hits_total") - count(before, "mmgate_mm_pixel_cache_hits_total") == 2
    assert count(after, "mmgate_mm_pixel_cache_misses_total") - count(before, "mmgate_mm_pixel_cache_misses_total") == 2


def test_two_parts_naming_one_url_are_fetched_once(worker: FakeWorker) -> None:
    with media_origin() as origin:
        url = origin.add("/same.png", png(70, 90, 6), "image/png")
        with gateway_in_thread(settings(worker)) as base:
            resp = post(base, chat([url, url]))
        assert resp.status_code == 200, resp.text
        assert origin.hits["/same.png"] == 1
    received = worker.state.received[0]
    # 70x90: round(70/28) = round(2.5) = 2 (half to even) -> 56, round(90/28) = 3 -> 84; grid 4x6, twice.
    assert received.tensors["image_grid_thw"].tolist() == [[1, 4, 6], [1, 4, 6]]


def test_request_larger_than_the_budget_is_413_at_once(worker: FakeWorker) -> None:
    with gateway_in_thread(settings(worker, max_inflight_bytes=SMALL_PV_BYTES + 1000)) as base:
        resp = post(base, chat([data_url(png(200, 200))]))
    assert resp.status_code == 413
    assert resp.headers["X-SMG-Error-Code"] == "multimodal_payload_too_large"
    assert worker.state.received == []


def test_budget_waits_then_429_with_retry_after_and_caps_the_queue() -> None:
    w = FakeWorker(FakeWorkerState(delay_s=3.5))
    results: dict[str, httpx.Response] = {}
    try:
        with gateway_in_thread(settings(w, max_inflight_bytes=SMALL_PV_BYTES + 1000)) as base:
            first = threading.Thread(target=lambda: results.__setitem__("first", post(base, chat([data_url(png(64, 64, 1))]))))
            first.start()
            while not w.state.received:
                threading.Event().wait(0.02)
            second = threading.Thread(target=lambda: results.__setitem__("second", post(base, chat([data_url(png(64, 64, 2))]))))
            second.start()
            threading.Event().wait(0.5)  # the second is now queued
            results["third"] = post(base, chat([data_url(png(64, 64, 3))]))
            second.join()
            first.join()
    finally:
        w.stop()
    assert results["first"].status_code == 200
    for key in ("second", "third"):
        resp = results[key]
        assert resp.status_code == 429, key
        assert resp.headers["X-SMG-Error-Code"] == "multimodal_inflight_budget"
        assert resp.headers["Retry-After"] == "2"
    assert results["third"].elapsed.total_seconds() < 1.0  # refused at once: the queue held a budget's worth


def test_budget_grants_in_order_as_bytes_are_released() -> None:
    from mmgate.observe import metrics

    def gauge(model: str) -> float | None:
        return metrics.REGISTRY.get_sample_value("mmgate_mm_inflight_bytes", {"model": model})

    async def scenario() -> list[str]:
        budget = InflightBudget(100, wait_s=2.0)  # one budget shared by two models
        order: list[str] = []
        a = await budget.acquire(60, "budget-model-a")
        order.append("a")
        assert (gauge("budget-model-a"), gauge("budget-model-b")) == (60, None)

        async def later(name: str, n: int) -> None:
            grant = await budget.acquire(n, "budget-model-b")
            order.append(name)
            if name == "c":
                assert (gauge("budget-model-a"), gauge("budget-model-b")) == (0, 90)  # b's 60 + c's 30
            await asyncio.sleep(0)  # c is granted while b still holds its bytes
            grant.release()

        waiting = asyncio.gather(later("b", 60), later("c", 30))
        await asyncio.sleep(0.05)
        assert budget.in_use == 60 and order == ["a"]
        a.release()
        a.release()  # idempotent
        await waiting
        assert budget.in_use == 0
        assert (gauge("budget-model-a"), gauge("budget-model-b")) == (0, 0)
        with pytest.raises(GatewayError) as err:
            await budget.acquire(101, "budget-model-a")
        assert err.value.code is ErrorCode.MULTIMODAL_PAYLOAD_TOO_LARGE and err.value.status == 413
        return order

    assert asyncio.run(scenario()) == ["a", "b", "c"]


def test_unbounded_budget_and_zero_budget_refused_at_start_up() -> None:
    from mmgate.config.settings import parse_settings

    assert parse_settings(["--model", "m"], {}).transport.max_inflight_bytes is None
    with pytest.raises(SystemExit):
        parse_settings(["--model", "m", "--multimodal-max-inflight-bytes", "0"], {})
    assert parse_settings(["--model", "m"], {"SMG_MM_TENSOR_TRANSPORT": "shm",
                                             "SMG_MM_SHM_MIN_BYTES": "1"}).transport.shm_min_bytes == 1


def test_encoded_request_parses_to_the_built_message() -> None:
    """encode_generate_request appends the big inline tensor as a second mm_inputs record: protobuf merges it."""
    import asyncio
    import json

    from smg_grpc_proto.generated import vllm_engine_pb2

    from mmgate.gateway.state import build_state
    from mmgate.request.parse import parse_chat_request
    from mmgate.engines.vllm import build_generate_request, encode_generate_request
    from mmgate.transport.dtypes import EncoderDtype
    from mmgate.transport.policy import WirePlan

    state = build_state(Settings(model=str(bundle_dir(MODEL))))
    try:
        with_images = parse_chat_request(json.dumps(chat([data_url(png(300, 410, 7)), data_url(png(50, 60, 8))])).encode())
        text_only = parse_chat_request(json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode())
        prepared = asyncio.run(state.pipeline.prepare(with_images))
        prepared_text = asyncio.run(state.pipeline.prepare(text_only))
    finally:
        state.executor.shutdown()
    for dtype in (EncoderDtype.FLOAT32, EncoderDtype.BFLOAT16):
        wire = WirePlan(shm=False, shm_min_bytes=0, encoder_dtype=dtype, device_normalize=False)
        built = build_generate_request(prepared, wire)
        parsed = vllm_engine_pb2.GenerateRequest.FromString(encode_generate_request(prepared, wire).data)
        assert parsed == built
        assert parsed.mm_inputs.pixel_values.dtype == dtype.value
        assert len(parsed.mm_inputs.pixel_values.inline) == prepared.batches[0].tensors["pixel_values"].size * (
            4 if dtype is EncoderDtype.FLOAT32 else 2)
    assert vllm_engine_pb2.GenerateRequest.FromString(encode_generate_request(prepared_text).data) == \
        build_generate_request(prepared_text)


def _prepare_both(body: dict, raw: bool = False, **settings_kw: object) -> tuple:
    """The same request prepared with arrays and with deferred pixels (same request id)."""
    import json

    from mmgate.gateway.state import build_state
    from mmgate.request.parse import parse_chat_request

    state = build_state(Settings(model=str(bundle_dir(MODEL)), preprocess_threads=2, **settings_kw))
    req = parse_chat_request(json.dumps(body).encode())

    async def both() -> tuple:
        arrays = await state.pipeline.prepare(req, request_id="r", choose_worker=lambda m, key: raw)
        deferred = await state.pipeline.prepare(req, request_id="r", choose_worker=lambda m, key: raw, defer_pixels=True)
        return arrays, deferred

    return state, asyncio.run(both())


@pytest.mark.parametrize("raw", [False, True], ids=["normalized", "raw-uint8"])
def test_deferred_pixels_are_computed_into_the_request_bytes_and_the_segment(raw: bool) -> None:
    """Rows computed straight into the serialized request / a new segment equal the array path's, in every
    wire dtype, with a repeated image (written at both of its places) and one large enough to be split
    across pool threads."""
    from smg_grpc_proto.generated import vllm_engine_pb2

    from mmgate.engines.vllm import build_generate_request, encode_generate_request
    from mmgate.transport import shm
    from mmgate.transport.dtypes import EncoderDtype
    from mmgate.transport.policy import WirePlan
    from mmgate.transport.shm import ShmLease
    from mmgate.types import PendingTensor

    a, b, large = data_url(png(300, 410, 7)), data_url(png(50, 60, 8)), data_url(png(900, 1200, 9))
    # a twice (computed once, copied to both places), b once (written block by block), large (in bands)
    state, (arrays, deferred) = _prepare_both(chat([a, b, a, large]), raw=raw)
    try:
        pending = deferred.batches[0].tensors["pixel_values"]
        assert isinstance(pending, PendingTensor)
        assert pending.shape == arrays.batches[0].tensors["pixel_values"].shape
        assert deferred.input_ids == arrays.input_ids
        dtypes = [EncoderDtype.FLOAT32] if raw else list(EncoderDtype)
        for dtype in dtypes:
            inline = WirePlan(shm=False, shm_min_bytes=0, encoder_dtype=dtype, device_normalize=raw)
            encoded = encode_generate_request(deferred, inline)
            asyncio.run(encoded.fill())
            assert vllm_engine_pb2.GenerateRequest.FromString(encoded.data) == build_generate_request(arrays, inline)
            via_shm = WirePlan(shm=True, shm_min_bytes=1024, encoder_dtype=dtype, device_normalize=raw)
            with ShmLease() as lease_a, ShmLease() as lease_b:
                expected = build_generate_request(arrays, via_shm, lease_a)
                encoded = encode_generate_request(deferred, via_shm, lease_b)
                asyncio.run(encoded.fill())
                parsed = vllm_engine_pb2.GenerateRequest.FromString(encoded.data)
                got_pv, want_pv = parsed.mm_inputs.pixel_values, expected.mm_inputs.pixel_values
                assert got_pv.WhichOneof("payload") == want_pv.WhichOneof("payload") == "shm"
                assert (list(got_pv.shape), got_pv.dtype) == (list(want_pv.shape), want_pv.dtype)
                assert shm.read_segment(got_pv.shm.name, 0, got_pv.shm.nbytes) == \
                    shm.read_segment(want_pv.shm.name, 0, want_pv.shm.nbytes)
                assert parsed.mm_inputs.mm_hashes == expected.mm_inputs.mm_hashes
                assert parsed.tokenized.input_ids == expected.tokenized.input_ids
    finally:
        state.executor.shutdown()


def test_failed_segment_falls_back_to_inline_and_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    from smg_grpc_proto.generated import vllm_engine_pb2

    from mmgate.observe import metrics
    from mmgate.engines.vllm import build_generate_request, encode_generate_request
    from mmgate.transport import shm
    from mmgate.transport.policy import WirePlan
    from mmgate.transport.shm import ShmLease

    def full(nbytes: int, reserve: bool = True) -> str:
        raise shm.ShmError("cannot create segment (EMFILE)")

    state, (arrays, deferred) = _prepare_both(chat([data_url(png(120, 160, 3))]))
    try:
        monkeypatch.setattr(shm, "create_segment", full)
        failures = metrics.SHM_WRITE_FAILURES.labels("vllm")
        wire = WirePlan(shm=True, shm_min_bytes=1024, encoder_dtype=EncoderDtype.FLOAT32, device_normalize=False)
        before = failures._value.get()
        with ShmLease() as lease:
            encoded = encode_generate_request(deferred, wire, lease)
            asyncio.run(encoded.fill())
            assert lease.names == []
        parsed = vllm_engine_pb2.GenerateRequest.FromString(encoded.data)
        assert parsed.mm_inputs.pixel_values.WhichOneof("payload") == "inline"
        inline = WirePlan(shm=False, shm_min_bytes=0, encoder_dtype=EncoderDtype.FLOAT32, device_normalize=False)
        assert parsed == build_generate_request(arrays, inline)
        assert failures._value.get() == before + 1
    finally:
        state.executor.shutdown()


def test_a_segment_added_after_the_request_ended_is_unlinked_at_once() -> None:
    from mmgate.transport import shm

    lease = shm.ShmLease()
    lease.add(shm.create_segment(4096))
    assert lease.release() == 1
    late = shm.create_segment(4096)
    lease.add(late)  # a pool task finishing after the request failed
    assert not os.path.exists(os.path.join(SHM_DIR, late))


def test_new_bytes_is_a_writable_bytes_object_owned_once() -> None:
    """``placement.new_bytes``: the bytes grpc sends, filled in place, owned by one reference only."""
    import sys

    from mmgate.transport.placement import new_bytes

    data, view = new_bytes(1 << 20)
    assert type(data) is bytes and len(data) == 1 << 20 and view.flags.writeable
    view[:] = 7
    view[-3:] = (1, 2, 3)
    assert data[:2] == b"\x07\x07" and data[-3:] == b"\x01\x02\x03"
    assert sys.getrefcount(data) == 2  # the name and getrefcount's argument: nothing leaked a reference
    empty, empty_view = new_bytes(0)
    assert empty == b"" and empty_view.size == 0


@pytest.mark.parametrize("dtype, convert, direct", [("float32", None, True), ("uint8", None, True),
                                                     ("bfloat16", to_bfloat16_bits, False),
                                                     ("float16", to_float16, False)])
def test_request_bytes_offer_their_rows_in_place_only_without_a_conversion(dtype: str, convert, direct: bool) -> None:
    """``BufferTarget.writer``: float32 / uint8 values travel as they are, so the writer is a ``RowArray`` over the
    request bytes (at an odd byte offset: the payload follows the serialized head) that a row writer computes
    into; a converting target (bfloat16, float16) keeps copying converted blocks.  Either way the bytes are the
    values' wire form, as torch converts them."""
    from mmgate.transport.placement import BufferTarget, new_bytes
    from mmgate.types import RowArray

    rows = np.random.default_rng(3).random((6, 10), dtype=np.float32) * 200
    values = rows.astype(np.uint8) if dtype == "uint8" else rows
    # the wire form by torch's own conversion (bfloat16 as its uint16 bit patterns)
    as_torch = {"bfloat16": (torch.bfloat16, torch.uint16), "float16": (torch.float16, torch.float16)}
    wire = values if convert is None else torch.from_numpy(values).to(as_torch[dtype][0]).view(
        as_torch[dtype][1]).numpy()
    data, view = new_bytes(wire.nbytes + 5)
    view[:5] = 9
    target = BufferTarget(view[5:], 10, wire.itemsize, *(() if convert is None else (convert,)), owner=data,
                          values=values.dtype)
    with target.writer() as put:
        assert isinstance(put, RowArray) is direct
        if direct:
            assert put.array.dtype == values.dtype and put.array.shape == (6, 10)
            put.rows(2, 2)[...] = values[2:4]  # computed in place
            put(4, values[4:])
            put(0, values[:2])
        else:
            put(4, values[4:])
            put(0, values[:4])
    assert data[:5] == b"\x09" * 5 and data[5:] == wire.tobytes()


def test_request_bytes_without_the_values_dtype_are_written_block_by_block() -> None:
    """A target not told the values' dtype (or whose bytes do not divide into rows) never offers a RowArray."""
    from mmgate.transport.placement import BufferTarget
    from mmgate.types import RowArray

    buf = np.zeros(6 * 10 * 4, dtype=np.uint8)
    for target in (BufferTarget(buf, 10, 4), BufferTarget(buf[:-4], 10, 4, values=np.dtype(np.float32)),
                   BufferTarget(buf, 10, 4, values=np.dtype(np.uint8))):
        with target.writer() as put:
            assert not isinstance(put, RowArray)


def test_segment_write_failure_during_the_fill_falls_back_to_inline(worker: FakeWorker,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """/dev/shm filling up while the rows are written: the request is encoded again inline, answers 200
    with the same tensors, the failure is counted and no segment is left."""
    from mmgate.observe import metrics
    from mmgate.transport import shm

    body = chat([data_url(png(300, 200, 4))])
    before = mmgate_segments()
    with gateway_in_thread(settings(worker, tensor_transport=TensorTransport.INLINE)) as base:
        assert post(base, body).status_code == 200

    def full(self: shm.SegmentWriter, offset: int, data: np.ndarray) -> None:
        raise shm.ShmError("cannot write segment (ENOSPC)")

    monkeypatch.setattr(shm.SegmentWriter, "write", full)
    failures = metrics.SHM_WRITE_FAILURES.labels("vllm")
    counted = failures._value.get()
    with gateway_in_thread(settings(worker, tensor_transport=TensorTransport.SHM, shm_min_bytes=1024)) as base:
        assert post(base, body).status_code == 200
    assert failures._value.get() == counted + 1
    inline, fallback = worker.state.received
    assert fallback.payloads["pixel_values"] == "inline"
    for name, array in inline.tensors.items():
        assert np.array_equal(array, fallback.tensors[name]), name
    assert mmgate_segments() == before


def test_one_pixel_cache_shared_by_two_models_keeps_their_rows_apart_and_counts_each() -> None:
    """Qwen2.5-VL and Gemma 3 (different preprocessing) share one pixel cache, as two served models of one
    gateway do: the same image sent to each is a miss for each (no entry of one is served to the other),
    the cache then holds two entries, and a repeat is a hit counted under its own model, equal bit for bit
    to that model's own miss."""
    from concurrent.futures import ThreadPoolExecutor

    from mmgate.gateway.state import load_runtime
    from mmgate.media.fetch import MediaFetcher
    from mmgate.models.bundle import resolve_bundle
    from mmgate.observe import metrics
    from mmgate.pipeline.cache import PixelCache
    from mmgate.pipeline.prepare import Pipeline
    from mmgate.request.parse import parse_chat_request
    from mmgate.types import Modality

    models = ("Qwen/Qwen2.5-VL-7B-Instruct", "google/gemma-3-4b-it")
    cache = PixelCache(256 * 1024 * 1024)
    image = data_url(png(120, 160, 11))

    def count(kind: str, model: str) -> float:
        return metrics.REGISTRY.get_sample_value(f"mmgate_mm_pixel_cache_{kind}_total",
                                                 {"model": model, "modality": "image"}) or 0.0

    def pixels(pipe: Pipeline, model: str) -> np.ndarray:
        body = {"model": model, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "hi"}]}]}
        prepared = asyncio.run(pipe.prepare(parse_chat_request(json.dumps(body).encode())))
        batch = next(b for b in prepared.batches if b.modality is Modality.IMAGE)
        return np.array(batch.tensors[batch.primary_key])

    before = {(kind, m): count(kind, m) for kind in ("hits", "misses") for m in models}
    with ThreadPoolExecutor(2) as pool:
        pipes = {}
        for model in models:
            settings = Settings(model=str(bundle_dir(model)))
            runtime = load_runtime(resolve_bundle(settings.model, ()), settings, model)
            pipes[model] = Pipeline(runtime, settings, MediaFetcher(settings.fetch), pool, cache)
        misses = {m: pixels(pipes[m], m) for m in models}
        assert len(cache) == 2
        hits = {m: pixels(pipes[m], m) for m in models}
    for model in models:
        assert (count("misses", model) - before[("misses", model)], count("hits", model) - before[("hits", model)]
                ) == (1, 1), model
        assert misses[model].dtype == hits[model].dtype and np.array_equal(misses[model], hits[model]), model
    assert misses[models[0]].shape != misses[models[1]].shape  # the two models' rows differ
