"""Sampling parameters -> a generation plan for ``model.generate``.

Stage: engine request intake.  In: the proto ``SamplingParams``, the model's
facts, the prompt length, the engine's ``--max-tokens-default``; out: a frozen
:class:`GenerationPlan`, which :mod:`.sampler` applies token by token.

Field reading mirrors ``smg_grpc_servicer/vllm/servicer.py``
``_sampling_params_from_proto`` (smg-grpc-servicer 0.14.1): ``top_p`` 0 means
1.0, ``top_k`` 0 means off, ``repetition_penalty`` 0 means 1.0,
``n`` 0 means 1.  One deliberate difference: an unset ``temperature`` means
greedy here (vLLM: 1.0), so the reference engine is deterministic unless a
request asks for sampling.

Stopping: the model's stop ids (config eos, then generation_config extras)
unless ``ignore_eos``, plus ``stop_token_ids`` always (vLLM keeps those under
``ignore_eos`` too), plus ``stop`` strings.  Token choice, penalties, ``logit_bias``,
``min_tokens`` and logprobs follow vLLM's V1 sampler (:mod:`.sampler`); ``n``
choices are decoded one after another, choice ``i`` seeded with ``seed + i``
(vLLM ``vllm/v1/engine/parallel_sampling.py`` ``ParentRequest._get_child_sampling_params``).
``prompt_logprobs`` and ``truncate_prompt_tokens`` are refused rather than ignored
(the gateway never sends them).  Structured output (the
``constraint`` oneof) is carried in the plan and applied by :mod:`.constraints`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from smg_grpc_proto.generated import vllm_engine_pb2

from mmgate.errors import ErrorCode, GatewayError
from mmgate.refengine.bundle import ModelFacts
from mmgate.refengine.constraints import read_constraint
from mmgate.types import Constraint


@dataclass(frozen=True, slots=True)
class GenerationPlan:
    """How one request is decoded (batch size 1; ``n`` choices one after another, see :meth:`for_choice`)."""

    max_new_tokens: int
    min_new_tokens: int
    do_sample: bool  # False: greedy argmax
    temperature: float  # used only when do_sample
    top_p: float  # 1.0 = off
    top_k: int  # 0 = off
    min_p: float  # 0.0 = off
    repetition_penalty: float  # 1.0 = off
    seed: int | None  # seeds this request's own torch.Generator, when set
    stop_token_ids: tuple[int, ...]  # generation ends after emitting one of these
    stop_strings: tuple[str, ...]  # generation ends once the decoded completion contains one
    constraint: Constraint | None = None  # structured output, applied by refengine.constraints
    # H-C1: vLLM's other sampling fields (refengine.sampler applies them)
    n: int = 1  # choices, decoded one after another
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    logprobs: int | None = None  # None: none; k: the sampled token's and the top k per position
    include_stop_str_in_output: bool = False  # a matched stop string is left in the text (gateway side)

    def for_choice(self, index: int) -> GenerationPlan:
        """The plan of choice ``index`` of ``n``: seeded ``seed + index`` when seeded (vLLM
        ``ParentRequest._get_child_sampling_params``, ``vllm/v1/engine/parallel_sampling.py``)."""
        return replace(self, n=1, seed=self.seed + index if self.seed is not None else None)


def _refuse_unsupported(params: vllm_engine_pb2.SamplingParams) -> None:
    def refuse(what: str) -> GatewayError:
        return GatewayError(ErrorCode.INVALID_REQUEST, f"{what} is not supported by the reference engine")

    if params.HasField("prompt_logprobs"):
        raise refuse("prompt_logprobs")
    if params.HasField("truncate_prompt_tokens"):
        raise refuse("truncate_prompt_tokens")


def plan_generation(
    params: vllm_engine_pb2.SamplingParams,
    facts: ModelFacts,
    prompt_len: int,
    max_tokens_default: int,
) -> GenerationPlan:
    """Read ``params`` into a :class:`GenerationPlan`.

    ``max_new_tokens`` is ``max_tokens`` (else ``max_tokens_default``), clamped
    to the room left in the context window.

    Raises:
        GatewayError(INVALID_REQUEST): an unsupported feature or an out-of-range value.
        GatewayError(CONTEXT_LENGTH_EXCEEDED): the prompt fills the context window.
    """
    _refuse_unsupported(params)
    room = facts.max_context_length - prompt_len if facts.max_context_length else None
    if room is not None and room < 1:
        raise GatewayError(
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            f"prompt has {prompt_len} tokens; the model's context is {facts.max_context_length}",
        )
    requested = params.max_tokens if params.HasField("max_tokens") else max_tokens_default
    if requested < 1:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "max_tokens must be at least 1")
    max_new = min(requested, room) if room is not None else requested
    temperature = params.temperature if params.HasField("temperature") else 0.0
    if temperature < 0:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "temperature must be >= 0")
    top_p = params.top_p if params.top_p != 0.0 else 1.0
    if not 0.0 < top_p <= 1.0:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "top_p must be in (0, 1]")
    if not 0.0 <= params.min_p <= 1.0:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "min_p must be in [0, 1]")
    repetition_penalty = params.repetition_penalty if params.repetition_penalty != 0.0 else 1.0
    if repetition_penalty < 0:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "repetition_penalty must be > 0")
    stop_ids = [] if params.ignore_eos else list(facts.stop_token_ids)
    stop_ids += [t for t in params.stop_token_ids if t not in stop_ids]
    return GenerationPlan(
        max_new_tokens=max_new,
        min_new_tokens=min(params.min_tokens, max_new),
        do_sample=temperature > 0.0,
        temperature=temperature,
        top_p=top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=repetition_penalty,
        seed=params.seed if params.HasField("seed") else None,
        stop_token_ids=tuple(stop_ids),
        stop_strings=tuple(s for s in params.stop if s),
        constraint=read_constraint(params),
        **_vllm_extras(params, facts),
    )


#: most choices one request may ask of the reference engine (it decodes them one after another)
MAX_CHOICES = 128


def _vllm_extras(params: vllm_engine_pb2.SamplingParams, facts: ModelFacts) -> dict[str, Any]:
    """The plan fields of ``n``, the penalties, ``logit_bias`` and logprobs, checked as vLLM checks them.

    vLLM ``SamplingParams._verify_args`` (v0.11): penalties in [-2, 2], ``n`` >= 1;
    ``vllm/v1/engine/processor.py`` ``_validate_logit_bias``: token ids inside the vocabulary;
    ``logprobs`` -1 means the whole vocabulary.

    Raises:
        GatewayError(INVALID_REQUEST): a value outside those ranges.
    """
    n = params.n if params.n > 0 else 1
    if n > MAX_CHOICES:
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"n must be at most {MAX_CHOICES}")
    for name in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= getattr(params, name) <= 2.0:
            raise GatewayError(ErrorCode.INVALID_REQUEST, f"{name} must be in [-2, 2]")
    if any(not 0 <= t < facts.vocab_size for t in params.logit_bias):
        raise GatewayError(ErrorCode.INVALID_REQUEST, "logit_bias has token ids outside the vocabulary")
    logprobs = None
    if params.HasField("logprobs"):
        if params.logprobs < -1:
            raise GatewayError(ErrorCode.INVALID_REQUEST, "logprobs must be -1 (all) or >= 0")
        logprobs = facts.vocab_size if params.logprobs == -1 else min(params.logprobs, facts.vocab_size)
    return {"n": n, "frequency_penalty": params.frequency_penalty, "presence_penalty": params.presence_penalty,
            "logit_bias": tuple(sorted(params.logit_bias.items())), "logprobs": logprobs,
            "include_stop_str_in_output": params.include_stop_str_in_output}
