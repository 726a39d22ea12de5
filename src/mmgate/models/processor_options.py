"""Per-request processor options (a request's ``mm_processor_kwargs``): the name and type check
every family that takes some shares.

Stage: plan, before any fetch (a family's ``check_hints``).  In: the item's
:class:`~mmgate.types.ItemHints` ``options`` and the family's table of the names it takes with
their accepted Python types; out: nothing, or a 400 naming the option
(``param = "mm_processor_kwargs.<name>"``).

The types are as strict as transformers 5.24's ``validate_typed_dict`` on the processor's kwargs
(a string ``"2"`` is no ``fps``), read from JSON: ``true`` is a bool and never an int; an integer
is a valid float, as JSON does not tell ``2`` from ``2.0``.  Unlike transformers, which drops a
name its processor does not declare with a warning, mmgate refuses it, so a misspelt option
never goes unnoticed.
"""

from __future__ import annotations

from collections.abc import Mapping

from mmgate.errors import ErrorCode, GatewayError
from mmgate.types import ItemHints


def option_error(name: str, message: str) -> GatewayError:
    """400 ``invalid_request`` about option ``name`` (``param = "mm_processor_kwargs.<name>"``)."""
    return GatewayError(ErrorCode.INVALID_REQUEST, message, f"mm_processor_kwargs.{name}")


def check_option_types(hints: ItemHints, types: Mapping[str, tuple[type, ...]], model_type: str) -> None:
    """Every option of ``hints`` is named in ``types`` and holds one of its types.

    Raises:
        GatewayError(INVALID_REQUEST): an unknown name (the message lists the names taken) or a
            value of another type.
    """
    for name, value in hints.options:
        kinds = types.get(name)
        if kinds is None:
            raise option_error(name, f"{model_type} does not take mm_processor_kwargs {name!r}; it takes "
                               + ", ".join(sorted(types)))
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            wanted = " or ".join(k.__name__ for k in kinds)
            raise option_error(name, f"{name} must be {wanted}, got {type(value).__name__}")
