"""What a vLLM worker does with a Qwen-VL clip before its processor sees it, written out for the tests.

The tests' second reference besides transformers 5.24: vLLM 0.33 ``vllm/multimodal/video.py``
``Qwen2VLVideoBackend`` (registered for ``Qwen2VLVideoProcessor``, so for Qwen2-VL and Qwen2.5-VL): its
``load_bytes`` default ``fps=2``, its ``compute_frames_index_to_sample`` ported here, and the sampling
kwargs under which the transformers processor keeps the same frames.  Qwen3-VL's
``Qwen3VLVideoBackend`` is its processor's default (``fps=2``), so it needs none.  Nothing here
imports mmgate: the expected values never come from the code under test.
"""

from __future__ import annotations

import math
from typing import Any

#: vLLM 0.33 ``vllm/multimodal/video.py`` ``Qwen2VLVideoBackend.load_bytes``: ``fps=2``
VLLM_FPS = 2


def vllm_qwen2_indices(total_frames: int, source_fps: float, fps: float = VLLM_FPS, temporal_patch_size: int = 2,
                       min_frames: int = 4, max_frames: int = 768) -> list[int]:
    """The frames a vLLM worker samples from a Qwen2-VL / Qwen2.5-VL clip: a port of vLLM 0.33
    ``vllm/multimodal/video.py`` ``Qwen2VLVideoBackend.compute_frames_index_to_sample`` (its defaults:
    ``temporal_patch_size`` 2, ``min_frames`` 4, ``max_frames`` 768 from the sampling kwargs; ``fps`` the
    target's, 2 from ``load_bytes``).  Same operations in the same order, the index step by torch itself
    as there; raises ``ZeroDivisionError`` where vLLM does (``n`` floored to 0)."""
    import torch

    if source_fps <= 0:
        raise ValueError("needs a known source fps")
    cap = math.floor(min(max_frames, total_frames) / temporal_patch_size) * temporal_patch_size
    n = total_frames / source_fps * fps
    n = min(max(n, min_frames), cap, total_frames)
    n = math.floor(n / temporal_patch_size) * temporal_patch_size
    steps = torch.arange(0, total_frames, total_frames / n).int()
    return [int(i) for i in torch.clamp(steps, max=total_frames - 1).tolist()]


def vllm_sampling_kwargs(proc: Any) -> dict[str, Any]:
    """The video kwargs under which the transformers processor ``proc`` samples clips as a vLLM worker."""
    if type(proc.video_processor).__name__ == "Qwen2VLVideoProcessor":
        return {"do_sample_frames": True, "fps": VLLM_FPS}
    return {}

