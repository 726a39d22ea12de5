"""Reference prompt ids for the ``add_special_tokens`` settings (transformers, never mmgate).

Used by tests/unit/test_add_special_tokens.py and tests/e2e/test_add_special_tokens_e2e.py.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image

#: the request bodies' extra fields per setting name
SETTINGS: dict[str, dict[str, Any]] = {"absent": {}, "false": {"add_special_tokens": False},
                                       "true": {"add_special_tokens": True}}


def reference_ids(processor: Any, image: bytes | None, text: str, setting: str) -> list[int]:
    """The prompt ids of one user turn (``image``, when given, then ``text``) for ``setting``:
    absent, transformers ``processor.apply_chat_template(tokenize=True)`` (the reference's BOS rule);
    ``false`` / ``true``, ``processor(text=rendered, images=..., add_special_tokens=...)``, what vLLM's
    renderer does with the request field (``tokenizer.encode(prompt, add_special_tokens=...)``,
    ``vllm/renderers/base.py``)."""
    images = [Image.open(io.BytesIO(image)).convert("RGB")] if image is not None else None
    parts: list[dict[str, Any]] = [{"type": "image"}] if image is not None else []
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
    if setting == "absent":
        out = processor.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True,
                                            images=images)
        return [int(i) for i in np.asarray(out["input_ids"]).reshape(-1)]
    rendered = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # "pt": Llama 4's bfloat16 pixel_values have no numpy form
    out = processor(text=[rendered], images=images, add_special_tokens=setting == "true", return_tensors="pt")
    return [int(i) for i in out["input_ids"][0]]
