"""Every @triton.jit kernel reads module globals only as tl.constexpr.

The GPU compiler refuses a kernel that reads a plain module-level number ("Cannot access global variable
... from within @jit'ed function"); the CPU interpreter runs it, so without this check such a kernel passes
the CPU suite and fails at its first launch on a GPU.
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
