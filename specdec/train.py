"""Entry point: ``python -m specdec.train +experiment=train_eagle3_smollm2 [overrides]``.

Trains an EAGLE-3 draft head for the configured target on the target's own answers. Reads top to
bottom:

1. prompts: Python standard-library coding tasks + self-instruct tasks written by the target (+ the
   seed tasks), decontaminated against HumanEval and MT-bench and then asserted clean;
2. answers: the target answers every prompt through the serving engine (``train.data``);
3. draft vocabulary: the most frequent answer tokens (special tokens always included);
4. features: one target forward per chunk keeps the three captured layers, the final hidden state
   (teacher) and the argmax per token; a held-out split is set aside by sequence;
5. training: the EAGLE-3 training-time-test loss (specdec.training.ttt), AdamW, warmup + cosine
   decay, gradient clipping, bf16 autocast on the GPU, held-out acceptance per draft position;
6. outputs in the run directory: ``checkpoint/`` (official layout, bf16, one model.safetensors unless
   over ``train.shard_mb`` MiB (default 5 GB), README.md model card), ``metrics.json``, ``sequences.jsonl`` (reusable with
   ``train.data.reuse=PATH``), ``config.json``, the W&B run; optionally a copy of the checkpoint in
   ``train.output_dir``. ``train.data.only=true`` stops after step 2 (data for several later runs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import re
import sys
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from .bench.provenance import git_commit, provenance
from .errors import ConfigError, SpecdecError
from .models.loading import SHARD_BYTES
from .loggers import make_logger
from .run import apply_kernel_options, build_target, resolve_device
from .training.data import (FeatureStore, Sequence, capture, draft_vocab, gather_batch, generate,
                            length_batches, load_sequences, save_sequences)
from .training.prompts import (EvalIndex, TrainingDataError, TrainPrompt, assert_no_overlap,
                               decontaminate, load_eval_texts, seed_set, self_instruct, stdlib_prompts)
from .training.ttt import ttt_unroll


def log(msg: str) -> None:
    print(f"[train] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# 1-2. Prompts and answers
# ----------------------------------------------------------------------------------------------

def build_prompts(dc, index: EvalIndex, write_tasks, seed: int) -> tuple[list[TrainPrompt], dict]:
    """Standard-library prompts + seed tasks + self-instruct tasks, with overlaps dropped.

    ``write_tasks(messages) -> replies`` runs the target (self-instruct)."""
    stdlib = stdlib_prompts(int(dc.stdlib_per_item), seed=seed,
                            max_prompts=None if dc.stdlib_max_prompts is None else int(dc.stdlib_max_prompts))
    seed_tasks = seed_set(dc.get("seed_set", "default"))
    seeds = [TrainPrompt(f"seed/{i}", t, "seed") for i, t in enumerate(seed_tasks)] if dc.seed_tasks else []
    tasks, t0 = [], time.perf_counter()
    if int(dc.self_instruct_requests) > 0:
        tasks = self_instruct(write_tasks, num_requests=int(dc.self_instruct_requests),
                              rounds=int(dc.self_instruct_rounds),
                              examples_per_request=int(dc.self_instruct_examples), seed=seed, seeds=seed_tasks)
    written = [TrainPrompt(f"self_instruct/{i}", t, "self_instruct") for i, t in enumerate(tasks)]
    prefix = str(dc.get("id_prefix") or "")  # keeps ids unique when several directories train together
    everything = [dataclasses.replace(p, id=prefix + p.id) for p in stdlib + seeds + written]
    kept, dropped = decontaminate(everything, index)
    assert_no_overlap(kept, index)  # the guarantee the eval numbers rest on: checked, not assumed
    stats = dict(stdlib_prompts=len(stdlib), seed_prompts=len(seeds), seed_set=str(dc.get("seed_set", "default")),
                 self_instruct_requests=int(dc.self_instruct_requests), self_instruct_tasks=len(written),
                 self_instruct_s=round(time.perf_counter() - t0, 1),
                 dropped_overlap=len(dropped), prompts=len(kept))
    if dropped:
        log(f"dropped {len(dropped)} prompts overlapping the eval sets, e.g. {dropped[:3]}")
    return kept, stats


def special_ids(target_dir: Path | None, tokenizer, model) -> list[int]:
    """Ids the draft vocabulary always holds: EOS ids and the tokenizer's special tokens."""
    ids = set(int(e) for e in model.config.eos_token_id)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    tj = target_dir / "tokenizer.json" if target_dir is not None else None
    if tj is not None and tj.is_file():
        for tok in json.loads(tj.read_text()).get("added_tokens", []):
            if tok.get("special"):
                ids.add(int(tok["id"]))
    return sorted(ids)


# ----------------------------------------------------------------------------------------------
# 5. Training
# ----------------------------------------------------------------------------------------------

def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


class StepSums:
    """Per-draft-position sums over batches: loss x rows, rows, top-1 hits, chain hits."""

    def __init__(self, steps: int, device):
        self.loss = torch.zeros(steps, device=device)
        self.rows = torch.zeros(steps, dtype=torch.long, device=device)
        self.correct = torch.zeros(steps, dtype=torch.long, device=device)
        self.chain = torch.zeros(steps, dtype=torch.long, device=device)

    def add_(self, out) -> None:
        self.loss += out.step_loss.detach() * out.rows
        self.rows += out.rows
        self.correct += out.correct
        self.chain += out.chain_correct

    def summary(self, prefix: str) -> dict:
        rows = self.rows.clamp(min=1).double().cpu()
        loss = (self.loss.double().cpu() / rows).tolist()
        acc = (self.correct.double().cpu() / rows).tolist()
        chain = (self.chain.double().cpu() / rows).tolist()
        out = {}
        for i in range(len(loss)):  # draft position i + 1 = the (i+1)-th drafted token
            out[f"{prefix}/loss_{i + 1}"] = loss[i]
            out[f"{prefix}/acc_{i + 1}"] = acc[i]
            out[f"{prefix}/chain_acc_{i + 1}"] = chain[i]
        # Expected tokens per verify step of a chain as long as the unroll: accepted drafts + bonus.
        out[f"{prefix}/chain_accept_len_est"] = 1.0 + sum(chain)
        return out


class Trainer:
    """The head, the frozen target tensors it reads (embedding, teacher rows) and the optimizer."""

    def __init__(self, head, model, tc, device: str):
        self.head, self.tc, self.device = head, tc, device
        self.steps = int(tc.ttt_steps)
        self.decay = float(tc.step_decay)
        self.compile = bool(tc.get("compile", False))
        self.embed = model.embed.detach()  # [V, H] frozen target embedding
        out_w = (model.embed if model.lm_head is None else model.lm_head).detach()
        draft_ids = head.to_target_ids(torch.arange(head.config.draft_vocab_size, device=head.device))
        self.vocab_weight = out_w[draft_ids.to(out_w.device)]  # [Vd, H] teacher rows, draft id order
        self.params = [p for p in head.parameters() if p.requires_grad]
        cuda = device == "cuda"
        self.opt = torch.optim.AdamW(self.params, lr=float(tc.lr), betas=tuple(float(b) for b in tc.betas),
                                     weight_decay=float(tc.weight_decay), **({"fused": True} if cuda else {}))
        # bf16 autocast on the GPU (fp32 master weights); plain fp32 on the CPU.
        self.autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext

    def forward(self, batch, compile: bool | None = None):
        with self.autocast():
            return ttt_unroll(self.head, self.embed, self.vocab_weight, batch.tokens, batch.features,
                              batch.teacher_hidden, batch.argmax, batch.lengths, batch.prompt_lens,
                              steps=self.steps, decay=self.decay,
                              compile=self.compile if compile is None else compile)

    def train_step(self, batch, lr: float):
        """One AdamW step at ``lr``; returns (TTTOut, gradient norm before clipping)."""
        for g in self.opt.param_groups:
            g["lr"] = lr
        out = self.forward(batch)
        self.opt.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, float(self.tc.grad_clip))
        self.opt.step()
        return out, float(grad_norm)

    @torch.no_grad()
    def evaluate(self, store: FeatureStore, batches, prefix: str = "eval") -> dict:
        sums = StepSums(self.steps, self.device)
        for b in batches:
            sums.add_(self.forward(gather_batch(store, b, self.device), compile=False))  # no second compile
        return sums.summary(prefix)


def load_init_head(path, target_config, device: str):
    """The head a warm start begins from (``train.init_from``: a checkpoint directory in the official
    layout, e.g. the committed head), in fp32 on ``device``; None when unset. Its captured layers and
    draft vocabulary are kept (training continues the same head), so ``train.draft_vocab_size`` and
    ``train.target_layers`` do not apply to it."""
    if not path:
        return None
    from .models.eagle3 import Eagle3Head

    p = Path(str(path)).expanduser()
    if not p.is_dir():
        raise ConfigError(f"train.init_from={path}: not a directory (a draft checkpoint: config.json + weights)")
    head = Eagle3Head.load(p, device=device, dtype=torch.float32, backend="torch", target=target_config)
    log(f"warm start from {p}: layers {list(head.config.target_layers)}, "
        f"draft vocabulary {head.config.draft_vocab_size}")
    return head


def init_from_target_(head, model) -> None:
    """Start lm_head as the target's output rows of the draft vocabulary and norm as the target's
    final norm (``train.init_from_target``). Off in the shipped experiment: with a random fc the
    target's sharp head makes confident wrong guesses (loss ~23 at step 0 vs ~7 from random init)
    and it stayed behind random init in a short CPU comparison."""
    with torch.no_grad():
        out_w = model.embed if model.lm_head is None else model.lm_head
        ids = head.to_target_ids(torch.arange(head.config.draft_vocab_size, device=head.device))
        head.w("lm_head.weight").copy_(out_w[ids.to(out_w.device)].to(head.device, torch.float32))
        head.w("norm.weight").copy_(model.norm.to(head.device, torch.float32))


def revocab_(head, vocab_ids: torch.Tensor, model) -> dict:
    """Give a warm-started head a new draft vocabulary (``train.revocab``): the target ids
    ``vocab_ids`` (as many as the head has). lm_head rows of ids in both vocabularies carry over; an id
    new to it starts as the target's output row, scaled so the rows' mean norm over the shared ids
    matches the head's (the head's final norm scales its hidden state differently from the
    target's). The other weights stay. Returns {"kept", "new"} counts."""
    n = head.config.draft_vocab_size
    new_ids = torch.as_tensor(vocab_ids, dtype=torch.long).cpu().sort().values
    if new_ids.numel() != n or new_ids.unique().numel() != n:
        raise ValueError(f"revocab: {new_ids.numel()} ids given; {n} distinct target ids needed "
                         "(the head's draft vocabulary)")
    old_ids = head.draft_to_target_table().long().cpu()
    where = torch.full((int(max(old_ids.max(), new_ids.max())) + 1,), -1, dtype=torch.long)
    where[old_ids] = torch.arange(n)
    old_pos = where[new_ids]  # the old draft id of each new id, -1 where it is new
    kept = old_pos >= 0
    out_w = model.embed if model.lm_head is None else model.lm_head
    with torch.no_grad():
        w = head.w("lm_head.weight")
        tgt = out_w[new_ids.to(out_w.device)].to(w.device, torch.float32)
        rows = torch.empty_like(w)
        k = kept.to(w.device)
        rows[k] = w[old_pos[kept].to(w.device)]
        if bool(kept.any()):
            scale = w[old_pos[kept].to(w.device)].norm(dim=1).mean() / tgt[k].norm(dim=1).mean().clamp(min=1e-12)
        else:
            scale = torch.tensor(1.0, device=w.device)
        rows[~k] = tgt[~k] * scale
        w.copy_(rows)
    head.set_vocab_(new_ids)
    return {"kept": int(kept.sum()), "new": int((~kept).sum())}


# ----------------------------------------------------------------------------------------------
# 6. Checkpoint
# ----------------------------------------------------------------------------------------------

def save_checkpoint(head, path: Path, card: str, *, dtype: str = "bfloat16", shard_mb: float | None = None) -> list[str]:
    """The official layout (Eagle3Head.save): config.json (no null fields, ``target_hidden_size``
    only when it differs from hidden_size), weights cast to ``dtype`` in one ``model.safetensors``
    (what the official EAGLE loader reads), README.md. Sharded into files of at most ``shard_mb`` MiB
    with an HF index only when given and smaller than the weights (default: only above
    loading.SHARD_BYTES, 5 GB). Returns the weight file names."""
    limit = SHARD_BYTES if not shard_mb else int(float(shard_mb) * 2**20)
    return head.save(path, {"README.md": card}, dtype=getattr(torch, dtype), shard_bytes=limit)


def rewrite_checkpoint(path: str | Path, *, shard_mb: float | None = None) -> list[str]:
    """Rewrite a head directory in place into the layout :func:`save_checkpoint` writes (same
    tensors, same dtype): e.g. shards fetched from a machine that returns files only up to 16 MiB
    (``train.shard_mb=15`` there) joined into one model.safetensors, and a config without null
    fields. Other files (README.md) are kept. Returns the weight file names."""
    from .models.eagle3 import Eagle3Config
    from .models.loading import load_safetensors, write_safetensors

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    sd = load_safetensors(path)
    Eagle3Config.from_hf(cfg, str(path / "config.json"), keys=sd.keys())  # refuse what is not a head
    cfg = {k: v for k, v in cfg.items() if v is not None}
    if cfg.get("target_hidden_size") == cfg.get("hidden_size"):
        cfg.pop("target_hidden_size", None)
    names = write_safetensors(path, sd, SHARD_BYTES if not shard_mb else int(float(shard_mb) * 2**20))
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    card = path / "README.md"
    if names == ["model.safetensors"] and card.is_file():  # the model card says how the weights are stored
        text = card.read_text()
        new = re.sub(r"in `model\.safetensors` or shards of at most ([0-9.]+) MiB",
                     r"in one `model.safetensors` (shards of at most \1 MiB joined by `specdec.train.rewrite_checkpoint`)",
                     text)
        if new != text:
            card.write_text(new)
    return names


def model_card(m: dict, cfg: DictConfig, final: bool) -> str:
    """README.md of the checkpoint: data, training, held-out acceptance, how to use it."""
    tc, S = cfg.train, int(cfg.train.ttt_steps)
    d = {k: "?" for k in ("stdlib_prompts", "seed_prompts", "self_instruct_tasks", "self_instruct_requests",
                          "dropped_overlap", "answer_temperature", "max_new_tokens")} | m["data"]
    ev = m.get("eval", {})
    pos = " | ".join(str(i) for i in range(1, S + 1))
    acc = " | ".join(f"{ev.get(f'eval/acc_{i}', float('nan')):.3f}" for i in range(1, S + 1))
    chain = " | ".join(f"{ev.get(f'eval/chain_acc_{i}', float('nan')):.3f}" for i in range(1, S + 1))
    status = "final" if final else f"intermediate (step {m['train']['steps']})"
    reused = f"\n- Sequences reused from {d['reused']}." if d.get("reused") else ""
    held_note = (f" (greedy answers only: the {d['heldout_sampled_left_out']} sampled answers of held-out prompts "
                 "are on neither side)" if d.get("heldout_sampled_left_out") else "")
    if d.get("staged_dir"):
        per = d.get("sequences_per_sample", {})
        reused += (f"\n- Staged data directory {d['staged_dir']} ({d.get('shards', '?')} answer shards; "
                   f"sequences per sample {per}: sample 0 is the greedy answer"
                   + (f", samples 1-{d['samples']} sampled at temperature {d.get('sample_temperature')}"
                      if d.get("samples") else "") + "); held out by prompt (no sample of a held-out "
                   "prompt is trained on), target features " + str(d.get("features", "stored")) + ".")
    for x in d.get("extra_dirs") or []:
        reused += (f"\n- Trained together with the staged data directory {x['staged_dir']} (train.data.extra_dirs): "
                   f"{x['sequences']} sequences, {x['tokens']} tokens, from {x.get('stdlib_prompts', '?')} "
                   f"standard-library prompts, {x.get('seed_prompts', '?')} seed tasks (seed set "
                   f"{x.get('seed_set') or 'default'}) and {x.get('self_instruct_tasks', '?')} self-instruct tasks "
                   f"({x.get('self_instruct_requests', '?')} requests); sequences per sample "
                   f"{x.get('sequences_per_sample')}. The counts in the line above are the main directory's.")
    rv = m.get("revocab")
    if m.get("init_from"):
        what = ("its weights and draft vocabulary" if not rv else
                "its weights; the draft vocabulary re-chosen from this data (train.revocab): "
                f"{rv['kept']} ids kept, {rv['new']} new with lm_head rows started from the target's, "
                f"answer-token coverage {100 * rv['coverage_before']:.1f}% before")
        reused += (f"\n- Warm start: training began from the head in {m['init_from']} ({what}"
                   + "); that head's own data and steps come before the ones below, and its training "
                   "prompts may share items with this held-out split, so the held-out rows can read high.")
    if m["phase_s"].get("resumed_from_step") is not None:
        reused += f"\n- Training resumed from a saved state at step {m['phase_s']['resumed_from_step']}."
    wall = ", ".join(f"{k} {v:.0f} s" for k, v in m["phase_s"].items() if k != "resumed_from_step")
    groups = sorted({k.split("/")[0][len("eval_"):] for k in ev if k.startswith("eval_")})
    by_dir = "".join(f"\n- held-out sequences of {g}: first position {ev.get(f'eval_{g}/acc_1', float('nan')):.3f}, "
                     f"chain estimate {ev.get(f'eval_{g}/chain_accept_len_est', float('nan')):.2f}" for g in groups)
    if by_dir:
        by_dir = "\n\nBy data directory:" + by_dir
    files = ("one `model.safetensors` (what the official EAGLE loader and other engines read)"
             if not tc.get("shard_mb") else f"`model.safetensors` or shards of at most {tc.shard_mb} MiB")
    return f"""# EAGLE-3 draft head for {m['target']}

{status} checkpoint, trained by specdec (commit {m['commit']}) on {m['device_name']} with
`python -m specdec.train {' '.join(m['overrides'])}`.
Official EAGLE-3 layout (`LlamaForCausalLMEagle3`, one layer, captured target layers
{list(m['target_layers'])}), weights in {m['checkpoint_dtype']} in {files}. Use it with
`python -m specdec.run draft=eagle3 draft.path=DIR policy=always` (or `draft=eagle3_smollm2`).

## Data (written by the target itself)
- Prompts: {d['stdlib_prompts']} Python standard-library coding tasks, {d['seed_prompts']} seed tasks and
  {d['self_instruct_tasks']} tasks the target wrote itself (self-instruct, {d['self_instruct_requests']} requests);
  {d['dropped_overlap']} dropped and the rest asserted free of overlap with HumanEval and MT-bench
  (exact, normalised substring either way, shared 13-word n-gram).
- Answers: the target's own, chat template, temperature {d['answer_temperature']}, at most
  {d['max_new_tokens']} new tokens: {d['sequences']} sequences, {d['tokens']} tokens
  ({d['answer_tokens']} answer tokens); held out: {d['heldout_sequences']} sequences{held_note}.{reused}
- Draft vocabulary: {m['draft_vocab_size']} most frequent answer tokens (special tokens included),
  covering {100 * m['vocab_coverage']:.1f}% of answer tokens.

## Training
EAGLE-3 training-time test: {S} unrolled draft steps, loss weights {tc.step_decay}^i, soft
cross-entropy against the target's distribution restricted to the draft vocabulary. AdamW
(lr {tc.lr}, betas {list(tc.betas)}, weight decay {tc.weight_decay}), {tc.warmup_steps} warmup steps
then cosine decay to {tc.min_lr_ratio} x lr, gradient clip {tc.grad_clip}, {tc.batch_tokens} padded
tokens per batch. {m['train']['steps']} steps ({m['train']['epochs']:.2f} epochs,
{m['train']['tokens_trained']} sequence tokens). Wall time: {wall}.

## Held-out acceptance (teacher-forced top-1 agreement with the target's argmax)
| draft position | {pos} |
|---|{'---|' * S}
| this position right | {acc} |
| all positions up to here right | {chain} |

Estimated tokens per step of a {S}-token chain (accepted + bonus, from the row above):
{ev.get('eval/chain_accept_len_est', float('nan')):.2f}. An estimate from teacher-forced held-out data; the engine
measures the real accepted length.{by_dir}
"""


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------

def check_config(tc, target_config) -> None:
    """Fail before minutes of data generation on settings that cannot work."""
    V, H = target_config.vocab_size, target_config.hidden_size
    vd = int(tc.draft_vocab_size)
    if not 0 < vd <= V:
        raise ConfigError(f"train.draft_vocab_size={vd}: must be in 1..{V} (the target's vocabulary)")
    if int(tc.ttt_steps) < 1:
        raise ConfigError(f"train.ttt_steps={tc.ttt_steps}: must be >= 1")
    dc = tc.get("data") or {}
    if dc.get("extra_dirs") and not dc.get("dir"):
        raise ConfigError("train.data.extra_dirs reads staged data directories beside train.data.dir: set "
                          "train.data.dir=DIR too")
    try:
        seed_set(dc.get("seed_set", "default"))
    except TrainingDataError as e:
        raise ConfigError(str(e)) from None
    if tc.get("revocab") and not tc.get("init_from"):
        raise ConfigError("train.revocab=true re-chooses a warm-started head's draft vocabulary: it needs "
                          "train.init_from=DIR (a head trained from scratch picks its vocabulary anyway)")
    if tc.checkpoint_dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"train.checkpoint_dtype={tc.checkpoint_dtype!r}; valid: float32, bfloat16, float16")
    width = 4 if tc.checkpoint_dtype == "float32" else 2
    if tc.shard_mb and vd * H * width > float(tc.shard_mb) * 2**20:
        raise ConfigError(f"the lm_head of train.draft_vocab_size={vd} takes {vd * H * width / 2**20:.1f} MiB, "
                          f"over train.shard_mb={tc.shard_mb} (one tensor cannot be split across files); "
                          "lower the draft vocabulary or raise train.shard_mb")


def _budget(value) -> float | None:
    return None if value is None else float(value)


def _engine_config(cfg, temperature: float):
    from .engine.engine import EngineConfig

    return EngineConfig.from_cfg(cfg.engine, temperature=float(temperature), seed=int(cfg.seed))


def _task_writer(cfg, model, tokenizer, eos: set[int]):
    """Self-instruct: the target writes new tasks from the messages build_prompts gives it."""
    dc = cfg.train.data
    budget = _budget(dc.self_instruct_budget_s)  # for all rounds together: a deadline set by the first
    deadline: list[float] = []

    def write_tasks(messages: list[str]) -> list[str]:
        left = None
        if budget is not None:
            if not deadline:
                deadline.append(time.perf_counter() + budget)
            left = deadline[0] - time.perf_counter()
            if left <= 0:
                log(f"self-instruct: train.data.self_instruct_budget_s={budget:.0f} spent; "
                    f"{len(messages)} requests of this round not sent")
                return [""] * len(messages)
        ids = [tokenizer.encode_chat([{"role": "user", "content": m}]) for m in messages]
        outs = generate(model, ids, int(dc.self_instruct_max_new_tokens),
                        engine_config=_engine_config(cfg, float(dc.self_instruct_temperature)), eos_ids=eos,
                        time_budget_s=left, title="self-instruct")
        return [tokenizer.decode(o) for o in outs]

    return write_tasks


def make_sequences(cfg, model, tokenizer, eos: set[int], run_dir: Path, phase: dict) -> tuple[list[Sequence], dict]:
    """Prompts, then the target's answers (steps 1-2); or the sequences of an earlier run."""
    from .assets import prompts_dir

    dc, seed = cfg.train.data, int(cfg.seed)
    if dc.get("dir"):
        return staged_sequences(cfg, model, tokenizer, eos, phase)
    if dc.reuse:
        seqs = load_sequences(dc.reuse)
        stats_path = Path(dc.reuse).with_name("data_stats.json")
        stats = json.loads(stats_path.read_text()) if stats_path.is_file() else {}
        log(f"reusing {len(seqs)} sequences from {dc.reuse}")
        return seqs, {**stats, "reused": str(dc.reuse)}

    write_tasks = _task_writer(cfg, model, tokenizer, eos)

    t0 = time.perf_counter()
    index = EvalIndex(load_eval_texts(prompts_dir()))
    prompts, stats = build_prompts(dc, index, write_tasks, seed)
    phase["prompts"] = time.perf_counter() - t0
    log(f"{len(prompts)} prompts: {stats['stdlib_prompts']} stdlib, {stats['seed_prompts']} seed, "
        f"{stats['self_instruct_tasks']} self-instruct ({phase['prompts']:.1f} s)")

    t0 = time.perf_counter()
    max_seq, max_new = int(dc.max_seq_len), int(dc.max_new_tokens)
    prompt_ids = [tokenizer.encode_chat([{"role": "user", "content": p.text}]) for p in prompts]
    keep = [i for i, p in enumerate(prompt_ids) if len(p) + 2 <= max_seq]
    outs = generate(model, [prompt_ids[i] for i in keep], max_new,
                    engine_config=_engine_config(cfg, float(dc.answer_temperature)), eos_ids=eos,
                    time_budget_s=_budget(dc.answer_budget_s), title="answers")
    seqs = [Sequence(prompts[i].id, prompts[i].source, prompt_ids[i], o[: max_seq - len(prompt_ids[i])])
            for i, o in zip(keep, outs) if o]
    phase["answers"] = time.perf_counter() - t0
    stats.update(answer_temperature=float(dc.answer_temperature), max_new_tokens=max_new)
    save_sequences(run_dir / "sequences.jsonl", seqs)
    (run_dir / "data_stats.json").write_text(json.dumps(stats, indent=2))
    log(f"{len(seqs)} answers ({phase['answers']:.1f} s)")
    return seqs, stats


def staged_sequences(cfg, model, tokenizer, eos: set[int], phase: dict) -> tuple[list[Sequence], dict]:
    """Steps 1-2 through a staged data directory (``train.data.dir``, specdec.training.stages): the
    prompts built once, the answers generated in resumable shards when this run generates
    (``train.data.generate``: null = only in a ``train.data.only`` run), then every answered sequence."""
    from .assets import prompts_dir
    from .training import stages

    dc, seed = cfg.train.data, int(cfg.seed)
    data_dir = Path(dc.dir)
    gen = dc.get("generate")
    gen = bool(dc.get("only")) if gen is None else bool(gen)
    index = EvalIndex(load_eval_texts(prompts_dir()))
    t0 = time.perf_counter()
    if not gen:
        seqs, stats = _read_staged(data_dir, index)
        seqs, stats = _with_extra_dirs(dc, seqs, stats, index)
        phase["load_data"] = time.perf_counter() - t0
        log(f"{len(seqs)} staged sequences from {data_dir} ({stats['shards']} shards)")
        return seqs, stats

    if stages.prompts_path(data_dir).is_file():
        prompts, pstats = stages.load_prompts(data_dir, index)
        log(f"stage 1 done before: {len(prompts)} prompts in {stages.prompts_path(data_dir)}")
    else:
        prompts, pstats = build_prompts(dc, index, _task_writer(cfg, model, tokenizer, eos), seed)
        stages.save_prompts(data_dir, prompts, pstats)
        log(f"stage 1: {len(prompts)} prompts written to {stages.prompts_path(data_dir)}")
    phase["prompts"] = time.perf_counter() - t0
    answer_budget = _budget(dc.answer_budget_s)
    if dc.get("stage_budget_s") is not None:  # stages 1-2 of this call together: answers get what is left
        left = float(dc.stage_budget_s) - phase["prompts"]
        answer_budget = left if answer_budget is None else min(answer_budget, left)
    t0 = time.perf_counter()
    samples = int(dc.get("samples", 0))
    astats = stages.answer_stage(
        model, tokenizer, prompts, data_dir, samples=samples, answer_temperature=float(dc.answer_temperature),
        sample_temperature=float(dc.get("sample_temperature", 1.0)), max_new_tokens=int(dc.max_new_tokens),
        max_seq_len=int(dc.max_seq_len), engine_config=_engine_config(cfg, 0.0), eos_ids=eos,
        budget_s=answer_budget, per_shard=int(dc.get("shard_records", 4096)), seed=seed)
    phase["answers"] = time.perf_counter() - t0
    seqs, stats = stages.load_staged(data_dir)
    stats.update(answer_temperature=float(dc.answer_temperature), max_new_tokens=int(dc.max_new_tokens),
                 samples=samples, sample_temperature=float(dc.get("sample_temperature", 1.0)), last_answer_run=astats)
    (data_dir / "data_stats.json").write_text(json.dumps(stats, indent=2))
    if not dc.get("only"):
        seqs, stats = _with_extra_dirs(dc, seqs, stats, index)
    return seqs, stats


def _read_staged(data_dir: Path, index: EvalIndex) -> tuple[list[Sequence], dict]:
    """A staged directory's answered sequences and stats (with those of the run that generated it), its
    prompts checked against the eval sets again: the guarantee re-asserted on this machine."""
    from .training import stages

    seqs, stats = stages.load_staged(data_dir)
    stages.load_prompts(data_dir, index)
    gen_stats = Path(data_dir) / "data_stats.json"  # written by the generating run
    if gen_stats.is_file():
        stats = {**json.loads(gen_stats.read_text()), **stats}
    return seqs, stats


def _with_extra_dirs(dc, seqs: list[Sequence], stats: dict, index: EvalIndex) -> tuple[list[Sequence], dict]:
    """``seqs`` plus every answered sequence of the staged directories in ``train.data.extra_dirs``
    (read, never generated into; each checked against the eval sets like the main one). Sequence ids
    must stay unique across directories (the held-out split groups them by prompt id): a clash is an
    error naming both directories (build one of them with ``train.data.id_prefix``)."""
    from .training import stages

    extra = [Path(d) for d in (dc.get("extra_dirs") or [])]
    if not extra:
        return seqs, stats
    owner = {s.id: str(dc.dir) for s in seqs}
    out, info = list(seqs), []
    for d in extra:
        more, st = _read_staged(d, index)
        for q in more:
            if q.id in owner:
                raise TrainingDataError(f"train.data.extra_dirs: sequence id {q.id!r} is in both {owner[q.id]} and {d}; "
                                        "build one of them with a train.data.id_prefix")
            owner[q.id] = str(d)
        info.append({k: st.get(k) for k in ("staged_dir", "shards", "stdlib_prompts", "seed_prompts", "seed_set",
                                            "self_instruct_requests", "self_instruct_tasks", "dropped_overlap",
                                            "sequences_per_sample", "samples", "sample_temperature")}
                    | {"sequences": len(more), "tokens": sum(len(q.ids) for q in more)})
        log(f"{len(more)} staged sequences from {d} (train.data.extra_dirs)")
        out.extend(more)
    return out, {**stats, "extra_dirs": info}


def held_groups_by_dir(data_stats: dict, n_seqs: int, held: list[int], main_dir) -> dict[str, list[int]]:
    """{data directory name: positions in the held-out list} when several staged directories train
    together (train.data.extra_dirs: their sequences follow the main directory's, in order), else {}."""
    extra = data_stats.get("extra_dirs") or []
    if not extra:
        return {}
    end = n_seqs - sum(int(x["sequences"]) for x in extra)  # the main directory's sequences come first
    bounds = [(Path(str(main_dir)).name, end)]
    for x in extra:
        end += int(x["sequences"])
        bounds.append((Path(str(x["staged_dir"])).name, end))
    groups: dict[str, list[int]] = {name: [] for name, _ in bounds}
    for pos, i in enumerate(held):
        groups[next(name for name, e in bounds if i < e)].append(pos)
    return groups


def fitted_steps(step: int, elapsed: float, per_step: float, budget: float, planned: int, refined: bool) -> int:
    """The steps of a run fitted into ``budget`` seconds (10% left for evaluations) after ``step`` steps
    in ``elapsed`` seconds at ``per_step`` seconds a step from here. The first estimate (``refined``
    False, step 20) keeps at least the 100 steps the refinement needs while time is left: its steps
    carry the start-up (a torch.compile of the draft layer and loss: ~150 s on an H200), which would
    otherwise fit the whole schedule into a few dozen steps."""
    fits = step + int((budget * 0.9 - elapsed) / per_step)
    floor = step if refined or elapsed >= budget * 0.9 else 100
    return min(planned, max(step, floor, fits))


def fit(trainer: Trainer, train_store, held_store: FeatureStore, tc, logger, seed: int,
        snapshot, resume: dict | None = None, save_state=None, held_groups: dict | None = None) -> dict:
    """The optimisation loop (step 5): AdamW steps over shuffled length-bucketed batches, warmup +
    cosine decay fitted to ``train.time_budget_s`` (unless ``train.fit_budget`` is false or the run
    resumes: then the schedule runs over the planned steps and the budget only ends this call), train
    metrics every ``log_every`` steps, held-out metrics every ``eval_every`` steps,
    ``snapshot(step, eval_metrics)`` every ``save_every`` steps. ``train_store``: a FeatureStore or an
    OnlineFeatures (its ``batch`` captures the features per step). ``resume``: the ``progress`` of a
    saved training state (the weights and optimizer are restored by the caller): the loop continues at
    its step, epoch and batch with its schedule. ``save_state(progress)`` is called every
    ``save_every`` steps, when the budget ends the call, and at the end. ``held_groups``: {name: positions
    in held_store}: each evaluation also scores each group alone (metrics ``eval_NAME/...``; e.g. the
    held-out sequences of each data directory)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    device, S = trainer.device, trainer.steps
    batch_tokens = int(tc.batch_tokens)
    train_lengths = train_store.lengths.tolist()
    online = getattr(train_store, "batch", None)
    held_batches = length_batches(held_store.lengths.tolist(), batch_tokens, random.Random(seed))
    group_batches = {}
    for name, pos in (held_groups or {}).items():
        if pos:
            lens = [int(held_store.lengths[j]) for j in pos]
            group_batches[name] = [[pos[i] for i in b] for b in length_batches(lens, batch_tokens, random.Random(seed))]
    per_epoch = len(length_batches(train_lengths, batch_tokens, random.Random(seed)))
    planned = max(1, math.ceil(float(tc.epochs) * per_epoch))
    if tc.get("max_steps"):
        planned = min(planned, int(tc.max_steps))
    total = planned
    budget = None if tc.time_budget_s is None else float(tc.time_budget_s)
    fit_budget = bool(tc.get("fit_budget", True)) and resume is None
    if resume is not None:
        total, planned = int(resume["total"]), int(resume["planned"])
    warmup, base_lr, min_ratio = int(tc.warmup_steps), float(tc.lr), float(tc.min_lr_ratio)
    log_every, eval_every, save_every = int(tc.log_every), int(tc.eval_every or 0), int(tc.save_every or 0)
    window = StepSums(S, device)
    history: list[dict] = []
    step, tokens, eval_metrics, eval_s = 0, 0, {}, 0.0
    epoch_no, skip = 0, 0  # epochs begun before this one; batches of it already trained (resume)
    if resume is not None:
        step, tokens, epoch_no, skip = (int(resume[k]) for k in ("step", "tokens", "epoch", "batch"))
        log(f"resuming at step {step} of {total} (epoch {epoch_no}, batch {skip})")
    stopped = False
    t0 = time.perf_counter()

    def progress(pos: int) -> dict:
        return dict(step=step, total=total, planned=planned, tokens=tokens, epoch=epoch_no, batch=pos)
    t_probe = 0.0  # elapsed seconds at the first budget estimate

    def evaluate() -> dict:
        nonlocal eval_s
        t = time.perf_counter()
        res = trainer.evaluate(held_store, held_batches)
        for name, pos in group_batches.items():
            res.update(trainer.evaluate(held_store, pos, prefix=f"eval_{name}"))
        eval_s += time.perf_counter() - t
        logger.log_metrics(res, step=step)
        return res

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[stats]}"), transient=True) as bar:
        task = bar.add_task(f"training ({device})", total=total, stats="", completed=step)
        epoch_rng = random.Random(seed + 1)
        for _ in range(epoch_no):  # the epochs a resumed run already began: the same shuffles
            length_batches(train_lengths, batch_tokens, epoch_rng)
        while step < total and not stopped:
            order = length_batches(train_lengths, batch_tokens, epoch_rng)
            for pos, b in enumerate(order):
                if pos < skip:
                    continue
                if step >= total:
                    break
                lr = base_lr * lr_factor(step, warmup, total, min_ratio)
                batch = online(b, device) if online else gather_batch(train_store, b, device)
                out, grad_norm = trainer.train_step(batch, lr)
                window.add_(out)
                tokens += batch.num_tokens
                step += 1
                if fit_budget and budget is not None and step in (min(20, planned), 100):
                    # Fit the run into the budget, so the decay runs over the steps that fit: a first
                    # estimate at step 20, refined at step 100 without the start-up (allocator, cuBLAS).
                    elapsed = time.perf_counter() - t0
                    per_step = elapsed / step if step != 100 else (elapsed - t_probe) / 80
                    t_probe = elapsed
                    fitted = fitted_steps(step, elapsed, per_step, budget, planned, refined=step == 100)
                    if fitted != total:
                        total = fitted
                        log(f"{per_step * 1e3:.0f} ms/step: {total} of {planned} planned steps fit "
                            f"train.time_budget_s={budget:.0f}")
                        bar.update(task, total=total)
                if step % log_every == 0 or step == total:
                    m = window.summary("train")
                    m.update({"train/loss": float(out.loss.detach()), "train/lr": lr, "train/grad_norm": grad_norm,
                              "train/tokens_per_s": tokens / (time.perf_counter() - t0),
                              "train/epoch": step / per_epoch})
                    logger.log_metrics(m, step=step)
                    history.append({"step": step, **m})
                    bar.update(task, stats=f"loss {m['train/loss']:.3f}  acc@1 {m['train/acc_1']:.3f}  "
                                           f"acc@{S} {m[f'train/acc_{S}']:.3f}  lr {lr:.2e}")
                    window = StepSums(S, device)
                if eval_every and step % eval_every == 0 and step < total:
                    eval_metrics = evaluate()
                if save_every and step % save_every == 0 and step < total:
                    snapshot(dict(steps=step, epochs=step / per_epoch, tokens_trained=tokens), eval_metrics)
                    if save_state is not None:
                        save_state(progress(pos + 1))
                bar.advance(task)
                if budget is not None and time.perf_counter() - t0 > budget and step < total:
                    log(f"train.time_budget_s={budget:.0f} reached at step {step} of {total}")
                    if fit_budget:
                        total = step
                    else:  # the schedule goes on in a later call (train.resume=true)
                        stopped = True
                        if save_state is not None:
                            save_state(progress(pos + 1))
                        break
            else:  # the epoch ran to its end: the next one
                epoch_no += 1
                skip = 0
                continue
            break  # step == total, or the budget ended this call
    train_s = time.perf_counter() - t0
    if save_state is not None and not stopped:
        save_state(progress(0))
    eval_metrics = evaluate()
    return dict(steps=step, planned_steps=planned, epochs=step / per_epoch, tokens_trained=tokens,
                history=history, eval=eval_metrics, train_s=train_s, eval_s=eval_s, finished=step >= total)


def feature_store_bytes(n_tokens: int, hidden: int, n_layers: int, dtype: torch.dtype) -> int:
    """Bytes of a stored feature set (training.data.capture): per token the captured layers and the
    final hidden state in ``dtype``, the target's argmax and the token id (int64)."""
    size = torch.empty((), dtype=dtype).element_size()
    return int(n_tokens) * ((n_layers + 1) * hidden * size + 16)


def resolve_online(setting, n_tokens: int, hidden: int, n_layers: int, dtype: torch.dtype, device: str,
                   budget_frac: float = 0.4, total_bytes: int | None = None) -> tuple[bool, str]:
    """train.online_features: true / false as given; ``auto``: store the features when they take at most
    ``budget_frac`` of the device's memory (``total_bytes``, default: the GPU's total memory, or the
    host's RAM on CPU), else capture them per batch. Stored features make a training step cheaper (152-232 ms
    per step captured per batch on 19,594 sequences against 107 ms stored on 7,408, on one GPU), per-batch
    capture bounds memory. Returns (online, why)."""
    if isinstance(setting, bool):
        return setting, "train.online_features=" + str(setting).lower()
    if setting != "auto":
        raise ConfigError(f"train.online_features={setting!r}; valid: true, false, auto")
    if not 0.0 < float(budget_frac) <= 1.0:
        raise ConfigError(f"train.store_budget_frac={budget_frac!r}: must be in (0, 1]")
    need = feature_store_bytes(n_tokens, hidden, n_layers, dtype)
    if total_bytes is None:
        if str(device).startswith("cuda") and torch.cuda.is_available():
            total_bytes = torch.cuda.get_device_properties(torch.device(device)).total_memory
        else:
            import os

            total_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    budget = float(budget_frac) * total_bytes
    online = need > budget
    return online, (f"train.online_features=auto: {need / 2**30:.1f} GiB of features "
                    f"{'>' if online else '<='} {budget / 2**30:.1f} GiB ({float(budget_frac):g} of "
                    f"{total_bytes / 2**30:.0f} GiB): {'captured per batch' if online else 'stored'}")


def run(cfg: DictConfig) -> dict:
    from rich.progress import Progress

    from .assets import smollm2_dir
    from .models.eagle3 import Eagle3Config, Eagle3Head

    if "train" not in cfg:
        raise ConfigError("no `train` section: run an experiment that has one, e.g. "
                          "+experiment=train_eagle3_smollm2")
    tc = cfg.train
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    seed = int(cfg.seed)
    torch.manual_seed(seed)
    device = resolve_device(cfg.device)
    apply_kernel_options(cfg)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    (run_dir / "config.json").write_text(json.dumps(resolved, indent=2))
    stamp = provenance(device)  # commit, date, device name, versions, kernel options
    t_start = time.perf_counter()
    phase: dict[str, float] = {}

    model, tokenizer = build_target(cfg, device)
    if getattr(tokenizer, "is_ids_only", False):
        raise ConfigError(f"target {cfg.target.name!r} has no tokenizer (random weights); training needs "
                          "a real target that can write its own answers")
    check_config(tc, model.config)
    eos = set(int(e) for e in model.config.eos_token_id)
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    layers = tuple(int(x) for x in tc.target_layers) if tc.target_layers else None
    head_cfg = Eagle3Config.for_target(model.config, int(tc.draft_vocab_size), target_layers=layers)
    base = load_init_head(tc.get("init_from"), model.config, device)
    if base is not None:  # a warm start keeps the head's own layers and draft vocabulary
        head_cfg = base.config
    max_seq = int(tc.data.max_seq_len)
    state_path = Path(tc.get("state_path") or run_dir / "train_state.pt")  # for train.resume

    logger = make_logger(cfg.logger, run_dir, run_dir.name, {**resolved, "provenance": stamp})
    try:
        # 1-2. Prompts and the target's answers.
        seqs, data_stats = make_sequences(cfg, model, tokenizer, eos, run_dir, phase)
        if tc.data.get("only"):  # data for later runs (train.data.reuse=RUN_DIR/sequences.jsonl)
            phase["total"] = time.perf_counter() - t_start
            where = str(tc.data.dir) if tc.data.get("dir") else str(run_dir / "sequences.jsonl")
            metrics = {"target": cfg.target.name, "device": device, "dtype": str(model.dtype),
                       "data": {**data_stats, "sequences": len(seqs), "tokens": sum(map(len, (s.ids for s in seqs)))},
                       "phase_s": phase, "sequences": where, **stamp}
            (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
            print(f"{len(seqs)} sequences ({metrics['data']['tokens']} tokens) in {metrics['sequences']}")
            print(f"run directory: {run_dir}")
            return metrics
        if len(seqs) < 2:
            raise TrainingDataError(f"only {len(seqs)} sequences were generated; need at least 2 "
                                    "(one to train on, one held out): raise the train.data sizes")
        ids_list = [s.ids[:max_seq] for s in seqs]
        plens = [min(len(s.prompt_ids), max_seq) for s in seqs]

        # 3. Draft vocabulary (a resumed run keeps the one it started with).
        from .training import stages

        resume = stages.load_train_state(state_path) if tc.get("resume") else None
        target_dir = Path(cfg.target.path) if cfg.target.path else smollm2_dir()
        revocab = None
        if resume is None and base is not None and tc.get("revocab"):  # the warm-started head's vocabulary re-chosen
            vocab_ids, coverage = draft_vocab(ids_list, plens, int(base.config.draft_vocab_size), model.config.vocab_size,
                                              always=special_ids(target_dir, tokenizer, model))
            before = vocab_coverage(ids_list, plens, base.draft_to_target_table().long().cpu(), model.config.vocab_size)
            revocab = {**revocab_(base, vocab_ids, model), "coverage_before": before}
            log(f"draft vocabulary re-chosen: {revocab['kept']} ids kept, {revocab['new']} new; coverage "
                f"{100 * before:.1f}% -> {100 * coverage:.1f}%")
        elif resume is None and base is not None:
            vocab_ids = base.draft_to_target_table().long().cpu()
            coverage = vocab_coverage(ids_list, plens, vocab_ids, model.config.vocab_size)
        elif resume is None:
            vocab_ids, coverage = draft_vocab(ids_list, plens, int(tc.draft_vocab_size), model.config.vocab_size,
                                              always=special_ids(target_dir, tokenizer, model))
        else:
            vocab_ids = resume["vocab_ids"].long()
            coverage = vocab_coverage(ids_list, plens, vocab_ids, model.config.vocab_size)
        log(f"draft vocabulary of {len(vocab_ids)} ids covers {100 * coverage:.1f}% of answer tokens")

        # 4. The held-out split (by sequence; staged data: by prompt, every sample of a prompt on one
        # side), then the target features: all stored, or (train.online_features) the held-out ones
        # stored and the training ones captured per batch.
        rng = random.Random(seed)
        if tc.data.get("dir"):
            cap = tc.data.get("heldout_max_sequences")
            held, train_idx = stages.split_by_prompt([s.id for s in seqs], float(tc.data.heldout_fraction), rng,
                                                     None if cap is None else int(cap))
            if tc.data.get("heldout_greedy_only", False):
                greedy = stages.greedy_only([s.id for s in seqs], held)
                if greedy:  # sampled answers of held-out prompts: on neither side
                    data_stats["heldout_sampled_left_out"] = len(held) - len(greedy)
                    held = greedy
        else:
            order = list(range(len(ids_list)))
            rng.shuffle(order)
            n_held = min(max(1, round(float(tc.data.heldout_fraction) * len(order))), len(order) - 1)
            held, train_idx = sorted(order[:n_held]), sorted(order[n_held:])
        t0 = time.perf_counter()
        online, why = resolve_online(tc.get("online_features", False), sum(map(len, ids_list)), model.config.hidden_size,
                                     len(head_cfg.target_layers), model.dtype, device,
                                     float(tc.get("store_budget_frac", 0.4)))
        if tc.get("online_features", False) == "auto":
            log(why)
        to_store = held if online else list(range(len(ids_list)))
        with Progress(transient=True) as bar:
            task = bar.add_task(f"capturing target features ({device})", total=sum(len(ids_list[i]) for i in to_store))
            store = capture(model, [ids_list[i] for i in to_store], [plens[i] for i in to_store],
                            head_cfg.target_layers, chunk_tokens=int(tc.data.capture_chunk_tokens),
                            progress=lambda n: bar.advance(task, n))
        phase["capture"] = time.perf_counter() - t0
        if online:
            held_store = store
            train_store = stages.OnlineFeatures(model, [ids_list[i] for i in train_idx],
                                                [plens[i] for i in train_idx], head_cfg.target_layers)
            answer_tokens = held_store.answer_tokens() + train_store.answer_tokens()
        else:
            held_store, train_store = store.subset(held), store.subset(train_idx)
            answer_tokens = store.answer_tokens()
        data_stats.update(sequences=len(seqs), tokens=sum(map(len, ids_list)), answer_tokens=answer_tokens,
                          train_sequences=len(train_idx), heldout_sequences=len(held),
                          features="online (captured per batch)" if online else "stored")

        # 5. Head and training.
        if base is not None:
            head = base  # its weights and vocabulary; a resumed state below replaces the weights
        else:
            head = Eagle3Head(head_cfg, backend="torch").init_weights_(seed)
            head.set_vocab_(vocab_ids)
            head.to_device(device, torch.float32)
        if tc.init_from_target and resume is None and base is None:
            init_from_target_(head, model)
        trainer = Trainer(head, model, tc, device)
        if resume is not None:
            head.load_state_dict({k: v.to(device) for k, v in resume["head"].items()})
            trainer.opt.load_state_dict(resume["opt"])
            phase["resumed_from_step"] = int(resume["progress"]["step"])
        card = {"target": cfg.target.name, "commit": git_commit(), "device_name": _device_name(device),
                "overrides": _overrides(), "target_layers": head_cfg.target_layers,
                "checkpoint_dtype": str(tc.checkpoint_dtype), "draft_vocab_size": int(head_cfg.draft_vocab_size),
                "vocab_coverage": coverage, "data": data_stats, "ttt_steps": int(tc.ttt_steps),
                "init_from": str(tc.init_from) if base is not None else None, "revocab": revocab}
        ckpt_dir = run_dir / "checkpoint"

        def snapshot(path: Path, train_state: dict, eval_metrics: dict, final: bool) -> None:
            m = dict(card, eval=eval_metrics, train=train_state, phase_s={k: round(v, 1) for k, v in phase.items()})
            save_checkpoint(head, path, model_card(m, cfg, final), dtype=str(tc.checkpoint_dtype),
                            shard_mb=tc.shard_mb)

        res = fit(trainer, train_store, held_store, tc, logger, seed,
                  lambda state, ev: snapshot(ckpt_dir, state, ev, final=False),
                  resume=None if resume is None else resume["progress"],
                  save_state=lambda prog: stages.save_train_state(state_path, head, trainer.opt, prog, vocab_ids),
                  held_groups=held_groups_by_dir(data_stats, len(seqs), held, tc.data.get("dir")))
        phase["train"], phase["eval"] = res["train_s"], res["eval_s"]

        # 6. Outputs.
        t0 = time.perf_counter()
        state = {k: res[k] for k in ("steps", "planned_steps", "epochs", "tokens_trained", "finished")}
        snapshot(ckpt_dir, state, res["eval"], final=True)
        exported = Path(tc.output_dir) if tc.output_dir else None
        if exported is not None:  # e.g. checkpoints/eagle3-smollm2-135m, or $OUT/... on a lent machine
            snapshot(exported, state, res["eval"], final=True)
        phase["save"] = time.perf_counter() - t0
        phase["total"] = time.perf_counter() - t_start
        history = res["history"]
        metrics = {
            **{k: card[k] for k in ("target", "device_name", "draft_vocab_size", "vocab_coverage", "ttt_steps")},
            "device": device, "dtype": str(model.dtype), "data": data_stats, "phase_s": phase,
            "train": {**state, "first": _strip_step(history[0]) if history else {},
                      "final": _strip_step(history[-1]) if history else {}},
            "eval": res["eval"],
            "checkpoint": str(ckpt_dir), "exported_checkpoint": str(exported) if exported else None,
            **{k: v for k, v in stamp.items() if k != "device_name"},
        }
        (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
        (run_dir / "train_log.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
        logger.log_metrics({"final/" + k.split("/", 1)[1]: v for k, v in res["eval"].items()}, step=res["steps"])
        logger.log_summary(stamp)
    finally:
        logger.finish()
    print_summary(metrics)
    print(f"run directory: {run_dir}")
    return metrics


def vocab_coverage(seqs: list[list[int]], prompt_lens: list[int], vocab_ids: torch.Tensor, vocab_size: int) -> float:
    """Share of answer tokens inside a draft vocabulary."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[vocab_ids] = True
    hit = total = 0
    for s, p in zip(seqs, prompt_lens):
        a = torch.tensor(s[p:], dtype=torch.long)
        hit += int(inside[a].sum())
        total += a.numel()
    return hit / total if total else 0.0


def _strip_step(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k != "step"}


def print_summary(metrics: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    ev, S = metrics["eval"], metrics["ttt_steps"]
    table = Table(title=f"EAGLE-3 head for {metrics['target']}: held-out acceptance per draft position")
    table.add_column("")
    for i in range(1, S + 1):
        table.add_column(str(i), justify="right")
    for name, key in (("loss", "loss"), ("top-1 = target argmax", "acc"), ("chain so far", "chain_acc")):
        table.add_row(name, *[f"{ev[f'eval/{key}_{i}']:.3f}" for i in range(1, S + 1)])
    console = Console()
    console.print(table)
    d, t = metrics["data"], metrics["train"]
    console.print(f"{d['sequences']} sequences ({d['tokens']} tokens), {t['steps']} steps "
                  f"({t['epochs']:.2f} epochs) in {metrics['phase_s']['train']:.0f} s; estimated tokens per "
                  f"{S}-token chain step {ev['eval/chain_accept_len_est']:.2f}; checkpoint {metrics['checkpoint']}")


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU ({torch.get_num_threads()} threads)"


def _overrides() -> list[str]:
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except Exception:  # not under @hydra.main (tests call run() directly)
        return []


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    try:
        metrics = run(cfg)
    except (SpecdecError, MissingMandatoryValue) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    return metrics["eval"]["eval/chain_accept_len_est"] if "eval" in metrics else float("nan")


if __name__ == "__main__":
    main()
