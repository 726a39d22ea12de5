"""Start the reference engine: load the bundle, bind, serve.

Stage: engine process entry.  In: an :class:`EngineConfig` (or ``argv`` for
``mmgate engine`` / ``python -m mmgate.refengine``); out: a started gRPC
server speaking ``vllm.grpc.engine.VllmEngine``.

One stderr line at start names the model, whether its weights are real or
random (shrunken, seeded), and the address.
"""

from __future__ import annotations

import logging
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from mmgate.refengine.bundle import load_model
from mmgate.refengine.config import EngineConfig, parse_args
from mmgate.refengine.servicer import MANAGEMENT_THREADS, RefEngineServicer

logger = logging.getLogger("mmgate.refengine")

#: pixel tensors travel inline; gRPC's 4 MiB default is far too small
MAX_MESSAGE_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class RunningEngine:
    """A started engine: the server, the port it is bound to, its servicer."""

    server: grpc.Server
    port: int
    servicer: RefEngineServicer

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving, cancel in-flight generations, and wait until the server is down."""
        self.servicer.shutdown()
        self.server.stop(grace).wait()


def start_engine(config: EngineConfig) -> RunningEngine:
    """Load the model, bind ``config.host:config.port`` (0 = a free port), and start serving.

    Raises:
        OSError / ValueError: the bundle cannot be loaded.
        RuntimeError: the address cannot be bound.
    """
    torch.set_num_threads(config.num_threads)
    loaded = load_model(config)
    servicer = RefEngineServicer(config, loaded)
    # Generate streams take at most config.rpc_workers threads (the servicer refuses more), so
    # MANAGEMENT_THREADS stay free for HealthCheck and the info RPCs while the engine is busy.
    server = grpc.server(
        ThreadPoolExecutor(max_workers=config.rpc_workers + MANAGEMENT_THREADS, thread_name_prefix="refengine-rpc"),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise RuntimeError(f"cannot bind {config.host}:{config.port}")
    server.start()
    facts = loaded.facts
    weights = f"random shrunken weights (seed {config.seed})" if facts.random_weights else "real weights"
    logger.info(
        "refengine: model %s (%s, %s) with %s, serving on %s:%d",
        facts.model_path,
        facts.model_type,
        ",".join(facts.architectures) or "?",
        weights,
        config.host,
        port,
    )
    return RunningEngine(server=server, port=port, servicer=servicer)


def serve(config: EngineConfig) -> grpc.Server:
    """Start the engine and return its (started, non-blocking) server.

    Use :func:`start_engine` to also learn the bound port when ``config.port`` is 0.
    """
    return start_engine(config).server


def main(argv: list[str] | None = None) -> int:
    """``mmgate engine --model DIR [--host H] [--port N] [--seed S] ...``: serve until SIGINT/SIGTERM.

    Returns:
        0 after a clean stop; 1 when the model cannot be loaded or the port bound.
    """
    config = parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
