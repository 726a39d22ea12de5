"""Type stub of the C extension ``mmgate._native.tvresize`` (source: tvresize.c)."""

from typing import Any, TypeAlias

#: a C-contiguous buffer (bytes, a numpy array); ``Any`` because numpy's stubs declare the buffer
#: protocol only for Python >= 3.12
_Buffer: TypeAlias = Any
#: (start int32[out], size int32[out], weights int16[out, ksize], ksize, precision)
Axis: TypeAlias = tuple[_Buffer, _Buffer, _Buffer, int, int]

#: "avx2" where the CPU runs the AVX2 kernels, else "c" (portable C)
KERNEL: str

def resize(src: _Buffer, dst: _Buffer, height: int, width: int, channels: int, out_h: int, out_w: int,
           h_axis: Axis | None, v_axis: Axis | None, simd: bool = True) -> None: ...
