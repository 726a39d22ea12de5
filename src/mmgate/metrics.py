"""Prometheus metrics and the one stage-timing helper.

``stage(name, timings)`` times a pipeline stage once and feeds both the
per-request timing record (``PreparedRequest.timings_ms``, printed by the
quick start and logged) and the ``mmgate_stage_seconds`` histogram.
Metric names follow SMG's where one exists (``smg_mm_*``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

REQUESTS = Counter("mmgate_requests_total", "Chat requests received", ["model", "stream"], registry=REGISTRY)
ERRORS = Counter("mmgate_errors_total", "Requests failed, by stable error code", ["code"], registry=REGISTRY)
STAGE_SECONDS = Histogram(
    "mmgate_stage_seconds", "Latency of each pipeline stage", ["stage"], registry=REGISTRY,
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
MM_ITEMS = Counter("mmgate_mm_items_total", "Media items preprocessed", ["modality"], registry=REGISTRY)
MM_TENSOR_BYTES = Counter("smg_mm_tensor_bytes_total", "Encoder tensor bytes sent to engines",
                          ["engine", "path"], registry=REGISTRY)
MM_TENSORS = Counter("smg_mm_tensors_total", "Encoder tensors sent to engines", ["engine", "path"], registry=REGISTRY)
PROMPT_TOKENS = Counter("mmgate_prompt_tokens_total", "Expanded prompt tokens sent", registry=REGISTRY)
COMPLETION_TOKENS = Counter("mmgate_completion_tokens_total", "Completion tokens received", registry=REGISTRY)
CLIENT_DISCONNECTS = Counter("mmgate_client_disconnects_total",
                             "Requests cancelled because their client disconnected before the answer", registry=REGISTRY)
ACTIVE_REQUESTS = Gauge("mmgate_active_requests", "Requests in flight", registry=REGISTRY)
WORKER_HEALTHY = Gauge("mmgate_worker_healthy", "1 when the worker's last health check passed", ["worker"],
                       registry=REGISTRY)


@contextmanager
def stage(name: str, timings: MutableMapping[str, float]) -> Iterator[None]:
    """Time the enclosed block as stage ``name``; adds milliseconds to ``timings[name]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - start
        timings[name] = timings.get(name, 0.0) + elapsed * 1000.0
        STAGE_SECONDS.labels(name).observe(elapsed)

# Issue 3: transport, budget and cache.
SHM_WRITE_FAILURES = Counter("smg_mm_shm_write_failures_total",
                             "Tensors that fell back to inline because the shared-memory write failed",
                             ["engine"], registry=REGISTRY)
BUDGET_REJECTIONS = Counter("smg_mm_inflight_budget_rejections_total", "Requests refused by the in-flight budget",
                            ["code"], registry=REGISTRY)
BUDGET_IN_USE = Gauge("smg_mm_inflight_bytes", "Preprocessed bytes held for engines", registry=REGISTRY)
CACHE_HITS = Counter("smg_mm_pixel_cache_hits_total", "Pixel-cache hits", ["modality"], registry=REGISTRY)
CACHE_MISSES = Counter("smg_mm_pixel_cache_misses_total", "Pixel-cache misses", ["modality"], registry=REGISTRY)
CACHE_BYTES = Gauge("smg_mm_pixel_cache_bytes", "Bytes held by the pixel cache", registry=REGISTRY)

# Issue 5: where media is processed.
MM_PROCESSING = Counter("smg_mm_processing_total", "Media requests by where their media is processed, and why",
                        ["model", "mode", "reason"], registry=REGISTRY)
