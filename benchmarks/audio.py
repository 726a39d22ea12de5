"""Audio decode + features: mmgate against the transformers processor path, on the same bytes, as ratios.

Clips (generated in memory with PyAV, tones + noise): ``wav_44k_stereo_10s``,
``mp3_44k_mono_30s``, ``opus_48k_stereo_5s`` -- formats transformers' own loader can read
here (its soundfile backend; m4a/webm need torchcodec, not installed).

Per clip and model, one process measures, interleaved, on the same bytes:
* ``mmgate``: ``decode_audio`` (PyAV, mean downmix, soxr_hq -- vLLM's loader) +
  ``log_mel_features`` (torch STFT, valid frames only) + the token count (the gateway's calls);
* ``mmgate/numpy``: the same with the torch-free feature path;
* ``hf``: what ``apply_chat_template`` does with a base64 audio block: ``load_audio(b64,
  sampling_rate=16000)`` (backend ``auto`` resolves to soundfile + soxr here), then
  ``processor(text=[audio placeholder], audio=[waveform])`` (features padded as the processor
  pads them: Qwen2.5-Omni to 300 s, Qwen3-Omni/ASR to the clip).

Before timing, mmgate's valid frames are checked equal to the processor's on mmgate's waveform
(0 expected), and mmgate's token count equal to the processor's.  Each round runs every
contender once per cell in a rotated order; the ratio reported is the median over rounds of
``hf seconds / mmgate seconds`` (> 1: mmgate faster).

Run:  python benchmarks/audio.py [--rounds 5] [--json bench-out/audio.json]
"""

from __future__ import annotations

import argparse
import base64
import io
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import av
import numpy as np
from bench_report import MODELS_DIR, environment, median, render_table, write_json

from mmgate.media.audio import decode_audio
from mmgate.models.audio_features import (
    WhisperMelParams,
    log_mel_features,
    qwen2_5_omni_audio_tokens,
    qwen3_asr_audio_tokens,
    qwen3_omni_audio_tokens,
)

#: name -> (muxer, encoder, sample format, rate, channels, seconds)
CLIPS = {
    "wav_44k_stereo_10s": ("wav", "pcm_s16le", "s16", 44100, 2, 10.0),
    "mp3_44k_mono_30s": ("mp3", "libmp3lame", "fltp", 44100, 1, 30.0),
    "opus_48k_stereo_5s": ("ogg", "libopus", "flt", 48000, 2, 5.0),
}
#: bundle -> (Qwen2.5-Omni-style max_length padding, contiguous |stft|^2, token formula, mask key)
MODELS: dict[str, tuple[bool, bool, Callable[[int], int], str]] = {
    "Qwen--Qwen2.5-Omni-7B": (True, True, qwen2_5_omni_audio_tokens, "feature_attention_mask"),
    "Qwen--Qwen3-Omni-30B-A3B-Instruct": (False, True, qwen3_omni_audio_tokens, "feature_attention_mask"),
    "Qwen--Qwen3-ASR-0.6B": (False, False, qwen3_asr_audio_tokens, "input_features_mask"),
}
CONTENDERS = ("mmgate", "mmgate/numpy", "hf")
LIMITS = {"max_input_bytes": 64 << 20, "max_duration_s": 600.0, "timeout_s": 60.0}


def encode_clip(muxer: str, codec: str, fmt: str, rate: int, channels: int, seconds: float) -> bytes:
    rng = np.random.default_rng(0)
    n = int(rate * seconds)
    t = np.arange(n) / rate
    sig = np.stack([0.4 * np.sin(2 * np.pi * (220 + 110 * c) * t) + 0.1 * rng.standard_normal(n)
                    for c in range(channels)]).astype(np.float32)
    layout = "mono" if channels == 1 else "stereo"
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=muxer) as out:
        stream = out.add_stream(codec, rate=rate, layout=layout)
        for start in range(0, n, 4096):
            part = sig[:, start:start + 4096]
            arr = (np.ascontiguousarray(part) if fmt == "fltp" else part.T.reshape(1, -1))
            if fmt == "s16":
                arr = (arr * 32767).astype(np.int16)
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(arr), format=fmt, layout=layout)
            frame.sample_rate, frame.pts = rate, start
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


@dataclass
class Cell:
    clip: str
    model: str
    fns: dict[str, Callable[[], Any]]
    info: dict[str, Any]
    seconds: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in CONTENDERS})


def build_cell(clip: str, model: str, data: bytes) -> Cell:
    from transformers import AutoProcessor
    from transformers.audio_utils import load_audio

    proc = AutoProcessor.from_pretrained(str(MODELS_DIR / model))
    pad_max, contiguous, tokens, mask_key = MODELS[model]
    params = WhisperMelParams.from_config(proc.feature_extractor.to_dict(), pad_to_max_length=pad_max,
                                          contiguous_magnitudes=contiguous)
    rate = params.sampling_rate
    text = proc.audio_bos_token + proc.audio_token + proc.audio_eos_token
    b64 = base64.b64encode(data).decode()

    def ours(backend: str) -> Callable[[], Any]:
        def run() -> tuple[np.ndarray, int]:
            audio = decode_audio(data, rate, **LIMITS)
            feats = log_mel_features(audio.samples, params, backend=backend)  # type: ignore[arg-type]
            return feats.input_features, tokens(feats.valid_frames)
        return run

    def hf() -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            waveform = load_audio(b64, sampling_rate=rate)
            return proc(text=[text], audio=[waveform], return_tensors="pt")

    # parity on mmgate's waveform (the loaders differ on lossy codecs: docs/parity.md "Audio")
    audio = decode_audio(data, rate, **LIMITS)
    ref = proc(text=[text], audio=[audio.samples], return_tensors="pt")
    valid = int(ref[mask_key][0].sum())
    feats, count = ours("torch")()
    audio_id = proc.tokenizer.convert_tokens_to_ids(proc.audio_token)
    info = {"valid_frames": valid, "tokens": count,
            "features_max_abs_diff": float(np.abs(feats - ref["input_features"][0, :, :valid].numpy()).max()),
            "tokens_equal": count == int((ref["input_ids"][0] == audio_id).sum()),
            "hf_frames_computed": int(ref["input_features"].shape[-1])}
    return Cell(clip, model, {"mmgate": ours("torch"), "mmgate/numpy": ours("numpy"), "hf": hf}, info)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clips", nargs="*", default=list(CLIPS), choices=list(CLIPS))
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args(argv)

    import torch

    env = environment() | {"torch_threads": torch.get_num_threads()}
    print(f"# audio benchmark  {env['date_utc']}  cpus={env['cpus']} load={env['loadavg_at_start']} "
          f"torch_threads={env['torch_threads']}")
    cells = []
    for clip in args.clips:
        data = encode_clip(*CLIPS[clip])
        for model in args.models:
            cell = build_cell(clip, model, data)
            print(clip, model, cell.info)
            cells.append(cell)
    for r in range(args.rounds):
        for cell in cells:
            for name in CONTENDERS[r % len(CONTENDERS):] + CONTENDERS[:r % len(CONTENDERS)]:
                t0 = time.perf_counter()
                cell.fns[name]()
                cell.seconds[name].append(time.perf_counter() - t0)
    rows, results = [], []
    for cell in cells:
        s = {c: median(cell.seconds[c]) for c in CONTENDERS}
        ratio = median([h / m for h, m in zip(cell.seconds["hf"], cell.seconds["mmgate"])])
        ratio_np = median([h / m for h, m in zip(cell.seconds["hf"], cell.seconds["mmgate/numpy"])])
        rows.append([cell.clip, cell.model.split("--")[1], cell.info["valid_frames"], 1 / s["mmgate"],
                     1 / s["mmgate/numpy"], 1 / s["hf"], ratio, ratio_np])
        results.append({"clip": cell.clip, "model": cell.model, **cell.info, "seconds": cell.seconds,
                        "median_s": s, "hf_over_mmgate": ratio, "hf_over_mmgate_numpy": ratio_np})
    print(render_table(["clip", "model", "valid frames", "mmgate clips/s", "mmgate/numpy clips/s", "hf clips/s",
                        "hf/mmgate", "hf/mmgate-numpy"], rows))
    env["loadavg_at_end"] = environment()["loadavg_at_start"]
    print(f"# load at end {env['loadavg_at_end']}")
    write_json(args.json, {"environment": env, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
