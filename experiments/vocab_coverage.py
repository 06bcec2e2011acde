"""How much of each staged data set's answer tokens a head's draft vocabulary covers, beside the
vocabulary of the same size chosen from all the sets together (what ``train.revocab=true`` picks;
special tokens aside). CPU, seconds:

    python experiments/vocab_coverage.py checkpoints/eagle3-smollm2-135m DIR [DIR ...] [--out FILE.md]
    python experiments/vocab_coverage.py --quick    # CPU smoke run: the committed head over a made-up set

DIR: staged data directories (``train.data.dir``; e.g. the unpacked ``.stage/data`` parts).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from specdec.bench.provenance import git_commit  # noqa: E402
from specdec.models.loading import load_safetensors  # noqa: E402
from specdec.training.data import draft_vocab  # noqa: E402
from specdec.training.stages import read_shards  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("head", type=Path, nargs="?", default=REPO / "checkpoints" / "eagle3-smollm2-135m")
    ap.add_argument("dirs", type=Path, nargs="*")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="a made-up staged set of two sequences (smoke run)")
    args = ap.parse_args()
    if args.quick:
        import tempfile

        from specdec.training.prompts import TrainPrompt
        from specdec.training.stages import ShardWriter, _record, save_prompts

        d = Path(tempfile.mkdtemp()) / "made_up"
        ps = [TrainPrompt(f"seed/{i}", f"task {i}", "seed") for i in range(2)]
        save_prompts(d, ps, {})
        w = ShardWriter(d, 8)
        for i, p in enumerate(ps):
            w.add(_record(p, 0, 0.0, [1, 2, 3], [10 + i, 200 + i, 30000 + i]))
        w.flush()
        args.dirs = [d]
    if not args.dirs:
        ap.error("give at least one staged data directory (or --quick)")
    sd = load_safetensors(args.head)
    t2d = sd["t2d"].bool()
    V, n = t2d.numel(), int(t2d.sum())
    sets = {}
    for d in args.dirs:
        seqs, _, _ = read_shards(d)
        if not seqs:
            raise SystemExit(f"error: {d}: no answer shards (answers/shard-*.jsonl)")
        sets[d.name] = ([s.ids for s in seqs], [len(s.prompt_ids) for s in seqs])
    every = [x for ids, _ in sets.values() for x in ids], [p for _, pl in sets.values() for p in pl]
    ids, _ = draft_vocab(every[0], every[1], n, V)
    rebuilt = torch.zeros(V, dtype=torch.bool)
    rebuilt[ids] = True

    def coverage(inside, seqs, plens):
        ans = torch.tensor([t for s, p in zip(seqs, plens) for t in s[p:]], dtype=torch.long)
        return float(inside[ans].float().mean()), ans.numel()

    lines = [f"Draft-vocabulary coverage of answer tokens (commit {git_commit()}): the head in {args.head} "
             f"({n} ids) and {n} ids chosen from all sets below (`train.revocab`); {int((rebuilt & t2d).sum())} ids "
             "in both.", "", "| data | answer tokens | head's vocabulary | chosen from all sets |", "|---|---:|---:|---:|"]
    for name, (seqs, plens) in sets.items():
        head_cov, tokens = coverage(t2d, seqs, plens)
        lines.append(f"| {name} | {tokens} | {100 * head_cov:.1f}% | {100 * coverage(rebuilt, seqs, plens)[0]:.1f}% |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
