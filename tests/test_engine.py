"""The serving engine against the single-request reference: batching, chunked prefill, paging.

The invariant: every request's greedy output is token-identical to generate_reference on that
request alone, whatever else is in the batch (arrivals, chunking, preemption, aborts, rejections).
On the CPU in fp32 with the torch references this holds exactly. (On a GPU in bf16, matmul
numerics depend on the batch size, so near-ties can flip; GPU tests compare at fp32.)
"""

import pytest
import torch

from specdec.engine.engine import Engine, EngineConfig
from specdec.engine.reference import generate_reference
from specdec.errors import ConfigError
from specdec.models.llama import LlamaModel
from specdec.models.families import ModelConfig

VOCAB = 128


def tiny_model(seed=0, layers=2, max_pos=256, device="cpu", backend="torch"):
    """A tiny random Llama whose logits are peaked (std 1/sqrt(fan_in) weights), so argmax is
    well separated and exact-equality tests are about logic, not rounding."""
    cfg = ModelConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, head_dim=16,
                      max_position_embeddings=max_pos, rope_theta=10000.0)
    model = LlamaModel.random(cfg, dtype="float32", seed=seed, backend=backend)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "embed":
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return model.to(device).init_rope()


def rand_prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def reference(model, prompt, max_new, eos=()):
    return generate_reference(model, prompt, max_new, eos_ids=eos).token_ids


def drive(engine, arrivals, max_new, *, check=True, aborts=None, max_steps=10_000):
    """Add (step, prompt) arrivals at their steps, abort {step: index}; run to the end.

    Returns the requests, and with ``aborts`` also the indices whose abort found them unfinished.
    """
    pending = sorted(arrivals, key=lambda a: a[0])
    want_aborted = aborts is not None
    aborts = dict(aborts or {})
    aborted = []
    reqs = [None] * len(pending)
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    step = 0
    while step < max_steps:
        for i in order:
            if arrivals[i][0] == step:
                mn = max_new[i] if isinstance(max_new, list) else max_new
                reqs[i] = engine.add_request(arrivals[i][1], mn)
        for s, i in list(aborts.items()):
            if s == step and reqs[i] is not None and engine.abort(reqs[i].id):
                aborted.append(i)
        if not engine.has_work() and step > max(a[0] for a in arrivals):
            break
        engine.step()
        if check:
            engine.check()
        step += 1
    engine.flush_trace()
    if check:
        engine.check()
    return (reqs, aborted) if want_aborted else reqs


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def test_smollm2_concurrent_requests_match_reference(smollm2, smollm2_tokenizer):
    questions = ["What is 17 * 23?", "Name three primary colors and say why they matter.",
                 "def is_prime(n):"]
    prompts = [smollm2_tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    max_new = 6
    engine = Engine(smollm2, EngineConfig(max_batch_size=4, kv_cache_tokens=1024, prefill_chunk=40),
                    eos_ids=[2])
    reqs = drive(engine, [(0, prompts[0]), (1, prompts[1]), (3, prompts[2])], max_new)
    for p, r in zip(prompts, reqs):
        assert r.output_ids == reference(smollm2, p, max_new, eos=[2]), r.id


@pytest.mark.parametrize("page_size,prefill_chunk,max_batch,pad,overlap", [
    (1, 5, 3, False, False), (4, 64, 8, True, False), (16, 7, 2, False, False), (8, 1000, 5, True, False),
    (4, 64, 8, True, True), (16, 7, 2, False, True)])
def test_tiny_batched_matches_reference(tiny, page_size, prefill_chunk, max_batch, pad, overlap):
    lengths = [1, 2, 9, 17, 33, 5, 60]
    prompts = rand_prompts(lengths, seed=page_size)
    max_new = [12, 5, 20, 8, 3, 16, 10]
    arrivals = [(s, p) for s, p in zip([0, 0, 1, 2, 2, 5, 9], prompts)]
    engine = Engine(tiny, EngineConfig(max_batch_size=max_batch, page_size=page_size, kv_cache_tokens=2048,
                                       prefill_chunk=prefill_chunk, pad_eager=pad,
                                       graph_buckets=(1, 2, 4), overlap=overlap))
    assert engine.overlap == overlap
    reqs = drive(engine, arrivals, max_new)
    for p, n, r in zip(prompts, max_new, reqs):
        assert r.finish_reason == "length"
        assert r.output_ids == reference(tiny, p, n), (len(p), r.id)


def test_chunked_prefill_gives_same_tokens(tiny):
    prompt = rand_prompts([75], seed=3)[0]
    outs = []
    for chunk in (1, 7, 32, 4096):
        engine = Engine(tiny, EngineConfig(page_size=4, kv_cache_tokens=512, prefill_chunk=chunk))
        r = engine.add_request(prompt, 10)
        engine.run_until_done()
        outs.append(r.output_ids)
    assert all(o == outs[-1] for o in outs)
    assert outs[-1] == reference(tiny, prompt, 10)


@pytest.mark.parametrize("overlap", [False, True])
def test_page_accounting_exact_with_aborts_and_preemptions(tiny, overlap):
    lengths = [3, 14, 7, 22, 1, 9, 30, 5, 12, 18, 2, 26, 8, 11, 4, 16]
    prompts = rand_prompts(lengths, seed=7)
    max_new = [6 + (i * 5) % 17 for i in range(len(prompts))]
    arrivals = [(i // 3, p) for i, p in enumerate(prompts)]
    # 24 pages of 4 slots = 96 slots: far less than the ~500 the requests need together.
    trace = []
    engine = Engine(tiny, EngineConfig(max_batch_size=6, page_size=4, kv_cache_tokens=96, prefill_chunk=16,
                                       overlap=overlap), trace=trace.append)
    # step -> request index; request i arrives at step i // 3, so 15 is aborted while still queued
    aborts = {3: 2, 6: 6, 8: 12, 5: 15}
    reqs, aborted = drive(engine, arrivals, max_new, aborts=aborts)
    assert sorted(aborted) == [2, 6, 12, 15]
    assert reqs[15].output_ids == []
    assert engine.scheduler.num_preemptions > 0, "pool too large: the test must force preemption"
    assert any(r.num_preemptions for r in reqs)
    assert engine.kv.num_free == engine.kv.num_pages
    assert engine.state.num_rows == 0 and not engine.scheduler.admitted
    for i, (p, n, r) in enumerate(zip(prompts, max_new, reqs)):
        assert r.finished
        if i in aborted:
            assert r.finish_reason == "abort"
            assert r.output_ids == reference(tiny, p, n)[: len(r.output_ids)]
        else:
            assert r.finish_reason == "length"
            assert r.output_ids == reference(tiny, p, n), (i, r.num_preemptions)
    assert sum(s["preempted"] for s in trace) == engine.scheduler.num_preemptions
    assert max(s["running"] for s in trace) <= 6


def test_too_long_request_rejected_others_finish(tiny):
    prompts = rand_prompts([10, 200, 6, 40], seed=11)
    engine = Engine(tiny, EngineConfig(page_size=8, kv_cache_tokens=128, max_batch_size=4))
    reqs = [engine.add_request(p, 8) for p in prompts]
    too_long_pos = engine.add_request(prompts[0], 250)  # 10 + 250 > 256 positions
    finished = engine.run_until_done()
    assert reqs[1].finish_reason == "error" and "KV pages" in reqs[1].error
    assert "200 tokens" in reqs[1].error and "kv_cache_tokens" in reqs[1].error
    assert too_long_pos.finish_reason == "error" and "256 positions" in too_long_pos.error
    assert reqs[1] in finished and too_long_pos in finished
    for i in (0, 2, 3):
        assert reqs[i].output_ids == reference(tiny, prompts[i], 8)
    assert engine.kv.num_free == engine.kv.num_pages
    empty = engine.add_request([], 4)
    assert "empty prompt" in empty.error


def test_unconfigured_k_is_rejected_before_any_change(tiny):
    with pytest.raises(ConfigError, match="need a drafter"):
        Engine(tiny, EngineConfig(kv_cache_tokens=256), ks=(2,))
    engine = Engine(tiny, EngineConfig(kv_cache_tokens=256))
    engine.add_request([1, 2, 3], 4)
    with pytest.raises(ConfigError, match="k=2 was not configured"):
        engine.step(k=2)
    assert engine.num_waiting == 1  # nothing was admitted or changed


@pytest.mark.parametrize("overlap", [False, True])
def test_eos_and_ignore_eos(tiny, overlap):
    prompt = rand_prompts([12], seed=5)[0]
    ref = reference(tiny, prompt, 16)
    eos = ref[4]
    first = ref.index(eos)
    engine = Engine(tiny, EngineConfig(kv_cache_tokens=256, overlap=overlap), eos_ids=[eos])
    a = engine.add_request(prompt, 16)
    b = engine.add_request(prompt, 16, ignore_eos=True)
    engine.run_until_done()
    assert a.finish_reason == "eos" and a.output_ids == ref[: first + 1]
    assert b.finish_reason == "length" and b.output_ids == ref


def test_commit_of_several_tokens_a_row_stops_at_eos_and_length(tiny):
    """A step's tokens for a row (a speculative step commits several): kept up to and including the
    first EOS (unless ignore_eos) or up to max_new_tokens, the rest dropped; the row's committed length
    still advances by every token the step wrote (its KV holds them until the request leaves)."""
    engine = Engine(tiny, EngineConfig(kv_cache_tokens=512), eos_ids=[VOCAB - 1])
    eos = VOCAB - 1
    prompts = rand_prompts([6, 7, 8, 9, 10], seed=11)
    reqs = [engine.add_request(prompts[0], 20), engine.add_request(prompts[1], 20),
            engine.add_request(prompts[2], 20, ignore_eos=True), engine.add_request(prompts[3], 4),
            engine.add_request(prompts[4], 20)]
    engine.step(0)  # prefill and one decode step each
    sched = engine.scheduler
    assert [len(r.output_ids) for r in reqs] == [1] * 5 and all(r.finish_reason is None for r in reqs)
    before = [(list(r.output_ids), r.seq_len, len(r.token_times)) for r in reqs]
    seq_before = list(engine.state.seq_lens_host)
    toks = [[1, 2, 3], [4, eos, 5], [eos, 6], [7, 8, 9], [eos]]  # row 3: exactly its last 3 of 4 outputs
    kept = sched.commit_tokens_([(r, r.row_epoch) for r in reqs], toks, 1.0)
    assert kept == toks
    took = [3, 2, 2, 3, 1]  # all / through EOS / EOS ignored / up to max_new_tokens = 4 / the EOS alone
    for r, (out, seq, nt), t, n in zip(reqs, before, toks, took):
        assert r.output_ids == out + t[:n] and r.seq_len == seq + len(t) and len(r.token_times) == nt + n
    assert [r.finish_reason for r in reqs] == [None, "eos", None, "length", "eos"]
    assert engine.state.seq_lens_host == [s + len(t) for s, t in zip(seq_before, toks)][:1] + [seq_before[2] + 2]
    assert [r.id for r in sched.rows] == [reqs[0].id, reqs[2].id]


def test_overlapped_decoding_commits_one_iteration_later(tiny):
    """engine.overlap: each iteration queues its decode step and then commits the previous one, so
    a request's tokens arrive one iteration late, the finished request's extra step is dropped,
    and the engine drains to the same tokens with every page back."""
    from specdec.engine.engine import _use_overlap

    prompt = rand_prompts([10], seed=8)[0]
    engine = Engine(tiny, EngineConfig(kv_cache_tokens=256, overlap=True))
    r = engine.add_request(prompt, 4)
    engine.step()  # prefill + launch of step 1; nothing to commit yet
    assert r.output_ids == [] and engine._inflight is not None
    engine.step()  # launch of step 2, commit of step 1
    assert len(r.output_ids) == 1
    steps = 2
    while engine.has_work():
        engine.step()
        steps += 1
        engine.check()
    assert r.output_ids == reference(tiny, prompt, 4) and r.finish_reason == "length"
    assert steps == 4 + 2  # 4 launches that count, one wasted launch, one iteration to drain it
    assert engine.kv.num_free == engine.kv.num_pages and engine._inflight is None
    # auto: CUDA graphs and no host-context drafter; bad values are named
    assert not Engine(tiny, EngineConfig(kv_cache_tokens=256)).overlap  # CPU: no graphs
    assert _use_overlap("auto", True, None) and not _use_overlap("auto", False, None)
    assert _use_overlap("auto", True, type("D", (), {"needs_context": True})())  # its k > 0 steps drain
    with pytest.raises(ConfigError, match="engine.overlap"):
        Engine(tiny, EngineConfig(kv_cache_tokens=256, overlap="sometimes"))


def test_stop_strings(tiny):
    letters = "abcdefghijklmnopqrstuvwxyz"

    def detok(ids):
        return "".join(letters[i % 26] for i in ids)

    prompt = rand_prompts([9], seed=2)[0]
    ref = reference(tiny, prompt, 20)
    stop = detok(ref[6:8])  # a two-token string that first appears at or before position 7
    engine = Engine(tiny, EngineConfig(kv_cache_tokens=256), detokenize=detok)
    r = engine.add_request(prompt, 20, stop=[stop])
    engine.run_until_done()
    assert r.finish_reason == "stop"
    assert stop in detok(r.output_ids) and r.output_ids == ref[: len(r.output_ids)]
    assert len(r.output_ids) <= 8
    no_tok = Engine(tiny, EngineConfig(kv_cache_tokens=256)).add_request(prompt, 4, stop=["x"])
    assert "tokenizer" in no_tok.error


@pytest.mark.parametrize("overlap", [False, True])
def test_sampling_is_seeded(tiny, overlap):
    prompts = rand_prompts([5, 8, 13], seed=4)

    def run(seed):
        engine = Engine(tiny, EngineConfig(kv_cache_tokens=512, temperature=1.0, seed=seed, overlap=overlap))
        reqs = [engine.add_request(p, 12) for p in prompts]
        engine.run_until_done()
        engine.check()
        assert all(len(r.output_ids) == 12 for r in reqs)
        return [r.output_ids for r in reqs]

    a, b, c = run(0), run(0), run(1)
    assert a == b and a != c
    greedy = [reference(tiny, p, 12) for p in prompts]
    assert a != greedy  # temperature 1 on peaked logits still samples something else somewhere


def test_generate_yields_finished_requests(tiny):
    engine = Engine(tiny, EngineConfig(kv_cache_tokens=256))
    reqs = [engine.add_request(p, n) for p, n in zip(rand_prompts([4, 9]), (3, 6))]
    assert list(engine.generate()) == reqs  # the shorter one finishes first
    assert not engine.has_work()


def test_trace_records(tiny):
    trace = []
    engine = Engine(tiny, EngineConfig(kv_cache_tokens=256, prefill_chunk=8), trace=trace.append)
    engine.add_request(rand_prompts([20])[0], 5)
    engine.run_until_done()
    assert [s["step"] for s in trace] == list(range(len(trace)))
    assert sum(s["prefill_tokens"] for s in trace) == 19  # the last prompt token is decoded
    assert sum(s["committed"] for s in trace) == 5
    assert all(s["decode_ms"] > 0 for s in trace if s["decode_bs"])


# Padding rows' attention output is never written (T_b = 0), so the interpreter may overflow on
# that garbage downstream; those rows are discarded.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_batched_prefill_runs_padded_and_matches_reference(tiny):
    """Several chunks in one prefill forward run through the padded static buffers (the shapes a
    CUDA graph replays: packed tokens, empty padding requests); more chunks than the largest
    request bucket run eagerly. Both give the reference tokens."""
    prompts = rand_prompts([5, 23, 2, 11, 40], seed=3)
    for request_buckets, expect_eager in (((1, 2, 4), 0), ((1, 2), 1)):
        engine = Engine(tiny, EngineConfig(max_batch_size=8, page_size=4, kv_cache_tokens=1024, pad_eager=True,
                                           graph_buckets=(1, 2, 4, 8), prefill_chunk=64,
                                           prefill_buckets=(8, 16, 32), prefill_requests=request_buckets))
        runner = engine.stepper.prefill_runner
        assert runner.buckets == [8, 16, 32, 64] and runner.r_max == max(request_buckets)
        padded, eager = [], []
        run_, body = runner.run_, engine.stepper.prefill_body
        runner.run_ = lambda chunks, *a: padded.append((len(chunks), runner.shape_for(chunks))) or run_(chunks, *a)
        engine.stepper.prefill_body = lambda ids, *a: eager.append(ids.numel()) or body(ids, *a)
        # 3 requests arrive together: one 3-chunk forward of 4 + 22 + 1 tokens (a prompt's last
        # token is the first decode input) -> shape (32, 4), or eager with at most 2 requests per
        # shape; then 2 more: 10 + 39 tokens, 2 chunks -> (64, 2).
        reqs = drive(engine, [(0, prompts[0]), (0, prompts[1]), (0, prompts[2]), (2, prompts[3]), (2, prompts[4])], 7)
        for p, r in zip(prompts, reqs):
            assert r.output_ids == reference(tiny, p, 7), (len(p), request_buckets)
        assert (3, (32, 4)) in padded if not expect_eager else eager == [27]
        assert (2, (64, 2)) in padded
        assert len(eager) == expect_eager  # the runner calls its own forward, not prefill_body


def test_deleted_engine_frees_its_kv_pool_without_the_cycle_collector(tiny):
    """`del engine` frees the KV pool (and on the GPU the CUDA graphs and their memory) at once: no
    reference cycle runs through the engine's step and prefill bodies, so a process that builds
    engines one after another (a benchmark sweep, an in-process multirun) does not size each new
    pool from memory the previous engines still hold."""
    import gc
    import weakref

    from specdec.spec import NgramDrafter

    gc.collect()
    gc.disable()
    try:
        for drafter in (None, NgramDrafter()):
            engine = Engine(tiny, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=256, pad_eager=True,
                                               graph_buckets=(1, 4), prefill_buckets=(8,)),
                            drafter=drafter, ks=(0, 2) if drafter else (0,))
            assert engine.stepper.prefill_runner is not None
            engine.add_request([5, 6, 7, 8, 9], 3)
            engine.run_until_done()
            alive = [weakref.ref(engine), weakref.ref(engine.kv.k), weakref.ref(engine.stepper)]
            del engine
            assert [r() is None for r in alive] == [True, True, True], drafter
    finally:
        gc.enable()


def test_prefill_request_buckets_stop_at_the_batch_limit(tiny):
    """No prefill forward holds more chunks than requests in flight: request buckets above
    max_batch_size (but the smallest one that holds it) are never captured."""
    from specdec.engine.graphs import prefill_request_buckets

    assert prefill_request_buckets((1, 8, 64), 1) == [1]
    assert prefill_request_buckets((1, 8, 64), 4) == [1, 8]
    assert prefill_request_buckets((8, 64), 8) == [1, 8]
    assert prefill_request_buckets((1, 8, 64), 9) == [1, 8, 64]
    assert prefill_request_buckets((1, 8, 64), 256) == [1, 8, 64]
    engine = Engine(tiny, EngineConfig(max_batch_size=2, page_size=4, kv_cache_tokens=256, pad_eager=True,
                                       graph_buckets=(1, 2), prefill_chunk=32, prefill_buckets=(8, 16),
                                       prefill_requests=(1, 8, 64)))
    runner = engine.stepper.prefill_runner
    assert runner.request_buckets == [1, 8] and runner.shapes == [(8, 1), (8, 8), (16, 1), (16, 8), (32, 1), (32, 8)]
    prompts = rand_prompts([5, 9], seed=4)
    reqs = drive(engine, [(0, prompts[0]), (0, prompts[1])], 4)
    for p, r in zip(prompts, reqs):
        assert r.output_ids == reference(tiny, p, 4)


def test_padded_prefill_shapes():
    from specdec.engine.graphs import PaddedPrefill
    from specdec.engine.step import PrefillChunk

    runner = PaddedPrefill(lambda *a: None, "cpu", (16, 32, 64), max_pages=4, graphed=False,
                           request_buckets=(8, 2, 32))
    assert runner.request_buckets == [1, 2, 8, 32] and runner.r_max == 32
    assert (16, 32) not in runner.shapes and (32, 32) in runner.shapes and (64, 8) in runner.shapes

    def chunks(*lengths):
        return [PrefillChunk(token_ids=[1] * n, start=0, pages=[0], next_token=0) for n in lengths]

    assert runner.shape_for(chunks(5)) == (16, 1)
    assert runner.shape_for(chunks(20)) == (32, 1)
    assert runner.shape_for(chunks(3, 4, 5)) == (16, 8)
    assert runner.shape_for(chunks(*[1] * 9)) == (32, 32)  # 32 request slots need a 32-token shape
    assert runner.shape_for(chunks(40, 30)) is None  # 70 tokens
    assert runner.shape_for(chunks(*[1] * 33)) is None  # 33 requests
    assert runner.shape_for([]) is None
    with pytest.raises(ConfigError, match="positive"):
        PaddedPrefill(lambda *a: None, "cpu", (0, 16), max_pages=4, graphed=False)


# Padding token rows of a packed prefill belong to no attention row, so their attention output is
# whatever the buffer held; the layers after it may overflow on them (never read, rows independent).
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter path; CUDA runs test_cuda_graphs_match_eager")
@pytest.mark.parametrize("exact", [False, True], ids=["default", "exact"])
def test_triton_kernels_with_bucket_padding(tiny, exact, kernel_options):
    """The Triton kernels (interpreter on the CPU) through the padded shapes a CUDA graph replays:
    padding rows with T_b = 0, kv_len 0 and slot -1 must not disturb the real rows; also with
    engine.exact's kernels."""
    kernel_options.set_(exact=exact)
    model = tiny_model(layers=1, backend="triton")
    ref_model = tiny_model(layers=1, backend="torch")
    prompts = rand_prompts([3, 20, 7], seed=1)
    engine = Engine(model, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=256, pad_eager=True,
                                        graph_buckets=(1, 2, 4), prefill_chunk=16))
    reqs = drive(engine, [(0, prompts[0]), (1, prompts[1]), (2, prompts[2])], 5)
    for p, r in zip(prompts, reqs):
        assert r.output_ids == reference(ref_model, p, 5)


def test_profile_decode_step_returns_pages(tiny):
    engine = Engine(tiny, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=256))
    ms = engine.profile_decode_step(3, 20, iters=3, warmup=1)
    assert ms > 0 and engine.kv.num_free == engine.kv.num_pages and engine.state.num_rows == 0
    r = engine.add_request([5, 6, 7], 4)
    engine.run_until_done()
    assert r.output_ids == reference(tiny, [5, 6, 7], 4)


def test_profiled_moe_rows_route_by_their_own_contexts():
    """An MoE target's own router routes by the rows' hidden states: the profile's borrowed rows get a
    real (prefilled, per-row) context, so the experts a profiled step reads no longer follow whatever the
    pool's pages held (zeros sent every row to the same K experts, noise spread them), the rows route
    apart as served requests do, and the statistics window holds the profiled steps alone."""
    from test_moe_routing import E, K, tiny_moe

    from specdec.engine import profiling

    engine = Engine(tiny_moe(layers=2), EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=512))
    got = []
    for fill in (torch.zeros_like, lambda t: torch.randn_like(t) * 50):
        for pool in (engine.kv.k, engine.kv.v):
            pool.copy_(fill(pool))
        ms, experts = profiling.with_distinct_experts(
            engine.model, lambda: profiling.decode_step_ms(engine, 4, 24, iters=2, warmup=1))
        stats = engine.model.moe_stats()
        assert ms > 0 and stats["forwards"] == 3 and stats["tokens_per_forward"] == 4  # the steps only
        got.append(experts)
    assert got[0] == got[1] and K < got[0] <= E
    assert engine.kv.num_free == engine.kv.num_pages and engine.state.num_rows == 0


def test_profile_decode_step_budget_sizes_the_timed_loop(tiny, monkeypatch):
    """With budget_ms, the last warm-up step is timed and the loop runs only as many steps as fit in
    the budget (at least 2, at most iters): a dear table entry costs a few steps, not iters + warm-up."""
    from specdec.engine import profiling

    engine = Engine(tiny, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=512))
    calls = []
    run_ = engine.stepper.runner.run_
    monkeypatch.setattr(engine.stepper.runner, "run_", lambda *a, **kw: calls.append(1) or run_(*a, **kw))
    clock = iter(range(0, 10_000, 50))  # every perf_counter call 50 s later: each step "takes" 50 s
    monkeypatch.setattr(profiling.time, "perf_counter", lambda: next(clock))
    assert profiling.decode_step_ms(engine, 2, 20, iters=8, warmup=3, budget_ms=1.0) > 0
    assert len(calls) == 2 + 1 + 2  # warm-up 2, the timed warm-up step, then the minimum of 2
    calls.clear()
    profiling.decode_step_ms(engine, 2, 20, iters=8, warmup=3, budget_ms=1e9)
    assert len(calls) == 2 + 1 + 8  # a cheap entry keeps every step
    calls.clear()
    profiling.decode_step_ms(engine, 2, 20, iters=8, warmup=3)
    assert len(calls) == 3 + 8 and engine.kv.num_free == engine.kv.num_pages


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_match_eager():
    # fp32 so that eager and graphed differ only in padding, not in bf16 rounding.
    model = tiny_model(device="cuda", backend="auto")
    prompts = rand_prompts([3, 17, 40, 9, 1], seed=9)
    outs = {}
    for mode in ("graph", "eager_padded"):
        engine = Engine(model, EngineConfig(max_batch_size=8, kv_cache_tokens=4096, page_size=16,
                                            cuda_graphs=mode == "graph", pad_eager=mode != "graph"))
        assert engine.graphed == (mode == "graph")
        # arrivals together and apart: prefill forwards of one and of several requests
        reqs = drive(engine, [(0, prompts[0]), (0, prompts[1]), (1, prompts[2]), (3, prompts[3]), (3, prompts[4])], 24)
        outs[mode] = [r.output_ids for r in reqs]
        if mode == "graph":  # prefills replayed as graphs at padded (tokens, requests) shapes
            assert engine.stepper.prefill_runner is not None and engine.stepper.prefill_runner.graphs
    assert outs["graph"] == outs["eager_padded"]
    assert outs["graph"] == [reference(model, p, 24) for p in prompts]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_prefill_fit_keeps_outputs():
    """Graphed prefill times its buckets at start-up; with a compute-bound table put in their place,
    plans are cut to buckets (two forwards where one padded forward ran) and greedy outputs stay the
    fp32 reference's."""
    model = tiny_model(device="cuda", backend="auto")
    prompts = rand_prompts([20, 20, 40], seed=12)
    engine = Engine(model, EngineConfig(max_batch_size=4, kv_cache_tokens=4096, page_size=16,
                                        prefill_buckets=(16, 32, 64), prefill_chunk=128))
    runner = engine.stepper.prefill_runner
    assert runner.graphs and sorted(runner.forward_ms) == [16, 32, 64, 128] and min(runner.forward_ms.values()) > 0
    runner.forward_ms = {16: 1.0, 32: 2.0, 64: 4.0, 128: 8.0}
    sizes = []
    prefill = engine.stepper.prefill_
    engine.stepper.prefill_ = lambda chunks, draft=True: sizes.append(sum(len(c.token_ids) for c in chunks)) or \
        prefill(chunks, draft=draft)
    reqs = drive(engine, [(0, p) for p in prompts], 12)
    assert sizes[0] == 64 and sum(sizes) == sum(len(p) - 1 for p in prompts)  # 77 tokens: 64, then 13
    assert [r.output_ids for r in reqs] == [reference(model, p, 12) for p in prompts]


def test_prefill_fit_prices_padding_against_a_second_forward():
    """fit_tokens keeps n unless the bucket below n plus a forward over the rest (alone) costs less
    than padding n up, by the runner's bucket timings; no timings: n."""
    from specdec.engine.graphs import PaddedPrefill

    runner = PaddedPrefill(lambda *a: None, "cpu", [128, 256, 512, 1024, 2048], 4, graphed=False)
    assert runner.fit_tokens(1035) == 1035  # not timed (eager): nothing to price
    runner.forward_ms = {128: 4.0, 256: 6.0, 512: 12.0, 1024: 24.0, 2048: 48.0}  # weight-bound below ~200 tokens
    assert runner.fit_tokens(1035) == 1024  # 24 + 4 (11 tokens at 128) < 48
    assert runner.fit_tokens(300) == 256  # 6 + 4 < 12
    assert runner.fit_tokens(1900) == 1900  # 24 + 24 is not below 48
    assert [runner.fit_tokens(n) for n in (100, 512, 2048)] == [100, 512, 2048]  # nothing below / a bucket
    runner.forward_ms = dict.fromkeys(runner.buckets, 1.0)  # launch-bound: padding is free
    assert runner.fit_tokens(1035) == 1035


def test_prefill_fit_defers_the_newest_chunks_and_keeps_outputs(tiny, monkeypatch):
    """With a compute-bound timing table the engine prefills a 38-token plan (two 20-token prompts, the
    last token of each pending) as 32 tokens (the second request's chunk cut short, its last 6 tokens
    in the next forward), outputs equal to the reference; engine.prefill_fit=false keeps one forward."""
    prompts = rand_prompts([20, 20], seed=3)
    sizes = {}
    for fit in (True, False):
        engine = Engine(tiny, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=512, pad_eager=True,
                                           prefill_buckets=(16, 32), prefill_chunk=64, prefill_fit=fit))
        runner = engine.stepper.prefill_runner
        runner.forward_ms = {16: 1.0, 32: 2.0, 64: 4.0}
        seen = sizes[fit] = []
        prefill = engine.stepper.prefill_
        monkeypatch.setattr(engine.stepper, "prefill_",
                            lambda chunks, draft=True, _p=prefill, _s=seen: _s.append(sum(len(c.token_ids) for c in chunks))
                            or _p(chunks, draft=draft))
        reqs = drive(engine, [(0, prompts[0]), (0, prompts[1])], 4)
        for p, r in zip(prompts, reqs):
            assert r.output_ids == reference(tiny, p, 4)
    assert sizes[True] == [32, 6] and sizes[False] == [38]
    with pytest.raises(ConfigError, match="prefill_fit"):
        EngineConfig.from_cfg({"prefill_fit": "sometimes"})


def test_pack_chunks_matches_a_per_chunk_reference():
    """PaddedPrefill's host packing (vectorized) against the per-chunk definition, on random chunks:
    ids, positions start .. start + n - 1, slots through each chunk's pages, next ids, padding (slot
    -1), cu_q_lens (empty requests repeat the total), kv_lens and the page table rows."""
    import random

    import numpy as np

    from specdec.engine.graphs import pack_chunks_
    from specdec.engine.step import PrefillChunk

    rng = random.Random(4)
    ps, max_pages, r_max = 4, 12, 8
    kv0, pt0 = r_max + 1, 2 * r_max + 1
    for _ in range(30):
        C = rng.randrange(1, r_max + 1)
        chunks = []
        for _ in range(C):
            n, start = rng.randrange(1, 9), rng.randrange(0, 20)
            pages = rng.sample(range(100), (start + n + ps - 1) // ps)
            chunks.append(PrefillChunk([rng.randrange(50) for _ in range(n)], start, pages))
        total = sum(len(c.token_ids) for c in chunks)
        N, R = total + rng.randrange(0, 5), rng.randrange(C, r_max + 1)
        nxt = [rng.randrange(50) for _ in range(total)] if rng.random() < 0.5 else None
        tokens = np.full((4, 80), 7, np.int64)
        ints = np.full(pt0 + r_max * max_pages, 7, np.int32)
        assert pack_chunks_(tokens, ints, chunks, ps, N, R, kv0, pt0, max_pages, nxt) == total
        want_t = np.zeros((4, N), np.int64)
        want_t[2] = -1
        want_i = np.zeros_like(ints)
        off = 0
        for b, c in enumerate(chunks):
            for j, tok in enumerate(c.token_ids):
                s = c.start + j
                want_t[:3, off + j] = (tok, s, c.pages[s // ps] * ps + s % ps)
            off += len(c.token_ids)
            want_i[b + 1], want_i[kv0 + b] = off, c.start + len(c.token_ids)
            want_i[pt0 + b * max_pages:pt0 + b * max_pages + len(c.pages)] = c.pages
        want_i[C + 1:R + 1] = off
        if nxt is not None:
            want_t[3, :total] = nxt
        assert (tokens[:, :N] == want_t).all() and (tokens[:, N:] == 7).all() and (ints == want_i).all()
