"""Screenshots of the Prefect and MLflow UIs for docs/PIPELINE.md: the typed run form of a
deployment made by `stepgrpo deploy`, the artifacts of a training run started from it through a
worker (its summary with the base -> trained gain), and MLflow's chart of the four credit schemes'
held-out reward against cumulative transformer NFEs (`heldout/reward_by_nfe`, no axis to set), an
evaluation image at its default size, a run's page with its description on top, and the model
card of an exported LoRA as the hub renders one.

    python -m bench.deployed.ui_screenshots [--out docs/images] [--chromium /usr/bin/chromium] [--only prefect|mlflow]

It starts its own Prefect server (a temporary PREFECT_HOME, a free port), creates the `stepgrpo`
process pool, deploys configs/shapes_stepwise.yaml, runs it for two short iterations through a
`--run-once` worker (a run directory under runs/), and photographs the pages with headless
Chromium driven by Playwright (`pip install playwright`; the browser is the system's Chromium:
Debian's `chromium` package, no browser download). For MLflow it trains the four shipped shapes
recipes (outcome, stepwise, dense, turning_point) for 4 iterations each into a temporary runs root
(`--mlflow-runs DIR` reuses such a root) and serves its store with `mlflow ui`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from bench._lib.prefect import BIN, api, call, free_port, local_server

REPO = Path(__file__).resolve().parents[2]
CHROMIUM_FLAGS = [  # headless on a machine without network: no background connections
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
RUN_ID = "ui-screenshots"
SCHEMES = ("outcome", "stepwise", "dense", "turning_point")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    p.add_argument("--chromium", default="/usr/bin/chromium")
    p.add_argument("--only", choices=("prefect", "mlflow"), default=None)
    p.add_argument("--mlflow-runs", type=Path, default=None, help="a runs root with the four schemes' runs")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only != "mlflow":
        prefect_shots(args)
    if args.only != "prefect":
        mlflow_shots(args)


def browser(pw, chromium: str):
    return pw.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)


def prefect_shots(args: argparse.Namespace) -> None:
    from playwright.sync_api import sync_playwright

    home = Path(tempfile.mkdtemp(prefix="prefect-home-"))
    with local_server(dict(os.environ), home) as (url, port, env):
        call(env, REPO, str(BIN / "prefect"), "work-pool", "create", "stepgrpo", "--type", "process")
        call(env, REPO, str(BIN / "stepgrpo"), "deploy", "--config", "configs/shapes_stepwise.yaml")
        (dep,) = api(url, "/deployments/filter", {"deployments": {"name": {"any_": ["shapes_stepwise"]}}})
        runs = Path(tempfile.gettempdir()) / "stepgrpo-ui" / "runs"  # the summary shows it: not the checkout's path
        overrides = json.dumps(["run.iterations=2", "run.eval_prompts=16", "run.eval_seeds=1", f"run.runs_root={runs}"])
        call(
            env,
            REPO,
            str(BIN / "prefect"),
            "deployment",
            "run",
            "train/shapes_stepwise",
            "--param",
            f"overrides={overrides}",
            "--param",
            f"run_id={RUN_ID}-{time.strftime('%Y%m%d-%H%M%S')}",
        )
        call(env, REPO, str(BIN / "prefect"), "worker", "start", "--pool", "stepgrpo", "--run-once", timeout=1800)
        (run,) = api(url, "/flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [dep["id"]]}}})
        with sync_playwright() as pw:
            b = browser(pw, args.chromium)
            page = b.new_page(viewport={"width": 1440, "height": 1100})
            page.goto(f"http://127.0.0.1:{port}/deployments/deployment/{dep['id']}/run")
            page.wait_for_timeout(4000)
            page.screenshot(path=str(args.out / "prefect-run-form.png"))
            # the credit section: the registered schemes are the choices of a select
            page.get_by_text("Credit scheme: a name in").first.scroll_into_view_if_needed()
            page.mouse.wheel(0, -350)
            page.wait_for_timeout(1000)
            page.screenshot(path=str(args.out / "prefect-run-form-credit.png"))
            page.goto(f"http://127.0.0.1:{port}/runs/flow-run/{run['id']}")  # named flow and task runs
            page.wait_for_timeout(4000)
            page.get_by_text("Artifacts", exact=True).first.click()
            page.wait_for_timeout(3000)
            page.screenshot(path=str(args.out / "prefect-run-artifacts.png"))
            page.get_by_text(f"{run['name']}-rewards").first.click()
            page.wait_for_timeout(3000)
            page.screenshot(path=str(args.out / "prefect-reward-table.png"))
            key = f"{run['name']}-summary"  # its markdown: the held-out rewards, the base -> trained gain
            (summary,) = api(url, "/artifacts/filter", {"artifacts": {"key": {"any_": [key]}}})
            page.goto(f"http://127.0.0.1:{port}/artifacts/artifact/{summary['id']}")
            page.wait_for_timeout(4000)
            page.screenshot(path=str(args.out / "prefect-summary-gain.png"))
            b.close()
        print(f"flow run {run['name']}: Prefect screenshots in {args.out}")


def mlflow_shots(args: argparse.Namespace) -> None:
    from playwright.sync_api import sync_playwright

    root = args.mlflow_runs
    if root is None:
        root = Path(tempfile.mkdtemp(prefix="stepgrpo-ui-runs-"))
        env = dict(os.environ, STEPGRPO_PROGRESS="0", STEPGRPO_KEPT_SERVER="0")
        env["PREFECT_HOME"] = str(root / "prefect-home")
        for scheme in SCHEMES:
            sets = ["run.iterations=4", "run.eval_every=2", "run.eval_prompts=16", "run.eval_seeds=1"]
            sets += [f"run.runs_root={root}", "scale.threads=1"]
            cmd = [str(BIN / "stepgrpo"), "train", "--config", f"shapes_{scheme}", "--run-id", f"ui-{scheme}"]
            call(env, REPO, *cmd, *[x for s in sets for x in ("--set", s)], timeout=3600)
    port = free_port()
    store = f"sqlite:///{root / 'mlflow.db'}"
    server = subprocess.Popen(
        [str(BIN / "mlflow"), "ui", "--backend-store-uri", store, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(180):
            try:
                urllib.request.urlopen(f"{base}/health", timeout=1)
                break
            except OSError:
                time.sleep(1)
        found = json.load(
            urllib.request.urlopen(f"{base}/api/2.0/mlflow/experiments/get-by-name?experiment_name=stepgrpo")
        )
        exp = found["experiment"]["experiment_id"]
        with sync_playwright() as pw:
            b = browser(pw, args.chromium)
            page = b.new_page(viewport={"width": 1440, "height": 1000})
            # the classic training view, runs as charts
            page.goto(f"{base}/#/experiments/{exp}/runs?workflowType=machine_learning&compareRunsMode=CHART")
            page.wait_for_timeout(6000)
            close_assistant(page)
            # the held-out reward logged at step = cumulative training NFEs: no axis to set
            page.get_by_placeholder("Search metric charts").fill("heldout/reward_by_nfe")
            page.wait_for_timeout(2500)
            expand(page, 0)  # the chart, full size
            page.screenshot(path=str(args.out / "mlflow-schemes-vs-nfe.png"))
            page.keyboard.press("Escape")
            page.wait_for_timeout(1000)
            # an evaluation image (key `eval`: the grid's first 16 captioned tiles, 4 x 4) at its default size,
            # in the artifact view of the last run's last step
            found = api_post(
                base, "runs/search", {"experiment_ids": [exp], "filter": "tags.`stepgrpo.scheme` = 'turning_point'"}
            )
            run_id = found["runs"][0]["info"]["run_id"]
            listed = json.load(
                urllib.request.urlopen(f"{base}/api/2.0/mlflow/artifacts/list?run_id={run_id}&path=images")
            )
            last = sorted((f["path"] for f in listed["files"] if f["path"].endswith(".png")), key=_step)[-1]
            page.goto(f"{base}/#/experiments/{exp}/runs/{run_id}/artifacts/{last}?workflowType=machine_learning")
            page.wait_for_timeout(5000)
            close_assistant(page)
            page.screenshot(path=str(args.out / "mlflow-eval-image.png"))
            # the run's page: its description (recipe, held-out reward and gain, compute) on top
            page.goto(f"{base}/#/experiments/{exp}/runs/{run_id}?workflowType=machine_learning")
            page.wait_for_timeout(5000)
            close_assistant(page)
            page.screenshot(path=str(args.out / "mlflow-run-note.png"))
            card_shot(b, root / f"ui-{SCHEMES[-1]}" / "lora", args.out / "model-card.png")
            b.close()
    finally:
        server.terminate()
        server.wait()
    print(f"MLflow screenshots in {args.out} (runs in {root})")


def card_shot(b, lora: Path, out: Path) -> None:
    """The exported LoRA's model card (`lora/README.md`), rendered as the hub shows one: its YAML
    metadata as a header, then the Markdown with the sample grid."""
    import shutil

    import markdown
    import yaml

    _, meta, body = (lora / "README.md").read_text().split("---", 2)
    page_dir = Path(tempfile.mkdtemp(prefix="stepgrpo-card-"))
    shutil.copy(lora / "samples.png", page_dir / "samples.png")
    tags = " ".join(f"<span class=tag>{t}</span>" for t in yaml.safe_load(meta).get("tags", []))
    html = markdown.markdown(body, extensions=["tables", "fenced_code"])
    style = (
        "body{font-family:sans-serif;max-width:900px;margin:24px auto;color:#222}"
        ".tag{background:#eef;border-radius:4px;padding:2px 6px;margin:2px;display:inline-block;font-size:13px}"
        "table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:4px 8px}"
        "pre{background:#f6f6f6;padding:8px}img{width:640px;image-rendering:pixelated}"
    )
    (page_dir / "card.html").write_text(f"<html><style>{style}</style><body><div>{tags}</div>{html}</body></html>")
    page = b.new_page(viewport={"width": 1000, "height": 1400})
    page.goto((page_dir / "card.html").as_uri())
    page.wait_for_timeout(1000)
    page.screenshot(path=str(out), full_page=True)
    page.close()


def api_post(base: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"{base}/api/2.0/mlflow/{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    return json.load(urllib.request.urlopen(req))


def _step(path: str) -> int:
    """The step of a logged image file, `images/eval+step+4+timestamp+...png`."""
    found = re.search(r"[+%]step[+%](\d+)", path)
    return int(found.group(1)) if found else -1


def expand(page, k: int) -> None:
    """Open the `k`-th chart card shown in its full-screen view."""
    card = page.locator("[data-testid='experiment-view-compare-runs-card-menu']").nth(k)
    card.locator("xpath=..").get_by_role("button").first.click()
    page.wait_for_timeout(3000)


def close_assistant(page) -> None:
    """MLflow 3.17 opens its assistant panel beside the runs: close it, if it is there."""
    try:
        page.get_by_role("button", name="Close").last.click(timeout=8000)
    except Exception:  # not shown
        pass
    page.wait_for_timeout(1000)


if __name__ == "__main__":
    main()
