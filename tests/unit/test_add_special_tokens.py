"""``add_special_tokens`` (vLLM's chat request field) and ``chat_template_kwargs``: the prompt ids a
request gets, in process (``Pipeline.prepare``: what the gateway sends an engine; ``render_prompt``:
what it forwards with media references to a worker).

Expected ids come from transformers, never from mmgate, for LLaVA-1.5 (its template renders no
``<s>``), Gemma 3 (its template starts with ``<bos>``), Qwen2-VL (no BOS token at all) and Llama 4
(its template starts with ``<|begin_of_text|>``):

* field absent: ``processor.apply_chat_template(tokenize=True)``, the reference's rule (BOS unless
  the rendered template starts with it);
* ``false`` / ``true``: ``processor(text=rendered, images=..., add_special_tokens=False/True)``, what
  vLLM's renderer does with the field (``tokenizer.encode(prompt, add_special_tokens=...)``,
  ``vllm/renderers/base.py``; the multimodal processor gets the same tokenization kwargs).

Facts these pin (transformers 5.24, the bundles in ``MMGATE_MODEL_PATH``): LLaVA-1.5 false = one
token fewer (no ``<s>``), true = absent; Gemma 3 false = absent, true = one more (a second
``<bos>``); Qwen2-VL the same ids for all three; Llama 4 as Gemma 3 (its template starts with
``<|begin_of_text|>``: true adds a second one).  (End to end with ``usage.prompt_tokens``:
tests/e2e/test_add_special_tokens_e2e.py.)
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from mmgate.config.settings import Settings
from mmgate.errors import GatewayError
from mmgate.gateway.state import build_state
from mmgate.request.parse import parse_chat_request
from tests.conftest import bundle_dir
from tests.support.special_tokens import SETTINGS, reference_ids

BUNDLES = ["llava-hf/llava-1.5-7b-hf", "google/gemma-3-4b-it", "Qwen/Qwen2-VL-2B-Instruct",
           "meta-llama/Llama-4-Scout-17B-16E-Instruct"]
#: tokens the field adds or removes against the reference's rule, per bundle: (false, true)
DELTA = {"llava-hf/llava-1.5-7b-hf": (-1, 0), "google/gemma-3-4b-it": (0, 1), "Qwen/Qwen2-VL-2B-Instruct": (0, 0),
         "meta-llama/Llama-4-Scout-17B-16E-Instruct": (0, 1)}


def _png(width: int, height: int) -> bytes:
    rng = np.random.default_rng(width * 1000 + height)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


IMAGE = _png(64, 48)
TEXT = "What is in this picture? Answer briefly."


@pytest.fixture(scope="module", params=BUNDLES)
def bundle(request: pytest.FixtureRequest) -> tuple[str, Any, Any]:
    from transformers import AutoProcessor

    path = bundle_dir(request.param)
    state = build_state(Settings(model=str(path), served_model_name=request.param))
    return request.param, state, AutoProcessor.from_pretrained(str(path))


def _messages(with_image: bool) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    if with_image:
        parts.append({"type": "image_url",
                      "image_url": {"url": "data:image/png;base64," + base64.b64encode(IMAGE).decode()}})
    parts.append({"type": "text", "text": TEXT})
    return [{"role": "user", "content": parts}]


def _request(name: str, with_image: bool, setting: str) -> Any:
    body = {"model": name, "messages": _messages(with_image), "max_tokens": 4, **SETTINGS[setting]}
    return parse_chat_request(json.dumps(body).encode())


@pytest.mark.parametrize("with_image", [False, True], ids=["text", "image"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_prompt_ids_follow_the_reference_for_each_setting(bundle: tuple[str, Any, Any], setting: str,
                                                          with_image: bool) -> None:
    name, state, processor = bundle
    req = _request(name, with_image, setting)
    prepared = asyncio.run(state.pipeline.prepare(req))
    assert list(prepared.input_ids) == reference_ids(processor, IMAGE if with_image else None, TEXT, setting)
    # what worker mode forwards with media references: the unexpanded ids, tokenized the same way
    # (absent: transformers ``apply_chat_template``'s rule, BOS unless the rendered text starts with it)
    _, prompt, ids, _ = state.pipeline.render_prompt(req, {})
    bos = processor.tokenizer.bos_token
    add = {"absent": not (bos and prompt.startswith(bos)), "false": False, "true": True}[setting]
    assert ids == processor.tokenizer.encode(prompt, add_special_tokens=add)


def test_the_difference_is_exactly_the_bos(bundle: tuple[str, Any, Any]) -> None:
    """Against the reference's rule, false and true change the prompt by the stated number of
    tokens, and every token added or removed is the tokenizer's BOS at the front."""
    name, state, processor = bundle
    lengths = {s: list(asyncio.run(state.pipeline.prepare(_request(name, True, s))).input_ids) for s in SETTINGS}
    low, high = DELTA[name]
    assert len(lengths["false"]) - len(lengths["absent"]) == low
    assert len(lengths["true"]) - len(lengths["absent"]) == high
    bos = processor.tokenizer.bos_token_id
    for setting, delta in (("false", low), ("true", high)):
        longer, shorter = (lengths["absent"], lengths[setting]) if delta < 0 else (lengths[setting], lengths["absent"])
        assert longer[abs(delta):] == shorter
        assert longer[:abs(delta)] == [bos] * abs(delta)


@pytest.mark.parametrize("value", ["yes", 1, 0, [], {}])
def test_a_wrong_type_is_refused_as_invalid_request(value: Any) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "add_special_tokens": value}
    with pytest.raises(GatewayError) as info:
        parse_chat_request(json.dumps(body).encode())
    assert (info.value.status, info.value.code.value) == (400, "invalid_request")
    assert info.value.param == "add_special_tokens"


def test_null_is_the_field_absent() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat_request(json.dumps({**body, "add_special_tokens": None}).encode()) == \
        parse_chat_request(json.dumps(body).encode())


# ---- chat_template_kwargs ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def thinking_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2-VL's files (linked, not copied) with the chat template of Qwen3-Omni, which reads
    ``enable_thinking`` as Qwen3 templates do (none of the served bundles' templates reads it)."""
    folder = tmp_path_factory.mktemp("thinking")
    qwen = bundle_dir("Qwen/Qwen2-VL-2B-Instruct")
    for item in qwen.iterdir():
        if not item.name.startswith("chat_template"):
            (folder / item.name).symlink_to(item)
    omni = json.loads((bundle_dir("Qwen/Qwen3-Omni-30B-A3B-Instruct") / "chat_template.json").read_text())
    (folder / "chat_template.jinja").write_text(omni["chat_template"], encoding="utf-8")
    return folder


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}], ids=str)
def test_enable_thinking_reaches_the_template(thinking_bundle: Path, kwargs: dict[str, Any]) -> None:
    """vLLM passes ``chat_template_kwargs`` to the template as variables (``ChatParams``,
    ``vllm/entrypoints/openai/chat_completion/protocol.py``): ``enable_thinking: false`` makes a
    Qwen3 template close an empty ``<think>`` block after the assistant header."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(thinking_bundle))
    template = (thinking_bundle / "chat_template.jinja").read_text(encoding="utf-8")
    state = build_state(Settings(model=str(thinking_bundle), served_model_name="thinking"))
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "thinking", "messages": messages, **({"chat_template_kwargs": kwargs} if kwargs else {})}
    _, prompt, ids, _ = state.pipeline.render_prompt(parse_chat_request(json.dumps(body).encode()), {})
    reference = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                              add_generation_prompt=True, **kwargs)
    assert prompt == reference
    assert ids == tokenizer.encode(reference, add_special_tokens=False)
    assert prompt.endswith("<think>\n\n</think>\n\n") == (kwargs.get("enable_thinking") is False)
