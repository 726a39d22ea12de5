"""Command-line options with environment fallbacks: the one mechanism behind every parser.

Stage: start-up.  In: ``argparse`` parsers (or argument groups) and the
environment as a mapping; out: a parsed ``argparse.Namespace`` in which every
option added through :func:`add_option` holds the flag's value, else its
environment variable's, else its built-in default.  ``mmgate serve``
(:mod:`mmgate.config.settings`), ``mmgate engine`` (:mod:`mmgate.refengine.config`) and
``mmgate sidecar`` (:mod:`mmgate.sidecar.config`) all add their shared option
groups with it, so a flag means the same, has the same default and the same
environment fallback in all three.  ``docs/configuration.md`` is rendered from
the same records (:mod:`mmgate.config.docs`).

Resolution mirrors the Rust gateway (lightseekorg/smg ``docs/reference/configuration.md``,
"Multimodal Configuration", v1.11): flag, then environment variable, then
default.  An option may list several variables (the first one set wins); the
ones marked deprecated (SMG's legacy spellings such as ``SMG_MM_PROCESSING``)
still work and log one warning per variable per parse (a process parses its
settings once at start-up, so once per run).  An unreadable value — not a
number, below the option's lower bound, not one of its choices, not a boolean
word — stops start-up with ``SystemExit`` naming the variable (or the flag).
"""

from __future__ import annotations

import argparse
import logging
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("mmgate.settings")

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off", ""})


@dataclass(frozen=True, slots=True)
class OptionRecord:
    """What argparse does not hold about one option: its fallbacks, real default and bound."""

    env: tuple[str, ...]  # environment variables read when the flag is absent, first set one wins
    deprecated: frozenset[str]  # the members of ``env`` that log a deprecation warning when used
    default: Any  # built-in default (argparse itself holds None when ``env`` is not empty)
    minimum: float | None  # smallest accepted value (flag or environment); None: unbounded
    env_doc: tuple[str, ...]  # variables the caller reads itself (listed in --help and the docs, not resolved here)
    help: str  # the one-line help as written, without the default/env suffix --help shows
    group: str  # topic the option is listed under in --help and docs/configuration.md


_RECORDS: weakref.WeakKeyDictionary[argparse.Action, OptionRecord] = weakref.WeakKeyDictionary()


def add_option(container: argparse._ActionsContainer, *flags: str, help: str, group: str = "",
               env: Sequence[str] = (), deprecated: Iterable[str] = (), default: Any = None,
               minimum: float | None = None, env_doc: Sequence[str] = (), **kwargs: Any) -> argparse.Action:
    """``container.add_argument(*flags, ...)`` plus the option's environment fallbacks.

    ``help`` is one line; the default and the variables are appended to it, so
    ``--help`` names them.  ``group`` defaults to the container's title.
    Returns the argparse action (its record is kept for :func:`resolve` and
    :func:`option_record`).
    """
    deprecated_names = frozenset(deprecated)
    unknown = deprecated_names - set(env)
    if unknown:
        raise ValueError(f"deprecated names not among env: {sorted(unknown)}")
    text = help + _help_suffix(default, (*env, *env_doc), deprecated_names)
    if kwargs.get("type") in (int, float) and "metavar" not in kwargs:
        kwargs["metavar"] = "N"
    action = container.add_argument(*flags, help=text, default=None if env else default, **kwargs)
    title = group or str(getattr(container, "title", "") or "")
    _RECORDS[action] = OptionRecord(env=tuple(env), deprecated=deprecated_names, default=default,
                                    minimum=minimum, group=title, env_doc=tuple(env_doc), help=help)
    return action


def _help_suffix(default: Any, env: tuple[str, ...], deprecated: frozenset[str]) -> str:
    parts = []
    if default is not None and default is not False and default != []:
        parts.append(f"default {format_default(default)}")
    if env:
        names = ", ".join(f"{n} (deprecated)" if n in deprecated else n for n in env)
        parts.append(f"env {names}")
    return f" [{'; '.join(parts)}]" if parts else ""


def format_default(value: Any) -> str:
    """A default as the docs and ``--help`` show it (``on``/``off`` for booleans, ``none`` for unset)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value) if value else "none"
    return str(value)


def option_record(action: argparse.Action) -> OptionRecord | None:
    """The record :func:`add_option` kept for ``action``; None for a plain ``add_argument``."""
    return _RECORDS.get(action)


def resolve(parser: argparse.ArgumentParser, ns: argparse.Namespace, environ: Mapping[str, str]) -> argparse.Namespace:
    """Fill every absent option of ``parser`` from the environment, else its default; check bounds.

    Returns ``ns`` (changed in place).

    Raises:
        SystemExit: an unreadable environment value, or a value below an option's
            minimum; the message names the variable or the flag.
    """
    warned: set[str] = set()
    for action in parser._actions:
        record = _RECORDS.get(action)
        if record is None or not hasattr(ns, action.dest):
            continue
        value = getattr(ns, action.dest)
        source = action.option_strings[0] if action.option_strings else action.dest
        if value is None and record.env:
            value = list(record.default) if isinstance(record.default, list) else record.default
            for name in record.env:
                raw = environ.get(name)
                if raw is None or not raw.strip():
                    continue
                value, source = env_value(action, name, raw), name
                if name in record.deprecated and name not in warned:
                    warned.add(name)
                    log.warning("%s is deprecated and will stop being read; use %s instead",
                                name, action.option_strings[0])
                break
            setattr(ns, action.dest, value)
        _check_minimum(value, record.minimum, source)
    return ns


def _check_minimum(value: Any, minimum: float | None, source: str) -> None:
    if minimum is None or value is None:
        return
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v < minimum:
            bound = int(minimum) if float(minimum).is_integer() else minimum
            raise SystemExit(f"{source} must be at least {bound}")


def env_value(action: argparse.Action, name: str, raw: str) -> Any:
    """Convert the text of variable ``name`` as ``action``'s flag would be converted.

    Booleans take 1/true/yes/on and 0/false/no/off; a list option takes items
    separated by commas or spaces; choices are matched case-insensitively.

    Raises:
        SystemExit: the text is not readable for this option (the message names ``name``).
    """
    text = raw.strip()
    if action.nargs == 0:  # store_true / store_false / BooleanOptionalAction
        word = text.lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
        raise SystemExit(f"unreadable {name}={raw!r}: expected one of 1, true, yes, on, 0, false, no, off")
    if action.nargs in ("*", "+"):
        items = [p for p in text.replace(",", " ").split() if p]
        return [_one(action, name, item) for item in items]
    return _one(action, name, text)


def _one(action: argparse.Action, name: str, text: str) -> Any:
    convert: Callable[[str], Any] = action.type if callable(action.type) else str
    if action.choices is not None:
        text = text.lower()
    try:
        value = convert(text)
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        kind = getattr(convert, "__name__", "value")
        expected = {"int": "an integer", "float": "a number"}.get(kind, f"a {kind}")
        raise SystemExit(f"unreadable {name}={text!r}: expected {expected}") from None
    if action.choices is not None and value not in action.choices:
        raise SystemExit(f"unreadable {name}={text!r}: expected one of {', '.join(map(str, action.choices))}")
    return value


def groups(parser: argparse.ArgumentParser) -> list[tuple[str, list[argparse.Action]]]:
    """The parser's options by ``--help`` group, in order, without ``--help`` and empty groups."""
    out: list[tuple[str, list[argparse.Action]]] = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if actions:
            out.append((str(group.title or ""), actions))
    return out
