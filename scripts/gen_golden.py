#!/usr/bin/env python
"""Write tests/families/golden/qwen_vl.json from the transformers reference.

Tier (a) of docs/parity.md: small fingerprints of what the transformers
processors produce, so that ``tests/families/test_qwen_vl_golden.py`` can check
mmgate without importing transformers.

For each Qwen-VL bundle (found on ``MMGATE_MODEL_PATH``, default
``<repo>/../shared/models``) and each reference backend
(``torchvision``: ``AutoProcessor.from_pretrained(bundle).image_processor``,
i.e. ``Qwen2VLImageProcessor``; ``pil``:
``AutoImageProcessor.from_pretrained(bundle, backend="pil")``, i.e.
``Qwen2VLImageProcessorPil``) and each image of :data:`GOLDEN_IMAGES`, it records
the resized size (reference ``smart_resize``), ``image_grid_thw``, the shape and
the sha256 of the float32 little-endian bytes of ``pixel_values``, and the
number of image tokens (reference ``_get_num_multimodal_tokens``); images the
reference refuses are recorded as refused.  For each bundle and each of
:data:`GOLDEN_CONVERSATIONS` it records the ``input_ids`` of
``processor.apply_chat_template(..., tokenize=True)``: their sha256, length,
the number of ``<|image_pad|>`` tokens, the ids with every pad run collapsed
to one pad token, and the run lengths.

Images are regenerated, not stored: ``parity_support.ImageSpec(width, height,
mode, seed, fmt).encode()`` builds the pixels from ``numpy.random.default_rng(seed)``
with integer arithmetic only and encodes PNG (stored, lossless) or JPEG
(quality 90).  The sha256 of the RGB pixels the reference decodes
(``convert_to_rgb(Image.open(bytes))``) is recorded per image, so a changed
decoder (Pillow / libjpeg) or RNG stream (numpy) is told apart from a changed
preprocessing.  Versions of transformers, torch, torchvision, Pillow and numpy
are recorded: a different Pillow may legitimately change PIL decodes (JPEG)
and PIL resizes.

Usage:  HF_HUB_OFFLINE=1 python scripts/gen_golden.py [--check]
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

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from parity_support import QWEN_VL_BUNDLES, QWEN_VL_GOLDEN, ImageSpec, find_bundle_dir, reference_messages  # noqa: E402

#: (name, width, height, mode, seed, format) — the golden corpus, one row each.
GOLDEN_IMAGES: tuple[ImageSpec, ...] = (
    ImageSpec(640, 480, "RGB", 1, "PNG", "rgb_640x480"),  # resize to 644x476 (28) / 640x480 (32): mixed direction
    ImageSpec(1, 1, "RGB", 2, "PNG", "tiny_1x1"),  # upscaled to min_pixels
    ImageSpec(1, 37, "L", 3, "PNG", "gray_1x37"),
    ImageSpec(200, 1, "RGB", 4, "PNG", "aspect_200_200x1"),  # aspect ratio exactly 200: accepted
    ImageSpec(201, 1, "RGB", 5, "PNG", "aspect_201_201x1"),  # aspect ratio 201: refused
    ImageSpec(27, 29, "RGBA", 6, "PNG", "rgba_27x29"),  # factor 28 -1 / +1
    ImageSpec(33, 31, "P", 7, "PNG", "palette_33x31"),  # factor 32 +1 / -1
    ImageSpec(57, 85, "P+tRNS", 8, "PNG", "palette_trns_57x85"),  # one transparent palette index
    ImageSpec(64, 48, "P+alpha", 9, "PNG", "palette_alpha_64x48"),  # per-index alpha table
    ImageSpec(113, 250, "LA", 10, "PNG", "gray_alpha_113x250"),
    ImageSpec(42, 70, "RGB", 11, "PNG", "round_half_42x70"),  # 42/28 = 1.5 -> 2, 70/28 = 2.5 -> 2
    ImageSpec(448, 448, "RGB", 12, "PNG", "exact_grid_448x448"),  # multiple of 28 and 32
    ImageSpec(1023, 769, "RGB", 13, "JPEG", "jpeg_1023x769"),
    ImageSpec(45, 300, "L", 14, "JPEG", "jpeg_gray_45x300"),
)

#: conversations: (role, parts) turns; an int part is an index into ``images``.
GOLDEN_CONVERSATIONS: tuple[dict, ...] = (
    {"images": ["rgb_640x480"], "turns": [["user", [0, "What is in this image?"]]]},
    {"images": ["tiny_1x1", "palette_trns_57x85"],
     "turns": [["user", [0, "Describe it."]], ["assistant", ["A dot."]], ["user", [1, "And this one? é 日本語 🙂"]]]},
    {"images": ["jpeg_1023x769", "round_half_42x70", "gray_alpha_113x250"],
     "turns": [["system", ["You are terse."]], ["user", ["Compare ", 0, ", ", 1, " and\n\n", 2, "."]]]},
)

BACKENDS = ("pil", "torchvision")


def sha256_f32le(array: np.ndarray) -> str:
    """sha256 of the float32 little-endian bytes of ``array`` (C order)."""
    return hashlib.sha256(np.ascontiguousarray(array, dtype="<f4").tobytes()).hexdigest()


def sha256_ids(ids: list[int]) -> str:
    """sha256 of token ids as int64 little-endian."""
    return hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest()


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


def bundle_rows(folder: str, path: Path, sources: dict[str, bytes]) -> tuple[dict, list[dict], list[dict]]:
    from transformers import AutoImageProcessor, AutoProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    processor = AutoProcessor.from_pretrained(str(path))
    pil_ip = AutoImageProcessor.from_pretrained(str(path), backend="pil")
    image_processors = {"torchvision": processor.image_processor, "pil": pil_ip}
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessor"
    assert type(pil_ip).__name__ == "Qwen2VLImageProcessorPil"
    ip = processor.image_processor
    config = json.loads((path / "config.json").read_text())
    info = {
        "bundle": folder,
        "model_type": config["model_type"],
        "image_token": processor.image_token,
        "image_token_id": processor.image_token_id,
        "patch_size": ip.patch_size,
        "merge_size": ip.merge_size,
        "min_pixels": ip.size["shortest_edge"],
        "max_pixels": ip.size["longest_edge"],
        "processor_class": type(processor).__name__,
    }
    rows: list[dict] = []
    for backend in BACKENDS:
        for spec in GOLDEN_IMAGES:
            data = sources[spec.name]
            row: dict = {"bundle": folder, "backend": backend, "image": spec.name}
            try:
                out = image_processors[backend](images=[Image.open(io.BytesIO(data))], return_tensors="np")
            except ValueError as exc:
                row["refused"] = f"ValueError: {exc}"
                rows.append(row)
                continue
            pv = np.asarray(out["pixel_values"])
            grid = [int(v) for v in np.asarray(out["image_grid_thw"])[0]]
            factor = ip.patch_size * ip.merge_size
            resized = smart_resize(spec.height, spec.width, factor, ip.size["shortest_edge"], ip.size["longest_edge"])
            tokens = processor._get_num_multimodal_tokens(image_sizes=[[spec.height, spec.width]])["num_image_tokens"][0]
            assert pv.dtype == np.float32, pv.dtype
            assert tokens == grid[0] * grid[1] * grid[2] // ip.merge_size**2
            row.update({
                "resized_hw": [int(resized[0]), int(resized[1])],
                "image_grid_thw": grid,
                "pixel_values_shape": list(pv.shape),
                "pixel_values_sha256": sha256_f32le(pv),
                "num_image_tokens": int(tokens),
            })
            rows.append(row)
    conversations: list[dict] = []
    for conv in GOLDEN_CONVERSATIONS:
        images = [Image.open(io.BytesIO(sources[name])) for name in conv["images"]]
        out = processor.apply_chat_template(
            reference_messages(conv["turns"], images), tokenize=True, return_dict=True,
            add_generation_prompt=True, return_tensors="np",
        )
        ids = [int(v) for v in out["input_ids"][0]]
        collapsed, runs = collapse_runs(ids, processor.image_token_id)
        conversations.append({
            "bundle": folder,
            "images": conv["images"],
            "turns": conv["turns"],
            "input_ids_len": len(ids),
            "input_ids_sha256": sha256_ids(ids),
            "num_image_pad": ids.count(processor.image_token_id),
            "pad_runs": runs,
            "input_ids_collapsed": collapsed,
        })
    return info, rows, conversations


def versions() -> dict[str, str]:
    import PIL
    import torch
    import torchvision
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__,
            "torchvision": torchvision.__version__, "Pillow": PIL.__version__, "numpy": np.__version__,
            "python": sys.version.split()[0]}


def build() -> dict:
    from transformers.image_transforms import convert_to_rgb

    sources = {spec.name: spec.encode() for spec in GOLDEN_IMAGES}
    images = []
    for spec in GOLDEN_IMAGES:
        rgb = convert_to_rgb(Image.open(io.BytesIO(sources[spec.name])), return_numpy=True)
        images.append({"name": spec.name, "width": spec.width, "height": spec.height, "mode": spec.mode,
                       "seed": spec.seed, "format": spec.fmt,
                       "rgb_sha256": hashlib.sha256(np.ascontiguousarray(rgb, dtype=np.uint8).tobytes()).hexdigest()})
    bundles, rows, conversations = [], [], []
    for folder in QWEN_VL_BUNDLES:
        path = find_bundle_dir(folder)
        if path is None:
            raise SystemExit(f"bundle {folder} not found on MMGATE_MODEL_PATH / ../shared/models")
        info, r, c = bundle_rows(folder, path, sources)
        bundles.append(info)
        rows += r
        conversations += c
    return {
        "format": 1,
        "generated_by": "scripts/gen_golden.py",
        "reference": "transformers AutoProcessor (torchvision backend) / AutoImageProcessor(backend='pil')",
        "pixel_values_hash": "sha256 of float32 little-endian C-order bytes",
        "input_ids_hash": "sha256 of int64 little-endian ids",
        "versions": versions(),
        "images": images,
        "bundles": bundles,
        "rows": rows,
        "conversations": conversations,
    }


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
    parser.add_argument("--check", action="store_true", help="compare with the committed file instead of writing")
    parser.add_argument("--out", type=Path, default=QWEN_VL_GOLDEN)
    args = parser.parse_args()
    text = dumps(build())
    if args.check:
        old = args.out.read_text(encoding="utf-8") if args.out.is_file() else ""
        if old == text:
            print(f"{args.out}: up to date")
            return 0
        print(f"{args.out}: differs from a fresh reference run")
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out} ({len(text.encode())} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
