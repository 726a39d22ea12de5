"""The pixel path of ``mmgate.models.video_pixels`` equals torch's, computed without torch.

``FrameProcessor`` (torchvision backend) resizes frame by frame with the torch-free
kernel, patchifies the uint8 frames and normalizes with the fused float32 formula.
Here it is compared with what the reference does on a ``[1, N, C, H, W]`` tensor
(transformers 5.24 ``Qwen2VLVideoProcessor._preprocess``: ``tvF.resize`` bicubic
antialias on the batch, ``TorchvisionBackend.rescale_and_normalize`` fused
``(x - mean/scale) / (std/scale)`` in float32, time padding, view + permute), run
with torch in this test; the whole-clip comparison with transformers itself is
``test_video_parity.py``.  The Pillow resize stays within one 8-bit step of it.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from mmgate.models import geometry
from mmgate.models.video_pixels import FrameProcessor, patchify_video
from mmgate.models.backend import ImageBackend
from tests.conftest import bundle_dir
from tests.video.video_support import frame_pixels

MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def processor(backend: ImageBackend) -> FrameProcessor:
    lut = geometry.normalize_lut(ImageBackend.TORCHVISION, 1 / 255, MEAN, STD, True, True)
    return FrameProcessor(backend, lut, 1 / 255, MEAN, STD, True, True)


def frames(n: int = 5, h: int = 50, w: int = 70) -> np.ndarray:
    return np.stack([frame_pixels(i, h, w) for i in range(n)])


def torch_reference(clip: np.ndarray, size_hw: tuple[int, int], patch: int, merge: int, tps: int,
                    raw: bool = False) -> np.ndarray:
    """The reference's arithmetic on torch tensors: batched resize, fused normalize (``raw``: none, the
    resized uint8 values), pad, patchify."""
    torch = pytest.importorskip("torch")
    tv = pytest.importorskip("torchvision.transforms.v2")
    x = torch.from_numpy(clip).permute(0, 3, 1, 2).contiguous()  # [N, C, H, W], as the reference stacks it
    x = tv.functional.resize(x, list(size_hw), interpolation=tv.InterpolationMode.BICUBIC, antialias=True)
    mean = torch.tensor(MEAN) * (1.0 / (1 / 255))  # _fuse_mean_std_and_rescale_factor
    std = torch.tensor(STD) * (1.0 / (1 / 255))
    if not raw:
        x = tv.functional.normalize(x.to(torch.float32), mean.tolist(), std.tolist())
    if pad := -x.shape[0] % tps:
        x = torch.cat([x, x[-1:].expand(pad, *x.shape[1:])], dim=0)
    n, c, h, w = x.shape
    gt, gh, gw = n // tps, h // patch, w // patch
    x = x.view(gt, tps, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, c * tps * patch * patch).numpy()


def test_frame_processor_equals_torch_resize_and_fused_normalize() -> None:
    proc = processor(ImageBackend.TORCHVISION)
    assert proc.normalizer.formula is not None and proc.normalizer.formula[0] == ""  # the fused formula
    for n, (h, w), size in [(5, (50, 70), (56, 84)), (4, (90, 120), (28, 56)), (3, (56, 84), (56, 84))]:
        clip = frames(n, h, w)
        got = proc(clip, size, geometry.RESAMPLE_BICUBIC, 14, 2, 2, raw=False)
        want = torch_reference(clip, size, 14, 2, 2)
        assert got.dtype == np.float32 and got.shape == want.shape
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (n, h, w, size)


def test_raw_rows_are_the_resized_frames_patchified() -> None:
    proc = processor(ImageBackend.TORCHVISION)
    clip = frames()
    raw = proc(clip, (56, 84), geometry.RESAMPLE_BICUBIC, 14, 2, 2, raw=True)
    resized = np.stack([geometry.resize_uint8(f, (56, 84), geometry.RESAMPLE_BICUBIC, ImageBackend.TORCHVISION)
                        for f in clip])
    assert raw.dtype == np.uint8 and np.array_equal(raw, patchify_video(resized, 14, 2, 2))
    assert raw.shape == (3 * 4 * 6, 3 * 2 * 14 * 14)  # 5 frames padded to 6: grid (3, 4, 6)
    table = proc.lut[np.arange(3)[None, :, None], raw.reshape(len(raw), 3, -1)].reshape(raw.shape)
    assert np.array_equal(proc(clip, (56, 84), geometry.RESAMPLE_BICUBIC, 14, 2, 2, raw=False), table)


@pytest.mark.parametrize("native", [True, False], ids=["kernel", "numpy"])
@pytest.mark.parametrize("offset", [0, 3])
def test_clip_rows_written_in_place_into_a_row_array(native: bool, offset: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``write_rows`` into a :class:`RowArray` (the request bytes, at any byte address, after another item's
    rows): each temporal patch written straight into its rows, the last one padded (5 frames, T = 2), the
    reference's values; nothing outside the clip's rows touched; raw uint8 rows too."""
    from mmgate.models import patch_native
    from mmgate.types import RowArray, shifted

    if not native:
        monkeypatch.setattr(patch_native, "NATIVE", False)
    proc = processor(ImageBackend.TORCHVISION)
    clip = frames()
    want = torch_reference(clip, (56, 84), 14, 2, 2)
    raws = {False: want, True: torch_reference(clip, (56, 84), 14, 2, 2, raw=True)}
    for raw, expected in raws.items():
        first, width, item = 3, expected.shape[1], expected.itemsize
        buf = np.full(offset + (first + len(expected) + 1) * width * item, 0xAB, dtype=np.uint8)
        rows = buf[offset:].view(expected.dtype).reshape(-1, width)
        sink = shifted(RowArray(rows), first)
        sent: list[int] = []
        monkeypatch.setattr(RowArray, "__call__", lambda self, row, block: sent.append(row))
        assert proc.write_rows(clip, (56, 84), geometry.RESAMPLE_BICUBIC, 14, 2, 2, raw, sink) == len(expected)
        assert sent == []  # no block handed over: every temporal patch computed in place
        assert np.array_equal(rows[first:first + len(expected)].view(np.uint8), expected.view(np.uint8))
        outside = np.concatenate([buf[:offset + first * width * item],
                                  buf[offset + (first + len(expected)) * width * item:]])
        assert (outside == 0xAB).all()
        with pytest.raises(ValueError, match="outside"):  # a destination one row short
            proc.write_rows(clip, (56, 84), geometry.RESAMPLE_BICUBIC, 14, 2, 2, raw,
                            RowArray(rows[:first + len(expected) - 1]).shifted(first))


def test_pillow_fallback_is_within_one_step_of_the_torch_kernel() -> None:
    clip = frames()
    a = processor(ImageBackend.TORCHVISION)(clip, (56, 84), geometry.RESAMPLE_BICUBIC, 14, 2, 2, raw=True)
    b = processor(ImageBackend.PIL)(clip, (56, 84), geometry.RESAMPLE_BICUBIC, 14, 2, 2, raw=True)
    assert a.shape == b.shape and int(np.abs(a.astype(int) - b.astype(int)).max()) <= 1


def test_video_backend_is_torchvision_whatever_the_image_backend_and_imports_no_torch() -> None:
    """The reference video processors are torchvision-only, and that backend needs no torch: the
    video path is exact to it under every ``--image-backend`` (checked in a fresh interpreter)."""
    tv, pil, auto = ImageBackend.TORCHVISION, ImageBackend.PIL, ImageBackend.AUTO
    assert geometry.resolve_backend(auto) is tv and geometry.resolve_backend(pil) is pil
    script = (
        "import sys\n"
        "from mmgate.gateway.state import build_state\n"
        "from mmgate.config.settings import Settings\n"
        "from mmgate.models.backend import ImageBackend\n"
        f"state = build_state(Settings(model={str(bundle_dir('Qwen/Qwen3-VL-2B-Instruct'))!r}, "
        "image_backend=ImageBackend.PIL))\n"
        "print(state.runtime.family.video.backend.value, 'torch' in sys.modules)\n"
        "state.executor.shutdown()\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["torchvision", "False"]
