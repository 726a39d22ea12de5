"""The reference side of ``tests/families/golden/qwen3_asr.json`` (``scripts/gen_golden.py --family qwen3_asr``).

Qwen3-ASR (transformers 5.24 ``Qwen3ASRProcessor`` + ``Qwen3ASRFeatureExtractor``, torch STFT): per clip (regenerated
from ``(samples, seed)`` by :func:`clip`, float32 mono at 16 kHz) the processor's valid frames (the
``input_features_mask`` sum), the audio token count (``<|audio_pad|>`` in ``input_ids``), the sha256 of the valid
frames of ``input_features`` (float32, C order, ``[128, valid]``) and probe values; per transcription request
(clip, language, prompt) the ``input_ids`` of ``apply_transcription_request``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

BUNDLE = "Qwen--Qwen3-ASR-0.6B"
SR = 16_000
#: (name, samples, seed): a hop, under min_length (8000), min_length - 1 and exactly, off-hop, one full 100-frame
#: chunk, past it, 12.3 s
CLIPS = (("hop", 160, 1), ("short", 4_800, 2), ("min_minus_1", 7_999, 3), ("min", 8_000, 4),
         ("off_hop", 24_037, 5), ("chunk", 16_000, 6), ("past_chunk", 16_161, 7), ("long", 196_800 + 11, 8))
#: (clip, language, prompt) of the transcription requests
REQUESTS = (("off_hop", None, None), ("off_hop", "en", None), ("short", "zh", "Qwen, mmgate"),
            ("long", "Japanese", ""))


def clip(samples: int, seed: int) -> np.ndarray:
    """A tone that rises over the clip plus seeded noise, float32 in [-1, 1] (numpy ``default_rng``, PCG64)."""
    t = np.arange(samples, dtype=np.float64)
    rng = np.random.default_rng(seed)
    x = 0.4 * np.sin(2 * np.pi * (150 + 40 * seed) * t / SR) * (0.2 + t / max(samples, 1)) \
        + 0.05 * rng.standard_normal(samples)
    return np.clip(x, -1.0, 1.0).astype(np.float32)


def _bundle_dir() -> Path:
    from parity_support import find_bundle_dir

    path = find_bundle_dir(BUNDLE)
    if path is None:
        raise SystemExit(f"bundle {BUNDLE} not found on MMGATE_MODEL_PATH / ../shared/models")
    return Path(path)


def qwen3_asr_golden() -> dict[str, Any]:
    import torch
    import transformers
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(str(_bundle_dir()))
    fe = proc.feature_extractor
    rows = []
    for name, samples, seed in CLIPS:
        out = proc(text=[proc.audio_token], audio=[clip(samples, seed)], sampling_rate=SR)
        valid = int(out["input_features_mask"][0].sum())
        feats = np.ascontiguousarray(out["input_features"][0].numpy()[:, :valid], dtype=np.float32)
        rows.append({"bundle": BUNDLE, "clip": name, "samples": samples, "seed": seed, "valid_frames": valid,
                     "padded_frames": int(out["input_features"].shape[-1]),
                     "num_audio_tokens": int((out["input_ids"][0] == proc.audio_token_id).sum()),
                     "input_features_sha256": hashlib.sha256(feats.tobytes()).hexdigest(),
                     "input_features_probe": [float(v) for v in feats.reshape(-1)[:: max(feats.size // 8, 1)][:8]]})
    by_name = {name: (samples, seed) for name, samples, seed in CLIPS}
    requests = []
    for name, language, prompt in REQUESTS:
        out = proc.apply_transcription_request(clip(*by_name[name]), language=language, prompt=prompt,
                                               processor_kwargs={"sampling_rate": SR})
        requests.append({"clip": name, "language": language, "prompt": prompt,
                         "input_ids": out["input_ids"][0].tolist()})
    return {
        "format": 1,
        "generated_by": "scripts/gen_golden.py --family qwen3_asr (scripts/golden_qwen3_asr.py)",
        "reference": "transformers Qwen3ASRProcessor (torch STFT); per clip processor(text=[<|audio_pad|>], audio=[clip])",
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__, "numpy": np.__version__},
        "bundles": [{"bundle": BUNDLE, "model_type": "qwen3_asr", "processor_class": type(proc).__name__,
                     "feature_extractor_class": type(fe).__name__, "audio_token": proc.audio_token,
                     "audio_token_id": proc.audio_token_id, "min_length": fe.min_length, "hop_length": fe.hop_length,
                     "feature_size": fe.feature_size}],
        "rows": rows,
        "requests": requests,
    }
