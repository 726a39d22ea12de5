"""The gateway's state: everything a running gateway holds, built once from :class:`~mmgate.config.settings.Settings`.

Stage: start-up.  In: the parsed settings; out: a :class:`GatewayState` (the served models, each with its
runtime, pipeline and view of the workers; the worker registry, the media fetcher, the preprocessing pool,
the pixel cache and the in-flight budget they share).  Below ``api/`` (every endpoint reads it) and above
``routing/`` and the pipeline, which it builds; the dispatch layer reads one served model through
:class:`mmgate.routing.context.DispatchContext`, which :class:`ServedModel` satisfies.

Models (issue 25):
* ``--model`` given: that one model, loaded at start-up from ``--model`` / ``--model-path``; every worker
  serves it (as before).
* no ``--model``: each worker's model is the one its GetModelInfo reports (``served_model_name``, else
  ``model_path``), found after its first passing probe (:meth:`GatewayState.admit`).  Its bundle comes from
  ``--model-path`` when a folder there holds it, else from the worker itself (the bundle source, by
  default :func:`worker_bundles`: its ``GetTokenizer`` archive, checked and cached by SHA-256); the
  tokenizer, template and family are loaded once per model, so two workers of one model share one
  runtime.  A worker whose bundle or model cannot be had is ``failed`` with the reason (``GET /workers``),
  takes no traffic, and is tried again after a backoff (:mod:`mmgate.routing.workers`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from mmgate.chat.tokenizer import load_tokenizer
from mmgate.config.settings import Settings, default_bundle_cache_dir
from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.fetch import MediaFetcher
from mmgate.models.backend import ImageBackend
from mmgate.models.bundle import ModelBundle, load_bundle, resolve_bundle
from mmgate.models.geometry import resolve_backend
from mmgate.models.registry import load_family
from mmgate.pipeline import memory
from mmgate.pipeline.budget import InflightBudget
from mmgate.pipeline.cache import PixelCache
from mmgate.pipeline.prepare import Pipeline
from mmgate.pipeline.runtime import ModelRuntime
from mmgate.routing.bundles import BundleError, fetch_worker_bundle
from mmgate.routing.workers import Worker, WorkerRegistry, WorkerStatus
from mmgate.transport.shm import sweep_dead_segments

log = logging.getLogger("mmgate.api")

#: where a worker's bundle comes from when ``--model-path`` does not hold it: ``source(worker)`` -> a bundle
#: folder (a file cache the source owns).  Raises on a bundle that cannot be had; its message is the
#: ``reason`` ``GET /workers`` shows, so it must not echo archive bytes.
BundleSource = Callable[[Worker], Awaitable[Path]]


def worker_bundles(settings: Settings) -> BundleSource:
    """The default bundle source: the worker's own bundle, fetched with ``GetTokenizer``, checked and kept in
    ``--worker-bundle-cache-dir`` under its SHA-256 within the ``--worker-bundle-*`` bounds
    (:func:`mmgate.routing.bundles.fetch_worker_bundle`; the Rust gateway takes the processor configuration
    from the tokenizer bundle its gRPC worker serves, smg 1.13).

    The source raises GatewayError(MODEL_NOT_FOUND) with the :class:`~mmgate.routing.bundles.BundleError`'s
    short reason when the bundle cannot be had (the RPC failed, or the archive broke a rule).
    """
    cache_dir = settings.bundle_cache_dir or default_bundle_cache_dir(os.environ)

    async def fetch(worker: Worker) -> Path:
        if worker.client is None:  # admitted only after a probe, which creates the client
            raise GatewayError(ErrorCode.MODEL_NOT_FOUND, "the worker has not been reached yet")
        try:
            return await fetch_worker_bundle(worker.client, cache_dir, settings.bundle_limits)
        except BundleError as exc:
            raise GatewayError(ErrorCode.MODEL_NOT_FOUND,
                               f"the worker's bundle (GetTokenizer) cannot be had: {exc.reason}") from None

    return fetch


@dataclass(slots=True)
class ServedModel:
    """One served model: its runtime, pipeline and workers, with the shared budget and pool
    (satisfies :class:`mmgate.routing.context.DispatchContext`)."""

    settings: Settings
    runtime: ModelRuntime
    pipeline: Pipeline
    workers: WorkerRegistry  # the registry's view of this model's serving workers
    budget: InflightBudget
    executor: ThreadPoolExecutor

    @property
    def name(self) -> str:
        """The id clients send and ``/v1/models`` lists."""
        return self.runtime.served_name


def load_runtime(bundle: ModelBundle, settings: Settings, served_name: str) -> ModelRuntime:
    """The tokenizer and family of ``bundle`` (CPU work: seconds for a large tokenizer).

    Raises:
        GatewayError(MODEL_NOT_FOUND): no usable tokenizer, or a media model no family serves.
    """
    tokenizer = load_tokenizer(bundle)
    family = load_family(bundle, tokenizer, resolve_backend(settings.image_backend),
                         ImageBackend.TORCHVISION,  # video: torchvision-only reference
                         video_sampling=settings.video.frame_sampling)
    return ModelRuntime(bundle=bundle, tokenizer=tokenizer, family=family, served_name=served_name)


@dataclass(eq=False)
class GatewayState:
    """Everything a running gateway holds.

    ``models``: served name -> :class:`ServedModel`, in the order they were loaded.  ``default``: the
    ``--model`` one (None without ``--model``); ``runtime`` and ``pipeline`` are its own.  ``bundles``:
    the :data:`BundleSource` of workers' bundles.
    """

    settings: Settings
    workers: WorkerRegistry
    fetcher: MediaFetcher
    executor: ThreadPoolExecutor
    budget: InflightBudget
    cache: PixelCache | None
    started: float
    bundles: BundleSource
    models: dict[str, ServedModel] = field(default_factory=dict)
    default: ServedModel | None = None
    parallelism: int = 1
    _loading: dict[str, asyncio.Task[ServedModel]] = field(default_factory=dict)

    @property
    def runtime(self) -> ModelRuntime:
        """The ``--model`` model's runtime.

        Raises:
            RuntimeError: no ``--model`` (each model has its own: :meth:`model_for`).
        """
        return self._default().runtime

    @property
    def pipeline(self) -> Pipeline:
        """The ``--model`` model's pipeline (raises as :attr:`runtime`)."""
        return self._default().pipeline

    def _default(self) -> ServedModel:
        if self.default is None:
            raise RuntimeError("no --model: each model has its own runtime (GatewayState.model_for)")
        return self.default

    def serve(self, runtime: ModelRuntime, model: str | None) -> ServedModel:
        """Add ``runtime`` as a served model whose workers are those of ``model`` (None: every worker)."""
        served = ServedModel(settings=self.settings, runtime=runtime,
                             pipeline=Pipeline(runtime, self.settings, self.fetcher, self.executor, self.cache,
                                               parallelism=self.parallelism),
                             workers=self.workers.view(model), budget=self.budget, executor=self.executor)
        self.models[runtime.served_name] = served
        return served

    def model_for(self, name: str) -> ServedModel:
        """The served model a request's ``model`` names (its served name, bundle name or bundle folder).

        Raises:
            GatewayError(MODEL_NOT_FOUND): no served model has that name (404; the name is not quoted).
            GatewayError(NO_HEALTHY_WORKER): not served yet, while some worker has not reported its model or
                its model is loading (retryable 503).
        """
        served = self.models.get(name)
        if served is None:
            served = next((m for m in self.models.values() if m.runtime.accepts(name)), None)
        if served is not None:
            return served
        if self.default is None and any(w.status in (WorkerStatus.PENDING, WorkerStatus.LOADING)
                                        for w in self.workers.workers):
            raise GatewayError(ErrorCode.NO_HEALTHY_WORKER, "the requested model is not served yet: some worker "
                               "has not reported its model (see GET /workers)", "model")
        raise GatewayError(ErrorCode.MODEL_NOT_FOUND, "the requested model is not served here (see GET /v1/models)",
                           "model")

    async def admit(self, worker: Worker) -> None:
        """Find ``worker``'s model and load it once (see the module docstring); the worker ends ``ready``, or
        ``failed`` with the reason.  Never raises."""
        name = worker.reported_model()
        worker.model = name
        if not name:
            worker.status, worker.reason = WorkerStatus.FAILED, "the worker reports no model name or path"
            return
        if name in self.models:
            worker.status, worker.reason = WorkerStatus.READY, ""
            return
        task = self._loading.get(name)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load(worker, name))
            self._loading[name] = task
        try:
            await asyncio.shield(task)
        except GatewayError as exc:
            worker.status, worker.reason = WorkerStatus.FAILED, exc.message
        except Exception as exc:  # a bundle source's own error: its message is the reason
            worker.status, worker.reason = WorkerStatus.FAILED, f"{type(exc).__name__}: {exc}"[:500]
        else:
            worker.status, worker.reason = WorkerStatus.READY, ""
        finally:
            if self._loading.get(name) is task and task.done():
                del self._loading[name]  # failed: the next worker of this model tries its own bundle
        if worker.status is WorkerStatus.FAILED:
            log.warning("worker %s takes no traffic: model %s: %s", worker.url, name, worker.reason)

    async def _load(self, worker: Worker, name: str) -> ServedModel:
        """Bundle (``--model-path``, else the worker's) -> runtime -> served model ``name``."""
        folder = _on_search_path(name, self.settings)
        if folder is None:
            folder = await self.bundles(worker)
            where = "the worker"
        else:
            where = "the model search path"
        loop = asyncio.get_running_loop()
        runtime = await loop.run_in_executor(
            None, lambda: load_runtime(load_bundle(folder, name=name), self.settings, name))
        log.info("serving %s (model_type %s) from %s's bundle", name, runtime.bundle.model_type, where)
        return self.serve(runtime, name)


def _on_search_path(name: str, settings: Settings) -> Path | None:
    """The folder of bundle ``name`` on ``--model-path`` (``org--name`` or ``org/name``), else None."""
    if not settings.model_search_path or Path(name).is_absolute():
        return None
    try:
        return resolve_bundle(name, settings.model_search_path, allow_hub=False).path
    except GatewayError:
        return None


def build_state(settings: Settings, bundles: BundleSource | None = None) -> GatewayState:
    """Build the shared parts; with ``--model``, load its bundle, tokenizer and family now.

    ``bundles``: where workers' bundles come from without ``--model`` when ``--model-path`` does not hold
    them (:data:`BundleSource`); None: from the workers themselves (:func:`worker_bundles`).

    Raises:
        GatewayError(MODEL_NOT_FOUND): ``--model`` cannot be found or has no usable tokenizer.
    """
    threads = settings.preprocess_threads or (os.cpu_count() or 2)
    executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mmgate-pre")
    budget = InflightBudget(settings.transport.max_inflight_bytes, settings.transport.budget_wait_s,
                            memory.configure(settings.malloc_mmap_threshold, settings.memory_trim_min_bytes,
                                             settings.malloc_trim_threshold, settings.malloc_arena_max))
    cache = PixelCache(settings.transport.pixel_cache_bytes) if settings.transport.pixel_cache_bytes else None
    runtime = None
    if settings.model is not None:
        bundle = resolve_bundle(settings.model, settings.model_search_path)
        runtime = load_runtime(bundle, settings, settings.served_model_name or bundle.name)
    state = GatewayState(settings=settings, workers=WorkerRegistry.from_settings(settings),
                         fetcher=MediaFetcher(settings.fetch), executor=executor, budget=budget, cache=cache,
                         started=time.time(), bundles=bundles or worker_bundles(settings), parallelism=threads)
    if runtime is not None:
        state.default = state.serve(runtime, None)
        log.info("serving %s (model_type %s, image backend %s)", runtime.served_name, runtime.bundle.model_type,
                 resolve_backend(settings.image_backend).value)
    else:
        state.workers.admit = state.admit
        for worker in state.workers.workers:
            worker.status = WorkerStatus.PENDING  # ready once admitted
        log.info("no --model: each worker's model from its GetModelInfo, its bundle from --model-path or the worker")
    swept = sweep_dead_segments()
    if swept:
        log.info("removed %d shared-memory segments left by dead processes", swept)
    memory.release_startup_garbage()
    return state
