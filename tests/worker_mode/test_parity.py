"""The same request through router mode, worker mode in process, and worker mode via the sidecar.

Each engine records the final ``input_ids`` and every tensor the model's
``forward`` receives (``--record-dir``); the three records must be equal byte
for byte, and so must ``usage.prompt_tokens`` (counted after expansion in
every mode) and the greedy completions.
"""

from __future__ import annotations

import json

import numpy as np

from tests.worker_mode.conftest import Stack
from tests.worker_mode.support import Gateway, Origin, chat, data_url, image_bytes, image_part

IMAGE_PAD = 151655  # <|image_pad|> of Qwen2-VL


def _parts(media: Origin) -> list[dict]:
    url = media.add("/parity.png", image_bytes(90, 70, 2, "PNG"))
    return [image_part(data_url(image_bytes(120, 160, 1))), {"type": "text", "text": "Compare"}, image_part(url)]


def test_router_inprocess_and_sidecar_reach_the_model_bit_identical(
        live: Stack, gateways: dict[str, Gateway], media: Origin) -> None:
    body = chat(_parts(media), max_tokens=6)
    answers, records = {}, {}
    for name, gw in gateways.items():
        resp = gw.post(body)
        assert resp.status_code == 200, (name, resp.text)
        answers[name] = resp.json()
        records[name] = np.load(live.records[name] / f"{resp.headers['X-Request-Id']}.npz")
    router = records["router"]
    assert set(router.files) == {"input_ids", "pixel_values", "image_grid_thw", "mm_token_type_ids"}
    # smart_resize to multiples of 28: 120x160 -> 112x168 (grid 8x12, 24 tokens); 90x70 -> 84x56 (grid 6x4, 6 tokens).
    assert router["image_grid_thw"].tolist() == [[1, 8, 12], [1, 6, 4]]
    assert int((router["input_ids"] == IMAGE_PAD).sum()) == 8 * 12 // 4 + 6 * 4 // 4
    for name in ("inprocess", "sidecar"):
        record = records[name]
        assert set(record.files) == set(router.files), name
        for key in router.files:
            assert record[key].dtype == router[key].dtype and record[key].shape == router[key].shape, (name, key)
            assert record[key].tobytes() == router[key].tobytes(), (name, key)
    usage = {name: a["usage"]["prompt_tokens"] for name, a in answers.items()}
    assert set(usage.values()) == {router["input_ids"].shape[1]}, usage
    texts = {a["choices"][0]["message"]["content"] for a in answers.values()}
    assert len(texts) == 1, texts  # same seeded weights, same inputs, greedy


def test_a_streamed_worker_mode_answer_counts_the_expanded_prompt(
        live: Stack, gateways: dict[str, Gateway], media: Origin) -> None:
    resp = gateways["sidecar"].post(chat(_parts(media), stream=True, max_tokens=3))
    assert resp.status_code == 200, resp.text
    events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
    (usage,) = [e["usage"] for e in events if e.get("usage")]
    expected = gateways["router"].post(chat(_parts(media), max_tokens=3)).json()["usage"]["prompt_tokens"]
    assert usage["prompt_tokens"] == expected
