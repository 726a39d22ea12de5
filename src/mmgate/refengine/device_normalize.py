"""Device-side rescale + normalize of raw uint8 pixels (``mm_device_do_normalize``).

Stage: engine request intake.  In: uint8 ``pixel_values`` ``[N, C*T*P*P]`` as
the gateway patchified them; out: float32 values identical to what the
transformers torchvision backend produces
(``TorchvisionBackend.rescale_and_normalize`` with the fused mean/std,
transformers 5.24): ``(x.float32 - float32(mean)*255) / (float32(std)*255)``.
The channel of column ``j`` is ``j // (T*P*P)`` (Qwen-VL patch layout
``C, T, P, P``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class DeviceNormalizer:
    """Per-channel affine normalization of uint8 patches."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    rescale_factor: float

    @classmethod
    def from_bundle(cls, folder: Path) -> DeviceNormalizer:
        """Read mean/std/rescale from the bundle's ``preprocessor_config.json`` (class defaults otherwise)."""
        path = Path(folder) / "preprocessor_config.json"
        cfg = json.loads(path.read_text()) if path.is_file() else {}
        return cls(mean=tuple(cfg.get("image_mean", _CLIP_MEAN)), std=tuple(cfg.get("image_std", _CLIP_STD)),
                   rescale_factor=float(cfg.get("rescale_factor", 1 / 255)))

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 ``[N, C*K]`` -> float32 ``[N, C*K]`` (K = T*P*P)."""
        channels = len(self.mean)
        n, width = pixels.shape
        scale = 1.0 / self.rescale_factor
        mean = torch.tensor(self.mean) * scale
        std = torch.tensor(self.std) * scale
        x = pixels.reshape(n, channels, width // channels).to(torch.float32)
        return ((x - mean[None, :, None]) / std[None, :, None]).reshape(n, width)
