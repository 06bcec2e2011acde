"""kernels_triton/options.py: the kernel switches are validated, flip in-process, and reach the
launchers at launch time (the other path runs). PDL is checked in test_attention.py
(test_pdl_on_off_and_cuda_only), the fused layers end to end in test_linear.py
(test_model_routes_one_row_to_gemv_at_any_weight_size, test_fused_rows_option_routes_tree_verify_rows)."""

import argparse
import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def test_defaults_and_validation(kernel_options):
    o = kernel_options.get()
    assert o.as_dict() == dict(pdl=True, fused_linear=True, step_kernels=None, fused_rows=None,
                               stream_tiles="builtin", warp_tiles=False, fused_moe=True, exact=False)
    for name, bad, needle in (("fused_linear", "yes", "true, false"), ("pdl", None, "true, false"),
                              ("pdl", "late", "true, false"),
                              ("fused_rows", 65, "1..64"), ("fused_rows", 0, "1..64"), ("fused_rows", True, "1..64"),
                              ("fused_rows", "17", "1..64"),
                              ("step_kernels", "on", "null (wherever Triton runs), true, false")):
        with pytest.raises(ValueError, match=name) as e:
            kernel_options.set_(**{name: bad})
        assert needle in str(e.value)
    with pytest.raises(ValueError, match="unknown kernel option.*small_m.*valid: pdl, fused_linear"):
        kernel_options.set_(small_m="dot")  # a decided A/B is no switch any more
    with pytest.raises(ValueError):  # one bad field: nothing is applied
        kernel_options.set_(fused_linear=False, pdl="sometimes")
    assert kernel_options.get() == o


def test_set_and_use_restore(kernel_options):
    old = kernel_options.set_(fused_linear=False)
    assert old.fused_linear and not kernel_options.get().fused_linear
    with kernel_options.use(pdl=False, fused_rows=8) as inside:
        assert (inside.pdl, inside.fused_rows, inside.fused_linear) == (False, 8, False)
        assert kernel_options.get() is inside
    assert kernel_options.get() == kernel_options.KernelOptions(fused_linear=False)
    with pytest.raises(RuntimeError):
        with kernel_options.use(step_kernels=False):
            raise RuntimeError("the block fails")
    assert kernel_options.get().step_kernels is None  # restored on the way out
    assert kernel_options.set_(pdl="off").pdl is True and kernel_options.get().pdl is False  # `kernels.pdl=off`


def test_command_line_flags(kernel_options):
    ap = argparse.ArgumentParser()
    kernel_options.add_flags(ap)
    opts = kernel_options.set_from_flags_(ap.parse_args(["--pdl", "off", "--step-kernels", "false"]))
    assert (opts.pdl, opts.step_kernels) == (False, False)
    assert opts.fused_linear and opts.stream_tiles == "builtin"  # flags not given keep their values
    assert kernel_options.set_from_flags_(ap.parse_args(["--pdl", "True"])).pdl is True
    assert kernel_options.set_from_flags_(ap.parse_args(["--fused-rows", "64"])).fused_rows == 64
    assert kernel_options.set_from_flags_(ap.parse_args(["--fused-rows", "null"])).fused_rows is None
    with pytest.raises(SystemExit, match="--fused-rows: kernel option fused_rows='99'.*1..64"):
        kernel_options.set_from_flags_(ap.parse_args(["--fused-rows", "99"]))
    with pytest.raises(SystemExit, match="--pdl: kernel option pdl='null'; valid: true, false"):
        kernel_options.set_from_flags_(ap.parse_args(["--pdl", "null"]))
    with pytest.raises(SystemExit, match="--fused-linear: kernel option fused_linear='maybe'"):
        kernel_options.set_from_flags_(ap.parse_args(["--fused-linear", "maybe"]))
    with pytest.raises(ValueError, match="unknown kernel option 'norm_stats'"):
        kernel_options.parse_value("norm_stats", "fold")


@pytest.mark.skipif(DEVICE == "cpu" and not INTERPRETED, reason="Triton kernels on CPU need the interpreter")
def test_step_kernels_option_switches_the_dispatch(monkeypatch, kernel_options):
    # backend "triton": the step kernels by default; step_kernels=False: the torch versions, same
    # values. backend "auto" on CPU tensors: the torch versions, unless step_kernels=True (interpreter).
    from kernels_triton import paging, tree_mask
    from specdec.engine import step_ops
    from specdec.spec import tree_ops

    calls = []
    for mod, name in ((paging, "block_meta"), (paging, "block_meta_ref"), (tree_mask, "ancestor_masks"),
                      (tree_mask, "ancestor_masks_ref")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    parents = torch.tensor([[-1, 0, 0, 1, 3], [-1, 0, 1, 1, 2]], dtype=torch.int32, device=DEVICE)
    start = torch.tensor([5, 17], dtype=torch.int32, device=DEVICE)
    valid = torch.tensor([True, True], device=DEVICE)
    table = torch.arange(16, dtype=torch.int32, device=DEVICE).reshape(2, 8)

    def run(backend):
        calls.clear()
        masks = tree_ops.ancestor_masks(parents, 4, backend=backend)
        meta = step_ops.block_meta(start, valid, table, 3, 4, backend=backend)
        return calls[:], masks, meta

    kernels, refs = ["ancestor_masks", "block_meta"], ["ancestor_masks_ref", "block_meta_ref"]
    want = {(None, "triton"): kernels, (False, "triton"): refs, (None, "auto"): refs, (True, "auto"): kernels}
    if DEVICE == "cuda":  # "auto" on CUDA tensors is the Triton backend
        want[None, "auto"] = want[True, "auto"] = kernels
    results = {}
    for (flag, backend), names in want.items():
        kernel_options.set_(step_kernels=flag)
        got, masks, meta = run(backend)
        assert got == names, (flag, backend, got)
        results[flag, backend] = (masks, meta)
    base_masks, base_meta = results[False, "triton"]
    for masks, meta in results.values():  # every path computes the same values
        assert torch.equal(masks, base_masks)
        for a, b in zip(meta, base_meta):
            assert torch.equal(a, b)


@pytest.mark.skipif(DEVICE == "cpu" and not INTERPRETED, reason="Triton kernels on CPU need the interpreter")
def test_qkv_trigger_is_early_for_small_weights_only(monkeypatch, kernel_options):
    # Under PDL (forced here: the CPU interpreter has none), the qkv kernel's trigger is early for small
    # weights, late above QKV_EARLY_MAX_BYTES; other projections trigger late.
    from kernels_triton import linear as lin
    from kernels_triton.attention_launch import PDL_EARLY, PDL_LATE

    seen = []

    class Recorder:  # stands in for the kernel: records the launch's PDL mode, computes nothing
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append(kw["USE_PDL"])

    monkeypatch.setattr(lin, "pdl_mode", lambda device: PDL_LATE)
    monkeypatch.setattr(lin, "_fused_linear_kernel", Recorder())
    HQ, HKV, D, K = 2, 1, 16, 32
    x = torch.randn(1, K, device=DEVICE)
    w = torch.randn((HQ + 2 * HKV) * D, K, device=DEVICE)
    nw = torch.ones(K, device=DEVICE)
    kc = torch.zeros(4, 4, HKV, D, device=DEVICE)
    from kernels_triton.rope import rope_tables

    cos, sin = rope_tables(D, 64, 10000.0, device=DEVICE)
    pos = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    slots = torch.zeros(1, dtype=torch.int64, device=DEVICE)

    def trigger():
        seen.clear()
        lin.norm_qkv_rope_write_kv_(x, None, nw, 1e-5, w, HQ, HKV, pos, cos, sin, kc, kc.clone(), slots)
        assert seen and len(set(seen)) == 1
        return seen[0]

    assert trigger() == PDL_EARLY  # 6 KB of weights
    monkeypatch.setattr(lin, "QKV_EARLY_MAX_BYTES", 100)
    assert trigger() == PDL_LATE
    seen.clear()
    lin.linear(x, w)  # other projections keep the late trigger
    assert seen == [PDL_LATE]


def test_run_applies_the_kernels_group(kernel_options):
    # specdec.run / specdec.train set every field from cfg.kernels (missing ones: defaults, so an
    # earlier job of a multirun in the same process leaves nothing behind); bad values are ConfigErrors.
    from omegaconf import OmegaConf

    from specdec.errors import ConfigError
    from specdec.run import apply_kernel_options

    kernel_options.set_(fused_linear=False, fused_rows=8)
    got = apply_kernel_options(OmegaConf.create({"kernels": {"pdl": "off", "step_kernels": False}}))
    assert got == dict(kernel_options.KernelOptions(pdl=False, step_kernels=False).as_dict())
    assert kernel_options.get().as_dict() == got
    with pytest.raises(ConfigError, match="kernels: kernel option fused_linear='no'"):
        apply_kernel_options(OmegaConf.create({"kernels": {"fused_linear": "no"}}))
    with pytest.raises(ConfigError, match="kernels: unknown kernel option.*wide_topk"):
        apply_kernel_options(OmegaConf.create({"kernels": {"wide_topk": True}}))
    # conf/kernels/default.yaml names every switch at its default; exact is engine.exact (conf/engine/)
    import pathlib

    root = pathlib.Path(__file__).parents[1] / "conf"
    conf = OmegaConf.load(root / "kernels" / "default.yaml")
    defaults = kernel_options.KernelOptions().as_dict()
    assert OmegaConf.to_container(conf) == {k: v for k, v in defaults.items() if k != "exact"}
    assert OmegaConf.load(root / "engine" / "default.yaml").exact is defaults["exact"] is False
    # engine.exact reaches the options with the kernels group, and a multirun's next job resets it
    cfg = {"kernels": {}, "engine": {"exact": True}}
    assert apply_kernel_options(OmegaConf.create(cfg))["exact"] is True and kernel_options.get().exact
    assert apply_kernel_options(OmegaConf.create({"kernels": {}}))["exact"] is False
    with pytest.raises(ConfigError, match="engine.exact"):
        apply_kernel_options(OmegaConf.create({"kernels": {}, "engine": {"exact": "maybe"}}))


def test_stream_tiles_builtin_tables(kernel_options):
    # The default reads the packaged tables: each one loads, holds on its own device only (CPU tensors
    # see none of the H200 entries), and "builtin" on a command line names them.
    assert kernel_options.get().stream_tiles == "builtin"
    paths = kernel_options.builtin_tile_paths()
    assert paths and all(kernel_options.load_tiles(p)["entries"] for p in paths)
    h200 = kernel_options.tile_entries("builtin", "NVIDIA H200")
    assert any(e["n"] == 3072 and e["k"] == 576 and e["rows"][0] <= 17 <= e["rows"][1] for e in h200)
    assert kernel_options.tile_entries("builtin", "cpu") == ()
    assert kernel_options.parse_value("stream_tiles", " Builtin ") == "builtin"
    assert kernel_options.set_(stream_tiles=None).stream_tiles == "builtin"
    assert kernel_options.get().stream_tiles is None


def test_stream_tiles_names_a_checked_table(tmp_path, kernel_options):
    # The option holds a path; a missing or malformed table fails when the option is set, naming the
    # file and the fault; "null" on a command line clears it.
    import json

    good = tmp_path / "tiles.json"
    entry = {"n": 576, "k": 1536, "rows": [16, 24], "config": {"block_n": 16, "split_k": 3}}
    good.write_text(json.dumps({"device": "NVIDIA H200", "source": "grid", "entries": [entry]}))
    assert kernel_options.set_(stream_tiles=str(good)) is not None
    assert kernel_options.tiles(str(good))["entries"] == [{**entry, "rows": (16, 24)}]
    cases = {"missing": (None, "cannot read the tile table"),
             "notjson": ("{", "is not a tile table"),
             "nodevice": (json.dumps({"entries": []}), '"device"'),
             "badrows": (json.dumps({"device": "x", "entries": [{**entry, "rows": [24, 16]}]}), "entry 0 needs"),
             "badkey": (json.dumps({"device": "x", "entries": [{**entry, "config": {"BLOCK_M": 16}}]}),
                        "config keys must be among block_n"),
             "badvalue": (json.dumps({"device": "x", "entries": [{**entry, "config": {"split_k": 0}}]}),
                          "positive integer")}
    for name, (text, needle) in cases.items():
        path = tmp_path / f"{name}.json"
        if text is not None:
            path.write_text(text)
        with pytest.raises(ValueError, match="stream_tiles") as e:
            kernel_options.set_(stream_tiles=str(path))
        assert needle in str(e.value) and str(path) in str(e.value), (name, str(e.value))
        assert kernel_options.get().stream_tiles == str(good)  # nothing applied
    with pytest.raises(ValueError, match="path of a tile table"):
        kernel_options.set_(stream_tiles=3)
    assert kernel_options.parse_value("stream_tiles", "null") is None
    assert kernel_options.parse_value("stream_tiles", f" {good} ") == str(good)
