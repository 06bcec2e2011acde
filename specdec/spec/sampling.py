"""Sampling parameters and token selection: temperature, then top-k, then top-p, then min-p.

The warpers apply in Hugging Face's order (TemperatureLogitsWarper, TopKLogitsWarper,
TopPLogitsWarper, MinPLogitsWarper), each on the distribution the earlier ones left:

    temperature  x = logits / temperature; 0 = greedy (argmax, first index on ties; warpers moot)
    top_k        keep the tokens whose x is at least the k-th largest (0 = off; ties kept)
    top_p        of those, keep the shortest head by descending x whose probability reaches top_p
                 (1 = off; tokens tied with its last member kept)
    min_p        keep the tokens whose probability is at least min_p x the largest (0 = off)

The result is the distribution plain decoding samples from and the one speculative verification
accepts against (kernels_triton/sampling.py computes it per row on the device, with per-request
parameters; ``warp_logits_ref`` there is the sort-based reference this module samples with).

A run sets the defaults (``sampling:`` in conf/config.yaml); a request may override any of them
(a jsonl workload line's ``"sampling": {...}``, or ``Engine.add_request(sampling=...)``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch

from ..errors import ConfigError, config_number

KEYS = ("temperature", "top_k", "top_p", "min_p")
# Below this a temperature is refused rather than run: logits / t overflows fp32 as t -> 0 (vLLM
# treats such temperatures as greedy); 0 is greedy.
MIN_TEMPERATURE = 1e-5
MAX_TOP_K = 1 << 24  # the device carries top_k in fp32 (exact integers below 2**24)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off

    @classmethod
    def from_mapping(cls, values, where: str = "sampling", base: "SamplingParams | None" = None) -> "SamplingParams":
        """Validated parameters from a mapping of some of KEYS (the rest from ``base``, else the
        defaults). An unknown key or a bad value is a ConfigError naming ``where.key`` and what is valid."""
        if values is None:
            return base or cls()
        if not isinstance(values, Mapping):
            raise ConfigError(f"{where} must be a mapping of {', '.join(KEYS)}, got {type(values).__name__} "
                              f"{values!r}")
        unknown = [k for k in values if k not in KEYS]
        if unknown:
            raise ConfigError(f"unknown key {where}.{unknown[0]}; known {where} keys: {', '.join(KEYS)}")
        merged = {**asdict(base or cls()), **{str(k): v for k, v in values.items()}}
        return cls(**{k: _check(f"{where}.{k}", k, merged[k]) for k in KEYS})

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def warps(self) -> bool:
        """Any of top-k, top-p, min-p on (they matter only when sampling)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def row(self) -> tuple[float, float, float, float]:
        """(temperature, top_k, top_p, min_p) as the warper kernel's per-request parameter row."""
        return (float(self.temperature), float(self.top_k), float(self.top_p), float(self.min_p))

    def as_dict(self) -> dict:
        return asdict(self)


def _check(key: str, name: str, value):
    """One parameter, validated (``key`` names it in errors)."""
    if value is None:
        raise ConfigError(f"{key}=None: must be a number")
    if name == "temperature":
        v = config_number(key, value, float)
        if not math.isfinite(v):
            raise ConfigError(f"{key}={value!r}: must be a finite number")
        if v != 0.0 and not v >= MIN_TEMPERATURE:
            raise ConfigError(f"{key}={value!r}: must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        return v
    if name == "top_k":
        v = config_number(key, value, int)
        if not 0 <= v <= MAX_TOP_K:
            raise ConfigError(f"{key}={value!r}: must be an integer in 0 .. {MAX_TOP_K} (0 = off)")
        return v
    if name == "top_p":
        v = config_number(key, value, float)
        if not 0.0 < v <= 1.0:
            raise ConfigError(f"{key}={value!r}: must be in (0, 1] (1 = off)")
        return v
    v = config_number(key, value, float)  # min_p
    if not 0.0 <= v <= 1.0:
        raise ConfigError(f"{key}={value!r}: must be in [0, 1] (0 = off)")
    return v


def _params(temperature, top_k, top_p, min_p) -> SamplingParams:
    if isinstance(temperature, SamplingParams):
        return temperature
    return SamplingParams.from_mapping(dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))


def warped_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[.., V] logits -> fp32 warped logits (-inf outside the kept set; greedy: one-hot at the argmax
    as 0 / -inf), by the sort-based reference of kernels_triton/sampling.py."""
    from kernels_triton.sampling import warp_logits_ref

    rows = logits.reshape(-1, logits.shape[-1])  # [N, V]
    p = torch.tensor(params.row(), dtype=torch.float32, device=logits.device).expand(rows.shape[0], 4)
    return warp_logits_ref(rows, p).view(logits.shape)


def probs_from_logits(logits: torch.Tensor, temperature, top_k: int = 0, top_p: float = 1.0,
                      min_p: float = 0.0) -> torch.Tensor:
    """[.., V] logits -> fp32 probabilities of the warped distribution (``temperature`` a number
    > 0 with the warper arguments, or a SamplingParams)."""
    return torch.softmax(warped_logits(logits, _params(temperature, top_k, top_p, min_p)), dim=-1)


def sample(logits: torch.Tensor, temperature, generator: torch.Generator | None = None, *, top_k: int = 0,
           top_p: float = 1.0, min_p: float = 0.0):
    """[B, V] -> [B] int64. Temperature 0 is argmax; otherwise an exact draw from the warped
    distribution (``temperature`` a number with the warper arguments, or a SamplingParams).

    Draws with ``torch.multinomial`` and the given generator, so a seeded run is reproducible.
    """
    params = _params(temperature, top_k, top_p, min_p)
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(warped_logits(logits, params), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
