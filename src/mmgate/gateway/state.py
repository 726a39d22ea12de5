"""The gateway's state: everything a running gateway holds, built once from :class:`~mmgate.config.settings.Settings`.

Stage: start-up.  In: the parsed settings; out: a :class:`GatewayState` (the served model's runtime, the
pipeline, the worker registry, the media fetcher, the preprocessing pool, the in-flight budget).  Below
``api/`` (every endpoint reads it) and above ``routing/`` and the pipeline, which it builds; the dispatch
layer reads it through :class:`mmgate.routing.context.DispatchContext`.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from mmgate.pipeline import memory
from mmgate.pipeline.budget import InflightBudget
from mmgate.pipeline.cache import PixelCache
from mmgate.chat.tokenizer import load_tokenizer
from mmgate.media.fetch import MediaFetcher
from mmgate.models.bundle import resolve_bundle
from mmgate.models.geometry import resolve_backend
from mmgate.models.registry import load_family
from mmgate.pipeline.prepare import Pipeline
from mmgate.routing.workers import WorkerRegistry
from mmgate.pipeline.runtime import ModelRuntime
from mmgate.config.settings import Settings
from mmgate.models.backend import ImageBackend
from mmgate.transport.shm import sweep_dead_segments

log = logging.getLogger("mmgate.api")


@dataclass(slots=True)
class GatewayState:
    """Everything a running gateway holds."""

    settings: Settings
    runtime: ModelRuntime
    pipeline: Pipeline
    workers: WorkerRegistry
    fetcher: MediaFetcher
    executor: ThreadPoolExecutor
    budget: InflightBudget
    started: float


def build_state(settings: Settings) -> GatewayState:
    """Load the model bundle, tokenizer and family; build fetcher, pool and worker registry.

    Raises:
        GatewayError(MODEL_NOT_FOUND): the model cannot be found or has no usable tokenizer.
    """
    bundle = resolve_bundle(settings.model, settings.model_search_path)
    tokenizer = load_tokenizer(bundle)
    backend = resolve_backend(settings.image_backend)
    family = load_family(bundle, tokenizer, backend, ImageBackend.TORCHVISION,  # video: torchvision-only reference
                         video_sampling=settings.video.frame_sampling)
    runtime = ModelRuntime(bundle=bundle, tokenizer=tokenizer, family=family,
                           served_name=settings.served_model_name or bundle.name)
    threads = settings.preprocess_threads or (os.cpu_count() or 2)
    executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mmgate-pre")
    fetcher = MediaFetcher(settings.fetch)
    cache = PixelCache(settings.transport.pixel_cache_bytes) if settings.transport.pixel_cache_bytes else None
    swept = sweep_dead_segments()
    if swept:
        log.info("removed %d shared-memory segments left by dead processes", swept)
    log.info("serving %s (model_type %s, image backend %s)", runtime.served_name, bundle.model_type, backend.value)
    memory.release_startup_garbage()
    return GatewayState(settings=settings, runtime=runtime,
                        pipeline=Pipeline(runtime, settings, fetcher, executor, cache, parallelism=threads),
                        workers=WorkerRegistry.from_settings(settings), fetcher=fetcher, executor=executor,
                        budget=InflightBudget(settings.transport.max_inflight_bytes, settings.transport.budget_wait_s,
                                              memory.configure(settings.malloc_mmap_threshold,
                                                               settings.memory_trim_min_bytes,
                                                               settings.malloc_trim_threshold,
                                                               settings.malloc_arena_max)),
                        started=time.time())
