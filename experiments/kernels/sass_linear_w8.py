"""Compile linear_w8's kernel for sm_90 on a machine without a GPU and count the SASS of its K loop
(per warp and iteration, by opcode), with registers and shared memory: how a launch choice changes
the instruction stream before spending device time on it. Triton's wheel carries ptxas and
cuobjdump. Use the device's Triton version for numbers that match it (e.g. ``pip install --target
/tmp/t36 --no-deps triton==3.6.0`` and ``PYTHONPATH=/tmp/t36``).

  python experiments/kernels/sass_linear_w8.py '{"BLOCK_N": 32, "num_warps": 4}' '{"BLOCK_N": 32, "num_warps": 2}'

Each argument: launch fields over the default (BLOCK_M 16, BLOCK_N 32, BLOCK_K 256, 4 warps, 4 stages,
bf16 x, no split, K a multiple of BLOCK_K); weight elements per warp-instruction = BLOCK_N x BLOCK_K /
(instructions per iteration x warps).
"""

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels_triton.linear_w8 import _w8_linear_kernel as KERNEL  # noqa: E402

SIG = {"x_ptr": "*bf16", "q_ptr": "*i8", "s_ptr": "*fp32", "a_ptr": "*bf16", "y_ptr": "*bf16", "p_ptr": "*fp32",
       "M": "i32", "NOUT": "i32", "K": "i32", "k_per_split": "i32", "stride_xm": "i32", "stride_qn": "i32",
       "stride_am": "i32", "stride_ym": "i32"}
DIV16 = ("x_ptr", "q_ptr", "s_ptr", "a_ptr", "y_ptr", "p_ptr", "NOUT", "K", "k_per_split", "stride_xm", "stride_qn",
         "stride_am", "stride_ym")  # what the launcher's specialization sees at the 8B head's shapes


def compile_sass(cfg: dict) -> tuple[str, str]:
    const = dict(HAS_ADD=False, SPLIT=False, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, DOT_PREC="tf32", EVEN_K=True)
    const.update({k: v for k, v in cfg.items() if k in const})
    names = KERNEL.arg_names
    sig = dict(SIG) | {k: "constexpr" for k in const}
    src = ASTSource(fn=KERNEL, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in DIV16})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 4)))
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.cubin")
        Path(p).write_bytes(c.asm["cubin"])
        sass = subprocess.run([str(tool), "-sass", p], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([str(tool), "-res-usage", p], capture_output=True, text=True, check=True).stdout
    return sass, f"shared {c.metadata.shared} B; " + " ".join(re.findall(r"REG:\d+", res))


def loop_histogram(sass: str) -> collections.Counter:
    ins = [(int(m.group(1), 16), m.group(2).strip())
           for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    lo = hi = None
    for a, t in ins:  # the K loop: the backward branch
        b = re.search(r"BRA.*0x([0-9a-f]+)", t)
        if b and int(b.group(1), 16) < a:
            lo, hi = int(b.group(1), 16), a
    body = [t for a, t in ins if lo is not None and lo <= a <= hi]
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)


def main():
    print(f"triton {triton.__version__}, sm_90")
    for arg in sys.argv[1:] or ['{}']:
        cfg = json.loads(arg)
        sass, res = compile_sass(cfg)
        h = loop_histogram(sass)
        n, warps = sum(h.values()), cfg.get("num_warps", 4)
        elems = cfg.get("BLOCK_N", 32) * cfg.get("BLOCK_K", 256)
        print(f"{arg}: {res}; loop {n} instructions per warp x {warps} warps = "
              f"{elems / (n * warps):.2f} weight elements per warp-instruction; {dict(h.most_common(6))}")


if __name__ == "__main__":
    main()
