"""Profiling harnesses over an idle engine: graphed step time, per-phase time, and the start-up
calibration of a policy that asks for a step-time table.

Both harnesses borrow ``batch`` rows of ``context`` garbage tokens (token 7, or a repetitive
pattern the n-gram drafter finds drafts in), run steps on them and return every borrowed page,
so the engine is exactly as it was afterwards (tests check the page accounting). A step's cost
does not depend on the values it reads, except on an MoE target whose own router routes: there the
experts a step reads (its cost) follow the rows' hidden states, so each borrowed row gets a real
context first (``context`` seeded random tokens prefilled, a different one per row), as a served
request has; without it the rows would route by whatever the pool's pages held.

    decode_step_ms(engine, B, ctx, k=k)   device ms of one step (graph replays, no host sync)
    step_phases(engine, B, ctx, k)        {draft, verify, commit} ms of eager steps with marks
    graphed_phases(engine, B, ctx, k)     ms and kernels of each phase of the graphed step, the step
                                          captured as one CUDA graph per phase
    calibrate_policy_(engine)             fill the policy's table: decode_step_ms per k and bucket
    step_time_vs_floor(engine, batches, ctx)  graphed k = 0 step ms per batch beside the target's
                                          weight-bandwidth floor (the run option engine.profile_steps)
                                          and the floor of the bytes the step must read (an MoE
                                          target's selected experts, the KV)
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from ..errors import ConfigError
from ..spec.base import needs_context, preparer
from .kv_cache import pages_for
from .step import step_body_


def profile_slots(engine, context_len: int, steps: int, T: int) -> int:
    """KV slots a profiled row needs: its context, up to T committed per step, one tree ahead."""
    return context_len + steps * T + engine.config.max_tree_tokens


@contextlib.contextmanager
def borrowed_rows(engine, batch: int, context_len: int, slots: int, what: str):
    """``batch`` decode rows of ``context_len`` tokens, each holding ``slots`` KV slots, for the
    duration of the block; the rows are dropped and their pages returned afterwards."""
    if engine.scheduler.has_work() or engine.state.num_rows:
        raise RuntimeError(f"{what} needs an idle engine")
    owners = [object() for _ in range(batch)]
    st = engine.state
    try:
        pages = [engine.kv.reserve_(o, slots) for o in owners]
        pending = [7] * batch
        if routes_by_context(engine.model) and context_len > 0:
            pending = prefill_contexts_(engine, pages, context_len)
        st.append_rows_(pending, [context_len] * batch, pages)
        st.num_active.fill_(batch)
        yield st
    finally:
        st.keep_rows_([])
        for o in owners:
            engine.kv.release_(o)


# Tokens per forward when borrowed rows get their contexts (prefill_contexts_): a bound on the
# forward's activations (an MoE layer's [tokens x top_k, hidden] fp32 rows), not a tuned size.
CONTEXT_PREFILL_TOKENS = 4096


def routes_by_context(model) -> bool:
    """True for an MoE target whose own router routes (no steered routing): the experts a step reads
    depend on the rows' hidden states, hence on their contexts."""
    return bool(getattr(model, "moe_slot", None)) and getattr(model, "routing", None) is None


def prefill_contexts_(engine, pages: list[list[int]], context_len: int, seed: int = 0) -> list[int]:
    """Prefill ``context_len`` random tokens (seeded, one sequence per row) into each row's pages with
    the target alone, ``CONTEXT_PREFILL_TOKENS`` tokens per forward; returns each row's next token.
    The MoE statistics window restarts afterwards, so a measurement around the borrowed rows counts
    their steps only."""
    from .step import PrefillChunk

    V = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(V, (len(pages), context_len + 1), generator=gen).tolist()
    n = min(context_len, CONTEXT_PREFILL_TOKENS)  # tokens of a row per chunk; a row's chunks in order
    per = CONTEXT_PREFILL_TOKENS // n  # rows per forward
    for start in range(0, context_len, n):
        end = min(start + n, context_len)
        chunks = [PrefillChunk(token_ids=row[start:end], start=start, pages=p, next_token=row[end])
                  for row, p in zip(ids, pages)]
        for i in range(0, len(chunks), per):
            engine.stepper.prefill_(chunks[i:i + per], draft=False)
    engine.model.reset_moe_stats_()
    return [row[context_len] for row in ids]


def _check_k(engine, k: int) -> int:
    if k not in engine.ks:
        raise ConfigError(f"k={k} was not configured for this engine (ks={engine.ks})")
    return engine.stepper.num_nodes(k)


def decode_step_ms(engine, batch_size: int, context_len: int, iters: int = 50, warmup: int = 3,
                   k: int = 0, budget_ms: float | None = None) -> float:
    """Device milliseconds of one decode step with k draft tokens (k = 0: plain) at ``batch_size``
    rows of ``context_len`` tokens each: ``iters`` back-to-back steps (graph replays when graphed)
    with no host sync in between, so host scheduling is excluded (a drafter that drafts on the
    host, e.g. n-gram, does that work between the launches, on histories of one repeated token).
    The step-time table a goodput policy profiles at start-up. ``budget_ms``: the last warm-up step
    is timed, and the timed loop runs only as many steps (at least 2, at most ``iters``) as fit in
    about that many ms: a 49-token tree over 256 rows of an 8B model is ~330 ms a step, which
    averages as well over 2 steps as a 5 ms step over 20."""
    if batch_size > engine.config.max_batch_size:
        raise ValueError(f"batch_size {batch_size} > engine.max_batch_size {engine.config.max_batch_size}")
    T = _check_k(engine, k)
    total = profile_slots(engine, context_len, warmup + iters, T)
    if total > engine.max_seq_len:
        raise ValueError(f"context_len {context_len} + {warmup + iters} steps of up to {T} tokens exceeds "
                         f"max_seq_len {engine.max_seq_len}")
    drafter = engine.drafter
    prepare = preparer(drafter) if T > 1 else None
    context = [[7] * context_len for _ in range(batch_size)] if T > 1 and needs_context(drafter) else None

    with borrowed_rows(engine, batch_size, context_len, total, "profile_decode_step") as st:
        if T > 1 and engine.acceptance is not None:
            engine.acceptance.fill_(batch_size, k)  # replayed: rows commit the trace's mean length

        def run():
            if engine.stepper.sampled:
                st.uniform[:batch_size, :T].uniform_(generator=st.generator)
            if prepare is not None:
                prepare(st, batch_size, T, context)
            engine.stepper.runner.run_(batch_size, T, context)

        cuda = engine.model.device.type == "cuda"

        def timed(n: int) -> float:  # ms per step over n back-to-back steps
            if cuda:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            for _ in range(n):
                run()
            if cuda:
                end.record()
                end.synchronize()
                return start.elapsed_time(end) / n
            return (time.perf_counter() - t0) * 1e3 / n

        for _ in range(warmup - 1 if budget_ms is not None and warmup > 0 else warmup):
            run()
        if budget_ms is not None and warmup > 0:
            iters = max(min(2, iters), min(iters, math.ceil(budget_ms / max(timed(1), 1e-3))))
        return timed(iters)


# The marks step_body_ (and the EAGLE-3 drafter's propose, when profiled) sets, in step order, and the
# coarse phase of step_phases each belongs to. The drafter's marks are draft_root (the root's children:
# draft lm_head + top-k) and draft_round1 .. (a growth round: the previous level's tree_expand, one
# draft layer over the frontier, its lm_head + top-k); "draft" then closes the last tree_expand and
# tree_select, "verify" verify_accept, "commit" the drafter's extend.
PHASES = {"draft_root": "draft", "draft": "draft", "verify_forward": "verify", "verify": "verify",
          "kv_sync": "commit", "commit": "commit"}
PHASE_LABELS = {"draft_root": "draft: root children", "draft": "draft: last expand + tree_select (plain: none)",
                "verify_forward": "verify: target forward + lm_head", "verify": "verify_accept",
                "kv_sync": "commit: kv_sync", "commit": "draft extend"}


def coarse_phase(mark: str) -> str:
    """draft / verify / commit for a step_body_ mark (draft_roundN: draft)."""
    return "draft" if mark.startswith("draft_round") else PHASES[mark]


def phase_label(mark: str) -> str:
    if mark.startswith("draft_round"):
        return f"draft: round {mark.removeprefix('draft_round')} (expand + draft layer + lm_head + top-k)"
    return PHASE_LABELS.get(mark, mark)


def step_phases(engine, batch_size: int, context_len: int, k: int, iters: int = 5) -> dict:
    """Milliseconds of the draft, verify and commit phases of one step with k draft tokens at
    ``batch_size`` rows of ``context_len`` tokens, run eagerly with a timing mark between phases
    (served steps run as whole graphs, so their phases cannot be split). Includes the draft extend
    in commit. The batch shrinks to what the free KV pool holds. Returns {draft, verify, commit}
    in ms plus the batch and context used."""
    T = _check_k(engine, k)
    B = min(batch_size, engine.config.max_batch_size)
    total = context_len + (iters + 1) * T + engine.config.max_tree_tokens
    if total > engine.max_seq_len:
        raise ValueError(f"context_len {context_len} leaves no room for {iters + 1} steps")
    fit = engine.kv.num_free // pages_for(total, engine.kv.page_size)
    if fit < 1:
        raise ValueError(f"context_len {context_len}: one profiling row does not fit the KV pool")
    B = min(B, fit)
    cuda = engine.model.device.type == "cuda"
    context = [[7, 8, 9] * (context_len // 3 + 1)] * B  # repetitive: the n-gram drafter finds drafts
    sums = {"draft": 0.0, "verify": 0.0, "commit": 0.0}
    prepare = preparer(engine.drafter)
    with borrowed_rows(engine, B, context_len, total, "profile_step_phases") as st:
        for it in range(iters + 1):  # the first step warms up
            marks = []

            def mark(phase, marks=marks):
                if cuda:
                    ev = torch.cuda.Event(enable_timing=True)
                    ev.record()
                    marks.append((phase, ev))
                else:
                    marks.append((phase, time.perf_counter()))

            mark("start")
            if T > 1 and prepare is not None:
                prepare(st, B, T, context)
            acceptance = engine.acceptance if T > 1 else None
            if acceptance is not None:
                acceptance.fill_(B, k)  # replayed: rows commit the trace's mean length
            step_body_(engine.model, st, engine.kv, B, T, engine.config.step_temperature, engine.drafter, context, mark,
                       acceptance=acceptance, counterfactual=engine._counterfactual)
            if cuda:
                marks[-1][1].synchronize()
            if it == 0:
                continue
            for (_, a), (phase, b) in zip(marks, marks[1:]):
                sums[coarse_phase(phase)] += a.elapsed_time(b) if cuda else (b - a) * 1e3
    return {**{phase: v / iters for phase, v in sums.items()}, "batch": B, "context": context_len}


def graphed_phases(engine, batch_size: int, context_len: int, k: int, iters: int = 50, warmup: int = 3,
                   kernels: bool = True) -> dict:
    """Where a graphed step's time goes: the step body (k draft tokens, ``batch_size`` rows of
    ``context_len`` tokens) captured as one CUDA graph per phase (split at the marks of
    :data:`PHASES`; the EAGLE-3 drafter also marks its root and each growth round), the graphs
    replayed back to back ``iters`` times with a CUDA event between phases. Returns
    ``{"phases": [{"phase", "label", "ms", "kernels", "kernel_ms", "top"}, ...], "sum_ms"}``: ms per
    phase replay (the phase's kernels plus one graph launch, ~2-4 us, so ``sum_ms`` exceeds the whole
    step's graph replayed, :func:`decode_step_ms`), and with ``kernels`` (torch
    profiler) the device kernels (memcpy / memset included) each phase launches per step and their
    summed device ms. On the CPU (no graphs) the body runs eagerly with wall-clock marks, no kernel
    counts. The engine is left as it was (rows borrowed, pages returned)."""
    T = _check_k(engine, k)
    total = profile_slots(engine, context_len, 2 * (warmup + iters) + 4, T)
    if total > engine.max_seq_len:
        raise ValueError(f"context_len {context_len}: no room for {2 * (warmup + iters) + 4} steps of {T} tokens "
                         f"within max_seq_len {engine.max_seq_len}")
    drafter = engine.drafter if T > 1 else None
    cuda = engine.model.device.type == "cuda"
    prepare = preparer(drafter) if drafter is not None else None
    context = [[7] * context_len for _ in range(batch_size)] if drafter is not None and needs_context(drafter) else None
    temp = engine.config.step_temperature
    B = batch_size

    def body(mark):
        if engine.stepper.sampled:
            st.uniform[:B, :T].uniform_(generator=st.generator)
        if prepare is not None:
            prepare(st, B, T, context)
        step_body_(engine.model, st, engine.kv, B, T, temp, drafter, context, mark,
                   counterfactual=engine._counterfactual if drafter is engine.drafter else None)

    has_marks = drafter is not None and hasattr(drafter, "phase_marks")
    with borrowed_rows(engine, B, context_len, total, "graphed_phases") as st:
        try:
            if not cuda:  # eager, wall-clock marks
                sums: dict[str, float] = {}
                for it in range(warmup + iters):
                    stamps = [("start", time.perf_counter())]

                    def mark(phase, stamps=stamps):
                        stamps.append((phase, time.perf_counter()))
                    if has_marks:
                        drafter.phase_marks = mark
                    body(mark)
                    if it >= warmup:
                        for (_, a), (phase, b) in zip(stamps, stamps[1:]):
                            sums[phase] = sums.get(phase, 0.0) + (b - a) * 1e3
                phases = [{"phase": p, "label": phase_label(p), "ms": v / iters} for p, v in sums.items()]
                ms = sum(p["ms"] for p in phases)
                return {"phases": phases, "sum_ms": ms, "step_ms": ms, "graphed": False, "batch": B,
                        "context": context_len, "T": T}
            graphs: list[tuple[str, torch.cuda.CUDAGraph]] = []
            pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # compile and warm outside the capture
                    body(None)
                torch.cuda.synchronize()
                cur = [torch.cuda.CUDAGraph()]
                cur[0].capture_begin(pool=pool)

                def split(phase):  # end this phase's graph, start the next one's
                    cur[0].capture_end()
                    graphs.append((phase, cur[0]))
                    cur[0] = torch.cuda.CUDAGraph()
                    cur[0].capture_begin(pool=pool)
                if has_marks:
                    drafter.phase_marks = split
                body(split)
                cur[0].capture_end()  # empty: the body's last mark closed its last phase
            torch.cuda.synchronize()

            def replay_all(events=None):
                for i, (_, g) in enumerate(graphs):
                    g.replay()
                    if events is not None:
                        events[i + 1].record()

            for _ in range(warmup):
                replay_all()
            torch.cuda.synchronize()
            sums = [0.0] * len(graphs)
            steps = [[torch.cuda.Event(enable_timing=True) for _ in range(len(graphs) + 1)] for _ in range(iters)]
            for ev in steps:  # back to back, no host sync (as served steps run)
                ev[0].record()
                replay_all(ev)
            steps[-1][-1].synchronize()
            for ev in steps:
                for i in range(len(graphs)):
                    sums[i] += ev[i].elapsed_time(ev[i + 1])
            phases = [{"phase": p, "label": phase_label(p), "ms": sums[i] / iters} for i, (p, _) in enumerate(graphs)]
            if kernels:
                _count_phase_kernels_(graphs, phases, reps=min(iters, 10))
            return {"phases": phases, "sum_ms": sum(p["ms"] for p in phases), "graphed": True, "batch": B,
                    "context": context_len, "T": T}
        finally:
            if has_marks:
                drafter.phase_marks = None


def _count_phase_kernels_(graphs, phases: list[dict], reps: int) -> None:
    """Adds ``kernels``, ``kernel_ms`` and ``top`` to each phase: one profiler session over ``reps``
    steps of the phase graphs replayed in order, a marker kernel (torch.cuda._sleep's spin_kernel)
    after each phase; device events sorted by start split at the markers into the phases' kernels
    (one stream: they run in order). Without the expected markers only the step's total is kept."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for _, g in graphs:
                g.replay()
                torch.cuda._sleep(64)  # marker: ends this phase in the device timeline
        torch.cuda.synchronize()
    evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    groups, cur = [], []
    for e in evs:
        if "spin_kernel" in e.name:
            groups.append(cur)
            cur = []
        else:
            cur.append(e)
    if len(groups) != reps * len(graphs):
        phases[0]["kernels_total_per_step"] = len(evs) / reps  # markers not recognised: no split
        return
    for i, p in enumerate(phases):
        mine = [e for r in range(reps) for e in groups[r * len(graphs) + i]]
        p["kernels"] = len(mine) / reps
        p["kernel_ms"] = sum(e.device_time for e in mine) / 1e3 / reps
        p["top"] = _top_kernels(mine, reps)


def _top_kernels(evs, reps: int, n: int = 6) -> list:
    """[(name, launches per step, us per step)] of the busiest kernels among profiler events."""
    by: dict[str, list[float]] = {}
    for e in evs:
        c = by.setdefault(e.name[:80], [0.0, 0.0])
        c[0] += 1 / reps
        c[1] += e.device_time / reps
    return [(name, round(c[0], 2), round(c[1], 1)) for name, c in sorted(by.items(), key=lambda kv: -kv[1][1])[:n]]


# Timed steps per start-up table entry: profile_iters, or as many as fit in about this many ms (at
# least 2): the largest trees at the largest buckets take hundreds of ms a step on an 8B target, and
# the table's start-up cost would otherwise rival a short run's.
CALIBRATE_BUDGET_MS = 100.0


def calibrate_policy_(engine) -> None:
    """Give a policy that wants one (``wants_step_table``) its step-time table: graphed steps for every
    k of its ks at every graph bucket, at its profile_context tokens of context (less where the pool
    or max_seq_len cannot hold that many rows of it). Adds the time to ``engine.startup_s``."""
    policy = engine.policy
    if policy is None or not policy.wants_step_table:
        return
    cuda = engine.model.device.type == "cuda"
    iters, warmup = (int(policy.profile_iters), 3) if cuda else (1, 1)
    budget = CALIBRATE_BUDGET_MS if cuda else None
    T_max = max(engine.stepper.num_nodes(k) for k in engine.ks)

    def context(batch: int) -> int:
        room = min(engine.max_seq_len, (engine.kv.num_free // batch) * engine.kv.page_size)
        return min(policy.profile_context, room - profile_slots(engine, 0, warmup + iters, T_max))

    def profile(batch: int, k: int) -> float:
        return decode_step_ms(engine, batch, context(batch), iters=iters, warmup=warmup, k=k, budget_ms=budget)

    # A bucket whose rows the pool cannot hold even at a short context is one the scheduler never
    # fills either (admission is by capacity): it is left out, and the largest profiled bucket
    # stands in for it.
    batches = [b for b in engine.buckets if b <= engine.config.max_batch_size and context(b) >= 16]
    if not batches:
        raise ConfigError(f"policy {policy.name}: the KV pool ({engine.kv.num_pages} pages) or "
                          f"max_seq_len ({engine.max_seq_len}) cannot hold even one profiling row; raise "
                          "engine.kv_cache_tokens")
    t0 = time.perf_counter()
    policy.calibrate_(profile, batches)
    engine.startup_s += time.perf_counter() - t0


def weight_bytes(model) -> dict:
    """Bytes of the target's parameters: ``all`` of them, and ``read`` by one decode step (every
    matrix once; of an untied embedding table a step reads only its rows, so it is left out)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed.numel() * model.embed.element_size()
    return {"all": total, "read": total - (embed if model.lm_head is not None else 0)}


def with_distinct_experts(model, measure):
    """(measure(), the distinct experts per MoE layer its target forwards read on average), counted on the
    device while it runs (the model's moe_stats); the second is None for a dense target."""
    if not getattr(model, "moe_slot", None):
        return measure(), None
    model.reset_moe_stats_()
    out = measure()
    return out, model.moe_stats()["distinct_experts_per_layer"]


def step_time_vs_floor(engine, batches, context_len: int, iters: int = 100, copy_gbps: float | None = None) -> dict:
    """Device ms of the graphed plain (k = 0) step at each decode batch in ``batches``, at
    ``context_len`` tokens of context, beside the weight-bandwidth floor: the time to stream the
    target's weights once at the device's copy bandwidth (bytes read + written per second of a large
    device-to-device copy, measured here unless given), the bound a memory-bound decode step cannot
    beat. ``floor_ms_all`` counts every parameter (as gpt-fast's published fraction does),
    ``floor_ms_read`` what a step reads (see weight_bytes). ``floor_ms_touched`` per batch: the bytes
    the step must read (model.step_read_bytes: attention and dense weights, of each MoE layer only the
    ``distinct_experts_per_layer`` its tokens select, and the rows' context KV). Batches above the
    engine's max_batch_size are an error. On the CPU the numbers only keep smoke runs going."""
    from ..bench.timing import copy_bandwidth_gbps

    batches = [int(b) for b in batches]
    bad = [b for b in batches if not 1 <= b <= engine.config.max_batch_size]
    if bad:
        raise ConfigError(f"engine.profile_steps={batches}: batches must be in 1..engine.max_batch_size "
                          f"({engine.config.max_batch_size})")
    gbps = float(copy_gbps) if copy_gbps is not None else copy_bandwidth_gbps(engine.model.device)
    nbytes = weight_bytes(engine.model)
    floor_all = nbytes["all"] / (gbps * 1e9) * 1e3
    floor_read = nbytes["read"] / (gbps * 1e9) * 1e3
    step_ms, experts = {}, {}
    for b in batches:
        step_ms[str(b)], experts[str(b)] = with_distinct_experts(
            engine.model, lambda: decode_step_ms(engine, b, context_len, iters=iters))
    touched = {b: engine.model.step_read_bytes(experts[b], int(b) * context_len)["total"] for b in step_ms}
    floor_touched = {b: n / (gbps * 1e9) * 1e3 for b, n in touched.items()}
    out = {"step_ms": step_ms, "context": context_len, "iters": iters, "graphed": engine.graphed,
           "copy_gbps": gbps, "weight_bytes": nbytes["all"], "weight_bytes_read": nbytes["read"],
           "floor_ms_all": floor_all, "floor_ms_read": floor_read,
           "floor_fraction_all": {b: floor_all / ms for b, ms in step_ms.items()},
           "floor_fraction_read": {b: floor_read / ms for b, ms in step_ms.items()},
           "bytes_touched": touched, "floor_ms_touched": floor_touched,
           "floor_fraction_touched": {b: floor_touched[b] / ms for b, ms in step_ms.items()}}
    if getattr(engine.model, "moe_slot", None):
        out["distinct_experts_per_layer"] = experts
    return out


class _StopStep(Exception):
    """Raised by a phase mark to end a step body after that phase (step prefixes, below)."""


def _prefix_ms(engine, B: int, T: int, stop: str, iters: int) -> float:
    """Device ms of step_body_ run up to the end of phase ``stop`` (draft | verify): a CUDA graph of
    that prefix replayed ``iters`` times when the engine is graphed (the capture ends where the mark
    raises, so the graph holds exactly the prefix's kernels), else eager wall time. A prefix commits
    nothing (no seq_lens advance), so replays repeat the same work on the same rows."""
    acceptance = engine.acceptance

    def mark(phase):
        if phase == stop:
            raise _StopStep

    def body():
        try:
            step_body_(engine.model, engine.state, engine.kv, B, T, engine.config.step_temperature, engine.drafter,
                       None, mark, acceptance=acceptance, counterfactual=engine._counterfactual)
        except _StopStep:
            pass

    cuda = engine.model.device.type == "cuda"
    if not (cuda and engine.graphed):
        body()
        t0 = time.perf_counter()
        for _ in range(iters):
            body()
        return (time.perf_counter() - t0) * 1e3 / iters
    from ..bench.timing import time_graph

    return time_graph(body, calls=1, replays=iters) / 1e3


def step_breakdown(engine, batches, context_len: int, iters: int = 50) -> dict:
    """The speculative step per configured k beside the plain step, at each decode batch in
    ``batches`` with ``context_len`` tokens of context: graphed full-step ms (``decode_step_ms``),
    and its draft / verify / commit split from graphed prefixes of the same body (draft = the tree's
    draft rounds; verify = target forward over the tree + verify_accept; commit = the rest: kv_sync
    and the draft extend), draft ms per round, the step's cost in plain steps, and with replayed
    acceptance the speed-up it implies: mean accepted length x plain ms / step ms (batch 1 is the
    latency speed-up; above it an upper bound, ignoring scheduling). An MoE target adds the distinct
    experts per layer each full step reads (``plain_distinct_experts_per_layer``, and per k). On the CPU
    the numbers only keep smoke runs going."""
    acceptance = engine.acceptance
    out = {"context": context_len, "iters": iters, "graphed": engine.graphed, "batches": {}}
    ks = [k for k in engine.ks if k > 0]
    for b in (int(x) for x in batches):
        if not 1 <= b <= engine.config.max_batch_size:
            raise ConfigError(f"engine.profile_spec_steps: batch {b} must be in 1..engine.max_batch_size "
                              f"({engine.config.max_batch_size})")
        plain, experts = with_distinct_experts(engine.model,
                                               lambda: decode_step_ms(engine, b, context_len, iters=iters))
        row = {"plain_ms": plain, "k": {}}
        if experts is not None:
            row["plain_distinct_experts_per_layer"] = experts
        for k in ks:
            T = engine.stepper.num_nodes(k)
            full, experts = with_distinct_experts(
                engine.model, lambda: decode_step_ms(engine, b, context_len, iters=iters, k=k))
            slots = profile_slots(engine, context_len, 1, T)
            with borrowed_rows(engine, b, context_len, slots, "step_breakdown") as st:
                if acceptance is not None:
                    acceptance.fill_(b, k)
                draft = _prefix_ms(engine, b, T, "draft", iters)
                upto_verify = _prefix_ms(engine, b, T, "verify", iters)
                del st
            shape = getattr(engine.drafter, "shape_for", None)
            rounds = shape(k)[1] if shape is not None else 1
            entry = {"step_ms": full, "draft_ms": draft, "draft_round_ms": draft / rounds, "draft_rounds": rounds,
                     "verify_ms": upto_verify - draft, "commit_ms": full - upto_verify,
                     "step_over_plain": full / plain if plain else None}
            if experts is not None:
                entry["distinct_experts_per_layer"] = experts
            if acceptance is not None:
                tau = acceptance._mean_length(k)
                entry.update(mean_accepted_length=tau, implied_speedup=tau * plain / full if full else None)
            row["k"][str(k)] = entry
        out["batches"][str(b)] = row
    if acceptance is not None:
        out["acceptance"] = acceptance.describe()
    return out
