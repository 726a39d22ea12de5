"""Start the reference engine: load the bundle, bind, serve the wire of ``--wire`` in the role of ``--role``.

Stage: engine process entry.  In: an :class:`EngineConfig` (or ``argv`` for
``mmgate engine`` / ``python -m mmgate.refengine``); out: a started gRPC server speaking
``vllm.grpc.engine.VllmEngine``, ``sglang.grpc.scheduler.SglangScheduler`` or
``tokenspeed.grpc.scheduler.TokenSpeedScheduler`` (an encode engine: ``TokenSpeedEncoder`` plus
the scheduler service for discovery, as smg-grpc-servicer's ``tokenspeed/server.py`` mounts
them), and ``grpc.health.v1.Health`` with that engine service as its readiness service
(:mod:`.health`).  A gateway detects the wire by which service's ``HealthCheck`` answers: every
other engine service is ``UNIMPLEMENTED`` here.  A prefill or encode engine also starts its
handoff listener on ``--bootstrap-port`` (:mod:`.handoff`).

One stderr line at start names the model, whether its weights are real or
random (shrunken, seeded), the wire, the role, and the addresses.
"""

from __future__ import annotations

import logging
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import torch
from smg_grpc_proto.generated import (
    sglang_scheduler_pb2_grpc,
    tokenspeed_encoder_pb2_grpc,
    tokenspeed_scheduler_pb2_grpc,
    vllm_engine_pb2_grpc,
)

from mmgate.engines.base import Role, Wire
from mmgate.refengine.bundle import load_model
from mmgate.refengine.config import EngineConfig, parse_args
from mmgate.refengine.core import MANAGEMENT_THREADS, EngineCore
from mmgate.refengine.health import HealthService
from mmgate.refengine.servicer import SERVICE_NAME as VLLM_SERVICE
from mmgate.refengine.servicer import RefEngineServicer, device_normalizer
from mmgate.refengine.sglang_servicer import SERVICE_NAME as SGLANG_SERVICE
from mmgate.refengine.sglang_servicer import SglangServicer
from mmgate.refengine.tokenspeed_servicer import SERVICE_NAME as TOKENSPEED_SERVICE
from mmgate.refengine.tokenspeed_servicer import (
    TokenSpeedEncoderServicer,
    TokenSpeedServicer,
)

logger = logging.getLogger("mmgate.refengine")

#: pixel tensors travel inline; gRPC's 4 MiB default is far too small
MAX_MESSAGE_BYTES = 1 << 30
#: HTTP/2 ping policy: accept a gateway's keepalive pings (``mmgate serve --engine-keepalive-*``, SMG's 30 s),
#: idle or in a long silent stream, as smg-grpc-servicer 0.14.1's TokenSpeed server does (``tokenspeed/server.py``
#: ``_grpc_server_options``; with ``max_ping_strikes`` 0 even a faster pinger is never sent away).  grpc core's
#: server defaults (5 min between pings without data, 2 strikes) would answer a pinging gateway with GOAWAY
#: ``too_many_pings`` during a long silent stream.  Spelling: core's RECV interval argument is
#: ``grpc.http2.min_ping_interval_without_data_ms``; ``grpc.http2.min_recv_ping_interval_without_data_ms`` is
#: silently ignored (docs/engines.md, "Liveness").
PING_POLICY = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10000),
    ("grpc.http2.max_ping_strikes", 0),
]
#: the engine service each wire serves (and names as the health service's readiness service)
ENGINE_SERVICES = {Wire.VLLM: VLLM_SERVICE, Wire.SGLANG: SGLANG_SERVICE, Wire.TOKENSPEED: TOKENSPEED_SERVICE}


@dataclass(frozen=True, slots=True)
class RunningEngine:
    """A started engine: the server, the port it is bound to, its core and wire servicer."""

    server: grpc.Server
    port: int
    servicer: Any  # the wire's servicer (RefEngineServicer, SglangServicer, TokenSpeedServicer)
    core: EngineCore

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def bootstrap_port(self) -> int:
        """The handoff listener's port (prefill and encode roles; 0 otherwise)."""
        return self.core.bootstrap_port

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving, cancel in-flight generations, and wait until the server is down."""
        self.servicer.shutdown()
        self.server.stop(grace).wait()


def _register(config: EngineConfig, core: EngineCore, server: grpc.Server) -> Any:
    """Add the wire's services for the role; the wire servicer."""
    if config.wire is Wire.VLLM:
        servicer: Any = RefEngineServicer(config, core)
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(servicer, server)
    elif config.wire is Wire.SGLANG:
        servicer = SglangServicer(config, core)
        sglang_scheduler_pb2_grpc.add_SglangSchedulerServicer_to_server(servicer, server)
    else:
        servicer = TokenSpeedServicer(config, core)
        tokenspeed_scheduler_pb2_grpc.add_TokenSpeedSchedulerServicer_to_server(servicer, server)
        if config.role is Role.ENCODE:
            tokenspeed_encoder_pb2_grpc.add_TokenSpeedEncoderServicer_to_server(TokenSpeedEncoderServicer(core), server)
    health = HealthService(ENGINE_SERVICES[config.wire], lambda: core.shutting_down)
    server.add_generic_rpc_handlers((health.handler(),))
    return servicer


def start_engine(config: EngineConfig) -> RunningEngine:
    """Load the model, bind ``config.host:config.port`` (0 = a free port), and start serving.

    Raises:
        OSError / ValueError: the bundle cannot be loaded (or the bootstrap port bound).
        RuntimeError: the address cannot be bound.
    """
    torch.set_num_threads(config.num_threads)
    loaded = load_model(config)
    core = EngineCore(config, loaded, device_normalizer(config, loaded))
    # Generate streams take at most config.rpc_workers threads (the core refuses more), so
    # MANAGEMENT_THREADS stay free for HealthCheck and the info RPCs while the engine is busy.
    server = grpc.server(
        ThreadPoolExecutor(max_workers=config.rpc_workers + MANAGEMENT_THREADS, thread_name_prefix="refengine-rpc"),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            *PING_POLICY,
        ],
    )
    servicer = _register(config, core, server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        core.shutdown()
        raise RuntimeError(f"cannot bind {config.host}:{config.port}")
    server.start()
    facts = loaded.facts
    weights = f"random shrunken weights (seed {config.seed})" if facts.random_weights else "real weights"
    handoff = f", handoff on {config.host}:{core.bootstrap_port}" if core.bootstrap_port else ""
    logger.info(
        "refengine: model %s (%s, %s) with %s, %s wire, %s role, serving on %s:%d%s",
        facts.model_path,
        facts.model_type,
        ",".join(facts.architectures) or "?",
        weights,
        config.wire.value,
        config.role.value,
        config.host,
        port,
        handoff,
    )
    return RunningEngine(server=server, port=port, servicer=servicer, core=core)


def serve(config: EngineConfig) -> grpc.Server:
    """Start the engine and return its (started, non-blocking) server.

    Use :func:`start_engine` to also learn the bound port when ``config.port`` is 0.
    """
    return start_engine(config).server


def main(argv: list[str] | None = None) -> int:
    """``mmgate engine --model DIR [--wire W] [--role R] [--host H] [--port N] ...``: serve until SIGINT/SIGTERM.

    Returns:
        0 after a clean stop; 1 when the model cannot be loaded or the port bound.
    """
    config = parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = start_engine(config)
    except (OSError, ValueError, RuntimeError) as exc:
        logger.error("refengine: cannot start: %s", exc)
        return 1

    def stop(signum: int, frame: object) -> None:
        logger.info("refengine: signal %d, stopping", signum)
        engine.servicer.shutdown()
        engine.server.stop(1.0)

    signal.signal(signal.SIGTERM, stop)
    try:
        engine.server.wait_for_termination()
    except KeyboardInterrupt:
        engine.stop()
    return 0
