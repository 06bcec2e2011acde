"""Reading Hugging Face checkpoint directories: config.json and one or several safetensors files."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import ConfigError, SpecdecError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


class CheckpointError(SpecdecError, ValueError):
    """A checkpoint directory is missing, malformed, or of an unsupported architecture."""


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """None/"auto" -> bf16 on GPU, fp32 on CPU; else a name from DTYPES."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; valid: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]



def read_json_object(path: Path, what: str = "file") -> dict:
    """A JSON object from ``path`` ({} when the file does not exist); errors name the file."""
    if not path.is_file():
        return {}
    try:
        obj = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a JSON object ({what}), got {type(obj).__name__}")
    return obj


SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_files(path: str | Path) -> list[Path]:
    """The weight files of a directory: those its shard index names (checked: a JSON object whose
    ``weight_map`` maps tensor names to files that exist), else every *.safetensors in it."""
    path = Path(path)
    index = path / SAFETENSORS_INDEX
    if not index.is_file():
        return sorted(path.glob("*.safetensors"))
    try:
        obj = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{index} is not valid JSON: {e}") from e
    wmap = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(wmap, dict) or not wmap or not all(isinstance(v, str) for v in wmap.values()):
        raise CheckpointError(f"{index}: expected a JSON object with a non-empty \"weight_map\" "
                              "{tensor name: shard file name}")
    files = sorted({path / f for f in wmap.values()})
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise CheckpointError(f"{index} names shard files that are not in {path}: {absent}")
    return files


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file, or shards with or without an index)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    files = safetensors_files(path)
    if not files:
        raise CheckpointError(f"{path} holds no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f}: cannot read safetensors file: {e}") from e
    return tensors


# transformers 4.x's default max_shard_size (5 GB; 5.x: 50 GB): below it a checkpoint is one file,
# which is also all the official EAGLE loader reads (model.safetensors or pytorch_model.bin).
SHARD_BYTES = 5 * 10**9


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor],
                      shard_bytes: int | None = SHARD_BYTES) -> list[str]:
    """Write ``tensors`` into directory ``path`` as one ``model.safetensors``, or, only when they
    exceed ``shard_bytes``, as ``model-0000i-of-0000n.safetensors`` shards of at most that size plus
    the Hugging Face index. Weight files already there (and a stale index) are removed first, so the
    directory never holds two copies. Returns the file names written."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for old in list(path.glob("*.safetensors")) + [path / SAFETENSORS_INDEX]:
        old.unlink(missing_ok=True)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    if not shard_bytes or total <= shard_bytes:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    groups: list[list[str]] = [[]]
    size = 0
    for k, v in tensors.items():
        n = v.numel() * v.element_size()
        if n > shard_bytes:
            raise ConfigError(f"tensor {k} is {n / 2**20:.2f} MiB, over the shard size of "
                              f"{shard_bytes / 2**20:.2f} MiB (one tensor cannot be split across files)")
        if groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += n
    names, weight_map = [], {}
    for i, keys in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k] for k in keys}, str(path / name), metadata={"format": "pt"})
        names.append(name)
        weight_map.update({k: name for k in keys})
    (path / SAFETENSORS_INDEX).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names
