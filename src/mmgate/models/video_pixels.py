"""Pixel work of a Qwen-VL clip: resize the frames, patchify, rescale + normalize.

Stage: preprocess (video).  In: uint8 frames ``[N, H, W, C]``; out: rows
``[grid_t*grid_h*grid_w, C*T*P*P]`` of ``pixel_values``, float32 (or uint8 raw).

The reference (transformers 5.24 ``Qwen2VLVideoProcessor`` / ``Qwen3VLVideoProcessor``
``_preprocess``) resizes a ``[1, N, C, H, W]`` uint8 tensor with ``tvF.resize``
(bicubic, antialias), applies the fused rescale+normalize in float32
(``TorchvisionBackend.rescale_and_normalize``: ``(x - mean/scale) / (std/scale)``),
pads time with copies of the last frame and patchifies with a view + permute.
Here the same values come in a cheaper order: resize the channels-last frames
(torch's uint8 kernel reads them directly: bit-identical, no copies), patchify
the **uint8** frames (a quarter of the bytes), then normalize the rows.  The
normalization is the same float32 arithmetic (checked at start-up against the
``[C, 256]`` table of ``geometry.normalize_lut``); without torch, or for other
rescale/normalize flags, the table is gathered.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from mmgate.models import geometry
from mmgate.settings import ImageBackend

#: (gt, T, gh/m, m_h, p_h, gw/m, m_w, p_w, C) -> (gt, gh/m, gw/m, m_h, m_w, C, T, p_h, p_w): the reference's
#: ``permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)`` of ``(B, gt, T, C, gh/m, m, p, gw/m, m, p)``, from channels-last
PATCH_AXES = (0, 2, 5, 3, 6, 8, 1, 4, 7)


def patchify_video(values: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int) -> np.ndarray:
    """``[N, H, W, C]`` frames -> ``[grid_t*gh*gw, C*T*p*p]`` rows (any dtype), time padded with the last frame.

    Port of transformers 5.24 ``Qwen2VLVideoProcessor.patchify`` (same in Qwen3-VL).
    """
    if pad := -values.shape[0] % temporal_patch_size:
        values = np.concatenate([values, np.repeat(values[-1:], pad, axis=0)], axis=0)
    n, height, width, channels = values.shape
    gt, gh, gw = n // temporal_patch_size, height // patch_size, width // patch_size
    m, p, t = merge_size, patch_size, temporal_patch_size
    x = values.reshape(gt, t, gh // m, m, p, gw // m, m, p, channels).transpose(PATCH_AXES)
    return np.ascontiguousarray(x).reshape(gt * gh * gw, channels * t * p * p)


def _patchify_torch(torch: Any, frames: Any, patch_size: int, merge_size: int, temporal_patch_size: int) -> Any:
    """:func:`patchify_video` on a torch ``[N, H, W, C]`` tensor (its permute copy runs on torch's threads)."""
    if pad := -frames.shape[0] % temporal_patch_size:
        frames = torch.cat([frames, frames[-1:].expand(pad, *frames.shape[1:])], dim=0)
    n, height, width, channels = frames.shape
    gt, gh, gw = n // temporal_patch_size, height // patch_size, width // patch_size
    m, p, t = merge_size, patch_size, temporal_patch_size
    x = frames.reshape(gt, t, gh // m, m, p, gw // m, m, p, channels).permute(*PATCH_AXES)
    return x.reshape(gt * gh * gw, channels * t * p * p)


def lut_rows(rows: np.ndarray, lut: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """uint8 ``[P, C*T*p*p]`` rows -> float32 through the ``[C, 256]`` table, channel by channel, in
    chunks of rows (``np.take`` widens its indices to intp: small chunks keep that in cache)."""
    channels = lut.shape[0]
    src = rows.reshape(rows.shape[0], channels, -1)
    out = np.empty(src.shape, dtype=np.float32)
    for c in range(channels):
        for start in range(0, src.shape[0], chunk):
            np.take(lut[c], src[start:start + chunk, c, :], out=out[start:start + chunk, c, :], mode="clip")
    return out.reshape(rows.shape)


class FrameProcessor:
    """Resize + patchify + normalize for one set of video parameters.

    ``fused``: (mean', std') float32 of the reference's fused rescale+normalize,
    or None (gather the table instead).
    """

    def __init__(self, backend: ImageBackend, lut: np.ndarray, rescale_factor: float, mean: tuple[float, ...],
                 std: tuple[float, ...], do_rescale: bool, do_normalize: bool) -> None:
        self.backend = backend
        self.lut = lut
        self._norm = (rescale_factor, mean, std, do_rescale and do_normalize)
        self._fused: tuple[Any, Any] | None | bool = False  # False: not checked yet (torch is imported on first use)
        self._lock = threading.Lock()

    @property
    def fused(self) -> tuple[Any, Any] | None:
        """(mean', std') torch tensors of the fused rescale+normalize when it equals the table, else None
        (the table is gathered); checked on first use, so torch loads with the first clip."""
        with self._lock:
            if self._fused is False:
                self._fused = self._check_fused()
            return None if isinstance(self._fused, bool) else self._fused

    @fused.setter
    def fused(self, value: tuple[Any, Any] | None) -> None:
        with self._lock:
            self._fused = value

    def _check_fused(self) -> tuple[Any, Any] | None:
        rescale_factor, mean, std, both = self._norm
        if self.backend is not ImageBackend.TORCHVISION or not both:
            return None
        torch, _, _ = geometry._torch_modules()
        inv = np.float32(1.0 / rescale_factor)  # as geometry.normalize_lut, torchvision branch
        mean_t = torch.from_numpy(np.asarray(mean, dtype=np.float32) * inv).view(1, -1, 1)
        std_t = torch.from_numpy(np.asarray(std, dtype=np.float32) * inv).view(1, -1, 1)
        table = torch.arange(256, dtype=torch.float32).expand(1, len(mean), 256).clone().sub_(mean_t).div_(std_t)
        return (mean_t, std_t) if np.array_equal(table[0].numpy(), self.lut) else None

    def __call__(self, frames: np.ndarray, size_hw: tuple[int, int] | None, resample: int, patch_size: int,
                 merge_size: int, temporal_patch_size: int, raw: bool) -> np.ndarray:
        """uint8 ``[N, H, W, C]`` -> rows; ``size_hw`` None: no resize."""
        if self.backend is ImageBackend.PIL:
            if size_hw is not None:
                frames = np.stack([geometry.resize_uint8(f, size_hw, resample, self.backend) for f in frames])
            rows = patchify_video(frames, patch_size, merge_size, temporal_patch_size)
            return rows if raw else lut_rows(rows, self.lut)
        torch, tvF, mode = geometry._torch_modules()
        x = torch.from_numpy(frames)
        if size_hw is not None:
            interp = getattr(mode, geometry._TV_INTERPOLATION.get(resample, "BILINEAR"))
            x = tvF.resize(x.permute(0, 3, 1, 2), list(size_hw), interpolation=interp, antialias=True)
            x = x.permute(0, 2, 3, 1)
        rows = _patchify_torch(torch, x, patch_size, merge_size, temporal_patch_size)
        if raw:
            return rows.numpy()
        fused = self.fused
        if fused is None:
            return lut_rows(rows.numpy(), self.lut)
        mean_t, std_t = fused
        out = rows.view(rows.shape[0], mean_t.shape[1], -1).to(torch.float32).sub_(mean_t).div_(std_t)
        return out.view(rows.shape).numpy()
