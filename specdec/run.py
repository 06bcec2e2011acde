"""Entry point: ``python -m specdec.run +experiment=NAME [overrides]``.

Reads top to bottom: compose the config, build target + tokenizer + workload, generate every
request, write ``metrics.json`` and ``requests.jsonl`` into the run directory, mirror them to the
logger, print a short table, return the headline metric.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from .bench.workloads import load_prompts
from .errors import ConfigError, SpecdecError
from .loggers import make_logger


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {name!r}; valid: auto, cpu, cuda")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is visible; use device=cpu or device=auto")
    return name


def build_target(cfg: DictConfig, device: str):
    from .assets import smollm2_dir
    from .models.llama import load_target
    from .models.tokenizer import Tokenizer

    path = cfg.target.path
    if path is None:
        if cfg.target.name != "smollm2-135m-instruct":
            raise ConfigError(f"target {cfg.target.name!r} needs target.path=DIR")
        path = smollm2_dir()
    model = load_target(path, device=device, dtype=cfg.engine.dtype, backend=cfg.engine.kernels)
    return model, Tokenizer(path)


def generate_all(model, tokenizer, prompts, cfg, progress_cb=None) -> list[dict]:
    """Generate every prompt; a request that cannot run is reported, never fatal to the others."""
    from .engine.reference import generate_reference

    max_new = int(cfg.engine.max_new_tokens)
    eos = set(model.config.eos_token_id)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    gen = torch.Generator(device=model.device).manual_seed(int(cfg.seed))
    budget = model.config.max_position_embeddings
    records = []
    for p in prompts:
        rec = {"id": p.id, "prompt": p.text, "prompt_tokens": len(p.prompt_ids)}
        if len(p.prompt_ids) + max_new > budget:
            rec.update(error=f"prompt of {len(p.prompt_ids)} tokens + max_new_tokens {max_new} "
                             f"exceeds the KV budget of {budget} positions", output_ids=[], output="")
        else:
            t0 = time.perf_counter()
            g = generate_reference(model, p.prompt_ids, max_new, eos_ids=eos,
                                   temperature=float(cfg.sampling.temperature), generator=gen,
                                   page_size=int(cfg.engine.page_size))
            latency = time.perf_counter() - t0
            n = len(g.token_ids)
            rec.update(output=tokenizer.decode(g.token_ids), output_ids=g.token_ids,
                       output_tokens=n, finish_reason=g.finish_reason, ttft_s=g.ttft_s,
                       latency_s=latency,
                       tpot_s=(latency - g.ttft_s) / (n - 1) if n > 1 else None)
        records.append(rec)
        if progress_cb:
            progress_cb(rec)
    return records


def summarize(records: list[dict], wall_s: float) -> dict:
    ok = [r for r in records if "error" not in r]
    out_tokens = sum(r["output_tokens"] for r in ok)
    tpots = [r["tpot_s"] for r in ok if r.get("tpot_s") is not None]
    return {
        "requests": len(records),
        "failed_requests": len(records) - len(ok),
        "output_tokens": out_tokens,
        "wall_s": wall_s,
        "output_tok_per_s": out_tokens / wall_s if wall_s > 0 else 0.0,
        "mean_ttft_s": sum(r["ttft_s"] for r in ok) / len(ok) if ok else None,
        "mean_tpot_s": sum(tpots) / len(tpots) if tpots else None,
    }


def print_table(records: list[dict], metrics: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="specdec run", show_lines=False)
    for col in ("id", "prompt tok", "out tok", "TTFT ms", "TPOT ms", "output"):
        table.add_column(col, overflow="fold" if col == "output" else "ellipsis")
    for r in records:
        if "error" in r:
            table.add_row(r["id"], str(r["prompt_tokens"]), "-", "-", "-", f"[red]error: {r['error']}")
            continue
        tpot = f"{r['tpot_s'] * 1e3:.1f}" if r.get("tpot_s") else "-"
        text = r["output"].replace("\n", " ")
        table.add_row(r["id"], str(r["prompt_tokens"]), str(r["output_tokens"]),
                      f"{r['ttft_s'] * 1e3:.0f}", tpot, text[:80] + ("..." if len(text) > 80 else ""))
    console = Console()
    console.print(table)
    console.print(f"{metrics['output_tokens']} tokens in {metrics['wall_s']:.1f} s "
                  f"({metrics['output_tok_per_s']:.1f} tok/s), {metrics['failed_requests']} failed")


def run(cfg: DictConfig) -> dict:
    from rich.progress import Progress

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(int(cfg.seed))
    device = resolve_device(cfg.device)
    if int(cfg.tp.size) != 1:
        raise ConfigError(f"tp.size={cfg.tp.size}: this build runs on one device only (tp=tp1)")
    if cfg.draft.name != "none" or cfg.policy.name != "never":
        raise ConfigError(f"draft={cfg.draft.name} policy={cfg.policy.name}: speculative decoding is "
                         "not available in this build; use draft=none policy=never")

    resolved = OmegaConf.to_container(cfg, resolve=True)
    (run_dir / "config.json").write_text(json.dumps(resolved, indent=2))
    model, tokenizer = build_target(cfg, device)
    prompts = load_prompts(cfg.workload, tokenizer)
    logger = make_logger(cfg.logger, run_dir, run_dir.name, resolved)
    try:
        t0 = time.perf_counter()
        with Progress(transient=True) as progress:
            task = progress.add_task(f"generating ({device})", total=len(prompts))
            records = generate_all(model, tokenizer, prompts, cfg,
                                   lambda rec: progress.advance(task))
        metrics = summarize(records, time.perf_counter() - t0)
        metrics.update(target=cfg.target.name, device=device, dtype=str(model.dtype),
                       workload=cfg.workload.name)
        with open(run_dir / "requests.jsonl", "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
        logger.log_metrics({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
        logger.log_table("requests", ["id", "output_tokens", "output"],
                         [[r["id"], r.get("output_tokens", 0), r.get("output", "")] for r in records])
    finally:
        logger.finish()
    print_table(records, metrics)
    print(f"run directory: {run_dir}")
    return metrics


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    try:
        metrics = run(cfg)
    except (SpecdecError, MissingMandatoryValue) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    return metrics["output_tok_per_s"]


if __name__ == "__main__":
    main()
