"""Drafting: one file per drafter (ngram, eagle3) over the protocol in :mod:`.base`; tree.py holds
the draft tree and its growth, sampling.py the sampling helpers. A new drafter is a new file plus
one branch in ``build_drafter``."""

from __future__ import annotations

from ..errors import ConfigError
from .base import Drafter
from .eagle3 import Eagle3Drafter
from .ngram import DeviceNgramDrafter, NgramDrafter

__all__ = ["DeviceNgramDrafter", "Drafter", "Eagle3Drafter", "NgramDrafter", "build_drafter"]


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
        chains = None if chains is None else [int(c) for c in chains]
        lookup = str(cfg.get("lookup", "device"))
        if lookup == "device":
            return DeviceNgramDrafter(int(cfg.get("max_ngram", 3)), int(cfg.get("min_ngram", 1)), chains=chains,
                                      backend=backend)
        if lookup != "host":
            raise ConfigError(f"draft.lookup={lookup!r}; valid: host, device")
        return NgramDrafter(int(cfg.get("max_ngram", 3)), int(cfg.get("min_ngram", 1)), chains=chains)
    if name == "eagle3" and cfg.get("random"):
        head = random_eagle3_head(target, cfg.get("draft_vocab_size", "auto"), cfg.get("target_layers"),
                                  device=device, dtype=dtype if dtype is not None else target.dtype,
                                  backend=backend, logit_std=float(cfg.get("logit_std", RANDOM_LOGIT_STD)))
        head.set_weight_dtype_(str(cfg.get("weight_dtype", "model")))
        return Eagle3Drafter(head, target, trees=tree_shapes(cfg),
                             sync_while_off=bool(cfg.get("sync_while_off", False)),
                             catch_up=bool(cfg.get("catch_up", True)))
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
        head.set_weight_dtype_(str(cfg.get("weight_dtype", "model")))
        return Eagle3Drafter(head, target, trees=tree_shapes(cfg),
                             sync_while_off=bool(cfg.get("sync_while_off", False)),
                             catch_up=bool(cfg.get("catch_up", True)))
    raise ConfigError(f"unknown draft {name!r}; valid: none, ngram, eagle3")


# The published Llama-3.1-8B EAGLE-3 head (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B) keeps 32000 draft ids.
RANDOM_DRAFT_VOCAB = 32000
# Std of a random head's draft logits. With std-0.02 weights every draft distribution is nearly uniform
# over 32000 ids, so the kept tree is its first two levels (16 nodes: 4 + 12) and replay could never
# accept more than 2 drafts; logits of std 12 give a dominant child per node, as a trained head has,
# and trees as deep as their growth allows (an i.i.d. simulation over 32000 ids: tree16 reaches depth
# 5.0 and tree48 7.0 of 5 and 7 on average at std 12, 4.7 and 6.85 at std 8; tests check real heads).
RANDOM_LOGIT_STD = 12.0


def random_draft_vocab(vocab_size: int, setting="auto") -> int:
    """draft_vocab_size of a random head: ``auto`` -> 32000 for a vocabulary of 128000 or more (Llama-3),
    else min(vocab, 32000); an integer must lie in 1 .. vocab."""
    if setting in (None, "auto"):
        return RANDOM_DRAFT_VOCAB if vocab_size >= 128000 else min(vocab_size, RANDOM_DRAFT_VOCAB)
    try:
        n = int(setting)
    except (TypeError, ValueError):
        raise ConfigError(f"draft.draft_vocab_size={setting!r}: auto or an integer in 1..{vocab_size}") from None
    if not 1 <= n <= vocab_size:
        raise ConfigError(f"draft.draft_vocab_size={n}: must be in 1..{vocab_size} (the target's vocabulary)")
    return n


def random_eagle3_head(target, draft_vocab="auto", target_layers=None, *, device, dtype=None, backend="auto",
                       seed: int = 0, logit_std: float = RANDOM_LOGIT_STD):
    """A random-weight EAGLE-3 head shaped like one layer of ``target`` (systems studies: it costs
    what a trained head of its shape costs; acceptance must be replayed). Weights drawn on the
    device (normal, std 0.02; norms 1; lm_head std logit_std / sqrt(hidden), so the normed rows give
    draft logits of std ``logit_std``); the draft vocabulary is target ids 0 .. draft_vocab - 1."""
    import torch

    from ..models.eagle3 import Eagle3Config, Eagle3Head

    tc = target.config
    layers = None if target_layers is None else [int(i) for i in target_layers]
    if layers is not None and (len(layers) != 3 or not all(0 <= i < tc.num_hidden_layers for i in layers)):
        raise ConfigError(f"draft.target_layers={layers}: three layer indices in 0..{tc.num_hidden_layers - 1}")
    if layers is None:  # 2, L//2, L-3, kept inside a shallow (test-sized) target
        L = tc.num_hidden_layers
        layers = [min(2, L - 1), L // 2, max(L - 3, 0)]
    cfg = Eagle3Config.for_target(tc, random_draft_vocab(int(tc.vocab_size), draft_vocab), layers)
    with torch.device(device):  # parameters allocated where they are drawn: no host copy of 8B-shape weights
        head = Eagle3Head(cfg, backend=backend)
    gen = torch.Generator(device=device).manual_seed(int(seed))
    with torch.no_grad():
        for key in head.shapes:
            p = head.w(key)
            if key.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                std = logit_std / cfg.hidden_size ** 0.5 if key == "lm_head.weight" else 0.02
                p.normal_(0, std, generator=gen)
    head.set_vocab_(torch.arange(cfg.draft_vocab_size, device=device))
    return head.to_device(device, dtype, max_positions=tc.max_position_embeddings)
