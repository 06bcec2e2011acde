"""Benchmark: speculation policies under load, all through the one step, in one run.

For SmolLM2-135M-Instruct on HumanEval prompts (chat template, greedy, 128 new tokens), closed-loop
concurrency C in {1, 2, 4, ..., 256} (--concurrency; 4 requests per client, at least 16, prompts reused
when a point needs more than half of them), the configurations of --configs beside each other:

    never            plain decoding (k = 0), the baseline
    always           a drafter, k draft tokens every step: n-gram prompt lookup (default, k = 4) or
                     the EAGLE-3 head (--draft eagle3: trees of --nodes nodes, k = nodes)
    batch_threshold  the same drafter, speculation off above a decode batch of 8, back on at 4
                     (--off-above, --on-at)
    goodput          the same drafter, k from {0} + --goodput-ks per step, by expected tokens per
                     second (a step-time table profiled at start-up x an EMA of acceptance)

Reports output tok/s, speed-up over `never` at the same C, fraction of steps speculating, mean
accepted length (tokens committed per speculative step and row), and how many outputs are
token-identical to `never` (in bf16 a verify forward over T tokens may round differently from a
1-token forward, so near-ties can flip; token identity is asserted in fp32 by the tests).

    python experiments/bench_spec.py --smollm2 DIR --prompts humaneval.jsonl --out OUT [--quick]
    python experiments/bench_spec.py ... --draft eagle3 [--head checkpoints/eagle3-smollm2-135m]

No Hydra / W&B / gguf imports: runs on a bare GPU machine with torch + triton + tokenizers.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from kernels_triton import options  # noqa: E402
from specdec.bench.provenance import git_commit  # noqa: E402

from specdec.bench.clients import closed_loop  # noqa: E402
from specdec.bench.metrics import StepTrace, request_record, summarize_requests  # noqa: E402
from specdec.engine.engine import Engine, EngineConfig  # noqa: E402
from specdec.models.llama import LlamaModel  # noqa: E402
from specdec.models.tokenizer import Tokenizer  # noqa: E402
from specdec.policy import Always, BatchThreshold, Goodput, Never  # noqa: E402
from specdec.spec import NgramDrafter  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smollm2", required=True, help="Hugging Face directory of SmolLM2-135M-Instruct")
    ap.add_argument("--prompts", required=True, help="humaneval.jsonl from the asset cache")
    ap.add_argument("--out", default="outputs/spec")
    ap.add_argument("--draft", choices=["ngram", "eagle3"], default="ngram")
    ap.add_argument("--k", type=int, default=None, help="draft tokens per step (default: ngram 4, eagle3 --nodes)")
    ap.add_argument("--head", default=str(REPO / "checkpoints" / "eagle3-smollm2-135m"), help="EAGLE-3 checkpoint")
    ap.add_argument("--topk", type=int, default=4, help="EAGLE-3 children per expanded node")
    ap.add_argument("--steps", type=int, default=5, help="EAGLE-3 tree depth")
    ap.add_argument("--nodes", type=int, default=16, help="EAGLE-3 tree nodes (num_draft_tokens)")
    ap.add_argument("--concurrency", default=None, help="closed-loop C values, comma list (default 1,2,4,...,256)")
    ap.add_argument("--off-above", type=int, default=8, help="batch_threshold: speculation off above this batch")
    ap.add_argument("--on-at", type=int, default=4, help="batch_threshold: back on at or below this batch")
    ap.add_argument("--while-off", choices=["catch_up", "sync", "left_behind"], default="catch_up",
                    help="EAGLE-3 during k = 0 steps: no draft work, backlog caught up on resume (default; "
                         "draft.catch_up=true), extend every step (draft.sync_while_off=true), or nothing "
                         "(draft.catch_up=false: stale on resume)")
    ap.add_argument("--trees", default=None,
                    help="EAGLE-3 tree shapes topk:steps:nodes, comma list (e.g. 1:3:3,2:4:8,4:5:16,8:6:32; "
                         "default: --topk:--steps:--nodes); always / batch_threshold use --k (default the largest)")
    ap.add_argument("--chains", default=None,
                    help="n-gram chain lengths, comma list (default: --k); goodput picks among them")
    ap.add_argument("--goodput-ks", default=None,
                    help="goodput: speculative lengths it may pick, comma list (default: every configured size)")
    ap.add_argument("--configs", default="always,batch_threshold,never",
                    help="policies to run, in this order (comma list; `never` is needed for the ratios)")
    ap.add_argument("--trace-dir", default=None,
                    help="also write each point's engine step records (k, batch, accepted, ...) to "
                         "DIR/steps_<config>_C<C>.jsonl")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny sizes")
    options.add_flags(ap)  # --pdl, --fused-linear, ... (kernels_triton/options.py)
    args = ap.parse_args()
    options.set_from_flags_(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.trace_dir:
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dev_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    model = LlamaModel.from_pretrained(args.smollm2, device=device)
    tok = Tokenizer(args.smollm2)
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines()]
    # humaneval.jsonl rows carry "prompt", mt_bench.jsonl rows "turns" (the first turn is sent)
    prompts = [tok.encode_chat([{"role": "user", "content": r.get("prompt") or r["turns"][0]}]) for r in rows]
    Cs = [1, 2] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128, 256]
    if args.concurrency:
        Cs = sorted(int(c) for c in args.concurrency.split(","))
    max_new = 8 if args.quick else 128
    buckets = tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max(Cs)) + (max(Cs),)
    if args.draft == "eagle3":
        from specdec.models.eagle3 import Eagle3Head
        from specdec.spec import Eagle3Drafter

        trees = ([tuple(int(x) for x in t.split(":")) for t in args.trees.split(",")] if args.trees
                 else [(args.topk, args.steps, args.nodes)])
        sizes = sorted(n for _, _, n in trees)
        k = args.k or sizes[-1]
        head = Eagle3Head.load(args.head, device=device, dtype=model.dtype, backend=model.backend,
                               target=model.config)
        make_drafter = lambda: Eagle3Drafter(head, model, trees=trees,  # noqa: E731
                                             sync_while_off=args.while_off == "sync",
                                             catch_up=args.while_off == "catch_up")
        shapes = ", ".join(f"{n} (topk {t}, depth {d})" for t, d, n in sorted(trees, key=lambda x: x[2]))
        drafter_name = f"EAGLE-3 head {Path(args.head).name}, trees of {shapes}, while off: {args.while_off}"
    else:
        sizes = sorted({int(c) for c in args.chains.split(",")}) if args.chains else [args.k or 4]
        k = args.k or sizes[-1]
        make_drafter = lambda: NgramDrafter(chains=sizes)  # noqa: E731
        drafter_name = f"n-gram drafter, chains {sizes}, k={k}"
    configs = {
        "never": lambda: (None, Never()),
        "always": lambda: (make_drafter(), Always(k)),
        "batch_threshold": lambda: (make_drafter(), BatchThreshold(k, off_above=args.off_above,
                                                                    on_at_or_below=args.on_at)),
        "goodput": lambda: (make_drafter(), Goodput([int(x) for x in args.goodput_ks.split(",")] if args.goodput_ks
                                                    else sizes, explore_backoff=2.0, shadow_evals=2)),  # as the conf
    }
    # Timed points draw from the first prompts, the untimed warm-up from the others.
    split = max(len(prompts) // 2, len(prompts) - max(Cs))
    timed, warm = prompts[:split], prompts[split:]
    results, outputs, states = [], {}, {}
    order = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(order) - set(configs))
    if unknown or "never" not in order or len(set(order)) != len(order):
        raise SystemExit(f"bench_spec: --configs {args.configs!r}: need distinct names from {sorted(configs)}, "
                         "including never")
    for name in order:
        drafter, policy = configs[name]()
        if device == "cuda":  # the previous engine's freed blocks go back to the device, so this one's
            torch.cuda.empty_cache()  # pool is sized from all free memory (kv_cache.size_pool)
        t0 = time.perf_counter()
        engine = Engine(model, EngineConfig(max_batch_size=max(Cs), graph_buckets=buckets,
                                            kv_cache_tokens=None if device == "cuda" else 16384),
                        eos_ids=[2], drafter=drafter, policy=policy)
        startup = time.perf_counter() - t0
        mem_gb = torch.cuda.memory_allocated() / 1e9 if device == "cuda" else 0.0
        as_req = lambda ps: [type("P", (), {"prompt_ids": p, "max_new_tokens": max_new})() for p in ps]  # noqa: E731
        # Untimed warm-up over other prompts: Triton compiles prefill kernels per chunk-length
        # block size on first use, which would otherwise land in the first timed point.
        closed_loop(engine, as_req(warm), max(Cs), lambda p, t: engine.add_request(p.prompt_ids, p.max_new_tokens))
        for C in Cs:
            # 4 requests per client (>= 16: a point lasts seconds), prompts reused when C needs more
            n = 2 * C if args.quick else max(16, 4 * C)
            batch = as_req([timed[i % len(timed)] for i in range(n)])
            trace = StepTrace(Path(args.trace_dir) / f"steps_{name}_C{C}.jsonl" if args.trace_dir else None)
            engine.trace = trace
            catch_ups0 = engine.num_catch_ups
            t1 = time.perf_counter()
            done = closed_loop(engine, batch, C, lambda p, t: engine.add_request(p.prompt_ids, p.max_new_tokens))
            wall = time.perf_counter() - t1
            engine.trace = None
            trace.close()
            m = summarize_requests([request_record(r) for r in done], wall)
            s = trace.summary()
            outputs[(name, C)] = {tuple(r.prompt_ids): r.output_ids for r in done}
            results.append(dict(config=name, C=C, requests=len(done), output_tok_per_s=m["output_tok_per_s"],
                                speculating=s["speculating_step_fraction"], held_k=s.get("steady_k"),
                                k_settle_steps=s.get("k_settle_steps"), k_switches=s.get("k_switches"),
                                catch_ups=engine.num_catch_ups - catch_ups0,
                                mean_accepted_length=s["mean_accepted_length"],
                                mean_batch=s["mean_batch_size"], startup_s=startup,
                                kv_pages=engine.kv.num_pages, mem_gb=mem_gb))
            if hasattr(policy, "describe"):  # goodput: the table and acceptance it chose from
                states[(name, C)] = policy.describe()
            print(f"{name:>16} C={C:<3} {m['output_tok_per_s']:9.1f} tok/s  spec {s['speculating_step_fraction']:.2f}"
                  f"  acc len {s['mean_accepted_length'] or 0:.2f}  mean batch {s['mean_batch_size']:.1f}"
                  f"  KV pages {engine.kv.num_pages}  allocated {mem_gb:.1f} GB", flush=True)
        del engine
    base = {r["C"]: r["output_tok_per_s"] for r in results if r["config"] == "never"}
    always = {r["C"]: r["output_tok_per_s"] for r in results if r["config"] == "always"}
    for r in results:
        r["speedup_vs_never"] = r["output_tok_per_s"] / base[r["C"]]
        # the envelope max(never, always): what a policy must reach at every C (0.98x) and beat somewhere
        r["vs_envelope"] = r["output_tok_per_s"] / max(base[r["C"]], always.get(r["C"], 0.0))
        ref = outputs[("never", r["C"])]
        got = outputs[(r["config"], r["C"])]
        r["identical_to_never"] = sum(got[p] == ref[p] for p in ref) / len(ref)
    stamp = dict(commit=git_commit(), device=dev_name, date=datetime.datetime.now().isoformat(timespec="seconds"),
                 dtype=str(model.dtype), drafter=drafter_name)
    with open(out / "bench_spec.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*results[0].keys(), *stamp.keys()])
        w.writeheader()
        for r in results:
            w.writerow({**r, **stamp})
    lines = [f"# Speculation policies under load ({stamp['device']}, commit {stamp['commit']}, {stamp['date']}, "
             f"{stamp['dtype']}, SmolLM2-135M-Instruct, {Path(args.prompts).stem} prompts, greedy, {max_new} new tokens, "
             f"{drafter_name}; batch_threshold off above {args.off_above}, on at {args.on_at})", "",
             "| config | C | output tok/s | vs never | vs max(never, always) | steps speculating | k held at full load "
             "(settle steps) | mean accepted length | identical to never |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["C"], r["config"])):
        acc = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        held = "-" if r["held_k"] is None else f"{r['held_k']} ({r['k_settle_steps']})"
        lines.append(f"| {r['config']} | {r['C']} | {r['output_tok_per_s']:.0f} | {r['speedup_vs_never']:.2f}x | "
                     f"{r['vs_envelope']:.3f} | {r['speculating']:.2f} | {held} | {acc} | {r['identical_to_never']:.2f} |")
    table = "\n".join(lines)
    (out / "bench_spec.md").write_text(table + "\n")
    if states:  # after each point: what the goodput policy chose from
        (out / "bench_spec_policy_state.json").write_text(json.dumps(
            {f"{name} C={C}": st for (name, C), st in states.items()}, indent=1))
    print(table)


if __name__ == "__main__":
    main()
