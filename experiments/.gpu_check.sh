export PYTHONPATH=$PWD SPECDEC_COMMIT=$1
python -m pytest -q -x tests/test_tree_grow.py tests/test_linear.py tests/test_eagle3.py tests/test_spec.py tests/test_tree.py -k "not smollm2" 2>&1 | tail -3
python experiments/profile_step.py --out $OUT/prof > $OUT/prof.log 2>&1 || tail -20 $OUT/prof.log
python - <<'PY'
import json,os
d=json.load(open(os.environ['OUT']+'/prof/profile_step.json'))
for k,v in d['steps'].items():
    print(k, round(v['replay_ms'],3), round(v['kernel_ms'],3), v['kernels'])
PY
