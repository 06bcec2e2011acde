"""policy=bandit: measured arms per load bucket over goodput's model, with a simulated clock; its
config and errors; greedy identity through the engine."""

import random

import pytest
from omegaconf import OmegaConf
from test_engine import reference, tiny_model
from test_spec import repetitive_prompts, run_engine

from specdec.errors import ConfigError
from specdec.policy import Bandit, BatchView, Goodput, StepStats, build_policy
from specdec.spec import NgramDrafter

# The model's start-up table (ms): speculation looks slow at every batch, so goodput's model picks 0.
MODEL_TABLE = {0: {1: 1.0, 64: 2.0}, 4: {1: 3.0, 64: 12.0}}


class World:
    """A simulated server: per step, ms and tokens committed per row as functions of (k, batch)."""

    def __init__(self, ms, tokens, noise=0.0, seed=0):
        self.ms, self.tokens, self.noise = ms, tokens, noise
        self.now = 0.0
        self.rng = random.Random(seed)

    def clock(self):
        return self.now / 1e3

    def commit(self, k, n):
        mean = self.tokens(k, n)
        if self.noise:
            return [max(1, round(self.rng.gauss(mean, self.noise * mean))) for _ in range(n)]
        return [mean] * n


def bandit(world, arms=("goodput", "always", "never"), **kw):
    model = Goodput([4], margin=0.0, explore_every=0, probe_rows=1)
    model.set_table(MODEL_TABLE)
    pol = Bandit(model, arms, **kw)
    pol.clock = world.clock
    return pol


def serve(pol, world, n, steps, overlap=False, prefilling=0):
    """Run ``steps`` decode iterations at batch n; returns the k of each. With ``overlap`` a step's
    update comes after the next choice (the engine's overlapped decoding)."""
    ks, pending = [], None
    for _ in range(steps):
        k = pol.choose(BatchView(num_decode=n, num_waiting=0, rows=tuple(range(n)), num_prefilling=prefilling))
        ks.append(k)
        stats = StepStats(k=k, num_decode=n, committed=world.commit(k, n), rows=list(range(n)))
        world.now += world.ms(k, n)
        if overlap:
            if pending is not None:
                pol.update(pending)
            pending = stats
        else:
            pol.update(stats)
    if pending is not None:
        pol.update(pending)
    return ks


def low_c_world(noise=0.0):
    # batch 1: a 4-token draft commits 2.2 tokens in 0.8 ms against 1 in 0.56 (always wins 1.54x)
    # batch 64: the verify costs 4x a plain step for 1.5x the tokens (never wins)
    return World(ms=lambda k, n: (0.56 if k == 0 else 0.8) if n <= 8 else (2.0 if k == 0 else 8.0),
                 tokens=lambda k, n: 1 if k == 0 else (2.2 if n <= 8 else 1.5), noise=noise)


def test_bandit_runs_the_measured_best_arm_where_the_model_is_wrong():
    """goodput's table says speculation loses at every batch; at batch 1 it wins 1.54x. The bandit
    measures each arm once, then runs always at batch 1 and never (or goodput's k = 0) at 64."""
    world = low_c_world()
    pol = bandit(world, block_rows=64)
    ks = serve(pol, world, 1, 3000)
    assert ks[1:4] == [0, 0, 0]  # goodput's arm first: one first try of k = 4, then its model picks 0
    tail = ks[1000:]
    assert sum(k == 4 for k in tail) / len(tail) > 0.95
    st = pol.describe()["buckets"]["1"]
    assert st["always"]["tok_per_s"] == pytest.approx(2.2 / 0.8 * 1e3, rel=0.01)  # measured exactly
    assert st["never"]["tok_per_s"] == pytest.approx(1 / 0.56 * 1e3, rel=0.01)
    # batch 64 is another bucket: measured afresh, and speculation off wins there
    ks64 = serve(pol, world, 64, 2000)
    assert sum(k == 0 for k in ks64[200:]) / len(ks64[200:]) > 0.97
    assert pol.describe()["buckets"]["64"]["always"]["blocks"] >= 1


def test_bandit_exploration_costs_at_most_its_budget():
    """An arm trailing the best by d is re-measured every d * (arms - 1) / explore_cost blocks: at
    explore_cost 0.01 the time in trailing arms, priced by their deficit, stays under 1% once every
    arm has been measured."""
    world = low_c_world()
    pol = bandit(world, block_rows=64, explore_cost=0.01)
    serve(pol, world, 1, 500)  # every arm measured
    start = world.now
    ks = serve(pol, world, 1, 20000)
    best = 2.2 / 0.8
    lost = sum(world.ms(k, 1) * (1 - (world.tokens(k, 1) / world.ms(k, 1)) / best) for k in ks)
    assert 0 < lost / (world.now - start) < 0.012
    # a nearly equal arm is re-measured often, a far one rarely
    pol2 = bandit(world, block_rows=64, explore_cost=0.01)
    near = World(ms=lambda k, n: 0.56 if k == 0 else 0.8, tokens=lambda k, n: 1 if k == 0 else 1.45)  # 1.013x
    pol2.clock = near.clock
    serve(pol2, near, 1, 20500)
    assert pol.switches > 0 and pol2.switches > 5 * pol.switches


def test_bandit_measures_the_same_rates_under_overlapped_updates():
    """With overlapped decoding a step's tokens come back one choice late: tags keep each step's
    tokens in the block that launched it, so the measured rates equal the true ones."""
    world = low_c_world()
    pol = bandit(world, block_rows=64)
    serve(pol, world, 1, 2000, overlap=True)
    st = pol.describe()["buckets"]["1"]
    assert st["always"]["tok_per_s"] == pytest.approx(2.2 / 0.8 * 1e3, rel=0.02)
    assert st["never"]["tok_per_s"] == pytest.approx(1 / 0.56 * 1e3, rel=0.02)
    assert not pol._closed or all(b.pending >= 0 for b in pol._closed.values())


def test_bandit_follows_a_load_change_and_holds_through_noise():
    """Noisy per-row acceptance (30% sd): the best arm still holds at each load, and a return to a
    bucket picks up its measurements where they were."""
    world = low_c_world(noise=0.3)
    pol = bandit(world, block_rows=128)
    for n, best in ((1, 4), (64, 0), (1, 4), (64, 0)):
        ks = serve(pol, world, n, 3000)
        assert sum(k == best for k in ks[-2000:]) / 2000 > 0.9, (n, best)


def test_bandit_measures_nothing_during_a_ramp_up():
    """While the requests still prefilling outnumber the decode rows, no block is measured and the
    model's arm runs."""
    world = low_c_world()
    pol = bandit(world, block_rows=8)
    ks = serve(pol, world, 2, 200, prefilling=10)
    assert set(ks[1:]) == {0}  # goodput's model throughout (a first try of k = 4, then 0)
    assert all(a["blocks"] == 0 for a in pol.describe()["buckets"].get("16", {}).values())


def test_bandit_load_bucket_counts_requests_still_prefilling():
    assert Bandit.bucket(BatchView(num_decode=3, num_waiting=0, num_prefilling=2)) == 8
    assert Bandit.bucket(BatchView(num_decode=1, num_waiting=5)) == 1
    assert Bandit.bucket(BatchView(num_decode=16, num_waiting=0)) == 16


def test_bandit_fixed_arms_and_choices():
    model = Goodput([2, 4, 8])
    pol = Bandit(model, ["always", "never", "2"])
    assert pol.arm_k == {"always": 8, "never": 0, "always2": 2}
    assert pol.choices == (0, 2, 8)  # the engine captures no path the bandit cannot reach
    assert Bandit(Goodput([2, 4]), ["goodput", "never"]).choices == (0, 2, 4)
    for arms in (["always"], ["always", "8"], ["goodput", "sometimes"], ["goodput", "3"]):
        with pytest.raises(ConfigError, match="policy bandit"):
            Bandit(Goodput([4, 8]), arms)
    with pytest.raises(ConfigError, match="explore_cost"):
        Bandit(Goodput([4]), ["always", "never"], explore_cost=0)


def test_bandit_from_config_takes_goodputs_keys():
    cfg = OmegaConf.create({"name": "bandit", "arms": ["goodput", "always"], "block_rows": 64, "margin": 0.1,
                            "shadow_evals": 2, "profile_context": 96})
    pol = build_policy(cfg, sizes=[2, 4])
    assert isinstance(pol, Bandit) and pol.block_rows == 64
    assert pol.model.margin == 0.1 and pol.shadow_evals == 2 and pol.profile_context == 96
    assert pol.ks == (0, 2, 4) and pol.arm_k == {"goodput": None, "always": 4}
    with pytest.raises(ConfigError, match="unknown policy"):
        build_policy(OmegaConf.create({"name": "bandits"}), sizes=[2])


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(layers=2)


def test_bandit_through_the_engine_stays_greedy_identical(tiny):
    """The engine calibrates the model, feeds shadow samples and iteration times through the bandit;
    whatever arms it runs (small blocks, so several), greedy output equals plain greedy."""
    prompts = repetitive_prompts(5, seed=4)
    want = [reference(tiny, p, 14) for p in prompts]
    model = Goodput([2, 4], profile_context=40, shadow_evals=2)
    pol = Bandit(model, ["goodput", "always", "never"], block_iters=2, block_rows=2, settle=1)
    got, engine = run_engine(tiny, prompts, 14, drafter=NgramDrafter(), policy=pol, max_batch=4)
    assert got == want
    assert model.table is not None and model.shadowed  # the hooks reached the model
    st = pol.describe()
    measured = {a for b in st["buckets"].values() for a, s in b.items() if s["blocks"]}
    assert len(measured) >= 2
    engine.check()


def test_bandit_drops_a_choice_that_launched_no_step():
    """A choice whose step never launched (the batch emptied by preemption) leaves a tag behind; the
    next fed step, of another k (an explicit ``engine.step(k)``), drops it and counts for no block."""
    world = low_c_world()
    pol = bandit(world, arms=("always", "never"), block_rows=64, settle=0)
    assert pol.choose(BatchView(num_decode=1, num_waiting=0)) == 4  # tagged, never launched
    pol.update(StepStats(k=0, num_decode=1, committed=[1]))
    assert pol._block.tokens == 0 and pol._block.pending == 0 and not pol._tags
