"""A Hydra sweeper that counterbalances the run order of a sweep's innermost key.

Hydra's basic sweeper runs the cartesian product with the last key varying fastest, in the same order in every
group: ``seed=0,1,2 policy=never,always,goodput`` runs never, always, goodput for seed 0, then the same three for
seed 1, ... so a policy listed third is always measured third. In n-gram sweeps at C = 64 .. 256 (21 groups of one
seed and C, never / always / goodput / a goodput variant in that order) the runs in third and fourth place took 7% and
15% more wall time per prefilled token than the second: an effect of the place or of the policy, which a fixed order
cannot tell apart (docs/results.md, "Speculation under load").
``RotatingSweeper`` runs the same jobs, but rotates the innermost swept key's values by one place from each group
to the next (group g starts at value g mod n), so over n consecutive groups every value runs once in every place.

The sweeper itself is ``hydra_plugins.specdec_sweeper.rotating_sweeper.RotatingSweeper`` (Hydra loads plugins from
the hydra_plugins package only); select it with ``hydra.sweeper._target_=`` that path, as the policy studies'
experiment configs do.
"""

from __future__ import annotations

from typing import List


def rotate_jobs(jobs: List[List[str]]) -> List[List[str]]:
    """Jobs as the basic sweeper orders them (lists of ``key=value``, keys in one order), with each group of
    consecutive jobs that differ only in the innermost swept key rotated by its group index."""
    if len(jobs) < 2:
        return jobs
    width = len(jobs[0])
    swept = [i for i in range(width) if len({job[i] for job in jobs}) > 1]
    if not swept:
        return jobs
    inner = swept[-1]
    n = len(dict.fromkeys(job[inner] for job in jobs))
    out = []
    for g in range(0, len(jobs), n):
        group = jobs[g:g + n]
        r = (g // n) % n
        out += group[r:] + group[:r]
    return out
