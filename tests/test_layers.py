"""The packages' one-way arrows (docs/ARCHITECTURE.md), read from the code's imports with the
installed names mapped back to the repository's folders (`stepgrpo.flows` is `flows/`), and no
import of a generic top-level name (`flows`, `tasks`, `storage`) anywhere in the product."""

from __future__ import annotations

import ast
from pathlib import Path

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
    for name in ("api.py", "session.py"):  # what the face imports at once: the standard library, and session
        tree = ast.parse((REPO / "flows" / name).read_text())
        top = [m for n in tree.body if isinstance(n, ast.ImportFrom | ast.Import) for m in imports_of(n)]
        assert [m for m in top if package_of(m)] in ([], ["stepgrpo.flows"]), (name, top)


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


def test_a_checkout_that_is_not_installed_maps_the_same_names(tmp_path):
    """`PYTHONPATH=<checkout>` with no install (the GPU benchmark's way): `stepgrpo._package` maps
    `stepgrpo.flows` to the checkout's `flows/`. The editable install's finder is taken away first."""
    code = (
        "import sys; "
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in type(f).__module__.lower() "
        "and 'editable' not in getattr(f, '__name__', '').lower()]; "
        f"sys.path.insert(0, {str(REPO)!r}); "
        "import stepgrpo.flows.train, stepgrpo.storage.run, stepgrpo.tasks.base; "
        "print(stepgrpo.flows.train.__file__, stepgrpo.storage.run.__file__, "
        "any(type(f).__name__ == 'CheckoutPackages' for f in sys.meta_path))"
    )
    flows, storage, mapped = run_python(code, tmp_path).split()
    assert (flows, storage, mapped) == (str(REPO / "flows" / "train.py"), str(REPO / "storage" / "run.py"), "True")


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
