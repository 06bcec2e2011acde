"""The serving engine: one model, one KV cache, one DecodeState, a scheduler and a stepper.

    engine = Engine(model, EngineConfig(max_batch_size=64), eos_ids={2})
    engine.add_request([1, 2, 3], max_new_tokens=32)
    for req in engine.run_until_done():
        print(req.id, req.output_ids, req.finish_reason)

``step()`` is one iteration: make room for the decode rows (preempting if needed), admit, run a
prefill forward over this iteration's chunks, run the decode step (k = 0) over every decode row,
commit the tokens. It returns the requests that finished in it. Each iteration appends a record
to the step trace (batch size, bucket, k, prefill tokens, phase milliseconds, queue lengths).

Overlapped decoding (``EngineConfig.overlap``; auto: on with CUDA graphs): an iteration queues its
decode step, then reads back and commits the previous iteration's step while the GPU runs, so the
host's commit, finish and scheduling work no longer leaves the GPU idle between steps. A drafter
that drafts from the host's tokens (n-gram) needs the newest ones: before each of its speculative
steps the engine commits the step in flight first, so those steps run synchronously with the
drafter's full context, while its k = 0 steps (speculation switched off under load) overlap.
Everything the step needs lives on the device (pending token, seq_lens, page table); the host
only lags one step in what it knows: a row holds pages for two steps ahead, a request that
finishes is seen one iteration late (the extra step computed for it is dropped), and tokens of a
request that left the batch (finish, abort, preemption) after a launch are dropped by its row
epoch. Greedy output is the same either way.

Start-up builds everything a run needs (specdec.engine.build): the KV pool, CUDA graphs for every k
the policy may pick at every batch bucket, the prefill paths the policy can reach, and the policy's
own start-up measurements; a step then only selects graphs.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from ..errors import ConfigError, config_flag, config_number
from ..policy.base import BatchView, StepStats
from ..spec.base import RowTokens, catches_up, extends_at_k0, prefills
from ..spec.base import needs_context as drafter_needs_context
from ..spec.sampling import SamplingParams
from . import build, profiling
from .graphs import bucket_for, make_buckets
from .kv_cache import KVCache, pages_for, size_pool
from .scheduler import Request, Scheduler
from .shadow import ShadowAcceptance
from .state import DecodeState
from .step import PhaseTimer, PrefillChunk, Stepper


@dataclass
class EngineConfig:
    max_batch_size: int = 256  # most requests in flight (prefilling + decoding); the largest bucket
    page_size: int = 16  # KV slots per page
    kv_cache_tokens: int | None = None  # pool size in slots; None: see kv_cache.size_pool
    kv_memory_fraction: float = 0.5  # GPU: share of free memory (after weights) for the pool
    prefill_chunk: int = 2048  # prompt tokens per prefill forward (chunked prefill budget)
    cuda_graphs: bool | str = "auto"  # auto: on for CUDA with Triton kernels, off on the CPU
    graph_buckets: tuple[int, ...] | None = None  # None: 1, 2, 4, ..., 256 (capped at max_batch_size)
    max_seq_len: int | None = None  # prompt + output bound; None: the model's max_position_embeddings
    temperature: float = 0.0  # 0 = greedy
    # Sampling warpers after temperature (specdec.spec.sampling): top-k, top-p, min-p; 0 / 1 / 0 = off
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    # Requests may bring their own sampling parameters (add_request(sampling=...)): steps then sample
    # every row through the warper kernel (a greedy row one-hot: still token-identical to argmax)
    per_request_sampling: bool = False
    seed: int = 0  # sampling generator seed
    max_tree_tokens: int = 1  # slots one step writes per request (k = 0: the pending token); the
    # engine raises it to the drafter's largest tree
    pad_eager: bool = False  # eager decode and prefill padded to the buckets (tests the graphed shapes on CPU)
    # Prefill forwards graphed (padded) at these token counts x request counts; see PaddedPrefill
    prefill_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048)  # capped at prefill_chunk
    prefill_requests: tuple[int, ...] = (1, 8, 64)
    # Graphed prefill: time each token bucket at start-up and prefill a plan's tokens only up to the
    # bucket below where padding costs more than a second forward (PaddedPrefill.fit_tokens)
    prefill_fit: bool = True
    # Overlapped decoding: launch step i + 1 before reading step i's tokens, so the host's work
    # (commit, finishes, scheduling) runs while the GPU computes. auto: on with CUDA graphs (a
    # host-context drafter's speculative steps still commit the step in flight first); true forces
    # it (also on the CPU, for tests).
    overlap: bool | str = "auto"

    @classmethod
    def from_cfg(cls, engine_cfg, *, temperature: float = 0.0, seed: int = 0, sampling=None,
                 per_request_sampling: bool = False) -> "EngineConfig":
        """From the Hydra ``engine`` group (keys this class lacks, e.g. max_new_tokens, are skipped)
        and the ``sampling`` group (specdec.spec.sampling.KEYS, and ``per_request``: true, false or
        auto, which the run resolves from its requests and reads false here; None: ``temperature``
        alone). A value of the wrong type is a ConfigError naming the key."""
        get = engine_cfg.get
        sampling = {"temperature": temperature} if sampling is None else dict(sampling)
        per_request = sampling.pop("per_request", False)
        per_request = per_request_sampling or (per_request != "auto" and config_flag("sampling.per_request", per_request))
        params = SamplingParams.from_mapping(sampling)

        def num(key, default, kind=int, minimum=None):
            return config_number(f"engine.{key}", get(key, default), kind, minimum)

        def ints(key, default, minimum=1):
            v = get(key, default)
            if v is None:
                return None
            try:
                items = list(v)
            except TypeError:
                raise ConfigError(f"engine.{key}={v!r}: must be a list of integers") from None
            return tuple(config_number(f"engine.{key}", b, int, minimum) for b in items)

        return cls(
            max_batch_size=num("max_batch_size", 256, minimum=1),
            page_size=num("page_size", 16, minimum=1),
            kv_cache_tokens=num("kv_cache_tokens", None, minimum=1),
            kv_memory_fraction=num("kv_memory_fraction", 0.5, float),
            prefill_chunk=num("prefill_chunk", 2048, minimum=1),
            cuda_graphs=get("cuda_graphs", "auto"),
            graph_buckets=ints("graph_buckets", None),
            max_seq_len=num("max_seq_len", None, minimum=1),
            prefill_buckets=ints("prefill_graph_tokens", cls.prefill_buckets) or (),
            prefill_requests=ints("prefill_graph_requests", cls.prefill_requests) or (1,),
            prefill_fit=config_flag("engine.prefill_fit", get("prefill_fit", True)),
            overlap=get("overlap", "auto"),
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
            per_request_sampling=per_request,
            seed=config_number("seed", seed, int),
        )

    @property
    def sampling(self) -> SamplingParams:
        """The run's sampling parameters (what a request without its own samples with)."""
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p)

    @property
    def step_temperature(self) -> float | None:
        """How steps sample (specdec.engine.step.step_body_): one temperature for every row, no
        warper (0 = greedy: the argmax kernels), or None: each row its own parameters through the
        warper kernel (a warper is on, or requests may bring their own)."""
        s = self.sampling
        return None if self.per_request_sampling or (s.warps and not s.greedy) else s.temperature

    def validate(self) -> None:
        """Raise ConfigError naming the first field out of range (the engine calls this)."""
        for key, minimum in (("max_batch_size", 1), ("page_size", 1), ("prefill_chunk", 1),
                             ("kv_cache_tokens", 1), ("max_seq_len", 1)):
            config_number(f"engine.{key}", getattr(self, key), int, minimum)
        if not 0 < float(self.kv_memory_fraction) <= 1:
            raise ConfigError(f"engine.kv_memory_fraction={self.kv_memory_fraction}: must be in (0, 1]")
        SamplingParams.from_mapping(dataclasses.asdict(self.sampling))


def _use_graphs(setting, model) -> bool:
    cuda = model.device.type == "cuda"
    capturable = cuda and model.backend in ("auto", "triton")  # torch references sync on the host
    if setting in ("auto", None):
        return capturable
    if isinstance(setting, str):
        if setting.lower() not in ("true", "false"):
            raise ConfigError(f"engine.cuda_graphs={setting!r}; valid: auto, true, false")
        setting = setting.lower() == "true"
    if setting and not capturable:
        raise ConfigError("engine.cuda_graphs=true needs a CUDA device and Triton kernels "
                          f"(device {model.device}, engine.kernels={model.backend}); use auto or false")
    return bool(setting)


def _use_overlap(setting, graphed: bool, drafter) -> bool:
    """engine.overlap: auto -> on with CUDA graphs (where host time per step matters; measured).
    With a drafter that needs host context, its speculative steps still run synchronously (the
    step in flight is committed before it drafts; see Engine.step), so only its k = 0 steps
    overlap. Sampling stays exact and seeded runs reproduce themselves, but which draws a row
    gets depends on the mode (a dropped step also draws), as it already depends on the batch's
    composition."""
    if isinstance(setting, str):
        if setting.lower() not in ("auto", "true", "false"):
            raise ConfigError(f"engine.overlap={setting!r}; valid: auto, true, false")
        setting = None if setting.lower() == "auto" else setting.lower() == "true"
    if setting is None:
        return graphed
    return bool(setting)


class Engine:
    """Continuous-batching engine over one target model (see the module docstring).

    Args:
        model: a LlamaModel.
        config: EngineConfig.
        eos_ids: tokens that finish a request (unless it sets ignore_eos).
        detokenize: ids -> text, for stop strings.
        trace: called with one dict per iteration once its GPU timings are known.
        drafter, policy, ks: speculation: the drafter, the Policy that picks k per step (None: the
            caller passes k to step()), and further ks to prepare besides the policy's.
        acceptance: replayed acceptance (specdec.acceptance): each speculative row accepts a drawn length.
    """

    def __init__(self, model, config: EngineConfig | None = None, *, eos_ids: Iterable[int] = (),
                 detokenize: Callable[[list[int]], str] | None = None,
                 trace: Callable[[dict], None] | None = None, drafter=None, policy=None,
                 ks: Iterable[int] = (0,), acceptance=None):
        cfg = self.config = dataclasses.replace(config or EngineConfig())  # a copy: adjusted below
        cfg.validate()
        self.model, self.drafter, self.policy, self.acceptance, self.trace = model, drafter, policy, acceptance, trace
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        # Every k a policy may pick is known up front: its tree size is reserved and graphed now.
        self.ks = sorted({0, *(int(k) for k in ks), *(policy.ks if policy is not None else ())})
        if drafter is None and self.ks != [0]:
            raise ConfigError(f"speculation lengths {self.ks} need a drafter (draft=none)")
        if acceptance is not None and drafter is None:
            raise ConfigError("acceptance=replay replays what a drafter's trees accept, but draft=none")
        # The ks the policy's choose() can return (without a policy: any of ks): whether steps ever
        # speculate (k > 0) and ever rest (k = 0) decides which prefill paths are captured.
        reach = frozenset(self.ks if policy is None or policy.choices is None else policy.choices)
        self._speculates, self._rests = any(k > 0 for k in reach), 0 in reach
        tree_sizes = sorted({1} | {drafter.num_nodes(k) for k in self.ks if k > 0})
        cfg.max_tree_tokens = max(cfg.max_tree_tokens, tree_sizes[-1])
        use_graphs = _use_graphs(cfg.cuda_graphs, model)
        self.overlap = _use_overlap(cfg.overlap, use_graphs, drafter)
        max_pages, ahead = self._init_cache_()
        self.scheduler = Scheduler(self.kv, self.state, max_batch_size=cfg.max_batch_size,
                                   prefill_chunk=cfg.prefill_chunk, max_seq_len=self.max_seq_len,
                                   max_tree_tokens=ahead, detokenize=detokenize, **self._vocab())
        self.buckets = make_buckets(cfg.max_batch_size, cfg.graph_buckets)
        # Counterfactual acceptance: {T: Counterfactual} (empty: off) and the ks whose commits the host derives
        self._counterfactual, self._host_cf = build.plan_counterfactual(policy, drafter, acceptance, self.state)
        t0 = time.perf_counter()
        runner = build.decode_runner(model, self.state, self.kv, cfg, drafter, acceptance, self._counterfactual,
                                     self.buckets, tree_sizes, use_graphs)
        self.graphed = runner.graphed
        self.stepper = Stepper(model, self.kv, self.state, runner, temperature=cfg.step_temperature, drafter=drafter,
                               sampling=cfg.sampling.row())
        build.attach_prefill_runners_(self.stepper, model, self.kv, cfg, drafter, max_pages,
                                      speculates=self._speculates, rests=self._rests,
                                      timed_catch_up=policy is not None and policy.wants_catch_up_ms)
        self.startup_s = time.perf_counter() - t0  # graph capture (incl. kernel compiles)
        self._init_iterations_()
        self._init_policy_()
        self.startup_graph_captures = self.graph_captures()
        self.t0 = time.perf_counter()

    def _init_cache_(self) -> tuple[int, int]:
        """The KV pool, the DecodeState and the drafter's and replay's views of them. Returns the
        page-table width and the slots each decode row holds beyond its committed tokens: one step's
        tree, or two when overlapped (a step in flight, not yet read back, plus the one being launched)."""
        cfg, model = self.config, self.model
        max_pos = model.config.max_position_embeddings
        self.max_seq_len = max_pos if cfg.max_seq_len is None else int(cfg.max_seq_len)
        if not 1 <= self.max_seq_len <= max_pos:
            raise ConfigError(f"engine.max_seq_len={cfg.max_seq_len}: must be in 1..{max_pos} "
                              "(the model's max_position_embeddings)")
        num_pages = size_pool(model, page_size=cfg.page_size, kv_cache_tokens=cfg.kv_cache_tokens,
                              kv_memory_fraction=cfg.kv_memory_fraction)
        self.kv = KVCache(model, num_pages, cfg.page_size)
        ahead = cfg.max_tree_tokens * (2 if self.overlap else 1)
        # Page-table width: enough for the longest request the scheduler admits.
        max_pages = min(pages_for(self.max_seq_len + ahead, cfg.page_size), num_pages)
        self.state = DecodeState(cfg.max_batch_size, max_pages, cfg.page_size, model.device, cfg.seed,
                                 max_tree_nodes=cfg.max_tree_tokens)
        if self.drafter is not None:  # its KV pool mirrors the target's pages; its row state follows rows
            self.drafter.bind_(self.state, num_pages, cfg.page_size)
        if self.acceptance is not None:
            self.acceptance.bind_(self.state, self.drafter, self.ks)
        return max_pages, ahead

    def _vocab(self) -> dict:
        """The vocabulary prompt ids are checked against at admission: the target's, or a draft head's
        when smaller (it embeds target ids: a smaller one would read past its table)."""
        vocab, name = int(self.model.config.vocab_size), "the target's"
        head_cfg = getattr(getattr(self.drafter, "head", None), "config", None)
        if head_cfg is not None and int(getattr(head_cfg, "vocab_size", vocab)) < vocab:
            vocab, name = int(head_cfg.vocab_size), "the draft head's"
        return {"vocab_size": vocab, "vocab_name": name}

    def _init_iterations_(self) -> None:
        """What the iterations keep between them: launched steps, trace records, the last iteration's
        times for the policy, catch-up counters."""
        drafter = self.drafter
        self._timer = PhaseTimer(self.model.device)
        self._pending_trace: dict[int, dict] = {}
        self._trace_shadow: dict[int, list[int]] = {}  # shadow samples {k: commits} of the iteration's commits (trace)
        self._step_no = 0
        # Launched steps not yet committed, oldest first: with overlapped decoding the one in
        # flight; a step stays here until its commit has succeeded (see step()).
        self._unread: list = []
        self._ids = itertools.count()
        # Only a policy that learns from step times gets each decode step's duration, only one that
        # reads request ids gets them (a tuple of B ids per step is host work).
        self._policy_times = self.policy is not None and self.policy.wants_step_ms
        self._policy_rows = self.policy is not None and self.policy.wants_rows
        self._waited_s = 0.0  # this iteration's time blocked on the device (reading a step's tokens)
        self._iter_prev = None  # (k, rows, start, waited, mixed) of the last iteration that decoded
        self._extra_prev = False  # that iteration also prefilled or switched speculation on
        self._shape_prev = None  # (k, batch bucket) of the last step launched
        self._catches_up = catches_up(drafter)
        self._stages_rows = prefills(drafter)  # new decode rows take the draft state of their prefill
        self._synced_at_k0 = drafter is None or extends_at_k0(drafter)
        self.num_catch_ups = 0  # catch-up forwards run (draft KV extended over a backlog)
        self.catch_up_tokens = 0  # backlog tokens caught up
        # Prefill while speculation is off (the last decode step ran k = 0) skips the draft of a
        # drafter that catches up: the prompt joins the row's backlog, caught up if and when the row
        # drafts (the draft's prefill would cost every request, speculating or not).
        # k of the last decode step (None: none yet: prefill drafts, unless the policy never speculates)
        self._last_k: int | None = None if self._speculates else 0

    def _init_policy_(self) -> None:
        """Give the policy what it asked for: shadow samples (a drafter that scores drafts from the
        committed tokens), whether drafting is serial, its start-up step-time table and the catch-up
        forwards' times."""
        policy, drafter = self.policy, self.drafter
        self._shadow = None
        if policy is None:
            return
        if policy.shadow_evals and hasattr(drafter, "shadow_commits") and len(self.ks) > 1:
            self._shadow = ShadowAcceptance(drafter, self.ks, policy.shadow_evals)
            policy.shadowed_()
        # A drafter that drafts from the host's committed tokens runs its speculative steps
        # synchronously under overlapped decoding (see step()): their host work does not overlap.
        policy.serial_drafting_(self.overlap and drafter_needs_context(drafter))
        profiling.calibrate_policy_(self)
        catch_up = self.stepper.catch_up_runner
        if catch_up is not None and catch_up.forward_ms and policy.wants_catch_up_ms:
            policy.catch_up_table_(catch_up.forward_ms)


    # -- requests -------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], max_new_tokens: int, *, request_id: str | None = None,
                    stop: Iterable[str] = (), ignore_eos: bool = False,
                    arrival_s: float | None = None, sampling=None) -> Request:
        """Queue a request. One that can never run (a token id that is not an integer of the
        vocabulary, a duplicate id, too long for the cache, bad sampling parameters) comes back
        finished with ``error`` set naming the bad input (and is also returned by the next
        ``step()``); it never reaches a forward, and the others are unaffected.

        ``sampling``: this request's own parameters (a mapping of some of specdec.spec.sampling.KEYS
        over the engine's, or a SamplingParams); other than the engine's needs
        EngineConfig.per_request_sampling (steps then sample per row).

        ``arrival_s`` (a time.perf_counter() value, default now) is when the request is deemed to
        have arrived: open-loop drivers pass the scheduled arrival time, so queueing counts in TTFT.
        """
        try:  # integers only (a float is refused at admission, not truncated)
            max_new_tokens = operator.index(max_new_tokens) if not isinstance(max_new_tokens, bool) else max_new_tokens
        except TypeError:
            pass
        req = Request(id=str(next(self._ids)) if request_id is None else str(request_id),
                      prompt_ids=prompt_ids, max_new_tokens=max_new_tokens,
                      eos_ids=self.eos_ids, stop=tuple(stop), ignore_eos=bool(ignore_eos),
                      arrival_s=time.perf_counter() if arrival_s is None else float(arrival_s))
        req.sampling, why = self._request_sampling(sampling)
        self.scheduler.add_(req, error=why)
        return req

    def _request_sampling(self, sampling) -> tuple[tuple | None, str | None]:
        """(the request's parameter row or None for the engine's, why they are refused or None)."""
        if sampling is None:
            return None, None
        cfg = self.config
        try:
            params = sampling if isinstance(sampling, SamplingParams) else SamplingParams.from_mapping(
                sampling, "sampling", base=cfg.sampling)
        except ConfigError as e:
            return None, str(e)
        if params == cfg.sampling:
            return None, None
        if cfg.step_temperature is not None:
            return None, (f"sampling {params.as_dict()} differs from the engine's {cfg.sampling.as_dict()}, and "
                          "this engine samples every row alike: build it with per_request_sampling=True")
        return params.row(), None

    def abort(self, request_id: str) -> bool:
        """Stop a queued or running request now (finish_reason "abort"); False if not found."""
        return self.scheduler.abort_(str(request_id), time.perf_counter())

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.scheduler.finished) or bool(self._unread)

    @property
    def _inflight(self):
        """The launched step not yet committed (overlapped decoding), or None."""
        return self._unread[-1] if self._unread else None

    @property
    def undrafted_prefill_tokens(self) -> int:
        """Prompt tokens prefilled without the draft (while speculation was off; counted by the
        scheduler's prefill accounting, so it costs the iteration nothing)."""
        return self.scheduler.undrafted_prefill_tokens

    @property
    def num_running(self) -> int:
        return len(self.scheduler.admitted)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)


    # -- iterations -----------------------------------------------------------------------------
    def step(self, k: int | None = None) -> list[Request]:
        """One iteration (prefill chunks + one decode step with k draft tokens); returns requests
        finished in it. k None: the policy decides (from decode rows only), else 0.

        A step commits for every row or for none. If it raises (a launch, the drafter, verify, the
        policy's update, the host commit), the engine is left consistent: a launched step whose
        tokens were not committed stays queued (with overlapped decoding the step in flight is
        never dropped) and the next call commits it before anything else, so the caller may step
        again (every request's tokens come out as if nothing had happened) or stop, keeping what
        finished. Only a failure inside the device commit (kv_sync, the drafter's extend) leaves
        the device ahead of the host: a device error; stop then. A request whose own stop-string
        check raises fails alone (finish_reason "error")."""
        if k is not None and k not in self.ks:  # before anything changes
            raise ConfigError(f"k={k} was not configured for this engine (ks={self.ks}); every "
                              "speculation length must be known at start-up so its graphs exist")
        sched, no = self.scheduler, self._step_no
        self._step_no += 1
        t_start = time.perf_counter()
        self._report_iteration_(t_start)
        # A step whose commit raised in an earlier call commits first (the host catches up with the
        # device before anything else changes); with overlapped decoding the newest stays in flight.
        committed = self._commit_until_(1 if self.overlap else 0)
        # Pages for a k = 0 step (plus what a step in flight may still write); a speculative step tops
        # them up below, so rows hold no tree's slots while speculation is off.
        preempted = sched.ensure_decode_capacity_(self._ahead(0))
        sched.admit_(t_start)
        plan, roots, ready = self._prefill_(no)
        k = self._choose() if k is None else k
        needs_context = k > 0 and drafter_needs_context(self.drafter)
        # A drafter that catches up needs the exact backlog of every row before its first drafting
        # step after k = 0 steps: the host knows it once the k = 0 step in flight is committed
        # (one synchronous step per switch back on; steady speculation stays overlapped).
        resume = k > 0 and self._catches_up and self._inflight is not None and self._inflight.k == 0
        if self._unread and (needs_context or resume):
            # A drafter that drafts from the host's committed tokens sees them: the step in flight
            # commits first (its speculative steps run synchronously; its k = 0 steps stay
            # overlapped). Evictions may move rows: look the new rows up again.
            committed += self._commit_until_(0)
            row_of = {id(r): i for i, r in enumerate(sched.rows)}
            ready = [(r, row_of[id(r)]) for r, _ in ready]
        self._stage_new_rows_(ready, plan, roots)
        caught_up = self.num_catch_ups
        if k > 0:  # the tree's slots (may preempt: rows are looked up afresh below)
            preempted += sched.ensure_decode_capacity_(self._ahead(k))
            if self._catches_up:
                self._catch_up_()
        n = self.state.num_rows
        if n:
            self._last_k = k
            self._launch_(no, k, n, needs_context)
        # The steps whose tokens this iteration commits: this one, or with overlapped decoding the
        # previous one, read while the GPU runs this one (with no rows launched: all of them).
        committed += self._commit_until_(1 if self.overlap and n else 0)
        t_end = time.perf_counter()
        if n and self.policy is not None:
            self._note_iteration_(k, n, t_start, extra=bool(plan) or resume or self.num_catch_ups != caught_up)
        finished = sched.pop_finished()
        if self.trace is not None:
            self._trace_(no, k, n, t_start, t_end, plan, committed, finished, preempted)
        return finished

    def _report_iteration_(self, t_start: float) -> None:
        """Tell the policy the previous decoding iteration's times, start to start: its wall time
        includes what the caller did between steps (a closed-loop client's finishes and submits),
        which throughput pays too; its host work is that wall time less the waits for the device."""
        if self._iter_prev is not None:
            k, n, t_prev, waited_s, mixed = self._iter_prev
            wall_ms = (t_start - t_prev) * 1e3
            self.policy.iteration_(k, n, wall_ms, wall_ms - waited_s * 1e3, mixed=mixed)
            self._iter_prev = None
        self._waited_s = 0.0

    def _note_iteration_(self, k: int, n: int, t_start: float, extra: bool) -> None:
        """Keep this iteration's times for the policy (reported when the next one starts: see
        ``_report_iteration_``). An iteration that also prefilled, or switched speculation back on
        (waited for the step in flight, caught the draft up: ``extra``) is ``mixed``: its wall time is
        not what a steady step at k costs (prefill costs the same whatever k the decode step runs).
        Overlapped, an iteration queues its step and then waits for the one before, so its wall time
        is that step's: the next iteration after extra work is mixed too, and so is one whose step
        differs in k or batch bucket from the one it waited for (charged the other way, a re-try's
        speculative step would be priced at a plain iteration and the plain step after it at the
        speculative one)."""
        shape = (k, self._bucket(n))
        switched = self.overlap and self._shape_prev is not None and self._shape_prev != shape
        self._shape_prev = shape
        self._iter_prev = (k, n, t_start, self._waited_s, extra or switched or (self.overlap and self._extra_prev))
        self._extra_prev = extra

    def _choose(self) -> int:
        """The policy's k for this iteration's decode rows (0 without a policy)."""
        if self.policy is None:
            return 0
        sched = self.scheduler
        k = self.policy.choose(BatchView(num_decode=self.state.num_rows, num_waiting=len(sched.waiting),
                                         num_prefilling=max(0, len(sched.admitted) - self.state.num_rows),
                                         rows=tuple(r.id for r in sched.rows) if self._policy_rows else None,
                                         backlog=self._backlog if self._catches_up else None))
        if k not in self.ks:
            raise ConfigError(f"policy {self.policy.name} chose k={k}, not in its ks {self.ks}")
        return k

    def _prefill_(self, no: int):
        """This iteration's prefill chunks in one forward. While off, prompts skip the draft of a
        drafter that catches up (it catches them up if speculation resumes). Returns (the plan, the
        drafter's roots, the requests that became decode rows with their rows)."""
        sched = self.scheduler
        draft = not (self._catches_up and self._last_k == 0)
        plan = sched.plan_prefill(self.stepper.prefill_fit(draft) if self.config.prefill_fit else None)
        roots = None
        if plan:
            if self.trace is not None:
                self._timer.start(no, "prefill")
            roots = self.stepper.prefill_(sched.prefill_chunks(plan), draft=draft)
            if self.trace is not None:
                self._timer.stop(no, "prefill")
        return plan, roots, sched.finish_prefill_(plan, drafted=draft)

    def _stage_new_rows_(self, ready, plan, roots) -> None:
        """Each new decode row takes the draft state of its request's last prefill chunk. A row whose
        draft is behind (a drafter that catches up: prefilled while off) needs none: the catch-up
        stages it before it drafts. While off that is every new row but a 1-token prompt's."""
        if not (self._stages_rows and ready):
            return
        if self._catches_up:
            ready = [(r, row) for r, row in ready if r.draft_len == r.seq_len]
        if ready:
            chunk_of = {id(req): i for i, (req, _) in enumerate(plan)}
            self.drafter.stage_rows_(roots, [chunk_of.get(id(r), -1) for r, _ in ready], [row for _, row in ready])

    def _launch_(self, no: int, k: int, n: int, needs_context: bool) -> None:
        """Queue the decode step with k draft tokens over the n decode rows. If the launch raises,
        nothing is queued and the step in flight stays queued."""
        rows = self.scheduler.rows
        # Each row's committed tokens, named by request id (a drafter may keep per-request state: the
        # n-gram index)
        context = RowTokens(keys=[r.id for r in rows], parts=[(r.prompt_ids, r.output_ids) for r in rows]) \
            if needs_context else None
        launched = None
        if self.trace is not None:
            launched = lambda: self._timer.stop(no, "decode")  # noqa: E731
            self._timer.start(no, "decode")
        replay_cf = None
        if k > 0 and self.acceptance is not None:  # the rows' replayed lengths, before the launch
            self.acceptance.prepare_(self.state, n, k, [r.id for r in rows])
            replay_cf = self.acceptance.last_cf
        step = self.stepper.launch_(k, launched, context, timed=self._policy_times)
        if replay_cf:  # the replay's counterfactual commits, per smaller size, rows in launch order
            step.cf_by_k = replay_cf
        step.rows = [(r, r.row_epoch) for r in rows]
        self._unread.append(step)

    def _trace_(self, no, k, n, t_start, t_end, plan, committed, finished, preempted) -> None:
        """The iteration's step-trace record, emitted once its GPU timings are known."""
        sched = self.scheduler
        self._pending_trace[no] = dict(
            step=no, t_s=t_start - self.t0, step_ms=(t_end - t_start) * 1e3,
            decode_bs=n, bucket=self._bucket(n), k=k,
            prefill_tokens=sum(c for _, c in plan), prefill_reqs=len(plan),
            committed=sum(len(t) for _, toks, _ in committed for t in toks), finished=len(finished),
            preempted=preempted, accepted=[len(t) - 1 for kc, toks, _ in committed if kc > 0 for t in toks],
            accepted_ids=[i for kc, _, ids in committed if kc > 0 for i in ids],
            running=len(sched.admitted), waiting=len(sched.waiting), free_pages=self.kv.num_free,
            prefill_ms=0.0, decode_ms=0.0)
        if self._trace_shadow:  # what each k would have committed, scored in the shadow this iteration
            self._pending_trace[no]["shadow"] = {str(j): c for j, c in sorted(self._trace_shadow.items())}
            self._trace_shadow = {}
        self._emit_trace(wait=False)

    def _commit_until_(self, in_flight: int) -> list[tuple[int, list[list[int]], list[str]]]:
        """The commit point: commit launched steps, oldest first, until ``in_flight`` remain queued;
        returns (k, token lists, request ids) of each step committed."""
        done = []
        while len(self._unread) > in_flight:
            done.append(self._commit_oldest_())
        return done

    def _commit_oldest_(self) -> tuple[int, list[list[int]], list[str]]:
        """Read the oldest launched step's tokens (waits for it), feed the policy, commit them, and
        only then drop it from the queue (a commit that raises is retried by the next step());
        returns (its k, the token lists committed: rows still in the batch, their request ids)."""
        step = self._unread[0]
        if step.tokens is None:
            w0 = time.perf_counter()
            step.tokens = self.stepper.collect_(step)
            self._waited_s += time.perf_counter() - w0  # blocked on the device, not host work
        if self.policy is not None and not step.policy_fed:
            self.policy.update(self._step_stats(step))
            step.policy_fed = True
        # The rows commit_tokens_ keeps (still in the batch, same epoch): their ids go to the step trace.
        live = {id(r) for r in self.scheduler.rows} if self.trace is not None and step.k > 0 else ()
        ids = [r.id for r, e in step.rows if id(r) in live and r.row_epoch == e]
        kept = self.scheduler.commit_tokens_(step.rows, step.tokens, time.perf_counter(),
                                             drafted=step.k > 0 or self._synced_at_k0, stats=step.stats)
        self._unread.pop(0)
        return step.k, kept, ids

    def _step_stats(self, step) -> StepStats:
        """What the policy learns from a step read back: its commits, duration, and the shadow and
        counterfactual samples it asked for."""
        tokens = step.tokens
        shadow = shadow_ms = None
        # Scored on every step, speculative ones too (there the ks above the step's): a policy that
        # speculates while a request's text repeats and stops where it does not would otherwise
        # score only the stretches it left speculation off in (a biased prior; see specdec.engine.shadow)
        if self._shadow is not None and step.rows and self.policy.shadow_due():
            sh, rows, n0, s0 = self._shadow, step.rows, self._shadow.lookups, self._shadow.lookup_s
            # A speculative step's commits are exact samples of its k, and with chains that nest of
            # every smaller one (_host_cf): it scores only the larger ks (its host work is serial)
            above = 0 if step.k == 0 else (step.k if self._host_cf else 0)
            shadow = sh.samples_([r.id for r, _ in rows], lambda i: rows[i][0].tokens + tokens[i], above=above)
            if sh.lookups > n0:
                # What a drafting step's host work costs per row: the drafter's own measure where it
                # keeps one (n-gram: its indexed drafting, far cheaper than the scans that score
                # shadow drafts at past positions), else the shadow scoring's time per draft
                shadow_ms = getattr(self.drafter, "host_ms_per_row", None)
                if shadow_ms is None:
                    shadow_ms = (sh.lookup_s - s0) * 1e3 / (sh.lookups - n0)
                if self.trace is not None:
                    for j, _, c in shadow:
                        self._trace_shadow.setdefault(j, []).append(c)
        cf = None
        if step.cf is not None:  # columns in the order of the plan's smaller ks
            ks = self._counterfactual[self.stepper.num_nodes(step.k)].ks
            cf = {j: [row[i] for row in step.cf] for i, j in enumerate(ks)}
        elif step.cf_by_k is not None:
            cf = step.cf_by_k
        elif self._host_cf and step.k > 0:
            cf = {j: [min(len(t), j + 1) for t in tokens] for j in self._host_cf if j < step.k} or None
        return StepStats(k=step.k, num_decode=step.n, committed=[len(t) for t in tokens],
                         rows=[r.id for r, _ in step.rows] if self._policy_rows else None,
                         step_ms=self.stepper.step_ms(step), shadow=shadow, shadow_ms=shadow_ms, counterfactual=cf)

    def run_until_done(self) -> list[Request]:
        """Step until every queued request has finished; returns them in finishing order."""
        done = []
        while self.has_work():
            done.extend(self.step())
        self.flush_trace()
        return done

    def generate(self) -> Iterable[Request]:
        """Yield requests as they finish, stepping while any work remains."""
        while self.has_work():
            yield from self.step()
        self.flush_trace()

    def flush_trace(self) -> None:
        """Emit trace records still waiting for their GPU timings (synchronises)."""
        if self.trace is not None:
            self._emit_trace(wait=True)

    def profile_decode_step(self, batch_size: int, context_len: int, iters: int = 50, warmup: int = 3,
                            k: int = 0) -> float:
        """Device ms of one graphed decode step with k draft tokens at ``batch_size`` rows of
        ``context_len`` tokens (an idle engine; see :func:`.profiling.decode_step_ms`)."""
        return profiling.decode_step_ms(self, batch_size, context_len, iters=iters, warmup=warmup, k=k)

    def profile_step_phases(self, batch_size: int, context_len: int, k: int, iters: int = 5) -> dict:
        """{draft, verify, commit} ms of eager steps with k draft tokens (an idle engine; see
        :func:`.profiling.step_phases`)."""
        return profiling.step_phases(self, batch_size, context_len, k, iters=iters)

    def check(self) -> None:
        """Assert the bookkeeping invariants (tests): page accounting, rows vs. requests."""
        self.kv.check()
        sched = self.scheduler
        assert self.state.num_rows == len(sched.rows)
        assert self.state.seq_lens_host == [r.seq_len for r in sched.rows]
        assert all(0 <= d <= s for d, s in zip(self.state.draft_lens_host, self.state.seq_lens_host))
        owners = {id(r) for r in sched.admitted}
        assert all(id(r) in owners for r in sched.rows)
        if not sched.has_work():
            assert self.kv.num_free == self.kv.num_pages, "pages leaked after all requests finished"

    def graph_captures(self) -> int:
        """CUDA graphs captured so far (decode, prefill, catch-up): all at start-up by design, so a
        run's ``graph_recaptures`` (this minus ``startup_graph_captures``) is 0."""
        st = self.stepper
        runners = (st.runner, st.prefill_runner, st.plain_prefill_runner, st.catch_up_runner)
        return sum(getattr(r, "captures", 0) for r in runners if r is not None)

    # -- internals ------------------------------------------------------------------------------
    def _ahead(self, k: int) -> int:
        """Slots a decode row needs past its host-known committed tokens for a step with k draft
        tokens: its tree, plus the tree of the step in flight (overlapped decoding: the host does not
        know yet what that one commits)."""
        inflight = self._inflight
        return self.stepper.num_nodes(k) + (self.stepper.num_nodes(inflight.k) if inflight is not None else 0)

    def _backlog(self) -> int:
        """Draft backlog tokens over the decode rows (what a catch-up before the next drafting step
        would run through the target), from the host mirror; computed only when a policy asks."""
        st = self.state
        return sum(st.seq_lens_host) - sum(st.draft_lens_host)

    def _catch_up_(self) -> None:
        """Extend the draft KV of every row with a backlog (tokens committed by k = 0 steps, whose
        target KV exists but draft KV does not) over it, before a drafting step: the target's
        features recomputed over the backlog, then the drafter's prefill over them, chunk by chunk
        (at most prefill_chunk tokens per forward; each row's last chunk sets its root state).
        Host-side: needs the host mirror exact (no k = 0 step in flight; see ``step``)."""
        st, sched, budget = self.state, self.scheduler, self.config.prefill_chunk
        todo = [(i, st.draft_lens_host[i], st.seq_lens_host[i]) for i in range(st.num_rows)
                if st.draft_lens_host[i] < st.seq_lens_host[i]]
        if not todo:
            return
        ps = self.kv.page_size
        runner = self.stepper.catch_up_runner  # at most its largest request bucket per forward
        max_chunks = runner.r_max if runner is not None else len(todo)
        forwards, chunks, rows_last, used = [], [], [], 0
        for row, start, end in todo:
            req = sched.rows[row]
            toks, pages = req.tokens, self.kv.pages(req)
            while start < end:
                if used == budget or len(chunks) == max_chunks:
                    forwards.append((chunks, rows_last))
                    chunks, rows_last, used = [], [], 0
                n = min(end - start, budget - used)
                chunks.append(PrefillChunk(toks[start:start + n], start, list(pages[:pages_for(start + n, ps)]),
                                           next_token=toks[start + n]))
                rows_last.append(row if start + n == end else -1)  # the row's last chunk: its root
                used += n
                start += n
            st.draft_lens_host[row] = end  # queued: the device has it before the next step runs
        forwards.append((chunks, rows_last))
        self.catch_up_tokens += sum(e - s for _, s, e in todo)
        for chunks, rows_last in forwards:
            roots = self.stepper.catch_up_(chunks)
            self.num_catch_ups += 1
            last = [(c, r) for c, r in enumerate(rows_last) if r >= 0]
            self.drafter.stage_rows_(roots, [c for c, _ in last], [r for _, r in last])

    def _bucket(self, n: int) -> int:
        if n == 0 or not (self.graphed or self.config.pad_eager):
            return n
        return bucket_for(self.buckets, n)

    def _emit_trace(self, wait: bool) -> None:
        for no, phases in self._timer.collect(wait=wait).items():
            rec = self._pending_trace.get(no)
            if rec is not None:
                rec["prefill_ms"] = phases.get("prefill", 0.0)
                rec["decode_ms"] = phases.get("decode", 0.0)
                rec["_timed"] = True
        # Emit in step order, stopping at the first step still waiting for its events.
        for no in sorted(self._pending_trace):
            rec = self._pending_trace[no]
            if not rec.pop("_timed", False) and (rec["prefill_reqs"] or rec["decode_bs"]) and not wait:
                break
            self.trace(self._pending_trace.pop(no))
