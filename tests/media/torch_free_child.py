"""Child process of ``test_torch_free.py``: the gateway's preprocessing with torch made unimportable.

Run as ``python -m tests.media.torch_free_child JOB.json OUT.json`` (or with ``serve ARGS...``
to run ``mmgate serve``).  Before anything else it installs :class:`BlockTorch` at the front
of ``sys.meta_path``: importing ``torch`` or ``torchvision`` (or any submodule) raises
``ModuleNotFoundError``, and every attempt is appended to the file named by
``MMGATE_TORCH_ATTEMPTS`` (module name and the importing frames), so the parent can tell
"nothing tried" from "something tried and caught the error".

The job (JSON): ``images``: ``[{id, bundle, file, options}]``, each decoded, planned and
preprocessed through the family the gateway builds for ``bundle`` with the ``auto`` image
backend (``decode_image`` -> ``plan`` -> ``preprocess`` -> ``assemble``); ``requests``:
``[{id, bundle, body}]``, each an OpenAI chat body run through ``build_state(Settings(model,
image_backend=auto)).pipeline.prepare`` (the app's own state and pipeline); ``sidecar``:
``[{id, bundle, prompt_ids, urls}]``, each run through the Redis sidecar's processor
(``load_runtime`` + ``MediaProcessor.process``, image refs in prompt order); ``imports``:
module names imported first (the entry points).  Out (JSON):
per image the batch's tensors, per request the expanded ``input_ids`` and each batch's tensors,
a tensor being ``{"sha256", "shape", "dtype"}`` plus ``"values"`` when small; the resolved
backends; and the torch modules loaded at the end (must be none).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np


class BlockTorch:
    """A meta-path finder that refuses torch and torchvision, and records who asked."""

    BLOCKED = ("torch", "torchvision")

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        """``None`` (ask the next finder) for every other module; ``ModuleNotFoundError`` for these."""
        if name.split(".")[0] not in self.BLOCKED:
            return
        log = os.environ.get("MMGATE_TORCH_ATTEMPTS")
        if log:
            frames = "".join(traceback.format_stack(limit=12)[:-1])
            with open(log, "a", encoding="utf-8") as fh:
                fh.write(f"--- import {name}\n{frames}")
        raise ModuleNotFoundError(f"No module named {name!r} (blocked by the torch-free test)", name=name)


# Before any mmgate import (they all happen below, inside functions): nothing above loads torch.
sys.meta_path.insert(0, BlockTorch())

SMALL = 64  # tensors up to this many values also travel as values


def describe(array: Any) -> dict:
    arr = np.ascontiguousarray(array)
    out = {"sha256": hashlib.sha256(arr.tobytes()).hexdigest(), "shape": list(arr.shape), "dtype": str(arr.dtype)}
    if arr.size <= SMALL:
        out["values"] = arr.tolist()
    return out


def torch_modules() -> list[str]:
    return sorted(m for m in sys.modules if m.split(".")[0] in BlockTorch.BLOCKED and sys.modules[m] is not None)


def run_images(jobs: list[dict], out: dict) -> None:
    from mmgate.chat.tokenizer import load_tokenizer
    from mmgate.media.image import decode_image
    from mmgate.models.bundle import load_bundle
    from mmgate.models.family import assemble
    from mmgate.models.geometry import resolve_backend
    from mmgate.models.registry import load_family
    from mmgate.config.settings import FetchSettings
    from mmgate.models.backend import ImageBackend
    from mmgate.types import ItemHints

    families: dict[str, Any] = {}
    max_pixels = FetchSettings().max_image_pixels
    for job in jobs:
        family: Any = families.get(job["bundle"])
        if family is None:
            bundle = load_bundle(Path(job["bundle"]))
            backend = resolve_backend(ImageBackend.AUTO)
            out["backends"][job["bundle"]] = backend.value
            family = families[job["bundle"]] = load_family(bundle, load_tokenizer(bundle), backend)
        proc = family.image
        hints = ItemHints(options=tuple(sorted(job["options"].items())))
        decoded = decode_image(Path(job["file"]).read_bytes(), max_pixels)
        plan = proc.plan(decoded.height, decoded.width, hints)
        batch = assemble(proc, [plan], [proc.preprocess(decoded, plan)])
        out["images"][job["id"]] = {name: describe(t) for name, t in batch.tensors.items()}


def run_requests(jobs: list[dict], out: dict) -> None:
    from mmgate.gateway.state import build_state
    from mmgate.request.parse import parse_chat_request
    from mmgate.config.settings import Settings, VideoSettings
    from mmgate.models.backend import ImageBackend

    for job in jobs:
        # The reference's pyav loader keeps the stored orientation, so rotation is not applied.
        state: Any = build_state(Settings(model=job["bundle"], image_backend=ImageBackend.AUTO,
                                     video=VideoSettings(apply_rotation=False)))
        try:
            body = dict(job["body"], model=state.runtime.served_name)
            prepared = asyncio.run(state.pipeline.prepare(parse_chat_request(json.dumps(body).encode())))
            out["requests"][job["id"]] = {
                "input_ids": list(prepared.input_ids),
                "batches": [{name: describe(t) for name, t in b.tensors.items()} for b in prepared.batches],
                "image_backend": state.runtime.family.image.backend.value,
                "video_backend": (state.runtime.family.video.backend.value
                                  if state.runtime.family.video is not None else None),
            }
        finally:
            state.executor.shutdown()


def run_sidecar(jobs: list[dict], out: dict) -> None:
    from mmgate.sidecar.config import ProcessingConfig
    from mmgate.sidecar.processor import MediaProcessor, load_runtime
    from mmgate.types import MediaRef, Modality

    for job in jobs:
        config = ProcessingConfig()
        processor: Any = MediaProcessor(load_runtime(job["bundle"], (), config), config)
        refs = [MediaRef(Modality.IMAGE, url, i, f"media_refs[{i}]") for i, url in enumerate(job["urls"])]
        result = asyncio.run(processor.process(job["prompt_ids"], refs))
        out["sidecar"][job["id"]] = {
            "input_ids": list(result.input_ids),
            "batches": [{name: describe(t) for name, t in b.tensors.items()} for b in result.batches],
            "image_backend": processor.runtime.family.image.backend.value,
        }


def main(argv: list[str]) -> int:
    if argv and argv[0] == "serve":
        from mmgate.cli import main as cli_main

        return int(cli_main(argv) or 0)
    job = json.loads(Path(argv[0]).read_text())
    out: dict = {"images": {}, "requests": {}, "sidecar": {}, "backends": {}}
    for module in job.get("imports", []):  # entry points: their module-level imports
        __import__(module)
    run_images(job.get("images", []), out)
    run_requests(job.get("requests", []), out)
    run_sidecar(job.get("sidecar", []), out)
    out["torch_modules"] = torch_modules()
    Path(argv[1]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
