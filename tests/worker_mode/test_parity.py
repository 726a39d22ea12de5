"""Worker-mode parity: what a worker hands its model equals what the transformers processor computes.

For Qwen2-VL, Qwen2.5-VL and Qwen3-VL, a chat goes through a worker-mode
gateway to an engine that processes the media itself, on both paths:

* ``inprocess``: the engine's own processor (``--mm-processor inprocess``);
* ``sidecar``: the engine hands the job to ``mmgate sidecar`` through a real
  ``redis-server`` (``--mm-processor redis``).

Each engine records the final ``input_ids`` and every tensor its model's
``forward`` receives (``--record-dir``).  The expected values are computed in
the test by transformers 5.24 on the same conversation and the same media bytes
(:mod:`tests.worker_mode.reference`: ``AutoProcessor`` with its default
torchvision image backend, which is the backend a worker's ``--image-backend
auto`` picks): ids, ``mm_token_type_ids``, ``pixel_values``, ``image_grid_thw``,
``pixel_values_videos``, ``video_grid_thw`` and, for Qwen2.5-VL,
``second_per_grid_ts`` (the clip's frames sampled as the workers' default
``--video-frame-sampling vllm`` and the gateway's take them: Qwen2/2.5-VL at 2 fps)
must match in key set, dtype, shape and bytes (the wire is
float32, as the model; max abs diff 0); ``usage.prompt_tokens`` must be the
reference's prompt length.

Qwen2-VL uses the session stack (conftest); the other two bundles get their own
engines and sidecars here, under their own namespaces on a second Redis.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from mmgate.sidecar.protocol import hello_text
from tests.conftest import bundle_dir
from tests.video.video_support import ClipSpec, make_clip
from tests.worker_mode.conftest import Stack, Workers, start_workers, worker_gateways
from tests.worker_mode.reference import Conversation, assert_same_model_inputs, processor, reference_inputs
from tests.worker_mode.support import MODEL, Gateway, Origin, chat, image_bytes, start_redis

QWEN2_5 = "Qwen/Qwen2.5-VL-7B-Instruct"
QWEN3 = "Qwen/Qwen3-VL-2B-Instruct"
MODELS = (MODEL, QWEN2_5, QWEN3)
PATHS = ("inprocess", "sidecar")
#: 8 frames at 8 fps, 64x48: the workers' default sampling keeps 4 (Qwen2/2.5-VL [0, 2, 4, 6], at 2 fps as a
#: vLLM worker; Qwen3-VL [0, 2, 5, 7]), as the gateway would: small enough for the stack's 1 MiB sidecar
#: result limit
CLIP = ClipSpec("wm_8f_8fps", 8, 8, 64, 48)


@dataclass
class Paths:
    gateways: dict[str, Gateway]  # "inprocess" | "sidecar"
    records: dict[str, Path]  # the record folder of the engine behind each gateway


@pytest.fixture(scope="module")
def paths(stack: Stack, gateways: dict[str, Gateway],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Paths]]:
    """model -> its worker paths: Qwen2-VL from the session stack, the others started here."""
    started: list[Workers] = []
    out = {MODEL: Paths({p: gateways[p] for p in PATHS}, {p: stack.records[p] for p in PATHS})}
    # Their own redis-server with the default result limit (512 MiB): Qwen3-VL upscales small images to
    # at least 65536 pixels, past the stack's 1 MiB.
    redis_server = start_redis(tmp_path_factory.mktemp("redis-parity"))
    try:
        for model, tag in ((QWEN2_5, "q25"), (QWEN3, "q3")):
            started.append(start_workers(model, bundle_dir(model), f"wm-{tag}", redis_server,
                                         tmp_path_factory.mktemp(f"workers-{tag}")))
        with worker_gateways(started[0]) as q25, worker_gateways(started[1]) as q3:
            out[QWEN2_5] = Paths(q25, started[0].records)
            out[QWEN3] = Paths(q3, started[1].records)
            yield out
    finally:
        for workers in started:
            workers.stop()
        redis_server.proc.stop()


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_clip(CLIP, tmp_path_factory.mktemp("clips"))


def _images(conv: Conversation, media: Origin) -> Conversation:
    """A JPEG as a ``data:`` URL and a PNG fetched over http, neither a multiple of the patch grid."""
    png = image_bytes(90, 70, 2, "PNG")
    return (conv.image(image_bytes(120, 160, 1), "image/jpeg").say("Compare")
            .image(png, "image/png", media.add("/parity.png", png)))


def _run(model: str, path: Paths, which: str, conv: Conversation) -> None:
    """Send ``conv`` through ``which`` path and compare what the model got with the reference."""
    expected = reference_inputs(bundle_dir(model), conv)
    resp = path.gateways[which].post(chat(conv.chat_parts(), max_tokens=2, model=model))
    assert resp.status_code == 200, (model, which, resp.text)
    record = np.load(path.records[which] / f"{resp.headers['X-Request-Id']}.npz")
    assert_same_model_inputs(record, expected, f"{model} {which}")
    assert resp.json()["usage"]["prompt_tokens"] == expected["input_ids"].shape[1]


def test_the_workers_and_the_reference_use_the_torchvision_image_backend(live: Stack) -> None:
    """The reference's default image processor is the torchvision one, as the workers' ``auto`` backend."""
    assert type(processor(live.bundle).image_processor).__name__ == "Qwen2VLImageProcessor"
    settings = json.loads(hello_text(live.redis.client().hgetall(live.hello_key()), "settings"))
    assert settings["family"].startswith("qwen_vl:qwen2_vl:torchvision:")


@pytest.mark.parametrize("which", PATHS)
@pytest.mark.parametrize("model", MODELS)
def test_a_worker_gives_the_model_the_transformers_processors_ids_and_image_tensors(
        live: Stack, paths: dict[str, Paths], media: Origin, model: str, which: str) -> None:
    _run(model, paths[model], which, _images(Conversation(), media))


@pytest.mark.parametrize("which", PATHS)
@pytest.mark.parametrize("model", MODELS)
def test_a_worker_gives_the_model_the_transformers_processors_video_and_image_tensors(
        live: Stack, paths: dict[str, Paths], media: Origin, clip: Path, model: str, which: str) -> None:
    conv = Conversation().image(image_bytes(64, 96, 3), "image/jpeg").say("and then")
    conv.video(clip, media.add("/parity.mp4", clip.read_bytes())).say("What happens?")
    _run(model, paths[model], which, conv)


def test_a_streamed_worker_mode_answer_counts_the_expanded_prompt(
        live: Stack, gateways: dict[str, Gateway], media: Origin) -> None:
    conv = _images(Conversation(), media)
    resp = gateways["sidecar"].post(chat(conv.chat_parts(), stream=True, max_tokens=3))
    assert resp.status_code == 200, resp.text
    events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
    (usage,) = [e["usage"] for e in events if e.get("usage")]
    assert usage["prompt_tokens"] == reference_inputs(live.bundle, conv)["input_ids"].shape[1]
