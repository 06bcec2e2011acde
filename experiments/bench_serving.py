"""Benchmark: the serving engine on one GPU, each number beside its peer measured in the same run.

(a) SmolLM2-135M-Instruct, bf16, greedy, real chat prompts:
    - batch-1 decode step: device time of the graphed k = 0 step (back-to-back replays, no host
      in between) and the engine's time per output token (TPOT, host scheduling included), vs
      Hugging Face ``generate`` at batch 1 (eager, dynamic cache), same prompt and token count;
    - C = 64: 64 requests at once through the engine vs ``generate`` on a batch of the same 64
      prompts, left-padded; same max_new_tokens, EOS honoured by both; output tok/s counts tokens
      up to and including each request's EOS. Also: how many outputs are token-identical (bf16
      numerics differ between the two implementations, so this is reported, not asserted).
(b) Llama-3.1-8B shapes, RANDOM bf16 weights: batch-1 decode step (device time) vs the
    weight-bandwidth floor = parameter bytes / device copy bandwidth (bytes read + written per
    second of a 1 GiB copy, measured in this run). "floor (all params)" counts every parameter like
    gpt-fast's published 72%; "floor (bytes read)" leaves out the embedding table, of which a
    decode step reads one row.
(c) SmolLM2 output tok/s vs closed-loop concurrency C = 1 .. 256 on synthetic lengths (256 prompt
    + 128 output tokens, EOS ignored, 4 requests per client, at least 16): where does throughput
    stop rising?

The Hydra form of these studies (no Hugging Face peer): ``python -m specdec.run --multirun
+experiment=serving_smollm2`` (a), ``+experiment=step_floor`` (b), ``+experiment=baseline_concurrency``
(c), tabled by ``python -m specdec.report multirun/NAME``; (b) here calls the same
``engine/profiling.step_time_vs_floor`` as ``engine.profile_steps``. This script stays for a bare GPU
machine without Hydra and for the Hugging Face ``generate`` peers.

Outputs under --out: bench_serving.csv (one row per number: commit, device, date, part, metric,
value, unit, peer, peer value, ratio), bench_serving_curve.csv (one row per C), bench_serving.md
(the tables). A short table is printed last.

Run (one H200, ~3-4 min incl. kernel compiles; no Hydra / W&B / gguf needed):
    python experiments/bench_serving.py --smollm2 DIR --out outputs/serving
  DIR: SmolLM2 converted to a Hugging Face directory (config.json, model.safetensors,
  tokenizer.json, tokenizer_config.json), e.g. a copy of $SPECDEC_CACHE/smollm2-135m-instruct.
CPU smoke run (tiny shapes, minutes, numbers meaningless):
    python experiments/bench_serving.py --quick --out /tmp/bench_serving
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
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
    sys.path.insert(0, str(REPO))  # run from a checkout without `pip install -e .`
from kernels_triton import options  # noqa: E402
from specdec.bench.provenance import git_commit  # noqa: E402
from specdec.bench.timing import copy_bandwidth_gbps  # noqa: E402

from specdec.bench.clients import closed_loop  # noqa: E402
from specdec.bench.metrics import StepTrace, request_record, summarize_requests  # noqa: E402
from specdec.bench.targets import RANDOM_WEIGHTS_LABEL, llama_config_from_dict, load_target_yaml  # noqa: E402
from specdec.bench.workloads import synthetic_prompts  # noqa: E402
from specdec.engine import profiling  # noqa: E402
from specdec.engine.engine import Engine, EngineConfig  # noqa: E402
from specdec.models.llama import LlamaModel  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32  # the CPU smoke run uses the exact fp32 path

TASKS = ["Explain {} to a curious ten-year-old.", "Write a short poem about {}.",
         "List three surprising facts about {}.", "Write a Python function related to {} and explain it.",
         "What are the pros and cons of {}?", "Summarise the history of {} in one paragraph.",
         "Give me a study plan for learning about {}.", "Write a haiku and a limerick about {}."]
TOPICS = ["black holes", "the French Revolution", "sourdough bread", "binary search", "honeybees",
          "the stock market", "volcanoes", "public transport"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()




def warm_up(engine: Engine, vocab: int) -> None:
    """Compile the prefill kernels' shape variants (query-block sizes, N % 16) before timing."""
    for n in (2, 3, 9, 14, 17, 21, 33, 101, 600):
        engine.add_request(synthetic_prompts(1, n, 2, vocab, seed=n)[0].prompt_ids, 2, ignore_eos=True)
        engine.run_until_done()
    for p in synthetic_prompts(8, 256, 3, vocab, seed=1):  # packed prefill of several requests
        engine.add_request(p.prompt_ids, 3, ignore_eos=True)
    engine.run_until_done()
    sync()


def engine_requests(engine: Engine, prompts: list[list[int]], max_new: int, ignore_eos: bool):
    """All prompts at once; returns (requests in prompt order, wall seconds first arrival -> last finish)."""
    reqs = [engine.add_request(p, max_new, ignore_eos=ignore_eos) for p in prompts]
    engine.run_until_done()
    return reqs, max(r.finish_s for r in reqs) - min(r.arrival_s for r in reqs)


def useful_tokens(ids: list[int], eos: int) -> list[int]:
    """Output up to and including the first EOS."""
    return ids[: ids.index(eos) + 1] if eos in ids else ids


# ------------------------------------------------------------------------------------ Hugging Face


def hf_load(path):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPE)
    except TypeError:  # transformers 4.x spelling
        model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=DTYPE)
    return model.to(DEVICE).eval()


@torch.no_grad()
def hf_generate(model, prompts: list[list[int]], max_new: int, eos: int, ignore_eos: bool):
    """Greedy generate on one left-padded batch; returns (outputs, wall seconds)."""
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, L), eos, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    kwargs = dict(max_new_tokens=max_new, do_sample=False, pad_token_id=eos, eos_token_id=eos,
                  temperature=None, top_p=None, top_k=None)
    if ignore_eos:
        kwargs["min_new_tokens"] = max_new
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    sync()
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    sync()
    wall = time.perf_counter() - t0
    gen = out[:, L:].tolist()
    return [row if ignore_eos else useful_tokens(row, eos) for row in gen], wall


# ------------------------------------------------------------------------------------ parts


class Results:
    def __init__(self, commit: str, device: str, date: str):
        self.meta = dict(commit=commit, device=device, date=date, kernel_options=options.get().as_dict())
        self.rows: list[dict] = []
        self.curve: list[dict] = []

    def add(self, part, metric, value, unit, peer="", peer_value=None, note=""):
        ratio = None  # speed-up over the peer (> 1: the engine is faster)
        if peer_value and value:
            ratio = peer_value / value if unit == "ms" else value / peer_value
        self.rows.append(dict(part=part, metric=metric, value=value, unit=unit, peer=peer,
                              peer_value=peer_value, ratio=ratio, note=note))
        log(f"{part}: {metric} = {fmt(value)} {unit}" + (f"  ({peer}: {fmt(peer_value)})" if peer else ""))


def fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}" if abs(x) < 1e4 else f"{x:.0f}"
    return str(x)


def smollm2_model(args):
    if args.smollm2 is not None:
        return LlamaModel.from_pretrained(args.smollm2, device=DEVICE, dtype=DTYPE), Path(args.smollm2)
    if args.quick:
        from specdec.assets import cache_dir

        path = cache_dir() / "smollm2-135m-instruct"
        if (path / "config.json").is_file():
            return LlamaModel.from_pretrained(path, device=DEVICE, dtype=DTYPE), path
    raise SystemExit("--smollm2 DIR is required (a Hugging Face directory of SmolLM2-135M-Instruct)")


def part_a(res: Results, engine: Engine, model_dir: Path, args) -> None:
    from specdec.models.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    eos = tok.eos_token_id if tok.eos_token_id is not None else 2
    n_conc = 4 if args.quick else 64
    prompts = [tok.encode_chat([{"role": "user", "content": TASKS[i // len(TOPICS) % len(TASKS)].format(
        TOPICS[i % len(TOPICS)])}]) for i in range(n_conc)]
    n1 = 8 if args.quick else 128  # batch-1 tokens
    max_new = 8 if args.quick else 128  # C = 64 tokens per request
    ctx = len(prompts[0])

    # Device time of the graphed step at batch 1, context ~ the prompt plus half the output.
    step_ms = engine.profile_decode_step(1, ctx + n1 // 2, iters=5 if args.quick else 200)
    res.add("a", "SmolLM2 batch-1 decode step (device)", step_ms, "ms", note="graphed" if engine.graphed else "eager")
    tpots, outs = [], None
    for _ in range(3):
        (r,), _ = engine_requests(engine, [prompts[0]], n1, ignore_eos=True)
        tpots.append((r.token_times[-1] - r.token_times[0]) / (n1 - 1) * 1e3)
        outs = r.output_ids
    tpot = statistics.median(tpots)

    hf = None if args.no_hf else hf_load(model_dir)
    hf_tpot = None
    if hf is not None:
        hf_generate(hf, [prompts[0]], 2, eos, True)  # warm-up (cuBLAS handles, allocator)
        hf_out, hf_wall = hf_generate(hf, [prompts[0]], n1, eos, ignore_eos=True)
        hf_tpot = hf_wall / n1 * 1e3
        # HF runs with EOS suppressed (min_new_tokens) and ours ignores it: compare up to the first EOS.
        mine = useful_tokens(outs, eos)
        mine = mine[:-1] if mine and mine[-1] == eos else mine  # HF could not pick EOS there
        theirs = hf_out[0][: len(mine)]
        same = next((i for i, (a, b) in enumerate(zip(theirs, mine)) if a != b), min(len(theirs), len(mine)))
        res.add("a", "SmolLM2 batch-1 greedy tokens equal to HF's before the first difference", same, "tokens",
                note=f"of {len(mine)} (up to the first EOS; bf16 numerics differ, so a near-tie can flip)")
    res.add("a", "SmolLM2 batch-1 time per output token (engine)", tpot, "ms", "HF generate", hf_tpot)
    res.add("a", "SmolLM2 batch-1 tok/s (engine)", 1e3 / tpot, "tok/s", "HF generate",
            1e3 / hf_tpot if hf_tpot else None)

    reqs, wall = engine_requests(engine, prompts, max_new, ignore_eos=False)
    ours = [useful_tokens(r.output_ids, eos) for r in reqs]
    tps = sum(map(len, ours)) / wall
    hf_tps = None
    if hf is not None:
        hf_outs, hf_wall = hf_generate(hf, prompts, max_new, eos, ignore_eos=False)
        hf_tps = sum(map(len, hf_outs)) / hf_wall
        same = sum(a == b for a, b in zip(ours, hf_outs)) / len(ours)
        res.add("a", f"SmolLM2 C={n_conc} outputs token-identical to HF", same, "fraction")
        del hf
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()
    res.add("a", f"SmolLM2 C={n_conc} output tok/s (engine)", tps, "tok/s", f"HF generate batch {n_conc}", hf_tps,
            note=f"{max_new} max new tokens, EOS honoured")


def part_c(res: Results, engine: Engine, vocab: int, args) -> None:
    Cs = [1, 2, 4] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128, 256]
    plen, olen = (16, 4) if args.quick else (256, 128)
    for C in Cs:
        prompts = synthetic_prompts(max(4 if args.quick else 16, 4 * C), plen, olen, vocab, seed=C)
        trace = StepTrace()
        engine.trace = trace
        t0 = time.perf_counter()
        done = closed_loop(engine, prompts, C,
                           lambda p, t: engine.add_request(p.prompt_ids, p.max_new_tokens, ignore_eos=True))
        wall = time.perf_counter() - t0
        engine.trace = None
        m = summarize_requests([request_record(r) for r in done], wall)
        s = trace.summary()
        row = dict(C=C, requests=len(done), output_tok_per_s=m["output_tok_per_s"],
                   requests_per_s=m["requests_per_s"], mean_batch_size=s["mean_batch_size"],
                   p50_decode_step_ms=s["p50_decode_step_ms"], p50_ttft_ms=1e3 * m["p50_ttft_s"],
                   p50_tpot_ms=1e3 * m["p50_tpot_s"], p99_itl_ms=1e3 * m["p99_itl_s"],
                   prefill_ms_total=s["prefill_ms_total"], decode_ms_total=s["decode_ms_total"],
                   wall_s=wall)
        res.curve.append(row)
        log(f"c: C={C:>3}  {row['output_tok_per_s']:9.1f} tok/s  mean bs {row['mean_batch_size']:.1f}  "
            f"step p50 {row['p50_decode_step_ms']:.2f} ms")
    best = max(res.curve, key=lambda r: r["output_tok_per_s"])
    res.add("c", "SmolLM2 peak output tok/s over C", best["output_tok_per_s"], "tok/s", note=f"at C={best['C']}")
    rising = [r["C"] for a, r in zip(res.curve, res.curve[1:]) if r["output_tok_per_s"] > a["output_tok_per_s"]]
    res.add("c", "SmolLM2 throughput rises up to C", max(rising) if rising else 1, "C")


def part_b(res: Results, args, copy_gbps: float) -> None:
    d = load_target_yaml(REPO / "conf" / "target" / "llama31_8b_random.yaml")
    shapes = dict(d["config"])
    label = f"Llama-3.1-8B shape ({RANDOM_WEIGHTS_LABEL})"
    if args.quick:  # same structure, tiny sizes
        shapes.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=4096)
        label = f"Llama-3.1-8B structure, quick tiny shapes ({RANDOM_WEIGHTS_LABEL})"
    config = llama_config_from_dict(shapes)
    log("b: building random weights on the device")
    model = LlamaModel.random(config, device=DEVICE, dtype=DTYPE, seed=0)
    engine = Engine(model, EngineConfig(max_batch_size=1, graph_buckets=(1,), kv_cache_tokens=8192,
                                        max_seq_len=4096, page_size=16, cuda_graphs=False if args.no_graphs else "auto"))
    log(f"b: engine ready in {engine.startup_s:.1f} s (graphs {'on' if engine.graphed else 'off'})")
    if CUDA:
        warm_up_small(engine, config.vocab_size)
    ctx = 512
    # The same measurement as `specdec.run ... engine.profile_steps=[1]` (experiment step_floor).
    prof = profiling.step_time_vs_floor(engine, [1], ctx, iters=5 if args.quick else 100, copy_gbps=copy_gbps)
    step_ms, param_bytes = prof["step_ms"]["1"], prof["weight_bytes"]
    res.add("b", f"{label} batch-1 decode step (device)", step_ms, "ms",
            note=(f"context {ctx}, {param_bytes / 1e9:.2f} GB of bf16 params"
                  + f", pdl={options.get().pdl}") if CUDA else "quick shapes")
    res.add("b", "  weight-bandwidth floor (all params)", prof["floor_ms_all"], "ms",
            note=f"{param_bytes / 1e9:.2f} GB / {copy_gbps:.0f} GB/s copy")
    res.add("b", "  fraction of floor (all params; gpt-fast 72%)", prof["floor_fraction_all"]["1"], "fraction")
    res.add("b", "  fraction of floor (bytes read: embedding excluded)", prof["floor_fraction_read"]["1"], "fraction")
    prompt = synthetic_prompts(1, ctx, 2, config.vocab_size)[0].prompt_ids
    n = 8 if args.quick else 128
    (r,), _ = engine_requests(engine, [prompt], n, ignore_eos=True)
    tpot = (r.token_times[-1] - r.token_times[0]) / (n - 1) * 1e3
    res.add("b", f"{label} batch-1 time per output token (engine)", tpot, "ms")
    del engine, model
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


def warm_up_small(engine: Engine, vocab: int) -> None:
    for n in (2, 9, 17, 101, 513):
        engine.add_request(synthetic_prompts(1, n, 2, vocab, seed=n)[0].prompt_ids, 2, ignore_eos=True)
        engine.run_until_done()
    sync()


# ------------------------------------------------------------------------------------ output


def write_outputs(res: Results, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    cols = ["commit", "device", "date", "kernel_options", "part", "metric", "value", "unit", "peer", "peer_value", "ratio", "note"]
    with open(out / "bench_serving.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in res.rows:
            w.writerow({**res.meta, **r})
    if res.curve:
        with open(out / "bench_serving_curve.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["commit", "device", "date", "kernel_options"] + list(res.curve[0]))
            w.writeheader()
            for r in res.curve:
                w.writerow({**res.meta, **r})
    lines = [f"# Serving benchmark ({res.meta['device']}, commit {res.meta['commit']}, {res.meta['date']})", "",
             f"Kernel options: {res.meta['kernel_options']}", "",
             "| part | metric | value | unit | peer | peer value | speed-up vs peer | note |", "|---|---|---|---|---|---|---|---|"]
    for r in res.rows:
        lines.append(f"| {r['part']} | {r['metric']} | {fmt(r['value'])} | {r['unit']} | {r['peer']} | "
                     f"{fmt(r['peer_value'])} | {fmt(r['ratio'])} | {r['note']} |")
    if res.curve:
        keys = ["C", "output_tok_per_s", "requests_per_s", "mean_batch_size", "p50_decode_step_ms",
                "p50_ttft_ms", "p50_tpot_ms", "p99_itl_ms"]
        lines += ["", "Throughput vs closed-loop concurrency (SmolLM2, synthetic lengths):", "",
                  "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in res.curve]
    text = "\n".join(lines) + "\n"
    (out / "bench_serving.md").write_text(text)
    return text


def guarded(res: Results, part: str, fn, *args) -> None:
    """Run one part; a failure is reported in the table and the other parts still run."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - a benchmark run should report every part it can
        import traceback

        traceback.print_exc()
        res.add(part, f"FAILED: {type(e).__name__}: {str(e)[:200]}", None, "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smollm2", help="Hugging Face directory of SmolLM2-135M-Instruct")
    ap.add_argument("--out", default="outputs/serving", help="where CSV / markdown go")
    ap.add_argument("--parts", default="a,b,c", help="subset of a,b,c")
    ap.add_argument("--no-hf", action="store_true", help="skip the Hugging Face generate peers")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny sizes, meaningless numbers")
    ap.add_argument("--no-graphs", action="store_true", help="eager decode (diagnosis: graphs vs eager)")
    ap.add_argument("--prefill-requests", default=None,
                    help="engine.prefill_graph_requests as a comma list (e.g. 1: only one-request prefills graphed)")
    options.add_flags(ap)  # --pdl, --fused-linear, ... (kernels_triton/options.py)
    args = ap.parse_args()
    options.set_from_flags_(args)
    parts = set(args.parts.split(","))
    t_start = time.perf_counter()
    device = torch.cuda.get_device_name() if CUDA else "cpu"
    res = Results(git_commit(), device, datetime.datetime.now().isoformat(timespec="seconds"))
    copy_gbps = copy_bandwidth_gbps()
    res.add("-", "device copy bandwidth (read + write)", copy_gbps, "GB/s")

    prefill_kw = ({} if args.prefill_requests is None else
                  dict(prefill_requests=tuple(int(r) for r in args.prefill_requests.split(","))))
    if parts & {"a", "c"}:
        model, model_dir = smollm2_model(args)
        vocab = model.config.vocab_size
        max_bs = 8 if args.quick else 256
        engine = Engine(model, EngineConfig(max_batch_size=max_bs, page_size=16, prefill_chunk=2048,
                                            kv_cache_tokens=max_bs * 512, graph_buckets=None,
                                            cuda_graphs=False if args.no_graphs else "auto", **prefill_kw),
                        eos_ids=model.config.eos_token_id)
        log(f"SmolLM2 engine ready in {engine.startup_s:.1f} s (graphs {'on' if engine.graphed else 'off'}, "
            f"buckets {engine.buckets})")
        if CUDA:  # Triton compiles; nothing to compile on the CPU
            warm_up(engine, vocab)
            log("warm-up done")
        if "a" in parts:
            guarded(res, "a", part_a, res, engine, model_dir, args)
        if "c" in parts:
            guarded(res, "c", part_c, res, engine, vocab, args)
        del engine, model
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()
    if "b" in parts:
        guarded(res, "b", part_b, res, args, copy_gbps)

    text = write_outputs(res, Path(args.out))
    log(f"total {time.perf_counter() - t_start:.0f} s; wrote {args.out}/bench_serving.{{csv,md}}")
    print(text)


if __name__ == "__main__":
    main()
