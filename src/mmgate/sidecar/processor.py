"""Worker-side media processing: prompt ids with anchors + media references -> expanded ids + tensors.

Stage: fetch+decode -> preprocess -> expand, on a worker (the reference
engine's ``--mm-processor inprocess``) or in the Redis sidecar.  In: the
unexpanded prompt ids (one anchor per item) and :class:`~mmgate.types.MediaRef`
items in prompt order; out: a :class:`ProcessedPrompt`.

It runs the gateway's own :meth:`mmgate.pipeline.prepare.Pipeline.process_media`
(same fetcher, decoder, family plan/preprocess/expand, content hashes), under
this process's own :class:`~mmgate.sidecar.config.ProcessingConfig` (allow-list,
byte caps, timeouts).  Same settings in, bit-identical tensors out.

Failures are :class:`~mmgate.errors.GatewayError` with ``param =
"media_refs[i]"`` for the item at fault: the caller's mistakes 4xx, transient
faults (fetch timeout, refused connection, origin 5xx) retryable 503.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mmgate.chat.tokenizer import load_tokenizer
from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.fetch import ALLOWED_SCHEMES, MediaFetcher, check_scheme
from mmgate.models.bundle import resolve_bundle
from mmgate.models.geometry import resolve_backend
from mmgate.models.registry import load_family
from mmgate.pipeline.prepare import Pipeline
from mmgate.pipeline.runtime import ModelRuntime
from mmgate.pipeline.planning import RequestPlan
from mmgate.config.settings import Settings
from mmgate.sidecar.config import ProcessingConfig
from mmgate.sidecar.protocol import SCHEMA_VERSION
from mmgate.types import EncoderBatch, MediaRef, Modality

log = logging.getLogger("mmgate.sidecar")


@dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    """The result of worker-side processing."""

    input_ids: tuple[int, ...]  # expanded: every anchor replaced by its placeholder run
    batches: tuple[EncoderBatch, ...]  # one per modality, placeholders set, prompt order
    timings_ms: dict[str, float] = field(default_factory=dict)


def item_param(index: int) -> str:
    """How an item is named in errors: its index in ``GenerateRequest.media_refs``."""
    return f"media_refs[{index}]"


def item_index(param: str | None) -> int | None:
    """The item index of :func:`item_param`, or None."""
    if param and param.startswith("media_refs[") and param.endswith("]") and param[11:-1].isdigit():
        return int(param[11:-1])
    return None


def processing_fingerprint(runtime: ModelRuntime, config: ProcessingConfig) -> tuple[str, dict[str, Any]]:
    """sha256 over the model's own files and every setting that changes what processing yields or accepts.

    Returns (hex digest, the description it was computed from).  Timeouts and
    thread counts are left out: they change when a request fails, not what a
    successful one produces.
    """
    bundle, family = runtime.bundle, runtime.family
    clips = family.processors.get(Modality.VIDEO) if family is not None else None
    video = clips.fingerprint if clips is not None else ""
    files = {"config": bundle.config, "preprocessor_config": bundle.preprocessor_config,
             "video_preprocessor_config": bundle.video_preprocessor_config,
             "processor_config": bundle.processor_config}
    model_files = hashlib.sha256(json.dumps(files, sort_keys=True, default=str).encode()).hexdigest()
    fetch = {k: v for k, v in asdict(config.fetch).items() if not k.endswith("_timeout_s")}
    description: dict[str, Any] = {
        "schema": SCHEMA_VERSION, "model_type": bundle.model_type, "model_files": model_files,
        "family": family.fingerprint if family is not None else "",
        "video": video,
        "fetch": fetch, "item_limits": dict(sorted(config.item_limits.items())),
        "video_decode": {"max_decoded_pixels": config.video.max_decoded_pixels,
                         "apply_rotation": config.video.apply_rotation,
                         "frame_sampling": config.video.frame_sampling.value},
    }
    digest = hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()).hexdigest()
    return digest, description


def load_runtime(model: str | Path, search_path: Sequence[Path], config: ProcessingConfig) -> ModelRuntime:
    """Bundle, tokenizer and family of ``model`` (no weights).

    Raises:
        GatewayError(MODEL_NOT_FOUND): no such bundle, or a media model no family serves
            (:func:`mmgate.models.registry.check_servable`: the message names its ``model_type``
            and the registered families).
    """
    bundle = resolve_bundle(str(model), tuple(search_path))
    tokenizer = load_tokenizer(bundle)
    family = load_family(bundle, tokenizer, resolve_backend(config.image_backend),
                         video_sampling=config.video.frame_sampling)
    return ModelRuntime(bundle=bundle, tokenizer=tokenizer, family=family, served_name=bundle.name)


class MediaProcessor:
    """Processes forwarded media for one model (see the module docstring).

    ``process`` must run on one event loop for the processor's life (the
    fetcher's connection pool is bound to it).
    """

    def __init__(self, runtime: ModelRuntime, config: ProcessingConfig) -> None:
        self.runtime = runtime
        self.config = config
        self.fingerprint, self.description = processing_fingerprint(runtime, config)
        self.schemes: tuple[str, ...] = tuple(sorted(ALLOWED_SCHEMES))
        self._settings = Settings(model=str(runtime.bundle.path), image_backend=config.image_backend,
                                  item_limits=dict(config.item_limits), fetch=config.fetch, video=config.video,
                                  audio=config.audio)
        self._executor = ThreadPoolExecutor(max_workers=config.threads, thread_name_prefix="mmgate-mm")
        self._pipeline: Pipeline | None = None

    @property
    def schemes_label(self) -> str:
        """The ``mm_media_ref_schemes`` label value, e.g. ``data,http,https``."""
        return ",".join(self.schemes)

    def validate(self, refs: Sequence[MediaRef], schemes: Sequence[str] | None = None) -> None:
        """Cheap refusals before any fetch: modality, per-request item limit, URL scheme.

        Raises:
            GatewayError: MULTIMODAL_NOT_SUPPORTED, MM_ITEM_LIMIT_EXCEEDED,
                UNSUPPORTED_MEDIA_URL_SCHEME, INVALID_MEDIA_URL (``param`` names the item).
        """
        family = self.runtime.family
        counts: dict[Modality, int] = {}
        for ref in refs:
            if family is None or ref.modality not in family.limits:
                raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED,
                                   f"this worker does not process {ref.modality.value} input", ref.param)
            counts[ref.modality] = counts.get(ref.modality, 0) + 1
        for modality, count in counts.items():
            assert family is not None
            limit = self.config.item_limits.get(modality.value, family.limits[modality])
            if count > limit:
                raise GatewayError(ErrorCode.MM_ITEM_LIMIT_EXCEEDED,
                                   f"{count} {modality.value} items exceed this worker's limit of {limit}")
        accepted = set(schemes if schemes is not None else self.schemes)
        for ref in refs:
            scheme = check_scheme(ref.url, ref.param)
            if scheme not in accepted:
                raise GatewayError(ErrorCode.UNSUPPORTED_MEDIA_URL_SCHEME,
                                   f"media URL scheme {scheme!r} is not fetched here", ref.param)

    async def process(self, prompt_ids: Sequence[int], refs: Sequence[MediaRef]) -> ProcessedPrompt:
        """Fetch, decode, preprocess and expand (the gateway's own stages).

        Raises:
            GatewayError: see the module docstring.
        """
        self.validate(refs)
        if self._pipeline is None:
            fetcher = MediaFetcher(self.config.fetch)
            self._pipeline = Pipeline(self.runtime, self._settings, fetcher, self._executor)
        timings: dict[str, float] = {}
        plan = RequestPlan(template_messages=[], media=tuple(refs))
        ids, batches, _ = await self._pipeline.process_media(list(prompt_ids), plan, timings)
        return ProcessedPrompt(input_ids=tuple(ids), batches=batches, timings_ms=timings)

    async def aclose(self) -> None:
        if self._pipeline is not None:
            await self._pipeline.fetcher.aclose()
        self._executor.shutdown(wait=False, cancel_futures=True)


def refs_from_items(items: Sequence[tuple[str, str]]) -> list[MediaRef]:
    """``(modality, url)`` pairs in prompt order -> :class:`MediaRef` items named ``media_refs[i]``.

    Raises:
        ValueError: an unknown modality name.
    """
    return [MediaRef(modality=Modality(m), url=u, part_index=i, param=item_param(i)) for i, (m, u) in enumerate(items)]

