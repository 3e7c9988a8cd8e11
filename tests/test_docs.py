"""Every code block of the README and docs/ runs here, at tiny settings, or says why not.

A fenced block with a language is code. The line above it may say `<!-- not run: why -->`
(a GPU, the network, a server that outlives the test, hours of compute); every other block runs:
Python in a fresh process, shell blocks command by command through the installed `stepgrpo`, YAML
and TOML parsed (a config fragment validated as a config). They run in an empty directory that
holds the checkout's `models/` and `configs/` (links), as the docs' paths assume the repository
root. Training commands get the tiny settings below appended (`--set` / `overrides`), so the
documented commands and calls are the ones that run, only smaller.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = [
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    *sorted((REPO / "docs" / "bench").glob("*/README.md")),  # a benchmark question's page
    REPO / "models" / "shapes" / "README.md",
]
FENCE = re.compile(r"^\s*```(\S*)\s*$")
SKIP = re.compile(r"^\s*<!-- not run: (.+) -->\s*$")
LANGUAGES = {"python", "bash", "sh", "yaml", "toml"}
TINY = [
    "run.iterations=1",
    "run.prompts_per_iteration=2",
    "run.group_size=2",
    "run.eval_prompts=2",
    "run.eval_seeds=1",
    "sampler.steps=4",
    "sampler.eval_steps=4",
    "sampler.sde_window_size=2",
]
TRAINING = {"train", "demo", "calibrate"}  # the commands that take the tiny settings
NOISED_TINY = ["update.times=2"]  # and, for an objective on noised copies, its grid times within the tiny steps
SMALL = {"credit-quality": ["--continuations", "2"]}  # and the tiny flags of the others


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    text: str
    not_run: str | None  # the reason given above it

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if FENCE.match(lines[j]) and not FENCE.match(lines[j]).group(1))
        above = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        reason = SKIP.match(above)
        body = "\n".join(line[len(lines[i]) - len(lines[i].lstrip()) :] for line in lines[i + 1 : end])
        found.append(Block(path, i + 1, opened.group(1), body, reason.group(1) if reason else None))
        i = end + 1
    return found


ALL = [b for doc in DOCS for b in blocks(doc)]
CODE = [b for b in ALL if b.language in LANGUAGES]
RUN = [b for b in CODE if b.not_run is None]


def checkout_like(tmp_path: Path) -> Path:
    """An empty working directory with the repository's `models/` and `configs/` in it."""
    tmp_path.mkdir(exist_ok=True)
    for name in ("models", "configs"):
        (tmp_path / name).symlink_to(REPO / name, target_is_directory=True)
    return tmp_path


def commands(block: Block) -> list[list[str]]:
    """A shell block's commands: continuation lines joined, comments dropped, each split."""
    joined = re.sub(r"\\\n\s*", " ", block.text)
    return [shlex.split(line, comments=True) for line in joined.split("\n") if shlex.split(line, comments=True)]


def stepgrpo_args(argv: list[str]) -> list[str] | None:
    """A `stepgrpo ...` (or `.venv/bin/stepgrpo ...`) command's arguments; None for anything else."""
    return argv[1:] if argv and Path(argv[0]).name == "stepgrpo" else None


def test_the_docs_have_code_blocks_and_every_fence_closes():
    assert len(CODE) > 20 and len(RUN) >= 8
    assert {b.language for b in ALL} <= LANGUAGES | {"", "text"}, {b.language for b in ALL}


@pytest.mark.parametrize("block", [b for b in CODE if b.language in ("bash", "sh")], ids=lambda b: b.name)
def test_a_shell_block_runs_only_stepgrpo_or_says_why_not(block):
    """What runs here is stepgrpo's own commands; anything else (make, pip, prefect, a server)
    must carry its reason, so no documented command is silently left out."""
    if block.not_run is None:
        others = [argv for argv in commands(block) if stepgrpo_args(argv) is None]
        assert others == [], f"{block.name}: mark it <!-- not run: why --> or run only stepgrpo commands"
    else:
        assert len(block.not_run) > 10


@pytest.mark.parametrize("block", [b for b in RUN if b.language in ("yaml", "toml")], ids=lambda b: b.name)
def test_a_yaml_or_toml_block_parses_and_a_config_fragment_validates(block, tmp_path, monkeypatch):
    """A fragment that names the user's own modules (`mypkg.rewards:Redness`) validates with the
    same document's Python blocks written as those modules (a block whose first line is its file name)."""
    if block.language == "toml":
        assert tomllib.loads(block.text)
        return
    from stepgrpo.config import Config, config_from

    for other in blocks(block.path):
        first = other.text.split("\n", 1)[0]
        if other.language == "python" and re.fullmatch(r"# [\w/]+\.py", first):
            module = tmp_path / first[2:]
            module.parent.mkdir(parents=True, exist_ok=True)
            (module.parent / "__init__.py").touch()
            module.write_text(other.text)
    monkeypatch.syspath_prepend(str(tmp_path))

    data = yaml.safe_load(block.text)
    assert isinstance(data, dict) and data
    if set(data) <= set(Config.model_fields):  # a config fragment: it must validate as one
        config_from(data, None, [])


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in RUN if b.language == "python"], ids=lambda b: b.name)
def test_a_python_block_runs(block, warm_cli, tmp_path):
    """As `python block.py` from an empty directory (in a warm child: tests/warm_cli.py, which
    imported stepgrpo and its libraries, not the block's own names); `stepgrpo.train` and
    `calibrate` calls get the tiny settings appended to their `overrides`, `credit_quality` two
    continuations a state."""
    preamble = (
        "import stepgrpo.flows.session as _s\n"
        "_config_of = _s.config_of\n"
        "def _noised(config, overrides):\n"
        "    return [] if _config_of(config, list(overrides)).update.on_transitions else "
        f"{NOISED_TINY!r}\n"
        f"_tiny = {TINY!r}\n"
        "_s.config_of = lambda config, sets: _config_of(config, [*sets, *_tiny, *_noised(config, sets)])\n"
        "import stepgrpo as _g\n"
        "_quality = _g.credit_quality\n"
        "_g.credit_quality = lambda *a, **k: _quality(*a, **{'continuations': 2, **k})\n"
    )
    script = tmp_path / "block.py"
    script.write_text(preamble + block.text + "\n")
    done = warm_cli.python(script, cwd=checkout_like(tmp_path / "work"), env=warm_cli.env, timeout=600)
    assert done.returncode == 0, f"{block.name}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in RUN if b.language in ("bash", "sh")], ids=lambda b: b.name)
def test_a_shell_block_runs(block, warm_cli, tmp_path):
    """Its commands in order, in one empty directory (runs/ under it), each as the console script
    runs it (in a warm child: tests/warm_cli.py); a training command gets the tiny settings as
    `--set`s, `credit-quality` two continuations a state."""
    work = checkout_like(tmp_path)
    for argv in commands(block):
        args = stepgrpo_args(argv)
        if args and args[0] in TRAINING:
            args = [*args, *[a for s in [*TINY, *noised_tiny(args)] for a in ("--set", s)]]
        elif args and args[0] in SMALL:
            args = [*args, *SMALL[args[0]]]
        done = warm_cli.run(args, cwd=work, env=warm_cli.env, timeout=600)
        assert done.returncode == 0, f"{block.name}: {shlex.join(argv)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def noised_tiny(args: list[str]) -> list[str]:
    """`NOISED_TINY` where the command's `--config` trains an objective on noised copies (AWM, DiffusionNFT)."""
    from stepgrpo.config import load_config

    if "--config" not in args:
        return []
    name = args[args.index("--config") + 1]
    path = Path(name) if (REPO / name).is_file() else name
    return [] if load_config(REPO / path if isinstance(path, Path) else path).update.on_transitions else NOISED_TINY


# --------------------------------------------------------------------------------- lists of names

LIST_SEPARATOR = r"(?:\s*[,/|;]\s*(?:and\s+|or\s+)?|\s+(?:and|or)\s+)"
NAME = r"`?[A-Za-z_][\w\-]*`?"
EXAMPLES = re.compile(r"(?:e\.g\.|for example|such as)[\s(`]*$")  # a list given as examples is no list of a family
GENERATED = re.compile(r"<!-- (\w+): generated.*?<!-- /\1 -->", re.S)


def hand_lists(text: str, family: set[str], least: int = 3) -> list[tuple[int, str]]:
    """Runs of at least `least` names of `family` joined by list separators in `text` (a line and the
    run): a list that goes stale when the family grows. Markdown table rows (data, one arm a cell),
    generated regions and lists given as examples are not lists of the family."""
    text = GENERATED.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    text = "\n".join("" if line.lstrip().startswith("|") else line for line in text.split("\n"))
    found = []
    for m in re.finditer(NAME + "(?:" + LIST_SEPARATOR + NAME + ")+", text):
        names = [n.strip("`") for n in re.findall(NAME, m.group(0)) if n.strip("`") not in ("and", "or")]
        ours = set(names) & family
        if len(ours) >= least and len(ours) >= len(set(names)) - 1 and not EXAMPLES.search(text[: m.start()]):
            found.append((text[: m.start()].count("\n") + 1, m.group(0)))
    return found


def test_no_document_or_docstring_lists_a_familys_names_by_hand():
    """The names of a family (kernels, completions, credit schemes, objectives, rewards, optimizer
    presets, evaluation protocols) are listed by their registry alone (`stepgrpo config variants`;
    the variants table of METHODS.md is its output): the README, every page under docs/ and every
    docstring and comment of the code (a config field's help is its docstring) name one where it
    matters, never the whole family by hand."""
    from stepgrpo.families import families

    folders = ("stepgrpo", "stepgrpo_cli", "stepgrpo_core", "flows", "tasks", "storage")
    code = sorted({p.resolve() for d in folders for p in (REPO / d).rglob("*.py")})  # stepgrpo/flows: a link
    lists = []
    for path in [*DOCS, *code]:
        text = path.read_text()
        for heading, registry in families().items():
            for line, run in hand_lists(text, set(registry.names())):
                lists.append(f"{path.relative_to(REPO)}:{line}: the {heading}s {run!r}")
    assert lists == [], "name the registry (`stepgrpo config variants`) instead:\n" + "\n".join(lists)


def test_a_hand_written_list_of_a_family_is_found():
    family = {"ode", "flow", "cps", "ddim"}
    assert hand_lists("kind: one of `ode`, `flow`, `cps` or `ddim`.", family) == [(1, "`ode`, `flow`, `cps` or `ddim`")]
    assert hand_lists("kind: one of ode | flow | cps\n", family) != []
    assert hand_lists("| ode | flow | cps |\n", family) == []  # a table row
    assert hand_lists("e.g. `ode`, `flow`, `cps`", family) == []  # examples
    assert hand_lists("`ode` and `flow`", family) == []  # two
