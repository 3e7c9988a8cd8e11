"""The packages' one-way arrows (docs/ARCHITECTURE.md), read from the code's imports with the
installed names mapped back to the repository's folders (`stepgrpo.flows` is `flows/`), and no
import of a generic top-level name (`flows`, `tasks`, `storage`) anywhere in the product."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# each package and the packages it may import (anything below it, through any number of layers)
BELOW = {
    "stepgrpo_cli": {"flows", "tasks", "stepgrpo", "stepgrpo_core", "storage"},
    "flows": {"tasks", "stepgrpo", "stepgrpo_core", "storage"},
    "tasks": {"stepgrpo", "stepgrpo_core", "storage"},
    "stepgrpo": {"stepgrpo_core", "storage"},
    "stepgrpo_core": set(),
    "storage": set(),
}
MAPPED = {"stepgrpo.flows": "flows", "stepgrpo.tasks": "tasks", "stepgrpo.storage": "storage"}
FACE = REPO / "stepgrpo" / "__init__.py"  # hands on the Python entry (`stepgrpo.flows.api`): names only


def package_of(module: str) -> str | None:
    """The repository folder an absolute import lands in (None: not the project's)."""
    for name, folder in MAPPED.items():
        if module == name or module.startswith(name + "."):
            return folder
    top = module.split(".")[0]
    return top if top in BELOW else None


def imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append(node.module)
    return found


def product_files():
    for package in BELOW:
        yield from ((package, path) for path in sorted((REPO / package).rglob("*.py")))


# Inside `stepgrpo`, the rooms stand on each other (docs/ARCHITECTURE.md): a room imports rooms of a
# lower level only (same level: none), through any number of levels
ROOMS = [
    {"_package", "errors", "paths", "images", "results", "shipped"},  # the contracts (and the shipped files)
    {"config"},  # the validated config
    {"policy", "shapes"},  # the models
    {"rewards"},  # the scorers (built on the models)
    {"plugins", "prompts", "runtime", "reporting", "pretraining"},
    {"families"},  # every family of names a config takes, by its registry
    {"loops"},  # the computations a stage calls
    {"runs"},  # a run as the pipeline opens it
    {"checks", "inspection"},  # what is checked before a server starts; the read side of a run
]
LEVEL = {room: level for level, rooms in enumerate(ROOMS) for room in rooms}
# the one import up: a config's `reward.name` is checked against the rewards registry, the list of
# names (imported inside the validator, when a config is validated)
UP = {("config", "rewards")}


def room_of(path: Path) -> str:
    parts = path.relative_to(REPO / "stepgrpo").parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def test_the_rooms_of_stepgrpo_stand_on_each_other():
    rooms = {room_of(p) for p in (REPO / "stepgrpo").rglob("*.py")} - {"__init__"}
    assert rooms == set(LEVEL), "a new room of stepgrpo/: give it a level in ROOMS"
    up = []
    for path in sorted((REPO / "stepgrpo").rglob("*.py")):  # not through the links to flows/, tasks/, storage/
        room = room_of(path)
        if room == "__init__":
            continue
        for module in imports(path):
            parts = module.split(".")
            if parts[0] != "stepgrpo" or len(parts) < 2 or parts[1] in MAPPED_ROOMS or parts[1] == room:
                continue
            if LEVEL[parts[1]] >= LEVEL[room] and (room, parts[1]) not in UP:
                up.append(f"{path.relative_to(REPO)} imports {module} ({room} -> {parts[1]})")
    assert up == []


MAPPED_ROOMS = {"flows", "tasks", "storage"}  # stepgrpo.<name>: the top-level packages, held by the test below


def test_every_import_runs_down_the_layers():
    up = []
    for package, path in product_files():
        for module in imports(path):
            target = package_of(module)
            if target in (None, package) or target in BELOW[package]:
                continue
            if path == FACE and module == "stepgrpo.flows.api":
                continue
            up.append(f"{path.relative_to(REPO)} imports {module} ({package} -> {target})")
    assert up == []


def test_the_product_imports_no_generic_top_level_name():
    generic = [
        f"{path.relative_to(REPO)}: {module}"
        for _, path in product_files()
        for module in imports(path)
        if module.split(".")[0] in {"flows", "tasks", "storage"}
    ]
    assert generic == []


def test_the_face_defines_nothing_and_hands_on_the_entry():
    """`stepgrpo/__init__.py` only hands names on; importing it imports no flow (each API function
    imports its flow when called), so every module's `import stepgrpo.<module>` stays cheap."""
    tree = ast.parse(FACE.read_text())
    assert all(isinstance(n, ast.ImportFrom | ast.Assign | ast.Expr) for n in tree.body)
    # what the face imports at once: the standard library, session and the result classes
    for name in ("api.py", "session.py", "outcomes.py", "stored.py"):
        tree = ast.parse((REPO / "flows" / name).read_text())
        top = [m for n in tree.body if isinstance(n, ast.ImportFrom | ast.Import) for m in imports_of(n)]
        light = {"stepgrpo.flows", "stepgrpo.flows.outcomes", "stepgrpo.flows.stored"}
        assert {m for m in top if package_of(m)} <= light, (name, top)


def imports_of(node: ast.Import | ast.ImportFrom) -> list[str]:
    return [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]


def run_python(code: str, cwd: Path) -> str:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_importing_stepgrpo_imports_no_flow_prefect_or_torch(tmp_path):
    out = run_python(
        "import sys, stepgrpo.storage.errors, stepgrpo; "
        "print(sorted(m for m in ('prefect', 'torch', 'stepgrpo.flows.train', 'flows', 'tasks', 'storage') "
        "if m in sys.modules), callable(stepgrpo.train))",
        tmp_path,
    )
    assert out.split() == ["[]", "True"]


def test_a_checkout_that_is_not_installed_has_the_same_names(tmp_path):
    """`PYTHONPATH=<checkout>` with no install (the GPU benchmark's way): `stepgrpo.flows` is the
    checkout's `flows/` through the link `stepgrpo/flows`, with no import hook of ours or an install's
    (the editable install's finder is taken away first)."""
    code = (
        "import sys; "
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in type(f).__module__.lower() "
        "and 'editable' not in getattr(f, '__name__', '').lower()]; "
        f"sys.path.insert(0, {str(REPO)!r}); "
        "import os, stepgrpo.flows.train, stepgrpo.storage.run, stepgrpo.tasks.base; "
        "print(os.path.realpath(stepgrpo.flows.train.__file__), os.path.realpath(stepgrpo.storage.run.__file__), "
        "not [f for f in sys.meta_path if type(f).__module__.startswith('stepgrpo')])"
    )
    flows, storage, no_hook = run_python(code, tmp_path).split()
    assert (flows, storage, no_hook) == (str(REPO / "flows" / "train.py"), str(REPO / "storage" / "run.py"), "True")


@pytest.mark.slow
def test_a_static_type_checker_resolves_every_import():
    """basedpyright (pyproject's `[tool.basedpyright]`: the code's packages, unresolved imports as
    errors) over the checkout as an editor sees it: no import it cannot follow, `stepgrpo.flows`,
    `stepgrpo.tasks` and `stepgrpo.storage` included (the optional extras marked where imported)."""
    done = subprocess.run(
        # the project file and this interpreter named: found by itself, neither is under every path
        # a clone can sit at (a checkout under /tmp analysed no file)
        [str(Path(sys.executable).with_name("basedpyright")), "--outputjson", "-p", str(REPO / "pyproject.toml"),
         "--pythonpath", sys.executable],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    report = json.loads(done.stdout)
    unresolved = [
        f"{d['file']}:{d['range']['start']['line'] + 1}: {d['message']}"
        for d in report["generalDiagnostics"]
        if d.get("rule") in ("reportMissingImports", "reportMissingModuleSource")
    ]
    assert unresolved == [] and report["summary"]["filesAnalyzed"] > 100, unresolved[:10]


@pytest.mark.slow
def test_a_type_checker_in_a_users_own_project_resolves_the_installed_names(tmp_path):
    """From a project outside the checkout (no path of it given), basedpyright resolves every
    `stepgrpo.*` name through the install and reads its signatures: the editable install is strict
    (pyproject.toml's `[tool.distutils.editable_wheel]`), whose files a checker follows where the
    default's import hook hides them, and the packages are marked typed (`py.typed`)."""
    (tmp_path / "use.py").write_text(
        "import stepgrpo\n"
        "from stepgrpo.config import load_config\n"
        "from stepgrpo.flows.train import train\n"
        "from stepgrpo.storage.run import Run\n"
        "from stepgrpo.tasks.credit import credit\n"
        "from stepgrpo_cli import main\n"
        "from stepgrpo_core import assign\n"
        "reveal_type(load_config)\n"
        "reveal_type(stepgrpo.train)\n"
        "print(train, Run, credit, main, assign)\n"
    )
    done = subprocess.run(
        [str(Path(sys.executable).with_name("basedpyright")), "--outputjson", "--pythonpath", sys.executable, "use.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    report = json.loads(done.stdout)
    problems = [
        f"{d.get('rule')}: {d['message']}"
        for d in report["generalDiagnostics"]
        if d.get("rule") in ("reportMissingImports", "reportMissingModuleSource", "reportAttributeAccessIssue",
                             "reportMissingTypeStubs")
    ]  # fmt: skip
    assert problems == [], problems
    revealed = [d["message"] for d in report["generalDiagnostics"] if d["severity"] == "information"]
    assert len(revealed) == 2 and "-> Config" in revealed[0] and "Unknown" not in revealed[0], revealed


def test_the_installed_names_are_links_to_the_top_level_folders():
    """`stepgrpo/flows` -> `flows/` (tasks, storage; the shipped configs and models): relative links,
    so a clone anywhere resolves them, and what a static checker or an editor follows."""
    links = {
        "stepgrpo/flows": "flows",
        "stepgrpo/tasks": "tasks",
        "stepgrpo/storage": "storage",
        "stepgrpo/shipped/configs": "configs",
        "stepgrpo/shipped/models": "models",
    }
    for link, folder in links.items():
        path = REPO / link
        assert path.is_symlink() and not Path(os.readlink(path)).is_absolute(), link
        assert path.resolve() == REPO / folder, link


def test_without_verbose_prefect_console_drops_error_records_only():
    """The console script's `quiet_failures`: Prefect's console handlers pass a flow's own lines
    (INFO, WARNING) and drop its error records, a failure's tracebacks (the CLI prints one line)."""
    import logging

    import prefect  # noqa: F401  (sets up its handlers)

    from stepgrpo.flows import session

    session.quiet_failures()
    session.quiet_failures()  # once is enough: no second filter
    handlers = [h for h in logging.getLogger().handlers if type(h).__name__ == "PrefectConsoleHandler"]
    assert handlers
    for handler in handlers:
        assert len([f for f in handler.filters if type(f).__name__ == "_NoErrors"]) == 1
        record = logging.LogRecord("prefect.flow_runs", logging.INFO, __file__, 1, "resuming run", None, None)
        assert handler.filter(record)
        record.levelno = logging.ERROR
        assert not handler.filter(record)
        record.name = "mine"  # another logger's error still shows
        assert handler.filter(record)
        handler.filters = [f for f in handler.filters if type(f).__name__ != "_NoErrors"]  # as it was
