"""The README and docs/ show only what runs: every command, path, link and Python block is checked.

Read from README.md and docs/*.md:

    shell blocks (```bash, ```sh, ```shell) and inline code that starts with `make ` or holds
    `python -m cli`: each command is split as a shell would split it (quotes, `\\` continuations,
    comments, `;` `&&` `|` `&` and newlines between commands), then
        python -m cli X [SUB] --opt ...   `python -m cli X [SUB] --help` succeeds and lists every --opt
        python path/to/script.py --opt    the script exists and its source names every --opt
        make T VAR=value                  T is a Makefile target and VAR a Makefile variable
    repository paths, in commands and in inline code: a word whose first component is a top-level entry
        of the repository (engine/..., tests/test_x.py, .ci/run) exists; a glob matches something.
    links and images: a relative target exists, and its #anchor is one of the target's headings.
    Python blocks (```python): every one compiles; those whose info string does not say `needs-server`
        run as they are, from the repository root, on the tiny test models.

A word in capitals where a subcommand goes (`python -m cli COMMAND --help`) is a placeholder and is
not run. The README also stays a door, not a manual: under README_MAX_LINES lines.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
README_MAX_LINES = 300
SHELL_LANGUAGES = frozenset({"bash", "sh", "shell"})
NEEDS_SERVER = "needs-server"  # a Python block's info-string word: compiled, not run (it talks to a server)
# Top-level names that are git-ignored run-time folders, never documented files.
NOT_IN_REPOSITORY = frozenset(
    {".git", ".venv", ".venv-vllm", ".build", "data", "artifacts", ".hypothesis", ".pytest_cache"}
)
PYTHONS = frozenset({"python", "python3", ".venv/bin/python"})
HELP_TIMEOUT_S = 60
TEST_DATA_DIR = Path(os.environ.get("PREFIX_CONSOLE_TEST_DATA_DIR", ROOT / "data" / "test-cache"))


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language and the rest of its info string, its text."""

    doc: Path
    line: int  # 1-based line of the opening fence
    language: str
    tags: frozenset[str]
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def fenced_blocks(doc: Path) -> list[Block]:
    blocks: list[Block] = []
    lines = doc.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            info = lines[i][3:].split()
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            if end is None:
                raise ValueError(f"{doc}:{i + 1}: a code block that never closes")
            language = info[0] if info else ""
            blocks.append(Block(doc, i + 1, language, frozenset(info[1:]), "\n".join(lines[i + 1 : end])))
            i = end + 1
        else:
            i += 1
    return blocks


def prose(doc: Path) -> str:
    """The document without its fenced blocks."""
    return re.sub(r"^```.*?^```[^\n]*$", "", doc.read_text(), flags=re.S | re.M)


def inline_code(doc: Path) -> list[str]:
    return re.findall(r"`([^`\n]+)`", prose(doc))


def shell_commands(text: str) -> list[list[str]]:
    """The commands of a shell text, each as its words: quotes removed, `\\`-newline joined, comments
    dropped, split at unquoted newlines, `;`, `&`, `|` (and their doubles)."""
    commands: list[list[str]] = []
    words: list[str] = []
    word: list[str] | None = None
    quote = ""
    i = 0

    def end_word() -> None:
        nonlocal word
        if word is not None:
            words.append("".join(word))
            word = None

    def end_command() -> None:
        nonlocal words
        end_word()
        if words:
            commands.append(words)
        words = []

    while i < len(text):
        c = text[i]
        if quote:
            if c == quote:
                quote = ""
            elif c == "\\" and quote == '"' and i + 1 < len(text):
                i += 1
                word.append(text[i])  # type: ignore[union-attr]
            else:
                word.append(c)  # type: ignore[union-attr]
        elif c == "\\" and i + 1 < len(text):
            i += 1
            if text[i] != "\n":
                word = (word or []) + [text[i]]
        elif c in "'\"":
            quote = c
            word = word or []
        elif c == "#" and word is None:
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        elif c in "\n;&|":
            end_command()
        elif c in " \t":
            end_word()
        else:
            word = (word or []) + [c]
        i += 1
    if quote:
        raise ValueError(f"an unclosed {quote} quote in: {text[:80]!r}")
    end_command()
    return commands


def documented_commands() -> list[tuple[str, list[str]]]:
    """(where, words) of every command the docs show, in shell blocks and in inline code."""
    found: list[tuple[str, list[str]]] = []
    for doc in DOCS:
        for block in fenced_blocks(doc):
            if block.language in SHELL_LANGUAGES:
                found += [(block.where, words) for words in shell_commands(block.text)]
        for code in inline_code(doc):
            if code.startswith("make ") or "python -m cli" in code:
                found += [(str(doc.relative_to(ROOT)), words) for words in shell_commands(code)]
    return found


def without_assignments(words: list[str]) -> list[str]:
    """The command past its leading `NAME=value` environment assignments."""
    i = 0
    while i < len(words) and re.fullmatch(r"[A-Za-z_]\w*=.*", words[i]):
        i += 1
    return words[i:]


def options(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("--")]


@cache
def cli_help(command: tuple[str, ...]) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "cli", *command, "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=HELP_TIMEOUT_S,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def subcommands(help_text: str) -> set[str]:
    """The choices of a parser's subcommand positional (`{watch,state}`), if it has one."""
    match = re.search(r"^positional arguments:\s*\n\s+\{([\w,-]+)\}", help_text, flags=re.M)
    return set(match.group(1).split(",")) if match else set()


@cache
def makefile() -> tuple[set[str], str]:
    text = (ROOT / "Makefile").read_text()
    targets = set()
    for match in re.finditer(r"^([\w.$()/ -]+?)\s*:(?!=)", text, flags=re.M):
        targets.update(match.group(1).split())
    return targets, text


def check_command(words: list[str]) -> list[str]:
    """What is wrong with one documented command (empty: nothing)."""
    words = without_assignments(words)
    if not words:
        return []
    if words[0] == "make":
        targets, text = makefile()
        problems = []
        for word in words[1:]:
            if word.startswith("-"):
                continue
            if "=" in word:
                name = word.split("=", 1)[0]
                if not re.search(rf"(\$\(|\$\{{|^){re.escape(name)}\b", text, flags=re.M):
                    problems.append(f"make variable {name} is not used in the Makefile")
            elif word not in targets:
                problems.append(f"make target {word!r} is not in the Makefile")
        return problems
    if words[0] not in PYTHONS:
        return []
    rest = words[1:]
    while rest and rest[0] in ("-O", "-OO", "-u", "-X"):
        rest = rest[2:] if rest[0] == "-X" else rest[1:]
    if rest[:2] == ["-m", "cli"]:
        return check_cli(rest[2:])
    if rest and rest[0].endswith(".py"):
        script = ROOT / rest[0]
        if not script.is_file():
            return [f"script {rest[0]} does not exist"]
        source = script.read_text()
        return [f"{rest[0]} has no option {o}" for o in options(rest[1:]) if f'"{o}"' not in source]
    return []


def check_cli(args: list[str]) -> list[str]:
    command: list[str] = []
    for word in args:
        if word.startswith("-"):
            break
        if word.isupper():
            return []  # a placeholder: `python -m cli COMMAND --help`
        status, text = cli_help(tuple(command)) if command else (0, "")
        if command and word not in subcommands(text):
            break
        command.append(word)
    if not command:
        return ["`python -m cli` without a command"]
    status, text = cli_help(tuple(command))
    shown = "python -m cli " + " ".join(command)
    if status != 0:
        return [f"`{shown} --help` failed: {text.strip()[-300:]}"]
    unknown = [o for o in options(args) if o != "--help" and not re.search(rf"{re.escape(o)}\b", text)]
    return [f"`{shown}` has no option {o}" for o in unknown]


def repository_paths(words: list[str]) -> list[str]:
    top = {p.name for p in ROOT.iterdir()} - NOT_IN_REPOSITORY
    return [w for w in words if re.fullmatch(r"[\w.-]+(/[\w.*-]*)+", w) and w.split("/", 1)[0] in top]


def missing_paths(words: list[str]) -> list[str]:
    missing = []
    for path in repository_paths(words):
        exists = any(ROOT.glob(path.rstrip("/"))) if "*" in path else (ROOT / path).exists()
        if not exists:
            missing.append(path)
    return missing


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    return {slug(m) for m in re.findall(r"^#+ (.+)$", prose(doc), flags=re.M)}


def broken_links(doc: Path) -> list[str]:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(doc)):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    return broken


def python_blocks() -> list[Block]:
    return [b for doc in DOCS for b in fenced_blocks(doc) if b.language == "python"]


# ---------------------------------------------------------------------------------------------- tests
def test_the_readme_stays_under_300_lines():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; depth belongs in docs/"


def test_every_command_the_docs_show_runs_with_the_options_shown():
    commands = documented_commands()
    assert any(w[:3] == ["python", "-m", "cli"] or w[1:3] == ["-m", "cli"] for _, w in commands)
    problems = [f"{where}: {p}" for where, words in commands for p in check_command(words)]
    assert not problems, "\n".join(problems)


def test_every_repository_path_the_docs_name_exists():
    problems = []
    for doc in DOCS:
        name = str(doc.relative_to(ROOT))
        problems += [f"{name}: {p}" for code in inline_code(doc) for p in missing_paths(code.split())]
        for block in fenced_blocks(doc):
            if block.language in SHELL_LANGUAGES:
                for words in shell_commands(block.text):
                    problems += [f"{block.where}: {p}" for p in missing_paths(words)]
    assert not problems, "\n".join(problems)


def test_every_link_and_image_in_the_docs_points_at_something_that_exists():
    problems = [f"{doc.relative_to(ROOT)}: {p}" for doc in DOCS for p in broken_links(doc)]
    assert not problems, "\n".join(problems)


def test_every_python_block_compiles():
    blocks = python_blocks()
    assert blocks
    for block in blocks:
        compile(block.text, block.where, "exec")


@pytest.mark.parametrize("block", [b for b in python_blocks() if NEEDS_SERVER not in b.tags], ids=lambda b: b.where)
def test_a_python_block_that_needs_no_server_runs_as_shown(block: Block, monkeypatch: pytest.MonkeyPatch):
    # In this process: torch and transformers are already imported (tests/conftest.py), which a fresh
    # interpreter would spend most of its time on. The block gets a namespace of its own.
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PREFIX_CONSOLE_DATA_DIR", str(TEST_DATA_DIR))
    exec(compile(block.text, block.where, "exec"), {"__name__": "__docs__"})


def test_the_checks_catch_a_stale_option_a_missing_target_and_a_missing_path():
    doc_text = """\
make run-everything
make run NO_SUCH_VARIABLE=1
.venv/bin/python -m cli why --db sqlite:///x.sqlite --no-such-option
python -m cli fleet state --db URL --pods a
python -m cli no-such-command --db URL
python benchmarks/peer_vllm.py --no-such-flag
"""
    problems = [p for words in shell_commands(doc_text) for p in check_command(words)]
    assert len(problems) == 6, problems
    assert missing_paths(["engine/core/no_such_module.py", "engine/core/block_pool.py", "data/x.sqlite"]) == [
        "engine/core/no_such_module.py"
    ]


def test_commands_split_as_a_shell_splits_them():
    text = """\
.venv/bin/python -m cli serve --port 8000 \\
    --db sqlite:///data/h.sqlite &   # a comment with --not-an-option
curl -s URL -d '{
  "a": "b # not a comment"}' && make test
"""
    assert shell_commands(text) == [
        [".venv/bin/python", "-m", "cli", "serve", "--port", "8000", "--db", "sqlite:///data/h.sqlite"],
        ["curl", "-s", "URL", "-d", '{\n  "a": "b # not a comment"}'],
        ["make", "test"],
    ]
