"""Grammar-constrained decoding for the reference engine, with xgrammar.

Stage: engine model thread.  In: the request's :class:`~mmgate.types.Constraint`
(read from the wire's ``SamplingParams.constraint`` oneof by :func:`read_constraint`),
compiled before the request reaches the model thread, in a child process, by
:mod:`.constraint_pool` (the compile itself: :mod:`.constraint_worker`); out: a
:class:`GrammarGuide` that masks the ``[1, vocab]`` float32 logits of each step to the
tokens the grammar allows, and is told each chosen token.

The compile mirrors vLLM's xgrammar backend, with two deliberate differences
(``json_object`` is an object, JSON without free whitespace): :mod:`.constraint_worker`.

The tokenizer information (the real vocabulary, padded to the model's ``vocab_size``)
is built once per engine (:mod:`.constraint_pool`).  Invalid constraints raise ``GatewayError(INVALID_REQUEST)``
(the servicer answers ``INVALID_ARGUMENT``); one too costly to compile (past the
deadline, over the memory cap, crashing the compiler) ``GatewayError(CONSTRAINT_TOO_COMPLEX)``
(:mod:`.constraint_pool`).
"""

from __future__ import annotations

import json

import torch
import xgrammar as xgr
from smg_grpc_proto.generated import vllm_engine_pb2

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


def grammar_guide(grammar: xgr.CompiledGrammar | None, stop_token_ids: tuple[int, ...],
                  vocab_size: int) -> GrammarGuide | None:
    """A fresh guide over ``grammar`` (compiled by :mod:`.constraint_pool`); ``None`` without one."""
    return GrammarGuide(grammar, stop_token_ids, vocab_size) if grammar is not None else None
