"""Tensor parallelism: process groups and rank launch (group.py), the sharded target (models/tp.py),
and the step plan that keeps every rank in lockstep (plan.py).

How a TP run works (``python -m specdec.run tp=tp2 ...``):

* ``launch.py`` starts ``tp.size`` processes (torch.multiprocessing spawn, or the ones ``torchrun``
  already started: detected from its environment variables), one device each, and joins a process
  group: NCCL on GPU, gloo on CPU, plus a gloo group for host-side objects (the plan).
* Every rank loads the target and keeps its shard (``specdec.models.tp.TPLlamaModel``): column-parallel
  q/k/v and gate|up, row-parallel o and down (one all-reduce after each), vocab-parallel embedding and
  LM head, its own share of the KV heads in its own paged KV pool.
* Rank 0 runs the workload clients, the scheduler's decisions and the policy; before every engine
  iteration it broadcasts the plan (new requests, aborts, k, and a fingerprint of its batch). Every
  other rank applies the same inputs to its own copy of the scheduler, which is deterministic, so all
  ranks build the same batch, page tables and bucket and replay the same CUDA graph. A fingerprint
  mismatch raises :class:`TPDesyncError` instead of hanging in a collective.
"""

from .group import TPGroup, current, set_current_
from .plan import TPDesyncError

__all__ = ["TPGroup", "TPDesyncError", "current", "set_current_"]
