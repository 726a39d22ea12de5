"""The codec core (:mod:`mmgate.engines.codec`, :mod:`mmgate.engines.wire_values`): the pieces the
three wires share, and each named per-wire parameter as the servicer it cites reads it."""

from __future__ import annotations

import json

import pytest
import xgrammar
import xgrammar.testing
from smg_grpc_proto.generated import sglang_scheduler_pb2, vllm_engine_pb2

from mmgate.engines import sglang, tokenspeed
from mmgate.engines.codec import SGLANG_PIXEL_TAGS, VLLM_PIXEL_TAGS, record_prefix, varint
from mmgate.engines.wire_values import check_range, choice_grammar, embedding_runs
from mmgate.errors import ErrorCode, GatewayError
from mmgate.types import Constraint, ConstraintKind, PlaceholderRange, SamplingParams

CHOICES = ["plain", 'say "hi"', "back\\slash", "two\nlines", "a\nb", "tab\there", "0\r1", "bell\x07", "caf\u00e9"]


def accepts(grammar: str, text: str) -> bool:
    return xgrammar.testing._is_grammar_accept_string(xgrammar.Grammar.from_ebnf(grammar), text)


def test_varint_is_base_128_little_endian() -> None:
    assert (varint(0), varint(127), varint(128), varint(300)) == (b"\x00", b"\x7f", b"\x80\x01", b"\xac\x02")


@pytest.mark.parametrize(("tags", "message"), [(VLLM_PIXEL_TAGS, vllm_engine_pb2.GenerateRequest),
                                               (SGLANG_PIXEL_TAGS, sglang_scheduler_pb2.GenerateRequest)])
def test_record_prefix_then_payload_parses_as_the_encoder_inputs_bytes(tags: tuple[bytes, ...], message) -> None:
    payload = bytes(range(200))  # 200 bytes: a two-byte varint inside
    parsed = message.FromString(record_prefix(tags, len(payload)) + payload)
    pixels = parsed.mm_inputs.pixel_values
    assert (pixels.inline if message is vllm_engine_pb2.GenerateRequest else pixels.data) == payload


def test_choice_grammar_is_read_by_xgrammar_as_exactly_the_choices() -> None:
    """Both servicers hand ``ebnf_grammar`` to the engine's xgrammar unchanged (``sglang/servicer.py``
    ``_convert_sampling_params``, ``tokenspeed/servicer.py`` ``_sampling_params_from_proto``)."""
    grammar = choice_grammar(CHOICES)
    for choice in CHOICES:
        assert accepts(grammar, choice), choice
    for other in ("a\\nb", "two", "say hi", "cafe", "a\xabb"):
        assert not accepts(grammar, other), other


def test_the_old_tokenspeed_hex_escape_misread_a_line_break_before_a_hex_digit() -> None:
    """Why TokenSpeed's choice bytes changed (tests/engines/test_wire_goldens.py ``CHANGED``): 05281ae
    wrote control characters as ``\\xHH``, which xgrammar reads greedily, so ``"a\\x0ab"`` is a, U+0AB."""
    old = 'root ::= "a\\x0ab"'
    assert not accepts(old, "a\nb") and accepts(old, "a\xab")
    assert accepts(choice_grammar(["a\nb"]), "a\nb")


def test_both_wires_send_the_one_choice_grammar() -> None:
    sampling = SamplingParams(constraint=Constraint(ConstraintKind.CHOICE, json.dumps(CHOICES)))
    assert sglang.sampling_message(sampling).ebnf_grammar == tokenspeed.sampling_message(sampling).ebnf_grammar \
        == choice_grammar(CHOICES)


def test_a_range_without_placeholder_tokens_is_a_bug_on_sglang_and_sent_whole_on_tokenspeed() -> None:
    ids = [1, 8, 5, 5, 9, 8, 5, 9]
    empty = PlaceholderRange(0, 2)
    with pytest.raises(GatewayError) as err:
        embedding_runs(ids, 5, (empty,), whole_span_when_empty=sglang.SPAN_WHEN_NO_RUN)
    assert err.value.code is ErrorCode.INTERNAL_ERROR
    assert embedding_runs(ids, 5, (empty,), whole_span_when_empty=tokenspeed.SPAN_WHEN_NO_RUN) == (empty,)


@pytest.mark.parametrize("span", [PlaceholderRange(-1, 2), PlaceholderRange(6, 3), PlaceholderRange(2, 0)])
def test_a_range_outside_the_prompt_is_a_bug_on_every_wire(span: PlaceholderRange) -> None:
    for whole in (False, True):
        with pytest.raises(GatewayError) as err:
            embedding_runs([1, 8, 5, 5, 9, 8, 5, 9], 5, (span,), whole_span_when_empty=whole)
        assert err.value.code is ErrorCode.INTERNAL_ERROR


def test_runs_split_a_clip_span_at_its_markers() -> None:
    ids = [9, 2, 5, 5, 3, 2, 5, 5, 3]  # S P P E S P P E
    assert embedding_runs(ids, 5, (PlaceholderRange(1, 8),), whole_span_when_empty=False) == (
        PlaceholderRange(2, 2), PlaceholderRange(6, 2))


def test_a_value_outside_its_wire_type_is_refused_by_name_with_the_wires_suffix() -> None:
    with pytest.raises(GatewayError) as err:
        check_range("top_k", 2**31, (0, 2**31 - 1), suffix=" on the SGLang wire")
    assert (err.value.code, err.value.param) == (ErrorCode.INVALID_REQUEST, "top_k")
    assert err.value.message == "top_k must be within [0, 2147483647] on the SGLang wire"
    check_range("seed", None, (0, 1))
