"""Compile every Triton kernel for a CUDA GPU without one: Triton lowers to PTX and runs the
ptxas it ships, so a kernel the interpreter accepts but the compiler rejects (a type that does
not unify, a tl.dot shape, a literal typed int64) fails here, on any machine.

    python -m tools.compile_triton_kernels [--arch 90]

Run without TRITON_INTERPRET (the kernels must be jit functions, not interpreted ones).
Each kernel is compiled in float32, bfloat16 and float16, with the constexprs the model uses.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

# Python ints reach a kernel as i32 when they fit, as strides and cache sizes here do
ATTENTION_INPUTS = dict(
    q_stride="i32", width="i32", kv_heads="i32", plane_slots="i32", block_size="i32", dim="i32"
)


def cases(dtype: str) -> list[tuple[str, str, dict[str, str], dict[str, Any]]]:
    """(module, kernel, the signature of its non-constexpr arguments, its constexprs)."""
    p, fp32 = f"*{dtype}", dtype == "fp32"
    decode = dict(
        partial_out="*fp32",
        partial_lse="*fp32",
        q=p,
        cache=p,
        tables="*i64",
        lens="*i64",
        **ATTENTION_INPUTS,
        scale="fp32",
    )
    extend = dict(
        out=p,
        q=p,
        cache=p,
        tables="*i64",
        q_starts="*i64",
        q_lens="*i64",
        context_lens="*i64",
        **ATTENTION_INPUTS,
        scale="fp32",
    )
    store = dict(
        cache=p, kv=p, slots="*i64", token_stride="i32", planes="i32", plane_slots="i32", dim="i32"
    )
    combine = dict(out=p, partial_out="*fp32", partial_lse="*fp32", splits="i32", dim="i32")
    norm = dict(out=p, residual=p, x=p, weight=p, dim="i32", eps="fp32")
    rotary = dict(x=p, cos=p, sin_signed=p, token_stride="i32", heads="i32", dim="i32")
    return [
        ("gpu_attention", "store_kv_kernel", store, dict(PLANES=16, DIM=128)),
        *(
            ("gpu_attention", "decode_kernel", decode,
             dict(GROUP=group, GROUP_PAD=16, DIM=dim, BLOCK_N=32, DOT_FP32=fp32))
            for group in (1, 4) for dim in (16, 128)
        ),
        ("gpu_attention", "combine_splits_kernel", combine, dict(SPLITS=1, DIM=128)),
        ("gpu_attention", "combine_splits_kernel", combine, dict(SPLITS=16, DIM=128)),
        *(
            ("gpu_attention", "extend_kernel", extend,
             dict(GROUP=4, DIM=128, BLOCK_M=block_m, BLOCK_N=32, DOT_FP32=fp32))
            for block_m in (16, 64)
        ),
        ("gpu_fused", "add_rms_norm_kernel", norm, dict(HAS_RESIDUAL=True, BLOCK=4096)),
        ("gpu_fused", "add_rms_norm_kernel", norm, dict(HAS_RESIDUAL=False, BLOCK=4096)),
        ("gpu_fused", "silu_and_mul_kernel", dict(out=p, x=p, inter="i32"), dict(BLOCK=1024)),
        ("gpu_fused", "rotary_kernel", rotary, dict(HEADS=32, HALF=64)),
    ]  # fmt: skip


SAMPLING = dict(
    tokens="*i64", logits="*fp32", temperatures="*fp32", top_ks="*i64", top_ps="*fp32",
    min_ps="*fp32", uniforms="*fp64", vocab="i32", stride="i32",
)  # fmt: skip


def compile_kernel(
    module: str, name: str, signature: dict[str, str], constexprs: dict, arch: int
) -> str:
    """Empty if the kernel compiles to a cubin for sm_`arch`, else why not."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(f"runtime.kernels.{module}"), name)
    full = {arg: "constexpr" if arg in constexprs else signature[arg] for arg in kernel.arg_names}
    try:
        compiled = triton.compile(
            ASTSource(fn=kernel, signature=full, constexprs=constexprs),
            target=GPUTarget("cuda", arch, 32),
        )
    except Exception as exc:  # any compiler error is the finding
        return f"{type(exc).__name__}: {exc}"
    return "" if compiled.asm.get("cubin") else "no cubin"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: interpreted kernels do not compile", file=sys.stderr)
        return 2
    todo = [case for dtype in ("fp32", "bf16", "fp16") for case in cases(dtype)]
    todo.append(("gpu_sampling", "sample_kernel", SAMPLING, dict(BLOCK=4096)))
    failures = 0
    for module, name, signature, constexprs in todo:
        error = compile_kernel(module, name, signature, constexprs, args.arch)
        dtype = signature.get("cache", signature.get("out", signature.get("x", "")))
        print(f"{'FAIL' if error else 'ok'} {name} {dtype} {constexprs} {error}".rstrip())
        failures += bool(error)
    print(f"{len(todo) - failures} of {len(todo)} kernels compiled for sm_{args.arch}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
