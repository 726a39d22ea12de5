"""The LLaVA-1.5 family (``model_type`` ``llava``) and the CLIP preprocessing it shares with LLaVA-NeXT.

Stage: plan / preprocess / expand for images (the family takes no video).  In: a decoded RGB
image (:class:`~mmgate.types.DecodedImage`); out: the item's share of ``pixel_values``
(float32 ``[3, 336, 336]``, CHW) and the ``<image>`` run replacing its anchor.

Reference (transformers 5.24), for both image backends transformers offers for the bundle:
* torchvision: ``models/clip/image_processing_clip.py`` ``CLIPImageProcessor`` (what
  ``AutoProcessor`` picks when torchvision imports) = ``image_processing_backends.py``
  ``TorchvisionBackend._preprocess``: ``resize`` to ``size["shortest_edge"]``
  (``image_transforms.get_resize_output_image_size(default_to_square=False)``: short side 336,
  long side ``int(336 * long / short)``), bicubic, antialiased, on uint8; ``center_crop`` to
  ``crop_size``; fused ``rescale_and_normalize``;
* PIL: ``image_processing_pil_clip.py`` ``CLIPImageProcessorPil`` = ``PilBackend._preprocess``:
  ``PIL.Image.resize``, ``image_transforms.center_crop``, ``rescale`` (float64) and ``normalize``.
Both convert a PIL input with ``image_transforms.convert_to_rgb`` (``do_convert_rgb``), which
:func:`mmgate.media.image.decode_image` ports.
* tokens: ``models/llava/processing_llava.py`` ``LlavaProcessor.replace_image_token``: each
  ``<image>`` becomes ``(h // patch_size) * (w // patch_size) + num_additional_image_tokens``
  copies (h, w of the cropped ``pixel_values``), less one for ``vision_feature_select_strategy``
  ``"default"`` (the CLS feature is dropped): ``24 * 24 + 1 - 1 = 576``.  The reference for ids is
  ``processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`` then
  ``processor(text=prompt, images=[...])``: the processor replaces the anchor *text*, then
  tokenizes; ``<image>`` is a special added token, so splicing token ids gives the same ids, and
  the tokenizer adds the one BOS ``<s>`` (the rendered prompt does not start with it), as
  :meth:`mmgate.chat.tokenizer.BundleTokenizer.encode_prompt` does.

Wire layout: vLLM ``vllm/model_executor/models/llava.py`` (v0.11.0 and v0.19.0, the SMG
servicer's minimum) ``LlavaMultiModalProcessor._get_mm_fields_config``: ``pixel_values``
``MultiModalFieldConfig.batched("image")`` (not ``keep_on_cpu``).  ``BaseLlavaMultiModalProcessor.
_get_prompt_updates``: ``PromptReplacement(target=[image_token_index], replacement=[image_token_index]
* n)``, so the placeholder range is the whole run and every position is an embedding
(``im_token_id`` = ``<image>``, config ``image_token_index`` 32000).

Resource bound (the one deviation from the reference): the shortest-edge resize of a thin strip
is huge (a 1x1000 image becomes 336x336000 before the crop; the reference allocates it).  An
image whose resized size exceeds :data:`MAX_RESIZED_PIXELS` is refused with
``image_aspect_ratio_invalid`` before any pixel is resized (aspect ratio above ~594:1 at 336).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from mmgate.chat.tokenizer import BundleTokenizer
from mmgate.errors import ErrorCode, GatewayError
from mmgate.models import geometry
from mmgate.models.bundle import ModelBundle
from mmgate.models.family import ImageOnlyFamily
from mmgate.models.image_rows import RowNormalizer
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

__all__ = ["MAX_RESIZED_PIXELS", "ClipCropImages", "ClipParams", "ImageTokens", "LlavaFamily", "center_crop",
           "check_no_hints", "chw_values", "clip_params", "crop_span", "image_limit", "image_tokens",
           "shortest_edge_size"]

# transformers 5.24 image_utils OPENAI_CLIP_MEAN / OPENAI_CLIP_STD (CLIPImageProcessor defaults)
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

#: the largest shortest-edge resize (pixels) planned; beyond it an image is refused (module docstring)
MAX_RESIZED_PIXELS = 1 << 26
#: images per request unless the context bounds it lower (:func:`image_limit`)
DEFAULT_IMAGE_LIMIT = 16


@dataclass(frozen=True, slots=True)
class ClipParams:
    """A CLIP-style image processor's settings, as transformers 5.24 resolves them (``SizeDict``)."""

    shortest_edge: int | None  # size["shortest_edge"] (resize keeping the aspect ratio)
    size_hw: tuple[int, int] | None  # size["height"], size["width"] (resize to exactly this)
    crop_hw: tuple[int, int]  # crop_size (height, width)
    do_resize: bool
    do_center_crop: bool
    do_rescale: bool
    do_normalize: bool
    rescale_factor: float
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    resample: int  # PILImageResampling value


def clip_params(cfg: Mapping[str, Any], bundle_name: str) -> ClipParams:
    """Read a ``preprocessor_config.json`` (CLIP defaults for missing keys; ``size`` /
    ``crop_size`` as transformers' ``SizeDict``).

    Raises:
        GatewayError(INTERNAL_ERROR): a ``size`` form this port does not cover (``longest_edge``,
            ``max_height``), or ``do_convert_rgb`` off (decoding always converts to RGB).
    """
    raw_size = cfg.get("size") or {"shortest_edge": 224}
    raw_crop = cfg.get("crop_size") or {"height": 224, "width": 224}
    size = {"shortest_edge": raw_size} if isinstance(raw_size, int) else dict(raw_size)
    crop = {"height": raw_crop, "width": raw_crop} if isinstance(raw_crop, int) else dict(raw_crop)
    shortest = size.get("shortest_edge")
    hw = (size.get("height"), size.get("width"))
    if set(size) - {"shortest_edge", "height", "width"} or (shortest is None and None in hw):
        raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle_name!r}: unsupported image size {size}")
    if cfg.get("do_convert_rgb") is False:
        raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle_name!r}: do_convert_rgb false is not supported")
    return ClipParams(
        shortest_edge=int(shortest) if shortest is not None else None,
        size_hw=None if shortest is not None else (int(hw[0]), int(hw[1])),  # type: ignore[arg-type]
        crop_hw=(int(crop["height"]), int(crop["width"])),
        do_resize=bool(cfg.get("do_resize", True)),
        do_center_crop=bool(cfg.get("do_center_crop", True)),
        do_rescale=bool(cfg.get("do_rescale", True)),
        do_normalize=bool(cfg.get("do_normalize", True)),
        rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
        image_mean=tuple(float(v) for v in cfg.get("image_mean", _CLIP_MEAN)),
        image_std=tuple(float(v) for v in cfg.get("image_std", _CLIP_STD)),
        resample=int(cfg.get("resample", geometry.RESAMPLE_BICUBIC)),
    )


def normalizer_for(p: ClipParams, backend: ImageBackend) -> RowNormalizer:
    """The exact uint8 -> float32 rescale + normalize of ``backend`` (:func:`geometry.normalize_lut`)."""
    lut = geometry.normalize_lut(backend, p.rescale_factor, p.image_mean, p.image_std, p.do_rescale, p.do_normalize)
    return RowNormalizer.for_table(lut, p.rescale_factor, p.image_mean, p.image_std, p.do_rescale, p.do_normalize)


def shortest_edge_size(height: int, width: int, shortest_edge: int) -> tuple[int, int]:
    """(height, width) with the short side ``shortest_edge`` and the aspect ratio kept.

    Port of transformers 5.24 ``image_transforms.get_resize_output_image_size(default_to_square=False,
    max_size=None)``: ``new_long = int(shortest_edge * long / short)`` (float division, truncated).

    Example: ``shortest_edge_size(480, 640, 336) == (336, 448)``; ``(1, 1000) -> (336, 336000)``.
    """
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = shortest_edge, int(shortest_edge * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def crop_span(size: int, crop: int, backend: ImageBackend) -> tuple[int, int, int]:
    """One axis of a center crop: ``(src, dst, n)``, ``out[dst:dst+n] = image[src:src+n]``, zeros elsewhere.

    Image at least as large as the crop: ``src = (size - crop) // 2`` (PIL backend
    ``image_transforms.center_crop``; torchvision ``TorchvisionBackend.center_crop``:
    ``int((size - crop) / 2.0)``, the same for non-negative values).  Smaller: the image is
    zero-padded, placed at ``ceil((crop - size) / 2)`` by the PIL backend (``top_pad``) but at
    ``(crop - size) // 2`` by the torchvision backend (``padding_ltrb``): they differ by one
    pixel on an odd difference.
    """
    if size >= crop:
        return (size - crop) // 2, 0, crop
    diff = crop - size
    return 0, (diff // 2 if backend is ImageBackend.TORCHVISION else (diff + 1) // 2), size


def center_crop(pixels: npt.NDArray[np.uint8], crop_hw: tuple[int, int],
                backend: ImageBackend) -> npt.NDArray[np.uint8]:
    """uint8 ``[H, W, C]`` -> ``[crop_h, crop_w, C]`` as the backend's ``center_crop`` (:func:`crop_span`)."""
    (sy, dy, ny), (sx, dx, nx) = (crop_span(pixels.shape[0], crop_hw[0], backend),
                                  crop_span(pixels.shape[1], crop_hw[1], backend))
    if (ny, nx) == crop_hw:
        return pixels[sy:sy + ny, sx:sx + nx]
    out = np.zeros((crop_hw[0], crop_hw[1], pixels.shape[2]), dtype=np.uint8)
    out[dy:dy + ny, dx:dx + nx] = pixels[sy:sy + ny, sx:sx + nx]
    return out


def chw_values(pixels: npt.NDArray[np.uint8], normalizer: RowNormalizer | None) -> np.ndarray:
    """uint8 ``[..., H, W, C]`` -> ``[..., C, H, W]``: float32 normalized values, or uint8 (``normalizer`` None)."""
    *lead, height, width, channels = pixels.shape
    chw = np.ascontiguousarray(np.moveaxis(pixels, -1, -3))
    if normalizer is None:
        return chw
    src = chw.reshape(-1, channels, height * width)
    out = np.empty(src.shape, dtype=np.float32)
    normalizer(src, out)
    return out.reshape(*lead, channels, height, width)


@dataclass(frozen=True, slots=True)
class ImageTokens:
    """The image token and the feature count settings of a LLaVA processor (``processor_config.json``)."""

    token: str  # "<image>"
    token_id: int  # its id (= config image_token_index)
    patch_size: int  # vision patch size (14)
    additional: int  # num_additional_image_tokens (CLS: 1)
    strategy: str  # vision_feature_select_strategy ("default" drops CLS, "full" keeps it)

    def features(self, height: int, width: int) -> int:
        """Tokens of an encoder input of ``height x width`` (``LlavaProcessor.replace_image_token``)."""
        n = (height // self.patch_size) * (width // self.patch_size) + self.additional
        return n - 1 if self.strategy == "default" else n


def image_tokens(bundle: ModelBundle, tokenizer: BundleTokenizer) -> ImageTokens:
    """Read the image token as ``LlavaProcessor.__init__`` / ``LlavaNextProcessor.__init__`` (5.24):
    the tokenizer's ``image_token`` (``extra_special_tokens``) over the processor's, default
    ``<image>``; ``patch_size``, ``num_additional_image_tokens`` (default 0) and
    ``vision_feature_select_strategy`` from the processor config.

    Raises:
        GatewayError(INTERNAL_ERROR): no ``patch_size``, the token is not a single token, or its
            id disagrees with ``config.json`` ``image_token_index``.
    """
    pc = bundle.processor_config
    extra = bundle.tokenizer_config.get("extra_special_tokens")
    token = str((extra or {}).get("image_token") if isinstance(extra, dict) and extra.get("image_token")
                else pc.get("image_token") or "<image>")
    token_id = tokenizer.token_id(token)
    config_id = bundle.config.get("image_token_index", bundle.config.get("image_token_id"))
    if token_id is None or (config_id is not None and int(config_id) != token_id):
        raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: {token} id disagrees with config")
    if pc.get("patch_size") is None:
        raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: processor_config has no patch_size")
    strategy = pc.get("vision_feature_select_strategy") or bundle.config.get("vision_feature_select_strategy")
    return ImageTokens(token=token, token_id=token_id, patch_size=int(pc["patch_size"]),
                       additional=int(pc.get("num_additional_image_tokens") or 0), strategy=str(strategy))


def image_limit(bundle: ModelBundle, min_tokens: int) -> int:
    """Images per request: :data:`DEFAULT_IMAGE_LIMIT`, lowered to what the text model's context
    (``text_config.max_position_embeddings``) can hold at ``min_tokens`` per image.

    vLLM sets no model limit for these models (``get_supported_mm_limits`` -> ``{"image": None}``)
    and defaults ``--limit-mm-per-prompt`` to 999 (``vllm/config/multimodal.py``); the gateway's
    own default (16, as for Qwen-VL) bounds fetch and decode work per request, and a count that
    can never fit the context (LLaVA-1.5: 4096 // 576 = 7) is refused before any fetch.
    """
    ctx = (bundle.config.get("text_config") or {}).get("max_position_embeddings")
    if not ctx or min_tokens <= 0:
        return DEFAULT_IMAGE_LIMIT
    return max(1, min(DEFAULT_IMAGE_LIMIT, int(ctx) // min_tokens))


def check_no_hints(hints: ItemHints, param: str, model_type: str) -> None:
    """Refuse every per-item hint: these processors have no knob a hint maps to.

    Raises:
        GatewayError(INVALID_REQUEST): ``fps`` (a clip's, where the family samples frames itself) or
        ``max_long_side_pixel`` set, or any ``mm_processor_kwargs``.
    """
    if hints.fps is not None:
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"{model_type} samples frames itself: fps is not supported",
                           param + ".fps")
    if hints.max_long_side_pixel is not None:
        raise GatewayError(ErrorCode.INVALID_REQUEST,
                           f"{model_type} resizes every image to a fixed size: max_long_side_pixel is not supported",
                           param + ".max_long_side_pixel")
    if hints.options:
        raise GatewayError(ErrorCode.INVALID_REQUEST,
                           f"mm_processor_kwargs {hints.options[0][0]!r} is not supported for {model_type}",
                           "mm_processor_kwargs")


class ClipCropImages:
    """LLaVA-1.5 images: shortest-edge resize, center crop, normalize (module docstring)."""

    modality = Modality.IMAGE
    device_normalizable = True  # a worker may normalize the raw uint8 pixels itself (float32, as the reference)
    specs = (TensorSpec("pixel_values", "float32", TensorLayout.BATCHED, primary=True),)

    def __init__(self, model_type: str, params: ClipParams, tokens: ImageTokens, backend: ImageBackend) -> None:
        if not params.do_center_crop and (not params.do_resize or params.size_hw is None):
            raise GatewayError(ErrorCode.INTERNAL_ERROR,
                               f"{model_type}: without center crop the image size must be fixed by size height/width")
        self.model_type = model_type
        self.params = params
        self.tokens = tokens
        self.backend = backend
        self._normalizer = normalizer_for(params, backend)
        out_hw = params.crop_hw if params.do_center_crop else params.size_hw
        assert out_hw is not None
        self.out_hw: tuple[int, int] = out_hw  # every item's encoder input size
        self.num_tokens = tokens.features(*self.out_hw)

    @property
    def anchor_token_id(self) -> int:
        return self.tokens.token_id

    @property
    def placeholder_token_id(self) -> int:
        return self.tokens.token_id

    @property
    def fingerprint(self) -> str:
        return f"llava:{self.model_type}:{self.backend.value}:{self.params!r}:{self.tokens!r}"

    def check_hints(self, hints: ItemHints, param: str) -> None:
        check_no_hints(hints, param, self.model_type)

    def resize_hw(self, height: int, width: int) -> tuple[int, int]:
        """The size before the crop (``TorchvisionBackend.resize`` / ``PilBackend.resize`` size rules)."""
        p = self.params
        if not p.do_resize:
            return height, width
        if p.shortest_edge is not None:
            return shortest_edge_size(height, width, p.shortest_edge)
        assert p.size_hw is not None
        return p.size_hw

    def plan(self, height: int, width: int, hints: ItemHints | None = None) -> ItemPlan:
        """The resize size, the crop placement (``detail``: ``(src_y, src_x, dst_y, dst_x)``) and 576 tokens.

        Raises:
            GatewayError(MEDIA_DECODE_FAILED): a zero-sized side.
            GatewayError(IMAGE_ASPECT_RATIO_INVALID): the resized image would exceed
                :data:`MAX_RESIZED_PIXELS`.
        """
        if min(height, width) <= 0:
            raise GatewayError(ErrorCode.MEDIA_DECODE_FAILED, "image has a zero-sized side")
        rh, rw = self.resize_hw(height, width)
        if rh * rw > MAX_RESIZED_PIXELS:
            raise GatewayError(ErrorCode.IMAGE_ASPECT_RATIO_INVALID,
                               f"a {width}x{height} image would be resized to {rw}x{rh} before the crop "
                               f"(more than {MAX_RESIZED_PIXELS} pixels); aspect ratio "
                               f"{max(height, width) / min(height, width):.4g} is too extreme for {self.model_type}")
        detail: tuple[int, ...] = (0, 0, 0, 0)
        if self.params.do_center_crop:
            (sy, dy, _), (sx, dx, _) = (crop_span(rh, self.params.crop_hw[0], self.backend),
                                        crop_span(rw, self.params.crop_hw[1], self.backend))
            detail = (sy, sx, dy, dx)
        oh, ow = self.out_hw
        return ItemPlan(modality=Modality.IMAGE, original_hw=(height, width), resized_hw=(rh, rw),
                        num_tokens=self.num_tokens, shapes=(("pixel_values", (3, oh, ow)),), detail=detail)

    def plan_tensors(self, plan: ItemPlan) -> dict[str, np.ndarray]:
        return {}

    def preprocess(self, image: DecodedImage, plan: ItemPlan, raw: bool = False) -> np.ndarray:
        """``[3, crop_h, crop_w]`` float32 normalized (or uint8 with ``raw``: the cropped pixels)."""
        pixels = image.pixels
        if self.params.do_resize and plan.resized_hw != pixels.shape[:2]:
            pixels = geometry.resize_uint8(pixels, plan.resized_hw, self.params.resample, self.backend)
        if self.params.do_center_crop:
            pixels = center_crop(pixels, self.params.crop_hw, self.backend)
        return chw_values(pixels, None if raw else self._normalizer)

    def expand(self, plan: ItemPlan) -> Replacement:
        """The run of ``<image>`` replacing the anchor; all of it is the placeholder range."""
        return Replacement(token_ids=(self.tokens.token_id,) * plan.num_tokens, embed_offset=0,
                           embed_length=plan.num_tokens)


class LlavaFamily(ImageOnlyFamily[ClipCropImages]):
    """LLaVA-1.5 (``LlavaForConditionalGeneration`` with a CLIP tower): images only."""

    model_types = ("llava",)
    limits: Mapping[Modality, int] = {Modality.IMAGE: DEFAULT_IMAGE_LIMIT}

    @classmethod
    def from_bundle(cls, bundle: ModelBundle, tokenizer: BundleTokenizer, backend: ImageBackend,
                    video_backend: ImageBackend | None = None,
                    video_sampling: FrameSampling = FrameSampling.VLLM) -> LlavaFamily:
        """Read every parameter from the bundle; ``backend`` ``auto`` is resolved here.

        Raises:
            GatewayError(INTERNAL_ERROR): an image processor other than ``CLIPImageProcessor``
                (e.g. ``LlavaImageProcessor``, which pads to a square first), or settings above.
        """
        cfg = bundle.preprocessor_config or dict(bundle.processor_config.get("image_processor") or {})
        kind = str(cfg.get("image_processor_type", "CLIPImageProcessor")).removesuffix("Fast").removesuffix("Pil")
        if kind != "CLIPImageProcessor":
            raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: image processor {kind} is not "
                               "supported for llava (CLIPImageProcessor only)")
        images = ClipCropImages(bundle.model_type, clip_params(cfg, bundle.name), image_tokens(bundle, tokenizer),
                                geometry.resolve_backend(backend))
        return cls(images, image_limit(bundle, images.num_tokens), (images.tokens.token,))


FAMILY = LlavaFamily
