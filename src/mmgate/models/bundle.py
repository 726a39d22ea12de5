"""Model bundles: the files of a model that mmgate reads (never weights).

A bundle is a folder holding ``config.json``, ``preprocessor_config.json``,
optional ``video_preprocessor_config.json`` / ``processor_config.json``,
``tokenizer.json`` or ``vocab.json`` + ``merges.txt``, ``tokenizer_config.json``
and the chat template (``chat_template.json`` or ``chat_template.jinja``, else
the ``chat_template`` key of ``tokenizer_config.json``).

``resolve_bundle(name, search_path)`` finds it: an existing folder; else
``<org>--<name>`` (or ``<org>/<name>``) under each search-path folder; else the
Hugging Face hub through ``huggingface_hub.snapshot_download`` (config,
tokenizer and processor files only), which fails cleanly when offline.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmgate.errors import ErrorCode, GatewayError

_HUB_PATTERNS = [
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
]


@dataclass(frozen=True, slots=True)
class ModelBundle:
    """The parsed files of one model bundle (JSON objects as read)."""

    path: Path
    name: str  # ``org/name`` when known, else the folder name
    config: dict[str, Any]
    preprocessor_config: dict[str, Any]
    video_preprocessor_config: dict[str, Any]
    processor_config: dict[str, Any]
    tokenizer_config: dict[str, Any]
    generation_config: dict[str, Any]
    chat_template: str | None

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as fh:
        data = json.load(fh)
    return data if isinstance(data, dict) else {}


def _read_chat_template(folder: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """The template as transformers 5.24 picks it (``processing_utils`` / ``tokenization_utils_base``):
    ``chat_template.jinja`` first, then ``chat_template.json``, then ``tokenizer_config.json``."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    data = _read_json(folder / "chat_template.json")
    if isinstance(data.get("chat_template"), str):
        return str(data["chat_template"])
    tmpl = tokenizer_config.get("chat_template")
    if isinstance(tmpl, str):
        return tmpl
    if isinstance(tmpl, list):  # named templates: take "default"
        for entry in tmpl:
            if isinstance(entry, dict) and entry.get("name") == "default":
                return str(entry.get("template"))
    return None


def load_bundle(folder: Path, name: str | None = None) -> ModelBundle:
    """Read a bundle folder.

    Raises:
        GatewayError(MODEL_NOT_FOUND): no ``config.json`` in ``folder``.
    """
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise GatewayError(ErrorCode.MODEL_NOT_FOUND, f"no config.json in model folder {folder.name!r}")
    tokenizer_config = _read_json(folder / "tokenizer_config.json")
    return ModelBundle(
        path=folder,
        name=name or folder.name.replace("--", "/", 1),
        config=_read_json(folder / "config.json"),
        preprocessor_config=_read_json(folder / "preprocessor_config.json"),
        video_preprocessor_config=_read_json(folder / "video_preprocessor_config.json"),
        processor_config=_read_json(folder / "processor_config.json"),
        tokenizer_config=tokenizer_config,
        generation_config=_read_json(folder / "generation_config.json"),
        chat_template=_read_chat_template(folder, tokenizer_config),
    )


def resolve_bundle(model: str, search_path: Sequence[Path], allow_hub: bool = True) -> ModelBundle:
    """Find and load the bundle for ``model``.

    Args:
        model: a folder path, or a hub id ``org/name``.
        search_path: folders holding ``org--name`` (or ``org/name``) bundles.
        allow_hub: fall back to ``huggingface_hub.snapshot_download``.

    Raises:
        GatewayError(MODEL_NOT_FOUND): nowhere to be found.
    """
    direct = Path(model).expanduser()
    if direct.is_dir():
        return load_bundle(direct)
    for root in search_path:
        for candidate in (root / model.replace("/", "--"), root / model):
            if (candidate / "config.json").is_file():
                return load_bundle(candidate, name=model)
    if allow_hub and "/" in model and not model.startswith(("/", ".")):
        try:
            from huggingface_hub import snapshot_download

            local = snapshot_download(repo_id=model, allow_patterns=_HUB_PATTERNS)
        except Exception as exc:  # offline, gated, unknown repo: all mean "not found here"
            raise GatewayError(
                ErrorCode.MODEL_NOT_FOUND, f"model {model!r} not found locally and not fetchable from the hub ({type(exc).__name__})"
            ) from None
        return load_bundle(Path(local), name=model)
    raise GatewayError(ErrorCode.MODEL_NOT_FOUND, f"model {model!r} not found on the model search path")
