"""Kernel source rules the CPU interpreter does not enforce and the GPU launcher does.

- Every @triton.jit kernel reads module globals only as tl.constexpr: the GPU compiler refuses a kernel that
  reads a plain module-level number ("Cannot access global variable ... from within @jit'ed function").
- No kernel argument takes a name of the launcher's own binder: Triton binds a launch's arguments in a
  generated function whose locals include ``params`` (the dict of bound arguments), so an argument called
  ``params`` is specialized as that dict ("failed to specialize argument of type: dict").

The CPU interpreter runs such kernels, so without these checks they pass the CPU suite and fail at their
first launch on a GPU.
"""

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "kernels_triton"


def _plain_globals(tree: ast.Module) -> dict[str, str]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            value = ast.unparse(node.value)
            for target in node.targets:
                if isinstance(target, ast.Name) and "constexpr" not in value:
                    out[target.id] = value
    return out


def _jit_functions(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
            yield node


def _locals(fn: ast.FunctionDef) -> set[str]:
    names = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def test_jit_kernels_read_no_plain_globals():
    bad = []
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        plain = _plain_globals(tree)
        for fn in _jit_functions(tree):
            local = _locals(fn)
            for node in ast.walk(fn):
                if (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in plain
                        and node.id not in local):
                    bad.append(f"{path.name}:{node.lineno} {fn.name} reads {node.id} = {plain[node.id]}")
    assert not bad, "wrap these in tl.constexpr(...) or pass them as constexpr arguments:\n" + "\n".join(bad)


# Locals and globals of the function Triton generates to bind a launch's arguments (runtime/jit.py,
# create_function_from_signature): an argument of one of these names is shadowed there.
BINDER_NAMES = {"params", "specialization", "options", "backend", "specialize_impl", "JITCallable"}


def test_jit_kernel_arguments_avoid_the_binders_names():
    bad = []
    for path in sorted(KERNELS.glob("*.py")):
        for fn in _jit_functions(ast.parse(path.read_text())):
            for a in fn.args.args + fn.args.kwonlyargs:
                if a.arg in BINDER_NAMES or a.arg.startswith("default_"):
                    bad.append(f"{path.name}:{fn.lineno} {fn.name}({a.arg})")
    assert not bad, "rename these kernel arguments (the GPU launcher's binder shadows them):\n" + "\n".join(bad)
