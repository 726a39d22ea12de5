"""Shape bounds of one structured-output or tool-choice constraint, checked before anything is sent.

Stage: api (``parse_chat_request`` -> :func:`mmgate.request.structured.request_constraint`).  In: one
constraint's value as the request gives it (a JSON schema object, a regex, an EBNF grammar, the
choices, a structural tag) and the gateway's :class:`~mmgate.config.settings.ConstraintLimits`; out:
nothing, or a 400 ``invalid_request`` whose ``param`` names the field and whose message names the
limit (never the caller's value).

Why: the worker compiles a constraint with xgrammar (vLLM's default backend, and the reference
engine's) on its own threads, with the library's C stack and memory.  Its cost follows the
constraint's shape, and some shapes cost minutes or crash the process (measured with xgrammar 0.2.9 and
the Qwen2-VL vocabulary; docs/limits.md, "Structured outputs and tools"): a schema ``pattern`` of
60,000 nested groups overflows its stack (SIGSEGV); an object of 1,000 optional properties takes 6 s
(time grows with their square); a schema pattern ``[a-z]{10000}`` takes 4 s and ``([a-z]{100}){100}``
11 s (its counted repetitions are expanded); schema text nested 950 levels takes 66 s.  vLLM's own
request validation compiles the constraint to check it (``validate_xgrammar_grammar``,
``vllm/v1/structured_output/backend_xgrammar.py``), which a gateway must never do on its event loop:
here the cost is decided from the shape alone, by linear scans with explicit stacks (no recursion,
nothing compiled).

What is bounded (each a :class:`~mmgate.config.settings.ConstraintLimits` field and a ``--constraint-*`` flag):
the text's characters; the JSON nesting of a schema or structural tag (also inside schema strings:
JSON text is depth-scanned before it is decoded); the number of JSON objects in a schema; choices and
enum / const values; the sum over a schema's objects of their optional properties squared; and, for
every regex (``guided_regex``, each schema ``pattern`` and ``patternProperties`` key) and grammar,
the nesting of groups and the atoms its counted repetitions ``{m,n}`` add.
"""

from __future__ import annotations

import re
from typing import Any

from mmgate.errors import ErrorCode, GatewayError
from mmgate.config.settings import ConstraintLimits


def _refuse(param: str, what: str, limit: int, flag: str) -> GatewayError:
    return GatewayError(ErrorCode.INVALID_REQUEST, f"{param} has more than {limit} {what} (limit {flag})", param)


def check_chars(count: int, param: str, limits: ConstraintLimits) -> None:
    """Refuse a constraint whose text (as sent to the worker) is longer than ``limits.max_chars`` characters.

    Raises:
        GatewayError(INVALID_REQUEST): too long (``param`` as given).
    """
    if count > limits.max_chars:
        raise _refuse(param, "characters", limits.max_chars, "--constraint-max-chars")


def check_choices(choices: list[str], param: str, limits: ConstraintLimits) -> None:
    """Bound ``guided_choice`` / ``structured_outputs.choice``: at most ``max_values`` entries and
    ``max_chars`` characters together.

    Raises:
        GatewayError(INVALID_REQUEST): too many entries, or too long together.
    """
    if len(choices) > limits.max_values:
        raise _refuse(param, "choices", limits.max_values, "--constraint-max-values")
    check_chars(sum(len(c) for c in choices), param, limits)


def check_document(doc: Any, param: str, limits: ConstraintLimits) -> None:
    """Bound a decoded JSON schema, or structural tag (whose ``schema`` members are schemas).

    Walks every JSON object and array with an explicit stack (the root is level 1) and refuses,
    naming the limit: nesting deeper than ``max_depth``; more than ``max_schema_nodes`` objects;
    more than ``max_values`` ``enum`` entries and ``const`` values together; a sum over objects with
    ``properties`` of (properties not in ``required``)**2 above ``max_optional_weight``; any
    ``pattern`` string or ``patternProperties`` key past :func:`check_regex`.

    Raises:
        GatewayError(INVALID_REQUEST): the first bound passed (``param`` as given).
    """
    nodes = values = weight = 0
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limits.max_depth:
            raise _refuse(param, "levels of nesting", limits.max_depth, "--constraint-max-depth")
        if isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))
            continue
        nodes += 1
        if nodes > limits.max_schema_nodes:
            raise _refuse(param, "schema nodes (JSON objects)", limits.max_schema_nodes,
                          "--constraint-max-schema-nodes")
        enum = node.get("enum")
        values += (len(enum) if isinstance(enum, list) else 0) + ("const" in node)
        if values > limits.max_values:
            raise _refuse(param, "enum and const values", limits.max_values, "--constraint-max-values")
        props = node.get("properties")
        if isinstance(props, dict):
            required = node.get("required")
            named = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
            optional = sum(1 for name in props if name not in named)
            weight += optional * optional
            if weight > limits.max_optional_weight:
                raise _refuse(param, "optional-property weight (the sum of each object's optional properties "
                              "squared)", limits.max_optional_weight, "--constraint-max-optional-weight")
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            check_regex(pattern, param, limits)
        pattern_props = node.get("patternProperties")
        if isinstance(pattern_props, dict):
            for key in pattern_props:
                check_regex(key, param, limits)
        stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))


def check_regex(pattern: str, param: str, limits: ConstraintLimits) -> None:
    """Bound one regex (``guided_regex``, a schema ``pattern``): group nesting and counted repetition.

    Raises:
        GatewayError(INVALID_REQUEST): more than ``max_regex_depth`` nested groups, or counted
            repetitions adding more than ``max_regex_repeat`` atoms (see :func:`regex_shape`).
    """
    _check_shape(regex_shape(pattern), param, limits)


def check_grammar(grammar: str, param: str, limits: ConstraintLimits) -> None:
    """Bound one EBNF grammar (``guided_grammar``): its text, parenthesis nesting and counted repetition.

    Raises:
        GatewayError(INVALID_REQUEST): as :func:`check_regex`, or longer than ``max_chars``.
    """
    check_chars(len(grammar), param, limits)
    _check_shape(regex_shape(grammar, ebnf=True), param, limits)


def _check_shape(shape: tuple[int, int], param: str, limits: ConstraintLimits) -> None:
    depth, added = shape
    if depth > limits.max_regex_depth:
        raise _refuse(param, "nested groups in a regex or grammar", limits.max_regex_depth,
                      "--constraint-max-regex-depth")
    if added > limits.max_regex_repeat:
        raise _refuse(param, "atoms added by counted repetitions ({m,n}) in a regex or grammar",
                      limits.max_regex_repeat, "--constraint-max-regex-repeat")


#: a counted repetition ``{m}``, ``{m,}`` or ``{m,n}`` (ECMA-262 and xgrammar's EBNF; anything else is literal)
_COUNTED = re.compile(r"\{(\d+)(?:(,)(\d*))?\}")
#: a repetition count of more digits than this is taken as 10**9 (it is refused either way)
_MAX_DIGITS = 9


def _count(digits: str) -> int:
    return int(digits) if len(digits) <= _MAX_DIGITS else 10**_MAX_DIGITS


def regex_shape(text: str, ebnf: bool = False) -> tuple[int, int]:
    """``(deepest group nesting, atoms added by counted repetitions)`` of a regex or an EBNF grammar.

    One left-to-right scan: an escape (``\\x``) or a character class (``[...]``) is one atom (in a
    grammar also a ``"..."`` literal, one atom per character; ``#`` comments skipped); ``(`` opens a
    group whose size is the sum of its atoms; a counted repetition ``{m,n}`` multiplies the atom or
    group before it by ``n`` (``m`` when open-ended), as xgrammar expands it; ``*``, ``+`` and ``?``
    do not expand.  The second value is the expanded size minus the plain atom count, so
    ``[a-z]{1000}`` -> 999 and ``([a-z]{100}){100}`` -> 9,999, while a long literal adds nothing.
    Malformed text is measured as far as it goes (the worker refuses it later).
    """
    sizes, lasts = [0], [0]  # per open group (the root first): its expanded size, the last atom's size
    plain = depth = deepest = 0
    i, n = 0, len(text)

    def atom(size: int) -> None:
        nonlocal plain
        plain += size
        sizes[-1] += size
        lasts[-1] = size

    while i < n:
        ch = text[i]
        if ch == "\\":
            atom(1)
            i += 2
        elif ch == "[":
            j = i + 1
            if j < n and text[j] == "^":
                j += 1
            if j < n and text[j] == "]":
                j += 1
            while j < n and text[j] != "]":
                j += 2 if text[j] == "\\" else 1
            atom(1)
            i = j + 1
        elif ebnf and ch == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            atom(max(1, j - i - 1))
            i = j + 1
        elif ebnf and ch == "#":
            j = text.find("\n", i)
            i = n if j < 0 else j + 1
        elif ch == "(":
            sizes.append(0)
            lasts.append(0)
            depth += 1
            deepest = max(deepest, depth)
            i += 1
        elif ch == ")" and depth:
            size = sizes.pop()
            lasts.pop()
            depth -= 1
            sizes[-1] += size
            lasts[-1] = size
            i += 1
        elif ch == "|":
            lasts[-1] = 0
            i += 1
        elif ch == "{" and (m := _COUNTED.match(text, i)):
            low, comma, high = m.group(1), m.group(2), m.group(3)
            times = _count(high) if comma and high else _count(low)
            if times > 1:
                sizes[-1] += lasts[-1] * (times - 1)
                lasts[-1] *= times
            elif times == 0:
                sizes[-1] -= lasts[-1]
                lasts[-1] = 0
            i = m.end()
        elif ch in "*+?" or ch.isspace() and ebnf:
            i += 1
        else:
            atom(1)
            i += 1
    while len(sizes) > 1:  # unclosed groups: measured as if closed
        size = sizes.pop()
        sizes[-1] += size
    return deepest, max(0, sizes[0] - plain)
