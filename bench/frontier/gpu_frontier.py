"""The frontier's objectives and TempFlow-GRPO's branched rollouts at SD3.5-Medium's shape: seconds per
iteration and transformer passes of DiffusionNFT, AWM, DGPO and TempFlow-GRPO beside Flow-GRPO's, one
iteration each (docs/bench/frontier/README.md; the
CPU decision is `bench/frontier/frontier.py`).

    python -m bench.frontier.gpu_frontier [--out bench/out/gpu_frontier]   # on a CUDA machine (~5 min, one H100)
    python -m bench.frontier.gpu_frontier --small --device cpu             # every code path at toy sizes, on a CPU

Five recipes as shipped (`configs/diffusionnft_geneval.yaml`, `configs/awm_geneval.yaml`,
`configs/dgpo_ocr.yaml`, `configs/tempflow_geneval.yaml`, `configs/flow_grpo_pickscore.yaml`; `--recipes`
picks some), each `--iterations` iterations of
`stepgrpo train` on random weights of SD3.5-M's transformer shape and a PickScore-shaped reward
(`bench/gpu/gpu_train.py` builds both; no download; the GenEval detector is not part of what is
timed), with `--prompts x --group` trajectories an iteration for all of them. For each it reads the stored costs
(`stepgrpo.reporting.costs.iteration_costs`): seconds per stage and NFEs per stage, and the
forward-equivalent passes (a backward row = 2 forwards). Output: `results.json` and `report.txt`
in `--out`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench._lib.gpu import REPO, device_name, gpu_arguments, prepare, train, write_report
from stepgrpo.config import load_config

RECIPES = {
    "diffusionnft": "configs/diffusionnft_geneval.yaml",
    "awm": "configs/awm_geneval.yaml",
    "dgpo": "configs/dgpo_ocr.yaml",
    "tempflow": "configs/tempflow_geneval.yaml",
    "flow_grpo": "configs/flow_grpo_pickscore.yaml",
}


def costs(run_dir: Path) -> list[dict[str, Any]]:
    from stepgrpo.reporting.costs import iteration_costs
    from stepgrpo.storage.run import Run

    return iteration_costs(Run.open(run_dir))


def main() -> None:
    p = gpu_arguments(__doc__.split("\n\n")[0], "gpu_frontier")
    p.add_argument("--iterations", type=int, default=1)
    p.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=list(RECIPES))
    args = p.parse_args()
    results: dict[str, Any] = {"device": device_name(args.device)}
    common = prepare(args) | {
        "reward.name": "pickscore", "run.iterations": str(args.iterations), "run.eval_prompts": "1",
        "run.eval_every": str(args.iterations + 1), "sampler.eval_steps": "4",
    }  # fmt: skip
    if args.small:  # toy sizes: fewer grid steps than the recipes' 10 and 14
        common["sampler.steps"] = "4"
        common["update.times"] = "2"
    out = [
        f"device: {results['device']}; {args.prompts} x {args.group} trajectories, {args.iterations} iteration(s)",
        "",
    ]
    out.append("recipe: seconds an iteration (rollout / score / update) | NFEs an iteration | passes an iteration")
    for name in args.recipes:
        recipe = RECIPES[name]
        shipped = load_config(REPO / recipe)
        sets = dict(common)
        if shipped.update.on_transitions:  # grid times are an objective on noised copies' setting
            sets.pop("update.times", None)
        if shipped.sampler.branch_window is not None and args.small:  # the branch steps within the toy grid
            sets["sampler.branch_window"] = "[0,3]"
        run_dir, seconds = train(recipe, sets, args.out, name)
        rows = costs(run_dir)
        results[name] = {"wall_seconds": seconds, "iterations": rows}
        last = rows[-1]
        st = last["seconds_stages"]
        out.append(
            f"{name}: {last['seconds']:.1f} s ({st.get('rollout', 0):.1f} / {st.get('score', 0):.1f} / "
            f"{st.get('update', 0):.1f}) | {last['nfe']} ({last['nfe_stages']}) | {last['passes']}"
        )
    write_report(args.out, results, out)


if __name__ == "__main__":
    main()
