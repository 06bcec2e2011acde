"""Policy types and protocol: what the engine shows a policy and what it tells it back.

    k = policy.choose(view)        view: BatchView (decode rows only; prefills never count)
    policy.update(stats)           stats: StepStats of the step just run

Every k a policy can return is listed in ``policy.ks`` up front, so the engine reserves KV and
captures CUDA graphs for all of them at start-up: switching k selects another graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, runtime_checkable


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


@runtime_checkable
class Policy(Protocol):
    """What the engine needs of a policy.

    Optional hooks, used when a policy has them (the engine looks them up once at start-up):
      wants_step_ms: bool       True: the engine times every step and fills StepStats.step_ms
      wants_rows: bool          True: BatchView.rows / StepStats.rows carry the rows' request ids
                                (else None: building B ids per step is host work nobody reads)
      calibrate_(profile, batches)
                                called once at start-up with the engine's graphed-step profiler
                                ``profile(batch, k) -> ms`` and its decode graph buckets
      describe() -> dict        what the choices rest on, written into the run's metrics
      shadow_evals: int         > 0: with a drafter that has ``shadow_commits`` (n-gram), every k = 0
                                step scores up to this many drafts on the host (StepStats.shadow);
                                ``shadowed_()`` is called once at start-up when that will happen
      wants_counterfactual: bool
                                True: with a drafter that has ``counterfactual_commits_`` (EAGLE-3),
                                every step at k also brings, per row, what each smaller k' of
                                ``ks`` would have committed (StepStats.counterfactual); at start-up
                                ``counterfactual_(pairs)`` is called with {(k', k): label} (exact /
                                lower_bound / approximate) when that will happen
    """

    name: str
    ks: tuple[int, ...]  # every k choose() may return, 0 included

    def choose(self, view: BatchView) -> int: ...

    def update(self, stats: StepStats) -> None: ...


def choices(policy, ks) -> frozenset[int]:
    """The ks ``choose()`` can return: the policy's ``choices`` where it declares them (never: 0;
    always: its k), else every k of ``ks``. The engine captures only the prefill paths these reach."""
    declared = getattr(policy, "choices", None)
    return frozenset(int(k) for k in (ks if declared is None else declared))


def wants_step_ms(policy) -> bool:
    return bool(getattr(policy, "wants_step_ms", False))


def wants_rows(policy) -> bool:
    return bool(getattr(policy, "wants_rows", False))


def prefill_drafting(policy) -> Callable[[], bool] | None:
    """The policy's say on whether prompts prefilled at k = 0 run the draft too (``drafts_prefill``, asked only
    where the policy sets ``wants_prefill_drafting``; goodput's ramp_hold), or None: the engine's own rule."""
    return getattr(policy, "drafts_prefill", None) if getattr(policy, "wants_prefill_drafting", False) else None


def calibrator(policy) -> Callable[[Callable[[int, int], float], Iterable[int]], None] | None:
    """The policy's start-up calibration hook, or None."""
    return getattr(policy, "calibrate_", None)


def describe(policy) -> dict | None:
    """The policy's own account of its state (for run logs), or None."""
    fn = getattr(policy, "describe", None)
    return fn() if fn is not None else None


def wants_counterfactual(policy) -> bool:
    return bool(getattr(policy, "wants_counterfactual", False))


def shadow_evals(policy) -> int:
    """Drafts per step the policy wants scored from the committed tokens (0: none)."""
    return int(getattr(policy, "shadow_evals", 0) or 0)
