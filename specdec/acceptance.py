"""Replayed acceptance: real-shape targets with random weights, accepting what a real pair accepted.

A random-weight target (``target=llama31_8b_random``) and a random EAGLE-3 head
(``draft=eagle3_random``) cost exactly what the real pair would per step, but accept nothing. With
``acceptance=replay`` the engine still does all of the step's work (draft the tree, verify every
node in one target forward, ``verify_accept``, commit the accepted nodes' KV, extend the draft),
and then the accepted length of each row is *replaced* by one drawn from a trace for that tree
size; the accepted path is forced along the drafted tree (the path from the root to its deepest
node, ties to the lowest index: the growth keeps candidates in score order, so the best-scored
one) down to the drawn depth, capped by that depth, and the bonus token is the target's argmax at the last
accepted node (greedy, whatever ``sampling.temperature``; the sampling draws are still made). The
forced verdict adds a dozen small launches to the graphed step (tens of microseconds). Commit then
moves exactly those nodes' KV, as usual. Committed tokens are real
tree tokens but not the target's greedy output: every output of such a run is labelled
``"acceptance": "replayed"`` (metrics.json, the report's tables, W&B).

Traces (``acceptance.trace=PATH``; ``pkg://specdec/data/NAME`` names one installed with the package,
specdec/data/__init__.py):
  * a run directory (or a folder of them): its ``steps.jsonl`` (per step: ``k`` and the accepted
    draft count of each row, plus ``accepted_ids`` when recorded: per-request sequences), or, when
    a run kept only its ``metrics.json``, its ``accepted_histogram`` if the run used one k only;
  * a trace file written by ``python -m specdec.acceptance build-trace RUN_DIRS -o trace.json``
    (only the accepted-length data of several runs: small enough to commit), or a steps.jsonl;
  * ``acceptance.parametric.mean=M`` (instead of the trace, when set): a geometric per-depth acceptance, labelled
    "parametric": each level of the path is accepted with probability p, so P(a >= i) = p^i up to
    the tree's depth D, and p is solved so that a tree of depth ``parametric.depth`` has a mean
    accepted length (drafts + bonus) of M. Shallower trees get the same p, truncated at their depth.

Draws: a request whose id (without a ``#n`` repeat suffix) has a recorded sequence at this tree
size replays it in order (``per_request``); others, and requests past their sequence's end, draw
from the size's empirical distribution. Draws are seeded (``acceptance.seed``, default the run's).
A tree size the trace lacks is an error unless ``missing: nearest`` (the recorded size closest to
it, capped at this tree's depth; the mapping is recorded in metrics.json).

    python -m specdec.acceptance build-trace RUN_DIR [RUN_DIR ...] -o trace.json
    python -m specdec.acceptance show trace.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .data import resolve as resolve_data_path
from .engine.state import upload
from .errors import ConfigError

TRACE_FORMAT = "specdec-acceptance-trace/1"
REPLAYED_LABEL = "replayed"
REAL_LABEL = "real"


# -- traces ---------------------------------------------------------------------------------------
@dataclass
class SizeTrace:
    """Accepted draft counts recorded at one tree size (k draft tokens)."""

    hist: dict[int, int] = field(default_factory=dict)  # accepted drafts -> steps x rows
    requests: dict[str, list[int]] = field(default_factory=dict)  # request id -> accepted, in step order

    def add_(self, accepted: int, request_id: str | None = None) -> None:
        self.hist[accepted] = self.hist.get(accepted, 0) + 1
        if request_id is not None:
            self.requests.setdefault(_base_id(request_id), []).append(accepted)

    @property
    def count(self) -> int:
        return sum(self.hist.values())

    def mean_length(self) -> float:
        """Mean accepted length (drafts + the bonus token): tokens committed per row-step."""
        return 1 + sum(a * n for a, n in self.hist.items()) / max(1, self.count)


@dataclass
class AcceptanceTrace:
    """Recorded accepted counts per tree size, or a parametric per-depth acceptance (``p``)."""

    sizes: dict[int, SizeTrace] = field(default_factory=dict)
    source: list[str] = field(default_factory=list)
    kind: str = "recorded"  # recorded | parametric
    p: float | None = None  # parametric: per-level acceptance probability
    parametric: dict | None = None  # parametric: {mean, depth} it was solved for

    def label(self) -> str:
        if self.kind == "parametric":
            return f"parametric (geometric, mean accepted length {self.parametric['mean']:g} at depth " \
                   f"{self.parametric['depth']}, p={self.p:.4f})"
        return ", ".join(self.source)

    def probs(self, k: int, depth: int) -> list[float]:
        """P(accepted drafts = a) for a = 0 .. depth at tree size k (recorded counts beyond the depth
        are capped at it)."""
        if self.kind == "parametric":
            tail = [self.p ** i for i in range(depth + 1)] + [0.0]  # P(a >= i)
            return [tail[i] - tail[i + 1] for i in range(depth + 1)]
        st = self.sizes[k]
        out = [0.0] * (depth + 1)
        for a, n in st.hist.items():
            out[min(a, depth)] += n
        total = sum(out)
        return [x / total for x in out]

    def to_json(self) -> dict:
        d = {"format": TRACE_FORMAT, "kind": self.kind, "source": self.source}
        if self.kind == "parametric":
            d.update(p=self.p, parametric=self.parametric)
        d["sizes"] = {str(k): {"hist": {str(a): n for a, n in sorted(s.hist.items())},
                               "mean_accepted_length": round(s.mean_length(), 4),
                               **({"requests": s.requests} if s.requests else {})}
                      for k, s in sorted(self.sizes.items())}
        return d

    @classmethod
    def from_json(cls, d: dict, source: str) -> "AcceptanceTrace":
        if not isinstance(d, dict) or d.get("format") != TRACE_FORMAT:
            raise ConfigError(f"acceptance trace {source}: not a {TRACE_FORMAT} file (write one with "
                              "`python -m specdec.acceptance build-trace RUN_DIRS -o trace.json`)")
        if d.get("kind") == "parametric":
            par = d.get("parametric") or {}
            return parametric_trace(float(par["mean"]), int(par["depth"]))
        tr = cls(source=list(d.get("source") or [source]))
        try:
            for k, s in (d.get("sizes") or {}).items():
                tr.sizes[int(k)] = SizeTrace({int(a): int(n) for a, n in s["hist"].items()},
                                             {str(r): [int(x) for x in v] for r, v in (s.get("requests") or {}).items()})
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"acceptance trace {source}: malformed sizes entry ({e})") from None
        return tr


def _base_id(request_id: str) -> str:
    """A request's id without the ``#n`` suffix closed-loop repeats of a prompt get."""
    return str(request_id).split("#", 1)[0]


def _read_steps(path: Path, tr: AcceptanceTrace) -> int:
    """Add a steps.jsonl's speculative steps to ``tr``; returns the number of accepted entries."""
    n = 0
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        k, acc = int(rec.get("k") or 0), rec.get("accepted") or []
        if k <= 0 or not acc:
            continue
        ids = rec.get("accepted_ids")
        ids = ids if ids is not None and len(ids) == len(acc) else [None] * len(acc)
        st = tr.sizes.setdefault(k, SizeTrace())
        for a, rid in zip(acc, ids):
            st.add_(int(a), rid)
        n += len(acc)
    return n


def _read_metrics(path: Path, tr: AcceptanceTrace) -> int:
    """A run without steps.jsonl: its metrics.json histogram, if every speculative step had one k."""
    m = json.loads(path.read_text())
    ks = [int(k) for k in (m.get("k_step_fraction") or {}) if int(k) > 0]
    hist = m.get("accepted_histogram") or {}
    if len(ks) != 1 or not hist:
        return 0  # several k in one histogram cannot be told apart
    st = tr.sizes.setdefault(ks[0], SizeTrace())
    for a, n in hist.items():
        st.hist[int(a)] = st.hist.get(int(a), 0) + int(n)
    return sum(int(n) for n in hist.values())


def run_dirs(path: Path) -> list[Path]:
    """Run directories at or below ``path`` (folders holding steps.jsonl or metrics.json)."""
    if (path / "steps.jsonl").is_file() or (path / "metrics.json").is_file():
        return [path]
    return sorted({p.parent for p in path.rglob("metrics.json")} | {p.parent for p in path.rglob("steps.jsonl")})


def build_trace(paths) -> AcceptanceTrace:
    """One trace from run directories (steps.jsonl preferred, metrics.json's histogram otherwise),
    steps.jsonl files and trace files; sizes present in several are summed (a request's sequence
    is kept from the first source that has it)."""
    tr = AcceptanceTrace()
    for raw in paths:
        path = resolve_data_path(raw)  # pkg://specdec/data/NAME: a trace installed with the package
        parts = []
        if path.is_dir():
            for d in run_dirs(path):
                part = AcceptanceTrace()
                if (d / "steps.jsonl").is_file():
                    n = _read_steps(d / "steps.jsonl", part)
                else:
                    n = _read_metrics(d / "metrics.json", part)
                if n:
                    part.source = [str(d)]
                    parts.append(part)
        elif path.is_file() and path.suffix == ".jsonl":
            part = AcceptanceTrace(source=[str(path)])
            if _read_steps(path, part):
                parts.append(part)
        elif path.is_file():
            try:
                d = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"acceptance trace {path}: not valid JSON ({e.msg})") from None
            parts.append(AcceptanceTrace.from_json(d, str(path)))
        else:
            raise ConfigError(f"acceptance trace {path} does not exist: give a run directory (steps.jsonl or "
                              "metrics.json), a steps.jsonl, or a trace file from `python -m specdec.acceptance "
                              "build-trace`")
        for part in parts:
            if part.kind == "parametric":
                if len(paths) > 1:
                    raise ConfigError(f"{path}: a parametric trace cannot be merged with recorded ones")
                return part
            tr.source += part.source
            for k, s in part.sizes.items():
                dst = tr.sizes.setdefault(k, SizeTrace())
                for a, n in s.hist.items():
                    dst.hist[a] = dst.hist.get(a, 0) + n
                for rid, seq in s.requests.items():
                    dst.requests.setdefault(rid, seq)
    if not tr.sizes:
        raise ConfigError(f"no accepted lengths found in {[str(p) for p in paths]}: need speculative steps in a "
                          "steps.jsonl, or a metrics.json of a run that used one draft size only")
    return tr


def solve_p(mean_length: float, depth: int) -> float:
    """Per-level acceptance p with 1 + sum_{i=1..depth} p^i = mean_length (bisection)."""
    if depth < 1 or not 1 < mean_length < depth + 1:
        raise ConfigError(f"acceptance.parametric: mean={mean_length} must lie in (1, depth + 1 = {depth + 1}) "
                          f"(mean accepted length = accepted drafts + 1, at most depth drafts)")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        p = (lo + hi) / 2
        if 1 + sum(p ** i for i in range(1, depth + 1)) < mean_length:
            lo = p
        else:
            hi = p
    return (lo + hi) / 2


def parametric_trace(mean: float, depth: int) -> AcceptanceTrace:
    p = solve_p(float(mean), int(depth))
    return AcceptanceTrace(kind="parametric", p=p, parametric={"mean": float(mean), "depth": int(depth)},
                           source=[f"parametric:mean={float(mean):g},depth={int(depth)}"])


# -- replay ---------------------------------------------------------------------------------------
def forced_verdict(tokens, depth, mask, logits, drawn, max_depth: int):
    """(accept_len [B] int32, accepted nodes [B, T] int32, out_tokens [B, T] int64) of a verify step
    whose rows accept ``drawn`` [B] drafts along the path from the root to the tree's deepest node
    (ties: the lowest index, which the growth gives the best-scored node), capped at that node's
    depth and at ``max_depth``, in verify_accept's layout: nodes[:, 0] = 0 (the root), nodes[:, i] =
    the path's node at depth i for i <= accept_len, then -1; out_tokens[:, i] = the token of the path's
    node at depth i + 1 for i < accept_len, out_tokens[:, accept_len] = the target's argmax at the last
    accepted node, then -1. Device ops only, a dozen launches (captured in the step's CUDA graph).

    tokens [B, T] int64, depth [B, T] int32, mask [B, T] int64 (ancestor-or-self bits), logits [B, T, V]."""
    B, T = tokens.shape
    dev = tokens.device
    idx = torch.arange(T, device=dev)
    dep = depth.long()  # [B, T]
    leaf = (dep * (T + 1) - idx[None]).argmax(1, keepdim=True)  # [B, 1] deepest node, lowest index
    on_path = (mask.gather(1, leaf) >> idx[None]) & 1  # [B, T] 1 on the leaf's ancestors (and itself)
    d = torch.arange(max_depth + 1, device=dev)
    at = on_path[:, None, :].bool() & (dep[:, None, :] == d[None, :, None])  # [B, D + 1, T]
    path = torch.where(at.any(2), at.int().argmax(2), T)  # [B, D + 1] node at each depth (T: none)
    a = torch.minimum(drawn.long().clamp(min=0), dep.gather(1, leaf)[:, 0].clamp(max=max_depth))  # [B]
    nodes = torch.full((B, T), -1, dtype=torch.int32, device=dev)
    nodes[:, : max_depth + 1] = torch.where(d[None] <= a[:, None], path, -1).to(torch.int32)
    tok = tokens.gather(1, path[:, 1:].clamp(max=T - 1))  # [B, D] token of the path's node at depth i + 1
    last = path.gather(1, a[:, None])  # [B, 1] the last accepted node
    V = logits.shape[-1]
    bonus = logits.gather(1, last[:, :, None].expand(B, 1, V))[:, 0].argmax(-1)  # [B]
    out = torch.full((B, T), -1, dtype=torch.int64, device=dev)
    out[:, :max_depth] = torch.where(d[None, :max_depth] < a[:, None], tok, -1)
    out.scatter_(1, a[:, None], bonus[:, None])
    return a.to(torch.int32), nodes, out


class ReplayAcceptance:
    """The engine's replay hook: ``prepare_`` draws each row's accepted length on the host before a
    speculative step's launch (into a static device buffer, so graphs replay it), and ``verdict``
    (called by the step right after verify_accept) forces the verdict to it."""

    label = REPLAYED_LABEL

    def __init__(self, trace: AcceptanceTrace, *, seed: int = 0, per_request: bool = True,
                 missing: str = "error"):
        import numpy as np

        if missing not in ("error", "nearest"):
            raise ConfigError(f"acceptance.missing={missing!r}; valid: error, nearest")
        self.trace, self.per_request, self.missing = trace, bool(per_request), missing
        self.rng = np.random.default_rng(int(seed))
        self.size_map: dict[int, int] = {}  # tree size -> recorded size used
        self._cdf: dict[int, object] = {}
        self._depth: dict[int, int] = {}
        self._cursor: dict[tuple[int, str], int] = {}
        self.buffer = None
        self.drawn = 0
        # Counterfactual samples (``counterfactual_``): {k: smaller sizes scored on a step at k}; each
        # draw at k also sets ``last_cf`` {smaller k': tokens it would have committed, per row}
        self.cf_ks: dict[int, tuple[int, ...]] = {}
        self.last_cf: dict[int, list[int]] | None = None

    # -- set-up -----------------------------------------------------------------------------------
    def bind_(self, state, drafter, ks) -> None:
        """Allocate the per-row draw buffer and check every configured size against the trace."""
        import numpy as np

        # [R] drafts to accept: written for every row before each speculative step (prepare_ / fill_),
        # so no row compaction needs to move it
        self.buffer = state.add_row_buffer("replay_accept", (), torch.int32, follows="none")
        for k in ks:
            if k <= 0:
                continue
            T = drafter.num_nodes(k)
            depth = (drafter.max_path_nodes(T) - 1) if hasattr(drafter, "max_path_nodes") else T - 1
            self._depth[k] = depth
            src = k
            if self.trace.kind != "parametric" and k not in self.trace.sizes:
                have = sorted(self.trace.sizes)
                if self.missing == "error":
                    raise ConfigError(f"acceptance trace {self.trace.label()} has no steps at tree size k={k} "
                                      f"(recorded sizes: {have}); record one, or set acceptance.missing=nearest")
                src = min(have, key=lambda s: (abs(s - k), s))
            self.size_map[k] = src
            self._cdf[k] = np.cumsum(self.trace.probs(src, depth))

    def depth(self, k: int) -> int:
        return self._depth[k]

    def counterfactual_(self, smaller: dict[int, tuple[int, ...]]) -> None:
        """Score, on every step at k, the sizes ``smaller[k]`` too (a policy's counterfactual
        acceptance, replayed): each row's k' length is the k' distribution's value at the quantile
        of its k draw (the same uniform draw; a recorded per-request length at the middle of its
        quantile range), so a row that accepts much at k accepts much at k', and the k' samples have
        the trace's k' distribution. A replayed run's policy then learns every smaller size from the
        steps of a larger one, as it does from a real drafter's counterfactual commits."""
        for k, small in smaller.items():
            missing = [j for j in (k, *small) if j not in self._cdf]
            if missing:
                raise ConfigError(f"replayed acceptance: counterfactual sizes {missing} were not bound "
                                  f"(configured sizes {sorted(self._cdf)})")
        self.cf_ks = {int(k): tuple(int(j) for j in small) for k, small in smaller.items() if small}

    # -- per step ----------------------------------------------------------------------------------
    def draw(self, k: int, request_ids) -> list[int]:
        """Accepted drafts for each row of a step at size k (request ids in row order)."""
        if k not in self._cdf:
            raise ConfigError(f"replayed acceptance: k={k} was not bound (configured sizes {sorted(self._cdf)})")
        depth, cdf = self._depth[k], self._cdf[k]
        seqs = self.trace.sizes[self.size_map[k]].requests if self.trace.kind != "parametric" else {}
        small = self.cf_ks.get(k, ())
        out, quantiles = [], []
        for rid in request_ids:
            seq = seqs.get(_base_id(rid)) if self.per_request and seqs else None
            if seq is not None:
                key = (k, str(rid))
                i = self._cursor.get(key, 0)
                if i < len(seq):
                    self._cursor[key] = i + 1
                    a = min(int(seq[i]), depth)
                    out.append(a)
                    if small:  # the middle of the recorded length's quantile range
                        quantiles.append(((cdf[a - 1] if a > 0 else 0.0) + cdf[a]) / 2 / cdf[-1])
                    continue
            u = self.rng.random()
            out.append(int(min(cdf.searchsorted(u * cdf[-1], side="right"), depth)))
            if small:
                quantiles.append(u)
        self.drawn += len(out)
        self.last_cf = {j: [1 + int(min(self._cdf[j].searchsorted(u * self._cdf[j][-1], side="right"),
                                        self._depth[j])) for u in quantiles] for j in small} if small else None
        return out

    def prepare_(self, state, n: int, k: int, request_ids) -> None:
        """Draw rows 0 .. n-1's accepted lengths for the next step at size k into the device buffer
        (a small host-to-device copy, queued: no sync)."""
        if k <= 0 or n == 0:
            return
        self.buffer[:n].copy_(upload(self.draw(k, request_ids), torch.int32, self.buffer.device))

    def fill_(self, n: int, k: int) -> None:
        """Rows 0 .. n-1 accept the trace's mean at size k (rounded): profiled steps commit what a
        served step commits on average."""
        cdf = self._cdf[k]
        probs = [cdf[0]] + [cdf[i] - cdf[i - 1] for i in range(1, len(cdf))]
        mean = sum(i * p for i, p in enumerate(probs)) / cdf[-1]
        self.buffer[:n].fill_(int(round(mean)))

    def verdict(self, tree, logits, B: int, T: int):
        """The step's hook after verify_accept: the forced verdict for rows 0 .. B-1 (device ops)."""
        depth = self._depth.get(T - 1, T - 1)
        return forced_verdict(tree.tokens, tree.depth, tree.mask, logits, self.buffer[:B], depth)

    def describe(self) -> dict:
        """What metrics.json records about the replay."""
        d = {"acceptance": REPLAYED_LABEL, "acceptance_trace": self.trace.label(),
             "acceptance_kind": self.trace.kind,
             "acceptance_sizes": {str(k): v for k, v in sorted(self.size_map.items())},
             "acceptance_trace_mean_length": {str(k): round(float(self._mean_length(k)), 4) for k in sorted(self._cdf)}}
        return d

    def _mean_length(self, k: int) -> float:
        cdf = self._cdf[k]
        return 1 + sum(1 - cdf[i] / cdf[-1] for i in range(len(cdf) - 1))


def build_acceptance(cfg, *, seed: int = 0):
    """From the Hydra ``acceptance`` group: real -> None; replay -> ReplayAcceptance."""
    if cfg is None:
        return None
    name = cfg.get("name", "real")
    if name == "real":
        return None
    if name != "replay":
        raise ConfigError(f"acceptance={name!r}; valid: real, replay")
    par = cfg.get("parametric") or {}
    trace_path = cfg.get("trace")
    if par.get("mean") is not None:  # wins over a trace, so one sweep can cover both (mean=null,6)
        trace = parametric_trace(float(par["mean"]), int(par.get("depth") or 7))
    elif trace_path:
        trace = build_trace([trace_path])
    else:
        raise ConfigError("acceptance=replay needs acceptance.trace=PATH (a run directory or a trace file from "
                          "`python -m specdec.acceptance build-trace`) or acceptance.parametric.mean=M")
    s = cfg.get("seed")
    return ReplayAcceptance(trace, seed=int(seed if s is None else s), per_request=bool(cfg.get("per_request", True)),
                            missing=str(cfg.get("missing", "error")))


def label_of(metrics: dict) -> str:
    """"replayed" for a run whose acceptance was replayed, else "real"."""
    return REPLAYED_LABEL if metrics.get("acceptance") == REPLAYED_LABEL else REAL_LABEL


def request_lengths(paths) -> dict:
    """{"source", "sets": {workload name: [{id, prompt_len, output_len}]}} from the requests.jsonl of the
    run directories below ``paths`` (first record of each id per workload; failed requests skipped)."""
    sets: dict[str, dict[str, dict]] = {}
    srcs = []
    for raw in paths:
        for d in run_dirs(Path(raw)):
            req, cfg = d / "requests.jsonl", d / "config.json"
            if not req.is_file():
                continue
            name = json.loads(cfg.read_text()).get("workload", {}).get("name", "workload") if cfg.is_file() else "workload"
            srcs.append(str(d))
            rows = sets.setdefault(name, {})
            for line in req.read_text().splitlines():
                if not line.strip():
                    continue
                r = json.loads(line)
                rid = _base_id(r.get("id", ""))
                if "error" in r or rid in rows:
                    continue
                rows[rid] = {"id": rid, "prompt_len": int(r["prompt_tokens"]), "output_len": int(r["output_tokens"])}
    if not sets:
        raise ConfigError(f"no requests.jsonl below {[str(p) for p in paths]}")
    return {"source": ", ".join(srcs), "sets": {k: list(v.values()) for k, v in sets.items()}}


# -- CLI ------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specdec.acceptance", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build-trace", help="accepted lengths of run directories -> one trace file")
    b.add_argument("paths", nargs="+", type=Path)
    b.add_argument("-o", "--out", type=Path, required=True)
    b.add_argument("--no-requests", action="store_true", help="keep only the histograms (a smaller file)")
    ln = sub.add_parser("lengths", help="prompt / output lengths of run directories' requests.jsonl -> a lengths "
                                        "file for workload sources {kind: synthetic, lengths: FILE, set: NAME}")
    ln.add_argument("paths", nargs="+", type=Path)
    ln.add_argument("-o", "--out", type=Path, required=True)
    s = sub.add_parser("show", help="tree sizes, counts and mean accepted lengths of a trace")
    s.add_argument("path", type=Path)
    p = sub.add_parser("parametric", help="the parametric trace's distribution at each depth")
    p.add_argument("--mean", type=float, required=True)
    p.add_argument("--depth", type=int, default=7)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "build-trace":
            tr = build_trace(args.paths)
            if args.no_requests:
                for st in tr.sizes.values():
                    st.requests = {}
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(tr.to_json(), separators=(",", ":")) + "\n")
            print(f"wrote {args.out}: " + ", ".join(f"k={k}: {s.count} row-steps, mean accepted length "
                                                     f"{s.mean_length():.2f}, {len(s.requests)} request sequences"
                                                     for k, s in sorted(tr.sizes.items())))
        elif args.cmd == "lengths":
            doc = request_lengths(args.paths)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
            print(f"wrote {args.out}: " + ", ".join(f"{k}: {len(v)} prompts" for k, v in doc["sets"].items()))
        elif args.cmd == "show":
            tr = build_trace([args.path])
            print(f"{tr.kind}: {tr.label()}")
            for k, st in sorted(tr.sizes.items()):
                print(f"  k={k}: {st.count} row-steps, mean accepted length {st.mean_length():.3f}, "
                      f"{len(st.requests)} request sequences, histogram {dict(sorted(st.hist.items()))}")
        else:
            tr = parametric_trace(args.mean, args.depth)
            print(tr.label())
            for d in range(1, args.depth + 1):
                pr = tr.probs(0, d)
                print(f"  depth {d}: mean accepted length {1 + sum(i * x for i, x in enumerate(pr)):.3f}, "
                      f"P(a) = {[round(x, 4) for x in pr]}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
