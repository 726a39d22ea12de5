#!/usr/bin/env python
"""Write tests/families/golden/llava.json and llava_next.json from the transformers reference.

Tier (a) of docs/parity.md for the LLaVA-1.5 (``llava``) and LLaVA-NeXT (``llava_next``)
families: small fingerprints of what the transformers 5.24 processors produce, so that
``tests/families/test_llava_golden.py`` checks mmgate without importing transformers.

For each bundle and each reference backend (``torchvision``:
``AutoProcessor.from_pretrained(bundle).image_processor``, i.e. ``CLIPImageProcessor`` /
``LlavaNextImageProcessor``; ``pil``: ``AutoImageProcessor.from_pretrained(bundle, backend="pil")``,
i.e. ``CLIPImageProcessorPil`` / ``LlavaNextImageProcessorPil``) and each image of
:data:`GOLDEN_IMAGES`, it records the shape, the sha256 of the float32 little-endian bytes and
eight exact values (at flat indices ``k * (n - 1) // 7``) of ``pixel_values``, ``image_sizes``
(NeXT), the reference geometry (LLaVA-1.5: the shortest-edge resize size; NeXT: the selected
pinpoint and the resize-for-patching size, from transformers' own functions) and the image
token count of ``processor(text="<image>", images=[image])``.

Conversations (per bundle): the reference ids are ``prompt =
processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`` then
``processor(text=prompt, images=images)`` (torchvision backend): their sha256, length, the ids
with every ``<image>`` run collapsed to one token, the run lengths, and the batched
``pixel_values`` (zero-padded across the batch for NeXT) / ``image_sizes`` fingerprints.

Images are regenerated, not stored (``parity_support.ImageSpec``); the sha256 of the RGB pixels
the reference decodes (``convert_to_rgb(Image.open(bytes))``) is recorded per image; versions of
transformers, torch, torchvision, Pillow and numpy are recorded.

Usage:  HF_HUB_OFFLINE=1 python scripts/gen_golden_llava.py [--check]
    --check: regenerate in memory and report differences instead of writing.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "families"))

import numpy as np
from parity_support import GOLDEN_DIR, ImageSpec, find_bundle_dir
from PIL import Image

#: bundle folder -> golden file
BUNDLES = {
    "llava-hf--llava-1.5-7b-hf": GOLDEN_DIR / "llava.json",  # llava
    "llava-hf--llava-v1.6-mistral-7b-hf": GOLDEN_DIR / "llava_next.json",  # llava_next
}

#: the golden corpus, one row each per bundle and backend
GOLDEN_IMAGES: tuple[ImageSpec, ...] = (
    ImageSpec(640, 480, "RGB", 1, "PNG", "rgb_640x480"),  # NeXT: pinpoint 672x672, 2x2 tiles, padded top/bottom
    ImageSpec(1, 1, "RGB", 2, "PNG", "tiny_1x1"),  # 336x336 upscale; NeXT: pinpoint 336x672 (tie, first wins)
    ImageSpec(1, 37, "L", 3, "PNG", "gray_1x37"),  # thin strip, grey
    ImageSpec(300, 1, "RGB", 4, "PNG", "strip_300x1"),  # LLaVA-1.5: resized to 100800x336 before the crop
    ImageSpec(2, 500, "RGB", 5, "PNG", "strip_2x500"),  # NeXT: pinpoint 1008x336
    ImageSpec(27, 29, "RGBA", 6, "PNG", "rgba_27x29"),
    ImageSpec(33, 31, "P", 7, "PNG", "palette_33x31"),
    ImageSpec(57, 85, "P+tRNS", 8, "PNG", "palette_trns_57x85"),
    ImageSpec(64, 48, "P+alpha", 9, "PNG", "palette_alpha_64x48"),
    ImageSpec(113, 250, "LA", 10, "PNG", "gray_alpha_113x250"),
    ImageSpec(336, 336, "RGB", 11, "PNG", "exact_336x336"),  # no resize (LLaVA-1.5), base tile unchanged (NeXT)
    ImageSpec(672, 336, "RGB", 12, "PNG", "pinpoint_672x336"),  # NeXT: exactly the 336x672 pinpoint, no padding
    ImageSpec(673, 336, "RGB", 13, "PNG", "pinpoint_673x336"),  # one pixel past it
    ImageSpec(1009, 335, "RGB", 14, "PNG", "around_1008x336"),  # NeXT: near the 336x1008 pinpoint
    ImageSpec(1023, 769, "RGB", 15, "JPEG", "jpeg_1023x769"),
    ImageSpec(45, 300, "L", 16, "JPEG", "jpeg_gray_45x300"),
)

#: conversations: (role, parts) turns; an int part is an index into ``images`` (all roles as part lists:
#: the LLaVA-NeXT template reads ``message['content'][0]['text']`` for system and assistant turns)
GOLDEN_CONVERSATIONS: tuple[dict, ...] = (
    {"images": ["rgb_640x480"], "turns": [["user", [0, "What is in this image?"]]]},
    {"images": ["tiny_1x1", "palette_trns_57x85"],
     "turns": [["user", ["Describe ", 0, " briefly."]], ["assistant", ["A dot."]],
               ["user", [1, "And this one? é 日本語 🙂"]]]},
    {"images": ["jpeg_1023x769", "strip_2x500", "gray_alpha_113x250"],
     "turns": [["user", ["Compare ", 0, ", ", 1, " and\n\n", 2, "."]]]},
)

BACKENDS = ("pil", "torchvision")


def sha256_f32le(array: np.ndarray) -> str:
    """sha256 of the float32 little-endian bytes of ``array`` (C order)."""
    return hashlib.sha256(np.ascontiguousarray(array, dtype="<f4").tobytes()).hexdigest()


def sha256_ids(ids: list[int]) -> str:
    """sha256 of token ids as int64 little-endian."""
    return hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest()


def probe(array: np.ndarray) -> list[float]:
    """Eight exact values of ``array`` at flat indices ``k * (n - 1) // 7`` (float32 values are exact floats)."""
    flat = np.ascontiguousarray(array, dtype=np.float32).reshape(-1)
    return [float(flat[k * (flat.size - 1) // 7]) for k in range(8)]


def collapse_runs(ids: list[int], pad: int) -> tuple[list[int], list[int]]:
    """(ids with each run of ``pad`` collapsed to one ``pad``, the run lengths).

    Example: ``collapse_runs([1, 9, 9, 9, 2, 9], 9) == ([1, 9, 2, 9], [3, 1])``.
    """
    collapsed: list[int] = []
    runs: list[int] = []
    in_run = False
    for tok in ids:
        if tok == pad and in_run:
            runs[-1] += 1
            continue
        in_run = tok == pad
        if in_run:
            runs.append(1)
        collapsed.append(tok)
    return collapsed, runs


def template_messages(turns: list, images: list) -> list[dict]:
    """The conversation for ``apply_chat_template``: ``{"type": "image", "image": PIL}`` and text parts."""
    return [{"role": role, "content": [{"type": "image", "image": images[p]} if isinstance(p, int)
                                       else {"type": "text", "text": p} for p in parts]}
            for role, parts in turns]


def geometry_of(model_type: str, ip, height: int, width: int) -> dict:
    """The reference's own geometry functions (transformers 5.24) for one image size."""
    if model_type == "llava":
        from transformers.image_transforms import get_resize_output_image_size

        shape = np.empty((3, height, width), dtype=np.uint8)
        rh, rw = get_resize_output_image_size(shape, ip.size["shortest_edge"], default_to_square=False,
                                              input_data_format="channels_first")
        return {"resized_hw": [int(rh), int(rw)]}
    from transformers.image_processing_utils import (
        get_patch_output_size,
        select_best_resolution,
    )

    best = select_best_resolution((height, width), ip.image_grid_pinpoints)
    resized = get_patch_output_size(np.empty((3, height, width), dtype=np.uint8), best, "channels_first")
    return {"best_resolution": [int(best[0]), int(best[1])], "resized_hw": [int(resized[0]), int(resized[1])]}


def bundle_golden(folder: str, path: Path) -> dict:
    from transformers import AutoImageProcessor, AutoProcessor
    from transformers.image_transforms import convert_to_rgb

    sources = {spec.name: spec.encode() for spec in GOLDEN_IMAGES}
    processor = AutoProcessor.from_pretrained(str(path))
    pil_ip = AutoImageProcessor.from_pretrained(str(path), backend="pil")
    config = json.loads((path / "config.json").read_text())
    model_type = config["model_type"]
    expected = {"llava": ("CLIPImageProcessor", "LlavaProcessor"),
                "llava_next": ("LlavaNextImageProcessor", "LlavaNextProcessor")}[model_type]
    assert (type(processor.image_processor).__name__, type(processor).__name__) == expected
    assert type(pil_ip).__name__ == expected[0] + "Pil"
    image_processors = {"torchvision": processor.image_processor, "pil": pil_ip}
    pil_processor = AutoProcessor.from_pretrained(str(path), image_processor=pil_ip)
    processors = {"torchvision": processor, "pil": pil_processor}
    ip = processor.image_processor
    image_id = processor.image_token_id
    info = {
        "bundle": folder, "model_type": model_type, "processor_class": type(processor).__name__,
        "image_processor_classes": {be: type(p).__name__ for be, p in image_processors.items()},
        "image_token": processor.image_token, "image_token_id": image_id, "patch_size": processor.patch_size,
        "num_additional_image_tokens": processor.num_additional_image_tokens,
        "vision_feature_select_strategy": processor.vision_feature_select_strategy,
        "size": dict(ip.size), "crop_size": dict(ip.crop_size),
    }
    if model_type == "llava_next":
        info["image_grid_pinpoints"] = [list(p) for p in ip.image_grid_pinpoints]
    images = []
    for spec in GOLDEN_IMAGES:
        rgb = convert_to_rgb(Image.open(io.BytesIO(sources[spec.name])), return_numpy=True)
        images.append({"name": spec.name, "width": spec.width, "height": spec.height, "mode": spec.mode,
                       "seed": spec.seed, "format": spec.fmt,
                       "rgb_sha256": hashlib.sha256(np.ascontiguousarray(rgb, dtype=np.uint8).tobytes()).hexdigest()})
    rows: list[dict] = []
    for backend in BACKENDS:
        for spec in GOLDEN_IMAGES:
            img = Image.open(io.BytesIO(sources[spec.name]))
            out = image_processors[backend](images=[img], return_tensors="np")
            pv = np.asarray(out["pixel_values"])[0]
            ids = processors[backend](text=processor.image_token, images=[img])["input_ids"][0]
            assert pv.dtype == np.float32, pv.dtype
            row = {"bundle": folder, "backend": backend, "image": spec.name,
                   **geometry_of(model_type, ip, spec.height, spec.width),
                   "num_image_tokens": int(list(ids).count(image_id)),
                   "pixel_values_shape": list(pv.shape), "pixel_values_sha256": sha256_f32le(pv),
                   "pixel_values_probe": probe(pv)}
            if "image_sizes" in out:
                sizes = np.asarray(out["image_sizes"])
                assert sizes.dtype == np.int64, sizes.dtype
                row["image_sizes"] = [int(v) for v in sizes[0]]
            rows.append(row)
    conversations: list[dict] = []
    for conv in GOLDEN_CONVERSATIONS:
        imgs = [Image.open(io.BytesIO(sources[name])) for name in conv["images"]]
        prompt = processor.apply_chat_template(template_messages(conv["turns"], imgs), tokenize=False,
                                               add_generation_prompt=True)
        out = processor(text=prompt, images=imgs, return_tensors="np")
        ids = [int(v) for v in out["input_ids"][0]]
        collapsed, runs = collapse_runs(ids, image_id)
        pv = np.asarray(out["pixel_values"])
        entry = {"bundle": folder, "images": conv["images"], "turns": conv["turns"], "prompt": prompt,
                 "input_ids_len": len(ids), "input_ids_sha256": sha256_ids(ids), "num_image_tokens": ids.count(image_id),
                 "runs": runs, "input_ids_collapsed": collapsed,
                 "pixel_values_shape": list(pv.shape), "pixel_values_sha256": sha256_f32le(pv)}
        if "image_sizes" in out:
            entry["image_sizes"] = np.asarray(out["image_sizes"]).tolist()
        conversations.append(entry)
    return {
        "format": 1,
        "generated_by": "scripts/gen_golden_llava.py",
        "reference": "transformers AutoProcessor (torchvision backend) / AutoImageProcessor(backend='pil'); ids: "
                     "processor(text=processor.apply_chat_template(messages, tokenize=False, "
                     "add_generation_prompt=True), images=images)",
        "pixel_values_hash": "sha256 of float32 little-endian C-order bytes of one item's pixel_values "
                             "(rows) / of the batch (conversations)",
        "pixel_values_probe": "the values at flat indices k * (n - 1) // 7, k = 0..7",
        "input_ids_hash": "sha256 of int64 little-endian ids",
        "versions": versions(),
        "images": images,
        "bundles": [info],
        "rows": rows,
        "conversations": conversations,
    }


def versions() -> dict[str, str]:
    import PIL
    import torch
    import torchvision
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__,
            "torchvision": torchvision.__version__, "Pillow": PIL.__version__, "numpy": np.__version__,
            "python": sys.version.split()[0]}


def dumps(golden: dict) -> str:
    """JSON with one list entry per line (small, diffable)."""
    lines = ["{"]
    keys = list(golden)
    for i, key in enumerate(keys):
        value = golden[key]
        comma = "," if i < len(keys) - 1 else ""
        if isinstance(value, list):
            lines.append(f"  {json.dumps(key)}: [")
            lines += [f"    {json.dumps(v, ensure_ascii=False)}{',' if j < len(value) - 1 else ''}"
                      for j, v in enumerate(value)]
            lines.append(f"  ]{comma}")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}{comma}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    args = parser.parse_args()
    status = 0
    for folder, out_path in BUNDLES.items():
        path = find_bundle_dir(folder)
        if path is None:
            raise SystemExit(f"bundle {folder} not found on MMGATE_MODEL_PATH / ../shared/models")
        text = dumps(bundle_golden(folder, path))
        if args.check:
            old = out_path.read_text(encoding="utf-8") if out_path.is_file() else ""
            print(f"{out_path}: {'up to date' if old == text else 'differs from a fresh reference run'}")
            status |= int(old != text)
            continue
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(text, encoding="utf-8")
        print(f"wrote {out_path} ({len(text.encode())} bytes)")
    return status


if __name__ == "__main__":
    sys.exit(main())
