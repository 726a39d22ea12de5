"""Tier (a): every family against the golden fingerprints of the transformers reference.

One set of tests for all fixtures of ``golden/`` (written by ``scripts/gen_golden.py``, versions
recorded in each), parametrized over ``replay.FAMILIES``: no transformers here, and no torch for
the ``pil`` rows (the ``torchvision`` rows need none either: mmgate reproduces torch's uint8
resize itself, ``mmgate.media.tv_resize``).  Per fixture:

* the file is small and has a row for every bundle x backend x image (x option set);
* every image decodes to the RGB pixels the reference decodes;
* every pixel row replays (``decode_image`` -> ``plan`` -> ``preprocess`` -> ``assemble``) to the
  recorded geometry, token count, ``pixel_values`` shape and sha256 and auxiliary tensors
  (``replay.qwen_vl_row`` / ``llava_row`` / ``gemma3_row``);
* every conversation, rendered and tokenized by mmgate and expanded by the family, gives the
  reference ids (and ranges, and batch where recorded) on each of its backends;
* one pil row recomputed in a child process that cannot import transformers or torch.

What only one family has (the pan-and-scan arithmetic, the anyres worked examples, refusals,
wire specs) is in ``test_<family>_golden.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from parity_support import GOLDEN_DIR, find_bundle_dir, sha256_rgb
from replay import FAMILIES, GoldenFamily, decoded, golden, spec_of, versions_note

BY_NAME = {f.name: f for f in FAMILIES}
FAMILY_PARAMS = [pytest.param(f, id=f.name) for f in FAMILIES]
IMAGES = [pytest.param(f.name, img["name"], id=f"{f.name}-{img['name']}")
          for f in FAMILIES for img in golden(f.name)["images"]]
ROWS = [pytest.param(f.name, row, id=f"{f.name}-{f.row_id(row)}") for f in FAMILIES for row in golden(f.name)["rows"]]
CONVERSATIONS = [
    pytest.param(f.name, conv, backend,
                 id=f"{f.name}-{conv['bundle'].split('--')[1]}-{len(conv['images'])}img"
                    f"{'-pas' if conv.get('options') else ''}-{backend}")
    for f in FAMILIES for conv in golden(f.name)["conversations"] for backend in f.conversation_backends
]


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_golden_file_is_small_and_covers_every_bundle_backend_image_and_option_set(family: GoldenFamily) -> None:
    fixture = golden(family.name)
    assert (GOLDEN_DIR / f"{family.name}.json").stat().st_size < family.max_bytes
    keys = {(r["bundle"], r["backend"], r["image"], json.dumps(r.get("options", {}), sort_keys=True))
            for r in fixture["rows"]}
    wanted = {(b["bundle"], be, img["name"], json.dumps(opts, sort_keys=True)) for b in fixture["bundles"]
              for be in family.backends for img in fixture["images"] for opts in family.option_sets}
    assert wanted <= keys
    assert {r[:3] for r in keys} == {w[:3] for w in wanted}  # no row of another bundle, backend or image
    assert {b["model_type"] for b in fixture["bundles"]} == family.model_types
    assert {len(c["images"]) for c in fixture["conversations"]} == {1, 2, 3}


@pytest.mark.parametrize(("name", "image"), IMAGES)
def test_decoded_rgb_pixels_equal_the_reference_decode(name: str, image: str) -> None:
    entry = next(i for i in golden(name)["images"] if i["name"] == image)
    assert sha256_rgb(decoded(name, image).pixels) == entry["rgb_sha256"], (
        f"{spec_of(name, image).label()}: decoded RGB differs from the reference decode "
        f"(convert_to_rgb(Image.open(bytes))) {versions_note(name)}")


@pytest.mark.parametrize(("name", "row"), ROWS)
def test_pixel_values_geometry_and_token_count_equal_the_reference(name: str, row: dict) -> None:
    BY_NAME[name].replay_row(name, row)


@pytest.mark.parametrize(("name", "conv", "backend"), CONVERSATIONS)
def test_expanded_input_ids_equal_the_reference_chat(name: str, conv: dict, backend: str) -> None:
    BY_NAME[name].replay_conversation(name, conv, backend)


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_pil_backend_runs_without_transformers_or_torch(family: GoldenFamily) -> None:
    """The golden tier's core claim: mmgate's PIL path needs neither transformers nor torch."""
    row = next(r for r in golden(family.name)["rows"]
               if r["backend"] == family.backends[0] and family.torch_free_row(r))
    if find_bundle_dir(row["bundle"]) is None:
        pytest.skip(f"model bundle {row['bundle']} not on the model search path")
    img = next(i for i in golden(family.name)["images"] if i["name"] == row["image"])
    script = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("transformers", "torch", "torchvision"):
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        from pathlib import Path
        from parity_support import ImageSpec, find_bundle_dir, sha256_f32le
        from mmgate.chat.tokenizer import load_tokenizer
        from mmgate.media.image import decode_image
        from mmgate.models.bundle import load_bundle
        from mmgate.models.registry import load_family
        from mmgate.models.backend import ImageBackend
        from mmgate.types import ItemHints
        bundle = load_bundle(Path(find_bundle_dir({row['bundle']!r})))
        proc = load_family(bundle, load_tokenizer(bundle), ImageBackend({row['backend']!r})).image
        decoded = decode_image(ImageSpec({img['width']}, {img['height']}, {img['mode']!r}, {img['seed']},
                                         {img['format']!r}).encode(), 10**9)
        options = tuple(sorted({row.get('options', {})!r}.items()))
        plan = proc.plan(decoded.height, decoded.width, ItemHints(options=options) if options else None)
        share = proc.preprocess(decoded, plan)
        assert not any(m.split(".")[0] in ("transformers", "torch") for m in sys.modules)
        print(sha256_f32le(share))
    """)
    out = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == row["pixel_values_sha256"]
