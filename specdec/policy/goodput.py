"""goodput: the k with the most expected committed tokens per second.

Every row of a step shares its k, so at decode batch B a step commits A(k) = sum over its rows of
a(k) tokens in t(k, B) ms, and the best k maximises A(k) / t(k, B):

  t(k, B)  what an iteration at k costs at the smallest profiled batch >= B. A start-up table of
           graphed steps for every k at every graph bucket (``calibrate_``, at ``profile_context``
           tokens of context), then the served steps and iterations: an EMA of the device step
           times the engine measures (``time_ema``), and of each iteration's wall time start to
           start (``iteration_``), which is what throughput pays: device time while the host keeps
           up, the host's own work when it does not. Iterations that also prefilled or switched
           speculation back on are left out (that work costs the same whatever k the step ran). A
           sample counts as at most SERVED_OUTLIER times the average, so one stalled step cannot
           turn speculation off in a bucket for the rest of a run.
  a(k)     tokens a step at k commits per row: 1 at k = 0; for k > 0 each request's own EMA,
           started from a prior over all requests' rows. Acceptance is a property of the request's
           text, so one request the draft cannot follow turns speculation off while it runs, not
           for the next one.

Where a(k) comes from:
  served steps       every step at k updates a(k) of its rows.
  counterfactual     a step at k also scores each smaller k' on its verified path (EAGLE-3 trees on
                     the device, nested n-gram chains on the host, replayed acceptance at the same
                     quantile), so one k's steps keep every smaller k current.
  shadow             with a drafter that scores drafts from the committed tokens (n-gram), steps
                     score drafts on the host while off, so a(k) stays current without re-tries.
  first tries        a k without samples runs until its prior covers ``probe_rows`` rows, at a
                     batch where its step costs at most ``probe_cost`` plain steps.
  request probes     until the largest k's prior rests on ``probe_requests`` requests, a request
                     that has decoded PROBE_AGE steps without a step there gets one: a k that is
                     never chosen learns nothing more, so one request's low first tries would
                     otherwise hold for the run.
  re-tries           while off without shadow samples, the best k > 0 runs once after
                     ``explore_every`` plain steps, the gap growing by ``explore_backoff`` after
                     each re-try that did not switch.

Switching: a switch needs a gain above ``margin`` over the previous k (a batch near the crossover
does not flip every step); a switch back on must save, over ``switch_horizon`` steps, the draft
catch-up it runs first; a re-try runs only if its catch-up costs at most ``explore_budget`` of
the time spent off. Decode rows only: prefills never count.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

from ..errors import ConfigError
from .base import BatchView, Policy, StepStats, options

PROBE_AGE = 8  # a request is probed once it has run this many decode steps (mid-answer)
SHADOW_SLACK = 0.2  # while the best k > 0 trails k = 0 by more than this share, shadow scoring backs off
SERVED_OUTLIER = 2.0  # a served step's duration counts as at most this many times the average
FIRST_ITER_OUTLIER = 4.0  # ... and the first served iteration at (k, bucket) as this many times the estimate
SWITCH_LOG = 64  # the last this many switches of k, with the estimates behind each (describe: switch_log)


def forwards_ms(forward_ms: dict[int, float], n: int) -> float:
    """ms of padded forwards over n tokens in all (a catch-up's backlog): full forwards of the largest
    token bucket, then one at the smallest bucket holding the rest, by ``forward_ms`` {token bucket: ms}."""
    buckets = sorted(forward_ms)
    full, rest = divmod(n, buckets[-1])
    return full * forward_ms[buckets[-1]] + (forward_ms[next(b for b in buckets if b >= rest)] if rest else 0.0)


@dataclass
class GoodputConfig:
    """goodput's options, each with its one default (conf/policy/goodput.yaml lists the keys; a null
    there takes the default here)."""

    # a(k)
    ema: float = 0.1  # weight of a request's newest step in its own a(k)
    shadow_ema: float = 0.03  # ... with shadow samples: a longer memory, since n-gram drafts mostly accept
    # nothing or everything, and a short run of misses would turn speculation off before the text repeats
    prior_ema: float = 0.01  # weight of each row's newest step in the all-requests prior of a(k)
    counterfactual: bool = True  # fold what each smaller k would have committed into its a(k)
    probe_rows: int = 4  # each k's first tries cover this many rows before its prior is trusted
    probe_cost: float = 4.0  # a first try waits for a batch where its step costs <= this many plain steps
    probe_requests: int = 16  # request probes until the largest k's prior covers this many requests (0: off)
    # t(k, B)
    profile_context: int = 512  # context tokens of the start-up table's steps (conf: auto, the workload's)
    profile_iters: int = 8  # timed graphed steps per start-up table entry (a CUDA device; else 1)
    time_ema: float = 0.1  # weight of the newest served step / iteration in t(k, B) (0: the table only)
    # switching
    margin: float = 0.03  # relative gain needed to switch away from the previous k
    switch_horizon: int = 32  # steps a switch on is expected to last: its catch-up must pay back within them
    explore_every: int = 32  # while off, re-try the best k > 0 after this many plain steps (0: never)
    explore_backoff: float = 2.0  # a re-try that leaves k = 0 the winner multiplies the gap by this ...
    explore_max: int = 1024  # ... up to this many steps
    explore_budget: float = 0.05  # a re-try runs only if its catch-up costs at most this share of the time off
    # shadow acceptance (a drafter that scores drafts from the committed tokens: n-gram)
    shadow_evals: int = 2  # drafts each step scores on the host (0: off)
    shadow_min_rows: float = 2.0  # a switch on waits until a(k) rests on this many scored drafts per decode row
    shadow_rows_cap: int = 16  # ... of at most this many rows when drafting does no host work per row (0: no cap)


def _need(ok: bool, want: str, cfg: GoodputConfig, *keys: str) -> None:
    if not ok:
        got = ", ".join(f"{k}={getattr(cfg, k)}" for k in keys)
        raise ConfigError(f"policy goodput: need {want} (got {got})")


def _check(c: GoodputConfig) -> None:
    _need(0 < c.ema <= 1 and 0 < c.shadow_ema <= 1 and 0 < c.prior_ema <= 1, "0 < ema, shadow_ema, prior_ema <= 1",
          c, "ema", "shadow_ema", "prior_ema")
    _need(0 <= c.time_ema <= 1, "0 <= time_ema <= 1 (0: the start-up table only)", c, "time_ema")
    _need(c.probe_rows >= 1 and c.probe_cost >= 1 and c.probe_requests >= 0,
          "probe_rows >= 1, probe_cost >= 1 and probe_requests >= 0", c, "probe_rows", "probe_cost", "probe_requests")
    _need(c.profile_context >= 1 and c.profile_iters >= 1, "profile_context >= 1 and profile_iters >= 1",
          c, "profile_context", "profile_iters")
    _need(c.margin >= 0 and c.switch_horizon >= 1 and c.explore_budget >= 0,
          "margin >= 0, switch_horizon >= 1 and explore_budget >= 0", c, "margin", "switch_horizon", "explore_budget")
    _need(c.explore_every >= 0 and c.explore_backoff >= 1 and c.explore_max >= c.explore_every,
          "explore_every >= 0, explore_backoff >= 1 and explore_max >= explore_every",
          c, "explore_every", "explore_backoff", "explore_max")
    _need(c.shadow_evals >= 0 and c.shadow_min_rows >= 0 and c.shadow_rows_cap >= 0,
          "shadow_evals, shadow_min_rows, shadow_rows_cap >= 0", c, "shadow_evals", "shadow_min_rows", "shadow_rows_cap")


class Goodput(Policy):
    """Pick the k that maximises expected committed tokens per second at this decode batch (see the
    module docstring). ``Goodput(ks, **options)``: options as in GoodputConfig."""

    name = "goodput"
    wants_step_ms = True
    wants_rows = True
    wants_step_table = True
    wants_catch_up_ms = True

    def __init__(self, ks, config: GoodputConfig | None = None, **given):
        cfg = options(GoodputConfig, {**(asdict(config) if config else {}), **given}, "goodput")
        ks = sorted({int(k) for k in ks} - {0})
        if not ks or ks[0] < 1:
            raise ConfigError(f"policy goodput: ks must list draft lengths >= 1, got {ks}")
        _check(cfg)
        self.config = cfg
        self.__dict__.update(asdict(cfg))  # the options, as attributes
        self.ks = (0, *ks)
        self.wants_counterfactual = cfg.counterfactual
        # what the engine tells it at start-up
        self.table: dict[int, list[tuple[int, float]]] | None = None  # k -> [(batch, ms)], batch ascending
        self._catch_up_fwd: dict[int, float] = {}  # {token bucket: ms} of a catch-up forward
        self.counterfactual_pairs: dict[tuple[int, int], str] = {}  # (k', k) -> label
        self.shadowed = False  # shadow samples come with the steps: no first tries, no re-tries
        self.serial_drafting = False  # speculative steps run after the host's work (n-gram, overlapped)
        # t(k, B) as served
        self.observed: dict[tuple[int, int], float] = {}  # (k, table batch) -> EMA of served step ms
        self.iter_observed: dict[tuple[int, int], float] = {}  # (k, table batch) -> EMA of iteration wall ms
        self.iter_samples: dict[tuple[int, int], int] = {}  # (k, table batch) -> unmixed iterations seen
        self.host_ms: dict[int, float] = {}  # table batch -> EMA of host ms per iteration (any k)
        self.lookup_ms: float | None = None  # EMA of the drafter's host ms per drafted row (shadow samples)
        # a(k)
        self.accept: dict[int, float | None] = {k: None for k in ks}  # prior: all requests' rows
        self.rows_seen: dict[int, int] = {k: 0 for k in ks}  # rows behind the prior
        self.row_accept: dict[int, dict] = {k: {} for k in ks}  # k -> {request id: its own a(k)}
        self.counterfactual_rows: dict[int, int] = {k: 0 for k in ks}
        self.shadow_samples = 0
        self._rows = None  # the row ids of the last choose(), whose estimates row_accept holds
        self._unpruned = False  # an update started a row's own estimate since the last choose()
        # request probes
        self.top_requests: set = set()  # requests with served rows at the largest k (up to probe_requests)
        self._row_age: dict = {}  # request id -> decode steps seen, while requests are probed
        self.request_probes = 0
        self._interrupted: int | None = None  # the k a probe step interrupted: the next choice switches from it
        # choices
        self.last = 0  # k of the previous choice
        self.off_steps = 0  # consecutive k = 0 choices
        self.explore_gap = float(self.explore_every)  # k = 0 steps until the next re-try
        self._explored = False  # the previous choice was a re-try
        self.shadow_gap = 1.0  # steps between shadow scorings (shadow_due)
        self._since_shadow = 0
        self._spec_behind = False  # the last choice: every k > 0 trailed k = 0 by more than SHADOW_SLACK
        self.shadow_skipped = 0
        self.n_choices = 0  # choose() calls with decode rows
        self.n_switches = 0  # ... whose k differed from the previous one
        self.switch_log: deque = deque(maxlen=SWITCH_LOG)

    # -- what the engine tells it ------------------------------------------------------------
    def calibrate_(self, profile, batches) -> None:
        """Fill the table: ``profile(batch, k)`` -> device ms per step, for every k of ks and every
        batch size in ``batches`` (the engine's graph buckets)."""
        self.set_table({k: {int(b): float(profile(int(b), k)) for b in batches} for k in self.ks})

    def set_table(self, table: dict[int, dict[int, float]]) -> None:
        """Use a given step-time table {k: {batch: ms}} (e.g. from an earlier profile)."""
        missing = [k for k in self.ks if not table.get(k)]
        if missing:
            raise ConfigError(f"policy goodput: the step-time table has no entries for k in {missing}")
        self.table = {k: sorted((int(b), float(ms)) for b, ms in table[k].items()) for k in self.ks}
        self._buckets: dict[tuple[int, int], tuple[int, float]] = {}  # (k, batch) -> _bucket's row
        # ms per token of the cheapest k = 0 step: a catch-up's price per backlog token when no
        # catch-up forwards were timed
        self._catch_up_ms_per_token = min(ms / b for b, ms in self.table[0])

    def catch_up_table_(self, forward_ms: dict[int, float]) -> None:
        """Device ms of one catch-up forward per token bucket {tokens: ms}: what a backlog is priced
        with. The per-row bound of the k = 0 table is far off at small batches (a whole prompt
        caught up in one forward would be priced as that many plain steps)."""
        self._catch_up_fwd = {int(n): float(ms) for n, ms in sorted(forward_ms.items()) if n > 0}

    def counterfactual_(self, pairs: dict) -> None:
        """The engine will feed counterfactual samples for these pairs {(smaller k', k): label}."""
        self.counterfactual_pairs = {(int(a), int(b)): str(v) for (a, b), v in pairs.items()}

    def shadowed_(self) -> None:
        self.shadowed = True

    def serial_drafting_(self, serial: bool) -> None:
        self.serial_drafting = bool(serial)

    def shadow_due(self) -> bool:
        """Whether the engine scores shadow drafts on this step: every step while some k > 0 is within
        SHADOW_SLACK of k = 0; while every one trails by more, the gap between scorings grows by
        explore_backoff per scoring up to explore_max (the lookups are host work between steps)."""
        self._since_shadow += 1
        if self._since_shadow < self.shadow_gap:
            self.shadow_skipped += 1
            return False
        self._since_shadow = 0
        if self._spec_behind:
            self.shadow_gap = min(self.shadow_gap * self.explore_backoff, float(self.explore_max))
        return True

    def iteration_(self, k: int, batch: int, wall_ms: float, host_ms: float, mixed: bool = False) -> None:
        """One engine iteration ran a decode step at k over ``batch`` rows in ``wall_ms``, ``host_ms``
        of it host work. A ``mixed`` one (it also prefilled or switched speculation back on) is left
        out: the first tries of every k fall at the start of a run, where every iteration prefills."""
        if mixed or self.table is None or self.time_ema <= 0 or batch <= 0 or k not in self.table:
            return
        b, _ = self._bucket(k, batch)
        old = self.host_ms.get(b)
        sample = host_ms if old is None else min(host_ms, SERVED_OUTLIER * old)
        self.host_ms[b] = sample if old is None else (1.0 - self.time_ema) * old + self.time_ema * sample
        # The mean of the first samples (the first at most FIRST_ITER_OUTLIER times the model's estimate),
        # then the EMA: a step that cannot overlap the host costs more than max(step, host) suggests
        n = self.iter_samples.get((k, b), 0)
        old = self.iter_observed.get((k, b)) if n else None
        if old is None:
            old = self._iter_model(k, batch, b)
        sample = min(wall_ms, (FIRST_ITER_OUTLIER if n == 0 else SERVED_OUTLIER) * old)
        w = max(self.time_ema, 1.0 / (n + 1))
        self.iter_observed[(k, b)] = (1.0 - w) * old + w * sample
        self.iter_samples[(k, b)] = n + 1

    # -- t(k, B) -----------------------------------------------------------------------------
    def _bucket(self, k: int, batch: int) -> tuple[int, float]:
        """(batch, ms) of the table row for batch: the smallest profiled batch >= it, else the largest
        (memoised: the table is fixed once set, and a step looks rows up ~10 times)."""
        hit = self._buckets.get((k, batch))
        if hit is None:
            rows = self.table[k]
            hit = self._buckets[(k, batch)] = next(((b, ms) for b, ms in rows if b >= batch), rows[-1])
        return hit

    def step_ms(self, k: int, batch: int) -> float:
        """t(k, batch) of the device step: the served steps' average in batch's bucket, else the start-up
        entry (for k > 0 plus the drafter's host work for batch rows, when shadow samples carried its
        cost per row: served steps include that time already)."""
        b, ms = self._bucket(k, batch)
        served = self.observed.get((k, b))
        if served is not None:
            return served
        if k > 0 and self.lookup_ms is not None:
            ms += batch * self.lookup_ms
        return ms

    def iter_ms(self, k: int, batch: int) -> float:
        """Wall ms an iteration at k and batch costs: the served iterations' average in the bucket,
        else the model (_iter_model)."""
        b, _ = self._bucket(k, batch)
        served = self.iter_observed.get((k, b))
        return served if served is not None else self._iter_model(k, batch, b)

    def _iter_model(self, k: int, batch: int, b: int) -> float:
        """t(k, batch) against the bucket's host ms per iteration (any k): the larger of the two while
        they overlap; with serial drafting a k > 0 iteration costs both (nothing overlaps)."""
        ms = self.step_ms(k, batch)
        host = self.host_ms.get(b)
        if host is None:
            return ms
        return ms + host if k > 0 and self.serial_drafting else max(ms, host)

    # -- a(k) --------------------------------------------------------------------------------
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
            return sum(own.values()) + (batch - len(own)) * prior
        return sum(own.get(r, prior) for r in rows)

    def rate(self, k: int, batch: int, rows=None) -> float | None:
        """Expected committed tokens per row per ms at k (None: a(k) unknown)."""
        a = self.expected(k, batch, rows)
        return None if a is None else a / batch / self.iter_ms(k, batch)

    def update(self, stats: StepStats) -> None:
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
        for j, counts in sorted((stats.counterfactual or {}).items()):
            if j in self.accept and counts:
                self._observe_(j, stats.rows, counts)
                self.counterfactual_rows[j] += len(counts)
        if stats.k == 0 or not stats.committed or stats.k not in self.accept:
            return
        if (self.probe_requests and stats.k == self.ks[-1] and stats.rows is not None
                and len(self.top_requests) < self.probe_requests):
            self.top_requests.update(stats.rows)
        self._observe_(stats.k, stats.rows, stats.committed)

    def _observe_(self, k: int, rows, committed) -> None:
        """Fold tokens committed per row at k (served, counterfactual or scored in the shadow) into the
        rows' own a(k) and the prior: the mean of the rows while they are fewer than 1 / prior_ema, then
        one prior_ema step per row (one first step does not set it)."""
        n = len(committed)
        mean = sum(committed) / n
        prior = self.accept[k]
        if rows is not None:
            e = self.shadow_ema if self.shadowed else self.ema
            own = self.row_accept[k]
            start = mean if prior is None else prior
            size, get, keep = len(own), own.get, 1.0 - e
            own.update(zip(rows, [keep * get(r, start) + e * c for r, c in zip(rows, committed)]))
            if len(own) != size:  # a row's first estimate: the next choose() prunes
                self._unpruned = True
        seen = self.rows_seen[k]
        w = max(n / (seen + n), 1.0 - (1.0 - self.prior_ema) ** n)
        self.rows_seen[k] = seen + n
        self.accept[k] = mean if prior is None else (1.0 - w) * prior + w * mean

    # -- the choice ----------------------------------------------------------------------------
    def choose(self, view: BatchView) -> int:
        if self.table is None:
            raise RuntimeError("policy goodput: no step-time table (the engine calls calibrate_ at start-up)")
        B, rows = view.num_decode, view.rows
        if B == 0:
            return self.last
        self._prune_(rows)
        untried = [k for k in self.ks[1:] if self.rows_seen[k] < self.probe_rows
                   and self.iter_ms(k, B) <= self.probe_cost * self.iter_ms(0, B)]
        if untried and not self.shadowed:
            # With counterfactual samples the largest untried k first: its steps sample every smaller one.
            k, why = untried[-1] if self.counterfactual_pairs else untried[0], "first_try"
        elif self._probe_due(B, rows):
            k, why = self.ks[-1], "request_probe"
            self._interrupted = self.last
            self.request_probes += 1
        else:
            k, why = self._by_estimates(B, rows, view)
        self.off_steps = self.off_steps + 1 if k == 0 else 0
        self._log_switch(k, B, rows, why)
        self.last = k
        return k

    def _prune_(self, rows) -> None:
        """Forget the requests that left the batch (set ops: no per-row Python loop); only when the batch
        changed or an update since the last choice started a row's estimate (a step launched before the
        last choice may have rows that left since)."""
        if rows is not None and (self._unpruned or rows != self._rows):
            live = set(rows)
            for own in self.row_accept.values():
                for r in own.keys() - live:
                    del own[r]
            self._unpruned = False
        self._rows = rows

    def _by_estimates(self, B: int, rows, view: BatchView) -> tuple[int, str]:
        """The k of the best rate, held back by the margin, the catch-up a switch on costs, and shadow
        estimates that rest on too few drafts; while off, a re-try now and then."""
        rates = {k: r for k in self.ks if (r := self.rate(k, B, rows)) is not None}
        spec = [r for j, r in rates.items() if j > 0]
        self._spec_behind = len(spec) == len(self.ks) - 1 and max(spec) < (1.0 - SHADOW_SLACK) * rates[0]
        if not self._spec_behind:
            self.shadow_gap = 1.0
        if self.shadowed and self.last == 0:
            # A switch on from shadow estimates waits until a(k) rests on shadow_min_rows scored drafts per
            # decode row: a prior from a few dozen drafts of n-gram's heavy-tailed acceptance is noise, and a
            # wrong switch costs in proportion to the batch. Without serial drafting a wrong switch costs one
            # overlapped step whose B exact samples correct a(k), so the rows counted are capped.
            counted = B if self.serial_drafting or not self.shadow_rows_cap else min(B, self.shadow_rows_cap)
            rates = {j: r for j, r in rates.items() if j == 0 or self.rows_seen[j] >= self.shadow_min_rows * counted}
        k = max(rates, key=rates.get)
        prev = self.last if self._interrupted is None else self._interrupted
        self._interrupted = None
        if k != prev and prev in rates and rates[k] <= rates[prev] * (1.0 + self.margin):
            k = prev  # not enough gain to switch
        if k > 0 and self.last == 0 and not self._switch_pays(k, B, rates, view):
            k = 0  # the gain does not pay for the catch-up
        k = self._explore(k, B, rates, view)
        return k, "explore" if self._explored else "estimates"

    def _explore(self, k: int, B: int, rates: dict, view: BatchView) -> int:
        """While off, re-measure the best speculative k once every explore_gap steps (without shadow
        samples: they keep a(k) current), unless its catch-up costs more than explore_budget of the
        time spent off since the last one. A re-try that did not turn speculation on widens the gap:
        under load every re-try costs a speculative step and the draft's catch-up."""
        if k > 0:
            self.explore_gap = float(self.explore_every)
        elif self._explored:
            self.explore_gap = min(self.explore_gap * self.explore_backoff, float(self.explore_max))
        self._explored = False
        if (k == 0 and self.explore_every and not self.shadowed and len(rates) > 1
                and self.off_steps + 1 >= self.explore_gap):
            if self._catch_up_ms(view) <= self.explore_budget * (self.off_steps + 1) * self.iter_ms(0, B):
                self._explored = True
                return max(self.ks[1:], key=lambda j: rates.get(j, 0.0))
            self.explore_gap = min(self.explore_gap * self.explore_backoff, float(self.explore_max))
            self.off_steps = -1  # counted afresh from here
        return k

    def _probe_due(self, B: int, rows) -> bool:
        """Whether this step probes the largest k for a request its prior has not seen (probe_requests):
        the prior rests on fewer requests than that, a live request has run PROBE_AGE decode steps
        without a step there, and a step there costs at most probe_cost plain steps. Not with shadow
        samples (they score every k while off)."""
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

    def _catch_up_ms(self, view: BatchView) -> float:
        """Estimated ms of the catch-up a switch on runs first: the rows' draft backlog (tokens committed
        or prompts prefilled while off) through full forwards of the largest timed bucket and one of the
        smallest bucket holding the rest (catch_up_table_), else at the start-up table's cheapest
        per-token k = 0 step (0: no backlog given, a drafter that does not catch up)."""
        n = view.backlog() if view.backlog is not None else 0
        if not n:
            return 0.0
        if not self._catch_up_fwd:
            return n * self._catch_up_ms_per_token
        return forwards_ms(self._catch_up_fwd, n)

    def _switch_pays(self, k: int, B: int, rates: dict, view: BatchView) -> bool:
        """Whether switching on at k saves, over switch_horizon steps, more than its catch-up costs: a
        step at k commits B a(k) tokens in iter_ms(k), which at k = 0 would take B a(k) / (B rate(0))."""
        t = self.iter_ms(k, B)
        saving = rates[k] * t / rates[0] - t
        return self.switch_horizon * saving >= self._catch_up_ms(view)

    def _log_switch(self, k: int, B: int, rows, why: str) -> None:
        """Count a choice, and log it with the estimates it compared when it changes k (switch_log): per k
        the expected tokens per row a(k), the iteration ms and the resulting tokens per row per ms."""
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

    def describe(self) -> dict:
        """What the choices rest on, for run logs: the step-time table, the served step and iteration
        times, the prior a(k) and the live requests' own estimates, the rows behind each prior, the
        counterfactual pairs with their labels, and the last SWITCH_LOG switches of k."""
        def by_k(d):
            return {f"k={k}": {b: v for (kk, b), v in sorted(d.items()) if kk == k} for k in self.ks}

        return {"profile_context": self.profile_context,
                "catch_up_forward_ms": dict(self._catch_up_fwd),
                "step_ms": {f"k={k}": dict(rows) for k, rows in (self.table or {}).items()},
                "served_step_ms": by_k(self.observed), "served_iter_ms": by_k(self.iter_observed),
                "served_iter_samples": by_k(self.iter_samples),
                "host_ms_per_iter": dict(sorted(self.host_ms.items())),
                "accept": {f"k={k}": a for k, a in self.accept.items()},
                "accept_rows_seen": {f"k={k}": n for k, n in self.rows_seen.items()},
                "shadow_samples": self.shadow_samples, "lookup_ms_per_row": self.lookup_ms,
                "shadow_skipped": self.shadow_skipped,
                "request_probes": self.request_probes, "probed_requests": len(self.top_requests),
                "counterfactual": bool(self.counterfactual_pairs),
                "counterfactual_rows": {f"k={k}": n for k, n in self.counterfactual_rows.items()},
                "counterfactual_pairs": {f"k={a}<k={b}": v for (a, b), v in sorted(self.counterfactual_pairs.items())},
                "accept_rows": {f"k={k}": {str(r): a for r, a in own.items()} for k, own in self.row_accept.items()},
                "choices_made": self.n_choices, "switches": self.n_switches, "switch_log": list(self.switch_log)}
