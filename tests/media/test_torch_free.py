"""Acceptance (issue 13): the gateway is exact to transformers' torchvision backend with torch unimportable.

The gateway's preprocessing runs in a child process (``tests/media/torch_free_child.py``) whose
first act is a ``sys.meta_path`` finder that makes ``torch`` and ``torchvision`` unimportable and
logs every attempt; the references come from transformers 5.24 in this (the parent) process,
with torch:

* images, per family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; LLaVA-1.5, LLaVA-NeXT; Gemma 3 with
  pan-and-scan off and on): the live tier's corpora, from the generators of
  ``tests/families/test_*_live_parity.py`` (edge sizes, every image mode, JPEG, random sizes
  from a seeded RNG: ``MMGATE_PARITY_SEED`` pins it, printed), through the family the gateway
  builds with the ``auto`` backend (``decode_image`` -> ``plan`` -> ``preprocess`` ->
  ``assemble``), against the torchvision-backend image processor ``AutoProcessor`` picks
  (``Qwen2VLImageProcessor``, ``CLIPImageProcessor``, ``LlavaNextImageProcessor``,
  ``Gemma3ImageProcessor``) on ``PIL.Image.open(bytes)``: ``pixel_values`` identical (sha256
  of the bytes, shape, dtype) and the auxiliary tensors equal.  The default run takes a sample
  of each corpus (the parity tests' own ``sample``/edge choices, at most ~1.5 Mpx); the ``slow``
  run takes every edge size and the live tier's >= 200 random sizes per family.
* whole requests through the app's own state (``mmgate.gateway.state.build_state`` +
  ``pipeline.prepare``): a two-image chat (reference: ``processor(text=apply_chat_template(...,
  tokenize=False), images=...)``) and video clips (reference: ``tests/video/video_support.reference``
  with ``vllm_video_kwargs``, the default ``--video-frame-sampling``,
  transformers' pyav loader + the processor), ``input_ids`` and every tensor identical;
* the Redis sidecar's processor (``load_runtime`` + ``MediaProcessor.process``);
* ``mmgate serve`` itself, started with torch blocked, serving a two-image chat to a loopback
  vLLM-wire worker: the tensors and ids the worker receives equal the reference.

Every child must end with no torch module loaded and no import of torch attempted.
Images mmgate refuses before resizing (aspect ratio > 200, LLaVA's resize bound) do not reach
the resize and are left out (the live parity tiers check those refusals).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import math
import os
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
# the family tiers import their helpers as top-level modules (pytest puts tests/families on sys.path)
sys.path.insert(0, str(REPO / "tests" / "families"))

transformers = pytest.importorskip("transformers")
pytest.importorskip("torchvision")

from gemma3_support import PAS_ON
from parity_support import ImageSpec, find_bundle_dir

from mmgate.chat.tokenizer import load_tokenizer
from mmgate.errors import GatewayError
from mmgate.models.bundle import load_bundle
from mmgate.models.registry import load_family
from mmgate.config.settings import FetchSettings
from mmgate.models.backend import ImageBackend
from mmgate.types import ItemHints
from tests.video.video_support import (
    QWEN2_5,
    QWEN3,
    ClipSpec,
    make_clip,
    reference,
    video_part,
    vllm_video_kwargs,
)

SEED = int(os.environ.get("MMGATE_PARITY_SEED") or secrets.randbits(32))
print(f"\n[torch-free] seed={SEED} (rerun with MMGATE_PARITY_SEED={SEED})")

MAX_DECODE_PIXELS = FetchSettings().max_image_pixels
SAMPLE_MAX_PIXELS = 1_500_000  # the default run's images stay below this
QWEN = ("Qwen--Qwen2-VL-2B-Instruct", "Qwen--Qwen2.5-VL-7B-Instruct", "Qwen--Qwen3-VL-2B-Instruct")
LLAVA, LLAVA_NEXT, GEMMA3 = "llava-hf--llava-1.5-7b-hf", "llava-hf--llava-v1.6-mistral-7b-hf", "google--gemma-3-4b-it"
#: tensors compared besides ``pixel_values``, per bundle: (mmgate's key, the reference image
#: processor's key, what mmgate adds to it); Gemma 3 sends vLLM's ``num_patches`` = ``num_crops + 1``
AUX = {**{q: (("image_grid_thw", "image_grid_thw", 0),) for q in QWEN}, LLAVA: (),
       LLAVA_NEXT: (("image_sizes", "image_sizes", 0),), GEMMA3: (("num_patches", "num_crops", 1),)}
#: a clip large enough that the video processors resize its frames (smart_resize of 640x360)
BIG_CLIP = ClipSpec("torchfree_f12_640x360", 12, 24, 640, 360)


# ---------------------------------------------------------------- the child process


def run_child(args: list[str], tmp_path: Path, timeout: float) -> tuple[subprocess.CompletedProcess, str]:
    """``python -m tests.media.torch_free_child ARGS`` with torch blocked; (result, logged torch imports)."""
    attempts = tmp_path / "torch_attempts.log"
    attempts.unlink(missing_ok=True)
    env = {**os.environ, "MMGATE_TORCH_ATTEMPTS": str(attempts), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "tests.media.torch_free_child", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
    return proc, attempts.read_text() if attempts.exists() else ""


def run_job(job: dict, tmp_path: Path, timeout: float = 900) -> dict:
    (tmp_path / "job.json").write_text(json.dumps(job))
    proc, attempts = run_child([str(tmp_path / "job.json"), str(tmp_path / "out.json")], tmp_path, timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not attempts, f"the torch-free gateway tried to import torch:\n{attempts[-4000:]}"
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["torch_modules"] == []
    return out


def describe(array: np.ndarray) -> dict:
    """What the child reports of a tensor (``torch_free_child.describe``), less the small values."""
    arr = np.ascontiguousarray(array)
    return {"sha256": hashlib.sha256(arr.tobytes()).hexdigest(), "shape": list(arr.shape), "dtype": str(arr.dtype)}


def same_tensor(got: dict, want: np.ndarray, exact_dtype: bool = True) -> bool:
    """Identical bytes, shape and dtype (``exact_dtype``), else equal values (small auxiliary tensors)."""
    if exact_dtype:
        return {k: got[k] for k in ("sha256", "shape", "dtype")} == describe(want)
    return "values" in got and np.array_equal(np.asarray(got["values"]), np.asarray(want))


# ---------------------------------------------------------------- corpora (the live tiers' generators)


@dataclass
class Reference:
    """One bundle's torchvision-backend reference processor and the mmgate family (in process)."""

    folder: str
    path: Path
    processor: object
    family: object
    tokenizer: object
    images_kwargs: dict = field(default_factory=dict)


@cache
def reference_for(folder: str) -> Reference:
    path = find_bundle_dir(folder)
    if path is None:
        pytest.skip(f"model bundle {folder} not on MMGATE_MODEL_PATH / ../shared/models")
    from transformers import AutoProcessor, Gemma3Processor

    bundle = load_bundle(Path(path))
    tok = load_tokenizer(bundle)
    processor = AutoProcessor.from_pretrained(str(path))
    assert not type(processor.image_processor).__name__.endswith("Pil")  # the torchvision backend
    return Reference(folder, Path(path), processor, load_family(bundle, tok, ImageBackend.TORCHVISION), tok,
                     dict(Gemma3Processor.images_kwargs) if folder == GEMMA3 else {})


def corpus(folder: str, full: bool) -> list[ImageSpec]:
    """The live tier's corpus of ``folder`` (``full``), or the default run's sample of it."""
    if folder in QWEN:
        import test_qwen_vl_live_parity as qwen

        ip = reference_for(folder).processor.image_processor  # type: ignore[attr-defined]
        index = QWEN.index(folder)
        edges = qwen.edge_specs(ip.patch_size * ip.merge_size, ip.size["shortest_edge"], ip.size["longest_edge"],
                                SEED % 100_000 + 1000 * index)
        randoms = qwen.random_specs(np.random.default_rng([SEED, index]), qwen.NUM_RANDOM if full else 4,
                                    qwen.NUM_LARGE if full else 0)
    elif folder in (LLAVA, LLAVA_NEXT):
        import test_llava_live_parity as llava

        if not full:
            return llava.sample_specs(SEED % 100_000)[::2]
        edges = llava.edge_specs(SEED % 100_000)
        randoms = llava.random_specs(np.random.default_rng([SEED, 3 if folder == LLAVA else 4]), llava.NUM_RANDOM)
    else:
        import test_gemma3_live_parity as gemma

        edges = gemma.edge_specs(SEED % 100_000)
        randoms = gemma.random_specs(np.random.default_rng(SEED), gemma.NUM_RANDOM if full else 3)
    if full:
        return edges + randoms
    small = [s for s in edges if s.width * s.height <= SAMPLE_MAX_PIXELS]
    return small[::max(1, len(small) // 9)] + [s for s in randoms if s.width * s.height <= SAMPLE_MAX_PIXELS]


def options_for(folder: str) -> list[dict]:
    return [{}, PAS_ON] if folder == GEMMA3 else [{}]


def plannable(ref: Reference, spec: ImageSpec, options: dict) -> bool:
    """Whether mmgate (in process) accepts the image: refusals happen before any resize."""
    proc = ref.family.image  # type: ignore[attr-defined]
    hints = ItemHints(options=tuple(sorted(options.items())))
    try:
        proc.check_hints(hints, "messages[0].content[0]")
        proc.plan(spec.height, spec.width, hints)
    except GatewayError:
        return False
    return True


def check_images(folders: tuple[str, ...], full: bool, tmp_path: Path) -> None:
    jobs: list[dict] = []
    expected: dict[str, tuple[ImageSpec, dict, dict[str, np.ndarray]]] = {}
    for folder in folders:
        ref = reference_for(folder)
        for k, spec in enumerate(corpus(folder, full)):
            data = spec.encode()
            for options in options_for(folder):
                if not plannable(ref, spec, options):
                    continue
                key = f"{folder}/{k}/{json.dumps(options, sort_keys=True)}"
                file = tmp_path / f"{len(jobs)}.{spec.fmt.lower()}"
                file.write_bytes(data)
                jobs.append({"id": key, "bundle": str(ref.path), "file": str(file), "options": options})
                out = ref.processor.image_processor(  # type: ignore[attr-defined]
                    images=[Image.open(io.BytesIO(data))], return_tensors="np", **{**ref.images_kwargs, **options})
                expected[key] = (spec, {"pixel_values": describe(np.asarray(out["pixel_values"]))},
                                 {ours: np.asarray(out[ref_key]) + add for ours, ref_key, add in AUX[folder]})
    t0 = time.perf_counter()
    result = run_job({"images": jobs}, tmp_path)
    assert set(result["backends"].values()) == {"torchvision"}  # auto picks torchvision without torch
    failures = []
    for key, (spec, want, aux) in expected.items():
        got = result["images"][key]
        if {k: got["pixel_values"][k] for k in want["pixel_values"]} != want["pixel_values"]:
            failures.append(f"{key} {spec.label()}: pixel_values {got['pixel_values']['shape']} "
                            f"{got['pixel_values']['dtype']} differ from the reference {want['pixel_values']['shape']}")
        for name, values in aux.items():
            if not same_tensor(got[name], values, exact_dtype=False):
                failures.append(f"{key} {spec.label()}: {name} {got[name].get('values')} != {values.tolist()}")
    print(f"[torch-free images] {len(jobs)} images of {', '.join(folders)}; child {time.perf_counter() - t0:.1f}s")
    assert not failures, f"seed={SEED}: {len(failures)} of {len(jobs)} differ:\n" + "\n".join(failures[:40])
    assert len(jobs) >= 8 * len(folders)


# ---------------------------------------------------------------- images


def test_images_of_every_family_are_exact_without_torch(tmp_path: Path) -> None:
    check_images((QWEN[0], QWEN[2], LLAVA, LLAVA_NEXT, GEMMA3), full=False, tmp_path=tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("folder", [*QWEN, LLAVA, LLAVA_NEXT, GEMMA3], ids=lambda f: f.split("--")[1])
def test_live_tier_images_are_exact_without_torch(folder: str, tmp_path: Path) -> None:
    check_images((folder,), full=True, tmp_path=tmp_path)


# ---------------------------------------------------------------- whole requests: app state, video, sidecar


def data_url(spec: ImageSpec) -> str:
    mime = "image/jpeg" if spec.fmt == "JPEG" else "image/png"
    return f"data:{mime};base64," + base64.b64encode(spec.encode()).decode()


TWO_IMAGES = (ImageSpec(640, 480, "RGB", 11, "JPEG", name="photo"), ImageSpec(333, 517, "RGBA", 12, name="rgba"))


def image_chat_reference(ref: Reference, specs: tuple[ImageSpec, ...], text: str) -> tuple[dict, dict]:
    """(OpenAI chat body, reference processor output) for one user turn: the images then ``text``."""
    processor = ref.processor
    images = [Image.open(io.BytesIO(s.encode())) for s in specs]
    messages = [{"role": "user", "content": [*({"type": "image"} for _ in specs), {"type": "text", "text": text}]}]
    prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)  # type: ignore[attr-defined]
    out = processor(text=[prompt], images=images, return_tensors="np")  # type: ignore[operator]
    body = {"messages": [{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": data_url(s)}} for s in specs), {"type": "text", "text": text}]}]}
    return body, dict(out)


def test_app_pipeline_video_and_sidecar_are_exact_without_torch(tmp_path: Path) -> None:
    qwen2 = reference_for(QWEN[0])
    body, want = image_chat_reference(qwen2, TWO_IMAGES, "Compare them.")
    clip_small = make_clip(ClipSpec("torchfree_f17_70x46", 17, 25, 70, 46, codec="mpeg4"), tmp_path)
    clip_big = make_clip(BIG_CLIP, tmp_path)
    videos = {f"{model}/{p.name}": (model, p) for model, p in ((QWEN2_5, clip_small), (QWEN3, clip_big))}
    video_refs = {key: reference(model, path, video_kwargs=vllm_video_kwargs(model))  # the default sampling
                  for key, (model, path) in videos.items()}
    anchor = qwen2.family.image.anchor_token_id  # type: ignore[attr-defined]
    prompt_ids = [9, anchor, 10, 11, anchor, 12]
    job = {
        "imports": ["mmgate.cli", "mmgate.api.app", "mmgate.sidecar.server", "mmgate.sidecar.processor"],
        "requests": [{"id": "images", "bundle": str(qwen2.path), "body": body}] + [
            {"id": key, "bundle": str(find_bundle_dir(model.replace("/", "--"))), "body": {"messages": [
                {"role": "user", "content": [video_part(path), {"type": "text", "text": "What happens?"}]}]}}
            for key, (model, path) in videos.items()],
        "sidecar": [{"id": "sidecar", "bundle": str(qwen2.path), "prompt_ids": prompt_ids,
                     "urls": [data_url(s) for s in TWO_IMAGES]}],
    }
    result = run_job(job, tmp_path)

    got = result["requests"]["images"]
    assert got["image_backend"] == "torchvision" and got["video_backend"] == "torchvision"
    assert got["input_ids"] == want["input_ids"][0].tolist()
    (batch,) = got["batches"]
    assert same_tensor(batch["pixel_values"], want["pixel_values"])
    assert same_tensor(batch["image_grid_thw"], want["image_grid_thw"], exact_dtype=False)

    for key, ref in video_refs.items():
        got = result["requests"][key]
        assert got["input_ids"] == ref.input_ids, key
        (batch,) = got["batches"]
        assert same_tensor(batch["pixel_values"], ref.out["pixel_values_videos"]), key
        assert same_tensor(batch["video_grid_thw"], ref.out["video_grid_thw"], exact_dtype=False), key
    big = video_refs[f"{QWEN3}/{clip_big.name}"].out["video_grid_thw"][0]
    assert int(big[1]) * 16 != BIG_CLIP.height or int(big[2]) * 16 != BIG_CLIP.width  # the frames were resized

    side = result["sidecar"]["sidecar"]
    assert side["image_backend"] == "torchvision"
    (batch,) = side["batches"]
    assert same_tensor(batch["pixel_values"], want["pixel_values"])
    grid = want["image_grid_thw"]
    tokens = [int(np.prod(g)) // 4 for g in grid]  # merge_size 2: grid_t * grid_h * grid_w / 4 placeholders
    assert len(side["input_ids"]) == len(prompt_ids) - 2 + sum(tokens)


# ---------------------------------------------------------------- mmgate serve


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_mmgate_serve_with_torch_blocked_serves_exact_tensors(tmp_path: Path) -> None:
    import httpx

    from tests.support.fake_worker import FakeWorker, FakeWorkerState

    qwen2 = reference_for(QWEN[0])
    body, want = image_chat_reference(qwen2, TWO_IMAGES, "What differs?")
    worker = FakeWorker(FakeWorkerState(model_type="qwen2_vl"))
    port = free_port()
    attempts = tmp_path / "torch_attempts.log"
    env = {**os.environ, "MMGATE_TORCH_ATTEMPTS": str(attempts), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")])}
    log = (tmp_path / "serve.log").open("w")
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.media.torch_free_child", "serve", "--model", str(qwen2.path),
         "--worker-urls", worker.url, "--host", "127.0.0.1", "--port", str(port)],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert child.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "mmgate serve did not become healthy"
            time.sleep(0.3)
        served = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        reply = httpx.post(f"{base}/v1/chat/completions", json={**body, "model": served, "max_tokens": 1},
                           timeout=120)
        assert reply.status_code == 200, reply.text
    finally:
        child.terminate()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        log.close()
        worker.stop()
    assert not attempts.exists(), f"mmgate serve tried to import torch:\n{attempts.read_text()[-4000:]}"
    (received,) = worker.state.received
    assert received.input_ids == want["input_ids"][0].tolist()
    assert received.dtypes["pixel_values"] == "float32"
    assert np.array_equal(received.tensors["pixel_values"].view(np.uint32), want["pixel_values"].view(np.uint32))
    assert np.array_equal(received.tensors["image_grid_thw"], want["image_grid_thw"])
    assert math.isfinite(float(received.tensors["pixel_values"].sum()))
