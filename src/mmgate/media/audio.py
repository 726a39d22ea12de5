"""Audio decode: encoded bytes -> float32 mono samples at the feature extractor's rate.

Stage: decode.  In: the fetched bytes of one ``input_audio`` / ``audio_url`` part, the
target rate (the family's feature extractor's ``sampling_rate``) and limits; out: a
:class:`DecodedAudio`.

Follows vLLM's audio loader, the path a vLLM worker takes for the same bytes
(docs/parity.md "Audio" says why this one and not transformers' ``load_audio``):

* decode -- vLLM ``vllm/multimodal/media/audio.py`` ``load_audio_pyav`` (``AudioMediaIO.load_bytes``):
  PyAV, the first audio stream (``container.streams.audio[0]``), its native rate
  (``stream.rate``), every frame through ``av.AudioResampler(format="fltp", rate=native)``
  (a sample-format conversion to planar float32, no rate change), the chunks concatenated to
  ``[channels, n]`` and averaged to mono with ``np.mean(axis=0)`` (float32);
* resample -- vLLM ``vllm/multimodal/audio.py`` ``AudioResampler(method="librosa")`` (the
  default), i.e. ``librosa.resample(y, orig_sr, target_sr)`` with librosa's default
  ``res_type="soxr_hq"``: ``soxr.resample(y, orig, target, quality="soxr_hq")`` then
  ``librosa.util.fix_length`` to ``ceil(n * target / orig)`` samples (zero-padded or cut);
  nothing when the rates are equal.  librosa is not a dependency: the two calls are made
  here with the same library (``soxr``), so the result is the same array.

transformers 5.24 ``audio_utils.load_audio`` resamples the same way on its ``soundfile``
backend (``_load_audio_soundfile``: downmix by mean, ``soxr_hq``, pad/cut to the same
``ceil``), but decodes with libsndfile, which cannot read m4a/aac/webm; with torchcodec
installed it decodes and resamples inside FFmpeg instead.  The measured residuals are in
docs/parity.md "Audio".

Beyond the reference: demuxers limited to ``ALLOWED_DEMUXERS`` and no nested protocol opens
(as media/video.py); the byte cap before opening; the duration cap checked on the header and
again while decoding (a stream that lies about its length stops at the cap, never decoded
to the end); a wall-clock deadline between packets; a stream whose channel count or rate changes
mid-stream refused (vLLM's loader fails on a channel change, and concatenates a rate change unnoticed).
"""

from __future__ import annotations

import io
import math
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.hashing import content_hash
from mmgate.types import DecodedAudio

#: demuxer names accepted (FFmpeg ``format_whitelist``): wav, flac, mp3, ogg (vorbis/opus),
#: mov/mp4/m4a (aac), matroska/webm (opus/vorbis), raw ADTS aac, aiff, w64
ALLOWED_DEMUXERS = "wav,w64,flac,mp3,ogg,mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,aac,aiff"
#: ``probesize``/``analyzeduration``: FFmpeg's stream probing reads and decodes up to 5 s of the input before the
#: first frame (20-60 ms for an in-memory WAV); every audio demuxer above states rate, channels and codec in its
#: header, so 2 KiB and no analysis give the same streams and the same decoded samples (tests/audio/test_decode.py
#: compares both settings on every container/codec, rate and channel count generated there)
_CONTAINER_OPTIONS = {"format_whitelist": ALLOWED_DEMUXERS, "protocol_whitelist": "none",
                      "probesize": "2048", "analyzeduration": "0"}
#: librosa.resample's default ``res_type`` (librosa >= 0.10), which vLLM's AudioResampler uses
RESAMPLE_QUALITY = "soxr_hq"


def resampled_length(num_samples: int, source_rate: float, target_rate: float) -> int:
    """Samples after resampling: librosa.resample's ``int(np.ceil(n * (target / orig)))``
    (``fix_length`` target); ``num_samples`` when the rates are equal."""
    if source_rate == target_rate:
        return num_samples
    return int(np.ceil(num_samples * (float(target_rate) / float(source_rate))))


def resample(samples: npt.NDArray[np.float32], source_rate: float, target_rate: float) -> npt.NDArray[np.float32]:
    """``librosa.resample(samples, orig_sr=source_rate, target_sr=target_rate)`` (res_type
    ``soxr_hq``): soxr, then zero-pad or cut to :func:`resampled_length`; float32 in and out."""
    if source_rate == target_rate:
        return samples
    import soxr

    out = soxr.resample(samples, float(source_rate), float(target_rate), quality=RESAMPLE_QUALITY)
    n = resampled_length(len(samples), source_rate, target_rate)
    if len(out) < n:
        out = np.pad(out, (0, n - len(out)))
    return np.ascontiguousarray(out[:n], dtype=np.float32)


def _failed(why: str) -> GatewayError:
    return GatewayError(ErrorCode.AUDIO_DECODE_FAILED, f"audio could not be decoded ({why})")


class _Deadline:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.at = time.monotonic() + timeout_s

    def check(self) -> None:
        if time.monotonic() > self.at:
            raise GatewayError(ErrorCode.AUDIO_DECODE_TIMEOUT, f"audio decoding exceeded the limit of {self.timeout_s:g} s")


def _too_long(seconds: float, cap: float) -> GatewayError:
    return GatewayError(ErrorCode.AUDIO_TOO_LONG, f"audio is longer than the limit of {cap:g} s ({seconds:.1f} s)")


def _header_seconds(container: Any, stream: Any) -> float | None:
    """Duration the header declares (stream, else container), None when it declares none."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return float(container.duration) / 1_000_000  # AV_TIME_BASE
    return None


def _decode_planar(container: Any, stream: Any, max_samples: int, max_duration_s: float,
                   deadline: _Deadline) -> npt.NDArray[np.float32]:
    """All frames as float32 planar ``[channels, n]`` (vLLM ``load_audio_pyav``), at most ``max_samples``.

    The resampler's frames are gathered in an ``av.AudioFifo`` and read out once: the same samples as
    vLLM's per-frame ``to_ndarray`` + ``np.concatenate`` (an mp3 frame is 1152 samples, so a 30 s clip
    is ~1150 arrays there): a 30 s mp3 decodes in ~17 % less time (docs/performance.md "Audio preprocessing").
    A stream whose channel count, rate or sample format changes mid-stream (an ADTS file of a stereo part
    then a mono one decodes so) is refused, as vLLM's ``np.concatenate`` refuses it: the resampler passes
    such frames through unchanged once its first frame needed no conversion, and the fifo checks neither
    the channel count nor copes with it (a mono frame into a stereo fifo reads a missing plane).

    Raises:
        GatewayError: ``audio_decode_failed`` (a corrupt or changing stream), ``audio_too_long``,
            ``audio_empty``, ``audio_decode_timeout``.
    """
    import av

    rate = int(stream.rate)
    resampler = av.AudioResampler(format="fltp", rate=rate)
    fifo = av.AudioFifo()
    kinds: set[tuple[int, int, str]] = set()  # (channels, rate, format) of the frames written: one allowed

    def take(out: Any) -> None:
        kinds.add((out.layout.nb_channels, out.sample_rate, out.format.name))
        if len(kinds) > 1:
            raise _failed("the channel count, rate or sample format changes mid-stream")
        out.pts = None  # the fifo checks timestamps for gaps; the samples are what vLLM keeps
        fifo.write(out)

    try:
        for frame in container.decode(stream):
            deadline.check()
            for out in resampler.resample(frame):
                take(out)
            if fifo.samples > max_samples:
                raise _too_long(fifo.samples / rate, max_duration_s)
        for out in resampler.resample(None):
            take(out)
    except av.FFmpegError as exc:
        raise _failed(type(exc).__name__) from None
    except ValueError:  # a frame the resampler or the fifo refuses (its setup does not match)
        raise _failed("a frame that does not match the stream's format") from None
    total = fifo.samples
    if total > max_samples:
        raise _too_long(total / rate, max_duration_s)
    everything = fifo.read() if total else None  # None: nothing was written
    del fifo  # its buffer (up to twice the clip) goes before the array is made
    if everything is None:
        raise GatewayError(ErrorCode.AUDIO_EMPTY, "audio stream holds no samples")
    return everything.to_ndarray().astype(np.float32, copy=False)


def decode_audio(data: bytes, target_rate: int, *, max_input_bytes: int, max_duration_s: float,
                 timeout_s: float, demuxers: str | None = None) -> DecodedAudio:
    """Decode, downmix to mono and resample to ``target_rate`` as vLLM's loader does (module docstring).

    Args:
        data: the encoded clip (wav, flac, mp3, ogg/opus, m4a/aac, webm, ...).
        target_rate: the feature extractor's ``sampling_rate`` (Hz).
        max_input_bytes: the byte cap (``--audio-max-input-bytes``), checked before opening.
        max_duration_s: the duration cap, on the header and on the decoded samples.
        timeout_s: wall-clock limit of decoding this clip.
        demuxers: the track of a video container: these demuxers (the video decoder's) and FFmpeg's default
            stream probing (a muxed file, e.g. MPEG-TS, may announce its audio stream only after 2 KiB); None:
            an audio file (``ALLOWED_DEMUXERS``, the short probe).

    Returns:
        The clip; ``samples`` float32 ``[resampled_length(n, source_rate, target_rate)]``.

    Raises:
        GatewayError(MEDIA_TOO_LARGE): over ``max_input_bytes`` (413).
        GatewayError(AUDIO_DECODE_TIMEOUT): decoding ran past ``timeout_s`` (413).
        GatewayError(AUDIO_DECODE_FAILED): not a supported container, or a corrupt stream.
        GatewayError(AUDIO_NO_STREAM): a container without an audio stream.
        GatewayError(AUDIO_EMPTY): an audio stream that decodes to no samples.
        GatewayError(AUDIO_TOO_LONG): longer than ``max_duration_s``.
        GatewayError(MULTIMODAL_NOT_SUPPORTED): PyAV or soxr not installed.
    """
    if len(data) > max_input_bytes:
        raise GatewayError(ErrorCode.MEDIA_TOO_LARGE,
                           f"audio is larger than the limit of {max_input_bytes} bytes ({len(data)} bytes)")
    if not data:
        raise _failed("empty payload")
    try:
        import av
        import soxr  # noqa: F401
    except (ImportError, OSError):
        raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED, "audio input needs PyAV and soxr") from None
    deadline = _Deadline(timeout_s)
    try:
        options = dict(_CONTAINER_OPTIONS) if demuxers is None else {"format_whitelist": demuxers,
                                                                      "protocol_whitelist": "none"}
        container = av.open(io.BytesIO(data), mode="r", container_options=options)
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise _failed(f"not a supported container: {type(exc).__name__}") from None
    try:
        if not container.streams.audio:
            raise GatewayError(ErrorCode.AUDIO_NO_STREAM, "the file holds no audio stream")
        stream = container.streams.audio[0]
        rate = int(stream.rate or 0)
        if rate <= 0:
            raise _failed("no sample rate")
        declared = _header_seconds(container, stream)
        if declared is not None and declared > max_duration_s + 1.0:  # a second of slack for header rounding
            raise _too_long(declared, max_duration_s)
        planar = _decode_planar(container, stream, math.floor(max_duration_s * rate), max_duration_s, deadline)
    finally:
        container.close()
    channels, n = int(planar.shape[0]), int(planar.shape[1])
    mono = planar.mean(axis=0) if channels > 1 else planar[0]  # vLLM: audio.mean(axis=0) when ndim > 1
    mono = np.ascontiguousarray(mono, dtype=np.float32)
    deadline.check()
    samples = resample(mono, rate, target_rate)
    return DecodedAudio(samples=samples, sampling_rate=int(target_rate), source_rate=rate, source_channels=channels,
                        content_hash=content_hash(data), num_bytes=len(data))
