"""Start the ranks of a tensor-parallel run and join their process group.

``launch(fn, size, device, *args)`` runs ``fn(group, *args)`` on ``size`` ranks and returns rank 0's
result. Two ways in:

* plain ``python -m specdec.run tp=tp2 ...``: spawns ``size`` processes (torch.multiprocessing,
  start method spawn: CUDA cannot be forked) on a free local port;
* under ``torchrun --nproc-per-node N``: the ranks exist already (RANK, WORLD_SIZE, LOCAL_RANK,
  MASTER_ADDR/PORT in the environment); each joins the group and runs ``fn`` itself. Only rank 0's
  process returns ``fn``'s result; the others return None.

A user error (:class:`~specdec.errors.SpecdecError`) raised on any rank comes back to the caller as
the same type and message (the CLI prints it and exits 2); the other ranks are torn down.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import ConfigError, SpecdecError
from .group import TPGroup, set_current_

# A rank blocked in a collective because a peer died gives up after this long (gloo / NCCL timeout).
TIMEOUT = timedelta(minutes=10)


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def check_launch(size: int, device: str) -> str:
    """The device backend for ``size`` ranks on ``device`` ("cpu" / "cuda"), or a ConfigError naming
    what is missing: more ranks than GPUs, no NCCL / gloo in this torch build."""
    if size < 1:
        raise ConfigError(f"tp.size={size}: must be an integer >= 1")
    if not dist.is_available():
        raise ConfigError(f"tp.size={size} needs torch.distributed, which this torch build lacks")
    if device.startswith("cuda"):
        n = torch.cuda.device_count()
        if size > n:
            raise ConfigError(f"tp.size={size} needs {size} GPUs (one per rank); {n} visible "
                              f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                              f"valid: tp.size <= {n}, or device=cpu")
        if not dist.is_nccl_available():
            raise ConfigError("tensor parallelism on GPU needs the NCCL backend, missing from this torch "
                              "build; use device=cpu (gloo) or a CUDA build of torch with NCCL")
        if not dist.is_gloo_available():
            raise ConfigError("tensor parallelism needs the gloo backend for host-side messages, missing "
                              "from this torch build")
        return "nccl"
    if not dist.is_gloo_available():
        raise ConfigError("tensor parallelism on CPU needs the gloo backend, missing from this torch build")
    return "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, size: int, local_rank: int, device: str, backend: str) -> TPGroup:
    """Join the default process group (env:// rendezvous) and build this rank's TPGroup."""
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        dist.init_process_group(backend, rank=rank, world_size=size, timeout=TIMEOUT, device_id=dev)
        cpu_group = dist.new_group(backend="gloo", timeout=TIMEOUT)
        # One eager collective now: NCCL sets up its channels on first use, which must not happen
        # inside a CUDA graph capture (the engine captures its steps at start-up).
        dist.all_reduce(torch.zeros(1, device=dev))
        torch.cuda.synchronize(dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group(backend, rank=rank, world_size=size, timeout=TIMEOUT)
        cpu_group = dist.group.WORLD
    group = TPGroup(rank=rank, size=size, device=dev, group=dist.group.WORLD, cpu_group=cpu_group)
    set_current_(group)
    return group


def _entry(rank, size, device, backend, port, out_dir, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(size), LOCAL_RANK=str(rank))
    # Each rank gets an equal share of the host's cores (2 ranks on 16 cores: 8 each), instead of
    # every rank starting a thread per core and all of them contending.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    result: tuple = ("ok", None)
    try:
        group = init_group(rank, size, rank, device, backend)
        result = ("ok", fn(group, *args))
    except SpecdecError as e:
        result = ("user", (type(e), str(e)))
    except BaseException:
        result = ("bug", traceback.format_exc())
    try:
        payload = pickle.dumps(result)
    except Exception:  # an unpicklable result: keep the fact that it finished
        payload = pickle.dumps(("ok", None))
    Path(out_dir, f"rank{rank}.pkl").write_bytes(payload)
    if result[0] != "ok":
        # Peers blocked in a collective with this rank see its sockets close and fail too; exit
        # without waiting for them in destroy_process_group.
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()
    set_current_(None)


def launch(fn, size: int, device: str, *args):
    """Run ``fn(group, *args)`` on ``size`` ranks; returns rank 0's result (see the module docstring)."""
    backend = check_launch(size, device)
    if under_torchrun():
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if world != size:
            raise ConfigError(f"tp.size={size} but torchrun started {world} processes; run "
                              f"torchrun --nproc-per-node {size}, or set tp.size={world}")
        group = init_group(rank, size, int(os.environ.get("LOCAL_RANK", rank)), device, backend)
        try:
            result = fn(group, *args)
        finally:
            dist.destroy_process_group()
            set_current_(None)
        return result if rank == 0 else None
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="specdec-tp-") as out_dir:
        port = _free_port()
        failure = None
        try:
            mp.start_processes(_entry, args=(size, device, backend, port, out_dir, fn, args), nprocs=size,
                               join=True, start_method="spawn")
        except Exception as e:  # a rank exited non-zero: its own record says why
            failure = e
        results = {}
        for r in range(size):
            p = Path(out_dir, f"rank{r}.pkl")
            if p.exists():
                results[r] = pickle.loads(p.read_bytes())
    for r in sorted(results):  # the first user error wins (the others are its echo in collectives)
        if results[r][0] == "user":
            kind, msg = results[r][1]
            raise kind(msg)
    for r in sorted(results):
        if results[r][0] == "bug":
            raise RuntimeError(f"tensor-parallel rank {r} failed:\n{results[r][1]}")
    if failure is not None or 0 not in results:
        raise RuntimeError(f"tensor-parallel ranks failed: {failure}")
    return results[0][1]
