"""specdec's Hydra sweeper (specdec/sweeper.py)."""
