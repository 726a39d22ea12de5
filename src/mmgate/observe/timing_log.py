"""``--log-mm-timing``: one parseable INFO line per media request, plus video-decode and transport events.

Stage: observability, beside every stage.  In: the stage timings a request collected
(:func:`mmgate.observe.metrics.stage`, ``PreparedRequest.timings_ms``) and the events the pipeline and the
engine adapter report while the request runs; out: lines on the ``mmgate.timing`` logger.

Line format (as SMG's tracing output of the same events, smg-project/smg#2625, SMG
``docs/reference/logging.md`` "Multimodal Timing Logs"): the message ``smg_mm_timing``, the event
name, then ``key=value`` pairs separated by single spaces; a value holding a space, ``"`` or ``=``
is JSON-quoted.  Times are milliseconds with three decimals.  Events:

``process_multimodal_plan``
    exactly one per media request that reached its engine, written when the engine first answered:
    ``request_id model mode transport image_count video_count audio_count video_frame_count
    media_fetch_decode_ms preprocess_ms token_expand_ms total_ms original_tokens expanded_tokens``
    (SMG's keys) plus ``plan_ms render_ms assemble_ms engine_first_response_ms``.  ``total_ms`` is
    the gateway's wall clock from the parsed request until the request was handed to the engine,
    so the stage times sum to at most ``total_ms``.  In worker mode the worker fetches, preprocesses
    and expands: those three are 0 and ``expanded_tokens`` is the engine's ``prompt_tokens``.
``video_decode_backend``
    one per distinct clip decoded: ``request_id backend ok input_bytes frames width height rotation
    elapsed_ms`` (``elapsed_ms`` includes the wait for a pool thread).
``mm_tensor_payload_inline`` / ``mm_shm_write``
    one per encoder tensor sent: ``request_id runtime name path nbytes`` (SMG's event names).

A text-only request writes nothing.  The events reach this module through a context variable set
by :func:`request_scope` (tasks and ``contextvars.copy_context().run`` carry it into the pool), so
the pipeline and the adapter need no extra parameters; outside a scope every hook is a no-op.
The logger's level is INFO whatever ``--log-level`` says: the flag itself asks for the lines.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

log = logging.getLogger("mmgate.timing")
log.setLevel(logging.INFO)

#: the first word of every line (SMG's)
TAG = "smg_mm_timing"
REQUEST_EVENT = "process_multimodal_plan"
VIDEO_EVENT = "video_decode_backend"
INLINE_EVENT = "mm_tensor_payload_inline"
SHM_EVENT = "mm_shm_write"


def format_value(value: object) -> str:
    """One value as written in a line: floats with 3 decimals, booleans lower-case, strings bare unless
    they hold a space, ``"``, ``=`` or nothing (then JSON-quoted)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.3f}"
    text = str(value)
    if not text or any(c in text for c in ' "=\n\t'):
        return json.dumps(text)
    return text


def format_line(event: str, fields: Mapping[str, object]) -> str:
    """``smg_mm_timing <event> k=v k=v ...`` in the order of ``fields``."""
    return " ".join([TAG, event, *(f"{k}={format_value(v)}" for k, v in fields.items())])


@dataclass(slots=True)
class RequestTiming:
    """What one request's events accumulate while it runs (inside :func:`request_scope`)."""

    request_id: str
    model: str
    started: float = field(default_factory=time.perf_counter)  # perf_counter seconds at the parsed request
    video_frames: int = 0  # frames decoded, summed over the distinct clips
    paths: set[str] = field(default_factory=set)  # transport paths the tensors took

    def emit(self, event: str, fields: Mapping[str, object]) -> None:
        log.info("%s", format_line(event, {"request_id": self.request_id, **fields}))


_current: ContextVar[RequestTiming | None] = ContextVar("mmgate_timing", default=None)


@contextmanager
def request_scope(enabled: bool, request_id: str, model: str) -> Iterator[RequestTiming | None]:
    """Collect the events of the enclosed request when ``enabled`` (``--log-mm-timing``); yields the
    record (None when disabled)."""
    if not enabled:
        yield None
        return
    record = RequestTiming(request_id=request_id, model=model)
    token = _current.set(record)
    try:
        yield record
    finally:
        _current.reset(token)


def video_decoded(input_bytes: int, frames: int, height: int, width: int, rotation: int, elapsed_s: float) -> None:
    """Event of one decoded clip (PyAV), counted into the request's ``video_frame_count``."""
    record = _current.get()
    if record is None:
        return
    record.video_frames += frames
    record.emit(VIDEO_EVENT, {"backend": "pyav", "ok": True, "input_bytes": input_bytes, "frames": frames,
                              "width": width, "height": height, "rotation": rotation,
                              "elapsed_ms": elapsed_s * 1000.0})


def tensor_sent(runtime: str, name: str, path: str, nbytes: int) -> None:
    """Event of one encoder tensor placed for the engine (``path``: inline or shm)."""
    record = _current.get()
    if record is None:
        return
    record.paths.add(path)
    record.emit(SHM_EVENT if path == "shm" else INLINE_EVENT,
                {"runtime": runtime, "name": name, "path": path, "nbytes": nbytes})


@dataclass(frozen=True, slots=True)
class MediaCounts:
    """Items of each modality in a request."""

    images: int = 0
    videos: int = 0
    audios: int = 0

    @property
    def total(self) -> int:
        return self.images + self.videos + self.audios


def request_done(record: RequestTiming | None, *, mode: str, counts: MediaCounts, timings: Mapping[str, float],
                 original_tokens: int, expanded_tokens: int, handed_over: float) -> None:
    """Write the request's ``process_multimodal_plan`` line (nothing for a text-only request or outside a scope).

    ``timings``: the request's stage milliseconds; ``handed_over``: ``time.perf_counter()`` when the
    request went to the engine (the end of ``total_ms``).
    """
    if record is None or counts.total == 0:
        return
    record.emit(REQUEST_EVENT, {
        "model": record.model, "mode": mode, "transport": ",".join(sorted(record.paths)) or "none",
        "image_count": counts.images, "video_count": counts.videos, "audio_count": counts.audios,
        "video_frame_count": record.video_frames,
        "media_fetch_decode_ms": timings.get("fetch_decode", 0.0), "preprocess_ms": timings.get("preprocess", 0.0),
        "token_expand_ms": timings.get("expand", 0.0), "total_ms": (handed_over - record.started) * 1000.0,
        "original_tokens": original_tokens, "expanded_tokens": expanded_tokens,
        "plan_ms": timings.get("plan", 0.0), "render_ms": timings.get("render", 0.0),
        "assemble_ms": timings.get("assemble", 0.0),
        "engine_first_response_ms": timings.get("engine_first_response", 0.0),
    })
