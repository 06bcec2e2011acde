"""specdec: speculative decoding research framework (see README.md)."""

from pathlib import Path

# The repository checkout this package runs from (committed checkpoints live under it).
REPO_ROOT = Path(__file__).resolve().parents[1]


def _register_resolvers() -> None:
    """``${specdec.repo:REL}``: REL under the repository root, so configs that name committed files
    (draft=eagle3_smollm2) work from any working directory."""
    try:
        from omegaconf import OmegaConf
    except ImportError:  # benchmarks may run without Hydra
        return
    if not OmegaConf.has_resolver("specdec.repo"):
        OmegaConf.register_new_resolver("specdec.repo", lambda rel: str(REPO_ROOT / str(rel)))


_register_resolvers()
