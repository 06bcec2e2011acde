"""Load generators for the in-process engine: closed-loop clients and open-loop Poisson arrivals.

The engine runs in this process, so a "client" is a driver loop around ``engine.step()``:

- closed loop at concurrency C (the parallel-throughput benchmark): C requests in flight; each time
  one finishes (or is rejected), that client sends its next prompt. Throughput vs C is the
  curve where speculation's benefit at low load turns into a cost at high load.
- open loop (latency studies): prompts arrive at Poisson times (rate r/s, seeded) whatever the
  engine's state; a request's arrival time is its scheduled time, so time spent waiting for a busy
  engine step counts toward its TTFT.

Both take ``submit(prompt, arrival_s) -> Request`` (the caller decides max_new_tokens, stop strings,
ignore_eos) and return finished requests in finishing order.
"""

from __future__ import annotations

import random
import time
from typing import Callable, Sequence

from ..errors import ConfigError

Submit = Callable[[object, float | None], object]


def closed_loop(engine, prompts: Sequence, concurrency: int | None, submit: Submit,
                on_finish: Callable[[object], None] | None = None) -> list:
    """Keep ``concurrency`` requests in flight (None: all prompts at once) until all are done."""
    if concurrency is not None and (isinstance(concurrency, bool) or not isinstance(concurrency, int)
                                    or concurrency < 1):
        raise ConfigError(f"workload.concurrency={concurrency!r}: must be an integer >= 1, or null "
                          "(every prompt at once)")
    todo = iter(prompts)
    first = len(prompts) if concurrency is None else min(int(concurrency), len(prompts))
    for _ in range(first):
        submit(next(todo), None)
    done = []
    while engine.has_work():
        for req in engine.step():
            done.append(req)
            if on_finish is not None:
                on_finish(req)
            nxt = next(todo, None)
            if nxt is not None:
                submit(nxt, None)  # this client's next prompt, sent as its previous one finishes
    engine.flush_trace()
    return done


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
