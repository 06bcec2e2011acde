"""EAGLE-3 training: the TTT mask and attention, the unroll against the inference path, a toy
training run whose loss falls and whose checkpoint drafts in the engine, clean training prompts,
and the Hydra entry end to end."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from test_engine import VOCAB, rand_prompts, reference, tiny_model

from specdec.engine.engine import Engine, EngineConfig
from specdec.models.eagle3 import Eagle3Config, Eagle3Head
from specdec.models.ops import AttentionMeta
from specdec.spec import Eagle3Drafter
from specdec.train import StepSums, Trainer, lr_factor, save_checkpoint
from specdec.training.data import capture, draft_vocab, gather_batch, generate, length_batches
from specdec.training.prompts import (SEED_TASKS, EvalIndex, TrainingDataError, TrainPrompt,
                                      assert_no_overlap, decontaminate, load_eval_texts, parse_task,
                                      self_instruct, stdlib_prompts)
from specdec.training.ttt import (draft_layer, draft_logits, row_mask, ttt_attention,
                                  ttt_attention_ref, ttt_mask)

ROOT = Path(__file__).resolve().parents[1]
LAYERS = (0, 1, 1)  # captured layers of the 2-layer tiny target


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(layers=2)


def causal_meta(start, n, pages=8):
    """One request whose n new tokens sit at slots start .. start + n - 1 of pages 0, 1, ..."""
    return AttentionMeta(cu_q_lens=torch.tensor([0, n], dtype=torch.int32),
                         kv_lens=torch.tensor([start + n], dtype=torch.int32),
                         page_table=torch.arange(pages, dtype=torch.int32)[None],
                         slot_mapping=torch.arange(start, start + n), max_q_len=n)


def new_head(model, draft_ids, seed=0):
    cfg = Eagle3Config.for_target(model.config, len(draft_ids), target_layers=LAYERS)
    head = Eagle3Head(cfg, backend="torch").init_weights_(seed)
    head.set_vocab_(torch.as_tensor(draft_ids))
    return head.to_device("cpu", torch.float32)


# ----------------------------------------------------------------------------------------------
# Mask, attention, unroll
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("T,step", [(1, 0), (5, 0), (5, 3), (9, 6)])
def test_ttt_mask_is_causal_plus_own_diagonal(T, step):
    mask = ttt_mask(T, step)
    assert mask.shape == (T, (step + 1) * T) and mask.dtype == torch.bool
    for j in range(T):
        for col in range(mask.shape[1]):
            s, jk = divmod(col, T)
            want = jk <= j if s == 0 else jk == j  # real keys <= j; draft keys of steps 1..step at j only
            assert bool(mask[j, col]) == want, (j, s, jk)


@pytest.mark.parametrize("B,T,HQ,HKV,D,steps", [(1, 1, 2, 1, 4, 1), (3, 13, 6, 2, 8, 4), (2, 7, 4, 4, 16, 2)])
def test_ttt_attention_matches_dense_reference(B, T, HQ, HKV, D, steps):
    gen = torch.Generator().manual_seed(T)
    q = torch.randn(B, T, HQ, D, generator=gen, requires_grad=True)
    ks = [torch.randn(B, T, HKV, D, generator=gen, requires_grad=True) for _ in range(steps)]
    vs = [torch.randn(B, T, HKV, D, generator=gen, requires_grad=True) for _ in range(steps)]
    got, want = ttt_attention(q, ks, vs), ttt_attention_ref(q, ks, vs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    w = torch.randn(got.shape, generator=gen)
    g_got = torch.autograd.grad((got * w).sum(), [q, *ks, *vs])
    g_want = torch.autograd.grad((want * w).sum(), [q, *ks, *vs])
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_unroll_matches_the_inference_path(tiny):
    """Step i of row j in training == the drafter's chain at inference: the paged head forward over
    rows 0..j (step 0), then one node per step at position j + i fed the previous hidden."""
    head = new_head(tiny, list(range(0, VOCAB, 2)))
    n, S = 12, 4
    toks = torch.tensor(rand_prompts([n], seed=5)[0])
    k, v = tiny.new_kv_cache(8, 4)
    feats = tiny(toks, torch.arange(n), causal_meta(0, n), k, v, capture_layers=LAYERS).captured
    hidden, ks, vs, logits = head.fuse(feats[None]), [], [], []
    padded = torch.nn.functional.pad(toks[None], (0, S + 1))
    for i in range(S):
        hidden = draft_layer(head, tiny.embed[padded[:, 1 + i:1 + i + n]], hidden, torch.arange(n) + i, ks, vs)
        logits.append(draft_logits(head, hidden[0]))  # [n, Vd]
    for j in (0, 3, 7):
        dk, dv = head.new_kv_cache(8, 4)
        h, lg = head(tiny.embed_tokens(toks[1:j + 2]), head.fuse(feats[:j + 1]), torch.arange(j + 1),
                     causal_meta(0, j + 1), dk, dv)
        torch.testing.assert_close(lg[-1], logits[0][j], atol=1e-5, rtol=1e-5)
        h = h[-1:]
        for i in range(1, S):
            h, lg = head(tiny.embed_tokens(toks[j + 1 + i:j + 2 + i]), h, torch.tensor([j + i]),
                         causal_meta(j + i, 1), dk, dv)
            torch.testing.assert_close(lg[0], logits[i][j], atol=1e-5, rtol=1e-5)


def test_row_mask_counts_answer_predictions_only():
    lengths, plens = torch.tensor([10, 6]), torch.tensor([4, 5])
    m0, m2 = row_mask(lengths, plens, 10, 0), row_mask(lengths, plens, 10, 2)
    # Row j at step i predicts token j + 2 + i: an answer token (>= prompt_len) that exists (< length),
    # from a chain anchored in the answer (j + 2 >= prompt_len).
    assert m0[0].nonzero().squeeze(1).tolist() == [2, 3, 4, 5, 6, 7]
    assert m2[0].nonzero().squeeze(1).tolist() == [2, 3, 4, 5]
    assert m0[1].nonzero().squeeze(1).tolist() == [3] and not m2[1].any()


def test_lr_schedule_warms_up_then_decays():
    f = [lr_factor(s, 10, 110, 0.1) for s in range(120)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[10:], f[11:])) and f[110] == pytest.approx(0.1)


# ----------------------------------------------------------------------------------------------
# Data pieces
# ----------------------------------------------------------------------------------------------

def test_draft_vocab_ranks_answer_tokens_and_keeps_specials():
    seqs = [[1, 2, 3, 7, 7, 7, 8, 8], [3, 3, 9, 7, 5]]
    plens = [3, 2]  # answers: [7, 7, 7, 8, 8] and [9, 7, 5]
    ids, cov = draft_vocab(seqs, plens, 4, 16, always=[0])
    # 0 forced; then answer counts 7: 4, 8: 2; 5 and 9 tie (1 each, never in prompts): lower id wins.
    assert ids.tolist() == [0, 5, 7, 8]
    assert cov == pytest.approx(7 / 8)
    ids, _ = draft_vocab([[4, 4, 6, 6, 6]], [1], 3, 16)  # prompt counts break answer-count ties
    assert ids.tolist() == [0, 4, 6]


def test_length_batches_respect_the_token_budget():
    lengths = [random.Random(i).randint(3, 60) for i in range(200)]
    batches = length_batches(lengths, 128, random.Random(0))
    assert sorted(i for b in batches for i in b) == list(range(200))
    assert all(len(b) * max(lengths[i] for i in b) <= 128 for b in batches)


def test_generate_stops_at_its_time_budget_keeping_prefixes(tiny):
    prompts = rand_prompts([5, 6, 7, 8], seed=2)
    cfg = EngineConfig(max_batch_size=2, page_size=4)
    full = generate(tiny, prompts, 12, engine_config=cfg, eos_ids=())
    cut = generate(tiny, prompts, 12, engine_config=cfg, eos_ids=(), time_budget_s=0.0)  # one step
    assert [len(f) for f in full] == [12] * 4 and sum(map(len, cut)) < 4
    assert all(c == f[:len(c)] for c, f in zip(cut, full))  # in-flight answers keep their prefix


# ----------------------------------------------------------------------------------------------
# Training on a tiny target, checkpoint, drafting in the engine
# ----------------------------------------------------------------------------------------------

def toy_config(**kw):
    base = dict(ttt_steps=3, step_decay=0.8, lr=3e-3, betas=[0.9, 0.95], weight_decay=0.0, grad_clip=0.5)
    return OmegaConf.create({**base, **kw})


def test_toy_training_loss_falls_and_checkpoint_drafts(tiny, tmp_path):
    prompts = rand_prompts([5, 9, 14, 7, 11, 6, 12, 8], seed=21)
    outs = generate(tiny, prompts, 24, engine_config=EngineConfig(max_batch_size=8, page_size=4), eos_ids=())
    seqs = [p + o for p, o in zip(prompts, outs)]
    plens = [len(p) for p in prompts]
    vocab, coverage = draft_vocab(seqs, plens, 64, VOCAB)
    assert 0.5 < coverage <= 1.0
    store = capture(tiny, seqs, plens, LAYERS, chunk_tokens=64, page_size=4)
    assert store.features.shape == (sum(map(len, seqs)), 3 * 64)
    head = new_head(tiny, vocab)
    trainer = Trainer(head, tiny, toy_config(), "cpu")
    batches = length_batches(store.lengths.tolist(), 96, random.Random(0))
    first = trainer.evaluate(store, batches)
    torch.manual_seed(0)
    for epoch in range(10):
        for b in batches:
            trainer.train_step(gather_batch(store, b, "cpu"), 3e-3)
    last = trainer.evaluate(store, batches)
    # The tiny target's teacher distributions are broad (entropy ~3.6 nats over the 64 draft ids,
    # the floor of the soft cross-entropy), so the loss falls from ~4.17 to ~3.8.
    for i in (1, 2, 3):  # every unrolled position learns
        assert last[f"eval/loss_{i}"] < first[f"eval/loss_{i}"] - 0.2, (first, last)
    assert last["eval/acc_1"] > first["eval/acc_1"] + 0.3
    assert last["eval/chain_accept_len_est"] > 1.5

    # Official layout, bf16, sharded (a 31 KiB limit forces several files), loads and drafts.
    names = save_checkpoint(head, tmp_path / "ckpt", "# toy\n", dtype="bfloat16", shard_mb=0.03)
    assert len(names) > 1 and (tmp_path / "ckpt" / "model.safetensors.index.json").is_file()
    assert (tmp_path / "ckpt" / "README.md").read_text() == "# toy\n"
    loaded = Eagle3Head.load(tmp_path / "ckpt", target=tiny.config, backend="torch")
    assert torch.equal(loaded.d2t, head.d2t)
    torch.testing.assert_close(loaded.w("lm_head.weight"), head.w("lm_head.weight"), atol=2e-2, rtol=1e-2)
    drafter = Eagle3Drafter(loaded, tiny, topk=1, steps=3, num_draft_tokens=3)
    trace = []
    engine = Engine(tiny, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=1024),
                    drafter=drafter, ks=(3,), trace=trace.append)
    reqs = [engine.add_request(p, 16) for p in prompts[:3]]
    while engine.has_work():
        engine.step(3)
    engine.flush_trace()
    assert [r.output_ids for r in reqs] == [reference(tiny, p, 16) for p in prompts[:3]]
    accepted = [a for rec in trace for a in rec["accepted"]]
    assert sum(accepted) / len(accepted) > 0.5  # the trained head's drafts are accepted


@pytest.mark.slow
def test_compiled_training_step_equals_eager(tiny):
    """train.compile=true: the compiled layer and loss give the eager step's loss, metrics and weights
    (two padded shapes: the dynamic-shape compile serves both), and evaluation stays eager."""
    prompts = rand_prompts([5, 9, 14, 7, 11, 6], seed=4)
    outs = generate(tiny, prompts, 12, engine_config=EngineConfig(max_batch_size=8, page_size=4), eos_ids=())
    seqs = [p + o for p, o in zip(prompts, outs)]
    plens = [len(p) for p in prompts]
    vocab, _ = draft_vocab(seqs, plens, 64, VOCAB)
    store = capture(tiny, seqs, plens, LAYERS, chunk_tokens=64, page_size=4)
    batches = [[0, 1, 2], [3, 4, 5, 0]]
    runs = []
    for compile in (False, True):
        head = new_head(tiny, vocab)
        trainer = Trainer(head, tiny, toy_config(compile=compile), "cpu")
        outs = [trainer.train_step(gather_batch(store, b, "cpu"), 3e-3) for b in batches * 2]
        runs.append((head, outs, trainer.evaluate(store, batches)))
    (h0, o0, e0), (h1, o1, e1) = runs
    from specdec.training import ttt
    assert set(ttt._COMPILED) == {"layer", "ce"}  # the second run went through torch.compile
    for (a, ga), (b, gb) in zip(o0, o1):
        torch.testing.assert_close(a.loss, b.loss, atol=1e-5, rtol=1e-5)
        assert torch.equal(a.rows, b.rows) and torch.equal(a.correct, b.correct)
        assert ga == pytest.approx(gb, rel=1e-4)
    for k in h0.weights:
        torch.testing.assert_close(h0.weights[k], h1.weights[k], atol=1e-5, rtol=1e-4)
    assert e0 == pytest.approx(e1, rel=1e-4)


def test_step_sums_summary_names_positions_from_one():
    s = StepSums(2, "cpu")

    class Out:
        step_loss, rows = torch.tensor([1.0, 2.0]), torch.tensor([4, 2])
        correct, chain_correct = torch.tensor([2, 1]), torch.tensor([2, 0])

    s.add_(Out)
    m = s.summary("eval")
    assert m["eval/acc_1"] == 0.5 and m["eval/acc_2"] == 0.5 and m["eval/chain_acc_2"] == 0.0
    assert m["eval/chain_accept_len_est"] == 1.5


# ----------------------------------------------------------------------------------------------
# Training prompts never overlap the eval sets
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def eval_index(prompts_path):
    return EvalIndex(load_eval_texts(prompts_path))


def test_training_prompts_do_not_overlap_eval_sets(eval_index):
    prompts = stdlib_prompts(per_item=2, seed=0)
    assert len(prompts) > 1000 and len({p.id for p in prompts}) == len(prompts)
    seeds = [TrainPrompt(f"seed/{i}", t, "seed") for i, t in enumerate(SEED_TASKS)]
    kept, dropped = decontaminate(prompts + seeds, eval_index)
    assert len(dropped) <= 0.01 * len(prompts)  # the sources are disjoint by construction
    assert_no_overlap(kept, eval_index)
    assert stdlib_prompts(per_item=2, seed=0) == prompts  # deterministic


def test_overlap_check_catches_copies(eval_index, prompts_path):
    he = json.loads((prompts_path / "humaneval.jsonl").read_text().splitlines()[3])["prompt"]
    mt = json.loads((prompts_path / "mt_bench.jsonl").read_text().splitlines()[0])["turns"][0]
    cases = {
        "exact": he,
        "contains": "Please help: " + mt.upper() + " Thanks!",  # normalised: case and punctuation
        "contained": " ".join(mt.split()[2:9]),
        "13-gram": "Intro words here. " + " ".join(he.split("\"\"\"")[1].split()[:14]) + " and more.",
    }
    for want, text in cases.items():
        assert eval_index.overlap(text) == want, (want, text)
    with pytest.raises(TrainingDataError, match="overlaps an eval prompt"):
        assert_no_overlap([TrainPrompt("x", cases["contains"], "test")], eval_index)
    clean = "Write a Python function like `textwrap.dedent`: remove common leading whitespace."
    assert eval_index.overlap(clean) is None


def test_self_instruct_parses_and_deduplicates():
    replies = iter(["1. Write a story about a dragon who bakes bread.", "Sure! Here is a new task:\n",
                    "4. write a story about a DRAGON who bakes bread!",  # a duplicate after normalisation
                    "Task 5: Explain how tides work on a lake.", "I'm ready to help. What task would you like?",
                    SEED_TASKS[0]])
    seen_requests = []

    def fake_generate(messages):
        seen_requests.extend(messages)
        return [next(replies) for _ in messages]

    tasks = self_instruct(fake_generate, num_requests=6, rounds=2, examples_per_request=2, seed=0)
    assert tasks == ["Write a story about a dragon who bakes bread.", "Explain how tides work on a lake."]
    assert len(seen_requests) == 6 and all("Reply with the task only." in m for m in seen_requests)
    assert parse_task("12) \"List three rivers in Peru.\"") == "List three rivers in Peru."
    assert parse_task("Describe the sadness that is reflected upon their") is None  # cut off


# ----------------------------------------------------------------------------------------------
# The Hydra entry
# ----------------------------------------------------------------------------------------------

def run_train(*overrides, tmp_path, timeout=600):
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    env.pop("TRITON_INTERPRET", None)  # the entry uses the torch references on CPU
    return subprocess.run([sys.executable, "-m", "specdec.train", *overrides, f"hydra.run.dir={tmp_path}/run"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # the suite's longest CPU test (two specdec.train runs); -m slow runs it
def test_train_entry_smoke_writes_a_loadable_checkpoint(tmp_path, smollm2):
    # Data once (train.data.only), then a training run that reuses it.
    data_dir = tmp_path / "data"
    proc = run_train("+experiment=train_eagle3_smollm2_smoke", "logger=none", "device=cpu",
                     "train.data.only=true", "kernels.step_kernels=false", tmp_path=data_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((data_dir / "run" / "metrics.json").read_text())
    assert data["kernel_options"]["step_kernels"] is False  # kernels.* overrides reach the options in force
    seq_file = data_dir / "run" / "sequences.jsonl"
    assert "train" not in data and not (data_dir / "run" / "checkpoint").exists()
    assert data["data"]["sequences"] == len(seq_file.read_text().splitlines()) >= 2

    proc = run_train("+experiment=train_eagle3_smollm2_smoke", "logger=none", "device=cpu",
                     f"train.data.reuse={seq_file}", f"train.output_dir={tmp_path}/export", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "run"
    m = json.loads((run_dir / "metrics.json").read_text())
    assert m["train"]["steps"] == 6 and m["data"]["sequences"] == data["data"]["sequences"] and m["ttt_steps"] == 3
    assert m["data"]["reused"] == str(seq_file)
    for metrics in (data, m):  # provenance in every metrics.json (tests/test_run.py checks the values)
        assert {"commit", "date_utc", "device_name", "torch", "triton", "python", "kernel_options"} <= set(metrics)
    assert m["train"]["final"]["train/loss_1"] < m["train"]["first"]["train/loss_1"]
    assert {f"eval/acc_{i}" for i in (1, 2, 3)} <= set(m["eval"])
    for d in (run_dir / "checkpoint", tmp_path / "export"):
        head = Eagle3Head.load(d, target=smollm2.config, backend="torch")
        assert head.config.draft_vocab_size == 512 and head.t2d[2]  # EOS is in the draft vocabulary
        card = (d / "README.md").read_text()
        assert "Held-out acceptance" in card and "HumanEval and MT-bench" in card
    assert not (run_dir / "wandb").exists()

    # Warm start from the exported head: its weights and draft vocabulary carry over (the run's own
    # draft_vocab_size is not used), so training starts where the first run ended.
    warm = tmp_path / "warm"
    proc = run_train("+experiment=train_eagle3_smollm2_smoke", "logger=none", "device=cpu",
                     f"train.data.reuse={seq_file}", f"train.init_from={tmp_path}/export",
                     "train.draft_vocab_size=1024", tmp_path=warm)
    assert proc.returncode == 0, proc.stderr[-3000:]
    w = json.loads((warm / "run" / "metrics.json").read_text())
    assert w["draft_vocab_size"] == 512
    assert w["train"]["first"]["train/loss_1"] < m["train"]["first"]["train/loss_1"]
    base = Eagle3Head.load(tmp_path / "export", target=smollm2.config, backend="torch")
    head = Eagle3Head.load(warm / "run" / "checkpoint", target=smollm2.config, backend="torch")
    assert torch.equal(head.d2t, base.d2t)
    assert "Warm start" in (warm / "run" / "checkpoint" / "README.md").read_text()


@pytest.mark.parametrize("overrides,needle", [
    (["+experiment=quickstart"], "no `train` section"),
    (["+experiment=train_eagle3_smollm2_smoke", "train.draft_vocab_size=16384", "train.shard_mb=15"],
     "over train.shard_mb=15"),
    (["+experiment=train_eagle3_smollm2_smoke", "train.draft_vocab_size=0"], "must be in 1..49152"),
    (["+experiment=train_eagle3_smollm2_smoke", "train.init_from=/nonexistent/head"], "train.init_from"),
    (["+experiment=train_eagle3_smollm2_smoke", "train.revocab=true"], "train.revocab=true re-chooses"),
    (["+experiment=train_eagle3_smollm2_smoke", "train.data.seed_set=prose"], "seed_set='prose'"),
    (["+experiment=train_eagle3_smollm2_smoke", "train.data.extra_dirs=[/tmp/x]"], "set train.data.dir=DIR too"),
])
def test_train_entry_rejects_bad_settings_before_generating(tmp_path, overrides, needle):
    proc = run_train(*overrides, "logger=none", "device=cpu", tmp_path=tmp_path, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert needle in proc.stderr
    assert not (tmp_path / "run" / "sequences.jsonl").exists()


# ----------------------------------------------------------------------------------------------
# Staged data, online features, resume (specdec/training/stages.py)
# ----------------------------------------------------------------------------------------------

class _NoLog:
    def log_metrics(self, *a, **k):
        pass


def _fit_config(**kw):
    base = dict(batch_tokens=48, epochs=3, max_steps=None, time_budget_s=None, warmup_steps=2, min_lr_ratio=0.1,
                log_every=2, eval_every=0, save_every=0, fit_budget=True)
    return toy_config(**{**base, **kw})


def test_online_features_equal_stored_ones(tiny):
    from specdec.training.stages import OnlineFeatures

    prompts = rand_prompts([5, 9, 7, 11], seed=3)
    seqs = [p + rand_prompts([6], seed=i)[0] for i, p in enumerate(prompts)]
    plens = [len(p) for p in prompts]
    store = capture(tiny, seqs, plens, LAYERS, chunk_tokens=64, page_size=4)
    online = OnlineFeatures(tiny, seqs, plens, LAYERS, page_size=4)
    assert online.lengths.tolist() == store.lengths.tolist() and online.answer_tokens() == store.answer_tokens()
    for idx in ([2, 0], [3], [1, 2, 3]):
        a, b = online.batch(idx, "cpu"), gather_batch(store, idx, "cpu")
        for f in ("tokens", "argmax", "lengths", "prompt_lens"):
            assert torch.equal(getattr(a, f), getattr(b, f)), f
        torch.testing.assert_close(a.features, b.features, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.teacher_hidden, b.teacher_hidden, atol=1e-5, rtol=1e-5)


def _fit_data(tiny, n_held):
    """(draft vocabulary, stored held-out features, online training features) of six random sequences,
    the first n_held held out."""
    from specdec.training.stages import OnlineFeatures

    prompts = rand_prompts([5, 9, 14, 7, 11, 6], seed=8)
    seqs = [p + rand_prompts([10], seed=40 + i)[0] for i, p in enumerate(prompts)]
    plens = [len(p) for p in prompts]
    vocab, _ = draft_vocab(seqs, plens, 64, VOCAB)
    held = capture(tiny, seqs[:n_held], plens[:n_held], LAYERS, page_size=4)
    return vocab, held, OnlineFeatures(tiny, seqs[n_held:], plens[n_held:], LAYERS, page_size=4)


def test_fit_stopped_by_its_budget_resumes_to_the_same_weights(tiny, tmp_path):
    # One straight run of the planned steps vs a run whose budget ends it after its first step
    # (fit_budget false: the schedule is kept), its state saved, then resumed in a fresh head and
    # optimizer: the same batches in the same order, so the same final weights.
    from specdec.train import fit
    from specdec.training.stages import load_train_state, save_train_state

    vocab, held, train = _fit_data(tiny, n_held=2)

    def fresh():
        head = new_head(tiny, vocab, seed=1)
        return head, Trainer(head, tiny, _fit_config(), "cpu")

    head_a, tr_a = fresh()
    res_a = fit(tr_a, train, held, _fit_config(fit_budget=False), _NoLog(), 0, lambda *a: None)
    assert res_a["finished"] and res_a["steps"] == res_a["planned_steps"] >= 4

    head_b, tr_b = fresh()
    path = tmp_path / "state.pt"
    saved = []
    res_b = fit(tr_b, train, held, _fit_config(fit_budget=False, time_budget_s=0.0), _NoLog(), 0, lambda *a: None,
                save_state=lambda prog: saved.append(prog) or save_train_state(path, head_b, tr_b.opt, prog, vocab))
    assert res_b["steps"] == 1 and not res_b["finished"] and saved[-1]["step"] == 1
    state = load_train_state(path)
    assert torch.equal(state["vocab_ids"], vocab)
    head_c, tr_c = fresh()
    head_c.load_state_dict(state["head"])
    tr_c.opt.load_state_dict(state["opt"])
    res_c = fit(tr_c, train, held, _fit_config(fit_budget=False), _NoLog(), 0, lambda *a: None,
                resume=state["progress"])
    assert res_c["finished"] and res_c["steps"] == res_a["steps"]
    for k, v in head_a.state_dict().items():
        torch.testing.assert_close(head_c.state_dict()[k], v, atol=1e-6, rtol=1e-5, msg=k)
    with pytest.raises(TrainingDataError, match="no training state"):
        load_train_state(tmp_path / "missing.pt")


def test_answer_stage_writes_shards_and_resumes(tiny, tmp_path):
    # Stage 2 over a fake tokenizer: every (prompt, sample) item answered once across two calls (the
    # first stopped by a budget that ends it after its first finished requests), samples 0 greedy
    # (equal to the reference) and 1 sampled; the held-out split keeps a prompt's samples together.
    from specdec.training import stages

    class Tok:
        def encode_chat(self, messages):
            text = messages[0]["content"]
            return [3 + (ord(c) % 50) for c in text]

    prompts = [TrainPrompt(f"p/{i}", f"task number {i} " + "x" * i, "stdlib") for i in range(5)]
    cfg = EngineConfig(max_batch_size=2, page_size=4, kv_cache_tokens=1024)
    kw = dict(samples=1, answer_temperature=0.0, sample_temperature=1.0, max_new_tokens=6, max_seq_len=64,
              engine_config=cfg, eos_ids=(), per_shard=3, seed=0)
    first = stages.answer_stage(tiny, Tok(), prompts[:2], tmp_path, budget_s=None, **kw)
    assert first["items_written"] == 4 and not first["stopped_by_budget"]
    # A budget that ends the call after one engine step: nothing finished, nothing written (redone later).
    cut = stages.answer_stage(tiny, Tok(), prompts, tmp_path, budget_s=0.0, min_left_s=0.0, **kw)
    assert cut["stopped_by_budget"] and cut["items_before"] == 4 and cut["items_written"] == 0
    second = stages.answer_stage(tiny, Tok(), prompts, tmp_path, budget_s=None, **kw)
    assert not second["stopped_by_budget"] and second["items_before"] == 4 and second["items_written"] == 6
    seqs, done, per_sample = stages.read_shards(tmp_path)
    ids = [s.id for s in seqs]
    assert len(ids) == len(set(ids)) == 10 and per_sample == {"0": 5, "1": 5}
    for s in seqs:
        if s.id.endswith("#0"):
            assert s.output_ids == reference(tiny, s.prompt_ids, 6)
    held, train = stages.split_by_prompt(ids, 0.4, random.Random(0))
    assert held and train and not set(held) & set(train)
    assert {stages.prompt_of(ids[i]) for i in held}.isdisjoint({stages.prompt_of(ids[i]) for i in train})
    with pytest.raises(TrainingDataError, match="no prompts.jsonl"):
        stages.load_staged(tmp_path)


def test_online_features_auto_stores_what_fits():
    """train.online_features=auto: stored when the feature store (captured layers + final hidden in the
    model dtype, argmax and token ids) fits in store_budget_frac of the device's memory, else per batch."""
    import torch

    from specdec.errors import ConfigError
    from specdec.train import feature_store_bytes, resolve_online

    per_token = 4 * 576 * 2 + 16  # 3 captured layers + final hidden, bf16; argmax + token, int64
    assert feature_store_bytes(10, 576, 3, torch.bfloat16) == 10 * per_token
    assert feature_store_bytes(10, 576, 3, torch.float32) == 10 * (4 * 576 * 4 + 16)
    n = 6_353_392  # the 10x-data run's tokens: 27.4 GiB, stored on a 141 GiB GPU at 0.4, not at 0.15
    online, why = resolve_online("auto", n, 576, 3, torch.bfloat16, "cuda:0", 0.4, total_bytes=141 * 2**30)
    assert not online and "stored" in why and "GiB" in why
    assert resolve_online("auto", n, 576, 3, torch.bfloat16, "cuda:0", 0.15, total_bytes=141 * 2**30)[0]
    assert resolve_online("auto", 4 * n, 576, 3, torch.bfloat16, "cuda:0", 0.4, total_bytes=141 * 2**30)[0]
    assert resolve_online(True, 1, 576, 3, torch.bfloat16, "cpu") == (True, "train.online_features=true")
    assert resolve_online(False, 10**12, 576, 3, torch.bfloat16, "cpu")[0] is False
    assert resolve_online("auto", 1000, 64, 3, torch.float32, "cpu")[0] is False  # host RAM on the CPU
    with pytest.raises(ConfigError, match="online_features='sometimes'"):
        resolve_online("sometimes", 1, 576, 3, torch.bfloat16, "cpu")
    with pytest.raises(ConfigError, match="store_budget_frac"):
        resolve_online("auto", 1, 576, 3, torch.bfloat16, "cpu", 0.0)


def test_heldout_greedy_only_keeps_sample_zero():
    """train.data.heldout_greedy_only: the held-out split keeps each held-out prompt's greedy answer
    (sample 0, or an id without a suffix) and leaves its sampled answers out of both sides."""
    import random

    from specdec.training.stages import greedy_only, split_by_prompt

    ids = [f"p{i}#{s}" for i in range(20) for s in range(3)] + ["plain-a", "x#y"]
    held, train = split_by_prompt(ids, 0.25, random.Random(0))
    kept = greedy_only(ids, held)
    assert kept and set(kept) <= set(held) and all(ids[i].endswith("#0") or "#" not in ids[i]
                                                  or not ids[i].rpartition("#")[2].isdigit() for i in kept)
    prompts = {ids[i].rpartition("#")[0] for i in held if ids[i].rpartition("#")[2].isdigit()}
    assert {ids[i] for i in kept if "#" in ids[i]} >= {f"{p}#0" for p in prompts}
    assert not {ids[i].rpartition("#")[0] for i in train} & prompts  # held-out prompts never trained on
    assert greedy_only(["a#1", "a#2"], [0, 1]) == [] and greedy_only(["a", "b#0"], [0, 1]) == [0, 1]


# ----------------------------------------------------------------------------------------------
# Conversational data (seed_set=chat) and several staged directories (extra_dirs)
# ----------------------------------------------------------------------------------------------

def test_chat_seeds_are_clean_and_select_by_name(eval_index):
    from specdec.training.prompts import CHAT_SEED_TASKS, seed_set

    assert seed_set("chat") == CHAT_SEED_TASKS and seed_set("default") == SEED_TASKS
    with pytest.raises(TrainingDataError, match="seed_set='prose'.*valid: default, chat"):
        seed_set("prose")
    seeds = [TrainPrompt(f"seed/{i}", t, "seed") for i, t in enumerate(CHAT_SEED_TASKS)]
    kept, dropped = decontaminate(seeds, eval_index)
    assert not dropped and len({normalize_text(t) for t in CHAT_SEED_TASKS}) == len(CHAT_SEED_TASKS)
    code_words = ("python", "function", "sql", "javascript", "bash", "regular expression", "code")
    assert not [t for t in CHAT_SEED_TASKS if any(w in t.lower() for w in code_words)]


def normalize_text(t):
    from specdec.training.prompts import normalize
    return normalize(t)


def test_build_prompts_uses_the_seed_set_and_prefixes_ids(eval_index):
    from specdec.train import build_prompts
    from specdec.training.prompts import CHAT_SEED_TASKS

    shown = []

    def write_tasks(messages):
        shown.extend(messages)
        return [f"Describe a quiet harbour town number {len(shown) - len(messages) + i} at dawn." for i in range(len(messages))]

    dc = OmegaConf.create(dict(stdlib_per_item=0, stdlib_max_prompts=None, seed_tasks=True, seed_set="chat",
                               id_prefix="chat/", self_instruct_requests=6, self_instruct_rounds=2,
                               self_instruct_examples=3))
    prompts, stats = build_prompts(dc, eval_index, write_tasks, seed=0)
    assert stats["stdlib_prompts"] == 0 and stats["seed_prompts"] == len(CHAT_SEED_TASKS)
    assert stats["seed_set"] == "chat" and stats["self_instruct_tasks"] == 6
    assert all(p.id.startswith("chat/") for p in prompts) and len({p.id for p in prompts}) == len(prompts)
    assert {p.text for p in prompts if p.source == "seed"} == set(CHAT_SEED_TASKS)
    # Round 1 shows chat seeds only (never a default seed); later rounds may show its own tasks too.
    first_round = shown[:3]
    for msg in first_round:
        examples = [ln.split(". ", 1)[1] for ln in msg.splitlines() if ln[:1].isdigit()]
        assert examples and all(e in CHAT_SEED_TASKS for e in examples)
    dc.seed_set = "nope"
    with pytest.raises(TrainingDataError, match="seed_set"):
        build_prompts(dc, eval_index, write_tasks, seed=0)


def _staged_dir(path, prompts, answers):
    """A staged data directory: prompts.jsonl and one answer shard (sample 0 of each prompt)."""
    from specdec.training import stages

    stages.save_prompts(path, prompts, {"stdlib_prompts": 0, "seed_prompts": len(prompts)})
    w = stages.ShardWriter(path, per_shard=100)
    for p, out in zip(prompts, answers):
        w.add(stages._record(p, 0, 0.0, [1, 2, 3], out))
    w.flush()


def test_extra_dirs_train_beside_the_main_directory(tmp_path, eval_index, prompts_path):
    from specdec.train import _with_extra_dirs
    from specdec.training import stages

    main, chat, clash, dirty = (tmp_path / n for n in ("main", "chat", "clash", "dirty"))
    _staged_dir(main, [TrainPrompt(f"seed/{i}", f"Tell me about river number {i}.", "seed") for i in range(3)],
                [[5, 6], [7], [8, 9, 10]])
    _staged_dir(chat, [TrainPrompt(f"chat/seed/{i}", f"Write a toast for friend number {i}.", "seed") for i in range(2)],
                [[11, 12, 13], [14]])
    _staged_dir(clash, [TrainPrompt("seed/1", "Name a mountain lake.", "seed")], [[15]])
    seqs, stats = stages.load_staged(main)
    dc = OmegaConf.create(dict(dir=str(main), extra_dirs=[str(chat)]))
    both, st = _with_extra_dirs(dc, seqs, stats, eval_index)
    assert [s.id for s in both] == ["seed/0#0", "seed/1#0", "seed/2#0", "chat/seed/0#0", "chat/seed/1#0"]
    assert both[3].output_ids == [11, 12, 13] and st["shards"] == stats["shards"]
    (x,) = st["extra_dirs"]
    assert x["staged_dir"] == str(chat) and x["sequences"] == 2 and x["tokens"] == 3 + 3 + 3 + 1
    # No extra directories: the main one's sequences and stats as they were.
    assert _with_extra_dirs(OmegaConf.create(dict(dir=str(main), extra_dirs=[])), seqs, stats, eval_index) == (seqs, stats)
    # A sequence id in two directories would join two prompts in the held-out split: an error naming both.
    with pytest.raises(TrainingDataError, match=r"'seed/1#0' is in both .*main and .*clash.*id_prefix"):
        _with_extra_dirs(OmegaConf.create(dict(dir=str(main), extra_dirs=[str(clash)])), seqs, stats, eval_index)
    # An extra directory is held to the same eval-overlap guarantee as the main one.
    mt = json.loads((prompts_path / "mt_bench.jsonl").read_text().splitlines()[0])["turns"][0]
    _staged_dir(dirty, [TrainPrompt("x/0", mt, "seed")], [[16]])
    with pytest.raises(TrainingDataError, match="overlaps an eval prompt"):
        _with_extra_dirs(OmegaConf.create(dict(dir=str(main), extra_dirs=[str(dirty)])), seqs, stats, eval_index)
    with pytest.raises(TrainingDataError, match="no prompts.jsonl"):
        _with_extra_dirs(OmegaConf.create(dict(dir=str(main), extra_dirs=[str(tmp_path / "none")])), seqs, stats,
                         eval_index)


def test_budget_fit_survives_a_slow_start():
    # Step 20's estimate carries the start-up (a torch.compile: 163 s for the first 20 steps, 8.1 s a
    # step) and must not cut the schedule to the 46 steps that rate allows: it keeps 100 for the
    # refinement, which (0.1 s a step since) fits the rest of the budget.
    from specdec.train import fitted_steps

    first = fitted_steps(20, 163.0, 163.0 / 20, 420.0, 16840, refined=False)
    assert first == 100
    assert fitted_steps(100, 171.0, 0.1, 420.0, 16840, refined=True) == 100 + int((378 - 171) / 0.1)
    assert fitted_steps(100, 171.0, 0.1, 420.0, 500, refined=True) == 500  # never past the plan
    assert fitted_steps(20, 2.0, 0.1, 420.0, 50, refined=False) == 50
    assert fitted_steps(20, 400.0, 20.0, 420.0, 16840, refined=False) == 20  # no time left: stop here
    assert fitted_steps(20, 10.0, 0.5, 420.0, 16840, refined=False) == 20 + int((378 - 10) / 0.5)


def test_revocab_keeps_shared_rows_and_starts_new_ones_from_the_target(tiny):
    # A warm-started head's draft vocabulary re-chosen: rows of ids in both vocabularies carry over
    # (so their logits for any hidden state are unchanged), new ids start as the target's output rows
    # scaled to the head's row norms, d2t / t2d describe the new ids; the other weights stay.
    from specdec.train import revocab_

    old_ids = list(range(0, 48, 2))  # 24 even ids
    head = new_head(tiny, old_ids, seed=5)
    before = {k: head.w(k).detach().clone() for k in head.shapes}
    new_ids = torch.tensor(sorted(set(range(0, 24, 2)) | set(range(101, 113))))  # 12 kept, 12 new
    counts = revocab_(head, new_ids, tiny)
    assert counts == {"kept": 12, "new": 12}
    assert torch.equal(head.draft_to_target_table().cpu(), new_ids)
    assert head.t2d.sum() == 24 and bool(head.t2d[new_ids].all())
    w = head.w("lm_head.weight")
    for j, t in enumerate(new_ids.tolist()):
        if t in old_ids:
            assert torch.equal(w[j], before["lm_head.weight"][old_ids.index(t)])
    out_w = tiny.embed if tiny.lm_head is None else tiny.lm_head
    new_rows = w[12:]
    tgt = out_w[new_ids[12:]].float()
    scale = before["lm_head.weight"][:12].norm(dim=1).mean() / out_w[new_ids[:12]].float().norm(dim=1).mean()
    torch.testing.assert_close(new_rows, tgt * scale)
    assert all(torch.equal(head.w(k), v) for k, v in before.items() if k != "lm_head.weight")
    with pytest.raises(ValueError, match="10 ids given; 24 distinct target ids needed"):
        revocab_(head, new_ids[:10], tiny)


def test_self_instruct_budget_covers_all_rounds(monkeypatch):
    # train.data.self_instruct_budget_s is one deadline for every round: each round's generate gets
    # what is left, and a round that starts after it sends nothing.
    import specdec.train as tr

    clock = [100.0]
    monkeypatch.setattr(tr.time, "perf_counter", lambda: clock[0])
    budgets = []

    def fake_generate(model, ids, max_new, *, engine_config, eos_ids, time_budget_s, title):
        budgets.append(time_budget_s)
        clock[0] += 40.0  # each round takes 40 s
        return [[7] for _ in ids]

    class Tok:
        def encode_chat(self, messages):
            return [1, 2]

        def decode(self, ids):
            return "Describe a quiet lake at dawn in three sentences."

    monkeypatch.setattr(tr, "generate", fake_generate)
    monkeypatch.setattr(tr, "_engine_config", lambda cfg, t: None)
    cfg = OmegaConf.create({"train": {"data": {"self_instruct_budget_s": 90, "self_instruct_max_new_tokens": 8,
                                               "self_instruct_temperature": 1.0}}})
    write = tr._task_writer(cfg, None, Tok(), set())
    replies = [write(["a", "b"]) for _ in range(4)]
    assert budgets == [90.0, 50.0, 10.0]  # the fourth round starts at 120 s: past the deadline
    assert replies[3] == ["", ""] and replies[0][0].startswith("Describe")


def test_heldout_scored_per_data_directory(tiny):
    # With several staged directories, each evaluation also scores each directory's held-out
    # sequences alone; the groups partition the held-out list (main directory's sequences first).
    from specdec.train import fit, held_groups_by_dir

    stats = {"extra_dirs": [{"staged_dir": "/x/chat10x", "sequences": 2}]}
    assert held_groups_by_dir(stats, 6, [0, 3, 4, 5], "/x/data10x") == {"data10x": [0, 1], "chat10x": [2, 3]}
    assert held_groups_by_dir({}, 6, [0, 3], "/x/data10x") == {}
    vocab, held, train = _fit_data(tiny, n_held=4)
    head = new_head(tiny, vocab, seed=1)
    trainer = Trainer(head, tiny, _fit_config(), "cpu")
    res = fit(trainer, train, held, _fit_config(fit_budget=False), _NoLog(), 0, lambda *a: None,
              held_groups={"a": [0, 1], "b": [2, 3]})
    ev = res["eval"]
    for g, idx in (("a", [[0, 1]]), ("b", [[2, 3]])):
        alone = trainer.evaluate(held, idx, prefix=f"eval_{g}")
        assert alone.keys() <= ev.keys()
        for k, v in alone.items():
            assert ev[k] == pytest.approx(v, rel=1e-5), k
    assert ev["eval_a/acc_1"] != ev["eval_b/acc_1"] or ev["eval_a/loss_1"] != ev["eval_b/loss_1"]
