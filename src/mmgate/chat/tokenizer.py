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
with ``bos_token``.  A request's ``add_special_tokens`` (vLLM's chat request
field) overrides that rule: ``tokenizer.encode(prompt, add_special_tokens=...)``
as vLLM's renderer calls it (:meth:`BundleTokenizer.adds_special_tokens`).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenizers import AddedToken, Encoding, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
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


def _add_extra_special_tokens(tok: Tokenizer, tokenizer_config: dict[str, Any]) -> None:
    """Add the ``extra_special_tokens`` the tokenizer does not have yet, as transformers 5.24 does at
    load (``PreTrainedTokenizerBase.__init__`` -> ``add_special_tokens``: special, not normalized; in
    the order the config lists them).  InternVL3's ``<video>`` (id 151674) exists only this way."""
    extra = tokenizer_config.get("extra_special_tokens") or {}
    values = list(extra.values()) if isinstance(extra, dict) else list(extra) if isinstance(extra, list) else []
    vocab = tok.get_vocab(with_added_tokens=True)
    for value in values:
        content = value.get("content") if isinstance(value, dict) else value
        if isinstance(content, str) and content not in vocab:
            tok.add_special_tokens([AddedToken(content, normalized=False, special=True)])
            vocab[content] = -1


@dataclass(frozen=True, slots=True)
class BundleTokenizer:
    """A loaded tokenizer plus the special-token strings templates see."""

    tokenizer: Tokenizer
    special_tokens: dict[str, str]  # bos_token, eos_token, ... (transformers ``special_tokens_map``)
    #: the most input characters one token can cover (longest vocabulary entry, byte-level entries
    #: counted in bytes): ``len(text) / max_token_chars`` is a lower bound on the tokens of ``text``
    #: before normalization
    max_token_chars: int = 1
    #: a copy of ``tokenizer`` with special-token matching off, made on first use (typed reserved strings)
    _plain: list[Tokenizer] = field(default_factory=list)
    _plain_lock: threading.Lock = field(default_factory=threading.Lock)
    #: the added-token splitter, made on first use (:meth:`_added_token_splitter`)
    _splitter: list[re.Pattern[str] | None] = field(default_factory=list)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    def token_id(self, token: str) -> int | None:
        """Id of a (usually added) token string, or None."""
        return self.tokenizer.token_to_id(token)

    def special_added_tokens(self) -> list[str]:
        """The contents of every added token marked ``special`` (control, media and other reserved tokens)."""
        return [t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special]

    def adds_special_tokens(self, prompt: str, add_special_tokens: bool | None = None) -> bool:
        """Whether the tokenizer's post-processor (BOS/EOS) runs on ``prompt``: ``add_special_tokens``
        when given (the request field, vLLM's meaning), else the reference's rule: unless ``prompt``
        already starts with ``bos_token`` (transformers 5.24 ``ProcessorMixin.apply_chat_template``
        with ``tokenize=True``)."""
        if add_special_tokens is not None:
            return add_special_tokens
        return not (self.bos_token is not None and prompt.startswith(self.bos_token))

    def encode_prompt(self, prompt: str, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of a rendered chat prompt, as the processor computes them (special tokens as
        :meth:`adds_special_tokens` says)."""
        return _encode(self.tokenizer, prompt, self.adds_special_tokens(prompt, add_special_tokens))

    def encode_segments(self, segments: Sequence[tuple[str, bool]], reserved_ids: frozenset[int],
                        add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of a prompt given as ``(text, typed)`` pieces (:meth:`Sanitized.segments
        <mmgate.chat.integrity.Sanitized.segments>`): template pieces as :meth:`encode_prompt`,
        typed pieces as plain text (special-token matching off).  One template piece is exactly
        :meth:`encode_prompt`.

        Typed text is tokenized *together with its neighbours*: the prompt is cut only where the
        template itself holds an added token (the tokenizer splits there too), and each stretch
        between two such tokens that holds typed text is tokenized whole with the plain tokenizer,
        as if the caller had typed all of it (template text there holds no added token, so it
        tokenizes the same either way).  Tokenizing the pieces one by one would differ wherever
        the tokenizer joins or prefixes across a cut (SentencePiece tokenizers prepend ``▁`` to
        every piece they are given: LLaVA's Llama and Mistral tokenizers).  BOS/EOS are added
        once, around the whole, as :meth:`adds_special_tokens` says: by default unless the prompt
        starts with ``bos_token``; ``add_special_tokens`` (the request field) true: always, false: never.

        Raises:
            GatewayError(RESERVED_TOKEN_IN_TEXT): a typed stretch still tokenizes to an id in
                ``reserved_ids`` (a reserved token that is not a special added token).
        """
        if len(segments) == 1 and not segments[0][1]:
            return self.encode_prompt(segments[0][0], add_special_tokens)
        plain = self._plain_tokenizer()
        pieces: list[Encoding] = []
        stretch: list[str] = []
        typed_in_stretch = False

        def flush() -> None:
            nonlocal typed_in_stretch
            if not stretch:
                return
            text = "".join(stretch)
            encoding = (plain if typed_in_stretch else self.tokenizer).encode_batch([text], add_special_tokens=False)[0]
            if typed_in_stretch and reserved_ids.intersection(encoding.ids):
                raise GatewayError(ErrorCode.RESERVED_TOKEN_IN_TEXT,
                                   "text contains one of the model's reserved tokens in a form that cannot be sent "
                                   "as plain text", "messages")
            pieces.append(encoding)
            stretch.clear()
            typed_in_stretch = False

        splitter = self._added_token_splitter()
        for text, typed in segments:
            if typed:
                stretch.append(text)
                typed_in_stretch = True
                continue
            matches = list(splitter.finditer(text)) if splitter is not None else []
            if not matches:
                stretch.append(text)
                continue
            # Head (up to the first added token) joins the open stretch; the part from the first
            # to the last added token is tokenized whole, as before; the tail opens a new stretch.
            first, last = matches[0].start(), matches[-1].end()
            if first:
                stretch.append(text[:first])
            flush()
            pieces.append(self.tokenizer.encode_batch([text[first:last]], add_special_tokens=False)[0])
            if last < len(text):
                stretch.append(text[last:])
        flush()
        merged = Encoding.merge(pieces, growing_offsets=True)
        if self.adds_special_tokens(segments[0][0] if segments else "", add_special_tokens):
            merged = self.tokenizer.post_process(merged, add_special_tokens=True)  # BOS/EOS once, around the whole
        return list(merged.ids)

    def _added_token_splitter(self) -> re.Pattern[str] | None:
        """A pattern matching every added token's content (longest first), where the tokenizer splits
        a text before anything else; None when there are none."""
        with self._plain_lock:
            if not self._splitter:
                contents = sorted({t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.content},
                                  key=len, reverse=True)
                self._splitter.append(re.compile("|".join(re.escape(c) for c in contents)) if contents else None)
            return self._splitter[0]

    def exceeds(self, text: str, limit: int, chunk_chars: int = 1 << 20) -> bool:
        """Whether ``text`` certainly tokenizes to more than ``limit`` tokens, found without holding the
        whole text's encoding: pieces of ``chunk_chars`` characters (cut after a whitespace run) are
        tokenized with the GIL released and counted, stopping as soon as the count, less
        ``_CHUNK_SLACK`` tokens per cut for what a cut can add, passes ``limit``.  Memory stays that of
        one piece; a text far over the limit is refused after its first few pieces.
        """
        count, cuts, start = 0, 0, 0
        while start < len(text):
            end = min(len(text), start + chunk_chars)
            if end < len(text):
                space = text.rfind(" ", start + chunk_chars // 2, end)
                end = space + 1 if space > 0 else end
                cuts += 1
            count += len(self.tokenizer.encode_batch([text[start:end]], add_special_tokens=False)[0].ids)
            if count - cuts * _CHUNK_SLACK > limit:
                return True
            start = end
        return False


    def _plain_tokenizer(self) -> Tokenizer:
        with self._plain_lock:
            if not self._plain:
                plain = Tokenizer.from_str(self.tokenizer.to_str())
                plain.encode_special_tokens = True
                self._plain.append(plain)
            return self._plain[0]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))


#: tokens a cut through a text can add to the count of its two sides (:meth:`BundleTokenizer.exceeds`):
#: only the pre-tokens around the cut are tokenized differently
_CHUNK_SLACK = 16

#: texts longer than this are encoded with the GIL released (``encode_batch``): a long prompt tokenized
#: in the pool must not stall the event loop (``encode`` holds the GIL: 5 s for a 4 MB prompt)
_GIL_FREE_CHARS = 16 * 1024


def _encode(tok: Tokenizer, text: str, add_special: bool) -> list[int]:
    """``tok.encode(text).ids``; long texts through ``encode_batch``, which releases the GIL (same ids)."""
    if len(text) <= _GIL_FREE_CHARS:
        return list(tok.encode(text, add_special_tokens=add_special).ids)
    return list(tok.encode_batch([text], add_special_tokens=add_special)[0].ids)


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
    _add_extra_special_tokens(tok, bundle.tokenizer_config)
    special: dict[str, str] = {}
    for key in _SPECIAL_KEYS:
        text = _token_text(bundle.tokenizer_config.get(key))
        if text is not None:
            special[key] = text
    longest = max((len(t) for t in tok.get_vocab(with_added_tokens=True)), default=1)
    return BundleTokenizer(tokenizer=tok, special_tokens=special, max_token_chars=max(1, longest))
