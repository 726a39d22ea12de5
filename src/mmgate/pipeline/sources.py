"""Media sources: one per modality, fetch -> decode -> sample, each distinct item once.

Stage: fetch+decode (the pipeline's ``fetch_decode`` stage).  In: a modality's media references in prompt
order and that modality's processor (:class:`~mmgate.models.family.MediaProcessor`); out: one decoded item
per reference (the same object for references that decode alike), ready for the processor's ``plan``.

A source is the only modality-specific piece of the pipeline's loop (:mod:`mmgate.pipeline.prepare`):

* :meth:`MediaSource.load` fetches each distinct URL once (:class:`~mmgate.media.fetch.MediaFetcher`, the
  modality's byte cap) and decodes each distinct (URL, decode hints) once in the thread pool, with the
  modality's decoder (:mod:`mmgate.media.image`, :mod:`mmgate.media.video`, ``mmgate.media.audio``);
* :meth:`MediaSource.plan` calls the processor's ``plan`` with what it takes (an image's size, a clip, a
  waveform): an :class:`~mmgate.types.ItemPlan`, the one plan type of every modality (its ``detail`` is
  the processor's own and no generic code reads it); :meth:`MediaSource.batch_context` first, where the
  reference processes a request's items of the modality as one batch (audio padded to the longest clip);
* :meth:`MediaSource.fingerprint` is the processor's fingerprint as it applies to one decoded item (a
  clip turned upright hashes apart from the same clip as stored).

Everything else (the content-hash cache, deferral, the anchor check, item limits, expansion) is generic.
How to add a modality: docs/architecture.md, "The modality seam".
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol, cast

from mmgate.config.settings import AudioSettings, Settings
from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.fetch import MediaFetcher
from mmgate.media.image import decode_image
from mmgate.media.video import ALLOWED_DEMUXERS as VIDEO_DEMUXERS
from mmgate.media.video import PixelAllowance, decode_video, planned_clip, upright_turns
from mmgate.models.family import (
    AudioProcessor,
    AudioTrackVideo,
    BatchPlanner,
    ImageProcessor,
    MediaProcessor,
    VideoProcessor,
)
from mmgate.observe import timing_log
from mmgate.transport.limits import element_bytes, payload_too_large
from mmgate.types import (
    DecodedAudio,
    DecodedImage,
    DecodedVideo,
    ItemHints,
    ItemPlan,
    MediaRef,
    Modality,
    VideoDetail,
    VideoMeta,
)

#: ``decode(data, target_rate, limits) -> DecodedAudio``: mono float32 at ``target_rate`` Hz
AudioDecoder = Callable[[bytes, int, Any], DecodedAudio]


@dataclass(frozen=True, slots=True)
class SourceContext:
    """What every source reads: the fetcher, the decode pool and the settings (limits)."""

    fetcher: MediaFetcher
    executor: Executor
    settings: Settings


class MediaSource(Protocol):
    """Fetch -> decode -> sample for one modality (see the module docstring)."""

    modality: Modality

    async def load(self, ctx: SourceContext, proc: MediaProcessor, refs: Sequence[MediaRef],
                   limit: int | None = None) -> list[Any]:
        """One decoded item per ref, in order; each distinct URL fetched once, each distinct decode once.
        ``limit``: encoder-tensor bytes the request may plan (a source that can plan from a header before
        decoding checks it there; None: not checked).

        Raises:
            GatewayError: a fetch or decode refusal, ``param`` naming the ref's content part.
        """
        ...

    def batch_context(self, proc: MediaProcessor, items: Sequence[Any], settings: Settings) -> Hashable | None:
        """What the request's decoded items of this modality pass to each item's plan when the reference
        processes them as one batch (:class:`~mmgate.models.family.BatchPlanner`, where the settings keep it
        on); None: each item is planned alone."""
        ...

    def plan(self, proc: MediaProcessor, item: Any, hints: ItemHints,
             context: Hashable | None = None) -> ItemPlan[Hashable]:
        """The processor's plan of one decoded item (what its ``preprocess`` and ``expand`` take), in the batch
        ``context`` describes (:meth:`batch_context`; None: alone)."""
        ...

    def fingerprint(self, proc: MediaProcessor, item: Any, settings: Settings) -> str:
        """``proc.fingerprint`` as it applies to ``item`` (the cache and hash key's processor part; the pipeline
        appends what a batch-planned item owes to its batch, :meth:`BatchPlanner.batch_fingerprint`)."""
        ...


async def gather_or_cancel(tasks: Sequence[asyncio.Future[Any]]) -> list[Any]:
    """``asyncio.gather`` that cancels (and waits for) the others when one fails."""
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _named(exc: GatewayError, ref: MediaRef) -> GatewayError:
    return GatewayError(exc.code, exc.message, ref.param)


async def _load_each(ctx: SourceContext, refs: Sequence[MediaRef], max_bytes: int,
                     decode_key: Callable[[MediaRef], Hashable],
                     decode: Callable[[bytes, MediaRef], Any], on_fail: Callable[[], None] | None = None,
                     decoded: Callable[[bytes, Any, float], None] | None = None) -> list[Any]:
    """Each distinct URL fetched once, each distinct ``decode_key`` decoded once in the pool (``decode(data,
    ref)``), concurrently; one result per ref.  ``on_fail``: called when any of it fails or is cancelled
    (stops decoders that poll a flag).  ``decoded(data, item, seconds)``: called on the event loop after each
    decode (the request's timing context lives there, not in the pool)."""
    loop = asyncio.get_running_loop()
    payloads: dict[str, asyncio.Future[bytes]] = {}
    tasks: dict[Hashable, asyncio.Future[Any]] = {}

    async def one(ref: MediaRef) -> Any:
        data = await payloads[ref.url]
        started = time.perf_counter()
        try:
            item = await loop.run_in_executor(ctx.executor, decode, data, ref)
        except GatewayError as exc:
            raise _named(exc, ref) from None
        if decoded is not None:
            decoded(data, item, time.perf_counter() - started)
        return item

    for ref in refs:
        if ref.url not in payloads:
            payloads[ref.url] = asyncio.ensure_future(ctx.fetcher.fetch(ref.url, max_bytes, ref.param))
        key = decode_key(ref)
        if key not in tasks:
            tasks[key] = asyncio.ensure_future(one(ref))
    try:
        await gather_or_cancel([*payloads.values(), *tasks.values()])
    except BaseException:
        if on_fail is not None:
            on_fail()
        raise
    return [tasks[decode_key(ref)].result() for ref in refs]


class ImageSource:
    """Images: :func:`mmgate.media.image.decode_image` (Pillow), keyed by URL."""

    modality = Modality.IMAGE

    async def load(self, ctx: SourceContext, proc: MediaProcessor, refs: Sequence[MediaRef],
                   limit: int | None = None) -> list[DecodedImage]:
        fs = ctx.settings.fetch

        def decode(data: bytes, ref: MediaRef) -> DecodedImage:
            return decode_image(data, fs.max_image_pixels, fs.image_apply_exif_orientation)

        return await _load_each(ctx, refs, fs.image_max_bytes, lambda r: r.url, decode)

    def batch_context(self, proc: MediaProcessor, items: Sequence[Any], settings: Settings) -> None:
        return None

    def plan(self, proc: MediaProcessor, item: DecodedImage, hints: ItemHints, context: Hashable | None = None
             ) -> ItemPlan:
        assert isinstance(proc, ImageProcessor)
        return proc.plan(item.height, item.width, hints)

    def fingerprint(self, proc: MediaProcessor, item: DecodedImage, settings: Settings) -> str:
        return proc.fingerprint


class VideoSource:
    """Clips: sampled from the header by the processor (:meth:`VideoProcessor.sample`), checked against the
    request's decoded-pixel allowance and, from the header, against the encoder-tensor limit, then decoded
    by :func:`mmgate.media.video.decode_video`; keyed by (URL, fps hint).  When the request fails or is
    cancelled the decoding threads stop at their next frame."""

    modality = Modality.VIDEO

    async def load(self, ctx: SourceContext, proc: MediaProcessor, refs: Sequence[MediaRef],
                   limit: int | None = None) -> list[DecodedVideo]:
        assert isinstance(proc, VideoProcessor)
        fs, vs = ctx.settings.fetch, ctx.settings.video
        allowance = PixelAllowance(vs.max_decoded_pixels)
        stop = threading.Event()
        planned: dict[tuple[str, float | None], int] = {}  # header-planned bytes per distinct clip
        planned_lock = threading.Lock()
        itemsize = element_bytes(ctx.settings.transport, raw=False)

        def sampler(ref: MediaRef) -> Callable[[VideoMeta], list[int]]:
            def sample(meta: VideoMeta) -> list[int]:
                indices = proc.sample(meta, ref.hints)
                if limit is not None:
                    item = proc.plan(planned_clip(meta, indices), ref.hints)
                    with planned_lock:
                        planned[(ref.url, ref.hints.fps)] = item.primary_values * itemsize
                        total = sum(planned.values())
                    if total > limit:
                        raise payload_too_large(total, limit, ref.param)
                return indices
            return sample

        def decode(data: bytes, ref: MediaRef) -> DecodedVideo:
            clip = decode_video(data, sampler(ref), allowance, vs.decode_timeout_s, stop,
                                apply_rotation=vs.apply_rotation)
            return _with_audio_track(clip, data, proc, ref.hints, ctx.settings)

        def logged(data: bytes, clip: DecodedVideo, seconds: float) -> None:
            timing_log.video_decoded(len(data), len(clip.frame_indices), clip.height, clip.width, clip.rotation,
                                     seconds)

        def key(ref: MediaRef) -> Hashable:
            return ref.url, ref.hints.fps, _track_rate(proc, ref.hints)

        return await _load_each(ctx, refs, fs.video_max_bytes, key, decode, stop.set, logged)

    def batch_context(self, proc: MediaProcessor, items: Sequence[Any], settings: Settings) -> None:
        return None

    def plan(self, proc: MediaProcessor, item: DecodedVideo, hints: ItemHints, context: Hashable | None = None
             ) -> ItemPlan[VideoDetail]:
        assert isinstance(proc, VideoProcessor)
        return proc.plan(item, hints)

    def fingerprint(self, proc: MediaProcessor, item: DecodedVideo, settings: Settings) -> str:
        """A clip turned upright hashes apart from the same clip in its stored orientation
        (``--no-video-apply-rotation``)."""
        turned = settings.video.apply_rotation and upright_turns(item.rotation)
        return f"{proc.fingerprint}:upright" if turned else proc.fingerprint


def _track_rate(proc: MediaProcessor, hints: ItemHints) -> int | None:
    """The rate a clip's audio track is wanted at (:class:`~mmgate.models.family.AudioTrackVideo`), else None."""
    return proc.audio_track_rate(hints) if isinstance(proc, AudioTrackVideo) else None


def _with_audio_track(clip: DecodedVideo, data: bytes, proc: MediaProcessor, hints: ItemHints,
                      settings: Settings) -> DecodedVideo:
    """``clip`` with its audio track when its processor wants it, decoded as an audio part is
    (:func:`mmgate.media.audio.decode_audio`: downmix, resampling, the duration cap and the decode timeout of
    ``--audio-*``), from the clip's own bytes with the video decoder's demuxers; a container without an audio
    stream gives a clip without one, as the reference skips a silent video's track (transformers 5.24
    ``OmniModalProcessorMixin._resolve_audio_from_video``).

    Raises:
        GatewayError: the audio decoder's refusals other than AUDIO_NO_STREAM (e.g. an over-long track).
    """
    rate = _track_rate(proc, hints)
    if rate is None:
        return clip
    try:
        from mmgate.media.audio import decode_audio
    except ImportError:
        raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED,
                           "a clip's audio track needs the audio decoder (mmgate.media.audio, PyAV)") from None
    limits = settings.audio
    try:
        audio = decode_audio(data, rate, max_input_bytes=len(data), max_duration_s=limits.max_duration_s,
                             timeout_s=limits.decode_timeout_s, demuxers=VIDEO_DEMUXERS)
    except GatewayError as exc:
        if exc.code is ErrorCode.AUDIO_NO_STREAM:
            return clip
        raise
    return dataclasses.replace(clip, audio=audio)


def default_audio_decoder() -> AudioDecoder:
    """``mmgate.media.audio.decode_audio`` (PyAV decode -> mono float32 at the processor's rate), imported
    when the first audio item arrives.

    Raises:
        GatewayError(MULTIMODAL_NOT_SUPPORTED): the decoder is not available in this install.
    """
    try:
        from mmgate.media.audio import decode_audio
    except ImportError:
        raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED,
                           "audio input needs the audio decoder (mmgate.media.audio, PyAV)") from None

    def decode(data: bytes, target_rate: int, limits: AudioSettings) -> DecodedAudio:
        # the byte cap (--audio-max-input-bytes) was applied while fetching: no second cap here
        return decode_audio(data, target_rate, max_input_bytes=len(data), max_duration_s=limits.max_duration_s,
                            timeout_s=limits.decode_timeout_s)

    return decode


class AudioSource:
    """Audio clips: decoded, downmixed to mono and resampled to the processor's
    :attr:`~mmgate.models.family.AudioProcessor.sampling_rate` by the audio decoder, keyed by URL.

    ``decoder``: ``decode(data, target_rate, limits)`` with ``limits`` the
    :class:`~mmgate.config.settings.AudioSettings` (duration cap, decode timeout); None:
    :func:`default_audio_decoder`."""

    modality = Modality.AUDIO

    def __init__(self, decoder: AudioDecoder | None = None) -> None:
        self._decoder = decoder

    async def load(self, ctx: SourceContext, proc: MediaProcessor, refs: Sequence[MediaRef],
                   limit: int | None = None) -> list[DecodedAudio]:
        decoder = self._decoder or default_audio_decoder()
        limits = ctx.settings.audio
        rate = cast(AudioProcessor, proc).sampling_rate  # only the rate is read here

        def decode(data: bytes, ref: MediaRef) -> DecodedAudio:
            return decoder(data, rate, limits)

        return await _load_each(ctx, refs, ctx.settings.fetch.audio_max_bytes, lambda r: r.url, decode)

    def batch_context(self, proc: MediaProcessor, items: Sequence[Any], settings: Settings) -> int | None:
        """The batch length of a :class:`~mmgate.models.family.BatchPlanner` (``--audio-batch-padding``, the
        default); None without one or with ``--no-audio-batch-padding``."""
        if settings.audio.batch_padding and isinstance(proc, BatchPlanner):
            return proc.batch_context(items)
        return None

    def plan(self, proc: MediaProcessor, item: DecodedAudio, hints: ItemHints, context: Hashable | None = None
             ) -> ItemPlan:
        assert isinstance(proc, AudioProcessor)
        if context is None:
            return proc.plan(item, hints)
        assert isinstance(proc, BatchPlanner) and isinstance(context, int)
        return proc.plan_in_batch(item, hints, context)

    def fingerprint(self, proc: MediaProcessor, item: DecodedAudio, settings: Settings) -> str:
        return proc.fingerprint


#: the one source of each modality
SOURCES: Mapping[Modality, MediaSource] = {
    Modality.IMAGE: ImageSource(), Modality.VIDEO: VideoSource(), Modality.AUDIO: AudioSource(),
}

__all__ = ["SOURCES", "AudioDecoder", "AudioSource", "ImageSource", "MediaSource", "SourceContext", "VideoSource",
           "default_audio_decoder", "gather_or_cancel"]
