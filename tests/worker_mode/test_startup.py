"""Start-up of the worker-side processors and of every command on bundles at the edge of what mmgate serves.

* A family without video support (a Qwen2-VL bundle copy whose tokenizer has no
  ``<|video_pad|>``: ``QwenVLFamily`` then serves images only) starts in worker
  mode in process and in the sidecar, and serves images exactly as the
  transformers processor computes them; a video is refused, not a crash.
* A bundle that takes media but whose ``model_type`` no family serves, at the
  top level (a Qwen2-VL copy renamed ``glm4v``) or through a nested config (a
  copy of Qwen2.5-Omni, whose towers live under ``thinker_config``), makes
  ``mmgate serve``, ``mmgate engine`` and ``mmgate sidecar`` exit at start-up
  with a message naming the ``model_type`` and the families that exist.  (The
  reference engine runs the Qwen2.5-Omni thinker itself and mmgate serves it
  (``mmgate.models.qwen_omni``), issue 23, so the nested case uses the Omni copy
  renamed to a ``model_type`` neither side knows.)
* A text-only bundle still loads, with no family.

Test bundles are copies in ``tmp_path`` of the shared ones, config edited.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from mmgate.chat.tokenizer import load_tokenizer
from mmgate.cli.launch import free_port
from mmgate.models.bundle import load_bundle
from mmgate.models.registry import FAMILY_BY_MODEL_TYPE, check_servable, load_family, media_markers
from mmgate.refengine.bundle import check_engine_bundle
from mmgate.models.backend import ImageBackend
from mmgate.types import Modality
from tests.conftest import bundle_dir
from tests.worker_mode.conftest import Stack, Workers, start_workers, worker_gateways
from tests.worker_mode.reference import Conversation, assert_same_model_inputs, reference_inputs
from tests.worker_mode.support import MODEL, Gateway, chat, copy_bundle, drop_added_token, image_bytes

IMAGE_ONLY = "test/qwen2-vl-image-only"
OMNI = "Qwen/Qwen2.5-Omni-7B"
# Qwen2-VL: <|vision_start|> <|image_pad|> <|vision_end|> "Hello"
ONE_ANCHOR = [151652, 151655, 151653, 9707]


@pytest.fixture(scope="module")
def image_only(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Workers, dict[str, Gateway]]]:
    root = tmp_path_factory.mktemp("image-only")
    bundle = copy_bundle(bundle_dir(MODEL), root / "test--qwen2-vl-image-only")
    drop_added_token(bundle, "<|video_pad|>")
    workers = start_workers(IMAGE_ONLY, bundle, "wm-image-only", stack.redis, root)
    try:
        with worker_gateways(workers) as gws:
            yield workers, gws
    finally:
        workers.stop()


def test_the_image_only_bundle_gives_a_family_without_video(image_only: tuple[Workers, dict[str, Gateway]]) -> None:
    bundle = load_bundle(image_only[0].bundle)
    family = load_family(bundle, load_tokenizer(bundle), ImageBackend.TORCHVISION)
    assert family is not None and set(family.limits) == {Modality.IMAGE}


@pytest.mark.parametrize("which", ["inprocess", "sidecar"])
def test_a_family_without_video_support_serves_images_in_worker_mode(
        image_only: tuple[Workers, dict[str, Gateway]], which: str) -> None:
    workers, gws = image_only
    conv = Conversation().image(image_bytes(120, 160, 1), "image/jpeg").say("What is this?")
    resp = gws[which].post(chat(conv.chat_parts(), max_tokens=2, model=IMAGE_ONLY))
    assert resp.status_code == 200, resp.text
    record = np.load(workers.records[which] / f"{resp.headers['X-Request-Id']}.npz")
    # The reference is the unedited bundle: the copy differs only in a token an image prompt never uses.
    assert_same_model_inputs(record, reference_inputs(bundle_dir(MODEL), conv), which)


@pytest.mark.parametrize("which", ["inprocess", "sidecar"])
def test_a_family_without_video_support_refuses_a_video_reference(
        image_only: tuple[Workers, dict[str, Gateway]], which: str) -> None:
    workers = image_only[0]
    engine = workers.inprocess if which == "inprocess" else workers.redis_engine
    request = vllm_engine_pb2.GenerateRequest(
        request_id=uuid.uuid4().hex, tokenized=vllm_engine_pb2.TokenizedInput(input_ids=ONE_ANCHOR),
        sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=2), stream=False,
        media_refs=vllm_engine_pb2.MediaRefs(items=[vllm_engine_pb2.MediaRef(
            modality=common_pb2.VIDEO, url="http://127.0.0.1:9/clip.mp4")]))
    with grpc.insecure_channel(f"127.0.0.1:{engine.port}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "multimodal_not_supported" in (info.value.details() or "")


# ---- start-up refusals ------------------------------------------------------------------


@pytest.fixture(scope="module")
def unservable(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """model_type -> a bundle that takes media no family serves."""
    root = tmp_path_factory.mktemp("unservable")
    return {
        "glm4v": copy_bundle(bundle_dir(MODEL), root / "test--renamed", model_type="glm4v"),
        # both sides serve qwen2_5_omni (mmgate.models.qwen_omni, refengine/families.py): a nested-config type
        # neither knows
        "qwen2_5_omni_preview": copy_bundle(bundle_dir(OMNI), root / "test--omni-renamed",
                                            model_type="qwen2_5_omni_preview"),
    }


def _command(name: str, bundle: Path) -> list[str]:
    dead = f"127.0.0.1:{free_port()}"
    if name == "serve":
        return [sys.executable, "-m", "mmgate.cli", "serve", "--model", str(bundle), "--worker-urls", f"grpc://{dead}",
                "--port", str(free_port())]
    if name == "engine":
        return [sys.executable, "-m", "mmgate.cli", "engine", "--model", str(bundle), "--port", str(free_port())]
    return [sys.executable, "-m", "mmgate.cli", "sidecar", "--model", str(bundle), "--redis-url", f"redis://{dead}/0"]


@pytest.mark.parametrize(("model_type", "command"), [
    ("qwen2_5_omni_preview", "serve"), ("qwen2_5_omni_preview", "engine"), ("qwen2_5_omni_preview", "sidecar"),
    ("glm4v", "serve"), ("glm4v", "engine"),
])
def test_a_media_bundle_no_family_serves_is_refused_at_start_up(
        unservable: dict[str, Path], model_type: str, command: str) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(_command(command, unservable[model_type]), capture_output=True, text=True, timeout=180,
                          env=env)
    output = done.stdout + done.stderr
    assert done.returncode == (1 if command == "engine" else 2), output[-3000:]
    assert f"model_type {model_type!r}" in output, output[-3000:]
    assert "no mmgate family supports it yet" in output
    for served in FAMILY_BY_MODEL_TYPE:
        assert served in output, (served, output[-3000:])
    if model_type.startswith("qwen2_5_omni"):
        assert "thinker_config.vision_config" in output and "thinker_config.audio_config" in output


def test_a_text_only_bundle_still_loads_with_no_family(tmp_path: Path) -> None:
    src = bundle_dir(MODEL)
    bundle = tmp_path / "test--qwen2-text"
    bundle.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.json", "generation_config.json"):
        (bundle / name).write_bytes((src / name).read_bytes())
    (bundle / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "eos_token_id": 151645, "bos_token_id": 151643}))
    loaded = load_bundle(bundle)
    assert media_markers(loaded) == ()
    check_servable(loaded)
    check_engine_bundle(bundle)  # what ``mmgate engine`` checks before it builds the model
    assert load_family(loaded, load_tokenizer(loaded), ImageBackend.PIL) is None
