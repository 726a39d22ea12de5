"""Tier (b): live differential of LLaVA-OneVision (images and video) against transformers 5.24.

References, per image backend:
* ``torchvision``: ``AutoProcessor.from_pretrained(bundle)`` (``LlavaOnevisionProcessor`` with
  ``LlavaOnevisionImageProcessor``); ``pil``: the same processor built with
  ``AutoImageProcessor.from_pretrained(bundle, backend="pil")`` (``LlavaOnevisionImageProcessorPil``);
* pixels: the image processor on ``PIL.Image.open(bytes)``; ``pixel_values`` and ``image_sizes``
  identical to mmgate's (``decode_image`` -> ``plan`` -> ``preprocess`` -> ``assemble``), and the
  token count of ``processor.replace_image_token(output, 0)`` equal to ``plan.num_tokens``;
* every tiling boundary by arithmetic, without pixels: ``processor._get_number_of_features`` (the
  reference's own count, pinpoint selection and anyres-max cap included) for every pinpoint and its
  +-1 neighbours, every size around the cap's ``ratio > 1.1`` switch and thousands of random sizes;
* video (torchvision only: ``LlavaOnevisionVideoProcessor`` has no PIL twin): clips of 1, 2, 7, 33
  and 301 frames decoded by transformers' pyav loader, the frames mmgate keeps handed to the
  processor (``tests/video/video_support.reference``): ``pixel_values_videos`` and the expanded ids
  identical, under ``--video-frame-sampling vllm`` (vLLM 0.33's 32 uniform frames) and
  ``transformers`` (every frame; 301 frames are a 58997-token run, past the 32768-token context: refused
  before any engine sees them, ``context_length_exceeded``).

Corpus: edge sizes (1x1, thin strips, every image mode, JPEG, the 384 tile +-1, the pinpoints up to
3x3 tiles exact and one past, the four largest pinpoints, vLLM's 1153x944) plus random sizes from a
seeded RNG (``MMGATE_PARITY_SEED`` pins it; printed), mostly small (the reference's cost grows with
the tile count, up to 37 tiles of 384x384).  The default run takes a sample of about 20 sizes per
backend and the 1-, 2- and 7-frame clips; ``slow`` takes every edge size, >= 200 random sizes per
backend and the 33- and 301-frame clips.

The image corpus comparison runs in ``test_live_parity.py`` over :data:`LIVE` (``live_support.run_live``).
"""

from __future__ import annotations

import io
import math
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import live_support as live
from parity_support import ImageSpec
from PIL import Image

transformers = pytest.importorskip("transformers")
pytest.importorskip("torchvision")

from mmgate.errors import ErrorCode, GatewayError  # noqa: E402
from mmgate.media.image import decode_image  # noqa: E402
from mmgate.models.backend import FrameSampling, ImageBackend  # noqa: E402
from mmgate.models.family import assemble  # noqa: E402
from mmgate.models.llava_onevision import LlavaOnevisionFamily  # noqa: E402
from mmgate.models.frame_sampling import vllm_frame_indices  # noqa: E402

SEED = live.live_seed("llava_onevision")

BUNDLE = "llava-hf--llava-onevision-qwen2-0.5b-ov-hf"
MODEL = "llava-hf/llava-onevision-qwen2-0.5b-ov-hf"  # the same bundle, by its hub name (video helpers)
NUM_RANDOM = 200  # random sizes per backend per slow run, on top of the edge sizes
TILE = 384
CONTEXT = 32768  # the bundle's text_config.max_position_embeddings
BACKENDS = (ImageBackend.PIL, ImageBackend.TORCHVISION)

#: the default run's sample (width, height, mode)
SAMPLE = (
    (1, 1, "RGB"), (1, 57, "L"), (57, 1, "RGB"), (3, 600, "RGB"), (600, 3, "RGBA"), (640, 480, "RGB"),
    (383, 385, "LA"), (384, 384, "P"), (385, 383, "P+tRNS"), (27, 29, "P+alpha"), (97, 61, "RGBA"),
    (768, 384, "RGB"), (769, 384, "RGB"), (384, 1153, "L"), (1153, 944, "RGB"), (1000, 860, "RGB"),
    (2400, 300, "RGB"), (200, 1, "RGB"), (1, 1000, "RGB"), (90, 1000, "RGB"),
)


def pinpoints() -> list[tuple[int, int]]:
    """``image_grid_pinpoints`` of the bundle, (h, w)."""
    return [(int(h), int(w)) for h, w in case().ref_image[ImageBackend.TORCHVISION].image_grid_pinpoints]


# ---------------------------------------------------------------- corpus


def sample_specs(seed: int) -> list[ImageSpec]:
    return [ImageSpec(w, h, mode, seed + i, name="sample") for i, (w, h, mode) in enumerate(SAMPLE)]


def edge_specs(seed: int) -> list[ImageSpec]:
    sizes = [  # (width, height)
        (1, 1), (1, 2), (2, 1), (2, 2), (3, 3), (1, 57), (57, 1), (1, 384), (384, 1), (1, 2000), (2000, 1),
        (383, 383), (384, 384), (385, 385), (383, 385), (385, 383), (384, 385), (512, 384), (384, 512),
        (7, 1500), (1500, 7), (1153, 944), (944, 1153), (3000, 200), (200, 3000),
    ]
    for ph, pw in pinpoints():  # up to 3x3 tiles: exact and one pixel past; the largest ones exact only
        if ph <= 3 * TILE and pw <= 3 * TILE:
            sizes += [(pw, ph), (pw + 1, ph), (pw, ph + 1), (pw // 2, ph // 2)]
    sizes += [(2304, 2304), (2304, 384), (384, 2304), (1536, 1920)]
    specs = [ImageSpec(w, h, "RGB", seed + i, name="edge") for i, (w, h) in enumerate(sizes)]
    return specs + live.mode_specs(seed, lambda j: (350 + 3 * j, 301), lambda j: (61, 97 + 7 * j), (1023, 769))


def random_specs(rng: np.random.Generator, count: int) -> list[ImageSpec]:
    """Log-uniform sides 1..1200 (aspect <= 100), so most images take 1-4 tiles; every tenth up to 2000."""
    specs: list[ImageSpec] = []
    while len(specs) < count:
        top = 2000 if len(specs) % 10 == 0 else 1200
        w, h = (round(math.exp(v)) for v in rng.uniform(0.0, math.log(top), size=2))
        if max(w, h) / min(w, h) > 100:
            continue
        specs.append(live.random_spec(rng, w, h))
    return specs


@cache
def case() -> live.Reference:
    return live.load_reference(BUNDLE, "LlavaOnevisionImageProcessor", LlavaOnevisionFamily.from_bundle)


# ---------------------------------------------------------------- comparison


def compare_one(key: str, backend: ImageBackend, job: live.Job, data: bytes) -> tuple[str, float]:
    """``pixel_values`` and ``image_sizes`` identical, the token count ``replace_image_token``'s."""
    ref_case = case()
    proc = ref_case.families[backend].image
    try:
        decoded = decode_image(data, live.MAX_DECODE_PIXELS)
        plan = proc.plan(decoded.height, decoded.width)
    except GatewayError as exc:
        return f"mmgate refused ({exc.code}: {exc})", math.nan
    batch = assemble(proc, [plan], [proc.preprocess(decoded, plan)])
    ref = ref_case.ref_image[backend](images=[Image.open(io.BytesIO(data))], return_tensors="np")
    wanted = {k: ref[k] for k in ("pixel_values", "image_sizes")}
    problems, diff = live.tensor_problems(wanted, batch.tensors, same_dtype=("image_sizes",))
    processor = ref_case.ref_processor[backend]
    tokens = len(processor.replace_image_token(ref, 0)) // len(processor.image_token)
    if tokens != plan.num_tokens:
        problems.append(f"{plan.num_tokens} image tokens, reference {tokens}")
    return ("; ".join(problems) if problems else live.EQUAL), diff


def check_results(key: str, backend: ImageBackend, results: list[live.Result]) -> None:
    """OneVision refuses no decodable image; the corpus reaches past nine tiles."""
    assert not any(r.outcome == live.REFUSED for r in results)


def full_corpus(key: str) -> list[live.Job]:
    specs = edge_specs(SEED % 100_000) + random_specs(np.random.default_rng([SEED, 24]), NUM_RANDOM)
    assert sum(s.name == "random" for s in specs) >= 200
    return [live.Job(s) for s in specs]


LIVE = live.LiveFamily(
    label="llava_onevision", keys=("llava_onevision",), key_id=str, seed=SEED, compare=compare_one,
    full=full_corpus, sample=lambda key: [live.Job(s) for s in sample_specs(SEED % 100_000)],
    check_results=check_results,
)


# ---------------------------------------------------------------- every tiling boundary, by arithmetic


def test_token_counts_equal_the_reference_on_every_tiling_boundary() -> None:
    """``_get_number_of_features`` (pinpoint choice, unpadding, newlines, anyres-max cap) against
    ``plan.num_tokens``, for every pinpoint +-1 in each side and double, the cap switch and random sizes."""
    ref_case = case()
    processor = ref_case.ref_processor[ImageBackend.TORCHVISION]
    proc = ref_case.families[ImageBackend.TORCHVISION].image
    sizes: set[tuple[int, int]] = set()
    for ph, pw in pinpoints():
        sizes |= {(ph + dh, pw + dw) for dh in (-1, 0, 1) for dw in (-1, 0, 1)}
        sizes |= {(2 * ph + 1, 2 * pw - 1), (ph // 2, pw // 2 + 1)}
    for side in range(700, 1400):  # squares and 3:4 around the cap's ratio 1.1 switch
        sizes |= {(side, side), (side, side * 4 // 3)}
    rng = np.random.default_rng([SEED, 7])
    sizes |= {(int(h), int(w)) for h, w in rng.integers(1, 5000, size=(3000, 2))}
    wrong = [(h, w, proc.num_tokens(h, w), processor._get_number_of_features(h, w, TILE, TILE))
             for h, w in sorted(sizes)
             if proc.num_tokens(h, w) != processor._get_number_of_features(h, w, TILE, TILE)]
    assert not wrong, f"seed={SEED}: (h, w, mmgate, reference) {wrong[:20]}"
    print(f"[llava_onevision] token counts equal on {len(sizes)} sizes")


# ---------------------------------------------------------------- video

#: (frames, fps, width, height): the issue's clip lengths, small frames (each is resized to 384x384)
CLIPS = ((1, 24, 64, 48), (2, 25, 66, 50), (7, 30, 65, 47), (33, 25, 48, 32), (301, 24, 48, 32))


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("onevision_clips")


@cache
def video_processor():  # noqa: ANN201 - the transformers LlavaOnevisionProcessor
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(case().path))


def video_reference(frames: np.ndarray) -> dict:
    """``processor(text=[prompt], videos=[frames])`` with the chat template's prompt (its own
    ``do_sample_frames=False``: it keeps the frames it is given, as a vLLM worker hands them over)."""
    processor = video_processor()
    content = [{"type": "video"}, {"type": "text", "text": "What happens?"}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=False)
    return dict(processor(text=[prompt], videos=[frames], return_tensors="np"))


def run_clip(folder: Path, frames: int, fps: int, width: int, height: int, sampling: FrameSampling) -> None:
    """mmgate's prepared request for one clip equals the reference's ids and ``pixel_values_videos``;
    the frames are transformers' pyav loader's (``load_video(path, backend="pyav")``)."""
    from tests.video.video_support import ClipSpec, load, make_clip, prepare, video_part

    path = make_clip(ClipSpec(f"ov_f{frames}", frames, fps, width, height), folder)
    indices = vllm_frame_indices(frames) if sampling is FrameSampling.VLLM else list(range(frames))
    if len(indices) * 196 + 1 > CONTEXT:  # 301 frames, every one kept: 58997 tokens, past the model's context
        with pytest.raises(GatewayError) as info:
            prepare(MODEL, [video_part(path)], sampling=sampling)
        assert info.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED
        return
    prepared = prepare(MODEL, [video_part(path)], sampling=sampling)
    decoded, _ = load(path)
    assert len(decoded) == frames
    ref = video_reference(decoded[indices])
    (batch,) = prepared.batches
    pv = batch.tensors["pixel_values"]
    want = np.asarray(ref["pixel_values_videos"])
    assert pv.shape == want.shape == (1, len(indices), 3, TILE, TILE)
    assert live.max_abs_diff(want, pv) == 0.0, f"{frames} frames {sampling.value}"
    ref_ids = [int(t) for t in ref["input_ids"][0]]
    assert prepared.input_ids == tuple(ref_ids), live.first_difference(prepared.input_ids, ref_ids)
    assert ref_ids.count(batch.placeholder_token_id) == len(indices) * 196 + 1


@pytest.mark.parametrize("sampling", list(FrameSampling), ids=lambda s: s.value)
@pytest.mark.parametrize("clip", CLIPS[:3], ids=lambda c: f"{c[0]}frames")
def test_short_clips_equal_the_reference(clip_dir: Path, clip: tuple[int, int, int, int],
                                         sampling: FrameSampling) -> None:
    run_clip(clip_dir, *clip, sampling)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", list(FrameSampling), ids=lambda s: s.value)
@pytest.mark.parametrize("clip", CLIPS[3:], ids=lambda c: f"{c[0]}frames")
def test_long_clips_equal_the_reference(clip_dir: Path, clip: tuple[int, int, int, int],
                                        sampling: FrameSampling) -> None:
    run_clip(clip_dir, *clip, sampling)


def test_vllm_keeps_at_most_32_uniform_frames() -> None:
    """vLLM 0.33 ``OpenCVVideoBackend.load_bytes(num_frames=32)``: every frame up to 32, else
    ``np.linspace(0, total - 1, 32, dtype=int)``."""
    assert vllm_frame_indices(1) == [0]
    assert vllm_frame_indices(32) == list(range(32))
    assert vllm_frame_indices(33) == [int(i) for i in np.linspace(0, 32, 32, dtype=int)]
    assert 31 not in vllm_frame_indices(33) and vllm_frame_indices(33)[-1] == 32
    assert vllm_frame_indices(301) == [int(i) for i in np.linspace(0, 300, 32, dtype=int)]
