"""Screenshots of the Prefect UI for docs/PIPELINE.md: the typed run form of a deployment made by
`stepgrpo deploy`, and the artifacts of a training run started from it through a worker.

    python docs/screenshots.py [--out docs/images] [--chromium /usr/bin/chromium]

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
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(env: dict[str, str], *args: str, timeout: float = 600) -> str:
    out = subprocess.run(list(args), env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def api(url: str, path: str, body: dict | None = None) -> object:
    req = urllib.request.Request(
        url + path,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="GET" if body is None else "POST",
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    p.add_argument("--chromium", default="/usr/bin/chromium")
    args = p.parse_args()
    from playwright.sync_api import sync_playwright

    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    home = tempfile.mkdtemp(prefix="prefect-home-")
    env = dict(os.environ, PREFECT_HOME=home, PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_API_URL=url)
    env.pop("PREFECT_API_URL", None)
    server = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    env["PREFECT_API_URL"] = url
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                api(url, "/health")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("the Prefect server did not start") from None
                time.sleep(0.5)
        call(env, str(BIN / "prefect"), "work-pool", "create", "stepgrpo", "--type", "process")
        call(env, str(BIN / "stepgrpo"), "deploy", "--config", "configs/shapes_stepwise.yaml")
        (dep,) = api(url, "/deployments/filter", {"deployments": {"name": {"any_": ["shapes_stepwise"]}}})
        overrides = json.dumps(["run.iterations=2", "run.eval_prompts=16", "run.eval_seeds=1"])
        call(
            env,
            str(BIN / "prefect"),
            "deployment",
            "run",
            "train/shapes_stepwise",
            "--param",
            f"overrides={overrides}",
            "--param",
            f"run_id={RUN_ID}-{time.strftime('%Y%m%d-%H%M%S')}",
        )
        call(env, str(BIN / "prefect"), "worker", "start", "--pool", "stepgrpo", "--run-once", timeout=1800)
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
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
