"""The ``specdec`` command: one entry for the framework's tools.

    specdec run +experiment=NAME [overrides]     serve a workload (= python -m specdec.run)
    specdec train +experiment=NAME [overrides]   train an EAGLE-3 head (= python -m specdec.train)
    specdec report RUN_DIRS... [--out DIR]       tables and plots from run directories (figures to the ledger)
    specdec fetch                                fill the asset cache (model, prompt sets)

Hydra reads its overrides from ``sys.argv``, so ``run`` and ``train`` hand over the rest of the
command line unchanged (``--multirun``, ``--cfg job``, ``hydra.*`` work as with ``python -m``).
"""

from __future__ import annotations

import sys

COMMANDS = {
    "run": "serve a workload: specdec run +experiment=NAME [overrides]",
    "train": "train an EAGLE-3 head: specdec train +experiment=train_eagle3_smollm2",
    "report": "tables and plots from run directories, each figure appended to experiments/results/ledger.csv: "
              "specdec report RUN_DIRS... --out DIR [--no-ledger]",
    "fetch": "fill the asset cache (SmolLM2-135M-Instruct, HumanEval, MT-bench)",
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: specdec COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {text}" for name, text in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"specdec: unknown command {cmd!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if cmd == "report":
        from .report import main as report_main

        report_main(rest)
        return 0
    if cmd == "fetch":
        from .assets import main as assets_main

        return assets_main(["fetch", *rest])
    import runpy

    sys.argv = [f"specdec {cmd}", *rest]  # Hydra parses sys.argv
    # As `python -m specdec.run`: Hydra finds conf/ relative to the script it runs as __main__.
    runpy.run_module(f"specdec.{cmd}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
