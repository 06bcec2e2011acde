"""Test setup: run Triton kernels under the interpreter when there is no GPU.

TRITON_INTERPRET must be set before any ``@triton.jit`` decorator runs, i.e. before
``kernels_triton`` is imported, so it is done here at collection time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# specdec.report appends its figures to experiments/results/ledger.csv by default: not from the tests' runs.
os.environ.setdefault("SPECDEC_LEDGER", "none")

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pytest_collection_modifyitems(config, items):
    """The GPU selection (``-m gpu``, a few minutes on a fresh H200, Triton compiles included): the
    tests marked ``gpu`` by hand (CUDA graphs, and one test per integer-only kernel) plus every test
    parametrized over bfloat16, the dtype the GPU serves in. Kernel tests add their bf16 case only on
    CUDA (the interpreter's bf16 tl.dot is wrong), so on a GPU ``-m gpu`` runs every kernel in bf16
    once, without repeating their fp32 / fp16 cases."""
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is not None and any(v is torch.bfloat16 for v in spec.params.values()):
            item.add_marker(pytest.mark.gpu)


@pytest.fixture
def poison(monkeypatch):
    """torch.empty returns garbage-filled tensors (floats NaN, integers -777), so an output element a
    kernel forgets to write fails the comparison. Tests that need more (empty_like, allocation
    counts) define their own."""
    real_empty = torch.empty

    def empty(*a, **kw):
        t = real_empty(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-777)

    monkeypatch.setattr(torch, "empty", empty)


@pytest.fixture(autouse=True)
def kernel_options():
    """kernels_triton.options, back at its defaults after every test (a test that sets an option
    cannot leak it into the next one); yields the module."""
    from kernels_triton import options

    options.reset_()
    yield options
    options.reset_()


@pytest.fixture
def row_invariant_dot(monkeypatch):
    """Under the interpreter, tl.dot is numpy's matmul, and on some CPUs its BLAS kernels sum an output row
    in an order that depends on the row's place in the tile (rows past the first microkernel block differ
    in the last bit); a GPU MMA row depends on its own inputs only. With this fixture each row of every
    interpreted dot is computed on its own, so bit-identity tests check the kernels, not the BLAS."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    from triton.runtime import interpreter

    real = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        rows = []
        for i in range(a.data.shape[-2]):
            ai = interpreter.TensorHandle(a.data[..., i:i + 1, :], a.dtype)
            di = interpreter.TensorHandle(d.data[..., i:i + 1, :], d.dtype)
            rows.append(real(self, ai, b, di, input_precision, max_num_imprecise_acc).data)
        return interpreter.TensorHandle(np.concatenate(rows, axis=-2), d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


@pytest.fixture
def device():
    return DEVICE


def fetch_asset(fetch):
    """fetch() (a specdec.assets getter that may download once). On a machine without network, e.g. a
    lent GPU, SPECDEC_TESTS_OFFLINE=1 turns a failed download into a skip; otherwise it fails the test."""
    from specdec.assets import AssetError

    try:
        return fetch()
    except AssetError as e:
        if os.environ.get("SPECDEC_TESTS_OFFLINE") == "1":
            pytest.skip(f"not in the specdec cache and SPECDEC_TESTS_OFFLINE=1: {str(e).splitlines()[0]}")
        raise


@pytest.fixture(scope="session")
def smollm2_path():
    from specdec.assets import smollm2_dir

    return fetch_asset(smollm2_dir)


@pytest.fixture(scope="session")
def prompts_path():
    from specdec.assets import prompts_dir

    return fetch_asset(prompts_dir)


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    from specdec.models.llama import LlamaModel

    # backend="torch": the full 30-layer model under the Triton interpreter would take minutes;
    # kernels are checked against the same references in their own tests.
    return LlamaModel.from_pretrained(smollm2_path, dtype="float32", backend="torch")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from specdec.models.tokenizer import Tokenizer

    return Tokenizer(smollm2_path)
