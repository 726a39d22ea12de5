"""The pixel paths of ``mmgate.models.video_pixels`` agree with each other.

The torch path (channels-last resize, uint8 patchify, fused normalize) is
checked against the reference in ``test_video_parity.py``; here the table
gather and the numpy patchify give the same values, and the torch-free
(Pillow) resize stays within one 8-bit step of it.
"""

from __future__ import annotations

import numpy as np

from mmgate.models import geometry
from mmgate.models.video_pixels import FrameProcessor, patchify_video
from mmgate.settings import ImageBackend
from tests.video.video_support import frame_pixels

MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def processor(backend: ImageBackend) -> FrameProcessor:
    lut = geometry.normalize_lut(ImageBackend.TORCHVISION, 1 / 255, MEAN, STD, True, True)
    return FrameProcessor(backend, lut, 1 / 255, MEAN, STD, True, True)


def frames(n: int = 5, h: int = 50, w: int = 70) -> np.ndarray:
    return np.stack([frame_pixels(i, h, w) for i in range(n)])


def test_fused_normalize_equals_the_table_and_numpy_patchify_equals_torch() -> None:
    fused = processor(ImageBackend.TORCHVISION)
    assert fused.fused is not None
    table = processor(ImageBackend.TORCHVISION)
    table.fused = None
    clip = frames()
    a = fused(clip, (56, 84), geometry.RESAMPLE_BICUBIC, 14, 2, 2, raw=False)
    b = table(clip, (56, 84), geometry.RESAMPLE_BICUBIC, 14, 2, 2, raw=False)
    assert a.dtype == np.float32 and np.array_equal(a, b)
    raw = fused(clip, (56, 84), geometry.RESAMPLE_BICUBIC, 14, 2, 2, raw=True)
    resized = np.stack([geometry.resize_uint8(f, (56, 84), geometry.RESAMPLE_BICUBIC, ImageBackend.TORCHVISION)
                        for f in clip])
    assert np.array_equal(raw, patchify_video(resized, 14, 2, 2))
    assert raw.shape == (3 * 4 * 6, 3 * 2 * 14 * 14)  # 5 frames padded to 6: grid (3, 4, 6)


def test_pillow_fallback_is_within_one_step_of_the_torch_kernel() -> None:
    clip = frames()
    a = processor(ImageBackend.TORCHVISION)(clip, (56, 84), geometry.RESAMPLE_BICUBIC, 14, 2, 2, raw=True)
    b = processor(ImageBackend.PIL)(clip, (56, 84), geometry.RESAMPLE_BICUBIC, 14, 2, 2, raw=True)
    assert a.shape == b.shape and int(np.abs(a.astype(int) - b.astype(int)).max()) <= 1


def test_video_backend_follows_the_image_backend_without_importing_torch_for_pil() -> None:
    """``--image-backend pil``: the video path stays exact to the torchvision-only reference but loads
    torch with the first clip, not at start-up (checked in a fresh interpreter)."""
    import subprocess
    import sys

    from tests.conftest import bundle_dir

    tv, pil, auto = ImageBackend.TORCHVISION, ImageBackend.PIL, ImageBackend.AUTO
    assert geometry.video_backend_for(auto, tv) is tv and geometry.video_backend_for(tv, tv) is tv
    assert geometry.video_backend_for(auto, pil) is pil  # auto fell back: torchvision does not import here
    assert geometry.video_backend_for(pil, pil) is tv  # installed (this suite needs it): loaded on first use
    lazy = processor(ImageBackend.TORCHVISION)
    assert lazy._fused is False and lazy.fused is not None  # checked on first use
    script = (
        "import sys\n"
        "from mmgate.api.app import build_state\n"
        "from mmgate.settings import ImageBackend, Settings\n"
        f"state = build_state(Settings(model={str(bundle_dir('Qwen/Qwen3-VL-2B-Instruct'))!r}, "
        "image_backend=ImageBackend.PIL))\n"
        "print(state.runtime.family.video.backend.value, 'torch' in sys.modules)\n"
        "state.executor.shutdown()\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["torchvision", "False"]
