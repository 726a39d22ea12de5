"""Tokenizer loading and encoding with the ``tokenizers`` library.

Stage: tokenize.  In: a bundle; out: a :class:`BundleTokenizer` that encodes a
rendered prompt exactly as the transformers processor does.

Loading mirrors transformers 5.24: ``tokenizer.json`` when present
(``TokenizersBackend``); otherwise, for the Qwen2 tokenizer classes, the BPE
built from ``vocab.json`` + ``merges.txt`` as
``models/qwen2/tokenization_qwen2.py`` ``Qwen2Tokenizer.__init__`` builds it,
then the ``added_tokens_decoder`` of ``tokenizer_config.json``.
Encoding mirrors ``ProcessorMixin.apply_chat_template`` followed by the
processor call: special tokens are added unless the prompt already starts
with ``bos_token``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from mmgate.errors import ErrorCode, GatewayError
from mmgate.models.bundle import ModelBundle

# transformers 5.24 models/qwen2/tokenization_qwen2.py PRETOKENIZE_REGEX
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _build_qwen2_bpe(bundle: ModelBundle) -> Tokenizer:
    vocab_path = bundle.path / "vocab.json"
    merges_path = bundle.path / "merges.txt"
    with vocab_path.open(encoding="utf-8") as fh:
        vocab = json.load(fh)
    merges: list[tuple[str, str]] = []
    with merges_path.open(encoding="utf-8") as fh:
        for line in fh:
            line = line.rstrip("\n")
            if not line or line.startswith("#version"):
                continue
            a, b = line.split(" ", 1)
            merges.append((a, b))
    tok = Tokenizer(
        BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, continuing_subword_prefix="",
            end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
    )
    tok.decoder = decoders.ByteLevel()
    tok.normalizer = normalizers.NFC()
    add_prefix_space = bool(bundle.tokenizer_config.get("add_prefix_space") or False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
    ])
    return tok


def _add_config_tokens(tok: Tokenizer, tokenizer_config: dict[str, Any]) -> None:
    """Add the ``added_tokens_decoder`` entries the tokenizer does not have yet, in id order."""
    decoder = tokenizer_config.get("added_tokens_decoder") or {}
    present = {t.content for t in tok.get_added_tokens_decoder().values()}
    for _, spec in sorted(((int(k), v) for k, v in decoder.items()), key=lambda kv: kv[0]):
        content = spec.get("content")
        if not isinstance(content, str) or content in present:
            continue
        is_special = bool(spec.get("special", False))
        added = AddedToken(
            content,
            single_word=bool(spec.get("single_word", False)),
            lstrip=bool(spec.get("lstrip", False)),
            rstrip=bool(spec.get("rstrip", False)),
            normalized=bool(spec.get("normalized", not is_special)),
            special=is_special,
        )
        if is_special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])


@dataclass(frozen=True, slots=True)
class BundleTokenizer:
    """A loaded tokenizer plus the special-token strings templates see."""

    tokenizer: Tokenizer
    special_tokens: dict[str, str]  # bos_token, eos_token, ... (transformers ``special_tokens_map``)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    def token_id(self, token: str) -> int | None:
        """Id of a (usually added) token string, or None."""
        return self.tokenizer.token_to_id(token)

    def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids of a rendered chat prompt, as the processor computes them."""
        add_special = not (self.bos_token is not None and prompt.startswith(self.bos_token))
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))


def load_tokenizer(bundle: ModelBundle) -> BundleTokenizer:
    """Load the bundle's tokenizer.

    Raises:
        GatewayError(MODEL_NOT_FOUND): no usable tokenizer files.
    """
    tokenizer_json = bundle.path / "tokenizer.json"
    if tokenizer_json.is_file():
        tok = Tokenizer.from_file(str(tokenizer_json))
    elif (bundle.path / "vocab.json").is_file() and (bundle.path / "merges.txt").is_file():
        cls = str(bundle.tokenizer_config.get("tokenizer_class", ""))
        if not cls.startswith("Qwen2Tokenizer"):
            raise GatewayError(ErrorCode.MODEL_NOT_FOUND, f"tokenizer class {cls!r} without tokenizer.json is not supported")
        tok = _build_qwen2_bpe(bundle)
    else:
        raise GatewayError(ErrorCode.MODEL_NOT_FOUND, f"no tokenizer files in bundle {bundle.name!r}")
    _add_config_tokens(tok, bundle.tokenizer_config)
    special: dict[str, str] = {}
    for key in _SPECIAL_KEYS:
        text = _token_text(bundle.tokenizer_config.get(key))
        if text is not None:
            special[key] = text
    return BundleTokenizer(tokenizer=tok, special_tokens=special)
