"""Profile: where does a batch-1 request's time go? SmolLM2-135M shapes, bf16, RANDOM weights (the
costs do not depend on the values), an EAGLE-3 head of the committed head's shapes (random too).

(a) prefill: wall milliseconds of the engine step that prefills one new prompt (~120-190 tokens,
    chat-prompt lengths of the eagle3_table runs) and decodes its first token, with and without
    the drafter; then torch.profiler's busiest host-side ops of one such step;
(b) graphed decode steps at batch 1: k = 0 and each configured tree size T: replay wall time vs
    the sum of the kernel durations inside the graph (the gap is launch / dependency latency),
    kernels per replay, and the kernels that take the most device time.

Run (one GPU, ~1 min, no model files, Hydra or W&B needed):
    python experiments/profile_step.py --out $OUT
    python experiments/profile_step.py --step-kernels false --out $OUT/no_step_kernels   # torch addressing
    python experiments/profile_step.py --fused-linear false --out $OUT/unfused   # cuBLAS layer path
    python experiments/profile_step.py --shape llama8b --out $OUT/llama8b   # (b) plain step only, 8B shapes
    python experiments/profile_step.py --pdl off --out $OUT/pdl0   # no programmatic dependent launch
    python experiments/profile_step.py --steps-only --temperature 1 --top-p 0.95 --out $OUT/top_p  # sampled steps
    python experiments/profile_step.py --shape qwen3_30b_a3b --batches 1,8,64 --out $OUT/q3moe   # see (e)
    python experiments/profile_step.py --shape qwen3_30b_a3b --ab fused_moe=false,true --out $OUT/q3moe_ab
(c) --phases: each graphed step split into its phases (draft root, each growth round, last expand +
    tree_select, verify forward, verify_accept, kv_sync, draft extend), every phase captured as a
    CUDA graph of its own (specdec.engine.profiling.graphed_phases): ms per phase and the kernels it
    launches per step;
(d) --ab OPTION=V1,V2,...: (b) (and (c) with --phases) once per value of one kernel option, in this
    process (engines built after each value is set, so their graphs capture it), one table at the end;
    several --ab flags: every combination, the first one the slowest-varying:
    python experiments/profile_step.py --steps-only --phases --ab fused_rows=null,64 --out $OUT/ab_rows
    python experiments/profile_step.py --steps-only --phases --trees tree16,tree32,tree48 \
        --ab stream_tiles=null,builtin --out $OUT/ab_tiles   # the streaming body's tile tables
    python experiments/profile_step.py --shape llama8b --steps-only --phases --trees tree16 \
        --ab draft_weight_dtype=model,int8 --out $OUT/ab_w8   # the head's projections (draft.weight_dtype)
(e) --shape qwen3_8b | qwen3_30b_a3b: the graphed plain step of conf/target/qwen3_{8b,30b_a3b}_random.yaml
    (built as target=..._random builds it; max_seq_len 1024, so the 30B-A3B's 61 GB fit one 80 GB GPU
    with its KV) at each --batches size, its kernel time grouped by family (MoE router, top-k, gate_up,
    down, combine, attention, norms, linears, ...): one table, us and launches per replay per batch.
The kernel options (--pdl, --fused-linear, --step-kernels, --fused-rows, --stream-tiles;
kernels_triton/options.py) are recorded in profile_step.json as "kernel_options".
CPU smoke run (tiny shapes, numbers meaningless):
    python experiments/profile_step.py --quick --out /tmp/profile_step
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first @triton.jit import

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from kernels_triton import options  # noqa: E402
from specdec.bench.provenance import device_name, provenance  # noqa: E402
from specdec.bench.targets import llama_config_from_dict, load_target_yaml  # noqa: E402
from specdec.engine.profiling import borrowed_rows, profile_slots  # noqa: E402
from specdec.models.llama import LlamaModel  # noqa: E402
from specdec.engine.engine import Engine, EngineConfig  # noqa: E402
from specdec.models.eagle3 import Eagle3Config, Eagle3Head  # noqa: E402
from specdec.spec import Eagle3Drafter  # noqa: E402

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
               rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
TINY = dict(SMOLLM2, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# The steps' sampling (--temperature, --top-k, --top-p, --min-p): greedy unless set.
SAMPLING: dict = {}


def make_engine(model, drafter, trees, max_seq_len=None, prefill_graphs=True, batches=(1,)):
    # prefill_graphs False: no prefill / catch-up graphs (~40 captures per EAGLE-3 engine) for engines
    # that only replay decode steps; the decode graphs are the same either way. batches: the decode
    # graph buckets (the largest is max_batch_size), with KV for each row's STEP_CONTEXT and its steps.
    cfg = EngineConfig(max_batch_size=max(batches), graph_buckets=sorted(batches),
                       kv_cache_tokens=max(8192, 512 * max(batches)), max_seq_len=max_seq_len,
                       **({} if prefill_graphs else {"prefill_buckets": ()}), **SAMPLING)
    return Engine(model, cfg, eos_ids=[], drafter=drafter, ks=(0, *trees) if drafter else (0,))


def prefill_ms(engine, lengths, vocab) -> list[float]:
    out = []
    gen = torch.Generator().manual_seed(0)
    for n in lengths:
        ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
        engine.add_request(ids, 1)
        sync()
        t0 = time.perf_counter()
        engine.step(0)
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
        engine.run_until_done()
    return out


def host_profile(engine, n, vocab, rows=18) -> str:
    from torch.profiler import ProfilerActivity, profile

    engine.add_request(torch.randint(3, vocab, (n,)).tolist(), 1)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        engine.step(0)
        sync()
    engine.run_until_done()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60)


STEP_CONTEXT = 256  # tokens of context of each profiled row

# Kernel families of a step's breakdown: (label, substrings of a kernel name), the first match wins;
# a name matching none is its own family (cut to 40 characters)
FAMILIES = (
    ("moe_route_fused", ("_moe_route_fused_kernel",)),
    ("moe_router", ("_moe_router_kernel",)),
    ("moe_topk", ("_moe_topk_kernel",)),
    ("moe_sort", ("_moe_sort_kernel",)),
    ("moe_gate_up", ("_moe_gate_up_kernel",)),
    ("moe_down", ("_moe_down_kernel",)),
    ("moe_combine", ("_moe_combine_kernel",)),
    ("attention", ("attention",)),
    ("rope_kv_write", ("rope", "_write_kv_kernel")),
    ("norm", ("rms_norm", "_add_norm_store", "_fused_norm")),
    ("linear", ("_fused_linear_kernel", "_stream_prologue_kernel", "_split_reduce", "_linear_exact_kernel",
                "_w8_")),
    ("gemm_cublas", ("gemm", "gemv", "nvjet", "cutlass", "xmma")),
    ("silu_mul", ("silu_mul",)),
    ("sampling", ("argmax", "topk", "_warp_kernel")),
    ("torch_elementwise", ("elementwise",)),
    ("torch_reduce", ("reduce_kernel",)),
    ("torch_other", ("at::",)),
)


def kernel_family(name: str) -> str:
    for label, keys in FAMILIES:
        if any(k in name for k in keys):
            return label
    return name[:40]


def graphed_step(engine, T: int, iters: int = 20, batch: int = 1) -> dict:
    """Wall ms per replay of the step with T tree nodes at ``batch`` rows of STEP_CONTEXT tokens, and
    its kernels from the profiler: each name and each family (FAMILIES) with launches and us per replay
    (off CUDA: the host's torch ops by self time, a smoke run of the same accounting)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.model.device.type == "cuda"
    run = engine.stepper.runner.run_
    with borrowed_rows(engine, batch, STEP_CONTEXT, profile_slots(engine, STEP_CONTEXT, 3 + 2 * iters, T),
                       "graphed_step"):
        for _ in range(3):
            run(batch, T)
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            run(batch, T)
        sync()
        wall = (time.perf_counter() - t0) * 1e3 / iters
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            for _ in range(iters):
                run(batch, T)
            sync()
    if cuda:
        kernels = [(e.name, e.device_time) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    else:
        kernels = [(e.name, e.self_cpu_time_total) for e in prof.events()]
    busy = sum(us for _, us in kernels) / 1e3 / iters  # us -> ms
    by_name: dict[str, list[float]] = {}
    by_family: dict[str, list[float]] = {}
    for name, us in kernels:
        for c in (by_name.setdefault(name, [0.0, 0.0]), by_family.setdefault(kernel_family(name), [0.0, 0.0])):
            c[0] += 1 / iters
            c[1] += us / iters
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    return {"T": T, "B": batch, "replay_ms": wall, "kernel_ms": busy, "kernels": len(kernels) / iters,
            "gap_ms": wall - busy, "top_us": [(n[:70], round(c[1], 1)) for n, c in ranked[:12]],
            # every kernel name: [launches per replay, us per replay]
            "all_kernels": [(n[:90], round(c[0], 2), round(c[1], 1)) for n, c in ranked],
            # each family: {launches per replay, us per replay}, the most device time first
            "families": {f: {"launches": round(c[0], 2), "us": round(c[1], 1)}
                         for f, c in sorted(by_family.items(), key=lambda kv: -kv[1][1])}}


TREES = {"chain5": (1, 5, 5), "tree16": (4, 5, 16), "tree20_deep": (4, 7, 20), "tree32": (8, 6, 32),
         "tree48": (8, 7, 48)}
PHASE_CONTEXT = STEP_CONTEXT  # tokens of context of the profiled row


# --ab draft_weight_dtype=model,int8: the EAGLE-3 head's projection weights (draft.weight_dtype; without it auto), not a
# kernel option: set on the head before each combination's engines are built
HEAD_AB = "draft_weight_dtype"


def parse_ab(text: str):
    """'fused_rows=null,64' -> ('fused_rows', [None, 64]), validated by kernels_triton.options (or
    HEAD_AB=model,int8)."""
    name, sep, vals = text.partition("=")
    name = name.strip().replace("-", "_")
    if name == HEAD_AB and vals:
        from specdec.models.eagle3 import WEIGHT_DTYPES

        bad = [v for v in vals.split(",") if v not in WEIGHT_DTYPES]
        if bad:
            raise SystemExit(f"error: --ab {text!r}: {HEAD_AB} values are {', '.join(WEIGHT_DTYPES)}")
        return name, vals.split(",")
    if not sep or name not in options.FIELDS or not vals:
        raise SystemExit(f"error: --ab {text!r}: expected OPTION=V1,V2 with OPTION one of {', '.join(options.FIELDS)}")
    try:
        return name, [options.parse_value(name, v) for v in vals.split(",")]
    except ValueError as e:
        raise SystemExit(f"error: --ab: {e}") from None


def step_set(model, head, trees, phases: bool, opts: dict, max_seq_len=None) -> dict:
    """Graphed batch-1 steps: plain and each tree (with ``phases``, each split into its phases too),
    engines built under the kernel options in force now."""
    from specdec.engine.profiling import graphed_phases

    out = {"kernel_options": opts, "steps": {}, "phases": {}}
    it = dict(iters=50) if torch.cuda.is_available() else dict(iters=1, warmup=1)  # CPU: a smoke run
    plain = make_engine(model, None, (), max_seq_len=max_seq_len, prefill_graphs=False)
    out["steps"]["plain"] = graphed_step(plain, 1)
    if phases:
        out["phases"]["plain"] = graphed_phases(plain, 1, PHASE_CONTEXT, 0, **it)
    del plain
    for name, (topk, steps, n) in trees.items():
        drafter = Eagle3Drafter(head, model, topk=topk, steps=steps, num_draft_tokens=n)
        eng = make_engine(model, drafter, (n,), max_seq_len=max_seq_len, prefill_graphs=False)
        out["steps"][name] = graphed_step(eng, drafter.num_nodes(n))
        if phases:
            out["phases"][name] = graphed_phases(eng, 1, PHASE_CONTEXT, n, **it)
        del eng
    return out


def print_phases(name: str, ph: dict) -> None:
    print(f"\n{name}: T = {ph['T']}, phases sum {ph['sum_ms']:.3f} ms ({'graph per phase' if ph['graphed'] else 'eager'})")
    print(f"  {'phase':<72} {'ms':>7} {'kernels':>8} {'kernel ms':>9}")
    for p in ph["phases"]:
        k = p.get("kernels")
        km = p.get("kernel_ms")
        print(f"  {p['label']:<72} {p['ms']:7.4f} {'-' if k is None else f'{k:.0f}':>8} "
              f"{'-' if km is None else f'{km:.4f}':>9}")


def print_ab(ab: dict, phases: bool) -> None:
    vals = list(ab["values"])
    if phases:  # first, so that the summary table below ends the output
        for v in vals:
            print(f"\n=== {v}")
            for n, ph in ab["values"][v]["phases"].items():
                print_phases(n, ph)
    print(f"\ngraphed batch-1 step ms by kernel options {ab['option']} (ratio to plain of the same options, kernels)")
    width = max(26, *(len(v) for v in vals))
    print(f"  {'step':<8} " + " ".join(f"{v:>{width}}" for v in vals))
    for n in ab["values"][vals[0]]["steps"]:
        cells = []
        for v in vals:
            st = ab["values"][v]["steps"]
            ms = st[n]["replay_ms"]
            k = st[n].get("kernels")
            cells.append(f"{ms:.4f} ({ms / st['plain']['replay_ms']:.2f}x, {'-' if k is None else round(k)} k)")
        print(f"  {n:<8} " + " ".join(f"{c:>{width}}" for c in cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--shape", choices=["smollm2", "llama8b", *QWEN3], default="smollm2",
                    help="llama8b: Llama-3.1-8B shapes (conf/target/llama31_8b_random.yaml), engine as in "
                         "bench_serving part b (max_seq_len 4096); the plain step only, or with --phases / --ab "
                         "the trees too, with a random EAGLE-3 head of its shape (32k draft vocabulary). "
                         "qwen3_8b, qwen3_30b_a3b: (e), the plain step at each --batches size")
    ap.add_argument("--batches", default="1", help="(e): comma-separated batch sizes of the plain step")
    ap.add_argument("--steps-only", action="store_true", help="skip (a): prefill timings and host profiles")
    ap.add_argument("--phases", action="store_true", help="(c): per-phase ms and kernels of each graphed step")
    ap.add_argument("--ab", metavar="OPTION=V1,V2", action="append",
                    help="(d): the steps once per value of a kernel option (repeatable: every combination)")
    ap.add_argument("--trees", default=",".join(TREES), help=f"tree shapes to step (of {', '.join(TREES)})")
    for flag, default, what in (("temperature", 0.0, "0: greedy"), ("top-k", 0, "0: off"), ("top-p", 1.0, "1: off"),
                                ("min-p", 0.0, "0: off")):
        ap.add_argument(f"--{flag}", type=type(default), default=default, help=f"the steps' sampling ({what})")
    options.add_flags(ap)
    args = ap.parse_args()
    options.set_from_flags_(args)
    off = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}  # greedy, no warper
    SAMPLING.update({k: getattr(args, k) for k in off if getattr(args, k) != off[k]})
    args.out.mkdir(parents=True, exist_ok=True)
    ab = [parse_ab(a) for a in args.ab] if args.ab else None
    if args.shape in QWEN3:
        return profile_qwen3(args, ab)
    if args.shape == "llama8b" and not (args.phases or args.ab):
        return profile_llama8b(args)
    trees = {n: TREES[n] for n in args.trees.split(",") if n}
    unknown = sorted(set(trees) - set(TREES))
    if unknown or not trees:
        raise SystemExit(f"error: --trees {args.trees!r}: valid names {', '.join(TREES)}")
    cuda = torch.cuda.is_available() and not args.quick
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    max_seq_len, draft_vocab = None, 8192 if not args.quick else 256
    if args.shape == "llama8b":  # the steps only (no prefill timings), as profile_llama8b's engine
        shape, max_seq_len, draft_vocab, args.steps_only = llama8b_shape(cuda), 8192 if cuda else 4096, 32000 if cuda else 256, True
    else:
        shape = TINY if args.quick else SMOLLM2
    model = LlamaModel.random(llama_config_from_dict(shape), device=dev, dtype=dtype)
    head_cfg = Eagle3Config.for_target(model.config, draft_vocab)
    head = Eagle3Head(head_cfg, backend=model.backend).init_weights_(0)
    head.set_vocab_(torch.arange(head_cfg.draft_vocab_size))
    head.to_device(dev, dtype)
    lengths = [150, 131, 160, 144, 120, 188] if not args.quick else [20, 24]
    V = shape["vocab_size"]
    res = {**provenance(dev), "device": device_name(dev), "date": time.strftime("%Y-%m-%d"),
           "sampling": dict(SAMPLING)}
    opts = res["kernel_options"]

    if ab is not None:
        import itertools

        res["ab"] = {"option": ", ".join(n for n, _ in ab), "values": {}}
        for combo in itertools.product(*[[(n, v) for v in vals] for n, vals in ab]):
            options.set_from_flags_(args)
            combo_opts = dict(combo)
            head.set_weight_dtype_(combo_opts.pop(HEAD_AB, "auto"))
            options.set_(**combo_opts)
            label = ",".join(f"{n}={'null' if v is None else str(v).lower()}" for n, v in combo)
            res["ab"]["values"][label] = step_set(model, head, trees, args.phases, options.get().as_dict(), max_seq_len)
            # after every combination: a run cut short by its time limit still returns what it measured
            (args.out / "profile_step.json").write_text(json.dumps(res, indent=2))
            print(f"{label}: " + ", ".join(f"{n} {st['replay_ms']:.4f} ms"
                                          for n, st in res["ab"]["values"][label]["steps"].items()), flush=True)
        options.reset_()
        options.set_from_flags_(args)
        (args.out / "profile_step.json").write_text(json.dumps(res, indent=2))
        print_ab(res["ab"], args.phases)
        print(f"commit {res['commit']}, {res['device']}, {res['date']}")
        return
    if not args.steps_only:
        plain = make_engine(model, None, ())
        prefill_ms(plain, lengths[:2], V)  # compiles
        res["prefill_plain_ms"] = prefill_ms(plain, lengths, V)
        res["host_profile_plain"] = host_profile(plain, 150 if not args.quick else 20, V)
        del plain
        drafter = Eagle3Drafter(head, model, topk=4, steps=5, num_draft_tokens=16)
        eng = make_engine(model, drafter, (16,))
        prefill_ms(eng, lengths[:2], V)
        res["prefill_eagle3_ms"] = prefill_ms(eng, lengths, V)
        res["host_profile_eagle3"] = host_profile(eng, 150 if not args.quick else 20, V)
        del eng
    res.update(step_set(model, head, trees, args.phases, opts, max_seq_len))
    (args.out / "profile_step.json").write_text(json.dumps(res, indent=2))
    if args.phases:
        for name, ph in res["phases"].items():
            print_phases(name, ph)
    if args.steps_only:
        for name, st in res["steps"].items():
            print(name, json.dumps(st))
        print(f"commit {res['commit']}, {res['device']}, {res['date']}, kernel options {opts}")
        return
    print(res["host_profile_plain"])
    print(res.get("host_profile_eagle3", ""))
    print(f"prefill ms (plain): {[round(x, 1) for x in res['prefill_plain_ms']]}, "
          f"median {statistics.median(res['prefill_plain_ms']):.1f}")
    print(f"prefill ms (eagle3): {[round(x, 1) for x in res['prefill_eagle3_ms']]}, "
          f"median {statistics.median(res['prefill_eagle3_ms']):.1f}")
    for name, s in res["steps"].items():
        print(name, json.dumps(s))
    print(f"commit {res['commit']}, {res['device']}, {res['date']}, kernel options {opts}")


def llama8b_shape(cuda: bool) -> dict:
    """conf/target/llama31_8b_random.yaml's shape (off CUDA: the same structure, tiny sizes)."""
    shape = dict(load_target_yaml(REPO / "conf" / "target" / "llama31_8b_random.yaml")["config"])
    if not cuda:
        shape.update(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=4096)
    return shape


def profile_llama8b(args) -> None:
    cuda = torch.cuda.is_available() and not args.quick
    shape = llama8b_shape(cuda)
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    model = LlamaModel.random(llama_config_from_dict(shape), device=dev, dtype=dtype)
    eng = make_engine(model, None, (), max_seq_len=4096)
    res = {**provenance(dev), "device": device_name(dev), "date": time.strftime("%Y-%m-%d"), "shape": "llama8b",
           "sampling": dict(SAMPLING),
           "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
           "steps": {"plain": graphed_step(eng, 1)}}
    (args.out / "profile_step.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res["steps"]["plain"], indent=1))


# (e): --shape -> its random-weight preset in conf/target/
QWEN3 = {"qwen3_8b": "qwen3_8b_random.yaml", "qwen3_30b_a3b": "qwen3_30b_a3b_random.yaml"}
# off CUDA: the presets' structure at tiny sizes (an MoE preset keeps MoE layers: 8 experts, top-2)
TINY_QWEN3 = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=4096)
TINY_EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


def qwen3_target(shape: str, cuda: bool) -> dict:
    """The preset of ``shape`` as a dict (off CUDA: its config at TINY_QWEN3 / TINY_EXPERTS sizes)."""
    conf = load_target_yaml(REPO / "conf" / "target" / QWEN3[shape])
    if not cuda:
        tiny = {**TINY_QWEN3, **(TINY_EXPERTS if conf["config"].get("num_experts") else {})}
        conf["config"] = {**conf["config"], **tiny}
    return conf


def profile_qwen3(args, ab=None) -> None:
    """(e): the graphed plain step of a Qwen3 preset at each --batches size, its kernels by family; with
    ``ab`` (parsed --ab flags, kernel options only), once per combination of their values, engines built
    after each is set (e.g. --ab fused_moe=false,true)."""
    import itertools

    from specdec.models.routing import apply_routing_

    try:
        batches = sorted({int(b) for b in args.batches.split(",") if b.strip()})
    except ValueError:
        batches = []
    if not batches or batches[0] < 1:
        raise SystemExit(f"error: --batches {args.batches!r}: expected positive integers, e.g. 1,8,64")
    if ab and any(n == HEAD_AB for n, _ in ab):
        raise SystemExit(f"error: --ab {HEAD_AB}: --shape {args.shape} profiles the plain step (no draft head)")
    cuda = torch.cuda.is_available() and not args.quick
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    conf = qwen3_target(args.shape, cuda)
    # as specdec.run's build_target builds a random_weights target (seed 0, the preset's routing)
    model = LlamaModel.random(llama_config_from_dict(conf["config"]), device=dev, dtype=dtype, seed=0)
    apply_routing_(model, conf)
    res = {**provenance(dev), "device": device_name(dev), "date": time.strftime("%Y-%m-%d"), "shape": args.shape,
           "sampling": dict(SAMPLING),
           "target": conf["name"], "config": conf["config"], "context": STEP_CONTEXT,
           "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()), "steps": {}}
    combos = list(itertools.product(*[[(n, v) for v in vals] for n, vals in ab])) if ab else [()]
    for combo in combos:
        options.set_from_flags_(args)
        options.set_(**dict(combo))
        label = ",".join(f"{n}={'null' if v is None else str(v).lower()}" for n, v in combo)
        eng = make_engine(model, None, (), max_seq_len=1024 if cuda else 512, prefill_graphs=False, batches=batches)
        steps = res["steps"] if not combo else res.setdefault("ab", {}).setdefault(label, {"steps": {}})["steps"]
        if combo:
            res["ab"][label]["kernel_options"] = options.get().as_dict()
        for B in batches:
            st = steps[f"plain_b{B}"] = graphed_step(eng, 1, batch=B)
            (args.out / "profile_step.json").write_text(json.dumps(res, indent=2))  # a cut-short run keeps these
            print(f"{label + ' ' if label else ''}B={B}: "
                  + json.dumps({k: v for k, v in st.items() if k not in ("all_kernels", "families")}), flush=True)
        del eng
        if combo:
            print(f"\n--ab {label}")
            print_families({**res, "steps": steps, "kernel_options": options.get().as_dict()},
                           model.config.num_hidden_layers)
    options.reset_()
    options.set_from_flags_(args)
    if not ab:
        print_families(res, model.config.num_hidden_layers)


def print_families(res: dict, layers: int, rows: int = 24) -> None:
    """One row per kernel family (the ``rows`` busiest), per batch size: us and launches per replay."""
    steps = res["steps"]
    fams: dict[str, float] = {}
    for st in steps.values():
        for f, c in st["families"].items():
            fams[f] = max(fams.get(f, 0.0), c["us"])
    order = sorted(fams, key=lambda f: -fams[f])
    print(f"\n{res['shape']} ({res['target']}), graphed plain step, context {res['context']}, {layers} layers: "
          "kernel us and launches per replay (us / layers: a once-per-layer kernel's cost per layer)")
    print(f"  {'family':<22} " + " ".join(f"{'B=' + str(st['B']) + ' us':>11} {'n':>6} {'us/L':>7}"
                                          for st in steps.values()))
    for f in order[:rows]:
        cells = []
        for st in steps.values():
            c = st["families"].get(f)
            cells.append(f"{'-':>11} {'-':>6} {'-':>7}" if c is None else
                         f"{c['us']:11.1f} {c['launches']:6.0f} {c['us'] / layers:7.2f}")
        print(f"  {f:<22} " + " ".join(cells))
    if len(order) > rows:
        print(f"  (+{len(order) - rows} more families in profile_step.json)")
    print(f"  {'kernels (sum)':<22} " + " ".join(f"{st['kernel_ms'] * 1e3:11.1f} {st['kernels']:6.0f} "
                                                f"{st['kernel_ms'] * 1e3 / layers:7.2f}" for st in steps.values()))
    print(f"  {'replay (wall)':<22} " + " ".join(f"{st['replay_ms'] * 1e3:11.1f} {'':>6} "
                                                f"{st['replay_ms'] * 1e3 / layers:7.2f}" for st in steps.values()))
    print(f"commit {res['commit']}, {res['device']}, {res['date']}, kernel options {res['kernel_options']}")


if __name__ == "__main__":
    main()
