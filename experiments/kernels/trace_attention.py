"""Per-program schedule of paged_attention: which SM each program ran on and when it started, finished
its prologue, its KV loop and its epilogue (PTX %smid and %globaltimer), for one call of a shape.

Question: where does a launch's time go -- programs per SM (imbalance), per-program fixed costs
(prologue: lengths, q, page table; epilogue: store / split merge) or the KV loop itself?
The kernel is instrumented by patching a copy of kernels_triton/attention.py's source (one extra
pointer argument and five timer reads per program; the loop body is unchanged, checked on the
sm_90 SASS), imported from a temporary file; paged_attention's launch logic is the library's.

Prints, per shape: rotating time (bench_attention's method: a CUDA graph of back-to-back calls over
>= 256 MB of KV), the traced call's span (first start to last end, one call after another pool's
call), programs per SM, and per-program prologue / loop / epilogue means and ranges.
Sets: ``schedule`` (the tree headline and its neighbours, splits, decode shapes) and ``balance``
(mixed request lengths that emulate giving long programs the SMs to themselves and splitting the
rest, without any merge).

    python experiments/kernels/trace_attention.py [--sets schedule,balance]   (H200: ~30 s)
"""
import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "experiments" / "kernels")]
import bench_attention as BA  # noqa: E402
from bench_attention import Pool, n_pools, time_rotating  # noqa: E402

STAMP = 'tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)'
SMID = 'tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)'
# (old, new) source edits, each applied exactly once: a trace pointer argument, five timer reads
# (start, after the PDL wait, before the KV loop, after it, after the epilogue's stores), the stores.
PATCHES = [
    ('    counters,  # [n_qblocks * B * HKV] int32 arrivals, zero between launches (FUSED_MERGE)\n',
     '    counters,  # [n_qblocks * B * HKV] int32 arrivals, zero between launches (FUSED_MERGE)\n    trace,\n'),
    ('    if USE_PDL == 2:  # PDL_EARLY\n        tlc.gdc_launch_dependents()\n    if USE_PDL:\n        tlc.gdc_wait()\n    i_t, i_bh, i_sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)\n',
     '    ts0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)\n    if USE_PDL == 2:  # PDL_EARLY\n        tlc.gdc_launch_dependents()\n    if USE_PDL:\n        tlc.gdc_wait()\n    ts1 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)\n    i_t, i_bh, i_sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)\n    p_tr = trace + ((i_sp * tl.num_programs(1) + i_bh) * tl.num_programs(0) + i_t).to(tl.int64) * 6\n'),
    ('    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)\n    if L2D:',
     '    ts2 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)\n    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)\n    if L2D:'),
    ('    if USE_PDL == 1:  # PDL_LATE: only the epilogue is left\n        tlc.gdc_launch_dependents()\n\n    if L2D:',
     '    ts3 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)\n    if USE_PDL == 1:  # PDL_LATE: only the epilogue is left\n        tlc.gdc_launch_dependents()\n\n    if L2D:'),
    ('        tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_r[:, None])\n\n\n@triton.jit(do_not_specialize=["num_splits"])',
     '        tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_r[:, None])\n    tl.debug_barrier()\n    ts4 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)\n    tl.store(p_tr + 0, tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1).to(tl.int64))\n    tl.store(p_tr + 1, ts0)\n    tl.store(p_tr + 2, ts1)\n    tl.store(p_tr + 3, ts2)\n    tl.store(p_tr + 4, ts3)\n    tl.store(p_tr + 5, ts4)\n\n\n@triton.jit(do_not_specialize=["num_splits"])'),
    ('q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, tm, o, o_part, lse_part, counters,\n',
     'q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, tm, o, o_part, lse_part, counters, TRACE[0],\n'),
    ('def paged_attention(\n',
     'TRACE = [None]\n\n\ndef paged_attention(\n'),
]


def instrumented_attention():
    """kernels_triton.attention with per-program stamps written to TRACE[0] (int64 [programs, 6]:
    SM id, then the five timer reads in ns)."""
    src = (REPO / "kernels_triton" / "attention.py").read_text()
    for old, new in PATCHES:
        if src.count(old) < 1:
            raise RuntimeError(f"trace_attention: kernels_triton/attention.py changed; no match for {old[:60]!r}")
        src = src.replace(old, new, 1)
    tmp = Path(tempfile.mkdtemp()) / "attention_traced.py"
    tmp.write_text(src)
    spec = importlib.util.spec_from_file_location("attention_traced", tmp)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


attn = None


def run(label, B, prefix, T, heads=(9, 3, 64), PS=16, lens=None, **kw):
    """Time one shape (rotating) and trace one call; print the schedule summary. lens: kv_lens per
    request (default prefix + T); kw go to paged_attention."""
    BA.PS = PS

    def inputs(pool):
        a = pool.batch(T)
        if lens is not None:
            a["kv_lens"] = torch.tensor(lens, dtype=torch.int32, device="cuda")
        return a

    pool = Pool(B, prefix, heads, torch.bfloat16, max_T=T)
    pools = [Pool(B, prefix, heads, torch.bfloat16, max_T=T, seed=s) for s in range(1, 1 + n_pools(pool.k_cache.numel() * 4))]
    trace = torch.zeros(B * heads[1] * launch.MAX_SPLITS * T * 6, dtype=torch.int64, device="cuda")
    attn.TRACE[0] = trace
    batches = [inputs(p) for p in pools]
    us = time_rotating([lambda a=a: attn.paged_attention(**a, max_q_len=T, **kw) for a in batches])
    mine = inputs(pool)
    attn.paged_attention(**batches[-1], max_q_len=T, **kw)  # another pool's call just before
    trace.zero_()
    attn.paged_attention(**mine, max_q_len=T, **kw)
    torch.cuda.synchronize()
    tr = trace.view(-1, 6).cpu()
    tr = tr[tr[:, 1] != 0]  # programs that reached the end (empty splits and past-T blocks return early)
    rel = (tr[:, 1:] - tr[:, 1].min()).double() / 1e3  # us from the first program's start
    sm = tr[:, 0]
    per_sm = torch.bincount(sm, minlength=torch.cuda.get_device_properties(0).multi_processor_count)
    pro, loop, epi = rel[:, 2] - rel[:, 1], rel[:, 3] - rel[:, 2], rel[:, 4] - rel[:, 3]
    span = rel[:, 4].max().item()

    def stat(x):
        return f"{x.mean():.2f} ({x.min():.2f}-{x.max():.2f})"

    print(f"{label}: B={B} prefix={prefix} T={T} heads={heads} PS={PS} {kw or ''}")
    print(f"   rotating {us:.2f} us | traced span {span:.2f} us | programs {len(tr)} | SMs holding 0, 1, 2, ... "
          f"programs: {torch.bincount(per_sm).tolist()}")
    print(f"   start {stat(rel[:, 0])} | prologue {stat(pro)} | KV loop {stat(loop)} | epilogue {stat(epi)} us")
    for k in sorted(set(per_sm.tolist()) - {0})[-2:]:
        sel = per_sm[sm] == k
        print(f"   on SMs with {k} program(s): KV loop {loop[sel].mean():.2f} us, end {rel[sel, 4].mean():.2f} "
              f"(last {rel[sel, 4].max():.2f}) us")
    return us


SETS = {
    "schedule": [
        ("tree headline", dict(B=64, prefix=1024, T=16)),
        ("tree headline, page size 64", dict(B=64, prefix=1024, T=16, PS=64)),
        ("tree B=32", dict(B=32, prefix=1024, T=16)),
        ("tree B=88", dict(B=88, prefix=1024, T=16)),
        ("tree B=128", dict(B=128, prefix=1024, T=16)),
        ("tree headline, 2 splits (plan options)", dict(B=64, prefix=1024, T=16, num_splits=2, fused_merge=True,
                                                        merge_chunk=1, maxnreg=168, one_loop=True)),
        ("tree headline, one loop", dict(B=64, prefix=1024, T=16, one_loop=True)),
        ("decode B=1 prefix 512", dict(B=1, prefix=512, T=1)),
        ("decode B=8 prefix 4096", dict(B=8, prefix=4096, T=1)),
        ("decode 32q/8kv d128 B=1 prefix 512", dict(B=1, prefix=512, T=1, heads=(32, 8, 128))),
    ],
    "balance": [
        ("tree headline", dict(B=64, prefix=1024, T=16)),
        ("44 long (17 tiles) first, then 40 of 9 tiles", dict(B=84, prefix=1024, T=16, lens=[1040] * 44 + [528] * 40,
                                                            num_splits=1)),
        ("40 of 9 tiles first, then 44 long", dict(B=84, prefix=1024, T=16, lens=[528] * 40 + [1040] * 44,
                                                 num_splits=1)),
        ("128 of 9 tiles (the headline's halves, no merge)", dict(B=128, prefix=1024, T=16, lens=[528] * 128,
                                                                  num_splits=1)),
        ("44 long, then 60 of 6 tiles", dict(B=104, prefix=1024, T=16, lens=[1040] * 44 + [336] * 60, num_splits=1)),
    ],
}


def main():
    global attn
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default="schedule,balance")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("trace_attention needs a CUDA GPU (PTX %globaltimer / %smid)")
    import triton

    attn = instrumented_attention()
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}, bf16, K/V 9q/3kv d64 unless noted")
    for name in args.sets.split(","):
        print(f"\n== {name}")
        for label, kw in SETS[name]:
            run(label, **kw)


if __name__ == "__main__":
    main()
