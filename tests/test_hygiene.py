"""The repository's own hygiene, checked like a linter (fast, no model): what is true now stays in the tree,
history goes to git (docs/results.md says where), and the tree fits one transfer to a GPU machine.

- README.md at most 15 KB; all prose (README.md, docs/, experiments/ outside results/, checkpoints/) at most 150 KB.
- experiments/results at most 30 MB and 1,500 files; experiments/ at most 20 files outside results/.
- No commit hash in any source or config file under specdec/, kernels_triton/, conf/ (comments, docstrings,
  strings alike), and no dated measurement (YYYY-MM-DD) in a comment or docstring there.
- Every file path a conf/ entry names lies inside the package or conf/ (``pkg://specdec/data/NAME``,
  ``${specdec.repo:specdec/...}``, ``${specdec.repo:conf/...}``) and exists.
"""

import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
KB = 1024
README_MAX = 15 * KB
PROSE_MAX = 150 * KB
RESULTS_MAX_BYTES = 30 * KB * KB
RESULTS_MAX_FILES = 1500
EXPERIMENTS_MAX_FILES = 20
GUARDED = ("specdec", "kernels_triton", "conf")
# Text files scanned for hashes and dates; data files (specdec/data/*.json, kernels_triton/tiles/*.json) are not.
SOURCE_SUFFIXES = {".py", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".sh", ".md", ".txt"}

# A commit hash: 7-40 lowercase hex digits with at least one digit and one letter a-f, standing alone as a word
# (not part of an identifier or a hex constant 0x...), and not a number in exponent notation (1e100000). Words of
# letters a-f only ("defaced") and plain numbers cannot be told from prose or values, so they are not flagged.
HASH = re.compile(r"(?<![0-9A-Za-z_])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![0-9A-Za-z_])")
DATE = re.compile(r"(?<![0-9])20\d\d-[01]\d-[0-3]\d(?![0-9]|T\d\d:)")  # a full timestamp is a format example
EXPONENT = re.compile(r"[0-9]+e[0-9]+")
PATH_SUFFIXES = (".json", ".jsonl", ".csv", ".yaml", ".yml", ".gz", ".txt", ".safetensors")
REPO_RESOLVER = re.compile(r"\$\{specdec\.repo:([^}]*)\}")


def hashes(text: str) -> list[str]:
    """The commit-hash-like words of ``text`` (hex constants 0x... excluded)."""
    return [m.group() for m in HASH.finditer(text)
            if text[max(0, m.start() - 2):m.start()].lower() != "0x" and not EXPONENT.fullmatch(m.group())]


def comment_text(path: Path, text: str) -> str:
    """The comments (and, for Python, the docstrings and other string literals standing as statements) of a
    source file: where a dated measurement would sit. YAML / shell / TOML: everything after a ``#``."""
    if path.suffix != ".py":
        return "\n".join(line.split("#", 1)[1] for line in text.splitlines() if "#" in line)
    out, prev = [], tokenize.NEWLINE
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                out.append(tok.string)
            elif tok.type == tokenize.STRING and prev in (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT):
                out.append(tok.string)  # a docstring (or any bare string statement)
            if tok.type not in (tokenize.COMMENT, tokenize.NL):
                prev = tok.type
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return text
    return "\n".join(out)


def guarded_files():
    for top in GUARDED:
        for p in sorted((ROOT / top).rglob("*")):
            if p.is_file() and p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts:
                yield p


def tree_files(folder: Path) -> list[Path]:
    """Files under ``folder`` that a copy of the working tree carries: tracked or untracked-but-not-ignored
    (git), else every file on disk."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z", "--", str(folder)], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        files = [ROOT / f for f in out.split("\0") if f]
        return [f for f in files if f.is_file()]  # deleted but not yet committed: gone from the copy too
    except (OSError, subprocess.CalledProcessError):
        return [p for p in folder.rglob("*") if p.is_file()]


def prose_files() -> list[Path]:
    files = [ROOT / "README.md"]
    for top in ("docs", "experiments", "checkpoints"):
        files += [p for p in tree_files(ROOT / top) if p.suffix == ".md"
                  and not p.is_relative_to(ROOT / "experiments" / "results")]
    return files


# ------------------------------------------------------------------------------------------- the checks
def test_readme_is_at_most_15_kb():
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_MAX, f"README.md is {size} bytes (> {README_MAX}): move detail to docs/, history to docs/results.md"


def test_prose_is_at_most_150_kb():
    sizes = {str(p.relative_to(ROOT)): p.stat().st_size for p in prose_files()}
    total = sum(sizes.values())
    biggest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    assert total <= PROSE_MAX, f"prose is {total} bytes (> {PROSE_MAX}); largest: {biggest}"


def test_results_tree_is_small():
    files = tree_files(ROOT / "experiments" / "results")
    size = sum(f.stat().st_size for f in files)
    assert len(files) <= RESULTS_MAX_FILES, (
        f"experiments/results holds {len(files)} files (> {RESULTS_MAX_FILES}): keep only the run directories the "
        "README and the ledger's current rows cite, without .hydra/ or per-step records")
    assert size <= RESULTS_MAX_BYTES, f"experiments/results holds {size} bytes (> {RESULTS_MAX_BYTES}): compress or drop"


def test_ledger_has_its_header():
    head = (ROOT / "experiments" / "results" / "ledger.csv").read_text().splitlines()[0]
    assert head == "date,commit,device,experiment,overrides,metric,value,run_dir"


def test_experiments_holds_at_most_20_files():
    files = [p for p in tree_files(ROOT / "experiments")
             if not p.is_relative_to(ROOT / "experiments" / "results") and "__pycache__" not in p.parts]
    assert len(files) <= EXPERIMENTS_MAX_FILES, (
        f"experiments/ holds {len(files)} files outside results/ (> {EXPERIMENTS_MAX_FILES}): one-off studies leave "
        f"the tree (their verdicts go to the ledger): {sorted(str(f.relative_to(ROOT)) for f in files)}")


def test_no_commit_hash_in_code_or_config():
    bad = []
    for p in guarded_files():
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            bad += [f"{p.relative_to(ROOT)}:{i}: {h}" for h in hashes(line)]
    assert not bad, "commit hashes (history belongs in git and docs/results.md):\n" + "\n".join(bad)


def test_no_dated_measurement_in_comments():
    bad = []
    for p in guarded_files():
        for d in DATE.findall(comment_text(p, p.read_text(errors="replace"))):
            bad.append(f"{p.relative_to(ROOT)}: {d}")
    assert not bad, "dated measurements in comments or docstrings (they go to the ledger):\n" + "\n".join(bad)


def _strings(node):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)
    elif isinstance(node, str):
        yield node


def conf_path_problems(value: str) -> list[str]:
    """What is wrong with the file paths a conf value names (empty: nothing, or not a path)."""
    from specdec.data import PKG_SCHEME, resolve

    inside = (ROOT / "specdec", ROOT / "conf")
    out = []
    for rel in REPO_RESOLVER.findall(value):  # ${specdec.repo:REL}: REL under the repository root
        target = (ROOT / rel).resolve()
        if rel.endswith(PATH_SUFFIXES) and not any(target.is_relative_to(d) for d in inside):
            out.append(f"{rel} is outside specdec/ and conf/ (move it to specdec/data/, name it {PKG_SCHEME}specdec/data/NAME)")
    rest = REPO_RESOLVER.sub("", value).strip()
    if rest.startswith(PKG_SCHEME):
        target = resolve(rest)
        if not target.is_file():
            out.append(f"{rest}: no such file in the installed package ({target})")
        elif not target.resolve().is_relative_to((ROOT / "specdec").resolve()) and "site-packages" not in target.parts:
            out.append(f"{rest} resolves outside the package ({target})")
    elif rest.endswith(PATH_SUFFIXES) and "${" not in rest and " " not in rest:
        target = (ROOT / rest).resolve()
        if not any(target.is_relative_to(d) for d in inside):
            out.append(f"{rest} is outside specdec/ and conf/ (move it to specdec/data/, name it {PKG_SCHEME}specdec/data/NAME)")
    return out


def test_conf_names_files_inside_the_package():
    bad = []
    for p in sorted((ROOT / "conf").rglob("*.yaml")):
        for s in _strings(yaml.safe_load(p.read_text())):
            bad += [f"{p.relative_to(ROOT)}: {why}" for why in conf_path_problems(s)]
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------------------------------- the guards' own tests
@pytest.mark.parametrize("text,found", [
    ("at ce17af3c the step", ["ce17af3c"]), ("(e5229cc, 2026-12-04)", ["e5229cc"]),
    ("commit 41d1e6b6f2f04a2b9d1c3e5f7a9b0c1d2e3f4a5b", ["41d1e6b6f2f04a2b9d1c3e5f7a9b0c1d2e3f4a5b"]),
    ("x = 0x1f2e3d4c", []), ("mask 0xdeadbeef1", []), ("1234567 tokens", []), ("defaced", []), ("abc1234x", []),
    ("lr 5.0e-4, eps 1.0e-05", []), ("bf16x4 f32", []), ("sha 1a2b3c", []), ("the_1a2b3c4d var", []),
    ("seed_1a2b3c4", []), ("1e100000", []),
])
def test_hash_pattern(text, found):
    assert hashes(text) == found


def test_date_scan_reads_comments_and_docstrings_only(tmp_path):
    src = 'FMT = "%Y-%m-%d"\nWHEN = "2026-12-04"  # a value, not a comment\n\n\ndef f():\n    """Measured 2026-12-03."""\n' \
          '    return 1  # seen 2026-11-30; stamps read 2026-12-01T14:35:07Z\n'
    p = tmp_path / "x.py"
    found = DATE.findall(comment_text(p, src))
    assert found == ["2026-12-03", "2026-11-30"]
    assert DATE.findall(comment_text(tmp_path / "x.yaml", "a: 1  # on 2026-12-05\nb: 2026-12-06\n")) == ["2026-12-05"]


def test_conf_path_check():
    assert conf_path_problems("pkg://specdec/data/prompt_lengths_smollm2.json") == []
    assert conf_path_problems("${specdec.repo:checkpoints/eagle3-smollm2-135m}") == []  # a directory: not a file path
    assert conf_path_problems("${specdec.repo:experiments/results/acceptance/trace.json}")
    assert conf_path_problems("experiments/results/x.json")
    assert conf_path_problems("pkg://specdec/data/no_such_file.json")
    assert conf_path_problems("builtin") == [] and conf_path_problems("${workload.concurrency}") == []
