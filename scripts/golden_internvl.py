"""The reference side of ``golden/internvl.json`` (``scripts/gen_golden.py --family internvl``).

transformers 5.24 ``InternVLProcessor`` over InternVL3-1B-hf, both image backends
(``torchvision``: ``AutoProcessor.from_pretrained(bundle).image_processor``, ``GotOcr2ImageProcessor``;
``pil``: ``AutoImageProcessor.from_pretrained(bundle, backend="pil")``, ``GotOcr2ImageProcessorPil``),
each called with ``InternVLProcessor.images_kwargs`` (``crop_to_patches=True``; the bundle's
``preprocessor_config.json`` says false, the processor overrides it).

Rows (per backend x image): the tile grid (``get_optimal_tiled_canvas``), ``num_patches``, the
``<IMG_CONTEXT>`` count of ``processor(text="<IMG_CONTEXT>", images=[image])``, the
``pixel_values`` shape, sha256 and eight probe values.  Conversations: the ids of
``processor(text=apply_chat_template(tokenize=False), images=...)`` (= ``apply_chat_template(
tokenize=True)``; the Qwen2 tokenizer adds no BOS), collapsed, with the context-token runs, and
the batched ``pixel_values`` of the torchvision processor.  Clips (1, 2, 7, 33, 301 frames, made
with ``tests/video/video_support.make_clip``, decoded by transformers' ``load_video(backend="pyav")``)
per frame-sampling rule (``vllm``: vLLM's loader, at most 32 frames evenly spaced; ``transformers``:
every frame, the bundle's ``do_sample_frames`` false): the frames kept, the ids of
``processor(text=[template prompt], videos=[kept frames])`` (transformers' form: ``<IMG_CONTEXT>``
inside the clip, where mmgate and vLLM carry ``<video>``) and the clip's ``pixel_values``, or the
refusal where the expanded prompt does not fit the context (replayed by
``tests/families/test_internvl_golden_video.py``).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from golden_llava_onevision import vllm_indices
from golden_reference import BACKENDS, bundle_path, image_entries, opened, reference_processors, versions
from parity_support import ImageSpec, collapse_runs, probe8, reference_messages, sha256_f32le, sha256_ids

import numpy as np

INTERNVL_BUNDLE = "OpenGVLab--InternVL3-1B-hf"

#: comments: the (cols, rows) grid among 1..12 tiles of 448, + thumbnail when more than one tile
INTERNVL_IMAGES: tuple[ImageSpec, ...] = (
    ImageSpec(640, 480, "RGB", 1, "PNG", "rgb_640x480"),  # ratio exactly 4/3 -> (4, 3) + thumbnail: 13 patches
    ImageSpec(1, 1, "RGB", 2, "PNG", "tiny_1x1"),  # (1, 1)
    ImageSpec(448, 448, "RGB", 3, "PNG", "exact_448x448"),  # no resize at all
    ImageSpec(896, 448, "RGB", 4, "PNG", "grid_896x448"),  # (2, 1) exactly: crops unresized + thumbnail
    ImageSpec(900, 400, "RGBA", 5, "PNG", "rgba_900x400"),  # ratio 2.25 -> (2, 1)
    ImageSpec(1000, 30, "L", 6, "PNG", "strip_1000x30"),  # (12, 1): the most tiles
    ImageSpec(30, 1000, "P", 7, "PNG", "strip_30x1000"),  # (1, 12)
    ImageSpec(1344, 1344, "RGB", 8, "PNG", "tie_1344x1344"),  # ratio 1: ties (1,1),(2,2),(3,3) -> (3, 3)
    ImageSpec(1300, 700, "LA", 9, "PNG", "wide_1300x700"),  # (2, 1) vs (4, 2) tie -> (4, 2)
    ImageSpec(57, 85, "P+tRNS", 10, "PNG", "palette_trns_57x85"),  # ratio exactly 2/3 -> (2, 3)
    ImageSpec(64, 48, "P+alpha", 11, "PNG", "palette_alpha_64x48"),
    ImageSpec(1023, 769, "RGB", 12, "JPEG", "jpeg_1023x769"),
    ImageSpec(45, 300, "L", 13, "JPEG", "jpeg_gray_45x300"),
)

#: turns as ``parity_support.chat_messages`` reads them (an int is the index of an image)
INTERNVL_CONVERSATIONS: tuple[dict, ...] = (
    {"images": ["rgb_640x480"], "turns": [["user", [0, "What is in this image?"]]]},
    {"images": ["tiny_1x1", "rgba_900x400"],
     "turns": [["user", ["Describe ", 0, " briefly."]], ["assistant", ["A dot."]],
               ["user", [1, "And this one? é 日本語 🙂"]]]},
    {"images": ["jpeg_1023x769", "strip_30x1000", "grid_896x448"],
     "turns": [["user", ["Compare ", 0, ", ", 1, " and\n\n", 2, "."]]]},
)


#: clips (frames, fps, width, height): the issue's lengths, small frames (each is resized to 448x448)
INTERNVL_CLIPS: tuple[tuple[int, int, int, int], ...] = ((1, 24, 64, 48), (2, 25, 66, 50), (7, 30, 65, 47),
                                                         (33, 25, 48, 32), (301, 24, 48, 32))
CONTEXT = 32768  # text_config.max_position_embeddings: a prompt of this many tokens or more is refused


def _image_kwargs() -> dict:
    from transformers import InternVLProcessor

    return dict(InternVLProcessor.images_kwargs)


def internvl_pixel_rows(image_processors: dict, sources: dict[str, bytes], processor) -> list[dict]:
    from transformers.models.got_ocr2.image_processing_got_ocr2 import get_optimal_tiled_canvas

    ctx = processor.image_token_id
    rows: list[dict] = []
    for backend in BACKENDS:
        ip = image_processors[backend]
        for spec in INTERNVL_IMAGES:
            (image,) = opened(sources, [spec.name])
            out = ip(images=[image], **_image_kwargs(), return_tensors="np")
            pv = np.asarray(out["pixel_values"])
            assert pv.dtype == np.float32, pv.dtype
            size = ip.size
            grid = get_optimal_tiled_canvas((spec.height, spec.width), (size.height, size.width),
                                            ip.min_patches, ip.max_patches)
            ids = processor(text=processor.image_token, images=[image], return_tensors="np")["input_ids"][0]
            rows.append({"bundle": INTERNVL_BUNDLE, "backend": backend, "image": spec.name, "grid": list(grid),
                         "num_patches": int(np.asarray(out["num_patches"])[0]),
                         "num_image_tokens": int((ids == ctx).sum()), "pixel_values_shape": list(pv.shape),
                         "pixel_values_sha256": sha256_f32le(pv), "probe": probe8(pv)})
    return rows


def internvl_conversation_rows(processor, sources: dict[str, bytes]) -> list[dict]:
    ctx = processor.image_token_id
    out: list[dict] = []
    for conv in INTERNVL_CONVERSATIONS:
        images = opened(sources, conv["images"])
        messages = reference_messages(conv["turns"], images)
        prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ref = processor(text=prompt, images=images, return_tensors="np")
        ids = [int(v) for v in ref["input_ids"][0]]
        tokenized = processor.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                  add_generation_prompt=True, return_tensors="np")
        assert [int(v) for v in tokenized["input_ids"][0]] == ids
        collapsed, runs = collapse_runs(ids, ctx)
        pv = np.asarray(ref["pixel_values"])
        out.append({"bundle": INTERNVL_BUNDLE, "images": conv["images"], "turns": conv["turns"], "prompt": prompt,
                    "input_ids_len": len(ids), "input_ids_sha256": sha256_ids(ids),
                    "num_image_tokens": ids.count(ctx), "context_runs": runs, "input_ids_collapsed": collapsed,
                    "pixel_values_shape": list(pv.shape), "pixel_values_sha256": sha256_f32le(pv)})
    return out


def internvl_clip_rows(processor) -> list[dict]:  # noqa: ANN001 - the transformers InternVLProcessor
    """Per clip and sampling rule: the frames kept, the ids and ``pixel_values`` of
    ``processor(text=[prompt], videos=[kept frames])`` on transformers' pyav decode, or the refusal."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from parity_support import sha256_rgb
    from tests.video.video_support import ClipSpec, load, make_clip

    assert not processor.video_processor.do_sample_frames  # the processor keeps every frame it is given
    ctx = processor.image_token_id
    content = [{"type": "video"}, {"type": "text", "text": "What happens?"}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=False)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as folder:
        for frames, fps, width, height in INTERNVL_CLIPS:
            spec = ClipSpec(f"ivl_f{frames}", frames, fps, width, height)
            decoded, _ = load(make_clip(spec, Path(folder)))
            assert len(decoded) == frames
            for sampling in ("vllm", "transformers"):
                kept = vllm_indices(frames) if sampling == "vllm" else list(range(frames))
                row: dict = {"clip": {"frames": frames, "fps": fps, "width": width, "height": height,
                                      "codec": spec.codec}, "sampling": sampling, "frames_kept": kept,
                             "frames_rgb_sha256": sha256_rgb(np.ascontiguousarray(decoded))}
                # return_tensors="np" fails in 5.24 (the video pixel_values are flattened as tensors)
                out = processor(text=[prompt], videos=[decoded[kept]], return_tensors="pt")
                ids = [int(v) for v in out["input_ids"][0]]
                assert ids.count(ctx) == len(kept) * processor.image_seq_length
                if len(ids) >= CONTEXT:
                    row["refused"] = f"context_length_exceeded: {len(ids)} tokens >= {CONTEXT}"
                    rows.append(row)
                    continue
                pv = out["pixel_values"].numpy()
                assert pv.dtype == np.float32, pv.dtype
                row.update({"num_context_tokens": ids.count(ctx), "input_ids_len": len(ids),
                            "input_ids_sha256": sha256_ids(ids), "pixel_values_shape": list(pv.shape),
                            "pixel_values_sha256": sha256_f32le(pv)})
                rows.append(row)
    return rows


def internvl_golden() -> dict:
    """``internvl.json``: pixel rows per backend, conversations, the bundle's token facts."""
    path = bundle_path(INTERNVL_BUNDLE)
    processor, image_processors = reference_processors(path)
    assert type(processor).__name__ == "InternVLProcessor"
    assert type(processor.image_processor).__name__ == "GotOcr2ImageProcessor"
    assert type(image_processors["pil"]).__name__ == "GotOcr2ImageProcessorPil"
    sources = {spec.name: spec.encode() for spec in INTERNVL_IMAGES}
    tok = processor.tokenizer
    ip = image_processors["pil"]
    bundle = {
        "bundle": INTERNVL_BUNDLE, "model_type": "internvl", "processor_class": type(processor).__name__,
        "image_processor_classes": {be: type(p).__name__ for be, p in image_processors.items()},
        "start_image_token_id": tok.start_image_token_id, "end_image_token_id": tok.end_image_token_id,
        "image_token_id": processor.image_token_id,
        "video_token_id": tok.convert_tokens_to_ids(processor.video_token),
        "image_seq_length": processor.image_seq_length, "size": dict(ip.size),
        "min_patches": ip.min_patches, "max_patches": ip.max_patches, "images_kwargs": _image_kwargs(),
    }
    return {
        "format": 1,
        "generated_by": "scripts/gen_golden.py (scripts/golden_internvl.py)",
        "reference": "transformers InternVLProcessor (GotOcr2ImageProcessor) / GotOcr2ImageProcessorPil, "
                     "crop_to_patches=True; ids: processor(text=apply_chat_template(tokenize=False))",
        "pixel_values_hash": "sha256 of float32 little-endian C-order bytes",
        "input_ids_hash": "sha256 of int64 little-endian ids",
        "versions": versions(),
        "images": image_entries(INTERNVL_IMAGES, sources),
        "bundles": [bundle],
        "rows": internvl_pixel_rows(image_processors, sources, processor),
        "conversations": internvl_conversation_rows(processor, sources),
        "clips_reference": "tests/video/video_support.make_clip (PyAV libx264) decoded by transformers' "
                           "load_video(backend='pyav'); the frames kept by the sampling rule handed to "
                           "processor(text=[template prompt], videos=[frames]) (do_sample_frames false); ids "
                           "with <IMG_CONTEXT> (image_token_id) in the clip, pixel_values the clip's frames",
        "clips": internvl_clip_rows(processor),
    }
