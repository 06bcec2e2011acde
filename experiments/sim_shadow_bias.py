"""Offline check of goodput's shadow acceptance for n-gram drafting (CPU, no GPU): greedy SmolLM2 answers
to the first N prompts of HumanEval / MT-bench, then goodput stepped over them with the H200's C = 1
step times (k = 0 a 0.61 ms iteration, chains 2 / 4 / 8 0.99 / 0.91 / 0.93 ms: the a93dbd1 envelope's
served iterations), committing what each chain commits there (``shadow_commits``), with shadow drafts
scored on k = 0 steps only (the engine before a93dbd1) or on every step.
First table: per k the mean of the shadow samples, goodput's final prior a(k), the always-k walk's mean
and tokens per ms of goodput against never and always chain 8 (per-request estimates with weight 0.1,
as then). Second table: goodput over the envelope max(never, always chain 2 / 4 / 8) of the same text
for each ``shadow_ema`` (the weight of a shadow sample in a request's own a(k)) and each of ``--variants``
(which chains a speculative step scores: every one, or only those above its own as the engine does since
7ee0bb9; and ``policy.shadow_max_lag``), over ``--draws`` random draws of ``--subset`` of the prompts.
Speculative steps feed goodput the nested chains' commits, min(committed, k' + 1), as the engine does.

    python experiments/sim_shadow_bias.py --prompts 32 --cache /tmp/answers32.pt [--out FILE.md]
        [--variants every:none,above:none,above:16]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics as st

import torch

from specdec.assets import prompts_dir, smollm2_dir
from specdec.engine.reference import generate_reference
from specdec.engine.shadow import ShadowAcceptance
from specdec.models.llama import load_target
from specdec.models.tokenizer import Tokenizer
from specdec.policy.base import BatchView, StepStats
from specdec.policy.goodput import Goodput
from specdec.spec.ngram import NgramDrafter

MS = {0: 0.61, 2: 0.99, 4: 0.91, 8: 0.93}


def answers(n: int, new_tokens: int) -> dict[str, list[tuple[list[int], list[int]]]]:
    d = smollm2_dir()
    tok, model = Tokenizer(d), load_target(d, device="cpu", dtype=torch.float32, backend="torch")
    out = {}
    for ws in ("humaneval", "mt_bench"):
        rows = [json.loads(line) for line in open(prompts_dir() / f"{ws}.jsonl")][:n]
        out[ws] = []
        for r in rows:
            ids = tok.encode_chat([{"role": "user", "content": r.get("prompt") or r["turns"][0]}])
            out[ws].append((ids, generate_reference(model, ids, new_tokens).token_ids))
    return out


def simulate(gens, every_step, repeats: int = 3, shadow_ema: float = 0.1, max_lag=None) -> dict:
    """every_step: False (k = 0 steps only), True (every step, every k) or "above" (every step, the ks
    above the step's: the engine now; a speculative step's own and nested chains are exact samples)."""
    dr = NgramDrafter(3, 1, [2, 4, 8])
    g = Goodput([2, 4, 8], shadow_evals=2, probe_rows=4, probe_cost=4, shadow_min_rows=2, explore_every=32,
                explore_backoff=2, margin=0.03, shadow_ema=shadow_ema)
    g.set_table({k: {1: v} for k, v in MS.items()})
    g.shadowed_()
    g.serial_drafting = True
    sh = ShadowAcceptance(dr, [2, 4, 8], 2, max_lag=max_lag)
    shadow: dict[int, list[int]] = {2: [], 4: [], 8: []}
    ks, t_ms, toks = [], 0.0, 0
    for i, (prompt, out) in enumerate(gens * repeats):
        rid, pos = str(i), 1
        while pos < len(out):
            k = g.choose(BatchView(num_decode=1, num_waiting=0, num_prefilling=0, rows=(rid,), backlog=None))
            if k and pos + k > len(out):
                k = 0
            hist = prompt + out[:pos]
            c = dr.shadow_commits(prompt + out, len(prompt) + pos, k) if k else 1
            new = out[pos:pos + c]
            above = k if every_step == "above" else 0
            sam = (sh.samples_([rid], lambda _: hist + new, above=above)
                   if (every_step or k == 0) and g.shadow_due() else [])
            for kk, _, cc in sam:
                shadow[kk].append(cc)
            cf = {j: [min(c, j + 1)] for j in (2, 4) if j < k} or None  # nested chains (the engine's _host_cf)
            g.update(StepStats(k=k, num_decode=1, committed=[c], rows=[rid], step_ms=MS[k], shadow=sam or None,
                               shadow_ms=0.01, counterfactual=cf))
            g.iteration_(k, 1, MS[k], 0.2)
            ks.append(k)
            pos, t_ms, toks = pos + c, t_ms + MS[k], toks + c
    walk = {}
    for k in (2, 4, 8):
        w = []
        for prompt, out in gens:
            h, s = prompt + out, len(prompt) + 1
            while s + k <= len(h):
                w.append(dr.shadow_commits(h, s, k))
                s += w[-1]
        walk[k] = st.mean(w)
    return {"shadow_mean": {k: st.mean(v) if v else None for k, v in shadow.items()},
            "prior": dict(g.accept), "walk_mean": walk,
            "k_share": {k: ks.count(k) / len(ks) for k in (0, 2, 4, 8)},
            "tok_per_ms": toks / t_ms, "never": 1 / MS[0], "always8": walk[8] / MS[8],
            "envelope": max(1 / MS[0], *(walk[k] / MS[k] for k in (2, 4, 8)))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cache", default=None, help="answers saved here (torch.save) and read back on later runs")
    ap.add_argument("--draws", type=int, default=6)
    ap.add_argument("--subset", type=int, default=16)
    ap.add_argument("--shadow-emas", default="0.2,0.1,0.05,0.03,0.02,0.01")
    ap.add_argument("--variants", default="every:none",
                    help="scoring:max_lag pairs for the second table, e.g. every:none,above:none,above:16 (scoring: "
                         "every = every k on every step, above = the ks above a speculative step's; max_lag: a "
                         "walk this far behind restarts at the newest position, none: never)")
    a = ap.parse_args()
    try:
        gens = torch.load(a.cache) if a.cache else None
    except FileNotFoundError:
        gens = None
    if gens is None or any(len(g) < a.prompts for g in gens.values()):
        gens = answers(a.prompts, a.new_tokens)
        if a.cache:
            torch.save(gens, a.cache)
    gens = {ws: g[:a.prompts] for ws, g in gens.items()}
    lines = ["| workload | shadow scored on | k | shadow mean | prior a(k) | always-k walk | goodput tok/ms | never | always 8 |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for ws, g in gens.items():
        for every in (False, True):
            r = simulate(g, every)
            for k in (2, 4, 8):
                sm, pr = r["shadow_mean"][k], r["prior"][k]
                lines.append(f"| {ws} | {'every step' if every else 'k = 0 steps'} | {k} | "
                             f"{'-' if sm is None else f'{sm:.2f}'} | {'-' if pr is None else f'{pr:.2f}'} | "
                             f"{r['walk_mean'][k]:.2f} | {r['tok_per_ms']:.3f} | {r['never']:.3f} | {r['always8']:.3f} |")
    lines += ["", f"goodput / envelope, {a.draws} draws of {a.subset} of {a.prompts} prompts each (min .. max):", "",
              "| workload | scoring | max_lag | shadow_ema | " + " | ".join(f"draw {i}" for i in range(a.draws))
              + " | mean | min |", "| --- | --- | ---: | ---: |" + " ---: |" * (a.draws + 2)]
    variants = [(v.split(":")[0], None if v.split(":")[1] == "none" else int(v.split(":")[1]))
                for v in a.variants.split(",")]
    for ws, g in gens.items():
        for mode, lag in variants:
            for e in (float(x) for x in a.shadow_emas.split(",")):
                rs = []
                for i in range(a.draws):
                    gg = list(g)
                    random.Random(i).shuffle(gg)
                    r = simulate(gg[:a.subset], "above" if mode == "above" else True, repeats=1, shadow_ema=e,
                                 max_lag=lag)
                    rs.append(r["tok_per_ms"] / r["envelope"])
                lines.append(f"| {ws} | {mode} | {lag if lag is not None else '-'} | {e} | "
                             + " | ".join(f"{x:.3f}" for x in rs) + f" | {st.mean(rs):.3f} | {min(rs):.3f} |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        open(a.out, "w").write(text + "\n")


if __name__ == "__main__":
    main()
