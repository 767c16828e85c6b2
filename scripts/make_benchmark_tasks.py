"""Write the two small offline benchmark tasks that ship in ``configs/benchmarks/nexa_stdlib/`` (deterministic).

Both are built from text that ships with CPython, so any machine can run them without a download:

* ``nexa_stdlib_module`` (multiple choice, log-likelihood): the first line of a standard-library module's docstring,
  and four module names to choose from; the right one and three others picked by a fixed-seed RNG.
* ``nexa_docstring_completion`` (generation): the first words of such a docstring line; the model must write the
  next three words (exact match, case and punctuation ignored).

Run ``python scripts/make_benchmark_tasks.py`` (Python 3.11) to rewrite the JSONL files; the same interpreter
version writes the same bytes (the docstrings are the interpreter's). The task YAMLs next to them are hand-written.
"""

from __future__ import annotations

import importlib
import json
import random
import re
from pathlib import Path

# Modules whose import has no side effect and whose docstring's first line says what the module is.
MODULES = sorted(
    [
        "abc",
        "argparse",
        "ast",
        "base64",
        "bisect",
        "calendar",
        "cmd",
        "codecs",
        "colorsys",
        "configparser",
        "contextlib",
        "copy",
        "csv",
        "dataclasses",
        "datetime",
        "decimal",
        "difflib",
        "enum",
        "filecmp",
        "fnmatch",
        "fractions",
        "ftplib",
        "functools",
        "getopt",
        "gettext",
        "glob",
        "graphlib",
        "gzip",
        "hashlib",
        "heapq",
        "hmac",
        "html",
        "imaplib",
        "inspect",
        "ipaddress",
        "json",
        "keyword",
        "linecache",
        "locale",
        "mailbox",
        "mimetypes",
        "netrc",
        "numbers",
        "operator",
        "optparse",
        "pathlib",
        "pickle",
        "pkgutil",
        "platform",
        "plistlib",
        "poplib",
        "pprint",
        "queue",
        "quopri",
        "random",
        "reprlib",
        "sched",
        "secrets",
        "selectors",
        "shelve",
        "shlex",
        "shutil",
        "smtplib",
        "socketserver",
        "statistics",
        "string",
        "struct",
        "subprocess",
        "tabnanny",
        "tarfile",
        "tempfile",
        "textwrap",
        "threading",
        "timeit",
        "token",
        "tokenize",
        "trace",
        "traceback",
        "types",
        "typing",
        "uuid",
        "warnings",
        "wave",
        "weakref",
        "zipapp",
        "zipfile",
    ]
)
OUT = Path(__file__).resolve().parents[1] / "configs" / "benchmarks" / "nexa_stdlib"
SEED = 16
NUM_EXAMPLES = 40


def first_line(module: str) -> str | None:
    doc = importlib.import_module(module).__doc__ or ""
    line = " ".join(doc.strip().split("\n\n")[0].split())  # the first paragraph, on one line
    line = re.sub(rf"\b{re.escape(module)}\b", "this module", line)  # the name itself would give it away
    return line if 4 <= len(line.split()) <= 40 else None


def main() -> None:
    lines = {m: line for m in MODULES if (line := first_line(m))}
    names = sorted(lines)
    rng = random.Random(SEED)
    chosen = sorted(rng.sample(names, NUM_EXAMPLES))
    mc, gen = [], []
    for module in chosen:
        others = rng.sample([n for n in names if n != module], 3)
        answer = rng.randrange(4)
        choices = others[:answer] + [module] + others[answer:]
        mc.append({"id": module, "docstring": lines[module], "choices": choices, "answer": answer})
        words = lines[module].split()
        cut = max(2, min(len(words) - 3, len(words) // 2))
        gen.append({"id": module, "prompt": " ".join(words[:cut]), "target": " ".join(words[cut : cut + 3])})
    OUT.mkdir(parents=True, exist_ok=True)
    for name, rows in (("stdlib_module.jsonl", mc), ("docstring_completion.jsonl", gen)):
        with open(OUT / name, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, sort_keys=True) + "\n" for row in rows)
        print(f"wrote {len(rows)} examples to {OUT / name}")


if __name__ == "__main__":
    main()
