"""Every Triton kernel compiles for a Hopper GPU (sm_90) in the dtypes an engine
runs there, bfloat16 included, without a GPU: Triton lowers to PTX and its
bundled ptxas assembles it. The interpreter (the other tests) checks what the
kernels compute; this checks what only a real compile can (bfloat16 code,
libdevice calls, register-held sorts), so a kernel that would fail on the
first CUDA engine fails here first.

Triton's cache keeps what compiled, keyed by the kernels' sources (and those of
the functions they call), the options, the target, ptxas and Triton itself, so
the test keeps it beside the CPU kernels' builds: an unchanged kernel is not
compiled again, a changed one is, and a compile that fails is never cached."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from rollout.kernels.build import kernel_dir

CHILD = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rollout.kernels.triton import fused, paged_decode, paged_prefill, sampling, uniform

    FLOATS = {"eps", "qk_scale"}


    def compile_for_hopper(kernel, pointers, constexprs, **options):
        signature = {}
        for name in kernel.arg_names:
            if name in constexprs:
                signature[name] = "constexpr"
            elif name.endswith("_ptr"):
                signature[name] = pointers.get(name, pointers["*"])
            else:
                signature[name] = "fp32" if name in FLOATS else "i32"
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        print("compiled", kernel.fn.__name__, pointers["*"], flush=True)


    index = {n: "*i64" for n in ("pos_ptr", "slot_ptr", "tables_ptr", "lens_ptr", "starts_ptr", "qlens_ptr")}
    for dtype in ("*bf16", "*fp16", "*fp32"):
        pool = "*bf16" if dtype == "*fp32" else dtype  # a bfloat16 pool under a float32 model
        compile_for_hopper(fused._rms_norm_kernel, {"*": dtype}, {"HAS_DELTA": True, "BLOCK": 1024}, num_warps=4)
        rope = {"*": dtype, "k_cache_ptr": pool, "v_cache_ptr": pool, **index}
        for norms in (True, False):
            constexprs = {"Q_NORM": norms, "K_NORM": norms, "BLOCK": 64, "BLOCK_HQ": 16, "BLOCK_HKV": 2}
            compile_for_hopper(fused._rope_cache_kernel, rope, constexprs, num_warps=4, enable_fp_fusion=False)
        compile_for_hopper(fused._silu_mul_kernel, {"*": dtype}, {"BLOCK": 1024}, num_warps=4)
        attention = {"*": dtype, "k_ptr": pool, "v_ptr": pool, "lse_ptr": "*fp32", **index}
        for split in (False, True):
            constexprs = dict(G=7, BLOCK_G=16, HEAD_DIM=64, BLOCK_D=64, PAGE_SIZE=16, BLOCK_N=32, WRITE_LSE=split)
            out = {"out_ptr": "*fp32"} if split else {}
            compile_for_hopper(paged_decode.paged_decode_kernel, {**attention, **out}, constexprs)
        merge = {"*": dtype, "part_ptr": "*fp32", "lse_ptr": "*fp32"}
        compile_for_hopper(paged_decode.merge_splits_kernel, merge, dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=16))
        constexprs = dict(G=4, BLOCK_G=4, BLOCK_M=16, HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=16, BLOCK_N=32)
        compile_for_hopper(paged_prefill.paged_prefill_kernel, attention, constexprs)
    sampler = {"*": "*fp32", "top_k_ptr": "*i64", "seed_ptr": "*i64", "stream_ptr": "*i64", "counter_ptr": "*i64",
               "mode_ptr": "*i64", "cand_id_ptr": "*i64", "out_token_ptr": "*i64", "out_exact_ptr": "*i1"}
    for filters in (False, True):
        constexprs = dict(vocab=151936, n_cand=1024, FILTERS=filters, BLOCK=4096, CANDIDATE_BLOCK=1024,
                          ACCURATE_EXP=True)
        compile_for_hopper(sampling._sample_rows, sampler, constexprs, num_warps=8)
    compile_for_hopper(uniform._counter_uniform, {"*": "*i64", "out_ptr": "*fp32"}, {"BLOCK": 1024})
    """
)


def test_every_triton_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a real compile, not the interpreter
    env["TRITON_CACHE_DIR"] = str(kernel_dir() / "triton-sm90")
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    compiled = done.stdout.count("compiled ")
    assert compiled == 3 * 8 + 3, done.stdout  # eight kernels a dtype, then the sampler's three
