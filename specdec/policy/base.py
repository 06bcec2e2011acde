"""The policy interface: what the engine shows a policy, what it tells it back, and the base class.

    k = policy.choose(view)        view: BatchView (decode rows only; prefills never count)
    policy.update(stats)           stats: StepStats of the step just run

Every k a policy can return is listed in ``policy.ks`` up front, so the engine reserves KV and
captures CUDA graphs for all of them at start-up: switching k selects another graph.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Callable, Iterable

from ..errors import ConfigError, config_flag


@dataclass
class BatchView:
    num_decode: int  # decode-ready rows this step (requests still prefilling are not counted)
    num_waiting: int  # queued requests
    rows: tuple | None = None  # the decode rows' request ids, in row order (None: not given)
    # () -> draft backlog tokens of the rows (committed or prefilled while off, caught up before a
    # drafter that catches up drafts again; computed on call); None: no catch-up
    backlog: Callable[[], int] | None = None
    num_prefilling: int = 0  # admitted requests whose prompt is still being prefilled (not decode rows yet)


@dataclass
class StepStats:
    k: int
    num_decode: int
    committed: list[int]  # tokens committed per row (accepted drafts + 1)
    step_ms: float | None = None  # the step's duration (device ms on a GPU), if the policy asked for it
    rows: list | None = None  # request id of each row of committed (None: not given)
    # Shadow acceptance (steps of a drafter that scores drafts from committed tokens, for a
    # policy with shadow_evals > 0; specdec.engine.shadow): (k, request id, tokens a k-step would
    # have committed), and what drafting costs per row on the host (ms: the drafter's own measure,
    # e.g. n-gram's indexed lookups, else the time one shadow lookup took)
    shadow: list | None = None
    shadow_ms: float | None = None
    # Counterfactual acceptance (speculative steps of a drafter that scores its smaller trees on the
    # verified path of the larger one, EAGLE-3, for a policy with wants_counterfactual):
    # {smaller k: tokens a step at that k would have committed, per row of committed}
    counterfactual: dict | None = None


class Policy:
    """Base class of every policy: a subclass sets ``name`` and ``ks`` and implements ``choose`` and
    ``update``. Everything else below is optional; the defaults ask the engine for nothing and ignore
    what it reports, so the engine calls every hook directly.

    What a policy asks of the engine (read once at start-up):
      choices               the ks choose() can return (None: every k of ks); the engine captures
                            only the prefill paths these reach (never: plain; always: drafted)
      wants_step_ms         the engine times every decode step and fills StepStats.step_ms
      wants_rows            BatchView.rows / StepStats.rows carry the rows' request ids (else None:
                            building B ids per step is host work nobody reads)
      wants_step_table      calibrate_() is called at start-up with the engine's graphed-step
                            profiler, at ``profile_context`` tokens of context, ``profile_iters``
                            timed steps per entry
      wants_catch_up_ms     the engine times its catch-up forwards at start-up: catch_up_table_()
      wants_counterfactual  with a drafter that scores its smaller trees on the verified path of a
                            larger one (EAGLE-3), or chains that nest (n-gram), or replayed
                            acceptance: every step at k also brings, per row, what each smaller k'
                            of ks would have committed (StepStats.counterfactual); counterfactual_()
      shadow_evals          > 0: with a drafter that scores drafts from committed tokens (n-gram),
                            steps score up to this many drafts on the host (StepStats.shadow);
                            shadowed_() is called at start-up, shadow_due() before each scoring

    What the engine tells it (hooks; the defaults do nothing):
      calibrate_(profile, batches)   ``profile(batch, k) -> ms`` over the engine's graph buckets
      catch_up_table_(forward_ms)    {tokens: device ms} of one catch-up forward per token bucket
      counterfactual_(pairs)         {(k', k): exact | lower_bound | approximate | replayed}
      shadowed_()                    shadow samples will come with the steps
      serial_drafting_(serial)       True: speculative steps run after the host's work (a drafter
                                     that drafts from the host's tokens under overlapped decoding)
      shadow_due() -> bool           whether this step scores shadow drafts (default: every step)
      iteration_(k, batch, wall_ms, host_ms, mixed)
                                     one iteration's wall time, start to start, and its host part;
                                     ``mixed``: it also prefilled or switched speculation back on
      describe() -> dict | None      what the choices rest on, written into the run's metrics
    """

    name: str = "policy"
    ks: tuple[int, ...] = (0,)  # every k choose() may return, 0 included
    choices: tuple[int, ...] | None = None
    wants_step_ms = False
    wants_rows = False
    wants_step_table = False
    profile_context = 512
    profile_iters = 20
    wants_catch_up_ms = False
    wants_counterfactual = False
    shadow_evals = 0

    def choose(self, view: BatchView) -> int:
        raise NotImplementedError

    def update(self, stats: StepStats) -> None:
        raise NotImplementedError

    def calibrate_(self, profile: Callable[[int, int], float], batches: Iterable[int]) -> None:
        pass

    def catch_up_table_(self, forward_ms: dict[int, float]) -> None:
        pass

    def counterfactual_(self, pairs: dict) -> None:
        pass

    def shadowed_(self) -> None:
        pass

    def serial_drafting_(self, serial: bool) -> None:
        pass

    def shadow_due(self) -> bool:
        return True

    def iteration_(self, k: int, batch: int, wall_ms: float, host_ms: float, mixed: bool = False) -> None:
        pass

    def describe(self) -> dict | None:
        return None


def describe(policy) -> dict | None:
    """The policy's own account of its state (for run logs), or None (no policy)."""
    return None if policy is None else policy.describe()


def options(config_class, given: dict, policy: str, ignored: Iterable[str] = ()):
    """``config_class(**given)``, each value of the type of its field's default (bool, int, float; a
    field without one: an int). A key the class does not have is a ConfigError naming the key and the
    valid ones, unless listed in ``ignored`` (keys of other policies' configs: an experiment may set
    goodput's profile_context whatever the policy)."""
    fields = {f.name: f for f in dataclasses.fields(config_class) if f.init}
    unknown = sorted(set(given) - set(fields) - set(ignored))
    if unknown:
        raise ConfigError(f"policy {policy}: unknown option(s) {', '.join(unknown)}; valid: {', '.join(fields)}")
    return config_class(**{k: _typed(k, v, fields[k].default) for k, v in given.items() if k in fields})


def _typed(key: str, value, default):
    if isinstance(default, bool):
        return config_flag(f"policy.{key}", value)
    if default is not dataclasses.MISSING and not isinstance(default, (int, float)):
        return value  # e.g. bandit's arms: checked by the policy
    kind = float if isinstance(default, float) else int
    try:
        if isinstance(value, bool):
            raise ValueError
        if kind is int and isinstance(value, float) and value.is_integer():
            value = int(value)
        return kind(value) if kind is float or isinstance(value, str) else operator.index(value)
    except (TypeError, ValueError):
        raise ConfigError(f"policy.{key}={value!r}: must be {'a number' if kind is float else 'an integer'}") from None
