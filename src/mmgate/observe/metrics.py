"""Prometheus metrics and the one stage-timing helper.

``stage(name, timings)`` times a pipeline stage once and feeds both the
per-request timing record (``PreparedRequest.timings_ms``, printed by the
quick start and written by ``--log-mm-timing``, :mod:`mmgate.observe.timing_log`) and the
``mmgate_stage_seconds`` histogram.

Naming policy (docs/metrics.md lists every metric): a metric the Rust gateway (SMG) also
exports keeps SMG's name, labels and meaning (``smg_mm_tensors_total{runtime,path}``,
``smg_mm_tensor_bytes_total{runtime,path}``, ``smg_mm_shm_write_failures_total{runtime}``,
``smg_mm_processing_total{model,mode,reason}``, ``smg_admission_queue_rejected_total{reason}``;
SMG ``model_gateway/src/observability/metrics.rs`` ``init_metrics``/``record_mm_tensor``), so
dashboards built for SMG work unchanged; every other metric is ``mmgate_*``.  Durations are
seconds, sizes bytes; counters end in ``_total``.  Every metric about one model's requests (requests,
tokens, stages, media items, pixel cache, in-flight budget; issue 25) carries ``model``, the served name;
on the admission counter it is added to SMG's ``reason``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

#: the label ``model`` of every metric about one model's requests: the served name (``/v1/models``' id), never
#: what the client sent, so a client cannot create series
REQUESTS = Counter("mmgate_requests_total", "Chat requests received", ["model", "stream"], registry=REGISTRY)
ERRORS = Counter("mmgate_errors_total", "Requests failed, by stable error code", ["code"], registry=REGISTRY)
STAGE_SECONDS = Histogram(
    "mmgate_stage_seconds", "Latency of each pipeline stage, by model", ["model", "stage"], registry=REGISTRY,
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
MM_ITEMS = Counter("mmgate_mm_items_total", "Media items preprocessed", ["model", "modality"], registry=REGISTRY)
MM_TENSOR_BYTES = Counter("smg_mm_tensor_bytes_total", "Encoder tensor bytes sent to engines, by runtime and path",
                          ["runtime", "path"], registry=REGISTRY)
MM_TENSORS = Counter("smg_mm_tensors_total", "Encoder tensors sent to engines, by runtime (wire) and path (inline|shm)",
                     ["runtime", "path"], registry=REGISTRY)
PROMPT_TOKENS = Counter("mmgate_prompt_tokens_total", "Expanded prompt tokens sent", ["model"], registry=REGISTRY)
COMPLETION_TOKENS = Counter("mmgate_completion_tokens_total", "Completion tokens received", ["model"],
                            registry=REGISTRY)
CLIENT_DISCONNECTS = Counter("mmgate_client_disconnects_total",
                             "Requests cancelled because their client disconnected before the answer", registry=REGISTRY)
ACTIVE_REQUESTS = Gauge("mmgate_active_requests", "Requests in flight", registry=REGISTRY)

#: seconds; from 5 ms to 10 min (a long generation streamed to its end)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)
REQUEST_SECONDS = Histogram(
    "mmgate_request_duration_seconds",
    "Time from a request's arrival to the end of its response (a stream: its last byte), by route and status",
    ["endpoint", "status"], registry=REGISTRY, buckets=LATENCY_BUCKETS)
TTFT_SECONDS = Histogram(
    "mmgate_time_to_first_token_seconds",
    "Streamed requests: time from the parsed request to the engine's first response (the first token)",
    ["model"], registry=REGISTRY, buckets=LATENCY_BUCKETS)
WORKER_HEALTHY = Gauge("mmgate_worker_healthy", "1 when the worker's last health check passed", ["worker"],
                       registry=REGISTRY)
#: ``serve --workers N``: process slots taken out of rotation for crashing too often; the parent process writes
#: it (``mmgate.api.multiproc.publish_quarantined``), every process declares it (0), ``max`` over them is the count
SERVE_CHILDREN_QUARANTINED_NAME = "mmgate_serve_children_quarantined"
SERVE_CHILDREN_QUARANTINED_HELP = "serve --workers N: gateway processes taken out of rotation for crashing too often"
SERVE_CHILDREN_QUARANTINED = Gauge(SERVE_CHILDREN_QUARANTINED_NAME, SERVE_CHILDREN_QUARANTINED_HELP,
                                   registry=REGISTRY, multiprocess_mode="max")


@contextmanager
def stage(name: str, timings: MutableMapping[str, float], model: str) -> Iterator[None]:
    """Time the enclosed block as stage ``name`` of a request to ``model`` (the served name); adds milliseconds
    to ``timings[name]`` and observes ``mmgate_stage_seconds{model,stage}``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - start
        timings[name] = timings.get(name, 0.0) + elapsed * 1000.0
        STAGE_SECONDS.labels(model, name).observe(elapsed)


def tensor_sent(runtime: str, path: str, nbytes: int) -> None:
    """Count one encoder tensor of ``nbytes`` bytes sent to a ``runtime`` worker over ``path`` (inline|shm)."""
    MM_TENSORS.labels(runtime, path).inc()
    MM_TENSOR_BYTES.labels(runtime, path).inc(nbytes)

# Issue 3: transport, budget and cache.
SHM_WRITE_FAILURES = Counter("smg_mm_shm_write_failures_total",
                             "Tensors that fell back to inline because the shared-memory write failed",
                             ["runtime"], registry=REGISTRY)
#: SMG's admission refusals; mmgate records the two multimodal reasons of its in-flight budget, per model (a
#: label SMG's counter lacks: SMG's queries, which sum over labels, work unchanged)
BUDGET_REJECTIONS = Counter("smg_admission_queue_rejected_total",
                            "Requests refused at admission (multimodal_inflight: 429, multimodal_too_large: 413)",
                            ["model", "reason"], registry=REGISTRY)
BUDGET_IN_USE = Gauge("mmgate_mm_inflight_bytes", "Preprocessed bytes held for engines, by the model of the "
                      "requests holding them (the budget itself is shared)", ["model"], registry=REGISTRY)
CACHE_HITS = Counter("mmgate_mm_pixel_cache_hits_total", "Pixel-cache hits", ["model", "modality"],
                     registry=REGISTRY)
CACHE_MISSES = Counter("mmgate_mm_pixel_cache_misses_total", "Pixel-cache misses", ["model", "modality"],
                       registry=REGISTRY)
CACHE_BYTES = Gauge("mmgate_mm_pixel_cache_bytes", "Bytes held by the pixel cache", registry=REGISTRY)

#: ``smg_admission_queue_rejected_total`` reason of each budget refusal code (SMG's values)
BUDGET_REASONS = {"multimodal_inflight_budget": "multimodal_inflight",
                  "multimodal_payload_too_large": "multimodal_too_large"}


def budget_rejected(code: str, model: str) -> None:
    """Count one in-flight budget refusal of a request to ``model`` (``code``: the error code value) under
    SMG's reason."""
    BUDGET_REJECTIONS.labels(model, BUDGET_REASONS.get(code, code)).inc()

# Issue 5: where media is processed.
MM_PROCESSING = Counter("smg_mm_processing_total", "Media requests by where their media is processed, and why",
                        ["model", "mode", "reason"], registry=REGISTRY)


class RequestTimer:
    """ASGI middleware that observes ``mmgate_request_duration_seconds{endpoint,status}`` for every HTTP request.

    ``endpoint`` is the matched route's path template (``/v1/chat/completions``; ``other`` when no route
    matched, so a client cannot create series); ``status`` the response status (``499`` when the
    client left before one was sent, ``500`` when the app raised first).  The clock runs from the
    request's arrival until the app returns, i.e. until the last byte of a streamed body.
    Mirrors SMG's ``smg_http_request_duration_seconds{method,path}`` (``metrics.rs``
    ``record_http_duration``), with the status instead of the method.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = ""

        async def send_status(message: MutableMapping[str, Any]) -> None:
            nonlocal status
            if message.get("type") == "http.response.start":
                status = str(message.get("status", ""))
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except BaseException:
            status = status or "500"
            raise
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "other"
            REQUEST_SECONDS.labels(endpoint, status or "499").observe(time.perf_counter() - start)
