"""``python -m specdec.run tp=tpN ...``: the ranks of a tensor-parallel run.

``run_tp(cfg)`` starts ``tp.size`` ranks (launch.py). Rank 0 runs the ordinary ``specdec.run.run``
(clients, logging, run directory) with three hooks that are identities without tensor parallelism:
``shard_for_run`` (the target becomes this rank's TPLlamaModel), and in ``build_engine``
``announce_engine_`` + ``wrap_policy`` + ``agree_engine_config`` + ``wrap_engine`` (the plan of
plan.py). The other ranks build the same target shard and then follow rank 0's plans: one engine
per ``("engine", cfg)`` op (``compare_plain`` serves twice), until ``("exit",)``.
"""

from __future__ import annotations

import dataclasses

from omegaconf import DictConfig, OmegaConf

from ..errors import ConfigError
from . import plan as plan_mod
from .group import TPGroup, current


def tp_settings(cfg: DictConfig) -> tuple[int, str]:
    """(tp.size, tp.allreduce) checked: size an integer >= 1, allreduce nccl | fused."""
    from ..engine.engine import config_number
    from ..models.tp import ALLREDUCE

    tp = cfg.get("tp") or {}  # configs without a tp group (training) run on one device
    size = config_number("tp.size", tp.get("size", 1), int, 1)
    allreduce = str(tp.get("allreduce", "nccl"))
    if allreduce not in ALLREDUCE:
        raise ConfigError(f"tp.allreduce={allreduce!r}; valid: {', '.join(ALLREDUCE)} (nccl = the backend's "
                          "all-reduce: NCCL on GPU, gloo on CPU)")
    return size, allreduce


def shard_for_run(model, cfg: DictConfig):
    """This rank's shard of ``model`` under tensor parallelism; at tp.size 1 the model itself, or with
    tp.allreduce=fused its world-size-1 TPLlamaModel (the fused kernel's no-communication path)."""
    from ..models.tp import TPLlamaModel, check_tp_shapes

    size, allreduce = tp_settings(cfg)
    group = current()
    if group is None:
        if size > 1:
            raise ConfigError(f"tp.size={size}: the target is sharded inside the ranks run_tp starts")
        if allreduce == "nccl":
            return model  # one device: today's model, untouched
        group = TPGroup(rank=0, size=1, device=model.device)
    check_tp_shapes(model.config, group.size)
    return TPLlamaModel(model, group, allreduce=allreduce)


def announce_engine_(cfg: DictConfig) -> None:
    """Rank 0: tell the other ranks to build the engine for ``cfg`` now (they build it in lockstep:
    its start-up runs collectives)."""
    group = current()
    if group is not None and group.is_leader:
        group.broadcast_object(([], ("engine", OmegaConf.to_container(cfg, resolve=True)), None))


def wrap_policy(policy):
    group = current()
    return policy if group is None or policy is None else plan_mod.TPPolicy(policy, group)


def agree_engine_config(ecfg, model):
    """Every rank's KV pool the same size (the schedulers must see the same pages): the pool each
    rank can afford for its own KV heads, the smallest over ranks."""
    group = current()
    if group is None or ecfg.kv_cache_tokens is not None:
        return ecfg
    import torch

    if model.device.type == "cuda":
        from ..engine.kv_cache import available_device_bytes

        free = available_device_bytes(model.device)  # the allocator's cached blocks count as free
        tokens = int(free * float(ecfg.kv_memory_fraction)) // model.kv_bytes_per_token()
    else:
        tokens = 8192  # kv_cache.size_pool's CPU default
    return dataclasses.replace(ecfg, kv_cache_tokens=group.all_reduce_min_int(tokens))


def wrap_engine(engine):
    group = current()
    if group is None:
        return engine
    agree_prefill_timings_(engine, group)
    return plan_mod.LeaderEngine(engine, group) if group.is_leader else engine


def agree_prefill_timings_(engine, group) -> None:
    """Rank 0's prefill bucket timings on every rank: the scheduler's prefill fit plans from them
    (PaddedPrefill.fit_tokens), and every rank must plan the same forwards."""
    st = engine.stepper
    runners = (st.prefill_runner, st.plain_prefill_runner)
    times = group.broadcast_object([None if r is None else dict(r.forward_ms) for r in runners])
    for runner, t in zip(runners, times):
        if runner is not None and t is not None:
            runner.forward_ms = t


def _rank_main(group: TPGroup, container: dict):
    from .. import run as run_mod

    cfg = OmegaConf.create(container)
    if group.is_leader:
        try:
            return run_mod.run(cfg)
        finally:
            group.broadcast_object(([], ("exit",), None))
    import torch

    run_mod.apply_kernel_options(cfg)
    torch.manual_seed(int(cfg.seed))
    model, tokenizer = run_mod.build_target(cfg, run_mod.resolve_device(cfg.device))
    engine = None
    while True:
        op = plan_mod.follow(engine, group)
        if op[0] == "exit":
            return None
        engine = None  # the previous one's KV pool and graphs go before the next is built
        engine = run_mod.build_engine(model, tokenizer, OmegaConf.create(op[1]))


def check_target_shapes(cfg: DictConfig, size: int) -> None:
    from ..models.families import ModelConfig
    from ..models.tp import check_tp_shapes

    if cfg.target.get("random_weights"):
        from ..bench.targets import llama_config_from_dict

        config = llama_config_from_dict(OmegaConf.to_container(cfg.target.config, resolve=True))
    else:
        path = cfg.target.get("path")
        if path is None:
            from ..assets import smollm2_dir

            path = smollm2_dir()
        config = ModelConfig.from_dir(path)
    check_tp_shapes(config, size, what=f"target {cfg.target.name}")


def run_tp(cfg: DictConfig) -> dict:
    """Start the ranks of a tp.size > 1 run; returns rank 0's metrics."""
    from ..run import resolve_device
    from .launch import launch

    size, _ = tp_settings(cfg)
    device = resolve_device(cfg.device)
    check_target_shapes(cfg, size)  # before any rank starts: the error names the target's heads
    container = OmegaConf.to_container(cfg, resolve=True)  # hydra's resolvers exist only here
    return launch(_rank_main, size, device, container)
