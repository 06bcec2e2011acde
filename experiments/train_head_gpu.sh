#!/usr/bin/env bash
# A better EAGLE-3 head for SmolLM2 on a lent H200, in resumable stages of one call each
# (conf/experiment/train_eagle3_smollm2_large.yaml: ~10x the committed head's data, several sampled
# answers per prompt beside the greedy one, features captured per batch). Run from the repository
# root on a machine whose SmolLM2 assets are staged (docs/gpu_machines.md: the three setup calls).
#
#   bash experiments/train_head_gpu.sh data    # call 1, ~8 min: prompts + answers into $S/data10x.
#                                              #   Rerun to add more: it resumes (items already answered
#                                              #   are skipped); DATA_BUDGET_S (430) caps the stages.
#   bash experiments/train_head_gpu.sh train   # call 2, ~8 min: training (TRAIN_BUDGET_S, 360 s, the lr
#                                              #   schedule fitted to it) + held-out eval; the checkpoint
#                                              #   (shards <= 15 MiB), its model card and metrics into $OUT.
#                                              #   Fails at once (exit 2) when the data is not on this machine.
#   bash experiments/train_head_gpu.sh all     # data, then train, in ONE call (~8.5 min: DATA_BUDGET_S 170,
#                                              #   TRAIN_BUDGET_S 340 by default; with the setup call's
#                                              #   conversion it fits a 600 s call: 452 s with 280):
#                                              #   nothing is lost if the machine is given back
#                                              #   between calls (its data would be)
#   bash experiments/train_head_gpu.sh trees   # ~3 min: tree shapes at batch 1 on 10 HumanEval prompts
#                                              #   for the new head (HEAD_DIR, default $S/ckpt10x), report in $OUT
#
# Longer training over several calls: LONG_STEPS=N keeps one schedule of N steps across calls, each
# call stopping at its budget with the training state saved ($S/train10x_state.pt); RESUME=1 continues:
#   LONG_STEPS=12000 bash experiments/train_head_gpu.sh train            # first call
#   RESUME=1 LONG_STEPS=12000 bash experiments/train_head_gpu.sh train   # each later call
#
# A `data` call on a fresh machine first unpacks .stage/data/$DATA_NAME.tar.xz.part* when carried, so it
# continues that data (e.g. the sampled answers a stage budget left out).
#
# Several data directories: DATA_NAME=NAME (default data10x) names the one under $S that `data` writes
# (with EXP=EXPERIMENT, default train_eagle3_smollm2_large) and `train` reads; EXTRA_DIRS=A,B adds
# more staged directories under $S to the training data (train.data.extra_dirs). The chat data beside
# the coding-heavy default set:
#   EXP=train_eagle3_smollm2_chat DATA_NAME=chat10x PACK_DATA=1 bash experiments/train_head_gpu.sh data
#   DATA_NAME=data10x EXTRA_DIRS=chat10x INIT_FROM=checkpoints/eagle3-smollm2-135m bash experiments/train_head_gpu.sh train
#
# Warm start: INIT_FROM=DIR (e.g. checkpoints/eagle3-smollm2-135m) trains that head further on the
# staged data (train.init_from); TRAIN_EXTRA adds overrides (e.g. "train.lr=3e-4 train.warmup_steps=100").
#
# The staged data lives on the lent machine only. PACK_DATA=1 with `data` also returns it: the data
# directory as xz parts of <= 15 MiB in $OUT (data10x.tar.xz.partNN). If the machine is given back
# before `train`, copy those parts into .stage/data (gitignored), carry it in the train call, and
# `train` unpacks them into $S/data10x first (the model still needs the four setup calls).
#
# Back on the workstation (files of $OUT fetched into DIR):
#   mkdir -p checkpoints/eagle3-smollm2-135m && cp DIR/eagle3-smollm2-135m/* checkpoints/eagle3-smollm2-135m/
#   python -c "from specdec.train import rewrite_checkpoint as r; r('checkpoints/eagle3-smollm2-135m')"  # one file
# $OUT gets at most 8 files: config.json, README.md, two weight shards + index, train_metrics.json,
# data_stats.json (data and training stay on the lent machine; the model card records their provenance).
set -uo pipefail
mode=${1:-}
case "$mode" in data|train|all|trees) ;; *) echo "usage: bash experiments/train_head_gpu.sh data|train|all|trees" >&2; exit 64;; esac
if [ "$mode" = all ]; then : "${DATA_BUDGET_S:=170}" "${TRAIN_BUDGET_S:=340}"; fi
: "${OUT:?OUT must name the folder whose files come back}"
source experiments/lent_gpu_setup.sh >/dev/null 2>&1  # idempotent; sets SPECDEC_CACHE and PYTHONPATH
set -e
S=${SPECDEC_STAGE:-/root/specdec-stage}
DATA_NAME=${DATA_NAME:-data10x}  # the staged data directory under $S ('data' writes it, 'train' reads it)
DATA=$S/$DATA_NAME
CKPT=$S/ckpt10x
export WANDB_MODE=disabled HYDRA_FULL_ERROR=0
if [ ! -f "${SPECDEC_CACHE:-}/smollm2-135m-instruct/config.json" ]; then
  echo "error: SmolLM2 is not converted in \$SPECDEC_CACHE (${SPECDEC_CACHE:-unset}): run the setup calls of docs/gpu_machines.md first" >&2
  exit 3
fi
mkdir -p "$S/runs" "$OUT"
stamp=$(date +%Y%m%d-%H%M%S)
exp=+experiment=${EXP:-train_eagle3_smollm2_large}

unpack() {  # $S/NAME from the xz parts a PACK_DATA run returned, carried in .stage/data (when not there yet)
  if [ ! -f "$S/$1/prompts.jsonl" ] && ls ".stage/data/$1".tar.xz.part* >/dev/null 2>&1; then
    cat ".stage/data/$1".tar.xz.part* | xz -d | tar -C "$S" -xf -
    echo "unpacked the carried data into $S/$1"
  fi
}

if [ "$mode" = data ] || [ "$mode" = all ]; then
  unpack "$DATA_NAME"  # a data run on a fresh machine resumes what the carried parts hold
  budget=${DATA_BUDGET_S:-430}
  # timeout: a last guard; shards are written whole, so whatever finished before it is kept.
  timeout -s INT $((budget + 100)) python -m specdec.train "$exp" logger=none device=cuda \
    train.data.dir="$DATA" train.data.only=true train.data.stage_budget_s="$budget" \
    hydra.run.dir="$S/runs/data-$stamp" || echo "warning: the data run ended with status $? (finished shards are kept)" >&2
  python - "$DATA" <<'EOF'
import json, sys
from pathlib import Path
from specdec.training.stages import read_shards, shard_paths
d = Path(sys.argv[1])
seqs, done, per = read_shards(d)
tokens = sum(len(s.prompt_ids) + len(s.output_ids) for s in seqs)
answer = sum(len(s.output_ids) for s in seqs)
print(f"staged data {d}: {len(shard_paths(d))} shards, {len(done)} items, {len(seqs)} sequences, "
      f"{tokens} tokens ({answer} answer tokens), sequences per sample {per}")
EOF
  cp "$DATA/data_stats.json" "$OUT/data_stats.json" 2>/dev/null || true
  if [ "${PACK_DATA:-0}" = 1 ]; then
    tar -C "$S" -cf - "$DATA_NAME" | xz -T0 -3 | split -b 15M -d - "$OUT/$DATA_NAME.tar.xz.part"
    ls -l "$OUT/$DATA_NAME".tar.xz.part*
  fi
  [ "$mode" = all ] || exit 0
fi

if [ "$mode" = train ] || [ "$mode" = all ]; then
  IFS=, read -r -a extra_names <<< "${EXTRA_DIRS:-}"
  extra_dirs=()
  for name in "$DATA_NAME" "${extra_names[@]}"; do
    d=$S/$name
    unpack "$name"
    if [ ! -f "$d/prompts.jsonl" ] || ! ls "$d"/answers/shard-*.jsonl >/dev/null 2>&1; then
      echo "error: no staged data in $d (this machine did not run 'data' for it, or it was given back since):" \
           "run 'DATA_NAME=$name bash experiments/train_head_gpu.sh data' on it first, or carry its parts in .stage/data" >&2
      exit 2
    fi
    [ "$name" = "$DATA_NAME" ] || extra_dirs+=("$d")
  done
  extra=()
  if [ ${#extra_dirs[@]} -gt 0 ]; then extra+=("train.data.extra_dirs=[$(IFS=,; echo "${extra_dirs[*]}")]"); fi
  if [ -n "${LONG_STEPS:-}" ]; then extra+=(train.fit_budget=false train.max_steps="$LONG_STEPS"); fi
  if [ "${RESUME:-0}" = 1 ]; then extra+=(train.resume=true); fi
  if [ -n "${INIT_FROM:-}" ]; then extra+=(train.init_from="$(realpath "$INIT_FROM")"); fi
  read -r -a more <<< "${TRAIN_EXTRA:-}"; extra+=("${more[@]}")
  rm -rf "$CKPT"
  python -m specdec.train "$exp" logger=none device=cuda train.data.dir="$DATA" \
    train.time_budget_s="${TRAIN_BUDGET_S:-360}" train.state_path="$S/train10x_state.pt" \
    train.output_dir="$CKPT" hydra.run.dir="$S/runs/train-$stamp" "${extra[@]}"
  mkdir -p "$OUT/eagle3-smollm2-135m"
  cp "$CKPT"/* "$OUT/eagle3-smollm2-135m/"
  cp "$S/runs/train-$stamp/metrics.json" "$OUT/train_metrics.json"
  cp "$DATA/data_stats.json" "$OUT/data_stats.json" 2>/dev/null || true
  ls -l "$OUT" "$OUT/eagle3-smollm2-135m"
  exit 0
fi

# trees
head_dir=${HEAD_DIR:-$CKPT}
if [ ! -f "$head_dir/config.json" ]; then
  echo "note: no head at $head_dir; using the committed one (checkpoints/eagle3-smollm2-135m)" >&2
  head_dir=$PWD/checkpoints/eagle3-smollm2-135m
fi
python -m specdec.run --multirun +experiment=eagle3_tree_shapes ++draft.path="$head_dir" \
  hydra.sweep.dir="$S/runs/trees-$stamp"
python -m specdec.report "$S/runs/trees-$stamp" --out "$S/runs/trees-$stamp-report"
cp "$S/runs/trees-$stamp-report/report.md" "$OUT/tree_shapes_report.md"
cat "$OUT/tree_shapes_report.md"
