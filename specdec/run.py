"""Entry point: ``python -m specdec.run +experiment=NAME [overrides]``.

Reads top to bottom (``run``): check the config, build target + tokenizer + workload + logger,
write and log the config, serve every request (``serve``: build the engine, ``serve_requests``, then
``profile_after_serving``), write ``metrics.json`` and ``requests.jsonl`` into the run directory,
mirror them to the logger, print the tables, return the headline metric. A progress display (rich)
shows requests done and tok/s while serving when stdout is a terminal.

Results survive interruption: each request's record is appended to ``requests.jsonl`` (flushed) as
it finishes, and the file is rewritten in prompt order once all have. On Ctrl-C or SIGTERM, or if
the engine stops on a failure no request can be blamed for, ``metrics.json`` is written for the
requests that finished, marked ``"partial": true``, and the exit code says why: 130 (SIGINT), 143
(SIGTERM), 1 (engine failure), 2 (bad input, with a message naming it). A request that fails is
recorded (its ``error`` in requests.jsonl, ``failed_requests`` in metrics.json) and the others go on;
the run still exits 0 unless ``run.fail_on_error=true``, which makes it exit 3 when any request of the
run (or of its plain baseline) failed. Under ``--multirun`` that stops the sweep at that job.

Run options beyond serving: ``compare_plain: true`` first serves the same prompts with plain
decoding (into ``RUN_DIR/plain/``, a run directory of its own) and adds the comparison (speed-up,
tokens per step, outputs identical) to metrics.json and the printed table, followed by a line or two
on what the policy decided and why (``explain_policy``); ``engine.profile_steps``
records the graphed plain step time at those decode batches beside the weight-bandwidth floor
(metrics.json ``step_floor``).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import signal
import sys
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue

from .bench.metrics import scalars
from .bench.provenance import provenance
from .bench.workloads import load_prompts, resolve_chat
from .errors import ConfigError, SpecdecError
from .loggers import make_logger


CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ("target", "draft", "tp", "policy", "workload", "engine", "kernels", "logger", "sampling", "acceptance")


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived while serving; ``signum`` says which (exit code 128 + signum)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def known_config_keys(conf_dir: Path = CONF_DIR) -> dict[str, set[str]]:
    """{"": top-level keys, group: keys} that the project's config files define: every option of
    a group, plus what experiment and method files (global package) set in it."""
    from omegaconf import OmegaConf

    known: dict[str, set[str]] = {"": {"hydra", *GROUPS}}
    known[""] |= set(OmegaConf.load(conf_dir / "config.yaml").keys())
    for g in GROUPS:
        known.setdefault(g, set())
        for f in (conf_dir / g).glob("*.yaml") if (conf_dir / g).is_dir() else ():
            known[g] |= set((OmegaConf.load(f) or {}).keys())
    known["sampling"] |= set(OmegaConf.load(conf_dir / "config.yaml").get("sampling", {}).keys())
    for sub in ("experiment", "method"):
        for f in (conf_dir / sub).glob("*.yaml"):
            doc = OmegaConf.to_container(OmegaConf.load(f)) or {}
            for key, val in doc.items():
                known[""].add(key)
                if key in known and isinstance(val, dict):
                    known[key] |= set(val.keys())
    return known


def check_config_keys(cfg: DictConfig, conf_dir: Path = CONF_DIR) -> None:
    """Refuse keys no config file defines (``+engine.max_new_token=8`` would otherwise be ignored
    silently), naming the key and listing the known ones."""
    known = known_config_keys(conf_dir)
    for key in cfg.keys():
        if key not in known[""]:
            raise ConfigError(f"unknown config key {key!r}; known top-level keys: {', '.join(sorted(known['']))}")
    for g in GROUPS:
        node = cfg.get(g)
        if not isinstance(node, DictConfig):
            continue
        for key in node.keys():
            if key not in known[g]:
                raise ConfigError(f"unknown config key {g}.{key}; known {g} keys: {', '.join(sorted(known[g]))}")
    run_keys = set((OmegaConf.load(conf_dir / "config.yaml").get("run") or {}).keys())
    for key in (cfg.get("run") or {}).keys():
        if key not in run_keys:
            raise ConfigError(f"unknown config key run.{key}; known run keys: {', '.join(sorted(run_keys))}")


def check_serving_config(cfg: DictConfig) -> None:
    """Values the engine or the load generator would only trip over mid-run, named up front."""
    from .engine.engine import EngineConfig, config_number

    config_number("engine.max_new_tokens", cfg.engine.get("max_new_tokens"), int, 1)
    EngineConfig.from_cfg(cfg.engine, sampling=cfg.sampling, seed=cfg.seed).validate()
    wl = cfg.workload
    mode = wl.get("mode", "closed")
    if mode not in ("closed", "open"):
        raise ConfigError(f"workload.mode={mode!r}; valid: closed, open")
    config_number("workload.concurrency", wl.get("concurrency"), int, 1)
    rate = config_number("workload.rate", wl.get("rate"), float)
    if rate is not None and rate <= 0:
        raise ConfigError(f"workload.rate={wl.get('rate')!r}: must be > 0 requests/s (or null: all at once)")


class RecordStream:
    """requests.jsonl written as requests finish: one JSON line each, flushed, so a run stopped at
    any point keeps every record it finished. ``finalize_`` rewrites it in prompt order."""

    def __init__(self, path: Path):
        self.path = path
        self.records: list[dict] = []
        self._file = open(path, "w")

    def write_(self, rec: dict) -> None:
        self._file.write(json.dumps(rec) + "\n")  # one write call: a signal cannot split a line
        self._file.flush()
        self.records.append(rec)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def finalize_(self, records: list[dict]) -> None:
        self.close()
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, self.path)


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {name!r}; valid: auto, cpu, cuda")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is visible; use device=cpu or device=auto")
    return name


def release_device_memory(device: str) -> None:
    """What an earlier run of this process left behind goes now, before this run builds anything:
    its garbage (reference cycles keep an engine's KV pool and CUDA graphs alive until the cyclic
    collector runs) and, on the GPU, the blocks torch's caching allocator kept for it (returned to
    the driver). Every job of a ``--multirun`` then starts from the same device state as the first:
    the same memory free for its KV pool and no predecessor's blocks to reuse."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class FrozenHeap:
    """``with FrozenHeap(): serve()``: everything alive before serving (model, engine, compiled
    kernels, whatever earlier runs of this process left alive) moves to the collector's permanent
    generation (``gc.freeze``), so the full collections that serving's allocations trigger scan only
    the objects serving creates, whatever this process ran before; ``collections`` counts the
    collections per generation while it was held."""

    def __enter__(self) -> "FrozenHeap":
        gc.collect()
        gc.freeze()
        self._before = [g["collections"] for g in gc.get_stats()]
        self.collections: list[int] = []
        return self

    def __exit__(self, *exc) -> None:
        self.collections = [g["collections"] - b for g, b in zip(gc.get_stats(), self._before)]
        gc.unfreeze()


def apply_kernel_options(cfg: DictConfig) -> dict:
    """Set the kernel research switches of ``cfg.kernels`` (conf/kernels/; fields it lacks take their
    defaults) and ``engine.exact`` (the batch-invariant kernels, kernels_triton/options.py) for this
    process, before any model or engine is built (CUDA graphs keep the options they were captured
    with); returns them."""
    from kernels_triton import options

    from .errors import config_flag

    group = cfg.get("kernels")
    fields = OmegaConf.to_container(group, resolve=True) if group is not None else {}
    engine = cfg.get("engine")
    if engine is not None and engine.get("exact") is not None:
        fields["exact"] = config_flag("engine.exact", engine.get("exact"))
    try:  # every field set: an earlier job of a --multirun in this process leaves nothing behind
        options.set_(**{**options.KernelOptions().as_dict(), **fields})
    except ValueError as e:
        raise ConfigError(f"kernels: {e}") from None
    return options.get().as_dict()


def build_target(cfg: DictConfig, device: str):
    """The target (under tensor parallelism: this rank's shard) and its tokenizer."""
    from .assets import smollm2_dir
    from .dist.runner import shard_for_run
    from .models.llama import load_target
    from .models.tokenizer import Tokenizer

    if cfg.target.get("random_weights"):
        # Real shapes, random weights (systems studies): no tokenizer, synthetic workloads only.
        from .bench.targets import IdsOnlyTokenizer, llama_config_from_dict
        from .models.llama import LlamaModel

        config = llama_config_from_dict(OmegaConf.to_container(cfg.target.config, resolve=True))
        model = LlamaModel.random(config, device=device, dtype=cfg.engine.dtype, seed=int(cfg.seed),
                                  backend=cfg.engine.kernels)
        _apply_routing(model, cfg)
        return shard_for_run(model, cfg), IdsOnlyTokenizer(config.vocab_size)
    path = cfg.target.path
    if path is None:
        if cfg.target.name != "smollm2-135m-instruct":
            raise ConfigError(f"target {cfg.target.name!r} needs target.path=DIR")
        path = smollm2_dir()
    model = load_target(path, device=device, dtype=cfg.engine.dtype, backend=cfg.engine.kernels)
    _apply_routing(model, cfg)  # refuses any routing kind but router: a real router routes
    return shard_for_run(model, cfg), Tokenizer(path)


def _apply_routing(model, cfg: DictConfig) -> None:
    """target.routing (specdec/models/routing.py): a random-weight MoE target's routing model."""
    from .dist.runner import tp_settings
    from .errors import config_flag
    from .models.routing import apply_routing_

    exact = cfg.engine.get("exact")
    apply_routing_(model, cfg.target, tp_size=tp_settings(cfg)[0],
                   exact=exact is not None and config_flag("engine.exact", exact))


def _truncate_at_stop(text: str, stop) -> str:
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


def workload_context(prompts, max_new_tokens: int) -> int | None:
    """Mean context of a decode step over ``prompts``: prompt length + half the new tokens (each
    prompt's own budget, else ``max_new_tokens``); None without prompts."""
    if not prompts:
        return None
    total = sum(len(p.prompt_ids) + (p.max_new_tokens or max_new_tokens) / 2 for p in prompts)
    return round(total / len(prompts))


def build_engine(model, tokenizer, cfg, trace=None):
    """The engine for one serve of ``cfg`` (drafter, policy, engine config). Under tensor parallelism
    every rank builds it (rank 0 announces it first), the policy decides on rank 0 only, and rank 0
    gets a LeaderEngine (specdec/dist/plan.py); without, the hooks change nothing."""
    from .dist import runner as tp
    from .engine.engine import Engine, EngineConfig
    from .policy import build_policy
    from .spec import build_drafter
    from .spec.base import sizes

    tp.announce_engine_(cfg)
    eos = set(model.config.eos_token_id)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    ids_only = getattr(tokenizer, "is_ids_only", False)
    drafter = build_drafter(cfg.draft, model, device=model.device, backend=model.backend)
    # Policies pick among the drafter's configured sizes (one key for the tree size: the draft config).
    policy = tp.wrap_policy(build_policy(cfg.policy, sizes=sizes(drafter)))
    from .acceptance import build_acceptance

    # Every rank seeds the same replay stream, so replayed accepted lengths agree across ranks.
    acceptance = build_acceptance(cfg.get("acceptance"), seed=int(cfg.seed))
    ecfg = EngineConfig.from_cfg(cfg.engine, sampling=cfg.sampling, seed=int(cfg.seed))
    engine = Engine(model, tp.agree_engine_config(ecfg, model), eos_ids=eos,
                    detokenize=None if ids_only else tokenizer.decode, trace=trace, drafter=drafter, policy=policy,
                    acceptance=acceptance)
    return tp.wrap_engine(engine)


def steady_settings(wl) -> tuple[float | None, float | None]:
    """(workload.duration_s, workload.warmup_s), checked: a timed closed loop serves for duration_s
    seconds (prompts cycled), and its steady-window tok/s starts warmup_s after the first send."""
    duration_s, warmup_s = wl.get("duration_s"), wl.get("warmup_s")
    for name, v in (("duration_s", duration_s), ("warmup_s", warmup_s)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
            raise ConfigError(f"workload.{name}={v!r}: must be a number of seconds >= 0, or null")
    if duration_s is not None:
        if wl.get("mode", "closed") != "closed" or wl.get("concurrency") is None:
            raise ConfigError(f"workload.duration_s={duration_s!r} needs a closed loop with a concurrency "
                              f"(got mode={wl.get('mode', 'closed')!r}, concurrency={wl.get('concurrency')!r})")
        if not duration_s > 0:
            raise ConfigError(f"workload.duration_s={duration_s!r}: must be > 0 seconds, or null")
        if warmup_s is not None and not warmup_s < duration_s:
            raise ConfigError(f"workload.warmup_s={warmup_s!r} must be below workload.duration_s="
                              f"{duration_s!r}: the steady window runs from one to the other")
    return (None if duration_s is None else float(duration_s)), (None if warmup_s is None else float(warmup_s))


def stagger_rows(wl) -> int:
    """How many first requests a staggered closed loop shortens (workload.stagger: the concurrency C),
    or 0. Client i's first request (i = 0 .. C-1) stops after ceil((i + 1) / C) of its output tokens,
    so the clients' requests finish spread over a request's lifetime from the start instead of
    together: without it every request of a closed loop at fixed output lengths (ignore_eos) starts
    and ends in the same few iterations, and tok/s over a window of a few such waves depends on
    where the window cuts them. Needs a timed closed loop (duration_s)."""
    v = wl.get("stagger", False)
    if v in (None, False):
        return 0
    if not isinstance(v, bool):
        raise ConfigError(f"workload.stagger={v!r}: must be true or false")
    if wl.get("mode", "closed") != "closed" or wl.get("concurrency") is None or wl.get("duration_s") is None:
        raise ConfigError(f"workload.stagger=true needs a timed closed loop (mode closed, a concurrency and "
                          f"duration_s; got mode={wl.get('mode', 'closed')!r}, concurrency={wl.get('concurrency')!r}, "
                          f"duration_s={wl.get('duration_s')!r})")
    return int(wl.get("concurrency"))


def serve_warmup(engine, prompts, wl, max_new: int, trace=None, *, stop=(), ignore_eos=False) -> int:
    """Serve ``workload.warmup_requests`` requests (the workload's first prompts, cycled, at most
    ``workload.warmup_new_tokens`` new tokens each, all at once) to the end before the measured run,
    untimed and unrecorded: whatever a process pays once (first-use loads, the first EAGLE-3 step)
    lands here instead of in the first measured configuration of a sweep. The trace does not see these steps and the engine's
    catch-up counters are put back; a policy keeps what it learned. Returns the requests served."""
    n = wl.get("warmup_requests", 0) or 0
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"workload.warmup_requests={n!r}: must be an integer >= 0")
    new_tokens = wl.get("warmup_new_tokens", 16)
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise ConfigError(f"workload.warmup_new_tokens={new_tokens!r}: must be an integer >= 1")
    if n == 0 or not prompts:
        return 0
    counters = (engine.num_catch_ups, engine.catch_up_tokens, engine.scheduler.undrafted_prefill_tokens)
    with (trace.paused() if trace is not None else contextlib.nullcontext()):
        for i in range(n):
            p = prompts[i % len(prompts)]
            engine.add_request(p.prompt_ids, min(new_tokens, p.max_new_tokens or max_new),
                               request_id=f"{p.id}@warmup{i}", stop=stop, ignore_eos=ignore_eos,
                               sampling=getattr(p, "sampling", None))
        while engine.has_work():
            engine.step()
    engine.num_catch_ups, engine.catch_up_tokens, engine.scheduler.undrafted_prefill_tokens = counters
    return n


def build_serving_engine(model, tokenizer, prompts, cfg, trace=None):
    """The engine for one serve of ``cfg`` and the config it was built from: whatever an engine served
    before in this process (compare_plain's plain run) is released first, so this one sizes its KV pool
    from the same free memory; goodput's ``profile_context: auto`` is resolved from the prompts here,
    so every rank builds the same policy."""
    from .engine.engine import config_number
    from .policy import profile_context_auto

    max_new = config_number("engine.max_new_tokens", cfg.engine.max_new_tokens, int, 1)
    release_device_memory(model.device.type)
    if profile_context_auto(cfg.policy):
        cfg = copy.deepcopy(cfg)
        with open_dict(cfg):
            cfg.policy.profile_context = max(16, workload_context(prompts, max_new) or 512)
    if str(cfg.sampling.get("per_request", "auto")) == "auto":  # per-row sampling iff a request brings its own
        cfg = copy.deepcopy(cfg)
        with open_dict(cfg):
            cfg.sampling.per_request = any(getattr(p, "sampling", None) is not None for p in prompts)
    return build_engine(model, tokenizer, cfg, trace), cfg


def serve_requests(engine, tokenizer, prompts, cfg, on_request=None, trace=None) -> list[dict]:
    """Serve every prompt through ``engine`` (after ``workload.warmup_requests``, untimed); records come
    back in prompt order.

    Load shape from ``cfg.workload``: ``mode: closed`` keeps ``concurrency`` requests in flight
    (null: all at once), ``mode: open`` sends Poisson arrivals at ``rate`` per second. A request that
    cannot run is reported in its record (``error``), never fatal to the others; ``on_request(record)``
    sees each as it finishes. ``trace`` (a bench.metrics.StepTrace) receives one record per engine
    step, and in ``meta`` the serve's facts: wall time, steady window, the engine's and the policy's.
    """
    from .bench.clients import closed_loop, open_loop, steady_window
    from .bench.metrics import request_record
    from .engine.engine import config_number

    max_new = config_number("engine.max_new_tokens", cfg.engine.max_new_tokens, int, 1)
    wl = cfg.workload
    ignore_eos = bool(wl.get("ignore_eos", False))
    stop = list(cfg.engine.get("stop") or [])
    mode = wl.get("mode", "closed")
    if mode not in ("closed", "open"):
        raise ConfigError(f"workload.mode={mode!r}; valid: closed, open")
    duration_s, warmup_s = steady_settings(wl)
    staggered = stagger_rows(wl)
    serve_warmup(engine, prompts, wl, max_new, trace, stop=stop, ignore_eos=ignore_eos)

    order: dict[int, int] = {}  # id(request) -> submit index
    by_index: dict[int, dict] = {}
    sent: list = []  # prompts in submit order (a timed closed loop sends them again under new ids)
    token_times: list = []  # each finished request's commit times: the steady window's tokens

    def submit(p, arrival_s):
        n = p.max_new_tokens or max_new
        if len(order) < staggered:  # a staggered loop's first round: client i stops after (i + 1) / C
            n = max(1, -(-n * (len(order) + 1) // staggered))
        req = engine.add_request(p.prompt_ids, n, request_id=p.id, stop=stop,
                                 ignore_eos=ignore_eos, arrival_s=arrival_s, sampling=getattr(p, "sampling", None))
        order[id(req)] = len(order)
        sent.append(p)
        return req

    def finish(req):
        i = order[id(req)]
        text = "" if req.error else _truncate_at_stop(tokenizer.decode(req.output_ids), stop)
        rec = request_record(req, sent[i].text, text)
        by_index[i] = rec
        if not req.error:
            token_times.append(req.token_times)
        if on_request:
            on_request(rec)

    window: dict = {}
    with FrozenHeap() as heap:
        t0 = time.perf_counter()
        if mode == "closed":
            closed_loop(engine, prompts, wl.get("concurrency"), submit, finish, duration_s=duration_s,
                        window=window)
        else:
            open_loop(engine, prompts, wl.get("rate"), submit, seed=int(cfg.seed), on_finish=finish)
        serve_s = time.perf_counter() - t0
    if trace is not None:
        if window:
            # Output tok/s over the steady window: from warmup_s after the first send to the last send
            # (the ramp-up and the drain left out; metrics' output_tok_per_s keeps the whole run).
            start = window["t0"] + (warmup_s or 0.0)
            n, span = steady_window(token_times, start, window["t_stop"])
            trace.meta.update(steady_window_s=span, steady_output_tokens=n,
                              steady_tok_per_s=n / span if span > 0 else None,
                              steady_warmup_s=warmup_s or 0.0, duration_s=duration_s,
                              prompt_rounds=window.get("rounds", 1), staggered_requests=staggered)
        trace.meta.update(serve_wall_s=serve_s, serve_gc_collections=heap.collections, **engine_facts(engine))
    return [by_index[i] for i in range(len(by_index))]


def engine_facts(engine) -> dict:
    """What the engine was and did, for metrics.json: start-up time, CUDA graphs, KV pages, catch-up
    work, the draft head's resolved weight dtype, replayed acceptance's source, the policy's own account
    of its state (goodput: its step-time table, a(k) estimates and switch log)."""
    facts = dict(engine_startup_s=engine.startup_s, cuda_graphs=engine.graphed, kv_pages=engine.kv.num_pages,
                 graph_captures=engine.startup_graph_captures,
                 graph_recaptures=engine.graph_captures() - engine.startup_graph_captures,
                 undrafted_prefill_tokens=engine.undrafted_prefill_tokens,
                 catch_up_tokens=engine.catch_up_tokens, catch_up_forwards=engine.num_catch_ups,
                 page_size=engine.kv.page_size, max_batch_size=engine.config.max_batch_size)
    head = getattr(engine.drafter, "head", None)
    if head is not None and hasattr(head, "weight_dtype"):  # draft.weight_dtype as resolved (auto: int8 or model)
        facts["draft_weight_dtype"] = head.weight_dtype
    acceptance = getattr(engine, "acceptance", None)
    if acceptance is not None:  # replayed: the label, the trace and the sizes it drew from
        facts.update(acceptance.describe())
    describe = getattr(engine.policy, "describe", None)
    state = describe() if describe is not None else None
    if state is not None:
        facts["policy_state"] = state
    return facts


def profile_after_serving(engine, cfg, trace, profile: bool = True) -> bool:
    """Post-serve profiling into ``trace.meta`` (the kernels are compiled and the engine is idle; served
    steps run as whole CUDA graphs, so their parts are timed here): each configured k's step split into
    draft / verify / commit at the run's mean decode batch (``engine.profile_iters`` steps; 0: none), the
    graphed plain step beside the weight-bandwidth floor (``engine.profile_steps``) and each k's graphed
    step beside the plain one (``engine.profile_spec_steps``); nothing without ``profile`` (compare_plain's
    baseline). Returns whether it profiled anything."""
    from .dist.plan import run_everywhere
    from .engine.engine import config_number

    if not profile:
        return False
    done = False
    mean_bs = max(1, round(trace.summary().get("mean_batch_size") or 1))
    ctx = min(256, engine.max_seq_len // 2, engine.kv.num_pages * engine.kv.page_size // 4)
    iters = config_number("engine.profile_iters", cfg.engine.get("profile_iters", 3), int, 0)
    if iters > 0:
        trace.meta["step_phase_ms"] = {f"k={k}": engine.profile_step_phases(mean_bs, ctx, k, iters=iters)
                                       for k in engine.ks}
        done = True
    ctx = min(int(cfg.engine.get("profile_steps_context", 512)), engine.max_seq_len // 2)
    steps_iters = int(cfg.engine.get("profile_steps_iters", 100))
    batches = list(cfg.engine.get("profile_steps") or [])
    if batches:
        from .engine import profiling

        trace.meta["step_floor"] = run_everywhere(engine, profiling.step_time_vs_floor, batches, ctx, iters=steps_iters)
        done = True
    spec_batches = list(cfg.engine.get("profile_spec_steps") or [])
    if spec_batches:
        from .engine import profiling

        trace.meta["step_breakdown"] = run_everywhere(engine, profiling.step_breakdown, spec_batches, ctx,
                                                      iters=steps_iters)
        done = True
    return done


def generate_all(model, tokenizer, prompts, cfg, progress_cb=None, trace=None, profile=True) -> list[dict]:
    """Build the engine, serve every prompt (``serve_requests``), then profile (``profile_after_serving``,
    which needs a trace); records in prompt order."""
    engine, cfg = build_serving_engine(model, tokenizer, prompts, cfg, trace)
    records = serve_requests(engine, tokenizer, prompts, cfg, progress_cb, trace)
    if trace is not None:
        with trace.paused():
            profile_after_serving(engine, cfg, trace, profile)
    return records


def summarize(records: list[dict], wall_s: float, trace=None) -> dict:
    """Aggregate metrics; with a step trace, throughput is over serving time (not start-up)."""
    from .bench.metrics import summarize_requests

    serve_s = trace.meta.get("serve_wall_s", wall_s) if trace is not None else wall_s
    metrics = summarize_requests(records, serve_s)
    metrics["total_wall_s"] = wall_s
    if trace is not None:
        metrics.update(trace.summary())
        metrics.update(trace.meta)
    return metrics


def print_table(records: list[dict], metrics: dict, max_rows: int = 20) -> None:
    """The per-request table (the first ``max_rows`` requests) and a summary line."""
    from rich.console import Console
    from rich.table import Table

    shown = min(len(records), max_rows)
    title = (f"Requests{'' if shown == len(records) else f' (first {shown} of {len(records)})'}: "
             f"{metrics.get('target', '')}")
    if metrics.get("weights") not in (None, "pretrained"):
        title += f" ({metrics['weights']})"
    table = Table(title=title, show_lines=False)
    for col in ("id", "prompt tok", "out tok", "TTFT ms", "TPOT ms", "output"):
        table.add_column(col, overflow="fold" if col == "output" else "ellipsis")
    for r in records[:max_rows]:
        if "error" in r:
            table.add_row(r["id"], str(r["prompt_tokens"]), "-", "-", "-", f"[red]error: {r['error']}")
            continue
        tpot = f"{r['tpot_s'] * 1e3:.1f}" if r.get("tpot_s") else "-"
        ttft = f"{r['ttft_s'] * 1e3:.0f}" if r.get("ttft_s") is not None else "-"
        text = r["output"].replace("\n", " ")
        table.add_row(r["id"], str(r["prompt_tokens"]), str(r["output_tokens"]),
                      ttft, tpot, text[:80] + ("..." if len(text) > 80 else ""))
    console = Console()
    console.print(table)
    if len(records) > max_rows:
        console.print(f"... {len(records) - max_rows} more requests in requests.jsonl")
    line = (f"{metrics['output_tokens']} tokens in {metrics['wall_s']:.1f} s "
            f"({metrics['output_tok_per_s']:.1f} tok/s), {metrics['failed_requests']} failed")
    if metrics.get("mean_batch_size") is not None:
        line += (f"; mean batch {metrics['mean_batch_size']:.1f}, decode step p50 "
                 f"{metrics['p50_decode_step_ms']:.2f} ms, cuda graphs {'on' if metrics.get('cuda_graphs') else 'off'}")
    console.print(line)


def plain_config(resolved: dict, run_dir: Path) -> dict:
    """The run's resolved config with plain decoding (draft none, policy never) into ``run_dir``:
    the baseline ``compare_plain`` serves first. Everything else is kept, so the report matches
    the two as a speculative run and its plain baseline."""
    plain = json.loads(json.dumps(resolved))  # a deep copy
    plain.update(draft={"name": "none"}, policy={"name": "never"}, acceptance={"name": "real"}, run_dir=str(run_dir))
    return plain


def plain_overrides(overrides: list[str] | None) -> list[str] | None:
    """The Hydra overrides of ``compare_plain``'s baseline: the run's, draft / policy / acceptance
    replaced by plain decoding."""
    if overrides is None:
        return None
    keep = [o for o in overrides if not o.lstrip("+~").startswith(("draft", "policy", "acceptance"))]
    return keep + ["draft=none", "policy=never"]


def serve(cfg: DictConfig, model, tokenizer, prompts, device: str, run_dir: Path, title: str, facts,
          profile: bool = True) -> tuple[list[dict], dict]:
    """Serve the workload once into ``run_dir``: steps.jsonl (flushed as it goes), requests.jsonl
    (one line per request as it finishes, rewritten in prompt order at the end) and metrics.json
    (``facts`` adds the run's provenance), written once serving ends and again with what the
    post-serve profiling adds. If serving stops early (Ctrl-C, SIGTERM, an engine failure),
    metrics.json is written for what finished, marked ``"partial": true``, and the exception
    propagates; if the profiling after it stops, the serving numbers stay whole and
    ``profile_stopped_by`` says why."""
    from .bench.console import ServeProgress, status
    from .bench.metrics import StepTrace

    t0 = time.perf_counter()
    trace = StepTrace(run_dir / "steps.jsonl")  # one line per engine step
    stream = RecordStream(run_dir / "requests.jsonl")

    def write_metrics(records: list[dict], **extra) -> dict:
        metrics = facts(summarize(records, time.perf_counter() - t0, trace))
        metrics.update(extra)
        (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
        return metrics

    try:
        with status(f"{title}: starting the engine"):
            engine, cfg = build_serving_engine(model, tokenizer, prompts, cfg, trace)
        duration_s = cfg.workload.get("duration_s")  # a timed loop: as many requests as fit
        with ServeProgress(len(prompts), f"{title} ({device})", duration_s=duration_s) as live:
            trace.listeners.append(live.on_step)

            def on_request(rec):
                stream.write_(rec)
                live.on_request(rec)

            records = serve_requests(engine, tokenizer, prompts, cfg, on_request, trace)
        trace.listeners.remove(live.on_step)
    except BaseException as e:
        # Interrupted, or the engine stopped: keep what finished, say so, exit non-zero.
        trace.close()
        stream.close()
        if isinstance(e, SpecdecError) and not stream.records:
            raise  # bad input found before any request ran: its message is the whole story
        why = _stopped_by(e)
        write_metrics(stream.records, partial=True, stopped_by=why, prompts=len(prompts))
        if not isinstance(e, SpecdecError):
            print(f"stopped ({why}) after {len(stream.records)} of {len(prompts)} requests; their "
                  f"records are in {run_dir / 'requests.jsonl'}, partial metrics in metrics.json",
                  file=sys.stderr)
        raise
    finally:
        trace.close()
        stream.close()
    stream.finalize_(records)
    metrics = write_metrics(records, partial=False)  # serving's numbers are safe before profiling starts
    try:
        with status(f"{title}: profiling steps after serving"), trace.paused():
            profiled = profile_after_serving(engine, cfg, trace, profile)
    except BaseException as e:
        metrics = write_metrics(records, partial=False, profile_stopped_by=_stopped_by(e))
        print(f"profiling after serving stopped ({_stopped_by(e)}); the serving metrics in "
              f"{run_dir / 'metrics.json'} are complete", file=sys.stderr)
        raise
    if profiled:
        metrics = write_metrics(records, partial=False)
    return records, metrics


def _stopped_by(e: BaseException) -> str:
    if type(e) is KeyboardInterrupt:
        return "SIGINT"
    return e.args[0] if isinstance(e, Interrupted) else f"{type(e).__name__}: {e}"


def compare(plain: tuple[list[dict], dict], spec: tuple[list[dict], dict]) -> dict:
    """The configured run against plain decoding of the same prompts: tokens per step, speed-up,
    share of steps speculating, and how many outputs are token-identical (greedy: all must be)."""
    (p_rec, p_met), (s_rec, s_met) = plain, spec
    same = sum("error" not in a and "error" not in b and a["output_ids"] == b["output_ids"]
               for a, b in zip(p_rec, s_rec))
    p_tps, s_tps = p_met["output_tok_per_s"], s_met["output_tok_per_s"]
    return {"plain_output_tok_per_s": p_tps, "plain_tokens_per_row_step": p_met.get("tokens_per_row_step"),
            "plain_failed_requests": p_met.get("failed_requests", 0),
            "speedup_over_plain": s_tps / p_tps if p_tps else None,
            "outputs_identical_to_plain": same / len(s_rec) if s_rec else None,
            "outputs_identical_count": same}


def print_comparison(cfg: DictConfig, plain: dict, spec: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Plain decoding vs {cfg.draft.name} + policy {cfg.policy.name}, same prompts")
    for col in ("decoding", "tok/s", "tokens per step", "speed-up", "steps speculating", "outputs identical"):
        table.add_column(col, justify="left" if col == "decoding" else "right")
    n = spec["requests"]

    def row(name, m, speedup, same):
        tps = m.get("tokens_per_row_step")
        table.add_row(name, f"{m['output_tok_per_s']:.1f}", "-" if tps is None else f"{tps:.2f}",
                      f"{speedup:.2f}x", f"{100 * m.get('speculating_step_fraction', 0.0):.0f}%", same)

    row("plain", plain, 1.0, "-")
    greedy = float(cfg.sampling.temperature) == 0.0
    same = f"{spec['outputs_identical_count']}/{n}" + ("" if greedy else " (sampling: need not match)")
    row(f"{cfg.draft.name} + {cfg.policy.name}", spec, spec["speedup_over_plain"] or 0.0, same)
    console = Console()
    console.print(table)
    for line in explain_policy(cfg.policy.name, spec):
        console.print(line, highlight=False)


def _ms_at(row: dict, batch: int) -> tuple[int, float] | None:
    """(bucket, ms) of a step-time row {bucket: ms} at ``batch``: the smallest bucket holding it, else
    the largest."""
    got = sorted((int(b), ms) for b, ms in (row or {}).items() if isinstance(ms, (int, float)))
    if not got:
        return None
    return next(((b, ms) for b, ms in got if b >= batch), got[-1])


def _policy_decision(state: dict, metrics: dict) -> dict | None:
    """What an estimating policy (goodput) compared when it last chose between speculating and not:
    {k, batch, cost (an iteration at k in plain iterations), a (tokens a step at k commits per request),
    probes (switches on from k = 0), scored (drafts scored on the side)}: its last decision by the
    estimates in its switch log, else, from its state after serving, the k it rated best at the run's
    batch (served iteration times where it has them, else its start-up table; the live requests' own
    a(k), else the prior). None without a step-time table or a(k)."""
    log = [e for e in state.get("switch_log") or [] if isinstance(e, dict)]
    seen = {"probes": sum(1 for e in log if e.get("from") == 0 and (e.get("to") or 0) > 0),
            "scored": int(state.get("shadow_samples") or 0)}
    for e in reversed(log):
        if e.get("why") != "estimates":
            continue
        k = max(int(e.get("from") or 0), int(e.get("to") or 0))
        est = e.get("k") or {}
        on, off = est.get(str(k)) or {}, est.get("0") or {}
        if k > 0 and on.get("iter_ms") and off.get("iter_ms") and on.get("a") is not None:
            return {"k": k, "batch": e.get("batch"), "cost": on["iter_ms"] / off["iter_ms"], "a": on["a"], **seen}
    table, served = state.get("step_ms") or {}, state.get("served_iter_ms") or {}
    batch = max(1, round(metrics.get("mean_batch_size") or 1))

    def ms(k):  # (bucket, ms) of an iteration at k: served where the policy has it, else its table
        return _ms_at(served.get(f"k={k}"), batch) or _ms_at(table.get(f"k={k}"), batch)

    off = ms(0)
    if off is None or not off[1]:
        return None
    best = untried = None
    for key in table:
        k = int(key.split("=", 1)[1]) if key.startswith("k=") else 0
        own = [v for v in ((state.get("accept_rows") or {}).get(key) or {}).values() if isinstance(v, (int, float))]
        a = sum(own) / len(own) if own else (state.get("accept") or {}).get(key)
        on = ms(k)
        if k <= 0 or on is None:
            continue
        d = {"k": k, "batch": off[0], "cost": on[1] / off[1], "a": a, **seen}
        if a is None:  # never tried: its cost alone kept it off
            untried = d if untried is None or d["cost"] < untried["cost"] else untried
        elif best is None or d["a"] / d["cost"] > best["a"] / best["cost"]:
            best = d
    return best or untried


def explain_policy(policy: str, metrics: dict) -> list[str]:
    """One or two lines on what the policy decided and why, from what metrics.json holds: an estimating
    policy's own comparison (goodput: an iteration at k in plain iterations against the tokens a step at
    k commits per request, from its switch log or its state after serving), else the served steps' times."""
    frac = metrics.get("speculating_step_fraction") or 0.0
    where = "this CPU" if metrics.get("device") == "cpu" else (metrics.get("device_name") or "this device")
    d = _policy_decision(metrics.get("policy_state") or {}, metrics)
    if d is not None:
        step = f"a {d['k']}-token draft step at batch {d['batch']}"
        if d["a"] is None:
            return [f"Why: on {where} {step} costs {d['cost']:.1f} plain steps, too dear for the {policy} policy "
                    f"to try: it kept speculation off ({100 * frac:.0f}% of decode steps speculated)."]
        if frac < 0.5:
            n = d["probes"]
            how = (f" after {n} probe{'s' * (n != 1)}" if n else
                   f", from {d['scored']} drafts it scored on the side" if d["scored"] else "")
            verdict = f"the {policy} policy kept speculation off{how} ({100 * frac:.0f}% of decode steps speculated)"
        else:
            verdict = f"the {policy} policy speculated on {100 * frac:.0f}% of decode steps"
        if (d["a"] > d["cost"]) == (frac >= 0.5):
            lines = [f"Why: on {where} {step} costs {d['cost']:.1f} plain steps and commits {d['a']:.1f} tokens per "
                     f"request: {verdict}."]
        else:  # its estimates as they stand after serving point the other way: say what they are, claim no cause
            return [f"On {where} {verdict}; after serving, its estimates rate {step} at {d['cost']:.1f} plain steps "
                    f"for {d['a']:.1f} tokens per request (metrics.json policy_state has the rest)."]
        if d["a"] <= d["cost"]:
            lines.append("Speculation pays where a drafted step costs fewer plain steps than the tokens it commits: "
                         + ("a GPU's memory-bound decode step, not a CPU's compute-bound one." if d["cost"] >= 2 else
                            "here too few drafted tokens are accepted for that."))
        return lines
    spec_ms, plain_ms = metrics.get("mean_spec_step_ms"), metrics.get("mean_plain_step_ms")
    acc = metrics.get("mean_accepted_length")
    if spec_ms and plain_ms and acc:
        return [f"Why: on {where} a speculative step took {spec_ms / plain_ms:.1f} plain steps and committed "
                f"{acc:.1f} tokens per request; the {policy} policy speculated on {100 * frac:.0f}% of decode steps."]
    return []


def hydra_overrides() -> list[str] | None:
    """The Hydra overrides of this run (``python -m specdec.run`` and its sweeps), None outside Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return [str(o) for o in HydraConfig.get().overrides.task] if HydraConfig.initialized() else None
    except Exception:  # not under Hydra's main (a direct call, a tensor-parallel rank)
        return None


def sweep_position() -> str:
    """"job 3/12" for a job of a ``--multirun`` sweep (the total when its swept values can be counted:
    the command line's and ``hydra.sweeper.params``), "" for a single run."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
            return ""
        hc = HydraConfig.get()
        num = int(hc.job.num) + 1
    except Exception:
        return ""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        params = dict(hc.sweeper.get("params") or {})
        specs = [f"{k}={v}" for k, v in params.items()] + [a for a in sys.argv[1:] if not a.startswith("-")]
        counts = {}
        for o in OverridesParser.create().parse_overrides(specs):
            if o.is_sweep_override():
                counts[o.get_key_element()] = len(list(o.sweep_string_iterator()))
        total = 1
        for n in counts.values():
            total *= n
        return f"job {num}/{total}" if total >= num else f"job {num}"
    except Exception:
        return f"job {num}"


def check_run_config(cfg: DictConfig) -> None:
    """Every value a run would only trip over later, named before the model loads."""
    check_config_keys(cfg)
    check_serving_config(cfg)
    resolve_device(cfg.device)
    if cfg.draft.name == "none" and cfg.policy.name != "never":
        raise ConfigError(f"policy={cfg.policy.name} speculates but draft=none; choose a drafter "
                          "(draft=ngram or draft=eagle3_smollm2 / eagle3) or policy=never")
    compare_plain = bool(cfg.get("compare_plain", False))
    if compare_plain and cfg.draft.name == "none":
        raise ConfigError("compare_plain=true compares a drafter with plain decoding, but draft=none; "
                          "choose a drafter (draft=ngram, eagle3_smollm2, eagle3) or compare_plain=false")
    duration_s, _ = steady_settings(cfg.workload)
    stagger_rows(cfg.workload)
    if compare_plain and duration_s is not None:
        raise ConfigError(f"compare_plain=true compares the same prompts request by request, but "
                          f"workload.duration_s={duration_s} serves as many as fit in the time; set one of them")
    fail = OmegaConf.select(cfg, "run.fail_on_error", default=False)
    if not isinstance(fail, bool):
        raise ConfigError(f"run.fail_on_error={fail!r}: must be true or false")


def run_facts(cfg: DictConfig, model, device: str, prompt_format: dict, stamp: dict, overrides):
    """``facts(metrics)``: the run's provenance added to a serve's metrics (target, device, dtype,
    workload, prompt format, weights, commit / date / device name / versions, the Hydra overrides)."""
    from .bench.targets import RANDOM_WEIGHTS_LABEL
    from .models.routing import routing_facts

    def facts(metrics: dict) -> dict:
        metrics.update(target=cfg.target.name, device=device, dtype=str(model.dtype),
                       workload=cfg.workload.name, **prompt_format,
                       weights=RANDOM_WEIGHTS_LABEL if cfg.target.get("random_weights") else "pretrained",
                       **routing_facts(cfg.target, model), **stamp, overrides=overrides)
        metrics.setdefault("acceptance", "real")  # replayed runs carry "replayed" from the engine's trace meta
        return metrics

    return facts


@contextlib.contextmanager
def sigterm_raises():
    """SIGTERM raises Interrupted while serving (records kept, exit 143), as Ctrl-C raises KeyboardInterrupt."""
    def on_signal(signum, frame):
        raise Interrupted(signum)

    old = signal.signal(signal.SIGTERM, on_signal)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def run(cfg: DictConfig) -> dict:
    """One run: check the config, build the target, prompts and logger, write and log the config,
    serve (plain decoding first with ``compare_plain``), log and print the results, return metrics."""
    check_run_config(cfg)
    from .dist import current as tp_group
    from .dist.runner import run_tp, tp_settings

    if tp_settings(cfg)[0] > 1 and tp_group() is None:
        return run_tp(cfg)  # starts tp.size ranks; rank 0 comes back here with its group set

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(int(cfg.seed))
    device = resolve_device(cfg.device)
    release_device_memory(device)  # nothing an earlier job of this process left shrinks this one's pool
    apply_kernel_options(cfg)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    (run_dir / "config.json").write_text(json.dumps(resolved, indent=2))
    stamp = provenance(device)  # commit, date, device name, versions, kernel options
    model, tokenizer = build_target(cfg, device)
    prompts = load_prompts(cfg.workload, tokenizer)
    # What workload.chat (auto by default) resolved to, and which file the template came from.
    prompt_format = {"chat": "template" if resolve_chat(cfg.workload, tokenizer) else "raw",
                     "chat_template_source": getattr(tokenizer, "chat_template_source", None)}
    resolved["workload"]["chat_resolved"] = prompt_format["chat"]
    (run_dir / "config.json").write_text(json.dumps(resolved, indent=2))
    replayed = (cfg.get("acceptance") or {}).get("name", "real") == "replay"
    logger = make_logger(cfg.logger, run_dir, run_dir.name,
                         {**resolved, "provenance": stamp, "acceptance_label": "replayed" if replayed else "real"})
    overrides = hydra_overrides()
    job = sweep_position()
    title = f"[{job}] " if job else ""
    plain = None
    with sigterm_raises():
        try:
            if cfg.get("compare_plain", False):
                # Plain decoding first, as its own run directory inside this one (config.json +
                # metrics.json: specdec.report finds it and matches it as this run's baseline).
                plain_dir = run_dir / "plain"
                plain_dir.mkdir(exist_ok=True)
                pcfg = plain_config(resolved, plain_dir)
                (plain_dir / "config.json").write_text(json.dumps(pcfg, indent=2))
                plain = serve(OmegaConf.create(pcfg), model, tokenizer, prompts, device, plain_dir,
                              f"{title}plain decoding",
                              run_facts(cfg, model, device, prompt_format, stamp, plain_overrides(overrides)),
                              profile=False)
            records, metrics = serve(cfg, model, tokenizer, prompts, device, run_dir, f"{title}serving",
                                     run_facts(cfg, model, device, prompt_format, stamp, overrides))
            if plain is not None:
                metrics.update(compare(plain, (records, metrics)))
                (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
            logger.log_metrics(scalars(metrics))  # numbers, and acceptance per depth flattened
            logger.log_summary(stamp)
            logger.log_table("requests", ["id", "output_tokens", "output"],
                             [[r["id"], r.get("output_tokens", 0), r.get("output", "")] for r in records])
        finally:
            logger.finish()
    print_table(records, metrics)
    if plain is not None:
        print_comparison(cfg, plain[1], metrics)
    print(f"run directory: {run_dir}")
    return metrics


def failed_requests(metrics: dict) -> int:
    """Requests that failed in the run, and in its plain baseline when it served one."""
    return int(metrics.get("failed_requests") or 0) + int(metrics.get("plain_failed_requests") or 0)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    try:
        metrics = run(cfg)
    except (SpecdecError, MissingMandatoryValue) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except Interrupted as e:
        sys.exit(128 + e.signum)  # 143 for SIGTERM, the shell's convention
    except KeyboardInterrupt:
        sys.exit(130)
    if OmegaConf.select(cfg, "run.fail_on_error", default=False) and failed_requests(metrics):
        print(f"error: {failed_requests(metrics)} request(s) failed (run.fail_on_error=true); their records in "
              f"{cfg.run_dir}/requests.jsonl say why", file=sys.stderr)
        sys.exit(3)
    return metrics["output_tok_per_s"]


if __name__ == "__main__":
    main()
