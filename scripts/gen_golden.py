#!/usr/bin/env python
"""Write the golden fixtures tests/families/golden/*.json from the transformers reference.

Tier (a) of docs/parity.md: small fingerprints of what the transformers 5.24 processors produce,
so that ``tests/families/test_golden_replay.py`` checks every family without importing
transformers.  One fixture per entry of :data:`FIXTURES` (the reference side of each is in
``scripts/golden_reference.py``, the images and conversations in ``scripts/golden_corpora.py``):

* ``qwen_vl.json`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): per bundle, backend and image, the resized
  size (reference ``smart_resize``), ``image_grid_thw``, the ``pixel_values`` shape and sha256 and
  the image token count (``_get_num_multimodal_tokens``), or that the reference refuses the image;
  per conversation the ids of ``apply_chat_template(..., tokenize=True)``: sha256, length,
  ``<|image_pad|>`` count, the ids with pad runs collapsed and the run lengths.
* ``llava.json`` / ``llava_next.json``: per backend and image the ``pixel_values`` shape, sha256 and
  eight probe values, ``image_sizes`` (NeXT), the reference geometry (shortest-edge resize size;
  NeXT: the selected pinpoint and the resize-for-patching size) and the token count of
  ``processor(text="<image>", images=[image])``; per conversation the ids of
  ``processor(text=apply_chat_template(tokenize=False), images=...)`` and the batched
  ``pixel_values`` (zero-padded for NeXT) / ``image_sizes``.
* ``gemma3.json``: per backend, image and pan-and-scan option set (the image processor called with
  ``Gemma3Processor.images_kwargs`` overridden by the options) ``num_crops``, the ``pixel_values``
  shape, sha256 and probe values; per conversation the ids of ``processor(text=prompt,
  add_special_tokens=False, **options)`` and the ranges vLLM's ``_find_mm_placeholders`` finds;
  whether the plain processor call adds a second ``<bos>``.
* ``llama4.json`` (``scripts/golden_llama4.py``): torchvision rows only (transformers has no PIL
  Llama 4 image processor): canvas, resize size, ``aspect_ratios``, ``<|patch|>`` count, the
  bfloat16 ``pixel_values`` as float32 sha256 and probes; conversations from
  ``apply_chat_template(tokenize=True)``.
* ``internvl.json``: InternVL3 crops + thumbnail, conversations and clips (``scripts/golden_internvl.py``).
* ``qwen_omni.json`` (Qwen2.5-Omni, Qwen3-Omni): the ``qwen_vl.json`` rows and conversations for the Omni
  bundles' images (``Qwen2VLImageProcessor``; audio parity is tests/families/test_qwen_omni.py's).
* ``qwen3_asr.json``: Qwen3-ASR audio clips (valid frames, tokens, feature sha256) and transcription prompts
  (``scripts/golden_qwen3_asr.py``).

Both image backends everywhere (``torchvision``: ``AutoProcessor.from_pretrained(bundle)
.image_processor``; ``pil``: ``AutoImageProcessor.from_pretrained(bundle, backend="pil")``).
Images are regenerated, not stored: ``parity_support.ImageSpec(width, height, mode, seed,
fmt).encode()`` (seeded numpy, integer arithmetic, PNG stored / JPEG quality 90).  The sha256 of
the RGB pixels the reference decodes (``convert_to_rgb(Image.open(bytes))``) is recorded per image,
so a changed decoder (Pillow / libjpeg) or RNG stream (numpy) is told apart from a changed
preprocessing; versions of transformers, torch, torchvision, Pillow and numpy are recorded.

Usage:  HF_HUB_OFFLINE=1 python scripts/gen_golden.py [--family NAME ...] [--check]
    --family: only these fixtures (default: all); --check: regenerate in memory and report
    differences instead of writing (exit 1 if any fixture differs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "families"))
sys.path.insert(0, str(REPO / "scripts"))

from golden_reference import gemma3_golden, llava_golden, qwen_vl_golden  # noqa: E402
from golden_llava_onevision import onevision_golden  # noqa: E402
from golden_llama4 import llama4_golden  # noqa: E402
from golden_internvl import internvl_golden  # noqa: E402
from golden_qwen3_asr import qwen3_asr_golden  # noqa: E402
from parity_support import GOLDEN_DIR, QWEN_OMNI_BUNDLES  # noqa: E402

#: fixture name (``golden/<name>.json``) -> the builder of its content
FIXTURES: dict[str, Callable[[], dict]] = {
    "qwen_vl": qwen_vl_golden,
    "llava": lambda: llava_golden("llava-hf--llava-1.5-7b-hf"),
    "llava_next": lambda: llava_golden("llava-hf--llava-v1.6-mistral-7b-hf"),
    "gemma3": gemma3_golden,
    "llava_onevision": onevision_golden,
    "llama4": llama4_golden,
    "internvl": internvl_golden,
    "qwen_omni": lambda: qwen_vl_golden(QWEN_OMNI_BUNDLES),
    "qwen3_asr": qwen3_asr_golden,
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
    parser.add_argument("--family", action="append", choices=sorted(FIXTURES),
                        help="regenerate only this fixture (repeatable; default: all)")
    parser.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    args = parser.parse_args()
    status = 0
    for name in args.family or FIXTURES:
        out_path = GOLDEN_DIR / f"{name}.json"
        text = dumps(FIXTURES[name]())
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
