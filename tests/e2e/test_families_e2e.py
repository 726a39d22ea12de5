"""End to end for the Gemma 3, LLaVA-1.5, LLaVA-NeXT, LLaVA-OneVision, Llama 4 and InternVL3 families: the official ``openai`` client ->
gateway process -> recording gRPC proxy -> reference engine process (vLLM wire, loopback).

The engine runs each bundle's transformers model shrunken with seeded random weights
(:mod:`mmgate.refengine.bundle`); every expected value comes from transformers, never from mmgate:

* the reference inputs are ``processor.apply_chat_template(messages, tokenize=True,
  add_generation_prompt=True, return_dict=True)`` with the request's images (and, for Gemma 3,
  its ``mm_processor_kwargs``).  That call carries one BOS for all three families: Gemma 3's
  rendered prompt starts with ``<bos>`` and the call tokenizes with ``add_special_tokens=False``
  (``mmgate.models.gemma3``); the LLaVA templates render no ``<s>`` and the tokenizer adds one
  (``mmgate.models.llava`` / ``llava_next`` docstrings), the same ids as
  ``processor(text=rendered, images=...)``;
* ``usage.prompt_tokens`` equals the length of its ``input_ids``, and the prompt ids the gateway
  sent to the engine (recorded by :class:`tests.corpus.stack.RecordingProxy`) *are* those ids;
  the ``pixel_values`` on the wire are the processor's, bit for bit (LLaVA-NeXT's zero-padded
  tiles included; Gemma 3's flat crops in order);
* the generated ids the engine returned for the request (recorded by the proxy) equal
  ``model.generate(do_sample=False)`` of the same shrunken model (``load_model``, same seed)
  on the processor's outputs; the completion's logprobs equal that run's log-softmax within
  float32 noise, and ``usage.completion_tokens`` is the number of those ids.

``ignore_eos`` (a vLLM request field): the engine's model has a neutral generation config, so
``generate`` does not stop at EOS either.  One module-scoped stack per family (the stacks are
started one after another: the tests are grouped by family).
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image

from mmgate.cli.launch import Child, start_engine, start_gateway
from tests.conftest import bundle_dir
from tests.corpus.stack import RecordingProxy, WireRequest

BUNDLES = {"gemma3": "google--gemma-3-4b-it", "llava": "llava-hf--llava-1.5-7b-hf",
           "llava_next": "llava-hf--llava-v1.6-mistral-7b-hf",
           "llava_onevision": "llava-hf--llava-onevision-qwen2-0.5b-ov-hf",
           "llama4": "meta-llama--Llama-4-Scout-17B-16E-Instruct",
           "internvl": "OpenGVLab--InternVL3-1B-hf"}
STEPS = 4  # max_tokens of every request (and max_new_tokens of the reference)
LOGPROB_TOLERANCE = 1e-4  # float32 noise between two processes running the same weights


@dataclass
class Stack:
    family: str
    bundle: Path
    engine: Child
    proxy: RecordingProxy
    gateway: Child
    client: openai.OpenAI


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Engine + recording proxy + gateway for the family named by the (indirect) parameter."""
    family: str = request.param
    bundle = bundle_dir(BUNDLES[family])
    logs = tmp_path_factory.mktemp(f"logs-{family}")
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    engine = start_engine(str(bundle), log_dir=logs, env=env)
    proxy = RecordingProxy(engine.port)
    try:
        gateway = start_gateway(str(bundle), [proxy.port], extra=["--served-model-name", family], log_dir=logs,
                                env=env)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="unused", max_retries=0,
                                   timeout=120)
            yield Stack(family, bundle, engine, proxy, gateway, client)
        finally:
            gateway.stop()
    finally:
        proxy.close()
        engine.stop()


def _png(width: int, height: int, seed: int) -> bytes:
    """A gradient with noise (lossless, so the gateway and PIL decode the same pixels)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx * 255 // max(width - 1, 1), yy * 255 // max(height - 1, 1), (xx + 3 * yy) % 256], axis=-1)
    pixels = np.clip(base + rng.integers(0, 48, (height, width, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _messages(images: list[bytes], text: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b).decode()}}
        for b in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


# ---- the transformers reference ----------------------------------------------------------------


@cache
def _processor(bundle: Path) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(bundle)


@cache
def _model(bundle: Path) -> Any:
    from mmgate.refengine.bundle import load_model
    from mmgate.refengine.config import EngineConfig

    return load_model(EngineConfig(model=bundle, port=0)).model  # seed 0, as the engine process


def _reference_inputs(bundle: Path, images: list[bytes], text: str, **processor_kwargs: Any) -> dict[str, Any]:
    conversation = [{"role": "user", "content": [
        *({"type": "image", "image": Image.open(io.BytesIO(b))} for b in images), {"type": "text", "text": text}]}]
    out = _processor(bundle).apply_chat_template(conversation, tokenize=True, add_generation_prompt=True,
                                                 return_dict=True, return_tensors="pt", **processor_kwargs)
    out = dict(out)
    # Llama 4's processor returns its bfloat16 values; the wire and the float32 model take them as float32
    out["pixel_values"] = out["pixel_values"].float()
    return out


def _reference_generation(bundle: Path, inputs: dict[str, Any]) -> tuple[list[int], list[float]]:
    """``model.generate(do_sample=False)``'s new ids and each chosen id's float32 log-softmax."""
    import torch

    with torch.inference_mode():
        out = _model(bundle).generate(**inputs, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                                      return_dict_in_generate=True)
    ids = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logprobs = [float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(out.logits, ids, strict=True)]
    return ids, logprobs


# ---- one request, judged ------------------------------------------------------------------------


def _wire_pixels(wire: WireRequest) -> np.ndarray:
    batch = wire.batch("pixel_values")
    assert batch is not None, "no image batch on the wire"
    tensor = batch.tensors["pixel_values"]
    assert tensor.dtype == "float32", f"pixel_values travelled as {tensor.dtype}"
    return tensor.array


def _check_request(stack: Stack, images: list[bytes], text: str, **processor_kwargs: Any) -> dict[str, Any]:
    """Send one greedy request; assert it equals the reference end to end; return the reference inputs."""
    extra: dict[str, Any] = {"ignore_eos": True}
    if processor_kwargs:
        extra["mm_processor_kwargs"] = processor_kwargs
    messages: Any = _messages(images, text)  # content parts as JSON (the client's TypedDicts accept them)
    raw = stack.client.chat.completions.with_raw_response.create(
        model=stack.family, messages=messages, max_tokens=STEPS, temperature=0, logprobs=True, extra_body=extra)
    assert raw.http_response.status_code == 200
    completion = raw.parse()
    request_id = raw.headers["X-Request-Id"]

    inputs = _reference_inputs(stack.bundle, images, text, **processor_kwargs)
    want_prompt = inputs["input_ids"][0].tolist()
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(want_prompt)

    wire = stack.proxy.get(request_id)
    assert wire is not None, "the request did not reach the engine"
    assert wire.input_ids == want_prompt
    assert np.array_equal(_wire_pixels(wire), inputs["pixel_values"].numpy())

    want_ids, want_logprobs = _reference_generation(stack.bundle, inputs)
    assert stack.proxy.output_ids(request_id) == want_ids
    assert completion.usage.completion_tokens == len(want_ids) == STEPS
    choice = completion.choices[0]
    assert choice.finish_reason == "length"
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [e.logprob for e in choice.logprobs.content] == pytest.approx(want_logprobs, abs=LOGPROB_TOLERANCE)
    return inputs


# ---- the tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stack", ["gemma3"], indirect=True)
def test_gemma3_two_images_equal_the_processor_and_generate(stack: Stack) -> None:
    inputs = _check_request(stack, [_png(320, 240, 1), _png(150, 400, 2)], "Compare the two pictures.")
    # 896x896 each, 256 soft tokens each, no crops (do_pan_and_scan defaults to False)
    assert tuple(inputs["pixel_values"].shape) == (2, 3, 896, 896)
    assert int((inputs["input_ids"] == 262144).sum()) == 2 * 256


@pytest.mark.parametrize("stack", ["gemma3"], indirect=True)
def test_gemma3_pan_and_scan_request_equals_the_processor_and_generate(stack: Stack) -> None:
    # 640x256: ratio 2.5 >= 1.2 activates pan-and-scan; min(4, 640 // 256, round(2.5)) = 2 crops of 320x256
    inputs = _check_request(stack, [_png(640, 256, 3)], "What is in the wide picture?", do_pan_and_scan=True)
    assert tuple(inputs["pixel_values"].shape) == (3, 3, 896, 896)  # the image, then its 2 crops
    assert int((inputs["input_ids"] == 255999).sum()) == 3  # one <start_of_image> per image and crop


@pytest.mark.parametrize("stack", ["llava"], indirect=True)
def test_llava_two_images_equal_the_processor_and_generate(stack: Stack) -> None:
    inputs = _check_request(stack, [_png(320, 240, 4), _png(200, 500, 5)], "Compare the two pictures.")
    # shortest edge 336, centre crop 336x336: (336 / 14)^2 = 576 <image> tokens each
    assert tuple(inputs["pixel_values"].shape) == (2, 3, 336, 336)
    assert int((inputs["input_ids"] == 32000).sum()) == 2 * 576


@pytest.mark.parametrize("stack", ["llava"], indirect=True)
def test_llava_one_image_equals_the_processor_and_generate(stack: Stack) -> None:
    _check_request(stack, [_png(97, 61, 6)], "Describe the image.")


@pytest.mark.parametrize("stack", ["llava_next"], indirect=True)
def test_llava_next_images_of_different_tile_counts_equal_the_processor_and_generate(stack: Stack) -> None:
    # 64x48 -> pinpoint 336x672 (base + 2 tiles); 350x1000 (w x h) -> 336x1008 (base + 3 tiles):
    # the first image's fourth tile travels as transformers' _pad_for_batching zeros
    inputs = _check_request(stack, [_png(64, 48, 7), _png(350, 1000, 8)], "Compare the two pictures.")
    assert tuple(inputs["pixel_values"].shape) == (2, 4, 3, 336, 336)
    assert inputs["image_sizes"].tolist() == [[48, 64], [1000, 350]]


@pytest.mark.parametrize("stack", ["llava_next"], indirect=True)
def test_llava_next_one_image_equals_the_processor_and_generate(stack: Stack) -> None:
    _check_request(stack, [_png(500, 300, 9)], "Describe the image.")


@pytest.mark.parametrize("stack", ["llava_onevision"], indirect=True)
def test_llava_onevision_one_image_equals_the_processor_and_generate(stack: Stack) -> None:
    # 500x300 (w x h) -> pinpoint 384x768 (base + 2 tiles of 384); the Qwen2 tokenizer adds no BOS
    inputs = _check_request(stack, [_png(500, 300, 10)], "Describe the image.")
    assert tuple(inputs["pixel_values"].shape) == (1, 3, 3, 384, 384)
    assert inputs["image_sizes"].tolist() == [[300, 500]]


@pytest.mark.parametrize("stack", ["llama4"], indirect=True)
def test_llama4_tiled_and_single_tile_images_equal_the_processor_and_generate(stack: Stack) -> None:
    # 700x400 (w x h): the least upscaling >= 1 is 1008 / 700 = 1.44 (2x3 and 3x3 tiles; the smaller
    # area wins): canvas 2x3, the image kept at its size and zero-padded, 6 tiles + the global tile;
    # 64x48: one tile, no global tile.  144 <|patch|> per tile; the run's separators are not embedded
    inputs = _check_request(stack, [_png(700, 400, 10), _png(64, 48, 11)], "Compare the two pictures.")
    assert tuple(inputs["pixel_values"].shape) == (8, 3, 336, 336)
    assert int((inputs["input_ids"] == 200092).sum()) == 8 * 144
    assert int((inputs["input_ids"] == 200084).sum()) == 2 * 2  # <|tile_x_separator|>: 2 per row of 3 tiles


@pytest.mark.parametrize("stack", ["internvl"], indirect=True)
def test_internvl_images_of_different_crop_counts_equal_the_processor_and_generate(stack: Stack) -> None:
    # InternVL3 (the Qwen2 tokenizer adds no BOS; the template renders none): 900x400 -> ratio 2.25 ->
    # 2x1 crops of 448 + the thumbnail (3 patches); 64x64 -> 1x1, no thumbnail (1 patch)
    inputs = _check_request(stack, [_png(900, 400, 10), _png(64, 64, 11)], "Compare the two pictures.")
    assert tuple(inputs["pixel_values"].shape) == (4, 3, 448, 448)
    assert int((inputs["input_ids"] == 151667).sum()) == 4 * 256  # <IMG_CONTEXT>


@pytest.mark.parametrize("stack", ["internvl"], indirect=True)
def test_internvl_one_image_equals_the_processor_and_generate(stack: Stack) -> None:
    _check_request(stack, [_png(97, 61, 12)], "Describe the image.")
