"""The Redis media sidecar: hello and fingerprint, result size, deadlines, overload, and a stop mid-run.

Runs against the session stack (a real ``redis-server``, a real engine with
``--mm-processor redis`` and a real ``mmgate sidecar`` with a 2 s hello TTL).
The last tests stop the sidecar; :meth:`Stack.ensure_sidecar` restarts it for
any test that runs later.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid

import grpc
import httpx
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from mmgate.sidecar.client import SidecarClient, SidecarUnavailable
from mmgate.sidecar.processor import refs_from_items
from mmgate.sidecar.protocol import (
    SCHEMA_VERSION,
    Job,
    JobItem,
    Keys,
    decode_result,
    encode,
    hello_text,
)
from tests.worker_mode.conftest import HELLO_TTL_S, NAMESPACE, SIDECAR_TIMEOUT_MS, Stack
from tests.worker_mode.support import Gateway, Origin, chat, data_url, image_bytes, image_part, server_info, wait_for

# Qwen2-VL: <|vision_start|> <|image_pad|> <|vision_end|> "Hello"
ONE_ANCHOR = [151652, 151655, 151653, 9707]


def _hello(stack: Stack) -> dict[bytes, bytes]:
    return stack.redis.client().hgetall(stack.hello_key())


def _push_job(stack: Stack, url: str, *, deadline_ms: int, fingerprint: str | None = None) -> str:
    client = stack.redis.client()
    job_id = uuid.uuid4().hex
    job = Job(v=SCHEMA_VERSION, job_id=job_id, request_id="test",
              fingerprint=fingerprint or hello_text(_hello(stack), "fingerprint"), prompt_token_ids=ONE_ANCHOR,
              items=[JobItem(modality="image", url=url)], enqueued_ms=int(time.time() * 1000), deadline_ms=deadline_ms)
    client.lpush(Keys.for_namespace(NAMESPACE).jobs, encode(job))
    return job_id


def _result(stack: Stack, job_id: str, timeout_s: float = 10.0):  # noqa: ANN202 - JobResult
    """The job's result, once the sidecar pushed it (with its 120 s expiry)."""
    client, key = stack.redis.client(), Keys.for_namespace(NAMESPACE).result(job_id)
    wait_for(lambda: client.exists(key) == 1, timeout_s, "the job's result")
    assert 0 < client.ttl(key) <= 120
    popped = client.brpop([key], timeout=1)
    assert popped is not None, "no result"
    return decode_result(popped[1])


def _generate(port: int, url: str, timeout_s: float) -> grpc.RpcError | vllm_engine_pb2.GenerateResponse:
    request = vllm_engine_pb2.GenerateRequest(
        request_id=uuid.uuid4().hex, tokenized=vllm_engine_pb2.TokenizedInput(input_ids=ONE_ANCHOR),
        sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=2), stream=False,
        media_refs=vllm_engine_pb2.MediaRefs(items=[vllm_engine_pb2.MediaRef(modality=common_pb2.IMAGE, url=url)]))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        try:
            return list(stub.Generate(request, timeout=timeout_s))[-1]
        except grpc.RpcError as exc:
            return exc


def test_the_engine_advertises_redis_with_the_sidecars_schemes(live: Stack, gateways: dict[str, Gateway]) -> None:
    labels = gateways["sidecar"].labels()[0]
    assert labels["mm_processor"] == "redis" and labels["mm_processor_source"] == "flag"
    assert labels["mm_media_ref_schemes"] == "data,http,https"
    inprocess = gateways["inprocess"].labels()[0]
    assert (inprocess["mm_processor"], inprocess["mm_media_ref_schemes"]) == ("inprocess", "data,http,https")
    hello = _hello(live)
    assert hello_text(hello, "schema") == "1" and len(hello_text(hello, "fingerprint")) == 64
    assert 0 < live.redis.client().pttl(live.hello_key()) <= HELLO_TTL_S * 1000


def test_a_result_at_or_above_the_limit_is_not_pushed_and_the_request_is_400_media_too_large(
        live: Stack, gateways: dict[str, Gateway]) -> None:
    # The default limit (512 MiB) was lowered to this server's proto-max-bulk-len (1 MiB).
    assert hello_text(_hello(live), "max_result_bytes") == str(1024 * 1024)
    big = chat([image_part(data_url(image_bytes(448, 448, 5))), {"type": "text", "text": "Describe."}])
    resp = gateways["sidecar"].post(big)  # pixel_values alone: 32*32 patches * 1176 * 4 bytes = 4.8 MB
    assert resp.status_code == 400, resp.text
    assert "media_too_large" in resp.json()["error"]["message"]
    assert gateways["inprocess"].post(big).status_code == 200  # in process there is no transport limit


def test_a_job_past_its_deadline_is_answered_expired_without_being_fetched(live: Stack, media: Origin) -> None:
    url = media.add("/expired.png", image_bytes(32, 32, 4, "PNG"))
    job_id = _push_job(live, url, deadline_ms=int(time.time() * 1000) - 1)
    result = _result(live, job_id)
    assert (result.ok, result.code) == (False, "expired")
    assert media.settled()["/expired.png"] == 0


def test_a_job_made_for_another_fingerprint_is_refused(live: Stack, media: Origin) -> None:
    url = media.add("/other.png", image_bytes(32, 32, 4, "PNG"))
    job_id = _push_job(live, url, deadline_ms=int(time.time() * 1000) + 10_000, fingerprint="0" * 64)
    assert _result(live, job_id).code == "fingerprint_mismatch"
    assert media.settled()["/other.png"] == 0


def test_the_engines_deadline_travels_with_the_job(live: Stack, media: Origin) -> None:
    """A 0.6 s RPC deadline: the sidecar stops at it, well before its own 1.5 s fetch timeout."""
    media.add("/deadline.png", image_bytes(32, 32, 6, "PNG"))
    start = time.monotonic()
    outcome = _generate(live.redis_engine.port, media.url("/slow/deadline.png"), timeout_s=0.6)
    # Either the client's own deadline fires first, or the engine's answer that the sidecar stopped at that
    # deadline arrives first (a race of a few milliseconds): both show the deadline travelled with the job.
    assert isinstance(outcome, grpc.RpcError)
    assert outcome.code() == grpc.StatusCode.DEADLINE_EXCEEDED or (
        outcome.code() == grpc.StatusCode.UNAVAILABLE and "deadline" in (outcome.details() or ""))
    assert time.monotonic() - start < 1.5
    # The sidecar cut the job at the engine's deadline and said so (the engine logs why it gave up).
    wait_for(lambda: "deadline_exceeded: processing passed the job's deadline (0.6 s)"
             in live.redis_engine.log_tail(20_000), 20, "the sidecar's deadline answer")
    assert media.hits["/slow/deadline.png"] == 1


def test_an_absent_or_overloaded_sidecar_is_unavailable(live: Stack) -> None:
    redis_client = live.redis.client()
    refs = refs_from_items([("image", "http://127.0.0.1:9/x.png")])
    absent = SidecarClient(live.redis.url, Keys.for_namespace("nobody"), "f" * 64, timeout_ms=500)
    with pytest.raises(SidecarUnavailable, match="no sidecar hello"):
        absent.process(ONE_ANCHOR, refs, "r")
    keys = Keys.for_namespace("busy")
    redis_client.hset(keys.hello, mapping={"schema": "1", "fingerprint": "f" * 64, "schemes": "data,http,https"})
    redis_client.expire(keys.hello, 30)
    redis_client.lpush(keys.jobs, b"queued-1", b"queued-2")
    busy = SidecarClient(live.redis.url, keys, "f" * 64, timeout_ms=500, max_queue=2)
    with pytest.raises(SidecarUnavailable, match="sidecar_overloaded"):
        busy.process(ONE_ANCHOR, refs, "r")
    assert redis_client.llen(keys.jobs) == 2  # refused before queueing
    other = SidecarClient(live.redis.url, keys, "e" * 64, timeout_ms=500)
    assert other.probe() is None and "another fingerprint" in other.last_problem


def test_stopping_the_sidecar_mid_run_gives_503s_and_the_engine_stops_advertising_after_the_ttl(
        live: Stack, gateways: dict[str, Gateway], media: Origin) -> None:
    gw = gateways["sidecar"]
    jobs = Keys.for_namespace(NAMESPACE).jobs
    redis_client = live.redis.client()
    media.add("/midrun.png", image_bytes(48, 48, 7, "PNG"))
    outcome: dict[str, httpx.Response] = {}
    started = time.monotonic()
    request = threading.Thread(target=lambda: outcome.setdefault("r", gw.post(chat(
        [image_part(media.url("/slow/midrun.png")), {"type": "text", "text": "hi"}]))))
    request.start()
    wait_for(lambda: media.hits["/slow/midrun.png"] == 1, 10, "the sidecar to start fetching")
    assert live.sidecar is not None
    live.sidecar.signal(signal.SIGKILL)  # a crash: the hello is left to lapse
    killed = time.monotonic()
    assert server_info(live.redis_engine.port).mm_processor == "redis"  # the hello is still alive
    request.join(timeout=30)
    resp = outcome["r"]
    # The job died with the sidecar: the engine waited out its 3 s timeout once, and did not resend it.
    assert resp.status_code == 503 and resp.headers["X-SMG-Error-Code"] == "engine_unavailable", resp.text
    assert resp.headers["Retry-After"]
    assert time.monotonic() - started >= SIDECAR_TIMEOUT_MS / 1000 - 0.2
    assert redis_client.llen(jobs) == 0
    # Within the TTL (plus the engine's 0.5 s probe cache) the engine stops advertising redis.
    wait_for(lambda: server_info(live.redis_engine.port).mm_processor == "", HELLO_TTL_S + 2, "mm_processor=''")
    assert time.monotonic() - killed <= HELLO_TTL_S + 2.5
    assert redis_client.exists(live.hello_key()) == 0
    wait_for(lambda: gw.labels()[0]["mm_processor"] == "", 5, "the gateway to see it")
    later = gw.post(chat([image_part(media.url("/midrun.png")), {"type": "text", "text": "hi"}]))
    assert later.status_code == 503 and later.headers["X-SMG-Error-Code"] == "no_healthy_worker"
    direct = _generate(live.redis_engine.port, media.url("/midrun.png"), timeout_s=10)
    assert isinstance(direct, grpc.RpcError) and direct.code() == grpc.StatusCode.UNAVAILABLE
    assert redis_client.llen(jobs) == 0  # nothing queued for a sidecar that is not there


def test_a_sidecar_with_another_fingerprint_is_ignored(stack: Stack, media: Origin) -> None:
    if stack.sidecar is not None:
        stack.sidecar.stop()
    wait_for(lambda: stack.redis.client().exists(stack.hello_key()) == 0, HELLO_TTL_S + 2, "no hello")
    # The PIL backend resizes differently from torchvision: another fingerprint, same namespace.
    other = stack.start_sidecar("--image-backend", "pil", name="sidecar-pil")
    try:
        wait_for(lambda: stack.redis.client().exists(stack.hello_key()) == 1 or not other.alive(), 60, "its hello")
        assert other.alive(), other.tail()
        time.sleep(1.0)  # past the engine's probe cache
        assert server_info(stack.redis_engine.port).mm_processor == ""
        outcome = _generate(stack.redis_engine.port, media.add("/fp.png", image_bytes(32, 32, 8, "PNG")), 10)
        assert isinstance(outcome, grpc.RpcError) and outcome.code() == grpc.StatusCode.UNAVAILABLE
        assert "another fingerprint" in outcome.details()
        assert media.settled()["/fp.png"] == 0
    finally:
        other.stop()
    assert stack.redis.client().exists(stack.hello_key()) == 0  # a stopped sidecar removes its hello
