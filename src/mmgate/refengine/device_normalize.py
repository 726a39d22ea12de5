"""Device-side rescale + normalize of raw uint8 pixels (``mm_device_do_normalize``).

Stage: engine request intake.  In: the uint8 primary tensor as the gateway
laid it out; out: float32 values identical to what the transformers torchvision
backend produces (``TorchvisionBackend.rescale_and_normalize`` with the fused
mean/std, transformers 5.24): ``(x.float32 - float32(mean)*255) / (float32(std)*255)``.

Where the channel is depends on the family's layout
(:class:`~mmgate.refengine.families.RawLayout`, one per row of the engine's
family table):
  * ``PATCH_ROWS``: ``[N, C*T*P*P]``, the channel of column ``j`` is
    ``j // (T*P*P)`` (Qwen-VL patch layout ``C, T, P, P``);
  * ``CHANNELS_FIRST``: ``[..., C, H, W]``, the channel axis third from last
    (LLaVA ``[N, 3, 336, 336]``, LLaVA-NeXT tiles ``[N, tiles, 3, 336, 336]``,
    Gemma 3 ``[sum(1 + crops), 3, 896, 896]``).  Zero-padded LLaVA-NeXT tiles
    normalize to ``-mean/std`` rather than 0; the model drops them by
    ``image_sizes`` (``LlavaNextModel.get_image_features``) either way.
A family without a layout gets no normalizer, and the engine does not
advertise ``mm_device_do_normalize`` for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from mmgate.refengine.families import RawLayout

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class DeviceNormalizer:
    """Per-channel affine normalization of uint8 pixels laid out as ``layout``."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    rescale_factor: float
    layout: RawLayout = RawLayout.PATCH_ROWS

    @classmethod
    def from_bundle(cls, folder: Path, layout: RawLayout = RawLayout.PATCH_ROWS) -> DeviceNormalizer:
        """Read mean/std/rescale from the bundle's ``preprocessor_config.json`` (class defaults otherwise)."""
        path = Path(folder) / "preprocessor_config.json"
        cfg = json.loads(path.read_text()) if path.is_file() else {}
        return cls(mean=tuple(cfg.get("image_mean", _CLIP_MEAN)), std=tuple(cfg.get("image_std", _CLIP_STD)),
                   rescale_factor=float(cfg.get("rescale_factor", 1 / 255)), layout=layout)

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 -> float32 of the same shape (``[N, C*K]`` or ``[..., C, H, W]``, per ``layout``).

        Raises:
            ValueError: a shape that cannot hold ``len(mean)`` channels where the layout puts them.
        """
        channels = len(self.mean)
        scale = 1.0 / self.rescale_factor
        mean = torch.tensor(self.mean) * scale
        std = torch.tensor(self.std) * scale
        if self.layout is RawLayout.CHANNELS_FIRST:
            if pixels.ndim < 3 or pixels.shape[-3] != channels:
                raise ValueError(f"raw pixels of shape {list(pixels.shape)} have no {channels} channels at dim -3")
            x = pixels.to(torch.float32)
            return (x - mean[:, None, None]) / std[:, None, None]
        if pixels.ndim != 2 or pixels.shape[1] % channels:
            raise ValueError(f"raw patch rows of shape {list(pixels.shape)} do not split into {channels} channels")
        n, width = pixels.shape
        x = pixels.reshape(n, channels, width // channels).to(torch.float32)
        return ((x - mean[None, :, None]) / std[None, :, None]).reshape(n, width)
