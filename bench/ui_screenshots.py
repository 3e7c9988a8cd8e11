"""Screenshots of the Prefect UI for docs/PIPELINE.md: the typed run form of a deployment made by
`stepgrpo deploy`, and the artifacts of a training run started from it through a worker.

    python bench/ui_screenshots.py [--out docs/images] [--chromium /usr/bin/chromium]

It starts its own Prefect server (a temporary PREFECT_HOME, a free port), creates the `stepgrpo`
process pool, deploys configs/shapes_stepwise.yaml, runs it for two short iterations through a
`--run-once` worker (a run directory under runs/), and photographs the pages with headless
Chromium driven by Playwright (`pip install playwright`; the browser is the system's Chromium:
Debian's `chromium` package, no browser download).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _prefect import BIN, api, call, local_server  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    p.add_argument("--chromium", default="/usr/bin/chromium")
    args = p.parse_args()
    from playwright.sync_api import sync_playwright

    home = Path(tempfile.mkdtemp(prefix="prefect-home-"))
    with local_server(dict(os.environ), home) as (url, port, env):
        call(env, REPO, str(BIN / "prefect"), "work-pool", "create", "stepgrpo", "--type", "process")
        call(env, REPO, str(BIN / "stepgrpo"), "deploy", "--config", "configs/shapes_stepwise.yaml")
        (dep,) = api(url, "/deployments/filter", {"deployments": {"name": {"any_": ["shapes_stepwise"]}}})
        overrides = json.dumps(["run.iterations=2", "run.eval_prompts=16", "run.eval_seeds=1"])
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
        args.out.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=args.chromium, args=CHROMIUM_FLAGS)
            page = browser.new_page(viewport={"width": 1440, "height": 1100})
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
            browser.close()
        print(f"flow run {run['name']}: screenshots in {args.out}")


if __name__ == "__main__":
    main()
