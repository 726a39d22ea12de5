"""End to end: the ``openai`` client -> gateway process -> reference engine process, Qwen3-VL, one
image (``data:`` URL) and one clip (``http`` URL from a loopback origin) in one request.

The engine runs the real transformers Qwen3-VL code on the tensors (random
weights), so a completion means the model accepted them; ``usage.prompt_tokens``
must equal the length of the transformers processor's ``input_ids`` for the
same conversation (the clip decoded by transformers' own pyav loader).
"""

from __future__ import annotations

import base64
import copy
import io
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image

from mmgate.cli.launch import Child, start_engine, start_gateway
from tests.conftest import bundle_dir
from tests.support.servers import MediaOrigin, media_origin
from tests.video.video_support import QWEN3, load, processor


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Child, MediaOrigin]]:
    logs = tmp_path_factory.mktemp("logs")
    bundle = str(bundle_dir(QWEN3))
    env = dict(os.environ)
    engine = start_engine(bundle, log_dir=logs, env=env)
    try:
        gateway = start_gateway(bundle, [engine.port], extra=["--mm-allow-private-media-hosts",
                                                              "--served-model-name", QWEN3], log_dir=logs, env=env)
        try:
            with media_origin() as origin:
                yield gateway, origin
        finally:
            gateway.stop()
    finally:
        engine.stop()


def reference_prompt_tokens(image: bytes, clip: Path, text: str) -> int:
    proc = processor(QWEN3)
    content = [{"type": "image"}, {"type": "video"}, {"type": "text", "text": text}]
    prompt = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                      tokenize=False)
    frames, meta = load(clip)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = proc(text=[prompt], images=[Image.open(io.BytesIO(image))], videos=[frames],
                   video_metadata=[copy.deepcopy(meta)], return_tensors="np")
    return int(out["input_ids"].shape[1])


def test_image_and_clip_request_completes_with_the_reference_prompt_token_count(
        stack: tuple[Child, MediaOrigin], clips: dict[str, Path]) -> None:
    gateway, origin = stack
    clip = clips["f60_30fps"]
    url = origin.add("/clip.mp4", clip.read_bytes(), "video/mp4")
    image = io.BytesIO()
    Image.fromarray(np.random.default_rng(5).integers(0, 256, (120, 200, 3), dtype=np.uint8)).save(image, "PNG")
    text = "What happens in the clip, and what is in the picture?"
    expected = reference_prompt_tokens(image.getvalue(), clip, text)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image.getvalue()).decode()}},
        {"type": "video_url", "video_url": {"url": url}},
        {"type": "text", "text": text}]}]
    out = client.chat.completions.create(model=QWEN3, messages=messages, max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage is not None and out.usage.prompt_tokens == expected
    assert 1 <= out.usage.completion_tokens <= 4
    assert origin.hits["/clip.mp4"] == 1
