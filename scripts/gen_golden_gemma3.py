#!/usr/bin/env python
"""Write tests/families/golden/gemma3.json from the transformers reference (Gemma 3).

Tier (a) for the Gemma 3 family: small fingerprints of what transformers produces, so that
``tests/families/test_gemma3_golden.py`` checks mmgate without importing transformers.

Reference (transformers 5.24, bundle ``google--gemma-3-4b-it`` on ``MMGATE_MODEL_PATH``):
* pixels: for each backend (``torchvision``: ``AutoProcessor.from_pretrained(bundle).image_processor``
  = ``Gemma3ImageProcessor``; ``pil``: ``AutoImageProcessor.from_pretrained(bundle, backend="pil")``
  = ``Gemma3ImageProcessorPil``), each image of :data:`GOLDEN_IMAGES` and each option set of
  :data:`OPTION_SETS`, the image processor called with the kwargs ``Gemma3Processor`` gives it
  (``Gemma3Processor.images_kwargs`` overridden by the options: ``do_convert_rgb=True``, the four
  pan-and-scan values); recorded: ``num_crops``, the shape and the sha256 of the float32
  little-endian ``pixel_values`` bytes and a few probe values;
* prompts: for each of :data:`GOLDEN_CONVERSATIONS`, ``processor.apply_chat_template(messages,
  tokenize=False, add_generation_prompt=True)`` then ``processor(text=prompt, images=...,
  add_special_tokens=False, **options)`` (= ``apply_chat_template(tokenize=True)``: the prompt
  starts with ``<bos>``); recorded: the ids' sha256, length, soft-token count, the ids with soft
  runs collapsed, the run lengths, and the placeholder ranges vLLM's ``_find_mm_placeholders``
  finds (``gemma3_support.vllm_placeholders`` over the replacement texts of
  ``Gemma3Processor.replace_image_token``).  Whether ``processor(text=prompt)`` without
  ``add_special_tokens=False`` adds a second ``<bos>`` is recorded per bundle.

Images are regenerated from ``parity_support.ImageSpec`` (seeded, integer arithmetic); the sha256
of the RGB pixels the reference decodes (``convert_to_rgb(Image.open(bytes))``) and the versions of
transformers, torch, torchvision, Pillow and numpy are recorded.

Usage:  HF_HUB_OFFLINE=1 python scripts/gen_golden_gemma3.py [--check]
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
sys.path.insert(0, str(REPO / "scripts"))

import numpy as np
from gemma3_support import (
    GEMMA3_BUNDLE,
    GEMMA3_GOLDEN,
    PAS_CUSTOM,
    PAS_ON,
    collapse_runs,
    probe,
    reference_messages,
    sha256_f32le,
    sha256_ids,
    vllm_placeholders,
)
from gen_golden import dumps, versions
from parity_support import ImageSpec, find_bundle_dir
from PIL import Image

#: the golden corpus; comments give the pan-and-scan outcome with the defaults (256 / 4 / 1.2)
GOLDEN_IMAGES: tuple[ImageSpec, ...] = (
    ImageSpec(640, 480, "RGB", 1, "PNG", "rgb_640x480"),  # ratio 1.33 -> 2 crops of 480x320
    ImageSpec(1500, 480, "RGBA", 2, "PNG", "rgba_wide_1500x480"),  # ratio 3.1 -> 3 crops of 480x500
    ImageSpec(1, 1, "L", 3, "PNG", "tiny_1x1"),  # no crops (crop side < 256)
    ImageSpec(300, 1200, "P", 4, "PNG", "palette_tall_300x1200"),  # ratio 4 -> 4 crops of 300x300
    ImageSpec(896, 896, "RGB", 5, "PNG", "exact_896x896"),  # no resize at all
    ImageSpec(1792, 896, "RGB", 6, "PNG", "crops_exact_1792x896"),  # 2 crops of exactly 896x896
    ImageSpec(1001, 300, "LA", 7, "PNG", "uneven_1001x300"),  # 3 crops, the last one 333 wide
    ImageSpec(600, 500, "RGB", 8, "PNG", "ratio_1.2_600x500"),  # ratio exactly 1.2: activates, 2 crops
    ImageSpec(599, 500, "RGB", 9, "PNG", "ratio_below_599x500"),  # ratio 1.198: no crops
    ImageSpec(510, 400, "P+tRNS", 10, "PNG", "crop_255_510x400"),  # 2 crops of 255 < 256: none
    ImageSpec(511, 400, "P+alpha", 11, "PNG", "crop_256_511x400"),  # 2 crops of 256 (last 255)
    ImageSpec(2000, 3, "RGB", 12, "PNG", "strip_2000x3"),  # thin strip: crop height 3 < 256, none
    ImageSpec(1023, 769, "RGB", 13, "JPEG", "jpeg_1023x769"),  # ratio 1.33 -> 2 crops
    ImageSpec(45, 300, "L", 14, "JPEG", "jpeg_gray_45x300"),  # crop width 45 < 256: none
)

#: ``mm_processor_kwargs`` per row: off (the bundle's default), on, and custom values on a few images
OPTION_SETS: tuple[tuple[dict, tuple[str, ...] | None], ...] = (
    ({}, None),
    (PAS_ON, None),
    (PAS_CUSTOM, ("rgb_640x480", "uneven_1001x300", "jpeg_gray_45x300", "exact_896x896")),
)

#: conversations: (role, parts) turns; an int part indexes ``images``; ``options``: mm_processor_kwargs
GOLDEN_CONVERSATIONS: tuple[dict, ...] = (
    {"images": ["rgb_640x480"], "options": {}, "turns": [["user", ["look:\n", 0, "\nnow"]]]},
    {"images": ["rgb_640x480", "tiny_1x1"], "options": {},
     "turns": [["system", ["You are terse."]], ["user", [0, 1, "Compare."]]]},  # "\n\n\n\n" tokens
    {"images": ["jpeg_gray_45x300"], "options": {},
     "turns": [["system", ["Rules:\n"]], ["user", [0, "What is it?"]]]},  # five newlines: one token
    {"images": ["rgba_wide_1500x480", "palette_tall_300x1200", "tiny_1x1"], "options": PAS_ON,
     "turns": [["user", ["A", 0, "B", 1, "C", 2]]]},
    {"images": ["uneven_1001x300", "crop_256_511x400"], "options": PAS_CUSTOM,
     "turns": [["user", [0, "Describe it."]], ["assistant", ["A gradient."]],
               ["user", ["And this one? é 日本語 🙂\n\n", 1]]]},
)

BACKENDS = ("pil", "torchvision")


def reference(path: Path) -> tuple[object, dict[str, object]]:
    from transformers import AutoImageProcessor, AutoProcessor

    processor = AutoProcessor.from_pretrained(str(path))
    pil_ip = AutoImageProcessor.from_pretrained(str(path), backend="pil")
    assert type(processor).__name__ == "Gemma3Processor"
    assert type(processor.image_processor).__name__ == "Gemma3ImageProcessor"
    assert type(pil_ip).__name__ == "Gemma3ImageProcessorPil"
    return processor, {"torchvision": processor.image_processor, "pil": pil_ip}


def image_kwargs(options: dict) -> dict:
    """What ``Gemma3Processor`` hands its image processor: its ``images_kwargs`` defaults (the
    bundle's ``preprocessor_config.json`` has null for all of them) overridden by ``options``."""
    from transformers import Gemma3Processor

    return {**Gemma3Processor.images_kwargs, **options}


def pixel_rows(image_processors: dict, sources: dict[str, bytes]) -> list[dict]:
    rows: list[dict] = []
    for backend in BACKENDS:
        for options, only in OPTION_SETS:
            for spec in GOLDEN_IMAGES:
                if only is not None and spec.name not in only:
                    continue
                out = image_processors[backend](images=[Image.open(io.BytesIO(sources[spec.name]))],
                                                **image_kwargs(options), return_tensors="np")
                pv = np.asarray(out["pixel_values"])
                assert pv.dtype == np.float32, pv.dtype
                rows.append({"bundle": GEMMA3_BUNDLE, "backend": backend, "image": spec.name, "options": options,
                             "num_crops": int(np.asarray(out["num_crops"])[0]), "pixel_values_shape": list(pv.shape),
                             "pixel_values_sha256": sha256_f32le(pv), "probe": probe(pv)})
    return rows


def conversation_rows(processor, sources: dict[str, bytes]) -> list[dict]:
    tok = processor.tokenizer
    soft = tok.image_token_id
    newlines = tuple(tok.convert_tokens_to_ids(t) for t in ("\n", "\n\n", "\n\n\n", "\n\n\n\n"))
    out: list[dict] = []
    for conv in GOLDEN_CONVERSATIONS:
        images = [Image.open(io.BytesIO(sources[name])) for name in conv["images"]]
        messages = reference_messages(conv["turns"], images)
        prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ref = processor(text=prompt, images=images, add_special_tokens=False, **conv["options"], return_tensors="np")
        ids = [int(v) for v in ref["input_ids"][0]]
        if not conv["options"]:
            tokenized = processor.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                      add_generation_prompt=True, return_tensors="np")
            assert [int(v) for v in tokenized["input_ids"][0]] == ids
        # num_crops as the processor computes it (it pops them: Gemma3Processor.unused_input_names)
        crops = [int(v) for v in processor.image_processor(images=images, **image_kwargs(conv["options"]))["num_crops"]]
        assert np.asarray(ref["pixel_values"]).shape[0] == len(images) + sum(crops)
        texts = [processor.replace_image_token({"num_crops": crops}, i) for i in range(len(images))]
        ranges = vllm_placeholders(ids, [tok.encode(t, add_special_tokens=False) for t in texts], newlines)
        collapsed, runs = collapse_runs(ids, soft)
        out.append({"bundle": GEMMA3_BUNDLE, "images": conv["images"], "options": conv["options"],
                    "turns": conv["turns"], "prompt": prompt, "num_crops": crops, "input_ids_len": len(ids),
                    "input_ids_sha256": sha256_ids(ids), "num_image_soft": ids.count(soft), "soft_runs": runs,
                    "input_ids_collapsed": collapsed,
                    "vllm_placeholders": None if ranges is None else [list(r) for r in ranges]})
    return out


def build() -> dict:
    from transformers.image_transforms import convert_to_rgb

    path = find_bundle_dir(GEMMA3_BUNDLE)
    if path is None:
        raise SystemExit(f"bundle {GEMMA3_BUNDLE} not found on MMGATE_MODEL_PATH / ../shared/models")
    processor, image_processors = reference(path)
    sources = {spec.name: spec.encode() for spec in GOLDEN_IMAGES}
    images = []
    for spec in GOLDEN_IMAGES:
        rgb = convert_to_rgb(Image.open(io.BytesIO(sources[spec.name])), return_numpy=True)
        images.append({"name": spec.name, "width": spec.width, "height": spec.height, "mode": spec.mode,
                       "seed": spec.seed, "format": spec.fmt,
                       "rgb_sha256": hashlib.sha256(np.ascontiguousarray(rgb, dtype=np.uint8).tobytes()).hexdigest()})
    tok = processor.tokenizer
    config = json.loads((path / "config.json").read_text())
    probe_prompt = "<bos><start_of_turn>user\n<start_of_image>hi<end_of_turn>\n"
    one = Image.open(io.BytesIO(sources["tiny_1x1"]))
    doubled = [int(v) for v in processor(text=probe_prompt, images=[one])["input_ids"][0]]
    single = [int(v) for v in processor(text=probe_prompt, images=[one], add_special_tokens=False)["input_ids"][0]]
    bundle = {
        "bundle": GEMMA3_BUNDLE, "model_type": config["model_type"], "processor_class": type(processor).__name__,
        "image_processor_classes": {be: type(ip).__name__ for be, ip in image_processors.items()},
        "boi_token_id": tok.boi_token_id, "eoi_token_id": tok.eoi_token_id, "image_token_id": tok.image_token_id,
        "bos_token_id": tok.bos_token_id, "image_seq_length": processor.image_seq_length,
        "size": dict(image_processors["pil"].size), "images_kwargs": image_kwargs({}),
        "full_image_sequence_sha256": hashlib.sha256(processor.full_image_sequence.encode()).hexdigest(),
        "processor_call_adds_second_bos": doubled == [tok.bos_token_id] + single,
    }
    return {
        "format": 1,
        "generated_by": "scripts/gen_golden_gemma3.py",
        "reference": "transformers Gemma3Processor (torchvision image processor) / Gemma3ImageProcessorPil; "
                     "ids: processor(text=apply_chat_template(tokenize=False), add_special_tokens=False)",
        "pixel_values_hash": "sha256 of float32 little-endian C-order bytes",
        "input_ids_hash": "sha256 of int64 little-endian ids",
        "versions": versions(),
        "images": images,
        "bundles": [bundle],
        "rows": pixel_rows(image_processors, sources),
        "conversations": conversation_rows(processor, sources),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed file instead of writing")
    parser.add_argument("--out", type=Path, default=GEMMA3_GOLDEN)
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
