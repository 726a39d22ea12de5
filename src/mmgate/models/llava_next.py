"""The LLaVA-NeXT family (``model_type`` ``llava_next``): anyres tiles of 336 plus the base image.

Stage: plan / preprocess / expand for images (no video).  In: a decoded RGB image; out: the
item's share of ``pixel_values`` (float32 ``[1 + rows*cols, 3, 336, 336]``: the base image, then
the tiles row by row), of ``image_sizes`` (int64 ``[2]``, the original ``(height, width)``) and
the ``<image>`` run replacing its anchor.

Reference (transformers 5.24), both backends:
* ``models/llava_next/image_processing_llava_next.py`` ``LlavaNextImageProcessor`` (torchvision,
  what ``AutoProcessor`` picks) and ``image_processing_pil_llava_next.py``
  ``LlavaNextImageProcessorPil``: ``image_processing_utils.select_best_resolution`` over
  ``image_grid_pinpoints`` (``(height, width)`` pairs); ``_resize_for_patching`` to
  ``get_patch_output_size`` (bicubic); ``_pad_for_patching`` with zeros, centred
  (``_get_padding_size``: ``divmod(target - size, 2)``, the odd pixel right / bottom);
  ``image_transforms.divide_to_patches`` into ``crop_size`` tiles; the original resized to
  ``(shortest_edge, shortest_edge)`` first (``get_image_patches``); every tile then resized to
  ``size`` and centre-cropped to ``crop_size``, identities when both equal the tile size, which
  :meth:`LlavaNextFamily.from_bundle` requires; rescale + normalize as CLIP
  (:mod:`mmgate.models.llava`).  ``_pad_for_batching`` zero-pads the tile dimension across a
  batch: :func:`mmgate.models.family.assemble` does it (``TensorLayout.BATCHED``).
* tokens: ``models/llava_next/processing_llava_next.py`` ``LlavaNextProcessor.replace_image_token``
  -> ``_get_number_of_features(orig_h, orig_w, 336, 336)`` (unpadded features + one newline per
  feature row + ``24 * 24 + num_additional_image_tokens``), less one for ``"default"``; the ids
  reference is ``processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``
  then ``processor(text=prompt, images=[...])``.  Ported with the same float operations
  (``int(round(x, 7))``), in :func:`unpadded_features`.

Wire layout: vLLM ``vllm/model_executor/models/llava_next.py`` (v0.11.0, v0.19.0)
``LlavaNextMultiModalProcessor._get_mm_fields_config``: ``pixel_values`` and ``image_sizes``
``MultiModalFieldConfig.batched("image")``, neither ``keep_on_cpu``; prompt updates are
``BaseLlavaMultiModalProcessor._get_prompt_updates`` (``vllm/.../llava.py``): the anchor becomes
``[image_token_index] * get_num_image_tokens(...)``, so the placeholder range is the whole run,
all ``<image>`` (the newline features are image-token positions too), ``im_token_id`` = ``<image>``.
vLLM's ``LlavaNextProcessingInfo.get_num_image_tokens`` gives the same count as the processor
here (pinpoints in ``config.json`` = ``preprocessor_config.json``).  The model drops the batch
padding tiles (``other_patch_embeds[:num_patches]``), so a padded item is embedded as an unpadded one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from mmgate.chat.tokenizer import BundleTokenizer
from mmgate.errors import ErrorCode, GatewayError
from mmgate.models import geometry
from mmgate.models.bundle import ModelBundle
from mmgate.models.family import ImageOnlyFamily
from mmgate.models.llava import (
    DEFAULT_IMAGE_LIMIT,
    ClipParams,
    ImageTokens,
    check_no_hints,
    chw_values,
    clip_params,
    image_limit,
    image_tokens,
    normalizer_for,
)
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

__all__ = ["AnyresImages", "LlavaNextFamily", "patch_output_size", "select_best_resolution", "unpadded_features"]

# transformers 5.24 LlavaNextImageProcessor.image_grid_pinpoints (class default)
_DEFAULT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))


def select_best_resolution(height: int, width: int, pinpoints: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The pinpoint ``(h, w)`` keeping the most of the image, then wasting the least.

    Port of transformers 5.24 ``image_processing_utils.select_best_resolution`` (same float
    operations; ties keep the earlier pinpoint).  Example: a 480x640 (h x w) image with the
    LLaVA-NeXT pinpoints -> ``(672, 672)``; 1x1 -> ``(336, 672)``.
    """
    best: tuple[int, int] | None = None
    max_effective, min_wasted = 0, math.inf
    for ph, pw in pinpoints:
        scale = min(pw / width, ph / height)
        down_w, down_h = int(width * scale), int(height * scale)
        effective = min(down_w * down_h, width * height)
        wasted = pw * ph - effective
        if effective > max_effective or (effective == max_effective and wasted < min_wasted):
            max_effective, min_wasted, best = effective, wasted, (ph, pw)
    assert best is not None
    return best


def patch_output_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """The size the image is resized to inside ``target`` (aspect ratio kept, one side = target's).

    Port of transformers 5.24 ``image_processing_utils.get_patch_output_size``.
    Example: 480x640 into (672, 672) -> (504, 672).
    """
    th, tw = target
    scale_w, scale_h = tw / width, th / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), th), tw
    return th, min(math.ceil(width * scale_h), tw)


def unpadded_features(height: int, width: int, patches_h: int, patches_w: int, scale_h: int,
                      scale_w: int) -> tuple[int, int]:
    """(unpadded features, newline features) of the tile grid.

    Port of transformers 5.24 ``LlavaNextProcessor._get_unpadded_features`` (same operations,
    including ``int(round(x, 7))``).  Example: 480x640 on a 2x2 grid of 24x24 -> current 48x48,
    ``new_height = int(round(480 * (48 / 640), 7)) = 36``, padding 6: ``(36 * 48, 36)``.
    """
    current_h, current_w = patches_h * scale_h, patches_w * scale_w
    if width / height > current_w / current_h:
        new_height = int(round(height * (current_w / width), 7))
        current_h -= ((current_h - new_height) // 2) * 2
    else:
        new_width = int(round(width * (current_h / height), 7))
        current_w -= ((current_w - new_width) // 2) * 2
    return current_h * current_w, current_h


class AnyresImages:
    """LLaVA-NeXT images (module docstring).  ``ItemPlan.detail``: ``(best_h, best_w, pad_top, pad_left)``."""

    modality = Modality.IMAGE
    device_normalizable = True  # a worker may normalize the raw uint8 pixels itself (float32, as the reference)
    specs: tuple[TensorSpec, ...] = (TensorSpec("pixel_values", "float32", TensorLayout.BATCHED, primary=True),
             TensorSpec("image_sizes", "int64", TensorLayout.BATCHED))

    def __init__(self, model_type: str, params: ClipParams, tile: int, pinpoints: tuple[tuple[int, int], ...],
                 tokens: ImageTokens, backend: ImageBackend) -> None:
        self.model_type = model_type
        self.params = params
        self.tile = tile  # tile side = crop_size = base image side (336)
        self.pinpoints = pinpoints
        self.tokens = tokens
        self.backend = backend
        self._normalizer = normalizer_for(params, backend)

    @property
    def anchor_token_id(self) -> int:
        return self.tokens.token_id

    @property
    def placeholder_token_id(self) -> int:
        return self.tokens.token_id

    @property
    def fingerprint(self) -> str:
        return (f"llava_next:{self.model_type}:{self.backend.value}:{self.params!r}:{self.tile}:{self.pinpoints!r}:"
                f"{self.tokens!r}")

    def check_hints(self, hints: ItemHints, param: str) -> None:
        check_no_hints(hints, param, self.model_type)

    def num_tokens(self, height: int, width: int) -> int:
        """``LlavaNextProcessor._get_number_of_features(height, width, tile, tile)``, less one for ``"default"``."""
        t, tok = self.tile, self.tokens
        best_h, best_w = select_best_resolution(height, width, self.pinpoints)
        patches = t // tok.patch_size
        unpadded, newlines = unpadded_features(height, width, patches, patches, best_h // t, best_w // t)
        return unpadded + newlines + tok.features(t, t)

    def plan(self, height: int, width: int, hints: ItemHints | None = None) -> ItemPlan:
        """Grid pinpoint, resize size (``resized_hw``), padding and token count from the size alone.

        Raises:
            GatewayError(MEDIA_DECODE_FAILED): a zero-sized side.
        """
        if min(height, width) <= 0:
            raise GatewayError(ErrorCode.MEDIA_DECODE_FAILED, "image has a zero-sized side")
        best_h, best_w = select_best_resolution(height, width, self.pinpoints)
        rh, rw = patch_output_size(height, width, (best_h, best_w))
        tiles = 1 + (best_h // self.tile) * (best_w // self.tile)
        return ItemPlan(
            modality=Modality.IMAGE, original_hw=(height, width), resized_hw=(rh, rw),
            num_tokens=self.num_tokens(height, width),
            shapes=(("pixel_values", (tiles, 3, self.tile, self.tile)), ("image_sizes", (2,))),
            detail=(best_h, best_w, (best_h - rh) // 2, (best_w - rw) // 2),
        )

    def plan_tensors(self, plan: ItemPlan) -> dict[str, np.ndarray]:
        """``image_sizes``: the original ``(height, width)`` (the processor's ``get_image_size``)."""
        return {"image_sizes": np.array(plan.original_hw, dtype=np.int64)}

    def tiles_u8(self, image: DecodedImage, plan: ItemPlan) -> np.ndarray:
        """uint8 ``[1 + rows*cols, tile, tile, 3]``: the base image, then the padded grid's tiles
        row by row (``get_image_patches`` order)."""
        p, t = self.params, self.tile
        best_h, best_w, top, left = plan.detail
        pixels = image.pixels
        resized = pixels if plan.resized_hw == pixels.shape[:2] else geometry.resize_uint8(
            pixels, plan.resized_hw, p.resample, self.backend)
        rows, cols = best_h // t, best_w // t
        out = np.zeros((1 + rows * cols, t, t, 3), dtype=np.uint8)
        out[0] = pixels if pixels.shape[:2] == (t, t) else geometry.resize_uint8(pixels, (t, t), p.resample,
                                                                                 self.backend)
        canvas = np.zeros((best_h, best_w, 3), dtype=np.uint8)
        canvas[top:top + resized.shape[0], left:left + resized.shape[1]] = resized
        out[1:] = canvas.reshape(rows, t, cols, t, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, t, t, 3)
        return out

    def preprocess(self, image: DecodedImage, plan: ItemPlan, raw: bool = False) -> np.ndarray:
        """``[1 + rows*cols, 3, tile, tile]`` float32 normalized (uint8 with ``raw``; padding is
        byte 0 there, as the reference pads before normalizing)."""
        return chw_values(self.tiles_u8(image, plan), None if raw else self._normalizer)

    def expand(self, plan: ItemPlan) -> Replacement:
        """The run of ``<image>`` replacing the anchor; all of it is the placeholder range."""
        return Replacement(token_ids=(self.tokens.token_id,) * plan.num_tokens, embed_offset=0,
                           embed_length=plan.num_tokens)


class LlavaNextFamily(ImageOnlyFamily[AnyresImages]):
    """LLaVA-NeXT (``LlavaNextForConditionalGeneration``, anyres CLIP tiles): images only."""

    model_types = ("llava_next",)
    limits: Mapping[Modality, int] = {Modality.IMAGE: DEFAULT_IMAGE_LIMIT}

    @classmethod
    def from_bundle(cls, bundle: ModelBundle, tokenizer: BundleTokenizer, backend: ImageBackend,
                    video_backend: ImageBackend | None = None,
                    video_sampling: FrameSampling = FrameSampling.VLLM) -> LlavaNextFamily:
        """Read every parameter from the bundle; ``backend`` ``auto`` is resolved here.

        Raises:
            GatewayError(INTERNAL_ERROR): another image processor, or a configuration whose tile
                steps are not identities (``size`` or ``crop_size`` other than the tile, a pinpoint
                not a multiple of it): this port covers the LLaVA-NeXT configurations, not those.
        """
        cfg = bundle.preprocessor_config or dict(bundle.processor_config.get("image_processor") or {})
        kind = str(cfg.get("image_processor_type", "LlavaNextImageProcessor")).removesuffix("Fast").removesuffix("Pil")
        if kind != "LlavaNextImageProcessor":
            raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: image processor {kind} is not "
                               "supported for llava_next")
        params = clip_params({"crop_size": {"height": 224, "width": 224}, **cfg}, bundle.name)
        tile = params.crop_hw[0]  # _preprocess: patch_size = crop_size.height
        base = params.shortest_edge if params.shortest_edge is not None else None
        pinpoints = tuple((int(h), int(w)) for h, w in (cfg.get("image_grid_pinpoints") or _DEFAULT_PINPOINTS))
        identities = (params.crop_hw == (tile, tile) and (base == tile or params.size_hw == (tile, tile))
                      and all(h % tile == 0 and w % tile == 0 for h, w in pinpoints) and pinpoints)
        if not identities:
            raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: unsupported LLaVA-NeXT geometry "
                               f"(size {cfg.get('size')}, crop_size {cfg.get('crop_size')}, pinpoints {pinpoints})")
        images = AnyresImages(bundle.model_type, params, tile, pinpoints, image_tokens(bundle, tokenizer),
                              geometry.resolve_backend(backend))
        return cls(images, image_limit(bundle, images.tokens.features(tile, tile)), (images.tokens.token,))


FAMILY = LlavaNextFamily
