"""bandit: goodput's choices checked against measured throughput, per load.

goodput picks k from a model (each request's acceptance over a step-time table); where the model is
off (a time estimate that ends high, per-request estimates below break-even while always wins), it
runs below max(never, always). bandit measures instead of predicting: per load bucket it runs whole
*arms* (goodput's model, always at a fixed k, never) in blocks of decode iterations, measures each
block's committed tokens per second of wall time, and runs the arm that measured best, re-measuring
the others as often as a bounded exploration cost allows.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

from ..errors import ConfigError
from .base import BatchView, Policy, StepStats, options
from .goodput import Goodput


class _Arm:
    """One arm's measurements in one load bucket: decayed sums of committed tokens and wall ms."""

    __slots__ = ("tokens", "ms", "blocks", "last_block", "iters")

    def __init__(self):
        self.tokens = 0.0
        self.ms = 0.0
        self.blocks = 0  # measured blocks
        self.last_block = 0  # the bucket's block count when this arm was last measured
        self.iters = 0  # decode iterations run (measured or not)

    def rate(self) -> float | None:
        """Committed tokens per ms, or None before the first measured block."""
        return self.tokens / self.ms if self.blocks and self.ms > 0 else None


class _Block:
    __slots__ = ("id", "bucket", "arm", "iters", "rows", "tokens", "t0", "ms", "open", "pending")

    def __init__(self, bid: int, bucket: int, arm: str):
        self.id, self.bucket, self.arm = bid, bucket, arm
        self.iters = 0  # decode iterations chosen in this block
        self.rows = 0  # decode rows over its measured iterations
        self.tokens = 0  # tokens committed by its measured steps (fed back through update)
        self.t0: float | None = None  # perf_counter at the first measured iteration
        self.ms = 0.0  # wall ms of its measured iterations (set when the block closes)
        self.open = True
        self.pending = 0  # measured steps launched but not yet fed back


@dataclass
class BanditConfig:
    """bandit's own options (it takes goodput's too: its model arm is goodput with them)."""

    arms: tuple = ("goodput", "always", "never")  # goodput (the model), always (the largest k of ks), never, a k
    block_iters: int = 8  # a block: at least this many decode iterations ...
    block_rows: int = 256  # ... and this many decode rows
    settle: int = 2  # iterations at a block's start not measured (a switch's catch-up, the step in flight)
    memory: float = 0.2  # an arm's rate: decayed sums of tokens and ms, the newest block at this weight
    explore_cost: float = 0.01  # share of the time re-measuring arms that trail the best may cost


class Bandit(Policy):
    """Per load bucket, run the arm with the most committed tokens per second, measured.

    Arms: ``goodput`` (the model policy this wraps: it picks k per step), ``always`` (the largest k
    of ``ks``), ``never`` (k = 0) or a number (always at that k). The load bucket is the power of two
    at or above the admitted requests (decode rows + requests still prefilling: a closed loop's C,
    steady while its requests come and go, where the decode batch alone dips at every finish).

    A block is at least ``block_iters`` decode iterations and ``block_rows`` decode rows under one arm
    (C = 1: block_rows iterations, over a few requests; from C = block_rows / block_iters on:
    block_iters). Its first ``settle`` iterations are not measured (a switch's catch-up, the step in
    flight of the previous arm under overlapped decoding); the rest count their wall time start to start
    (what throughput pays: prefills, the host, the caller's work between iterations) and the tokens
    their steps commit. Each arm's rate is a decayed sum over its blocks (weight ``memory`` for the
    newest block: tokens and ms each ``(1 - memory) * old + the block's``).

    Choice at each block's start: an arm not measured yet in this bucket first (goodput first: it is
    the model's guess), then the arm with the best rate, except that an arm trailing the best by a
    share d is re-measured once the bucket has run ``d * (arms - 1) / explore_cost`` blocks since it
    was last measured (at least one): re-measuring it costs about d of a block, so re-measuring
    every arm so spaced costs at most ``explore_cost`` of the time; an arm within a few percent of
    the best is measured nearly every other block, one far behind rarely. While the requests still
    prefilling outnumber the decode rows (a ramp-up) no block is measured and the best measured arm
    (else goodput) runs.

    The model learns from every step whichever arm ran it (its acceptance and time estimates,
    counterfactual and shadow samples), and gets every engine hook (start-up table, catch-up table,
    iteration times); it is asked for a k only while its arm runs. Short blocks of a closed loop's
    iterations may not resolve the arms, and long ones make every re-measurement dear.
    """

    name = "bandit"
    wants_step_ms = True
    wants_rows = True
    wants_step_table = True
    wants_catch_up_ms = True

    def __init__(self, model: Goodput, arms=None, **given):
        if arms is not None:
            given["arms"] = arms
        cfg = options(BanditConfig, given, "bandit")
        arms, block_iters, block_rows, settle = cfg.arms, cfg.block_iters, cfg.block_rows, cfg.settle
        memory, explore_cost = cfg.memory, cfg.explore_cost
        self.model = model
        self.ks = model.ks
        top = max(model.ks)
        self.arm_k: dict[str, int | None] = {}  # arm label -> fixed k (None: the model picks)
        for a in arms:
            label = str(a).strip().lower()
            if label == "goodput":
                k = None
            elif label == "always":
                k = top
            elif label == "never":
                k = 0
            else:
                try:
                    k = int(label)
                except ValueError:
                    raise ConfigError(f"policy bandit: arm {a!r} is not goodput, always, never or a draft "
                                      f"length of ks {list(model.ks[1:])}") from None
                if k not in model.ks:
                    raise ConfigError(f"policy bandit: arm {a!r} is not goodput, always, never or a draft "
                                      f"length of ks {list(model.ks[1:])}")
                label = "never" if k == 0 else f"always{k}"
            if label in self.arm_k or (k is not None and k in self.arm_k.values()):
                raise ConfigError(f"policy bandit: arm {a!r} is listed twice, or its k is (arms: {list(arms)})")
            self.arm_k[label] = k
        if "goodput" in self.arm_k:  # the model's arm is measured first in every bucket
            self.arm_k = {"goodput": None, **self.arm_k}
        if len(self.arm_k) < 2:
            raise ConfigError(f"policy bandit: needs at least two arms (got {list(arms)})")
        if block_iters < 1 or block_rows < 0 or settle < 0:
            raise ConfigError(f"policy bandit: need block_iters >= 1, block_rows >= 0 and settle >= 0 (got "
                              f"block_iters={block_iters}, block_rows={block_rows}, settle={settle})")
        if not 0.0 < memory <= 1.0 or explore_cost <= 0.0:
            raise ConfigError(f"policy bandit: need 0 < memory <= 1 and explore_cost > 0 (got memory={memory}, "
                              f"explore_cost={explore_cost})")
        self.block_iters, self.block_rows, self.settle = block_iters, block_rows, settle
        self.memory, self.explore_cost = memory, explore_cost
        fixed = {k for k in self.arm_k.values() if k is not None}
        self.choices = tuple(sorted(fixed | (set(model.ks) if None in self.arm_k.values() else set())))
        self.arms: dict[int, dict[str, _Arm]] = {}  # bucket -> arm label -> measurements
        self.blocks_done: dict[int, int] = {}  # bucket -> measured blocks
        self.switches = 0  # blocks whose arm differs from the block before
        self._block: _Block | None = None
        self._last_arm: str | None = None  # the arm of the last block
        self._next_id = 0
        self._closed: dict[int, _Block] = {}  # closed blocks whose steps are still being fed back
        self._tags: deque = deque()  # (block or None, k) per launched decode step, in launch order
        self.clock = time.perf_counter  # replaceable in tests

    # -- engine hooks and requests, the model's -------------------------------------------------
    @property
    def wants_counterfactual(self) -> bool:
        return self.model.wants_counterfactual

    @property
    def shadow_evals(self) -> int:
        return self.model.shadow_evals

    @property
    def profile_context(self) -> int:
        return self.model.profile_context

    @property
    def profile_iters(self) -> int:
        return self.model.profile_iters

    def calibrate_(self, profile, batches) -> None:
        self.model.calibrate_(profile, batches)

    def catch_up_table_(self, forward_ms) -> None:
        self.model.catch_up_table_(forward_ms)

    def counterfactual_(self, pairs) -> None:
        self.model.counterfactual_(pairs)

    def shadowed_(self) -> None:
        self.model.shadowed_()

    def serial_drafting_(self, serial: bool) -> None:
        self.model.serial_drafting_(serial)

    def shadow_due(self) -> bool:
        return self.model.shadow_due()

    def iteration_(self, k, batch, wall_ms, host_ms, mixed=False) -> None:
        self.model.iteration_(k, batch, wall_ms, host_ms, mixed=mixed)

    # -- the policy ----------------------------------------------------------------------------
    @staticmethod
    def bucket(view: BatchView) -> int:
        n = view.num_decode + max(0, view.num_prefilling)
        return 1 << max(0, math.ceil(math.log2(max(n, 1))))

    def _pick(self, bucket: int) -> str:
        arms = self.arms.setdefault(bucket, {a: _Arm() for a in self.arm_k})
        for a, st in arms.items():  # in arm order: goodput first
            if st.blocks == 0:
                return a
        rates = {a: st.rate() for a, st in arms.items()}
        best = max(rates, key=lambda a: rates[a])
        done = self.blocks_done.get(bucket, 0)
        due, most = None, 0.0
        for a, st in arms.items():
            if a == best:
                continue
            d = max(0.0, 1.0 - rates[a] / rates[best])
            gap = max(1.0, d * (len(arms) - 1) / self.explore_cost)
            overdue = (done - st.last_block) / gap
            if overdue >= 1.0 and overdue > most:
                due, most = a, overdue
        return due or best

    def _start(self, bucket: int, arm: str) -> None:
        if self._last_arm is not None and self._last_arm != arm:
            self.switches += 1
        self._last_arm = arm
        self._block = _Block(self._next_id, bucket, arm)
        self._next_id += 1

    def _close(self, now: float) -> None:
        b = self._block
        self._block = None
        if b is None:
            return
        b.open = False
        if b.t0 is not None:
            b.ms = (now - b.t0) * 1e3
        self._closed[b.id] = b
        self._fold(b)

    def _fold(self, b: _Block) -> None:
        """A closed block whose measured steps have all been fed back joins its arm's rate."""
        if b.open or b.pending > 0:
            return
        self._closed.pop(b.id, None)
        if b.t0 is None or b.ms <= 0.0:
            return
        st = self.arms[b.bucket][b.arm]
        keep = 1.0 - self.memory if st.blocks else 0.0
        st.tokens = keep * st.tokens + b.tokens
        st.ms = keep * st.ms + b.ms
        st.blocks += 1
        done = self.blocks_done.get(b.bucket, 0) + 1
        self.blocks_done[b.bucket] = done
        st.last_block = done

    def choose(self, view: BatchView) -> int:
        B = view.num_decode
        if B == 0:
            return 0
        now = self.clock()
        bucket = self.bucket(view)
        ramp = view.num_prefilling > B
        b = self._block
        if b is not None and (b.bucket != bucket or ramp or (b.iters >= self.settle + self.block_iters
                                                              and b.rows >= self.block_rows)):
            self._close(now)
            b = None
        if ramp:
            arms = self.arms.get(bucket, {})
            rated = {a: r for a, st in arms.items() if (r := st.rate()) is not None}
            arm = max(rated, key=rated.get) if rated else next(iter(self.arm_k))
            k = self._k(arm, view)
            self._tags.append((None, k))
            return k
        if b is None:
            self._start(bucket, self._pick(bucket))
            b = self._block
        b.iters += 1
        self.arms[bucket][b.arm].iters += 1
        measured = b.iters > self.settle
        if measured:
            if b.t0 is None:
                b.t0 = now
            b.rows += B
            b.pending += 1
        k = self._k(b.arm, view)
        self._tags.append((b if measured else None, k))
        return k

    def _k(self, arm: str, view: BatchView) -> int:
        k = self.arm_k[arm]
        return self.model.choose(view) if k is None else k

    def update(self, stats: StepStats) -> None:
        self.model.update(stats)
        # The launch this step came from: tags are pushed per choose() with decode rows, in launch
        # order; a tag whose k differs (a choice that launched no step, an explicit k) is dropped.
        while self._tags:
            blk, k = self._tags.popleft()
            if k == stats.k:
                break
            if blk is not None:
                blk.pending -= 1
                self._fold(blk)
        else:
            return
        if blk is None:
            return
        blk.pending -= 1
        blk.tokens += sum(stats.committed)
        self._fold(blk)

    def describe(self) -> dict:
        """Per bucket and arm: measured tok/s, blocks measured, decode iterations run; the model's own state."""
        out = {}
        for bucket, arms in sorted(self.arms.items()):
            out[str(bucket)] = {a: {"tok_per_s": None if (r := st.rate()) is None else round(r * 1e3, 1),
                                    "blocks": st.blocks, "iterations": st.iters} for a, st in arms.items()}
        return {"arms": list(self.arm_k), "block_iters": self.block_iters, "block_rows": self.block_rows,
                "settle": self.settle, "memory": self.memory, "explore_cost": self.explore_cost,
                "switches": self.switches, "buckets": out, "model": self.model.describe()}
