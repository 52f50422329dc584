"""The CPU kernels' shared library (cpu_build.py builds it), loaded with ctypes: each C entry
point's signature, a call that raises for the error code every one returns, and per-thread
scratch buffers. The torch-shaped wrappers are in cpu_matmul.py and cpu.py.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Any

import torch

from runtime.kernels.checks import KernelError

DTYPES = {torch.float32: 0, torch.bfloat16: 1}
LINEAR_TILE = 4  # cpu_linear.cpp's kTileN: weight rows widened at once, per thread
PANEL = 32  # cpu_panels.cpp's kPanel: weight rows per panel
# Each C entry point's arguments, as the .cpp files declare them: i int, q int64, f float,
# p pointer. Every one returns an int: 0, or a code for `_raise_for`.
SIGNATURES = {
    "paged_decode": "i p p q p p q p q q q q q q f i",
    "paged_decode_partials": "p q q q q p",
    "paged_decode_items": "i p p p q p p q p q q q q q q f i q q",
    "paged_decode_merge": "i p p p q q q q i",
    "paged_extend": "i p p q q p p q p p p q q q q q q f i",
    "paged_store_kv": "i p p q p q q q q",
    "fused_add_rms_norm": "i p p p p q q f i",
    "fused_silu_and_mul": "i p p q q i",
    "fused_rotary": "i p q q q q p p i",
    "greedy_pick": "p q q p p i",
    "sample_pick": "p q q q p p p p p p i",
    "skinny_linear": "i p p p p q q q p i",
    "panel_isa": "",
    "panel_pack": "i p p q q i",
    "panel_linear": "i p p p p q q q i",
    "quant_linear": "i p p p p q q q p i",
    "quant_dequantize": "i p p q q i",
    "quant_isa": "",
    "quant_repack": "i p p q q i",
    "repacked_linear": "i p p p p q q q p i",
    "repacked_formats": "",
    "repacked_rows": "",
    "repacked_groups": "i p p p p q q q q q",
    "decode_layers": "i p q p p q q q q q f f p p p q q q p p q p p p i p p",
}
QUANT_ISAS = {0: "plain loops", 1: "AVX2", 2: "AVX-512", 3: "AVX-512 VNNI"}
_CTYPES = {"i": ctypes.c_int, "q": ctypes.c_int64, "f": ctypes.c_float, "p": ctypes.c_void_p}


class CpuLibrary:
    """ctypes handles on the compiled kernels."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))
        self._per_thread = threading.local()  # scratch buffers (`_scratch`)
        self._functions: dict[str, Any] = {}
        for name, codes in SIGNATURES.items():
            function = getattr(lib, name)
            function.argtypes = [_CTYPES[code] for code in codes.split()]
            self._functions[name] = function
        self.library = library

    def _call(self, name: str, *args: Any) -> None:
        """Run one kernel; under torch.profiler it shows as `runtime::<name>` (otherwise a
        check of ~0.1 us, where a record_function would cost microseconds every call)."""
        function = self._functions[name]
        if torch._C._autograd._profiler_enabled():
            with torch.profiler.record_function(f"runtime::{name}"):
                _raise_for(function(*args))
        else:
            _raise_for(function(*args))

    def _scratch(self, size: int) -> int:
        """The address of a buffer of at least `size` bytes (64-byte aligned, as torch
        allocates), this thread's own, kept from call to call."""
        buffer = getattr(self._per_thread, "scratch", None)
        if buffer is None or buffer.numel() < size:
            buffer = self._per_thread.scratch = torch.empty(size, dtype=torch.uint8)
        return buffer.data_ptr()


def _raise_for(code: int) -> None:
    if code:
        reasons = {1: "heads do not group"}
        reasons |= {2: "a context length (or a prefill chunk) is outside its block table (or q)"}
        reasons |= {3: "a block id is outside the cache", 4: "a slot is outside the cache"}
        reasons |= {6: "items outside the rows' kv heads and chunks"}
        reasons |= {10: "K is not a multiple of 32", 11: "no kernel for this block format"}
        reasons |= {12: "N is not a multiple of the rows a repacked group interleaves"}
        reasons |= {13: "groups outside the matrix"}
        reasons |= {20: "this build has no AVX512-BF16 panels", 21: "k is odd"}
        raise KernelError(reasons.get(code, f"unsupported dtype (code {code})"))
