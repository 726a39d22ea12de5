"""The transformers reference for the worker-mode tests: one conversation, two renderings.

A :class:`Conversation` is a user message of image, video and text parts with
their media bytes.  :meth:`Conversation.chat_parts` gives the OpenAI content
parts sent to a gateway; :func:`reference_inputs` runs the transformers 5.24
processor on the same conversation and the same bytes:

* ``AutoProcessor.from_pretrained(bundle)`` (``Qwen2VLProcessor``,
  ``Qwen2_5_VLProcessor`` or ``Qwen3VLProcessor`` with the torchvision
  ``Qwen2VLImageProcessor``: transformers' own default, and the backend a worker
  uses with its default ``--image-backend auto`` when torchvision imports);
* ``apply_chat_template(..., add_generation_prompt=True, tokenize=False)`` on
  ``{"type": "image"}`` / ``{"type": "video"}`` / text parts in the same order;
* the processor on that prompt with the images opened by PIL from the bytes and
  the videos decoded by the processor's own loader
  (``transformers.video_utils.load_video(path, backend="pyav")``, with its
  ``VideoMetadata``), ``return_tensors="pt"`` (the dtypes the model receives:
  float32 pixels, int64 ids and grids, float32 ``second_per_grid_ts``).

Nothing here imports mmgate.
"""

from __future__ import annotations

import base64
import copy
import io
import warnings
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from tests.support.vllm_video import vllm_sampling_kwargs


@dataclass(frozen=True)
class Part:
    kind: str  # "image" | "video" | "text"
    data: bytes = b""  # the media bytes (image or video file)
    mime: str = ""  # of ``data``
    url: str = ""  # where a gateway fetches it: ``data:`` URL when empty
    text: str = ""
    path: Path | None = None  # the video file (the reference loader reads a path)


@dataclass
class Conversation:
    """One user message, in prompt order."""

    parts: list[Part] = field(default_factory=list)

    def image(self, data: bytes, mime: str, url: str = "") -> Conversation:
        self.parts.append(Part("image", data, mime, url))
        return self

    def video(self, path: Path, url: str = "") -> Conversation:
        self.parts.append(Part("video", path.read_bytes(), "video/mp4", url, path=path))
        return self

    def say(self, text: str) -> Conversation:
        self.parts.append(Part("text", text=text))
        return self

    def chat_parts(self) -> list[dict]:
        """OpenAI content parts: ``image_url`` / ``video_url`` (the URL, else a ``data:`` URL) and ``text``."""
        out: list[dict] = []
        for p in self.parts:
            if p.kind == "text":
                out.append({"type": "text", "text": p.text})
                continue
            url = p.url or f"data:{p.mime};base64," + base64.b64encode(p.data).decode()
            key = f"{p.kind}_url"
            out.append({"type": key, key: {"url": url}})
        return out


@cache
def processor(bundle: Path) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(bundle)


def reference_inputs(bundle: Path, conversation: Conversation) -> dict[str, np.ndarray]:
    """The processor's output for ``conversation`` (``input_ids`` ``[1, seq]`` and every tensor), as numpy.

    Keys are the processor's: ``input_ids``, ``attention_mask``, ``mm_token_type_ids``,
    ``pixel_values`` + ``image_grid_thw`` (images), ``pixel_values_videos`` +
    ``video_grid_thw`` (videos; ``second_per_grid_ts`` for Qwen2.5-VL).
    """
    from transformers.video_utils import load_video

    proc = processor(bundle)
    content: list[dict] = []
    images, videos, metadata = [], [], []
    for p in conversation.parts:
        if p.kind == "text":
            content.append({"type": "text", "text": p.text})
        elif p.kind == "image":
            content.append({"type": "image"})
            images.append(Image.open(io.BytesIO(p.data)))
        else:
            assert p.path is not None
            content.append({"type": "video"})
            frames, meta = load_video(str(p.path), backend="pyav")
            videos.append(frames)
            metadata.append(copy.deepcopy(meta))
    prompt = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                      tokenize=False)
    kwargs: dict[str, Any] = {}
    if images:
        kwargs["images"] = images
    if videos:
        # ``cap_pixels_per_frame`` is unset in every bundle: the reference warns and reads it as off.  Frames
        # as the workers' default --video-frame-sampling vllm takes them (Qwen2/2.5-VL: 2 fps).
        kwargs.update(videos=videos, video_metadata=metadata,
                      videos_kwargs={"cap_pixels_per_frame": False, **vllm_sampling_kwargs(proc)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = proc(text=[prompt], return_tensors="pt", **kwargs)
    return {key: value.numpy() for key, value in out.items()}


def assert_same_model_inputs(record: Any, reference: dict[str, np.ndarray], where: str) -> None:
    """``record`` (an engine ``--record-dir`` file) holds exactly the reference's ids and tensors.

    Every key the model receives is one the processor returns (``attention_mask`` aside: the
    engine builds it), with the same dtype, shape and bytes (max abs diff 0).
    """
    expected = {k: v for k, v in reference.items() if k != "attention_mask"}
    assert set(record.files) == set(expected), (where, sorted(record.files), sorted(expected))
    for key, want in expected.items():
        got = record[key]
        assert (got.dtype, got.shape) == (want.dtype, want.shape), (where, key, got.dtype, got.shape, want.dtype,
                                                                     want.shape)
        if got.tobytes() != want.tobytes():
            diff = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
            raise AssertionError(f"{where}: {key} differs from the transformers processor (max abs diff {diff})")
