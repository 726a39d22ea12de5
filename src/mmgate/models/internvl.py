"""The InternVL3 family (HF format, ``model_type`` ``internvl``): 448-px crops chosen by aspect ratio, plus a thumbnail.

Stage: plan / preprocess / expand (images).  In: an image's decoded size (plan), its RGB pixels
(preprocess); out: the item's ``pixel_values`` share ``[num_patches, 3, 448, 448]`` float32, its
``image_num_patches`` and a token-level prompt update.

Reference (transformers 5.24), exact for both image backends:

* ``models/got_ocr2/image_processing_got_ocr2.py`` ``GotOcr2ImageProcessor`` (torchvision backend,
  ``AutoProcessor``'s pick when torchvision imports) and ``image_processing_pil_got_ocr2.py``
  ``GotOcr2ImageProcessorPil``, with ``crop_to_patches=True`` (``InternVLProcessor.images_kwargs``,
  over the bundle's ``false``): ``get_optimal_tiled_canvas`` picks ``(cols, rows)`` among the
  grids of ``min_patches..max_patches`` tiles (1..12) closest in aspect ratio (ties: the later grid
  while the image's area exceeds half the grid's); ``crop_image_to_patches`` resizes the image to
  ``(rows*448, cols*448)`` (bicubic, ``resample`` 3, the backend's kernel), cuts it row-major into
  448x448 patches and, when there is more than one, appends the whole image resized to 448x448
  (the thumbnail); rescale + normalize (ImageNet mean / std).
* ``models/internvl/processing_internvl.py`` ``InternVLProcessor``: the template leaves
  ``<IMG_CONTEXT>`` once per image; ``replace_image_token`` gives ``<img>`` +
  ``<IMG_CONTEXT>`` x ``256 * num_patches`` + ``</img>``.  All three are special tokens, so the
  update is token-level (the ids do not depend on the neighbouring text).

Wire layout on vLLM (vLLM 0.33 ``vllm/model_executor/models/interns1.py``, which serves the HF-format
``InternVLForConditionalGeneration``; ``internvl.py`` is the remote-code ``InternVLChatModel``):
``InternS1MultiModalProcessor._get_mm_fields_config``: ``pixel_values``
``flat_from_sizes("image", image_num_patches)``, ``image_num_patches`` batched, ``image_token_id``
``shared`` (the ``<IMG_CONTEXT>`` id); nothing kept on CPU.  ``_get_prompt_updates``
``get_replacement_interns1_image``: ``PromptUpdateDetails.select_text(<img> + ctx * n + </img>,
<IMG_CONTEXT>``): the placeholder range is the whole replacement and ``is_embed`` marks the
context tokens (here: ``embed_offset`` 0, ``embed_length`` = ``num_tokens + 2``).

Video (``<video>``, ``Frame{i}: <img>…</img>`` text, vLLM's ``<video>`` context ids): :mod:`mmgate.models.internvl_video`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from mmgate.chat.tokenizer import BundleTokenizer
from mmgate.errors import ErrorCode, GatewayError
from mmgate.models import geometry
from mmgate.models.backend import FrameSampling, ImageBackend
from mmgate.models.bundle import ModelBundle
from mmgate.models.family import ImageVideoFamily
from mmgate.models.image_rows import RowNormalizer
from mmgate.models.internvl_video import InternVLVideo
from mmgate.models.llava import check_no_hints
from mmgate.types import DecodedImage, ItemHints, ItemPlan, Modality, Replacement, TensorLayout, TensorSpec

__all__ = ["FAMILY", "InternVLFamily", "InternVLImageParams", "InternVLImages", "InternVLTokens",
           "optimal_tiled_canvas", "supported_grids"]


@dataclass(frozen=True, slots=True)
class InternVLImageParams:
    """Every image-preprocessing parameter, as the reference resolves it from the bundle."""

    height: int  # size["height"] (one patch)
    width: int  # size["width"]
    resample: int  # PILImageResampling value (3: bicubic)
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    crop_to_patches: bool  # InternVLProcessor.images_kwargs: True
    min_patches: int
    max_patches: int
    image_seq_length: int  # context tokens per patch (processor_config / config image_seq_length)


@dataclass(frozen=True, slots=True)
class InternVLTokens:
    """Token ids of the media markers (tokenizer ``extra_special_tokens``)."""

    start: int  # <img>
    end: int  # </img>
    context: int  # <IMG_CONTEXT>: the image anchor and the embedding token (HF image_token_id)
    video: int  # <video>: the clip anchor; vLLM's video embedding token (id 151674, added at load)


def _floats(value: Any, default: tuple[float, ...]) -> tuple[float, ...]:
    if value is None:
        return default
    return tuple(float(v) for v in (value if isinstance(value, (list, tuple)) else [value] * 3))


def image_params_from_bundle(bundle: ModelBundle) -> InternVLImageParams:
    """Resolve parameters like ``GotOcr2ImageProcessor.__init__`` + ``InternVLProcessor`` (5.24).

    Raises:
        GatewayError(INTERNAL_ERROR): a configuration the gateway does not serve (``do_resize`` or
            ``do_convert_rgb`` false, a size without height and width, ``min_patches`` > ``max_patches``).
    """
    cfg = bundle.preprocessor_config or dict(bundle.processor_config.get("image_processor") or {})
    size = cfg.get("size") or {"height": 384, "width": 384}  # GotOcr2ImageProcessor.size
    if not isinstance(size, Mapping) or not size.get("height") or not size.get("width"):
        raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: internvl size needs height and width")
    if cfg.get("do_resize") is False or cfg.get("do_convert_rgb") is False:
        raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: internvl without resize or RGB "
                           "conversion is not supported")
    lo, hi = int(cfg.get("min_patches", 1)), int(cfg.get("max_patches", 12))
    if not 1 <= lo <= hi:
        raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: min_patches {lo} > max_patches {hi}")
    seq = bundle.processor_config.get("image_seq_length") or bundle.config.get("image_seq_length") or 256
    clip = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)  # OPENAI_CLIP_MEAN / STD
    return InternVLImageParams(
        height=int(size["height"]), width=int(size["width"]),
        resample=int(cfg.get("resample", geometry.RESAMPLE_BICUBIC)),
        do_rescale=bool(cfg.get("do_rescale", True)), rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
        do_normalize=bool(cfg.get("do_normalize", True)),
        image_mean=_floats(cfg.get("image_mean"), clip[0]), image_std=_floats(cfg.get("image_std"), clip[1]),
        crop_to_patches=True, min_patches=lo, max_patches=hi, image_seq_length=int(seq),
    )


@lru_cache(maxsize=16)
def supported_grids(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """``(cols, rows)`` grids of ``min_tiles..max_tiles`` tiles, sorted by tile count (stable).

    Port of transformers 5.24 ``got_ocr2/image_processing_got_ocr2.py``
    ``get_all_supported_aspect_ratios``.  Example: ``supported_grids(1, 4)`` ->
    ``((1, 1), (1, 2), (2, 1), (1, 3), (3, 1), (1, 4), (2, 2), (4, 1))``.
    """
    grids = [(w, h) for w in range(1, max_tiles + 1) for h in range(1, max_tiles + 1)
             if min_tiles <= w * h <= max_tiles]
    return tuple(sorted(grids, key=lambda g: g[0] * g[1]))


def optimal_tiled_canvas(height: int, width: int, tile_hw: tuple[int, int], min_tiles: int,
                         max_tiles: int) -> tuple[int, int]:
    """``(cols, rows)`` of the tile grid for a ``height`` x ``width`` image.

    Port of transformers 5.24 ``get_optimal_tiled_canvas`` (same float operations): the grid whose
    aspect ratio ``cols / rows`` is closest to ``width / height``; on a tie the later grid (more
    tiles) while the image's area exceeds half the grid's area.
    Example (448-px tiles, 1..12): 900 x 400 (w x h) -> ratio 2.25 -> (2, 1).
    """
    aspect = width / height
    area = width * height
    best_diff = float("inf")
    best = (1, 1)
    for grid in supported_grids(min_tiles, max_tiles):
        diff = abs(aspect - grid[0] / grid[1])
        if diff < best_diff:
            best_diff, best = diff, grid
        elif diff == best_diff and area > 0.5 * tile_hw[0] * tile_hw[1] * grid[0] * grid[1]:
            best = grid
    return best


class InternVLImages:
    """The image processor of InternVL3 (see module docstring)."""

    modality = Modality.IMAGE
    device_normalizable = True  # a worker may normalize the raw uint8 pixels itself (float32, as the reference)
    specs: tuple[TensorSpec, ...] = (
        TensorSpec("pixel_values", "float32", TensorLayout.FLAT, sizes_key="image_num_patches", primary=True),
        TensorSpec("image_num_patches", "int64", TensorLayout.BATCHED),
        TensorSpec("image_token_id", "int64", TensorLayout.SHARED),
    )

    def __init__(self, model_type: str, params: InternVLImageParams, tokens: InternVLTokens,
                 backend: ImageBackend) -> None:
        self.model_type = model_type
        self.params = params
        self.tokens = tokens
        self.backend = backend
        p = params
        lut = geometry.normalize_lut(backend, p.rescale_factor, p.image_mean, p.image_std, p.do_rescale,
                                     p.do_normalize)
        self._normalizer = RowNormalizer.for_table(lut, p.rescale_factor, p.image_mean, p.image_std,
                                                   p.do_rescale, p.do_normalize)

    @property
    def anchor_token_id(self) -> int:
        """``<IMG_CONTEXT>``: what the chat template leaves once per image."""
        return self.tokens.context

    @property
    def placeholder_token_id(self) -> int:
        """``<IMG_CONTEXT>`` (config ``image_token_id``; vLLM ``im_token_id``)."""
        return self.tokens.context

    @property
    def fingerprint(self) -> str:
        """The model and every preprocessing setting that shapes this processor's output (cache and hash key)."""
        return f"internvl:{self.model_type}:{self.backend.value}:{self.params!r}"

    def check_hints(self, hints: ItemHints, param: str) -> None:
        """Refuse what InternVL3 does not take here, before any fetch.

        Raises:
            GatewayError(INVALID_REQUEST): ``max_long_side_pixel`` (every patch is 448x448) or any
                ``mm_processor_kwargs`` (none is taken per request).
        """
        check_no_hints(hints, param, self.model_type)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """``(cols, rows)`` of the crops (``(1, 1)`` without cropping)."""
        p = self.params
        if not (p.crop_to_patches and p.max_patches > 1):
            return 1, 1
        return optimal_tiled_canvas(height, width, (p.height, p.width), p.min_patches, p.max_patches)

    def plan(self, height: int, width: int, hints: ItemHints | None = None) -> ItemPlan:
        """One image: its crops (row-major) and, with more than one, the thumbnail.

        ``detail`` = ``(cols, rows)``; ``resized_hw`` the canvas ``(rows*448, cols*448)``;
        ``num_tokens`` = ``256 * num_patches`` context tokens, ``num_patches`` = ``cols*rows``
        (+1 thumbnail when above 1).  Example: 900 x 400 -> 2 x 1 crops + thumbnail: 3 patches, 768.

        Raises:
            GatewayError(MEDIA_DECODE_FAILED): a zero-sized side.
        """
        if min(height, width) <= 0:
            raise GatewayError(ErrorCode.MEDIA_DECODE_FAILED, "image has a zero-sized side")
        p = self.params
        cols, rows = self.grid(height, width)
        patches = cols * rows + (1 if cols * rows > 1 else 0)
        return ItemPlan(
            modality=Modality.IMAGE, original_hw=(height, width), resized_hw=(rows * p.height, cols * p.width),
            num_tokens=patches * p.image_seq_length,
            shapes=(("pixel_values", (patches, 3, p.height, p.width)), ("image_num_patches", ()),
                    ("image_token_id", ())),
            detail=(cols, rows),
        )

    def plan_tensors(self, plan: ItemPlan) -> dict[str, np.ndarray]:
        """``image_num_patches`` (the item's ``pixel_values`` rows) and ``image_token_id``
        (``<IMG_CONTEXT>``; vLLM's shared key)."""
        return {"image_num_patches": np.array(plan.primary_shape[0], dtype=np.int64),
                "image_token_id": np.array(self.tokens.context, dtype=np.int64)}

    def patches(self, pixels: np.ndarray, plan: ItemPlan) -> list[np.ndarray]:
        """uint8 ``[h, w, 3]`` -> the item's uint8 ``[448, 448, 3]`` patches in the reference's order
        (``crop_image_to_patches``: canvas crops row-major, then the thumbnail)."""
        p = self.params
        cols, rows = plan.detail
        canvas = self._resized(pixels, plan.resized_hw)
        out = [canvas[r * p.height:(r + 1) * p.height, c * p.width:(c + 1) * p.width]
               for r in range(rows) for c in range(cols)]
        if len(out) > 1:
            out.append(self._resized(pixels, (p.height, p.width)))
        return out

    def _resized(self, pixels: np.ndarray, size_hw: tuple[int, int]) -> np.ndarray:
        """``pixels`` resized to ``size_hw`` (as they are when already that size: PIL returns a copy,
        torchvision the input, so the values are the same)."""
        if pixels.shape[:2] == tuple(size_hw):
            return pixels
        return geometry.resize_uint8(pixels, size_hw, self.params.resample, self.backend)

    def preprocess(self, image: DecodedImage, plan: ItemPlan, raw: bool = False) -> np.ndarray:
        """The item's ``pixel_values`` share ``[num_patches, 3, 448, 448]``: normalized float32 values,
        or with ``raw`` the uint8 pixels in the same layout."""
        p = self.params
        out = np.empty(plan.primary_shape, dtype=np.uint8 if raw else np.float32)
        for k, patch in enumerate(self.patches(image.pixels, plan)):
            chw = np.moveaxis(patch, 2, 0)
            if raw:
                out[k] = chw
            else:
                src = np.ascontiguousarray(chw).reshape(1, 3, p.height * p.width)
                self._normalizer(src, out[k].reshape(1, 3, p.height * p.width))
        return out

    def expand(self, plan: ItemPlan) -> Replacement:
        """``<img>`` + ``<IMG_CONTEXT>`` x ``num_tokens`` + ``</img>`` replacing the anchor; the
        range is the whole run (vLLM ``select_text``), the context tokens its embedding positions."""
        t = self.tokens
        ids = (t.start,) + (t.context,) * plan.num_tokens + (t.end,)
        return Replacement(token_ids=ids, embed_offset=0, embed_length=len(ids))


def read_tokens(bundle: ModelBundle, tokenizer: BundleTokenizer) -> tuple[InternVLTokens, dict[str, str]]:
    """The media-marker ids and strings (``tokenizer_config.json`` ``extra_special_tokens``, the
    names ``InternVLProcessor.__init__`` reads).

    Raises:
        GatewayError(INTERNAL_ERROR): a marker missing from the tokenizer, or ``<IMG_CONTEXT>``'s id
            disagreeing with ``config.json`` ``image_token_id``.
    """
    extra = bundle.tokenizer_config.get("extra_special_tokens") or {}
    extra = extra if isinstance(extra, dict) else {}
    defaults = {"start_image_token": "<img>", "end_image_token": "</img>",
                "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
    texts = {k: str(extra.get(k) or v) for k, v in defaults.items()}
    ids: dict[str, int] = {}
    for key, text in texts.items():
        token_id = tokenizer.token_id(text)
        if token_id is None:
            raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: {text} is not a token")
        ids[key] = token_id
    config_id = bundle.config.get("image_token_id")
    if config_id is not None and int(config_id) != ids["context_image_token"]:
        raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: {texts['context_image_token']} id "
                           f"{ids['context_image_token']} disagrees with config image_token_id {config_id}")
    tokens = InternVLTokens(start=ids["start_image_token"], end=ids["end_image_token"],
                            context=ids["context_image_token"], video=ids["video_token"])
    return tokens, texts


class InternVLFamily(ImageVideoFamily[InternVLImages, InternVLVideo]):
    """InternVL3 (``internvl``): images, and video where the clip processor loads
    (:mod:`mmgate.models.internvl_video`)."""

    model_types = ("internvl",)
    limits: Mapping[Modality, int] = {Modality.IMAGE: 16, Modality.VIDEO: 1}
    #: the clip's context ids are vLLM's ``<video>`` (151674, past the embedding table), as vLLM's
    #: ``interns1.py`` rewrites them (:mod:`mmgate.models.internvl_video`): only a vLLM worker embeds them
    vllm_video_ids = True
    text_updates = frozenset({Modality.VIDEO})  # the clip's Frame{i}: text (images: token-level)

    @classmethod
    def from_bundle(cls, bundle: ModelBundle, tokenizer: BundleTokenizer, backend: ImageBackend,
                    video_backend: ImageBackend | None = None,
                    video_sampling: FrameSampling = FrameSampling.VLLM) -> InternVLFamily:
        """Read every parameter from the bundle (see :func:`image_params_from_bundle`, :func:`read_tokens`)."""
        tokens, texts = read_tokens(bundle, tokenizer)
        images = InternVLImages(bundle.model_type, image_params_from_bundle(bundle), tokens,
                                geometry.resolve_backend(backend))
        video = None
        from mmgate.media.video import av_available

        if av_available() and bundle.video_preprocessor_config:
            from mmgate.models.internvl_video import load_video

            video = load_video(bundle, (texts["start_image_token"], texts["video_token"], texts["end_image_token"]),
                               tokens.video, images.params.image_seq_length,
                               video_backend or geometry.resolve_backend(ImageBackend.AUTO), video_sampling)
        return cls(images, video, 16, 1, tuple(texts.values()))


FAMILY = InternVLFamily
