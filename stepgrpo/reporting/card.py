"""The model card of an exported LoRA (`<run>/lora/README.md`), in the Hugging Face hub's format
(YAML metadata, then Markdown), so that the folder is what a colleague or the hub needs: the base
model, what trained it (credit scheme, reward, iterations), its held-out gain with its interval,
the command that makes it again (`config.yaml` beside it), a sample grid, and how to load it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from stepgrpo.config import Config
from stepgrpo.reporting.report import paired_gain, stored_evaluations

CARD = "README.md"
SAMPLES = "samples.png"  # the last held-out evaluation's grid
CONFIG = "config.yaml"  # the run's resolved config: `stepgrpo train --config config.yaml` makes it again


def base_of(path: str) -> tuple[str, str]:
    """Which base a run trained: `("hub", id)`, `("shipped", "models/shapes")` (the model stepgrpo
    ships, in a checkout or a wheel) or `("local", its folder's name)`: a card never carries a path
    of the machine that trained it."""
    from stepgrpo.paths import SHIPPED_MODEL, SHIPPED_ROOT

    given = Path(path).expanduser()
    shipped = (SHIPPED_ROOT / SHIPPED_MODEL).resolve()
    if path == SHIPPED_MODEL or (given.is_absolute() and given.resolve() == shipped):
        return "shipped", SHIPPED_MODEL
    if given.is_absolute() or given.exists() or path.startswith((".", "~")):
        return "local", given.name
    return "hub", path


def portable(cfg: Config) -> dict[str, Any]:
    """The config as `config.yaml` publishes it: the runs root and any absolute path (a prompt file,
    a local model or LoRA) made relative (their names), so nothing of the trainer's machine leaves it."""
    from stepgrpo.paths import SHIPPED_MODEL

    data = cfg.model_dump(mode="json")
    if Path(data["run"]["runs_root"]).is_absolute():
        data["run"]["runs_root"] = "runs"
    for section, key in (("run", "prompts"), ("run", "heldout_prompts"), ("model", "path"), ("model", "init_lora")):
        value = data[section].get(key)
        if value and Path(value).is_absolute():
            kind, shown = base_of(value) if key == "path" else ("local", Path(value).name)
            data[section][key] = SHIPPED_MODEL if kind == "shipped" else shown
    return data


def model_card(
    cfg: Config,
    run_id: str,
    evaluations: list[Mapping[str, Any]],
    samples: bool,
    protocols: list[Mapping[str, Any]] | None = None,
    iteration: int | None = None,
) -> str:
    """The card's text; `evaluations`: the run's held-out records, base first; `protocols`: the
    reports of its evaluations under a paper's protocol (`protocol_reports`); `iteration`: the
    checkpoint's, where it is not the run's last (an earlier iteration's export)."""
    early = iteration is not None and iteration + 1 != cfg.run.iterations
    label = f"iter_{iteration}" if iteration is not None else None
    kind, base = base_of(cfg.model.path)
    flux = "flux" in base.lower()
    meta: dict[str, Any] = {"base_model": base} if kind == "hub" else {}
    meta |= {
        "library_name": "diffusers",
        "pipeline_tag": "text-to-image",
        "tags": ["text-to-image", "diffusers", "lora", "grpo", "stepgrpo", f"credit-{cfg.credit.scheme}"]
        + (["flux"] if flux else ["stable-diffusion-3"])
        + ([] if kind == "hub" else [f"base-model-{kind}"]),
    }
    described = {
        "hub": f"`{base}`",
        "shipped": f"`{base}` (the model stepgrpo ships)",
        "local": f"`{base}` (a local model)",
    }
    if kind == "shipped":
        load = [
            "from stepgrpo.paths import SHIPPED_ROOT  # the model stepgrpo ships, in a checkout or a wheel",
            "",
            f'pipe = Pipeline.from_pretrained(str(SHIPPED_ROOT / "{base}"){no_t5(cfg.model.path)}, '
            f"torch_dtype=torch.{cfg.model.dtype})",
        ]
    elif kind == "local":
        load = [
            f'base = "path/to/the/base/model"  # the local model it was trained on: {base}',
            f"pipe = Pipeline.from_pretrained(base{no_t5(cfg.model.path)}, torch_dtype=torch.{cfg.model.dtype})",
        ]
    else:
        load = [f'pipe = Pipeline.from_pretrained("{base}"{no_t5(base)}, torch_dtype=torch.{cfg.model.dtype})']
    method = cfg.completion.method
    scheme = cfg.credit.scheme + (f" (step rewards by {method} completion)" if method else "")
    run, sampler = cfg.run, cfg.sampler
    from stepgrpo_core.objectives import OBJECTIVES

    objective = OBJECTIVES.facts(cfg.update.objective)["title"] or cfg.update.objective
    lines = [
        "---",
        yaml.safe_dump(meta, sort_keys=False).strip(),
        "---",
        "",
        f"# {run_id}: {'an' if objective[0] in 'AEIOU' else 'a'} {objective} LoRA for `{base}`"
        + (f", after iteration {iteration} of {cfg.run.iterations}" if early else ""),
        "",
        f"Trained with stepgrpo's {objective} (`update.objective: {cfg.update.objective}`), "
        f"credit scheme **{scheme}**.",
        "",
        "| setting | value |",
        "|---|---|",
        f"| base model | {described[kind]} |",
        f"| reward | `{cfg.reward.name}`{' ' + str(dict(cfg.reward.options)) if cfg.reward.options else ''} |",
        f"| credit | `{cfg.credit.scheme}`{' ' + str(dict(cfg.credit.options)) if cfg.credit.options else ''} |",
        f"| iterations | {(iteration + 1) if early else run.iterations}"
        + (f" of the run's {run.iterations}" if early else "")
        + f" x {run.prompts_per_iteration} prompts x {run.group_size} samples |",
        f"| sampler | {sampler.steps} steps, "
        + (
            f"{sampler.sde_solver} |"
            if sampler.sde_solver
            else f"SDE window {sampler.sde_window_size}, kernel {sampler.kernel} |"
        ),
        f"| LoRA | rank {cfg.model.lora_rank}, alpha {cfg.model.lora_alpha}; lr {cfg.optim.lr:g} |",
        "",
        "## Held-out reward",
        "",
        *held_out(evaluations, label),
        "",
    ]
    if protocols:
        lines += ["## Under the papers' evaluation protocols", "", "| protocol | checkpoint | result | images |"]
        lines += ["|---|---|---|---|"]
        for r in protocols:
            head = r["results"]["headline"]
            name = r["protocol"]["name"] + (f" ({', '.join(r['overrides'])})" if r.get("overrides") else "")
            lines.append(f"| {name} | {r['label']} | {head['name']}: **{head['value']:.4f}** | {r['pairs']} |")
        lines += ["", "Each with its evidence bundle in the run's `evidence/` (`stepgrpo inspect RUN --verify`).", ""]
    if samples:
        lines += ["## Samples", "", f"![held-out samples after training]({SAMPLES})", ""]
    lines += [
        "## Use",
        "",
        "```python",
        "import torch",
        f"from diffusers import {'FluxPipeline' if flux else 'StableDiffusion3Pipeline'} as Pipeline",
        "",
        *load,
        'pipe.load_lora_weights("path/to/this/folder")  # or the hub repository it was pushed to',
        "# sampled as the run evaluated it: its steps and guidance",
        f'image = pipe("{example_prompt(cfg)}", num_inference_steps={cfg.sampler.eval_steps}, '
        f"guidance_scale={cfg.model.guidance_scale:g}).images[0]",
        "```",
        "",
        "To merge the LoRA into the base weights and save a pipeline that needs no adapter:",
        "",
        "```python",
        "pipe.fuse_lora()",
        "pipe.unload_lora_weights()",
        'pipe.save_pretrained("merged")',
        "```",
        "",
        "## Made by",
        "",
        "```bash",
        f"stepgrpo train --config {CONFIG} --run-id {run_id}",
        "```",
        "",
        f"`{CONFIG}` (beside this card) is the run's resolved config, every field set (paths of the machine "
        "that trained it made relative).",
        "",
    ]
    return "\n".join(lines)


def example_prompt(cfg: Config) -> str:
    """A prompt to show the Use block with: the task's own kind of prompt where it is known."""
    return "a red circle above a blue square" if cfg.run.prompts == "shapes" else "a photo of a cat"


def run_note(cfg: Config, evaluations: list[Mapping[str, Any]], nfe: float) -> str:
    """The tracked run's description (MLflow's run note, W&B's notes), a few lines in place of the
    parameter table: the recipe, the held-out reward so far and its paired gain, the compute."""
    window = cfg.sampler.window()
    lines = [
        f"**{cfg.credit.scheme} @ {cfg.completion.method or 'final'}** · reward `{cfg.reward.name}` · "
        f"{cfg.run.iterations} iterations x {cfg.run.prompts_per_iteration * cfg.run.group_size} samples · "
        f"SDE window {window[1] - window[0]} of {cfg.sampler.steps} steps · lr {cfg.optim.lr:g} · "
        f"base `{cfg.model.path}`",
        "",
        *held_out(evaluations),
        "",
        f"Training compute so far: {nfe:,.0f} transformer NFEs. Every field: the params, or `config.yaml` in the LoRA.",
    ]
    return "\n".join(lines)


def no_t5(base: str) -> str:
    """The loading arguments of a local SD3 directory without a T5 encoder (the shipped shapes
    model): diffusers wants the missing components named."""
    from stepgrpo.paths import SHIPPED_ROOT

    folder = Path(base) if Path(base).is_dir() else SHIPPED_ROOT / base
    index = folder / "model_index.json"
    if index.is_file() and yaml.safe_load(index.read_text()).get("text_encoder_3", [None])[0] is None:
        return ", text_encoder_3=None, tokenizer_3=None"
    return ""


def held_out(evaluations: list[Mapping[str, Any]], label: str | None = None) -> list[str]:
    """The base and final held-out reward, and the paired gain with its 95 % interval; with `label`
    (the checkpoint's, `iter_N`), only that checkpoint's evaluation counts as "after training"."""
    if not evaluations:
        return ["Not evaluated."]
    first, last = evaluations[0], evaluations[-1]
    where = f"{first.get('prompts')} held-out prompts x {first.get('seeds')} seeds, `{first.get('reward_name')}`"
    if label is not None and last.get("label") != label:
        return [
            f"On {where}: base {first['reward_mean']:.4f}. This checkpoint ({label}) was not evaluated: "
            f"`stepgrpo evaluate RUN --iteration {label.removeprefix('iter_')}` measures it."
        ]
    out = [f"On {where}: base {first['reward_mean']:.4f}, after training {last['reward_mean']:.4f}."]
    gain = paired_gain(first, last) if len(evaluations) > 1 else None
    if gain is not None:
        mean, low, high = gain
        out += ["", f"Paired gain **{mean:+.4f}** (95 % interval [{low:+.4f}, {high:+.4f}], clustered by prompt)."]
    return out


def protocol_reports(run: Any, labels: set[str]) -> list[dict[str, Any]]:
    """The reports of `run`'s evidence bundles whose checkpoint label is in `labels`, each bundle
    verified first (a damaged one is left out of the card)."""
    import json

    from stepgrpo.storage.bundle import verify_bundle
    from stepgrpo.storage.errors import StorageError

    out = []
    for folder in sorted((Path(run.path) / run.EVIDENCE_DIR).glob("[!.]*")):
        if ".damaged-" in folder.name:  # kept aside by a later evaluation
            continue
        try:
            verify_bundle(folder)
            report = json.loads((folder / "report.json").read_text())
        except (StorageError, OSError, ValueError, RecursionError):
            continue
        # only this run's bundles, each under its own name (a copied or swapped one is left out)
        if not isinstance(report, dict) or report.get("run_id") != run.run_id:
            continue
        protocol = report.get("protocol")
        name = protocol.get("name") if isinstance(protocol, dict) else None
        if not folder.name.startswith(f"{name}-{report.get('label')}"):
            continue
        if report.get("label") in labels:
            out.append(report)
    return out


def write_card(
    folder: Path,
    cfg: Config,
    run_id: str,
    evaluations: list[Mapping[str, Any]],
    grid: Path | None,
    protocols: list[Mapping[str, Any]] | None = None,
    iteration: int | None = None,
) -> None:
    """The card, the sample grid and the config into an export folder (files anyone can read);
    `iteration`: the exported checkpoint's (`model_card`)."""
    from stepgrpo.storage.publish import write_file_atomic

    if grid is not None and grid.is_file():
        write_file_atomic(folder / SAMPLES, grid.read_bytes())
    write_file_atomic(folder / CONFIG, yaml.safe_dump(portable(cfg), sort_keys=False).encode())
    card = model_card(cfg, run_id, evaluations, grid is not None and grid.is_file(), protocols, iteration)
    write_file_atomic(folder / CARD, card.encode())


def refresh_export(run: Any, stored_cfg: Config) -> Path:
    """Write the card, samples and config of a finished run's export again from what the run stored
    (its evaluations under `eval/`), and seal the folder again; returns the folder."""
    name = next((n for n in run.EXPORTS if (Path(run.path) / n).is_dir()), None)
    if name is None:
        raise FileNotFoundError(
            f"run {run.run_id} has no exported weights (lora/ or transformer/): a run exports them when its "
            "last iteration finishes; resume it with `stepgrpo train ... --run-id` to finish it"
        )
    folder = run.inside(Path(run.path) / name)
    records = stored_evaluations(run)
    grid = Path(run.path) / records[-1]["grid"] if records else None
    last = run.checkpoints.latest_checkpoint()
    labels = {"base"} | ({f"iter_{last}"} if last is not None else set())
    write_card(folder, stored_cfg, run.run_id, records, grid, protocol_reports(run, labels))
    run.seal_export(name)
    return folder


def push_to_hub(folder: Path, repo_id: str, private: bool, message: str) -> str:
    """Upload an export folder (its own seal left out) to the hub model repository `repo_id`,
    made if missing; returns the repository's URL. Errors name the fix (login, offline mode)."""
    from huggingface_hub import HfApi, is_offline_mode

    if is_offline_mode():
        raise ValueError("--push-to-hub: HF_HUB_OFFLINE is set; unset it to reach the hub")
    api = HfApi()
    try:
        url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        api.upload_folder(
            repo_id=repo_id, folder_path=str(folder), ignore_patterns=["_export.json", ".*"], commit_message=message
        )
    except Exception as err:
        raise ValueError(
            f"--push-to-hub {repo_id}: {type(err).__name__}: {err} (log in with `hf auth login` or set HF_TOKEN "
            "with write access; the repository id is owner/name)"
        ) from None
    return str(url)
