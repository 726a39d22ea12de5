"""A finished call lets go of its request at once (issue 13, memory).

grpc.aio's ``async for`` over a unary-stream call builds an async generator that refers back to its call
(``grpc/aio/_call.py`` ``_StreamResponseMixin.__aiter__``); the cycle keeps the call, and the request bytes
it holds, alive until the cyclic collector runs, which an allocation-light gateway does rarely: with
inline tensors (29.5 MB per 1280x960 Qwen3-VL image) RSS grew by one request's bytes per request until a
collection (measured 213 -> 471 MB over 12 sequential requests; 1.8 GB peak at c=8 in
``benchmarks/e2e_gateway.py``).  :meth:`WorkerClient.generate` reads with ``call.read()`` instead.

The check is exact and untimed: with the cyclic collector off, the request bytes' reference count is back
to its value before the call once the stream is consumed (or abandoned early), so nothing but the caller
holds them.  Real gRPC on loopback (``tests.support.fake_worker``).
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import mmap
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2

from mmgate.engines.base import EncodedRequest, Role
from mmgate.engines.client import WorkerClient
from mmgate.errors import ErrorCode, GatewayError
from tests.support.fake_worker import FakeWorker


@pytest.fixture
def worker() -> Iterator[FakeWorker]:
    w = FakeWorker()
    yield w
    w.stop()


def _request(nbytes: int) -> bytes:
    tensor = vllm_engine_pb2.TensorData(shape=[nbytes // 4], dtype="float32", inline=bytes(nbytes))
    return vllm_engine_pb2.GenerateRequest(
        request_id="r", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[1, 2, 3]),
        mm_inputs=vllm_engine_pb2.MultimodalInputs(pixel_values=tensor), stream=True).SerializeToString()


@pytest.mark.parametrize("early_stop", [False, True])
def test_a_consumed_or_abandoned_stream_drops_its_request_bytes(worker: FakeWorker, early_stop: bool) -> None:
    async def scenario() -> tuple[int, int, int]:
        client = WorkerClient(worker.url.removeprefix("grpc://"))
        try:
            assert (await client.probe(5.0)).capabilities is not None
            data = _request(4 * 1024 * 1024)
            before = sys.getrefcount(data)
            events = 0
            for _ in range(3):
                stream = client.generate(EncodedRequest(data), Role.SINGLE)
                async for _event in stream:
                    events += 1
                    if early_stop:
                        break
                await stream.aclose()
                await asyncio.sleep(0.05)  # grpc's own completion callbacks run
            return before, sys.getrefcount(data), events
        finally:
            await client.close()

    gc.collect()
    gc.disable()
    try:
        before, after, events = asyncio.run(scenario())
    finally:
        gc.enable()
    assert events >= 3
    assert after == before, f"{after - before} references to the request bytes outlived their calls"


def _random_request(nbytes: int) -> tuple[bytes, np.ndarray]:
    values = np.random.default_rng(nbytes).random(nbytes // 4, dtype=np.float32)
    tensor = vllm_engine_pb2.TensorData(shape=[len(values)], dtype="float32", inline=values.tobytes())
    data = vllm_engine_pb2.GenerateRequest(
        request_id="big", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[1, 2, 3]),
        mm_inputs=vllm_engine_pb2.MultimodalInputs(pixel_values=tensor), stream=True).SerializeToString()
    return data, values


@pytest.mark.parametrize("min_bytes", [32 << 20, 0, 64 << 20], ids=["released", "kept", "kept-below"])
def test_a_large_request_is_sent_whole_and_its_pages_given_back_after_grpc_copied_it(worker: FakeWorker,
                                                                                      min_bytes: int) -> None:
    """``--multimodal-release-sent-min-bytes``: a 40 MiB request (a mapping of its own) reaches the worker byte
    for byte although its pages are given back as soon as grpc-python has copied it (the release runs after
    the copy: were grpc to send from the caller's buffer, or to copy it later, the worker would receive zeros
    and this test would fail); the caller's bytes read as zeros afterwards, and the request cannot be sent
    again.  With 0, or a threshold above the request's size, nothing is released."""
    data, values = _random_request(40 << 20)
    digest = hashlib.sha256(data).digest()

    async def scenario() -> list[int]:
        client = WorkerClient(worker.url.removeprefix("grpc://"), release_sent_min_bytes=min_bytes)
        try:
            assert (await client.probe(5.0)).capabilities is not None
            request = EncodedRequest(data)
            finishes = [event.prompt_tokens for event in [e async for e in client.generate(request, Role.SINGLE)]
                        if event.is_complete]
            if min_bytes and len(data) >= min_bytes:
                with pytest.raises(GatewayError) as refused:
                    async for _event in client.generate(request, Role.SINGLE):
                        pass
                assert refused.value.code is ErrorCode.INTERNAL_ERROR
            return finishes
        finally:
            await client.close()

    assert asyncio.run(scenario()) == [3]
    (got,) = worker.state.received
    assert np.array_equal(got.tensors["pixel_values"], values)  # every byte arrived
    if min_bytes and len(data) >= min_bytes:
        assert not np.frombuffer(data, dtype=np.uint8)[2 * mmap.PAGESIZE:-2 * mmap.PAGESIZE].any()
    else:
        assert hashlib.sha256(data).digest() == digest


def test_release_pages_zeroes_whole_interior_pages_and_keeps_both_ends() -> None:
    """``placement.release_pages``: the pages wholly inside the buffer read as zeros afterwards (and count as
    released); the first 64 bytes and the partial pages at both ends keep their bytes."""
    from mmgate.transport.placement import new_bytes, release_pages

    data, view = new_bytes((33 << 20) + 123)
    view[:] = 7
    released = release_pages(data)
    page = mmap.PAGESIZE
    address = view.ctypes.data
    start = -(-(address + 64) // page) * page - address
    end = (address + len(data)) // page * page - address
    assert released == end - start > 32 << 20
    assert (view[:start] == 7).all() and (view[end:] == 7).all() and (view[start:end] == 0).all()
    assert release_pages(b"") == 0 and release_pages(b"x" * 100) == 0  # no whole page inside


@pytest.mark.parametrize("argv, expected", [([], 32 << 20), (["--multimodal-release-sent-min-bytes", "0"], 0),
                                            (["--multimodal-release-sent-min-bytes", "1048576"], 1 << 20)])
def test_the_release_threshold_reaches_every_worker_client(worker: FakeWorker, argv: list[str],
                                                           expected: int) -> None:
    """The flag (default 32 MiB, glibc's largest mmap threshold) is parsed once and every worker's client
    (the registry and its per-model views) gets it."""
    from mmgate.config.settings import parse_settings
    from mmgate.routing.workers import WorkerRegistry

    settings = parse_settings(["--worker-urls", worker.url, *argv], {})
    assert settings.transport.release_sent_min_bytes == expected

    async def scenario() -> list[int]:
        registry = WorkerRegistry.from_settings(settings)
        try:
            await registry.refresh()  # one probe of every worker: their clients are made
            return [w.client.release_sent_min_bytes for w in registry.workers if w.client is not None] + [
                registry.view(None).release_sent_min_bytes]
        finally:
            for w in registry.workers:
                if w.client is not None:
                    await w.client.close()

    assert asyncio.run(scenario()) == [expected, expected]


def test_the_release_is_on_only_for_grpc_versions_that_copy_before_sending(monkeypatch: pytest.MonkeyPatch,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The installed grpcio's send path was read and the test above shows it copies first; another version
    (upstream grpc after 1.85 adds a zero-copy send) turns the release off, with one warning."""
    import grpc

    from mmgate.engines import client as client_module

    check = client_module._grpc_copies_before_sending
    assert check(grpc.__version__) is client_module._RELEASE_SAFE
    assert check("1.85.4") and check("1.60.0")
    assert not check("1.86.0") and not check("1.59.2") and not check("2.0.0") and not check("dev")
    monkeypatch.setattr(client_module, "_RELEASE_SAFE", False)
    client_module._warn_release_off.cache_clear()

    async def made() -> int:
        client = WorkerClient("127.0.0.1:1", release_sent_min_bytes=32 << 20)
        await client.close()
        return client.release_sent_min_bytes

    with caplog.at_level("WARNING", logger="mmgate.engines"):
        assert asyncio.run(made()) == 0
    assert "--multimodal-release-sent-min-bytes is off" in caplog.text
