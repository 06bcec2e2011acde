"""Load generators for the in-process engine: closed-loop clients and open-loop Poisson arrivals.

The engine runs in this process, so a "client" is a driver loop around ``engine.step()``:

- closed loop at concurrency C (the parallel-throughput benchmark): C requests in flight; each time
  one finishes (or is rejected), that client sends its next prompt. Throughput vs C is the
  curve where speculation's benefit at low load turns into a cost at high load. With
  ``duration_s`` the clients keep sending (the prompts again, in order, under new ids) until that
  many seconds of serving have passed, then the requests in flight drain: every C serves for about
  the same time, and ``window`` records when sending stopped, so throughput can be read over the
  steady window alone (``steady_window``), without the ramp-up and the drain.
- open loop (latency studies): prompts arrive at Poisson times (rate r/s, seeded) whatever the
  engine's state; a request's arrival time is its scheduled time, so time spent waiting for a busy
  engine step counts toward its TTFT.

Both take ``submit(prompt, arrival_s) -> Request`` (the caller decides max_new_tokens, stop strings,
ignore_eos) and return finished requests in finishing order.
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Callable, Sequence

from ..errors import ConfigError

Submit = Callable[[object, float | None], object]


def _again(p, rnd: int):
    """Prompt ``p`` sent again in round ``rnd`` >= 1 of a timed closed loop: a new id (``ID@rnd``) so
    that records and aborts stay keyed by request; objects without an ``id`` field go as they are."""
    if dataclasses.is_dataclass(p) and hasattr(p, "id"):
        return dataclasses.replace(p, id=f"{p.id}@{rnd}")
    return p


def closed_loop(engine, prompts: Sequence, concurrency: int | None, submit: Submit,
                on_finish: Callable[[object], None] | None = None, *, duration_s: float | None = None,
                window: dict | None = None) -> list:
    """Keep ``concurrency`` requests in flight (None: all prompts at once) until all are done.

    ``duration_s``: keep sending, cycling through ``prompts`` (round r >= 1 under ids ``ID@r``), until
    ``duration_s`` seconds after the first submit, then drain. ``window`` (a dict) receives ``t0`` (the
    first submit, perf_counter seconds) and ``t_stop`` (when the last prompt was sent: with a duration,
    when it ran out; without, when the list did), the end of the loop's steady state."""
    if concurrency is not None and (isinstance(concurrency, bool) or not isinstance(concurrency, int)
                                    or concurrency < 1):
        raise ConfigError(f"workload.concurrency={concurrency!r}: must be an integer >= 1, or null "
                          "(every prompt at once)")
    if duration_s is not None and (concurrency is None or not prompts):
        raise ConfigError(f"workload.duration_s={duration_s!r} needs a closed-loop concurrency (got "
                          f"{concurrency!r}) and at least one prompt")
    t0 = t_stop = time.perf_counter()
    rounds = 1  # passes over the prompts begun
    stopped = False

    def prompt_iter():
        nonlocal rounds
        while True:
            for p in prompts:
                yield p if rounds == 1 else _again(p, rounds - 1)
            if duration_s is None:
                return
            rounds += 1

    todo = prompt_iter()

    def send_next() -> bool:
        nonlocal stopped, t_stop
        if not stopped and duration_s is not None and time.perf_counter() - t0 >= duration_s:
            stopped = True
        nxt = None if stopped else next(todo, None)
        if nxt is None:
            stopped = True
            return False
        submit(nxt, None)
        t_stop = time.perf_counter()
        return True

    first = len(prompts) if concurrency is None else (
        int(concurrency) if duration_s is not None else min(int(concurrency), len(prompts)))
    for _ in range(first):
        if not send_next():
            break
    done, late = [], False
    while engine.has_work():
        for req in engine.step():
            done.append(req)
            if on_finish is not None:
                on_finish(req)
            late |= send_next()  # this client's next prompt, sent as its previous one finishes
    if window is not None:
        # The steady state ends with the last send made as a request finished; when every prompt went
        # out at the start (C >= the prompts) there is no such send: the whole run.
        window.update(t0=t0, t_stop=t_stop if late else time.perf_counter(), rounds=rounds)
    engine.flush_trace()
    return done


def steady_window(token_times: Sequence[Sequence[float]], start: float, stop: float) -> tuple[int, float]:
    """(tokens committed at times in [start, stop), the window's length in s): output tok/s of the
    steady state is their ratio. ``token_times``: each request's commit times (perf_counter s)."""
    if not stop > start:
        return 0, 0.0
    n = sum(1 for times in token_times for t in times if start <= t < stop)
    return n, stop - start


def poisson_arrivals(n: int, rate: float | None, seed: int = 0) -> list[float]:
    """Arrival offsets in seconds of n requests at ``rate`` per second (None or inf: all at 0)."""
    if rate is None or rate == float("inf"):
        return [0.0] * n
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
        raise ConfigError(f"workload.rate={rate!r}: must be > 0 requests/s, or null (every prompt at once)")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def open_loop(engine, prompts: Sequence, rate: float | None, submit: Submit, *, seed: int = 0,
              on_finish: Callable[[object], None] | None = None) -> list:
    """Send prompt i at t0 + arrivals[i] (Poisson, ``rate`` per s); step while work remains."""
    arrivals = poisson_arrivals(len(prompts), rate, seed)
    t0 = time.perf_counter()
    i, done = 0, []
    while i < len(prompts) or engine.has_work():
        now = time.perf_counter() - t0
        while i < len(prompts) and arrivals[i] <= now:
            submit(prompts[i], t0 + arrivals[i])
            i += 1
        if engine.has_work():
            for req in engine.step():
                done.append(req)
                if on_finish is not None:
                    on_finish(req)
        elif i < len(prompts):
            time.sleep(max(0.0, arrivals[i] - now))  # idle until the next arrival
    engine.flush_trace()
    return done
