"""Video decode: encoded bytes -> the sampled RGB frames, as the reference's pyav loader decodes them.

Stage: decode.  In: the fetched bytes of one ``video_url`` part, the family's
sampler (``VideoMeta -> frame indices``) and limits; out: a
:class:`~mmgate.types.DecodedVideo`.

Mirrors transformers 5.24 ``video_utils.read_video_pyav`` (what
``load_video(path, backend="pyav")`` runs): the first video stream, its header
frame count (``stream.frames``) and ``float(average_rate)``, ``seek(0)``, frames
decoded in order and converted with ``VideoFrame.to_ndarray(format="rgb24")``.
So the frames equal the reference's bit for bit (same FFmpeg, same swscale
call); only the sampled frames are converted and kept, straight into one
preallocated array, and of the others only what the kept ones need is decoded
(:func:`_decode_indices`: H.264/HEVC non-reference pictures and the tails of
IDR-closed GOPs are skipped; docs/video.md, "Decoding").  The angle of the
display matrix is recorded on the result.

Beyond the reference, by default: a clip whose display matrix rotates it by 90,
180 or 270 degrees comes out upright, as FFmpeg's ``autorotate`` (the ``ffmpeg``
CLI, fftools 5.1 ``ffmpeg_filter.c`` ``configure_input_video_filter``) and
OpenCV (``CAP_PROP_ORIENTATION_AUTO``, vLLM's default video loader) give it:
each kept frame is ``np.rot90(frame, k)`` with ``k = angle / 90`` (the angle
counter-clockwise, ``av_display_rotation_get``; exact, no resampling).  With
``apply_rotation=False`` (``--no-video-apply-rotation``) frames keep the stored
orientation of the reference's loader (docs/video.md, "Rotation").

Beyond the reference (docs/video.md, "Decoding"):
* demuxers are limited to ``ALLOWED_DEMUXERS`` and nested protocol opens are
  refused (no playlist/concat input reaching other files or hosts);
* a header without a frame count (Matroska/WebM) or a stream shorter than
  its header: the frames are counted by decoding, and the clip is sampled as a
  clip of that many frames (the reference's loader fails on both);
* frame decoding uses FFmpeg's frame+slice threading (bit-exact), its thread count
  shared among the clips decoding at once in the process;
* limits: a decoded-pixel allowance (sampled frames x height x width), checked
  from the header before decoding and again on the first frame, and a
  wall-clock deadline checked between frames, with the request's stop signal
  (a request that ends stops its decoding threads at the next frame).
"""

from __future__ import annotations

import io
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.hashing import content_hash
from mmgate.types import DecodedVideo, VideoMeta

#: demuxer names accepted (FFmpeg ``format_whitelist``)
ALLOWED_DEMUXERS = "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi,mpegts,mpeg,flv,ogg"
_CONTAINER_OPTIONS = {"format_whitelist": ALLOWED_DEMUXERS, "protocol_whitelist": "none"}
#: FFmpeg decoder threading: "AUTO" (frame + slice threads, bit-exact); PyAV's own default, which the
#: reference's loader uses, is "SLICE" (benchmarks/video.py measures both)
DECODE_THREAD_TYPE = "AUTO"


def av_available() -> bool:
    """Whether PyAV imports (video support needs it)."""
    try:
        import av  # noqa: F401
    except (ImportError, OSError):  # not installed, or a wheel whose FFmpeg libraries fail to load
        return False
    return True


class PixelAllowance:
    """Decoded pixels a request may still take (thread-safe; shared by its clips)."""

    def __init__(self, total: int) -> None:
        self.left = total
        self._lock = threading.Lock()

    def take(self, pixels: int) -> None:
        """Raises GatewayError(MEDIA_TOO_LARGE) when ``pixels`` exceed what is left."""
        with self._lock:
            if pixels > self.left:
                raise GatewayError(ErrorCode.MEDIA_TOO_LARGE,
                                   f"the request's videos decode to more than the limit of decoded pixels "
                                   f"({pixels} asked, {max(self.left, 0)} left)")
            self.left -= pixels

    def give_back(self, pixels: int) -> None:
        with self._lock:
            self.left += pixels


def _failed(why: str) -> GatewayError:
    return GatewayError(ErrorCode.MEDIA_DECODE_FAILED, f"video could not be decoded ({why})")


class _Deadline:
    """The wall-clock limit of one clip, and the request's stop signal, checked between frames."""

    def __init__(self, timeout_s: float, stop: threading.Event | None = None) -> None:
        self.timeout_s = timeout_s
        self.at = time.monotonic() + timeout_s
        self.stop = stop

    def check(self) -> None:
        if self.stop is not None and self.stop.is_set():
            raise GatewayError(ErrorCode.MEDIA_DECODE_FAILED, "video decoding stopped: the request ended")
        if time.monotonic() > self.at:
            raise GatewayError(ErrorCode.MEDIA_TOO_LARGE,
                               f"video decoding exceeded the limit of {self.timeout_s:g} s")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class _Decoding:
    """Clips decoding now in this process: each decoder gets ``cores // clips`` threads (FFmpeg's own
    count, one per core, for a clip alone).  Frame threads shorten one clip's decode but cost CPU
    (~10-15 %, docs/performance.md "Video"); with several clips at once the cores are busy anyway and
    a decoder per core wastes none.  Threading is bit-exact: the thread count changes no pixel."""

    def __init__(self) -> None:
        self.active = 0
        self._lock = threading.Lock()
        self.cores = _cores()

    @contextmanager
    def slot(self) -> Iterator[int]:
        """The decoder thread count for one more clip (0: FFmpeg's automatic count) while it decodes."""
        with self._lock:
            self.active += 1
            active = self.active
        try:
            yield 0 if active <= 1 else max(1, self.cores // active)
        finally:
            with self._lock:
                self.active -= 1


_DECODING = _Decoding()


def _open(data: bytes, threads: int = 0) -> tuple[Any, Any]:
    """The container and its first video stream (``streams.video[0]``, as the reference), its decoder
    on ``threads`` threads (0: FFmpeg's automatic count)."""
    import av

    try:
        container = av.open(io.BytesIO(data), mode="r", container_options=dict(_CONTAINER_OPTIONS))
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise _failed(f"not a supported container: {type(exc).__name__}") from None
    if not container.streams.video:
        container.close()
        raise _failed("no video stream")
    stream = container.streams.video[0]
    stream.codec_context.thread_type = DECODE_THREAD_TYPE
    if threads:
        stream.codec_context.thread_count = threads
    return container, stream


def _meta(container: Any, stream: Any, total: int | None) -> VideoMeta:
    rate = stream.average_rate or stream.guessed_rate
    if not rate or rate <= 0:
        raise _failed("no frame rate")
    frames = int(stream.frames) if total is None else total
    return VideoMeta(total_frames=frames, fps=float(rate), height=int(stream.height), width=int(stream.width),
                     codec=str(stream.codec_context.name), container=str(container.format.name),
                     frames_counted=total is not None)


def _count_frames(data: bytes, deadline: _Deadline) -> int:
    """Frames the stream really decodes to (for headers without, or with a wrong, frame count)."""
    import av

    container, stream = _open(data)
    count = 0
    try:
        for _ in container.decode(stream):
            count += 1
            deadline.check()
    except av.FFmpegError as exc:
        raise _failed(type(exc).__name__) from None
    finally:
        container.close()
    return count


def upright_turns(rotation: int) -> int:
    """Quarter turns counter-clockwise (``np.rot90``'s ``k``) that make a frame with display-matrix angle
    ``rotation`` (degrees, counter-clockwise, ``VideoFrame.rotation``) upright; 0 for an angle that is not
    within 1 degree of a multiple of 90 (left in the stored orientation)."""
    turns = round(rotation / 90)
    return turns % 4 if abs(rotation - 90 * turns) <= 1 else 0


class _Fallback(Exception):
    """The skipping decode met a stream it cannot index by timestamps: decode every frame instead."""


#: codecs whose ``skip_frame="NONREF"`` drops only pictures no other picture references (H.264
#: ``nal_ref_idc == 0``, HEVC sub-layer non-reference pictures), and whose IDR access units start a
#: stream that needs nothing before it
_SKIPPING_CODECS = frozenset({"h264", "hevc"})


def _nal_types(codec: str, extradata: bytes | None, payload: bytes) -> list[int]:
    """NAL unit types of one H.264/HEVC packet (``avcC``/``hvcC`` length-prefixed, else Annex B)."""
    size = 0
    if extradata and extradata[0] == 1:
        size = (extradata[4] & 3) + 1 if codec == "h264" else ((extradata[21] & 3) + 1 if len(extradata) > 22 else 0)
    heads: list[int] = []
    if size:
        at = 0
        while at + size < len(payload):
            n = int.from_bytes(payload[at:at + size], "big")
            heads.append(payload[at + size])
            at += size + n
    else:
        at = payload.find(b"\x00\x00\x01")
        while 0 <= at < len(payload) - 3:
            heads.append(payload[at + 3])
            at = payload.find(b"\x00\x00\x01", at + 3)
    return [h & 0x1F for h in heads] if codec == "h264" else [(h >> 1) & 0x3F for h in heads]


def _is_idr(codec: str, extradata: bytes | None, payload: bytes) -> bool:
    """Whether an access unit holds an IDR picture (H.264 type 5; HEVC ``IDR_W_RADL``/``IDR_N_LP``):
    decoding from it needs no earlier packet, and no later picture references one before it."""
    idr = {5} if codec == "h264" else {19, 20}
    return any(t in idr for t in _nal_types(codec, extradata, payload))


@dataclass
class _SkipPlan:
    """How the skipping decode indexes and drops frames: ``rank`` maps a packet's pts to its frame
    index (presentation order); ``drop``: packets (decode order) not sent at all (in a GOP that an
    IDR picture follows, every packet after its last wanted one: the whole GOP when it has none)."""

    rank: dict[int, int]
    drop: frozenset[int]


def _skip_plan(packets: Sequence[Any], stream: Any, meta: VideoMeta, want: Mapping[int, Any]) -> _SkipPlan | None:
    """The skipping plan for ``packets`` (decode order, the final empty one included), or None where
    frames cannot be indexed by timestamps: another codec, a packet without pts, repeated pts, a
    packet the demuxer marks discard, or a packet count other than the header's frame count."""
    codec = str(stream.codec_context.name)
    if codec not in _SKIPPING_CODECS or meta.frames_counted:
        return None
    media = [p for p in packets if p.size]
    if len(media) != meta.total_frames or any(p.pts is None or p.is_discard for p in media):
        return None
    pts = sorted(int(p.pts) for p in media)
    if len(set(pts)) != len(pts):
        return None
    rank = {t: i for i, t in enumerate(pts)}
    extradata = stream.codec_context.extradata
    keys = [i for i, p in enumerate(packets) if p.size and p.is_keyframe] + [len(packets)]
    drop: set[int] = set()
    for start, stop in zip(keys, keys[1:]):
        nxt = packets[stop] if stop < len(packets) else None
        if nxt is None or not nxt.size or not _is_idr(codec, extradata, bytes(nxt)):
            continue
        # A GOP that an IDR closes: nothing after it references it, and a picture references only
        # pictures before it in decode order, so the packets after its last wanted one are not needed.
        wanted = [j for j in range(start, stop) if packets[j].size and rank[int(packets[j].pts)] in want]
        drop.update(range(wanted[-1] + 1 if wanted else start, stop))
    return _SkipPlan(rank, frozenset(drop))


class _Frames:
    """The clip's kept frames, written straight into one preallocated ``[len(indices), H, W, 3]`` array."""

    def __init__(self, indices: Sequence[int], allowance: PixelAllowance | None, taken: int,
                 apply_rotation: bool) -> None:
        self.want: dict[int, list[int]] = {}
        for pos, idx in enumerate(indices):
            self.want.setdefault(idx, []).append(pos)
        self.count = len(indices)
        self.allowance = allowance
        self.taken = taken
        self.apply_rotation = apply_rotation
        self.out: np.ndarray | None = None
        self.rotation = 0
        self.turns = 0

    def keep(self, index: int, frame: Any) -> None:
        """Convert ``frame`` (stream frame ``index``, wanted) to RGB into each of its places."""
        if self.out is None:
            self.rotation = int(getattr(frame, "rotation", 0) or 0)  # VideoFrame.rotation: PyAV >= 14
            self.turns = upright_turns(self.rotation) if self.apply_rotation else 0
            height, width = int(frame.height), int(frame.width)
            if self.turns % 2:
                height, width = width, height
            extra = self.count * height * width - self.taken
            if self.allowance is not None and extra > 0:
                self.allowance.take(extra)
                self.taken += extra
            self.out = np.empty((self.count, height, width, 3), dtype=np.uint8)
        rgb = frame.to_ndarray(format="rgb24")
        if self.turns:
            rgb = np.rot90(rgb, self.turns)  # a view; copied once below
        if rgb.shape != self.out.shape[1:]:
            raise _failed("the frame size changes within the stream")
        for pos in self.want[index]:
            self.out[pos] = rgb


def _decode_indices(data: bytes, indices: Sequence[int], allowance: PixelAllowance | None, meta: VideoMeta,
                    deadline: _Deadline, apply_rotation: bool) -> tuple[np.ndarray | None, int, int, int]:
    """Decode frames ``indices`` (ascending, repeats allowed), turned upright when ``apply_rotation``.

    Returns ``(frames, rotation, frames decoded, pixels taken from the allowance)``;
    ``frames`` is None when the stream ended before the last wanted index.

    H.264/HEVC streams whose packets index the frames (:func:`_skip_plan`) are decoded skipping
    what no kept frame needs: a packet of an unwanted frame is sent with ``skip_frame="NONREF"``
    (the decoder drops it when no other picture references it), and in a GOP that an IDR picture
    follows, the packets after its last wanted one (all of them when it has none) are not sent.
    The kept frames are the same bytes (what is dropped is never referenced); a frame out of step
    with the plan falls back to decoding every frame, as the reference does.
    """
    taken = len(indices) * meta.height * meta.width
    if allowance is not None:
        allowance.take(taken)
    frames = _Frames(indices, allowance, taken, apply_rotation)
    with _DECODING.slot() as threads:
        try:
            return _decode_skipping(data, frames, meta, deadline, threads)
        except _Fallback:
            return _decode_every(data, _Frames(indices, allowance, frames.taken, apply_rotation), deadline, threads)


def _decode_every(data: bytes, frames: _Frames, deadline: _Deadline,
                  threads: int = 0) -> tuple[np.ndarray | None, int, int, int]:
    """Every frame up to the last wanted one decoded in order, as the reference's loader."""
    import av

    last, seen = max(frames.want), 0
    container, stream = _open(data, threads)
    try:
        container.seek(0)
        for i, frame in enumerate(container.decode(stream)):
            seen = i + 1
            deadline.check()
            if i in frames.want:
                frames.keep(i, frame)
            if i >= last:
                return frames.out, frames.rotation, seen, frames.taken
    except av.FFmpegError as exc:
        raise _failed(type(exc).__name__) from None
    finally:
        container.close()
    return None, frames.rotation, seen, frames.taken


def _decode_skipping(data: bytes, frames: _Frames, meta: VideoMeta, deadline: _Deadline,
                     threads: int = 0) -> tuple[np.ndarray | None, int, int, int]:
    """:func:`_decode_indices` for a stream :func:`_skip_plan` indexes; raises :class:`_Fallback` else."""
    import av

    container, stream = _open(data, threads)
    try:
        container.seek(0)
        packets = []
        for n, packet in enumerate(container.demux(stream)):
            packets.append(packet)
            if n % 256 == 0:
                deadline.check()
        plan = _skip_plan(packets, stream, meta, frames.want)
        if plan is None:
            raise _Fallback
        last, ctx = max(frames.want), stream.codec_context
        skipped: set[int] = set()  # frame indices sent as droppable or not sent
        for n in plan.drop:
            skipped.add(plan.rank[int(packets[n].pts)])
        done = -1  # the last frame index out of the decoder
        for n, packet in enumerate(packets):
            if n in plan.drop:
                continue
            if packet.size:
                index = plan.rank[int(packet.pts)]
                droppable = index not in frames.want
                ctx.skip_frame = "NONREF" if droppable else "DEFAULT"
                if droppable:
                    skipped.add(index)
            for frame in packet.decode():
                deadline.check()
                at = plan.rank.get(frame.pts) if frame.pts is not None else None
                if at is None or at <= done or any(i not in skipped for i in range(done + 1, at)):
                    raise _Fallback
                done = index = at
                if index in frames.want:
                    frames.keep(index, frame)
                if index >= last:
                    return frames.out, frames.rotation, index + 1, frames.taken
    except av.FFmpegError as exc:
        raise _failed(type(exc).__name__) from None
    finally:
        container.close()
    raise _Fallback


def _header(data: bytes, total: int | None) -> VideoMeta:
    container, stream = _open(data)
    try:
        return _meta(container, stream, total)
    finally:
        container.close()


def planned_clip(meta: VideoMeta, indices: Sequence[int]) -> DecodedVideo:
    """A stand-in for the clip ``meta`` describes, for planning before decoding: ``frames`` is a
    zero-byte read-only view of shape ``[len(indices), H, W, 3]`` (the header's stored size; a
    display rotation swaps H and W, which changes no tensor size)."""
    frames = np.broadcast_to(np.zeros((), dtype=np.uint8), (len(indices), meta.height, meta.width, 3))
    return DecodedVideo(frames=frames, meta=meta, frame_indices=tuple(indices), rotation=0, content_hash="",
                        num_bytes=0)


def decode_video(data: bytes, sample: Callable[[VideoMeta], Sequence[int]], allowance: PixelAllowance | None,
                 timeout_s: float, stop: threading.Event | None = None, apply_rotation: bool = False) -> DecodedVideo:
    """Decode the frames ``sample(meta)`` picks.

    Args:
        data: the encoded clip.
        sample: the family's frame sampler; may raise GatewayError.
        allowance: decoded pixels the request may still take (None: unbounded).
        timeout_s: wall-clock limit of decoding this clip.
        stop: set when the request has ended (failed, cancelled, client gone): decoding
            stops at the next frame instead of running on to the deadline.
        apply_rotation: turn frames upright by the display matrix (module docstring); the
            pipeline passes ``VideoSettings.apply_rotation`` (on by default).  False: the stored
            orientation, as the reference's pyav loader.

    Returns:
        The clip; ``frames`` uint8 ``[N, H, W, 3]``, H and W upright when rotated.

    Raises:
        GatewayError(MEDIA_DECODE_FAILED): not a supported container, no video stream,
            no frames, no frame rate, a corrupt stream, a frame size that changes; ``stop`` set.
        GatewayError(MEDIA_TOO_LARGE): over the decoded-pixel allowance or the deadline.
    """
    if not av_available():
        raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED, "video input needs PyAV (pip install av)")
    deadline = _Deadline(timeout_s, stop)
    meta = _header(data, None)
    if meta.total_frames <= 0:
        meta = _header(data, _count_frames(data, deadline))
    for _ in range(2):
        if meta.total_frames <= 0:
            raise _failed("no frames")
        indices = list(sample(meta))
        if not indices:
            raise _failed("no frames sampled")
        frames, rotation, seen, taken = _decode_indices(data, indices, allowance, meta, deadline,
                                                             apply_rotation)
        if frames is not None:
            return DecodedVideo(frames=frames, meta=meta, frame_indices=tuple(indices), rotation=rotation,
                                content_hash=content_hash(data), num_bytes=len(data))
        # The stream holds fewer frames than its header says: sample it as the clip it is.
        if allowance is not None:
            allowance.give_back(taken)
        meta = _header(data, seen)
    raise _failed("the frame count is inconsistent")
