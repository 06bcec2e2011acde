# Source on a lent GPU machine without network, Hydra or gguf (recipe:
# docs/gpu_machines.md):  source experiments/lent_gpu_setup.sh
# The SmolLM2 GGUF travels in parts (the tree plus what a call carries must stay under 64 MiB):
# every call that carries an ignored .stage/*/ folder with a gguf.partNN copies it to
# /root/specdec-stage (outside the repository, so it survives while the machine stays warm); the
# call that brings the last part (and .stage/*/prompts/, .whl/) joins and converts. Idempotent: a
# later call of the same lease finds the converted model and the installed wheels.
S=${SPECDEC_STAGE:-/root/specdec-stage}  # outside the repository (SPECDEC_STAGE: elsewhere)
export SPECDEC_CACHE=$S/cache
mkdir -p /tmp/site "$SPECDEC_CACHE/smollm2-135m-instruct"
cp .stage/*/gguf.part* .stage/*/gguf.size "$S/" 2>/dev/null
for d in .stage/*/prompts; do [ -d "$d" ] && cp -r "$d" "$SPECDEC_CACHE/"; done
# A draft head trained on an earlier machine travels the same way: its files split over the parts'
# head/ subfolders (.stage/q1/head, .stage/q2/head; docs/gpu_machines.md), gathered in $S/head.
for d in .stage/*/head; do [ -d "$d" ] && mkdir -p "$S/head" && cp "$d"/* "$S/head/"; done
if [ ! -f /tmp/site/.done ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && touch /tmp/site/.done
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
# Every part staged: their sizes add up to gguf.size (the recipe writes it); without it, four parts.
staged() {
  local n; n=$(cat $S/gguf.part?? 2>/dev/null | wc -c)
  if [ -f $S/gguf.size ]; then [ "$n" = "$(cat $S/gguf.size)" ]; else [ "$(ls $S/gguf.part?? 2>/dev/null | wc -l)" -ge 4 ]; fi
}
if [ ! -f "$SPECDEC_CACHE/smollm2-135m-instruct/config.json" ] && [ -f /tmp/site/.done ] && [ -d "$SPECDEC_CACHE/prompts" ] \
   && staged; then
  cat $S/gguf.part?? > $S/smol.gguf
  python3 -c "from pathlib import Path; from specdec.assets import convert_gguf; convert_gguf(Path('$S/smol.gguf'), Path('$SPECDEC_CACHE/smollm2-135m-instruct'))"
fi
# A complete asset entry holds its source GGUF too (specdec.assets.SMOLLM2_FILES): without it
# smollm2_dir() sees an incomplete entry and tries to rebuild it from the PyPI wheel (no network here).
G=$SPECDEC_CACHE/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -s "$G" ] && [ -f "$SPECDEC_CACHE/smollm2-135m-instruct/config.json" ]; then
  [ -s $S/smol.gguf ] || cat $S/gguf.part?? > $S/smol.gguf 2>/dev/null
  [ -s $S/smol.gguf ] && cp $S/smol.gguf "$G"
fi
ls "$S" "$SPECDEC_CACHE/smollm2-135m-instruct"
