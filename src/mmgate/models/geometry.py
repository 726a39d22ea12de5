"""Pure shared math of vision preprocessing: smart_resize, resize, normalize tables, patch geometry.

Every function here ports one piece of a transformers 5.24 image processor and
names it.  Exactness strategy: the decoded image is uint8, so rescale +
normalize is a function of (channel, byte value) alone; we tabulate it as a
``[C, 256]`` float32 look-up table computed with *the reference's own
arithmetic* (same dtypes, same operation order).  The row writer
(:mod:`mmgate.models.image_rows`) computes with a formula proven equal to that
table on every input, or gathers it; patchify lives there too.

Resizing is the one step whose kernel differs by backend:
* PIL backend (``*ImageProcessorPil``): ``PIL.Image.resize`` — we call Pillow.
* torchvision backend (``Qwen2VLImageProcessor``): ``tvF.resize`` on a uint8
  ``[C, H, W]`` tensor with ``antialias=True`` — torch's own uint8 kernel, which
  differs from Pillow by 1 LSB on a fraction of pixels (docs/parity.md).  We
  reproduce that kernel bit for bit without torch (:mod:`mmgate.media.tv_resize`,
  compiled passes with a numpy fallback), so the gateway imports no torch and
  ``auto`` always means transformers' own default, the torchvision backend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from PIL import Image

from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.tv_resize import resize_uint8_tv
from mmgate.models.backend import ImageBackend

#: transformers ``PILImageResampling`` values (= Pillow's)
RESAMPLE_NEAREST, RESAMPLE_LANCZOS, RESAMPLE_BILINEAR, RESAMPLE_BICUBIC = 0, 1, 2, 3

MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Resized (height, width): multiples of ``factor``, area within [min_pixels, max_pixels].

    Port of transformers 5.24 ``models/qwen2_vl/image_processing_qwen2_vl.py``
    ``smart_resize`` (same float operations, so the same rounding).

    Raises:
        GatewayError(IMAGE_ASPECT_RATIO_INVALID): ``max/min`` side ratio > 200,
            where the reference raises ``ValueError``.
    """
    if min(height, width) <= 0:
        raise GatewayError(ErrorCode.MEDIA_DECODE_FAILED, "image has a zero-sized side")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise GatewayError(
            ErrorCode.IMAGE_ASPECT_RATIO_INVALID,
            f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got {max(height, width) / min(height, width)}",
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class PatchGeometry:
    """Mixin of the Qwen-VL parameter records: the resize factor and the width of a patch row."""

    __slots__ = ()
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    image_mean: tuple[float, ...]

    @property
    def factor(self) -> int:
        """``patch_size * merge_size``: resized sides are multiples of it."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Values per ``pixel_values`` row: ``C * T * P * P``."""
        return len(self.image_mean) * self.temporal_patch_size * self.patch_size * self.patch_size


def resolve_backend(requested: ImageBackend) -> ImageBackend:
    """``auto`` -> ``torchvision``: the class transformers' ``AutoImageProcessor`` picks when
    torchvision imports (its default), reproduced here without torch."""
    return ImageBackend.TORCHVISION if requested is ImageBackend.AUTO else requested


#: transformers ``pil_torch_interpolation_mapping`` for the resamples torch's uint8 antialiased kernel runs
_TV_MODES: dict[int, Literal["bilinear", "bicubic"]] = {RESAMPLE_BILINEAR: "bilinear", RESAMPLE_BICUBIC: "bicubic"}
#: resamples the torch-free kernel does not cover (no shipped bundle uses one): run by torch itself
_TV_TORCH_ONLY = {RESAMPLE_NEAREST: "NEAREST_EXACT", RESAMPLE_LANCZOS: "LANCZOS"}


def resize_uint8(pixels: npt.NDArray[np.uint8], size_hw: tuple[int, int], resample: int,
                 backend: ImageBackend) -> npt.NDArray[np.uint8]:
    """Resize a uint8 ``[H, W, 3]`` RGB image to ``size_hw`` as the backend's reference does.

    PIL: transformers ``image_transforms.resize`` -> ``PIL.Image.resize((w, h), resample)``.
    torchvision: ``TorchvisionBackend.resize`` -> ``tvF.resize(uint8 [C,H,W], antialias=True)``
    (``pil_torch_interpolation_mapping`` maps BICUBIC -> InterpolationMode.BICUBIC), i.e.
    torch's CPU uint8 antialiased kernel, computed by :func:`mmgate.media.tv_resize.resize_uint8_tv`
    without torch for BILINEAR and BICUBIC.  NEAREST and LANCZOS are handed to torch itself when
    it is installed (no shipped bundle uses them).

    Returns:
        uint8 ``[h, w, 3]``.

    Raises:
        GatewayError(INTERNAL_ERROR): torchvision backend, NEAREST or LANCZOS, and torch is not
            installed.
    """
    if backend is ImageBackend.PIL:
        out = Image.fromarray(pixels).resize((size_hw[1], size_hw[0]), resample=resample)
        return np.asarray(out)
    if resample in _TV_TORCH_ONLY:
        return _resize_with_torch(pixels, size_hw, _TV_TORCH_ONLY[resample])
    # BOX / HAMMING have no tensor kernel in torchvision (the reference raises): bilinear, as before
    return resize_uint8_tv(pixels, size_hw, _TV_MODES.get(resample, "bilinear"))


def _resize_with_torch(pixels: npt.NDArray[np.uint8], size_hw: tuple[int, int],
                       interpolation: str) -> npt.NDArray[np.uint8]:
    """``tvF.resize`` itself, for the resamples :mod:`mmgate.media.tv_resize` does not cover."""
    try:
        import torch
        from torchvision.transforms.v2 import InterpolationMode
        from torchvision.transforms.v2 import functional as tvF
    except Exception as exc:  # noqa: BLE001  # ImportError, or a torchvision that fails to load its ops
        raise GatewayError(
            ErrorCode.INTERNAL_ERROR,
            f"image backend 'torchvision' with resample {interpolation} needs torch + torchvision "
            f"({type(exc).__name__}); BILINEAR and BICUBIC do not",
        ) from None
    tensor: Any = torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1)
    resized = tvF.resize(tensor, list(size_hw), interpolation=getattr(InterpolationMode, interpolation),
                         antialias=True)
    return np.ascontiguousarray(resized.permute(1, 2, 0).numpy())


@lru_cache(maxsize=64)
def normalize_lut(backend: ImageBackend, rescale_factor: float, mean: tuple[float, ...],
                  std: tuple[float, ...], do_rescale: bool, do_normalize: bool) -> npt.NDArray[np.float32]:
    """``[C, 256]`` float32 table: value of byte ``v`` in channel ``c`` after rescale + normalize.

    PIL backend (``PilBackend.rescale`` / ``normalize`` -> ``image_transforms.rescale``:
    ``(x.astype(float64) * scale).astype(float32)``; ``image_transforms.normalize``:
    ``(x - float32(mean)) / float32(std)`` in float32).
    torchvision backend (``TorchvisionBackend.rescale_and_normalize`` with
    ``_fuse_mean_std_and_rescale_factor``: ``mean' = float32(mean) * (1/scale)``,
    ``std'`` likewise, then ``tvF.normalize(x.float32)`` = ``(x - mean') / std'`` in float32).
    """
    values = np.arange(256, dtype=np.uint8)
    channels = len(mean) if do_normalize else 3
    table = np.empty((channels, 256), dtype=np.float32)
    if backend is ImageBackend.TORCHVISION and do_rescale and do_normalize:
        inv = np.float32(1.0 / rescale_factor)  # torch multiplies a float32 tensor by a wrapped scalar in float32
        mean_f = np.asarray(mean, dtype=np.float32) * inv
        std_f = np.asarray(std, dtype=np.float32) * inv
        x = values.astype(np.float32)
        for c in range(channels):
            table[c] = (x - mean_f[c]) / std_f[c]
        return table
    if do_rescale:
        x = (values.astype(np.float64) * rescale_factor).astype(np.float32)
    else:
        x = values.astype(np.float32)
    if do_normalize:
        mean_f = np.asarray(mean, dtype=np.float32)
        std_f = np.asarray(std, dtype=np.float32)
        for c in range(channels):
            table[c] = (x - mean_f[c]) / std_f[c]
    else:
        table[:] = x
    return table


_FLOAT32 = np.dtype(np.float32)


def concat_rows(parts: Sequence[np.ndarray], width: int, dtype: np.dtype = _FLOAT32) -> np.ndarray:
    """Concatenate ``[n_i, width]`` arrays (an empty ``[0, width]`` array of ``dtype`` for none)."""
    if not parts:
        return np.zeros((0, width), dtype=dtype)
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
