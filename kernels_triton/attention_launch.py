"""Launch policy of paged attention (attention.py): tile, split counts, loop shape, merge, PDL.

Every choice here comes from static information only (shapes, dtypes, page-table capacity, SM
count, the kernel option pdl), never from tensor values, so a launch stays CUDA-graph capturable.
``plan`` gathers them for one call; attention.paged_attention launches what it returns. The
choices do not change results (beyond summation order); each was picked by a same-run A/B in
CUDA graphs, and each rule carries its reason here. The measurements behind them and the variants
tried and dropped: docs/kernel_notes.md ("Paged attention").

Names: B requests, HKV KV heads, G query heads per KV head, D head dim, max_q_len the host bound
on the query tokens per request, kv_capacity = MP * PS slots of page-table width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from . import options

MAX_SPLITS = 64  # split-KV cap: bounds the merge kernel's tile and the fp32 workspace
MIN_SPLIT_TILES = 4  # default split-KV keeps >= 4 BLOCK_N tiles of page-table capacity per split
# Fused merge by default only where the merged rows x D are at most this many values (its last
# program then folds >= 8 partials per step); a serial fold of wider rows costs more than the merge
# launch it saves (graphed steps, docs/kernel_notes.md "Fused merge").
FUSED_MERGE_MAX_TILE = 1024
WGMMA_MIN_CAPACITY_D128 = 4096  # 17-32 rows take the wgmma tile at d128 from this page-table capacity
TREE_MIN_SPLIT_TILES = 16  # the tree-tile occupancy plan keeps >= 16 tiles per split (capacity and run time)
TREE_PROGRAMS_PER_SM = {64: 3, 128: 2}  # by head dim, see occupancy_splits
TREE_MAXNREG = 168  # register cap of the d64 tree tile when split (its unsplit count on sm_90)
ONE_LOOP_MAX_TILES = 8  # default one loop for BLOCK_M >= 64 up to this many tiles of capacity per split
MERGE_STEP_VALUES = 8192  # fp32 values the fused merge folds per step (S_CHUNK partials x rows x D)
PDL_LATE, PDL_EARLY = 1, 2  # USE_PDL values: successor launched after the main loop / at the start (pdl_mode)

_SM_COUNT = {}


def sm_count(device) -> int:
    """Streaming multiprocessors of device (a fixed small number on CPU, where the interpreter runs)."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def pdl_mode(device) -> int:
    """Programmatic dependent launch for the step kernels (attention, merge, fused linear): PDL_LATE
    when the kernel option pdl is on and the device is CUDA of compute capability >= 9.0, else 0 (e.g.
    under the CPU interpreter, which has no griddepcontrol).

    A kernel launched this way waits for its predecessor (griddepcontrol.wait) before reading
    anything it wrote and lets its successor launch (launch_dependents) once its main loop is done,
    so the next kernel's weight stream starts during this one's tail. Triggering at the start instead
    lets successors (and theirs) pile up holding SM slots while they wait: slower than no PDL at all.
    The one exception is linear.py's (a small qkv kernel, a prologue whose GEMM prefetches), which
    passes PDL_EARLY itself."""
    if not options.get().pdl or device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return 0
    return PDL_LATE


def launch_config(max_q_len, G, D, dtype=torch.bfloat16, kv_capacity=None) -> dict:
    """Tile sizes and launch options (BLOCK_M, BLOCK_T, BLOCK_N, num_warps, num_stages) from static info.

    BLOCK_M packs BLOCK_T queries x G heads, a power of two >= 16: decode 16 rows, trees and short
    chunks 32-64, prefill 128.
    - 17-32 rows with 16-bit inputs take the one-warpgroup wgmma tile (BLOCK_M = 64) at d <= 64, and
      at d128 from WGMMA_MIN_CAPACITY_D128 slots of capacity (up to 1.66x; at d128 short prefixes
      are faster on mma.sync).
    - BLOCK_M <= 32 (mma.sync, bandwidth-bound): N=64 (32 at d128), 4 warps, 5 stages: two K/V
      buffers in flight (2, 1 or 8 warps slower).
    - BLOCK_M = 64: N=64, 4 warps, 5 stages (3-4 stages 35% slower, 6-10 no better; N=128 needs 255
      registers at d64; docs/kernel_notes.md "Tiles").
    - BLOCK_M = 128 (prefill): 8 warps (4 spill at d64), N=64, 3 stages (2 above d128).
    - fp32 inputs (tests, debugging) run an ieee FMA dot: 8 warps, 2 stages, BLOCK_M <= 64 x N = 32 at
      d64 and 32 x 16 at d128, so nothing spills.
    """
    rows = max_q_len * G
    max_m = 128 if dtype != torch.float32 else (64 if D <= 64 else 32)
    block_m = min(max_m, max(16, triton.next_power_of_2(rows)))
    block_m = max(block_m, triton.next_power_of_2(G))
    if (block_m == 32 and dtype != torch.float32
            and (D <= 64 or (kv_capacity is not None and kv_capacity >= WGMMA_MIN_CAPACITY_D128))):
        block_m = 64  # the wgmma tile, see above
    block_t = block_m // G
    if block_m <= 32:
        cfg = dict(BLOCK_N=64 if D <= 64 else 32, num_warps=4, num_stages=5)
    elif block_m == 64:
        cfg = dict(BLOCK_N=64, num_warps=4, num_stages=5)
    else:
        cfg = dict(BLOCK_N=64, num_warps=8, num_stages=3 if D <= 128 else 2)
    if dtype == torch.float32:
        cfg.update(BLOCK_N=32 if D <= 64 else 16, num_warps=8, num_stages=2)
    return dict(BLOCK_M=block_m, BLOCK_T=block_t, **cfg)


def default_num_splits(B, HKV, D, n_qblocks, kv_capacity, cfg, device) -> int:
    """Split-KV factor that fills every SM once with as many programs as can be resident (~4 per SM
    at BLOCK_M <= 32, 1 for the larger tiles, which split further under occupancy_splits), keeping
    >= MIN_SPLIT_TILES tiles of capacity per split; a power of two (few merge-kernel compiles).

    Capture-safe: it sees the capacity MP * PS, not kv_lens; the kernel divides the request's real
    tiles among the splits, so a short request in a wide table keeps only its first splits busy
    (the others return at once). Trade-offs: docs/kernel_notes.md "Split-KV";
    experiments/kernels/bench_decode_layer.py times split counts side by side.
    """
    base = max(1, B * HKV * n_qblocks)
    per_sm = 4 if cfg["BLOCK_M"] <= 32 else 1  # tree tiles: a 2nd split + merge kernel cost 60% at B=64, T=16
    splits = max(1, (per_sm * sm_count(device)) // base)
    splits = min(splits, max(1, kv_capacity // (MIN_SPLIT_TILES * cfg["BLOCK_N"])), MAX_SPLITS)
    return 1 << (splits.bit_length() - 1)


def occupancy_splits(B, HKV, D, n_qblocks, kv_capacity, cfg, device, dtype) -> int:
    """Split count of the tree-tile occupancy plan (BLOCK_M = 64, 16-bit inputs, D in 64 / 128), or 1.

    A tree program's tiles form a dependent chain (QK wgmma, softmax, PV wgmma), so more programs per
    SM, not bandwidth, lifts throughput: split the KV range until TREE_PROGRAMS_PER_SM programs per
    SM exist, each split keeping >= TREE_MIN_SPLIT_TILES tiles of capacity (and, at run time, of its
    request's tiles). paged_attention launches the plan with the fused merge folding one partial per
    step and, at d64, a TREE_MAXNREG cap (3 programs per SM instead of 2). Up to 1.75x at long
    prefixes; shapes it leaves alone were slower split (B=64 prefix 1024). It applies only where it
    gives more splits than default_num_splits.
    """
    per_sm = TREE_PROGRAMS_PER_SM.get(D)
    if cfg["BLOCK_M"] != 64 or dtype == torch.float32 or per_sm is None:
        return 1
    splits = max(1, (per_sm * sm_count(device)) // max(1, B * HKV * n_qblocks))
    splits = min(splits, max(1, kv_capacity // (TREE_MIN_SPLIT_TILES * cfg["BLOCK_N"])), MAX_SPLITS)
    return 1 << (splits.bit_length() - 1)


def default_split_count(B, HKV, D, n_qblocks, kv_capacity, cfg, device, dtype) -> tuple[int, bool]:
    """(num_splits, plan) that paged_attention launches with num_splits=None: the larger of
    default_num_splits and occupancy_splits; plan is True when the occupancy plan's count wins
    (and with it its launch options)."""
    fill = default_num_splits(B, HKV, D, n_qblocks, kv_capacity, cfg, device)
    occupancy = occupancy_splits(B, HKV, D, n_qblocks, kv_capacity, cfg, device, dtype)
    return (occupancy, True) if occupancy > fill else (fill, False)


def merge_rows(cfg, max_q_len, G) -> int:
    """Rows of the fused merge's tile: pow2 >= the rows a query block can use (<= BLOCK_M)."""
    return triton.next_power_of_2(min(cfg["BLOCK_T"], max_q_len) * G)


def default_l2d(cfg) -> bool:
    """Running softmax sums kept per element of the score tile and reduced once after the loop (L2D)
    at BLOCK_M <= 32, where each row sum is a cross-warp reduction on every tile's chain (decode
    3-4% faster); the wgmma tiles keep row sums, which per-element sums would cost an occupancy step."""
    return cfg["BLOCK_M"] <= 32


def default_one_loop(cfg, kv_capacity, num_splits) -> bool:
    """One loop over all tiles, masking at run time (ONE_LOOP), at BLOCK_M <= 32 and where a split
    holds at most ONE_LOOP_MAX_TILES tiles of capacity; else an unmasked loop then a masked one.
    Two loops restart the pipeline (two more round trips per program), which short programs feel;
    in long wgmma loops the per-tile branch costs more."""
    if cfg["BLOCK_M"] <= 32:
        return True
    return triton.cdiv(triton.cdiv(kv_capacity, cfg["BLOCK_N"]), num_splits) <= ONE_LOOP_MAX_TILES


def default_fused_merge(cfg, max_q_len, G, D) -> bool:
    """Whether split-KV merges in the attention kernel by default: where merged rows x D <=
    FUSED_MERGE_MAX_TILE."""
    return merge_rows(cfg, max_q_len, G) * D <= FUSED_MERGE_MAX_TILE


@dataclass(frozen=True)
class AttentionLaunch:
    """What one paged_attention call launches (see plan)."""

    cfg: dict  # BLOCK_M, BLOCK_T, BLOCK_N, num_warps, num_stages
    n_qblocks: int  # query blocks per request (grid dim 0)
    num_splits: int  # split-KV factor (grid dim 2)
    min_busy_tiles: int  # a busy split takes >= this many of its request's tiles
    fused_merge: bool  # split and merged by the last split (False: a merge kernel follows, if split)
    merge_rows: int  # the fused merge's row tile
    s_chunk: int  # partials the fused merge folds per step
    one_loop: bool
    l2d: bool
    pdl: int  # 0 or PDL_LATE (pdl_mode)
    maxnreg: int | None  # register cap, None: ptxas decides

    @property
    def split(self) -> bool:
        return self.num_splits > 1


def plan(max_q_len, B, HKV, G, D, kv_capacity, dtype, device, *, num_splits=None, fused_merge=None,
         one_loop=None, maxnreg=None, merge_chunk=None, l2d=None, min_busy_tiles=None) -> AttentionLaunch:
    """The launch of one paged_attention call: explicit arguments win, None takes the defaults above
    (with num_splits None and the tree occupancy plan applying, the plan's fused merge, one partial
    per merge step and register cap). Raises ValueError for an out-of-range num_splits or merge_chunk."""
    cfg = launch_config(max_q_len, G, D, dtype, kv_capacity)
    n_qblocks = triton.cdiv(max_q_len, cfg["BLOCK_T"])
    busy = min_busy_tiles
    min_busy_tiles = 1
    if num_splits is None:
        num_splits, occupancy = default_split_count(B, HKV, D, n_qblocks, kv_capacity, cfg, device, dtype)
        if occupancy:  # the tree-tile occupancy plan (see occupancy_splits)
            min_busy_tiles = TREE_MIN_SPLIT_TILES
            fused_merge = True if fused_merge is None else fused_merge
            merge_chunk = 1 if merge_chunk is None else merge_chunk
            if maxnreg is None and D <= 64:
                maxnreg = TREE_MAXNREG
    if busy is not None:
        if not isinstance(busy, int) or busy < 1:
            raise ValueError(f"paged_attention: min_busy_tiles must be an int >= 1, got {busy!r}")
        min_busy_tiles = busy
    if not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"paged_attention: num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    if merge_chunk is not None and (not isinstance(merge_chunk, int) or merge_chunk < 1
                                    or merge_chunk & (merge_chunk - 1)):
        raise ValueError(f"paged_attention: merge_chunk must be a power of two >= 1, got {merge_chunk!r}")
    rows = merge_rows(cfg, max_q_len, G)
    if fused_merge is None:
        fused_merge = default_fused_merge(cfg, max_q_len, G, D)
    block_s = triton.next_power_of_2(num_splits)
    pdl = pdl_mode(device)
    return AttentionLaunch(
        cfg=cfg, n_qblocks=n_qblocks, num_splits=num_splits, min_busy_tiles=min_busy_tiles,
        fused_merge=num_splits > 1 and bool(fused_merge), merge_rows=rows,
        s_chunk=merge_chunk or min(block_s, max(1, MERGE_STEP_VALUES // (rows * D))),
        one_loop=default_one_loop(cfg, kv_capacity, num_splits) if one_loop is None else one_loop,
        l2d=default_l2d(cfg) if l2d is None else bool(l2d),
        pdl=pdl, maxnreg=maxnreg or None,
    )
