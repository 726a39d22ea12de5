"""HTTP/2 keepalive of the gateway's engine channels and the reference engine's ping policy, on real gRPC.

A tiny gRPC server (a streaming method that answers once, then stays silent) behind a loopback
:class:`~tests.e2e.fault_proxy.FaultProxy`; the client channel is built with
:func:`mmgate.engines.client.channel_options`.  grpc core 1.85 facts these pin down (docs/engines.md,
"Liveness"): a keepalive ping's ack is timed by ``grpc.http2.ping_timeout_ms`` (so a frozen link fails the
call in about interval + timeout, not grpc's 60 s default), pings go on while the client sends nothing
(``max_pings_without_data`` 0), and a server with grpc core's default ping policy sends a pinging client
away (GOAWAY ``too_many_pings``) while the reference engine's :data:`~mmgate.refengine.server.PING_POLICY`
does not.  The end-to-end cases (a PD decode leg, a single worker) are in tests/e2e/test_disagg_faults.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from mmgate.engines.client import DEFAULT_KEEPALIVE, channel_options
from mmgate.refengine.server import PING_POLICY
from mmgate.config.settings import KeepaliveSettings, parse_settings
from tests.e2e.fault_proxy import FaultProxy

FAST = KeepaliveSettings(interval_s=1.0, timeout_s=1.0)


def _silent_stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    """One message, then ``request`` seconds of silence, then another."""
    yield b"first"
    time.sleep(float(request.decode()))
    yield b"last"


def _server(options: list[tuple[str, Any]]) -> tuple[grpc.Server, int]:
    server = grpc.server(ThreadPoolExecutor(4), options=options)
    handler = grpc.method_handlers_generic_handler(
        "t.Silent", {"Gen": grpc.unary_stream_rpc_method_handler(_silent_stream)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


async def _stream(port: int, silence_s: float, freeze: FaultProxy | None = None) -> tuple[list[bytes], str, float]:
    """(messages, the failure's status name or "", seconds from the first message to the end)."""
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options(FAST))
    call = channel.unary_stream("/t.Silent/Gen", request_serializer=None, response_deserializer=None)(
        str(silence_s).encode())
    got: list[bytes] = []
    failure = ""
    started = 0.0
    try:
        while (message := await call.read()) is not grpc.aio.EOF:
            got.append(message)
            if len(got) == 1:
                started = time.monotonic()
                if freeze is not None:
                    freeze.freeze()
    except grpc.aio.AioRpcError as exc:
        failure = exc.code().name
    finally:
        await channel.close()
    return got, failure, time.monotonic() - started


def test_the_channel_options_are_smgs_keepalive() -> None:
    options = dict(channel_options(DEFAULT_KEEPALIVE))
    assert (DEFAULT_KEEPALIVE.interval_s, DEFAULT_KEEPALIVE.timeout_s) == (30.0, 10.0)  # SMG's channel.rs
    assert options["grpc.keepalive_time_ms"] == 30000
    assert options["grpc.keepalive_timeout_ms"] == options["grpc.http2.ping_timeout_ms"] == 10000
    assert options["grpc.keepalive_permit_without_calls"] == 1
    assert options["grpc.http2.max_pings_without_data"] == 0
    settings = parse_settings(["--model", "m", "--engine-keepalive-interval", "2", "--engine-keepalive-timeout", "3"],
                              {})
    assert settings.engine_keepalive == KeepaliveSettings(2.0, 3.0)
    with pytest.raises(SystemExit):
        parse_settings(["--model", "m", "--engine-keepalive-interval", "0.5"], {})


def test_a_frozen_link_fails_the_call_within_interval_plus_timeout() -> None:
    server, port = _server(PING_POLICY)
    proxy = FaultProxy(port, "keepalive")
    try:
        got, failure, seconds = asyncio.run(_stream(proxy.port, 30.0, freeze=proxy))
    finally:
        proxy.close()
        server.stop(0)
    assert (got, failure) == ([b"first"], "UNAVAILABLE")
    assert seconds < FAST.interval_s + FAST.timeout_s + 3.0, seconds


@pytest.mark.parametrize(("options", "sent_away"), [
    (PING_POLICY, False),
    ([], True),  # grpc core's default: one ping per 5 min without data, GOAWAY at the third strike
    ([("grpc.http2.min_recv_ping_interval_without_data_ms", 500)], True),  # not a grpc core argument: ignored
], ids=["refengine", "grpc-default", "misspelt"])
def test_a_silent_stream_under_pings(options: list[tuple[str, Any]], sent_away: bool) -> None:
    """A healthy engine silent for 4 s while the client pings every second: the reference engine's policy
    keeps the stream; grpc core's default (and vLLM's misspelt argument) end it with ``too_many_pings``."""
    server, port = _server([*options, ("grpc.keepalive_permit_without_calls", 1)])
    try:
        got, failure, _ = asyncio.run(_stream(port, 4.0))
    finally:
        server.stop(0)
    if sent_away:
        assert (got, failure) == ([b"first"], "UNAVAILABLE")
    else:
        assert (got, failure) == ([b"first", b"last"], "")
