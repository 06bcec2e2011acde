"""One bad request never stops or corrupts the others.

Bad prompts are refused at admission by name and never reach a forward; a step that raises commits
for every row or for none (the engine stays consistent and the same step commits on the next call);
a fault attributable to one request fails that request alone. Survivors are checked against the
single-request reference (greedy, fp32, torch references on the CPU: exact).
"""

import numpy as np
import pytest
import torch
from test_engine import VOCAB, drive, rand_prompts, reference, tiny_model
from test_spec import repetitive_prompts, tiny_head

from specdec.engine.engine import Engine, EngineConfig
from specdec.errors import ConfigError
from specdec.engine import step_ops as ops
from specdec.policy import Policy, StepStats
from specdec.spec import Eagle3Drafter, NgramDrafter


class Injected(RuntimeError):
    """The fault the tests inject."""


def fail_once(fn, on_call: int, fired: list):
    """``fn`` that raises Injected on its ``on_call``-th call (1-based), once."""
    calls = [0]

    def wrapped(*a, **kw):
        calls[0] += 1
        if calls[0] == on_call:
            fired.append(calls[0])
            raise Injected(f"injected fault on call {on_call}")
        return fn(*a, **kw)

    return wrapped


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(layers=2)


# -- admission ------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad,needle,overlap", [
    ([5, VOCAB, 7], f"token id {VOCAB} at position 1", False),
    ([5, VOCAB, 7], f"token id {VOCAB} at position 1", True),
    ([5, 6, -1], "token id -1 at position 2", False),
    ([5, 6.0, 7], "position 1 is 6.0 (float)", True),
    ([5, 6, 7.9], "position 2 is 7.9 (float)", False),
    ([True, 6], "position 0 is True (bool)", False),
    ([5, "7"], "position 1 is '7' (str)", False),
])
def test_bad_token_ids_rejected_at_admission_by_name(tiny, bad, needle, overlap, monkeypatch):
    """An id outside the vocabulary (or not an integer) is refused when the request arrives, with
    the id and its position named, and never reaches a forward; the others match the reference."""
    prompts = rand_prompts([7, 12], seed=21)
    engine = Engine(tiny, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=256, overlap=overlap))
    seen = []  # every token id any forward is given
    real = tiny.forward

    def spy(ids, *a, **kw):
        seen.extend(ids.tolist())
        return real(ids, *a, **kw)

    monkeypatch.setattr(tiny, "forward", spy)
    good = [engine.add_request(p, 6) for p in prompts[:1]]
    rejected = engine.add_request(bad, 6)
    good.append(engine.add_request(prompts[1], 6))
    assert rejected.finished and rejected.finish_reason == "error"
    assert needle in rejected.error and ("vocabulary" in rejected.error or "integers" in rejected.error)
    if "vocabulary" in rejected.error:
        assert f"0 .. {VOCAB - 1}" in rejected.error
    finished = engine.run_until_done()
    engine.check()
    assert rejected in finished
    assert all(0 <= t < VOCAB for t in seen)
    monkeypatch.undo()
    for p, r in zip(prompts, good):
        assert r.output_ids == reference(tiny, p, 6)


def test_numpy_and_torch_integer_ids_accepted(tiny):
    p = rand_prompts([6], seed=2)[0]
    engine = Engine(tiny, EngineConfig(kv_cache_tokens=256))
    a = engine.add_request(np.array(p, dtype=np.int64), 4)
    b = engine.add_request(torch.tensor(p), 4, request_id="t")
    c = engine.add_request(p, 4.0)  # max_new_tokens must be an integer too
    engine.run_until_done()
    assert a.error is None and b.error is None and a.output_ids == b.output_ids == reference(tiny, p, 4)
    assert "max_new_tokens=4.0" in c.error


def test_draft_head_vocabulary_bounds_admission(tiny):
    """A draft head that embeds fewer ids than the target (its t2d table) bounds the valid ids."""
    head = tiny_head(tiny)
    head.config.vocab_size = VOCAB - 8  # as if the head had been built for a smaller vocabulary
    drafter = Eagle3Drafter(head, tiny, topk=2, steps=2, num_draft_tokens=4)
    engine = Engine(tiny, EngineConfig(kv_cache_tokens=256), drafter=drafter, ks=(4,))
    r = engine.add_request([1, VOCAB - 3], 4)
    assert r.finish_reason == "error" and f"token id {VOCAB - 3} at position 1" in r.error
    assert "draft head" in r.error and f"0 .. {VOCAB - 9}" in r.error


def test_duplicate_request_id_refused_by_name(tiny):
    p = rand_prompts([5], seed=3)[0]
    engine = Engine(tiny, EngineConfig(kv_cache_tokens=256))
    a = engine.add_request(p, 4, request_id="q1")
    dup = engine.add_request(p, 4, request_id="q1")
    assert dup.finish_reason == "error" and "duplicate request id 'q1'" in dup.error
    engine.run_until_done()
    assert a.output_ids == reference(tiny, p, 4)
    again = engine.add_request(p, 4, request_id="q1")  # finished ids may be reused
    engine.run_until_done()
    assert again.error is None and again.output_ids == a.output_ids


@pytest.mark.parametrize("field,value", [("page_size", 0), ("prefill_chunk", 0), ("max_batch_size", 0),
                                         ("kv_cache_tokens", 0), ("page_size", 2.5)])
def test_engine_config_out_of_range_named(tiny, field, value):
    with pytest.raises(ConfigError, match=f"engine.{field}={value}: must be an integer >= 1"):
        Engine(tiny, EngineConfig(**{field: value}))


# -- faults inside a step -------------------------------------------------------------------------

PROMPT_LENS = [3, 14, 7, 22, 9, 5]
MAX_NEW = [10, 7, 12, 9, 6, 11]


def run_with_fault(model, inject, *, overlap, drafter=None, ks=(0,), k=0, policy=None, detok=None,
                   stop_for=None, prompts=None):
    """Serve the prompts (arriving over a few steps) with the fault ``inject(engine)`` installs;
    every time a step raises Injected, check the engine's invariants and step again. Returns
    (requests, number of raising steps)."""
    prompts = prompts or rand_prompts(PROMPT_LENS, seed=13)
    engine = Engine(model, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=160, prefill_chunk=16,
                                        overlap=overlap), drafter=drafter, ks=ks, policy=policy,
                    detokenize=detok)
    inject(engine)
    reqs, raised, step = [None] * len(prompts), 0, 0
    while step < 500:
        for i, p in enumerate(prompts):
            if i // 2 == step:
                stop = ["zz"] if stop_for == i else ()
                reqs[i] = engine.add_request(p, MAX_NEW[i], stop=stop)
        if not engine.has_work() and step > len(prompts):
            break
        try:
            engine.step(None if policy is not None else k)
        except Injected:
            raised += 1
        engine.check()
        step += 1
    engine.check()
    assert engine.kv.num_free == engine.kv.num_pages and engine._inflight is None
    return prompts, reqs, raised


def assert_all_match_reference(model, prompts, reqs, skip=()):
    for i, (p, r) in enumerate(zip(prompts, reqs)):
        if i in skip:
            continue
        assert r.finish_reason == "length", (i, r.finish_reason, r.error)
        assert r.output_ids == reference(model, p, MAX_NEW[i]), i


def _patch_runner(engine, on_call, fired):
    runner = engine.stepper.runner
    runner.run_ = fail_once(runner.run_, on_call, fired)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("point", ["launch", "verify", "commit", "host_commit", "policy"])
def test_unattributable_fault_commits_no_row_and_the_step_retries(tiny, point, overlap, monkeypatch):
    """A step that raises (the launch, verify, the device commit's entry, the host commit halfway
    through the rows, the policy's update) leaves the engine consistent, the step in flight kept:
    stepping on gives every request its reference output."""
    fired = []
    policy = None
    refs = None
    if point in ("verify", "commit"):
        refs = [reference(tiny, p, n) for p, n in zip(rand_prompts(PROMPT_LENS, seed=13), MAX_NEW)]
    if point == "policy":
        class Flaky(Policy):
            name, ks = "flaky", (0,)

            def choose(self, view):
                return 0

            def update(self, stats: StepStats):
                pass

        policy = Flaky()
        policy.update = fail_once(policy.update, 6, fired)

    def inject(engine):
        if point == "launch":
            _patch_runner(engine, 6, fired)
        elif point == "verify":
            monkeypatch.setattr(ops, "verify_accept", fail_once(ops.verify_accept, 6, fired))
        elif point == "commit":
            monkeypatch.setattr(ops, "kv_sync_", fail_once(ops.kv_sync_, 6, fired))
        elif point == "host_commit":
            sched = engine.scheduler
            sched._outcome = fail_once(sched._outcome, 9, fired)  # a row in the middle of a step

    prompts, reqs, raised = run_with_fault(tiny, inject, overlap=overlap, policy=policy)
    monkeypatch.undo()
    assert fired and raised == 1
    if refs is not None:
        for i, (r, ref) in enumerate(zip(reqs, refs)):
            assert r.output_ids == ref, i
    else:
        assert_all_match_reference(tiny, prompts, reqs)


def _letters(ids):
    return "".join("abcdefghijklmnopqrstuvwxy"[i % 25] for i in ids)  # never "z": no stop fires


@pytest.mark.parametrize("overlap", [False, True])
def test_stop_check_that_raises_fails_that_request_alone(tiny, overlap):
    calls = [0]

    def detok(ids):
        calls[0] += 1
        if calls[0] == 4:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return _letters(ids)

    prompts, reqs, raised = run_with_fault(tiny, lambda e: None, overlap=overlap, detok=detok, stop_for=2)
    assert raised == 0  # attributable: the step itself succeeds
    bad = reqs[2]
    assert bad.finish_reason == "error" and "stop-string check failed" in bad.error
    assert "UnicodeDecodeError" in bad.error
    assert bad.output_ids == reference(tiny, prompts[2], MAX_NEW[2])[: len(bad.output_ids)]
    assert_all_match_reference(tiny, prompts, reqs, skip=(2,))


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("kind", ["ngram", "eagle3"])
def test_drafter_fault_commits_no_row_and_the_step_retries(tiny, kind, overlap):
    fired = []
    prompts = repetitive_prompts(6, seed=5)
    if kind == "ngram":
        drafter = NgramDrafter()
        drafter.prepare_ = fail_once(drafter.prepare_, 3, fired)
    else:
        drafter = Eagle3Drafter(tiny_head(tiny), tiny, topk=2, steps=2, num_draft_tokens=4)
        drafter.propose = fail_once(drafter.propose, 3, fired)
    _, reqs, raised = run_with_fault(tiny, lambda e: None, overlap=overlap, drafter=drafter, ks=(4,), k=4,
                                     prompts=prompts)
    assert fired and raised == 1
    assert_all_match_reference(tiny, prompts, reqs)


def test_launch_fault_keeps_the_step_in_flight(tiny):
    """Overlapped decoding: when the next launch raises, the step in flight is still queued and its
    tokens are committed by the next call (none skipped)."""
    p = rand_prompts([9], seed=4)[0]
    engine = Engine(tiny, EngineConfig(kv_cache_tokens=256, overlap=True))
    r = engine.add_request(p, 6)
    engine.step()
    inflight = engine._inflight
    fired = []
    _patch_runner(engine, 1, fired)
    with pytest.raises(Injected):
        engine.step()
    assert engine._inflight is inflight and r.output_ids == []
    engine.run_until_done()
    assert r.output_ids == reference(tiny, p, 6)
