"""specdec: speculative decoding research framework (see README.md)."""

from pathlib import Path

# The repository checkout this package runs from (committed checkpoints live under it).
REPO_ROOT = Path(__file__).resolve().parents[1]


def _register_resolvers() -> None:
    """``${specdec.repo:REL}``: REL under the repository root, so configs that name committed files
    (draft=eagle3_smollm2) work from any working directory. ``${specdec.or:A,B}``: A unless it is null,
    else B (e.g. graphs only up to the swept concurrency, all of them without one).
    ``${specdec.at_least:X,T,A,B}``: A when the number X is >= T, else B (X null: B), e.g. a longer timed
    closed loop at high concurrency only."""
    try:
        from omegaconf import OmegaConf
    except ImportError:  # benchmarks may run without Hydra
        return
    if not OmegaConf.has_resolver("specdec.repo"):
        OmegaConf.register_new_resolver("specdec.repo", lambda rel: str(REPO_ROOT / str(rel)))
    if not OmegaConf.has_resolver("specdec.or"):
        OmegaConf.register_new_resolver("specdec.or", lambda a, b: b if a is None else a)
    if not OmegaConf.has_resolver("specdec.at_least"):
        OmegaConf.register_new_resolver("specdec.at_least", _at_least)


def _at_least(x, threshold, then, otherwise):
    """``${specdec.at_least:X,T,A,B}``: A when X >= T, else B; X null: B."""
    if x is None:
        return otherwise
    try:
        return then if float(x) >= float(threshold) else otherwise
    except (TypeError, ValueError):
        raise ValueError(f"specdec.at_least: {x!r} and {threshold!r} must be numbers") from None


_register_resolvers()
