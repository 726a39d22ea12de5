"""Clips with an audio track, made with PyAV: h264 frames (tests/video/video_support.py ``frame_pixels``) and an
aac stereo tone in one mp4, or the frames alone (a silent clip, no audio stream); and the track as mmgate's audio
decoder gives it (the waveform the parity tests hand the reference processor)."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from tests.video.video_support import frame_pixels


def av_clip(folder: Path, name: str, seconds: float, fps: int = 10, size: tuple[int, int] = (96, 64),
            rate: int | None = 44100, container: str = "mp4") -> Path:
    """An mp4 (or another ``container``: ``mpegts``) of ``seconds`` of h264 frames at ``fps`` and, with ``rate``,
    an aac stereo tone of the same length."""
    path = folder / f"{name}.{'ts' if container == 'mpegts' else container}"
    width, height = size
    with av.open(str(path), "w", format=container) as out:
        video = out.add_stream("libx264", rate=fps)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        video.options = {"preset": "ultrafast", "crf": "18"}
        audio = out.add_stream("aac", rate=rate, layout="stereo") if rate else None
        for i in range(int(seconds * fps)):
            for packet in video.encode(av.VideoFrame.from_ndarray(frame_pixels(i, height, width), format="rgb24")):
                out.mux(packet)
        for packet in video.encode():
            out.mux(packet)
        if audio is not None and rate is not None:
            n = int(seconds * rate)
            t = np.arange(n) / rate
            wave = np.stack([0.3 * np.sin(2 * np.pi * 440 * t), 0.2 * np.sin(2 * np.pi * 660 * t)]).astype(np.float32)
            for start in range(0, n, 1024):
                frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(wave[:, start:start + 1024]), format="fltp",
                                                   layout="stereo")
                frame.sample_rate, frame.pts, frame.time_base = rate, start, Fraction(1, rate)
                for packet in audio.encode(frame):
                    out.mux(packet)
            for packet in audio.encode():
                out.mux(packet)
    return path


def track(path: Path) -> np.ndarray:
    """The clip's audio as mmgate's decoder gives it for a clip (mono float32 at 16 kHz, the video decoder's
    demuxers): the waveform fed to the reference (decode parity is tests/audio's)."""
    from mmgate.media.audio import decode_audio
    from mmgate.media.video import ALLOWED_DEMUXERS

    return decode_audio(path.read_bytes(), 16000, max_input_bytes=1 << 30, max_duration_s=600.0,
                        timeout_s=30.0, demuxers=ALLOWED_DEMUXERS).samples
