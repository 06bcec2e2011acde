"""Compile check without a GPU: the fused-linear kernels (kernels_triton/linear.py) compiled ahead of time
for sm_90 (H100 / H200) by the installed Triton and its bundled ptxas, with the argument specialisation a
real launch gets (16-byte aligned pointers, integer arguments divisible by 16), so the software pipeliner
engages as it does on the device. Prints, per variant, the MMA kind in the PTX (wgmma / mma.sync),
whether the loads became cp.async (pipelined), whether the L2 prefetch is there, and the shared memory.

Run (CPU, ~20 s; --quick: two variants):  python experiments/kernels/compile_linear_sm90.py
"""
import os
import sys
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("unset TRITON_INTERPRET: this compiles for the GPU, it does not interpret")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels_triton import linear as lin  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
DO_NOT_SPECIALIZE = ("M", "n_blocks", "xi_w", "xi_group", "xi_stride", "n_positions", "eps", "n_ss", "stride_ss")


def compile_kernel(kernel, ptr_args, int_args, float_args, i64_args, consts, options):
    sig = {}
    for name in kernel.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptr_args:
            sig[name] = ptr_args[name]
        elif name in float_args:
            sig[name] = "fp32"
        elif name in i64_args:
            sig[name] = "i64"
        else:
            sig[name] = "i32"
    nodiv = set(DO_NOT_SPECIALIZE) | set(float_args)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if n not in consts and n not in nodiv}
    src = ASTSource(kernel, sig, constexprs={(kernel.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=TARGET, options=options)


def main_kernel(epi, stream, block_m, block_n, block_k, stages, warps, prefetch=0, pdl=1, gather=False,
                has_add=False, dt="*bf16", split=1, inline=False, res_stats=False, pre_ss=0):
    k = lin._fused_linear_kernel
    ptrs = {n: dt for n in ("x_ptr", "r_ptr", "nw_ptr", "s_ptr", "x2_ptr", "nw2_ptr", "w_ptr", "o_ptr", "add_ptr",
                             "kc_ptr", "vc_ptr")}
    ptrs.update(pos_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32", slot_ptr="*i64", xi_ptr="*i32", part_ptr="*fp32",
                cnt_ptr="*i32", ss_ptr="*fp32")
    norm = (inline or not stream or pre_ss == 1) and pre_ss != 2
    consts = dict(HQ=32, HKV=8, HALF=64, PARTS=2, PS=16, NORM=norm, HAS_RESIDUAL=(inline or not stream) and not pre_ss,
                  TWO_INPUTS=False,
                  HAS_ADD=has_add, EPI=epi, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PREC="tf32",
                  GEMV=False, BLOCK_SS=block_k, USE_PDL=pdl, GATHER=gather, STREAM=stream, PREFETCH=prefetch, LINE=64,
                  SPLIT=split, RES_STATS=res_stats, PRE_SS=pre_ss, SS_ROWS=32 if pre_ss else 1)
    return compile_kernel(k, ptrs, (), ("eps",), (), consts, dict(num_warps=warps, num_stages=stages))


def prologue(two):
    k = lin._stream_prologue_kernel
    ptrs = {n: "*bf16" for n in ("x_ptr", "r_ptr", "nw_ptr", "s_ptr", "x2_ptr", "nw2_ptr", "y_ptr")}
    ptrs["xi_ptr"] = "*i32"
    consts = dict(NORM=True, HAS_RESIDUAL=not two, GATHER=two, BLOCK=4096, USE_PDL=2 if two else 1)
    return compile_kernel(k, ptrs, (), ("eps",), (), consts, dict(num_warps=8, num_stages=1))


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two variants only (a smoke run)")
    args = ap.parse_args()
    cases = []
    for epi in (0, 1, 2):
        for bm in (16, 32, 64):
            cases.append(dict(epi=epi, stream=True, block_m=bm, block_n=32 if epi else 64, block_k=128, stages=4,
                              warps=4, prefetch=1024))
    cases += [dict(epi=e, stream=True, block_m=64, block_n=64 if e == 0 else 32, block_k=64, stages=4, warps=4, split=3,
                   prefetch=1024) for e in (0, 1, 2)]
    cases += [dict(epi=e, stream=True, inline=True, block_m=32, block_n=32, block_k=128, stages=4, warps=4,
                   split=2 if e == 0 else 1) for e in (0, 1, 2)]
    cases += [dict(epi=e, stream=False, block_m=32, block_n=32, block_k=128, stages=3, warps=4) for e in (0, 2)]
    cases += [dict(epi=0, stream=True, block_m=16, block_n=16, block_k=256, stages=4, warps=4, gather=True,
                   has_add=True),
              dict(epi=0, stream=True, block_m=64, block_n=128, block_k=64, stages=3, warps=8),
              dict(epi=2, stream=True, block_m=32, block_n=16, block_k=256, stages=4, warps=4, prefetch=1024)]
    # norm statistics (kernel option norm_stats): the producer's epilogue (split-K), the folded consumers
    # (row scale before the epilogue) and the K-loop one
    cases += [dict(epi=0, stream=True, block_m=32, block_n=32, block_k=64, stages=4, warps=4, split=3, res_stats=True),
              dict(epi=1, stream=True, block_m=32, block_n=32, block_k=128, stages=4, warps=4, prefetch=1024, pre_ss=2),
              dict(epi=2, stream=True, block_m=32, block_n=16, block_k=64, stages=4, warps=4, split=2, prefetch=1024,
                   pre_ss=2),
              dict(epi=1, stream=True, block_m=32, block_n=32, block_k=128, stages=4, warps=4, pre_ss=1)]
    if args.quick:
        cases = [cases[0], cases[-3]]
    for c in cases:
        t = time.time()
        ck = main_kernel(**c)
        ptx = ck.asm["ptx"]
        mma = "wgmma" if "wgmma" in ptx else ("mma.sync" if "mma.sync" in ptx else "no-mma")
        print(c, f"{time.time() - t:.1f}s", mma,
              "cp.async" if "cp.async" in ptx else "no-cp.async", "prefetch" if "prefetch.global.L2" in ptx else "",
              "smem", ck.metadata.shared, flush=True)
    for two in (False, True):
        ck = prologue(two)
        print("prologue", two, "ok smem", ck.metadata.shared)
