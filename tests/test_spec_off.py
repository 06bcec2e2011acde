"""Speculation off is free, and the draft catches up on resume.

- A k = 0 step of an engine with a drafter (n-gram; EAGLE-3 with catch-up, the default) runs exactly
  the torch calls of the same step without a drafter: no draft call, no feature capture (checked on
  the call sequence; an EAGLE-3 drafter that syncs while off fails the same check).
- Whole iterations while off (admission, prefill, new rows, the k = 0 step, commits, finishes and
  row compaction) of an engine with a drafter run the torch calls and the specdec functions of the
  same iterations without one, and call no drafter method: no per-row or per-prefill host work is
  left that exists only because a drafter is configured.
- Rows hold no tree's slots while speculation is off (the same free pages as without a drafter).
- A prompt prefilled while speculation is off runs the target's prefill alone (the torch calls of
  an engine without a drafter, no draft call); its draft KV is left to the catch-up.
- After random on/off schedules (rows joining and leaving at different times, preemptions in
  between, catch-up chunked over several forwards, padded shapes) the draft KV over every row's
  committed slots and its root state equal a from-scratch draft prefill of the same tokens after
  every drafting step, and greedy output equals plain greedy.
- The trees drafted after a catch-up are the trees an always-in-sync draft drafts (fp32, CPU).
- Shadow acceptance (n-gram): the drafter's score of a draft from the committed tokens, walked as an
  always-k run steps, is what speculating at k commits, step for step; goodput fed with it speculates
  without a forced first try, and greedy output stays plain greedy's.
"""

import random
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_engine import rand_prompts, reference, tiny_model
from test_spec import draft_prefill_kv, repetitive_prompts, tiny_head
from torch.overrides import TorchFunctionMode

import specdec
from specdec.engine.engine import Engine, EngineConfig
from specdec.engine.state import DecodeState
from specdec.errors import ConfigError
from specdec.policy import Never
from specdec.spec import Eagle3Drafter, NgramDrafter


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(layers=2)


class CallLog(TorchFunctionMode):
    """Names of the torch functions / tensor methods called (the step body's device work)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def spy_drafter_(drafter) -> list[str]:
    """Wraps the drafter's work methods so each call appends its name to the returned list."""
    drafted: list[str] = []
    if drafter is not None:
        for name in ("propose", "extend_", "prefill_", "prepare_", "stage_rows_"):
            if hasattr(drafter, name):
                real = getattr(drafter, name)
                setattr(drafter, name, lambda *a, _real=real, _name=name, **kw: drafted.append(_name) or _real(*a, **kw))
    return drafted


def k0_calls(model, drafter, prompts, steps=3):
    """Torch calls of each of ``steps`` k = 0 decode steps (prefill done first, outside the log),
    plus the drafter methods called during them."""
    engine = Engine(model, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=1024),
                    drafter=drafter, ks=(0,) if drafter is None else (4,))
    drafted = spy_drafter_(drafter)
    for p in prompts:
        engine.add_request(p, 16)
    engine.step(0)  # prefill (+ a first k = 0 step)
    drafted.clear()
    logs = []
    run = engine.stepper.runner.run_
    for _ in range(steps):
        log = CallLog()
        engine.stepper.runner.run_ = lambda n, T, ctx, _log=log: _run_logged(run, _log, n, T, ctx)
        engine.step(0)
        logs.append(log.calls)
    return logs, drafted, engine


def _run_logged(run, log, n, T, ctx):
    with log:
        return run(n, T, ctx)


def test_k0_step_with_a_drafter_runs_the_plain_step_body(tiny):
    prompts = rand_prompts([6, 11, 9], seed=2)
    plain, _, _ = k0_calls(tiny, None, prompts)
    assert plain and all(plain)
    for drafter in (Eagle3Drafter(tiny_head(tiny), tiny, topk=2, steps=2, num_draft_tokens=4),  # catch-up
                    NgramDrafter()):
        logs, drafted, _ = k0_calls(tiny, drafter, prompts)
        assert logs == plain, f"{drafter.name}: the k = 0 step does work a plain step does not"
        assert drafted == [], f"{drafter.name}: drafter called at k = 0: {drafted}"
    # Mutation check: a drafter that extends at k = 0 (sync_while_off) is caught by both checks.
    synced = Eagle3Drafter(tiny_head(tiny), tiny, topk=2, steps=2, num_draft_tokens=4, sync_while_off=True)
    logs, drafted, _ = k0_calls(tiny, synced, prompts)
    assert logs != plain and len(logs[0]) > len(plain[0])
    assert drafted.count("extend_") == 3


def off_prefill_calls(model, drafter, first, later, pad):
    """Torch calls of the prefill forward of prompts ``later`` that arrive after a k = 0 step (the
    engine is off), plus the drafter methods called by it."""
    engine = Engine(model, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=1024, pad_eager=pad,
                                        prefill_buckets=(32,), graph_buckets=(1, 2, 4)),
                    drafter=drafter, ks=(0,) if drafter is None else (4,))
    drafted = spy_drafter_(drafter)
    engine.add_request(first, 8)
    engine.step(0)  # prefill of the first prompt (drafted: no step has run yet) + a k = 0 step
    engine.step(0)
    drafted.clear()
    for p in later:
        engine.add_request(p, 8)
    log, real_prefill = CallLog(), engine.stepper.prefill_

    def logged(*a, **kw):
        with log:
            return real_prefill(*a, **kw)

    engine.stepper.prefill_ = logged
    engine.step(0)
    return log.calls, drafted, engine


@pytest.mark.parametrize("pad", [False, True])
def test_prefill_while_off_skips_the_draft(tiny, pad):
    """Prompts prefilled while speculation is off run the target's prefill alone (the torch calls of
    an engine without a drafter; no draft call), and their rows' draft length stays at 0; an
    EAGLE-3 drafter that syncs while off (mutation check) still runs its draft prefill."""
    first, later = rand_prompts([7], seed=5)[0], rand_prompts([9, 12], seed=6)
    plain, _, _ = off_prefill_calls(tiny, None, first, later, pad)
    assert plain
    drafter = Eagle3Drafter(tiny_head(tiny), tiny, topk=2, steps=2, num_draft_tokens=4)
    calls, drafted, engine = off_prefill_calls(tiny, drafter, first, later, pad)
    assert calls == plain and drafted == []
    assert engine.undrafted_prefill_tokens == sum(len(p) - 1 for p in later)
    # The first row: drafted over its prompt, then behind by its k = 0 steps; the later: nothing drafted.
    assert engine.state.draft_lens_host == [len(first) - 1, 0, 0] and engine.state.seq_lens_host[0] == len(first) + 2
    synced = Eagle3Drafter(tiny_head(tiny), tiny, topk=2, steps=2, num_draft_tokens=4, sync_while_off=True)
    calls, drafted, engine = off_prefill_calls(tiny, synced, first, later, pad)
    assert calls != plain and "prefill_" in drafted and engine.undrafted_prefill_tokens == 0
    assert engine.state.draft_lens_host == engine.state.seq_lens_host


SPECDEC_DIR = str(Path(specdec.__file__).parent)


class IterationLog(CallLog):
    """CallLog plus the specdec functions entered (by file and name; comprehensions aside: their
    per-row work shows in the torch calls, and a filter over new rows is all they add)."""

    def __init__(self):
        super().__init__()
        self.functions = Counter()

    def _profile(self, frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(SPECDEC_DIR) and not code.co_name.startswith("<"):
            self.functions[(Path(code.co_filename).name, code.co_name)] += 1

    def __enter__(self):
        sys.setprofile(self._profile)
        return super().__enter__()

    def __exit__(self, *exc):
        sys.setprofile(None)
        return super().__exit__(*exc)


def off_iterations(model, drafter, pad, overlap, mutate=None):
    """Per iteration while off (after a first drafted prefill and two k = 0 steps): (torch calls,
    specdec functions entered), the drafter methods called, and the outputs. Requests arrive in
    waves of different lengths, so iterations admit, prefill, add rows, finish and compact rows."""
    engine = Engine(model, EngineConfig(max_batch_size=6, page_size=4, kv_cache_tokens=1024, prefill_chunk=24,
                                        pad_eager=pad, overlap=overlap, prefill_buckets=(8, 24),
                                        prefill_requests=(1, 4), graph_buckets=(1, 2, 4, 6)),
                    drafter=drafter, policy=Never(), ks=(drafter.sizes if drafter is not None else (0,)),
                    trace=lambda rec: None)
    if mutate is not None:
        mutate(engine)
    drafted = spy_drafter_(drafter)
    waves = [rand_prompts([5, 9, 14], seed=21), rand_prompts([7, 3, 18, 11], seed=22), rand_prompts([6, 12], seed=23)]
    news = iter([3, 9, 5, 12, 4, 8, 6, 10, 7])
    reqs = [engine.add_request(p, next(news)) for p in waves[0]]
    engine.step()  # drafted prefill: no step has run yet
    engine.step()
    drafted.clear()
    logs, i = [], 0
    while engine.has_work() or i < 4:
        if i in (1, 4):  # later waves: prefilled while off, joining rows that are decoding
            reqs += [engine.add_request(p, next(news)) for p in waves[1 if i == 1 else 2]]
        log = IterationLog()
        with log:
            engine.step()
        logs.append((log.calls, log.functions))
        i += 1
    engine.check()
    return logs, drafted, [r.output_ids for r in reqs]


@pytest.mark.parametrize("pad,overlap", [(False, False), (True, True)])
def test_off_iterations_with_a_drafter_do_the_host_work_of_none(tiny, pad, overlap):
    """Whole iterations under policy never with the drafter's sizes configured: the same torch
    calls and specdec functions per iteration as without a drafter, and no drafter method called
    (no staging of rows prefilled while off, no root-state compaction when rows finish)."""
    plain, _, want = off_iterations(tiny, None, pad, overlap)
    # The iterations cover new rows (prefilled while off) and compactions (rows leaving mid-batch).
    assert len(plain) > 10 and any(f[("state.py", "append_rows_")] for _, f in plain)
    assert sum(f[("state.py", "keep_rows_")] for _, f in plain) >= 4
    eagle = lambda **kw: Eagle3Drafter(tiny_head(tiny), tiny, trees=[(1, 3, 3), (2, 3, 6)], **kw)  # noqa: E731
    for drafter in (NgramDrafter(chains=[2, 4]), eagle()):
        logs, drafted, out = off_iterations(tiny, drafter, pad, overlap)
        assert out == want and drafted == [], (drafter.name, drafted)
        assert len(logs) == len(plain)
        for i, ((calls, funcs), (calls0, funcs0)) in enumerate(zip(logs, plain)):
            assert calls == calls0, f"{drafter.name}: iteration {i} runs torch calls a plain one does not"
            assert funcs == funcs0, f"{drafter.name}: iteration {i}: {(funcs - funcs0) + (funcs0 - funcs)}"
    # Mutation checks: root state compacted with its rows while off (as before catch-up skipped it),
    # and a drafter that syncs while off; both are seen.
    logs, _, out = off_iterations(tiny, eagle(), pad, overlap,
                                  mutate=lambda e: e.state._synced_row_buffers.clear())
    assert out == want and any(c != c0 for (c, _), (c0, _) in zip(logs, plain))
    logs, drafted, out = off_iterations(tiny, eagle(sync_while_off=True), pad, overlap)
    assert out == want and "extend_" in drafted and "prefill_" in drafted and "stage_rows_" in drafted


def test_row_buffers_follow_rows_as_declared():
    """keep_rows_ compacts a "rows" buffer always, a "synced_rows" buffer only while some kept row is
    in sync (draft length = seq_len), a "none" buffer never."""
    st = DecodeState(4, 2, 4, "cpu")
    bufs = {f: st.add_row_buffer(f, (), torch.int64, follows=f) for f in ("rows", "synced_rows", "none")}
    for b in bufs.values():
        b.copy_(torch.arange(4))
    st.append_rows_([1] * 4, [5, 6, 7, 8], [[0]] * 4, draft_lens=[0, 6, 3, 1])  # row 1 in sync
    st.keep_rows_([0, 2, 3])  # row 1 leaves: every kept row is behind
    assert bufs["rows"][:3].tolist() == [0, 2, 3]
    assert bufs["synced_rows"][:3].tolist() == [0, 1, 2] and bufs["none"][:3].tolist() == [0, 1, 2]
    st.draft_lens_host[1] = st.seq_lens_host[1]  # kept row 1 (was 2) in sync
    st.keep_rows_([1, 2])
    assert bufs["rows"][:2].tolist() == [2, 3] and bufs["synced_rows"][:2].tolist() == [1, 2]
    assert bufs["none"][:2].tolist() == [0, 1] and "none" not in st.row_buffers
    with pytest.raises(ValueError, match="follows='always'"):
        st.add_row_buffer("x", (), torch.int64, follows="always")


def test_speculation_off_holds_no_tree_slots(tiny):
    """A drafter with 16-node trees configured but off: rows hold the pages plain decoding holds."""
    prompts = rand_prompts([5, 14, 9, 21], seed=4)
    free = {}
    for name, drafter in (("none", None), ("ngram", NgramDrafter(chains=[15])),
                          ("eagle3", Eagle3Drafter(tiny_head(tiny), tiny, topk=4, steps=4, num_draft_tokens=15))):
        engine = Engine(tiny, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=1024, overlap=True),
                        drafter=drafter, ks=(0,) if drafter is None else (15,))
        for p in prompts:
            engine.add_request(p, 12)
        seen = []
        for _ in range(6):
            engine.step(0)
            seen.append(engine.kv.num_free)
        free[name] = seen
        while engine.has_work():
            engine.step(0)
        engine.check()
    assert free["ngram"] == free["none"] and free["eagle3"] == free["none"]


def check_draft_in_sync(engine, drafter, model):
    """Every row's draft KV over its committed slots and its root state equal a fresh draft prefill."""
    ps = engine.kv.page_size
    assert engine.state.draft_lens_host == engine.state.seq_lens_host
    for row, req in enumerate(engine.scheduler.rows):
        s = req.seq_len
        if s == 0:
            continue
        pages = engine.kv.pages(req)
        slots = torch.tensor([pages[j // ps] * ps + j % ps for j in range(s)])
        live_k = drafter.k_cache[0].reshape(-1, *drafter.k_cache.shape[-2:])[slots]
        fresh, root = draft_prefill_kv(drafter, model, req.tokens[: s + 1], with_hidden=True)
        torch.testing.assert_close(live_k, fresh, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(drafter.root_hidden[row], root, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed,pad,overlap", [(0, False, False), (1, True, True), (2, False, True)])
def test_catch_up_after_random_schedules_equals_fresh_prefill(tiny, seed, pad, overlap):
    """Random on/off schedules over rows that join and leave at different times (so their backlogs
    differ), in a KV pool small enough to preempt, with catch-up chunked over forwards of at most 8
    tokens (pad: through the padded static-buffer runner a CUDA graph replays)."""
    rng = random.Random(seed)
    lengths = [rng.randint(3, 20) for _ in range(6)]
    prompts = rand_prompts(lengths, seed=seed + 10)
    max_new = [rng.randint(10, 26) for _ in prompts]
    want = [reference(tiny, p, m) for p, m in zip(prompts, max_new)]
    drafter = Eagle3Drafter(tiny_head(tiny, seed=seed), tiny, topk=2, steps=3, num_draft_tokens=5)
    engine = Engine(tiny, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=96, prefill_chunk=8,
                                       pad_eager=pad, graph_buckets=(1, 2, 4), prefill_buckets=(8,),
                                       overlap=overlap),
                    drafter=drafter, ks=(5,))
    assert (engine.stepper.catch_up_runner is not None) == pad
    reqs, arrive = [None] * len(prompts), {i: rng.randint(0, 12) for i in range(len(prompts))}
    step, drafting, forced = 0, 0, 0
    while step < 400 and (engine.has_work() or any(r is None for r in reqs)):
        for i, at in arrive.items():
            if at == step:
                reqs[i] = engine.add_request(prompts[i], max_new[i])
        k = 5 if rng.random() < 0.35 else 0
        engine.step(k)
        engine.check()
        backlog = [r for i, r in enumerate(engine.scheduler.rows)
                   if engine.state.draft_lens_host[i] < engine.state.seq_lens_host[i]]
        if not k and backlog and (not forced or rng.random() < 0.15):  # preempt a row while its draft is behind
            engine.scheduler._preempt_(backlog[-1])  # (what the scheduler does when pages run out)
            engine.check()
            forced += 1
        if k and engine.state.num_rows:
            while engine._unread:  # overlapped: commit the step in flight (as a drain does)
                engine._commit_oldest_()
            check_draft_in_sync(engine, drafter, tiny)  # after a drafting step's commit
            drafting += 1
        step += 1
    assert drafting > 3 and engine.num_catch_ups > 3 and engine.scheduler.num_preemptions > 0
    assert engine.undrafted_prefill_tokens > 0  # prompts (and recomputes) prefilled while off
    assert [r.output_ids for r in reqs] == want


def test_first_trees_after_resume_match_an_always_in_sync_draft(tiny):
    """fp32 on the CPU: the trees drafted by the catch-up drafter after each off period, and what
    they accept, are the in-sync (sync_while_off) drafter's."""
    prompts = repetitive_prompts(4, seed=9)
    head = tiny_head(tiny, seed=3)
    schedule = ([4] * 2 + [0] * 5) * 6
    runs = {}
    for name, sync in (("sync", True), ("catch_up", False)):
        drafter = Eagle3Drafter(head, tiny, topk=2, steps=2, num_draft_tokens=4, sync_while_off=sync)
        trees = []
        real = drafter.propose
        drafter.propose = lambda *a, _real=real, **kw: trees.append(_real(*a, **kw)) or trees[-1]
        trace = []
        engine = Engine(tiny, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=1024),
                        drafter=drafter, ks=(4,), trace=trace.append)
        reqs = [engine.add_request(p, 30) for p in prompts]
        for k in schedule:
            if engine.has_work():
                engine.step(k)
        engine.flush_trace()
        runs[name] = ([t.tokens.clone() for t in trees], [rec["accepted"] for rec in trace if rec["k"]],
                      [r.output_ids for r in reqs])
    (t_sync, a_sync, o_sync), (t_cu, a_cu, o_cu) = runs["sync"], runs["catch_up"]
    assert len(t_sync) == len(t_cu) > 6
    for a, b in zip(t_sync, t_cu):
        assert torch.equal(a, b)
    assert a_sync == a_cu and o_sync == o_cu


def test_unconfigured_sizes_are_config_errors(tiny):
    from omegaconf import OmegaConf

    from specdec.policy import build_policy

    drafter = Eagle3Drafter(tiny_head(tiny), tiny, trees=[(1, 3, 3), (2, 3, 6)])
    assert drafter.sizes == (3, 6) and drafter.num_nodes(6) == 7
    with pytest.raises(ConfigError, match=r"configured sizes.*\[3, 6\]"):
        Engine(tiny, EngineConfig(max_batch_size=2, page_size=4, kv_cache_tokens=256), drafter=drafter, ks=(5,))
    assert build_policy(OmegaConf.create({"name": "always", "k": None}), sizes=drafter.sizes).k == 6
    assert build_policy(OmegaConf.create({"name": "goodput", "ks": None}), sizes=drafter.sizes).ks == (0, 3, 6)
    with pytest.raises(ConfigError, match=r"policy.k=5 .*configured sizes: \[3, 6\]"):
        build_policy(OmegaConf.create({"name": "always", "k": 5}), sizes=drafter.sizes)
    with pytest.raises(ConfigError, match="two shapes of 6"):
        Eagle3Drafter(tiny_head(tiny), tiny, trees=[(2, 3, 6), (3, 2, 6)])
    with pytest.raises(ConfigError, match=r"chain length.*\[3\]"):
        NgramDrafter(chains=[3]).num_nodes(4)


def test_shadow_acceptance_is_what_speculation_commits(tiny):
    """The n-gram drafter's shadow score walked over a request's greedy output (start += committed,
    from the prompt's end) is, step for step, what an engine speculating at k every step commits
    (the tiny model's greedy output repeats, so the chains accept runs of several tokens)."""
    from specdec.engine.shadow import ShadowAcceptance

    prompts = repetitive_prompts(3, seed=4)
    for k in (2, 5):
        drafter = NgramDrafter(chains=[2, 5])
        for p in prompts:
            trace = []
            engine = Engine(tiny, EngineConfig(max_batch_size=2, page_size=4, kv_cache_tokens=512),
                            drafter=drafter, ks=(k,), trace=trace.append)
            req = engine.add_request(p, 24)
            while engine.has_work():
                engine.step(k)
            engine.flush_trace()
            served = [a + 1 for rec in trace for a in rec["accepted"]]
            hist, start, walked = req.tokens, len(p), []
            while start + k <= len(hist):
                walked.append(drafter.shadow_commits(hist, start, k))
                start += walked[-1]
            n = len(walked)
            assert n >= 3 and walked == served[:n], (k, p)
            assert max(served) > 1  # some chains accepted: the check is not all ones
    # The walker: one (request, k) walk per pair, at most evals_per_step lookups per call.
    sh = ShadowAcceptance(NgramDrafter(chains=[2, 5]), (0, 2, 5), evals_per_step=3)
    hist = prompts[0] * 3
    got = sh.samples_(["a", "b"], lambda i: hist)
    assert len(got) == 3 and [g[:2] for g in got] == [(2, "a"), (5, "a"), (2, "b")]
    assert sh.next_start[("a", 2)] == len(hist) - 2 + got[0][2]
    assert sh.samples_(["a"], lambda i: hist) == []  # no new tokens: nothing left to score


def test_shadow_walks_score_above_a_speculative_steps_k_and_keep_their_place():
    """A speculative step's own k and the chains nested in it have exact samples: it scores only the
    larger ks (none at the largest, and then no history is read). A walk far behind the newest
    position it can score keeps its place (its samples stay exact, of older text)."""
    from specdec.engine.shadow import ShadowAcceptance

    hist = repetitive_prompts(1, seed=4)[0] * 3
    sh = ShadowAcceptance(NgramDrafter(chains=[2, 5]), (0, 2, 5), evals_per_step=4)
    got = sh.samples_(["a", "b"], lambda i: hist, above=2)
    assert [g[:2] for g in got] == [(5, "a"), (5, "b")]
    read = []
    assert sh.samples_(["a"], lambda i: read.append(i) or hist, above=5) == [] and read == []
    sh = ShadowAcceptance(NgramDrafter(chains=[2]), (0, 2), evals_per_step=1)
    sh.next_start[("a", 2)] = 3  # a walk far behind the newest scorable position
    (k, _, c), = sh.samples_(["a"], lambda i: hist)
    assert sh.next_start[("a", 2)] == 3 + c


def test_goodput_with_shadow_scores_turns_ngram_speculation_on(tiny):
    """An n-gram engine under goodput with shadow scoring: k = 0 steps feed it samples (no forced
    try), it speculates on repetitive text, and greedy output stays plain greedy's."""
    from specdec.policy import Goodput

    prompts = repetitive_prompts(3, seed=4)
    want = [reference(tiny, p, 24) for p in prompts]
    pol = Goodput([2, 5], margin=0.0, explore_every=0, shadow_evals=2, counterfactual=False)
    trace = []
    engine = Engine(tiny, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=1024),
                    drafter=NgramDrafter(chains=[2, 5]), policy=pol, trace=trace.append)
    assert pol.shadowed and engine._shadow is not None
    pol.set_table({0: {1: 1.0, 4: 1.0}, 2: {1: 1.05, 4: 1.05}, 5: {1: 1.1, 4: 1.1}})  # speculation nearly free
    reqs = [engine.add_request(p, 24) for p in prompts]
    while engine.has_work():
        engine.step()
    engine.flush_trace()
    ks = [rec["k"] for rec in trace if rec["decode_bs"]]
    assert ks[0] == 0  # no first try: k > 0 waits for the first shadow samples
    assert pol.shadow_samples > 0 and pol.accept[5] is not None and pol.lookup_ms is not None
    assert any(ks), ks
    assert [r.output_ids for r in reqs] == want


def test_shadow_scoring_runs_on_speculative_steps_too(tiny):
    """The engine scores shadow drafts on every step, not only on k = 0 steps: a policy that speculates
    where a request's text repeats would otherwise score only the stretches it left off (a prior biased
    low). Every step here is speculative (the table makes speculation nearly free), yet samples arrive."""
    from specdec.policy import Goodput

    pol = Goodput([2, 5], margin=0.0, explore_every=0, shadow_evals=2, counterfactual=False)
    fed = []
    update = pol.update
    pol.update = lambda stats: (fed.append((stats.k, len(stats.shadow or ()))), update(stats))
    engine = Engine(tiny, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=1024),
                    drafter=NgramDrafter(chains=[2, 5]), policy=pol)
    pol.set_table({0: {1: 1.0, 4: 1.0}, 2: {1: 1.01, 4: 1.01}, 5: {1: 1.02, 4: 1.02}})
    for p in repetitive_prompts(3, seed=4):
        engine.add_request(p, 24)
    while engine.has_work():
        engine.step(5)  # speculative on every step
    assert fed and all(k == 5 for k, _ in fed)
    assert sum(n for _, n in fed) > 0 and pol.shadow_samples > 0


def test_step_trace_carries_the_shadow_samples(tiny):
    """With a step trace (steps.jsonl) each iteration's record holds the shadow samples scored on it, by
    k: every sample the policy got, and only those (what a(k) rested on while a policy sat at k = 0)."""
    from specdec.policy import Goodput

    pol = Goodput([2, 5], margin=0.0, explore_every=0, shadow_evals=2)
    trace = []
    engine = Engine(tiny, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=1024),
                    drafter=NgramDrafter(chains=[2, 5]), policy=pol, trace=trace.append)
    pol.set_table({0: {1: 1.0, 4: 1.0}, 2: {1: 9.0, 4: 9.0}, 5: {1: 9.0, 4: 9.0}})  # stays off
    for p in repetitive_prompts(3, seed=4):
        engine.add_request(p, 16)
    while engine.has_work():
        engine.step()
    engine.flush_trace()
    got = [(int(j), c) for rec in trace for j, cs in rec.get("shadow", {}).items() for c in cs]
    assert got and len(got) == pol.shadow_samples
    assert {j for j, _ in got} == {2, 5} and all(1 <= c <= j + 1 for j, c in got)


def test_ngram_steps_feed_the_smaller_chains_commits_exactly(tiny):
    """n-gram chains nest (the chain of 2 is the first 2 tokens of the chain of 5), so each step at 5
    feeds goodput the chain of 2's commits at the same position, min(committed, 3), as counterfactual
    samples labelled exact; they equal what a chain-2 draft there commits (the drafter's own
    shadow_commits over the finished text)."""
    from specdec.policy import Goodput

    pol = Goodput([2, 5], margin=0.0, explore_every=0, shadow_evals=2, counterfactual=True)
    fed = []
    update = pol.update
    pol.update = lambda stats: (fed.append(stats), update(stats))
    dr = NgramDrafter(chains=[2, 5])
    engine = Engine(tiny, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=1024), drafter=dr, policy=pol)
    assert pol.counterfactual_pairs == {(2, 5): "exact"}
    pol.set_table({0: {1: 1.0, 4: 1.0}, 2: {1: 1.01, 4: 1.01}, 5: {1: 1.02, 4: 1.02}})
    for i, p in enumerate(repetitive_prompts(3, seed=4)):
        engine.add_request(p, 24, request_id=f"q{i}")
    done = {}
    while engine.has_work():
        done.update({r.id: r for r in engine.step(5)})
    steps = [s for s in fed if s.k == 5]
    assert steps and all(s.counterfactual == {2: [min(c, 3) for c in s.committed]} for s in steps)
    assert pol.counterfactual_rows[2] == sum(s.num_decode for s in steps)
    checked = hits = 0
    for rid, req in done.items():
        hist = list(req.prompt_ids) + list(req.output_ids)
        mine = [(s.committed[s.rows.index(rid)], s.counterfactual[2][s.rows.index(rid)]) for s in steps if rid in s.rows]
        start = len(req.prompt_ids)  # the first decode step commits the prefill's token first
        for c, cf2 in mine:
            if start + 5 <= len(hist):
                assert cf2 == dr.shadow_commits(hist, start, 2)
                checked, hits = checked + 1, hits + (cf2 > 1)
            start += c
    assert checked > 10 and hits > 0


def test_goodput_prices_ngram_drafting_by_the_drafters_own_host_time(tiny):
    """Shadow samples carry the drafter's measured host ms per drafted row (n-gram: its indexed
    lookups), not the time of the scans that score shadow drafts at past positions."""
    from specdec.policy import Goodput

    class Fixed(NgramDrafter):
        host_ms_per_row = property(lambda self: 0.123, lambda self, v: None)

    pol = Goodput([2, 5], margin=0.0, explore_every=0, shadow_evals=2)
    engine = Engine(tiny, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=1024),
                    drafter=Fixed(chains=[2, 5]), policy=pol)
    pol.set_table({0: {1: 1.0, 4: 1.0}, 2: {1: 9.0, 4: 9.0}, 5: {1: 9.0, 4: 9.0}})  # stays off
    for p in repetitive_prompts(3, seed=4):
        engine.add_request(p, 16)
    while engine.has_work():
        engine.step()
    assert pol.shadow_samples > 0 and pol.lookup_ms == pytest.approx(0.123)
    assert NgramDrafter(chains=[2]).host_ms_per_row is None
    plain = NgramDrafter(chains=[2])
    plain.bind_(engine.state, 16, 4)
    assert 0 < plain.host_ms_per_row < 5  # timed at bind_


def test_goodput_spaces_shadow_scoring_out_while_speculation_trails(tiny):
    """shadow_due: every k = 0 step while some k > 0 is close to k = 0; while every k > 0 trails by
    more than SHADOW_SLACK the gap between scorings doubles (explore_backoff), and a batch where
    speculation is close again resets it. Through the engine: far fewer lookups than k = 0 steps."""
    from specdec.policy import BatchView, Goodput, StepStats

    pol = Goodput([2, 5], margin=0.0, explore_every=0, shadow_evals=2, explore_backoff=2.0, explore_max=64)
    pol.set_table({0: {1: 1.0, 8: 1.0}, 2: {1: 1.05, 8: 4.0}, 5: {1: 1.1, 8: 8.0}})  # dear at 8 rows only
    pol.shadowed_()
    pol.update(StepStats(k=0, num_decode=8, committed=[1] * 8, shadow=[(2, "a", 2.0), (5, "a", 2.0)]))
    due = []
    for _ in range(40):
        assert pol.choose(BatchView(num_decode=8, num_waiting=0)) == 0
        due.append(pol.shadow_due())
    assert [i for i, d in enumerate(due) if d] == [0, 2, 6, 14, 30]  # gaps 2, 4, 8, 16
    assert pol.shadow_skipped == 40 - 5
    pol.choose(BatchView(num_decode=1, num_waiting=0))  # one row: speculation is close again
    assert pol.shadow_gap == 1.0 and pol.shadow_due()

    prompts = rand_prompts([12, 15, 9, 11], seed=8)
    pol = Goodput([2, 5], margin=0.0, explore_every=0, shadow_evals=2, explore_backoff=2.0)
    engine = Engine(tiny, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=1024),
                    drafter=NgramDrafter(chains=[2, 5]), policy=pol)
    # speculation far too dear at any batch, also beside the host time of a loaded CPU's iterations
    pol.set_table({0: {4: 1.0}, 2: {4: 5000.0}, 5: {4: 10000.0}})
    reqs = [engine.add_request(p, 40) for p in prompts]
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    assert engine._shadow.lookups <= 2 * 12 and pol.shadow_skipped > steps // 2
    assert [r.output_ids for r in reqs] == [reference(tiny, p, 40) for p in prompts]


def test_only_the_prefill_paths_a_policy_reaches_are_captured(tiny):
    """never (k = 0 only) gets no drafted prefill and no catch-up runner, and its first prompt prefills
    without the draft; always (one k > 0) no plain prefill and no catch-up; a policy that switches gets
    all three. Greedy outputs stay plain greedy's (pad_eager: the padded runners' shapes on the CPU)."""
    from specdec.policy import Always, BatchThreshold

    prompts = rand_prompts([9, 14], seed=11)
    runners = {}
    for name, policy in (("never", Never()), ("always", Always(4)), ("switching", BatchThreshold(4, 1, 1))):
        drafter = Eagle3Drafter(tiny_head(tiny), tiny, topk=2, steps=2, num_draft_tokens=4)
        engine = Engine(tiny, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=1024, pad_eager=True,
                                           prefill_buckets=(8, 32), graph_buckets=(1, 2, 4)),
                        drafter=drafter, policy=policy)
        st = engine.stepper
        runners[name] = tuple(r is not None for r in (st.prefill_runner, st.plain_prefill_runner, st.catch_up_runner))
        reqs = [engine.add_request(p, 6) for p in prompts]
        engine.run_until_done()
        for p, r in zip(prompts, reqs):
            assert r.output_ids == reference(tiny, p, 6), name
        if name == "never":
            assert engine.undrafted_prefill_tokens == sum(len(p) - 1 for p in prompts)
    assert runners == {"never": (False, True, False), "always": (True, False, False), "switching": (True, True, True)}


def test_speculative_ngram_steps_shadow_score_only_the_larger_chains(tiny):
    """Under goodput with nested-chain counterfactuals, a step at the largest chain does no shadow
    lookups (its host work is on the serial path), a step at a smaller one scores only the larger
    chain, a k = 0 step every chain; greedy output stays plain greedy's."""
    from specdec.policy import Goodput

    prompts = repetitive_prompts(2, seed=4)
    want = [reference(tiny, p, 20) for p in prompts]
    pol = Goodput([2, 5], explore_every=0, shadow_evals=2, counterfactual=True)
    engine = Engine(tiny, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=1024),
                    drafter=NgramDrafter(chains=[2, 5]), policy=pol)
    pol.set_table({0: {1: 1.0, 4: 1.0}, 2: {1: 1.05, 4: 1.05}, 5: {1: 1.1, 4: 1.1}})
    seen = []
    update = pol.update
    pol.update = lambda st: (seen.append((st.k, sorted({k for k, _, _ in st.shadow or ()}))), update(st))
    reqs = [engine.add_request(p, 20) for p in prompts]
    schedule = [0, 0, 5, 5, 2, 2, 0, 5]
    i = 0
    while engine.has_work():
        engine.step(schedule[i % len(schedule)] if engine.state.num_rows else 0)
        i += 1
    by_k = {}
    for k, scored in seen:
        by_k.setdefault(k, set()).update(scored)
    assert by_k[5] == set() and by_k[2] == {5} and by_k[0] == {2, 5}
    assert [r.output_ids for r in reqs] == want
