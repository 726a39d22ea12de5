"""Issue 24 item 4: each family's tensors on the vLLM wire, as vLLM's own processor lays them out.

A real gateway (in a thread, the family's bundle) sends a two-image request to a recording
vLLM-wire worker (:mod:`tests.support.fake_worker`); the request it received is turned into
vLLM's kwargs by the real servicer code (smg-grpc-servicer 0.14.1 ``vllm/servicer.py``
``VllmEngineServicer._build_preprocessed_mm_inputs``, compiled from the installed file by
:func:`tests.support.servicer_code.vllm_input`).  For every key the servicer hands vLLM, its field
layout (batched / flat with which sizes / shared, keep-on-CPU) is compared with the layout vLLM's
processor for the model declares (:data:`VLLM_FIELDS`, written out from vLLM's
``_get_mm_fields_config`` of each model file, cited per row); the keys mmgate adds only because
the servicer needs a flat key's sizes in the batch are listed apart (:data:`SIZES_KEYS`).  Each
item's embedding positions (the placeholder range, masked by ``is_embed`` where the servicer builds
one) are counted against transformers' processor for the same image, and the encoder input against
its ``pixel_values``.  docs/families.md's table names every key.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from mmgate.config.settings import Settings
from tests.conftest import bundle_dir
from tests.support.fake_worker import FakeWorker, FakeWorkerState
from tests.support.servers import gateway_in_thread
from tests.support.servicer_code import VllmInput, vllm_input

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Layout:
    """One key as vLLM's processor declares it: ``kind`` batched / flat / shared; a flat key's
    sizes key; ``keep_on_cpu``."""

    kind: str
    sizes_key: str | None = None
    keep_on_cpu: bool = False


BATCHED, BATCHED_CPU = Layout("batched"), Layout("batched", keep_on_cpu=True)


@dataclass(frozen=True)
class Case:
    """A family's bundle, its ``model_type``, the token vLLM embeds into (its ``im_token_id``), what
    vLLM declares, the request's processor options."""

    model: str
    model_type: str
    embed_token: str
    fields: dict[str, Layout]
    sizes_keys: frozenset[str] = frozenset()
    options: dict[str, Any] = field(default_factory=dict)


#: vLLM's ``_get_mm_fields_config`` per model (the keys an image request produces), with the keys
#: mmgate adds as the servicer's flat sizes (vLLM computes those sizes inside its field factory).
CASES = {
    # vllm/model_executor/models/qwen2_vl.py _create_qwen2vl_field_factory: pixel_values
    # flat_from_sizes("image", image_grid_thw.prod(-1)), image_grid_thw batched(keep_on_cpu=True)
    "qwen2_5_vl": Case("Qwen/Qwen2.5-VL-7B-Instruct", "qwen2_5_vl", "<|image_pad|>",
                       {"pixel_values": Layout("flat", "patches_per_image"), "image_grid_thw": BATCHED_CPU,
                        "patches_per_image": BATCHED},
                       sizes_keys=frozenset({"patches_per_image"})),
    # vllm/model_executor/models/llava.py LlavaMultiModalProcessor._get_mm_fields_config: pixel_values batched
    "llava": Case("llava-hf/llava-1.5-7b-hf", "llava", "<image>", {"pixel_values": BATCHED}),
    # vllm/model_executor/models/llava_next.py _get_mm_fields_config: pixel_values, image_sizes batched
    "llava_next": Case("llava-hf/llava-v1.6-mistral-7b-hf", "llava_next", "<image>",
                       {"pixel_values": BATCHED, "image_sizes": BATCHED}),
    # vllm/model_executor/models/gemma3_mm.py Gemma3MultiModalProcessor: _call_hf_processor adds
    # num_patches = num_crops + 1; _get_mm_fields_config: pixel_values flat_from_sizes("image",
    # num_patches), num_patches batched.  No num_crops (transformers' Gemma3Processor pops it).
    "gemma3": Case("google/gemma-3-4b-it", "gemma3", "<image_soft_token>",
                   {"pixel_values": Layout("flat", "num_patches"), "num_patches": BATCHED},
                   options={"do_pan_and_scan": True}),
    # vllm/model_executor/models/llava_onevision.py (0.33) LlavaOnevisionMultiModalProcessor._get_mm_fields_config:
    # pixel_values, image_sizes batched("image") (pixel_values_videos batched("video"): a video request)
    "llava_onevision": Case("llava-hf/llava-onevision-qwen2-0.5b-ov-hf", "llava_onevision", "<image>",
                            {"pixel_values": BATCHED, "image_sizes": BATCHED}),
    # vllm/model_executor/models/mllama4.py Mllama4MultiModalProcessor: _call_hf_processor adds
    # aspect_ratios and patches_per_image; _get_mm_fields_config: pixel_values
    # flat_from_sizes("image", patches_per_image), patches_per_image and aspect_ratios batched;
    # _get_prompt_updates: select_text(repl, "<|patch|>"), so is_embed marks <|patch|> in the run
    "llama4": Case("meta-llama/Llama-4-Scout-17B-16E-Instruct", "llama4", "<|patch|>",
                   {"pixel_values": Layout("flat", "patches_per_image"), "patches_per_image": BATCHED,
                    "aspect_ratios": BATCHED}),
    # vllm/model_executor/models/interns1.py (serves the HF-format InternVLForConditionalGeneration)
    # InternS1MultiModalProcessor._get_mm_fields_config: pixel_values flat_from_sizes("image",
    # image_num_patches), image_num_patches batched, image_token_id shared; select_text(<img>...</img>,
    # <IMG_CONTEXT>): the range holds <img> / </img>, is_embed marks the context tokens
    "internvl": Case("OpenGVLab/InternVL3-1B-hf", "internvl", "<IMG_CONTEXT>",
                     {"pixel_values": Layout("flat", "image_num_patches"), "image_num_patches": BATCHED,
                      "image_token_id": Layout("shared")}),
}

#: two images: landscape 640x480 and a tall 300x1001 (Gemma 3 cuts crops from both with pan-and-scan)
SIZES = ((640, 480), (300, 1001))


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([(xx * 3) % 256, (yy * 5) % 256, ((xx + yy) * 7) % 256], axis=-1)
    return Image.fromarray(np.clip(base + rng.integers(0, 32, base.shape), 0, 255).astype(np.uint8))


def _png(im: Image.Image) -> str:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


IMAGES = [_image(w, h, k) for k, (w, h) in enumerate(SIZES)]


@cache
def _processor(model: str) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(bundle_dir(model))


def _reference(case: Case) -> tuple[list[int], torch.Tensor]:
    """transformers: each image's embedding-position count (its ``embed_token`` ids in the processor's
    ``input_ids``) and the two images' ``pixel_values`` from one call."""
    proc = _processor(case.model)
    anchor = getattr(proc, "boi_token", None) or proc.image_token
    token = proc.tokenizer.convert_tokens_to_ids(case.embed_token)
    counts = []
    for im in IMAGES:
        ids = proc(text=anchor, images=[im], return_tensors="pt", **case.options)["input_ids"][0]
        counts.append(int((ids == token).sum()))
    both = proc(text=anchor + " " + anchor, images=IMAGES, return_tensors="pt", **case.options)
    return counts, both["pixel_values"]


@pytest.fixture(scope="module", params=sorted(CASES))
def received(request: pytest.FixtureRequest) -> Iterator[tuple[Case, VllmInput]]:
    """The family's two-image request as the real servicer hands it to vLLM."""
    case = CASES[request.param]
    worker = FakeWorker(FakeWorkerState(model_type=case.model_type))
    settings = Settings(model=str(bundle_dir(case.model)), served_model_name=case.model, worker_urls=(worker.url,))
    try:
        with gateway_in_thread(settings) as base:
            content = [{"type": "text", "text": "Compare them."}]
            content += [{"type": "image_url", "image_url": {"url": _png(im)}} for im in IMAGES]
            body: dict[str, Any] = {"model": case.model, "max_tokens": 1,
                                    "messages": [{"role": "user", "content": content}]}
            if case.options:
                body["mm_processor_kwargs"] = case.options
            r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
        (got,) = worker.state.received
        assert got.request is not None
        yield case, vllm_input(got.request)
    finally:
        worker.stop()


def test_every_key_has_the_layout_vllm_declares(received: tuple[Case, VllmInput]) -> None:
    case, vin = received
    assert set(vin.fields) == set(case.fields), "keys the servicer hands vLLM"
    for key, want in case.fields.items():
        got = vin.fields[key]
        assert (got.modality, got.kind, got.keep_on_cpu) == ("image", want.kind, want.keep_on_cpu), key
        tensor = vin.tensors[key]
        if want.kind == "batched":
            assert tensor.shape[0] == len(IMAGES), key
        if want.kind == "flat":
            sizes = vin.tensors[want.sizes_key].flatten().tolist()
            assert got.sizes == tuple(sizes) and sum(sizes) == tensor.shape[0], key
    # a sizes key mmgate adds for the servicer is one of the flat keys' sizes
    assert case.sizes_keys <= {want.sizes_key for want in case.fields.values()}


def test_each_items_embedding_positions_and_pixels_are_the_processors(received: tuple[Case, VllmInput]) -> None:
    case, vin = received
    counts, pixel_values = _reference(case)
    ranges = vin.mm_placeholders["image"]
    assert len(ranges) == len(IMAGES) and len(vin.mm_hashes["image"]) == len(IMAGES)
    ids = torch.tensor(vin.prompt_token_ids)
    token = _processor(case.model).tokenizer.convert_tokens_to_ids(case.embed_token)
    embeds = []
    for r in ranges:
        mask = r.is_embed if r.is_embed is not None else torch.ones(r.length, dtype=torch.bool)
        assert mask.shape == (r.length,)
        assert torch.equal(mask, ids[r.offset:r.offset + r.length] == token)
        embeds.append(int(mask.sum()))
    assert embeds == counts
    assert vin.tensors["pixel_values"].shape == pixel_values.shape
    assert torch.equal(vin.tensors["pixel_values"], pixel_values.to(torch.float32))


def test_docs_name_every_key_of_every_family() -> None:
    text = (ROOT / "docs" / "families.md").read_text()
    table = text[text.index("## Wire layouts on the vLLM wire"):]
    table = table[:table.index("\n## ", 10)]
    for case in CASES.values():
        for key in case.fields:
            assert f"`{key}`" in table, (case.model, key)
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert not any("`num_crops`" in row for row in rows)  # Gemma 3 sends vLLM's num_patches only
