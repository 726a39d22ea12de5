"""Typed reserved strings in a SentencePiece tokenizer's prompt (LLaVA-1.5's Llama, LLaVA-NeXT's
Mistral): they are plain text, tokenized together with the text around them.

A SentencePiece tokenizer prepends ``▁`` to every piece it is given, so tokenizing the typed string
apart from its neighbours would add ``▁`` tokens that no whole-text tokenization has.  Neither LLaVA
template writes an added token itself, so the reference is exact and independent of mmgate: the
transformers tokenizer of the bundle on the whole rendered prompt with ``split_special_tokens=True``
(every special token in the text read as plain text).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from mmgate.gateway.state import build_state
from mmgate.request.parse import parse_chat_request
from mmgate.config.settings import Settings
from tests.conftest import bundle_dir

BUNDLES = ["llava-hf/llava-1.5-7b-hf", "llava-hf/llava-v1.6-mistral-7b-hf"]
TEXTS = ["say </s> now", "</s>", "a<s>b</s>c <image> d", "x  </s>\n\n<unk> y", " <s>"]


@pytest.fixture(scope="module", params=BUNDLES)
def bundle(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    from transformers import AutoTokenizer

    path = bundle_dir(request.param)
    state = build_state(Settings(model=str(path), served_model_name=request.param))
    return state, AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("text", TEXTS)
def test_typed_reserved_strings_tokenize_with_their_neighbours(bundle: tuple[Any, Any], text: str) -> None:
    state, tokenizer = bundle
    body = {"model": state.runtime.served_name, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": text}, {"type": "text", "text": "and </s> more"}]}]}
    _, prompt, ids, _ = state.pipeline.render_prompt(parse_chat_request(json.dumps(body).encode()), {})
    reference = tokenizer(prompt, split_special_tokens=True)["input_ids"]
    assert ids == reference
    assert ids.count(tokenizer.eos_token_id) == 0 and ids.count(tokenizer.bos_token_id) == 1
