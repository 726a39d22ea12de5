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
import sys
from collections.abc import Iterator

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2

from mmgate.engines.base import EncodedRequest, Role
from mmgate.engines.client import WorkerClient
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
