"""Where does an EAGLE-3 training step's time go? One optimizer step of the training-time test
(specdec.training.ttt.ttt_unroll: 7 unrolled draft steps, soft cross-entropy against the target's
distribution over the draft vocabulary, backward, fused AdamW) for a head shaped for SmolLM2-135M
(hidden 576, 9 / 3 heads, MLP 1536, draft vocabulary 8192), random weights and inputs, bf16
autocast as specdec.train runs it. The target's online feature capture is not included (one
forward of the 135M target over the batch).

Per shape (padded batch B x T tokens, prompts the first quarter of each row): ms per step and
tokens per second over --steps timed steps after --warmup, CUDA events; then one torch.profiler
run of --profile-steps steps and its top kernels by CUDA time (--top), so a change to the step
can be aimed at what dominates.

Run (GPU, ~1 min; no model files):
    python experiments/profile_ttt.py [--shapes 16384x256,16384x640,16384x1024,65536x640] [--out FILE.json]
--variants eager,compile: the same shapes with train.compile's torch.compile of the layer and the
loss (ttt_functions), beside the eager step in one run. On a CPU it runs a tiny shape only (--quick),
to check the script.
"""

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]
from specdec.models.eagle3 import Eagle3Config, Eagle3Head  # noqa: E402
from specdec.training.ttt import ttt_unroll  # noqa: E402


def smollm2_head_config(draft_vocab: int) -> Eagle3Config:
    return Eagle3Config(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                        head_dim=64, vocab_size=49152, draft_vocab_size=draft_vocab, rms_norm_eps=1e-5,
                        rope_theta=100000.0, max_position_embeddings=8192, target_layers=(2, 15, 27))


def build(cfg: Eagle3Config, device: str, seed: int = 0):
    torch.manual_seed(seed)
    head = Eagle3Head(cfg, backend="torch").init_weights_(seed)
    head.set_vocab_(torch.randperm(cfg.vocab_size)[:cfg.draft_vocab_size])
    head.to_device(device, torch.float32)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, device=device) * 0.02
    draft_ids = head.to_target_ids(torch.arange(cfg.draft_vocab_size, device=device))
    vocab_weight = (torch.randn(cfg.vocab_size, cfg.hidden_size, device=device) * 0.02)[draft_ids]
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), **({"fused": True} if device == "cuda" else {}))
    return head, embed, vocab_weight, params, opt


def batch(cfg: Eagle3Config, B: int, T: int, device: str, dtype):
    H = cfg.hidden_size
    tokens = torch.randint(0, cfg.vocab_size, (B, T), device=device)
    feats = torch.randn(B, T, 3 * H, device=device, dtype=dtype)
    teacher = torch.randn(B, T, H, device=device, dtype=dtype)
    argmax = torch.randint(0, cfg.vocab_size, (B, T), device=device)
    lengths = torch.full((B,), T, dtype=torch.long, device=device)
    plens = torch.full((B,), max(1, T // 4), dtype=torch.long, device=device)
    return tokens, feats, teacher, argmax, lengths, plens


def step(head, embed, vocab_weight, params, opt, b, steps: int, device: str, compile: bool = False):
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext()
    with ctx:
        out = ttt_unroll(head, embed, vocab_weight, *b, steps=steps, decay=0.8, compile=compile)
    opt.zero_grad(set_to_none=True)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 0.5)
    opt.step()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="16384x256,16384x640,16384x1024,65536x640",
                    help="TOKENSxT: padded tokens per step x sequence length (B = TOKENS // T)")
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--variants", default="eager",
                    help="comma list of eager (the layer and loss as written) and compile (train.compile=true: "
                         "torch.compile of both, dynamic shapes; its first step's compile time is reported)")
    ap.add_argument("--quick", action="store_true", help="a tiny shape (CPU check of the script)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = args.shapes
    if args.quick or device == "cpu":
        shapes, args.warmup, args.steps, args.profile_steps, args.draft_vocab = "256x32", 1, 2, 1, 512
    cfg = smollm2_head_config(args.draft_vocab)
    head, embed, vocab_weight, params, opt = build(cfg, device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    results = []
    for variant in args.variants.split(","):
        if variant not in ("eager", "compile"):
            raise SystemExit(f"--variants: unknown variant {variant!r} (eager, compile)")
        comp = variant == "compile"
        for spec in shapes.split(","):
            tokens, T = (int(x) for x in spec.split("x"))
            B = max(1, tokens // T)
            b = batch(cfg, B, T, device, dtype)
            t0 = time.perf_counter()
            step(head, embed, vocab_weight, params, opt, b, args.ttt_steps, device, comp)
            sync()
            first_s = time.perf_counter() - t0  # with compile: the compile (once per unroll depth, any shape)
            for _ in range(args.warmup):
                step(head, embed, vocab_weight, params, opt, b, args.ttt_steps, device, comp)
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(head, embed, vocab_weight, params, opt, b, args.ttt_steps, device, comp)
            sync()
            ms = (time.perf_counter() - t0) / args.steps * 1e3
            peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
            with torch.profiler.profile(activities=acts) as prof:
                for _ in range(args.profile_steps):
                    step(head, embed, vocab_weight, params, opt, b, args.ttt_steps, device, comp)
                sync()
            key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
            ev = sorted(prof.key_averages(), key=lambda e: getattr(e, key.replace("cuda", "device"), 0)
                        or getattr(e, key, 0), reverse=True)
            top = []
            for e in ev[:args.top]:
                us = (getattr(e, "self_device_time_total", None) or getattr(e, key, 0)) / args.profile_steps
                top.append({"name": e.key[:90], "ms_per_step": round(us / 1e3, 3), "calls_per_step": e.count // args.profile_steps})
            rec = {"variant": variant, "tokens": B * T, "B": B, "T": T, "ms_per_step": round(ms, 2),
                   "tokens_per_s": round(B * T / ms * 1e3), "first_step_s": round(first_s, 1),
                   "peak_gib": None if peak is None else round(peak, 1), "top": top}
            results.append(rec)
            print(f"== {variant} {B} x {T} ({B * T} tokens): {ms:.1f} ms/step, {rec['tokens_per_s']} tok/s, "
                  f"first step {first_s:.1f} s, peak {rec['peak_gib']} GiB")
            for t in top:
                print(f"   {t['ms_per_step']:8.3f} ms  {t['calls_per_step']:5d}x  {t['name']}")
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
    print("\nvariant  shape       ms/step  tok/s")
    for r in results:
        print(f"{r['variant']:8s} {r['B']:3d}x{r['T']:<5d} {r['ms_per_step']:8.1f}  {r['tokens_per_s']}")
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "ttt_steps": args.ttt_steps, "draft_vocab": args.draft_vocab}
    if args.out:
        Path(args.out).write_text(json.dumps({**meta, "shapes": results}, indent=1))


if __name__ == "__main__":
    main()
