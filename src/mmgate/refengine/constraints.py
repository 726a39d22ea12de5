"""Grammar-constrained decoding for the reference engine, with xgrammar.

Stage: engine model thread.  In: the request's :class:`~mmgate.types.Constraint`
(read from the wire's ``SamplingParams.constraint`` oneof by
:func:`read_constraint`), the bundle's tokenizer and the model's vocabulary size;
out: a :class:`GrammarGuide` that masks the ``[1, vocab]`` float32 logits of each
step to the tokens the grammar allows, and is told each chosen token.

Mirrors vLLM's xgrammar backend (``vllm/v1/structured_output/backend_xgrammar.py``
``XgrammarBackend.compile_grammar``, v0.11): ``json`` -> ``compile_json_schema``,
``regex`` -> ``compile_regex``,
``grammar`` (EBNF / GBNF) -> ``compile_grammar``, ``choice`` -> an EBNF alternation
(``GrammarConfig.choice_as_grammar``, vLLM ``vllm/v1/structured_output/backend_xgrammar.py``),
``structural_tag`` -> ``compile_structural_tag`` (vLLM's ``{"structures", "triggers"}`` shape).
Two deliberate differences: ``json_object`` is the schema ``{"type": "object"}``
(vLLM compiles xgrammar's built-in JSON grammar, which also takes arrays and
scalars; OpenAI's ``json_object`` promises an object), and JSON schemas are compiled with ``any_whitespace=False``
(vLLM's ``--structured-outputs-config.disable_any_whitespace``), so a model with
random weights cannot fill its output with whitespace and a bounded schema ends
in a bounded number of tokens.

The tokenizer information (the real vocabulary, padded to the model's
``vocab_size``) is built once per tokenizer and kept with a compiler whose cache
holds compiled grammars.  Invalid constraints raise
``GatewayError(INVALID_REQUEST)`` (the servicer answers ``INVALID_ARGUMENT``).
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any

import torch
import xgrammar as xgr
from smg_grpc_proto.generated import vllm_engine_pb2

from mmgate.errors import ErrorCode, GatewayError
from mmgate.refengine.bundle import LazyTokenizer
from mmgate.types import Constraint, ConstraintKind


def read_constraint(params: vllm_engine_pb2.SamplingParams) -> Constraint | None:
    """The wire's ``SamplingParams.constraint`` oneof as a :class:`Constraint` (``None`` when unset)."""
    which = params.WhichOneof("constraint")
    if which is None:
        return None
    kind = ConstraintKind(which)
    if kind is ConstraintKind.JSON_OBJECT:
        return Constraint(kind, "") if params.json_object else None
    if kind is ConstraintKind.CHOICE:
        return Constraint(kind, json.dumps(list(params.choice.choices)))
    return Constraint(kind, str(getattr(params, which)))


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``.

    Mirrors vLLM ``GrammarConfig.choice_as_grammar`` (``escape_ebnf_string``:
    backslashes and double quotes escaped).  ``["a", "b\\"c"]`` -> ``root ::= "a" | "b\\"c"``.
    """
    def escape(text: str) -> str:
        return text.replace("\\", "\\\\").replace('"', '\\"')

    return "root ::= " + " | ".join(f'"{escape(c)}"' for c in choices)


class _Compilers:
    """One ``xgr.GrammarCompiler`` per tokenizer (built on first use; its cache keeps compiled grammars)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_tokenizer: weakref.WeakKeyDictionary[LazyTokenizer, tuple[int, xgr.GrammarCompiler]] = (
            weakref.WeakKeyDictionary())

    def get(self, tokenizer: LazyTokenizer, vocab_size: int) -> xgr.GrammarCompiler:
        with self._lock:
            held = self._by_tokenizer.get(tokenizer)
            if held is None or held[0] != vocab_size:
                info = xgr.TokenizerInfo.from_huggingface(tokenizer.get(), vocab_size=vocab_size)
                held = (vocab_size, xgr.GrammarCompiler(info, max_threads=1))
                self._by_tokenizer[tokenizer] = held
            return held[1]


_COMPILERS = _Compilers()


#: ``json_object``: any JSON object (``strict_mode=False``: any properties)
_ANY_OBJECT = '{"type": "object"}'


def _compile(compiler: xgr.GrammarCompiler, constraint: Constraint) -> xgr.CompiledGrammar:
    kind, value = constraint.kind, constraint.value
    if kind is ConstraintKind.JSON_SCHEMA:
        return compiler.compile_json_schema(value, any_whitespace=False)
    if kind is ConstraintKind.JSON_OBJECT:
        return compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=False, strict_mode=False)
    if kind is ConstraintKind.REGEX:
        return compiler.compile_regex(value)
    if kind is ConstraintKind.GRAMMAR:
        return compiler.compile_grammar(value)
    if kind is ConstraintKind.CHOICE:
        return compiler.compile_grammar(choice_grammar(json.loads(value)))
    tag: Any = json.loads(value)
    if not isinstance(tag, dict) or "structures" not in tag or "triggers" not in tag:
        raise ValueError("structural_tag must be an object with structures and triggers")
    items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
             for s in tag["structures"]]
    return compiler.compile_structural_tag(items, list(tag["triggers"]))


class GrammarGuide:
    """The grammar state of one generation: masks each step's logits, advances with each chosen token.

    Wraps ``xgr.GrammarMatcher``; the matcher's stop tokens are the plan's stop
    token ids (so the grammar's end is the model's own end of turn).
    """

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: tuple[int, ...], vocab_size: int) -> None:
        stops = list(stop_token_ids)
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None,
                                           terminate_without_stop_token=not stops)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._vocab_size = vocab_size

    def mask(self, logits: torch.Tensor) -> None:
        """Set, in place, every token the grammar does not allow next to ``-inf`` (``logits``: ``[1, vocab]`` float32)."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        xgr.apply_token_bitmask_inplace(logits, self._bitmask, vocab_size=min(self._vocab_size, logits.shape[-1]))

    def advance(self, token: int) -> None:
        """Feed the chosen token.

        Raises:
            RuntimeError: the grammar refuses it (cannot happen after :meth:`mask`).
        """
        if not self._matcher.accept_token(token):
            raise RuntimeError("the grammar refused the chosen token")

    @property
    def terminated(self) -> bool:
        """The grammar has been completed (its stop token accepted, or its end reached without stop tokens)."""
        return bool(self._matcher.is_terminated())


def grammar_guide(constraint: Constraint | None, tokenizer: LazyTokenizer, vocab_size: int,
                  stop_token_ids: tuple[int, ...]) -> GrammarGuide | None:
    """Compile ``constraint`` for this tokenizer and start its guide (``None`` without a constraint).

    Raises:
        GatewayError(INVALID_REQUEST): the library refuses the constraint (bad
            schema, regex or grammar; a structural tag not of vLLM's shape).
    """
    if constraint is None:
        return None
    compiler = _COMPILERS.get(tokenizer, vocab_size)
    try:
        compiled = _compile(compiler, constraint)
    except (RuntimeError, ValueError, TypeError, KeyError) as exc:
        raise GatewayError(ErrorCode.INVALID_REQUEST,
                           f"the {constraint.kind.value} constraint does not compile: {type(exc).__name__}") from None
    return GrammarGuide(compiled, stop_token_ids, vocab_size)
