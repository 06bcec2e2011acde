# Source on a lent GPU machine without network, Hydra or gguf (see README.md here, "Running on a GPU
# machine without network or Hydra"):  source experiments/lent_gpu_setup.sh
# Needs /root/specdec-stage/gguf.part00 (copied there by an earlier call) and, the first time,
# .stage/p2/{gguf.part01,prompts/} and .whl/ carried in this call. Idempotent: a later call of the
# same lease finds the converted model and the installed wheels and only sets the environment.
S=/root/specdec-stage
export SPECDEC_CACHE=$S/cache
mkdir -p /tmp/site "$SPECDEC_CACHE"
if [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && touch /tmp/site/.done
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ ! -f "$SPECDEC_CACHE/smollm2-135m-instruct/config.json" ]; then
  cp -r .stage/p2/prompts "$SPECDEC_CACHE/"
  cat $S/gguf.part00 .stage/p2/gguf.part01 > $S/smol.gguf
  python3 -c "from pathlib import Path; from specdec.assets import convert_gguf; convert_gguf(Path('$S/smol.gguf'), Path('$SPECDEC_CACHE/smollm2-135m-instruct'))"
fi
ls "$SPECDEC_CACHE" "$SPECDEC_CACHE/smollm2-135m-instruct"
