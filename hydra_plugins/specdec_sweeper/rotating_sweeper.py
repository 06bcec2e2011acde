"""RotatingSweeper: Hydra's basic sweeper with the innermost swept key's run order rotated from one group of jobs
to the next (specdec/sweeper.py says why). Select it with
``hydra.sweeper._target_=hydra_plugins.specdec_sweeper.rotating_sweeper.RotatingSweeper``."""

from __future__ import annotations

from typing import List, Optional

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.types import Override

from specdec.sweeper import rotate_jobs


class RotatingSweeper(BasicSweeper):
    """Hydra's basic sweeper (the same jobs, ``params``, ``max_batch_size``) with the innermost swept key's
    values rotated from one group of jobs to the next (rotate_jobs)."""

    @staticmethod
    def split_arguments(overrides: List[Override], max_batch_size: Optional[int]) -> List[List[List[str]]]:
        jobs = rotate_jobs(BasicSweeper.split_arguments(overrides, None)[0])
        if max_batch_size is None:
            return [jobs]
        return list(BasicSweeper.split_overrides_to_chunks(jobs, max_batch_size))
