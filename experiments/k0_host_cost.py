"""Is speculation off free on the host? Per-iteration host time of an engine without a drafter vs
one with the n-gram drafter and one with the EAGLE-3 drafter (catch-up, the default), all under
policy=never (every decode step k = 0), serving the same closed-loop stream.

A tiny random Llama (hidden 32, 1 layer) on the CPU with the torch kernels, so the forwards stay
small; the time inside them (the CPU's stand-in for device work) is measured and subtracted, which
leaves the engine's own Python work per ``Engine.step``. The engines are built like
a serving run's: the drafter's sizes configured as ks (its trees are reserved, its graphs would be
captured), overlapped decoding on and prefill / decode padded to the graph buckets (``pad_eager``:
the padded static-buffer prefill runners a GPU replays), a step trace attached (the benchmark's
StepTrace). The load is closed-loop: C requests in flight, each finished one replaced by the next
prompt (short random prompts, ``--max-new`` tokens each), until ``--requests`` have finished.

Per engine: the mean and median ms per iteration (time.perf_counter around step()), and the same
less the time inside the model's and the head's forwards (the engine's own host work), over
``--repeats`` runs in one process, engines interleaved (none first and last, to show drift); then
one cProfile run per engine and the functions whose call counts or own time differ from the
no-drafter engine's (the host work a drafter adds while off). Greedy outputs of all engines are
checked equal.

Run (CPU, ~1-2 min):  python experiments/k0_host_cost.py [--quick] [--profile-top 25]
"""

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]
from specdec.engine.engine import Engine, EngineConfig  # noqa: E402
from specdec.models.eagle3 import Eagle3Config, Eagle3Head  # noqa: E402
from specdec.models.llama import LlamaModel  # noqa: E402
from specdec.models.loading import LlamaConfig  # noqa: E402
from specdec.policy import Never  # noqa: E402
from specdec.spec import Eagle3Drafter, NgramDrafter  # noqa: E402
from specdec.spec.base import sizes  # noqa: E402

VOCAB = 256


def tiny_target(hidden: int, layers: int) -> LlamaModel:
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB, head_dim=hidden // 2,
                      max_position_embeddings=512, rope_theta=10000.0)
    return LlamaModel.random(cfg, dtype="float32", seed=0, backend="torch").init_rope()


def random_head(model) -> Eagle3Head:
    cfg = Eagle3Config.for_target(model.config, VOCAB, target_layers=(0, 0, 0))
    head = Eagle3Head(cfg, backend=model.backend).init_weights_(0)
    head.set_vocab_(torch.arange(VOCAB))
    return head.to_device(model.device, torch.float32)


def make_drafter(name: str, model, head):
    if name == "none":
        return None
    if name == "ngram":
        return NgramDrafter(chains=[2, 4])
    return Eagle3Drafter(head, model, trees=[(1, 3, 3), (2, 3, 6)])  # catch-up (the default)


def prompts_for(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 48, (n,), generator=gen).tolist()
    return [torch.randint(0, VOCAB, (m,), generator=gen).tolist() for m in lengths]


class ForwardClock:
    """Wall time spent inside the model's (and the head's) forwards and logits: the CPU's stand-in
    for device work, subtracted from each step to leave the engine's own host work."""

    def __init__(self, *modules):
        self.s = 0.0
        self._real = []
        for m in modules:
            for attr in ("forward", "logits"):
                if hasattr(m, attr):
                    real = getattr(m, attr)
                    self._real.append((m, attr))
                    setattr(m, attr, self._timed(real))

    def _timed(self, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.s += time.perf_counter() - t0
        return timed

    def remove(self):
        for m, attr in self._real:
            delattr(m, attr)  # back to the class's method


def serve(model, head, name, args, prompts, profiler=None):
    """One closed-loop run; returns (ms per iteration, ms per iteration outside the forwards,
    outputs by prompt index, the engine)."""
    drafter = make_drafter(name, model, head)
    ks = (sizes(drafter) or (0,)) if args.ks == "sizes" else (0,)
    trace = []
    engine = Engine(model, EngineConfig(max_batch_size=args.concurrency, page_size=16,
                                        kv_cache_tokens=args.concurrency * 128, prefill_chunk=256,
                                        overlap=True, pad_eager=not args.no_pad,
                                        prefill_buckets=(16, 32, 64, 128, 256), prefill_requests=(1, 8, 64)),
                    drafter=drafter, policy=Never(), ks=ks, trace=trace.append)
    todo = iter(enumerate(prompts))
    index: dict[int, int] = {}
    out: dict[int, list[int]] = {}

    def submit():
        nxt = next(todo, None)
        if nxt is not None:
            index[id(engine.add_request(nxt[1], args.max_new, ignore_eos=True))] = nxt[0]

    for _ in range(args.concurrency):
        submit()
    times, host = [], []
    clock = ForwardClock(model, head)
    if profiler is not None:
        profiler.enable()
    while engine.has_work():
        f0 = clock.s
        t0 = time.perf_counter()
        done = engine.step()
        dt = time.perf_counter() - t0
        times.append(dt * 1e3)
        host.append((dt - (clock.s - f0)) * 1e3)
        for req in done:  # the client's next prompt (outside the timed step, as the benchmark's client)
            out[index[id(req)]] = req.output_ids
            submit()
    engine.flush_trace()
    if profiler is not None:
        profiler.disable()
    clock.remove()
    assert all(rec["k"] == 0 for rec in trace), "policy never ran a speculative step"
    return times, host, out, engine


def by_function(stats: pstats.Stats) -> dict:
    """{(file, line, name): (calls, tottime s, cumtime s)} of one profile."""
    return {f"{Path(fn[0]).name}:{fn[1]}({fn[2]})": (nc, tt, ct)
            for fn, (cc, nc, tt, ct, _) in stats.stats.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-pad", action="store_true", help="eager prefill / decode at exact shapes")
    ap.add_argument("--ks", choices=("sizes", "0"), default="sizes",
                    help="ks of the engines with a drafter: its sizes (a policy that may speculate), or "
                         "only 0 (policy=never alone, as specdec.run builds it)")
    ap.add_argument("--profile-top", type=int, default=25)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.concurrency, args.requests, args.max_new, args.repeats = 16, 48, 12, 1
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = tiny_target(args.hidden, args.layers)
    head = random_head(model)
    prompts = prompts_for(args.requests)
    names = ("none", "ngram", "eagle3")
    print(f"# k0_host_cost.py: C={args.concurrency}, {args.requests} requests x {args.max_new} new tokens, "
          f"hidden {args.hidden}, {args.layers} layer(s), torch {torch.__version__}, CPU, policy never, "
          f"overlap on, padded: {not args.no_pad}, ks: {args.ks}")
    serve(model, head, "none", args, prompts[: args.concurrency])  # warm-up (allocator, first calls)
    per = {n: [] for n in names}
    per_host = {n: [] for n in names}
    iters, outputs = {}, {}
    for rep in range(args.repeats):
        for name in (*names, "none") if rep == args.repeats - 1 else names:
            times, host, out, _ = serve(model, head, name, args, prompts)
            per[name].extend(times)
            per_host[name].extend(host)
            iters[name], outputs[name] = len(times), out
    for name in names:
        assert outputs[name] == outputs["none"], f"{name}: greedy outputs differ from draft=none"
    base, base_h = statistics.mean(per["none"]), statistics.mean(per_host["none"])
    print("\n| engine | iterations | ms / iteration (mean) | median | vs none | outside the forwards: ms / iteration "
          "(mean) | median | vs none |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        t, h = per[name], per_host[name]
        print(f"| {name} | {iters[name]} | {statistics.mean(t):.3f} | {statistics.median(t):.3f} | "
              f"{statistics.mean(t) / base:.3f}x | {statistics.mean(h):.3f} | {statistics.median(h):.3f} | "
              f"{statistics.mean(h) / base_h:.3f}x |")
    profiles = {}
    for name in names:
        prof = cProfile.Profile()
        serve(model, head, name, args, prompts, profiler=prof)
        profiles[name] = by_function(pstats.Stats(prof))
    ref = profiles["none"]
    for name in names[1:]:
        rows = []
        for fn, (nc, tt, ct) in profiles[name].items():
            nc0, tt0, ct0 = ref.get(fn, (0, 0.0, 0.0))
            if nc != nc0 or abs(tt - tt0) > 0.002:
                rows.append((tt - tt0, fn, nc0, nc, tt0, tt, ct0, ct))
        gone = [fn for fn in ref if fn not in profiles[name]]
        head_row = ("| function | calls none | calls | tottime none ms | tottime ms | cumtime none ms | cumtime ms |\n"
                    "|---|---|---|---|---|---|---|")
        for title, key in (("|d calls|", lambda r: -abs(r[3] - r[2])), ("|d tottime|", lambda r: -abs(r[0]))):
            print(f"\n## {name} vs none: functions whose calls or own time differ (top {args.profile_top} by {title})\n")
            print(head_row)
            for d, fn, nc0, nc, tt0, tt, ct0, ct in sorted(rows, key=key)[: args.profile_top]:
                print(f"| {fn} | {nc0} | {nc} | {tt0 * 1e3:.1f} | {tt * 1e3:.1f} | {ct0 * 1e3:.1f} | {ct * 1e3:.1f} |")
        extra = [r for r in rows if r[2] == 0]
        print(f"\nonly with {name}: {len(extra)} functions, {sum(r[3] for r in extra)} calls: "
              + ", ".join(f"{r[1]} x{r[3]}" for r in sorted(extra, key=lambda r: -r[3])[:12]))
        if gone:
            print(f"only without a drafter: {', '.join(gone[:12])}")


if __name__ == "__main__":
    main()
