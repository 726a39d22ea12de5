"""Generated audio clips: numpy tones + noise encoded with PyAV into each container/codec the gateway takes.

``make_clip(spec)`` returns the encoded bytes; ``CODECS`` names the container/codec pairs and
the rates each encoder takes (Opus: 8/12/16/24/48 kHz only).  Deterministic (seeded by the spec).
"""

from __future__ import annotations

import io
import zlib
from dataclasses import dataclass

import av
import numpy as np


@dataclass(frozen=True)
class Codec:
    name: str  # id in test names
    container: str  # FFmpeg muxer
    codec: str  # FFmpeg encoder
    sample_format: str  # the frames' format handed to the encoder
    rates: tuple[int, ...] | None  # rates the encoder takes (None: any)


CODECS: dict[str, Codec] = {c.name: c for c in (
    Codec("wav", "wav", "pcm_s16le", "s16", None),
    Codec("flac", "flac", "flac", "s16", None),
    Codec("mp3", "mp3", "libmp3lame", "fltp", (8000, 11025, 16000, 22050, 24000, 32000, 44100, 48000)),
    Codec("ogg_opus", "ogg", "libopus", "flt", (8000, 12000, 16000, 24000, 48000)),
    Codec("m4a_aac", "ipod", "aac", "fltp", (8000, 16000, 22050, 44100, 48000)),
    Codec("webm_opus", "webm", "libopus", "flt", (8000, 12000, 16000, 24000, 48000)),
)}

RATES = (8000, 16000, 22050, 44100, 48000)


@dataclass(frozen=True)
class ClipSpec:
    codec: str
    rate: int
    channels: int
    seconds: float

    @property
    def id(self) -> str:
        return f"{self.codec}-{self.rate}-{self.channels}ch-{self.seconds:g}s"


def waveform(spec: ClipSpec) -> np.ndarray:
    """float32 ``[channels, n]`` in [-0.9, 0.9]: two tones per channel plus noise, seeded by the spec."""
    rng = np.random.default_rng(zlib.crc32(spec.id.encode()))
    n = max(1, int(round(spec.seconds * spec.rate)))
    t = np.arange(n) / spec.rate
    out = np.empty((spec.channels, n), dtype=np.float32)
    for ch in range(spec.channels):
        f1, f2 = rng.uniform(100, min(3000, spec.rate / 2.5), size=2)
        sig = 0.4 * np.sin(2 * np.pi * f1 * t) + 0.2 * np.sin(2 * np.pi * f2 * t + ch)
        sig += 0.1 * rng.standard_normal(n)
        out[ch] = np.clip(sig, -0.9, 0.9)
    return out


def _frames_for(signal: np.ndarray, codec: Codec, rate: int, layout: str) -> list[av.AudioFrame]:
    frames = []
    step = 1024
    for start in range(0, signal.shape[1], step):
        part = signal[:, start:start + step]
        if codec.sample_format == "s16":
            arr = (part.T.reshape(1, -1) * 32767).astype(np.int16)
        elif codec.sample_format == "flt":
            arr = np.ascontiguousarray(part.T.reshape(1, -1))
        else:  # fltp
            arr = np.ascontiguousarray(part)
        frame = av.AudioFrame.from_ndarray(arr, format=codec.sample_format, layout=layout)
        frame.sample_rate = rate
        frame.pts = start
        frames.append(frame)
    return frames


#: raw ADTS AAC (the ``aac`` demuxer): not in the parity matrix; its parts can be concatenated into one stream whose
#: channel count changes (:func:`changing_adts`)
ADTS_AAC = Codec("adts_aac", "adts", "aac", "fltp", (8000, 16000, 22050, 44100, 48000))


def encode(signal: np.ndarray, codec_name: str, rate: int) -> bytes:
    """Encode float32 ``[channels, n]`` at ``rate`` with the named codec."""
    return encode_with(CODECS[codec_name], signal, rate)


def changing_adts(parts: list[tuple[int, int]], seconds: float = 0.5) -> bytes:
    """ADTS AAC parts of ``(rate, channels)`` back to back: one stream whose frames change rate or channel count."""
    return b"".join(encode_with(ADTS_AAC, waveform(ClipSpec("adts_aac", rate, channels, seconds)), rate)
                    for rate, channels in parts)


def encode_with(codec: Codec, signal: np.ndarray, rate: int) -> bytes:
    """Encode float32 ``[channels, n]`` at ``rate`` with ``codec``."""
    layout = "mono" if signal.shape[0] == 1 else "stereo"
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=codec.container) as out:
        stream = out.add_stream(codec.codec, rate=rate, layout=layout)
        for frame in _frames_for(signal, codec, rate, layout):
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def make_clip(spec: ClipSpec) -> bytes:
    return encode(waveform(spec), spec.codec, spec.rate)


def video_only_mp4() -> bytes:
    """A short mp4 with one video stream and no audio stream."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for i in range(3):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), i * 40, dtype=np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def wav_header_only(rate: int = 16000) -> bytes:
    """A wav file whose data chunk is empty (zero samples)."""
    return encode(np.zeros((1, 0), dtype=np.float32), "wav", rate) if False else _empty_wav(rate)


def _empty_wav(rate: int) -> bytes:
    import struct
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", 0)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def pcm16_tone(samples: int, seed: int, base_hz: float, step_hz: float, rate: int = 16_000) -> np.ndarray:
    """int16 ``[samples]``: a tone of ``base_hz + step_hz * seed`` Hz at amplitude 0.3 plus seeded noise (0.05)."""
    t = np.arange(samples)
    rng = np.random.default_rng(seed)
    x = 0.3 * np.sin(2 * np.pi * (base_hz + step_hz * seed) * t / rate) + 0.05 * rng.standard_normal(samples)
    return np.clip(np.round(x * 32767), -32768, 32767).astype(np.int16)


def wav16(pcm: np.ndarray, rate: int = 16_000) -> bytes:
    """A mono 16-bit WAV (the stdlib ``wave`` writer) of ``pcm``."""
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()
