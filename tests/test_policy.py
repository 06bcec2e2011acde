"""Speculation policies: the goodput policy's choice from its step-time table and acceptance EMA,
its start-up calibration through the engine, and greedy identity whatever it chooses."""

import random
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from test_engine import rand_prompts, reference, tiny_model
from test_spec import repetitive_prompts, run_engine, tiny_head

from specdec.engine.engine import Engine, EngineConfig
from specdec.errors import ConfigError
from specdec.policy import BatchView, Goodput, GoodputConfig, Policy, Schedule, StepStats, build_policy
from specdec.spec import Eagle3Drafter, NgramDrafter

# ms per step: speculation pays at small batches (cheap verify), not at 64 rows.
TABLE = {0: {1: 1.0, 8: 1.2, 64: 2.0}, 2: {1: 1.2, 8: 1.5, 64: 4.4}, 4: {1: 1.4, 8: 2.4, 64: 6.0}}


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(layers=2)


# goodput's model alone: none of the guards its defaults add (first tries over several rows, a step
# cost bound on them, request probes, re-try backoff, counterfactual and shadow samples), so each
# test switches on the one it checks
BARE = dict(probe_rows=1, probe_cost=float("inf"), probe_requests=0, explore_backoff=1.0, counterfactual=False,
            shadow_evals=0, shadow_rows_cap=0, profile_iters=20)


def bare(ks, cls=Goodput, **kw):
    return cls(ks, **{**BARE, **kw})


def view(n):
    return BatchView(num_decode=n, num_waiting=0)


def run_k(pol, k, committed):
    assert pol.choose(view(len(committed))) == k
    pol.update(StepStats(k=k, num_decode=len(committed), committed=committed))


def test_goodput_tries_each_k_then_maximises_tokens_per_ms():
    pol = bare([4, 2], margin=0.0, explore_every=0)
    assert pol.ks == (0, 2, 4)
    pol.set_table(TABLE)
    run_k(pol, 2, [2, 2])  # untried k first, smallest first: a(2) = 2
    run_k(pol, 4, [3, 2])  # a(4) = 2.5
    # B=1: 1/1.0, 2/1.2 = 1.67, 2.5/1.4 = 1.79 per ms -> 4; B=8 (bucket 8): 0.83, 1.33, 1.04 -> 2;
    # B=9..64 (bucket 64): 0.5, 0.45, 0.42 -> 0; past the largest bucket, its times.
    assert [pol.choose(view(b)) for b in (1, 5, 8, 9, 64, 100, 2, 1)] == [4, 2, 2, 0, 0, 0, 2, 4]
    assert pol.step_ms(2, 100) == 4.4 and pol.step_ms(4, 3) == 2.4


def test_goodput_acceptance_prior_moves_the_choice():
    # Without request ids every row takes the prior a(k): an EMA with weight prior_ema per row and step.
    pol = bare([2], prior_ema=0.5, margin=0.0, explore_every=0)
    pol.set_table(TABLE)
    run_k(pol, 2, [3])  # a(2) = 3: 2.5 per ms at B=1 vs 1.0
    assert pol.accept[2] == 3.0
    pol.update(StepStats(k=2, num_decode=1, committed=[1]))  # 0.5 * 3 + 0.5 * 1 = 2
    pol.update(StepStats(k=0, num_decode=1, committed=[1]))  # k = 0 steps say nothing of a(2)
    assert pol.accept[2] == 2.0
    assert pol.choose(view(8)) == 2  # 2 / 1.5 = 1.33 > 1 / 1.2
    pol.update(StepStats(k=2, num_decode=2, committed=[1, 1]))  # two rows: weight 1 - 0.5^2: 0.25 * 2 + 0.75
    assert pol.accept[2] == 1.25 and pol.choose(view(8)) == 2  # 1.25 / 1.5 = 1 / 1.2: a tie keeps the previous k
    pol.update(StepStats(k=2, num_decode=1, committed=[1]))  # a(2) = 1.125: 0.75 < 0.83
    assert pol.accept[2] == 1.125 and pol.choose(view(8)) == 0


def test_goodput_keeps_each_requests_acceptance():
    """a(k) of a batch sums each request's own estimate; a request the draft cannot follow turns
    speculation off while it runs alone, and the next request starts from the all-requests prior
    instead of inheriting it (on the H200 a shared EMA cost a C = 1 point 235 plain steps)."""
    pol = bare([2], ema=0.5, prior_ema=0.1, margin=0.0, explore_every=0)
    pol.set_table(TABLE)
    both = BatchView(2, 0, rows=("a", "b"))
    assert pol.choose(both) == 2  # untried
    pol.update(StepStats(k=2, num_decode=2, committed=[3, 1], rows=["a", "b"]))  # from the first mean, 2
    assert pol.row_accept[2] == {"a": 2.5, "b": 1.5} and pol.accept[2] == 2.0
    assert pol.choose(both) == 2  # bucket 8: (2.5 + 1.5) / 2 / 1.5 = 1.33 per row-ms > 1 / 1.2
    pol.update(StepStats(k=2, num_decode=2, committed=[3, 1], rows=["a", "b"]))  # a 2.75, b 1.25, prior 2
    # b 1.125; the prior is the mean of the 5 rows seen (fewer than 1 / prior_ema): (3 + 1 + 3 + 1 + 1) / 5
    pol.update(StepStats(k=2, num_decode=1, committed=[1], rows=["b"]))
    assert pol.row_accept[2]["b"] == 1.125 and pol.accept[2] == pytest.approx(1.8)
    assert pol.choose(BatchView(1, 0, rows=("b",))) == 0  # b alone: 1.125 / 1.2 < 1 / 1.0
    assert set(pol.row_accept[2]) == {"b"}  # a left the batch: forgotten
    assert pol.choose(BatchView(1, 0, rows=("c",))) == 2  # c starts from the prior: 1.8 / 1.2 > 1 / 1.0
    assert pol.expected(2, 3, rows=("c", "d", "e")) == pytest.approx(3 * 1.8) and pol.row_accept[2] == {}
    assert "accept_rows" in pol.describe()


def test_goodput_margin_keeps_the_previous_k():
    table = {0: {8: 1.0}, 2: {8: 2.0}}
    for margin, want in ((0.05, 0), (0.10, 2)):
        pol = bare([2], prior_ema=0.1, margin=margin, explore_every=0)
        pol.set_table(table)
        run_k(pol, 2, [2] * 10)  # a(2) = 2: 1.0 per ms, a tie with k = 0: stays at 2
        assert pol.choose(view(8)) == 2
        # 10 rows seen (1 / prior_ema): the prior is an EMA now: a(2) = 1.9: k = 0 gains 5.3%
        pol.update(StepStats(k=2, num_decode=1, committed=[1]))
        assert pol.choose(view(8)) == want, margin


def test_goodput_reexplores_while_off():
    pol = bare([2, 4], margin=0.0, explore_every=3)
    pol.set_table(TABLE)
    run_k(pol, 2, [1] * 64)
    run_k(pol, 4, [1] * 64)  # a = 1 everywhere: k = 0 wins at every batch
    seen = [pol.choose(view(64)) for _ in range(7)]
    # every 3rd consecutive k = 0 choice re-tries the best speculative k (2: 1/4.4 > 1/6.0)
    assert seen == [0, 0, 2, 0, 0, 2, 0]


def test_goodput_served_step_times_replace_the_startup_table():
    pol = bare([2], margin=0.0, explore_every=0, time_ema=0.5)
    pol.set_table(TABLE)
    run_k(pol, 2, [2])  # a(2) = 2; at B=1: 2 / 1.2 > 1 / 1.0
    assert pol.choose(view(1)) == 2
    # The start-up entry for k = 2 at batch 1 was off: served steps take 2.5 ms there. The average
    # starts from the entry, and a sample counts as at most twice the average so far.
    pol.update(StepStats(k=2, num_decode=1, committed=[2], step_ms=2.5))  # 0.5 * 1.2 + 0.5 * 2.4
    assert pol.observed == {(2, 1): pytest.approx(1.8)} and pol.step_ms(2, 5) == 1.5
    assert pol.choose(view(1)) == 2  # 2 / 1.8 > 1 / 1.0
    pol.update(StepStats(k=2, num_decode=1, committed=[2], step_ms=2.5))  # 0.5 * 1.8 + 0.5 * 2.5
    assert pol.step_ms(2, 1) == pytest.approx(2.15) and pol.choose(view(1)) == 0  # 2 / 2.15 < 1 / 1.0
    pol.update(StepStats(k=0, num_decode=3, committed=[1] * 3, step_ms=3.0))  # bucket 8 of k = 0: 0.6 + 1.2
    pol.update(StepStats(k=0, num_decode=7, committed=[1] * 7, step_ms=2.0))  # 0.5 * 1.8 + 0.5 * 2.0
    assert pol.step_ms(0, 8) == pytest.approx(1.9) and pol.step_ms(0, 1) == 1.0
    assert pol.choose(view(8)) == 2  # 2 / 1.5 > 1 / 1.9
    assert pol.describe()["served_step_ms"] == {"k=0": {8: pytest.approx(1.9)}, "k=2": {1: pytest.approx(2.15)}}
    off = bare([2], time_ema=0.0)
    off.set_table(TABLE)
    off.update(StepStats(k=2, num_decode=1, committed=[2], step_ms=9.0))
    assert off.observed == {} and off.step_ms(2, 1) == 1.2


def test_goodput_one_stalled_step_does_not_turn_speculation_off():
    # On the H200 one served step of 8.1 ms (against 1.6) became a bucket's average and turned
    # speculation off there for the rest of the run.
    pol = bare([2], margin=0.0, explore_every=0, time_ema=0.1)
    pol.set_table(TABLE)
    run_k(pol, 2, [2] * 8)  # a(2) = 2 per row; bucket 8: 2 / 1.5 > 1 / 1.2
    pol.update(StepStats(k=2, num_decode=8, committed=[2] * 8, step_ms=80.0))  # one stall
    assert pol.step_ms(2, 8) == pytest.approx(0.9 * 1.5 + 0.1 * 3.0)
    assert pol.choose(view(8)) == 2  # 2 / 1.65 > 1 / 1.2


def test_goodput_config_and_errors():
    pol = build_policy(OmegaConf.create({"name": "goodput", "ks": [8, 4], "ema": 0.2, "margin": 0.1,
                                         "explore_every": 10, "profile_context": 256}))
    assert isinstance(pol, Goodput) and pol.ks == (0, 4, 8) and pol.ema == 0.2 and pol.profile_context == 256
    with pytest.raises(ConfigError, match="ks must list"):
        bare([0])
    with pytest.raises(ConfigError, match="ema"):
        bare([2], ema=0.0)
    pol = bare([2])
    with pytest.raises(RuntimeError, match="no step-time table"):
        pol.choose(view(1))
    with pytest.raises(ConfigError, match=r"no entries for k in \[2\]"):
        pol.set_table({0: {1: 1.0}})


def test_engine_calibrates_goodput_and_stays_greedy_identical(tiny):
    """The engine profiles every k at every graph bucket at start-up; whatever the policy then
    chooses (real CPU timings, real n-gram acceptance), greedy output equals plain greedy."""
    prompts = repetitive_prompts(5, seed=4)
    want = [reference(tiny, p, 14) for p in prompts]
    seen = []  # (request ids the policy saw, rows of the batch) per choice and per update

    class Spy(Goodput):
        def choose(self, view):
            seen.append((view.rows, view.num_decode))
            return super().choose(view)

        def update(self, stats):
            seen.append((stats.rows, len(stats.committed)))
            super().update(stats)

    pol = Spy([2, 4], explore_every=4, profile_context=40)
    got, engine = run_engine(tiny, prompts, 14, drafter=NgramDrafter(), policy=pol, max_batch=4)
    assert got == want
    # the engine names each row's request, in row order, to choose and to update: one id per request
    assert seen and all(rows is not None and len(rows) == n and len(set(rows)) == n for rows, n in seen)
    assert len({r for rows, _ in seen for r in rows}) == len(prompts)
    assert set(pol.table) == {0, 2, 4}
    assert [b for b, _ in pol.table[4]] == engine.buckets and all(ms > 0 for k in pol.table for _, ms in pol.table[k])
    assert pol.accept[2] is not None and pol.accept[4] is not None  # both were run
    # every decode step was timed and folded into its (k, bucket) entry
    assert pol.observed and all(b in dict(pol.table[k]) and ms > 0 for (k, b), ms in pol.observed.items())
    state = pol.describe()
    assert state["accept"] == {"k=2": pol.accept[2], "k=4": pol.accept[4]}
    assert state["step_ms"]["k=4"] == dict(pol.table[4])
    engine.check()


def test_goodput_profiles_only_the_buckets_the_pool_can_hold(tiny):
    """A small pool: the largest bucket cannot hold its rows, so it is left out of the table and
    the largest profiled bucket's times stand in for it."""
    pol = bare([4], profile_context=64)
    engine = Engine(tiny, EngineConfig(max_batch_size=8, page_size=4, kv_cache_tokens=128, graph_buckets=(1, 2, 4, 8)),
                    drafter=NgramDrafter(), policy=pol)
    # per row: context >= 16 + 2 steps x 5 tokens + one 5-token tree ahead; 32 pages of 4 slots hold 4 such rows
    assert [b for b, _ in pol.table[0]] == [1, 2, 4] and engine.buckets == [1, 2, 4, 8]
    assert pol.step_ms(4, 8) == dict(pol.table[4])[4]
    tiny_pool = bare([4])
    with pytest.raises(ConfigError, match="cannot hold even one profiling row"):
        Engine(tiny, EngineConfig(max_batch_size=2, page_size=4, kv_cache_tokens=24), drafter=NgramDrafter(),
               policy=tiny_pool)


def test_profile_decode_step_with_draft_tokens_returns_pages(tiny):
    drafter = Eagle3Drafter(tiny_head(tiny), tiny, topk=2, steps=2, num_draft_tokens=4)
    engine = Engine(tiny, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=1024),
                    drafter=drafter, ks=(4,))
    for k in (0, 4):
        assert engine.profile_decode_step(3, 30, iters=2, warmup=1, k=k) > 0
        assert engine.kv.num_free == engine.kv.num_pages and engine.state.num_rows == 0
    with pytest.raises(ConfigError, match="k=2 was not configured"):
        engine.profile_decode_step(3, 30, k=2)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        engine.profile_decode_step(1, tiny.config.max_position_embeddings - 10, iters=5, k=4)
    prompt = [5, 6, 7, 5, 6, 7, 5]
    r = engine.add_request(prompt, 6)
    while engine.has_work():
        engine.step(4)
    assert r.output_ids == reference(tiny, prompt, 6)


def test_goodput_picks_the_best_of_several_tree_sizes_per_batch():
    """ks = every configured size (chain 3, trees 8, 16, 32): the step-time table and the acceptance
    of each k decide per batch; k = 0 where speculation is slower than plain decoding at any size."""
    table = {0: {1: 1.0, 8: 1.1, 32: 1.5, 256: 3.0},
             3: {1: 1.1, 8: 1.3, 32: 2.0, 256: 7.0},
             8: {1: 1.15, 8: 1.6, 32: 2.8, 256: 10.0},
             16: {1: 1.2, 8: 2.0, 32: 4.0, 256: 16.0},
             32: {1: 1.3, 8: 3.0, 32: 7.0, 256: 30.0}}
    accept = {3: 2.2, 8: 2.8, 16: 3.3, 32: 3.6}  # tokens committed per row and step
    pol = build_policy(OmegaConf.create({"name": "goodput", "ks": None, "margin": 0.0, "explore_every": 0, **BARE}),
                       sizes=(3, 8, 16, 32))
    assert pol.ks == (0, 3, 8, 16, 32)
    pol.set_table(table)
    for k in (3, 8, 16, 32):
        run_k(pol, k, [accept[k]] * 2)

    def best(b):
        rate = {k: (accept.get(k, 1.0)) / pol.step_ms(k, b) for k in pol.ks}
        return max(rate, key=rate.get)

    # tokens per row-ms: B=1: 3.6 / 1.3 = 2.77 (32) > 3.3 / 1.2 = 2.75 (16); B=8: 2.8 / 1.6 = 1.75 (8)
    # > 2.2 / 1.3 = 1.69 (3); B=32: 2.2 / 2.0 = 1.1 (3) > 1 / 1.5; B=256: 1 / 3.0 (0) > 2.2 / 7.0 (3).
    got = [pol.choose(view(b)) for b in (1, 8, 32, 256)]
    assert got == [best(b) for b in (1, 8, 32, 256)] == [32, 8, 3, 0]
    slow = bare([3, 8, 16, 32], margin=0.0, explore_every=0)
    slow.set_table({k: {b: ms * (2.0 if k else 1.0) for b, ms in v.items()} for k, v in table.items()})
    for k in (3, 8, 16, 32):
        run_k(slow, k, [accept[k]] * 2)
    assert [slow.choose(view(b)) for b in (1, 8, 32, 256)] == [32, 0, 0, 0]


def test_goodput_logs_each_switch_with_the_estimates_it_compared():
    """describe()'s switch_log: one entry per change of k (none for a choice that keeps it), with the batch, the
    k left and taken, why (first tries, then the estimates), and per k the a(k), iteration ms and rate compared,
    the taken k's rate the highest when the estimates decided; the log keeps the last SWITCH_LOG switches."""
    from specdec.policy.goodput import SWITCH_LOG

    table = {0: {1: 1.0, 8: 1.1, 32: 1.5}, 3: {1: 1.1, 8: 1.3, 32: 2.0}, 32: {1: 1.3, 8: 3.0, 32: 7.0}}
    pol = bare([3, 32], margin=0.0, explore_every=0)
    pol.set_table(table)
    run_k(pol, 3, [2.2, 2.2])  # first tries: the smallest k first (no counterfactual pairs)
    log = pol.describe()["switch_log"]
    assert [(e["from"], e["to"], e["why"]) for e in log] == [(0, 3, "first_try")]
    run_k(pol, 32, [3.6, 3.6])
    got = [pol.choose(view(b)) for b in (1, 1, 8, 32)]
    assert got == [32, 32, 3, 3]  # 32 at one row (2.77 tokens a row-ms against 2.0), 3 at 8 and 32 rows
    d = pol.describe()
    log = d["switch_log"]
    assert [(e["from"], e["to"], e["why"]) for e in log] == [(0, 3, "first_try"), (3, 32, "first_try"),
                                                            (32, 3, "estimates")]
    assert d["switches"] == 3 and d["choices_made"] == 6
    last = log[-1]
    assert (last["from"], last["to"], last["why"], last["batch"]) == (32, 3, "estimates", 8)
    rates = {int(k): e["rate"] for k, e in last["k"].items()}
    assert max(rates, key=rates.get) == 3
    assert last["k"]["3"]["iter_ms"] == pytest.approx(1.3) and last["k"]["3"]["a"] == pytest.approx(2.2)
    assert last["k"]["0"] == {"a": 1.0, "iter_ms": 1.1, "rate": pytest.approx(1 / 1.1, abs=1e-4)}
    for i in range(SWITCH_LOG + 5):  # alternate: every choice a switch
        pol.choose(view(1 if i % 2 == 0 else 8))
    assert len(pol.describe()["switch_log"]) == SWITCH_LOG and pol.describe()["switches"] == 3 + SWITCH_LOG + 5


def test_goodput_rows_fast_path_matches_the_direct_sum():
    pol = bare([2], ema=0.5, margin=0.0, explore_every=0)
    pol.set_table(TABLE)
    rows = tuple(f"r{i}" for i in range(40))
    pol.choose(BatchView(40, 0, rows=rows))
    pol.update(StepStats(k=2, num_decode=40, committed=[1 + i % 3 for i in range(40)], rows=list(rows)))
    rows2 = rows[5:] + ("new1", "new2")
    pol.choose(BatchView(len(rows2), 0, rows=rows2))
    assert pol.expected(2, len(rows2), rows2) == pytest.approx(pol.expected(2, len(rows2), tuple(rows2)))
    assert set(pol.row_accept[2]) == set(rows[5:])


def test_goodput_prunes_rows_an_older_step_brought_back():
    """With overlapped steps an update can carry rows of a step launched before the last choice, some
    of which left the batch since: the next choice forgets them even when the batch did not change
    (choose skips the pruning only while no update started a row's estimate)."""
    pol = bare([2], ema=0.5, margin=0.0, explore_every=0)
    pol.set_table(TABLE)
    rows = ("a", "b")
    pol.choose(BatchView(2, 0, rows=rows))
    pol.update(StepStats(k=2, num_decode=2, committed=[3, 1], rows=["a", "b"]))
    pol.choose(BatchView(2, 0, rows=rows))
    pol.update(StepStats(k=2, num_decode=3, committed=[3, 1, 3], rows=["a", "b", "gone"]))  # launched earlier
    pol.choose(BatchView(2, 0, rows=tuple(rows)))  # the same batch
    assert set(pol.row_accept[2]) == {"a", "b"}
    direct = sum(pol.row_accept[2][r] for r in rows)
    assert pol.expected(2, 2, pol._rows) == pytest.approx(direct)
    pol.update(StepStats(k=2, num_decode=2, committed=[1, 1], rows=["a", "b"]))  # no new row: nothing to prune
    assert not pol._unpruned


def test_goodput_retries_back_off_while_speculation_keeps_losing():
    pol = bare([2], margin=0.0, explore_every=2, explore_backoff=2.0, explore_max=8)
    pol.set_table(TABLE)
    run_k(pol, 2, [1] * 64)  # a(2) = 1: k = 0 wins at 64 rows
    seen = [pol.choose(view(64)) for _ in range(24)]
    retries = [i for i, k in enumerate(seen) if k]
    # gaps of 2, then 4, then 8 (the cap), 8, ... k = 0 steps between re-tries
    assert [b - a - 1 for a, b in zip(retries, retries[1:])] == [3, 7, 7][: len(retries) - 1]
    pol.accept[2] = 3.0  # speculation now wins on merit at 8 rows: the gap resets
    assert pol.choose(view(8)) == 2 and pol.explore_gap == 2.0


def test_schedule_pattern_and_window_positions():
    """on steps at k, off steps at 0, repeated over decode steps only; each speculative step's
    committed tokens are kept by its position in the window (0: first after an off period), also
    when update comes one step late (overlapped decoding)."""
    pol = build_policy(OmegaConf.create({"name": "schedule", "k": 3, "on_steps": 2, "off_steps": 3}))
    assert pol.ks == (0, 3)
    ks = []
    for i in range(11):
        if i == 4:
            assert pol.choose(view(0)) == 0  # no decode rows: the schedule does not advance
        ks.append(pol.choose(view(2)))
    assert ks == [3, 3, 0, 0, 0, 3, 3, 0, 0, 0, 3]
    committed = iter([[1, 3], [2, 2], [4, 2], [3, 3], [1, 1]])  # per speculative step, in launch order
    for k in ks:
        pol.update(StepStats(k=k, num_decode=2, committed=next(committed) if k else [1, 1]))
    st = pol.describe()
    # positions 0, 1, 0, 1, 0 -> first-after-off means of [2, 3, 1], others of [2, 3]
    assert st["spec_steps"] == 5 and st["first_after_off_steps"] == 3 and st["other_steps"] == 2
    assert st["first_after_off_tokens_per_step"] == pytest.approx(2.0)
    assert st["other_tokens_per_step"] == pytest.approx(2.5)
    assert st["by_position"] == pytest.approx([2.0, 2.5])
    always = build_policy(OmegaConf.create({"name": "schedule", "k": 3, "on_steps": 4, "off_steps": 0}))
    assert all(always.choose(view(1)) == 3 for _ in range(9))
    assert always.describe()["first_after_off_steps"] == 0 and always.describe()["by_position"] == []
    with pytest.raises(ConfigError, match="on_steps >= 1"):
        build_policy(OmegaConf.create({"name": "schedule", "k": 3, "on_steps": 0, "off_steps": 2}))


@pytest.mark.parametrize("sync", [True, False])
def test_schedule_switching_stays_greedy_identical(tiny, sync):
    """EAGLE-3 trees switched on and off by the schedule, the draft KV kept in sync while off or
    left behind: outputs equal plain greedy either way (verification is exact whatever the drafts),
    and the policy saw every speculative step the engine ran."""
    prompts = repetitive_prompts(3, seed=2)
    want = [reference(tiny, p, 16) for p in prompts]
    drafter = Eagle3Drafter(tiny_head(tiny), tiny, topk=2, steps=2, num_draft_tokens=4, sync_while_off=sync)
    pol = Schedule(4, on_steps=2, off_steps=2)
    got, engine = run_engine(tiny, prompts, 16, drafter=drafter, policy=pol, max_batch=4)
    assert got == want
    st = pol.describe()
    assert st["spec_steps"] == st["first_after_off_steps"] + st["other_steps"] > 0
    assert 1.0 <= st["tokens_per_spec_step"] <= 3.0  # a 2-deep tree commits 1..3 tokens per row
    engine.check()


# H200 (41d1e6b, policy_envelope, n-gram chain 8, HumanEval, always at C = 1): accepted drafts per step
NGRAM_ACCEPTED = {0: 597, 1: 142, 2: 33, 3: 21, 4: 8, 5: 8, 6: 5, 7: 9, 8: 70}
# ... and goodput's start-up table (ms) at batches 1 and 256
NGRAM_TABLE = {0: {1: 0.566, 256: 2.116}, 2: {1: 0.880, 256: 2.650}, 4: {1: 0.883, 256: 2.840},
               8: {1: 0.900, 256: 3.547}}


def test_goodput_shadow_samples_turn_ngram_on_at_low_batch_only():
    """With n-gram's measured acceptance (a heavy tail: two thirds of the steps accept nothing) fed as
    shadow samples, goodput speculates at batch 1 (chain 8 commits 2.1 tokens in 0.9 ms against 1 in
    0.57) and stays off at 256 once the host lookups are priced in (37 us per row served there: 256
    lookups outweigh the verify). Without shadow samples the first try decides: one step that
    accepted nothing kept it off (the H200 run: 98% of C = 1 steps at k = 0)."""
    import random

    rng = random.Random(0)
    steps = [a for a, n in NGRAM_ACCEPTED.items() for _ in range(n)]
    mean = sum(steps) / len(steps) + 1
    pol = bare([2, 4, 8], margin=0.03, explore_every=32, shadow_evals=2)
    pol.set_table(NGRAM_TABLE)
    pol.shadowed_()
    assert pol.choose(view(1)) == 0  # nothing scored yet: off, no forced try
    for i in range(300):  # one row; shadow samples of every k from the same text
        shadow = [(k, "r", min(k, rng.choice(steps)) + 1) for k in (2, 4, 8)]
        pol.update(StepStats(k=0, num_decode=1, committed=[1], rows=["r"], shadow=shadow, shadow_ms=0.037))
    assert pol.accept[8] == pytest.approx(mean, rel=0.2)
    assert pol.choose(BatchView(1, 0, rows=("r",))) == 8
    assert pol.choose(BatchView(1, 0, rows=("s",))) == 8  # a new request: the prior
    assert pol.step_ms(8, 256) == pytest.approx(3.547 + 256 * 0.037)
    assert pol.choose(view(256)) == 0
    # Without the host lookups priced in, 256 rows would speculate (2.1 / 3.5 > 1 / 2.1): the table
    # alone is wrong for a drafter that drafts on the host.
    pol.lookup_ms = None
    pol.shadow_min_rows = 0.0  # (300 scored drafts back a switch at up to 150 rows by default)
    assert pol.choose(view(256)) == 8
    old = bare([2, 4, 8], margin=0.03, explore_every=32)
    old.set_table(NGRAM_TABLE)
    for k in (2, 4, 8):
        run_k(old, k, [1])  # the first try of each accepted nothing
    assert all(old.choose(view(1)) == 0 for _ in range(20))


def test_goodput_shadow_samples_keep_a_longer_memory_per_request():
    """With shadow samples a request's own a(k) moves by shadow_ema per sample, not ema: n-gram's
    acceptance is a heavy tail (most drafts accept nothing, a few all 8), and with ema = 0.1 ten
    misses in a row turn chain 8 off (own a(8) 2.1 -> 1.4, below the table's 1.59 crossover) just
    before the text repeats again; with shadow_ema = 0.03 (the default) it stays on. Without
    shadow samples (served steps) ema still applies."""
    mean = sum(a * n for a, n in NGRAM_ACCEPTED.items()) / sum(NGRAM_ACCEPTED.values()) + 1

    def after_misses(**kw):
        pol = bare([8], margin=0.03, explore_every=32, shadow_evals=2, **kw)
        pol.set_table(NGRAM_TABLE)
        pol.shadowed_()
        pol.update(StepStats(k=0, num_decode=1, committed=[1], rows=["r"], shadow=[(8, "r", mean)] * 2))
        assert pol.choose(BatchView(1, 0, rows=("r",))) == 8
        for _ in range(10):
            pol.update(StepStats(k=0, num_decode=1, committed=[1], rows=["r"], shadow=[(8, "r", 1)]))
        return pol

    short = after_misses(shadow_ema=0.1)  # as ema
    assert short.row_accept[8]["r"] == pytest.approx(1 + (mean - 1) * 0.9 ** 10)
    assert short.choose(BatchView(1, 0, rows=("r",))) == 0
    long = after_misses()
    assert long.shadow_ema == 0.03
    assert long.row_accept[8]["r"] == pytest.approx(1 + (mean - 1) * 0.97 ** 10)
    assert long.choose(BatchView(1, 0, rows=("r",))) == 8
    served = bare([8], margin=0.03, explore_every=32, ema=0.1)
    served.set_table(NGRAM_TABLE)
    run_k(served, 8, [3])
    served.update(StepStats(k=8, num_decode=1, committed=[1], rows=["r"]))
    assert served.row_accept[8]["r"] == pytest.approx(3 * 0.9 + 0.1)
    with pytest.raises(ConfigError, match="shadow_ema"):
        bare([8], shadow_ema=0.0)


def test_goodput_switch_on_from_shadow_samples_waits_for_enough_of_them():
    """A switch on that rests on shadow samples needs shadow_min_rows scored drafts per decode row
    behind a(k): a few lucky drafts (long runs of repeated text) at 128 rows stay off, as many
    drafts of the same acceptance switch on, and at one row a couple of drafts suffice."""
    table = {0: {1: 0.5, 128: 1.0}, 8: {1: 0.6, 128: 1.2}}

    def fed(n, commits, serial=True, cap=16):
        pol = bare([8], margin=0.03, explore_every=32, shadow_evals=2, shadow_rows_cap=cap)
        pol.set_table(table)
        pol.shadowed_()
        pol.serial_drafting = serial  # host lookups before each drafting step
        for i in range(n):
            pol.update(StepStats(k=0, num_decode=1, committed=[1], rows=[f"r{i}"], shadow=[(8, f"r{i}", commits)]))
        return pol

    assert fed(30, 9).choose(view(128)) == 0  # a(8) = 9 from 30 drafts: 30 < 2 x 128
    assert fed(256, 9).choose(view(128)) == 8  # the same a(8) from 256 drafts
    assert fed(2, 9).choose(view(1)) == 8
    loose = fed(30, 9)
    loose.shadow_min_rows = 0.0
    assert loose.choose(view(128)) == 8  # the rule off: the 30 drafts decide
    with pytest.raises(ConfigError, match="shadow_min_rows"):
        bare([8], shadow_min_rows=-1)
    # Drafting without host work (n-gram lookups on the device): the rows counted stop at shadow_rows_cap
    assert fed(30, 9, serial=False).choose(view(128)) == 0  # 30 < 2 x 16
    assert fed(32, 9, serial=False).choose(view(128)) == 8
    assert fed(32, 9, serial=False, cap=0).choose(view(128)) == 0  # no cap: 2 x 128
    assert fed(32, 9, serial=True).choose(view(128)) == 0  # host lookups: every row counts
    with pytest.raises(ConfigError, match="shadow_rows_cap"):
        bare([8], shadow_rows_cap=-1)


def test_goodput_prices_host_bound_iterations():
    """When the host sets the pace (each iteration's host work exceeds the device step), a larger
    tree costs no more wall time per iteration: goodput moves from tree 8 (fastest device step) to
    tree 32 (most tokens per iteration), as the H200 C = 64 run should have (there tree 8's 1.9 ms
    device steps ran in 3.7 ms iterations and always (tree 32) won 1.08x); with a fast host it
    stays at 8, and at k = 0 when the table makes speculation slower."""
    table = {0: {64: 1.15}, 8: {64: 1.66}, 32: {64: 3.14}}
    accept = {8: 2.68, 32: 3.45}

    def fresh():
        pol = bare([8, 32], margin=0.03, explore_every=0)
        pol.set_table(table)
        for k in (8, 32):
            run_k(pol, k, [accept[k]] * 64)
        return pol

    fast = fresh()
    for _ in range(30):
        k = fast.choose(view(64))
        fast.iteration_(k, 64, fast.step_ms(k, 64) + 0.2, 0.5)  # host 0.5 ms: device-bound
    assert fast.choose(view(64)) == 8  # 2.68 / 1.86 > 3.45 / 3.34
    slow = fresh()
    held = []
    for _ in range(30):
        k = slow.choose(view(64))
        held.append(k)
        slow.iteration_(k, 64, max(slow.step_ms(k, 64), 3.7), 3.7)  # host 3.7 ms per iteration
    assert held[-10:] == [32] * 10 and slow.iter_ms(32, 64) == pytest.approx(3.7, rel=0.05)
    assert "served_iter_ms" in slow.describe() and slow.describe()["host_ms_per_iter"][64] == pytest.approx(3.7)
    # Speculation slower than plain decoding at every k (no host limit): k = 0.
    off = bare([8, 32], margin=0.03, explore_every=0)
    off.set_table({0: {64: 1.15}, 8: {64: 3.5}, 32: {64: 4.5}})
    for k in (8, 32):
        run_k(off, k, [accept[k]] * 64)
    for _ in range(5):
        k = off.choose(view(64))
        off.iteration_(k, 64, off.step_ms(k, 64), 0.3)
    assert off.choose(view(64)) == 0


def test_goodput_leaves_out_iterations_that_also_prefilled():
    """Iterations that also ran a prefill (or a switch back on) do not price their k: at the start of
    a run every iteration prefills, and the k tried first would carry the prefills' cost (H200,
    crossover_8b, C = 16: tree16 priced at 37.8 ms per iteration against 10.6 ms steps, goodput at
    0.66x of always tree16)."""
    pol = bare([8, 32], margin=0.03, explore_every=0)
    pol.set_table({0: {64: 1.15}, 8: {64: 1.66}, 32: {64: 3.14}})
    for k, a in ((8, 2.68), (32, 3.45)):
        run_k(pol, k, [a] * 64)
    for _ in range(40):  # tree 8's iterations also prefilled: 30 ms each
        pol.iteration_(8, 64, 30.0, 25.0, mixed=True)
    assert pol.iter_ms(8, 64) == pytest.approx(1.66) and pol.choose(view(64)) == 8
    for _ in range(40):  # the same, unmixed, is what a tree-8 iteration costs
        pol.iteration_(8, 64, 30.0, 25.0)
    assert pol.iter_ms(8, 64) > 20 and pol.choose(view(64)) == 32


def test_engine_reports_prefill_iterations_as_mixed(tiny):
    """The engine tells the policy which iterations also prefilled (and, overlapped, the one after):
    an iteration without prefill or catch-up is reported unmixed."""
    calls = []

    class Spy(Goodput):
        def iteration_(self, k, batch, wall_ms, host_ms, mixed=False):
            calls.append((k, batch, mixed))
            super().iteration_(k, batch, wall_ms, host_ms, mixed=mixed)

    pol = bare([2], cls=Spy, explore_every=4, profile_context=40)
    engine = Engine(tiny, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=1024), drafter=NgramDrafter(),
                    policy=pol, ks=(2,))
    prompts = repetitive_prompts(3, seed=1)
    engine.add_request(prompts[0], 12)
    engine.step()  # prefill + first decode step
    engine.step()  # decode only
    engine.add_request(prompts[1], 12)
    engine.step()  # prefill again
    engine.step()
    engine.step()
    engine.step()
    # reported one iteration late (start to start): the prefill iterations are mixed, plain decoding ones not
    assert [m for _, _, m in calls[:2]] == [True, engine.overlap]
    assert calls[2][2] is True and calls[-1][2] is False
    assert all(b >= 1 for _, b, _ in calls)


def test_overlapped_iterations_are_charged_to_the_step_they_waited_for(tiny):
    """Overlapped, an iteration queues its step and waits for the one before: its wall time is that
    step's. An iteration whose step differs in k from the step before is reported mixed, so a re-try
    at k > 0 is not charged the k = 0 step it waited for (nor the k = 0 step after it the tree)."""
    class Alternate(Policy):
        name = "alternate"
        ks = (0, 3)

        def __init__(self):
            self.launched, self.reports, self.i = [], [], 0

        def choose(self, view):
            if view.num_decode == 0:
                return 0
            k = (0, 0, 0, 3, 3, 3)[self.i % 6]
            self.i += 1
            self.launched.append(k)
            return k

        def update(self, stats):
            pass

        def iteration_(self, k, batch, wall_ms, host_ms, mixed=False):
            self.reports.append((k, mixed))

    for overlap in (True, False):
        pol = Alternate()
        drafter = Eagle3Drafter(tiny_head(tiny), tiny, topk=1, steps=3, num_draft_tokens=3)
        engine = Engine(tiny, EngineConfig(max_batch_size=2, page_size=4, kv_cache_tokens=1024, overlap=overlap),
                        drafter=drafter, policy=pol, ks=(3,))
        engine.add_request(rand_prompts([7], seed=2)[0], 40)
        engine.step()  # prefill: mixed either way
        for _ in range(24):
            engine.step()
        assert [k for k, _ in pol.reports] == pol.launched[:len(pol.reports)]
        reports = list(enumerate(pol.reports))[2:]
        # A switch back on catches the draft up (mixed anyway); a switch off (k = 3 -> 0) runs no extra work,
        # so only the step it waited for makes it mixed.
        off = [mixed for i, (k, mixed) in reports if k == 0 and pol.launched[i - 1] == 3]
        assert off and (all(off) if overlap else not any(off))
        on = [mixed for i, (k, mixed) in reports if k == 3 and pol.launched[i - 1] == 3]
        steady_off = [mixed for i, (k, mixed) in reports if k == 0 and pol.launched[i - 1] == 0]
        assert False in on and False in steady_off  # steady iterations still count


def test_goodput_probes_each_k_over_probe_rows_rows():
    """At batch 1 each k is tried for probe_rows steps before its a(k) decides: a first step that
    accepted little does not rule out the best k (the envelope at C = 2 lost 5% that way)."""
    pol = bare([2, 4], margin=0.0, explore_every=0, probe_rows=3)
    pol.set_table(TABLE)
    run_k(pol, 2, [2])
    run_k(pol, 2, [2])
    run_k(pol, 2, [2])
    run_k(pol, 4, [1])  # an unlucky first step at k = 4 ...
    run_k(pol, 4, [5])
    run_k(pol, 4, [5])  # ... then its real acceptance: a(4) = 11 / 3 over 3 rows
    assert pol.rows_seen == {2: 3, 4: 3} and pol.choose(view(1)) == 4  # 3.67 / 1.4 > 2 / 1.2
    once = bare([2, 4], margin=0.0, explore_every=0)  # probe_rows = 1: the first step decides
    once.set_table(TABLE)
    run_k(once, 2, [2])
    run_k(once, 4, [1])
    assert once.choose(view(1)) == 2
    with pytest.raises(ConfigError, match="probe_rows"):
        bare([2], probe_rows=0)


def test_goodput_learns_an_iteration_cost_from_its_first_samples():
    """A k whose iterations cost far more than its estimate (a step that cannot overlap the host)
    is priced from its first served iteration (up to 4x the estimate), then by the running mean;
    later a single stalled iteration moves the average by at most one clamped EMA step."""
    pol = bare([8], margin=0.0, explore_every=0)
    pol.set_table({0: {64: 1.2}, 8: {64: 1.9}})
    run_k(pol, 8, [2.6] * 64)
    assert pol.choose(view(64)) == 8  # estimated: 2.6 / 1.9 > 1 / 1.2
    pol.iteration_(8, 64, 9.0, 1.0)  # host 1 ms: the estimate stays max(1.9, 1.0)
    assert pol.iter_ms(8, 64) == pytest.approx(7.6)  # clamped at 4 x 1.9
    assert pol.choose(view(64)) == 0
    pol.iteration_(8, 64, 7.8, 1.0)
    assert pol.iter_ms(8, 64) == pytest.approx(7.7)  # the mean of the two
    for _ in range(20):
        pol.iteration_(8, 64, 7.7, 7.0)
    pol.iteration_(8, 64, 100.0, 7.0)  # a stall: at most 2x the average, weight time_ema
    assert pol.iter_ms(8, 64) < 7.7 * 1.11


def test_goodput_prices_the_catch_up_of_a_switch_on():
    """With a drafter that catches up, switching on first runs the rows' backlog through the
    target: goodput switches on only when switch_horizon steps save more than that, and re-tries
    only when the catch-up costs at most explore_budget of the time spent off."""
    table = {0: {64: 2.0}, 8: {64: 2.5}}  # 2.0 / 64 = 0.031 ms per caught-up token
    backlog = {"n": 0}

    def bview():
        return BatchView(num_decode=64, num_waiting=0, backlog=lambda: backlog["n"])

    def fresh():
        pol = bare([8], margin=0.0, explore_every=4, explore_backoff=2.0, switch_horizon=32, explore_budget=0.05)
        pol.set_table(table)
        assert pol.choose(bview()) == 8
        pol.update(StepStats(k=8, num_decode=64, committed=[1] * 64))  # a(8) = 1: k = 0 wins
        assert pol.choose(bview()) == 0
        return pol

    pol = fresh()
    pol.accept[8] = 2.0  # now k = 8 saves 2.0 * 2.5 / 1.25 ... : 2 tokens in 2.5 ms vs 4 ms at k = 0
    backlog["n"] = 64 * 10  # 640 tokens: 20 ms of catch-up < 32 x 1.5 ms saved
    assert pol.choose(bview()) == 8
    pol = fresh()
    pol.accept[8] = 2.0
    backlog["n"] = 64 * 100  # 200 ms > 48 ms saved: stay off
    assert pol.choose(bview()) == 0
    # re-tries (k = 0 still wins): 4 off steps x 2.0 ms x 0.05 = 0.4 ms allows no catch-up at all ...
    pol = fresh()
    backlog["n"] = 64
    assert [pol.choose(bview()) for _ in range(12)] == [0] * 12
    assert pol.explore_gap > 4  # postponed, with back-off
    # ... and without a backlog (no catch-up) the re-try runs on schedule
    pol = fresh()
    backlog["n"] = 0
    assert 8 in [pol.choose(bview()) for _ in range(5)]
    with pytest.raises(ConfigError, match="switch_horizon"):
        bare([8], switch_horizon=0)


def test_goodput_prices_the_catch_up_by_its_timed_forwards():
    """With the catch-up forwards timed (catch_up_table_), a backlog costs full forwards of the
    largest bucket plus one over the rest, not the decode table's ms per row: at batch 1 (the H200
    envelope at C = 1) a 200-token prompt prefilled while off is one ~1 ms forward, and the switch
    back on pays; priced at the batch-1 step's 0.57 ms a token (114 ms) it never did."""
    backlog = {"n": 200}
    bview = BatchView(num_decode=1, num_waiting=0, backlog=lambda: backlog["n"])

    def off_then_better(timed):
        pol = bare([16], margin=0.0, explore_every=0, switch_horizon=32)
        pol.set_table({0: {1: 0.57}, 16: {1: 1.05}})
        if timed:
            pol.catch_up_table_({128: 0.6, 256: 0.8, 512: 1.0})
        pol.accept[16], pol.rows_seen[16] = 1.2, 8  # the last request: 1.2 tokens a step, k = 0 wins
        assert pol.choose(bview) == 0
        pol.accept[16] = 2.8  # the next request's prior: 2.8 tokens in 1.05 ms against 1 in 0.57
        return pol

    assert off_then_better(timed=False).choose(bview) == 0  # 200 x 0.57 = 114 ms > 32 x 0.49 ms saved
    pol = off_then_better(timed=True)
    assert pol._catch_up_ms(bview) == pytest.approx(0.8)  # one 256-token forward
    assert pol.choose(bview) == 16
    backlog["n"] = 1100  # two full 512-token forwards + one 128-token forward over the 76 left
    assert pol._catch_up_ms(bview) == pytest.approx(2 * 1.0 + 0.6)
    backlog["n"] = 1024
    assert pol._catch_up_ms(bview) == pytest.approx(2.0)
    assert pol.describe()["catch_up_forward_ms"] == {128: 0.6, 256: 0.8, 512: 1.0}


def test_goodput_first_tries_wait_for_a_batch_where_they_are_cheap():
    """A k's first try waits while its step costs more than probe_cost plain steps at this batch
    (tree steps at 128+ rows of an 8B target cost 10-25 plain steps): k = 0 meanwhile, the try at a
    small batch."""
    pol = bare([4], margin=0.0, explore_every=0, probe_cost=3.0)
    pol.set_table({0: {1: 1.0, 64: 2.0}, 4: {1: 1.4, 64: 9.0}})
    assert pol.choose(view(64)) == 0  # 9.0 > 3 x 2.0: no try at 64 rows
    assert pol.accept[4] is None
    run_k(pol, 4, [3])  # at one row: 1.4 <= 3 x 1.0
    with pytest.raises(ConfigError, match="probe_cost"):
        bare([4], probe_cost=0.5)


def test_goodput_profile_context_auto_is_the_workloads_mean_decode_context():
    """profile_context: auto profiles the start-up table at the served workload's mean context (prompt
    length + half the new tokens), resolved by specdec.run before the policy is built (the run below
    checks it reaches the policy); a number stays a number, and an unresolved auto is an error."""
    from specdec.bench.workloads import Prompt
    from specdec.run import workload_context

    prompts = [Prompt(id="a", text="", messages=None, prompt_ids=[1] * 100),
               Prompt(id="b", text="", messages=None, prompt_ids=[1] * 200, max_new_tokens=64)]
    assert workload_context(prompts, 128) == round((100 + 64 + 200 + 32) / 2)
    assert workload_context([], 128) is None
    assert build_policy(OmegaConf.create({"name": "goodput", "profile_context": 300}), sizes=(2,)).profile_context == 300
    with pytest.raises(ConfigError, match="profile_context=auto needs"):
        build_policy(OmegaConf.create({"name": "goodput", "profile_context": "auto"}), sizes=(2,))
    with pytest.raises(ConfigError, match="profile_context='long'"):
        build_policy(OmegaConf.create({"name": "goodput", "profile_context": "long"}), sizes=(2,))


def test_profile_context_auto_reaches_a_served_goodput(tmp_path):
    """Through specdec.run: the run's goodput profiled its table at the synthetic workload's mean
    decode context (20-token prompts, 8 new tokens: 24), recorded in metrics.json."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from test_experiments import TINY_SHAPES

    cmd = [sys.executable, "-m", "specdec.run", "target=llama31_8b_random", "draft=eagle3_random", "acceptance=replay",
           "acceptance.parametric.mean=3", "policy=goodput", "policy.profile_context=auto", "workload=synthetic",
           "workload.concurrency=2", "workload.sources.0.num_prompts=3", "workload.sources.0.prompt_len=20",
           "workload.sources.0.output_len=8", "engine.max_new_tokens=8", "engine.dtype=float32",
           "engine.kv_cache_tokens=2048", "engine.profile_iters=1", "device=cpu", "logger=none",
           f"hydra.run.dir={tmp_path}", *(f"target.config.{k}={v}" for k, v in TINY_SHAPES.items())]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "metrics.json").read_text())["policy_state"]["profile_context"] == 24


class _SeesPrefilling(Policy):
    """A k = 0 policy that records what each BatchView says, beside the engine's own counts."""

    name = "sees_prefilling"
    ks = (0,)

    def __init__(self):
        self.engine, self.seen = None, []

    def choose(self, view):
        sched = self.engine.scheduler
        self.seen.append((view.num_prefilling, view.num_decode, len(sched.admitted)))
        return 0

    def update(self, stats):
        pass


def test_engine_tells_the_policy_how_many_requests_are_prefilling(tiny):
    """BatchView.num_prefilling is the admitted requests not yet decoding: with a 16-token prefill
    budget, prompts of 40 tokens take three iterations each, so some steps see requests mid-prefill."""
    pol = _SeesPrefilling()
    engine = Engine(tiny, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=1024, prefill_chunk=16),
                    policy=pol)
    pol.engine = engine
    for p in rand_prompts([40, 40, 40, 5], seed=3):
        engine.add_request(p, 6)
    engine.run_until_done()
    assert all(pre == adm - dec >= 0 for pre, dec, adm in pol.seen)
    assert max(pre for pre, _, _ in pol.seen) >= 2 and pol.seen[-1][0] == 0


def test_goodput_prices_serial_drafting_as_host_plus_device():
    """With serial_drafting (the engine's drafter drafts from the host's tokens, so its speculative
    steps wait for the step in flight and the host's work), a k > 0 iteration without served
    iteration times costs its step plus the host ms, not the larger of the two; k = 0 overlaps."""
    pol = bare([8], margin=0.0, explore_every=0)
    pol.set_table({0: {128: 1.0}, 8: {128: 1.5}})
    pol.iteration_(0, 128, wall_ms=1.6, host_ms=1.2)  # one unmixed k = 0 iteration: host 1.2 ms
    assert pol.iter_ms(8, 128) == pytest.approx(1.5) and pol.iter_ms(0, 128) == pytest.approx(1.6)
    run_k(pol, 8, [1.6] * 128)  # a(8) = 1.6 tokens a row
    pol.iteration_(0, 128, wall_ms=1.6, host_ms=1.2)
    assert pol.choose(view(128)) == 8  # 1.6 / 1.5 > 1 / 1.6: overlapped, chain 8 pays
    pol.serial_drafting = True
    assert pol.iter_ms(8, 128) == pytest.approx(1.5 + pol.host_ms[128])
    assert pol.choose(view(128)) == 0  # 1.6 / 2.7 < 1 / 1.6


def test_engine_tells_goodput_when_drafting_is_serial(tiny):
    """The engine sets serial_drafting for a host-context drafter (n-gram) under overlapped decoding only."""
    for drafter, overlap, want in ((NgramDrafter(chains=[2]), True, True), (NgramDrafter(chains=[2]), False, False),
                                   (Eagle3Drafter(tiny_head(tiny), tiny, trees=[(1, 2, 2)]), True, False)):
        pol = bare([2], shadow_evals=0)
        Engine(tiny, EngineConfig(max_batch_size=2, page_size=4, kv_cache_tokens=256, overlap=overlap),
               drafter=drafter, policy=pol)
        assert pol.serial_drafting is want


def test_goodput_probe_requests_spreads_the_largest_ks_prior_over_requests():
    """At C = 1 a k's first tries are one request's rows. When they come out low, a k that is then never
    chosen keeps that prior for the rest of the run (its estimate moves only when it runs); with
    probe_requests each later request gets one step at the largest k once it has run PROBE_AGE steps,
    until the prior rests on that many requests, so the prior follows the workload and the k is chosen
    on its merits. Probes wait for a batch where the largest k costs at most probe_cost plain steps."""
    from specdec.policy.goodput import PROBE_AGE

    def serve(probe_requests, requests=40, steps=30):
        pol = bare([32], margin=0.0, explore_every=0, probe_rows=4, probe_requests=probe_requests)
        pol.set_table({0: {1: 0.6}, 32: {1: 1.3}})
        chosen = []
        for i in range(requests):
            rid = f"r{i}"
            for _ in range(steps):
                k = pol.choose(BatchView(num_decode=1, num_waiting=0, rows=(rid,)))
                chosen.append(k)
                # the first request accepts nothing at tree 32, every later one 3 tokens a step
                got = (1 if i == 0 else 4) if k == 32 else 1
                pol.update(StepStats(k=k, num_decode=1, committed=[got], rows=[rid]))
        return pol, chosen

    pol, chosen = serve(0)
    assert chosen[:4] == [32] * 4 and 32 not in chosen[4:]  # a(32) = 1.0 from request r0: never again
    pol, chosen = serve(16)
    assert chosen[30 + PROBE_AGE - 1] == 32 and chosen[30 + PROBE_AGE - 2] == 0  # r1's 8th step probes
    # three probes (r1 .. r3) move the prior to (4 * 1 + 3 * 4) / 7 = 2.3 tokens a step, where tree 32
    # (1.3 ms) beats k = 0 (0.6 ms a token) and runs on its merits; those requests count too
    assert pol.request_probes == 3 and len(pol.top_requests) == 16
    assert pol.accept[32] > 3.0 and chosen[-30:] == [32] * 30  # the prior moved: tree 32 on its merits
    assert pol._row_age == {}  # done probing: no bookkeeping left
    # too dear at this batch (tree 32 at 5 plain steps > probe_cost 4): no probes
    dear = bare([32], margin=0.0, explore_every=0, probe_rows=4, probe_requests=16, probe_cost=4)
    dear.set_table({0: {1: 0.6}, 32: {1: 3.0}})
    for i in range(20):
        for _ in range(12):
            k = dear.choose(BatchView(num_decode=1, num_waiting=0, rows=(f"q{i}",)))
            dear.update(StepStats(k=k, num_decode=1, committed=[1], rows=[f"q{i}"]))
    assert dear.request_probes == 0
    with pytest.raises(ConfigError):
        bare([32], probe_requests=-1)
    assert build_policy(OmegaConf.create({"name": "goodput", "probe_requests": 8}), [32]).probe_requests == 8


def test_engine_reports_resume_iterations_as_mixed(tiny):
    """A resume after k = 0 steps catches the draft up before its step: the engine reports that iteration
    mixed (its wall time is not a steady step's), steady speculative iterations unmixed."""
    calls = []

    class Script(Goodput):
        def choose(self, view):
            return (0, 0, 0, 3, 3, 3)[len(calls) % 6] if view.num_decode else 0

        def iteration_(self, k, batch, wall_ms, host_ms, mixed=False):
            calls.append((k, mixed))

    for overlap in (True, False):
        calls.clear()
        pol = bare([3], cls=Script, explore_every=0, profile_context=40)
        drafter = Eagle3Drafter(tiny_head(tiny), tiny, topk=1, steps=3, num_draft_tokens=3)
        engine = Engine(tiny, EngineConfig(max_batch_size=2, page_size=4, kv_cache_tokens=1024, overlap=overlap),
                        drafter=drafter, policy=pol, ks=(3,))
        engine.add_request(rand_prompts([7], seed=2)[0], 60)
        for _ in range(30):
            engine.step()
        assert calls[0][1]  # the prefill iteration
        resumes = [i for i in range(1, len(calls)) if calls[i][0] == 3 and calls[i - 1][0] == 0]
        assert resumes and all(calls[i][1] for i in resumes)
        steady = [c for i, c in enumerate(calls[1:], 1) if c[0] == calls[i - 1][0] == 3 and i - 1 not in resumes]
        assert steady and any(not m for _, m in steady)


@pytest.mark.parametrize("name", sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "conf/policy").glob("*.yaml")))
def test_every_policy_config_composes_and_builds(name):
    """Each conf/policy option composes through Hydra and builds a policy over a drafter's sizes (an option file that
    sets a key the builder does not read, or a value it rejects, fails here before a sweep on a GPU does)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"policy={name}"])
    if "profile_context" in cfg.policy:  # auto: the workload's prompts, which specdec.run resolves
        cfg.policy.profile_context = 512
    pol = build_policy(cfg.policy, sizes=(3, 16, 48))
    assert pol.name == cfg.policy.get("name", "never")
    if pol.name == "goodput":  # a null in the file takes the one default, GoodputConfig's
        assert pol.config == GoodputConfig(profile_context=512)
        assert pol.config == bare([3], **{k: getattr(GoodputConfig(), k) for k in BARE}, profile_context=512).config


def test_policy_options_have_one_default_and_unknown_keys_are_named():
    """build_policy: a null takes the policy's own default, a value its type (the strings a command line gives
    included), a key no policy has is an error naming it and the policy's valid keys; a key of another policy is
    ignored (an experiment may set goodput's profile_context whatever the policy)."""
    from specdec.policy import BatchThreshold, Bandit

    pol = build_policy(OmegaConf.create({"name": "batch_threshold", "k": None, "off_above": None, "on_at_or_below": 2}),
                       sizes=(3, 5))
    assert isinstance(pol, BatchThreshold) and (pol.k, pol.off_above, pol.on_at_or_below) == (5, 16, 2)
    pol = build_policy(OmegaConf.create({"name": "goodput", "ks": [3], "margin": "0.25", "counterfactual": "false",
                                         "probe_cost": "inf"}))
    assert pol.margin == 0.25 and pol.wants_counterfactual is False and pol.probe_cost == float("inf")
    assert pol.ema == GoodputConfig.ema and Goodput([3]).config == GoodputConfig()
    assert build_policy(OmegaConf.create({"name": "never", "profile_context": 64})).ks == (0,)
    with pytest.raises(ConfigError, match=r"unknown option\(s\) marg; valid: .*margin"):
        build_policy(OmegaConf.create({"name": "goodput", "marg": 0.1}), sizes=(3,))
    with pytest.raises(ConfigError, match=r"policy always: unknown option\(s\) bogus; valid: k"):
        build_policy(OmegaConf.create({"name": "always", "bogus": 1}), sizes=(3,))
    with pytest.raises(ConfigError, match="unknown option"):
        Goodput([3], time_every=8)  # an option that no longer exists
    with pytest.raises(ConfigError, match="policy.probe_rows='many': must be an integer"):
        Goodput([3], probe_rows="many")
    with pytest.raises(ConfigError, match="unknown option"):
        Bandit(Goodput([3]), block_size=4)
