"""What the routing policies learn from real workers on loopback: ``GetLoads`` polls (least_load) and a
``SubscribeKvEvents`` stream (cache_aware follows the worker's stored and removed blocks).

Two real gRPC vLLM-wire workers (:mod:`tests.support.fake_worker`) answer with loads and KV-event batches the
test writes; the expected worker of each selection is written out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest
from smg_grpc_proto.generated import common_pb2

from mmgate.config.settings import RoutingSettings
from mmgate.engines.base import Role
from mmgate.pipeline.routing_key import RoutingKey, expanded_key
from mmgate.routing.policies.base import RouteRequest
from mmgate.routing.workers import WorkerRegistry
from tests.support.fake_worker import FakeWorker, FakeWorkerState


@pytest.fixture
def two_workers() -> Iterator[tuple[FakeWorker, FakeWorker]]:
    a, b = FakeWorker(FakeWorkerState()), FakeWorker(FakeWorkerState())
    try:
        yield a, b
    finally:
        for w in (a, b):
            w.state.kv_batches.put(None)
            w.stop()


async def until(condition: Callable[[], bool]) -> None:
    """Yield to the event loop until ``condition`` holds (a sync point, bounded by the test's timeout)."""
    while not condition():
        await asyncio.sleep(0.01)


def test_least_load_follows_getloads(two_workers: tuple[FakeWorker, FakeWorker]) -> None:
    a, b = two_workers
    a.state.load = {"num_waiting_uncached_tokens": 4000, "gen_throughput": 2000.0}  # 2.0 s of queued work
    b.state.load = {"num_waiting_uncached_tokens": 200, "gen_throughput": 2000.0}  # 0.1 s

    async def run() -> list[str]:
        reg = WorkerRegistry([a.url, b.url], routing=RoutingSettings(policy="least_load"))
        try:
            await reg.refresh()
            await reg.monitor.poll_once()
            picks = [reg.select(frozenset(), request=RouteRequest(RoutingKey.text([1] * 100))).url]
            a.state.load = {"num_waiting_uncached_tokens": 0, "gen_throughput": 2000.0}
            await reg.monitor.poll_once()
            picks.append(reg.select(frozenset(), request=RouteRequest(RoutingKey.text([1] * 100))).url)
            return picks
        finally:
            await reg.close()

    assert asyncio.run(asyncio.wait_for(run(), 30)) == [b.url, a.url]


def stored(parent: int | None, *blocks: tuple[int, list[int], str | None]) -> common_pb2.KvEventBatch:
    pb = [common_pb2.KvBlock(block_hash=h, token_ids=ids, block_size=len(ids), extra_keys=[
        common_pb2.KvBlockExtraKey(multimodal=common_pb2.KvMultimodalKey(identifier=item, offset=0))]
        if item else []) for h, ids, item in blocks]
    event = common_pb2.KvBlocksStored(blocks=pb)
    if parent is not None:
        event.parent_block_hash = parent
    return common_pb2.KvEventBatch(sequence_number=1, events=[common_pb2.KvCacheEvent(event_id=1, stored=event)])


def test_cache_aware_follows_a_workers_kv_event_stream(two_workers: tuple[FakeWorker, FakeWorker]) -> None:
    a, b = two_workers
    b.state.kv_events = True  # a publishes no events (UNIMPLEMENTED)
    system = list(range(1, 17))
    # the prompt: 16 system tokens, then an image (anchor 999) of 16 placeholders (id 7), keyed by its hash "cafe"
    prompt = RouteRequest(expanded_key([*system, 999], {999: [("cafe", [7] * 16)]}))
    other = RouteRequest(expanded_key([*system, 999], {999: [("beef", [7] * 16)]}))

    async def run() -> list[str]:
        reg = WorkerRegistry([a.url, b.url], routing=RoutingSettings(policy="cache_aware"))
        policy = reg.policies[Role.SINGLE]
        try:
            await reg.refresh()
            await reg.monitor.poll_once()
            b.state.kv_batches.put(stored(None, (101, system, None), (102, [7] * 16, "cafe")))
            await until(lambda: b.url in getattr(policy, "kv", {}) and len(policy.kv[b.url].blocks) == 2)
            picks = [reg.select(frozenset(), request=prompt).url,  # b holds both blocks
                     reg.select(frozenset(), request=other).url]  # b holds the system block only; a none
            removed = common_pb2.KvEventBatch(sequence_number=2, events=[common_pb2.KvCacheEvent(
                event_id=2, removed=common_pb2.KvBlocksRemoved(block_hashes=[101, 102]))])
            b.state.kv_batches.put(removed)
            await until(lambda: not policy.kv[b.url].blocks)
            picks.append(reg.select(frozenset(), request=prompt).url)  # nobody holds anything: least loaded
            return picks
        finally:
            await reg.close()

    assert asyncio.run(asyncio.wait_for(run(), 30)) == [b.url, b.url, a.url]


def test_every_reference_servicer_answers_getloads_in_its_wires_shape() -> None:
    from types import SimpleNamespace

    from mmgate.engines.loads import WorkerLoad, load_from_response
    from mmgate.refengine.servicer import RefEngineServicer
    from mmgate.refengine.sglang_servicer import SglangServicer
    from mmgate.refengine.tokenspeed_servicer import TokenSpeedServicer

    # 5 requests active, 2 on a model thread; the bundle folder its GetTokenizer would serve
    core = SimpleNamespace(counts=lambda: (5, 2), loaded=SimpleNamespace(facts=SimpleNamespace(model_path=".")))
    config = SimpleNamespace(model_workers=2)
    for cls in (SglangServicer, TokenSpeedServicer):
        servicer = cls(config, core)  # type: ignore[arg-type]
        assert load_from_response(servicer.GetLoads(None, None)) == WorkerLoad(running=2, waiting=3)
    vllm = RefEngineServicer.__new__(RefEngineServicer)
    vllm._core, vllm._config = core, config  # type: ignore[attr-defined]
    assert load_from_response(vllm.GetLoads(None, None)) == WorkerLoad(running=2, waiting=3)
