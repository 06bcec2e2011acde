"""Kernel switches that are still research questions: one options object, read by the launchers at launch time.

Each switch selects between kernels (or launch settings) that compute the same values. Only open
questions are switches; a variant whose A/B is decided is either the code path or gone (its verdict
is in experiments/results/ledger.csv, the reasons for today's design in docs/kernel_notes.md).

The object is process-global: ``get()`` returns the options in force, ``set_(**fields)`` replaces the
named fields (validated) and returns the previous options, and ``use(**fields)`` does the same for a
``with`` block. Launchers read it on every call, so a change takes effect at the next launch (Triton
compiles one variant per constexpr value and caches each). Launches already recorded in a CUDA graph
keep the options they were captured with: set the options before building an engine.

specdec applies the ``kernels`` config group (conf/kernels/default.yaml) through ``set_`` at the
start of every run, with ``exact`` from ``engine.exact`` (conf/engine/default.yaml: a guarantee of the
engine, not a research switch), and records ``as_dict()`` in the run's metrics.json; the experiment
scripts take the same switches as flags (``add_flags`` / ``set_from_flags_``: ``--pdl off``,
``--fused-linear false``, ``--exact true``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelOptions:
    """The switches, their defaults, and why each is still a question.

    pdl: programmatic dependent launch of the step kernels (attention, split-KV merge, fused linear)
        on sm_90+ (never elsewhere, e.g. under the CPU interpreter): each kernel waits for its
        predecessor before reading its output and lets its successor launch once its main loop is
        done. Open because what the overlap buys differs per GPU, model and Triton version; off is the
        baseline of that measurement (and the way to bisect an ordering bug).
    fused_linear: the small-M fused layer kernels (kernels_triton/linear.py) for decode / draft / verify
        rows on the Triton backend; False: norm kernel + cuBLAS + epilogue kernels. Open because the
        answer depends on the model's shapes (launch-bound small models, bandwidth-bound large ones):
        the unfused composition is the in-run baseline of bench_linear.py and profile_step.py.
    step_kernels: the step's addressing and tree kernels (paging.py, tree_mask.py, tree_grow.py) instead
        of their torch versions. None: wherever the Triton backend runs; True: also on CPU tensors under
        backend "auto" when TRITON_INTERPRET=1 (the engine tests run the kernels this way); False: the
        torch versions everywhere (the references the kernels are checked against).
    fused_rows: the most rows a layer runs on the fused kernels (1 .. MAX_FUSED_ROWS). None: the rule
        in specdec.models.ops (FUSED_MAX_ROWS). Open because where the streaming body meets cuBLAS moves
        whenever its tiles improve (tile tables, new devices): this re-measures the boundary.
    stream_tiles: a tile table (a JSON file: ``load_tiles``) whose entries give the streaming body's
        launch settings (column block, split-K, BLOCK_K, stages, warps, qkv programs per head) for a
        weight shape at a range of rows on one device, over the launchers' rules; settings a caller
        passes still win. "builtin" (the default): the tables packaged in kernels_triton/tiles/, each
        applied on its own device only; None: the rules alone. Open because every new device or model
        shape is tuned by measuring (``experiments/kernels/bench_linear.py --write-tiles``), writing a
        table and A/B-ing it against the rules in the graphed step.
    warp_tiles: the sampling warp kernel's threshold search (kernels_triton/sampling.py, top-k / top-p)
        keeps per-lane sums, minima and maxima over a row's chunks and reduces them once per pass; False:
        three cross-thread reductions per 512-wide chunk (96 per pass at V = 49,152). One program warps a
        row, so at batch 1 the search's 6-10 passes run on one SM: a sampled SmolLM2 step cost 0.64 ms
        more device time than a greedy one on an H100. Open until bench_verify_commit.py --warp and a
        sampled profile_step A/B it on a GPU; the mass sums in another order (equal up to rounding, the
        kept set up to the documented boundary cases).
    fused_moe: the MoE layer's fused launches at decode and verify sizes (kernels_triton/moe.py): RMSNorm,
        router, top-k and grouping in one launch, the combine in the down kernel, three launches a layer;
        False: the RMSNorm kernel and the six-launch path (router, top-k, gate|up, down, combine), which
        prefill and exact mode always take. Open until the graphed Qwen3-30B-A3B-shape step A/Bs it on a
        GPU (``+experiment=step_qwen3 kernels.fused_moe=false,true``); the logits sum the H splits in
        another order (equal up to rounding).
    exact: batch-invariant target kernels (``engine.exact``): every launch that computes a value a
        committed token depends on (projections, LM head, attention, MoE, norms) takes a plan that is a
        function of the weight shape / head shape only, never of the rows M, the batch, the tree or the
        prefill chunk, so a token's logits and KV are bit-identical however it was computed and bf16
        greedy speculative output equals plain greedy output. It replaces the fused small-M layers and
        cuBLAS with one tl.dot GEMM body (kernels_triton/linear_exact.py) and the split-count attention
        with a fixed-order one (kernels_triton/attention_exact.py); specdec.models.ops routes. Off (the
        default): every launch exactly as without the switch. Its cost is measured, not assumed
        (conf/experiment/exact_cost.yaml). The guarantee is the Triton backend's at one rank: the torch
        references (the CPU default) use BLAS, and tensor parallelism's NCCL all-reduce picks its algorithm
        by message size, so neither is row-invariant.
    """

    pdl: bool = True
    fused_linear: bool = True
    step_kernels: bool | None = None
    fused_rows: int | None = None
    stream_tiles: str | None = "builtin"
    warp_tiles: bool = False
    fused_moe: bool = True
    exact: bool = False

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


FIELDS = tuple(f.name for f in dataclasses.fields(KernelOptions))
_BOOL = ("pdl", "fused_linear", "warp_tiles", "fused_moe", "exact")
_TRISTATE = ("step_kernels",)
_ROWS = ("fused_rows",)
_PATHS = ("stream_tiles",)
# Launch settings a tile-table entry may give (the public launchers' config keys of the streaming body).
TILE_KEYS = ("block_n", "split_k", "BLOCK_K", "num_stages", "num_warps", "parts", "programs")
BUILTIN_TILES = "builtin"  # kernel option stream_tiles: the packaged tables (builtin_tile_paths)
MAX_FUSED_ROWS = 64  # kernels_triton/linear.py MAX_M (not imported: options is imported by linear)

_current = KernelOptions()

_WORDS = {"true": True, "on": True, "1": True, "false": False, "off": False, "0": False, "null": None, "auto": None,
          "none": None}


def _validated(name: str, value):
    if name in _BOOL:
        if isinstance(value, str) and _WORDS.get(value.strip().lower()) is not None:  # `kernels.pdl=off`
            value = _WORDS[value.strip().lower()]
        if not isinstance(value, bool):
            raise ValueError(f"kernel option {name}={value!r}; valid: true, false (or on, off)")
        return value
    if name in _ROWS:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 1 <= value <= MAX_FUSED_ROWS):
            raise ValueError(f"kernel option {name}={value!r}; valid: null (the routing rule) or an "
                             f"integer 1..{MAX_FUSED_ROWS}")
        return value
    if name in _PATHS:
        if value is not None:
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"kernel option {name}={value!r}; valid: null, {BUILTIN_TILES!r} or the path of "
                                 "a tile table (JSON)")
            for path in _tile_paths(value):
                load_tiles(path)  # a missing or malformed table fails here, naming the file
        return value
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"kernel option {name}={value!r}; valid: null (wherever Triton runs), true, false")
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


def parse_value(name: str, text: str):
    """A command-line word as the value of option ``name`` (true/false/on/off/1/0, null/auto for the
    tri-state and row options, a path or "builtin" for stream_tiles), validated."""
    if name not in FIELDS:
        raise ValueError(f"unknown kernel option {name!r}; valid: {', '.join(FIELDS)}")
    word = text.strip().lower()
    if name in _PATHS:
        if word in ("null", "none", ""):
            return None
        return _validated(name, BUILTIN_TILES if word == BUILTIN_TILES else text.strip())
    if name in _ROWS:
        if word in ("null", "auto", "none"):
            return None
        try:
            return _validated(name, int(word))
        except ValueError:
            return _validated(name, text)  # raises, naming the valid values
    if word not in _WORDS or (name in _BOOL and _WORDS[word] is None):
        raise ValueError(f"kernel option {name}={text!r}; valid: true, false"
                         + (", null (wherever Triton runs)" if name in _TRISTATE else ""))
    return _validated(name, _WORDS[word])


_FLAG_DOC = {"pdl": "true | false", "fused_linear": "true | false", "step_kernels": "null | true | false",
             "fused_rows": "null | 1..64", "stream_tiles": "null | builtin | PATH of a tile table (JSON)",
             "warp_tiles": "true | false", "fused_moe": "true | false", "exact": "true | false"}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per option (``--pdl``, ``--fused-linear``, ``--step-kernels``, ``--fused-rows``,
    ``--stream-tiles``, ``--exact``); unset flags keep the defaults."""
    group = parser.add_argument_group("kernel options (kernels_triton/options.py)")
    for name in FIELDS:
        group.add_argument("--" + name.replace("_", "-"), dest="kernel_" + name, metavar="VALUE", default=None,
                           help=f"{_FLAG_DOC[name]} (default {getattr(KernelOptions(), name)!r})")


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
