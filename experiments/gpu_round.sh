#!/usr/bin/env bash
# The H200 measurements behind the README's results, in stages of one lent-machine call each
# (docs/gpu_machines.md: the three setup calls carry .stage/q1, .stage/q2, .stage/q3 + .whl; stage
# 8b needs no SmolLM2 files, so it runs in the first call). Each stage packs its run directories
# (config.json, metrics.json, overrides.yaml, reports; no per-request / per-step logs) into one tarball
# under $OUT:
#   bash experiments/gpu_round.sh 8b          # TP world-size-1 bench, 8B-shape step breakdown
#   bash experiments/gpu_round.sh crossover   # the 8B-shape crossover, replayed acceptance (CROSSOVER_MEAN=6: parametric;
#                                             CROSSOVER_EXTRA: more overrides, e.g. draft.weight_dtype=model)
#   bash experiments/gpu_round.sh profile8b   # the 8B-shape tree steps split into phases
#   bash experiments/gpu_round.sh k0cost      # speculation-off cost, paired: never with each drafter vs the adjacent draft=none runs (K0_R repeats)
#   bash experiments/gpu_round.sh batch1      # batch-1 HumanEval table, step floor
#   bash experiments/gpu_round.sh envelope_eagle3 | envelope_ngram   # policy_envelope, one drafter each
#                                             (ENVELOPE_WORKLOADS, ENVELOPE_EXTRA: more overrides, e.g.
#                                             workload.stagger=true; ENVELOPE_NAME: the folder / tarball name)
#   HEAD_DIR=DIR bash experiments/gpu_round.sh eagle3head   # batch-1 tables of the head in DIR (default: the
#                                             committed one): all 164 HumanEval prompts, and the T = 0
#                                             eagle3_table (40 prompts of HumanEval and MT-bench), plain beside
#                                             (HEAD_EXTRA: more overrides for both sweeps, e.g. kernel options)
#   bash experiments/gpu_round.sh w8          # draft.weight_dtype=model vs int8: 8B step table, phases A/B, projections
#   bash experiments/gpu_round.sh ncuw8       # Nsight Compute of the int8 projection (and cuBLAS) at 4 rows; 8-warp tile sweep
#   bash experiments/gpu_round.sh w8smol      # the same two with the committed SmolLM2 head on HumanEval (tau, speed-up)
#   bash experiments/gpu_round.sh ab8b        # 8B A/Bs: draft rounds streamed (verify on cuBLAS); goodput defer_first_tries
#   bash experiments/gpu_round.sh ngramdiag   # n-gram speculation-off gap at SmolLM2 shapes, random weights (no staging):
#                                             never / batch_threshold / goodput at NGD_C, and host ms per engine phase
#   bash experiments/gpu_round.sh repeats     # envelope points x seeds 0,1,2 (REPEAT_DRAFT / _POLICIES / _C / _SEEDS)
#   bash experiments/gpu_round.sh recheck     # after ca37d2e (SmolLM2 staged): n-gram shadow scoring / drafting costs
#                                             (random weights, then HumanEval at C = 1, 16, 64), goodput probe_requests
#                                             on MT-bench at C = 1, 2, 8, the n-gram C = 1 step split by phase
#   ABITER_W=mt_bench|humaneval bash experiments/gpu_round.sh abiter   # goodput iter_min_samples=0,16 x row_sample=0,16
#                                             beside never / always, n-gram, 3 seeds, at the e5229cc misses (ABITER_C)
#   HM_W=mt_bench|humaneval bash experiments/gpu_round.sh hostmodel   # goodput host_model A/B beside never / always,
#                                             n-gram, staggered, seeds 0-2, at HM_C (64,128,256)
#   MIX_W=mt_bench|humaneval bash experiments/gpu_round.sh mixedab   # goodput mixed_pricing A/B beside never / always,
#                                             n-gram, staggered, seeds 0-2 (order rotated), at MIX_C (64,128,256)
#   bash experiments/gpu_round.sh ramphold8b  # goodput ramp_hold A/B beside never / always chain 3, 8B shapes, RH_C
#   bash experiments/gpu_round.sh paramlow    # the parametric 8B crossover's low Cs (PL_C: 2,4,8), seeds 0 / 1, never /
#                                             tree16 / tree48 / goodput / goodput_host_model, per-step records and
#                                             goodput's switch_log (the report's "Policy switches" table)
#   SWEEP_NAME=N SWEEP_ARGS="..." bash experiments/gpu_round.sh sweep   # any one multirun (SWEEP_S: its limit),
#                                             packed as N.tgz, e.g. an A/B arm beside an earlier stage's sweep
#   bash experiments/gpu_round.sh tiles17     # SmolLM2 projections at 17 / 21 rows (tree16 / tree20_deep verify): cuBLAS
#                                             vs the small-M bodies and the streaming tile sweep (no model files)
#   bash experiments/gpu_round.sh gputests    # pytest -m gpu, one line per test as it ends ($OUT/gpu_tests.txt):
#                                             a time limit (GPU_TESTS_S, 560) keeps the names of what ran;
#                                             SmolLM2 tests skip until the q3 call has converted it
# Back here: tar xzf FILE -C experiments/results/...; python -m specdec.report DIR.
set -uo pipefail
stage=${1:?stage}
: "${OUT:?OUT must name the folder whose files come back}"
source experiments/lent_gpu_setup.sh >/dev/null 2>&1
export WANDB_MODE=disabled SPECDEC_COMMIT=${SPECDEC_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
R=/root/runs-$SPECDEC_COMMIT
mkdir -p "$R" "$OUT"
run() { local t=$1; shift; echo "+ $*"; timeout "$t" "$@" > "$R/last.log" 2>&1; local rc=$?; echo "rc=$rc"; tail -n 4 "$R/last.log"; }
pack() {  # pack NAME DIR...: the small files of finished runs (PACK_STEPS=1: with each run's steps.jsonl,
  # the per-step k, batch and commits that explain a policy's choices; ~0.4 MB per run before compression)
  local steps=(--exclude=steps.jsonl); [ "${PACK_STEPS:-0}" = 1 ] && steps=()
  tar czf "$OUT/$1.tgz" --exclude=requests.jsonl "${steps[@]}" --exclude='*.log' -C "$R" "${@:2}" 2>/dev/null
  ls -l "$OUT/$1.tgz"
}
case "$stage" in
8b)
  run 150 python experiments/bench_tp.py --world-size 1 --out "$R/tp"
  tail -n 30 "$R/last.log"
  run 150 python -m specdec.run +experiment=step_8b hydra.run.dir="$R/step_8b"
  pack 8b tp step_8b ;;
crossover)  # CROSSOVER_MEAN=6: the parametric trace; CROSSOVER_POLICIES / CROSSOVER_C: the sweep (every policy:
  # 54 runs, 8-21 s each at 533a1d2: two calls, e.g. CROSSOVER_POLICIES=never,always3,always16,always48 CROSSOVER_TAG=a,
  # then batch_threshold,goodput with CROSSOVER_TAG=b; `python -m specdec.report DIR_a DIR_b` reads both folders)
  m=${CROSSOVER_MEAN:-null}; d=crossover_8b; [ "$m" = null ] || d=crossover_8b_parametric; d=$d${CROSSOVER_TAG:+_$CROSSOVER_TAG}
  run ${CROSSOVER_S:-560} python -m specdec.run --multirun +experiment=crossover_8b acceptance.parametric.mean=$m \
    policy=${CROSSOVER_POLICIES:-never,always3,always16,always48,batch_threshold,goodput} workload.concurrency=${CROSSOVER_C:-1,2,4,8,16,32,64,128,256} \
    ${CROSSOVER_EXTRA:-} hydra.sweep.dir="$R/$d"
  pack $d $d ;;
profile8b)  # the 8B-shape batch-1 tree steps split into phases (kernels per phase)
  run ${PROFILE_S:-200} python experiments/profile_step.py --shape llama8b --phases --trees ${PROFILE_TREES:-tree16,tree48} \
    --out "$R/profile8b"
  tail -n 40 "$R/last.log"
  pack profile8b profile8b ;;
k0cost)  # speculation off, paired (conf/experiment/k0_cost.yaml): per C, draft=none between and around
  # K0_R repeats of the two drafters (none, ngram, eagle3, none, eagle3, ngram, none, ...: the order flips
  # on alternate repeats); the report divides each drafter run by its adjacent draft=none runs
  arms=none
  for i in $(seq "${K0_R:-2}"); do
    if [ $((i % 2)) = 1 ]; then arms+=,ngram_chains,eagle3_smollm2_trees,none; else arms+=,eagle3_smollm2_trees,ngram_chains,none; fi
  done
  run ${K0_S:-420} python -m specdec.run --multirun +experiment=k0_cost draft=$arms \
    workload.concurrency=${K0_C:-16,64,256} hydra.sweep.dir="$R/k0_cost"
  python -m specdec.report "$R/k0_cost" --out "$R/k0_cost/report" 2>&1 | sed -n '/^## Speculation off/,/^## Runs/p' | head -n 80
  pack k0_cost k0_cost ;;
batch1)
  run 200 python -m specdec.run --multirun +experiment=eagle3_humaneval_full '+method=plain,eagle3_tree16,eagle3_tree48' \
    hydra.sweep.dir="$R/humaneval_full"
  run 90 python -m specdec.run --multirun +experiment=step_floor hydra.sweep.dir="$R/step_floor"
  pack batch1 humaneval_full step_floor ;;  # the speculation-off cost: stage k0cost (paired)
envelope_eagle3|envelope_ngram)
  d=eagle3_smollm2_trees; [ "$stage" = envelope_ngram ] && d=ngram_chains
  run ${ENVELOPE_S:-560} python -m specdec.run --multirun +experiment=policy_envelope draft=$d \
    workload=${ENVELOPE_WORKLOADS:-humaneval,mt_bench} ${ENVELOPE_EXTRA:-} hydra.sweep.dir="$R/${ENVELOPE_NAME:-$stage}"
  stage=${ENVELOPE_NAME:-$stage}; pack "$stage" "$stage"
  # The adaptive runs' per-step records (k, batch, commits per step) in a second tarball: what a
  # policy's choices rest on, for the diagnosis the metrics' end-of-run state cannot give.
  (cd "$R" && grep -l '"goodput"' "$stage"/*/config.json 2>/dev/null | sed 's|config.json$|steps.jsonl|' \
     | xargs -r tar czf "$OUT/${stage}_goodput_steps.tgz" 2>/dev/null) && ls -l "$OUT/${stage}_goodput_steps.tgz" ;;
eagle3head)  # HEAD_DIR: a head trained on this machine (experiments/train_head_gpu.sh train), else the committed one
  h=${HEAD_DIR:-$PWD/checkpoints/eagle3-smollm2-135m}
  run ${HEAD_FULL_S:-240} python -m specdec.run --multirun +experiment=eagle3_humaneval_full ++draft.path="$h" \
    "+method=${HEAD_FULL_METHODS:-plain,eagle3_tree16,eagle3_tree32,eagle3_tree48}" ${HEAD_EXTRA:-} hydra.sweep.dir="$R/humaneval_full"
  run ${HEAD_TABLE_S:-150} python -m specdec.run --multirun +experiment=eagle3_table ++draft.path="$h" sampling.temperature=0.0 \
    "+method=${HEAD_TABLE_METHODS:-plain,eagle3_tree16,eagle3_tree32}" ${HEAD_EXTRA:-} hydra.sweep.dir="$R/table"
  for d in humaneval_full table; do python -m specdec.report "$R/$d" --out "$R/$d/report" > /dev/null 2>&1 && cat "$R/$d/report/report.md"; done
  pack eagle3head humaneval_full table ;;
w8)  # draft.weight_dtype=model vs int8 at 8B shapes: the step table (both arms in one multirun), the whole graphed
  # batch-1 tree steps split into phases (A/B in one process), the int8 projections beside cuBLAS at 1-64 rows
  run ${W8_STEP_S:-320} python -m specdec.run --multirun +experiment=step_8b draft.weight_dtype=model,int8 \
    hydra.sweep.dir="$R/step_8b_w8"
  python -m specdec.report "$R/step_8b_w8" --out "$R/step_8b_w8/report" > /dev/null 2>&1
  sed -n '/Step breakdown/,/^## Runs/p' "$R/step_8b_w8/report/report.md" | head -n 30
  run ${PROFILE_S:-200} python experiments/profile_step.py --shape llama8b --phases --trees tree16,tree48 \
    --ab draft_weight_dtype=model,int8 --out "$R/ab_w8"
  tail -n 30 "$R/last.log"
  run ${W8_BENCH_S:-150} python experiments/kernels/bench_linear_w8.py --rows 1,4,8,16,32,64 --out "$R/bench_linear_w8.csv"
  cat "$R/last.log" | tail -n 40
  pack w8 step_8b_w8 ab_w8 bench_linear_w8.csv ;;
ncuw8)  # where the int8 projection's time goes: Nsight Compute (full set, one launch after warm-up) of linear_w8 at
  # 4 rows on gate|up and q|k|v and of cuBLAS bf16 on gate|up (the summary metrics and the stall table of each),
  # then the 4-row tile sweep with 8 warps (NCUW8_WARPS) on gate|up, q|k|v, lm_head
  for v in "gate_up w8" "qkv w8" "gate_up cublas"; do
    set -- $v; f="$R/ncu_${2}_$1"; extra=(); [ "$2" = cublas ] && extra=(--cublas)
    timeout 120 ncu --clock-control none --set full --nvtx --nvtx-include calls/ --launch-skip 4 --launch-count 1 \
      -f -o "$f" python experiments/kernels/ncu_linear_w8.py --shape "$1" --rows 4 "${extra[@]}" > "$f.log" 2>&1
    echo "== $v rc=$? $(tail -n 1 "$f.log")"
    ncu -i "$f.ncu-rep" --page details --csv > "$f.details.csv" 2>/dev/null
    grep -E '"(Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per Thread|Block Limit Shared Mem|Block Limit Registers|Dynamic Shared Memory Per Block|Grid Size|L2 Hit Rate|Issue Slots Busy|Executed Ipc Active|Theoretical Occupancy|Waves Per SM)"' \
      "$f.details.csv" | awk -F'","' '{print "  " $(NF-2) " = " $NF " " $(NF-1)}' | tr -d '"' | head -n 20
    ncu -i "$f.ncu-rep" --page source --csv --print-source sass > "$f.sass.csv" 2>/dev/null
    python experiments/kernels/ncu_stalls.py "$f.sass.csv" 25 2>&1 | head -n 45
  done
  run ${NCUW8_SWEEP_S:-240} python experiments/kernels/bench_linear_w8.py --rows 4 --sweep --warps ${NCUW8_WARPS:-8} \
    --shapes gate_up,qkv,lm_head --out "$R/bench_linear_w8_sweep.csv"
  tail -n 8 "$R/last.log"
  tar czf "$OUT/ncuw8.tgz" -C "$R" $(cd "$R" && ls ncu_*.csv ncu_*.log bench_linear_w8_sweep.csv 2>/dev/null); ls -l "$OUT" ;;
w8smol)  # draft.weight_dtype=model vs int8 with the committed SmolLM2 head: all 164 HumanEval prompts at batch 1
  # (greedy), plain beside: does int8 keep the head's acceptance (tau) and what does it do to the speed-up there
  run ${W8_PLAIN_S:-200} python -m specdec.run --multirun +experiment=eagle3_humaneval_full +method=plain \
    hydra.sweep.dir="$R/w8_humaneval/plain"
  run ${W8_SPEC_S:-360} python -m specdec.run --multirun +experiment=eagle3_humaneval_full \
    "+method=${W8_METHODS:-eagle3_tree16,eagle3_tree32}" draft.weight_dtype=model,int8 hydra.sweep.dir="$R/w8_humaneval/eagle3"
  python -m specdec.report "$R/w8_humaneval/plain" "$R/w8_humaneval/eagle3" --out "$R/w8_humaneval/report" > /dev/null 2>&1
  head -n 40 "$R/w8_humaneval/report/report.md"
  pack w8_humaneval w8_humaneval ;;
ab8b|ab8b_rows|ab8b_defer)  # two 8B-shape A/Bs (ab8b: both; ab8b_rows / ab8b_defer: one each): the draft rounds'
  # rows streamed with verify left on cuBLAS (small_m x fused_rows: stream_prefetch + fused_rows=8 streams rows <= 8,
  # the rounds of tree16 / tree48), and goodput's defer_first_tries at C = 128 / 256 beside never (replayed trace);
  # AB8B_C: the concurrencies
  if [ "$stage" != ab8b_defer ]; then
    run ${PROFILE_S:-240} python experiments/profile_step.py --shape llama8b --steps-only --phases --trees tree16,tree48 \
      --ab small_m=auto,stream_prefetch --ab fused_rows=null,8 --out "$R/ab8b_rows"
    tail -n 24 "$R/last.log"
    pack ab8b_rows ab8b_rows
  fi
  if [ "$stage" != ab8b_rows ]; then
    run ${AB8B_S:-300} python -m specdec.run --multirun +experiment=crossover_8b acceptance.parametric.mean=null \
      policy=never workload.concurrency=${AB8B_C:-128,256} hydra.sweep.dir="$R/ab8b_defer/never"
    run ${AB8B_S:-300} python -m specdec.run --multirun +experiment=crossover_8b acceptance.parametric.mean=null \
      policy=goodput ++policy.defer_first_tries=false,true workload.concurrency=${AB8B_C:-128,256} \
      hydra.sweep.dir="$R/ab8b_defer/goodput"
    python -m specdec.report "$R/ab8b_defer/never" "$R/ab8b_defer/goodput" --out "$R/ab8b_defer/report" 2>&1 | tail -n 3
    PACK_STEPS=1 pack ab8b_defer ab8b_defer
  fi ;;
ngramdiag)  # the n-gram drafter's k = 0 gap (goodput 0.82x of never at C = 256 while off on 98% of steps, and
  # batch_threshold 0.86x at 13275cd) at SmolLM2 shapes with random weights and HumanEval's lengths: needs no
  # staged checkpoint. The sweep (with per-step records), then profile_serving --phases per policy at NGD_PC: host ms
  # of each engine phase per iteration, split by iterations that prefill and those that do not
  b=(+experiment=policy_envelope target=smollm2_random workload=humaneval_lengths draft=ngram_chains ${NGD_EXTRA:-})
  run ${NGD_S:-300} python -m specdec.run --multirun "${b[@]}" policy=${NGD_POLICIES:-never,batch_threshold,goodput} \
    workload.concurrency=${NGD_C:-128,256} hydra.sweep.dir="$R/ngramdiag/sweep"
  for p in ${NGD_PHASES:-never batch_threshold goodput}; do
    run 150 python experiments/profile_serving.py --phases --skip 400 --out "$R/ngramdiag/phases_$p" -- "${b[@]}" \
      policy=$p workload.concurrency=${NGD_PC:-256}
  done
  python -m specdec.report "$R/ngramdiag/sweep" --out "$R/ngramdiag/sweep/report" 2>&1 | sed -n '/^## Policy envelope/,/^## /p' | head -n 30
  PACK_STEPS=1 pack ngramdiag ngramdiag ;;
recheck)  # what ca37d2e's lease found, re-measured after the fixes (one call, ~6 min; needs the SmolLM2 files):
  # goodput at k = 0 with random weights (0.90x / 0.96x of never at C = 64 / 256 before follow_at), the n-gram envelope
  # points it missed (HumanEval C = 1 / 64; C = 16 beside), EAGLE-3 goodput with probe_requests 0 / 16 on MT-bench at
  # C = 1, 2, 8 (seeds 0 / 1), and host ms per phase of always / goodput n-gram at C = 1 (their 0.88 / 0.99 ms steps)
  # RECHECK_PARTS: which of random / humaneval / probe / phases to run (default: all)
  e=(+experiment=policy_envelope workload.stagger=true) parts=" ${RECHECK_PARTS:-random humaneval probe phases} "
  [[ $parts == *" random "* ]] && run ${RECHECK_S:-110} python -m specdec.run --multirun "${e[@]}" target=smollm2_random workload=humaneval_lengths \
    draft=ngram_chains policy=never,goodput workload.concurrency=64,256 hydra.sweep.dir="$R/recheck/ngram_random"
  [[ $parts == *" humaneval "* ]] && run ${RECHECK_S:-150} python -m specdec.run --multirun "${e[@]}" draft=ngram_chains workload=humaneval \
    policy=never,always,goodput workload.concurrency=1,16,64 hydra.sweep.dir="$R/recheck/ngram_humaneval"
  [[ $parts == *" probe "* ]] && run ${RECHECK_S:-180} python -m specdec.run --multirun "${e[@]}" draft=eagle3_smollm2_trees workload=mt_bench \
    policy=goodput ++policy.probe_requests=0,16 workload.concurrency=1,2,8 seed=0,1 hydra.sweep.dir="$R/recheck/probe"
  for p in always goodput; do
    [[ $parts == *" phases "* ]] || continue
    run 60 python experiments/profile_serving.py --phases --skip 400 --out "$R/recheck/phases_$p" -- "${e[@]}" \
      draft=ngram_chains workload=humaneval policy=$p workload.concurrency=1
  done
  for d in ngram_random ngram_humaneval probe; do
    [ -d "$R/recheck/$d" ] || continue
    python -m specdec.report "$R/recheck/$d" --out "$R/recheck/$d/report" 2>&1 | sed -n '/^## Policy envelope/,/^## /p' | head -n 12
  done
  PACK_STEPS=1 pack recheck recheck ;;
repeats)  # envelope points repeated (seed=0,1,2; the report averages them): REPEAT_DRAFT (eagle3_smollm2_trees),
  # REPEAT_POLICIES (always,goodput), REPEAT_C (1,2,4), REPEAT_SEEDS (0,1,2), on HumanEval; with per-step records
  d=${REPEAT_DRAFT:-eagle3_smollm2_trees}
  run ${REPEAT_S:-540} python -m specdec.run --multirun +experiment=policy_envelope draft=$d workload=humaneval \
    policy=${REPEAT_POLICIES:-always,goodput} workload.concurrency=${REPEAT_C:-1,2,4} seed=${REPEAT_SEEDS:-0,1,2} \
    hydra.sweep.dir="$R/repeats_$d"
  PACK_STEPS=1 pack "repeats_$d" "repeats_$d" ;;
abiter)  # goodput iter_min_samples 0 / 16 x row_sample 0 / 16 beside never / always, n-gram, seeds 0 / 1 / 2, at the points
  # it missed at e5229cc: ABITER_W (mt_bench) at ABITER_C (mt_bench: 128,256; humaneval: 128); one call per workload
  w=${ABITER_W:-mt_bench}; c=${ABITER_C:-128,256}; [ "$w" = humaneval ] && c=${ABITER_C:-128}
  run ${ABITER_S:-150} python -m specdec.run --multirun +experiment=policy_envelope draft=ngram_chains workload=$w \
    workload.stagger=true workload.concurrency=$c seed=0,1,2 policy=never,always hydra.sweep.dir="$R/abiter_$w/base"
  run ${ABITER_GS:-400} python -m specdec.run --multirun +experiment=policy_envelope draft=ngram_chains workload=$w \
    workload.stagger=true workload.concurrency=$c seed=0,1,2 policy=goodput ++policy.iter_min_samples=0,16 \
    ++policy.row_sample=0,16 hydra.sweep.dir="$R/abiter_$w/goodput"
  python -m specdec.report "$R/abiter_$w/base" "$R/abiter_$w/goodput" --out "$R/abiter_$w/report" 2>&1 \
    | sed -n '/^## Policy envelope/,/^## /p' | head -n 14
  PACK_STEPS=1 pack "abiter_$w" "abiter_$w" ;;
hostmodel)  # goodput host_model A/B beside never / always, n-gram, staggered, seeds 0 / 1 / 2 at HM_C (64,128,256) on
  # HM_W (mt_bench): one multirun, a point's four policies back to back per seed (the sweep lists seed before policy)
  w=${HM_W:-mt_bench}
  run ${HM_S:-560} python -m specdec.run --multirun +experiment=policy_envelope draft=ngram_chains workload=$w \
    workload.stagger=true workload.concurrency=${HM_C:-64,128,256} seed=0,1,2 \
    policy=never,always,goodput,goodput_host_model hydra.sweep.dir="$R/hostmodel_$w"
  python -m specdec.report "$R/hostmodel_$w" --out "$R/hostmodel_$w/report" 2>&1 | sed -n '/^## Paired by seed/,/^## /p' | head -n 12
  PACK_STEPS=1 pack "hostmodel_$w" "hostmodel_$w" ;;
mixedab)  # goodput mixed_pricing (and calibrate) beside never / always, n-gram, staggered, seeds 0 / 1 / 2, at the MT-bench
  # misses (MIX_C: 64,128,256) on MIX_W (mt_bench); the sweep's RotatingSweeper rotates the policies' order per seed
  w=${MIX_W:-mt_bench}
  run ${MIX_S:-560} python -m specdec.run --multirun +experiment=policy_envelope draft=ngram_chains workload=$w \
    workload.stagger=true workload.concurrency=${MIX_C:-64,128,256} seed=0,1,2 \
    policy=${MIX_POLICIES:-never,always,goodput,goodput_mixed} hydra.sweep.dir="$R/mixedab_$w"
  python -m specdec.report "$R/mixedab_$w" --out "$R/mixedab_$w/report" 2>&1 | sed -n '/^## Paired by seed/,/^## /p' | head -n 12
  PACK_STEPS=1 pack "mixedab_$w" "mixedab_$w" ;;
ramphold8b)  # goodput ramp_hold A/B beside never / always chain 3 at 8B shapes (replayed trace, not staggered), RH_C
  # (32,64,128,256): one multirun, a point's policies back to back
  run ${RH_S:-560} python -m specdec.run --multirun +experiment=crossover_8b acceptance.parametric.mean=null \
    policy=never,always3,goodput,goodput_ramp_hold workload.concurrency=${RH_C:-32,64,128,256} \
    hydra.sweep.dir="$R/ramphold8b"
  python -m specdec.report "$R/ramphold8b" --out "$R/ramphold8b/report" 2>&1 | sed -n '/^## Crossover summary/,/^## /p' | head -n 12
  PACK_STEPS=1 pack ramphold8b ramphold8b ;;
paramlow)  # 6d0055c: goodput 0.967 of the envelope at C = 4 (31 switches between tree16 and tree48); the same point
  # with per-step records and the switch log, beside host_model (device step times + one host line, not each k's own
  # served iterations)
  run ${PL_S:-560} python -m specdec.run --multirun +experiment=crossover_8b acceptance.parametric.mean=6 \
    workload.concurrency=${PL_C:-2,4,8} seed=0,1 policy=never,always16,always48,goodput,goodput_host_model \
    hydra.sweep.dir="$R/paramlow"
  python -m specdec.report "$R/paramlow" --out "$R/paramlow/report" 2>&1 | sed -n '/^## Policy switches/,/^## /p' | cut -c1-40,440-900 | head -n 20
  PACK_STEPS=1 pack paramlow paramlow ;;
sweep)
  n=${SWEEP_NAME:?SWEEP_NAME}
  # shellcheck disable=SC2086  # SWEEP_ARGS: overrides, split on spaces
  run ${SWEEP_S:-300} python -m specdec.run --multirun ${SWEEP_ARGS:?SWEEP_ARGS} hydra.sweep.dir="$R/$n"
  python -m specdec.report "$R/$n" --out "$R/$n/report" > /dev/null 2>&1
  pack "$n" "$n" ;;
tiles17)  # where the 17-row verify GEMMs lose to the one-row GEMV (docs/kernel_notes.md, "Norm statistics from the producer")
  run ${TILES_S:-400} python experiments/kernels/bench_linear.py --small-m --small-m-sweep --shapes smollm2 --rows 17 21 --out "$OUT"
  ls -l "$OUT" ;;
tiles8b)  # Llama-3.1-8B projections: the streaming tile sweep at a 16-node tree's verify rows (17) and its draft
  # rounds' rows (4), one tile table of the winners ($OUT/h200_llama8b.json), then the graphed tree16 / tree48
  # steps with the verify and rounds on cuBLAS (small_m=auto) vs streamed under the packaged and the new tables
  for m in 17 4; do
    lo=$m hi=$m; [ $m = 17 ] && lo=16 hi=24; [ $m = 4 ] && lo=2 hi=8
    run ${TILES_S:-240} python experiments/kernels/bench_linear.py --small-m --small-m-sweep --shapes llama8b --rows $m \
      --bodies stream --write-tiles "$R/tiles8b_$m.json" --tile-rows $lo $hi --out "$R/tiles8b_$m"
    cp "$R/tiles8b_$m/bench_linear_small_m_sweep.csv" "$OUT/bench_linear_small_m_sweep_llama8b_${m}_$SPECDEC_COMMIT.csv"
  done
  python3 - "$R" "$OUT/h200_llama8b.json" <<'PY'
import json, sys
r, out = sys.argv[1:]
ts = [json.load(open(f"{r}/tiles8b_{m}.json")) for m in (17, 4)]
ts[0]["entries"] += ts[1]["entries"]
ts[0]["source"] = "bench_linear.py --small-m-sweep --shapes llama8b --rows 17 (rows 16-24) and --rows 4 (rows 2-8)"
json.dump(ts[0], open(out, "w"), indent=1)
print(json.dumps(ts[0])[:3000])
PY
  run ${PROFILE_S:-300} python experiments/profile_step.py --shape llama8b --steps-only --trees ${PROFILE_TREES:-tree16,tree48} \
    --ab small_m=auto,stream_prefetch --ab stream_tiles=builtin,"$OUT/h200_llama8b.json" ${PROFILE_EXTRA:-} --out "$R/tiles8b_ab"
  tail -n 30 "$R/last.log"
  cp "$R"/tiles8b_ab/*.json "$OUT/" 2>/dev/null; ls -l "$OUT" ;;
gputests)  # GPU_TESTS_FILES: test files to run (default: all of tests/), e.g. "tests/test_engine.py tests/test_spec.py"
  # shellcheck disable=SC2086  # GPU_TESTS_FILES: paths, split on spaces
  SPECDEC_TESTS_OFFLINE=1 timeout ${GPU_TESTS_S:-560} python -m pytest -m gpu -v -rfEs -p no:cacheprovider ${GPU_TESTS_FILES:-} \
    > "$OUT/gpu_tests.txt" 2>&1; echo "rc=$?"
  grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_tests.txt" | tail -n 20 ;;
*) echo "unknown stage $stage" >&2; exit 64 ;;
esac
