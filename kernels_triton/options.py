"""Kernel research switches: one options object, read by the launchers at launch time.

Every switch here selects between kernels (or launch modes) that compute the same values; they
exist for A/B measurements. Defaults are the measured winners (see docs/kernel_notes.md). The
object is process-global: ``get()`` returns the options in force, ``set_(**fields)`` replaces the
named fields (validated) and returns the previous options, and ``use(**fields)`` does the same for
a ``with`` block. Launchers read it on every call, so a change takes effect at the next launch
(Triton compiles one variant per constexpr value and caches each). Launches already recorded in a
CUDA graph keep the options they were captured with: set the options before building an engine.

specdec applies the ``kernels`` config group (conf/kernels/default.yaml) through ``set_`` at the
start of every run and records ``as_dict()`` in the run's metrics.json; the experiment scripts take
the same switches as flags (``add_flags`` / ``set_from_flags_``: ``--pdl off``, ``--fused-linear false``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from dataclasses import dataclass

PDL_MODES = ("late", "early", "off")
SMALL_M_BODIES = ("auto", "dot", "stream", "stream_prefetch", "stream_inline")  # kernel option small_m
NORM_STATS_MODES = ("off", "loop", "fold")  # kernel option norm_stats


@dataclass(frozen=True)
class KernelOptions:
    """The research switches and their defaults.

    pdl: programmatic dependent launch of the step kernels (attention, split-KV merge, fused
        linear) on sm_90+ (never elsewhere, e.g. under the CPU interpreter): "late" lets the next
        kernel launch once the main loop is done, "early" at the kernel's start, "off" not at all.
    fused_linear: the small-M fused layer kernels (kernels_triton/linear.py) for decode / draft
        rows on the Triton backend; False: the unfused kernels + cuBLAS composition.
    step_kernels: the step's addressing and tree kernels (paging.py, tree_mask.py, tree_grow.py)
        instead of their torch versions. None: wherever the Triton backend runs; True: also on CPU
        tensors under backend "auto" when TRITON_INTERPRET=1 (tests of the engine loop); False:
        the torch versions everywhere.
    fused_merge: split-KV attention merges its partials in the kernel (the last split of a group)
        instead of a second launch. None: the measured default per launch
        (attention_launch.default_fused_merge, and the tree occupancy plan); True / False: forced.
    attn_prewait: with PDL, attention reads its lengths and prefetches its cached prefix into L2
        before it waits for its predecessor.
    pdl_qkv_early: with PDL, the qkv kernel (RoPE epilogue) lets the attention launch at its start.
        None: when its weights are at most linear.QKV_EARLY_MAX_BYTES; True / False: always / never.
    fused_rows: the most rows a layer may run on the small-M fused kernels (1 .. linear.MAX_M = 64).
        None: the measured default (specdec.models.ops.FUSED_MAX_ROWS = 16: batch-1 decode and draft
        rows, verify of a 16-node tree on cuBLAS; with a streaming small_m body
        ops.STREAM_MAX_ROWS = 64); 64 puts the verify of trees up to 63 nodes on them too: 4 instead
        of 8 launches per layer (an A/B switch, profile_step.py --fused-rows).
    gather_rows: layers whose input rows are picked from a table (EAGLE-3's token embeddings in every
        draft round, the accepted path's features for the extend's fc) read them through an index in
        the fused kernel (linear.py, gathered rows) instead of a torch gather (+ clamp, cast) first:
        ~9 fewer launches per 16-node tree step. False: the torch gathers (an A/B switch).
    wide_topk: the draft's top-k log-probabilities (and the plain top-k) over rows wider than
        kernels_triton.topk.MAX_V = 16384 ids (32000-id EAGLE-3 draft vocabularies of Llama-3
        targets, full 128256 / 151936 vocabularies) run as the split-row Triton kernels (2 launches)
        on the Triton backend. False: torch log_softmax + topk there (an A/B switch).
    small_m: the fused kernels' body for more than one row (linear.py; one row keeps the GEMV).
        "dot": the tl.dot body (each K chunk of x loaded, residual-added and normalised right
        before its dot, [rows, K] @ [K, columns]); routing as today (rows <= fused_rows or
        ops.FUSED_MAX_ROWS = 16, weights <= ops.FUSED_MAX_WEIGHT_BYTES). "stream": a prologue launch
        writes the ready rows (RMSNorm(x + residual), the second input's norm, gathered rows) and
        s once, then the GEMM streams only weight and row tiles (swap-AB: [columns, K] @ [K, rows],
        pipelined), with the same epilogues; layers without a norm (wo, w2, fc) take one launch.
        With "stream", rows up to fused_rows or ops.STREAM_MAX_ROWS = 64 (tree verify, EAGLE-3
        draft rounds) and projections of any weight size (Llama-3.1-8B's) take the fused kernels;
        LM heads (more than linear.GEMV_MAX_COLUMNS outputs) keep FUSED_MAX_WEIGHT_BYTES.
        "stream_prefetch": "stream" whose GEMM, launched early under PDL, first asks for its first
        weight columns into L2 (prefetch.global.L2) and only then waits for its inputs, so the weight
        fetch overlaps the prologue / previous kernel (no effect with pdl=off). "stream_inline": one
        launch, no prologue: the streaming body's tiles (swap-AB, split-K) with each row chunk
        residual-added and normalised in the K loop right before its dot (as "dot" does). "auto"
        (the default): "stream_prefetch" for up to ops.AUTO_STREAM_MAX_ROWS = 24 rows (fused_rows
        overrides it) of weights up to ops.FUSED_MAX_WEIGHT_BYTES (SmolLM2's layers: a 16-node tree's
        verify, draft rounds) and, for larger projections (Llama-3.1-8B's), from
        ops.AUTO_STREAM_LARGE_MIN_ROWS = 17 rows (a 16-node tree's verify); norm + cuBLAS + epilogues
        elsewhere (8B draft rounds, small batches): the measured winner (docs/kernel_notes.md, "Fused
        small-M layers").
    norm_stats: where the streaming body runs several rows (tree verify, draft rounds, small
        batches), the projections that close a residual block (wo, w2) add the residual in their
        epilogue and write each column block's sums of squares of the new stream, so the next RMSNorm
        needs no prologue launch (linear.linear_residual, sumsq=). "fold" (the default): the norm
        weight folded into the consumer's weight columns (a copy of wqkv and w13 per layer, made
        once) and 1 / rms applied to the accumulator in the epilogue, so the K loop is the plain
        streaming one (the normalised rows are not rounded on their own); H200 graphed tree16 step
        0.973 vs 1.043 ms off. "loop": the consumer normalises each row chunk in its K loop (the
        prologue's roundings), 1.096 ms: the normalisation between load and dot costs the GEMM more
        than the launch, which the GEMM's weight prefetch hid. "off": the prologue launch.
        (docs/kernel_notes.md "Norm statistics from the producer".)
    split_min_chunks: the streaming body splits its K loop over several programs (split-K, when its
        column blocks leave SMs idle) only when the loop has at least this many BLOCK_K chunks (each
        split keeps two or more). None: linear.SPLIT_MIN_CHUNKS = 8 (H200 graphed tree16 step 0.927
        vs 0.967 ms at 4, the rule before it: SmolLM2's K = 576 loops run whole); an integer 2..64.
    stream_block_n: the streaming body's column block (output columns per program) for plain
        projections (linear.linear / linear_residual: wo, w2, the draft's fc and down projection).
        None: linear.STREAM_PLAIN_BLOCK_N = 64 (H200 graphed tree16 step 0.906 ms vs 0.927 with the
        column rule of the other projections, linear._stream_block_n, which gave SmolLM2's wo 16 or 32);
        16, 32, 64 or 128: that block (an A/B switch).
    stream_tiles: a tile table (a JSON file: ``load_tiles``) whose entries give the streaming body's
        launch settings (column block, split-K, BLOCK_K, stages, warps, qkv programs per head) for a
        weight shape at a range of rows on one device, over the launchers' rules; settings a caller
        passes still win. Written by ``experiments/kernels/bench_linear.py --write-tiles`` from its
        --small-m-grid measurements. "builtin" (the default): the tables packaged in kernels_triton/tiles/,
        each applied on its own device only (docs/kernel_notes.md "Tile tables"); None: the rules alone.
    """

    pdl: str = "late"
    fused_linear: bool = True
    step_kernels: bool | None = None
    fused_merge: bool | None = None
    attn_prewait: bool = True
    pdl_qkv_early: bool | None = None
    fused_rows: int | None = None
    gather_rows: bool = True
    wide_topk: bool = True
    small_m: str = "auto"
    norm_stats: str = "fold"
    split_min_chunks: int | None = None
    stream_block_n: int | None = None
    stream_tiles: str | None = "builtin"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


FIELDS = tuple(f.name for f in dataclasses.fields(KernelOptions))
_BOOL = ("fused_linear", "attn_prewait", "gather_rows", "wide_topk")
_TRISTATE = ("step_kernels", "fused_merge", "pdl_qkv_early")
_ROWS = ("fused_rows",)
_CHUNKS = ("split_min_chunks",)
_BLOCK_N = ("stream_block_n",)
_PATHS = ("stream_tiles",)
# Launch settings a tile-table entry may give (the public launchers' config keys of the streaming body).
TILE_KEYS = ("block_n", "split_k", "BLOCK_K", "num_stages", "num_warps", "parts", "programs")
BUILTIN_TILES = "builtin"  # kernel option stream_tiles: the packaged tables (builtin_tile_paths)
MAX_FUSED_ROWS = 64  # kernels_triton/linear.py MAX_M (not imported: options is imported by linear)

_current = KernelOptions()


def _validated(name: str, value):
    if name == "pdl":
        if value is True:  # `kernels.pdl=true` / `false` from a command line
            return "late"
        if value is False:
            return "off"
        if value not in PDL_MODES:
            raise ValueError(f"kernel option pdl={value!r}; valid: {', '.join(PDL_MODES)} (or true = late, "
                             "false = off)")
        return value
    if name == "norm_stats":
        if value is False:
            return "off"
        if value not in NORM_STATS_MODES:
            raise ValueError(f"kernel option norm_stats={value!r}; valid: {', '.join(NORM_STATS_MODES)}")
        return value
    if name == "small_m":
        if value not in SMALL_M_BODIES:
            raise ValueError(f"kernel option small_m={value!r}; valid: {', '.join(SMALL_M_BODIES)}")
        return value
    if name in _ROWS:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 1 <= value <= MAX_FUSED_ROWS):
            raise ValueError(f"kernel option {name}={value!r}; valid: null (the measured default) or an "
                             f"integer 1..{MAX_FUSED_ROWS}")
        return value
    if name in _CHUNKS:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= 64):
            raise ValueError(f"kernel option {name}={value!r}; valid: null (the measured default) or an integer 2..64")
        return value
    if name in _BLOCK_N:
        if value is not None and (isinstance(value, bool) or value not in (16, 32, 64, 128)):
            raise ValueError(f"kernel option {name}={value!r}; valid: null (the measured default), 16, 32, 64, 128")
        return value
    if name in _PATHS:
        if value is not None:
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"kernel option {name}={value!r}; valid: null, {BUILTIN_TILES!r} or the path of "
                                 "a tile table (JSON)")
            for path in _tile_paths(value):
                load_tiles(path)  # a missing or malformed table fails here, naming the file
        return value
    if name in _BOOL:
        if not isinstance(value, bool):
            raise ValueError(f"kernel option {name}={value!r}; valid: true, false")
        return value
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"kernel option {name}={value!r}; valid: null (the measured default), true, false")
    return value


_tile_cache: dict = {}
_entries_cache: dict = {}


def builtin_tile_paths() -> list[str]:
    """The tile tables packaged with the kernels (kernels_triton/tiles/*.json), in name order."""
    import pathlib

    return [str(p) for p in sorted((pathlib.Path(__file__).parent / "tiles").glob("*.json"))]


def _tile_paths(value: str) -> list[str]:
    return builtin_tile_paths() if value == BUILTIN_TILES else [value]


def tile_entries(value: str, device_name: str) -> tuple:
    """The entries that hold on ``device_name`` of the table(s) the option value names (a path, or
    BUILTIN_TILES: every packaged table), in order; cached per value and device."""
    key = (value, device_name)
    hit = _entries_cache.get(key)
    if hit is None:
        hit = tuple(e for path in _tile_paths(value) for t in (tiles(path),) if t["device"] == device_name
                    for e in t["entries"])
        _entries_cache[key] = hit
    return hit


def load_tiles(path: str) -> dict:
    """The tile table at ``path``, checked (cached while the file is unchanged)::

        {"device": "NVIDIA H200",            # torch.cuda.get_device_name(); "cpu" for CPU tensors
         "source": "...",                    # free text: how the entries were measured
         "entries": [{"n": 576, "k": 1536,   # the weight's shape [n, k] (w.shape)
                      "rows": [16, 24],      # the entry holds for this many rows (inclusive)
                      "config": {"block_n": 16, "split_k": 3, "BLOCK_K": 128, "num_stages": 3}}]}

    ``config`` keys: TILE_KEYS. The first entry that matches a launch's weight shape and rows is used.
    Raises ValueError naming the file and what is wrong with it."""
    import json
    import os

    try:
        stamp = os.stat(path).st_mtime_ns
    except OSError as e:
        raise ValueError(f"kernel option stream_tiles: cannot read the tile table {path!r} ({e.strerror})") from None
    hit = _tile_cache.get(path)
    if hit is not None and hit[0] == stamp:
        return hit[1]

    def bad(why):
        return ValueError(f"kernel option stream_tiles: {path} is not a tile table: {why}")

    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise bad(e) from None
    if not isinstance(table, dict) or not isinstance(table.get("device"), str) \
            or not isinstance(table.get("entries"), list):
        raise bad('expected an object with "device" (a string) and "entries" (a list)')
    entries = []
    for i, e in enumerate(table["entries"]):
        ok = isinstance(e, dict) and all(isinstance(e.get(k), int) and e[k] > 0 for k in ("n", "k")) \
            and isinstance(e.get("rows"), list) and len(e["rows"]) == 2 \
            and all(isinstance(r, int) and r >= 1 for r in e["rows"]) and e["rows"][0] <= e["rows"][1] \
            and isinstance(e.get("config"), dict) and e["config"]
        if not ok:
            raise bad(f'entry {i} needs "n", "k" (positive integers), "rows" ([lo, hi], 1 <= lo <= hi) and a '
                      f'non-empty "config"; got {e!r}')
        unknown = sorted(set(e["config"]) - set(TILE_KEYS))
        if unknown or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in e["config"].values()):
            raise bad(f"entry {i}: config keys must be among {', '.join(TILE_KEYS)} with positive integer values; "
                      f"got {e['config']!r}")
        entries.append({"n": e["n"], "k": e["k"], "rows": tuple(e["rows"]), "config": dict(e["config"])})
    out = {"device": table["device"], "entries": entries, "source": table.get("source", "")}
    _tile_cache[path] = (stamp, out)
    _entries_cache.clear()
    return out


def tiles(path: str) -> dict:
    """load_tiles(path) as read when the option was set (no file check per launch)."""
    hit = _tile_cache.get(path)
    return hit[1] if hit is not None else load_tiles(path)


def validate(**fields) -> KernelOptions:
    """The options in force with ``fields`` replaced, checked; raises ValueError naming a bad field or value."""
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown kernel option(s) {', '.join(unknown)}; valid: {', '.join(FIELDS)}")
    return dataclasses.replace(_current, **{k: _validated(k, v) for k, v in fields.items()})


def get() -> KernelOptions:
    """The kernel options in force."""
    return _current


def set_(**fields) -> KernelOptions:
    """Replace the named fields of the process-wide options (all validated first); returns the previous options."""
    global _current
    new = validate(**fields)
    old, _current = _current, new
    return old


def reset_() -> KernelOptions:
    """Back to the defaults; returns the previous options."""
    global _current
    old, _current = _current, KernelOptions()
    return old


@contextlib.contextmanager
def use(**fields):
    """``with options.use(fused_linear=False): ...``: the named fields replaced inside the block."""
    global _current
    old = set_(**fields)
    try:
        yield _current
    finally:
        _current = old


_WORDS = {"true": True, "on": True, "1": True, "false": False, "off": False, "0": False, "null": None, "auto": None,
          "none": None}


def parse_value(name: str, text: str):
    """A command-line word as the value of option ``name`` (true/false/on/off/1/0, null/auto for the
    tri-state ones, late/early/off for pdl, a body of SMALL_M_BODIES for small_m), validated."""
    word = text.strip().lower()
    if name == "pdl" and word in PDL_MODES:
        return word
    if name in ("small_m", "norm_stats"):
        return _validated(name, word)
    if name in _PATHS:
        if word in ("null", "none", ""):
            return None
        return _validated(name, BUILTIN_TILES if word == BUILTIN_TILES else text.strip())
    if name in _ROWS + _CHUNKS + _BLOCK_N:
        if word in ("null", "auto", "none"):
            return None
        try:
            return _validated(name, int(word))
        except ValueError:
            return _validated(name, text)  # raises, naming the valid values
    if word not in _WORDS:
        raise ValueError(f"kernel option {name}={text!r}; valid: "
                         + ("late, early, off" if name == "pdl" else "true, false"
                            + (", null (the measured default)" if name in _TRISTATE else "")))
    return _validated(name, _WORDS[word])


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per option (``--pdl``, ``--fused-linear``, ``--step-kernels``, ``--fused-merge``,
    ``--attn-prewait``, ``--pdl-qkv-early``, ``--fused-rows``, ``--gather-rows``,
    ``--wide-topk``, ``--small-m``, ``--norm-stats``, ``--split-min-chunks``, ``--stream-block-n``,
    ``--stream-tiles``); unset
    flags keep the defaults."""
    group = parser.add_argument_group("kernel options (kernels_triton/options.py)")
    doc = {"pdl": "late | early | off", "fused_linear": "true | false", "step_kernels": "null | true | false",
           "fused_merge": "null | true | false", "attn_prewait": "true | false", "pdl_qkv_early": "null | true | false",
           "fused_rows": "null | 1..64", "gather_rows": "true | false",
           "wide_topk": "true | false",
           "small_m": "dot | stream | stream_prefetch | stream_inline", "norm_stats": "off | loop | fold",
           "split_min_chunks": "null | 2..64", "stream_block_n": "null | 16 | 32 | 64 | 128",
           "stream_tiles": "null | builtin | PATH of a tile table (JSON)"}
    for name in FIELDS:
        group.add_argument("--" + name.replace("_", "-"), dest="kernel_" + name, metavar="VALUE", default=None,
                           help=f"{doc[name]} (default {getattr(KernelOptions(), name)!r})")


def set_from_flags_(args: argparse.Namespace) -> KernelOptions:
    """Apply the flags of ``add_flags`` that were given (exits with a usage message on a bad value);
    returns the options now in force."""
    fields = {}
    for name in FIELDS:
        text = getattr(args, "kernel_" + name, None)
        if text is not None:
            try:
                fields[name] = parse_value(name, text)
            except ValueError as e:
                raise SystemExit(f"error: --{name.replace('_', '-')}: {e}") from None
    set_(**fields)
    return _current
