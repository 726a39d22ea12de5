"""The Qwen-VL family: Qwen2-VL, Qwen2.5-VL and Qwen3-VL images.

Stage: plan / preprocess / expand for ``model_type`` ``qwen2_vl``,
``qwen2_5_vl`` and ``qwen3_vl``.  The three differ only in parameters read
from the bundle (patch size 14 vs 16, CLIP vs 0.5 mean/std, pixel bounds), so
they are rows of one parameter table, not three classes.

Reference (transformers 5.24):
* ``models/qwen2_vl/image_processing_qwen2_vl.py`` ``Qwen2VLImageProcessor``
  (torchvision backend; the class ``AutoImageProcessor`` picks for all three
  bundles when torchvision imports) and ``image_processing_pil_qwen2_vl.py``
  ``Qwen2VLImageProcessorPil``;
* ``models/qwen2_vl/processing_qwen2_vl.py`` ``Qwen2VLProcessor.replace_image_token``
  and ``models/qwen3_vl/processing_qwen3_vl.py`` (same for images): each
  ``<|image_pad|>`` becomes ``grid_t*grid_h*grid_w // merge_size**2`` copies.

Wire layout (as SMG ``registry/qwen_vl.rs`` and vLLM ``qwen2_vl.py``
``_create_qwen2vl_field_factory``): ``pixel_values`` flat, sized by
``patches_per_image``; ``image_grid_thw`` and ``patches_per_image`` batched;
``image_grid_thw`` kept on CPU.  The placeholder range of an image covers its
pad run only (the template's ``<|vision_start|>``/``<|vision_end|>`` stay
outside), which is what vLLM's ``PromptReplacement`` for Qwen2-VL produces.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmgate.chat.tokenizer import BundleTokenizer
from mmgate.errors import ErrorCode, GatewayError
from mmgate.models import geometry
from mmgate.models.bundle import ModelBundle
from mmgate.models.image_rows import RowNormalizer, RowSink, image_rows, write_rows
from mmgate.models.qwen_vl_frames import long_side_bound, video_config, video_params
from mmgate.models.qwen_vl_kwargs import TAKES_OPTIONS, check_options, sized
from mmgate.models.qwen_vl_video import QwenVLVideo
from mmgate.models.family import MediaProcessor, processor_map
from mmgate.models.backend import FrameSampling, ImageBackend
from mmgate.types import (
    DecodedImage,
    ItemHints,
    ItemPlan,
    Modality,
    Replacement,
    TensorLayout,
    TensorSpec,
)

# transformers 5.24 Qwen2VLImageProcessor class attributes
_DEFAULT_MIN_PIXELS = 56 * 56
_DEFAULT_MAX_PIXELS = 28 * 28 * 1280
_OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True, slots=True)
class QwenVLImageParams(geometry.PatchGeometry):
    """Every image-preprocessing parameter, as the reference image processor resolves it."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int  # size["shortest_edge"]
    max_pixels: int  # size["longest_edge"]
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float
    do_resize: bool
    do_rescale: bool
    do_normalize: bool
    resample: int  # PILImageResampling value


def image_params_from_config(cfg: Mapping[str, Any]) -> QwenVLImageParams:
    """Resolve parameters like ``Qwen2VLImageProcessor.__init__`` (5.24): ``size`` with
    ``min_pixels``/``max_pixels`` overriding ``shortest_edge``/``longest_edge``."""
    size = dict(cfg.get("size") or {"shortest_edge": _DEFAULT_MIN_PIXELS, "longest_edge": _DEFAULT_MAX_PIXELS})
    if cfg.get("min_pixels") is not None:
        size["shortest_edge"] = cfg["min_pixels"]
    if cfg.get("max_pixels") is not None:
        size["longest_edge"] = cfg["max_pixels"]
    if not size.get("shortest_edge") or not size.get("longest_edge"):
        raise GatewayError(ErrorCode.INTERNAL_ERROR, "preprocessor size needs shortest_edge and longest_edge")
    return QwenVLImageParams(
        patch_size=int(cfg.get("patch_size", 14)),
        merge_size=int(cfg.get("merge_size", 2)),
        temporal_patch_size=int(cfg.get("temporal_patch_size", 2)),
        min_pixels=int(size["shortest_edge"]),
        max_pixels=int(size["longest_edge"]),
        image_mean=tuple(float(v) for v in cfg.get("image_mean", _OPENAI_CLIP_MEAN)),
        image_std=tuple(float(v) for v in cfg.get("image_std", _OPENAI_CLIP_STD)),
        rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
        do_resize=bool(cfg.get("do_resize", True)),
        do_rescale=bool(cfg.get("do_rescale", True)),
        do_normalize=bool(cfg.get("do_normalize", True)),
        resample=int(cfg.get("resample", geometry.RESAMPLE_BICUBIC)),
    )


#: Qwen-VL image tensors, in vLLM's layout (``qwen2_vl.py`` ``_create_qwen2vl_field_factory``)
IMAGE_SPECS = (
    TensorSpec("pixel_values", "float32", TensorLayout.FLAT, sizes_key="patches_per_image", primary=True),
    TensorSpec("image_grid_thw", "int64", TensorLayout.BATCHED, keep_on_cpu=True),
    TensorSpec("patches_per_image", "int64", TensorLayout.BATCHED),
)


class QwenVLImage:
    """Qwen-VL images: ``smart_resize``, patch rows, a pad run per image (see module docstring).

    Implements :class:`~mmgate.models.family.ImageProcessor` and
    :class:`~mmgate.models.family.RowWriter`.
    """

    modality = Modality.IMAGE
    device_normalizable = True  # a worker may normalize the raw uint8 pixels itself (float32, as the reference)
    specs: tuple[TensorSpec, ...] = IMAGE_SPECS

    def __init__(self, model_type: str, params: QwenVLImageParams, image_token_id: int,
                 backend: ImageBackend) -> None:
        self.model_type = model_type
        self.params = params
        self.image_token_id = image_token_id
        self.backend = backend
        lut = geometry.normalize_lut(backend, params.rescale_factor, params.image_mean, params.image_std,
                                     params.do_rescale, params.do_normalize)
        self._normalizer = RowNormalizer.for_table(lut, params.rescale_factor, params.image_mean, params.image_std,
                                                   params.do_rescale, params.do_normalize)

    @property
    def anchor_token_id(self) -> int:
        return self.image_token_id

    @property
    def placeholder_token_id(self) -> int:
        return self.image_token_id

    @property
    def fingerprint(self) -> str:
        """Identifies the model and every preprocessing setting (cache and hash key)."""
        return f"qwen_vl:{self.model_type}:{self.backend.value}:{self.params!r}"

    def check_hints(self, hints: ItemHints, param: str) -> None:
        """Model-dependent hint checks, before any fetch.

        Raises:
            GatewayError(INVALID_REQUEST): ``max_long_side_pixel`` not a multiple of the resize
                factor; ``mm_processor_kwargs`` for Qwen3-VL, or ones Qwen2-VL / Qwen2.5-VL do not
                take (:mod:`mmgate.models.qwen_vl_kwargs`: images use ``min_pixels`` /
                ``max_pixels``, the video processor's names are taken and left to videos).
        """
        if hints.max_long_side_pixel is not None and hints.max_long_side_pixel % self.params.factor:
            raise GatewayError(ErrorCode.INVALID_REQUEST,
                               f"max_long_side_pixel must be a positive multiple of {self.params.factor}",
                               param + ".max_long_side_pixel")
        if self.model_type in TAKES_OPTIONS:
            check_options(hints, self.model_type)
        else:
            check_no_options(hints, self.model_type)

    def image_max_pixels(self, height: int, width: int, hints: ItemHints | None) -> int:
        """``size["longest_edge"]`` for one image: the config's (or the request's ``max_pixels``), or a
        ``max_long_side_pixel`` hint's bound."""
        p = sized(self.params, hints)
        if hints is None or hints.max_long_side_pixel is None or not p.do_resize:
            return p.max_pixels
        return long_side_bound(lambda bound: geometry.smart_resize(height, width, p.factor, p.min_pixels, bound),
                               height, width, hints.max_long_side_pixel, p.max_pixels)

    def plan(self, height: int, width: int, hints: ItemHints | None = None) -> ItemPlan:
        """Geometry of one image from its size (``smart_resize`` + grid); ``detail`` = grid ``(1, h, w)``."""
        p = sized(self.params, hints)
        if p.do_resize:
            rh, rw = geometry.smart_resize(height, width, p.factor, p.min_pixels,
                                           self.image_max_pixels(height, width, hints))
        else:
            rh, rw = height, width
            if rh % p.factor or rw % p.factor:
                raise GatewayError(ErrorCode.INVALID_REQUEST, "image size is not a multiple of the patch grid")
        gh, gw = rh // p.patch_size, rw // p.patch_size
        return ItemPlan(
            modality=Modality.IMAGE, original_hw=(height, width), resized_hw=(rh, rw),
            num_tokens=gh * gw // (p.merge_size**2),
            shapes=(("pixel_values", (gh * gw, p.patch_dim)), ("image_grid_thw", (3,)), ("patches_per_image", ())),
            detail=(1, gh, gw),
        )

    def plan_tensors(self, plan: ItemPlan) -> dict[str, np.ndarray]:
        """``image_grid_thw`` ``[3]`` and ``patches_per_image`` (rows) of one image, int64."""
        return {"image_grid_thw": np.array(plan.detail, dtype=np.int64),
                "patches_per_image": np.array(plan.primary_shape[0], dtype=np.int64)}

    def resized(self, image: DecodedImage, plan: ItemPlan) -> DecodedImage:
        """``image`` with its pixels at ``plan.resized_hw`` (itself when the size is unchanged).

        No resize when the size is unchanged: both references return the image as
        it is then (``PIL.Image.resize`` returns a copy, torchvision's
        ``resize_image`` the input), so the values are the same.
        """
        p = self.params
        if not p.do_resize or plan.resized_hw == image.pixels.shape[:2]:
            return image
        pixels = geometry.resize_uint8(image.pixels, plan.resized_hw, p.resample, self.backend)
        return DecodedImage(pixels=pixels, content_hash=image.content_hash, num_bytes=image.num_bytes)

    def preprocess(self, image: DecodedImage, plan: ItemPlan, raw: bool = False) -> np.ndarray:
        """One image -> ``[grid_h*grid_w, C*T*P*P]`` rows of ``pixel_values``.

        float32 normalized values (the reference's), or with ``raw`` the resized
        uint8 pixels in the same layout, for a worker that rescales and
        normalizes on device (``mm_device_do_normalize``).
        """
        p = self.params
        return image_rows(self.resized(image, plan).pixels, p.patch_size, p.merge_size, p.temporal_patch_size,
                          None if raw else self._normalizer)

    def write_rows(self, image: DecodedImage, plan: ItemPlan, raw: bool, sink: RowSink,
                   band: tuple[int, int] = (0, 1)) -> int:
        """:meth:`preprocess` handing its rows to ``sink(first_row, rows)`` block by block
        (``image_rows.write_rows``, ``band`` as there); returns the rows written.  Pass an image
        already :meth:`resized` when writing it in several bands."""
        p = self.params
        return write_rows(self.resized(image, plan).pixels, p.patch_size, p.merge_size, p.temporal_patch_size,
                          None if raw else self._normalizer, sink, band=band)

    def expand(self, plan: ItemPlan) -> Replacement:
        """The pad run replacing one ``<|image_pad|>`` anchor."""
        return Replacement(token_ids=(self.image_token_id,) * plan.num_tokens, embed_offset=0,
                           embed_length=plan.num_tokens)


def check_no_options(hints: ItemHints, model_type: str) -> None:
    """Refuse ``mm_processor_kwargs`` for a processor that takes none per request.

    Raises:
        GatewayError(INVALID_REQUEST): ``param`` ``mm_processor_kwargs``.
    """
    if hints.options:
        raise GatewayError(ErrorCode.INVALID_REQUEST,
                           f"{model_type} takes no mm_processor_kwargs here (got {', '.join(k for k, _ in hints.options)})",
                           "mm_processor_kwargs")


class QwenVLFamily:
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL images and videos (see module docstring).

    Video planning, preprocessing and prompt layout live in
    :mod:`mmgate.models.qwen_vl_video`; ``video`` is None (and ``limits`` has no
    video entry) when the bundle lacks the video tokens or PyAV is missing.
    """

    model_types = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
    limits: Mapping[Modality, int] = {Modality.IMAGE: 16, Modality.VIDEO: 4}
    #: the three configs' ``rope_scaling`` / ``rope_parameters`` carry ``mrope_section`` (transformers 5.24
    #: ``Qwen2VLModel.get_rope_index`` and its Qwen2.5 / Qwen3 copies)
    mrope = True
    vllm_video_ids = False  # the clip's ids are the model's own <|video_pad|>
    text_updates: frozenset[Modality] = frozenset()  # token-level images and clips
    image_token = "<|image_pad|>"
    video_tokens = ("<|video_pad|>", "<|vision_start|>", "<|vision_end|>")

    def __init__(self, model_type: str, image: QwenVLImage, video: QwenVLVideo | None = None) -> None:
        self.model_type = model_type
        self.image = image
        self.video = video
        #: the seam generic code reads (:attr:`mmgate.models.family.Family.processors`)
        self.processors: Mapping[Modality, MediaProcessor] = processor_map(image, video)
        if video is None:
            self.limits = {Modality.IMAGE: QwenVLFamily.limits[Modality.IMAGE]}

    @classmethod
    def from_bundle(cls, bundle: ModelBundle, tokenizer: BundleTokenizer, backend: ImageBackend,
                    video_backend: ImageBackend | None = None,
                    video_sampling: FrameSampling = FrameSampling.VLLM) -> QwenVLFamily:
        """Read every parameter from the bundle; ``backend`` must be resolved (not ``auto``).

        ``video_backend``: the video path's (:func:`mmgate.models.registry.load_family`); None: torchvision
        when it imports, as the reference video processors.  ``video_sampling``: the frames a bundle
        that does not set ``do_sample_frames`` keeps (``--video-frame-sampling``).
        """
        cfg = bundle.preprocessor_config or dict(bundle.processor_config.get("image_processor") or {})
        token_id = tokenizer.token_id(cls.image_token)
        config_id = bundle.config.get("image_token_id")
        if token_id is None or (config_id is not None and int(config_id) != token_id):
            raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: <|image_pad|> id disagrees with config")
        image = QwenVLImage(bundle.model_type, image_params_from_config(cfg), token_id, backend)
        return cls(bundle.model_type, image, cls._video_from_bundle(bundle, tokenizer, video_backend, video_sampling))

    @classmethod
    def _video_from_bundle(cls, bundle: ModelBundle, tokenizer: BundleTokenizer, backend: ImageBackend | None = None,
                           sampling: FrameSampling = FrameSampling.VLLM) -> QwenVLVideo | None:
        """The video side: the reference video processor is torchvision-only, so its backend is
        torchvision whenever importable, whatever the image backend (docs/video.md)."""
        from mmgate.media.video import av_available

        ids = {t: tokenizer.token_id(t) for t in cls.video_tokens}
        if not av_available() or any(v is None for v in ids.values()):
            return None
        config_id = bundle.config.get("video_token_id")
        if config_id is not None and int(config_id) != ids["<|video_pad|>"]:
            raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: <|video_pad|> id disagrees with config")
        cfg = video_config(bundle.processor_config, bundle.video_preprocessor_config, bundle.preprocessor_config)

        def encode(text: str) -> list[int]:
            return list(tokenizer.tokenizer.encode(text, add_special_tokens=False).ids)

        return QwenVLVideo(bundle.model_type, video_params(bundle.model_type, cfg, sampling),
                           {k: int(v) for k, v in ids.items() if v is not None}, encode,
                           backend or geometry.resolve_backend(ImageBackend.AUTO))

    @property
    def fingerprint(self) -> str:
        """Identifies the model and every preprocessing setting (cache and hash key)."""
        return self.image.fingerprint

    @property
    def reserved_tokens(self) -> tuple[str, ...]:
        """Token strings this family uses as anchors, placeholders or media-structure markers
        (``<|image_pad|>``, ``<|video_pad|>``, ``<|vision_start|>``, ``<|vision_end|>``): caller text
        may never contain them (:mod:`mmgate.chat.integrity`), with or without video support."""
        return (self.image_token, *self.video_tokens)


FAMILY = QwenVLFamily
