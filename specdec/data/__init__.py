"""Data files the product reads, installed with the package (pyproject.toml package-data).

* ``acceptance_smollm2_eagle3_humaneval.json``: the acceptance trace ``crossover_8b`` and ``step_8b``
  replay (``python -m specdec.acceptance build-trace``): SmolLM2-135M-Instruct with the committed EAGLE-3
  head at batch 1 on HumanEval, tree16 / tree32 / tree48 accepted-length histograms.
* ``prompt_lengths_smollm2.json``: HumanEval's and MT-bench's prompt lengths and ids as SmolLM2's chat
  template tokenises them (``python -m specdec.acceptance lengths``), for ``workload=*_lengths``.

Configs name these files ``pkg://specdec/data/NAME``: :func:`resolve` turns such a name into the file's path
wherever the package is installed. Any other path is returned unchanged.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

PKG_SCHEME = "pkg://"


def resolve(path: str | Path) -> Path:
    """``pkg://PACKAGE/REL`` -> REL inside the installed PACKAGE (e.g. ``pkg://specdec/data/x.json``);
    anything else -> ``Path(path)``."""
    text = str(path)
    if not text.startswith(PKG_SCHEME):
        return Path(text)
    package, _, rel = text[len(PKG_SCHEME):].partition("/")
    if not package or not rel:
        raise ValueError(f"{text!r}: a package path is pkg://PACKAGE/RELATIVE_PATH, e.g. "
                         f"{PKG_SCHEME}specdec/data/prompt_lengths_smollm2.json")
    return Path(str(resources.files(package).joinpath(rel)))
