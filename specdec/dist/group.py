"""A tensor-parallel process group and the few collectives the sharded model and the plan use.

One :class:`TPGroup` per process: ``rank`` / ``size``, the device group (NCCL on GPU, gloo on CPU)
for tensors and a gloo group for host objects (the step plan: pickled Python objects never go
through NCCL, which would stage them on the GPU and synchronise). ``current()`` is the group of
this process (None without tensor parallelism), set once by ``launch.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class TPGroup:
    rank: int
    size: int
    device: torch.device
    group: object = None  # device process group (None: world size 1, no communication)
    cpu_group: object = None  # gloo group for host objects (the plan)
    _gather_bufs: dict = field(default_factory=dict, repr=False)

    @property
    def backend(self) -> str:
        return "none" if self.group is None else dist.get_backend(self.group)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over ranks in place (returns x); a no-op at world size 1. Capturable under NCCL."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_cols(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C] on every rank -> [N, size * C], rank r's columns at r*C .. (r+1)*C - 1 (vocab-parallel
        logits -> full logits). NCCL gathers into one [size, N, C] tensor (one capturable launch)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if x.is_cuda:
            out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)  # [W, N, C]
            dist.all_gather_into_tensor(out, x, group=self.group)
            parts = out.unbind(0)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)  # [N, W*C]

    def broadcast_object(self, obj=None):
        """Rank 0's ``obj`` on every rank (host objects over the gloo group)."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def all_reduce_min_int(self, v: int) -> int:
        if self.size == 1:
            return int(v)
        t = torch.tensor([int(v)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


_CURRENT: TPGroup | None = None


def current() -> TPGroup | None:
    """This process's tensor-parallel group, or None (one device, no tensor parallelism)."""
    return _CURRENT


def set_current_(group: TPGroup | None) -> None:
    global _CURRENT
    _CURRENT = group
