"""The Gemma 3 family: SigLIP 896x896 images, with optional pan-and-scan crops.

Stage: plan / preprocess / expand for ``model_type`` ``gemma3`` (images only).  In: an image's
decoded size and the request's ``mm_processor_kwargs`` (plan), its RGB pixels (preprocess);
out: the item's ``pixel_values`` share ``[1 + num_crops, 3, 896, 896]`` float32, its
``num_patches`` (= ``num_crops + 1``) and a *text-level* prompt update.

Reference (transformers 5.24), exact for both image backends:

* ``models/gemma3/image_processing_gemma3.py`` ``Gemma3ImageProcessor`` (torchvision backend,
  what ``AutoProcessor`` picks when torchvision imports) and
  ``image_processing_pil_gemma3.py`` ``Gemma3ImageProcessorPil``: convert to RGB, optional
  ``pan_and_scan`` (crops of the *original* image), resize the image and each crop to
  ``size`` (bilinear, ``resample`` 2) with the backend's kernel, rescale + normalize
  (mean = std = 0.5); ``pixel_values`` lists the image, then its crops.
* ``models/gemma3/processing_gemma3.py`` ``Gemma3Processor``: the template's anchor is
  ``<start_of_image>`` (boi); ``replace_image_token`` replaces its *text* by
  ``full_image_sequence`` = ``"\\n\\n<start_of_image>" + "<image_soft_token>" * 256 +
  "<end_of_image>\\n\\n"`` (with crops: ``"Here is the original image " + full + " and here
  are some crops to help you see better " + " ".join([full] * num_crops)``) and tokenizes the
  whole prompt, so the newline ids depend on the neighbouring text (``"\\n\\n"`` after a
  ``"\\n\\n"`` is one ``"\\n\\n\\n\\n"`` token).  The reference call is
  ``processor.apply_chat_template(messages, tokenize=True)`` = ``processor(text=rendered,
  images=..., add_special_tokens=False)`` (the rendered prompt starts with ``<bos>``);
  ``processor(text=rendered)`` without that flag adds a second ``<bos>``.
* ``mm_processor_kwargs`` (per request, :meth:`Gemma3Images.check_hints`): the four
  ``Gemma3ImageProcessorKwargs`` (``do_pan_and_scan``, ``pan_and_scan_min_crop_size``,
  ``pan_and_scan_max_num_crops``, ``pan_and_scan_min_ratio_to_activate``); unset ones come
  from ``preprocessor_config.json`` and, where null there, from ``Gemma3Processor.images_kwargs``
  (False, 256, 4, 1.2), as vLLM ``Gemma3ProcessingInfo._resolve_image_kwargs`` resolves them.

Wire layout: exactly the tensors vLLM's processor produces (vLLM
``vllm/model_executor/models/gemma3_mm.py``, ``Gemma3MultiModalProcessor._call_hf_processor`` and
``_get_mm_fields_config``, as of the 0.33 line): ``pixel_values`` flat,
``flat_from_sizes("image", num_patches)``, and ``num_patches`` = ``num_crops + 1`` batched (what
``Gemma3ImagePixelInputs`` reads); nothing kept on CPU.  No ``num_crops`` tensor: transformers'
``Gemma3Processor.__call__`` pops it from the image processor's output and vLLM adds
``num_patches`` instead (vLLM 0.11 still declared a batched ``num_crops``; mmgate sent it until
issue 24).  ``im_token_id`` = ``<image_soft_token>``.

Placeholder range: vLLM's ``get_image_repl`` returns
``PromptUpdateDetails.select_token_id(repl_full, image_token_id)`` for the *whole*
replacement, and ``Gemma3MultiModalProcessor._find_mm_placeholders`` splits merged
``"\\n\\n\\n"`` / ``"\\n\\n\\n\\n"`` tokens to find it, then maps the start back to the merged
token: the range runs from the token holding the leading ``"\\n\\n"`` (with crops: the first
token of ``"Here is the original image"``) to the token holding the trailing ``"\\n\\n"``;
``is_embed`` marks the soft tokens.  In :class:`~mmgate.types.Replacement` terms:
``embed_offset`` = 2 (``"\\n\\n"``, boi) without crops, the tokens of ``"Here is the original
image \\n\\n"`` + 1 with crops; ``trail`` = 2 (eoi, ``"\\n\\n"``).  Two adjacent images share
their ``"\\n\\n\\n\\n"`` token, so their ranges overlap by one token, as in vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmgate.chat.tokenizer import BundleTokenizer
from mmgate.errors import ErrorCode, GatewayError
from mmgate.models import geometry
from mmgate.models.bundle import ModelBundle
from mmgate.models.family import ImageOnlyFamily
from mmgate.models.image_rows import RowNormalizer
from mmgate.models.processor_options import check_option_types, option_error
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

__all__ = ["FAMILY", "Gemma3Family", "Gemma3ImageParams", "Gemma3Images", "PanAndScan", "pan_and_scan_grid"]

# transformers 5.24 Gemma3Processor.images_kwargs (used where preprocessor_config.json has null)
_PROCESSOR_DEFAULTS: dict[str, Any] = {
    "do_pan_and_scan": False,
    "pan_and_scan_min_crop_size": 256,
    "pan_and_scan_max_num_crops": 4,
    "pan_and_scan_min_ratio_to_activate": 1.2,
}
#: ``mm_processor_kwargs`` names taken per request -> accepted Python types
#: (:func:`mmgate.models.processor_options.check_option_types`)
_OPTION_TYPES: dict[str, tuple[type, ...]] = {
    "do_pan_and_scan": (bool,),
    "pan_and_scan_min_crop_size": (int,),
    "pan_and_scan_max_num_crops": (int,),
    "pan_and_scan_min_ratio_to_activate": (float, int),
}
#: gateway bound on ``pan_and_scan_max_num_crops`` (each crop is 3 x 896 x 896 float32 = 9.6 MB
#: and 256 tokens); the reference has none
MAX_PAN_AND_SCAN_CROPS = 16
#: vLLM ``Gemma3ProcessingInfo.get_image_repl`` / transformers ``Gemma3Processor.replace_image_token``
_CROPS_INTRO = "Here is the original image "
_CROPS_MIDDLE = " and here are some crops to help you see better "


@dataclass(frozen=True, slots=True)
class PanAndScan:
    """Pan-and-scan settings (``Gemma3ImageProcessorKwargs``)."""

    enabled: bool  # do_pan_and_scan
    min_crop_size: int  # pan_and_scan_min_crop_size
    max_num_crops: int  # pan_and_scan_max_num_crops
    min_ratio_to_activate: float  # pan_and_scan_min_ratio_to_activate


@dataclass(frozen=True, slots=True)
class Gemma3ImageParams:
    """Every image-preprocessing parameter, as the reference resolves it from the bundle."""

    height: int  # size["height"]
    width: int  # size["width"]
    resample: int  # PILImageResampling value (2: bilinear)
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    image_seq_length: int  # soft tokens per image or crop (config mm_tokens_per_image)
    pan_and_scan: PanAndScan  # the bundle's defaults; a request may override them


def _resolved(cfg: Mapping[str, Any], key: str) -> Any:
    value = cfg.get(key)
    return _PROCESSOR_DEFAULTS[key] if value is None else value


def image_params_from_bundle(bundle: ModelBundle) -> Gemma3ImageParams:
    """Resolve parameters like ``Gemma3ImageProcessor.__init__`` + ``Gemma3Processor`` (5.24).

    Raises:
        GatewayError(INTERNAL_ERROR): a configuration the reference cannot run or the gateway does
            not serve (``do_resize`` / ``do_convert_rgb`` false, a size without height and width,
            ``image_seq_length`` disagreeing with ``mm_tokens_per_image``).
    """
    cfg = bundle.preprocessor_config or dict(bundle.processor_config.get("image_processor") or {})
    size = cfg.get("size") or {"height": 224, "width": 224}  # class default
    if not isinstance(size, Mapping) or not size.get("height") or not size.get("width"):
        raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: gemma3 size needs height and width")
    if cfg.get("do_resize") is False or cfg.get("do_convert_rgb") is False:
        raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: gemma3 without resize or RGB "
                           "conversion is not supported")
    seq = (bundle.processor_config.get("image_seq_length") or cfg.get("image_seq_length")
           or bundle.config.get("mm_tokens_per_image") or 256)
    model_seq = bundle.config.get("mm_tokens_per_image")
    if model_seq is not None and int(model_seq) != int(seq):
        raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: image_seq_length {seq} != "
                           f"mm_tokens_per_image {model_seq}")
    mean = cfg.get("image_mean", (0.5, 0.5, 0.5))  # IMAGENET_STANDARD_MEAN
    std = cfg.get("image_std", (0.5, 0.5, 0.5))
    return Gemma3ImageParams(
        height=int(size["height"]), width=int(size["width"]),
        resample=int(cfg.get("resample", geometry.RESAMPLE_BILINEAR)),
        do_rescale=bool(cfg.get("do_rescale", True)), rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
        do_normalize=bool(cfg.get("do_normalize", True)),
        image_mean=tuple(float(v) for v in (mean if isinstance(mean, (list, tuple)) else [mean] * 3)),
        image_std=tuple(float(v) for v in (std if isinstance(std, (list, tuple)) else [std] * 3)),
        image_seq_length=int(seq),
        pan_and_scan=PanAndScan(
            enabled=bool(_resolved(cfg, "do_pan_and_scan")),
            min_crop_size=int(_resolved(cfg, "pan_and_scan_min_crop_size")),
            max_num_crops=int(_resolved(cfg, "pan_and_scan_max_num_crops")),
            min_ratio_to_activate=float(_resolved(cfg, "pan_and_scan_min_ratio_to_activate")),
        ),
    )


def pan_and_scan_grid(height: int, width: int, pas: PanAndScan) -> tuple[int, int, int, int] | None:
    """``(rows, cols, crop_h, crop_w)`` of the crops of a ``height`` x ``width`` image, or None.

    Port of transformers 5.24 ``Gemma3ImageProcessor.pan_and_scan_batched`` /
    ``Gemma3ImageProcessorPil.pan_and_scan`` (same float operations): crops along the long side
    only, when its ratio to the short side reaches ``min_ratio_to_activate``; their count is the
    ratio rounded half up, at most ``long // min_crop_size``, clamped to
    ``[2, max_num_crops]``; none when a crop side would be under ``min_crop_size``.
    Example (defaults 256 / 4 / 1.2): 1500 x 480 (w x h) -> ratio 3.125 -> 3 crops of 480 x 500.
    """
    if width >= height:
        if width / height < pas.min_ratio_to_activate:
            return None
        cols = math.floor(width / height + 0.5)
        cols = min(math.floor(width / pas.min_crop_size), cols)
        cols = min(pas.max_num_crops, max(2, cols))
        rows = 1
    else:
        if height / width < pas.min_ratio_to_activate:
            return None
        rows = math.floor(height / width + 0.5)
        rows = min(math.floor(height / pas.min_crop_size), rows)
        rows = min(pas.max_num_crops, max(2, rows))
        cols = 1
    crop_w = math.ceil(width / cols)
    crop_h = math.ceil(height / rows)
    if min(crop_w, crop_h) < pas.min_crop_size:
        return None
    return rows, cols, crop_h, crop_w


def crop_boxes(plan: ItemPlan) -> list[tuple[int, int, int, int]]:
    """``(top, left, height, width)`` of each crop of ``plan``, row-major, as the reference slices
    ``image[..., top:top + crop_h, left:left + crop_w]`` (the last row / column may be shorter)."""
    count, rows, cols, crop_h, crop_w = plan.detail
    if not count:
        return []
    h, w = plan.original_hw
    return [(crop_h * r, crop_w * c, min(crop_h, h - crop_h * r), min(crop_w, w - crop_w * c))
            for r in range(rows) for c in range(cols)]


class Gemma3Images:
    """The image processor of Gemma 3 (see module docstring)."""

    modality = Modality.IMAGE
    device_normalizable = True  # a worker may normalize the raw uint8 pixels itself (float32, as the reference)
    specs: tuple[TensorSpec, ...] = (
        TensorSpec("pixel_values", "float32", TensorLayout.FLAT, sizes_key="num_patches", primary=True),
        TensorSpec("num_patches", "int64", TensorLayout.BATCHED),
    )

    def __init__(self, model_type: str, params: Gemma3ImageParams, tokens: Mapping[str, int],
                 texts: Mapping[str, str], intro_tokens: int, backend: ImageBackend) -> None:
        """``tokens`` / ``texts``: ids and strings of ``boi``, ``eoi`` and ``image`` (the soft token);
        ``intro_tokens``: tokens of ``"Here is the original image \\n\\n"`` alone."""
        self.model_type = model_type
        self.params = params
        self.backend = backend
        self._boi_id, self._image_id = tokens["boi"], tokens["image"]
        self._intro_tokens = intro_tokens
        p = params
        self._full_sequence = ("\n\n" + texts["boi"] + texts["image"] * p.image_seq_length + texts["eoi"] + "\n\n")
        lut = geometry.normalize_lut(backend, p.rescale_factor, p.image_mean, p.image_std, p.do_rescale,
                                     p.do_normalize)
        self._normalizer = RowNormalizer.for_table(lut, p.rescale_factor, p.image_mean, p.image_std,
                                                   p.do_rescale, p.do_normalize)

    @property
    def anchor_token_id(self) -> int:
        """``<start_of_image>``: what the chat template leaves once per image."""
        return self._boi_id

    @property
    def placeholder_token_id(self) -> int:
        """``<image_soft_token>`` (config ``image_token_index``; vLLM ``im_token_id``)."""
        return self._image_id

    @property
    def fingerprint(self) -> str:
        return f"gemma3:{self.model_type}:{self.backend.value}:{self.params!r}"

    # -- hints --------------------------------------------------------------------------------

    def check_hints(self, hints: ItemHints, param: str) -> None:
        """Refuse what Gemma 3 does not take, before any fetch.

        Raises:
            GatewayError(INVALID_REQUEST): ``max_long_side_pixel`` (every image is resized to
                896x896; param ``<item>.max_long_side_pixel``); an ``mm_processor_kwargs`` key
                other than the four pan-and-scan ones, or one of a wrong type or out of range
                (param ``mm_processor_kwargs.<key>``).
        """
        if hints.max_long_side_pixel is not None:
            raise GatewayError(ErrorCode.INVALID_REQUEST, f"{self.model_type} resizes every image to "
                               f"{self.params.height}x{self.params.width}; max_long_side_pixel is not supported",
                               param + ".max_long_side_pixel")
        check_option_types(hints, _OPTION_TYPES, self.model_type)
        pas = self.pan_and_scan(hints)
        if pas.min_crop_size < 1:
            raise option_error("pan_and_scan_min_crop_size", "pan_and_scan_min_crop_size must be at least 1")
        if not 1 <= pas.max_num_crops <= MAX_PAN_AND_SCAN_CROPS:
            raise option_error("pan_and_scan_max_num_crops",
                               f"pan_and_scan_max_num_crops must be within [1, {MAX_PAN_AND_SCAN_CROPS}]")
        if not math.isfinite(pas.min_ratio_to_activate):
            raise option_error("pan_and_scan_min_ratio_to_activate",
                               "pan_and_scan_min_ratio_to_activate must be a finite number")

    def pan_and_scan(self, hints: ItemHints | None) -> PanAndScan:
        """The bundle's pan-and-scan settings with ``hints.options`` applied (checked by
        :meth:`check_hints`)."""
        base = self.params.pan_and_scan
        if hints is None or not hints.options:
            return base
        return PanAndScan(
            enabled=bool(hints.option("do_pan_and_scan", base.enabled)),
            min_crop_size=int(hints.option("pan_and_scan_min_crop_size", base.min_crop_size)),  # type: ignore[arg-type]
            max_num_crops=int(hints.option("pan_and_scan_max_num_crops", base.max_num_crops)),  # type: ignore[arg-type]
            min_ratio_to_activate=float(
                hints.option("pan_and_scan_min_ratio_to_activate", base.min_ratio_to_activate)),  # type: ignore[arg-type]
        )

    # -- plan ---------------------------------------------------------------------------------

    def plan(self, height: int, width: int, hints: ItemHints | None = None) -> ItemPlan:
        """One image: the image plus its pan-and-scan crops, each resized to 896x896.

        ``detail`` = ``(num_crops, rows, cols, crop_h, crop_w)`` (zeros without crops);
        ``num_tokens`` = ``(1 + num_crops) * 256`` soft tokens.

        Raises:
            GatewayError(INVALID_REQUEST): pan-and-scan settings that would cut an empty crop
                (only with a tiny ``pan_and_scan_min_crop_size``, e.g. 6x1 with 1: crops of 2 at
                0, 2, 4, 6).  ``Gemma3ImageProcessor`` fails there (RuntimeError); the PIL class
                returns a black tile for the empty crop, which mmgate does not copy.
        """
        if min(height, width) <= 0:
            raise GatewayError(ErrorCode.MEDIA_DECODE_FAILED, "image has a zero-sized side")
        p = self.params
        pas = self.pan_and_scan(hints)
        grid = pan_and_scan_grid(height, width, pas) if pas.enabled else None
        rows, cols, crop_h, crop_w = grid or (0, 0, 0, 0)
        if grid is not None and ((rows - 1) * crop_h >= height or (cols - 1) * crop_w >= width):
            raise option_error("pan_and_scan_min_crop_size", f"pan-and-scan settings cut an empty crop from a "
                               f"{width}x{height} image")
        crops = rows * cols
        return ItemPlan(
            modality=Modality.IMAGE, original_hw=(height, width), resized_hw=(p.height, p.width),
            num_tokens=(1 + crops) * p.image_seq_length,
            shapes=(("pixel_values", (1 + crops, 3, p.height, p.width)), ("num_patches", ())),
            detail=(crops, rows, cols, crop_h, crop_w),
        )

    def plan_tensors(self, plan: ItemPlan) -> dict[str, np.ndarray]:
        """``num_patches`` (= ``num_crops + 1``, the item's ``pixel_values`` rows; vLLM's name and
        value, see the module docstring)."""
        return {"num_patches": np.array(plan.detail[0] + 1, dtype=np.int64)}

    # -- preprocess ---------------------------------------------------------------------------

    def _resized(self, pixels: np.ndarray) -> np.ndarray:
        """uint8 ``[h, w, 3]`` -> ``[896, 896, 3]`` (as it is when already that size: PIL returns a
        copy, torchvision the input, so the values are the same)."""
        p = self.params
        if pixels.shape[:2] == (p.height, p.width):
            return pixels
        return geometry.resize_uint8(pixels, (p.height, p.width), p.resample, self.backend)

    def preprocess(self, image: DecodedImage, plan: ItemPlan, raw: bool = False) -> np.ndarray:
        """The item's ``pixel_values`` share ``[1 + num_crops, 3, 896, 896]``: the whole image, then its
        crops (cut from the decoded pixels, each resized on its own), normalized float32 values, or
        with ``raw`` the resized uint8 pixels."""
        p = self.params
        out = np.empty(plan.primary_shape, dtype=np.uint8 if raw else np.float32)
        parts = [image.pixels] + [image.pixels[t:t + h, left:left + w] for t, left, h, w in crop_boxes(plan)]
        for k, part in enumerate(parts):
            chw = np.moveaxis(self._resized(part), 2, 0)  # [3, H, W] view
            if raw:
                out[k] = chw
            else:
                src = np.ascontiguousarray(chw).reshape(1, 3, p.height * p.width)
                self._normalizer(src, out[k].reshape(1, 3, p.height * p.width))
        return out

    # -- expand -------------------------------------------------------------------------------

    def expand(self, plan: ItemPlan) -> Replacement:
        """The text replacing this image's ``<start_of_image>`` (``Gemma3Processor.replace_image_token``),
        with vLLM's placeholder range (module docstring)."""
        crops = plan.detail[0]
        if not crops:
            return Replacement(token_ids=(), embed_offset=2, embed_length=plan.num_tokens,
                               text=self._full_sequence, trail=2)
        text = _CROPS_INTRO + self._full_sequence + _CROPS_MIDDLE + " ".join([self._full_sequence] * crops)
        return Replacement(token_ids=(), embed_offset=self._intro_tokens + 1, embed_length=plan.num_tokens,
                           text=text, trail=2)


class Gemma3Family(ImageOnlyFamily[Gemma3Images]):
    """Gemma 3 (``gemma3``): images; no video."""

    model_types = ("gemma3",)
    limits: Mapping[Modality, int] = {Modality.IMAGE: 16}
    text_updates = frozenset({Modality.IMAGE})  # Gemma3Images.expand: text, re-tokenized with the prompt
    #: transformers ``GemmaTokenizer`` extra special tokens and their defaults
    token_keys = (("boi", "boi_token", "boi_token_index", "<start_of_image>"),
                  ("eoi", "eoi_token", "eoi_token_index", "<end_of_image>"),
                  ("image", "image_token", "image_token_index", "<image_soft_token>"))

    @classmethod
    def from_bundle(cls, bundle: ModelBundle, tokenizer: BundleTokenizer, backend: ImageBackend,
                    video_backend: ImageBackend | None = None,
                    video_sampling: FrameSampling = FrameSampling.VLLM) -> Gemma3Family:
        """Read every parameter from the bundle (``video_backend`` is unused: no video).

        Raises:
            GatewayError(INTERNAL_ERROR): a media token missing from the tokenizer or whose id
                disagrees with ``config.json``; see also :func:`image_params_from_bundle`.
        """
        tokens: dict[str, int] = {}
        texts: dict[str, str] = {}
        for key, tok_key, config_key, default in cls.token_keys:
            text = bundle.tokenizer_config.get(tok_key)
            text = text if isinstance(text, str) else default
            token_id = tokenizer.token_id(text)
            config_id = bundle.config.get(config_key)
            if token_id is None or (config_id is not None and int(config_id) != token_id):
                raise GatewayError(ErrorCode.INTERNAL_ERROR,
                                   f"bundle {bundle.name!r}: {text} id {token_id} disagrees with config {config_key}")
            tokens[key], texts[key] = token_id, text
        intro = _CROPS_INTRO + "\n\n"
        intro_tokens = len(tokenizer.tokenizer.encode(intro, add_special_tokens=False).ids)
        images = Gemma3Images(bundle.model_type, image_params_from_bundle(bundle), tokens, texts, intro_tokens,
                              geometry.resolve_backend(backend))
        # ``<start_of_image>``, ``<end_of_image>``, ``<image_soft_token>``: caller text may not hold them
        return cls(images, cls.limits[Modality.IMAGE], (texts["boi"], texts["eoi"], texts["image"]))


FAMILY = Gemma3Family
