"""specdec: speculative decoding research framework (see README.md)."""

from pathlib import Path

# The repository checkout this package runs from (committed checkpoints live under it).
REPO_ROOT = Path(__file__).resolve().parents[1]


def _register_resolvers() -> None:
    """``${specdec.repo:REL}``: REL under the repository root, so configs that name committed files
    (draft=eagle3_smollm2) work from any working directory. ``${specdec.or:A,B}``: A unless it is null,
    else B (e.g. graphs only up to the swept concurrency, all of them without one)."""
    try:
        from omegaconf import OmegaConf
    except ImportError:  # benchmarks may run without Hydra
        return
    if not OmegaConf.has_resolver("specdec.repo"):
        OmegaConf.register_new_resolver("specdec.repo", lambda rel: str(REPO_ROOT / str(rel)))
    if not OmegaConf.has_resolver("specdec.or"):
        OmegaConf.register_new_resolver("specdec.or", lambda a, b: b if a is None else a)


_register_resolvers()
