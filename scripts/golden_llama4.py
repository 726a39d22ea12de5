"""The reference side of ``llama4.json`` (``scripts/gen_golden.py --family llama4``).

transformers 5.24 has one Llama 4 image processor, ``Llama4ImageProcessor`` (a
``TorchvisionBackend``; no ``*Pil`` class), so the fixture has ``torchvision`` rows only.  Per image:
the reference geometry (``get_best_fit`` canvas over ``find_supported_resolutions``, the resize size
of ``_preprocess``), ``aspect_ratios``, the ``<|patch|>`` count of ``processor(text="<|image|>",
images=[image])``, the ``pixel_values`` shape (``[tiles, 3, 336, 336]``, bfloat16 in the reference),
its sha256 as float32 and eight probe values.  Per conversation the ids of
``processor.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
return_dict=True)`` (the rendered prompt starts with ``<|begin_of_text|>``; the call adds no second
one), the runs of ``<|patch|>``, the ids with those runs collapsed, and the batch's
``pixel_values`` sha256; the image processor's ``aspect_ratios`` for the same images (the processor
drops them: ``Llama4Processor.unused_input_names``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from golden_reference import bundle_path, image_entries, opened, versions
from parity_support import ImageSpec, collapse_runs, probe8, reference_messages, sha256_f32le, sha256_ids

LLAMA4_BUNDLE = "meta-llama--Llama-4-Scout-17B-16E-Instruct"

#: every tiling boundary of the 16-tile canvas set at 336 px, and the usual decode modes
LLAMA4_IMAGES: tuple[ImageSpec, ...] = (
    ImageSpec(640, 480, "RGB", 1, "PNG", "rgb_640x480"),  # 2x2 canvas, no resize (never below 336 but never more than needed), padded
    ImageSpec(1, 1, "RGB", 2, "PNG", "tiny_1x1"),  # one tile, upscaled to 336x336
    ImageSpec(1, 37, "L", 3, "PNG", "gray_1x37"),
    ImageSpec(336, 336, "RGB", 4, "PNG", "exact_336x336"),  # one tile, no resize, no global tile
    ImageSpec(337, 336, "RGB", 5, "PNG", "wide_337x336"),  # one pixel past a tile: 1x2 canvas + global
    ImageSpec(672, 336, "RGB", 6, "PNG", "exact_672x336"),  # exactly 1x2 tiles
    ImageSpec(336, 672, "RGBA", 7, "PNG", "rgba_336x672"),  # exactly 2x1 tiles
    ImageSpec(1344, 1344, "RGB", 8, "JPEG", "jpeg_1344x1344"),  # exactly 4x4 = 16 tiles
    ImageSpec(1345, 1344, "RGB", 9, "PNG", "past_16_1345x1344"),  # more than 16 tiles: downscaled
    ImageSpec(5376, 336, "RGB", 10, "PNG", "strip_5376x336"),  # 1x16 canvas, exact
    ImageSpec(5377, 2, "RGB", 11, "PNG", "strip_5377x2"),  # 1x16 canvas, downscaled
    ImageSpec(27, 29, "P", 12, "PNG", "palette_27x29"),
    ImageSpec(57, 85, "P+tRNS", 13, "PNG", "palette_trns_57x85"),
    ImageSpec(113, 250, "LA", 14, "PNG", "gray_alpha_113x250"),
    ImageSpec(1023, 769, "RGB", 15, "JPEG", "jpeg_1023x769"),
    ImageSpec(45, 300, "L", 16, "JPEG", "jpeg_gray_45x300"),
)

LLAMA4_CONVERSATIONS: tuple[dict, ...] = (
    {"images": ["rgb_640x480"], "turns": [["user", [0, "What is in this image?"]]]},
    {"images": ["tiny_1x1", "palette_trns_57x85"],
     "turns": [["user", ["Describe ", 0, " briefly."]], ["assistant", ["A dot."]],
               ["user", [1, "And this one? é 日本語 🙂"]]]},
    {"images": ["jpeg_1023x769", "wide_337x336", "gray_alpha_113x250"],
     "turns": [["system", ["You are terse."]], ["user", ["Compare ", 0, ", ", 1, " and\n\n", 2, "."]]]},
)


def _geometry(ip, height: int, width: int) -> dict:
    """The reference's own geometry functions for one size (``Llama4ImageProcessor._preprocess``)."""
    import torch
    from transformers.image_utils import SizeDict
    from transformers.models.llama4.image_processing_llama4 import (
        find_supported_resolutions,
        get_best_fit,
        get_max_res_without_distortion,
    )

    size = SizeDict(height=ip.size["height"], width=ip.size["width"])
    res = torch.tensor(find_supported_resolutions(max_num_chunks=ip.max_patches, patch_size=size))
    canvas = [int(v) for v in get_best_fit((height, width), res, resize_to_max_canvas=ip.resize_to_max_canvas)]
    target = (min(max(height, size.height), canvas[0]), min(max(width, size.height), canvas[1]))
    rh, rw = get_max_res_without_distortion((height, width), target)
    return {"canvas": canvas, "resized_hw": [max(rh, 1), max(rw, 1)]}


def _rows(processor, sources: dict[str, bytes], specs: Sequence[ImageSpec]) -> list[dict]:
    ip = processor.image_processor
    patch = processor.tokenizer.convert_tokens_to_ids(processor.img_patch_token)
    rows = []
    for spec in specs:
        img = opened(sources, [spec.name])
        out = ip(images=img, return_tensors="pt")
        pv = out["pixel_values"].float().numpy()
        ids = [int(v) for v in processor(text=processor.image_token, images=img)["input_ids"][0]]
        rows.append({"bundle": LLAMA4_BUNDLE, "backend": "torchvision", "image": spec.name,
                     **_geometry(ip, spec.height, spec.width),
                     "aspect_ratios": [int(v) for v in out["aspect_ratios"][0]],
                     "num_image_tokens": ids.count(patch), "pixel_values_dtype": str(out["pixel_values"].dtype),
                     "pixel_values_shape": list(pv.shape), "pixel_values_sha256": sha256_f32le(pv),
                     "pixel_values_probe": probe8(pv)})
    return rows


def _conversations(processor, sources: dict[str, bytes]) -> list[dict]:
    patch = processor.tokenizer.convert_tokens_to_ids(processor.img_patch_token)
    out_rows = []
    for conv in LLAMA4_CONVERSATIONS:
        imgs = opened(sources, conv["images"])
        messages = reference_messages(conv["turns"], imgs, flatten_text_turns=False)
        prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out = processor.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True,
                                            return_tensors="pt")
        ids = [int(v) for v in out["input_ids"][0]]
        collapsed, runs = collapse_runs(ids, patch)
        pv = out["pixel_values"].float().numpy()
        out_rows.append({"bundle": LLAMA4_BUNDLE, "images": conv["images"], "turns": conv["turns"], "prompt": prompt,
                         "input_ids_len": len(ids), "input_ids_sha256": sha256_ids(ids),
                         "num_image_tokens": ids.count(patch), "patch_runs": runs, "input_ids_collapsed": collapsed,
                         "pixel_values_shape": list(pv.shape), "pixel_values_sha256": sha256_f32le(pv),
                         "aspect_ratios": [[int(v) for v in r] for r in
                                           processor.image_processor(images=imgs, return_tensors="pt")["aspect_ratios"]]})
    return out_rows


def llama4_golden() -> dict:
    """``llama4.json``: torchvision rows (the only backend), conversations, the bundle's token facts."""
    from transformers import AutoProcessor

    path = bundle_path(LLAMA4_BUNDLE)
    processor = AutoProcessor.from_pretrained(str(path))
    assert (type(processor.image_processor).__name__, type(processor).__name__) == (
        "Llama4ImageProcessor", "Llama4Processor")
    sources = {spec.name: spec.encode() for spec in LLAMA4_IMAGES}
    ip = processor.image_processor
    tok = processor.tokenizer
    names = ("<|image|>", "<|image_start|>", "<|image_end|>", "<|patch|>", "<|tile_x_separator|>",
             "<|tile_y_separator|>")
    info = {"bundle": LLAMA4_BUNDLE, "model_type": json.loads((path / "config.json").read_text())["model_type"],
            "processor_class": type(processor).__name__, "image_processor_class": type(ip).__name__,
            "token_ids": {n: tok.convert_tokens_to_ids(n) for n in names},
            "patch_size": processor.patch_size, "downsample_ratio": processor.downsample_ratio,
            "size": dict(ip.size), "max_patches": ip.max_patches, "resize_to_max_canvas": ip.resize_to_max_canvas}
    return {
        "format": 1,
        "generated_by": "scripts/golden_llama4.py",
        "reference": "transformers Llama4ImageProcessor (torchvision backend, the only one); ids: "
                     "processor.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, "
                     "return_dict=True)",
        "pixel_values_hash": "sha256 of float32 little-endian C-order bytes of the bfloat16 pixel_values "
                             "(one item's tiles for rows, the batch for conversations)",
        "pixel_values_probe": "the values at flat indices k * (n - 1) // 7, k = 0..7",
        "input_ids_hash": "sha256 of int64 little-endian ids",
        "versions": versions(),
        "images": image_entries(LLAMA4_IMAGES, sources),
        "bundles": [info],
        "rows": _rows(processor, sources, LLAMA4_IMAGES),
        "conversations": _conversations(processor, sources),
    }

