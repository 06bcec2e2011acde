"""Training prompts for the draft head, and the check that they never overlap the eval sets.

Two sources exist on every machine (FACTS.md, "Prompt sets"):

- **Standard-library coding tasks**: for a fixed list of Python standard-library modules, every
  public function, class and method with a docstring becomes a few prompts built from templates
  ("Write a Python function like `textwrap.dedent`: <first docstring paragraph>", a HumanEval-style
  ``def`` stub with the docstring, "explain", "reimplement", "write tests"). The list depends on the
  Python version that runs it, and is deterministic for a given version and seed.
- **Self-instruct tasks**: the target is shown a few example tasks (seeds written for this project,
  plus tasks it wrote in earlier rounds) and asked for a new one; unique, well-formed replies are kept.

Decontamination (:class:`EvalIndex`): a prompt is dropped if, after normalisation (lower case,
non-alphanumerics to spaces), it equals an eval prompt, contains one, is contained in one, or shares
a 13-word n-gram with one (the usual contamination test for training sets). The eval prompts are
HumanEval's 164 prompts and both turns of MT-bench's 80 questions.
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import SpecdecError


class TrainingDataError(SpecdecError):
    """Training data could not be built (the message says which input and why)."""


@dataclass
class TrainPrompt:
    id: str  # source/name/variant, unique
    text: str  # the user message
    source: str  # "stdlib" | "self_instruct" | "seed"


# Modules whose public API becomes coding prompts. Fixed, so that the prompt set depends only on the
# Python version and the seed; modules missing from a Python build are skipped.
STDLIB_MODULES = (
    "textwrap", "string", "re", "json", "os.path", "shutil", "itertools", "functools", "collections",
    "heapq", "bisect", "math", "statistics", "random", "datetime", "calendar", "fractions",
    "decimal", "operator", "copy", "difflib", "html", "urllib.parse", "base64", "binascii",
    "hashlib", "hmac", "secrets", "uuid", "fnmatch", "glob", "pathlib", "csv", "configparser",
    "argparse", "logging", "inspect", "ast", "tokenize", "keyword", "enum", "dataclasses",
    "contextlib", "cmath", "zlib", "gzip", "struct", "array", "queue", "threading", "time",
    "locale", "unicodedata", "pprint", "reprlib", "shlex", "ipaddress", "email.utils",
    "mimetypes", "colorsys", "sched", "weakref", "types", "traceback", "warnings", "tempfile",
    "filecmp", "zipfile", "tarfile", "sqlite3", "xml.etree.ElementTree", "http.cookies", "codecs",
    "io", "pickle", "graphlib", "plistlib", "quopri", "gettext", "wave",
)

FUNCTION_TEMPLATES = (
    "Write a Python function like `{qual}`: {doc}",
    "{stub}",  # a HumanEval-style stub: def line + docstring, nothing else
    "Explain what `{qual}` does in Python and show a short example of using it.",
    "Implement `{name}` in plain Python without importing `{module}`. It should behave like this: {doc}",
    "Write pytest unit tests for `{qual}`. Its documentation says: {doc}",
)
CLASS_TEMPLATES = (
    "Write a Python class like `{qual}`: {doc}",
    "Explain when to use `{qual}` in Python and show a short example.",
    "Implement a simplified version of `{qual}` in plain Python. {doc}",
)

# Seed tasks for self-instruct, written for this project (general assistant requests across
# writing, explanation, reasoning, maths, extraction, advice and code in other languages).
SEED_TASKS = (
    "Write a short poem about a lighthouse keeper who has never seen the sea in daylight.",
    "Give me three tips for keeping houseplants alive in a dark apartment.",
    "Explain how a refrigerator moves heat out of its inside, in simple words.",
    "Summarise the plot of a detective story in which the butler is innocent, in five sentences.",
    "A train leaves at 9:40 and arrives at 13:15. How long is the journey?",
    "Write a polite message to a neighbour asking them to move their bicycle from the stairway.",
    "List the pros and cons of working from home for a small design team.",
    "Translate 'The library opens at eight and closes at noon on Saturdays' into French.",
    "What is the difference between weather and climate?",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "Create a weekly meal plan for a vegetarian student on a small budget.",
    "Explain why the sky looks red at sunset.",
    "If a shirt costs 24 dollars after a 20 percent discount, what was the original price?",
    "Write a JavaScript function that removes duplicate values from an array.",
    "Describe the water cycle to a ten-year-old.",
    "Suggest five names for a bakery that specialises in sourdough bread.",
    "Write the opening paragraph of a science-fiction story set on a frozen moon.",
    "Compare renting and buying a house for a young couple in a big city.",
    "Explain what a hash table is and when it is a good choice.",
    "Rewrite this sentence to sound more formal: 'we gotta fix the bug before friday'.",
    "Write a bash command that counts the lines in every .txt file in a folder.",
    "What are the main causes of inflation?",
    "Plan a one-day walking tour of an old harbour town.",
    "Write a haiku about the first snow of winter.",
    "Explain the rules of chess castling.",
    "Give a step-by-step recipe for a simple tomato soup.",
    "A farmer has 17 sheep and all but 9 run away. How many are left? Explain.",
    "Write a product description for a waterproof hiking backpack.",
    "What is recursion? Give an example in any programming language.",
    "Draft an agenda for a 30-minute team meeting about a delayed project.",
    "Explain the difference between a virus and a bacterium.",
    "Write a C function that reverses a string in place.",
    "List four ways to reduce stress before an exam.",
    "Write a dialogue between a customer and a shop assistant about a broken umbrella.",
    "Explain how compound interest works with a numeric example.",
    "Give a short history of the bicycle.",
    "Write a regular expression that matches a date in the form YYYY-MM-DD and explain it.",
    "What should I check before buying a used car?",
    "Write a limerick about a cat who learns to code.",
    "Explain what photosynthesis produces and why it matters.",
)

# Seed tasks for conversational self-instruct (``train.data.seed_set=chat``): general assistant
# requests only, no code, spread over the kinds of request a chat benchmark asks (writing, role-play,
# reasoning, maths, extraction, science, humanities, advice), written for this project. A data
# directory built from these holds chat answers to train beside the coding-heavy default set.
CHAT_SEED_TASKS = (
    "Write a short speech a retiring school librarian might give at her farewell party.",
    "Write a four-line poem about a bus stop in the rain, with a rhyme at the end of each pair of lines.",
    "Write a letter to a future version of yourself describing what your town looks like today.",
    "Write a cheerful announcement for a community garden's first harvest festival.",
    "Write a short fable about a tortoise who opens a repair shop, ending with a moral.",
    "Write a review of an imaginary board game about running a lighthouse, with one criticism.",
    "Rewrite the following note so that it sounds warm instead of strict: 'Meeting at 8. Do not be late.'",
    "Write a thank-you note to a volunteer firefighter who rescued a neighbour's dog.",
    "You are a ship's cook in the 1800s. Describe what the crew eats during a long voyage.",
    "Act as a museum guide and introduce a room full of old clocks to a group of visitors.",
    "Pretend you are a weather forecaster on a planet with two suns and give tomorrow's forecast.",
    "You are a patient driving instructor. Explain to a nervous student how to merge onto a motorway.",
    "Play the role of a medieval baker and describe a normal working day.",
    "You are a travel agent. Convince a hesitant customer to spend a weekend in a small mountain village.",
    "Three friends share a pizza cut into 12 slices. Anna eats twice as many as Ben, and Ben eats as many as Carl. How many slices does each eat if none are left?",
    "If all glorps are fleems and some fleems are blue, must some glorps be blue? Explain your reasoning.",
    "A clock shows 3:15. What is the angle between the hour hand and the minute hand?",
    "Tom is older than Sara, and Sara is older than Mia. Who is the youngest? Explain step by step.",
    "A box holds red and green marbles in the ratio 3 to 5. If there are 24 green marbles, how many marbles are in the box?",
    "Which weighs more, a kilogram of feathers or a kilogram of iron? Explain the trick in the question.",
    "Solve for x: 5x - 7 = 3x + 9. Show each step.",
    "A rectangle has a perimeter of 30 cm and its length is twice its width. Find its area.",
    "What is the sum of the first 20 odd numbers? Explain a quick way to find it.",
    "A bag has 4 blue and 6 yellow beads. Two beads are drawn without replacement. What is the probability both are blue?",
    "Convert 72 kilometres per hour into metres per second and explain the conversion.",
    "A recipe for 4 people uses 300 grams of rice. How much rice is needed for 10 people?",
    "From the sentence 'Dr. Lena Ortiz moved from Lyon to Oslo in 2019 to lead a glacier lab', list the person, the cities, the year and the job.",
    "Extract every date from this text and list them in order: 'The shop opened on 3 May 2001, closed on 12 June 2009 and reopened on 1 April 2015.'",
    "Turn this list into a table with two columns, fruit and colour: banana yellow, plum purple, lime green, cherry red.",
    "Read this review and say whether it is positive, negative or mixed: 'The hotel was spotless, but the staff ignored us for an hour.'",
    "Summarise the following in one sentence: 'The council voted to close the old bridge to cars. Cyclists and walkers may still use it. A new road bridge will open next spring.'",
    "List the ingredients mentioned in this sentence: 'Stir the lentils with garlic, cumin and a squeeze of lemon, then top with parsley.'",
    "Explain why ice floats on water.",
    "Describe how vaccines train the immune system.",
    "What causes the seasons on Earth? Correct the common mistake people make about it.",
    "Explain what an electric current is, using the picture of water in a pipe.",
    "Why do some metals rust while others do not?",
    "Describe the life cycle of a star like the Sun.",
    "What were the main effects of the printing press on European society?",
    "Explain the idea of supply and demand with an example from a farmers' market.",
    "Compare the roles of a president and a prime minister.",
    "Why did ancient cities often grow up beside rivers?",
    "Give a short introduction to the philosophy of Stoicism and one practical lesson from it.",
    "Explain what a metaphor is and give three examples from everyday speech.",
    "How can I politely decline an invitation to a wedding I cannot attend?",
    "Suggest a plan for learning to swim as an adult who is afraid of deep water.",
    "What are good ways to save money on groceries without eating worse?",
    "Give advice to someone starting their first job in a busy restaurant kitchen.",
)

SEED_SETS = {"default": SEED_TASKS, "chat": CHAT_SEED_TASKS}


def seed_set(name: str) -> tuple[str, ...]:
    """The seed tasks called ``name`` (``train.data.seed_set``)."""
    try:
        return SEED_SETS[str(name)]
    except KeyError:
        raise TrainingDataError(f"unknown train.data.seed_set={name!r}; valid: {', '.join(SEED_SETS)}") from None


# ----------------------------------------------------------------------------------------------
# Standard-library prompts
# ----------------------------------------------------------------------------------------------

def _first_paragraph(doc: str, name: str, max_chars: int = 600) -> str | None:
    """The first docstring paragraph that is prose (not a signature line), on one line."""
    for para in doc.strip().split("\n\n"):
        text = " ".join(para.split())
        if not text or re.match(rf"^{re.escape(name)}\s*\(", text):  # "split(sep=None) -> list"
            continue
        if len(text) > max_chars:  # cut at the last sentence end that fits
            cut = text.rfind(". ", 0, max_chars)
            text = text[: cut + 1] if cut > 40 else text[:max_chars]
        return text if len(text) >= 20 else None
    return None


def _stub(name: str, obj, doc: str) -> str | None:
    """``def name(signature):`` + docstring, or None when the signature is unknown or unstable."""
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return None
    if " at 0x" in sig or "<" in sig:  # defaults whose repr holds a memory address: not deterministic
        return None
    body = "\n    ".join(doc.strip().split("\n"))
    return f'def {name}{sig}:\n    """{body}\n    """\n'


def stdlib_items(modules=STDLIB_MODULES) -> list[dict]:
    """Public functions, classes and methods with docstrings: dicts with kind, module, name, qual,
    doc (first paragraph) and stub (functions; may be None). Each object appears once, under the
    first module in ``modules`` that exposes it."""
    seen: set[int] = set()
    items = []

    def add(kind, module, name, qual, obj):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        full = inspect.getdoc(obj)
        doc = _first_paragraph(full or "", name)
        if doc is None:
            return
        items.append(dict(kind=kind, module=module, name=name, qual=qual, doc=doc,
                          stub=_stub(name, obj, doc) if kind == "function" else None))

    for modname in modules:
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        for name, obj in inspect.getmembers(mod):
            if name.startswith("_") or inspect.ismodule(obj):
                continue
            if inspect.isclass(obj):
                add("class", modname, name, f"{modname}.{name}", obj)
                for mname, mobj in sorted(vars(obj).items()):
                    if not mname.startswith("_") and (inspect.isfunction(mobj) or inspect.ismethoddescriptor(mobj)):
                        add("function", modname, mname, f"{modname}.{name}.{mname}", mobj)
            elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
                add("function", modname, name, f"{modname}.{name}", obj)
    return items


def stdlib_prompts(per_item: int = 2, seed: int = 0, max_prompts: int | None = None,
                   modules=STDLIB_MODULES) -> list[TrainPrompt]:
    """``per_item`` prompts per standard-library item, each from a different template (seeded)."""
    rng = random.Random(seed)
    out = []
    for it in stdlib_items(modules):
        templates = CLASS_TEMPLATES if it["kind"] == "class" else FUNCTION_TEMPLATES
        usable = [i for i, t in enumerate(templates) if "{stub}" not in t or it["stub"]]
        for i in sorted(rng.sample(usable, min(per_item, len(usable)))):
            text = templates[i].format(**it)
            out.append(TrainPrompt(f"stdlib/{it['qual']}/{i}", text, "stdlib"))
    if max_prompts is not None and len(out) > max_prompts:
        keep = sorted(rng.sample(range(len(out)), max_prompts))
        out = [out[i] for i in keep]
    return out


# ----------------------------------------------------------------------------------------------
# Self-instruct
# ----------------------------------------------------------------------------------------------

def self_instruct_request(examples: list[str]) -> str:
    """The user message that asks the target for one new task after numbered examples."""
    lines = "\n".join(f"{i}. {t}" for i, t in enumerate(examples, 1))
    return ("Here are some tasks that people ask an AI assistant to do:\n" + lines +
            f"\nWrite task {len(examples) + 1}: one new task on a different topic from the ones above. "
            "Reply with the task only.")


_LEADER = re.compile(r"^\s*(?:\d+\s*[.):]|task\s*\d*\s*[.:]|[-*#]+|new task\s*:)\s*", re.IGNORECASE)
# Replies that talk to the user instead of stating a task ("I'm ready to help. What task ...").
_CHATTER = re.compile(r"^(?:i\b|i'm\b|sure\b|here\b|hello\b|hi\b|okay\b|ok\b|of course\b|as an\b|thank)|\btasks?\b",
                      re.IGNORECASE)


def parse_task(reply: str, min_chars: int = 15, max_chars: int = 400) -> str | None:
    """The task in a self-instruct reply (its first non-empty line, numbering and quotes stripped),
    or None when that line is not a plausible task: too short or long, not starting with a letter,
    chatter or talk about tasks, or cut off (not ending like a sentence)."""
    line = next((ln.strip() for ln in reply.splitlines() if ln.strip()), "")
    line = _LEADER.sub("", line).strip().strip('"\'*').strip()
    if not (min_chars <= len(line) <= max_chars) or len(line.split()) < 4:
        return None
    if not line[0].isalpha() or _CHATTER.search(line) or line[-1] not in ".?!:)\"'`":
        return None
    return line


def self_instruct(generate: Callable[[list[str]], list[str]], *, num_requests: int, rounds: int = 1,
                  examples_per_request: int = 3, seed: int = 0,
                  seeds: tuple[str, ...] = SEED_TASKS) -> list[str]:
    """New tasks written by the target: ``generate`` maps user messages to replies (batched).

    Each round sends ``num_requests / rounds`` requests, each showing ``examples_per_request`` tasks
    drawn from the seeds plus the tasks kept in earlier rounds. Replies are parsed with
    :func:`parse_task`; duplicates (after normalisation) of seeds or earlier tasks are dropped.
    """
    rng = random.Random(seed)
    pool = list(seeds)
    seen = {normalize(t) for t in pool}
    new: list[str] = []
    per_round = [num_requests // rounds + (r < num_requests % rounds) for r in range(rounds)]
    for n in per_round:
        if n == 0:
            continue
        requests = [self_instruct_request(rng.sample(pool, min(examples_per_request, len(pool))))
                    for _ in range(n)]
        for reply in generate(requests):
            task = parse_task(reply)
            if task is None or normalize(task) in seen:
                continue
            seen.add(normalize(task))
            new.append(task)
        pool = list(seeds) + new
    return new


# ----------------------------------------------------------------------------------------------
# Decontamination
# ----------------------------------------------------------------------------------------------

NGRAM = 13  # word n-gram length of the overlap test


def normalize(text: str) -> str:
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def load_eval_texts(prompts_dir: str | Path) -> list[str]:
    """Every eval prompt: HumanEval prompts and both turns of each MT-bench question."""
    d = Path(prompts_dir)
    texts = []
    for name, field in (("humaneval.jsonl", "prompt"), ("mt_bench.jsonl", "turns")):
        path = d / name
        if not path.is_file():
            raise TrainingDataError(f"eval prompt file {path} is missing; run `python -m specdec.assets fetch`")
        for line in path.read_text().splitlines():
            if line.strip():
                value = json.loads(line)[field]
                texts += value if isinstance(value, list) else [value]
    return texts


class EvalIndex:
    """Normalised eval prompts for the overlap test (see the module docstring)."""

    def __init__(self, eval_texts: list[str]):
        self.norm = [n for n in (normalize(t) for t in eval_texts) if n]
        self.exact = {t.strip() for t in eval_texts}
        self.joined = "\x00".join(self.norm)  # one `in` for "contained in some eval prompt"
        self.ngrams = {g for n in self.norm for g in _ngrams(n)}

    def overlap(self, text: str) -> str | None:
        """Why ``text`` overlaps an eval prompt ("exact", "contains", "contained", "13-gram"), or None."""
        if text.strip() in self.exact:
            return "exact"
        n = normalize(text)
        if not n:
            return None
        if n in self.joined:
            return "contained"
        if any(e in n for e in self.norm):
            return "contains"
        if any(g in self.ngrams for g in _ngrams(n)):
            return f"{NGRAM}-gram"
        return None


def _ngrams(norm_text: str) -> set[str]:
    w = norm_text.split()
    return {" ".join(w[i:i + NGRAM]) for i in range(len(w) - NGRAM + 1)}


def decontaminate(prompts: list[TrainPrompt], index: EvalIndex) -> tuple[list[TrainPrompt], list[tuple[str, str]]]:
    """(kept prompts, [(dropped id, reason)])."""
    kept, dropped = [], []
    for p in prompts:
        why = index.overlap(p.text)
        if why is None:
            kept.append(p)
        else:
            dropped.append((p.id, why))
    return kept, dropped


def assert_no_overlap(prompts: list[TrainPrompt], index: EvalIndex) -> None:
    """Raise TrainingDataError naming the first training prompt that overlaps an eval prompt."""
    for p in prompts:
        why = index.overlap(p.text)
        if why is not None:
            raise TrainingDataError(f"training prompt {p.id} overlaps an eval prompt ({why}): {p.text[:200]!r}")
