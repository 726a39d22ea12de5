"""The reference side of ``golden/llava_onevision.json`` (``scripts/gen_golden.py``): LLaVA-OneVision
images through transformers 5.24, both backends.

The fixture has the LLaVA-NeXT format (``scripts/golden_reference.py`` ``llava_golden``), so
``tests/families/replay.py`` replays it with ``llava_row`` / ``llava_conversation``: per backend and
image the selected pinpoint, the resize-for-patching size, the token count of
``processor(text="<image>", images=[image])``, the ``pixel_values`` shape, sha256 and probe values
and ``image_sizes``; per conversation the ids of ``processor(text=apply_chat_template(tokenize=False),
images=images)`` (a flat image list: every image tiled, as vLLM calls it) and the batch; per clip
(1, 2, 7, 33, 301 frames) and frame-sampling rule the frames kept, the ids and the
``pixel_values_videos`` sha256 of the video processor (replayed by
``tests/families/test_llava_onevision_golden_video.py``).

The corpus adds OneVision's own boundaries to the LLaVA one: the 384 tile and pinpoints
(384x384 exact, 768x384 exact and one pixel past), sizes whose unpadded grid is capped by
``anyres_max_9`` (ratio just above / below 1.1) and vLLM's profiling size 1153x944.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
from golden_corpora import LLAVA_CONVERSATIONS, LLAVA_IMAGES
from golden_reference import (
    BACKENDS,
    bundle_path,
    image_entries,
    llava_geometry,
    opened,
    reference_processors,
    versions,
)
from parity_support import (
    ImageSpec,
    collapse_runs,
    probe8,
    reference_messages,
    sha256_f32le,
    sha256_ids,
)

ONEVISION_BUNDLE = "llava-hf--llava-onevision-qwen2-0.5b-ov-hf"

#: LLaVA's corpus (its 336 boundaries are ordinary sizes here) plus the OneVision boundaries
ONEVISION_IMAGES: tuple[ImageSpec, ...] = LLAVA_IMAGES + (
    ImageSpec(384, 384, "RGB", 21, "PNG", "exact_384x384"),  # one tile, base unchanged: 729 + 27*27 + 27
    ImageSpec(768, 384, "RGB", 22, "PNG", "pinpoint_768x384"),  # exactly the 384x768 pinpoint
    ImageSpec(769, 384, "RGB", 23, "PNG", "pinpoint_769x384"),  # one pixel past it: 384x1152
    ImageSpec(1153, 944, "RGB", 24, "JPEG", "vllm_max_1153x944"),  # vLLM's image size with most features
    ImageSpec(1000, 860, "RGB", 25, "PNG", "cap_1000x860"),  # 3x3 grid, anyres_max cap just off/on
    ImageSpec(2400, 300, "RGB", 26, "PNG", "wide_2400x300"),  # 384x2304 pinpoint, thin unpadded grid
)

#: clips (frames, fps, width, height): the issue's lengths, small frames (each is resized to 384x384)
ONEVISION_CLIPS: tuple[tuple[int, int, int, int], ...] = ((1, 24, 64, 48), (2, 25, 66, 50), (7, 30, 65, 47),
                                                          (33, 25, 48, 32), (301, 24, 48, 32))
CONTEXT = 32768  # text_config.max_position_embeddings: a longer expansion is refused by the gateway

#: the LLaVA conversations (the OneVision template puts every image before the turn's text)
ONEVISION_CONVERSATIONS: tuple[dict, ...] = LLAVA_CONVERSATIONS


def vllm_indices(total: int) -> list[int]:
    """vLLM 0.33 ``OpenCVVideoBackend.load_bytes(num_frames=32)`` (written out, not mmgate's)."""
    n = max(1, min(32, total))
    return list(range(total)) if n == total else [int(i) for i in np.linspace(0, total - 1, n, dtype=int)]


def clip_rows(processor) -> list[dict]:  # noqa: ANN001 - the transformers LlavaOnevisionProcessor
    """Per clip and sampling rule: the frames kept, the ids and ``pixel_values_videos`` of
    ``processor(text=[prompt], videos=[frames])`` on transformers' pyav decode, or the refusal."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from parity_support import sha256_rgb
    from tests.video.video_support import ClipSpec, load, make_clip

    content = [{"type": "video"}, {"type": "text", "text": "What happens?"}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=False)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as folder:
        for frames, fps, width, height in ONEVISION_CLIPS:
            spec = ClipSpec(f"ov_f{frames}", frames, fps, width, height)
            decoded, _ = load(make_clip(spec, Path(folder)))
            assert len(decoded) == frames
            for sampling in ("vllm", "transformers"):
                kept = vllm_indices(frames) if sampling == "vllm" else list(range(frames))
                row: dict = {"clip": {"frames": frames, "fps": fps, "width": width, "height": height,
                                      "codec": spec.codec}, "sampling": sampling, "frames_kept": kept,
                             "frames_rgb_sha256": sha256_rgb(np.ascontiguousarray(decoded))}
                tokens = len(kept) * 196 + 1
                if tokens > CONTEXT:
                    row["refused"] = f"context_length_exceeded: {tokens} tokens > {CONTEXT}"
                    rows.append(row)
                    continue
                out = processor(text=[prompt], videos=[decoded[kept]], return_tensors="np")
                pv = np.asarray(out["pixel_values_videos"])
                ids = [int(v) for v in out["input_ids"][0]]
                assert ids.count(processor.video_token_id) == tokens
                row.update({"num_video_tokens": tokens, "input_ids_len": len(ids), "input_ids_sha256": sha256_ids(ids),
                            "pixel_values_videos_shape": list(pv.shape),
                            "pixel_values_videos_sha256": sha256_f32le(pv)})
                rows.append(row)
    return rows


def onevision_golden() -> dict:
    """``llava_onevision.json``."""
    from transformers import AutoProcessor

    folder = ONEVISION_BUNDLE
    path = bundle_path(folder)
    sources = {spec.name: spec.encode() for spec in ONEVISION_IMAGES}
    processor, image_processors = reference_processors(path)
    assert (type(processor.image_processor).__name__, type(processor).__name__) == (
        "LlavaOnevisionImageProcessor", "LlavaOnevisionProcessor")
    assert type(image_processors["pil"]).__name__ == "LlavaOnevisionImageProcessorPil"
    processors = {"torchvision": processor,
                  "pil": AutoProcessor.from_pretrained(str(path), image_processor=image_processors["pil"])}
    ip = processor.image_processor
    image_id = processor.image_token_id
    model_type = json.loads((path / "config.json").read_text())["model_type"]
    info = {
        "bundle": folder, "model_type": model_type, "processor_class": type(processor).__name__,
        "image_processor_classes": {be: type(p).__name__ for be, p in image_processors.items()},
        "image_token": processor.image_token, "image_token_id": image_id,
        "video_token": processor.video_token, "video_token_id": processor.video_token_id,
        "num_image_tokens": processor.num_image_tokens, "vision_aspect_ratio": processor.vision_aspect_ratio,
        "vision_feature_select_strategy": processor.vision_feature_select_strategy,
        "size": dict(ip.size), "image_grid_pinpoints": [list(p) for p in ip.image_grid_pinpoints],
    }
    rows: list[dict] = []
    for backend in BACKENDS:
        for spec in ONEVISION_IMAGES:
            img = opened(sources, [spec.name])
            out = image_processors[backend](images=img, return_tensors="np")
            pv = np.asarray(out["pixel_values"])[0]
            ids = processors[backend](text=processor.image_token, images=img)["input_ids"][0]
            assert pv.dtype == np.float32, pv.dtype
            sizes = np.asarray(out["image_sizes"])
            assert sizes.dtype == np.int64, sizes.dtype
            rows.append({"bundle": folder, "backend": backend, "image": spec.name,
                         **llava_geometry("llava_next", ip, spec.height, spec.width),
                         "num_image_tokens": int(list(ids).count(image_id)),
                         "pixel_values_shape": list(pv.shape), "pixel_values_sha256": sha256_f32le(pv),
                         "pixel_values_probe": probe8(pv), "image_sizes": [int(v) for v in sizes[0]]})
    conversations: list[dict] = []
    for conv in ONEVISION_CONVERSATIONS:
        imgs = opened(sources, conv["images"])
        prompt = processor.apply_chat_template(reference_messages(conv["turns"], imgs, flatten_text_turns=False),
                                               tokenize=False, add_generation_prompt=True)
        out = processor(text=prompt, images=imgs, return_tensors="np")
        ids = [int(v) for v in out["input_ids"][0]]
        collapsed, runs = collapse_runs(ids, image_id)
        pv = np.asarray(out["pixel_values"])
        conversations.append({
            "bundle": folder, "images": conv["images"], "turns": conv["turns"], "prompt": prompt,
            "input_ids_len": len(ids), "input_ids_sha256": sha256_ids(ids), "num_image_tokens": ids.count(image_id),
            "runs": runs, "input_ids_collapsed": collapsed, "pixel_values_shape": list(pv.shape),
            "pixel_values_sha256": sha256_f32le(pv), "image_sizes": np.asarray(out["image_sizes"]).tolist()})
    return {
        "format": 1,
        "generated_by": "scripts/gen_golden.py",
        "reference": "transformers AutoProcessor (torchvision backend) / AutoImageProcessor(backend='pil'); ids: "
                     "processor(text=processor.apply_chat_template(messages, tokenize=False, "
                     "add_generation_prompt=True), images=images)",
        "pixel_values_hash": "sha256 of float32 little-endian C-order bytes of one item's pixel_values "
                             "(rows) / of the batch (conversations)",
        "pixel_values_probe": "the values at flat indices k * (n - 1) // 7, k = 0..7",
        "input_ids_hash": "sha256 of int64 little-endian ids",
        "versions": versions(),
        "images": image_entries(ONEVISION_IMAGES, sources),
        "bundles": [info],
        "rows": rows,
        "conversations": conversations,
        "clips_reference": "tests/video/video_support.make_clip (PyAV libx264) decoded by transformers' "
                           "load_video(backend='pyav'); the frames kept by the sampling rule handed to "
                           "processor(text=[template prompt], videos=[frames]) (its do_sample_frames=False)",
        "clips": clip_rows(processor),
    }
