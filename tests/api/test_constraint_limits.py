"""The gateway's bounds on structured-output and tool-choice constraints (issue 20, deliverables 1 and 3).

Through ``parse_chat_request`` (the parse every chat completion goes through), with the default
:class:`~mmgate.config.settings.ConstraintLimits` and with settings parsed from the ``--constraint-*``
flags.  Each limit is shown on both sides: a constraint exactly at the limit is accepted and reaches
the :class:`~mmgate.types.Constraint` the wire carries unchanged, one past it is a 400 naming the field
and the limit.  The sizes are written out as arithmetic here; the caller mistakes that used to raise
``RecursionError``, ``AttributeError`` or ``ValueError`` (500s) are 400s.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from mmgate.request.constraint_limits import regex_shape
from mmgate.request.parse import parse_chat_request
from mmgate.request.structured import request_constraint
from mmgate.errors import ErrorCode, GatewayError
from mmgate.config.settings import ConstraintLimits, parse_settings
from mmgate.types import Constraint, ConstraintKind

LIMITS = ConstraintLimits()


def _body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                       **fields}).encode()


def _constraint(limits: ConstraintLimits = LIMITS, **fields: Any) -> Constraint | None:
    req = parse_chat_request(_body(**fields), limits)
    return request_constraint(req)


def _refused(limits: ConstraintLimits = LIMITS, **fields: Any) -> GatewayError:
    return _refused_body(_body(**fields), limits)


def _refused_body(body: bytes, limits: ConstraintLimits = LIMITS) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        parse_chat_request(body, limits)
    assert info.value.code is ErrorCode.INVALID_REQUEST
    assert info.value.status == 400
    return info.value


def _nested_arrays(levels: int) -> dict[str, Any]:
    """``levels`` nested ``{"type": "array", "items": ...}`` around an integer: JSON depth levels + 1."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def _nested_arrays_text(levels: int) -> str:
    """The JSON text of ``_nested_arrays(levels)``, written without recursion: ``json.dumps`` of ~950 levels
    exceeds Python's recursion limit on a deeper stack (a pytest-xdist worker's)."""
    return '{"type": "array", "items": ' * levels + '{"type": "integer"}' + "}" * levels


def _body_with_nested_arrays(fields: Any, levels: int) -> bytes:
    """``_body(**fields(_nested_arrays(levels)))`` as bytes, the schema spliced in as text (see above)."""
    marker = {"mmgate_test_marker": 0}
    body = _body(**fields(marker)).decode()
    raw, quoted = json.dumps(marker), json.dumps(json.dumps(marker))[1:-1]
    text = _nested_arrays_text(levels)
    if quoted in body:  # a field that takes the schema as JSON text
        return body.replace(quoted, json.dumps(text)[1:-1]).encode()
    assert raw in body
    return body.replace(raw, text).encode()


def _nested_groups(groups: int) -> str:
    return "(" * groups + "a" + ")" * groups


def _schema_with_pattern(pattern: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "required": ["s"]}


def _rf(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _tool(name: str, parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# ---- the fields every schema arrives through -------------------------------------------------------

#: (request fields, param named in the refusal) for a schema ``s``; JSON text where vLLM takes it
SCHEMA_FIELDS = {
    "response_format": (lambda s: {"response_format": _rf(s)}, "response_format.json_schema.schema"),
    "guided_json_object": (lambda s: {"guided_json": s}, "guided_json"),
    "guided_json_text": (lambda s: {"guided_json": json.dumps(s)}, "guided_json"),
    "structured_outputs_json": (lambda s: {"structured_outputs": {"json": json.dumps(s)}}, "structured_outputs.json"),
    "tool_choice_named": (lambda s: {"tools": [_tool("f", s)],
                                     "tool_choice": {"type": "function", "function": {"name": "f"}}},
                          "tools[0].function.parameters"),
    "tool_choice_required": (lambda s: {"tools": [_tool("f", s)], "tool_choice": "required"},
                             "tools[0].function.parameters"),
}


@pytest.mark.parametrize("field", sorted(SCHEMA_FIELDS))
def test_a_schema_pattern_of_sixty_thousand_nested_groups_is_refused_in_every_field(field: str) -> None:
    fields, param = SCHEMA_FIELDS[field]
    err = _refused(**fields(_schema_with_pattern(_nested_groups(60_000))))
    assert err.param == param
    assert "nested groups" in err.message and "--constraint-max-regex-depth" in err.message
    assert "((" not in err.message  # the caller's value is never echoed


@pytest.mark.parametrize("field", sorted(SCHEMA_FIELDS))
def test_group_nesting_at_the_limit_reaches_the_wire_and_one_more_is_refused(field: str) -> None:
    fields, param = SCHEMA_FIELDS[field]
    at_limit = _nested_groups(LIMITS.max_regex_depth)
    constraint = _constraint(**fields(_schema_with_pattern(at_limit)))
    assert constraint is not None and constraint.kind is ConstraintKind.JSON_SCHEMA
    assert json.dumps(at_limit) in constraint.value  # the pattern is sent as given
    assert _refused(**fields(_schema_with_pattern(_nested_groups(LIMITS.max_regex_depth + 1)))).param == param


def test_schema_text_nested_past_the_depth_limit_is_refused_before_it_is_decoded() -> None:
    assert _nested_arrays_text(3) == json.dumps(_nested_arrays(3))  # the text is the schema the helper builds
    # 950 nested arrays (the issue's 66 s compile): JSON depth 951
    for field in ("guided_json_text", "structured_outputs_json"):
        fields, param = SCHEMA_FIELDS[field]
        err = _refused_body(_body_with_nested_arrays(fields, 950))
        assert err.param == param and "nested more than 64 levels" in err.message
    for field in ("response_format", "guided_json_object", "tool_choice_named", "tool_choice_required"):
        fields, _ = SCHEMA_FIELDS[field]  # objects inside the body: the body's own 64-level bound refuses them
        message = _refused_body(_body_with_nested_arrays(fields, 950)).message
        assert "request JSON is nested more than 64 levels" in message


def test_schema_depth_at_the_limit_is_accepted_and_one_more_level_is_refused() -> None:
    # guided_json as JSON text: 63 levels of arrays are 64 levels of JSON, 64 levels 65
    schema = _nested_arrays(63)
    constraint = _constraint(guided_json=json.dumps(schema))
    assert constraint is not None and json.loads(constraint.value) == schema
    assert _refused(guided_json=json.dumps(_nested_arrays(64))).param == "guided_json"
    shallow = ConstraintLimits(max_depth=9)  # 8 levels of arrays: 9 levels of JSON
    assert _constraint(shallow, guided_json=_nested_arrays(8)) is not None
    assert "--constraint-max-depth" in _refused(shallow, guided_json=_nested_arrays(9)).message


@pytest.mark.parametrize("text_field", [
    lambda v: {"guided_json": v},
    lambda v: {"structured_outputs": {"json": v}},
    lambda v: {"response_format": _rf(v)},
    lambda v: {"structured_outputs": {"structural_tag": v}},
])
def test_json_text_nested_five_thousand_deep_is_a_400_not_a_recursion_error(text_field: Any) -> None:
    err = _refused(**text_field("[" * 5000 + "]" * 5000))
    assert "nested more than" in err.message


def test_an_enum_of_a_hundred_thousand_values_is_refused_and_the_limit_itself_is_accepted() -> None:
    err = _refused(guided_json={"enum": [f"v{i}" for i in range(100_000)]})
    assert err.param == "guided_json" and "--constraint-max-values" in err.message
    constraint = _constraint(guided_json={"enum": list(range(LIMITS.max_values))})
    assert constraint is not None and json.loads(constraint.value)["enum"][-1] == LIMITS.max_values - 1
    # enum entries and const values add up across the schema: 1023 + 1 const + 1 more = 1025
    schema = {"anyOf": [{"enum": list(range(LIMITS.max_values - 1))}, {"const": 5}, {"const": 6}]}
    assert _refused(guided_json=schema).param == "guided_json"


@pytest.mark.parametrize(("count", "length", "ok"), [
    (256, 1024, False),  # the issue's 19 s compile: 262,144 characters > 131,072
    (1024, 10 * 1024, False),  # the issue's 8-minute, 2.9 GB compile
    (128, 1024, True),  # 131,072 characters: exactly the limit
    (1024, 1, True),  # 1024 choices: exactly the limit
    (1025, 1, False),
])
def test_choices_are_bounded_in_number_and_total_length(count: int, length: int, ok: bool) -> None:
    choices = [str(i % 10) * length for i in range(count)]
    for fields, param in (({"guided_choice": choices}, "guided_choice"),
                          ({"structured_outputs": {"choice": choices}}, "structured_outputs.choice")):
        if ok:
            constraint = _constraint(**fields)
            assert constraint is not None and json.loads(constraint.value) == choices
        else:
            assert _refused(**fields).param == param


def test_optional_properties_weigh_their_square() -> None:
    def obj(optional: int, required: int = 0) -> dict[str, Any]:
        names = [f"p{i}" for i in range(optional + required)]
        return {"type": "object", "properties": {n: {"type": "string"} for n in names}, "required": names[optional:]}

    assert _constraint(guided_json=obj(256)) is not None  # 256**2 = 65,536: the limit
    assert "--constraint-max-optional-weight" in _refused(guided_json=obj(257)).message  # 66,049
    assert _constraint(guided_json=obj(0, required=2000)) is not None  # required properties weigh nothing
    # four objects of 128 optional properties: 4 * 128**2 = 65,536; a fifth adds 16,384
    four = {"type": "object", "properties": {f"o{i}": obj(128) for i in range(4)},
            "required": [f"o{i}" for i in range(4)]}
    assert _constraint(guided_json=four) is not None
    five = {"type": "object", "properties": {f"o{i}": obj(128) for i in range(5)},
            "required": [f"o{i}" for i in range(5)]}
    assert _refused(guided_json=five).param == "guided_json"


def test_schema_node_count_is_bounded() -> None:
    limits = ConstraintLimits(max_schema_nodes=101)
    props = {f"p{i}": {"type": "integer"} for i in range(99)}
    schema = {"type": "object", "properties": props, "required": sorted(props)}  # 1 + 1 (properties) + 99 = 101
    assert _constraint(limits, guided_json=schema) is not None
    props["p99"] = {"type": "integer"}
    assert "--constraint-max-schema-nodes" in _refused(limits, guided_json=schema).message


def test_constraint_text_is_bounded_in_characters() -> None:
    limits = ConstraintLimits(max_chars=1000)
    base = json.dumps({"const": ""})  # '{"const": ""}': 13 characters around the string
    assert _constraint(limits, guided_json={"const": "x" * (1000 - len(base))}) is not None
    assert "--constraint-max-chars" in _refused(limits, guided_json={"const": "x" * (1001 - len(base))}).message
    assert _refused(limits, guided_grammar='root ::= "' + "a" * 1000 + '"').param == "guided_grammar"
    tag = json.dumps({"structures": [], "triggers": ["x" * 1000]})
    assert _refused(limits, structured_outputs={"structural_tag": tag}).param == "structured_outputs.structural_tag"


def test_counted_repetitions_are_bounded_by_the_atoms_they_add() -> None:
    # [a-z]{4097} adds 4096 atoms (the limit); ([a-z]{100}){100} adds 9,999 (the issue's 11 s pattern)
    assert _constraint(guided_json=_schema_with_pattern("[a-z]{4097}")) is not None
    err = _refused(guided_json=_schema_with_pattern("[a-z]{4098}"))
    assert "--constraint-max-regex-repeat" in err.message
    assert _refused(guided_json=_schema_with_pattern("([a-z]{100}){100}")).param == "guided_json"
    assert _refused(guided_regex="(ab|cd){2000}").param == "guided_regex"  # 4 atoms x 2000 - 4 = 7,996
    assert _refused(guided_grammar='root ::= ("ab" | [0-9]){5000}').param == "guided_grammar"
    constraint = _constraint(guided_regex=r"\d{3}-\d{4}")
    assert constraint == Constraint(ConstraintKind.REGEX, r"\d{3}-\d{4}")


def test_pattern_properties_keys_are_regexes_too() -> None:
    schema = {"type": "object", "patternProperties": {_nested_groups(100): {"type": "string"}}}
    assert _refused(guided_json=schema).param == "guided_json"


def test_regex_and_grammar_nesting_are_bounded() -> None:
    assert _refused(guided_regex=_nested_groups(65)).param == "guided_regex"
    assert _constraint(guided_regex=_nested_groups(64)) is not None
    grammar = "root ::= " + "(" * 65 + '"a"' + ")" * 65
    assert "--constraint-max-regex-depth" in _refused(guided_grammar=grammar).message
    # parentheses inside string literals, character classes and comments are not groups
    quoted = 'root ::= "' + "(" * 100 + '" [(]' + " # " + "(" * 100 + "\n"
    assert _constraint(guided_grammar=quoted) is not None


def test_a_structural_tag_schema_is_bounded_like_any_schema() -> None:
    tag = {"structures": [{"begin": "<f>", "schema": _schema_with_pattern(_nested_groups(1000)), "end": "</f>"}],
           "triggers": ["<f>"]}
    err = _refused(structured_outputs={"structural_tag": json.dumps(tag)})
    assert err.param == "structured_outputs.structural_tag" and "nested groups" in err.message


def test_the_required_tool_schema_is_bounded_as_a_whole() -> None:
    # each tool alone is within the optional weight (128**2 each), the five together are not (5 * 128**2)
    params = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(128)}}
    tools = [_tool(f"f{i}", params) for i in range(5)]
    assert _refused(tools=tools, tool_choice="required").param == "tools"
    assert _constraint(tools=tools[:4], tool_choice="required") is not None
    assert _constraint(tools=tools, tool_choice="auto") is None  # not compiled: only rendered into the prompt


def test_defs_that_are_not_an_object_are_a_400_not_an_attribute_error() -> None:
    for defs in ([1, 2], "x", 5):
        err = _refused(tools=[_tool("f", {"type": "object", "$defs": defs})], tool_choice="required")
        assert err.param == "tools[0].function.parameters.$defs"


def test_a_logit_bias_key_of_five_thousand_digits_is_a_400_not_a_value_error() -> None:
    err = _refused(logit_bias={"9" * 5000: 1.0})
    assert err.param == "logit_bias" and "9999" not in err.message
    req = parse_chat_request(_body(logit_bias={str(2**31 - 1): 1.0, "0000000005": -1.0}))
    assert req.logit_bias == {"2147483647": 1.0, "0000000005": -1.0}


def test_the_flags_set_every_limit() -> None:
    settings = parse_settings(["--model", "m", "--constraint-max-chars", "10", "--constraint-max-depth", "3",
                               "--constraint-max-schema-nodes", "4", "--constraint-max-values", "5",
                               "--constraint-max-optional-weight", "6", "--constraint-max-regex-depth", "7",
                               "--constraint-max-regex-repeat", "8"], {})
    assert settings.constraints == ConstraintLimits(max_chars=10, max_depth=3, max_schema_nodes=4, max_values=5,
                                                    max_optional_weight=6, max_regex_depth=7, max_regex_repeat=8)
    assert parse_settings(["--model", "m"], {}).constraints == ConstraintLimits(
        max_chars=131072, max_depth=64, max_schema_nodes=8192, max_values=1024, max_optional_weight=65536,
        max_regex_depth=64, max_regex_repeat=4096)
    with pytest.raises(SystemExit):
        parse_settings(["--model", "m", "--constraint-max-depth", "513"], {})


@pytest.mark.parametrize(("text", "ebnf", "shape"), [
    ("abc", False, (0, 0)),
    (r"\d{3}-\d{4}", False, (0, 2 + 3)),
    ("(a(b)c){10}", False, (2, 3 * 9)),
    ("[)(]{3}", False, (0, 2)),  # brackets in a class are not groups
    (r"\({3}", False, (0, 2)),  # an escaped bracket is not a group
    ("a{,5}b{x}", False, (0, 0)),  # not counted repetitions: literal text
    ("x{2,}", False, (0, 1)),  # open-ended: the lower bound
    ('r ::= "((" ("ab"){3}', True, (1, 4)),
])
def test_regex_shape_counts_nesting_and_expansion(text: str, ebnf: bool, shape: tuple[int, int]) -> None:
    assert regex_shape(text, ebnf=ebnf) == shape
