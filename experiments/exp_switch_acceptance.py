"""Experiment: does acceptance hold when speculation switches back on? The draft KV kept in sync
during k = 0 steps (draft.sync_while_off=true) vs caught up on resume (the default: no draft work
while off, the backlog extended in one chunked forward before the first tree) vs left behind (an
engine that skips the draft while off and never catches up).

The Hydra form of this study is ``python -m specdec.run --multirun +experiment=switch_acceptance``
(conf/experiment/switch_acceptance.yaml; ``python -m specdec.report multirun/switch_acceptance``
tables it). This script is a thin wrapper over the same pieces (policy ``Schedule``, drafter
``sync_while_off``) for a machine without Hydra: SmolLM2-135M-Instruct with the committed EAGLE-3
head (trees of 16 nodes: topk 4, depth 5), HumanEval prompts (chat template) in one batch, greedy.
Speculation follows a fixed schedule: --on steps with k = 16, then --off steps with k = 0, repeated
(decode steps only). Three modes side by side:

    always      k = 16 every step (the acceptance to expect)
    in_sync     the schedule; while off, every k = 0 step still extends the draft KV and root
                state over the committed token (draft.sync_while_off=true)
    catch_up    the schedule; k = 0 steps run no draft work; before the first speculative step
                after them the engine recomputes the target's features over each row's backlog and
                extends the draft KV over it (the default: draft.catch_up=true)
    left_behind the schedule; k = 0 steps skip the drafter and nothing catches up
                (draft.catch_up=false: its KV keeps holes over the tokens committed while off, and
                its root state is the one of the last drafting step)

Reports the tokens committed per row on the first speculative step after each off period, on the
other speculative steps, and whether each run's outputs equal plain greedy decoding (they must).
Acceptance does not depend on the device, so this runs anywhere (fp32 on the CPU by default).

    python experiments/exp_switch_acceptance.py --smollm2 $SPECDEC_CACHE/smollm2-135m-instruct \\
        --prompts $SPECDEC_CACHE/prompts/humaneval.jsonl --out experiments/results/spec
    python experiments/exp_switch_acceptance.py --quick --out /tmp/switch   (2 prompts, 8 tokens)
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from kernels_triton import options  # noqa: E402
from specdec.bench.provenance import git_commit  # noqa: E402
from specdec.engine.engine import Engine, EngineConfig  # noqa: E402
from specdec.models.eagle3 import Eagle3Head  # noqa: E402
from specdec.models.llama import LlamaModel  # noqa: E402
from specdec.models.tokenizer import Tokenizer  # noqa: E402
from specdec.policy import Schedule  # noqa: E402
from specdec.spec import Eagle3Drafter  # noqa: E402

K = 16


def run(model, prompts, max_new, drafter, policy):
    engine = Engine(model, EngineConfig(max_batch_size=len(prompts), kv_cache_tokens=len(prompts) * 2048,
                                        max_seq_len=2048),
                    eos_ids=[2], drafter=drafter, policy=policy)
    reqs = [engine.add_request(p, max_new) for p in prompts]
    engine.run_until_done()
    out = [r.output_ids for r in reqs]
    del engine
    return out


def fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smollm2", help="Hugging Face directory of SmolLM2-135M-Instruct (--quick: the asset cache)")
    ap.add_argument("--prompts", help="humaneval.jsonl from the asset cache (--quick: the asset cache)")
    ap.add_argument("--head", default=str(REPO / "checkpoints" / "eagle3-smollm2-135m"))
    ap.add_argument("--out", default="experiments/results/spec")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n", type=int, default=8, help="prompts (one batch)")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--on", type=int, default=4, help="speculative steps per window")
    ap.add_argument("--off", type=int, default=6, help="k = 0 steps between windows")
    options.add_flags(ap)  # --pdl, --fused-linear, ... (kernels_triton/options.py)
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 prompts, 8 new tokens, 2 on / 2 off")
    args = ap.parse_args()
    options.set_from_flags_(args)
    if args.quick:
        from specdec.assets import prompts_dir, smollm2_dir

        args.smollm2 = args.smollm2 or str(smollm2_dir())
        args.prompts = args.prompts or str(prompts_dir() / "humaneval.jsonl")
        args.n, args.max_new, args.on, args.off = 2, 8, 2, 2
    if not args.smollm2 or not args.prompts:
        raise SystemExit("--smollm2 DIR and --prompts FILE are required (or --quick: the asset cache)")
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model = LlamaModel.from_pretrained(args.smollm2, device=args.device, dtype=dtype)
    tok = Tokenizer(args.smollm2)
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines()][: args.n]
    prompts = [tok.encode_chat([{"role": "user", "content": r["prompt"]}]) for r in rows]
    head = Eagle3Head.load(args.head, device=args.device, dtype=model.dtype, backend=model.backend,
                           target=model.config)

    def drafter(mode):
        return Eagle3Drafter(head, model, topk=4, steps=5, num_draft_tokens=K, sync_while_off=mode == "sync",
                             catch_up=mode == "catch_up")

    plain = run(model, prompts, args.max_new, None, None)
    results = []
    for name, mode, on, off in (("always", "sync", 1, 0), ("in_sync", "sync", args.on, args.off),
                                ("catch_up", "catch_up", args.on, args.off),
                                ("left_behind", "left_behind", args.on, args.off)):
        pol = Schedule(K, on, off)
        out = run(model, prompts, args.max_new, drafter(mode), pol)
        st = pol.describe()
        results.append(dict(drafter=name, spec_steps=st["spec_steps"], first_after_off=st["first_after_off_tokens_per_step"],
                            first_steps=st["first_after_off_steps"], other=st["other_tokens_per_step"],
                            all=st["tokens_per_spec_step"], by_pos=st["by_position"],
                            identical=sum(o == p for o, p in zip(out, plain)) / len(plain)))
        print(results[-1], flush=True)
    stamp = (f"commit {git_commit()}, {args.device} ({dtype}), {datetime.date.today()}, SmolLM2-135M-Instruct + "
             f"{Path(args.head).name}, trees of {K} nodes, {len(prompts)} HumanEval prompts in one batch, greedy, "
             f"{args.max_new} new tokens; schedule {args.on} speculative steps then {args.off} plain")
    lines = [f"# Acceptance after switching speculation back on ({stamp})", "",
             "| drafter while off | spec steps | accepted length: first step after an off period | other spec "
             f"steps | all | by position in the window (1..{args.on}) | outputs = plain greedy |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        first = "-" if r["first_steps"] == 0 else f"{r['first_after_off']:.2f} ({r['first_steps']} steps)"
        pos = " / ".join("-" if a is None else f"{a:.2f}" for a in r["by_pos"]) or "-"
        lines.append(f"| {r['drafter']} | {r['spec_steps']} | {first} | {fmt(r['other'])} | {fmt(r['all'])} | "
                     f"{pos} | {r['identical']:.2f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "exp_switch_acceptance.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
