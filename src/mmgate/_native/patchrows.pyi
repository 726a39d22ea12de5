"""Type stub of the C extension ``mmgate._native.patchrows`` (source: patchrows.c)."""

from typing import Any, TypeAlias

#: a C-contiguous buffer (bytes, a numpy array); ``Any`` because numpy's stubs declare the buffer
#: protocol only for Python >= 3.12
_Buffer: TypeAlias = Any

def patch_rows(src: _Buffer, dst: _Buffer, lut: _Buffer | None, frames: int, height: int, width: int,
               channels: int, patch: int, merge: int, temporal: int, first_row: int, num_rows: int) -> None: ...
