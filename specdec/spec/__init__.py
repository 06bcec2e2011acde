"""Drafting: one file per drafter (ngram, eagle3) over the protocol in :mod:`.base`; tree.py holds
the draft tree and its growth, sampling.py the sampling helpers. A new drafter is a new file plus
one branch in ``build_drafter``."""

from __future__ import annotations

from ..errors import ConfigError
from .base import Drafter
from .eagle3 import Eagle3Drafter
from .ngram import NgramDrafter

__all__ = ["Drafter", "Eagle3Drafter", "NgramDrafter", "build_drafter"]


def tree_shapes(cfg) -> list[tuple[int, int, int]]:
    """The EAGLE-3 tree shapes of a draft config: ``trees`` (a list of {topk, steps, num_draft_tokens}),
    or the one-tree shorthand of top-level topk / steps / num_draft_tokens."""
    from .eagle3 import _tree_tuple

    trees = cfg.get("trees")
    if trees is None:
        if any(cfg.get(k) is None for k in ("topk", "steps", "num_draft_tokens")):
            raise ConfigError("draft=eagle3 needs draft.trees: a list of {topk, steps, num_draft_tokens} shapes")
        return [(int(cfg.topk), int(cfg.steps), int(cfg.num_draft_tokens))]
    if isinstance(trees, (str, int)) or not len(trees):
        raise ConfigError(f"draft.trees={trees!r}: need a non-empty list of {{topk, steps, num_draft_tokens}}")
    return [tuple(int(x) for x in _tree_tuple(t)) for t in trees]


def build_drafter(cfg, target, *, device, dtype=None, backend="auto"):
    """From the Hydra ``draft`` group: none -> None, ngram, eagle3 (needs draft.path)."""
    name = cfg.get("name", "none")
    if name == "none":
        return None
    if name == "ngram":
        chains = cfg.get("chains")
        return NgramDrafter(int(cfg.get("max_ngram", 3)), int(cfg.get("min_ngram", 1)),
                            chains=None if chains is None else [int(c) for c in chains])
    if name == "eagle3":
        from ..models.eagle3 import Eagle3Head

        path = cfg.get("path")
        if not path:
            raise ConfigError("draft=eagle3 needs draft.path=DIR (an EAGLE-3 checkpoint directory)")
        from pathlib import Path

        if not Path(path).is_dir():
            raise ConfigError(f"draft checkpoint {path} not found: train one with `python -m "
                              "specdec.train +experiment=train_eagle3_smollm2 train.output_dir=DIR`, "
                              "or point draft.path at an EAGLE-3 checkpoint")
        head = Eagle3Head.load(path, device=device, dtype=dtype if dtype is not None else target.dtype,
                               backend=backend, target=target.config)
        return Eagle3Drafter(head, target, trees=tree_shapes(cfg),
                             sync_while_off=bool(cfg.get("sync_while_off", False)),
                             catch_up=bool(cfg.get("catch_up", True)))
    raise ConfigError(f"unknown draft {name!r}; valid: none, ngram, eagle3")
