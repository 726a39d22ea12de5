"""InternVL3 clips: each sampled frame one 448x448 tile, ``Frame{i}: <img>…</img>`` text around each.

Stage: sample / plan / preprocess / expand (video) for ``model_type`` ``internvl``.  In: the clip's
header (sample) and its decoded frames (plan, preprocess); out: the clip's ``pixel_values`` share
``[num_frames, 3, 448, 448]`` float32, its ``video_num_patches`` (= frames), the shared
``video_token_id`` and a *text-level* prompt update.

Reference (transformers 5.24):

* ``models/internvl/video_processing_internvl.py`` ``InternVLVideoProcessor`` (torchvision-only):
  every frame resized to 448x448 (bicubic, antialiased, torch's uint8 kernel) and rescaled +
  normalized with the fused float32 formula; ``do_sample_frames`` false in the bundle, so the
  processor keeps every frame it is given.
* ``processing_internvl.py`` ``InternVLProcessor.replace_video_token``: the template's ``<video>``
  becomes ``"\\n".join(f"Frame{i + 1}: <img>" + "<IMG_CONTEXT>" * 256 + "</img>")``, replaced in the
  *text* and tokenized with the whole prompt (``"Frame"`` merges with the letters before it);
  ``InternVLForConditionalGeneration`` embeds the frames as images (the processor concatenates
  them into ``pixel_values`` in prompt order).

vLLM 0.33 (``vllm/model_executor/models/interns1.py``, which serves the HF-format
``InternVLForConditionalGeneration``): ``InternS1MultiModalProcessor._call_hf_processor`` calls the
HF processor per clip, **rewrites the clip's ``<IMG_CONTEXT>`` ids to ``<video>``** (id 151674, a
token transformers adds at load from ``extra_special_tokens``; the checkpoint's embedding table
ends at 151673, so vLLM never looks it up: it is an embedding position), decodes that and
re-tokenizes the whole prompt; ``_get_mm_fields_config``: ``pixel_values_videos``
``flat_from_sizes("video", video_num_patches)``, ``video_num_patches`` batched, ``video_token_id``
shared; ``get_replacement_interns1_video``: ``select_text(repl_full, "<video>")`` (the range is the
whole replacement, ``is_embed`` the ``<video>`` tokens).  Frames: vLLM's video loader
(``vllm/multimodal/media/video.py`` ``VideoMediaIO`` ``num_frames`` 32, the OpenCV backend): every
frame of a clip of at most 32, else ``np.linspace(0, total - 1, 32, dtype=int)``.

mmgate follows vLLM here: the clip's context ids are ``<video>`` (the ids and the batch's
``placeholder_token_id``), the wire vLLM reads.  The reference's ids are the same with ``<video>``
read as ``<IMG_CONTEXT>`` inside the clip's range (:func:`reference_ids`); the reference engine
embeds the frames as images that way (``mmgate.refengine.frames_as_images``).  docs/families.md,
docs/parity.md.  ``--video-frame-sampling transformers``: every frame (the processor's default).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mmgate.errors import ErrorCode, GatewayError
from mmgate.models import geometry
from mmgate.models.backend import FrameSampling, ImageBackend
from mmgate.models.bundle import ModelBundle
from mmgate.models.frame_sampling import sample_every_or_vllm
from mmgate.models.image_rows import RowNormalizer
from mmgate.models.llava import check_no_hints
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

__all__ = ["InternVLVideo", "frame_text", "reference_ids"]

#: ``"Frame1: <img>"`` before the first context token (Frame, 1, :, " ", <img>) when the clip's text
#: starts a pre-token (after a newline or a special token, as the template renders it)
LEAD_TOKENS = 5


def frame_text(num_frames: int, start: str, context: str, end: str, seq: int) -> str:
    """``InternVLProcessor.replace_video_token``'s text with ``context`` as the context token."""
    return "\n".join(f"Frame{i + 1}: {start}{context * seq}{end}" for i in range(num_frames))


def reference_ids(ids: Sequence[int], video_id: int, context_id: int) -> list[int]:
    """The transformers ids of a prompt mmgate expanded: each ``<video>`` context id read as
    ``<IMG_CONTEXT>`` (the template's ``<video>`` anchors are all replaced, so every ``<video>``
    left is a context position)."""
    return [context_id if t == video_id else t for t in ids]


class InternVLVideo:
    """The clip processor of InternVL3 (see the module docstring)."""

    modality = Modality.VIDEO
    device_normalizable = True  # a worker may normalize the raw uint8 pixels itself (float32, as the reference)
    specs: tuple[TensorSpec, ...] = (
        TensorSpec("pixel_values", "float32", TensorLayout.FLAT, sizes_key="video_num_patches", primary=True),
        TensorSpec("video_num_patches", "int64", TensorLayout.BATCHED),
        TensorSpec("video_token_id", "int64", TensorLayout.SHARED),
    )

    def __init__(self, model_type: str, size_hw: tuple[int, int], resample: int, lut_params: tuple,
                 texts: tuple[str, str, str], video_id: int, seq: int, backend: ImageBackend,
                 sampling: FrameSampling) -> None:
        """``lut_params``: ``(rescale_factor, mean, std, do_rescale, do_normalize)``; ``texts``:
        ``(<img>, <video>, </img>)``; ``seq``: context tokens per frame (256)."""
        self.model_type = model_type
        self.size_hw = size_hw
        self.resample = resample
        self.lut_params = lut_params
        self.texts = texts
        self.video_id = video_id
        self.seq = seq
        self.backend = backend
        self.sampling = sampling
        lut = geometry.normalize_lut(ImageBackend.TORCHVISION, *lut_params)
        self._normalizer = RowNormalizer.for_table(lut, *lut_params)

    @property
    def anchor_token_id(self) -> int:
        """``<video>``: what the chat template leaves once per clip."""
        return self.video_id

    @property
    def placeholder_token_id(self) -> int:
        """``<video>``: vLLM's video context token (``video_token_id``)."""
        return self.video_id

    @property
    def fingerprint(self) -> str:
        """The model and every preprocessing setting that shapes this processor's output (cache and hash key)."""
        return (f"internvl_video:{self.model_type}:{self.backend.value}:{self.sampling.value}:{self.size_hw}:"
                f"{self.resample}:{self.lut_params!r}:{self.seq}")

    def check_hints(self, hints: ItemHints, param: str) -> None:
        """Raises GatewayError(INVALID_REQUEST): ``fps``, ``max_long_side_pixel`` or ``mm_processor_kwargs``
        (the frames follow vLLM's sampling or every frame, the size the model's)."""
        check_no_hints(hints, param, self.model_type)

    def sample(self, meta: VideoMeta, hints: ItemHints) -> list[int]:
        """vLLM's frames, or every frame (``--video-frame-sampling transformers``: ``do_sample_frames`` false);
        :func:`mmgate.models.frame_sampling.sample_every_or_vllm`.

        Raises:
            GatewayError(MEDIA_DECODE_FAILED): a clip with no frames.
        """
        return sample_every_or_vllm(meta.total_frames, self.sampling)

    def plan(self, video: DecodedVideo, hints: ItemHints) -> ItemPlan[VideoDetail]:
        """One tile per decoded frame: ``num_tokens`` = ``256 * frames`` ``<video>`` tokens;
        ``detail.geometry``: ``(frames,)``.

        Raises:
            GatewayError(MEDIA_DECODE_FAILED): a clip without frames.
        """
        frames = len(video.frame_indices)
        if frames == 0:
            raise GatewayError(ErrorCode.MEDIA_DECODE_FAILED, "the video has no frames")
        h, w = self.size_hw
        return ItemPlan(modality=Modality.VIDEO, original_hw=(video.height, video.width), resized_hw=(h, w),
                        num_tokens=frames * self.seq,
                        shapes=(("pixel_values", (frames, 3, h, w)), ("video_num_patches", ()),
                                ("video_token_id", ())),
                        detail=VideoDetail.sampled(video, (frames,), h * w))

    def plan_tensors(self, plan: ItemPlan[VideoDetail]) -> dict[str, np.ndarray]:
        """``video_num_patches`` (frames) and ``video_token_id`` (``<video>``, vLLM's shared key)."""
        return {"video_num_patches": np.array(plan.detail.geometry[0], dtype=np.int64),
                "video_token_id": np.array(self.video_id, dtype=np.int64)}

    def preprocess(self, video: DecodedVideo, plan: ItemPlan[VideoDetail], raw: bool = False) -> np.ndarray:
        """``[frames, 3, 448, 448]``: each frame resized (torchvision kernel) and normalized
        (the torchvision fused formula), float32; or with ``raw`` the resized uint8 pixels."""
        h, w = self.size_hw
        out = np.empty(plan.primary_shape, dtype=np.uint8 if raw else np.float32)
        for k, frame in enumerate(video.frames):
            if frame.shape[:2] != (h, w):
                frame = geometry.resize_uint8(frame, (h, w), self.resample, self.backend)
            chw = np.moveaxis(frame, 2, 0)
            if raw:
                out[k] = chw
            else:
                self._normalizer(np.ascontiguousarray(chw).reshape(1, 3, h * w), out[k].reshape(1, 3, h * w))
        return out

    def expand(self, plan: ItemPlan[VideoDetail]) -> Replacement:
        """The text replacing ``<video>``; the range runs from ``Frame1`` to the last ``</img>``."""
        start, context, end = self.texts
        text = frame_text(plan.detail.geometry[0], start, context, end, self.seq)
        return Replacement(token_ids=(), embed_offset=LEAD_TOKENS, embed_length=plan.num_tokens, text=text,
                           trail=1)


def load_video(bundle: ModelBundle, texts: tuple[str, str, str], video_id: int, seq: int,
               backend: ImageBackend, sampling: FrameSampling) -> InternVLVideo:
    """The clip processor from ``video_preprocessor_config.json`` (``InternVLVideoProcessor``).

    Raises:
        GatewayError(INTERNAL_ERROR): a config mmgate does not serve (no resize, center crop,
            ``do_sample_frames`` true, a size without height and width).
    """
    cfg = bundle.video_preprocessor_config
    size = cfg.get("size") or {"height": 384, "width": 384}  # InternVLVideoProcessor.size
    if not size.get("height") or not size.get("width") or cfg.get("do_resize") is False \
            or cfg.get("do_center_crop") or cfg.get("do_sample_frames"):
        raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: internvl video config not supported")
    clip = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    mean = tuple(float(v) for v in cfg.get("image_mean") or clip[0])
    std = tuple(float(v) for v in cfg.get("image_std") or clip[1])
    lut_params = (float(cfg.get("rescale_factor", 1 / 255)), mean, std, bool(cfg.get("do_rescale", True)),
                  bool(cfg.get("do_normalize", True)))
    return InternVLVideo(bundle.model_type, (int(size["height"]), int(size["width"])),
                         int(cfg.get("resample", geometry.RESAMPLE_BICUBIC)), lut_params, texts, video_id, seq,
                         backend, sampling)
