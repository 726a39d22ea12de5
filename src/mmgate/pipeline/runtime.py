"""The served model: its bundle, tokenizer and family, built once at start-up.

Stage: below planning and the pipeline (both read it).  In: a resolved bundle, its tokenizer and family;
out: :class:`ModelRuntime`, with the reserved token strings caller text may not contain derived once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mmgate.chat.integrity import ReservedTokens
from mmgate.chat.tokenizer import BundleTokenizer
from mmgate.models.bundle import ModelBundle
from mmgate.models.family import Family


@dataclass(frozen=True, slots=True)
class ModelRuntime:
    """One served model: its bundle, tokenizer and family (None: text only).

    ``reserved``: the token strings caller text may not contain (:mod:`mmgate.chat.integrity`),
    derived from the tokenizer's special tokens and the family's declared tokens unless given.
    """

    bundle: ModelBundle
    tokenizer: BundleTokenizer
    family: Family | None
    served_name: str
    reserved: ReservedTokens = field(default_factory=lambda: ReservedTokens(()))
    #: the ids of ``reserved`` tokens
    reserved_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not self.reserved.tokens:
            family_tokens = self.family.reserved_tokens if self.family is not None else ()
            object.__setattr__(self, "reserved", ReservedTokens.for_model(self.tokenizer.special_added_tokens(),
                                                                          family_tokens))
        ids = (self.tokenizer.token_id(t) for t in self.reserved.tokens)
        object.__setattr__(self, "reserved_ids", frozenset(i for i in ids if i is not None))

    def accepts(self, model: str) -> bool:
        return model in (self.served_name, self.bundle.name, str(self.bundle.path))
