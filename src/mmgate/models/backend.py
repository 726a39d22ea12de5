"""Which reference a family's processors are exact to: the image-processor backend and the video
frame-sampling rule.

Stage: model (pure data).  ``mmgate serve`` reads them from ``--image-backend`` and
``--video-frame-sampling`` (:mod:`mmgate.config.settings`) and passes them down; the families
(:mod:`mmgate.models.registry` and one module per family) branch on them.  Imports nothing of mmgate,
so ``models/`` does not depend on the configuration.
"""

from __future__ import annotations

from enum import StrEnum


class ImageBackend(StrEnum):
    """Which transformers image-processor backend mmgate is exact to.

    ``torchvision``: the torchvision-backend image processor class (e.g. ``Qwen2VLImageProcessor``,
    transformers 5.24's default whenever torchvision is importable); its resize is torch's uint8
    antialiased kernel, which mmgate reproduces exactly without torch
    (:mod:`mmgate.media.tv_resize` and its C extension).
    ``pil``: the ``*ImageProcessorPil`` class; resizes with Pillow.
    ``auto``: ``torchvision`` (transformers' default), with or without torch installed.
    """

    AUTO = "auto"
    PIL = "pil"
    TORCHVISION = "torchvision"


class FrameSampling(StrEnum):
    """Which frames of a clip a bundle whose video config does not set ``do_sample_frames`` keeps
    (docs/video.md, "Sampling rules").

    ``vllm``: as a vLLM worker (``vllm/multimodal/video.py`` ``Qwen2VLVideoBackend``, vLLM 0.33):
    Qwen2-VL and Qwen2.5-VL clips sampled at 2 fps (transformers 5.24
    ``Qwen2VLVideoProcessor.sample_frames`` in fps mode).  ``transformers``: the transformers 5.24
    processor's own default, ``do_sample_frames=False`` for ``Qwen2VLVideoProcessor`` (every frame).
    Qwen3-VL samples at 2 fps under both: its processor's default is vLLM's.  A request's
    ``mm_processor_kwargs`` (``do_sample_frames``, ``fps``, ``num_frames``) override either.
    """

    VLLM = "vllm"
    TRANSFORMERS = "transformers"
