"""The report's MoE parts: targets labelled with their routing, the "MoE step cost" table and figure
(experiment=step_moe), and the dense-vs-MoE crossover figure (experiment=crossover_moe)."""

import json

from test_report import make_run, table

from specdec import report

DENSE, MOE = "qwen3-8b-shape (random weights)", "qwen3-30b-a3b-shape (random weights)"
ZIPF = {"label": "zipf s=1.2 reuse 0.5", "kind": "zipf", "skew": 1.2, "reuse": 0.5}
ROUTER = {"label": "random router", "kind": "router"}
UNIFORM = {"label": "uniform", "kind": "uniform", "skew": 0.0, "reuse": 0.0625, "keep": 0.0}
OLD_ROUTER = {"label": "uniform", "kind": "uniform"}  # the random router, as runs recorded it before kind router


def _replayed(run, mean=2.5):
    cfg = json.loads((run / "config.json").read_text())
    cfg["acceptance"] = {"name": "replay", "trace": None, "parametric": {"mean": mean, "depth": 5}}
    (run / "config.json").write_text(json.dumps(cfg))


def _breakdown(ratios: dict, experts: dict | None) -> dict:
    """step_breakdown metrics: {batch: {k: step / plain}} with plain 10 ms; experts {batch: (plain, {k: n})}."""
    out = {"context": 256, "iters": 10, "graphed": True, "batches": {}}
    for b, ks in ratios.items():
        row = {"plain_ms": 10.0, "k": {}}
        if experts:
            row["plain_distinct_experts_per_layer"] = experts[b][0]
        for k, r in ks.items():
            e = {"step_ms": 10.0 * r, "step_over_plain": r, "draft_ms": 1.0, "draft_round_ms": 0.5, "draft_rounds": 2,
                 "verify_ms": 5.0, "commit_ms": 1.0}
            if experts:
                e["distinct_experts_per_layer"] = experts[b][1][k]
            row["k"][str(k)] = e
        out["batches"][str(b)] = row
    return out


def test_moe_step_cost_table_and_figure(tmp_path):
    """Dense, MoE random router, MoE uniform and MoE zipf step profiles: one row per target x routing x B x k with
    step / plain and the experts per layer (dense: "-"), rows in the order dense, router, uniform, zipf, the
    routing in its own column and in every Target label, and the figure."""
    ratios = {1: {3: 1.2, 16: 1.5}, 64: {3: 1.1, 16: 1.3}}
    specs = [("zipf", MOE, ZIPF, {1: (8.0, {3: 20.1, 16: 52.0}), 64: (97.0, {3: 120.0, 16: 127.0})}),
             ("uniform", MOE, UNIFORM, {1: (8.0, {3: 29.5, 16: 85.9}), 64: (125.0, {3: 128.0, 16: 128.0})}),
             ("dense", DENSE, None, None),
             ("router", MOE, ROUTER, {1: (8.0, {3: 9.1, 16: 12.5}), 64: (50.0, {3: 60.0, 16: 80.0})})]
    for name, target, routing, experts in specs:
        extra = {"routing": routing} if routing else {}
        run = make_run(tmp_path / "step" / name, tok_s=10.0, draft="eagle3", policy="goodput", concurrency=1,
                       target=target, random_weights=True, acceptance="replayed",
                       step_breakdown=_breakdown(ratios, experts), **extra)
        _replayed(run, mean=3)
    md, files = report.build_report(report.load_runs([tmp_path / "step"]), tmp_path / "out")
    rows = table(md, "MoE step cost")
    head = rows[0]
    assert head[:4] == ["Target", "routing", "B", "k"]
    got = {(r[0], r[1], r[2], r[3]): dict(zip(head, r)) for r in rows[1:]}
    assert len(got) == 4 * 2 * 2
    order = list(dict.fromkeys(r[1] for r in rows[1:]))
    assert order == ["(dense)", "random router", "uniform", "zipf s=1.2 reuse 0.5"]
    z = got[(MOE, "zipf s=1.2 reuse 0.5", "1", "16")]
    assert z["step / plain"] == "1.50" and z["experts / layer, plain"] == "8.0" and z["experts / layer, at k"] == "52.0"
    assert got[(MOE, "random router", "1", "16")]["experts / layer, at k"] == "12.5"
    d = got[(DENSE, "(dense)", "64", "3")]
    assert d["step / plain"] == "1.10" and d["experts / layer, at k"] == "-"
    breakdown = table(md, "Step breakdown")
    targets = {r[0] for r in breakdown[1:]}
    for route in ("zipf s=1.2 reuse 0.5", "uniform", "random router"):
        assert any(t.startswith(f"{MOE}, routing: {route},") for t in targets), route
    assert not any("routing" in t for t in targets if t.startswith(DENSE))
    assert "moe_step_cost.png" in files


def test_routing_label_reads_old_runs_as_the_random_router(tmp_path):
    """Runs recorded before kind router: {"label": "uniform", "kind": "uniform"} without steering facts, or no
    routing at all on a random-weight MoE target, were routed by the random router; a steered uniform run
    (keep, skew recorded) stays "uniform"; a dense or real target has no routing label."""
    moe_config = {"num_experts": 128, "num_experts_per_tok": 8}

    def run(metrics, random_weights=True, config=None):
        return report.Run(tmp_path, {"target": {"name": MOE, "random_weights": random_weights,
                                                **({"config": config} if config else {})}},
                          {"weights": "random weights" if random_weights else "pretrained", **metrics})

    assert report.routing_label(run({"routing": OLD_ROUTER})) == "random router"
    assert report.routing_label(run({"routing": ROUTER})) == "random router"
    assert report.routing_label(run({"routing": UNIFORM})) == "uniform"
    assert report.routing_label(run({"routing": ZIPF})) == "zipf s=1.2 reuse 0.5"
    assert report.routing_label(run({}, config=moe_config)) == "random router"
    assert report.routing_label(run({}, config={"hidden_size": 64})) == ""
    assert report.routing_label(run({}, random_weights=False)) == ""


def test_dense_vs_moe_crossover_figure_and_tables_per_routing(tmp_path):
    """crossover_moe-shaped runs (replayed acceptance; never / always at C = 1, 4 on a dense and an MoE target,
    the MoE one under three routings): one crossover table per target and routing, and one side-by-side figure
    whose caption names the routings' line styles."""
    for target, routing, base in ((DENSE, None, 100.0), (MOE, ROUTER, 260.0), (MOE, UNIFORM, 200.0),
                                  (MOE, ZIPF, 220.0)):
        for policy, k, gain in (("never", None, 1.0), ("always", 3, 1.3)):
            for c in (1, 4):
                tag = "dense" if routing is None else routing["kind"]
                extra = {"routing": routing} if routing else {}
                run = make_run(tmp_path / "x" / f"{tag}_{policy}_{c}", tok_s=base * c * gain / (1 + (c > 1)),
                               draft="eagle3", policy=policy, k=k, concurrency=c, target=target, random_weights=True,
                               acceptance="replayed", **extra)
                _replayed(run)
    runs = report.load_runs([tmp_path / "x"])
    md, files = report.build_report(runs, tmp_path / "out")
    titles = [line[3:] for line in md.splitlines() if line.startswith("## Crossover, replayed acceptance")]
    assert len(titles) == 4
    for route in ("zipf s=1.2 reuse 0.5", "routing: uniform", "routing: random router"):
        assert sum(route in t for t in titles) == 1, route
    assert all("parametric, mean 2.5 at depth 5" in t for t in titles)
    shapes = [f for f in files if f.startswith("crossover_dense_vs_moe_01_")]
    assert sorted(f.rsplit(".", 1)[1] for f in shapes) == ["pdf", "png"]
    assert "Crossover, dense vs MoE" in md and "random router solid, uniform dashed, zipf dotted" in md
