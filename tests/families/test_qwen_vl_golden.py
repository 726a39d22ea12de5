"""Tier (a): mmgate against golden fingerprints of the transformers reference.

``golden/qwen_vl.json`` was written by ``scripts/gen_golden.py`` from the
transformers processors (versions recorded in the file).  This test imports
neither transformers nor (for the ``pil`` rows) torch: it regenerates the same
image bytes (``parity_support.ImageSpec.encode``), runs them through mmgate
(``decode_image`` -> ``plan`` -> ``preprocess_one`` -> ``assemble``) and
compares the resized size, ``image_grid_thw``, the ``pixel_values`` shape and
the sha256 of its float32 little-endian bytes, and the image token count.
The ``torchvision`` rows need no torch either: mmgate reproduces torch's uint8
resize itself (``mmgate.media.tv_resize``; ``tests/media/test_torch_free.py`` runs
the torchvision backend with torch unimportable).

Conversations: the prompt rendered and tokenized by mmgate, each anchor
spliced with ``family.expand``, must give the reference ``input_ids`` (sha256,
length, pad count, the ids with pad runs collapsed, and the run lengths).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from functools import lru_cache
from pathlib import Path

import numpy as np
import PIL
import pytest

from parity_support import QWEN_VL_GOLDEN, ImageSpec, find_bundle_dir, openai_messages, splice_anchors

from mmgate.chat.template import render_chat
from mmgate.chat.tokenizer import load_tokenizer
from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.image import decode_image
from mmgate.models.bundle import load_bundle
from mmgate.models.family import assemble
from mmgate.models.registry import load_family
from mmgate.config.settings import FetchSettings
from mmgate.models.backend import ImageBackend

GOLDEN = json.loads(QWEN_VL_GOLDEN.read_text(encoding="utf-8"))
IMAGES = {img["name"]: img for img in GOLDEN["images"]}
VERSIONS = GOLDEN["versions"]
MAX_DECODE_PIXELS = FetchSettings().max_image_pixels


def versions_note() -> str:
    """Recorded vs local versions: a different Pillow may legitimately change PIL decodes and resizes."""
    local = {"Pillow": PIL.__version__, "numpy": np.__version__}
    try:
        import torch
        import torchvision

        local |= {"torch": torch.__version__, "torchvision": torchvision.__version__}
    except ImportError:
        local |= {"torch": "missing", "torchvision": "missing"}
    parts = [f"{k} golden={VERSIONS.get(k)} here={v}" for k, v in local.items()]
    return ("(" + ", ".join(parts) + f"; golden from transformers {VERSIONS.get('transformers')}. "
            "The PIL backend's decode (JPEG) and resize depend on the Pillow version and the torchvision backend's "
            "resize on torch: if a version differs, regenerate with scripts/gen_golden.py and check the live tier "
            "test_qwen_vl_live_parity.py before calling this an mmgate bug)")


def spec_of(name: str) -> ImageSpec:
    img = IMAGES[name]
    return ImageSpec(img["width"], img["height"], img["mode"], img["seed"], img["format"], name)


@lru_cache(maxsize=None)
def image_bytes(name: str) -> bytes:
    return spec_of(name).encode()


@lru_cache(maxsize=None)
def bundle_and_tokenizer(folder: str):
    path = find_bundle_dir(folder)
    if path is None:
        pytest.skip(f"model bundle {folder} not on MMGATE_MODEL_PATH / ../shared/models")
    bundle = load_bundle(Path(path))
    return bundle, load_tokenizer(bundle)


@lru_cache(maxsize=None)
def family_for(folder: str, backend: str):
    bundle, tok = bundle_and_tokenizer(folder)
    return load_family(bundle, tok, ImageBackend(backend))


def sha256_f32le(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array, dtype="<f4").tobytes()).hexdigest()


def _row_id(row: dict) -> str:
    return f"{row['bundle'].split('--')[1]}-{row['backend']}-{row['image']}"


def test_golden_file_is_small_and_covers_every_bundle_backend_and_image() -> None:
    assert QWEN_VL_GOLDEN.stat().st_size < 200_000
    keys = {(r["bundle"], r["backend"], r["image"]) for r in GOLDEN["rows"]}
    assert keys == {(b["bundle"], be, name) for b in GOLDEN["bundles"] for be in ("pil", "torchvision") for name in IMAGES}
    assert {b["model_type"] for b in GOLDEN["bundles"]} == {"qwen2_vl", "qwen2_5_vl", "qwen3_vl"}


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_decoded_rgb_pixels_equal_the_reference_decode(name: str) -> None:
    decoded = decode_image(image_bytes(name), MAX_DECODE_PIXELS)
    digest = hashlib.sha256(np.ascontiguousarray(decoded.pixels).tobytes()).hexdigest()
    assert digest == IMAGES[name]["rgb_sha256"], (
        f"{spec_of(name).label()}: decoded RGB differs from the reference decode "
        f"(convert_to_rgb(Image.open(bytes))) {versions_note()}"
    )


@pytest.mark.parametrize("row", GOLDEN["rows"], ids=_row_id)
def test_pixel_values_fingerprint_equals_the_reference(row: dict) -> None:
    family = family_for(row["bundle"], row["backend"])
    label = f"{row['bundle']} backend={row['backend']} image={spec_of(row['image']).label()}"
    decoded = decode_image(image_bytes(row["image"]), MAX_DECODE_PIXELS)
    if "refused" in row:
        with pytest.raises(GatewayError) as info:
            family.image.plan(decoded.height, decoded.width)
        assert info.value.code is ErrorCode.IMAGE_ASPECT_RATIO_INVALID, label
        return
    plan = family.image.plan(decoded.height, decoded.width)
    assert list(plan.resized_hw) == row["resized_hw"], label
    assert list(plan.detail) == row["image_grid_thw"], label
    assert plan.num_tokens == row["num_image_tokens"], label
    batch = assemble(family.image, [plan], [family.image.preprocess(decoded, plan)])
    pv = batch.tensors["pixel_values"]
    assert pv.dtype == np.float32, label
    assert list(pv.shape) == row["pixel_values_shape"], label
    assert batch.tensors["image_grid_thw"].tolist() == [row["image_grid_thw"]], label
    assert sha256_f32le(pv) == row["pixel_values_sha256"], f"{label}: pixel_values differ from the golden {versions_note()}"


@pytest.mark.parametrize("backend", ["pil", "torchvision"])
@pytest.mark.parametrize("conv", GOLDEN["conversations"],
                         ids=lambda c: f"{c['bundle'].split('--')[1]}-{len(c['images'])}img")
def test_expanded_input_ids_equal_the_reference_chat_template(conv: dict, backend: str) -> None:
    bundle, tok = bundle_and_tokenizer(conv["bundle"])
    family = family_for(conv["bundle"], backend)
    urls = [f"data:image/png;base64,<{i}>" for i in range(len(conv["images"]))]  # the template only tests the key
    prompt = render_chat(bundle.chat_template, openai_messages(conv["turns"], urls), tok.special_tokens)
    anchored = tok.encode_prompt(prompt)
    decoded = [decode_image(image_bytes(name), MAX_DECODE_PIXELS) for name in conv["images"]]
    plans = [family.image.plan(im.height, im.width) for im in decoded]
    ids = splice_anchors(anchored, family.image.image_token_id, [family.image.expand(pl).token_ids for pl in plans])
    pad = family.image.image_token_id
    assert anchored == conv["input_ids_collapsed"]  # one pad per image before expansion
    assert [pl.num_tokens for pl in plans] == conv["pad_runs"]
    assert len(ids) == conv["input_ids_len"]
    assert ids.count(pad) == conv["num_image_pad"]
    assert hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest() == conv["input_ids_sha256"]


def test_pil_backend_rows_run_without_transformers_or_torch() -> None:
    """The golden tier's core claim: mmgate's PIL path needs neither transformers nor torch."""
    row = next(r for r in GOLDEN["rows"] if r["backend"] == "pil" and "refused" not in r)
    script = textwrap.dedent(f"""
        import hashlib, sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("transformers", "torch", "torchvision"):
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        import numpy as np
        from pathlib import Path
        from parity_support import ImageSpec, find_bundle_dir
        from mmgate.chat.tokenizer import load_tokenizer
        from mmgate.media.image import decode_image
        from mmgate.models.bundle import load_bundle
        from mmgate.models.registry import load_family
        from mmgate.models.backend import ImageBackend
        from mmgate.types import Modality
        bundle = load_bundle(Path(find_bundle_dir({row['bundle']!r})))
        family = load_family(bundle, load_tokenizer(bundle), ImageBackend.PIL)
        img = {IMAGES[row['image']]!r}
        data = ImageSpec(img["width"], img["height"], img["mode"], img["seed"], img["format"]).encode()
        decoded = decode_image(data, 10**9)
        plan = family.image.plan(decoded.height, decoded.width)
        rows = family.image.preprocess(decoded, plan)
        assert not any(m.split(".")[0] in ("transformers", "torch") for m in sys.modules)
        print(hashlib.sha256(np.ascontiguousarray(rows, dtype="<f4").tobytes()).hexdigest())
    """)
    if find_bundle_dir(row["bundle"]) is None:
        pytest.skip(f"model bundle {row['bundle']} not on the model search path")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == row["pixel_values_sha256"]
