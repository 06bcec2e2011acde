source experiments/lent_gpu_setup.sh > /dev/null 2>&1
export SPECDEC_COMMIT=$1
python -m specdec.run --multirun +experiment=eagle3_humaneval_full hydra.sweep.dir=$OUT/he > $OUT/he.log 2>&1
python -m specdec.report $OUT/he --out $OUT/he/report > /dev/null 2>&1
tar czf $OUT/he.tgz -C $OUT he && rm -rf $OUT/he
grep -h "output_tok_per_s\|mean_accepted_length" -r /dev/null
python - <<'PY'
import tarfile, json, os
t = tarfile.open(os.environ['OUT'] + '/he.tgz')
for m in sorted(t.getnames()):
    if m.endswith('metrics.json'):
        d = json.load(t.extractfile(m))
        print(m, round(d['output_tok_per_s']), d.get('mean_accepted_length'), d.get('mean_spec_step_ms') or d.get('mean_plain_step_ms'))
PY
timeout 330 python -m specdec.run --multirun +experiment=eagle3_table hydra.sweep.dir=$OUT/table > $OUT/table.log 2>&1
python -m specdec.report $OUT/table --out $OUT/table/report > /dev/null 2>&1
tar czf $OUT/table.tgz -C $OUT table && rm -rf $OUT/table
tail -3 $OUT/table.log
