"""Soak: many requests with random lengths, aborts, preemption (a small KV pool) and bad requests
mixed in, overlap on and off, plain decoding and both drafters (n-gram, EAGLE-3 with a tiny random
head, k switching between 0 and 4). Afterwards: 0 leaked pages, every good output equal to its
single-request reference (an aborted one: a prefix of it), every bad request rejected by name.

Slow (outside CI's default selection): ``python -m pytest -q -s -m slow tests/test_soak.py``.
SOAK_REQUESTS is the total over the six configurations.
"""

import random
import time

import pytest
import torch
from test_engine import VOCAB, tiny_model
from test_spec import tiny_head

from specdec.engine.engine import Engine, EngineConfig
from specdec.engine.reference import generate_reference
from specdec.spec import Eagle3Drafter, NgramDrafter

SOAK_REQUESTS = 10_000
MAX_POS = 128
MAX_NEW = 16
POOL = 160  # distinct prompts (references are computed once each, at MAX_NEW tokens)

# (kind of bad request, what its error must name)
BAD = [
    ("out_of_vocab", f"token id {VOCAB + 3} at position"),
    ("negative", "token id -2 at position"),
    ("float", "(float): token ids must be integers"),
    ("empty", "empty prompt"),
    ("too_long", f"exceeds the maximum sequence length of {MAX_POS} positions"),
    ("duplicate", "duplicate request id"),
]


def soak_prompts(seed=0):
    """Random lengths 1..40; half of them repeat a motif (the n-gram drafter finds drafts)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(POOL):
        n = int(torch.randint(1, 41, (1,), generator=gen))
        if i % 2:
            motif = torch.randint(0, VOCAB, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen).tolist()
            out.append((motif * 20)[:n])
        else:
            out.append(torch.randint(0, VOCAB, (n,), generator=gen).tolist())
    return out


def bad_request(kind, rng, prompts):
    p = list(prompts[rng.randrange(POOL)])
    if kind == "out_of_vocab":
        p[rng.randrange(len(p))] = VOCAB + 3
    elif kind == "negative":
        p[rng.randrange(len(p))] = -2
    elif kind == "float":
        p[rng.randrange(len(p))] = 1.5
    elif kind == "empty":
        p = []
    elif kind == "too_long":
        return p, MAX_POS  # prompt + max_new > MAX_POS positions
    return p, 4


def soak(model, refs, prompts, n_requests, *, drafter, overlap, seed):
    """Drive one engine through n_requests arrivals; returns its figures."""
    rng = random.Random(seed)
    ks = (4,) if drafter is not None else (0,)
    engine = Engine(model, EngineConfig(max_batch_size=8, page_size=4, kv_cache_tokens=160, prefill_chunk=24,
                                        overlap=overlap), drafter=drafter, ks=ks)
    good, bad, live = [], [], []  # good: (request, prompt index, max_new)
    aborts, sent, step = {}, 0, 0
    while sent < n_requests or engine.has_work():
        while sent < n_requests and engine.num_waiting < 6 and rng.random() < 0.7:
            sent += 1
            if rng.random() < 0.05:
                kind, needle = BAD[rng.randrange(len(BAD))]
                if kind == "duplicate" and not live:
                    kind, needle = BAD[0]
                if kind == "duplicate":
                    r = engine.add_request(prompts[0], 4, request_id=rng.choice(live).id)
                else:
                    r = engine.add_request(*bad_request(kind, rng, prompts), request_id=f"bad{sent}")
                bad.append((r, needle))
                continue
            i, n = rng.randrange(POOL), rng.randint(1, MAX_NEW)
            r = engine.add_request(prompts[i], n, request_id=f"r{sent}")
            good.append((r, i, n))
            live.append(r)
            if rng.random() < 0.08:
                aborts.setdefault(step + rng.randint(0, 8), r)
        r = aborts.pop(step, None)
        if r is not None:
            engine.abort(r.id)
        engine.step(rng.choice(ks + (0,)) if drafter is not None else 0)
        engine.check()
        live = [r for r in live if not r.finished]
        step += 1
    engine.check()
    assert engine.kv.num_free == engine.kv.num_pages, "pages leaked"
    assert engine._inflight is None and engine.state.num_rows == 0
    n_aborted = 0
    for r, i, n in good:
        assert r.finished and r.error is None, (r.id, r.error)
        want = refs[i][:n]
        if r.finish_reason == "abort":
            n_aborted += 1
            assert r.output_ids == want[: len(r.output_ids)], r.id
        else:
            assert r.finish_reason == "length" and r.output_ids == want, r.id
    for r, needle in bad:
        assert r.finish_reason == "error" and needle in r.error, (r.id, r.error, needle)
        assert r.output_ids == []
    return dict(requests=len(good) + len(bad), aborted=n_aborted, preemptions=engine.scheduler.num_preemptions,
                bad=len(bad), steps=step)


@pytest.mark.slow
def test_soak_many_requests_every_config():
    torch.set_num_threads(1)  # tiny matmuls: threads only contend
    model = tiny_model(layers=2, max_pos=MAX_POS)
    prompts = soak_prompts()
    t0 = time.perf_counter()
    refs = [generate_reference(model, p, MAX_NEW).token_ids for p in prompts]
    t_ref = time.perf_counter() - t0
    configs = [(name, overlap) for name in ("plain", "ngram", "eagle3") for overlap in (False, True)]
    per = SOAK_REQUESTS // len(configs)
    totals = dict(requests=0, aborted=0, preemptions=0, bad=0, steps=0)
    for c, (name, overlap) in enumerate(configs):
        drafter = {"plain": None, "ngram": NgramDrafter(),
                   "eagle3": Eagle3Drafter(tiny_head(model), model, topk=2, steps=2, num_draft_tokens=4)
                   if name == "eagle3" else None}[name]
        t1 = time.perf_counter()
        fig = soak(model, refs, prompts, per + (SOAK_REQUESTS % len(configs) if c == 0 else 0),
                   drafter=drafter, overlap=overlap, seed=c)
        print(f"soak {name:6s} overlap={overlap!s:5s}: {fig} in {time.perf_counter() - t1:.1f} s")
        assert fig["aborted"] > 0 and fig["preemptions"] > 0 and fig["bad"] > 0
        for k in totals:
            totals[k] += fig[k]
    wall = time.perf_counter() - t0
    print(f"soak total: {totals}, references {t_ref:.1f} s, wall {wall:.1f} s")
    assert totals["requests"] == SOAK_REQUESTS
