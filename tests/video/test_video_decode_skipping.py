"""Decoding only what the kept frames need (issue 26) changes no pixel: ``decode_video`` = the reference's loader.

The reference is transformers 5.24's own pyav loader, ``load_video(path, backend="pyav")`` (every
frame decoded in order), indexed with the sampled indices.  Clips: H.264 with short closed GOPs,
open GOPs, a strict B-pyramid, intra only; HEVC with B-frames, with IDR and with open (CRA) GOPs;
MPEG-TS (no header frame count: every frame decoded, as before).  For H.264/HEVC in MP4 the
skipping decode must be the one that ran (the every-frame fallback is made to fail); whole GOPs
with no wanted frame, and the tail of a closed GOP after its last wanted frame, must be left out.
Two clips decoding at once (one decoder thread each) give the same frames.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest

import mmgate.media.video as video
from mmgate.media.video import decode_video
from tests.video.video_support import load

#: name -> (encoder, options, container format, file suffix)
CLIPS = {
    "h264_gop10": ("libx264", {"x264-params": "keyint=10:min-keyint=10:scenecut=0:bframes=3"}, None, "mp4"),
    "h264_open_gop": ("libx264", {"x264-params": "keyint=12:min-keyint=12:open-gop=1:scenecut=0:bframes=3"}, None,
                      "mp4"),
    "h264_pyramid": ("libx264", {"x264-params": "keyint=30:bframes=5:b-pyramid=strict"}, None, "mp4"),
    "h264_intra": ("libx264", {"x264-params": "keyint=1"}, None, "mp4"),
    "hevc_gop15": ("libx265", {"x265-params": "keyint=15:min-keyint=15:bframes=4:open-gop=0:log-level=error"}, None,
                   "mp4"),
    "hevc_cra": ("libx265", {"x265-params": "keyint=15:min-keyint=15:bframes=4:log-level=error"}, None, "mp4"),
    "h264_mpegts": ("libx264", {"x264-params": "keyint=15"}, "mpegts", "ts"),
}
FRAMES = 75
SKIPPING = ("h264_gop10", "h264_open_gop", "h264_pyramid", "h264_intra", "hevc_gop15", "hevc_cra")


def _make(path: Path, codec: str, options: dict[str, str], fmt: str | None) -> None:
    rng = np.random.default_rng(0)
    texture = rng.integers(0, 256, (96, 128, 3), dtype=np.uint8)
    container = av.open(str(path), "w", format=fmt)
    stream = container.add_stream(codec, rate=25, options=options)
    stream.width, stream.height, stream.pix_fmt = 128, 96, "yuv420p"
    stream.codec_context.time_base = Fraction(1, 25)
    for i in range(FRAMES):
        frame = np.roll(texture, (i * 3, i * 5), axis=(0, 1)).copy()
        frame[:, (i * 7) % 128:(i * 7) % 128 + 4] = 255  # a moving bar: every frame differs
        for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
            container.mux(packet)
    for packet in stream.encode():
        container.mux(packet)
    container.close()


def reference(path: Path) -> np.ndarray:
    """Every frame as the reference's loader decodes it: ``load_video``; for MPEG-TS, whose header has no
    frame count (``load_video`` raises), ``read_video_pyav``'s own loop (``seek(0)``, ``decode``,
    ``to_ndarray(format="rgb24")``) over the whole stream."""
    if path.suffix != ".ts":
        return load(path)[0]
    with av.open(str(path)) as container:
        container.seek(0)
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("skip-clips")
    out = {}
    for name, (codec, options, fmt, suffix) in CLIPS.items():
        path = folder / f"{name}.{suffix}"
        _make(path, codec, options, fmt)
        out[name] = path
    return out


INDEX_SETS = {
    "every 7th": list(range(0, FRAMES, 7)),
    "last only": [FRAMES - 1],
    "first and last": [0, FRAMES - 1],
    "repeats": [3, 3, 40, 40, 41],
    "every frame": list(range(FRAMES)),
}


@pytest.mark.parametrize("name", list(CLIPS))
@pytest.mark.parametrize("which", list(INDEX_SETS))
def test_kept_frames_are_the_reference_loaders(name: str, which: str, clips: dict[str, Path],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    indices = INDEX_SETS[which]
    ref = reference(clips[name])
    if name in SKIPPING:
        def no_fallback(*args: object) -> None:
            raise AssertionError("the skipping decode fell back to decoding every frame")
        monkeypatch.setattr(video, "_decode_every", no_fallback)
    clip = decode_video(clips[name].read_bytes(), lambda meta: indices, None, 60.0)
    assert clip.frame_indices == tuple(indices)
    assert np.array_equal(clip.frames, ref[indices])


@pytest.mark.parametrize("name", ["h264_gop10", "h264_intra", "hevc_gop15"])
def test_gops_without_a_wanted_frame_are_not_sent(name: str, clips: dict[str, Path]) -> None:
    data = clips[name].read_bytes()
    meta = video._header(data, None)
    container, stream = video._open(data)
    try:
        packets = list(container.demux(stream))
        plan = video._skip_plan(packets, stream, meta, {FRAMES - 1: [0]})
    finally:
        container.close()
    assert plan is not None and len(plan.rank) == FRAMES
    assert len(plan.drop) >= FRAMES // 2  # only the last GOP (before which an IDR starts) is decoded


def test_the_tail_of_a_closed_gop_after_its_last_wanted_frame_is_not_sent(clips: dict[str, Path]) -> None:
    data = clips["h264_gop10"].read_bytes()
    meta = video._header(data, None)
    container, stream = video._open(data)
    try:
        packets = list(container.demux(stream))
        plan = video._skip_plan(packets, stream, meta, {0: [0], FRAMES - 1: [1]})
    finally:
        container.close()
    assert plan is not None
    first_gop = range(1, 10)  # decode order: frame 0's IDR packet, then the other 9 of its GOP
    assert 0 not in plan.drop and set(first_gop) <= plan.drop


def test_a_stream_without_a_header_count_is_decoded_every_frame(clips: dict[str, Path]) -> None:
    data = clips["h264_mpegts"].read_bytes()
    container, stream = video._open(data)
    try:
        packets = list(container.demux(stream))
        meta = video._header(data, FRAMES)  # counted: the skipping plan does not apply
        assert video._skip_plan(packets, stream, meta, {0: [0]}) is None
    finally:
        container.close()


def test_clips_decoding_at_once_give_the_same_frames(clips: dict[str, Path]) -> None:
    names = ["h264_gop10", "h264_pyramid", "hevc_gop15", "h264_open_gop"]
    indices = INDEX_SETS["every 7th"]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda n: decode_video(clips[n].read_bytes(), lambda meta: indices, None, 60.0).frames,
                            names))
    for name, frames in zip(names, got):
        assert np.array_equal(frames, reference(clips[name])[indices]), name
