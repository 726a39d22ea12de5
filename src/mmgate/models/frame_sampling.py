"""The frames a vLLM worker keeps of a clip whose model has no sampling rule of its own.

Stage: model (pure arithmetic).  vLLM 0.33 reads a clip through ``vllm/multimodal/media/video.py``
``VideoMediaIO(num_frames=32)`` -> ``vllm/multimodal/video.py`` ``OpenCVVideoBackend.load_bytes``: every frame
when the clip has at most 32, else ``np.linspace(0, total - 1, 32, dtype=int)``.  Families whose transformers
video processor keeps every frame (``do_sample_frames`` False: LLaVA-OneVision, InternVL3) follow it under
``--video-frame-sampling vllm`` and keep every frame under ``transformers``.
"""

from __future__ import annotations

import numpy as np

from mmgate.errors import ErrorCode, GatewayError
from mmgate.models.backend import FrameSampling

__all__ = ["VLLM_NUM_FRAMES", "sample_every_or_vllm", "vllm_frame_indices"]

#: vLLM 0.33 ``VideoMediaIO.__init__`` default ``num_frames``
VLLM_NUM_FRAMES = 32


def vllm_frame_indices(total: int, num_frames: int = VLLM_NUM_FRAMES) -> list[int]:
    """The frame indices vLLM 0.33 ``OpenCVVideoBackend.load_bytes(num_frames=32)`` reads (no fps bound).

    Examples: 7 frames -> ``[0..6]``; 33 -> ``np.linspace(0, 32, 32, dtype=int)`` (frame 31 skipped:
    ``[0, 1, ..., 30, 32]``); 301 -> 32 frames ``0, 9, 19, ..., 300``.
    """
    n = max(1, min(num_frames, total))
    if n == total:
        return list(range(total))
    return [int(i) for i in np.linspace(0, total - 1, n, dtype=int)]


def sample_every_or_vllm(total: int, sampling: FrameSampling) -> list[int]:
    """Every frame (``transformers``: the processor's ``do_sample_frames`` False) or vLLM's
    (:func:`vllm_frame_indices`).

    Raises:
        GatewayError(MEDIA_DECODE_FAILED): a clip with no frames.
    """
    if total <= 0:
        raise GatewayError(ErrorCode.MEDIA_DECODE_FAILED, "video has no frames")
    if sampling is FrameSampling.TRANSFORMERS:
        return list(range(total))
    return vllm_frame_indices(total)
