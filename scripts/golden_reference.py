"""The reference side of ``scripts/gen_golden.py``: one builder per golden fixture.

Each builder runs the transformers 5.24 processors of its family's bundles (both image backends:
``torchvision``, ``AutoProcessor.from_pretrained(bundle).image_processor``; ``pil``,
``AutoImageProcessor.from_pretrained(bundle, backend="pil")``) over the family's golden corpus
(``scripts/golden_corpora.py``) and returns the fixture as a dict (key order is the file's order);
``gen_golden.dumps`` writes it.  What each fixture records is in ``gen_golden``'s module docstring.  Images are regenerated from
``parity_support.ImageSpec``; the helpers that the replay shares (hashes, run collapsing, message
builders) are ``parity_support``'s and ``gemma3_support``'s, not copies.
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from gemma3_support import GEMMA3_BUNDLE, probe, vllm_placeholders
from golden_corpora import (
    GEMMA3_CONVERSATIONS,
    GEMMA3_IMAGES,
    GEMMA3_OPTION_SETS,
    LLAVA_CONVERSATIONS,
    LLAVA_IMAGES,
    QWEN_VL_CONVERSATIONS,
    QWEN_VL_IMAGES,
)
from parity_support import (
    QWEN_VL_BUNDLES,
    ImageSpec,
    collapse_runs,
    find_bundle_dir,
    probe8,
    reference_messages,
    sha256_f32le,
    sha256_ids,
    sha256_rgb,
)
from PIL import Image

BACKENDS = ("pil", "torchvision")

# ---------------------------------------------------------------- shared


def bundle_path(folder: str) -> Path:
    path = find_bundle_dir(folder)
    if path is None:
        raise SystemExit(f"bundle {folder} not found on MMGATE_MODEL_PATH / ../shared/models")
    return path


def reference_processors(path: Path) -> tuple[object, dict[str, object]]:
    """``AutoProcessor`` (torchvision backend) and the image processor per backend."""
    from transformers import AutoImageProcessor, AutoProcessor

    processor = AutoProcessor.from_pretrained(str(path))
    pil_ip = AutoImageProcessor.from_pretrained(str(path), backend="pil")
    return processor, {"torchvision": processor.image_processor, "pil": pil_ip}


def image_entries(specs: Sequence[ImageSpec], sources: dict[str, bytes]) -> list[dict]:
    """The fixture's ``images``: each spec with the sha256 of the RGB pixels the reference decodes."""
    from transformers.image_transforms import convert_to_rgb

    return [{"name": spec.name, "width": spec.width, "height": spec.height, "mode": spec.mode, "seed": spec.seed,
             "format": spec.fmt,
             "rgb_sha256": sha256_rgb(convert_to_rgb(Image.open(io.BytesIO(sources[spec.name])), return_numpy=True))}
            for spec in specs]


def versions() -> dict[str, str]:
    import PIL
    import torch
    import torchvision
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__,
            "torchvision": torchvision.__version__, "Pillow": PIL.__version__, "numpy": np.__version__,
            "python": sys.version.split()[0]}


def opened(sources: dict[str, bytes], names: Sequence[str]) -> list[Image.Image]:
    return [Image.open(io.BytesIO(sources[name])) for name in names]


# ---------------------------------------------------------------- Qwen-VL (qwen_vl.json)


def qwen_vl_bundle(folder: str, path: Path, sources: dict[str, bytes]) -> tuple[dict, list[dict], list[dict]]:
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    processor, image_processors = reference_processors(path)
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessor"
    assert type(image_processors["pil"]).__name__ == "Qwen2VLImageProcessorPil"
    ip = processor.image_processor
    config = json.loads((path / "config.json").read_text())
    info = {
        "bundle": folder,
        "model_type": config["model_type"],
        "image_token": processor.image_token,
        "image_token_id": processor.image_token_id,
        "patch_size": ip.patch_size,
        "merge_size": ip.merge_size,
        "min_pixels": ip.size["shortest_edge"],
        "max_pixels": ip.size["longest_edge"],
        "processor_class": type(processor).__name__,
    }
    rows: list[dict] = []
    for backend in BACKENDS:
        for spec in QWEN_VL_IMAGES:
            row: dict = {"bundle": folder, "backend": backend, "image": spec.name}
            try:
                out = image_processors[backend](images=opened(sources, [spec.name]), return_tensors="np")
            except ValueError as exc:
                row["refused"] = f"ValueError: {exc}"
                rows.append(row)
                continue
            pv = np.asarray(out["pixel_values"])
            grid = [int(v) for v in np.asarray(out["image_grid_thw"])[0]]
            factor = ip.patch_size * ip.merge_size
            resized = smart_resize(spec.height, spec.width, factor, ip.size["shortest_edge"], ip.size["longest_edge"])
            tokens = processor._get_num_multimodal_tokens(image_sizes=[[spec.height, spec.width]])["num_image_tokens"][0]
            assert pv.dtype == np.float32, pv.dtype
            assert tokens == grid[0] * grid[1] * grid[2] // ip.merge_size**2
            row.update({
                "resized_hw": [int(resized[0]), int(resized[1])],
                "image_grid_thw": grid,
                "pixel_values_shape": list(pv.shape),
                "pixel_values_sha256": sha256_f32le(pv),
                "num_image_tokens": int(tokens),
            })
            rows.append(row)
    conversations: list[dict] = []
    for conv in QWEN_VL_CONVERSATIONS:
        out = processor.apply_chat_template(
            reference_messages(conv["turns"], opened(sources, conv["images"])), tokenize=True, return_dict=True,
            add_generation_prompt=True, return_tensors="np",
        )
        ids = [int(v) for v in out["input_ids"][0]]
        collapsed, runs = collapse_runs(ids, processor.image_token_id)
        conversations.append({
            "bundle": folder,
            "images": conv["images"],
            "turns": conv["turns"],
            "input_ids_len": len(ids),
            "input_ids_sha256": sha256_ids(ids),
            "num_image_pad": ids.count(processor.image_token_id),
            "pad_runs": runs,
            "input_ids_collapsed": collapsed,
        })
    return info, rows, conversations


def qwen_vl_golden(folders: Sequence[str] = QWEN_VL_BUNDLES) -> dict:
    """``qwen_vl.json``: the three Qwen-VL bundles in one fixture (``qwen_omni.json``: the Omni bundles, whose
    images go through the same ``Qwen2VLImageProcessor``)."""
    sources = {spec.name: spec.encode() for spec in QWEN_VL_IMAGES}
    bundles, rows, conversations = [], [], []
    for folder in folders:
        info, r, c = qwen_vl_bundle(folder, bundle_path(folder), sources)
        bundles.append(info)
        rows += r
        conversations += c
    return {
        "format": 1,
        "generated_by": "scripts/gen_golden.py",
        "reference": "transformers AutoProcessor (torchvision backend) / AutoImageProcessor(backend='pil')",
        "pixel_values_hash": "sha256 of float32 little-endian C-order bytes",
        "input_ids_hash": "sha256 of int64 little-endian ids",
        "versions": versions(),
        "images": image_entries(QWEN_VL_IMAGES, sources),
        "bundles": bundles,
        "rows": rows,
        "conversations": conversations,
    }


# ---------------------------------------------------------------- LLaVA-1.5 / LLaVA-NeXT (llava*.json)


def llava_geometry(model_type: str, ip, height: int, width: int) -> dict:
    """The reference's own geometry functions (transformers 5.24) for one image size."""
    if model_type == "llava":
        from transformers.image_transforms import get_resize_output_image_size

        shape = np.empty((3, height, width), dtype=np.uint8)
        rh, rw = get_resize_output_image_size(shape, ip.size["shortest_edge"], default_to_square=False,
                                              input_data_format="channels_first")
        return {"resized_hw": [int(rh), int(rw)]}
    from transformers.image_processing_utils import get_patch_output_size, select_best_resolution

    best = select_best_resolution((height, width), ip.image_grid_pinpoints)
    resized = get_patch_output_size(np.empty((3, height, width), dtype=np.uint8), best, "channels_first")
    return {"best_resolution": [int(best[0]), int(best[1])], "resized_hw": [int(resized[0]), int(resized[1])]}


def llava_golden(folder: str) -> dict:
    """``llava.json`` / ``llava_next.json``: one LLaVA bundle per fixture."""
    from transformers import AutoProcessor

    path = bundle_path(folder)
    sources = {spec.name: spec.encode() for spec in LLAVA_IMAGES}
    processor, image_processors = reference_processors(path)
    model_type = json.loads((path / "config.json").read_text())["model_type"]
    expected = {"llava": ("CLIPImageProcessor", "LlavaProcessor"),
                "llava_next": ("LlavaNextImageProcessor", "LlavaNextProcessor")}[model_type]
    assert (type(processor.image_processor).__name__, type(processor).__name__) == expected
    assert type(image_processors["pil"]).__name__ == expected[0] + "Pil"
    processors = {"torchvision": processor,
                  "pil": AutoProcessor.from_pretrained(str(path), image_processor=image_processors["pil"])}
    ip = processor.image_processor
    image_id = processor.image_token_id
    info = {
        "bundle": folder, "model_type": model_type, "processor_class": type(processor).__name__,
        "image_processor_classes": {be: type(p).__name__ for be, p in image_processors.items()},
        "image_token": processor.image_token, "image_token_id": image_id, "patch_size": processor.patch_size,
        "num_additional_image_tokens": processor.num_additional_image_tokens,
        "vision_feature_select_strategy": processor.vision_feature_select_strategy,
        "size": dict(ip.size), "crop_size": dict(ip.crop_size),
    }
    if model_type == "llava_next":
        info["image_grid_pinpoints"] = [list(p) for p in ip.image_grid_pinpoints]
    rows: list[dict] = []
    for backend in BACKENDS:
        for spec in LLAVA_IMAGES:
            img = opened(sources, [spec.name])
            out = image_processors[backend](images=img, return_tensors="np")
            pv = np.asarray(out["pixel_values"])[0]
            ids = processors[backend](text=processor.image_token, images=img)["input_ids"][0]
            assert pv.dtype == np.float32, pv.dtype
            row = {"bundle": folder, "backend": backend, "image": spec.name,
                   **llava_geometry(model_type, ip, spec.height, spec.width),
                   "num_image_tokens": int(list(ids).count(image_id)),
                   "pixel_values_shape": list(pv.shape), "pixel_values_sha256": sha256_f32le(pv),
                   "pixel_values_probe": probe8(pv)}
            if "image_sizes" in out:
                sizes = np.asarray(out["image_sizes"])
                assert sizes.dtype == np.int64, sizes.dtype
                row["image_sizes"] = [int(v) for v in sizes[0]]
            rows.append(row)
    conversations: list[dict] = []
    for conv in LLAVA_CONVERSATIONS:
        imgs = opened(sources, conv["images"])
        prompt = processor.apply_chat_template(reference_messages(conv["turns"], imgs, flatten_text_turns=False),
                                               tokenize=False, add_generation_prompt=True)
        out = processor(text=prompt, images=imgs, return_tensors="np")
        ids = [int(v) for v in out["input_ids"][0]]
        collapsed, runs = collapse_runs(ids, image_id)
        pv = np.asarray(out["pixel_values"])
        entry = {"bundle": folder, "images": conv["images"], "turns": conv["turns"], "prompt": prompt,
                 "input_ids_len": len(ids), "input_ids_sha256": sha256_ids(ids), "num_image_tokens": ids.count(image_id),
                 "runs": runs, "input_ids_collapsed": collapsed,
                 "pixel_values_shape": list(pv.shape), "pixel_values_sha256": sha256_f32le(pv)}
        if "image_sizes" in out:
            entry["image_sizes"] = np.asarray(out["image_sizes"]).tolist()
        conversations.append(entry)
    return {
        "format": 1,
        # the name of the script that first wrote these fixtures, kept so that they regenerate byte-identical
        "generated_by": "scripts/gen_golden_llava.py",
        "reference": "transformers AutoProcessor (torchvision backend) / AutoImageProcessor(backend='pil'); ids: "
                     "processor(text=processor.apply_chat_template(messages, tokenize=False, "
                     "add_generation_prompt=True), images=images)",
        "pixel_values_hash": "sha256 of float32 little-endian C-order bytes of one item's pixel_values "
                             "(rows) / of the batch (conversations)",
        "pixel_values_probe": "the values at flat indices k * (n - 1) // 7, k = 0..7",
        "input_ids_hash": "sha256 of int64 little-endian ids",
        "versions": versions(),
        "images": image_entries(LLAVA_IMAGES, sources),
        "bundles": [info],
        "rows": rows,
        "conversations": conversations,
    }


# ---------------------------------------------------------------- Gemma 3 (gemma3.json)


def gemma3_image_kwargs(options: dict) -> dict:
    """What ``Gemma3Processor`` hands its image processor: its ``images_kwargs`` defaults (the
    bundle's ``preprocessor_config.json`` has null for all of them) overridden by ``options``."""
    from transformers import Gemma3Processor

    return {**Gemma3Processor.images_kwargs, **options}


def gemma3_pixel_rows(image_processors: dict, sources: dict[str, bytes]) -> list[dict]:
    rows: list[dict] = []
    for backend in BACKENDS:
        for options, only in GEMMA3_OPTION_SETS:
            for spec in GEMMA3_IMAGES:
                if only is not None and spec.name not in only:
                    continue
                out = image_processors[backend](images=opened(sources, [spec.name]),
                                                **gemma3_image_kwargs(options), return_tensors="np")
                pv = np.asarray(out["pixel_values"])
                assert pv.dtype == np.float32, pv.dtype
                rows.append({"bundle": GEMMA3_BUNDLE, "backend": backend, "image": spec.name, "options": options,
                             "num_crops": int(np.asarray(out["num_crops"])[0]), "pixel_values_shape": list(pv.shape),
                             "pixel_values_sha256": sha256_f32le(pv), "probe": probe(pv)})
    return rows


def gemma3_conversation_rows(processor, sources: dict[str, bytes]) -> list[dict]:
    tok = processor.tokenizer
    soft = tok.image_token_id
    newlines = tuple(tok.convert_tokens_to_ids(t) for t in ("\n", "\n\n", "\n\n\n", "\n\n\n\n"))
    out: list[dict] = []
    for conv in GEMMA3_CONVERSATIONS:
        images = opened(sources, conv["images"])
        messages = reference_messages(conv["turns"], images)
        prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ref = processor(text=prompt, images=images, add_special_tokens=False, **conv["options"], return_tensors="np")
        ids = [int(v) for v in ref["input_ids"][0]]
        if not conv["options"]:
            tokenized = processor.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                      add_generation_prompt=True, return_tensors="np")
            assert [int(v) for v in tokenized["input_ids"][0]] == ids
        # num_crops as the processor computes it (it pops them: Gemma3Processor.unused_input_names)
        crops = [int(v) for v in
                 processor.image_processor(images=images, **gemma3_image_kwargs(conv["options"]))["num_crops"]]
        assert np.asarray(ref["pixel_values"]).shape[0] == len(images) + sum(crops)
        texts = [processor.replace_image_token({"num_crops": crops}, i) for i in range(len(images))]
        ranges = vllm_placeholders(ids, [tok.encode(t, add_special_tokens=False) for t in texts], newlines)
        collapsed, runs = collapse_runs(ids, soft)
        out.append({"bundle": GEMMA3_BUNDLE, "images": conv["images"], "options": conv["options"],
                    "turns": conv["turns"], "prompt": prompt, "num_crops": crops, "input_ids_len": len(ids),
                    "input_ids_sha256": sha256_ids(ids), "num_image_soft": ids.count(soft), "soft_runs": runs,
                    "input_ids_collapsed": collapsed,
                    "vllm_placeholders": None if ranges is None else [list(r) for r in ranges]})
    return out


def gemma3_golden() -> dict:
    """``gemma3.json``: pixel rows per backend and option set, conversations, the bundle's token facts."""
    path = bundle_path(GEMMA3_BUNDLE)
    processor, image_processors = reference_processors(path)
    assert type(processor).__name__ == "Gemma3Processor"
    assert type(processor.image_processor).__name__ == "Gemma3ImageProcessor"
    assert type(image_processors["pil"]).__name__ == "Gemma3ImageProcessorPil"
    sources = {spec.name: spec.encode() for spec in GEMMA3_IMAGES}
    tok = processor.tokenizer
    config = json.loads((path / "config.json").read_text())
    probe_prompt = "<bos><start_of_turn>user\n<start_of_image>hi<end_of_turn>\n"
    one = opened(sources, ["tiny_1x1"])
    doubled = [int(v) for v in processor(text=probe_prompt, images=one)["input_ids"][0]]
    single = [int(v) for v in processor(text=probe_prompt, images=one, add_special_tokens=False)["input_ids"][0]]
    bundle = {
        "bundle": GEMMA3_BUNDLE, "model_type": config["model_type"], "processor_class": type(processor).__name__,
        "image_processor_classes": {be: type(ip).__name__ for be, ip in image_processors.items()},
        "boi_token_id": tok.boi_token_id, "eoi_token_id": tok.eoi_token_id, "image_token_id": tok.image_token_id,
        "bos_token_id": tok.bos_token_id, "image_seq_length": processor.image_seq_length,
        "size": dict(image_processors["pil"].size), "images_kwargs": gemma3_image_kwargs({}),
        "full_image_sequence_sha256": hashlib.sha256(processor.full_image_sequence.encode()).hexdigest(),
        "processor_call_adds_second_bos": doubled == [tok.bos_token_id] + single,
    }
    images = image_entries(GEMMA3_IMAGES, sources)
    return {
        "format": 1,
        # the name of the script that first wrote this fixture, kept so that it regenerates byte-identical
        "generated_by": "scripts/gen_golden_gemma3.py",
        "reference": "transformers Gemma3Processor (torchvision image processor) / Gemma3ImageProcessorPil; "
                     "ids: processor(text=apply_chat_template(tokenize=False), add_special_tokens=False)",
        "pixel_values_hash": "sha256 of float32 little-endian C-order bytes",
        "input_ids_hash": "sha256 of int64 little-endian ids",
        "versions": versions(),
        "images": images,
        "bundles": [bundle],
        "rows": gemma3_pixel_rows(image_processors, sources),
        "conversations": gemma3_conversation_rows(processor, sources),
    }
