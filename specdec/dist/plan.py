"""The step plan: rank 0 decides, every rank runs the same engine iteration.

Rank 0 holds the real clients (closed / open loop), the policy's decisions and the results. Its
:class:`LeaderEngine` has the Engine's API; before each call that does device work (``step``, the
profiling calls) it broadcasts one plan over the gloo group:

    (inputs, op, fingerprint)
    inputs       requests added and aborted since the last plan, in order (the scheduler's inputs)
    op           ("step", k) | ("call", method, args, kwargs) | ("fn", module, name, args, kwargs)
                 | ("engine", cfg) | ("exit",)
    fingerprint  rank 0's (iteration, decode rows, seq_lens, free pages, queue) before the op

Every other rank (:func:`follow`) applies the same inputs to its own engine and runs the same op.
The scheduler is deterministic given its inputs (admission, preemption, chunking and finishing
depend on page counts and tokens only: times are recorded, never decided on), and every rank reads
the same tokens (full logits gathered on every rank, the same seeded random numbers), so the ranks
build the same batch, page tables and bucket and replay the same CUDA graph. What is not
deterministic stays on rank 0 and is broadcast: the requests' arrival (clients, wall-clock arrival
times), aborts, and k (:class:`TPPolicy`: a policy may decide from measured step times). A follower
whose fingerprint differs from rank 0's raises :class:`TPDesyncError` before the op (never a hang
in a mismatched collective).
"""

from __future__ import annotations

import importlib

from ..errors import SpecdecError


class TPDesyncError(RuntimeError):
    """A follower rank's engine state differs from rank 0's before an op (a bug: the scheduler or
    the tokens diverged)."""


def fingerprint(engine) -> tuple:
    """What every rank's engine must agree on before an op: iteration, decode rows, their seq_lens and
    newest tokens (a sampled token that differed between ranks shows here), free pages, queue."""
    st, sched = engine.state, engine.scheduler
    return (engine._step_no, st.num_rows, tuple(st.seq_lens_host), tuple(r.tokens[-1] for r in sched.rows),
            engine.kv.num_free, len(sched.waiting), len(sched.admitted))


class TPPolicy:
    """A policy under tensor parallelism: rank 0's ``choose`` decides and broadcasts k; other ranks
    receive it (their copy's state is never consulted). Everything else is the wrapped policy's."""

    def __init__(self, inner, group):
        self._inner, self._group = inner, group

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def choose(self, view):
        k = self._inner.choose(view) if self._group.is_leader else None
        return self._group.broadcast_object(k)

    def update(self, stats) -> None:
        if self._group.is_leader:
            self._inner.update(stats)


class LeaderEngine:
    """Rank 0's engine (see the module docstring): the Engine's API, with every device-work call
    broadcast to the other ranks first. Attributes not defined here are the engine's."""

    def __init__(self, engine, group):
        self._engine, self._group = engine, group
        self._inputs: list[tuple] = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _send(self, op) -> None:
        self._group.broadcast_object((self._inputs, op, fingerprint(self._engine)))
        self._inputs = []

    def add_request(self, prompt_ids, max_new_tokens, *, request_id=None, stop=(), ignore_eos=False,
                    arrival_s=None, sampling=None):
        req = self._engine.add_request(prompt_ids, max_new_tokens, request_id=request_id, stop=stop,
                                       ignore_eos=ignore_eos, arrival_s=arrival_s, sampling=sampling)
        self._inputs.append(("add", dict(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens,
                                         request_id=req.id, stop=tuple(stop), ignore_eos=ignore_eos,
                                         arrival_s=req.arrival_s, sampling=sampling)))
        return req

    def abort(self, request_id) -> bool:
        self._inputs.append(("abort", str(request_id)))
        return self._engine.abort(request_id)

    def step(self, k=None):
        self._send(("step", k))
        return self._engine.step(k)

    def run_until_done(self):
        done = []
        while self.has_work():
            done.extend(self.step())
        self.flush_trace()
        return done

    def generate(self):
        while self.has_work():
            yield from self.step()
        self.flush_trace()

    def profile_decode_step(self, *args, **kwargs):
        self._send(("call", "profile_decode_step", args, kwargs))
        return self._engine.profile_decode_step(*args, **kwargs)

    def profile_step_phases(self, *args, **kwargs):
        self._send(("call", "profile_step_phases", args, kwargs))
        return self._engine.profile_step_phases(*args, **kwargs)

    def run_everywhere(self, fn, *args, **kwargs):
        """fn(engine, *args, **kwargs) on every rank (a module-level function doing device work)."""
        self._send(("fn", fn.__module__, fn.__qualname__, args, kwargs))
        return fn(self._engine, *args, **kwargs)

    def close(self, next_op=("exit",)) -> None:
        """Hand the followers the next op outside this engine (a new engine, or exit)."""
        self._send(next_op)


def run_everywhere(engine, fn, *args, **kwargs):
    """fn(engine, ...) here, and on every rank when ``engine`` is rank 0's LeaderEngine."""
    if isinstance(engine, LeaderEngine):
        return engine.run_everywhere(fn, *args, **kwargs)
    return fn(engine, *args, **kwargs)


def follow(engine, group):
    """A follower rank: apply rank 0's plans to ``engine`` until an op outside it arrives
    (("engine", cfg) or ("exit",)), which is returned."""
    while True:
        inputs, op, want = group.broadcast_object(None)
        if engine is not None:
            for kind, arg in inputs:
                if kind == "add":
                    engine.add_request(**arg)
                else:
                    engine.abort(arg)
        if op[0] in ("engine", "exit"):
            return op
        got = fingerprint(engine)
        if got != want:
            raise TPDesyncError(f"rank {group.rank} is out of step with rank 0 before {op[0]}: (iteration, rows, "
                                f"seq_lens, newest tokens, free pages, waiting, admitted) {got} here vs {want} on rank 0")
        if op[0] == "step":
            try:
                engine.step(op[1])
            except SpecdecError:
                pass  # rank 0 raised the same error from the same state: it reports it
        elif op[0] == "call":
            getattr(engine, op[1])(*op[2], **op[3])
        elif op[0] == "fn":
            fn = importlib.import_module(op[1])
            for part in op[2].split("."):
                fn = getattr(fn, part)
            fn(engine, *op[3], **op[4])
        else:
            raise TPDesyncError(f"rank {group.rank}: unknown plan op {op!r}")
