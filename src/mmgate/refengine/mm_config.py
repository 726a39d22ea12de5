"""The reference engine's worker-side media-processing flags.

Stage: engine start-up.  In: parsed flags and the environment; out: a frozen
:class:`MmProcessorConfig` carried in :class:`~mmgate.refengine.config.EngineConfig`.

``--mm-processor off|inprocess|redis`` (flag first, then
``$SMG_VLLM_MM_PROCESSOR``, else ``off``; an unreadable value stops start-up)
says whether the engine takes ``GenerateRequest.media_refs`` and who
processes them: the engine itself, or a Redis sidecar (``mmgate sidecar``)
started with the same processing flags (:mod:`mmgate.sidecar.config`).
Where the mode came from (``flag``, ``env``, ``default``) is advertised in the
``mm_processor_source`` label.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from mmgate.config.options import add_option
from mmgate.sidecar.config import ProcessingConfig, add_processing_arguments, processing_config
from mmgate.sidecar.protocol import DEFAULT_REDIS_URL, ENV_REDIS_URL

ENV_PROCESSOR = "SMG_VLLM_MM_PROCESSOR"
ENV_NAMESPACE = "SMG_VLLM_MM_SIDECAR_NAMESPACE"


class MmProcessorMode(StrEnum):
    OFF = "off"  # media_refs are refused (multimodal_not_supported)
    INPROCESS = "inprocess"  # mmgate's pipeline in the engine process
    REDIS = "redis"  # jobs to a Redis media sidecar


@dataclass(frozen=True, slots=True)
class MmProcessorConfig:
    mode: MmProcessorMode = MmProcessorMode.OFF
    source: str = "default"  # flag | env | default
    processing: ProcessingConfig = field(default_factory=ProcessingConfig)
    redis_url: str = DEFAULT_REDIS_URL
    namespace: str | None = None  # None: derived from the processing fingerprint (as the sidecar derives it)
    sidecar_timeout_ms: int = 30_000  # longest wait for a sidecar result (the request's deadline may cut it)
    sidecar_max_queue: int = 256  # jobs queued at or above this: 503 overloaded


def add_mm_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's worker-side media-processing options (one group) and the shared processing groups."""
    g = parser.add_argument_group("worker-side media processor")
    add_option(g, "--mm-processor", env_doc=(ENV_PROCESSOR,), metavar="MODE",
               help="off | inprocess | redis: who processes media references (default off; "
                    "the source is advertised as mm_processor_source)")
    add_option(g, "--mm-redis-url", default=DEFAULT_REDIS_URL, env=(ENV_REDIS_URL,), metavar="URL",
               help="Redis of the media sidecar (--mm-processor redis)")
    add_option(g, "--mm-sidecar-namespace", env=(ENV_NAMESPACE,), metavar="NS",
               help="sidecar key namespace (default: derived from the processing fingerprint)")
    add_option(g, "--mm-sidecar-timeout-ms", type=int, default=30_000, minimum=1,
               help="longest wait for a sidecar result, milliseconds")
    add_option(g, "--mm-sidecar-max-queue", type=int, default=256, minimum=1,
               help="sidecar jobs queued at or above this: 503 overloaded")
    add_processing_arguments(parser)


def mm_config(ns: argparse.Namespace, parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> MmProcessorConfig:
    """Resolve the flags (``parser.error`` on an unreadable value)."""
    raw, source = ns.mm_processor, "flag"
    if raw is None and environ.get(ENV_PROCESSOR, "").strip():
        raw, source = environ[ENV_PROCESSOR], "env"
    if raw is None:
        raw, source = MmProcessorMode.OFF.value, "default"
    try:
        mode = MmProcessorMode(raw.strip().lower())
    except ValueError:
        parser.error(f"--mm-processor / {ENV_PROCESSOR}={raw!r} is not one of off, inprocess, redis")
    if ns.mm_sidecar_timeout_ms < 1 or ns.mm_sidecar_max_queue < 1:
        parser.error("--mm-sidecar-timeout-ms and --mm-sidecar-max-queue must be positive")
    return MmProcessorConfig(
        mode=mode, source=source, processing=processing_config(ns, parser, environ),
        redis_url=ns.mm_redis_url or environ.get(ENV_REDIS_URL) or DEFAULT_REDIS_URL,
        namespace=ns.mm_sidecar_namespace or environ.get(ENV_NAMESPACE) or None,
        sidecar_timeout_ms=ns.mm_sidecar_timeout_ms, sidecar_max_queue=ns.mm_sidecar_max_queue,
    )
