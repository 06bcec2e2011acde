"""specdec.report: run directories -> tables (markdown + LaTeX) and plots.

Fake run directories hold the config.json / metrics.json fields a real run writes; one real tiny run
checks the report reads what ``specdec.run`` actually writes.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specdec import report

ROOT = Path(__file__).resolve().parents[1]


def make_run(path: Path, *, tok_s: float, draft: str = "none", policy: str = "never", k: int = 5,
             workload: str = "humaneval", concurrency=None, temperature: float = 0.0,
             target: str = "smollm2-135m-instruct", random_weights: bool = False, device: str = "cpu",
             max_new_tokens: int = 128, accepted: dict | None = None, **metrics) -> Path:
    """A run directory shaped like ``python -m specdec.run`` writes it."""
    draft_cfg = {"name": draft, **({"max_ngram": 3, "min_ngram": 1} if draft == "ngram" else {})}
    policy_cfg = {"name": policy, **({"k": k} if policy != "never" else {})}
    config = {
        "target": {"name": target, "path": None, "random_weights": random_weights},
        "draft": draft_cfg, "tp": {"size": 1}, "policy": policy_cfg,
        "workload": {"name": workload, "sources": [{"kind": workload, "limit": 2}], "chat": True,
                     "mode": "closed", "concurrency": concurrency, "rate": None},
        "engine": {"max_new_tokens": max_new_tokens, "page_size": 16, "graph_buckets": [1, 2, 4], "stop": []},
        "logger": {"name": "none"}, "name": path.parent.name, "device": "auto", "seed": 0,
        "sampling": {"temperature": temperature}, "run_dir": str(path),
    }
    spec = policy != "never" and draft != "none"
    hist = accepted if accepted is not None else ({"0": 6, "1": 2, "5": 2} if spec else {})
    n = sum(hist.values())
    out = {
        "requests": 2, "failed_requests": 0, "output_tokens": 256, "output_tok_per_s": tok_s,
        "mean_ttft_s": 0.05, "p50_tpot_s": 0.012, "mean_batch_size": 2.0,
        "speculating_step_fraction": 1.0 if spec else 0.0,
        "mean_accepted_length": sum((int(a) + 1) * c for a, c in hist.items()) / n if n else None,
        "accepted_histogram": hist,
        "target": target, "device": device, "dtype": "torch.bfloat16", "workload": workload,
        "weights": "random weights" if random_weights else "pretrained", **metrics,
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "metrics.json").write_text(json.dumps(out))
    return path


def table(md: str, title: str) -> list[list[str]]:
    """The rows (header first) of the markdown table under ``## title``."""
    section = md.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    rows = [[c.strip() for c in ln.strip("|").split(" | ")] for ln in lines]
    return [rows[0]] + rows[2:]  # drop the alignment rule


def col(rows, header):
    return [r[rows[0].index(header)] for r in rows[1:]]


def cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "specdec.report", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_flatten_indexes_lists_of_dicts_like_hydra():
    flat = report.flatten({"workload": {"sources": [{"limit": 2}]}, "engine": {"graph_buckets": [1, 2]},
                           "stop": []})
    assert flat == {"workload.sources.0.limit": 2, "engine.graph_buckets": [1, 2], "stop": []}


def test_finds_run_dirs_below_sweep_folders(tmp_path):
    sweep = tmp_path / "multirun" / "baseline_concurrency" / "2026-01-01_00-00-00"
    for i, c in enumerate([1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]):
        make_run(sweep / str(i), tok_s=float(c), concurrency=c, workload="synthetic")
    (sweep / "multirun.yaml").write_text("")
    (sweep / "11" / ".hydra").mkdir(parents=True)  # a sweep point that failed: no metrics.json
    dirs = report.find_run_dirs([tmp_path / "multirun", sweep / "3"])  # parent and a child: once each
    assert [d.name for d in dirs] == [str(i) for i in range(11)]  # 10 after 9, not after 1
    unfinished = report.find_unfinished([tmp_path / "multirun"])
    assert unfinished == [sweep / "11"]
    md, _ = report.build_report(report.load_runs(dirs), tmp_path / "out", unfinished=unfinished)
    assert f"without metrics.json (failed or unfinished): {sweep / '11'}" in md
    run = report.load_run(dirs[0])
    assert run.row["workload.concurrency"] == 1 and run.row["workload.sources.0.limit"] == 2
    assert run.row["device"] == "cpu" and run.row["config.device"] == "auto"  # measured value keeps the key


def test_partial_runs_are_named_not_tabulated(tmp_path):
    """A run stopped before the end (metrics.json "partial": true, no steady window) stays out of the
    tables (its point keeps the finished repeat's value, not the average with 0 tok/s) and is named."""
    sweep = tmp_path / "multirun"
    for i, c in enumerate([1, 2]):
        make_run(sweep / str(i), tok_s=100.0 * c, concurrency=c, workload="synthetic", duration_s=5.0,
                 steady_tok_per_s=90.0 * c)
    make_run(sweep / "2", tok_s=0.0, concurrency=2, workload="synthetic", partial=True)
    runs, partial = report.split_partial(report.load_runs([sweep]))
    assert [r.path.name for r in runs] == ["0", "1"] and partial == [sweep / "2"]
    md, _ = report.build_report(runs, tmp_path / "out", partial=partial)
    assert f"partial run (stopped before the end; metrics.json marked partial): {sweep / '2'}" in md
    rows = table(md, "Throughput vs concurrency")
    assert rows[-1][-2:] == ["100.0", "200.0"]  # C = 2: the finished run's 200, not (200 + 0) / 2
    proc = cli(sweep / "2", "--out", tmp_path / "o2")
    assert proc.returncode == 2 and "every run found is partial" in proc.stderr


def test_speedup_is_against_the_matching_plain_run(tmp_path):
    # Baselines: one per (workload, temperature, device, output budget); speculative runs must each
    # find their own, and a run without one shows "-".
    make_run(tmp_path / "base_he_t0", tok_s=100.0)
    make_run(tmp_path / "base_he_t07", tok_s=50.0, temperature=0.7)
    make_run(tmp_path / "base_mt_t0", tok_s=80.0, workload="mt_bench")
    make_run(tmp_path / "base_he_t0_cuda", tok_s=1000.0, device="cuda")
    make_run(tmp_path / "base_he_t0_short", tok_s=10.0, max_new_tokens=16)
    make_run(tmp_path / "spec_he_t0", tok_s=150.0, draft="ngram", policy="always")
    make_run(tmp_path / "spec_he_t07", tok_s=60.0, draft="ngram", policy="always", temperature=0.7)
    make_run(tmp_path / "spec_mt_t0", tok_s=40.0, draft="ngram", policy="batch_threshold", workload="mt_bench")
    make_run(tmp_path / "spec_cuda", tok_s=1500.0, draft="ngram", policy="always", device="cuda")
    make_run(tmp_path / "spec_orphan", tok_s=70.0, draft="ngram", policy="always", max_new_tokens=64)
    md, _ = report.build_report(report.load_runs([tmp_path]), tmp_path / "out")
    rows = table(md, "Speculation")
    got = {key[:-1]: key[-1] for key in zip(col(rows, "Workload"), col(rows, "T"), col(rows, "device"),
                                            col(rows, "max new"), col(rows, "speedup"))}
    assert len(got) == len(rows) - 1 == 5
    assert got == {("humaneval", "0", "cpu", "128"): "1.50×", ("humaneval", "0.7", "cpu", "128"): "1.20×",
                   ("mt_bench", "0", "cpu", "128"): "0.50×", ("humaneval", "0", "cuda", "128"): "1.50×",
                   ("humaneval", "0", "cpu", "64"): "-"}
    assert "no plain-decoding run" in md
    assert not any(p.startswith("never") for p in col(rows, "Policy"))  # speculative runs only
    assert set(col(rows, "acc. len")) == {"2.20"}  # accepted 0, 1, 5 drafts 6, 2, 2 times: 22 / 10


def test_speculation_summary_matrix(tmp_path):
    # Methods x (workload, T): "τ / speed-up" per cell, "-" where a method was not run.
    for w, t, base in (("humaneval", 0.0, 100.0), ("humaneval", 1.0, 80.0), ("mt_bench", 0.0, 50.0)):
        make_run(tmp_path / f"plain_{w}_{t}", tok_s=base, workload=w, temperature=t)
        make_run(tmp_path / f"ngram_{w}_{t}", tok_s=base * 2, draft="ngram", policy="always", workload=w,
                 temperature=t)
    make_run(tmp_path / "ngram_k3", tok_s=150.0, draft="ngram", policy="always", k=3,
             accepted={"1": 1, "2": 1})
    md, _ = report.build_report(report.load_runs([tmp_path]), tmp_path / "out")
    rows = table(md, "Speculation summary")
    assert rows[0] == ["Drafter", "Policy", "humaneval T=0", "humaneval T=1", "mt_bench T=0"]
    assert rows[1:] == [["ngram", "always k=3", "2.50 / 1.50×", "-", "-"],
                        ["ngram", "always k=5", "2.20 / 2.00×", "2.20 / 2.00×",
                         "2.20 / 2.00×"]]
    assert md.index("## Speculation summary") < md.index("## Speculation\n")
    assert r"mt\_bench $T=0$" in (tmp_path / "out" / "report.tex").read_text()
    # One (workload, T) pair: the long-form table says it all.
    md1, _ = report.build_report(report.load_runs([tmp_path / "plain_humaneval_0.0", tmp_path / "ngram_k3"]),
                                 tmp_path / "out1")
    assert "Speculation summary" not in md1 and "## Speculation" in md1


# conf/policy/goodput.yaml as a run's config.json holds it (null: the policy's default), as the quickstart sets it.
GOODPUT = {"name": "goodput", "ks": None, "profile_context": 128, **dict.fromkeys(
    ("ema", "shadow_ema", "prior_ema", "counterfactual", "probe_rows", "probe_cost", "probe_requests", "profile_iters",
     "time_ema", "margin", "switch_horizon", "explore_every", "explore_backoff", "explore_max", "explore_budget",
     "shadow_evals", "shadow_min_rows", "shadow_rows_cap"))}
# ... as runs of an older tree wrote it: every value spelled out, and options since retired.
GOODPUT_SPELLED = {"name": "goodput", "ks": None, "ema": 0.1, "shadow_ema": 0.03, "prior_ema": 0.01, "margin": 0.03,
                   "probe_rows": 4, "probe_cost": 4, "switch_horizon": 32, "explore_budget": 0.05, "explore_every": 32,
                   "explore_backoff": 2.0, "explore_max": 1024, "profile_context": "auto", "profile_iters": 8,
                   "shadow_evals": 2, "counterfactual": True, "time_ema": 0.1, "host_model": False, "calibrate": 0.0,
                   "mixed_pricing": False}


def make_quickstart(path: Path, *, draft: dict, plain_tok_s: float, tok_s: float) -> Path:
    """A ``+experiment=quickstart`` run directory as specdec.run writes it: compare_plain serves the
    plain baseline first into RUN_DIR/plain (draft none, policy never, acceptance real, everything else
    the run's own config), then the run itself, whose metrics.json carries the comparison."""
    def fill(run_dir, tok, draft_cfg, policy_cfg, **metrics):
        cfg = json.loads((run_dir / "config.json").read_text())
        cfg.update(draft=draft_cfg, policy=policy_cfg, acceptance={"name": "real"}, compare_plain=True,
                   name="quickstart")
        cfg["workload"]["name"] = "quickstart"
        cfg["engine"]["max_batch_size"] = 4
        (run_dir / "config.json").write_text(json.dumps(cfg))
        met = json.loads((run_dir / "metrics.json").read_text())
        met.update(output_tok_per_s=tok, workload="quickstart", **metrics)
        (run_dir / "metrics.json").write_text(json.dumps(met))

    make_run(path / "plain", tok_s=plain_tok_s, speculating_step_fraction=0.0, tokens_per_row_step=1.0)
    fill(path / "plain", plain_tok_s, {"name": "none"}, {"name": "never"})
    make_run(path, tok_s=tok_s, draft=draft["name"], policy="goodput")
    fill(path, tok_s, draft, GOODPUT, plain_output_tok_per_s=plain_tok_s, speedup_over_plain=tok_s / plain_tok_s,
         outputs_identical_count=2)
    return path


def test_each_run_is_paired_with_its_own_plain_baseline(tmp_path):
    """Two quickstarts (EAGLE-3, then n-gram), each with its own plain/ served minutes apart at other
    speeds: the report prints each run's own speed-up, never one over the two plain runs pooled."""
    out = tmp_path / "outputs" / "quickstart"
    eagle = {"name": "eagle3", "path": "/ckpt", "trees": [{"topk": 4, "steps": 5, "num_draft_tokens": 16}],
             "sync_while_off": False, "catch_up": True, "weight_dtype": "auto"}
    ngram = {"name": "ngram", "max_ngram": 3, "min_ngram": 1, "lookup": "device", "chains": [2, 4, 8]}
    a = make_quickstart(out / "2026-12-07_10-00-00", draft=eagle, plain_tok_s=10.0, tok_s=9.3)
    b = make_quickstart(out / "2026-12-07_10-05-00", draft=ngram, plain_tok_s=20.0, tok_s=17.4)
    proc = cli(out, "--out", tmp_path / "rep", "--no-ledger")
    assert proc.returncode == 0, proc.stderr
    rows = table(proc.stdout, "Speculation")
    own = {json.loads((d / "config.json").read_text())["draft"]["name"]:
           f"{json.loads((d / 'metrics.json').read_text())['speedup_over_plain']:.2f}×" for d in (a, b)}
    assert own == {"eagle3": "0.93×", "ngram": "0.87×"}
    got = {d.split()[0]: sp for d, sp in zip(col(rows, "Drafter"), col(rows, "speedup"))}
    assert got == own
    assert col(rows, "baseline tok/s") == ["10.0", "20.0"]
    # Labels name what differs from conf/: the goodput options the quickstart sets, not all of them.
    assert col(rows, "Policy") == ["goodput profile_context=128"] * 2
    assert col(rows, "Drafter") == ["eagle3", "ngram chains=[2, 4, 8]"]
    # The two plain runs are two rows of the Runs table (their run dirs named), not one of "runs 2".
    runs = table(proc.stdout, "Runs")
    assert "runs" not in runs[0] and len(runs) - 1 == 4
    assert sorted(col(runs, "run dir")) == ["2026-12-07_10-00-00", "2026-12-07_10-00-00",
                                            "2026-12-07_10-05-00", "2026-12-07_10-05-00"]


def test_sweep_point_pairs_with_the_plain_run_of_its_own_sweep(tmp_path):
    """Without plain/, a run's baseline is the plain run of its sweep folder at the same point; plain runs of
    another sweep (other commit, other day) with the same config are not pooled in."""
    for sweep, base, spec in (("2026-01-01_00-00-00", 100.0, 150.0), ("2026-02-01_00-00-00", 50.0, 100.0)):
        make_run(tmp_path / sweep / "0", tok_s=base)
        make_run(tmp_path / sweep / "1", tok_s=spec, draft="ngram", policy="always")
    md, _ = report.build_report(report.load_runs([tmp_path]), tmp_path / "out")
    rows = table(md, "Speculation")
    assert col(rows, "run dir") == ["2026-01-01_00-00-00", "2026-02-01_00-00-00"]
    assert col(rows, "speedup") == ["1.50×", "2.00×"] and col(rows, "baseline tok/s") == ["100.0", "50.0"]


def test_labels_show_only_options_that_differ_from_conf():
    def run(draft, policy):
        return report.Run(Path("r"), {"draft": draft, "policy": policy}, {})

    trees = [{"topk": 1, "steps": 3, "num_draft_tokens": 3}, {"topk": 4, "steps": 5, "num_draft_tokens": 16}]
    r = run({"name": "eagle3", "path": "/x", "trees": trees, "sync_while_off": False, "catch_up": True,
             "weight_dtype": "auto"}, {**GOODPUT_SPELLED, "time_every": 8})
    assert report.drafter_label(r) == "eagle3 trees=chain3,tree16(4x5)"
    # an option conf/ no longer has shows only when on (an opt-in switch that was off says nothing)
    assert report.policy_label(r) == "goodput time_every=8"
    assert report.policy_label(run({}, {"name": "always", "k": 3})) == "always k=3"
    assert report.policy_label(run({}, {"name": "no_such_policy", "x": 1})) == "no_such_policy x=1"


def test_ledger_gets_every_reported_figure_once(tmp_path):
    """Each figure the report prints becomes one ledger row (date, commit, device from the run's provenance;
    the experiment; the run's overrides less bookkeeping; run_dir); a second report adds nothing."""
    out = tmp_path / "outputs" / "quickstart"
    a = make_quickstart(out / "2026-12-07_10-00-00", draft={"name": "ngram", "chains": [2, 4, 8]},
                        plain_tok_s=10.0, tok_s=9.3)
    for d, over in ((a, ["+experiment=quickstart", "draft=ngram_chains", "logger=none"]), (a / "plain", None)):
        met = json.loads((d / "metrics.json").read_text())
        met.update(commit="abc1234", date_utc="2026-12-07T10:00:00Z", device_name="AMD EPYC")
        if over:
            met["overrides"] = over
        (d / "metrics.json").write_text(json.dumps(met))
    ledger = tmp_path / "ledger.csv"
    proc = cli(a, "--out", tmp_path / "rep", "--ledger", ledger)
    assert proc.returncode == 0, proc.stderr
    import csv

    rows = list(csv.DictReader(ledger.open()))
    assert list(rows[0]) == ["date", "commit", "device", "experiment", "overrides", "metric", "value", "run_dir"]
    by = {(r["run_dir"], r["metric"]): r for r in rows}
    sp = by[(str(a), "speedup_over_plain")]
    assert sp["value"] == "0.93" and sp["date"] == "2026-12-07" and sp["commit"] == "abc1234"
    assert sp["device"] == "AMD EPYC" and sp["experiment"] == "quickstart" and sp["overrides"] == "draft=ngram_chains"
    assert by[(str(a), "plain_output_tok_per_s")]["value"] == "10"
    # the plain/ baseline has no overrides of its own: its run's, with plain decoding
    assert by[(str(a / "plain"), "output_tok_per_s")]["overrides"] == "draft=none policy=never"
    assert len(by) == len(rows)  # (run_dir, metric) once each
    assert f"{len(rows)} rows appended, 0 already there" in proc.stderr
    again = cli(a, "--out", tmp_path / "rep", "--ledger", ledger)
    assert f"0 rows appended, {len(rows)} already there" in again.stderr
    assert len(list(csv.DictReader(ledger.open()))) == len(rows)
    # --no-ledger writes nothing; a run inside the repository is named relative to it
    cli(a, "--out", tmp_path / "rep", "--no-ledger", "--ledger", tmp_path / "other.csv")
    assert not (tmp_path / "other.csv").exists()
    run = report.load_run(a)
    run.path = report.REPO / "experiments" / "results" / "x" / "0"
    assert report.ledger_rows([(run, "m", 1.5)])[0]["run_dir"] == "experiments/results/x/0"


def test_acceptance_by_depth_table_and_ranks(tmp_path):
    make_run(tmp_path / "plain", tok_s=10.0)
    make_run(tmp_path / "chain", tok_s=12.0, draft="ngram", policy="always",
             acceptance_by_depth={"rate": [0.8, 0.5, 0.25], "drafted": [10, 8, 4], "accepted": [8, 4, 1]})
    make_run(tmp_path / "tree", tok_s=15.0, draft="eagle3", policy="always", k=16,
             acceptance_by_depth={"rate": [0.9, 0.6], "drafted": [10, 9], "accepted": [9, 5]},
             accepted_rank_by_depth=[[6, 2, 1], [3, 1, 0, 1]])
    md, files = report.build_report(report.load_runs([tmp_path]), tmp_path / "out")
    rows = table(md, "Acceptance by draft depth")
    assert rows[0][-3:] == ["d=1", "d=2", "d=3"]
    got = {r[0]: r[-3:] for r in rows[1:]}
    assert got == {"eagle3": ["0.90", "0.56", "-"], "ngram": ["0.80", "0.50", "0.25"]}
    ranks = table(md, "Accepted rank among siblings")
    assert ranks[1][-2:] == ["67% / 22% / 11%", "60% / 20% / 20%"]
    assert "acceptance_by_depth.png" in files
    figs = []
    report.build_report(report.load_runs([tmp_path]), tmp_path / "out", figures_out=figs)
    assert ("acceptance_rate_d3", 0.125) not in [(m, v) for _, m, v in figs]
    assert [(m, v) for r, m, v in figs if r.path.name == "chain" and m.startswith("acceptance")] == [
        ("acceptance_rate_d1", 0.8), ("acceptance_rate_d2", 0.5), ("acceptance_rate_d3", 0.25)]


def test_baseline_may_be_a_never_run_with_a_drafter(tmp_path):
    make_run(tmp_path / "never_ngram", tok_s=40.0, draft="ngram", policy="never")
    make_run(tmp_path / "spec", tok_s=60.0, draft="ngram", policy="always")
    run = [r for r in report.load_runs([tmp_path]) if report.is_spec(r)]
    assert len(run) == 1 and report.baseline_tok_s(run[0], report.load_runs([tmp_path])) == 40.0
    # draft=none preferred over a never-with-drafter run when both exist
    make_run(tmp_path / "none", tok_s=50.0)
    runs = report.load_runs([tmp_path])
    assert report.baseline_tok_s(next(r for r in runs if report.is_spec(r)), runs) == 50.0


def test_concurrency_table_orders_c_numerically(tmp_path):
    for c, tok in [(16, 160.0), (2, 20.0), (128, 900.0), (1, 10.0)]:  # "128" < "16" < "2" as text
        make_run(tmp_path / f"never_c{c}", tok_s=tok, concurrency=c, workload="synthetic")
    for c, tok in [(2, 35.0), (1, 18.0)]:
        make_run(tmp_path / f"always_c{c}", tok_s=tok, concurrency=c, workload="synthetic",
                 draft="ngram", policy="always")
    md, files = report.build_report(report.load_runs([tmp_path]), tmp_path / "out")
    rows = table(md, "Throughput vs concurrency")
    assert rows[0][-4:] == ["C=1", "C=2", "C=16", "C=128"]
    assert col(rows, "Policy") == ["always k=5", "never"]  # one row per config
    assert rows[1][-4:] == ["18.0", "35.0", "-", "-"] and rows[2][-4:] == ["10.0", "20.0", "160.0", "900.0"]
    tex = (tmp_path / "out" / "report.tex").read_text()
    assert r"\multicolumn{4}{c}{output tok/s at concurrency $C$}" in tex and r"\cmidrule(lr){4-7}" in tex
    assert "Workload" not in rows[0] and "workload synthetic" in md  # a constant moves to the caption
    # the speculation table pairs each C with the plain run at the same C
    spec = table(md, "Speculation")
    assert col(spec, "C") == ["1", "2"] and col(spec, "speedup") == ["1.80×", "1.75×"]


def test_latex_is_escaped_booktabs(tmp_path):
    make_run(tmp_path / "a", tok_s=12.5, workload="my_prompts", target="ckpt_v2&50%")
    make_run(tmp_path / "b", tok_s=20.0, workload="my_prompts", target="ckpt_v2&50%", draft="ngram",
             policy="batch_threshold")
    report.build_report(report.load_runs([tmp_path]), tmp_path / "out")
    tex = (tmp_path / "out" / "report.tex").read_text()
    assert r"my\_prompts" in tex and r"ckpt\_v2\&50\%" in tex and r"batch\_threshold" in tex
    assert r"1.60$\times$" in tex and r"\toprule" in tex and r"\midrule" in tex and r"\bottomrule" in tex
    body = [ln for ln in tex.splitlines() if ln.endswith(r"\\")]
    assert body and not [ln for ln in body if re.search(r"(?<!\\)[_&%#]", ln.replace(" & ", " "))]
    for block in re.findall(r"\\begin\{tabular\}\{(\w+)\}(.*?)\\end\{tabular\}", tex, re.S):
        ncols = len(block[0])
        rows = [ln for ln in block[1].splitlines() if ln.endswith(r"\\") and "multicolumn" not in ln]
        assert all(ln.count(" & ") == ncols - 1 for ln in rows), block


def test_random_weight_targets_are_labelled(tmp_path):
    make_run(tmp_path / "a", tok_s=1000.0, target="llama-3.1-8b-shape (random weights)", random_weights=True,
             workload="synthetic", concurrency=1)
    make_run(tmp_path / "b", tok_s=3000.0, target="llama-3.1-8b-shape (random weights)", random_weights=True,
             workload="synthetic", concurrency=4)
    make_run(tmp_path / "c", tok_s=100.0, target="tiny", random_weights=True, workload="synthetic",
             concurrency=4)
    make_run(tmp_path / "d", tok_s=100.0, target="tiny", workload="synthetic", concurrency=4)
    md, _ = report.build_report(report.load_runs([tmp_path]), tmp_path / "out")
    targets = col(table(md, "Throughput vs concurrency"), "Target")
    assert sorted(targets) == ["llama-3.1-8b-shape (random weights)", "tiny", "tiny (random weights)"]
    md, _ = report.build_report(report.load_runs([tmp_path]), tmp_path / "out2",
                                group_by=["workload.concurrency"], metrics=["output_tok_per_s"])
    assert "(random weights)" in md  # shown even when no target column is asked for


def test_generic_group_by_and_metrics(tmp_path, capsys):
    for c in (1, 2):
        make_run(tmp_path / f"n{c}", tok_s=10.0 * c, concurrency=c)
        make_run(tmp_path / f"n{c}_repeat", tok_s=10.0 * c + 2, concurrency=c)
    report.main([str(tmp_path), "--out", str(tmp_path / "out"), "--group-by", "workload.concurrency",
                 "--metrics", "output_tok_per_s,device,engine.max_new_tokens"])
    md = capsys.readouterr().out
    rows = table(md, "Runs by workload.concurrency")
    assert rows[0] == ["C", "tok/s", "device", "engine.max_new_tokens", "runs"]
    assert rows[1:] == [["1", "11.0", "cpu", "128", "2"], ["2", "21.0", "cpu", "128", "2"]]
    assert "Speculation" not in md and (tmp_path / "out" / "report.md").read_text().strip() == md.strip()
    # --metrics alone: one row per config (repeats merged), any metrics.json key, flags listed as text
    md, files = report.build_report(report.load_runs([tmp_path]), tmp_path / "out2",
                                    metrics=["requests", "p50_tpot_s", "weights"])
    rows = table(md, "Runs")
    assert rows[0] == ["Workload", "Target", "Drafter", "Policy", "T", "C", "requests", "p50 TPOT ms", "weights",
                       "runs"]
    assert rows[1][5:] == ["1", "2", "12.0", "pretrained", "2"] and files == []


def test_old_runs_fall_back_to_steps_jsonl(tmp_path):
    run = make_run(tmp_path / "old", tok_s=5.0, draft="ngram", policy="always")
    m = json.loads((run / "metrics.json").read_text())
    for key in ("accepted_histogram", "mean_accepted_length", "speculating_step_fraction"):
        del m[key]
    (run / "metrics.json").write_text(json.dumps(m))
    steps = [{"decode_bs": 2, "bucket": 2, "k": 5, "accepted": [1, 3], "prefill_reqs": 0, "prefill_tokens": 0,
              "prefill_ms": 0.0, "decode_ms": 1.0, "step_ms": 1.0},
             {"decode_bs": 2, "bucket": 2, "k": 0, "accepted": [], "prefill_reqs": 0, "prefill_tokens": 0,
              "prefill_ms": 0.0, "decode_ms": 1.0, "step_ms": 1.0}]
    (run / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    r = report.load_run(run)
    assert r.metrics["accepted_histogram"] == {"1": 1, "3": 1}
    assert r.metrics["mean_accepted_length"] == 3.0 and r.metrics["speculating_step_fraction"] == 0.5


def test_plots_written(tmp_path):
    pytest.importorskip("matplotlib")
    for c in (1, 2, 4):
        make_run(tmp_path / f"n{c}", tok_s=10.0 * c, concurrency=c, workload="synthetic")
        make_run(tmp_path / f"s{c}", tok_s=15.0 * c, concurrency=c, workload="synthetic", draft="ngram",
                 policy="always")
    out = tmp_path / "out"
    md, files = report.build_report(report.load_runs([tmp_path]), out)
    assert "throughput_vs_concurrency.png" in files and "throughput_vs_concurrency.pdf" in files
    hists = sorted(f for f in files if f.startswith("accepted_length_") and f.endswith(".png"))
    assert len(hists) == 3  # one per speculative run
    for f in files:
        head = (out / f).read_bytes()[:8]
        assert head == b"\x89PNG\r\n\x1a\n" if f.endswith(".png") else head.startswith(b"%PDF")
        if f.endswith(".png"):
            assert f"]({f})" in md  # linked from report.md


def test_policy_trace_plotted_when_k_changes(tmp_path):
    pytest.importorskip("matplotlib")
    steps = [{"t_s": 0.1 * i, "decode_bs": b, "k": k, "accepted": [1] * b if k else []}
             for i, (b, k) in enumerate([(2, 5), (6, 5), (20, 0), (30, 0), (8, 5), (0, 0)])]
    for name, ks in (("adaptive", None), ("fixed", 5)):
        run = make_run(tmp_path / name, tok_s=10.0, draft="ngram", policy="batch_threshold" if ks is None else "always")
        recs = steps if ks is None else [{**s, "k": ks} for s in steps]
        (run / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert [(t, b, k) for t, b, k in report._policy_steps(report.load_run(tmp_path / "adaptive"))] == [
        (0.0, 2, 5), (0.1, 6, 5), (0.2, 20, 0), (0.30000000000000004, 30, 0), (0.4, 8, 5)]  # no decode: skipped
    assert report._policy_steps(report.load_run(tmp_path / "fixed")) == []  # k never changed
    out = tmp_path / "out"
    md, files = report.build_report(report.load_runs([tmp_path]), out)
    traces = [f for f in files if f.startswith("policy_trace_") and f.endswith(".png")]
    assert len(traces) == 1 and "batch_threshold" in traces[0] and f"]({traces[0]})" in md
    assert (out / traces[0]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_skipped_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    for c in (1, 2):
        make_run(tmp_path / f"s{c}", tok_s=15.0 * c, concurrency=c, draft="ngram", policy="always")
    md, files = report.build_report(report.load_runs([tmp_path]), tmp_path / "out")
    assert files == [] and md.count("Plots skipped: matplotlib is not installed") == 1
    assert "## Throughput vs concurrency" in md and (tmp_path / "out" / "report.tex").exists()


@pytest.mark.parametrize("case", ["empty", "missing", "malformed", "no_config", "list", "bad_key", "out_is_file"])
def test_bad_input_is_a_clean_error(tmp_path, case):
    target, args, needle = tmp_path / "runs", [], None
    if case == "empty":
        target.mkdir()
        needle = "no metrics.json"
    elif case == "missing":
        needle = "no such file or directory"
    elif case == "malformed":
        make_run(target, tok_s=1.0)
        (target / "metrics.json").write_text('{"output_tok_per_s": 1.0,\n  oops}')
        target, needle = target / "metrics.json", "malformed JSON (line 2"
    elif case == "no_config":
        make_run(target, tok_s=1.0)
        (target / "config.json").unlink()
        needle = "without config.json"
    elif case == "list":
        make_run(target, tok_s=1.0)
        (target / "config.json").write_text("[]")
        needle = f"{target / 'config.json'}: expected a JSON object"
    elif case == "bad_key":
        make_run(target, tok_s=1.0, concurrency=4)
        args, needle = ["--group-by", "workload.concurency"], "did you mean workload.concurrency"
    else:
        make_run(target, tok_s=1.0)
        (tmp_path / "out").write_text("")
        needle = f"--out {tmp_path / 'out'}: cannot create the folder"
    proc = cli(target, "--out", tmp_path / "out", *args)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and needle in proc.stderr, proc.stderr
    assert str(target) in proc.stderr or case in ("bad_key", "out_is_file")


def test_report_on_a_real_run(tmp_path):
    """One tiny real speculative run (synthetic prompts, 1 request, 4 tokens): the report reads it."""
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    env.pop("TRITON_INTERPRET", None)  # the entry uses the torch references on CPU
    run_dir = tmp_path / "multirun" / "spec" / "0"
    proc = subprocess.run(
        [sys.executable, "-m", "specdec.run", "+experiment=baseline_concurrency", "draft=ngram", "policy=always",
         "policy.k=3", "draft.chains=[3]", "workload.concurrency=1", "workload.sources.0.prompt_len=8",
         "workload.sources.0.output_len=4", "workload.sources.0.requests_per_client=1",
         "workload.sources.0.min_prompts=1", "device=cpu", f"hydra.run.dir={run_dir}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = cli(tmp_path / "multirun", "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = table(proc.stdout, "Speculation")
    assert col(rows, "Workload") == ["synthetic"] and col(rows, "Policy") == ["always k=3"]
    assert col(rows, "speedup") == ["-"] and float(col(rows, "tok/s")[0]) > 0
    assert float(col(rows, "acc. len")[0]) >= 1.0 and col(rows, "spec. steps") == ["100%"]
    assert (tmp_path / "out" / "report.md").exists() and (tmp_path / "out" / "report.tex").exists()


def test_policy_envelope_ratios_and_k_choice(tmp_path):
    """A drafter x policy x C sweep: each policy's tok/s over max(never, always) per C, the envelope
    drawn, and the k a run held at full load with its settle steps (from steps.jsonl)."""
    tok = {"never": [100.0, 190.0, 350.0], "always": [150.0, 200.0, 300.0], "goodput": [147.0, 210.0, 350.0]}
    for policy, vals in tok.items():
        for c, v in zip([1, 2, 4], vals):
            run = make_run(tmp_path / "sweep" / f"{policy}_{c}", tok_s=v, draft="ngram", policy=policy,
                           concurrency=c, k=8)
            if policy == "goodput" and c == 4:  # ramp to 4 rows, k = 8 for 3 full-load steps, then 0
                bs = [1, 2, 4] + [4] * 20 + [2, 1]
                ks = [8, 8, 8, 8, 8, 8] + [0] * 19
                (run / "steps.jsonl").write_text("".join(
                    json.dumps({"step": i, "decode_bs": b, "k": k, "prefill_reqs": 0}) + "\n"
                    for i, (b, k) in enumerate(zip(bs, ks))))
    md, files = report.build_report(report.load_runs([tmp_path / "sweep"]), tmp_path / "out")
    assert "Run-to-run spread" not in md  # one run a point: no spread table
    title = next(line[3:] for line in md.splitlines() if line.startswith("## Policy envelope"))
    rows = table(md, title)
    assert rows[0] == ["Policy", "C=1", "C=2", "C=4", "min", "max"]
    by = {r[0].split()[0]: r for r in rows[1:]}
    assert by["never"][1:4] == ["0.667", "0.950", "1.000"]
    assert by["always"][1:4] == ["1.000", "1.000", "0.857"]
    assert by["goodput"][1:] == ["0.980", "1.050", "1.000", "0.980", "1.050"]
    assert [float(x) for x in by["envelope"][1:4]] == [150.0, 200.0, 350.0]
    k_rows = table(md, next(line[3:] for line in md.splitlines() if line.startswith("## k chosen at full load")))
    held = {(r[0].split()[0], r[1]): r for r in k_rows[1:]}
    g4 = held[("goodput", "4")]
    # steady window = the 21 steps at >= 90% of 4 rows (from step 2): k = 8 for its first 4, then 0
    assert g4[2:6] == ["0", "0.81", "1", "4"]
    assert any(f.startswith("policy_envelope_01_") and f.endswith(".png") for f in files)


def _edit_config(path: Path, **sections) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for key, value in sections.items():
        cfg[key].update(value)
    (path / "config.json").write_text(json.dumps(cfg))


def test_switch_acceptance_table(tmp_path):
    """policy=schedule runs: one row per mode (draft KV in sync / left behind / always on) with the
    tokens per step of the first speculative step after an off period, from metrics' policy_state."""
    def state(first, other, by_pos, off=6):
        return {"k": 16, "on_steps": 2, "off_steps": off, "spec_steps": 10, "first_after_off_tokens_per_step": first,
                "first_after_off_steps": 0 if first is None else 4, "other_tokens_per_step": other,
                "tokens_per_spec_step": other if first is None else (first + other) / 2,
                "by_position": by_pos}

    for name, sync, off, st, same in (("in_sync", True, 6, state(2.5, 2.75, [2.5, 2.75]), 1.0),
                                      ("left", False, 6, state(1.25, 2.5, [1.25, 2.5]), 1.0),
                                      ("always", True, 0, state(None, 2.8, [], off=0), 0.5)):
        p = make_run(tmp_path / name, tok_s=100.0, draft="eagle3", policy="schedule", policy_state=st,
                     outputs_identical_to_plain=same)
        _edit_config(p, draft={"sync_while_off": sync, "topk": 4}, policy={"on_steps": 2, "off_steps": off})
    md, _ = report.build_report(report.load_runs([tmp_path]), tmp_path / "out")
    rows = table(md, "Acceptance after switching back on")
    head, body = rows[0], {r[2]: dict(zip(rows[0], r)) for r in rows[1:]}
    assert head[:3] == ["Drafter", "schedule", "draft KV while off"]
    assert set(body) == {"in sync", "left behind", "always on (off = 0)"}
    assert body["in sync"]["first step after off"] == "2.50 (4 steps)"
    assert body["left behind"]["first step after off"] == "1.25 (4 steps)"
    assert body["left behind"]["by position in window"] == "1.25 / 2.50"
    assert body["always on (off = 0)"]["first step after off"] == "-"
    assert body["always on (off = 0)"]["other spec steps"] == "2.80"
    assert body["always on (off = 0)"]["outputs = plain"] == "50%"
    assert body["in sync"]["schedule"] == "2 on / 6 off"


def test_step_floor_table(tmp_path):
    """Runs with engine.profile_steps: one row per target x batch, floor / step as the fraction."""
    sf = {"step_ms": {"1": 4.0, "8": 5.0}, "context": 512, "iters": 100, "graphed": True, "copy_gbps": 4000.0,
          "weight_bytes": 16e9, "weight_bytes_read": 15e9, "floor_ms_all": 4.0 * 0.9, "floor_ms_read": 3.375,
          "floor_fraction_all": {"1": 0.9, "8": 0.72}, "floor_fraction_read": {"1": 0.84375, "8": 0.675}}
    make_run(tmp_path / "a", tok_s=200.0, target="llama-3.1-8b-shape (random weights)", random_weights=True,
             concurrency=1, step_floor=sf, p50_tpot_s=0.0045)
    make_run(tmp_path / "b", tok_s=100.0, concurrency=64)  # no profile: not in the table
    md, _ = report.build_report(report.load_runs([tmp_path]), tmp_path / "out")
    rows = table(md, "Step time vs weight-bandwidth floor")
    body = [dict(zip(rows[0], r)) for r in rows[1:]]
    assert [(r["batch"], r["step ms"], r["of floor"], r["of floor (bytes read)"]) for r in body] == [
        ("1", "4.00", "90.0%", "84.4%"), ("8", "5.00", "72.0%", "67.5%")]
    assert all(r["Target"] == "llama-3.1-8b-shape (random weights)" and r["weights GB"] == "16.0" for r in body)
    assert body[0]["TPOT ms (C=1)"] == "4.50"
    assert all(r["of floor (bytes touched)"] == "-" and r["experts / layer"] == "-" for r in body)  # none recorded


def test_step_floor_table_reads_an_moe_target_by_the_bytes_it_touches(tmp_path):
    """An MoE target's step reads only the experts its batch selects: the touched-bytes fraction and the
    distinct experts per layer sit beside the all-weights fraction (several times 100% at batch 1)."""
    sf = {"step_ms": {"1": 5.0, "8": 10.0}, "context": 256, "iters": 10, "graphed": True, "copy_gbps": 3000.0,
          "weight_bytes": 61e9, "weight_bytes_read": 60e9, "floor_ms_all": 20.0, "floor_ms_read": 19.8,
          "floor_fraction_all": {"1": 4.0, "8": 2.0}, "floor_fraction_read": {"1": 3.96, "8": 1.98},
          "floor_fraction_touched": {"1": 0.407, "8": 0.727}, "distinct_experts_per_layer": {"1": 8.0, "8": 45.03}}
    make_run(tmp_path / "a", tok_s=200.0, target="qwen3-30b-a3b-shape (random weights)", random_weights=True,
             concurrency=1, step_floor=sf)
    md, _ = report.build_report(report.load_runs([tmp_path]), tmp_path / "out")
    rows = table(md, "Step time vs weight-bandwidth floor")
    body = [dict(zip(rows[0], r)) for r in rows[1:]]
    assert [(r["of floor"], r["of floor (bytes touched)"], r["experts / layer"]) for r in body] == [
        ("400.0%", "40.7%", "8.0"), ("200.0%", "72.7%", "45.0")]


def test_step_breakdown_sets_draft_weight_dtypes_side_by_side(tmp_path):
    """step_8b with draft.weight_dtype=model,int8: a "draft weights" column, and each (batch, k) row of
    one dtype next to the other's; a single dtype keeps the table without the column."""
    def sb(step):
        e = lambda ms: {"step_ms": ms, "step_over_plain": ms / 4.0, "draft_ms": 1.0, "draft_round_ms": 0.2,  # noqa: E731
                        "draft_rounds": 5, "verify_ms": 4.5, "commit_ms": 0.2, "mean_accepted_length": 4.87,
                        "implied_speedup": 4.87 * 4.0 / ms}
        return {"context": 512, "graphed": True,
                "batches": {"64": {"plain_ms": 6.0, "k": {"16": e(step * 5)}},
                            "1": {"plain_ms": 4.0, "k": {"3": e(step - 0.5), "16": e(step)}}}}
    for name, dt, step in (("m", "model", 6.0), ("q", "int8", 5.6)):
        run = make_run(tmp_path / "sweep" / name, tok_s=1.0, draft="eagle3", policy="goodput", concurrency=1,
                       step_breakdown=sb(step))
        cfg = json.loads((run / "config.json").read_text())
        cfg["draft"]["weight_dtype"] = dt
        (run / "config.json").write_text(json.dumps(cfg))
    md, _ = report.build_report(report.load_runs([tmp_path / "sweep"]), tmp_path / "out")
    rows = table(md, "Step breakdown")
    body = [dict(zip(rows[0], r)) for r in rows[1:]]
    assert [(r["batch"], r["k"], r["draft weights"], r["step ms"]) for r in body] == [
        ("1", "3", "model", "5.50"), ("1", "3", "int8", "5.10"), ("1", "16", "model", "6.00"),
        ("1", "16", "int8", "5.60"), ("64", "16", "model", "30.00"), ("64", "16", "int8", "28.00")]
    assert body[3]["step / plain"] == "1.40" and body[3]["implied speed-up"] == "3.48x"
    md1, _ = report.build_report(report.load_runs([tmp_path / "sweep" / "m"]), tmp_path / "out1")
    assert "draft weights" not in table(md1, "Step breakdown")[0]


def test_drafter_label_shows_what_weight_dtype_auto_resolved_to(tmp_path):
    """draft.weight_dtype=auto: the label carries the run's draft_weight_dtype (int8 shows, model does not)."""
    labels = {}
    for dt in ("int8", "model"):
        run = make_run(tmp_path / dt, tok_s=1.0, draft="eagle3", policy="always", concurrency=1, draft_weight_dtype=dt)
        cfg = json.loads((run / "config.json").read_text())
        cfg["draft"]["weight_dtype"] = "auto"
        (run / "config.json").write_text(json.dumps(cfg))
        labels[dt] = report.drafter_label(report.load_runs([run])[0])
    assert "weight_dtype=int8" in labels["int8"] and "weight_dtype" not in labels["model"]


def test_crossover_table_for_replayed_acceptance(tmp_path):
    """Replayed-acceptance runs over C: tok/s per policy beside the envelope, where each always
    falls below never, the ratios at the top C, and the label in the tables (replayed, the trace)."""
    tok = {("never", None): [100.0, 300.0, 900.0], ("always", 3): [180.0, 350.0, 700.0],
           ("always", 16): [250.0, 280.0, 400.0], ("goodput", None): [245.0, 345.0, 890.0]}
    for (policy, k), vals in tok.items():
        for c, v in zip([1, 4, 16], vals):
            run = make_run(tmp_path / "sweep" / f"{policy}{k}_{c}", tok_s=v, draft="eagle3", policy=policy,
                           concurrency=c, k=k, target="llama-3.1-8b-shape (random weights)", random_weights=True,
                           acceptance="replayed", acceptance_trace="parametric")
            _edit_config(run, policy={"k": k} if policy == "always" else {})
            cfg = json.loads((run / "config.json").read_text())
            cfg["acceptance"] = {"name": "replay", "trace": None, "parametric": {"mean": 6, "depth": 7}}
            (run / "config.json").write_text(json.dumps(cfg))
    md, files = report.build_report(report.load_runs([tmp_path / "sweep"]), tmp_path / "out")
    title = next(line[3:] for line in md.splitlines() if line.startswith("## Crossover, replayed acceptance"))
    assert "replayed acceptance (parametric, mean 6 at depth 7)" in title
    rows = table(md, title)
    assert rows[0] == ["Policy", "C=1", "C=4", "C=16"]
    by = {r[0]: r[1:] for r in rows[1:]}
    assert [float(x) for x in by["envelope max(never, always)"]] == [250.0, 350.0, 900.0]
    summary = table(md, next(line[3:] for line in md.splitlines() if line.startswith("## Crossover summary")))
    s = {r[0]: r[1:] for r in summary[1:]}
    # always k=3 falls below never at C = 16 (700 < 900): 0.78x there; k=16 already at C = 4 (280 < 300)
    assert s["always k=3"][2:] == ["16", "0.78x"] and s["always k=16"][2:] == ["4", "0.44x"]
    g = next(v for p, v in s.items() if p.startswith("goodput"))
    assert g[:3] == ["0.980", "0.989", "16"]  # min over C, at C = 16, and below never there (890 < 900)
    assert any(f.startswith("crossover_01_") and f.endswith(".png") for f in files)
    # every table names the replay in its Target column
    runs_rows = table(md, "Runs")
    assert all("replayed acceptance" in r[runs_rows[0].index("Target")] for r in runs_rows[1:])


def test_policy_envelope_ignores_settings_resolved_from_c(tmp_path):
    """policy_envelope sizes its graphs by C (engine.max_batch_size = C): a key that varies with C
    alone belongs to the sweep over C, so the runs stay one study with one envelope table; a key
    that differs between runs of one C still splits it."""
    tok = {"never": [100.0, 190.0], "always": [150.0, 200.0], "goodput": [150.0, 220.0]}
    for policy, vals in tok.items():
        for c, v in zip([1, 4], vals):
            d = make_run(tmp_path / "sweep" / f"{policy}_{c}", tok_s=v, draft="ngram", policy=policy, concurrency=c)
            cfg = json.loads((d / "config.json").read_text())
            cfg["engine"]["max_batch_size"] = c
            (d / "config.json").write_text(json.dumps(cfg))
    runs = report.load_runs([tmp_path / "sweep"])
    assert report.follows_concurrency(runs, "engine.max_batch_size")
    assert not report.follows_concurrency(runs, "engine.page_size")
    md, _ = report.build_report(runs, tmp_path / "out")
    titles = [line[3:] for line in md.splitlines() if line.startswith("## Policy envelope")]
    assert len(titles) == 1 and "max_batch_size" not in titles[0]
    by = {r[0].split()[0]: r for r in table(md, titles[0])[1:]}
    assert by["goodput"][1:3] == ["1.000", "1.100"]
    # The same key set apart within one C (max_batch_size 64 for one goodput run at C = 4): a setting again.
    d = tmp_path / "sweep" / "goodput_4"
    cfg = json.loads((d / "config.json").read_text())
    cfg["engine"]["max_batch_size"] = 64
    (d / "config.json").write_text(json.dumps(cfg))
    assert not report.follows_concurrency(report.load_runs([tmp_path / "sweep"]), "engine.max_batch_size")


def test_policy_envelope_averages_repeats_over_seed(tmp_path):
    """Repeats of a sweep (seed=0,1) stay one study: each policy's tok/s per C is the mean of its runs,
    and the caption says how many runs a point averages."""
    tok = {"never": [[100.0, 110.0], [190.0, 190.0]], "always": [[150.0, 170.0], [200.0, 200.0]],
           "goodput": [[150.0, 160.0], [220.0, 200.0]]}
    for policy, per_c in tok.items():
        for c, vals in zip([1, 4], per_c):
            for seed, v in enumerate(vals):
                d = make_run(tmp_path / "sweep" / f"{policy}_{c}_{seed}", tok_s=v, draft="ngram", policy=policy,
                             concurrency=c)
                cfg = json.loads((d / "config.json").read_text())
                cfg["seed"] = seed
                (d / "config.json").write_text(json.dumps(cfg))
    md, _ = report.build_report(report.load_runs([tmp_path / "sweep"]), tmp_path / "out")
    titles = [line[3:] for line in md.splitlines() if line.startswith("## Policy envelope")]
    assert len(titles) == 1 and "seed" not in titles[0]
    by = {r[0].split()[0]: r for r in table(md, titles[0])[1:]}
    assert by["goodput"][1:3] == ["0.969", "1.050"]  # 155 / 160, 210 / 200
    assert "Each point is the mean of 2 runs." in md
    # ... and how far apart each point's runs are
    spread = {r[0].split()[0]: r for r in table(md, "Run-to-run spread: " + titles[0].split(": ", 1)[1])[1:]}
    assert spread["never"][1:3] == ["9.5%", "0.0%"]  # 10 / 105
    assert spread["goodput"][1:3] == ["6.5%", "9.5%"]  # 10 / 155, 20 / 210
    # ... and the envelope of each point's best run, every policy alike
    best = {r[0].split()[0]: r for r in table(md, "Best of repeats vs the envelope: " + titles[0].split(": ", 1)[1])[1:]}
    assert best["goodput"][1:3] == ["0.941", "1.100"]  # 160 / max(110, 170), 220 / max(190, 200)
    assert best["never"][1:3] == ["0.647", "0.950"] and best["envelope"][1:3] == ["170.0", "200.0"]
    # ... and each run over the envelope of its own seed, averaged: (150 / 150 + 160 / 170) / 2, (220 / 200 + 200 / 200) / 2
    paired = {r[0].split()[0]: r for r in table(md, "Paired by seed vs the envelope: " + titles[0].split(": ", 1)[1])[1:]}
    assert paired["goodput"][1:3] == ["0.971", "1.050"] and paired["goodput"][3:5] == ["0.971", "1.050"]
    assert paired["never"][1:3] == ["0.657", "0.950"]  # (100 / 150 + 110 / 170) / 2


def test_policy_envelope_of_one_repeated_point(tmp_path):
    """Repeats at a single C (seed=0,1,2 at C = 8) still make an envelope table: one column."""
    tok = {"never": [100.0, 104.0, 96.0], "always": [150.0, 152.0, 148.0], "goodput": [147.0, 149.0, 148.0]}
    for policy, vals in tok.items():
        for seed, v in enumerate(vals):
            d = make_run(tmp_path / "sweep" / f"{policy}_{seed}", tok_s=v, draft="eagle3", policy=policy, concurrency=8)
            cfg = json.loads((d / "config.json").read_text())
            cfg["seed"] = seed
            (d / "config.json").write_text(json.dumps(cfg))
    md, _ = report.build_report(report.load_runs([tmp_path / "sweep"]), tmp_path / "out")
    titles = [line[3:] for line in md.splitlines() if line.startswith("## Policy envelope")]
    assert len(titles) == 1
    rows = table(md, titles[0])
    assert rows[0][1] == "C=8"
    by = {r[0].split()[0]: r for r in rows[1:]}
    assert by["goodput"][1] == "0.987" and by["never"][1] == "0.667"  # 148 / 150, 100 / 150


def test_policy_envelope_uses_the_steady_window_of_timed_runs(tmp_path):
    """Timed closed loops (workload.duration_s): the envelope compares steady-window tok/s, says so in
    its caption, and falls back to whole-run tok/s when a run of the study lacks the window."""
    steady = {"never": [100.0, 400.0], "always": [200.0, 300.0], "goodput": [196.0, 420.0]}
    for policy, vals in steady.items():
        for c, v in zip([1, 4], vals):
            make_run(tmp_path / "sweep" / f"{policy}_{c}", tok_s=50.0 * c, draft="ngram", policy=policy,
                     concurrency=c, k=8, duration_s=5.0, steady_warmup_s=1.0, steady_tok_per_s=v)
    md, _ = report.build_report(report.load_runs([tmp_path / "sweep"]), tmp_path / "out")
    title = next(line[3:] for line in md.splitlines() if line.startswith("## Policy envelope"))
    by = {r[0].split()[0]: r for r in table(md, title)[1:]}
    assert by["goodput"][1:3] == ["0.980", "1.050"] and by["never"][1:3] == ["0.500", "1.000"]
    assert "steady-window output tok/s (timed closed loop of 5 s; tokens committed from 1 s after" in md
    # One run without the window: the whole study goes back to whole-run tok/s (all 50 C: ratios 1).
    m = tmp_path / "sweep" / "goodput_4" / "metrics.json"
    m.write_text(json.dumps({k: v for k, v in json.loads(m.read_text()).items() if k != "steady_tok_per_s"}))
    md, _ = report.build_report(report.load_runs([tmp_path / "sweep"]), tmp_path / "out2")
    by = {r[0].split()[0]: r for r in table(md, title)[1:]}
    assert by["goodput"][1:3] == ["1.000", "1.000"] and "steady-window" not in md.split(title, 1)[1].split("\n## ", 1)[0]


def test_policy_envelope_caption_says_when_the_loop_was_staggered(tmp_path):
    """workload.stagger reaches the envelope's caption: all runs staggered, or only some of them."""
    for policy, v in {"never": 100.0, "always": 200.0}.items():
        for c in (1, 4):
            make_run(tmp_path / "sweep" / f"{policy}_{c}", tok_s=50.0 * c, draft="ngram", policy=policy,
                     concurrency=c, k=8, duration_s=5.0, steady_warmup_s=1.0, steady_tok_per_s=v * c)
    md, _ = report.build_report(report.load_runs([tmp_path / "sweep"]), tmp_path / "out")
    assert "staggered" not in md

    def stagger(name):
        p = tmp_path / "sweep" / name / "config.json"
        cfg = json.loads(p.read_text())
        cfg["workload"]["stagger"] = True
        p.write_text(json.dumps(cfg))

    for name in ("never_1", "never_4", "always_1", "always_4"):
        stagger(name)
    md, _ = report.build_report(report.load_runs([tmp_path / "sweep"]), tmp_path / "out2")
    assert "timed closed loop of 5 s, first round staggered (workload.stagger)" in md


def test_policy_switches_table_tells_why_a_run_changed_k(tmp_path):
    """A goodput run's switch_log becomes one row: its switch count, the logged switches by reason and the last
    ones its estimates decided, with a(k) / iteration ms of the k left and the k taken; runs without a log
    (never, older goodput runs) get no row and, all of them without, no table."""
    def est(a16, it16, a48, it48):
        def one(a, it):
            return {"a": a, "iter_ms": it, "rate": None if a is None else a / it}
        return {"0": one(1.0, 4.7), "16": one(a16, it16), "48": one(a48, it48)}
    log = [{"choice": 1, "batch": 4, "from": 0, "to": 48, "why": "first_try", "k": est(None, 6.6, None, 8.8)},
           {"choice": 9, "batch": 4, "from": 48, "to": 16, "why": "estimates", "k": est(4.6, 6.69, 5.67, 8.99)},
           {"choice": 40, "batch": 4, "from": 16, "to": 48, "why": "estimates", "k": est(4.1, 7.52, 5.67, 8.99)}]
    make_run(tmp_path / "s" / "0", tok_s=2305.0, draft="eagle3", policy="goodput", concurrency=4,
             policy_state={"switches": 31, "choices_made": 650, "switch_log": log})
    make_run(tmp_path / "s" / "1", tok_s=818.0, concurrency=4)
    md, _ = report.build_report(report.load_runs([tmp_path / "s"]), tmp_path / "out")
    rows = table(md, "Policy switches")
    assert len(rows) == 2
    assert col(rows, "switches") == ["31"] and col(rows, "choices") == ["650"]
    assert col(rows, "logged switches by reason") == ["estimates 2, first_try 1"]
    last = rows[1][-1]
    assert last == "B=4: 48 -> 16 (5.67 / 8.99 -> 4.60 / 6.69); B=4: 16 -> 48 (4.10 / 7.52 -> 5.67 / 8.99)"
    make_run(tmp_path / "t" / "0", tok_s=818.0, concurrency=4)
    md, _ = report.build_report(report.load_runs([tmp_path / "t"]), tmp_path / "out2")
    assert "## Policy switches" not in md
