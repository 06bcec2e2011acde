"""Serving metrics: per-request records, aggregates, the per-step trace and a live progress display.

Per request (``request_record``): TTFT = first token - arrival (queueing included), TPOT = (last
token - first token) / (tokens - 1), inter-token latencies (ITL) = gaps between consecutive tokens,
latency = finish - arrival. Aggregates (``summarize_requests``): output tok/s and requests/s over
the wall time, p50/p99 of TTFT, TPOT and ITL (ITL pooled over all tokens of all requests).

Per step (``StepTrace``, written as ``steps.jsonl``): decode batch size and graph bucket, k, prefill
tokens, prefill / decode milliseconds (CUDA events on the GPU, read without extra syncs), queue
lengths, free pages, preemptions. ``StepTrace.summary()`` gives the mean running batch size and the
step-time breakdown.

Acceptance per draft depth (``acceptance_counts``), per request and summed over the run, from the
statistics each speculative step writes on the device and the engine reads back with the committed
tokens (kernels_triton/accept_stats.py; no extra copy or sync): for depth d = 1 .. D,

    drafted[d]   speculative steps whose draft reached depth d (a node at depth d)
    accepted[d]  of those, the steps that accepted a draft token at depth d
    rate[d]      accepted[d] / drafted[d]  (P(accepted length >= d | drafted that deep))

plus the accepted-length histogram (draft tokens accepted per step) and, for trees, the accepted
token's rank among its siblings at each depth (0 = the first child verification tried).
Keys: requests.jsonl ``acceptance_by_depth`` (rates), ``drafted_by_depth``, ``accepted_by_depth``,
``accepted_histogram``, ``accepted_rank_by_depth`` (trees); metrics.json ``acceptance_by_depth``
{rate, drafted, accepted} and ``accepted_rank_by_depth`` (trees), beside the step trace's
``accepted_histogram``. ``scalars`` flattens them for W&B.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Callable


def percentile(values, q: float) -> float | None:
    """q-th percentile (0..100) with linear interpolation; None for no values."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _mean(values) -> float | None:
    xs = [v for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None


def acceptance_counts(stats_rows) -> dict | None:
    """Acceptance per depth from speculative steps' statistics rows ([drafted depth, draft nodes,
    accepted sibling rank at depth 1, 2, ..., -1 past the accepted length]; see the module
    docstring), or None without any. {drafted, accepted (lists over depth 1 .. D), histogram
    {accepted length: steps}, ranks ([depth][rank] counts), branched (a step drafted a tree, not a chain)}."""
    drafted: list[int] = []
    accepted: list[int] = []
    ranks: list[list[int]] = []
    hist: dict[int, int] = {}
    branched = False
    for row in stats_rows:
        depth, nodes, path = int(row[0]), int(row[1]), row[2:]
        acc = sum(1 for r in path if r >= 0)
        need = max(depth, acc)
        if need > len(drafted):
            drafted += [0] * (need - len(drafted))
            accepted += [0] * (need - len(accepted))
            ranks += [[] for _ in range(need - len(ranks))]
        for d in range(depth):
            drafted[d] += 1
        for d in range(acc):
            accepted[d] += 1
            r = int(path[d])
            if r >= len(ranks[d]):
                ranks[d] += [0] * (r + 1 - len(ranks[d]))
            ranks[d][r] += 1
        hist[acc] = hist.get(acc, 0) + 1
        branched |= nodes > depth
    if not hist:
        return None
    return {"drafted": drafted, "accepted": accepted, "histogram": hist, "ranks": ranks, "branched": branched}


def _rates(drafted, accepted) -> list:
    return [round(a / n, 6) if n else None for n, a in zip(drafted, accepted)]


def request_record(req, prompt_text: str | None = None, output_text: str = "") -> dict:
    """The requests.jsonl record of a finished engine request."""
    rec = {"id": req.id, "prompt": prompt_text, "prompt_tokens": len(req.prompt_ids)}
    if getattr(req, "sampling", None) is not None:  # its own parameters (temperature, top_k, top_p, min_p)
        rec["sampling"] = dict(zip(("temperature", "top_k", "top_p", "min_p"), req.sampling))
        rec["sampling"]["top_k"] = int(rec["sampling"]["top_k"])
    if req.error is not None:
        rec.update(error=req.error, output_ids=[], output="")
        return rec
    n = len(req.output_ids)
    times = req.token_times
    rec.update(
        output=output_text,
        output_ids=list(req.output_ids),
        output_tokens=n,
        finish_reason=req.finish_reason,
        ttft_s=None if req.first_token_s is None else req.first_token_s - req.arrival_s,
        latency_s=req.finish_s - req.arrival_s,
        tpot_s=(times[-1] - times[0]) / (n - 1) if n > 1 else None,
        queue_s=None if req.admitted_s is None else req.admitted_s - req.arrival_s,
        num_preemptions=req.num_preemptions,
        itl_s=[round(b - a, 6) for a, b in zip(times, times[1:])],
    )
    acc = acceptance_counts(getattr(req, "accept_stats", ()))
    if acc is not None:
        rec.update(acceptance_by_depth=_rates(acc["drafted"], acc["accepted"]), drafted_by_depth=acc["drafted"],
                   accepted_by_depth=acc["accepted"],
                   accepted_histogram={str(k): v for k, v in sorted(acc["histogram"].items())})
        if acc["branched"]:
            rec["accepted_rank_by_depth"] = acc["ranks"]
    return rec


def _add(into: list, xs) -> list:
    into += [0] * (len(xs) - len(into))
    for i, x in enumerate(xs):
        into[i] += x
    return into


def acceptance_summary(records: list[dict]) -> dict:
    """Run-level acceptance per depth: the requests' counts summed (metrics.json keys; see the module
    docstring); {} when no request speculated."""
    drafted: list[int] = []
    accepted: list[int] = []
    ranks: list[list[int]] = []
    branched = False
    for r in records:
        if "drafted_by_depth" not in r:
            continue
        _add(drafted, r["drafted_by_depth"])
        _add(accepted, r["accepted_by_depth"])
        if r.get("accepted_rank_by_depth"):
            branched = True
            ranks += [[] for _ in range(len(r["accepted_rank_by_depth"]) - len(ranks))]
            for d, row in enumerate(r["accepted_rank_by_depth"]):
                _add(ranks[d], row)
    if not drafted:
        return {}
    out = {"acceptance_by_depth": {"rate": _rates(drafted, accepted), "drafted": drafted, "accepted": accepted}}
    if branched:
        out["accepted_rank_by_depth"] = ranks
    return out


def scalars(metrics: dict) -> dict:
    """The numbers of ``metrics`` for a scalar logger (W&B): numbers as they are, and the acceptance
    per depth flattened (``acceptance_by_depth/rate_d1``, ``.../drafted_d1``, ``.../accepted_d1``,
    ``accepted_rank_by_depth/d1_r0``, ``accepted_histogram/3``)."""
    out = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for key, vals in (metrics.get("acceptance_by_depth") or {}).items():
        out.update({f"acceptance_by_depth/{key}_d{d + 1}": v for d, v in enumerate(vals) if v is not None})
    for d, row in enumerate(metrics.get("accepted_rank_by_depth") or ()):
        out.update({f"accepted_rank_by_depth/d{d + 1}_r{r}": c for r, c in enumerate(row)})
    out.update({f"accepted_histogram/{k}": v for k, v in (metrics.get("accepted_histogram") or {}).items()})
    return out


def summarize_requests(records: list[dict], wall_s: float) -> dict:
    ok = [r for r in records if "error" not in r]
    out_tokens = sum(r["output_tokens"] for r in ok)
    ttft = [r.get("ttft_s") for r in ok]
    tpot = [r.get("tpot_s") for r in ok]
    itl = [x for r in ok for x in r.get("itl_s") or ()]
    lat = [r.get("latency_s") for r in ok]
    return {
        "requests": len(records),
        "failed_requests": len(records) - len(ok),
        "aborted_requests": sum(r.get("finish_reason") == "abort" for r in ok),
        "output_tokens": out_tokens,
        "wall_s": wall_s,
        "output_tok_per_s": out_tokens / wall_s if wall_s > 0 else 0.0,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "mean_ttft_s": _mean(ttft),
        "p50_ttft_s": percentile(ttft, 50),
        "p99_ttft_s": percentile(ttft, 99),
        "mean_tpot_s": _mean(tpot),
        "p50_tpot_s": percentile(tpot, 50),
        "p99_tpot_s": percentile(tpot, 99),
        "p50_itl_s": percentile(itl, 50),
        "p99_itl_s": percentile(itl, 99),
        "mean_latency_s": _mean(lat),
        "preemptions": sum(r.get("num_preemptions", 0) for r in ok),
        **acceptance_summary(ok),
    }


class StepTrace:
    """Collects engine step records (pass it as ``Engine(trace=...)``); optionally streams jsonl."""

    def __init__(self, path: str | Path | None = None, listeners: list[Callable[[dict], None]] | None = None):
        self.records: list[dict] = []
        self.meta: dict = {}  # run-level facts (serving wall time, start-up, pool size), set by the caller
        self.listeners = list(listeners or [])
        self._file = open(path, "w") if path is not None else None
        self._flushed = time.perf_counter()

    # steps.jsonl is flushed at most this often (a flush per step would cost a syscall each ~0.6 ms
    # step on a GPU) and on close: a killed run keeps all but its last second of steps.
    FLUSH_S = 1.0

    _paused = False

    @contextlib.contextmanager
    def paused(self):
        """Steps inside the block are not recorded, written or passed on (a warm-up's)."""
        was, self._paused = self._paused, True
        try:
            yield self
        finally:
            self._paused = was

    def __call__(self, rec: dict) -> None:
        if self._paused:
            return
        self.records.append(rec)
        if self._file is not None:
            self._file.write(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                         for k, v in rec.items()}) + "\n")
            now = time.perf_counter()
            if now - self._flushed >= self.FLUSH_S:
                self._file.flush()
                self._flushed = now
        for fn in self.listeners:
            fn(rec)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def summary(self) -> dict:
        steps = self.records
        dec = [s for s in steps if s["decode_bs"]]
        pre = [s for s in steps if s["prefill_reqs"]]
        by_bucket: dict[int, list[float]] = {}
        for s in dec:
            by_bucket.setdefault(s["bucket"], []).append(s["decode_ms"])
        spec = [s for s in dec if s.get("k", 0) > 0]
        accepted = [a for s in spec for a in s.get("accepted", [])]
        hist: dict[str, int] = {}
        for a in accepted:
            hist[str(a)] = hist.get(str(a), 0) + 1
        return {
            "speculating_step_fraction": len(spec) / len(dec) if dec else 0.0,
            # accepted draft tokens per row per speculative step, and tokens committed (+1 bonus)
            "mean_accepted_drafts": _mean(accepted),
            "mean_accepted_length": _mean(a + 1 for a in accepted),
            # tokens committed per decode row and step, over every decode step (1 for plain decoding)
            # (None for step records written before the engine logged ``committed``)
            "tokens_per_row_step": (sum(s["committed"] for s in steps) / sum(s["decode_bs"] for s in dec)
                                    if dec and all("committed" in s for s in steps) else None),
            "accepted_histogram": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
            "mean_spec_step_ms": _mean(s["decode_ms"] for s in spec),
            "mean_plain_step_ms": _mean(s["decode_ms"] for s in dec if s.get("k", 0) == 0),
            "steps": len(steps),
            "decode_steps": len(dec),
            "prefill_steps": len(pre),
            "mean_batch_size": _mean(s["decode_bs"] for s in dec),
            "prefill_tokens": sum(s["prefill_tokens"] for s in steps),
            "prefill_ms_total": sum(s["prefill_ms"] for s in steps),
            "decode_ms_total": sum(s["decode_ms"] for s in steps),
            "step_ms_total": sum(s["step_ms"] for s in steps),
            "mean_decode_step_ms": _mean(s["decode_ms"] for s in dec),
            "p50_decode_step_ms": percentile([s["decode_ms"] for s in dec], 50),
            # median decode step per graph bucket: the step-time table a goodput policy needs
            "decode_step_ms_by_bucket": {str(b): percentile(v, 50) for b, v in sorted(by_bucket.items())},
            **k_choice(steps),
        }


def k_choice(steps: list[dict], hold_steps: int = 8) -> dict:
    """How a policy chose k over a run's step records: the share of decode steps at each k, and in
    the steady window (decode batch >= 90% of its peak: a closed loop at full concurrency) the k
    that held (the most frequent one over the window's second half), its share of the window, the
    number of k switches, and the settle time: decode steps from the window's start (the load
    change from empty to C) until the first step at the held k that the next ``hold_steps`` steps
    keep (0: held from the start)."""
    dec = [(s["decode_bs"], int(s.get("k", 0))) for s in steps if s["decode_bs"]]
    if not dec:
        return {}
    share: dict[str, float] = {}
    for _, k in dec:
        share[str(k)] = share.get(str(k), 0.0) + 1.0 / len(dec)
    top = max(b for b, _ in dec)
    idx = [i for i, (b, _) in enumerate(dec) if b >= 0.9 * top]
    window = [k for _, k in dec[idx[0]:idx[-1] + 1]]
    half = window[len(window) // 2:]
    held = max(sorted(set(half)), key=half.count)
    settle = next((j for j in range(len(window)) if all(k == held for k in window[j:j + hold_steps + 1])),
                  len(window))
    return {"k_step_fraction": dict(sorted(share.items(), key=lambda kv: int(kv[0]))),
            "steady_k": held, "steady_k_share": window.count(held) / len(window),
            "k_switches": sum(a != b for a, b in zip(window, window[1:])), "k_settle_steps": settle}


class LiveProgress:
    """Rich progress bar: finished/total requests plus live batch size, tok/s and queue lengths."""

    def __init__(self, total: int, title: str, refresh_s: float = 0.25):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), TextColumn("{task.fields[stats]}"), transient=True)
        self._task = self._progress.add_task(title, total=total, stats="")
        self._refresh_s = refresh_s
        self._tokens = 0
        self._t0 = self._last = time.perf_counter()

    def __enter__(self) -> "LiveProgress":
        self._progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.__exit__(*exc)

    def on_request(self, rec) -> None:
        self._progress.advance(self._task)

    def on_step(self, rec: dict) -> None:
        self._tokens += rec["committed"]
        now = time.perf_counter()
        if now - self._last < self._refresh_s:
            return
        self._last = now
        rate = self._tokens / (now - self._t0)
        self._progress.update(self._task, stats=(
            f"bs {rec['decode_bs']:>3}  {rate:7.1f} tok/s  waiting {rec['waiting']}  "
            f"free pages {rec['free_pages']}  step {rec['step_ms']:.1f} ms"))
