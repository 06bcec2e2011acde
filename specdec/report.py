"""Paper-style tables and plots from run directories.

    python -m specdec.report RUN_DIRS... [--out DIR] [--group-by KEYS] [--metrics KEYS] [--ledger PATH | --no-ledger]

Reads every run directory (one holding ``metrics.json`` and ``config.json``, as written by
``python -m specdec.run``) under the given paths, recursively, so a multirun sweep folder works as
is. Each run becomes one flat row: the resolved config and the metrics under dotted keys
(``workload.concurrency``, ``draft.topk``, ``workload.sources.0.limit``, ``output_tok_per_s``,
``accepted_histogram.2``). Where a metric and a config entry share a key, the metric keeps it and
the config value moves to ``config.KEY`` (``device`` is the device the run used, ``config.device``
what was asked for, e.g. ``auto``).

Default report, each part only when the runs hold it:

- Speculation summary (paper style): one row per drafter x policy, one column per workload x
  temperature, cells "τ / speed-up"; when the speculative runs cover two or more such pairs.
- Speculation: one row per workload x target x drafter x policy x temperature: mean accepted length,
  fraction of decode steps that speculated, output tok/s, and the speed-up over the run's own plain
  baseline. That is a run of the same origin (``run_origin``: the run's ``plain/``, served first by
  ``compare_plain``, or else a run of the same sweep folder) that is ``policy=never`` (or
  ``draft=none``) with the same config apart from ``draft.*``, ``policy.*`` and bookkeeping
  (``name``, ``run_dir``, ``logger.*``), on the same device and dtype: a speed-up is only ever a
  ratio of two runs that served the same requests the same way, one after the other. Plain runs of
  other folders (another command, another day) are never pooled in. No such run: "-". A row that
  merges repeats shows the mean of their own speed-ups.
- Acceptance by draft depth (runs whose metrics hold ``acceptance_by_depth``): per method the share
  of draft tokens at depth 1..D the target accepted, and a plot of it; for trees also which sibling
  (by draft rank) the accepted node was (``accepted_rank_by_depth``).
- Throughput vs concurrency: closed-loop runs at two or more ``workload.concurrency`` values; one
  row per config, one column per C (output tok/s), and a plot of tok/s against C (log2 axis).
- Policy envelope: closed-loop sweeps holding policy=never and policy=always runs of one drafter
  at two or more C: per C, each policy's tok/s over the envelope max(never, always) (a table per
  workload x target x drafter, and a plot of tok/s against C with the envelope dashed), and for
  every run the k it held at full load, the share of steps at it, its switches and settle steps
  (steps from the load change until the held k holds; see ``bench.metrics.k_choice``).
- Speculation off (paired): closed-loop policy=never runs with a drafter and draft=none runs at the
  same C (experiment=k0_cost interleaves them): each drafter run's tok/s (and decode-only tok/s) over
  the mean of the draft=none runs adjacent to it in run order, per C and drafter, with the spread of
  the draft=none runs beside it; and every run in order (see ``paired_off_cost``).
- Exact mode's cost (paired): runs with ``engine.exact=true`` beside their twins (the same settings with
  ``engine.exact=false``, same sweep folder; experiment=exact_cost): tok/s of each, their ratio, each mode's
  speed-up over its own plain run, and how many outputs equal plain greedy's at C = 1 of the same mode
  (requests.jsonl, by request id).
- Step time vs weight-bandwidth floor: runs with ``engine.profile_steps`` (metrics ``step_floor``):
  one row per target x decode batch: graphed step ms, the floor (weight bytes / measured copy
  bandwidth) and the fraction of it reached.
- Acceptance after switching back on: ``policy=schedule`` runs: tokens per step of the first
  speculative step after an off period, per mode (draft KV in sync or left behind while off).
- Runs: every config with its headline numbers.
- One accepted-length histogram plot per speculative run, and for a run whose k changed during the
  run (an adaptive policy: ``batch_threshold``, ``goodput``) a plot of its decode batch and chosen
  k against time (from ``steps.jsonl``).

Config keys that differ between runs that would otherwise share a row (``workload.concurrency``,
``engine.max_new_tokens``, ...) become extra columns, so two different runs never merge into one
row; runs with identical configs (repeats) of one origin do, and their numbers are averaged (column
"runs"); identical configs of different origins get a "run dir" column instead. Drafter and Policy
labels show the name and only the options that differ from ``conf/draft/NAME.yaml`` /
``conf/policy/NAME.yaml`` (a null there: the policy's own default), e.g. "goodput profile_context=128".
Rows from random-weight targets are labelled "(random weights)".

Ledger: every figure the tables show is appended, one row per run and metric, to
``experiments/results/ledger.csv`` (``--ledger PATH``, or ``$SPECDEC_LEDGER``; ``--no-ledger``: none):
date, commit and device from the run's provenance, the experiment, its Hydra overrides less
bookkeeping, metric, value, and the run directory (relative to the repository when inside it). A row
whose commit, run directory and metric are there already is not written again.

``--group-by KEYS`` (comma-separated dotted keys) asks for one table instead of the default report:
rows grouped by those values, ``--metrics KEYS`` (default: the headline numbers) averaged per group.
``--metrics`` alone keeps the Runs table's rows (one per config) with those metrics. No plots then.

Writes ``report.md``, ``report.tex`` (booktabs tables, ``\\usepackage{booktabs}``) and the plots
(PNG + PDF; needs matplotlib: ``pip install -e ".[plot]"``) into ``--out`` (default ``./report``),
and prints the markdown. Bad input (a path without runs, malformed JSON, an unknown key) exits 2
with a message naming it.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import difflib
import functools
import json
import math
import os
import re
import sys
import textwrap
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError, SpecdecError

# Config entries that say where or how a run was recorded, not what it measured.
BOOKKEEPING = ("name", "run_dir", "logger.")
# Config entries a speculative run may differ in from its plain-decoding baseline.
SPEC_ONLY = ("draft.", "policy.")
# Metrics that describe the machine, compared like config entries.
CONTEXT_METRICS = ("device", "dtype")
# The setting naming a run's origin (run_origin): shown as a column only where two runs differ in
# nothing else, and part of the key that pairs a run with its baseline.
ORIGIN = "origin"
# Keys shown by the descriptor columns (Workload, Target, Drafter, Policy, T) of every table.
DESCRIBED = ("workload.name", "target.name", "sampling.temperature", "policy.", "draft.name", "acceptance.",
             "target.routing.")

# key -> (markdown header, LaTeX header, scale, kind); kind picks the number format.
METRICS = {
    "output_tok_per_s": ("tok/s", "tok/s", 1.0, "num"),
    "mean_accepted_length": ("acc. len", r"acc.\ len $\tau$", 1.0, "fixed2"),
    "speculating_step_fraction": ("spec. steps", "spec.\\ steps", 100.0, "percent"),
    "mean_ttft_s": ("TTFT ms", "TTFT (ms)", 1e3, "num"),
    "p50_ttft_s": ("p50 TTFT ms", "p50 TTFT (ms)", 1e3, "num"),
    "p99_ttft_s": ("p99 TTFT ms", "p99 TTFT (ms)", 1e3, "num"),
    "mean_tpot_s": ("TPOT ms", "TPOT (ms)", 1e3, "num"),
    "p50_tpot_s": ("p50 TPOT ms", "p50 TPOT (ms)", 1e3, "num"),
    "p99_tpot_s": ("p99 TPOT ms", "p99 TPOT (ms)", 1e3, "num"),
    "mean_batch_size": ("batch", "batch", 1.0, "num"),
    "requests": ("requests", "requests", 1.0, "num"),
    "failed_requests": ("failed", "failed", 1.0, "num"),
}
OVERVIEW_METRICS = ("output_tok_per_s", "mean_ttft_s", "p50_tpot_s", "mean_batch_size",
                    "mean_accepted_length", "speculating_step_fraction")
HEADERS = {"workload.concurrency": "C", "engine.max_new_tokens": "max new", ORIGIN: "run dir"}  # short column names


# --------------------------------------------------------------------------------------- loading
@dataclass
class Run:
    path: Path
    config: dict
    metrics: dict
    row: dict = field(default_factory=dict)       # flat config + metrics: every key a table may show
    settings: dict = field(default_factory=dict)  # what the run did: flat config + device, dtype, origin
    origin: Path | None = None                    # where its baseline comes from (see run_origin)

    def get(self, key: str, default=None):
        return self.row.get(key, default)


def flatten(obj, prefix: str = "") -> dict:
    """Nested dicts -> {"a.b.c": leaf}. Lists of dicts index like Hydra overrides do
    ("workload.sources.0.limit"); a list of plain values stays one value ("engine.graph_buckets")."""
    if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        items = enumerate(obj)
    else:
        items = obj.items() if isinstance(obj, dict) else None
    if items is None or not obj:  # a leaf, or an empty container kept as its own value
        return {prefix: obj} if prefix else {}
    out = {}
    for k, v in items:
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SpecdecError(f"{path}: malformed JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecdecError(f"{path}: cannot read it ({e})") from None
    if not isinstance(data, dict):
        raise SpecdecError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def find_run_dirs(paths) -> list[Path]:
    """Run directories (holding metrics.json) at or below each path, in order, each once."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_file() and p.name == "metrics.json":
            p = p.parent
        if not p.exists():
            raise SpecdecError(f"{p}: no such file or directory")
        if not p.is_dir():
            raise SpecdecError(f"{p}: not a directory; pass run directories (holding metrics.json) "
                               "or folders above them, e.g. outputs/ or multirun/NAME/")
        if (p / "metrics.json").is_file():
            # A run directory is a leaf, apart from the plain baseline a compare_plain run serves first.
            dirs = [p / "plain", p] if (p / "plain" / "metrics.json").is_file() else [p]
        else:
            dirs = sorted({m.parent for m in p.rglob("metrics.json")}, key=_path_sort_key)
        if not dirs:
            raise SpecdecError(f"{p}: no metrics.json in it or below it; is it a run directory "
                               "written by `python -m specdec.run` (or a folder above some)?")
        found += dirs
    seen, unique = set(), []
    for d in found:
        if d.resolve() not in seen:
            seen.add(d.resolve())
            unique.append(d)
    return unique


def find_unfinished(paths) -> list[Path]:
    """Hydra job directories (holding .hydra/) below ``paths`` without metrics.json: runs that failed
    or are still running."""
    out = []
    for p in map(Path, paths):
        if p.is_dir() and not (p / "metrics.json").is_file():
            out += [h.parent for h in p.rglob(".hydra")
                    if h.is_dir() and not (h.parent / "metrics.json").exists()]
    return sorted(set(out), key=_path_sort_key)


def _path_sort_key(p: Path):
    # multirun/NAME/DATE/10 after .../9: numeric path parts compare as numbers
    return [(0, int(s), "") if s.isdigit() else (1, 0, s) for s in p.parts]


def run_origin(path: Path) -> Path:
    """The folder a run shares its provenance with: a ``compare_plain`` run and the ``plain/`` baseline it
    served first share the run's own directory; any other run shares its parent (a Hydra sweep folder,
    whose jobs ran one after the other from one command). A speed-up is only ever taken against a plain
    run of the same origin, and repeats only merge within one origin."""
    path = Path(os.path.abspath(path))
    if (path / "plain" / "metrics.json").is_file():
        return path
    if path.name == "plain" and (path.parent / "metrics.json").is_file():
        return path.parent
    return path.parent


def load_run(path: Path) -> Run:
    metrics = _read_json(path / "metrics.json")
    if not (path / "config.json").is_file():
        raise SpecdecError(f"{path}: metrics.json without config.json; a run directory written by "
                           "`python -m specdec.run` holds both")
    config = _read_json(path / "config.json")
    metrics = {**_step_summary(path, metrics), **metrics}
    flat_cfg, flat_met = flatten(config), flatten(metrics)
    for k in set(flat_cfg) & set(flat_met):  # the measured value keeps the key
        flat_cfg[f"config.{k}"] = flat_cfg.pop(k)
    settings = {k: v for k, v in flat_cfg.items() if not k.startswith(BOOKKEEPING)}
    settings.update({k: metrics.get(k) for k in CONTEXT_METRICS})
    origin = run_origin(path)
    settings[ORIGIN] = origin.name
    row = {"run": str(path), **flat_cfg, **flat_met}
    return Run(path, config, metrics, row, settings, origin)


def _step_summary(path: Path, metrics: dict) -> dict:
    """Speculation numbers from steps.jsonl, for runs whose metrics.json predates them."""
    wanted = ("accepted_histogram", "mean_accepted_length", "speculating_step_fraction")
    steps_file = path / "steps.jsonl"
    if all(k in metrics for k in wanted) or not steps_file.is_file():
        return {}
    from .bench.metrics import StepTrace  # the same definitions the engine logs with

    trace = StepTrace()
    for i, line in enumerate(steps_file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            trace.records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise SpecdecError(f"{steps_file}:{i}: malformed JSON ({e.msg})") from None
    try:
        summary = trace.summary()
    except (KeyError, TypeError) as e:
        raise SpecdecError(f"{steps_file}: a step record lacks a field the engine writes ({e})") from None
    return {k: summary[k] for k in wanted}


def load_runs(paths) -> list[Run]:
    runs = [load_run(d) for d in find_run_dirs(paths)]
    name_origins(runs)
    return runs


def name_origins(runs: list[Run]) -> None:
    """Each run's origin setting as a short name: its folder relative to what all origins share
    (distinct origins keep distinct names)."""
    origins = [r.origin for r in runs if r.origin is not None]
    if not origins:
        return
    common = Path(os.path.commonpath([str(o) for o in origins]))
    for r in runs:
        if r.origin is not None:
            rel = r.origin.relative_to(common)
            r.settings[ORIGIN] = str(rel) if str(rel) != "." else r.origin.name


# ------------------------------------------------------------------------------ describing runs
def _h(v) -> str:
    """Hashable, order-free identity of a config value (lists and dicts included)."""
    return json.dumps(v, sort_keys=True)


CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


@functools.lru_cache(maxsize=None)
def conf_defaults(group: str, name: str) -> dict | None:
    """The options ``conf/GROUP/NAME.yaml`` sets (``policy=goodput``: conf/policy/goodput.yaml), without
    interpolations and mandatory values (``???``); None when there is no such file. Labels leave out what
    a run shares with these: a goodput run reads "goodput profile_context=128", not its 30 options."""
    f = CONF_DIR / group / f"{name}.yaml"
    if not f.is_file():
        return None
    from omegaconf import OmegaConf

    try:
        doc = OmegaConf.to_container(OmegaConf.load(f), resolve=False) or {}
    except Exception:  # an unreadable file: labels then show every option
        return None
    out = {k: v for k, v in doc.items() if not (isinstance(v, str) and (v.startswith("${") or v == "???"))}
    if group == "policy":  # a null in conf/policy takes the policy's own default: that is the default shown
        code = _policy_code_defaults(name)
        out = {k: (code.get(k) if v is None else v) for k, v in out.items()} | {
            k: v for k, v in code.items() if k not in out}
    return out


def _policy_code_defaults(name: str) -> dict:
    """The defaults of policy NAME's options as its code declares them (dataclass fields), {} when they
    cannot be read: ``specdec.policy.defaults(name)`` where it exists, else the fields of the policy's
    dataclasses (its own class, and option classes such as GoodputConfig) among the keys it takes."""
    try:
        from . import policy as pol

        if callable(getattr(pol, "defaults", None)):
            return dict(pol.defaults(name))
        keys = pol.BUILDERS[name][0]
    except Exception:  # no such policy here (a run of an older tree): the conf file alone
        return {}
    out: dict = {}
    for cls in vars(pol).values():
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            continue
        if getattr(cls, "name", None) != name and not cls.__name__.endswith("Config"):
            continue
        for f in dataclasses.fields(cls):
            if f.name in keys and f.default is not dataclasses.MISSING:
                out.setdefault(f.name, f.default)
    return out


def _tree_name(t: dict) -> str:
    """One draft tree shape, short: chain3 (one child per node, 3 deep), tree16(4x5) (16 nodes kept of
    4 children per expanded node, 5 deep)."""
    topk, steps, n = t.get("topk"), t.get("steps"), t.get("num_draft_tokens")
    if topk == 1 and steps == n:
        return f"chain{n}"
    return f"tree{n}({topk}x{steps})"


def _show_option(key: str, v) -> str:
    if key == "trees" and isinstance(v, list) and all(isinstance(t, dict) for t in v):
        return ",".join(map(_tree_name, v))
    return _show(v)


def _params(section: dict, skip=("name", "path"), defaults: dict | None = None) -> str:
    """``key=value`` for the options of ``section`` a label must show: with ``defaults``, only those
    that differ from them (an option the defaults lack shows unless it is off: None, False or 0, as
    an opt-in switch a later config dropped was)."""
    def shown(k, v):
        if k in skip:
            return False
        if defaults is None:
            return True
        if k in defaults:
            return defaults[k] != v
        return v not in (None, False, 0, 0.0)

    return " ".join(f"{k}={_show_option(k, v)}" for k, v in section.items() if shown(k, v))


def is_random(run: Run) -> bool:
    return run.metrics.get("weights", "pretrained") != "pretrained" or bool(
        (run.config.get("target") or {}).get("random_weights"))


def target_label(run: Run) -> str:
    label = target_shape_label(run)
    route = routing_label(run)
    if route:
        label += f", routing: {route}"
    acc = acceptance_label(run)
    return f"{label}, {acc}" if acc else label


def target_shape_label(run: Run) -> str:
    """The target's name (its checkpoint folder's) and "(random weights)" where they are."""
    t = run.config.get("target") or {}
    label = Path(t["path"]).name if t.get("path") else str(t.get("name", "?"))
    if is_random(run):
        tag = run.metrics.get("weights") or "random weights"
        if tag not in label:  # llama31_8b_random already says it in its name
            label += f" ({tag})"
    return label


def routing_label(run: Run) -> str:
    """How a random-weight MoE target's tokens picked experts (metrics.json ``routing``, specdec/models/routing.py):
    "random router" (no steering), "uniform" (steered, independent draws) or e.g. "zipf s=1.2 reuse 0.5"; "" for
    a dense target or a real router."""
    r = run.metrics.get("routing")
    if not isinstance(r, dict):
        # runs from before metrics.json held the routing: a random-weight MoE target was the random router's
        t = run.config.get("target") or {}
        return "random router" if is_random(run) and (t.get("config") or {}).get("num_experts") else ""
    if r.get("kind") == "uniform" and "keep" not in r and "skew" not in r:
        return "random router"  # runs from before kind router named the unsteered random router "uniform"
    return str(r.get("label") or "")


ROUTING_ORDER = ("", "random router", "uniform")  # dense, then the MoE routings in this order, then zipf ones
ROUTING_STYLE = {"": "-", "random router": "-", "uniform": "--"}  # any other (zipf): ":"


def _routing_rank(route: str) -> tuple:
    return (ROUTING_ORDER.index(route) if route in ROUTING_ORDER else len(ROUTING_ORDER), route)


def _target_routing_rank(key: tuple) -> tuple:
    """(target, routing) keys in report order: dense targets first, then each MoE target's routings in
    ROUTING_ORDER."""
    target, route = key
    return (route != "", target, _routing_rank(route))


def is_replayed(run: Run) -> bool:
    """The run's accepted lengths were replayed from a trace (specdec.acceptance), not the target's."""
    return run.metrics.get("acceptance") == "replayed" or (run.config.get("acceptance") or {}).get("name") == "replay"


def acceptance_label(run: Run) -> str:
    """"replayed acceptance (SOURCE)" for a replayed run, naming its trace briefly; "" otherwise."""
    if not is_replayed(run):
        return ""
    acc = run.config.get("acceptance") or {}
    par = acc.get("parametric") or {}
    if par.get("mean") is not None:
        src = f"parametric, mean {par['mean']:g} at depth {par.get('depth', 7)}"
    elif acc.get("trace"):
        src = Path(str(acc["trace"])).name or str(acc["trace"])
    else:
        src = str(run.metrics.get("acceptance_trace", "trace"))
    return f"replayed acceptance ({src})"


def drafter_label(run: Run) -> str:
    d = run.config.get("draft") or {}
    if d.get("weight_dtype") == "auto" and run.metrics.get("draft_weight_dtype"):  # what auto resolved to
        d = {**d, "weight_dtype": run.metrics["draft_weight_dtype"]}
    if d.get("weight_dtype") in ("model", "auto"):  # the bf16 head says nothing (labels match runs before the key)
        d = {k: v for k, v in d.items() if k != "weight_dtype"}
    name = str(d.get("name", "none"))
    defaults = conf_defaults("draft", name)
    if d.get("random"):  # draft=eagle3_random: its shape follows the target; the label says random
        skip = ("name", "path", "random", "draft_vocab_size", "target_layers", "logit_std")
        return f"{name} (random head) {_params(d, skip, defaults)}".strip()
    return f"{name} {_params(d, defaults=defaults)}".strip()


def policy_label(run: Run) -> str:
    """The policy's name and the options it ran with that differ from conf/policy/NAME.yaml."""
    p = {k: v for k, v in (run.config.get("policy") or {}).items() if v is not None}  # null: the default
    name = str(p.get("name", "never"))
    return f"{name} {_params(p, defaults=conf_defaults('policy', name))}".strip()


def is_baseline(run: Run) -> bool:
    return run.get("policy.name", "never") == "never" or run.get("draft.name", "none") == "none"


def is_spec(run: Run) -> bool:
    return not is_baseline(run)


def descriptors(run: Run) -> dict:
    """The label columns every table starts from."""
    return {"Workload": str(run.get("workload.name", "?")), "Target": target_label(run),
            "Drafter": drafter_label(run), "Policy": policy_label(run),
            "T": _show(run.get("sampling.temperature", 0.0))}


def _described(key: str) -> bool:
    if key.startswith("draft."):
        return key != "draft.path"  # every draft field but the path is in the Drafter label
    return key.startswith(DESCRIBED)


def distinguishing_keys(runs: list[Run], ignore=()) -> list[str]:
    """Setting keys that differ between runs with the same descriptors: they need a column.

    A key some runs lack (written by an older specdec) is no difference by itself.
    """
    groups: dict[tuple, list[Run]] = {}
    for r in runs:
        groups.setdefault(tuple(descriptors(r).values()), []).append(r)
    keys = set()
    for rs in groups.values():
        for k in set().union(*(r.settings for r in rs)):
            if len({_h(r.settings[k]) for r in rs if k in r.settings}) > 1:
                keys.add(k)
    keys = {k for k in keys if not _described(k) and k not in ignore and k not in CONTEXT_METRICS}
    if ORIGIN in keys and not origin_needed(runs):
        keys.discard(ORIGIN)
    return sorted(keys, key=lambda k: (k != "workload.concurrency", k))


def origin_needed(runs: list[Run]) -> bool:
    """Whether two runs of different origin differ in nothing else: then the origin is a column of
    their tables (they are separate rows, never averaged together)."""
    seen: dict[str, str] = {}
    for r in runs:
        key = _h({k: v for k, v in r.settings.items() if k != ORIGIN})
        if seen.setdefault(key, r.settings.get(ORIGIN)) != r.settings.get(ORIGIN):
            return True
    return False


REPEAT_KEYS = ("seed",)  # settings that only repeat a run: a sweep over C averages its repeats


def follows_concurrency(runs: list[Run], key: str) -> bool:
    """Whether ``key`` varies with the closed-loop C alone: runs of one C share its value and runs of
    different Cs do not all share it (a setting resolved from C, e.g. policy_envelope's
    ``engine.max_batch_size: ${specdec.or:${workload.concurrency},256}``). Such a key is part of the
    sweep over C, not a study setting of its own."""
    by: dict = {}
    for r in runs:
        if key in r.settings and _concurrency(r) is not None:
            by.setdefault(_concurrency(r), set()).add(_h(r.settings[key]))
    return len(by) > 1 and all(len(v) == 1 for v in by.values()) and len(set().union(*by.values())) > 1


def _swept_keys(runs: list[Run]) -> list[str]:
    """distinguishing_keys of a sweep over C, less C itself, the keys that follow it and the keys
    that only repeat a run (REPEAT_KEYS: ``seed=0,1,2`` repeats every point; the tables average them)."""
    return [k for k in distinguishing_keys(runs, ignore=("workload.concurrency", *REPEAT_KEYS))
            if not follows_concurrency(runs, k)]


def _baseline_key(run: Run) -> str:
    return _h({k: v for k, v in run.settings.items() if not k.startswith(SPEC_ONLY)})


def baselines(run: Run, runs: list[Run]) -> list[Run]:
    """The plain run(s) ``run`` is measured against: same origin (its own ``plain/``, or the plain
    run of its sweep point) and the same settings apart from draft and policy; draft=none preferred
    over policy=never with a drafter. Several: repeats of one sweep point."""
    key = _baseline_key(run)
    matches = [b for b in runs if is_baseline(b) and _baseline_key(b) == key]
    return [b for b in matches if b.get("draft.name", "none") == "none"] or matches


def baseline_tok_s(run: Run, runs: list[Run]) -> float | None:
    """Output tok/s of the plain run(s) matching ``run`` (mean of repeats of its sweep point)."""
    return _mean(b.metrics.get("output_tok_per_s") for b in baselines(run, runs))


def speedup(run: Run, runs: list[Run]) -> float | None:
    """``run``'s output tok/s over its own baseline's (None: no baseline among ``runs``)."""
    tok, base = run.metrics.get("output_tok_per_s"), baseline_tok_s(run, runs)
    return tok / base if _is_num(tok) and base else None


# ----------------------------------------------------------------------------------- formatting
def _show(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    if isinstance(v, str) and v.startswith("torch."):
        return v[len("torch."):]  # dtype "torch.float32" -> "float32"
    return str(v)


def _finite(values) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]


def _mean(values) -> float | None:
    xs = _finite(values)
    return sum(xs) / len(xs) if xs else None


def _best(values) -> float | None:
    return max(_finite(values), default=None)


def format_column(values: list, kind: str = "num") -> list[str]:
    """One precision per column, so numbers line up: 1234 | 123.4 | 12.3 | 1.23 | 0.0123."""
    nums = [v for v in values if v is not None]
    if kind == "fixed2":
        return [f"{v:.2f}" if v is not None else "-" for v in values]
    if kind == "percent":
        return [f"{v:.0f}%" if v is not None else "-" for v in values]
    if kind == "percent_of":  # a fraction (0.889) shown as a percentage with one decimal
        return [f"{100 * v:.1f}%" if v is not None else "-" for v in values]
    if kind == "speedup":
        return [f"{v:.2f}×" if v is not None else "-" for v in values]
    if nums and all(isinstance(v, int) and not isinstance(v, bool) for v in nums):
        return [str(v) if v is not None else "-" for v in values]
    top = max((abs(v) for v in nums), default=0.0)
    if top >= 1000:
        dec = 0
    elif top >= 10:
        dec = 1
    elif top >= 1:
        dec = 2
    elif top > 0:
        dec = min(6, 2 - math.floor(math.log10(top)))  # three significant digits
    else:
        dec = 2
    return [f"{v:.{dec}f}" if v is not None else "-" for v in values]


def _sort_key(values) -> list:
    """Numbers numerically (C = 2 before 16), then strings, missing last."""
    out = []
    for v in values:
        if _is_num(v):
            out.append((0, float(v), ""))
        elif v is None or v == "-":
            out.append((2, 0.0, ""))
        else:
            out.append((1, 0.0, str(v)))
    return out


# --------------------------------------------------------------------------------------- tables
@dataclass
class Column:
    header: str
    tex: str | None = None  # LaTeX header (raw); default: the escaped markdown header
    align: str = "l"


@dataclass
class Table:
    title: str
    caption: str
    label: str
    columns: list[Column]
    rows: list[list[str]]
    span: tuple[str, int] | None = None  # LaTeX header over columns [span[1]:], e.g. "tok/s at C"
    notes: list[str] = field(default_factory=list)
    # (run, metric, value): the per-run numbers behind the cells, one ledger row each
    figures: list[tuple[Run, str, object]] = field(default_factory=list)


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
        "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
        "<": r"\textless{}", ">": r"\textgreater{}",
        "×": r"$\times$", "τ": r"$\tau$", "≤": r"$\leq$", "≥": r"$\geq$"}


def tex_escape(s: str) -> str:
    return "".join(_TEX.get(c, c) for c in str(s))


def to_markdown(t: Table) -> str:
    cells = [[c.header for c in t.columns]] + t.rows
    cells = [[str(x).replace("|", r"\|").replace("\n", " ") for x in row] for row in cells]
    widths = [max(3, *(len(row[i]) for row in cells)) for i in range(len(t.columns))]

    def line(row):
        return "| " + " | ".join(x.rjust(w) if c.align == "r" else x.ljust(w)
                                 for x, w, c in zip(row, widths, t.columns)) + " |"

    rule = "| " + " | ".join(("-" * (w - 1) + ":") if c.align == "r" else ("-" * w)
                             for w, c in zip(widths, t.columns)) + " |"
    out = [f"## {t.title}", "", t.caption, "", line(cells[0]), rule, *map(line, cells[1:])]
    if t.notes:
        out += [""] + t.notes
    return "\n".join(out)


def to_latex(t: Table) -> str:
    cols = "".join(c.align for c in t.columns)
    head = [c.tex if c.tex is not None else tex_escape(c.header) for c in t.columns]
    out = [f"% {t.title}", r"\begin{table}[t]", r"\centering",
           rf"\caption{{{tex_escape(t.caption)}}}", rf"\label{{tab:{t.label}}}",
           rf"\begin{{tabular}}{{{cols}}}", r"\toprule"]
    if t.span is not None:
        text, first = t.span
        n = len(t.columns)
        out.append(" & " * first + rf"\multicolumn{{{n - first}}}{{c}}{{{text}}} \\")
        out.append(rf"\cmidrule(lr){{{first + 1}-{n}}}")
    out.append(" & ".join(head) + r" \\")
    out.append(r"\midrule")
    out += [" & ".join("--" if x == "-" else tex_escape(x) for x in row) + r" \\" for row in t.rows]
    out += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    return "\n".join(out)


def _context(runs: list[Run]) -> tuple[str, list[str]]:
    """Device and dtype: a caption phrase when one value, else keys needing a column."""
    phrase, varying = [], []
    for k in CONTEXT_METRICS:
        vals = sorted({_show(r.metrics.get(k)) for r in runs})
        if len(vals) == 1:
            if vals[0] != "-":
                phrase.append(vals[0])
        else:
            varying.append(k)
    return ", ".join(phrase), varying


def _merge(runs: list[Run], key_fn) -> list[tuple[tuple, list[Run]]]:
    """Runs with equal keys (a tuple of values, lists allowed) as (key, runs), sorted by key."""
    groups: dict[str, tuple[tuple, list[Run]]] = {}
    for r in runs:
        key = key_fn(r)
        groups.setdefault(_h(key), (key, []))[1].append(r)
    return sorted(groups.values(), key=lambda kv: _sort_key(kv[0]))


def _label_values(r: Run, desc: list[str], extras: list[str]) -> tuple:
    d = descriptors(r)
    return tuple(d[c] for c in desc) + tuple(r.settings.get(k) for k in extras)


def _label_columns(desc: list[str], extras: list[str]) -> list[Column]:
    return [Column(c, "$T$" if c == "T" else None) for c in desc] + [
        Column(HEADERS.get(k, k), "$C$" if k == "workload.concurrency" else None,
               "r" if k == "workload.concurrency" else "l") for k in extras]


def _describe(columns: list[Column], key: tuple, keep=None) -> str:
    """A row's label for plots: "humaneval, ngram ..., always k=5, T=0, C=4"."""
    parts = []
    for i, (c, v) in enumerate(zip(columns, key)):
        if keep is None or i in keep:
            named = c.header in ("Workload", "Target", "Drafter", "Policy")
            parts.append(_show(v) if named else f"{c.header}={_show(v)}")
    return ", ".join(parts)


def speculation_table(runs: list[Run]) -> tuple[Table, list[tuple[str, Run]]] | None:
    """Speculative runs against their plain baselines; also returns (label, run) per spec run."""
    spec = [r for r in runs if is_spec(r)]
    if not spec:
        return None
    context, ctx_keys = _context(spec)
    extras = distinguishing_keys(spec) + ctx_keys
    desc = ["Workload", "Target", "Drafter", "Policy", "T"]
    groups = _merge(spec, lambda r: _label_values(r, desc, extras))
    acc = [_mean(r.metrics.get("mean_accepted_length") for r in rs) for _, rs in groups]
    frac = [_mean(r.metrics.get("speculating_step_fraction") for r in rs) for _, rs in groups]
    frac = [None if f is None else 100 * f for f in frac]
    tok = [_mean(r.metrics.get("output_tok_per_s") for r in rs) for _, rs in groups]
    # Each run over its own baseline, then the mean over a row's runs (repeats of one origin).
    base = [_mean(baseline_tok_s(r, runs) for r in rs) for _, rs in groups]
    speedups = [_mean(speedup(r, runs) for r in rs) for _, rs in groups]
    n = [len(rs) for _, rs in groups]
    columns = _label_columns(desc, extras) + [
        Column("acc. len", r"acc.\ len $\tau$", "r"), Column("spec. steps", r"spec.\ steps", "r"),
        Column("tok/s", None, "r"), Column("baseline tok/s", None, "r"),
        Column("speedup", None, "r")]
    tok_base = format_column(tok + base)  # one precision for both tok/s columns
    cols = [format_column(acc, "fixed2"), format_column(frac, "percent"), tok_base[:len(tok)],
            tok_base[len(tok):], format_column(speedups, "speedup")]
    if max(n) > 1:
        columns.append(Column("runs", None, "r"))
        cols.append([str(x) for x in n])
    rows = [[_show(v) for v in key] + [c[i] for c in cols] for i, (key, _) in enumerate(groups)]
    caption = ("Speculative decoding: mean accepted length τ (tokens committed per verify step and "
               "request, bonus token included), share of decode steps that speculated, output tok/s, "
               "and speed-up over the run's own plain-decoding baseline (its plain/ run, or the "
               "policy=never or draft=none run of its sweep with the same config otherwise)"
               + (f"; {context}" if context else "") + ".")
    notes = []
    if any(b is None for b in base):
        notes.append("-: no plain-decoding run of the same origin (the run's plain/ or its sweep folder) "
                     "with the same config apart from draft and policy was among the inputs.")
    label_cols = columns[:len(desc) + len(extras)]
    hist_runs = [(_describe(label_cols, key), r) for key, rs in groups for r in rs]
    figures = _figures(spec, ("mean_accepted_length", "speculating_step_fraction", "output_tok_per_s"))
    for r in spec:
        base, sp = baseline_tok_s(r, runs), speedup(r, runs)
        if base is not None:
            figures += [(r, "plain_output_tok_per_s", base), (r, "speedup_over_plain", sp)]
    return Table("Speculation", caption, "speculation", columns, rows, notes=notes, figures=figures), hist_runs


def speculation_summary(runs: list[Run]) -> Table | None:
    """Paper-style matrix: one row per drafter x policy (x target and other settings), one column
    per workload x temperature, each cell "τ / speed-up". Only when the speculative runs cover two
    or more (workload, temperature) pairs; the long-form Speculation table keeps every number."""
    spec = [r for r in runs if is_spec(r)]
    combos = sorted({(str(r.get("workload.name", "?")), r.get("sampling.temperature", 0.0)) for r in spec},
                    key=lambda c: _sort_key(list(c)))
    if len(combos) < 2:
        return None
    context, ctx_keys = _context(spec)
    extras = distinguishing_keys(spec) + ctx_keys
    desc = ["Target", "Drafter", "Policy"]
    groups = _merge(spec, lambda r: _label_values(r, desc, extras))
    targets = {key[0] for key, _ in groups}
    keep = [i for i, c in enumerate(desc) if not (c == "Target" and len(targets) == 1)]
    label_cols = _label_columns(desc, extras)
    columns = [label_cols[i] for i in keep] + label_cols[len(desc):]
    columns += [Column(f"{w} T={_show(t)}", tex_escape(f"{w} ") + f"$T={_show(t)}$", "r") for w, t in combos]
    rows = []
    for key, rs in groups:
        cells = []
        for w, t in combos:
            cell = [r for r in rs if (str(r.get("workload.name", "?")), r.get("sampling.temperature", 0.0)) == (w, t)]
            acc = _mean(r.metrics.get("mean_accepted_length") for r in cell)
            sp = _mean(speedup(r, runs) for r in cell)
            cells.append("-" if acc is None and sp is None else
                         f"{format_column([acc], 'fixed2')[0]} / {format_column([sp], 'speedup')[0]}")
        rows.append([_show(key[i]) for i in keep] + [_show(v) for v in key[len(desc):]] + cells)
    only = f" (target {next(iter(targets))})" if len(targets) == 1 else ""
    caption = ("Mean accepted length τ / speed-up over plain decoding of the same config, per workload "
               f"and temperature{only}" + (f"; {context}" if context else "") + ".")
    return Table("Speculation summary", caption, "speculation-summary", columns, rows)


def _concurrency(r: Run):
    c = r.get("workload.concurrency")
    closed = r.get("workload.mode", "closed") == "closed"
    return c if closed and isinstance(c, int) and not isinstance(c, bool) else None


def concurrency_table(runs: list[Run]) -> tuple[Table, list[tuple[str, list, list]], str] | None:
    """Closed-loop tok/s per config (rows) and concurrency C (columns); None below two C values.

    Also returns the plot's series (label, C values, tok/s) and what all of them share (its title).
    """
    swept = [r for r in runs if _concurrency(r) is not None]
    cs = sorted({_concurrency(r) for r in swept})
    if len(cs) < 2:
        return None
    context, ctx_keys = _context(swept)
    extras = _swept_keys(swept) + ctx_keys
    desc = [c for c in ("Workload", "Target", "Drafter", "Policy", "T")
            if c in ("Target", "Drafter", "Policy") or len({descriptors(r)[c] for r in swept}) > 1]
    fixed = [("workload " if c == "Workload" else "T = ") + descriptors(swept[0])[c]
             for c in ("Workload", "T") if c not in desc]
    groups = _merge(swept, lambda r: _label_values(r, desc, extras))
    grid = [[_mean(r.metrics.get("output_tok_per_s") for r in rs if _concurrency(r) == c) for c in cs]
            for _, rs in groups]
    flat = format_column([v for row in grid for v in row])
    columns = _label_columns(desc, extras) + [Column(f"C={c}", str(c), "r") for c in cs]
    rows = [[_show(v) for v in key] + flat[i * len(cs):(i + 1) * len(cs)]
            for i, (key, _) in enumerate(groups)]
    caption = ("Output tok/s against closed-loop concurrency C (requests in flight)"
               + "".join(f"; {x}" for x in fixed + ([context] if context else [])) + ".")
    # Legend labels name only what differs between the rows (the policy when nothing does).
    label_cols = columns[:len(desc) + len(extras)]
    keep = [i for i in range(len(label_cols)) if len({_h(key[i]) for key, _ in groups}) > 1]
    keep = keep or [desc.index("Policy")]
    series = [(_describe(label_cols, key, keep), cs, vals) for (key, _), vals in zip(groups, grid)]
    target = desc.index("Target")  # a shared target goes in the title: "(random weights)" stays visible
    shared = ([groups[0][0][target]] if target not in keep else []) + fixed + ([context] if context else [])
    table = Table("Throughput vs concurrency", caption, "concurrency", columns, rows,
                  span=("output tok/s at concurrency $C$", len(columns) - len(cs)),
                  figures=_figures(swept, ("output_tok_per_s",)))
    return table, series, ", ".join(shared)


def _k_choice(run: Run) -> dict:
    """k_choice numbers of a run: from metrics.json, else from its steps.jsonl."""
    if "steady_k" in run.metrics:
        return run.metrics
    path = run.path / "steps.jsonl"
    if not path.is_file():
        return {}
    from .bench.metrics import k_choice

    try:
        return k_choice([json.loads(line) for line in path.read_text().splitlines() if line.strip()])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise SpecdecError(f"{path}: unreadable step records ({e})") from None


def _steady(rs: list[Run]) -> bool:
    """Whether every run of a study served a timed closed loop (workload.duration_s) and has its
    steady-window throughput: the envelope tables then compare that, not whole-run tok/s."""
    return bool(rs) and all(r.metrics.get("duration_s") is not None and _is_num(r.metrics.get("steady_tok_per_s"))
                            for r in rs)


def _steady_note(rs: list[Run]) -> str:
    """The caption's words for the throughput an envelope table compares."""
    if not _steady(rs):
        return "output tok/s"
    warm = sorted({r.metrics.get("steady_warmup_s") for r in rs}, key=str)
    dur = sorted({r.metrics.get("duration_s") for r in rs}, key=str)
    stagger = "" if not any(r.get("workload.stagger") for r in rs) else (
        ", first round staggered (workload.stagger)" if all(r.get("workload.stagger") for r in rs) else
        ", first round staggered in some runs (workload.stagger)")
    return (f"steady-window output tok/s (timed closed loop of {'/'.join(_show(d) for d in dur)} s{stagger}; tokens "
            f"committed from {'/'.join(_show(w) for w in warm)} s after the first send to the last send, so the "
            "ramp-up and the drain are left out; whole-run tok/s in the Runs table)")


def _tok_key(rs: list[Run]) -> str:
    """The tok/s metric a study compares: the steady window's when every run has one, else the whole run's."""
    return "steady_tok_per_s" if _steady(rs) else "output_tok_per_s"


def _policy_envelope(rs: list[Run], stat=_mean):
    """Mean (``stat``: another reduction, e.g. _best) tok/s per policy label and C over runs of one study,
    with the envelope max(never, always) per C. Returns (tok {policy: {C: tok/s}}, policy names, Cs,
    envelope {C: tok/s}, policies in table order: never, always, then the rest), or None without both a
    never and an always run (one C is enough: a repeated point). tok/s is the steady window's when every
    run of the study has one (``_steady``), else the whole run's."""
    by: dict[str, dict[int, list]] = {}
    names = {}
    key = _tok_key(rs)
    for r in rs:
        by.setdefault(policy_label(r), {}).setdefault(_concurrency(r), []).append(r.metrics.get(key))
        names[policy_label(r)] = r.get("policy.name", "never")
    tok = {p: {c: stat(v) for c, v in cs.items()} for p, cs in by.items()}
    bounds = [p for p in tok if names[p] in ("never", "always")]
    cs = sorted({c for v in tok.values() for c in v})
    if not any(names[p] == "never" for p in bounds) or not any(names[p] == "always" for p in bounds) or not cs:
        return None
    env = {c: max((tok[p][c] for p in bounds if tok[p].get(c) is not None), default=None) for c in cs}
    order = sorted(tok, key=lambda p: (names[p] not in ("never", "always"), names[p] != "never", p))
    return tok, names, cs, env, order


def _envelope_rows(tok, env, cs, order) -> list[list[str]]:
    """Each policy's tok/s over the envelope at every C, its min and max, then the envelope's tok/s."""
    rows = []
    for p in order:
        ratios = [None if tok[p].get(c) is None or not env[c] else tok[p][c] / env[c] for c in cs]
        got = [x for x in ratios if x is not None]
        rows.append([p] + [f"{x:.3f}" if x is not None else "-" for x in ratios]
                    + [f"{min(got):.3f}" if got else "-", f"{max(got):.3f}" if got else "-"])
    rows.append(["envelope tok/s"] + format_column([env[c] for c in cs]) + ["", ""])
    return rows


def envelope_tables(runs: list[Run]) -> list[tuple]:
    """Per study (workload x target x drafter x temperature x other settings, swept over C): each
    policy's tok/s divided by the envelope max(never, always) at every C, plus the k each run held.
    Returns (table, plot series incl. the envelope, plot title, k-choice table or None, and with repeated
    runs the run-to-run spread table and the envelope of each point's best run, a list, else None) per study
    with both never and always."""
    swept = [r for r in runs if _concurrency(r) is not None and r.get("draft.name", "none") != "none"]
    if not swept:
        return []
    extras = [k for k in _swept_keys(swept) if not k.startswith("policy.")]

    def study_key(r: Run) -> tuple:
        d = descriptors(r)
        return (d["Workload"], d["Target"], d["Drafter"], d["T"], *(_h(r.get(k)) for k in extras))

    out = []
    for key, rs in _merge(swept, study_key):
        study = _policy_envelope(rs)
        if study is None:
            continue
        tok, names, cs, env, order = study
        columns = [Column("Policy", None, "l")] + [Column(f"C={c}", str(c), "r") for c in cs] + [
            Column("min", None, "r"), Column("max", None, "r")]
        rows = _envelope_rows(tok, env, cs, order)
        label = f"{key[0]}, {key[1]}, {key[2]}" + (f", T = {key[3]}" if key[3] not in ("0.0", "0") else "")
        label += "".join(f", {k}={json.loads(v) if v != 'null' else None}" for k, v in zip(extras, key[4:]))
        counts = Counter((policy_label(r), _concurrency(r)) for r in rs)
        lo, hi = min(counts.values()), max(counts.values())
        repeats = "" if hi == 1 else f" Each point is the mean of {lo if lo == hi else f'{lo}-{hi}'} runs."
        caption = (f"Policy envelope ({label}): {_steady_note(rs)} of each policy over max(never, always) at "
                   f"closed-loop concurrency C; min / max over C.{repeats} Target: >= 0.98 at every C and >= 1.05 "
                   "somewhere.")
        table = Table(f"Policy envelope: {label}", caption, f"envelope{len(out) + 1}", columns, rows)
        tkey = _tok_key(rs)
        table.figures = [(r, f"{tkey}_over_envelope", r.metrics[tkey] / env[_concurrency(r)]) for r in rs
                         if _is_num(r.metrics.get(tkey)) and env.get(_concurrency(r))]
        series = [(p, cs, [tok[p].get(c) for c in cs]) for p in order]
        series.append(("envelope max(never, always)", cs, [env[c] for c in cs]))
        # What each adaptive run held at full load, and how fast it got there.
        kcols = [Column("Policy", None, "l"), Column("C", "$C$", "r"), Column("held k", None, "r"),
                 Column("share", None, "r"), Column("switches", None, "r"), Column("settle steps", None, "r"),
                 Column("recaptures", None, "r"), Column("k shares", None, "l")]
        krows = []
        for r in sorted(rs, key=lambda r: (order.index(policy_label(r)), _concurrency(r))):
            if names[policy_label(r)] in ("never",):
                continue
            kc = _k_choice(r)
            if not kc:
                continue
            shares = " ".join(f"{k}:{v:.2f}" for k, v in (kc.get("k_step_fraction") or {}).items())
            krows.append([policy_label(r), str(_concurrency(r)), str(kc.get("steady_k", "-")),
                          f"{kc.get('steady_k_share', 0):.2f}", str(kc.get("k_switches", "-")),
                          str(kc.get("k_settle_steps", "-")), str(r.metrics.get("graph_recaptures", "-")), shares])
        ktable = None
        if krows:
            ktable = Table(f"k chosen at full load: {label}", f"k held in the steady window (decode batch >= 90% of "
                           f"its peak) per run ({label}): its share of the window's steps, switches, steps from the "
                           "load change until it held, CUDA graphs captured after start-up; k shares over all "
                           "decode steps.", f"kchoice{len(out) + 1}",
                           kcols, krows)
        spread = None
        if hi > 1:  # repeats: how far apart a point's runs are, against the 2% a verdict needs
            key_tok = _tok_key(rs)
            vals: dict = {}
            for r in rs:
                v = r.metrics.get(key_tok)
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    vals.setdefault((policy_label(r), _concurrency(r)), []).append(float(v))

            def _spread(p, c):
                xs = vals.get((p, c), [])
                return f"{100 * (max(xs) - min(xs)) / (sum(xs) / len(xs)):.1f}%" if len(xs) > 1 and sum(xs) else "-"

            spread = [Table(f"Run-to-run spread: {label}", f"(max - min) / mean of the tok/s of each point's repeated "
                            f"runs ({label}): a ratio to the envelope whose spread exceeds the gap to 0.98 or 1.05 is "
                            "not resolved by these runs.", f"spread{len(out) + 1}",
                            [Column("Policy", None, "l")] + [Column(f"C={c}", str(c), "r") for c in cs],
                            [[p] + [_spread(p, c) for c in cs] for p in order])]
            best = _policy_envelope(rs, stat=_best)
            if best is not None:
                btok, _, bcs, benv, border = best
                spread.append(Table(
                    f"Best of repeats vs the envelope: {label}",
                    f"As the envelope table ({label}), with each point's best run instead of the mean, for every "
                    "policy alike (never and always too): where a run is only ever slowed by something outside "
                    "it (the lent H200 machine's host-speed episodes, docs/gpu_machines.md), the best of a "
                    "point's repeats estimates its unperturbed tok/s.", f"envelope_best{len(out) + 1}",
                    columns, _envelope_rows(btok, benv, bcs, border)))
            paired = _paired_rows(rs, cs, order, names)
            if paired is not None:
                spread.append(Table(
                    f"Paired by seed vs the envelope: {label}",
                    f"Each run over max(never, always) of the same seed and C, averaged over the seeds that have "
                    f"both ({label}): a sweep lists seed before policy (conf/experiment/policy_envelope.yaml), so a "
                    "seed's runs of a point run back to back and a slow spell of the host slows them alike.",
                    f"envelope_paired{len(out) + 1}", columns, paired))
        out.append((table, series, label, ktable, spread))
    return out


def _paired_rows(rs: list[Run], cs, order, names) -> list[list[str]] | None:
    """Per policy and C: the mean over seeds of run / max(never, always) of the same seed (None: no seed has a
    never and an always run at some C)."""
    key = _tok_key(rs)
    by: dict[tuple, list[float]] = {}
    for r in rs:
        v, seed = r.metrics.get(key), r.get("seed")
        if seed is None or not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            continue
        by.setdefault((policy_label(r), _concurrency(r), str(seed)), []).append(float(v))
    mean = {k: sum(v) / len(v) for k, v in by.items()}
    bounds = [p for p in order if names[p] in ("never", "always")]
    envs = {}
    for (_, c, s) in mean:
        have = [b for b in bounds if (b, c, s) in mean]
        if {names[b] for b in have} == {"never", "always"}:
            envs[(c, s)] = max(mean[(b, c, s)] for b in have)
    if not envs:
        return None
    rows = []
    for p in order:
        ratios = []
        for c in cs:
            xs = [mean[(p, c, s)] / envs[(c, s)] for (pp, cc, s) in mean if pp == p and cc == c
                  and envs.get((c, s))]
            ratios.append(sum(xs) / len(xs) if xs else None)
        got = [x for x in ratios if x is not None]
        rows.append([p] + [f"{x:.3f}" if x is not None else "-" for x in ratios]
                    + [f"{min(got):.3f}" if got else "-", f"{max(got):.3f}" if got else "-"])
    return rows


def plot_envelope(series, out: Path, title: str, stem: str) -> list[str] | None:
    fig = _figure()
    if fig is None:
        return None
    from matplotlib.ticker import FixedLocator, NullLocator

    ax = fig.add_subplot()
    all_c = sorted({c for _, cs, _ in series for c in cs})
    for label, cs, vals in series:
        pts = [(c, v) for c, v in zip(cs, vals) if v is not None]
        env = label.startswith("envelope")
        ax.plot([c for c, _ in pts], [v for _, v in pts], marker=None if env else "o", label=label,
                linestyle="--" if env else "-", color="black" if env else None, linewidth=2.0 if env else 1.2)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(FixedLocator(all_c))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([str(c) for c in all_c])
    ax.set_xlabel("concurrency C (requests in flight)")
    ax.set_ylabel("output tok/s")
    ax.grid(alpha=0.3)
    ax.set_title("\n".join(textwrap.wrap("Policies vs the envelope: " + title, 70)), fontsize=8)
    ax.legend(fontsize=7)
    return _save(fig, out, stem)
def crossover_tables(runs: list[Run]) -> list[tuple[Table, Table, list, str]]:
    """Where speculation starts to lose, per study of replayed-acceptance runs swept over C (workload x
    target x drafter x trace): tok/s of each policy at every C beside the envelope max(never, every
    always), then per policy its ratio to the envelope (min over C, at the top C) and, for each always,
    the first C where it falls below never and its ratio to never at the top C. Returns (tok/s table,
    summary table, plot series, label) per study that has both never and always runs."""
    swept = [r for r in runs if _concurrency(r) is not None and is_replayed(r)
             and r.get("draft.name", "none") != "none"]
    out = []
    for key, rs in _merge(swept, lambda r: tuple(descriptors(r)[c] for c in ("Workload", "Target", "Drafter", "T"))):
        study = _policy_envelope(rs)
        if study is None:
            continue
        tok, names, cs, env, order = study
        label = f"{key[0]}, {key[1]}, {key[2]}" + (f", T = {key[3]}" if key[3] not in ("0.0", "0") else "")
        columns = [Column("Policy", None, "l")] + [Column(f"C={c}", str(c), "r") for c in cs]
        flat = format_column([tok[p].get(c) for p in order for c in cs] + [env[c] for c in cs])
        n = len(cs)
        rows = [[p] + flat[i * n:(i + 1) * n] for i, p in enumerate(order)]
        rows.append(["envelope max(never, always)"] + flat[len(order) * n:])
        top = cs[-1]
        ref = tok[next(p for p in order if names[p] == "never")]
        caption = (f"Crossover ({label}): {_steady_note(rs)} per policy at closed-loop concurrency C, REPLAYED ACCEPTANCE "
                   "(accepted lengths drawn from the trace named; committed tokens are tree tokens, not the "
                   "target's greedy output); envelope = max(never, every always) at each C.")
        table = Table(f"Crossover, replayed acceptance: {label}", caption, f"crossover{len(out) + 1}", columns, rows,
                      span=("output tok/s at concurrency $C$", 1))
        scols = [Column("Policy", None, "l"), Column("min / envelope", None, "r"),
                 Column(f"at C={top} / envelope", None, "r"), Column("first C below never", None, "r"),
                 Column(f"at C={top} / never", None, "r")]
        srows = []
        for p in order:
            if names[p] == "never":
                continue
            ratios = [tok[p][c] / env[c] for c in cs if tok[p].get(c) is not None and env[c]]
            at_top = tok[p].get(top) / env[top] if tok[p].get(top) is not None and env[top] else None
            below = next((c for c in cs if tok[p].get(c) is not None and ref.get(c) is not None
                          and tok[p][c] < ref[c]), None)
            vs_never = tok[p][top] / ref[top] if tok[p].get(top) is not None and ref.get(top) else None
            srows.append([p, f"{min(ratios):.3f}" if ratios else "-", "-" if at_top is None else f"{at_top:.3f}",
                          "never" if below is None else str(below), "-" if vs_never is None else f"{vs_never:.2f}x"])
        summary = Table(f"Crossover summary, replayed acceptance: {label}",
                        f"Crossover summary ({label}), replayed acceptance: each policy's tok/s over the envelope (min "
                        f"over C, and at the top C = {top}); the first C where it falls below never, and its tok/s "
                        "over never's at the top C. Targets: always below never somewhere; a dynamic policy >= 0.98 "
                        "of the envelope at every C.", f"crossoversummary{len(out) + 1}", scols, srows)
        series = [(p, cs, [tok[p].get(c) for c in cs]) for p in order]
        series.append(("envelope max(never, always)", cs, [env[c] for c in cs]))
        out.append((table, summary, series, label))
    return out


def _decode_tok_s(run: Run) -> float | None:
    """Output tokens per second of decode-step device time (``decode_ms_total``, CUDA events around
    each decode step): the run's throughput with prefill and the host's time between steps left out."""
    ms, n = run.metrics.get("decode_ms_total"), run.metrics.get("output_tokens")
    return n / (ms / 1e3) if _is_num(ms) and _is_num(n) and ms > 0 else None


def _run_order(run: Run) -> tuple:
    """When the run started (``date_utc``, seconds), then its path (a sweep's job number): the order
    the paired study interleaves its arms in."""
    return (str(run.metrics.get("date_utc") or ""), _path_sort_key(run.path))


def _spread(values) -> float | None:
    """(max - min) / mean of two or more values, else None."""
    xs = [v for v in values if v is not None]
    return (max(xs) - min(xs)) / (sum(xs) / len(xs)) if len(xs) > 1 and sum(xs) else None


def paired_off_cost(runs: list[Run]) -> list[dict]:
    """Speculation off, paired: closed-loop policy=never runs, per study (workload x target x T x
    other settings) and C, in run order. Each run with a drafter is divided by the mean of the
    draft=none runs next to it at that C (the nearest one before it and the nearest one after it),
    in output tok/s and in decode tok/s (:func:`_decode_tok_s`). Returns one dict per study and C
    with ``runs`` (in order: drafter name, label, tok/s, decode tok/s, prefill s, ratios, the
    neighbours' indices) and ``none`` (the draft=none runs' tok/s and decode tok/s); studies and Cs
    without both a draft=none and a drafter run are left out."""
    sel = [r for r in runs if _concurrency(r) is not None and r.get("policy.name", "never") == "never"]
    if not sel:
        return []
    extras = [k for k in _swept_keys(sel) if not k.startswith(SPEC_ONLY)]

    def study_key(r: Run) -> tuple:
        d = descriptors(r)
        return (d["Workload"], d["Target"], d["T"], *(_h(r.get(k)) for k in extras), _concurrency(r))

    out = []
    for key, rs in _merge(sel, study_key):
        rs = sorted(rs, key=_run_order)
        plain = [i for i, r in enumerate(rs) if r.get("draft.name", "none") == "none"]
        if not plain or len(plain) == len(rs):
            continue
        rows = []
        for i, r in enumerate(rs):
            tok, dec = r.metrics.get("output_tok_per_s"), _decode_tok_s(r)
            pre = r.metrics.get("prefill_ms_total")
            steady = r.metrics.get("steady_tok_per_s")
            row = {"draft": str(r.get("draft.name", "none")), "label": drafter_label(r), "tok_s": tok,
                   "decode_tok_s": dec, "prefill_s": pre / 1e3 if _is_num(pre) else None,
                   "steady_tok_s": steady if _is_num(steady) else None, "steady_ratio": None,
                   "kv_pages": r.metrics.get("kv_pages"), "preemptions": r.metrics.get("preemptions"),
                   "path": str(r.path), "neighbours": [], "ratio": None, "decode_ratio": None}
            if i not in plain:
                before = [j for j in plain if j < i][-1:]
                after = [j for j in plain if j > i][:1]
                nb = before + after
                row["neighbours"] = nb
                base = _mean(rs[j].metrics.get("output_tok_per_s") for j in nb)
                base_dec = _mean(_decode_tok_s(rs[j]) for j in nb)
                row["ratio"] = tok / base if _is_num(tok) and base else None
                row["decode_ratio"] = dec / base_dec if dec is not None and base_dec else None
                nb_steady = [rs[j].metrics.get("steady_tok_per_s") for j in nb]
                if row["steady_tok_s"] is not None and nb_steady and all(_is_num(v) and v > 0 for v in nb_steady):
                    row["steady_ratio"] = row["steady_tok_s"] / _mean(nb_steady)
            rows.append(row)
        label = f"{key[0]}, {key[1]}" + (f", T = {key[2]}" if key[2] not in ("0.0", "0") else "")
        label += "".join(f", {k}={json.loads(v) if v != 'null' else None}" for k, v in zip(extras, key[3:-1]))
        out.append({"study": label, "C": key[-1], "runs": rows,
                    "none": {"tok_s": [rows[j]["tok_s"] for j in plain],
                             "decode_tok_s": [rows[j]["decode_tok_s"] for j in plain],
                             "steady_tok_s": [rows[j]["steady_tok_s"] for j in plain]}})
    return out


def off_cost_tables(runs: list[Run]) -> list[Table]:
    """The paired speculation-off study (:func:`paired_off_cost`) as two tables per study: per C and
    drafter the mean ratio to the adjacent draft=none runs (and its range over the drafter's runs),
    with the draft=none runs' mean and spread beside it; then every run in order."""
    points = paired_off_cost(runs)
    tables = []
    for study in dict.fromkeys(p["study"] for p in points):
        pts = [p for p in points if p["study"] == study]
        labels = list(dict.fromkeys(r["label"] for p in pts for r in p["runs"] if r["neighbours"]))
        names = {lab: next(r["draft"] for p in pts for r in p["runs"] if r["label"] == lab) for lab in labels}
        if len(set(names.values())) < len(names):  # two configs of one drafter: name them in full
            names = {lab: lab for lab in labels}
        rows = []
        for p in pts:
            none_tok, none_dec = p["none"]["tok_s"], p["none"]["decode_tok_s"]
            pages = sorted({r["kv_pages"] for r in p["runs"]}, key=lambda v: _sort_key([v]))
            pre = sum(r["preemptions"] or 0 for r in p["runs"])
            pages_s = " / ".join(map(_show, pages)) + (" (differ)" if len(pages) > 1 else "")
            sp, dsp = _spread(none_tok), _spread(none_dec)
            none_steady = p["none"].get("steady_tok_s") or []
            ssp = _spread(none_steady) if none_steady and all(v is not None for v in none_steady) else None
            for lab in labels:
                mine = [r for r in p["runs"] if r["label"] == lab and r["ratio"] is not None]
                if not mine:
                    continue
                ratios = [r["ratio"] for r in mine]
                dec = [r["decode_ratio"] for r in mine if r["decode_ratio"] is not None]
                st = [r["steady_ratio"] for r in mine if r["steady_ratio"] is not None]
                rows.append([str(p["C"]), names[lab], str(len(mine)),
                             format_column([_mean(r["tok_s"] for r in mine)])[0],
                             f"{_mean(ratios):.4f}", f"{min(ratios):.4f} .. {max(ratios):.4f}",
                             f"{_mean(dec):.4f}" if dec else "-",
                             format_column([_mean(none_tok)])[0], str(len(none_tok)),
                             "-" if sp is None else f"{100 * sp:.1f}%",
                             "-" if dsp is None else f"{100 * dsp:.1f}%",
                             f"{_mean(st):.4f}" if st else "-", "-" if ssp is None else f"{100 * ssp:.1f}%",
                             pages_s + (f", {pre} preempted" if pre else "")])
        columns = [Column("C", "$C$", "r"), Column("Drafter"), Column("runs", None, "r"),
                   Column("tok/s", None, "r"), Column("/ none", None, "r"), Column("range", None, "r"),
                   Column("decode / none", None, "r"), Column("none tok/s", None, "r"),
                   Column("none runs", None, "r"), Column("none spread", None, "r"),
                   Column("none decode spread", None, "r"), Column("steady / none", None, "r"),
                   Column("none steady spread", None, "r"), Column("KV pages", None, "l")]
        caption = (f"Speculation off ({study}; policy=never, closed loop): each drafter run's output tok/s over "
                   "the mean of the draft=none runs adjacent to it in run order at the same C (the nearest "
                   "before and after), averaged over its runs (range: min .. max); decode / none: the same "
                   "ratio of output tokens per second of decode-step device time; none spread: (max - min) / "
                   "mean over the draft=none runs at that C, the run-to-run noise the ratios sit in; steady / none: "
                   "the ratio of steady-window tok/s (from workload.warmup_s after the first send to the last send: "
                   "the start-up burst of prefills and the drain left out) and its none spread. Target: "
                   "/ none >= 0.99 at every C.")
        tables.append(Table(f"Speculation off: {study}", caption, f"offcost{len(tables) // 2 + 1}", columns, rows))
        orows = []
        for p in pts:
            for n, r in enumerate(p["runs"], 1):
                nb = ", ".join(f"#{j + 1}" for j in r["neighbours"])
                orows.append([str(p["C"]), str(n), names.get(r["label"], r["draft"]), *format_column([r["tok_s"]]), *format_column([r["decode_tok_s"]]),
                              *format_column([r["prefill_s"]]), "-" if r["ratio"] is None else f"{r['ratio']:.4f}",
                              "-" if r["decode_ratio"] is None else f"{r['decode_ratio']:.4f}", nb or "-"])
        ocols = [Column("C", "$C$", "r"), Column("#", None, "r"), Column("Drafter"), Column("tok/s", None, "r"),
                 Column("decode tok/s", None, "r"), Column("prefill s", None, "r"), Column("/ none", None, "r"),
                 Column("decode / none", None, "r"), Column("vs", None, "l")]
        tables.append(Table(f"Speculation off, run order: {study}",
                            f"Speculation off ({study}): every run in the order it ran per C, with its ratios to the "
                            "draft=none runs named under vs (by # in this list); prefill s = prefill_ms_total.",
                            f"offcostorder{len(tables) // 2 + 1}", ocols, orows))
    return tables


EXACT = "engine.exact"  # the batch-invariant kernels (kernels_triton/options.py); exact_cost_table pairs on it


def _request_outputs(run: Run) -> dict | None:
    """{request id: output token ids} of the run's requests.jsonl (failed requests left out), the ids of
    cycled repeats (``ID#n``, ``ID@n``) reduced to the prompt's; None without the file."""
    path = run.path / "requests.jsonl"
    if not path.is_file():
        return None
    out: dict = {}
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "error" not in rec and "id" in rec:
            out.setdefault(re.split(r"[#@]", str(rec["id"]))[0], []).append(rec.get("output_ids"))
    return out


def _same_outputs(run: Run, ref: Run) -> tuple[int, int] | None:
    """(requests of ``run`` whose output ids equal ``ref``'s for the same prompt, requests compared)."""
    a, b = _request_outputs(run), _request_outputs(ref)
    if not a or not b:
        return None
    pairs = [(x, b[k][0]) for k, xs in a.items() if k in b for x in xs]
    return sum(x == y for x, y in pairs), len(pairs)


def _plain_at_one(run: Run, runs: list[Run]) -> Run | None:
    """The plain run at C = 1 that ``run``'s outputs are checked against: same origin and settings apart
    from draft, policy, the concurrency and what follows it (engine.max_batch_size); else the run's own
    plain baseline."""
    skip = ("workload.concurrency", "engine.max_batch_size")

    def key(r: Run) -> str:
        return _h({k: v for k, v in r.settings.items() if not k.startswith(SPEC_ONLY) and k not in skip})

    k = key(run)
    at_one = [b for b in runs if is_baseline(b) and _concurrency(b) == 1 and key(b) == k]
    return (at_one or baselines(run, runs) or [None])[0]


def exact_cost_table(runs: list[Run]) -> Table | None:
    """Exact mode against the default kernels, paired (experiment=exact_cost): each run with
    engine.exact=true beside its twin(s), the runs of the same origin with the same settings but
    engine.exact=false; per row (repeats averaged) both modes' tok/s, exact / default, each mode's
    speed-up over its own plain run, and the share of outputs equal to plain greedy at C = 1 of the same
    mode (:func:`_plain_at_one`). None without such a pair."""
    def twin(r: Run) -> str:
        return _h({k: v for k, v in r.settings.items() if k != EXACT})

    modes: dict[str, dict[bool, list[Run]]] = {}
    for r in runs:
        if isinstance(r.get(EXACT), bool):
            modes.setdefault(twin(r), {}).setdefault(r.get(EXACT), []).append(r)
    paired = [r for m in modes.values() if m.get(True) and m.get(False) for r in m[True] + m[False]]
    if not paired:
        return None
    desc = ["Workload", "Target", "Drafter", "Policy", "T"]
    extras = [k for k in distinguishing_keys(paired, ignore=(EXACT, *REPEAT_KEYS))
              if k == "workload.concurrency" or not follows_concurrency(paired, k)]
    groups = _merge(paired, lambda r: _label_values(r, desc, extras))
    rows, figures = [], []
    for key, rs in groups:
        cells = []
        for mode in (False, True):
            mine = [r for r in rs if r.get(EXACT) is mode]
            same = []
            for r in mine:
                ref = _plain_at_one(r, runs)
                got = _same_outputs(r, ref) if ref is not None and ref is not r else None
                if got is not None:
                    same.append(got)
            n_same, n_all = sum(s[0] for s in same), sum(s[1] for s in same)
            cells.append((_mean(r.metrics.get("output_tok_per_s") for r in mine),
                          _mean(speedup(r, runs) for r in mine) if is_spec(rs[0]) else None,
                          f"{n_same}/{n_all}" if n_all else "-", len(mine)))
            if n_all:
                figures += [(r, "outputs_identical_to_plain_c1", n_same / n_all) for r in mine]
        ratio = cells[1][0] / cells[0][0] if cells[0][0] and cells[1][0] is not None else None
        for r in rs:
            if r.get(EXACT) is True and ratio is not None:
                figures.append((r, "exact_over_default_tok_per_s", ratio))
        tok = format_column([cells[0][0], cells[1][0]])
        rows.append([_show(v) for v in key] + [f"{cells[0][3]} + {cells[1][3]}", tok[0], tok[1],
                                               "-" if ratio is None else f"{ratio:.3f}",
                                               *format_column([cells[0][1], cells[1][1]], "speedup"),
                                               cells[0][2], cells[1][2]])
    columns = _label_columns(desc, extras) + [
        Column("runs", None, "r"), Column("default tok/s", None, "r"), Column("exact tok/s", None, "r"),
        Column("exact / default", None, "r"), Column("speed-up default", None, "r"),
        Column("speed-up exact", None, "r"), Column("= plain C=1, default", None, "r"),
        Column("= plain C=1, exact", None, "r")]
    caption = ("Exact mode's cost (engine.exact: batch-invariant kernels, so bf16 greedy speculative output is "
               "plain greedy's bit for bit): each row's exact runs and their default twins (same settings and "
               "sweep folder, engine.exact=false), output tok/s of each mode (mean of repeats), their ratio, each "
               "mode's speed-up over its own plain run, and how many requests' outputs equal the same mode's "
               "plain greedy run at C = 1 (requests.jsonl, by prompt; \"-\" for that plain run itself). Targets: "
               "exact / default >= 0.90 at C = 1 and >= 0.85 under load; every exact output equal to plain C = 1.")
    return Table("Exact mode: cost against the default kernels", caption, "exactcost", columns, rows,
                 figures=figures)


def step_breakdown_table(runs: list[Run]) -> Table | None:
    """The speculative step per k split into draft / verify / commit beside the plain step (runs with
    ``engine.profile_spec_steps``; experiment=step_8b), with the speed-up replayed acceptance implies."""
    prof = [r for r in runs if isinstance(r.metrics.get("step_breakdown"), dict)]
    if not prof:
        return None
    cols = [Column("Target", None, "l"), Column("batch", None, "r"), Column("k", None, "r"),
            Column("plain ms", None, "r"), Column("step ms", None, "r"), Column("step / plain", None, "r"),
            Column("draft ms", None, "r"), Column("per round", None, "r"), Column("verify ms", None, "r"),
            Column("commit ms", None, "r"), Column("τ", r"$\tau$", "r"), Column("implied speed-up", None, "r")]
    # runs that differ only in the draft's weight dtype (draft.weight_dtype=model,int8) sit side by side
    dtypes = [str(r.metrics.get("draft_weight_dtype") or r.get("draft.weight_dtype", "model")) for r in prof]
    by_dtype = len(set(dtypes)) > 1
    if by_dtype:
        cols.insert(3, Column("draft weights", None, "l"))
    keyed = []
    for i, r in enumerate(prof):
        sb = r.metrics["step_breakdown"]
        for b, row in sb.get("batches", {}).items():
            for k, e in row.get("k", {}).items():
                tau, sp = e.get("mean_accepted_length"), e.get("implied_speedup")
                cells = [target_label(r), b, k, f"{row['plain_ms']:.2f}", f"{e['step_ms']:.2f}",
                         f"{e['step_over_plain']:.2f}", f"{e['draft_ms']:.2f}",
                         f"{e['draft_round_ms']:.3f} x {e['draft_rounds']}", f"{e['verify_ms']:.2f}",
                         f"{e['commit_ms']:.2f}", "-" if tau is None else f"{tau:.2f}",
                         "-" if sp is None else f"{sp:.2f}x"]
                if by_dtype:
                    cells.insert(3, dtypes[i])
                keyed.append(((target_label(r), int(b), int(k), i), cells))
    rows = [cells for _, cells in sorted(keyed, key=lambda kc: kc[0])]
    ctx = {r.metrics["step_breakdown"].get("context") for r in prof}
    graphed = all(r.metrics["step_breakdown"].get("graphed") for r in prof)
    caption = (f"The speculative step per k ({'graphed' if graphed else 'EAGER (not graphed)'}, context "
               f"{', '.join(map(str, sorted(ctx)))}) split into the draft rounds, verify (target forward over the tree + "
               "verify_accept) and commit (kv_sync + draft extend), beside the plain step; implied speed-up = "
               "τ x plain / step with τ the mean accepted length of the replayed acceptance (labelled in Target).")
    return Table("Step breakdown", caption, "stepbreakdown", cols, rows)


def step_floor_table(runs: list[Run]) -> Table | None:
    """Graphed plain step time against the weight-bandwidth floor (runs with ``engine.profile_steps``):
    one row per target x decode batch (repeats averaged)."""
    prof = [r for r in runs if isinstance(r.metrics.get("step_floor"), dict)]
    if not prof:
        return None
    groups: dict[tuple, list[tuple[Run, str]]] = {}
    for r in prof:
        for b in r.metrics["step_floor"].get("step_ms", {}):
            groups.setdefault((target_label(r), int(b), r.metrics["step_floor"].get("context")), []).append((r, b))
    cols = {"step": [], "floor": [], "frac_all": [], "frac_read": [], "frac_touched": [], "experts": [], "gbps": [],
            "gb": [], "tpot": []}
    keys = sorted(groups, key=lambda k: _sort_key(list(k)))
    for key in keys:
        members = groups[key]
        sf = [r.metrics["step_floor"] for r, _ in members]
        cols["step"].append(_mean(f["step_ms"][b] for f, (_, b) in zip(sf, members)))
        cols["floor"].append(_mean(f.get("floor_ms_all") for f in sf))
        cols["frac_all"].append(_mean(f["floor_fraction_all"][b] for f, (_, b) in zip(sf, members)))
        cols["frac_read"].append(_mean(f["floor_fraction_read"][b] for f, (_, b) in zip(sf, members)))
        # the bytes this batch's step must read: an MoE target's selected experts only, plus the rows' KV
        cols["frac_touched"].append(_mean((f.get("floor_fraction_touched") or {}).get(b, math.nan)
                                          for f, (_, b) in zip(sf, members)))
        cols["experts"].append(_mean((f.get("distinct_experts_per_layer") or {}).get(b, math.nan)
                                     for f, (_, b) in zip(sf, members)))
        cols["gbps"].append(_mean(f.get("copy_gbps") for f in sf))
        cols["gb"].append(_mean(f.get("weight_bytes", 0) / 1e9 for f in sf))
        cols["tpot"].append(_mean((r.metrics.get("p50_tpot_s") or math.nan) * 1e3 for r, _ in members
                                  if _concurrency(r) == 1))
    columns = [Column("Target"), Column("batch", None, "r"), Column("context", None, "r"),
               Column("step ms", None, "r"), Column("floor ms", None, "r"), Column("of floor", None, "r"),
               Column("of floor (bytes read)", None, "r"), Column("of floor (bytes touched)", None, "r"),
               Column("experts / layer", None, "r"), Column("copy GB/s", None, "r"),
               Column("weights GB", None, "r"), Column("TPOT ms (C=1)", None, "r")]
    formatted = [format_column(cols["step"]), format_column(cols["floor"]), format_column(cols["frac_all"], "percent_of"),
                 format_column(cols["frac_read"], "percent_of"), format_column(cols["frac_touched"], "percent_of"),
                 format_column(cols["experts"]), format_column(cols["gbps"]),
                 format_column(cols["gb"]), format_column(cols["tpot"])]
    rows = [[key[0], str(key[1]), _show(key[2])] + [c[i] for c in formatted] for i, key in enumerate(keys)]
    context, _ = _context(prof)
    caption = ("Graphed plain decode step (device time of back-to-back replays) against the "
               "weight-bandwidth floor: weight bytes / copy bandwidth (read + written, measured in the "
               "same run); \"of floor\" = floor / step (1 = at the floor), all parameters, the bytes "
               "a step reads (an untied embedding table only by its rows), or the bytes it touches (of an MoE "
               "target only the distinct experts its tokens select, per layer in the next column; plus the rows' "
               "KV); TPOT = median time per output "
               "token at one request in flight" + (f"; {context}" if context else "") + ".")
    return Table("Step time vs weight-bandwidth floor", caption, "step-floor", columns, rows)


def _is_moe_profile(run: Run) -> bool:
    sb = run.metrics.get("step_breakdown") or {}
    return bool(routing_label(run)) or any("plain_distinct_experts_per_layer" in row
                                           for row in (sb.get("batches") or {}).values())


def _step_cost_rows(runs: list[Run]) -> dict:
    """{(target, routing): {batch: {k: (plain ms, step ms, step / plain, experts plain, experts at k)}}} from the
    runs' step_breakdown, repeats (and runs split over batches) merged by the mean."""
    acc: dict = {}
    for r in runs:
        sb = r.metrics.get("step_breakdown")
        if not isinstance(sb, dict):
            continue
        key = (target_shape_label(r), routing_label(r))
        for b, row in (sb.get("batches") or {}).items():
            for k, e in (row.get("k") or {}).items():
                acc.setdefault(key, {}).setdefault(int(b), {}).setdefault(int(k), []).append(
                    (row.get("plain_ms"), e.get("step_ms"), e.get("step_over_plain"),
                     row.get("plain_distinct_experts_per_layer"), e.get("distinct_experts_per_layer")))
    return {key: {b: {k: tuple(_mean(v[i] for v in vals) for i in range(5)) for k, vals in ks.items()}
                  for b, ks in bs.items()} for key, bs in acc.items()}


def moe_step_cost_table(runs: list[Run]) -> Table | None:
    """"MoE step cost" (experiment=step_moe): per target shape and routing, decode batch B and k, the graphed
    speculative step over the plain one (the accepted length it must beat) and the distinct experts per MoE
    layer the plain step and the step at k read; dense targets beside (no experts). Only when some profiled
    run's target is MoE."""
    prof = [r for r in runs if isinstance(r.metrics.get("step_breakdown"), dict)]
    if not any(_is_moe_profile(r) for r in prof):
        return None
    data = _step_cost_rows(prof)
    cols = [Column("Target", None, "l"), Column("routing", None, "l"), Column("B", "$B$", "r"), Column("k", None, "r"),
            Column("plain ms", None, "r"), Column("step ms", None, "r"), Column("step / plain", None, "r"),
            Column("experts / layer, plain", None, "r"), Column("experts / layer, at k", None, "r")]

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    rows = []
    for (target, route), bs in sorted(data.items(), key=lambda kv: _target_routing_rank(kv[0])):
        for b in sorted(bs):
            for k in sorted(bs[b]):
                plain, step, ratio, ep, ek = bs[b][k]
                rows.append([target, route or "(dense)", str(b), str(k), num(plain, ".2f"), num(step, ".2f"),
                             num(ratio, ".2f"), num(ep, ".1f"), num(ek, ".1f")])
    figures = []
    for r in prof:
        for b, row in (r.metrics["step_breakdown"].get("batches") or {}).items():
            for k, e in (row.get("k") or {}).items():
                figures.append((r, f"step_over_plain_b{b}_k{k}", e.get("step_over_plain")))
                if e.get("distinct_experts_per_layer") is not None:
                    figures.append((r, f"distinct_experts_per_layer_b{b}_k{k}", e["distinct_experts_per_layer"]))
            if row.get("plain_distinct_experts_per_layer") is not None:
                figures.append((r, f"distinct_experts_per_layer_b{b}_k0", row["plain_distinct_experts_per_layer"]))
    ctx = sorted({str(r.metrics["step_breakdown"].get("context")) for r in prof})
    graphed = all(r.metrics["step_breakdown"].get("graphed") for r in prof)
    caption = (f"MoE step cost ({'graphed' if graphed else 'EAGER (not graphed)'}, context {', '.join(ctx)}): the "
               "speculative step at k draft tokens over the plain step at the same decode batch B (the accepted "
               "length it must beat), and the distinct experts per MoE layer each reads (mean over layers and "
               "steps; a verify of B x (k + 1) tokens against B). Routing: random router = the random router's own "
               "choice (a request's tokens share most experts), uniform = every token's experts drawn "
               "independently (the upper bound), zipf = a stated model of a trained router's skew and reuse "
               "(specdec/models/routing.py). Random weights.")
    return Table("MoE step cost", caption, "moe-step-cost", cols, rows, figures=figures)


def plot_moe_step_cost(runs: list[Run], out: Path) -> list[str] | None:
    """Step / plain vs B per k, one panel per target and routing (dense beside MoE); [] without MoE profiles."""
    prof = [r for r in runs if isinstance(r.metrics.get("step_breakdown"), dict)]
    if not any(_is_moe_profile(r) for r in prof):
        return []
    data = _step_cost_rows(prof)
    fig = _figure()
    if fig is None:
        return None
    from matplotlib.ticker import FixedLocator, NullLocator

    keys = sorted(data, key=_target_routing_rank)  # dense, then random router, uniform, zipf
    fig.set_size_inches(3.4 * len(keys), 3.2)
    axes = fig.subplots(1, len(keys), sharey=True, squeeze=False)[0]
    for ax, key in zip(axes, keys):
        bs = sorted(data[key])
        for k in sorted({k for b in bs for k in data[key][b]}):
            pts = [(b, data[key][b][k][2]) for b in bs if k in data[key][b] and data[key][b][k][2] is not None]
            ax.plot([b for b, _ in pts], [v for _, v in pts], marker="o", markersize=3, label=f"k = {k}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(bs))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([str(b) for b in bs], fontsize=6)
        ax.set_xlabel("decode batch B")
        ax.grid(alpha=0.3)
        title = textwrap.wrap(key[0], 45) + [f"routing: {key[1]}" if key[1] else "(dense)"]
        ax.set_title("\n".join(title), fontsize=7)
    axes[0].set_ylabel("speculative step / plain step")
    axes[0].legend(fontsize=6)
    return _save(fig, out, "moe_step_cost")


def plot_crossover_shapes(runs: list[Run], out: Path) -> list[tuple[str, list[str]]] | None:
    """"Crossover, dense vs MoE" (experiment=crossover_moe): per drafter x workload x replayed acceptance whose
    crossover runs (never and always, two or more C) span two or more targets, one of them MoE, policy tok/s vs C
    with one panel per target (the random router solid, uniform dashed, zipf dotted; repeats averaged). Returns
    (caption, files) per figure; None without matplotlib."""
    swept = [r for r in runs if _concurrency(r) is not None and is_replayed(r)
             and r.get("draft.name", "none") != "none"]
    out_figs = []
    for key, rs in _merge(swept, lambda r: (descriptors(r)["Workload"], descriptors(r)["Drafter"],
                                            acceptance_label(r), descriptors(r)["T"])):
        moe = {target_shape_label(r) for r in rs if routing_label(r)}
        shapes = sorted({target_shape_label(r) for r in rs}, key=lambda t: (t in moe, t))  # dense first
        pols = {r.get("policy.name", "never") for r in rs}
        if (len(shapes) < 2 or not any(routing_label(r) for r in rs) or len({_concurrency(r) for r in rs}) < 2
                or not {"never", "always"} <= pols):
            continue
        fig = _figure()
        if fig is None:
            return None
        from matplotlib.ticker import FixedLocator, NullLocator

        tkey = _tok_key(rs)
        fig.set_size_inches(3.6 * len(shapes), 3.4)
        axes = fig.subplots(1, len(shapes), sharey=True, squeeze=False)[0]
        colors = {p: f"C{i}" for i, p in enumerate(sorted({policy_label(r) for r in rs}))}
        for ax, shape in zip(axes, shapes):
            mine = [r for r in rs if target_shape_label(r) == shape]
            cs = sorted({_concurrency(r) for r in mine})
            for route in sorted({routing_label(r) for r in mine}, key=_routing_rank):
                for pol in sorted({policy_label(r) for r in mine}):
                    pts = [(c, _mean(r.metrics.get(tkey) for r in mine if _concurrency(r) == c
                                     and routing_label(r) == route and policy_label(r) == pol)) for c in cs]
                    pts = [(c, v) for c, v in pts if v is not None]
                    if pts:
                        ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", markersize=3, color=colors[pol],
                                linestyle=ROUTING_STYLE.get(route, ":"),
                                label=pol + (f" ({route})" if route else ""))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.xaxis.set_major_locator(FixedLocator(cs))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xticklabels([str(c) for c in cs], fontsize=6)
            ax.set_xlabel("concurrency C (requests in flight)")
            ax.grid(alpha=0.3)
            ax.set_title("\n".join(textwrap.wrap(shape, 45)), fontsize=7)
            ax.legend(fontsize=5)
        axes[0].set_ylabel("steady-window output tok/s" if tkey == "steady_tok_per_s" else "output tok/s")
        label = f"{key[0]}, {key[1]}, {key[2]}" + (f", T = {key[3]}" if key[3] not in ("0.0", "0") else "")
        fig.suptitle("\n".join(textwrap.wrap(f"Crossover, dense vs MoE: {label}", 110)), fontsize=8)
        files = _save(fig, out, f"crossover_dense_vs_moe_{len(out_figs) + 1:02d}_" + _slug(label))
        out_figs.append((f"Crossover, dense vs MoE: {label} (MoE routing: random router solid, uniform dashed, "
                         "zipf dotted)", files))
    return out_figs


def switch_table(runs: list[Run]) -> Table | None:
    """Acceptance after switching speculation back on (``policy=schedule`` runs): tokens committed per
    row on the first speculative step after an off period, on the other speculative steps, and by
    position in the on-window; one row per drafter mode (draft KV in sync or left behind while off)."""
    sched = [r for r in runs if r.get("policy.name") == "schedule" and isinstance(r.metrics.get("policy_state"), dict)]
    if not sched:
        return None
    def mode(r):
        off = int(r.get("policy.off_steps", 0) or 0)
        if off == 0:
            return "always on (off = 0)"
        return "in sync" if r.get("draft.sync_while_off", True) else "left behind"
    groups = _merge(sched, lambda r: (drafter_label(r), f"{r.get('policy.on_steps')} on / {r.get('policy.off_steps')} off",
                                      mode(r), _concurrency(r)))
    rows = []
    for key, rs in groups:
        st = [r.metrics["policy_state"] for r in rs]
        first = _mean(s.get("first_after_off_tokens_per_step") for s in st)
        nfirst = sum(s.get("first_after_off_steps", 0) for s in st)
        by_pos = [s.get("by_position") or [] for s in st]
        width = max(map(len, by_pos), default=0)
        pos = " / ".join(format_column([_mean(p[j] for p in by_pos if j < len(p)) for j in range(width)],
                                       "fixed2")) or "-"
        same = _mean(r.metrics.get("outputs_identical_to_plain") for r in rs)
        rows.append([key[0], key[1], key[2],
                     str(sum(s.get("spec_steps", 0) for s in st)),
                     "-" if first is None else f"{first:.2f} ({nfirst} steps)",
                     format_column([_mean(s.get("other_tokens_per_step") for s in st)], "fixed2")[0],
                     format_column([_mean(s.get("tokens_per_spec_step") for s in st)], "fixed2")[0],
                     pos, format_column([None if same is None else 100 * same], "percent")[0]])
    columns = [Column("Drafter"), Column("schedule"), Column("draft KV while off"), Column("spec steps", None, "r"),
               Column("first step after off", None, "r"), Column("other spec steps", None, "r"),
               Column("all spec steps", None, "r"), Column("by position in window"),
               Column("outputs = plain", None, "r")]
    context, _ = _context(sched)
    caption = ("Acceptance after switching speculation back on: tokens committed per row and speculative "
               "step (accepted drafts + 1) on the first step after an off period, on the other speculative "
               "steps, on all, and by position in the on-window; share of outputs token-identical to plain "
               "decoding of the same prompts (compare_plain)" + (f"; {context}" if context else "") + ".")
    return Table("Acceptance after switching back on", caption, "switch-acceptance", columns, rows)


def policy_switch_table(runs: list[Run], last: int = 3) -> Table | None:
    """Why goodput changed k (``policy_state.switch_log``): per run with switches, how many
    and why (first tries, request probes, re-tries, refreshes, ramp_hold, the estimates), and the last ``last``
    switches the estimates decided, each with the a(k) and iteration ms of the k left and the k taken."""
    logged = [r for r in runs if isinstance(r.metrics.get("policy_state"), dict)
              and r.metrics["policy_state"].get("switch_log")]
    if not logged:
        return None
    def side(e, k):  # "a(k) / iteration ms" of k in switch e
        est = (e.get("k") or {}).get(str(k)) or {}
        a = est.get("a")
        return f"{'-' if a is None else f'{a:.2f}'} / {est.get('iter_ms', float('nan')):.2f}"

    rows = []
    for r in sorted(logged, key=lambda r: (policy_label(r), _concurrency(r) or 0)):
        st = r.metrics["policy_state"]
        log = st["switch_log"]
        why = collections.Counter(e.get("why", "?") for e in log)
        recent = [e for e in log if e.get("why") == "estimates"][-last:]
        shown = "; ".join(f"B={e['batch']}: {e['from']} -> {e['to']} ({side(e, e['from'])} -> {side(e, e['to'])})"
                          for e in recent) or "-"
        c = _concurrency(r)
        rows.append([policy_label(r), "-" if c is None else str(c), str(st.get("switches", len(log))),
                     str(st.get("choices_made", "-")),
                     ", ".join(f"{k} {n}" for k, n in sorted(why.items())), shown])
    columns = [Column("Policy"), Column("C", None, "r"), Column("switches", None, "r"), Column("choices", None, "r"),
               Column("logged switches by reason"),
               Column(f"last {last} by the estimates: batch, from -> to (a(k) / iteration ms)")]
    context, _ = _context(logged)
    caption = ("Why the policy changed k: switches of the whole run and choices made, the logged switches by "
               "reason (the policy keeps the last 64), and the last ones its estimates decided, with the tokens per "
               "row a(k) and iteration ms it compared for the k left and the k taken"
               + (f"; {context}" if context else "") + ".")
    return Table("Policy switches", caption, "policy-switches", columns, rows)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _depth_rates(rs: list[Run]) -> list[float | None]:
    """Acceptance rate at draft depth 1..D over runs (metrics ``acceptance_by_depth``): accepted over
    drafted summed over the runs where both counts are there, else the mean of their rates."""
    data = [r.metrics.get("acceptance_by_depth") or {} for r in rs]
    depth = max((len(d.get("rate") or d.get("drafted") or []) for d in data), default=0)
    out = []
    for i in range(depth):
        counts = [(d["accepted"][i], d["drafted"][i]) for d in data
                  if i < len(d.get("accepted") or []) and i < len(d.get("drafted") or [])]
        drafted = sum(c for _, c in counts if _is_num(c))
        if counts and drafted:
            out.append(sum(a for a, _ in counts if _is_num(a)) / drafted)
        else:
            out.append(_mean((d.get("rate") or [None] * depth)[i] if i < len(d.get("rate") or []) else None
                             for d in data))
    return out


def _rank_shares(rs: list[Run], shown: int = 3) -> list[list[float] | None]:
    """Per draft depth, the shares of accepted tree nodes that were their parent's 1st, 2nd, ..., and
    ``shown``-th or later child by draft rank (metrics ``accepted_rank_by_depth``: counts per rank, per depth),
    summed over runs."""
    data = [r.metrics.get("accepted_rank_by_depth") or [] for r in rs]
    out = []
    for i in range(max(map(len, data), default=0)):
        counts = [0.0] * shown
        for d in data:
            for rank, c in enumerate(d[i] if i < len(d) and isinstance(d[i], list) else []):
                if _is_num(c):
                    counts[min(rank, shown - 1)] += c
        total = sum(counts)
        out.append([c / total for c in counts] if total else None)
    return out


def acceptance_depth_tables(runs: list[Run]) -> tuple[list[Table], list] | None:
    """Acceptance per draft position: per method (drafter x policy, and what else tells runs apart) the
    rate at which a draft token at depth d = 1..D was accepted, given its parent was (metrics
    ``acceptance_by_depth``); for trees also which sibling (by draft rank) the accepted node was
    (``accepted_rank_by_depth``). Returns the tables and the plot's series (label, rates)."""
    spec = [r for r in runs if is_spec(r) and isinstance(r.metrics.get("acceptance_by_depth"), dict)]
    if not spec:
        return None
    context, ctx_keys = _context(spec)
    extras = distinguishing_keys(spec) + ctx_keys
    desc = [c for c in ("Workload", "Target", "Drafter", "Policy", "T")
            if c in ("Drafter", "Policy") or len({descriptors(r)[c] for r in spec}) > 1]
    fixed = [("workload " if c == "Workload" else "target " if c == "Target" else "T = ") + descriptors(spec[0])[c]
             for c in ("Workload", "Target", "T") if c not in desc]
    groups = _merge(spec, lambda r: _label_values(r, desc, extras))
    rates = [_depth_rates(rs) for _, rs in groups]
    depth = max(map(len, rates), default=0)
    if depth == 0:
        return None
    label_cols = _label_columns(desc, extras)
    columns = label_cols + [Column(f"d={d}", f"$d={d}$", "r") for d in range(1, depth + 1)]
    rows = [[_show(v) for v in key] + format_column(rs_ + [None] * (depth - len(rs_)), "fixed2")
            for (key, _), rs_ in zip(groups, rates)]
    where = "".join(f"; {x}" for x in fixed + ([context] if context else []))
    caption = ("Acceptance by draft position: the share of draft tokens at depth d (1 = the first drafted "
               "token) that the target accepted, among those whose parent it accepted (trees: the nodes on "
               "the accepted path's frontier), summed over the runs of a row" + where + ".")
    table = Table("Acceptance by draft depth", caption, "acceptance-depth", columns, rows)
    table.figures = [(r, f"acceptance_rate_d{d}", v) for r in spec
                     for d, v in enumerate(_depth_rates([r]), 1) if v is not None]
    tables = [table]
    ranked = [(key, rs, _rank_shares(rs)) for key, rs in groups
              if any(r.metrics.get("accepted_rank_by_depth") for r in rs)]
    if ranked:
        rdepth = max(len(sh) for _, _, sh in ranked)
        rcols = label_cols + [Column(f"d={d}", f"$d={d}$", "r") for d in range(1, rdepth + 1)]
        rrows = [[_show(v) for v in key] + ["-" if x is None else " / ".join(f"{100 * v:.0f}%" for v in x)
                                            for x in sh + [None] * (rdepth - len(sh))] for key, _, sh in ranked]
        tables.append(Table("Accepted rank among siblings", "Trees: which child of its parent the accepted node "
                            "at depth d was, by the drafter's rank (shares of 1st / 2nd / 3rd or later)" + where + ".",
                            "accepted-rank", rcols, rrows))
    keep = [i for i in range(len(label_cols)) if len({_h(key[i]) for key, _ in groups}) > 1] or [desc.index("Drafter")]
    series = [(_describe(label_cols, key, keep), rs_) for (key, _), rs_ in zip(groups, rates)]
    return tables, series


def _metric_column(groups: list[tuple[tuple, list[Run]]], key: str) -> tuple[Column, list[str]]:
    """One metric over row groups: numbers averaged (known metrics scaled, e.g. s -> ms), other
    values (device, weights, flags) listed."""
    header, tex, scale, kind = METRICS.get(key, (key, None, 1.0, "num"))
    values = [[r.get(key) for r in rs] for _, rs in groups]
    present = [v for vs in values for v in vs if v is not None]
    if not all(_is_num(v) for v in present):
        return Column(header, tex, "l"), [", ".join(sorted({_show(v) for v in vs})) for vs in values]
    means = [None if (x := _mean(vs)) is None else x * scale for vs in values]
    if all(isinstance(v, int) for v in present) and scale == 1.0:  # counts stay integers
        means = [int(x) if x is not None and x.is_integer() else x for x in means]
    return Column(header, tex, "r"), format_column(means, kind)


def _with_metrics(columns, rows, groups, metrics, always_count=False) -> None:
    """Append a column per metric, then the run count (when rows merged runs), to ``columns`` and
    ``rows`` in place."""
    for m in metrics:
        column, cells = _metric_column(groups, m)
        columns.append(column)
        for row, x in zip(rows, cells):
            row.append(x)
    n = [len(rs) for _, rs in groups]
    if always_count or max(n, default=1) > 1:
        columns.append(Column("runs", None, "r"))
        for row, x in zip(rows, n):
            row.append(str(x))


def overview_table(runs: list[Run], metrics: list[str] | None = None) -> Table:
    """Every config (one row each; repeats merged) with its headline numbers or ``metrics``."""
    context, ctx_keys = _context(runs)
    extras = distinguishing_keys(runs) + ctx_keys
    desc = ["Workload", "Target", "Drafter", "Policy", "T"]
    groups = _merge(runs, lambda r: _label_values(r, desc, extras))
    if metrics is None:
        metrics = [m for m in OVERVIEW_METRICS if any(r.metrics.get(m) is not None for r in runs)]
        what = ("output tok/s, mean time to first token (TTFT), median time per output token (TPOT), "
                "mean decode batch" + (", mean accepted length τ, share of decode steps that speculated"
                                       if "mean_accepted_length" in metrics else ""))
    else:
        _check_keys(metrics, runs, "--metrics")
        what = ", ".join(metrics) + " (mean over merged runs)"
    columns = _label_columns(desc, extras)
    rows = [[_show(v) for v in key] for key, _ in groups]
    _with_metrics(columns, rows, groups, metrics)
    caption = f"Runs: {what}" + (f"; {context}" if context else "") + "."
    return Table("Runs", caption, "runs", columns, rows, figures=_figures(runs, metrics))


def _figures(runs: list[Run], metrics) -> list[tuple[Run, str, object]]:
    """(run, metric, value) for each numeric metric of each run that has it."""
    return [(r, m, r.get(m)) for r in runs for m in metrics if _is_num(r.get(m))]


def _check_keys(keys: list[str], runs: list[Run], what: str) -> None:
    known = set().union(*(r.row for r in runs))
    for k in keys:
        if k not in known:
            close = difflib.get_close_matches(k, sorted(known), n=5, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"{what} key {k!r} is in none of the {len(runs)} runs{hint} "
                              f"(keys are dotted config / metrics.json paths, e.g. workload.concurrency, "
                              f"output_tok_per_s)")


def generic_table(runs: list[Run], group_by: list[str], metrics: list[str]) -> Table:
    """Rows grouped by the ``group_by`` values; each metric averaged over the group's runs."""
    _check_keys(group_by, runs, "--group-by")
    _check_keys(metrics, runs, "--metrics")
    groups = _merge(runs, lambda r: tuple(r.get(k) for k in group_by))
    columns = [Column(HEADERS.get(k, k), "$C$" if k == "workload.concurrency" else None,
                      "r" if all(_is_num(key[i]) or key[i] is None for key, _ in groups)
                      else "l") for i, k in enumerate(group_by)]
    rows = [[_show(v) for v in key] for key, _ in groups]
    # Random weights must be visible in every row they are in: on the target column if shown.
    tcol = group_by.index("target.name") if "target.name" in group_by else 0
    for row, (_, rs) in zip(rows, groups):
        if row and any(is_random(r) for r in rs) and "random weights" not in row[tcol]:
            row[tcol] += " (random weights)"
    _with_metrics(columns, rows, groups, metrics, always_count=True)
    caption = f"Metrics averaged over the runs of each group; grouped by {', '.join(group_by)}."
    return Table("Runs by " + ", ".join(group_by), caption, "grouped", columns, rows)


# ---------------------------------------------------------------------------------------- plots
def _figure():
    """A matplotlib Figure without pyplot (no global backend state), or None without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure(figsize=(5.0, 3.4), layout="constrained")


def _save(fig, out: Path, stem: str) -> list[str]:
    names = [f"{stem}.png", f"{stem}.pdf"]
    fig.savefig(out / names[0], dpi=200)
    fig.savefig(out / names[1], metadata={"CreationDate": None})  # byte-stable across re-runs
    return names


def plot_concurrency(series, out: Path, title_note: str = "") -> list[str] | None:
    fig = _figure()
    if fig is None:
        return None
    from matplotlib.ticker import FixedLocator, NullLocator

    ax = fig.add_subplot()
    all_c = sorted({c for _, cs, _ in series for c in cs})
    for label, cs, vals in series:
        pts = [(c, v) for c, v in zip(cs, vals) if v is not None]
        if pts:
            ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(all_c))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([str(c) for c in all_c])
    ax.set_xlabel("concurrency C (requests in flight)")
    ax.set_ylabel("output tok/s")
    ys = [v for _, _, vals in series for v in vals if v]
    if ys and max(ys) > 10 * min(ys):  # log-log: a speed-up reads as a constant vertical gap
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    title = "Throughput vs concurrency" + (f": {title_note}" if title_note else "")
    ax.set_title("\n".join(textwrap.wrap(title, 70)), fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, out, "throughput_vs_concurrency")


def plot_accepted_histogram(run: Run, label: str, out: Path, stem: str) -> list[str] | None:
    hist = {int(k): v for k, v in (run.metrics.get("accepted_histogram") or {}).items()}
    if not hist:
        return []
    fig = _figure()
    if fig is None:
        return None
    total = sum(hist.values())
    k = int(run.get("policy.k") or 0)
    if run.get("draft.steps"):  # a tree of k nodes accepts at most one path: `steps` deep
        k = min(k, int(run.get("draft.steps")))
    k = max(k, max(hist))
    lengths = list(range(1, k + 2))  # accepted drafts a -> accepted length a + 1 (bonus token)
    ax = fig.add_subplot()
    ax.bar(lengths, [hist.get(n - 1, 0) / total for n in lengths], color="tab:blue")
    mean = run.metrics.get("mean_accepted_length")
    if mean is not None:
        ax.axvline(mean, color="tab:red", linestyle="--", label=f"mean τ = {mean:.2f}")
        ax.legend(fontsize=8)
    ax.set_xticks(lengths)
    ax.set_xlabel("accepted length τ (tokens committed per verify step)")
    ax.set_ylabel(f"fraction of {total} request-steps")
    ax.set_title("\n".join(textwrap.wrap(label, 80)), fontsize=7)
    return _save(fig, out, stem)


def plot_acceptance_depth(series, out: Path) -> list[str] | None:
    """Acceptance rate against draft depth, one line per method."""
    fig = _figure()
    if fig is None:
        return None
    ax = fig.add_subplot()
    for label, rates in series:
        pts = [(d, v) for d, v in enumerate(rates, 1) if v is not None]
        ax.plot([d for d, _ in pts], [v for _, v in pts], marker="o", label=label)
    ax.set_xlabel("draft depth d")
    ax.set_ylabel("acceptance rate at d (parent accepted)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title("Acceptance by draft depth", fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, out, "acceptance_by_depth")


def _policy_steps(run: Run) -> list[tuple[float, int, int]]:
    """(t_s, decode batch, k) of the decode steps in the run's steps.jsonl, if k took >= 2 values."""
    path = run.path / "steps.jsonl"
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise SpecdecError(f"{path}: malformed JSON line: {line[:80]!r}") from None
        if rec.get("decode_bs"):
            steps.append((float(rec.get("t_s", len(steps))), int(rec["decode_bs"]), int(rec.get("k", 0))))
    return steps if len({k for _, _, k in steps}) >= 2 else []


def plot_policy_trace(run: Run, label: str, out: Path, stem: str) -> list[str] | None:
    """Decode batch size and the k the policy chose, step by step, against time."""
    steps = _policy_steps(run)
    if not steps:
        return []
    fig = _figure()
    if fig is None:
        return None
    t = [s[0] for s in steps]
    ax = fig.add_subplot()
    ax.step(t, [s[1] for s in steps], where="post", color="tab:blue", label="decode batch")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("decode batch (requests)", color="tab:blue")
    ax.set_ylim(bottom=0)
    ax2 = ax.twinx()
    ax2.step(t, [s[2] for s in steps], where="post", color="tab:red", label="k")
    ax2.set_ylabel("draft tokens k", color="tab:red")
    ax2.set_ylim(bottom=0, top=max(s[2] for s in steps) * 1.15 + 1)
    ax.grid(alpha=0.3)
    ax.set_title("\n".join(textwrap.wrap(label, 80)), fontsize=7)
    return _save(fig, out, stem)


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", s).strip("_")[:60]


# ---------------------------------------------------------------------------------------- entry
def split_partial(runs: list[Run]) -> tuple[list[Run], list[Path]]:
    """(finished runs, directories of partial ones): a run stopped before the end (a call's time
    limit, Ctrl-C) writes metrics.json marked ``"partial": true`` over the requests it finished. Its
    throughput is not a point of its sweep (0 tok/s when no request had finished) and it has no
    steady window, so in a table it would be averaged with a finished repeat of the same point, and
    turn a timed sweep's tables from steady-window to whole-run tok/s."""
    partial = [r.path for r in runs if r.metrics.get("partial")]
    done = [r for r in runs if not r.metrics.get("partial")]
    if runs and not done:
        raise SpecdecError(f"every run found is partial (stopped before the end): {', '.join(map(str, partial))}")
    return done, partial


def build_report(runs: list[Run], out: Path, group_by: list[str] | None = None,
                 metrics: list[str] | None = None, unfinished=(), partial=(),
                 figures_out: list | None = None) -> tuple[str, list[str]]:
    """Write report.md, report.tex and plots into ``out``; return the markdown and the plot files.

    ``unfinished``: run directories without metrics.json, named in the report so that a sweep
    missing a point (a failed run) says so; ``partial``: those of partial runs (``split_partial``),
    left out of every table and named the same way. ``figures_out``: a list that receives the
    (run, metric, value) behind every table (for the ledger, ``append_ledger``).
    """
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecdecError(f"--out {out}: cannot create the folder ({e.strerror})") from None
    tables: list[Table] = []
    figures: list[tuple[str, str]] = []  # (caption, png file name)
    plot_files: list[str] = []
    plots_skipped = False
    if group_by:
        tables.append(generic_table(runs, group_by, metrics or [
            m for m in OVERVIEW_METRICS if any(r.metrics.get(m) is not None for r in runs)]))
    elif metrics:  # one row per config, as in the default report
        tables.append(overview_table(runs, metrics))
    else:
        spec = speculation_table(runs)
        conc = concurrency_table(runs)
        if spec:
            summary = speculation_summary(runs)
            if summary is not None:
                tables.append(summary)
            tables.append(spec[0])
        depth = acceptance_depth_tables(runs)
        if depth:
            tables += depth[0]
            names = plot_acceptance_depth(depth[1], out)
            if names is None:
                plots_skipped = True
            else:
                figures.append(("Acceptance rate by draft depth", names[0]))
                plot_files += names
        if conc:
            tables.append(conc[0])
            names = plot_concurrency(conc[1], out, conc[2])
            if names is None:
                plots_skipped = True
            else:
                figures.append(("Output tok/s against concurrency C", names[0]))
                plot_files += names
        for i, (table, series, label, ktable, spread) in enumerate(envelope_tables(runs), 1):
            tables.append(table)
            if spread is not None:
                tables.extend(spread)
            if ktable is not None:
                tables.append(ktable)
            names = plot_envelope(series, out, label, f"policy_envelope_{i:02d}_" + _slug(label))
            if names is None:
                plots_skipped = True
            else:
                figures.append((f"Policies vs the envelope: {label}", names[0]))
                plot_files += names
        for i, (table, summary, series, label) in enumerate(crossover_tables(runs), 1):
            tables += [table, summary]
            names = plot_envelope(series, out, label, f"crossover_{i:02d}_" + _slug(label))
            if names is None:
                plots_skipped = True
            else:
                figures.append((f"Crossover, replayed acceptance: {label}", names[0]))
                plot_files += names
        shapes = plot_crossover_shapes(runs, out)
        if shapes is None:
            plots_skipped = True
        for caption, names in shapes or []:
            figures.append((caption, names[0]))
            plot_files += names
        tables += off_cost_tables(runs)
        for extra in (exact_cost_table(runs), step_breakdown_table(runs), moe_step_cost_table(runs),
                      step_floor_table(runs), switch_table(runs), policy_switch_table(runs)):
            if extra is not None:
                tables.append(extra)
        names = plot_moe_step_cost(runs, out)
        if names is None:
            plots_skipped = True
        elif names:
            figures.append(("MoE step cost: step / plain vs B per k", names[0]))
            plot_files += names
        tables.append(overview_table(runs))
        for i, (label, run) in enumerate(spec[1] if spec else [], 1):
            c = _concurrency(run)
            stem = f"accepted_length_{i:02d}_" + _slug(f"{run.get('workload.name')}_{run.get('draft.name')}_"
                                                       f"{run.get('policy.name')}" + (f"_C{c}" if c else ""))
            names = plot_accepted_histogram(run, label, out, stem)
            if names is None:
                plots_skipped = True
                break
            if names:
                figures.append((f"Accepted length τ: {label}", names[0]))
                plot_files += names
            names = plot_policy_trace(run, label, out, stem.replace("accepted_length_", "policy_trace_", 1))
            if names:
                figures.append((f"Decode batch and chosen k: {label}", names[0]))
                plot_files += names
    src = str(runs[0].path) if len(runs) == 1 else ", ".join(sorted({str(r.path.parent) for r in runs}))
    md = ["# specdec report", "", f"{len(runs)} run{'s' * (len(runs) != 1)} from {src}.", ""]
    if unfinished:
        md += [f"Not included: {len(unfinished)} run director{'ies' if len(unfinished) > 1 else 'y'} "
               f"without metrics.json (failed or unfinished): {', '.join(map(str, unfinished))}.", ""]
    if partial:
        md += [f"Not included: {len(partial)} partial run{'s' * (len(partial) != 1)} (stopped before the end; "
               f"metrics.json marked partial): {', '.join(map(str, partial))}.", ""]
    for t in tables:
        md += [to_markdown(t), ""]
    if figures:
        md += ["## Plots", ""] + [f"![{cap}]({name})" for cap, name in figures] + [""]
    if plots_skipped:
        md += ["Plots skipped: matplotlib is not installed (pip install -e \".[plot]\").", ""]
    markdown = "\n".join(md)
    if figures_out is not None:
        figures_out.extend(f for t in tables for f in t.figures)
    (out / "report.md").write_text(markdown)
    tex = ["% specdec report: tables for \\input{}; needs \\usepackage{booktabs}.", ""]
    tex += [to_latex(t) + "\n" for t in tables]
    (out / "report.tex").write_text("\n".join(tex))
    return markdown, plot_files


# ---------------------------------------------------------------------------------------- ledger
REPO = Path(__file__).resolve().parents[1]
LEDGER = REPO / "experiments" / "results" / "ledger.csv"
LEDGER_FIELDS = ("date", "commit", "device", "experiment", "overrides", "metric", "value", "run_dir")
# Overrides that say where or how a run was recorded, or repeat the experiment column: not in the ledger.
QUIET_OVERRIDES = ("logger", "hydra.", "run_dir", "+experiment=", "experiment=", "device=")


def _read_overrides(path: Path) -> list[str] | None:
    """The run's Hydra overrides: metrics.json ``overrides`` (specdec.run records them), else
    ``.hydra/overrides.yaml``; None when neither is there."""
    met = path / "metrics.json"
    try:
        got = json.loads(met.read_text()).get("overrides") if met.is_file() else None
    except (OSError, json.JSONDecodeError):
        got = None
    if isinstance(got, list):
        return [str(o) for o in got]
    hyd = path / ".hydra" / "overrides.yaml"
    if hyd.is_file():
        from omegaconf import OmegaConf

        try:
            return [str(o) for o in OmegaConf.to_container(OmegaConf.load(hyd)) or []]
        except Exception:
            return None
    return None


def run_overrides(run: Run) -> str:
    """The overrides that matter, compact: the run's Hydra overrides less bookkeeping (logger, hydra.*,
    run_dir, the experiment itself), space-separated. A ``plain/`` baseline without its own takes its run's,
    draft and policy replaced by plain decoding; a run without any names its drafter and policy."""
    got = _read_overrides(run.path)
    if got is None and run.path.name == "plain" and run.origin == Path(os.path.abspath(run.path.parent)):
        parent = _read_overrides(run.path.parent)
        if parent is not None:
            got = [o for o in parent if not o.lstrip("+~").startswith(("draft", "policy", "acceptance"))]
            got += ["draft=none", "policy=never"]
    if got is None:
        got = [f"draft={run.get('draft.name', 'none')}", f"policy={run.get('policy.name', 'never')}"]
    return " ".join(o for o in got if not o.lstrip("+~").startswith(QUIET_OVERRIDES) and not o.startswith(QUIET_OVERRIDES))


def _ledger_path_of(run: Run) -> str:
    """The run directory, relative to the repository when inside it."""
    path = Path(os.path.abspath(run.path))
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def _ledger_value(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def ledger_rows(figures) -> list[dict]:
    """One ledger row per (run, metric, value), each (run, metric) once."""
    rows, seen = [], set()
    for run, metric, value in figures:
        key = (id(run), metric)
        if key in seen or value is None:
            continue
        seen.add(key)
        m = run.metrics
        rows.append({"date": str(m.get("date_utc") or m.get("date") or "")[:10],
                     "commit": str(m.get("commit") or "unknown"),
                     "device": str(m.get("device_name") or m.get("device") or ""),
                     "experiment": str(run.config.get("name") or ""),
                     "overrides": run_overrides(run), "metric": metric, "value": _ledger_value(value),
                     "run_dir": _ledger_path_of(run)})
    return rows


def append_ledger(path: Path, figures) -> tuple[int, int]:
    """Append the rows of ``figures`` to the ledger CSV at ``path`` (created with its header if missing),
    leaving out every row whose (commit, run_dir, metric) is there already. Returns (appended, already
    there)."""
    import csv

    rows = ledger_rows(figures)
    have = set()
    try:
        if path.is_file():
            with open(path, newline="") as f:
                have = {(r.get("commit"), r.get("run_dir"), r.get("metric")) for r in csv.DictReader(f)}
            text = path.read_bytes()
            if text and not text.endswith(b"\n"):  # a last line without its newline: the next row starts fresh
                with open(path, "ab") as f:
                    f.write(b"\n")
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w", newline="") as f:
                csv.writer(f).writerow(LEDGER_FIELDS)
        new = []
        for r in rows:
            key = (r["commit"], r["run_dir"], r["metric"])
            if key not in have:
                have.add(key)
                new.append(r)
        with open(path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=LEDGER_FIELDS).writerows(new)
    except OSError as e:
        raise SpecdecError(f"--ledger {path}: cannot write it ({e.strerror or e})") from None
    return len(new), len(rows) - len(new)


def default_ledger() -> Path | None:
    """$SPECDEC_LEDGER (a path; "none" or empty: no ledger), else experiments/results/ledger.csv of this
    checkout (None for an installed package without one)."""
    env = os.environ.get("SPECDEC_LEDGER")
    if env is not None:
        return None if env.strip().lower() in ("", "none") else Path(env)
    return LEDGER if LEDGER.parent.is_dir() else None


def _keys(s: str) -> list[str]:
    return [k.strip() for k in s.split(",") if k.strip()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m specdec.report",
                                 description="Tables (markdown + LaTeX) and plots from specdec run directories.")
    ap.add_argument("paths", nargs="+", metavar="RUN_DIR",
                    help="run directories, or folders above them (outputs/, multirun/NAME/)")
    ap.add_argument("--out", default="report", help="output folder (default: ./report)")
    ap.add_argument("--group-by", type=_keys, default=None, metavar="KEYS",
                    help="comma-separated dotted keys, e.g. workload.concurrency,policy.name: "
                         "one table grouped by these instead of the default report")
    ap.add_argument("--metrics", type=_keys, default=None, metavar="KEYS",
                    help="comma-separated metrics.json keys for that table, e.g. output_tok_per_s")
    ap.add_argument("--ledger", default=None, metavar="PATH",
                    help="CSV the reported figures are appended to, one row each (default: "
                         "experiments/results/ledger.csv of this checkout, or $SPECDEC_LEDGER)")
    ap.add_argument("--no-ledger", action="store_true", help="append nothing to the ledger")
    args = ap.parse_args(argv)
    ledger = None if args.no_ledger else (Path(args.ledger) if args.ledger else default_ledger())
    figures: list = []
    try:
        runs, partial = split_partial(load_runs(args.paths))
        markdown, plots = build_report(runs, Path(args.out), args.group_by, args.metrics,
                                       unfinished=find_unfinished(args.paths), partial=partial,
                                       figures_out=figures)
        added = append_ledger(ledger, figures) if ledger is not None else None
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        print(markdown)
    except BrokenPipeError:  # `... | head` stopped reading; the files are written all the same
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    print(f"wrote report.md, report.tex and {len(plots)} plot files to {args.out}", file=sys.stderr)
    if added is not None:
        print(f"ledger {ledger}: {added[0]} rows appended, {added[1]} already there", file=sys.stderr)


if __name__ == "__main__":
    main()
