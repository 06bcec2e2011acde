"""What does speculation-off cost with a drafter? The graphed k = 0 step (plain decoding) of an
engine without a drafter vs one with the n-gram drafter, one with the EAGLE-3 drafter in its
default catch-up mode (no draft work while off: the k = 0 graph must equal plain decoding's, kernel
for kernel), one whose EAGLE-3 drafter extends its KV over every committed token
(draft.sync_while_off=true: its draft layer runs every step), and the same through its general
extend path (the path a drafting step takes: gathered features, clamps, its own block metadata, a
root gather) instead of the k = 0 one. Pass criterion of the catch-up and n-gram rows: step ms
within 1% of `none` (and the same kernel count) at every B.

SmolLM2-135M shapes with RANDOM bf16 weights (step time does not depend on the values), the
committed head checkpoints/eagle3-smollm2-135m, context 512, batch B in {1, 16, 64, 256}. Per engine
and B: device ms per step (100 back-to-back steps, best of 3, `Engine.profile_decode_step`), then
the kernels of 20 graph replays under torch.profiler (launches per step, device us per step).
`none` runs first and last, to show drift within the process.

Run (one GPU, ~1 min, no model files):  python experiments/k0_step_cost.py > $OUT/k0_step_cost.txt
Kernel options as flags (e.g. --pdl off, --step-kernels false; kernels_triton/options.py).
"""

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "experiments")]
from profile_step import SMOLLM2  # noqa: E402
from kernels_triton import options  # noqa: E402
from specdec.bench.provenance import device_name, git_commit  # noqa: E402
from specdec.bench.targets import llama_config_from_dict  # noqa: E402
from specdec.models.llama import LlamaModel  # noqa: E402
from specdec.engine.engine import Engine, EngineConfig  # noqa: E402
from specdec.models.eagle3 import Eagle3Head  # noqa: E402
from specdec.spec import Eagle3Drafter, NgramDrafter  # noqa: E402


class GeneralExtend(Eagle3Drafter):
    """The same drafter, but every step extends through the general (drafting-step) path."""

    def extend_(self, *args):
        super().extend_(*args[:9], None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    options.add_flags(ap)
    options.set_from_flags_(ap.parse_args())
    if not torch.cuda.is_available():
        raise SystemExit("k0_step_cost.py times CUDA-graph replays: it needs a GPU")
    model = LlamaModel.random(llama_config_from_dict(SMOLLM2), device="cuda", dtype=torch.bfloat16, seed=0)
    head = Eagle3Head.load(REPO / "checkpoints/eagle3-smollm2-135m", device="cuda", dtype=model.dtype,
                           backend=model.backend, target=model.config)
    print(f"# k0_step_cost.py at {git_commit()}, {device_name()}, SmolLM2-135M shapes (random bf16), context 512, "
          f"kernel options {options.get().as_dict()}")
    summary = []
    batches = (1, 16, 64, 256)
    for name in ("none", "ngram", "eagle3_catch_up", "eagle3_sync", "eagle3_general_extend", "none"):
        cls = GeneralExtend if name == "eagle3_general_extend" else Eagle3Drafter
        if name == "none":
            drafter = None
        elif name == "ngram":
            drafter = NgramDrafter(chains=[4])
        else:
            drafter = cls(head, model, topk=4, steps=5, num_draft_tokens=16, sync_while_off=name != "eagle3_catch_up")
        k = 0 if drafter is None else (4 if name == "ngram" else 16)
        eng = Engine(model, EngineConfig(max_batch_size=256, graph_buckets=batches, kv_cache_tokens=256 * 1024,
                                         max_seq_len=2048, page_size=16, prefill_buckets=(16,)),
                     drafter=drafter, ks=(k,))
        for B in batches:
            ms = min(eng.profile_decode_step(B, 512, iters=100) for _ in range(3))
            owners = [object() for _ in range(B)]
            pages = [eng.kv.reserve_(o, 700) for o in owners]
            eng.state.append_rows_([7] * B, [512] * B, pages)
            eng.state.num_active.fill_(B)
            run = eng.stepper.runner.run_
            try:
                for _ in range(3):
                    run(B)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(20):
                        run(B)
                    torch.cuda.synchronize()
            finally:
                eng.state.keep_rows_([])
                for o in owners:
                    eng.kv.release_(o)
            by = {}
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    c = by.setdefault(e.name[:80], [0.0, 0.0])
                    c[0] += 1 / 20
                    c[1] += e.device_time / 20
            launches = sum(c[0] for c in by.values())
            print(f"== {name} B={B}: step {ms:.4f} ms, {launches:.0f} kernels, busy {sum(c[1] for c in by.values()):.1f} us")
            for n, c in sorted(by.items(), key=lambda x: -x[1][1]):
                print(f"   {c[0]:5.1f} x {c[1]:7.1f} us  {n}")
            summary.append((name, B, ms))
        del eng
        torch.cuda.empty_cache()
    print("\n| engine | B | k = 0 step ms |\n|---|---|---|")
    for name, B, ms in summary:
        print(f"| {name} | {B} | {ms:.4f} |")


if __name__ == "__main__":
    main()
