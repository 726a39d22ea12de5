"""LLaVA-OneVision video: frame sampling, preprocessing and the pooled ``<video>`` run.

Stage: plan / preprocess / expand of ``video_url`` parts for ``llava_onevision``.  In: a clip's
header facts (:class:`~mmgate.types.VideoMeta`), then its decoded frames
(:class:`~mmgate.types.DecodedVideo`); out: frame indices, an :class:`~mmgate.types.ItemPlan`,
the clip's share of the video batch's ``pixel_values`` (float32 ``[num_frames, 3, 384, 384]``; on the
vLLM wire the servicer hands it to vLLM as ``pixel_values_videos``, smg-grpc-servicer 0.14.1
``vllm/mm_keys.py`` ``modality_key``) and the run of ``<video>`` replacing the template's anchor.

Reference (transformers 5.24):
* ``models/llava_onevision/video_processing_llava_onevision.py`` ``LlavaOnevisionVideoProcessor``
  (a ``BaseVideoProcessor``, torchvision only): every frame resized to ``size`` (384x384,
  bicubic, antialiased, on uint8: :func:`mmgate.models.geometry.resize_uint8`, torchvision
  backend), then the fused rescale + normalize (mean = std = 0.5).  ``do_sample_frames`` is
  False (class default, the bundle does not set it): the processor keeps every frame it gets.
* ``models/llava_onevision/processing_llava_onevision.py``
  ``LlavaOnevisionProcessor.replace_video_token``: ``num_frames * ceil(sqrt(num_image_tokens) / 2)**2
  + 1`` copies of ``<video>`` (196 per frame for 27x27 patches, pooled 2x2 by the model's
  ``apply_pooling``; the one extra is the ``image_newline`` appended after the last frame).

Frames (``--video-frame-sampling``, :class:`~mmgate.models.backend.FrameSampling`):
* ``vllm`` (default): as vLLM 0.33's OpenAI server loads a clip: ``VideoMediaIO(num_frames=32)`` ->
  ``vllm/multimodal/video.py`` ``OpenCVVideoBackend.load_bytes``: ``n = max(1, min(32, total))``
  frames, all of them when ``n == total``, else ``np.linspace(0, total - 1, n, dtype=int)``.
  ``LlavaOnevisionMultiModalProcessor`` overrides no data parser, so its processor call
  (``_call_hf_processor``, one clip at a time) gets those frames alone and keeps them all.
* ``transformers``: every frame (the processor's ``do_sample_frames=False``).

Wire layout: vLLM 0.33 ``llava_onevision.py`` ``_get_mm_fields_config``: ``pixel_values_videos``
``MultiModalFieldConfig.batched("video")``; ``_get_prompt_updates``: ``[video_token_index] *
get_num_video_tokens(...)`` (``num_frames * pooled**2 + 1``), the whole run embedded.
"""

from __future__ import annotations

import math

import numpy as np

from mmgate.chat.tokenizer import BundleTokenizer
from mmgate.errors import ErrorCode, GatewayError
from mmgate.models import geometry
from mmgate.models.backend import FrameSampling, ImageBackend
from mmgate.models.bundle import ModelBundle
from mmgate.models.frame_sampling import sample_every_or_vllm
from mmgate.models.llava import ClipParams, check_no_hints, chw_values, clip_params, normalizer_for
from mmgate.types import (
    DecodedVideo,
    ItemHints,
    ItemPlan,
    Modality,
    Replacement,
    TensorLayout,
    TensorSpec,
    VideoDetail,
    VideoMeta,
)

__all__ = ["OnevisionVideo", "onevision_tokens", "onevision_video_from_bundle"]




def onevision_tokens(bundle: ModelBundle, tokenizer: BundleTokenizer, name: str, default: str,
                     config_key: str) -> tuple[str, int]:
    """A media token as ``LlavaOnevisionProcessor.__init__`` reads it (the tokenizer's
    ``extra_special_tokens`` entry over the processor config's, else ``default``) and its id.

    Raises:
        GatewayError(INTERNAL_ERROR): not a single token, or its id disagrees with ``config.json``.
    """
    extra = bundle.tokenizer_config.get("extra_special_tokens")
    token = str((extra or {}).get(name) if isinstance(extra, dict) and extra.get(name)
                else bundle.processor_config.get(name) or default)
    token_id = tokenizer.token_id(token)
    config_id = bundle.config.get(config_key)
    if token_id is None or (config_id is not None and int(config_id) != token_id):
        raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: {token} id disagrees with config")
    return token, token_id


class OnevisionVideo:
    """One bundle's video side (module docstring).  ``ItemPlan.detail``: a :class:`~mmgate.types.VideoDetail`, geometry
    ``(num_frames,)``."""

    modality = Modality.VIDEO
    device_normalizable = True  # a worker may normalize the raw uint8 pixels itself (float32, as the reference)
    specs: tuple[TensorSpec, ...] = (TensorSpec("pixel_values", "float32", TensorLayout.BATCHED, primary=True),)  # -> pixel_values_videos

    def __init__(self, model_type: str, params: ClipParams, token: str, token_id: int, frame_tokens: int,
                 backend: ImageBackend, sampling: FrameSampling) -> None:
        if params.size_hw is None:
            raise GatewayError(ErrorCode.INTERNAL_ERROR, f"{model_type}: the video size must be height/width")
        self.model_type = model_type
        self.params = params
        self.token = token
        self.token_id = token_id
        self.frame_tokens = frame_tokens  # pooled tokens per frame (196)
        self.backend = backend
        self.sampling = sampling
        self.size_hw: tuple[int, int] = params.size_hw
        self._normalizer = normalizer_for(params, backend)

    @property
    def anchor_token_id(self) -> int:
        """The token the chat template leaves once per item (the processor protocol's ``anchor_token_id``)."""
        return self.token_id

    @property
    def placeholder_token_id(self) -> int:
        """The token that receives the encoder output (vLLM ``im_token_id``)."""
        return self.token_id

    @property
    def fingerprint(self) -> str:
        """The model and every preprocessing setting that shapes this processor's output (cache and hash key)."""
        return (f"llava_onevision_video:{self.model_type}:{self.backend.value}:{self.sampling.value}:{self.params!r}:"
                f"{self.token_id}:{self.frame_tokens}")

    def check_hints(self, hints: ItemHints, param: str) -> None:
        """Refuse every hint: the clip's frames and size follow the model (module docstring).

        Raises:
            GatewayError(INVALID_REQUEST): ``fps``, ``max_long_side_pixel`` or ``mm_processor_kwargs`` set.
        """
        check_no_hints(hints, param, self.model_type)

    def sample(self, meta: VideoMeta, hints: ItemHints) -> list[int]:
        """Stream frame indices to decode (module docstring, "Frames").

        Raises:
            GatewayError(MEDIA_DECODE_FAILED): a clip with no frames.
        """
        return sample_every_or_vllm(meta.total_frames, self.sampling)

    def num_tokens(self, num_frames: int) -> int:
        """``num_frames * frame_tokens + 1`` (``replace_video_token``; vLLM ``get_num_video_tokens``)."""
        return num_frames * self.frame_tokens + 1

    def plan(self, video: DecodedVideo, hints: ItemHints) -> ItemPlan[VideoDetail]:
        """The clip's shape and token count from its decoded frames."""
        n = int(video.frames.shape[0])
        if n <= 0:
            raise GatewayError(ErrorCode.MEDIA_DECODE_FAILED, "video has no frames")
        h, w = self.size_hw
        return ItemPlan(modality=Modality.VIDEO, original_hw=(video.height, video.width), resized_hw=(h, w),
                        num_tokens=self.num_tokens(n), shapes=(("pixel_values", (n, 3, h, w)),),
                        detail=VideoDetail.sampled(video, (n,), h * w))

    def plan_tensors(self, plan: ItemPlan[VideoDetail]) -> dict[str, np.ndarray]:
        """The clip's tensors besides the primary one (none: ``pixel_values_videos`` carries the clip)."""
        return {}

    def preprocess(self, video: DecodedVideo, plan: ItemPlan[VideoDetail], raw: bool = False) -> np.ndarray:
        """``[num_frames, 3, 384, 384]`` float32 normalized (uint8 with ``raw``)."""
        frames = video.frames
        if frames.shape[1:3] != self.size_hw:
            resized = np.empty((frames.shape[0], *self.size_hw, frames.shape[3]), dtype=np.uint8)
            for i, frame in enumerate(frames):
                resized[i] = geometry.resize_uint8(frame, self.size_hw, self.params.resample, self.backend)
            frames = resized
        return chw_values(frames, None if raw else self._normalizer)

    def expand(self, plan: ItemPlan[VideoDetail]) -> Replacement:
        """The run of ``<video>`` replacing the anchor; all of it is the placeholder range."""
        n = plan.num_tokens
        return Replacement(token_ids=(self.token_id,) * n, embed_offset=0, embed_length=n)


def onevision_video_from_bundle(bundle: ModelBundle, tokenizer: BundleTokenizer, num_image_tokens: int,
                                backend: ImageBackend | None, sampling: FrameSampling) -> OnevisionVideo | None:
    """The video side, or None when PyAV is missing (a bundle without its ``<video>`` token is refused).

    ``num_image_tokens``: the processor's (729); a frame keeps ``ceil(sqrt(729) / 2)**2`` = 196.
    ``backend``: the reference video processor is torchvision-only, so None means torchvision.

    Raises:
        GatewayError(INTERNAL_ERROR): a video ``size`` that is not height/width, a ``<video>`` that is not
            a token, or its id disagreeing with ``config.json`` ``video_token_index``.
    """
    from mmgate.media.video import av_available

    if not av_available():
        return None
    token, token_id = onevision_tokens(bundle, tokenizer, "video_token", "<video>", "video_token_index")
    cfg = dict(bundle.video_preprocessor_config or bundle.preprocessor_config)
    size = cfg.get("size") or {"height": 384, "width": 384}
    params = clip_params({**cfg, "size": size, "crop_size": size, "do_center_crop": False}, bundle.name)
    pooled = math.ceil(int(math.sqrt(num_image_tokens)) / 2)
    vb = geometry.resolve_backend(backend or ImageBackend.TORCHVISION)
    return OnevisionVideo(bundle.model_type, params, token, token_id, pooled * pooled, vb, sampling)
