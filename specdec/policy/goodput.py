"""goodput: the k with the most expected committed tokens per second."""

from __future__ import annotations

import statistics
from collections import deque
from itertools import chain

from ..engine.graphs import forwards_ms
from ..errors import ConfigError
from .base import BatchView, StepStats


PROBE_AGE = 8  # goodput probe_requests: a request is probed once it has run this many decode steps (mid-answer)
SHADOW_SLACK = 0.2  # goodput: while the best k > 0 trails k = 0 by more than this, shadow scoring backs off
SERVED_OUTLIER = 2.0  # goodput: a served step's duration counts as at most this many times the average
FIRST_ITER_OUTLIER = 4.0  # ... and the first served iteration at (k, bucket) as this many times the estimate
HOST_SLOPE_MEMORY = 0.1  # goodput host_model: the slope's fit forgets at this share of time_ema (a longer memory)
SWITCH_LOG = 64  # goodput: the last this many switches of k, with the estimates behind each (describe: switch_log)
MIXED_MEMORY = 0.02  # goodput mixed_pricing: weight of the newest iteration in the mixed iterations per token
CALIBRATION_CLAMP = (0.5, 2.0)  # goodput calibrate: the factor on the requests' own a(k) stays within these


class Goodput:
    """Pick the k that maximises expected committed tokens per second at this decode batch.

    Every row of a step shares its k, so at batch B the step commits B * a(k) tokens in t(k, B)
    seconds and the best k maximises a(k) / t(k, B), where
      t(k, B)  the step-time table: device ms of a graphed step with k draft tokens at the smallest
               profiled batch >= B, measured once at start-up (``calibrate_``: the engine calls it
               with its ``profile_decode_step``, over its graph buckets, at ``profile_context``
               tokens of context), then replaced by an exponential moving average (weight
               ``time_ema``, starting from the start-up entry) of the durations of the steps served
               with k in that bucket (the engine times each step: ``wants_step_ms``), which follows
               the real context lengths and host work, and corrects a start-up entry that is off.
               A served step counts as at most SERVED_OUTLIER times the average so far: on the H200
               one stalled step at (k = 16, bucket 16) took 8.1 ms against 1.6 ms, became the
               bucket's average as the first served sample, and turned speculation off there for
               the rest of the run (C = 16: 1.16x of never where always gave 1.44x);
      a(k)     committed tokens per step at k, summed over the rows: 1 per row at k = 0; for k > 0
               each request's own estimate, an exponential moving average (weight ``ema``; ``shadow_ema``
               with shadow samples) of what
               its steps with k committed, started from a prior: the average over all requests'
               rows (an EMA of weight ``prior_ema`` per row and step). Acceptance is a property of
               the request (its text), so one request the draft cannot follow turns speculation off
               while it runs alone but does not carry over to the next one. Without row ids (a
               BatchView / StepStats without ``rows``) every row takes the prior. A k not yet run
               is tried once first (its prior is unknown), and while k = 0 is chosen a k > 0 is
               re-tried every ``explore_every`` steps (0: never; a re-try after which k = 0 still wins
               multiplies the gap by ``explore_backoff``, up to ``explore_max``; a k > 0 chosen on
               its merits resets it), so that acceptance tracks the
               workload (the draft KV stays in sync meanwhile, so a re-try costs one step's draft).
    Drafts scored while off (``shadow_evals`` > 0 with a drafter that scores its drafts from the
    committed tokens, n-gram: specdec.engine.shadow): every step brings samples of what a
    step at each k would have committed, from the running requests' own text, so a(k) stays
    current with no re-tries and no first try (a k is chosen once its first sample is in); the
    host time of those lookups measures the drafter's host work per row, added to the start-up
    table's t(k, B) for k > 0 (B rows, each looked up before a step: at C = 256 on the H200 an
    n-gram step took 12.9 ms served against 3.5 ms profiled).
    Iterations, not only steps (``iteration_``: the engine reports every iteration's wall and host
    ms, start to start): throughput pays an iteration's wall time, which is the device's decode
    when the host keeps up and the host's own work (the engine's and its caller's) when it does
    not. Iterations that also prefilled or switched speculation back on are left out (``mixed``):
    that work does not depend on the k of the step beside it. The rate divides by the served
    iterations' average wall time at (k, bucket) where there is one, else by max(t(k, B), the
    bucket's host ms per iteration): a host-bound batch gains from a larger tree at no wall cost.
    H200 policy envelope at 41d1e6b, EAGLE-3, C = 64: goodput held tree 8 at 1.9 ms device steps
    against tree 32's 3.1 ms, yet each iteration took 3.7 ms of wall time against 4.3 (prefill
    836 vs 581 ms over the run: more iterations, more prefill forwards; 0.43 vs 0.24 s outside the
    engine's steps) and always (tree 32) served 1.08x more tokens per second.
    Counterfactual acceptance (``counterfactual``, with a drafter that scores its smaller trees on
    the verified path of a larger one, EAGLE-3: kernels_triton/counterfactual.py, with chains that
    nest, n-gram: the engine reads min(committed, k' + 1) off each row on the host, or with replayed
    acceptance, which draws the smaller sizes at the same quantile: specdec.acceptance): every step at k
    also brings, per row, what each smaller k' of ks would have committed on the same text, folded
    into a(k') (the row's own and the prior) like a step served at k'; so one k's steps keep the
    estimates of every smaller k current, a k' whose samples cover probe_rows rows needs no first
    try, and the first tries go to the largest untried k first (its steps sample all the smaller
    ones). Each pair (k', k) is exact (the same growth: the k'-tree is the k'-best nodes of the
    k-tree), a lower bound (a chain under a wider tree) or approximate (other growths); describe()
    lists them beside the counterfactual rows each k' got. H200 policy envelope on HumanEval at C =
    1 without it: a(3) = 1.9 from 24 rows, a(8) = 1.6 from 5, a(16) = 2.7 from 48 where always
    (tree32) accepted 3.9 on average, and goodput ran 3-6% below always. With it (H200, 2026-12-02,
    6e40d5d, experiments/results/spec/counterfactual_6e40d5d, on / off in one sweep): a(3) / a(8) /
    a(16) = 2.5 / 3.2 / 3.8 at C = 1 from 315-542 counterfactual rows, mean accepted length 3.67 /
    3.93 / 4.03 at C = 1 / 2 / 4 (off: 3.76 / 3.47 / 3.89), 2471 / 4758 / 8031 tok/s (off: 2534 /
    4189 / 7895); two runs of always per C differed by 4-8% in the same sweep, so only C = 2 is
    outside the noise.
    Each k's first tries run until its prior covers ``probe_rows`` rows (several steps at a small
    batch, one at a large one). The prior a(k) is the mean of the rows seen while they are fewer than 1 / prior_ema, then the
    EMA: one first step does not set it (n-gram's first step at C = 1 accepted nothing, a prior of
    1.0 that the EMA took hundreds of rows to move).
    ``host_model`` (off by default; no gain on the H200 at fd4df8d, conf/policy/goodput.yaml): iter_ms from one host line per
    table batch, a + b x (tokens committed per row), fitted over the unmixed iterations of every k, instead of each
    k's own served iterations: an estimate refreshed only while its k runs stays where a fast or slow spell of the
    host left it (experiments/sim_host_drift.py).
    ``calibrate`` (off by default; no gain on the H200 at 969e48b, conf/policy/goodput.yaml): a batch's summed own a(k) times the ratio of
    what observed steps (served, counterfactual, shadow) committed to what their rows' own estimates predicted just
    before, a decayed sum with weight ``calibrate`` per row. The own estimates run low where acceptance grows along
    an answer (n-gram on MT-bench at C = 64: 1 / 1.11 of what the steps committed), which prices every k > 0 below
    k = 0's exact a(0) = 1.
    ``mixed_pricing`` (off by default; H200 at 11ce6bda, n-gram MT-bench C = 64, seeds 0-2: 0.873 of the envelope
    against goodput's 0.968, two seeds held k = 0 after pricing chain 8 from its resume iteration, which switched
    iterations no longer feed): an iteration at k is priced as the blend of
    its unmixed and its mixed (prefilling) iterations, in the share of mixed ones that a step committing a(k) tokens
    sees at the workload's measured mixed iterations per token (see _blended_ms): prefill overlaps the extra device
    time of a larger k, which unmixed iterations alone overprice.
    ``defer_first_tries`` (off by default; H200 6ac62a3: 0.77x of never at C = 256): first tries wait
    while the requests still prefilling (BatchView.num_prefilling) outnumber the decode rows (see choose);
    ``ramp_hold`` (off by default; no gain on the H200 crossover at 6d0055c: 0.982 against 0.981 at C = 256): every
    step does.
    A switch needs a gain above ``margin`` (relative) over the k of the previous step, so a batch
    near the crossover does not flip every step. Decode rows only: prefills never count.
    H200 (bench_spec --draft eagle3 --trace-dir, results/spec/goodput_trace_2dbe67d.md): with one
    EMA for all requests, the last request of a closed-loop point committed 1 token per speculative
    step, the EMA fell to ~1.3 and the next point (C = 1, other prompts) ran 235 plain steps before
    its first re-try.
    """

    name = "goodput"

    wants_step_ms = True
    wants_rows = True

    def __init__(self, ks, *, ema: float = 0.1, margin: float = 0.03, explore_every: int = 32,
                 profile_context: int = 512, time_ema: float = 0.1, prior_ema: float = 0.01,
                 explore_backoff: float = 1.0, explore_max: int = 1024, shadow_evals: int = 0,
                 profile_iters: int = 20, probe_rows: int = 1, switch_horizon: int = 32,
                 explore_budget: float = 0.05, probe_cost: float = float("inf"), counterfactual: bool = False,
                 refresh_every: int = 0, defer_first_tries: bool = False, shadow_min_rows: float = 2.0,
                 probe_requests: int = 0, shadow_ema: float | None = 0.03, iter_median: int = 0,
                 shadow_max_lag: int | None = None, explore_fresh: float = 0.0, shadow_rows_cap: int | None = None,
                 iter_min_samples: int = 0, row_sample: int = 0, ramp_hold: bool = False,
                 host_model: bool = False, calibrate: float = 0.0, mixed_pricing: bool = False,
                 time_every: int = 1):
        ks = sorted({int(k) for k in ks} - {0})
        if not ks or ks[0] < 1:
            raise ConfigError(f"policy goodput: ks must list draft lengths >= 1, got {ks}")
        if (not 0.0 < ema <= 1.0 or not 0.0 < prior_ema <= 1.0 or not 0.0 <= time_ema <= 1.0 or margin < 0.0
                or explore_every < 0 or profile_context < 1):
            raise ConfigError(f"policy goodput: need 0 < ema <= 1, 0 < prior_ema <= 1, 0 <= time_ema <= 1 (0: "
                              f"start-up table only), margin >= 0, explore_every >= 0 and profile_context >= 1 "
                              f"(got ema={ema}, prior_ema={prior_ema}, time_ema={time_ema}, margin={margin}, "
                              f"explore_every={explore_every}, profile_context={profile_context})")
        self.ks = (0, *ks)
        if explore_backoff < 1.0 or explore_max < explore_every:
            raise ConfigError(f"policy goodput: need explore_backoff >= 1 and explore_max >= explore_every (got "
                              f"explore_backoff={explore_backoff}, explore_max={explore_max}, "
                              f"explore_every={explore_every})")
        self.ema, self.margin, self.explore_every = float(ema), float(margin), int(explore_every)
        shadow_ema = None if shadow_ema is None else float(shadow_ema)
        if shadow_ema is not None and not 0.0 < shadow_ema <= 1.0:
            raise ConfigError(f"policy goodput: need 0 < shadow_ema <= 1 (null: ema; got shadow_ema={shadow_ema})")
        # a request's own a(k) with shadow samples: a longer memory than ema (see _observe_)
        self.shadow_ema = self.ema if shadow_ema is None else shadow_ema
        self.explore_backoff, self.explore_max = float(explore_backoff), int(explore_max)
        if shadow_evals < 0 or profile_iters < 1:
            raise ConfigError(f"policy goodput: need shadow_evals >= 0 and profile_iters >= 1 (got "
                              f"shadow_evals={shadow_evals}, profile_iters={profile_iters})")
        if probe_rows < 1:
            raise ConfigError(f"policy goodput: need probe_rows >= 1 (got probe_rows={probe_rows})")
        if switch_horizon < 1 or explore_budget < 0:
            raise ConfigError(f"policy goodput: need switch_horizon >= 1 and explore_budget >= 0 (got "
                              f"switch_horizon={switch_horizon}, explore_budget={explore_budget})")
        self.switch_horizon = int(switch_horizon)  # steps a switch on is expected to last (its catch-up's payback)
        self.explore_budget = float(explore_budget)  # share of the off time a re-try's catch-up may cost
        if probe_cost < 1.0:
            raise ConfigError(f"policy goodput: need probe_cost >= 1 (got probe_cost={probe_cost})")
        self.probe_cost = float(probe_cost)  # a first try waits for a batch where its step costs <= this many plain steps
        if refresh_every < 0:
            raise ConfigError(f"policy goodput: need refresh_every >= 0 (0: off; got refresh_every={refresh_every})")
        # First tries wait while the requests still prefilling outnumber the decode rows (a ramp-up)
        self.defer_first_tries = bool(defer_first_tries)
        # k = 0 on every step while the requests still prefilling outnumber the decode rows, and prompts prefilled
        # with the draft while a k is still to be tried (drafts_prefill)
        self.ramp_hold = bool(ramp_hold)
        self.wants_prefill_drafting = self.ramp_hold  # the engine asks drafts_prefill while off
        self.ramp_steps = 0  # steps ramp_hold held at k = 0
        self.refresh_every = int(refresh_every)  # while at a k > 0 below the largest: a step at the largest this often
        self.refresh_gap = float(refresh_every)  # steps below the largest k until the next refresh (backoff)
        self.since_top = 0  # consecutive speculative choices below the largest k
        self._refreshed = False  # the previous choice was a refresh
        self._before_refresh = 0  # ... which interrupted this k
        self.refreshes = 0  # refresh steps run
        self.probe_rows = int(probe_rows)  # rows a k's first tries cover before its prior a(k) is trusted
        if probe_requests < 0:
            raise ConfigError(f"policy goodput: need probe_requests >= 0 (0: off; got probe_requests={probe_requests})")
        # The largest k's prior rests on rows of at least this many requests: until then each request
        # that has run PROBE_AGE decode steps without a step at the largest k gets one (0: off)
        self.probe_requests = int(probe_requests)
        self.top_requests: set = set()  # requests with served rows at the largest k (up to probe_requests)
        self._row_age: dict = {}  # request id -> decode steps seen, while requests are probed
        self.request_probes = 0  # probe steps run
        self.shadow_evals = int(shadow_evals)  # drafts scored per step (the engine's ShadowAcceptance)
        if shadow_max_lag is not None and int(shadow_max_lag) < 0:
            raise ConfigError(f"policy goodput: need shadow_max_lag >= 0 or null (got shadow_max_lag={shadow_max_lag})")
        # a shadow walk this many tokens behind the newest scorable position restarts there (the engine's
        # ShadowAcceptance max_lag; None: walks never skip)
        self.shadow_max_lag = None if shadow_max_lag is None else int(shadow_max_lag)
        self.serial_drafting = False  # set by the engine: speculative steps run after the host's work (n-gram)
        if shadow_min_rows < 0:
            raise ConfigError(f"policy goodput: need shadow_min_rows >= 0 (got shadow_min_rows={shadow_min_rows})")
        self.shadow_min_rows = float(shadow_min_rows)  # scored drafts per decode row behind a switch on
        if shadow_rows_cap is not None and int(shadow_rows_cap) < 1:
            raise ConfigError(f"policy goodput: need shadow_rows_cap >= 1 or null (got {shadow_rows_cap})")
        # Without serial drafting, the rows shadow_min_rows counts are capped at this many (None: no cap)
        self.shadow_rows_cap = None if shadow_rows_cap is None else int(shadow_rows_cap)
        self.profile_iters = int(profile_iters)  # graphed steps per start-up table entry
        self.shadowed = False  # the engine feeds shadow samples (``shadowed_``): no forced tries, no re-tries
        self.shadow_gap = 1.0  # steps between shadow scorings (shadow_due)
        self._since_shadow = 0
        self._spec_behind = False  # the last choice: every k > 0 trailed k = 0 by more than SHADOW_SLACK
        self.shadow_skipped = 0  # steps whose shadow scoring shadow_due skipped
        self.wants_counterfactual = bool(counterfactual)  # ask the engine for counterfactual commits
        self.counterfactual_pairs: dict[tuple[int, int], str] = {}  # (k', k) -> label, set by the engine
        self.counterfactual_rows: dict[int, int] = {k: 0 for k in ks}  # counterfactual rows folded into a(k)
        self.lookup_ms: float | None = None  # EMA of the drafter's host ms per drafted row (shadow samples carry it)
        self.shadow_samples = 0
        self.rows_seen: dict[int, int] = {k: 0 for k in ks}  # rows behind the prior a(k)
        self.iter_observed: dict[tuple[int, int], float] = {}  # (k, table batch) -> EMA of iteration wall ms
        self.iter_samples: dict[tuple[int, int], int] = {}  # (k, table batch) -> unmixed iterations seen
        if iter_median < 0:
            raise ConfigError(f"policy goodput: need iter_median >= 0 (0: the EMA; got iter_median={iter_median})")
        # > 0: t(k, B) of served iterations is the median of the last this many unmixed ones instead of the EMA
        self.iter_median = int(iter_median)
        self._iter_recent: dict[tuple[int, int], deque] = {}
        if iter_min_samples < 0:
            raise ConfigError(f"policy goodput: need iter_min_samples >= 0 (0: from the first; got {iter_min_samples})")
        # The served iterations' wall ms at (k, bucket) stands for iter_ms once it rests on this many of them
        # (before: the model, max(t(k, B), the bucket's host ms of any k)); 0: from the first
        self.iter_min_samples = int(iter_min_samples)
        if row_sample < 0:
            raise ConfigError(f"policy goodput: need row_sample >= 0 (0: every row; got row_sample={row_sample})")
        # A step's served and counterfactual commits update the own a(k) of at most this many of its rows, in turn
        # over the batch (the prior still takes every row); 0: every row
        self.row_sample = int(row_sample)
        self._row_cursor = 0  # where the next step's sampled rows start
        self.host_ms: dict[int, float] = {}  # table batch -> EMA of host ms per iteration (any k)
        # host_model: an iteration's host ms as a + b x (tokens committed per row), fitted per table batch over the
        # unmixed iterations of every k (decayed sums [w, w x, w x^2, w y, w x y]); iter_ms prices k from it
        self.host_model = bool(host_model)
        self._host_fit: dict[int, tuple[list[float], list[float]]] = {}  # table batch -> (short, long memory)
        self._last_commit: tuple[float, int] | None = None  # (tokens, rows) the last step fed to update() committed
        if not 0.0 <= calibrate < 1.0:
            raise ConfigError(f"policy goodput: need 0 <= calibrate < 1 (0: off; got calibrate={calibrate})")
        # > 0: the requests' own a(k), summed over a batch, are scaled by the ratio of what steps committed to what
        # those sums predicted for them, a decayed sum over observations with this weight per row (see _observe_)
        self.calibrate = float(calibrate)
        self._calib: dict[int, list[float]] = {k: [0.0, 0.0] for k in ks}  # k -> [decayed committed, predicted] per row
        # mixed_pricing: an iteration at k priced as the blend of its unmixed and mixed (prefilling) iterations, in
        # the share of mixed ones a step committing a(k) tokens sees (see rate)
        self.mixed_pricing = bool(mixed_pricing)
        # time_every: the engine times one decode step in this many (CUDA events around the launch, read after the
        # step): the served step-time EMA needs a sample now and then, and every timed step costs the host two
        # events and a read-back (H200, e5229cc, n-gram HumanEval C = 16: 0.045 ms of a 1.33 ms iteration)
        if int(time_every) < 1:
            raise ConfigError(f"policy goodput: need time_every >= 1 (got time_every={time_every})")
        self.time_every = int(time_every)
        self.mixed_observed: dict[tuple[int, int], float] = {}  # (k, table batch) -> EMA of mixed iteration wall ms
        self._mixed_rate = [0.0, 0.0]  # decayed [mixed iterations, tokens committed] (mixed iterations per token)
        self.explore_gap = float(explore_every)  # k = 0 steps until the next re-try
        self._explored = False  # the previous choice was a re-try
        if not 0.0 <= explore_fresh <= 1.0:
            raise ConfigError(f"policy goodput: need 0 <= explore_fresh <= 1 (0: off; got "
                              f"explore_fresh={explore_fresh})")
        # While off: once this share of the decode rows joined after the last re-try, the backoff starts
        # afresh (a re-try speaks for the requests it ran on; 0: off)
        self.explore_fresh = float(explore_fresh)
        self._retry_rows: frozenset | None = None  # the rows of the last re-try
        self.fresh_resets = 0  # backoffs started afresh by explore_fresh
        self.prior_ema = float(prior_ema)
        self.time_ema = float(time_ema)
        self.observed: dict[tuple[int, int], float] = {}  # (k, table batch) -> EMA of served step ms
        self.profile_context = int(profile_context)
        self.table: dict[int, list[tuple[int, float]]] | None = None  # k -> [(batch, ms)], batch ascending
        self._catch_up_fwd: dict[int, float] = {}  # {token bucket: ms} of a catch-up forward (catch_up_table_)
        self.accept: dict[int, float | None] = {k: None for k in ks}  # prior: all requests' rows
        self.row_accept: dict[int, dict] = {k: {} for k in ks}  # k -> {request id: its own a(k)}
        self._rows = None  # the row ids of the last choose(), whose estimates row_accept holds
        self._unpruned = False  # an update started a row's own estimate since the last choose()
        self.last = 0  # k of the previous choice
        self.off_steps = 0  # consecutive k = 0 choices
        self.n_choices = 0  # choose() calls with decode rows
        self.n_switches = 0  # ... whose k differed from the previous one
        # the last SWITCH_LOG switches: choice number, batch, from / to, why, and per k the estimates compared
        self.switch_log: deque = deque(maxlen=SWITCH_LOG)

    # -- the step-time table ----------------------------------------------------------------
    def calibrate_(self, profile, batches) -> None:
        """Fill the table: ``profile(batch, k)`` -> device ms per step (the engine's, at about
        ``profile_context`` tokens of context), for every k of ``ks`` and every batch size in
        ``batches`` (the engine's graph buckets)."""
        self.set_table({k: {int(b): float(profile(int(b), k)) for b in batches} for k in self.ks})

    def set_table(self, table: dict[int, dict[int, float]]) -> None:
        """Use a given step-time table {k: {batch: ms}} (e.g. from an earlier profile)."""
        missing = [k for k in self.ks if not table.get(k)]
        if missing:
            raise ConfigError(f"policy goodput: the step-time table has no entries for k in {missing}")
        self.table = {k: sorted((int(b), float(ms)) for b, ms in table[k].items()) for k in self.ks}
        self._buckets: dict[tuple[int, int], tuple[int, float]] = {}  # (k, batch) -> _bucket's row
        # ms per token of the cheapest k = 0 step: what a catch-up costs per backlog token when no
        # catch-up forwards were timed (catch_up_table_)
        self._catch_up_ms_per_token = min(ms / b for b, ms in self.table[0])

    def catch_up_table_(self, forward_ms: dict[int, float]) -> None:
        """Device ms of one catch-up forward per token bucket {tokens: ms} (the engine's graphed
        catch-up shapes, timed at start-up): what ``_catch_up_ms`` prices a backlog with. Without it
        a backlog token costs the cheapest k = 0 step's ms per row, a bound that is far off at small
        batches: H200 policy envelope at c33d9cd, EAGLE-3, C = 1 (max_batch_size 1, so the table's
        one bucket is batch 1): 0.57 ms a token, so the next prompt prefilled while off (~200
        tokens, one ~1 ms forward) was priced at ~110 ms, no switch back on paid for it, and
        goodput stayed at k = 0 from 2.5 s to the end of the run (69% of the steps; 0.77x of always)."""
        self._catch_up_fwd = {int(n): float(ms) for n, ms in sorted(forward_ms.items()) if n > 0}

    def _bucket(self, k: int, batch: int) -> tuple[int, float]:
        """(batch, ms) of the table row for batch: the smallest profiled batch >= it, else the largest
        (memoised: the table is fixed once set, and a step looks rows up ~10 times)."""
        hit = self._buckets.get((k, batch))
        if hit is not None:
            return hit
        rows = self.table[k]
        hit = next(((b, ms) for b, ms in rows if b >= batch), rows[-1])
        self._buckets[(k, batch)] = hit
        return hit

    def step_ms(self, k: int, batch: int) -> float:
        """t(k, batch): the served steps' average in batch's table bucket, else the start-up entry
        (for k > 0 plus the drafter's host work for batch rows, when shadow samples carried its cost
        per row: served steps include that time already)."""
        b, ms = self._bucket(k, batch)
        served = self.observed.get((k, b))
        if served is not None:
            return served
        if k > 0 and self.lookup_ms is not None:
            ms += batch * self.lookup_ms
        return ms

    def iter_ms(self, k: int, batch: int) -> float:
        """Wall ms an iteration at k and batch costs: the served iterations' average in the bucket (once
        there are iter_min_samples of them), else max(t(k, batch), the bucket's host ms per iteration),
        else t(k, batch). With
        ``serial_drafting`` (the engine's drafter drafts from the host's tokens, so its speculative
        steps wait for the step in flight and do the host's work before they launch) a k > 0
        iteration costs t(k, batch) plus the host ms: nothing overlaps."""
        b, _ = self._bucket(k, batch)
        if self.host_model:
            host = self._host_line(b, 1.0 if k == 0 else (self.accept.get(k) or 1.0))
            if host is not None:
                ms = self.step_ms(k, batch)
                return ms + host if k > 0 and self.serial_drafting else max(ms, host)
        served = self.iter_observed.get((k, b))
        if served is not None and (not self.iter_min_samples
                                   or self.iter_samples.get((k, b), 0) >= self.iter_min_samples):
            return served
        return self._iter_model(k, batch, b)

    def _host_line(self, b: int, per_row: float) -> float | None:
        """host_model: the fitted host ms of an iteration at table batch b committing per_row tokens a row (None:
        no fit yet). The slope needs iterations that committed different amounts (k > 0 steps); until then, and
        if it comes out negative, the line is flat at the mean."""
        fits = self._host_fit.get(b)
        if fits is None:
            return None
        (w, sx, _, sy, _), slow = fits
        mx, my = sx / w, sy / w
        # the slope from the long memory (the k = 0 point, one token a row, lies outside the spread of a k > 0
        # step's commits: a slope from the last ~1 / time_ema iterations alone swings the extrapolation there),
        # the level from the short one (it follows the host's speed)
        w2, sx2, sxx2, sy2, sxy2 = slow
        mx2, my2 = sx2 / w2, sy2 / w2
        var = sxx2 / w2 - mx2 * mx2
        slope = max(0.0, (sxy2 / w2 - mx2 * my2) / var) if var > 1e-6 else 0.0
        return my + slope * (per_row - mx)

    def _fit_host_(self, b: int, per_row: float, host_ms: float) -> None:
        """Fold one unmixed iteration into the host line of table batch b (weight time_ema for the newest; a sample
        counts as at most SERVED_OUTLIER times the line's estimate)."""
        fits = self._host_fit.get(b)
        if fits is None:
            first = [1.0, per_row, per_row * per_row, host_ms, per_row * host_ms]
            self._host_fit[b] = (first, list(first))
            return
        est = self._host_line(b, per_row)
        y = min(host_ms, SERVED_OUTLIER * est) if est else host_ms
        for f, keep in zip(fits, (1.0 - self.time_ema, 1.0 - self.time_ema * HOST_SLOPE_MEMORY)):
            for i, v in enumerate((1.0, per_row, per_row * per_row, y, per_row * y)):
                f[i] = keep * f[i] + v

    def _iter_model(self, k: int, batch: int, b: int) -> float:
        """iter_ms where the served iterations at (k, bucket b) do not price it (none, or fewer than
        iter_min_samples): t(k, batch) against the bucket's host ms per iteration (any k)."""
        ms = self.step_ms(k, batch)
        host = self.host_ms.get(b)
        if host is None:
            return ms
        return ms + host if k > 0 and self.serial_drafting else max(ms, host)

    def iteration_(self, k: int, batch: int, wall_ms: float, host_ms: float, mixed: bool = False,
                   switched: bool = False) -> None:
        """One engine iteration ran a decode step at k over ``batch`` rows in ``wall_ms`` of wall
        time, ``host_ms`` of it host work (the rest: waiting for the device). ``mixed``: it also ran
        (or, overlapped, waited for) a prefill or a switch back on (catch-up): not counted, since
        that work costs the same whatever k the step ran, and the first tries of every k fall in
        the start of a run, where every iteration prefills. H200, crossover_8b at a3b05ab, C = 16:
        tree16's first iterations averaged 37.8 ms against its 10.6 ms steps (prefills of 8B
        prompts), so goodput held tree48 (23.5 ms steps, 0.66x of always tree16). ``switched`` (with
        ``mixed``): the extra work was a switch (a resume, a catch-up, a step of another k or bucket
        waited for), which mixed_pricing leaves out of the prefilling iterations it prices by."""
        if self.mixed_pricing and self.table is not None and batch > 0 and k in self.table:
            prefilled = mixed and not switched
            keep = 1.0 - MIXED_MEMORY
            self._mixed_rate[0] = keep * self._mixed_rate[0] + (1.0 if prefilled else 0.0)
            self._mixed_rate[1] = keep * self._mixed_rate[1] + (self._last_commit[0] if self._last_commit else 0.0)
            if prefilled and self.time_ema > 0:
                b, _ = self._bucket(k, batch)
                old = self.mixed_observed.get((k, b))
                # the first sample at most FIRST_ITER_OUTLIER times the clean price, as for the unmixed ones
                sample = (min(wall_ms, FIRST_ITER_OUTLIER * self.iter_ms(k, batch)) if old is None
                          else min(wall_ms, SERVED_OUTLIER * old))
                self.mixed_observed[(k, b)] = sample if old is None else (1.0 - self.time_ema) * old + self.time_ema * sample
        if mixed or self.table is None or self.time_ema <= 0 or batch <= 0 or k not in self.table:
            return
        b, _ = self._bucket(k, batch)
        if self.host_model and self._last_commit is not None:
            self._fit_host_(b, self._last_commit[0] / self._last_commit[1], float(host_ms))
        old = self.host_ms.get(b)
        sample = host_ms if old is None else min(host_ms, SERVED_OUTLIER * old)
        self.host_ms[b] = sample if old is None else (1.0 - self.time_ema) * old + self.time_ema * sample
        # The mean of the first samples (the first at most FIRST_ITER_OUTLIER times the estimate),
        # then the EMA, a sample counting as at most SERVED_OUTLIER times the average: the estimate
        # max(step, host) misses what a step that cannot overlap the host costs (an n-gram step
        # drafts from the committed tokens: H200 envelope at a3b05ab, C = 64, tree 8 estimated at
        # 2.0 ms, served at 7.7 ms per iteration, was held on 14% of the steps while the clamped EMA
        # climbed there; 0.79x of never).
        n = self.iter_samples.get((k, b), 0)
        if self.iter_median:
            # The median of the recent iterations: robust to the heavy tail of wall times (H200 policy envelope
            # at ee0c300, n-gram on HumanEval, C = 16: clean chain 8 iterations averaged 1.68 ms in the per-step
            # records, the EMA ended at 2.29 ms and goodput ran k = 0 on 76% of its steps; always won 1.13x
            # over never there). First A/B (effdfcc, one seed, spec/policy_effdfcc): 0.931 -> 1.194 of the
            # envelope at C = 4, 1.019 -> 1.035 at C = 16; a full sweep is ++policy.iter_median=0,31.
            recent = self._iter_recent.setdefault((k, b), deque(maxlen=self.iter_median))
            # (the first at most FIRST_ITER_OUTLIER times the estimate, as for the EMA)
            recent.append(min(float(wall_ms), FIRST_ITER_OUTLIER * self.iter_ms(k, batch)) if n == 0 else float(wall_ms))
            self.iter_observed[(k, b)] = statistics.median(recent)
            self.iter_samples[(k, b)] = n + 1
            return
        # the running estimate (trusted by iter_ms or not yet: iter_min_samples), else the model
        old = self.iter_observed.get((k, b)) if n else None
        if old is None:
            old = self._iter_model(k, batch, b)
        sample = min(wall_ms, (FIRST_ITER_OUTLIER if n == 0 else SERVED_OUTLIER) * old)
        w = max(self.time_ema, 1.0 / (n + 1))
        self.iter_observed[(k, b)] = (1.0 - w) * old + w * sample
        self.iter_samples[(k, b)] = n + 1

    def counterfactual_(self, pairs: dict) -> None:
        """The engine will feed counterfactual samples (StepStats.counterfactual) for these pairs
        {(smaller k', k): "exact" | "lower_bound" | "approximate"}."""
        self.counterfactual_pairs = {(int(a), int(b)): str(v) for (a, b), v in pairs.items()}

    def shadowed_(self) -> None:
        """The engine will feed shadow samples (StepStats.shadow) from its steps (see shadow_due)."""
        self.shadowed = True

    def shadow_due(self) -> bool:
        """Whether the engine scores shadow drafts on this step. Every step while some k > 0 is
        within SHADOW_SLACK of k = 0 at the current batch; while every one trails by more, the gap
        between scorings grows by ``explore_backoff`` per scoring, up to ``explore_max`` steps (the
        re-tries' backoff), and a choice where speculation is close again resets it. The lookups are
        host work between steps: H200 policy envelope at 6238c1f, n-gram, C = 128, goodput at k = 0
        on 98% of its steps spent 0.75 s of host time outside its steps against never's 0.38 s (its
        3848 lookups 0.21 s of it) and ran 0.86x of never."""
        self._since_shadow += 1
        if self._since_shadow < self.shadow_gap:
            self.shadow_skipped += 1
            return False
        self._since_shadow = 0
        if self._spec_behind:
            self.shadow_gap = min(self.shadow_gap * self.explore_backoff, float(self.explore_max))
        return True

    # -- the policy -------------------------------------------------------------------------
    def expected(self, k: int, batch: int, rows=None) -> float | None:
        """Expected tokens a step at k commits over its rows (request ids ``rows``, else ``batch``
        rows at the prior); None: the prior of k is unknown."""
        if k == 0:
            return float(batch)
        prior = self.accept[k]
        if prior is None:
            return None
        if rows is None:
            return batch * prior
        own = self.row_accept[k]
        if rows is self._rows:  # choose()'s batch: own holds only its rows (pruned), summed in C
            return (sum(own.values()) + (batch - len(own)) * prior) * self.calibration(k)
        return sum(own.get(r, prior) for r in rows) * self.calibration(k)

    def calibration(self, k: int) -> float:
        """The factor on a batch's summed own a(k) (``calibrate``; 1.0 while off or before any sample): what
        observed steps committed over what the own estimates of their rows predicted, decayed per row."""
        num, den = self._calib[k]
        if not self.calibrate or den <= 0.0:
            return 1.0
        lo, hi = CALIBRATION_CLAMP
        return min(max(num / den, lo), hi)

    def rate(self, k: int, batch: int, rows=None) -> float | None:
        """Expected committed tokens per row per ms at k (None: a(k) unknown)."""
        a = self.expected(k, batch, rows)
        if a is None:
            return None
        it = self.iter_ms(k, batch)
        if self.mixed_pricing:
            it = self._blended_ms(k, batch, it, a)
        return a / batch / it

    def mixed_per_token(self) -> float | None:
        """mixed_pricing: iterations that also prefilled per committed token, over the recent iterations (None:
        none seen yet). A closed loop prefills once per request whatever k runs, so per token this is the
        workload's, and the share of an iteration's wall time it explains grows with the tokens a step commits."""
        mixed, tokens = self._mixed_rate
        return mixed / tokens if tokens > 0.0 and mixed > 0.0 else None

    def _blended_ms(self, k: int, batch: int, clean_ms: float, tokens: float) -> float:
        """mixed_pricing: what an iteration at k costs on average when min(1, f x a(k)) of the iterations also
        prefill (f: mixed_per_token), those at their own served average at (k, bucket), else at the clean price
        plus the bucket's mean (mixed - clean) over the ks served mixed there. H200 envelope at fd4df8d, n-gram on
        MT-bench, C = 64 (per-step records, experiments/iter_noise.py): ~78% of the full-batch iterations prefill,
        and there chain 8 cost 0.06-0.24 ms more than chain 4 against 0.2-0.5 ms in the unmixed ones that goodput
        priced them by: it ran chain 2 / 4 where always chain 8 made the envelope."""
        f = self.mixed_per_token()
        if f is None:
            return clean_ms
        b, _ = self._bucket(k, batch)
        mixed_ms = self.mixed_observed.get((k, b))
        if mixed_ms is None:
            gaps = [ms - self.iter_ms(j, batch) for (j, bb), ms in self.mixed_observed.items() if bb == b]
            if not gaps:
                return clean_ms
            mixed_ms = clean_ms + sum(gaps) / len(gaps)
        share = min(1.0, f * tokens)
        return (1.0 - share) * clean_ms + share * mixed_ms

    def choose(self, view: BatchView) -> int:
        if self.table is None:
            raise RuntimeError("policy goodput: no step-time table (the engine calls calibrate_ at start-up)")
        B = view.num_decode
        if B == 0:
            return self.last
        rows = view.rows
        if rows is not None and (self._unpruned or rows != self._rows):
            # Forget the requests that left the batch (set ops: no per-row Python loop); only when the
            # batch changed or an update since the last choice started a row's estimate (a step
            # launched before the last choice may have rows that left since)
            live = set(rows)
            for own in self.row_accept.values():
                for r in own.keys() - live:
                    del own[r]
            self._unpruned = False
        self._rows = rows
        # A k is tried until its prior covers probe_rows rows: one step at a small batch is a
        # sample of one or two rows (H200 envelope at a3b05ab, C = 2: tree32's first step accepted
        # 2.0 against its 4.1 under always, and goodput held tree16 all run at 0.95x).
        # A try waits for a batch where its step costs at most probe_cost plain steps (H200,
        # crossover_8b at 8ef8fbb, C = 256: tree48's first try ran at 128 rows, 176 ms against a
        # 7.2 ms plain step; with the other first tries there, 0.87x of never while off 98% of steps).
        # defer_first_tries: no first try while the requests still prefilling outnumber the decode rows
        # (a ramp-up, e.g. a closed loop's start: every client's first prompt queued at once). A try
        # there runs at a batch the ramp-up is about to fill, and its speculative steps make requests
        # finish out of step, so a closed loop stays out of step: H200 crossover_8b at c33d9cd, C = 256,
        # goodput's first tries in the ramp-up, then k = 0 on 96% of the steps, yet prefill forwards of
        # 1032 tokens against never's 1871 and 0.94x of never. experiments/sim_serving.py (the same
        # setting, no host time; scale/sim_serving_a967863.md): goodput 0.981 / 0.999 / 0.993 of the
        # envelope at C = 256 / 128 / 64, deferred 0.984 / 1.065 / 0.984, the same at C <= 32.
        if self.ramp_hold and view.num_prefilling > B:
            # A ramp-up (a closed loop's start, or a wave of requests that finished together being replaced):
            # the rows decoding now are the few that came first, and a k > 0 here speeds them ahead of the
            # rest, so the loop runs out of step from then on (its replacements prefill a few at a time, in
            # smaller forwards). H200 crossover_8b at 72c9090, C = 256: goodput ran chain 3 at 44-126 rows
            # through the ramp-up only, k = 0 in the whole window, and made 0.978-0.988 of never's tok/s
            # with a decode batch of 232-240 rows against 241-249.
            self.ramp_steps += 1
            self.off_steps += 1
            self._log_switch(0, B, rows, "ramp_hold")
            self.last = 0
            return 0
        ramp = self.defer_first_tries and view.num_prefilling > B
        untried = [k for k in self.ks[1:] if self.rows_seen[k] < self.probe_rows
                   and self.iter_ms(k, B) <= self.probe_cost * self.iter_ms(0, B)] if not ramp else []
        if untried and not self.shadowed:
            # With counterfactual samples, the largest untried k first: its steps also sample every
            # smaller k (which then may need no first try of its own).
            k = untried[-1] if self.counterfactual_pairs else untried[0]
            why = "first_try"
        elif self._probe_due(B, rows):
            # One step at the largest k for a request its prior has not seen (the k it interrupts stays
            # the one to switch from: the refresh's bookkeeping)
            k = self.ks[-1]
            self._refreshed, self._before_refresh = True, self.last
            self.request_probes += 1
            why = "request_probe"
        else:
            rates = {k: r for k in self.ks if (r := self.rate(k, B, rows)) is not None}
            spec = [r for j, r in rates.items() if j > 0]
            # behind: every k > 0 has an estimate and the best trails k = 0 by more than the slack
            self._spec_behind = len(spec) == len(self.ks) - 1 and max(spec) < (1.0 - SHADOW_SLACK) * rates[0]
            if not self._spec_behind:
                self.shadow_gap = 1.0
            if self.shadowed and self.last == 0:
                # A switch on from shadow estimates waits until a(k) rests on shadow_min_rows scored drafts
                # per decode row: a prior from a few dozen drafts of an n-gram's heavy-tailed acceptance
                # is noise, and a wrong switch costs in proportion to the batch (a host lookup per row
                # and a synchronous step). H200 policy envelope at 2aad171, n-gram on HumanEval, C = 128
                # (staggered loop): a(8) from ~35 drafts switched goodput to chain 8 at 125 rows, whose
                # steps took 14 ms against 2.4 ms at k = 0 and accepted 2.0 a row; 24 speculative steps
                # (340 ms, 8.5% of the window) before a(k) and the clamped step times caught up: 0.88x of never.
                # Without serial drafting (no host work per row: n-gram lookups on the device) a wrong switch
                # costs one overlapped step whose B exact samples correct a(k); the rows counted are capped
                # (shadow_rows_cap). H200 envelope at a46569a, n-gram on the device, HumanEval, C = 256: 2 x 256
                # scored drafts took 768 steps (3 s) at k = 0 while always ran 1.19x of never: 0.82 of the envelope.
                counted = B if self.serial_drafting or self.shadow_rows_cap is None else min(B, self.shadow_rows_cap)
                rates = {j: r for j, r in rates.items() if j == 0 or self.rows_seen[j] >= self.shadow_min_rows * counted}
            k = max(rates, key=rates.get)
            # After a refresh step the k to stay with is the one it interrupted.
            prev = self._before_refresh if self._refreshed else self.last
            if k != prev and prev in rates and rates[k] <= rates[prev] * (1.0 + self.margin):
                k = prev  # not enough gain to switch
            if k > 0 and self.last == 0 and not self._switch_pays(k, B, rates, view):
                k = 0  # the gain does not pay for the catch-up
            # A re-try that did not turn speculation on widens the gap to the next one (backoff):
            # under load every re-try costs a speculative step and the draft's catch-up over the
            # off period, so re-trying every explore_every steps forever costs a fixed share.
            if k > 0:
                self.explore_gap = float(self.explore_every)
            elif self._explored:
                self.explore_gap = min(self.explore_gap * self.explore_backoff, float(self.explore_max))
            elif (self.explore_fresh and rows and self._retry_rows is not None
                  and self.explore_gap > self.explore_every
                  and sum(r not in self._retry_rows for r in rows) >= self.explore_fresh * len(rows)):
                # A re-try's outcome (and its backoff) speaks for the requests it ran on: once enough of
                # the batch joined after it, the gap starts afresh. H200 envelope at f8cc0a4, EAGLE-3 on
                # MT-bench, C = 8: four off periods of 95 steps (re-tries after 32, then 64 more), 12%
                # of the steps at k = 0 where never ran 0.77 of always; 0.972 of the envelope.
                self.explore_gap = float(self.explore_every)
                self.fresh_resets += 1
            self._explored = False
            if (k == 0 and self.explore_every and not self.shadowed and len(rates) > 1
                    and self.off_steps + 1 >= self.explore_gap):
                j = max(self.ks[1:], key=lambda j: rates.get(j, 0.0))  # re-measure the best speculative k once
                # ... unless its catch-up costs more than explore_budget of the time spent off since
                # the last one (a re-try at a large batch catches up every row's backlog)
                if self._catch_up_ms(view) <= self.explore_budget * (self.off_steps + 1) * self.iter_ms(0, B):
                    k, self._explored = j, True
                    if self.explore_fresh and rows is not None:
                        self._retry_rows = frozenset(rows)
                else:
                    self.explore_gap = min(self.explore_gap * self.explore_backoff, float(self.explore_max))
                    self.off_steps = -1  # counted afresh from here
            k = self._refresh(k, B)
            why = "explore" if self._explored else "refresh" if self._refreshed else "estimates"
        self.off_steps = self.off_steps + 1 if k == 0 else 0
        self._log_switch(k, B, rows, why)
        self.last = k
        return k

    def _log_switch(self, k: int, B: int, rows, why: str) -> None:
        """Count a choice, and log it with the estimates it compared when it changes k (switch_log): per k the
        expected tokens per row a(k), the iteration ms and the resulting tokens per row per ms at batch B."""
        self.n_choices += 1
        if k == self.last:
            return
        self.n_switches += 1
        est = {}
        for j in self.ks:
            a = self.expected(j, B, rows)
            it = self.iter_ms(j, B)
            est[str(j)] = {"a": None if a is None else round(a / B, 4), "iter_ms": round(it, 4),
                           "rate": None if a is None else round(a / B / it, 5)}
        self.switch_log.append({"choice": self.n_choices, "batch": B, "from": self.last, "to": k, "why": why,
                                "k": est})

    def drafts_prefill(self) -> bool:
        """Whether the engine runs the draft over prompts it prefills while at k = 0 (``ramp_hold``: while some
        k has not had its first tries, so that they need no catch-up over every prompt of the batch; the
        engine's own rule, drafting only while the last step speculated, otherwise)."""
        return self.ramp_hold and not self.shadowed and any(self.rows_seen[k] < self.probe_rows for k in self.ks[1:])

    def _probe_due(self, B: int, rows) -> bool:
        """Whether this step probes the largest k (``probe_requests``): its prior rests on fewer requests
        than that, a live request has run PROBE_AGE decode steps without a step there, and a step there
        costs at most probe_cost plain steps. The first tries of a k cover probe_rows rows, at C = 1 all
        of one request, and a k that is not chosen learns nothing more (counterfactual samples only
        reach smaller ks): H200 policy envelope at ca37d2e, EAGLE-3 on MT-bench, C = 1: the first
        request's 5 rows put a(32) at 1.2 where always (tree 32) accepted 2.38, goodput never ran tree
        32 again, held k = 0 on 76% of its steps and chain 3 on the rest: 0.97x of always. Not with
        shadow samples (they score every k while off)."""
        if (not self.probe_requests or rows is None or self.shadowed
                or len(self.top_requests) >= self.probe_requests):
            if self._row_age:
                self._row_age = {}
            return False
        age = self._row_age
        for r in rows:
            age[r] = age.get(r, 0) + 1
        if len(age) > 2 * len(rows) + 64:  # requests that left the batch
            live = set(rows)
            self._row_age = age = {r: a for r, a in age.items() if r in live}
        top = self.ks[-1]
        if self.iter_ms(top, B) > self.probe_cost * self.iter_ms(0, B):
            return False
        return any(age[r] >= PROBE_AGE and r not in self.top_requests for r in rows)

    def _refresh(self, k: int, B: int) -> int:
        """While speculating below the largest k, run one step at the largest every ``refresh_gap`` steps
        (``refresh_every``, growing by ``explore_backoff`` up to ``explore_max`` after a refresh that
        did not switch), once its extra time is at most ``explore_budget`` of the steps since the last.
        a(k) of a k is learnt only from steps at k and, with counterfactual acceptance, from steps at
        larger ks: the largest k's estimate goes stale while a smaller one runs, and stays where its
        last steps left it. A greedy choice on such estimates keeps the arms it has seen at their low
        draws: H200 policy envelope at b48c50b, EAGLE-3 on HumanEval, C = 2: goodput held a(32) = 2.77
        where always (tree 32) accepted 3.59, flipped 42 times between trees 8 and 32 and ran 0.93x of
        always. A refresh step at the largest k updates it, and counterfactually every smaller one.
        Not with shadow samples (n-gram): those score every k on every step already."""
        top = self.ks[-1]
        was_refresh, self._refreshed = self._refreshed, False
        if k == top:  # chosen on its merits (after a refresh or not): the gap starts afresh
            self.refresh_gap, self.since_top = float(self.refresh_every), 0
            return k
        if was_refresh:  # the refresh did not move the choice to the largest k: wait longer next time
            self.refresh_gap = min(self.refresh_gap * self.explore_backoff, float(self.explore_max))
        if k == 0 or not self.refresh_every or self.shadowed:  # shadow samples keep every a(k) current
            self.since_top = 0
            return k
        self.since_top += 1
        if self.since_top < self.refresh_gap:
            return k
        extra = self.iter_ms(top, B) - self.iter_ms(k, B)
        if extra <= self.explore_budget * self.since_top * self.iter_ms(k, B):
            self.since_top, self._refreshed, self._before_refresh = 0, True, k
            self.refreshes += 1
            return top
        return k  # too dear at this batch for now: the allowance grows with every step below the largest

    def _catch_up_ms(self, view: BatchView) -> float:
        """Estimated ms of the catch-up a switch on runs first: the rows' draft backlog (tokens
        committed while off, prompts prefilled while off) through target + draft forwards: full
        forwards of the largest timed bucket and one of the smallest bucket holding the rest
        (catch_up_table_), else at the start-up table's cheapest per-token k = 0 step (0: no backlog
        given, a drafter that does not catch up)."""
        if view.backlog is None:
            return 0.0
        n = view.backlog()
        if not n:
            return 0.0
        if not self._catch_up_fwd:
            return n * self._catch_up_ms_per_token
        return forwards_ms(self._catch_up_fwd, n)

    def _switch_pays(self, k: int, B: int, rates: dict, view: BatchView) -> bool:
        """Whether switching on at k saves, over switch_horizon steps, more than its catch-up costs:
        a step at k commits B a(k) tokens in iter_ms(k), which at k = 0 would take B a(k) / (B
        rate(0)). H200 crossover_8b at 545917e, C = 256: goodput held k = 0 on 96% of the steps but
        its switches on caught up 176k tokens in 88 target forwards (7.6 s over a 9.5 s never run:
        0.56x of never)."""
        t = self.iter_ms(k, B)
        saving = rates[k] * t / rates[0] - t
        return self.switch_horizon * saving >= self._catch_up_ms(view)

    def describe(self) -> dict:
        """What the choices rest on, for run logs: the step-time table (ms by k and batch), the prior
        a(k) and the live requests' own estimates, the rows behind each prior (counterfactual ones
        also counted apart), the counterfactual pairs with their labels, and the last SWITCH_LOG switches of k with
        the estimates each compared (switch_log: why a run left a k it then came back to)."""
        return {"profile_context": self.profile_context, "time_every": self.time_every,
                "catch_up_forward_ms": dict(self._catch_up_fwd),
                "step_ms": {f"k={k}": dict(rows) for k, rows in (self.table or {}).items()},
                "served_step_ms": {f"k={k}": {b: ms for (kk, b), ms in sorted(self.observed.items()) if kk == k}
                                   for k in self.ks},
                "served_iter_ms": {f"k={k}": {b: ms for (kk, b), ms in sorted(self.iter_observed.items()) if kk == k}
                                   for k in self.ks},
                "served_iter_samples": {f"k={k}": {b: n for (kk, b), n in sorted(self.iter_samples.items()) if kk == k}
                                        for k in self.ks},
                "host_ms_per_iter": dict(sorted(self.host_ms.items())),
                "host_line": {b: {"at_1": self._host_line(b, 1.0), "per_token": self._host_line(b, 2.0)
                                  - self._host_line(b, 1.0)} for b in sorted(self._host_fit)},
                "accept": {f"k={k}": a for k, a in self.accept.items()},
                "calibration": {f"k={k}": self.calibration(k) for k in self.ks[1:]},
                "mixed_iter_ms": {f"k={k}": {b: ms for (kk, b), ms in sorted(self.mixed_observed.items()) if kk == k}
                                  for k in self.ks},
                "mixed_per_token": self.mixed_per_token(),
                "accept_rows_seen": {f"k={k}": n for k, n in self.rows_seen.items()},
                "shadow_samples": self.shadow_samples, "lookup_ms_per_row": self.lookup_ms,
                "shadow_skipped": self.shadow_skipped,
                "refreshes": self.refreshes, "fresh_resets": self.fresh_resets,
                "request_probes": self.request_probes, "probed_requests": len(self.top_requests),
                "counterfactual": bool(self.counterfactual_pairs),
                "counterfactual_rows": {f"k={k}": n for k, n in self.counterfactual_rows.items()},
                "counterfactual_pairs": {f"k={a}<k={b}": v for (a, b), v in sorted(self.counterfactual_pairs.items())},
                "accept_rows": {f"k={k}": {str(r): a for r, a in own.items()} for k, own in self.row_accept.items()},
                "choices_made": self.n_choices, "switches": self.n_switches, "switch_log": list(self.switch_log)}

    def update(self, stats: StepStats) -> None:
        if self.host_model or self.mixed_pricing:
            self._last_commit = (float(sum(stats.committed)), len(stats.committed)) if stats.committed else None
        if (stats.step_ms is not None and self.time_ema > 0 and self.table is not None and stats.num_decode
                and stats.k in self.table):
            b, table_ms = self._bucket(stats.k, stats.num_decode)
            old = self.observed.get((stats.k, b), table_ms)
            sample = min(stats.step_ms, SERVED_OUTLIER * old)  # a stalled step moves the average a little
            self.observed[(stats.k, b)] = (1.0 - self.time_ema) * old + self.time_ema * sample
        if stats.shadow:
            by_k: dict[int, list] = {}
            for k, r, c in stats.shadow:
                if k in self.accept:
                    by_k.setdefault(k, []).append((r, c))
            for k, pairs in by_k.items():
                self._observe_(k, [r for r, _ in pairs], [c for _, c in pairs])
            self.shadow_samples += len(stats.shadow)
            if stats.shadow_ms is not None:
                old = self.lookup_ms
                self.lookup_ms = stats.shadow_ms if old is None else (1.0 - self.ema) * old + self.ema * stats.shadow_ms
        # row_sample: this step's own estimates move for rows [start, start + row_sample) of it (wrapping)
        n = len(stats.committed) if stats.committed else 0
        start = None
        if self.row_sample and stats.rows is not None and n > self.row_sample:
            start = self._row_cursor % n
            self._row_cursor = start + self.row_sample
        if stats.counterfactual:
            for j, counts in sorted(stats.counterfactual.items()):
                if j in self.accept and counts:
                    self._observe_(j, stats.rows, counts, start)
                    self.counterfactual_rows[j] += len(counts)
        if stats.k == 0 or not stats.committed or stats.k not in self.accept:
            return
        if (self.probe_requests and stats.k == self.ks[-1] and stats.rows is not None
                and len(self.top_requests) < self.probe_requests):
            self.top_requests.update(stats.rows)
        self._observe_(stats.k, stats.rows, stats.committed, start)

    def _observe_(self, k: int, rows, committed, sample_from: int | None = None) -> None:
        """Fold tokens committed per row at k (served, or scored in the shadow) into the rows' own
        a(k) and the prior (``sample_from``: only rows [sample_from, sample_from + row_sample) of them,
        wrapping, move their own; the prior takes every row)."""
        n = len(committed)
        mean = sum(committed) / n
        prior = self.accept[k]
        if rows is not None:
            # With shadow samples (n-gram: every step scores drafts, and most accept nothing while a few
            # accept all k) a request's own a(k) keeps a longer memory, shadow_ema: with ema = 0.1 a
            # run of ~8 misses turns speculation off and the next repeat of text starts while off.
            # experiments/sim_shadow_bias.py (greedy SmolLM2 answers, the H200's C = 1 step times, six
            # draws of 16 of 32 prompts): goodput / envelope on HumanEval 0.967 (0.932 .. 1.000) at
            # 0.1, 1.012 (0.989 .. 1.040) at 0.03; MT-bench 1.001 / 1.004
            e = self.shadow_ema if self.shadowed else self.ema
            own = self.row_accept[k]
            start = mean if prior is None else prior
            if self.calibrate and prior is not None:
                # How far the rows' own estimates, as they stand before this step, missed what it committed.
                # They run low where a request's acceptance grows along its answer (an EMA of its past steps
                # lags): H200 envelope at fd4df8d, n-gram on MT-bench, C = 64, always chain 8: the sum
                # over a step's rows predicted 1 / 1.11 of what the step committed (EAGLE-3 at e5229cc,
                # C >= 32: 1 / 1.01 .. 1 / 1.04), and goodput left chain 8 for k = 0 on a(8) 4-11% below
                # what its last 40 steps committed (experiments/calibration_bias.py)
                pred = sum(own.get(r, prior) for r in rows)
                if pred > 0.0:
                    w = 1.0 - (1.0 - self.calibrate) ** n
                    cal = self._calib[k]
                    cal[0] = (1.0 - w) * cal[0] + w * mean
                    cal[1] = (1.0 - w) * cal[1] + w * pred / n
            size = len(own)
            pairs = zip(rows, committed)
            if sample_from is not None:  # row_sample: a window of the rows, in turn over steps
                end = sample_from + self.row_sample
                pairs = zip(rows[sample_from:end], committed[sample_from:end])
                if end > n:
                    pairs = chain(pairs, zip(rows[: end - n], committed[: end - n]))
            get, keep = own.get, 1.0 - e
            if sample_from is None:
                own.update(zip(rows, [keep * get(r, start) + e * c for r, c in pairs]))
            else:
                own.update([(r, keep * get(r, start) + e * c) for r, c in pairs])
            if len(own) != size:  # a row's first estimate: the next choose() prunes
                self._unpruned = True
        # The mean of the rows so far while they are few, then one prior_ema step per row.
        seen = self.rows_seen[k]
        w = max(n / (seen + n), 1.0 - (1.0 - self.prior_ema) ** n)
        self.rows_seen[k] = seen + n
        self.accept[k] = mean if prior is None else (1.0 - w) * prior + w * mean
