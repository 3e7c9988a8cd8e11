"""The bodies of the pipeline stages: storage in, storage out, a small reference returned.

Each function reads its inputs from the run directory, computes with `stepgrpo_core` through the
policy / reward of `stepgrpo.workspace`, publishes its output through `storage`, and returns a
JSON-able reference (digest, counts, a few summary numbers). `tasks/` wraps each one in a Prefect
task whose cache key is `key` (see `tasks.keys`).

Every stage is idempotent: when its output is already in the run with the same key (a resumed
run), it returns the stored reference without computing. A stage that crashed half-way left
nothing published (storage's atomic publish), so it is simply redone.

Seeds: everything random in iteration `i` derives from `(run.seed, what, i, ...)` through
`seed_for`, never from a global RNG: a resumed run draws the same numbers as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stepgrpo import workspace
from stepgrpo.config import Config, digest_of
from stepgrpo.images import dequantize
from stepgrpo.report import track

EVAL_DIR = "eval"
CALIBRATION_FILE = "calibration/psi.json"


class StageError(RuntimeError):
    """A stage cannot run on its inputs (NaN rewards, a missing upstream stage, a key mismatch)."""


def seed_for(*parts: Any) -> int:
    """A 63-bit seed from any JSON-able parts (`seed_for(run_seed, "noise", i, g)`)."""
    return int.from_bytes(hashlib.sha256(json.dumps(parts).encode()).digest()[:8], "little") >> 1


def generator(*parts: Any, device: str | torch.device = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed_for(*parts))


def method_dir(method: str) -> str:
    """Storage name of a completion method (`substeps:5` -> `substeps-5`)."""
    return method.replace(":", "-")


# ------------------------------------------------------------------------------------- run


def open_run(cfg: Config, run_dir: str | Path) -> Any:
    """Create the run directory bound to `cfg`, or open it to resume (same config required)."""
    from storage.run import Run

    run_dir = Path(run_dir)
    try:
        return Run.create(run_dir.parent, run_dir.name, cfg.model_dump(mode="json"), exist_ok=True)
    except ValueError as err:
        if "different config" not in str(err):
            raise
        stored = Run.open(run_dir).config
        changed = _diff(stored, cfg.model_dump(mode="json"))
        raise StageError(
            f"run {run_dir.name} was created with another config (changed: {', '.join(changed)}); "
            "resume it with the same config, pick a new --run-id, or use `stepgrpo rescore` / "
            "`stepgrpo credit` to try another reward / scheme on its stored trajectories"
        ) from None


def _diff(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    keys = sorted(set(a) | set(b))
    out = []
    for k in keys:
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict) and k != "options":
            out += _diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}")
    return out


def find_run(run: str | Path, runs_root: str | Path = "runs") -> Path:
    """A run directory given as a path, or as a run id under `runs_root`."""
    for candidate in (Path(run), Path(runs_root) / str(run)):
        if (candidate / "manifest.json").is_file():
            return candidate.resolve()
    raise StageError(f"no run {str(run)!r}: neither a run directory nor a run id under {runs_root}/ (see `stepgrpo runs`)")


def run_path(run: str | Path, overrides: Sequence[str] = ()) -> tuple[Path, Config]:
    """The run directory of `run` and its stored config (with `key=value` overrides applied)."""
    from stepgrpo.config import _set_dotted
    from storage.run import Run

    path = find_run(run)
    stored = Run.open(path).config
    for item in overrides or ():
        key, sep, raw = item.partition("=")
        if not sep:
            raise StageError(f"override {item!r}: expected key=value")
        import yaml

        _set_dotted(stored, key.strip(), yaml.safe_load(raw) if raw.strip() else None)
    return path, validate(stored)


def stored_iterations(path: str | Path) -> list[int]:
    """Iterations of the run whose rollout is published."""
    from storage.run import Run

    found = Run.open(path).iterations("rollout")
    if not found:
        raise StageError(f"run {Path(path).name} has no published rollout yet")
    return found


def clean_ref(path: str | Path, cfg: Config, iteration: int) -> dict[str, Any]:
    """Digest of what `score` reads for `iteration`: the completion of `cfg.completion.method`, or the rollout."""
    from storage.run import Run

    run = Run.open(path)
    rollout = run.stage_manifest(iteration, "rollout")
    m = run.stage_manifest(iteration, _clean_source(cfg.completion.method))
    if m is None:
        raise StageError(f"run {run.run_id} iteration {iteration} has no stored completion {cfg.completion.method!r}")
    return {"digest": m["digest"], "rollout": rollout["digest"]}


def stored_reward(path: str | Path, cfg: Config, iteration: int, reward_name: str | None = None) -> dict[str, Any]:
    """`{"name", "version", "digest"}` of the rewards stored for `iteration` (default: the run's reward)."""
    from storage.run import Run

    run = Run.open(path)
    name = reward_name or workspace.reward(cfg.reward).name
    table = run.read_rewards(iteration, name)
    versions = sorted(set(table.column("reward_version").to_pylist()))
    if not versions:
        stored = sorted(set(run.read_rewards(iteration).column("reward_name").to_pylist()))
        raise StageError(f"run {run.run_id} iteration {iteration} has no rewards named {name!r}; stored: {', '.join(stored) or 'none'}")
    version = versions[-1]
    return {"name": name, "version": version, "digest": run.rewards_digest(iteration, name, version)}


def latest_checkpoint(path: str | Path) -> int:
    from storage.run import Run

    latest = Run.open(path).latest_checkpoint()
    if latest is None:
        raise StageError(f"run {Path(path).name} has no checkpoint yet; evaluate the base model with --iteration -1")
    return latest


def checkpoint_digest(path: str | Path, iteration: int) -> str:
    from storage.run import Run

    m = Run.open(path).stage_manifest(iteration, "checkpoint")
    if m is None:
        raise StageError(f"run {Path(path).name} has no checkpoint for iteration {iteration}")
    return m["digest"]


def validate(config: dict[str, Any]) -> Config:
    from stepgrpo.config import validate_config

    return validate_config(config)


# --------------------------------------------------------------------------------- prompts


def prompt_source(cfg: Config) -> tuple[list[str], list[str], list[dict[str, Any]]]:
    """All prompts of the config's source: texts, splits ("train" / "test"), metadata."""
    if cfg.run.prompts == "shapes":
        from stepgrpo.shapes.data import prompt_of, split

        train, test = split(held_out=False), split(held_out=True)
        specs = train + test
        return [prompt_of(s) for s in specs], ["train"] * len(train) + ["test"] * len(test), specs
    texts, splits, metadata = [], [], []
    for path, name in ((cfg.run.prompts, "train"), (cfg.run.heldout_prompts, "test")):
        if path is None:
            continue
        p = workspace.REPO_ROOT / path if not Path(path).exists() and (workspace.REPO_ROOT / path).exists() else Path(path)
        if not p.is_file():
            raise StageError(f"run.prompts file {path!r} does not exist (.txt: one prompt a line; "
                             ".jsonl: one JSON object a line with a 'prompt' field)")
        file_texts, file_meta = _read_prompt_file(p)
        texts += file_texts
        metadata += file_meta
        splits += [name] * len(file_texts)
    return texts, splits, metadata


def _read_prompt_file(path: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """Prompts of a `.txt` file (one a line) or a `.jsonl` file (GenEval / Flow-GRPO's
    `metadata.jsonl`: one object a line with a `prompt` field; the whole object is the prompt's
    metadata, which structured rewards such as `geneval` read)."""
    lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if path.suffix != ".jsonl":
        return lines, [{} for _ in lines]
    texts, metadata = [], []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise StageError(f"{path}:{number} is not a JSON object ({err.msg}); a .jsonl prompt file "
                             "holds one object a line") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise StageError(f"{path}:{number} has no 'prompt' string field; each line must look like "
                             '{"prompt": "a photo of two dogs", "tag": "counting", "include": [...]}')
        texts.append(row["prompt"])
        metadata.append(row)
    return texts, metadata


def prompts(run: Any, cfg: Config) -> dict[str, Any]:
    """Write the run's prompt table once; returns its digest and split sizes."""
    manifest = run.prompts_manifest()
    if manifest is None:
        texts, splits, meta = prompt_source(cfg)
        if "train" not in splits:
            raise StageError(f"run.prompts {cfg.run.prompts!r} holds no training prompts")
        manifest = run.write_prompts(list(range(len(texts))), texts, splits, meta)
    return {"digest": manifest["digest"], "rows": manifest["rows"]}


def _prompt_rows(run: Any) -> tuple[list[str], list[str], list[dict[str, Any]]]:
    table = run.read_prompts().sort_by("prompt_id")
    meta = [json.loads(m) for m in table.column("metadata").to_pylist()]
    return table.column("text").to_pylist(), table.column("split").to_pylist(), meta


def _encode(pol: Any, texts: Sequence[str], prompt_ids: np.ndarray) -> Any:
    """Conditioning for every trajectory, encoding each distinct prompt once."""
    from stepgrpo_core.conditioning import take

    unique, inverse = np.unique(prompt_ids, return_inverse=True)
    cond = pol.encode([texts[int(p)] for p in unique])
    return take(cond, torch.from_numpy(inverse.reshape(-1)).long())


# ------------------------------------------------------------------------------ checkpoints


def lora_before(run: Any, cfg: Config, iteration: int) -> dict[str, torch.Tensor]:
    """The LoRA weights the policy has when iteration `iteration` starts."""
    if iteration == 0:
        return workspace.initial_lora(cfg)
    ckpt = run.load_checkpoint(iteration - 1)
    return ckpt.tensors["lora"]


def policy_at(run: Any, cfg: Config, iteration: int) -> Any:
    pol = workspace.policy(cfg)
    workspace.set_lora(pol, lora_before(run, cfg, iteration))
    return pol


def kernel_noise(run: Any, cfg: Config) -> float | torch.Tensor:
    """The kernel's `noise`: the config's value, or the calibrated `psi` table of the run."""
    if cfg.sampler.kernel != "psi":
        return cfg.sampler.noise
    path = Path(run.path) / CALIBRATION_FILE
    if not path.is_file():
        raise StageError(f"kernel 'psi' needs the run's calibrated table {CALIBRATION_FILE}: run the calibrate stage first")
    return torch.tensor(json.loads(path.read_text())["psi"], dtype=torch.float32)


def _published(manifest: dict[str, Any] | None, key: str, what: str) -> bool:
    if manifest is None:
        return False
    stored = manifest.get("inputs", {}).get("key")
    if stored is not None and stored != key:
        raise StageError(
            f"{what} is already published from other inputs (key {stored[:12]} != {key[:12]}); "
            "the run's stages are immutable: start a new run id"
        )
    return True


# ---------------------------------------------------------------------------------- rollout


def rollout(run: Any, cfg: Config, iteration: int, key: str) -> dict[str, Any]:
    """Sample `prompts_per_iteration x group_size` trajectories; store every state and log-prob,
    and the ODE sample of each group's initial noise (`ode_final`, `nfe_ode` NFEs)."""
    from stepgrpo_core.conditioning import take
    from stepgrpo_core.rollout import rollout as sample

    what = f"iteration {iteration} rollout"
    if not _published(run.stage_manifest(iteration, "rollout"), key, what):
        t0 = time.perf_counter()
        pol = policy_at(run, cfg, iteration)
        texts, splits, _ = _prompt_rows(run)
        P, G, T = cfg.run.prompts_per_iteration, cfg.run.group_size, cfg.sampler.steps
        prompt_ids, group_ids, seeds = iteration_plan(cfg, splits, iteration)
        sigmas = pol.sigmas(T)
        noise = kernel_noise(run, cfg)
        start, end = cfg.sampler.window()
        writer = run.begin_rollout(
            iteration, sigmas=sigmas.cpu().numpy(), seeds=np.repeat(seeds, G), prompt_ids=prompt_ids,
            group_ids=group_ids, latent_shape=pol.latent_shape, latent_dtype=cfg.model.dtype,
            kernel=cfg.sampler.kernel, kernel_params={"noise": _json_noise(noise), "window": [start, end - start]},
        )
        nfe0, nfe_ode = pol.nfe, 0
        with writer:
            per_chunk = max(1, cfg.model.max_batch // G)  # whole groups per sampling call
            for c0 in track(range(0, P, per_chunk), f"rollout {iteration}"):
                groups = range(c0, min(P, c0 + per_chunk))
                x0 = torch.cat([pol.initial_noise(1, generator(int(seeds[g]), device=pol.device)).expand(G, -1, -1, -1) for g in groups])
                rows = np.arange(c0 * G, (groups[-1] + 1) * G)
                cond = _encode(pol, texts, prompt_ids[rows])
                out = sample(pol.velocity, x0, sigmas, cond, kernel=cfg.sampler.kernel, noise=noise,
                             window=(start, end - start), generator=generator(cfg.run.seed, "sde", iteration, c0, device=pol.device))
                # The ODE sample of each group's x_0 (one per group: members share prompt and noise):
                # R_0 for outcome runs, and the ODE reward beside the SDE training reward.
                nfe_sde = pol.nfe
                ode = sample(pol.velocity, x0[::G], sigmas, take(cond, torch.arange(0, len(rows), G)), kernel="ode")
                nfe_ode += pol.nfe - nfe_sde
                writer.write(int(rows[0]), states=out.states.cpu(), log_probs=out.log_probs.cpu(), stds=out.stds.cpu(),
                             ode_final=ode.states[:, -1].repeat_interleave(G, dim=0).cpu())
            writer.publish(inputs={"key": key, "nfe": pol.nfe - nfe0 - nfe_ode, "nfe_ode": nfe_ode,
                                   "seconds": time.perf_counter() - t0})
    m = run.stage_manifest(iteration, "rollout")
    return {"stage": "rollout", "iteration": iteration, "digest": m["digest"], "nfe": m["inputs"].get("nfe", 0),
            "nfe_ode": m["inputs"].get("nfe_ode", 0), "seconds": m["inputs"].get("seconds", 0.0), "trajectories": m["counts"]["trajectories"]}


def iteration_plan(cfg: Config, splits: Sequence[str], iteration: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Who samples what in `iteration`: `prompt_ids [B]`, `group_ids [B]` (trajectories of a group
    are adjacent) and one noise seed per group `[P]`, all derived from `(run.seed, iteration)`."""
    train_ids = np.array([i for i, s in enumerate(splits) if s == "train"])
    if len(train_ids) == 0:
        raise StageError("the prompt source has no 'train' prompts to sample")
    P, G = cfg.run.prompts_per_iteration, cfg.run.group_size
    pick = torch.randperm(len(train_ids), generator=generator(cfg.run.seed, "prompts", iteration)).numpy()
    chosen = train_ids[np.resize(pick, P)]  # more prompts than the split holds: the permutation repeats
    seeds = np.array([seed_for(cfg.run.seed, "noise", iteration, g) for g in range(P)], np.int64)
    return np.repeat(chosen, G), np.repeat(np.arange(P), G), seeds


def _json_noise(noise: float | torch.Tensor) -> float | list[float]:
    return noise.tolist() if isinstance(noise, torch.Tensor) else float(noise)


# --------------------------------------------------------------------------------- complete


# Completion attr: states k >= this evolve deterministically (after the SDE window); their
# completion is x_T, so they are neither completed nor scored (their rewards are R_T's).
DETERMINISTIC_FROM = "deterministic_from"


def _window_end(kernel_params: dict[str, Any], num_steps: int) -> int:
    """The first step after the rollout's SDE window (`kernel_params["window"] = [start, size]`)."""
    start, size = kernel_params.get("window", [0, num_steps])
    return int(start) + int(size)


def complete(run: Any, cfg: Config, iteration: int, key: str) -> dict[str, Any]:
    """ODE-complete every stored state that needs it with `completion.method` (states after the SDE
    window are `x_T` already, module `stepgrpo_core.completions`); store the clean latents and NFEs."""
    from stepgrpo_core.completions import complete as run_completion

    method = cfg.completion.method
    stage = f"completions/{method_dir(method)}"
    what = f"iteration {iteration} completion {method}"
    if not _published(run.stage_manifest(iteration, stage), key, what):
        t0 = time.perf_counter()
        pol = policy_at(run, cfg, iteration)
        data = run.read_rollout(iteration)
        texts, _, _ = _prompt_rows(run)
        sigmas = torch.from_numpy(data.sigmas)
        through = _window_end(data.kernel_params, len(data.sigmas) - 1)
        writer = run.begin_completion(iteration, method_dir(method), latent_dtype=cfg.model.dtype,
                                      attrs={"method_spec": method, DETERMINISTIC_FROM: through})
        nfe = 0
        with writer:
            per_chunk = max(1, cfg.model.max_batch)
            for c0 in track(range(0, len(data.group_ids), per_chunk), f"complete {iteration}"):
                rows = slice(c0, c0 + per_chunk)
                states = torch.from_numpy(data.states[rows]).to(pol.device, pol.dtype)
                cond = _encode(pol, texts, data.prompt_ids[rows])
                with torch.no_grad():
                    out = run_completion(method, pol.velocity, states, sigmas.to(pol.device), cond, cfg.model.max_batch, through)
                writer.write(c0, latents=out.latents.cpu())
                nfe += out.nfe
            writer.publish(attrs={"nfe": nfe}, inputs={"key": key, "seconds": time.perf_counter() - t0})
    m = run.stage_manifest(iteration, stage)
    return {"stage": "complete", "iteration": iteration, "method": method, "digest": m["digest"],
            "nfe": int(m["attrs"]["nfe"]), "seconds": m["inputs"].get("seconds", 0.0)}


# ------------------------------------------------------------------------------------ score


def _clean_source(cfg_method: str | None) -> str:
    """The stage whose latents `score` reads: a completion, or the rollout (its x_T) for outcome."""
    return "rollout" if cfg_method is None else f"completions/{method_dir(cfg_method)}"


def scored_states(run: Any, cfg_method: str | None, iteration: int) -> tuple[np.ndarray, np.ndarray]:
    """Which states `score` evaluates, `k [K]`, and which copy R_T, `copies [n]`.

    With a completion: every `k < deterministic_from` and `T` are scored; the states after the SDE
    window copy R_T. Without one (outcome credit): `k = 0` (the ODE sample of `x_0`) and `T`; the
    states in between have no reward (NaN in `reward_grid`).
    """
    T = int(run.stage_manifest(iteration, "rollout")["attrs"]["T"])
    if cfg_method is None:
        return np.array([0, T]), np.zeros(0, np.int64)
    attrs = run.stage_manifest(iteration, _clean_source(cfg_method))["attrs"]
    through = int(attrs.get(DETERMINISTIC_FROM, T))
    return np.array([*range(through), T]), np.arange(through, T)


def _clean_latents(run: Any, cfg_method: str | None, iteration: int, k: np.ndarray) -> np.ndarray:
    """Latents of the scored states `k` `[B, K, C, H, W]`: completions, or `ode_final` and `x_T`."""
    if cfg_method is None:
        final = run.read_array(iteration, "rollout", "states")[:, -1]  # a trajectory's states are one chunk
        return np.stack([run.read_array(iteration, "rollout", "ode_final"), final], axis=1)
    return run.read_completion(iteration, method_dir(cfg_method)).latents[:, k]


def reward_images(decoder: Any, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Clean latents -> (uint8 images on the CPU, the fp32 images in [0, 1] a reward is given)."""
    u8 = decoder.decode_uint8(latents)
    return u8, dequantize(u8.to(decoder.device))


def _distinct_rows(rows: np.ndarray) -> tuple[list[int], np.ndarray]:
    """The first index of each distinct row of `rows [N, ...]` and, per row, which distinct row it
    is (`inverse [N]`). Rows are matched by a digest of their bytes: cheap at any latent size,
    unlike sorting them."""
    seen: dict[bytes, int] = {}
    first, inverse = [], np.empty(len(rows), np.int64)
    for i, row in enumerate(rows):
        index = seen.setdefault(hashlib.blake2b(row.tobytes(), digest_size=16).digest(), len(first))
        if index == len(first):
            first.append(i)
        inverse[i] = index
    return first, inverse


def _images(run: Any, cfg: Config, iteration: int) -> tuple[np.ndarray, np.ndarray, str]:
    """`[B, K, 3, Y, X]` uint8 images of the clean latents, their state indices `k [K]`, and where
    they came from ("stored", "decoded" or "decoded+stored"). Decodes (VAE only) when the iteration
    has no stored images; stores them when `storage.images` is on."""
    source = _clean_source(cfg.completion.method)
    stored = run.read_images(iteration, source)
    if stored is not None:
        return stored.images, stored.k, "stored"
    dec = workspace.decoder(cfg.model)
    k, _ = scored_states(run, cfg.completion.method, iteration)
    latents = _clean_latents(run, cfg.completion.method, iteration, k)
    B, K = latents.shape[:2]
    flat = latents.reshape(B * K, *latents.shape[2:])
    # Equal latents decode to equal images: decode each once (a group's ODE sample of x_0 is shared).
    first, inverse = _distinct_rows(flat)
    unique = flat[first]
    chunk = max(1, cfg.model.max_batch)
    parts = [reward_images(dec, torch.from_numpy(unique[c0 : c0 + chunk]))[0]
             for c0 in track(range(0, len(unique), chunk), f"decode {iteration}")]
    images = torch.cat(parts)[torch.from_numpy(inverse.reshape(-1))].reshape(B, K, *parts[0].shape[1:]).numpy()
    if not cfg.storage.images:
        return images, k, "decoded"
    from storage.errors import AlreadyPublishedError, StageLockedError

    try:
        with run.begin_images(iteration, source, k=k, image_shape=images.shape[2:]) as writer:
            writer.write(0, images=images)
            writer.publish()
    except (AlreadyPublishedError, StageLockedError):
        return images, k, "decoded"  # another scorer stored (or is storing) the same bytes
    return images, k, "decoded+stored"


def score(run: Any, cfg: Config, iteration: int, key: str) -> dict[str, Any]:
    """Append one reward's rows for every clean state; no transformer call.

    The images come from the iteration's image store when it has one (no VAE call either), else
    from decoding the clean latents with the VAE alone, stored for the next reward
    (`storage.images`).
    """
    reward = workspace.reward(cfg.reward)
    name, version = reward.name, str(reward.version)
    stored = run.read_rewards(iteration, name, version)
    images_from = "none"
    t0 = time.perf_counter()
    if stored.num_rows == 0:
        images, k_of, images_from = _images(run, cfg, iteration)
        B, K = images.shape[:2]
        flat = torch.from_numpy(images.reshape(B * K, *images.shape[2:]))
        traj, k = np.repeat(np.arange(B), K), np.tile(k_of, B)
        texts, _, meta = _prompt_rows(run)
        pids = _prompt_ids(run, iteration)[traj]
        scores, strict, subs = [], [], {}
        chunk = max(1, cfg.model.max_batch)
        for c0 in track(range(0, len(traj), chunk), f"score {iteration}"):
            rows = slice(c0, c0 + chunk)
            out = reward(dequantize(flat[rows]), [texts[int(p)] for p in pids[rows]], [meta[int(p)] for p in pids[rows]])
            scores.append(out.scores.float().cpu())
            strict.append(out.strict.float().cpu() if out.strict is not None else None)
            for sname, v in out.sub.items():
                subs.setdefault(sname, []).append(v.float().cpu())
        value = torch.cat(scores)
        bad = torch.nonzero(~torch.isfinite(value)).reshape(-1).tolist()
        if bad:
            rows = ", ".join(f"(traj {int(traj[b])}, k {int(k[b])})" for b in bad[:10])
            raise StageError(f"reward {name!r} returned NaN/inf for {len(bad)} rows of iteration {iteration}: {rows}; nothing was stored")
        strict_all = torch.cat(strict) if all(s is not None for s in strict) else None
        sub = {s: torch.cat(v) for s, v in subs.items()}
        # States after the SDE window are x_T: their rows repeat R_T's (the last scored state).
        _, copies = scored_states(run, cfg.completion.method, iteration)
        src = np.repeat(np.arange(B) * K + K - 1, len(copies))
        take_rows = torch.from_numpy(np.concatenate([np.arange(B * K), src]))
        traj, k = np.concatenate([traj, np.repeat(np.arange(B), len(copies))]), np.concatenate([k, np.tile(copies, B)])
        run.append_rewards(iteration, name, version, traj, k, value[take_rows].double().numpy(),
                           strict=None if strict_all is None else strict_all[take_rows].double().numpy(),
                           sub={s: v[take_rows].double().numpy() for s, v in sub.items()} or None)
    grid = run.reward_grid(iteration, name, version)  # [B, T+1]
    summary = reward_summary(grid, run.reward_grid(iteration, name, version, field="strict"),
                             torch.from_numpy(run.read_array(iteration, "rollout", "group_ids")).long())
    return {"stage": "score", "iteration": iteration, "reward_name": name, "reward_version": version,
            "digest": run.rewards_digest(iteration, name, version), "images": images_from,
            "seconds": time.perf_counter() - t0, **summary}


def reward_summary(grid: torch.Tensor, strict: torch.Tensor, group_ids: torch.Tensor) -> dict[str, Any]:
    """The training reward of an iteration: `grid, strict [B, T+1]` (NaN where not scored), `group_ids [B]`.

    `reward_*`: the SDE samples `x_T`; `ode_reward_*`: `R_0`, the ODE sample of the same prompt
    and initial noise (with a completion method, the completion of `x_0`: exact for `remaining`).
    `group_reward_std`: the mean within-group std of `R_T` (what GRPO's advantages are made of);
    `zero_std_groups`: the fraction of groups whose rewards are all equal (no signal).
    """
    from stepgrpo_core.credit import Groups

    final = grid[:, -1]
    out: dict[str, Any] = {"reward_mean": float(final.mean()), "reward_std": float(final.std(unbiased=False))}
    if bool(torch.isfinite(strict[:, -1]).all()):
        out["reward_strict"] = float(strict[:, -1].mean())
    if bool(torch.isfinite(grid[:, 0]).all()):
        out["ode_reward_mean"] = float(grid[:, 0].mean())
        if bool(torch.isfinite(strict[:, 0]).all()):
            out["ode_reward_strict"] = float(strict[:, 0].mean())
    per_group = Groups(group_ids).std(final.double())  # [groups]
    out["group_reward_std"] = float(per_group.mean())
    out["zero_std_groups"] = float((per_group == 0).float().mean())
    if bool(torch.isfinite(grid).all()):
        out["reward_per_state"] = grid.mean(0).tolist()
    return out


def _prompt_ids(run: Any, iteration: int) -> np.ndarray:
    """`[B]` prompt row of each trajectory (one small array; the states are not read)."""
    return run.read_array(iteration, "rollout", "prompt_ids")


# ----------------------------------------------------------------------------------- credit


def credit_options(cfg: Config, reward_name: str, reward_version: str) -> dict[str, Any]:
    """What the advantages are stored under: the scheme's options and the reward they came from."""
    return {"options": dict(cfg.credit.options), "reward": reward_name, "reward_version": reward_version}


def credit(run: Any, cfg: Config, iteration: int, reward_name: str, reward_version: str, key: str) -> dict[str, Any]:
    """Advantages `[B, T]` from the stored rewards of one reward version; append them."""
    from stepgrpo_core.credit import assign
    from storage.publish import options_digest

    t0 = time.perf_counter()
    scheme = cfg.credit.scheme
    options = credit_options(cfg, reward_name, reward_version)
    digest = options_digest(options)
    rewards = run.reward_grid(iteration, reward_name, reward_version).float()
    if not bool(torch.isfinite(rewards[:, -1]).all()):
        raise StageError(f"iteration {iteration}: reward {reward_name!r} has no final-sample score for some trajectories")
    if not bool(torch.isfinite(rewards).all()):
        if scheme != "outcome":
            raise StageError(f"credit scheme {scheme!r} needs a reward for every state; iteration {iteration} was scored on final samples only")
        rewards = rewards[:, -1:].expand_as(rewards).clone()  # outcome reads R_T only
    group_ids = torch.from_numpy(run.read_array(iteration, "rollout", "group_ids")).long()
    result = assign(scheme, rewards, group_ids, **cfg.credit.options)
    if run.read_advantages(iteration, scheme, digest).num_rows == 0:
        B, T = result.advantages.shape
        run.append_advantages(iteration, scheme, options, np.repeat(np.arange(B), T), np.tile(np.arange(T), B),
                              result.advantages.double().reshape(-1).numpy())
    adv = result.advantages
    return {
        "stage": "credit", "iteration": iteration, "scheme": scheme, "options_digest": digest,
        "digest": run.advantages_digest(iteration, scheme, digest), "seconds": time.perf_counter() - t0,
        "adv_mean": float(adv.mean()), "adv_std": float(adv.std(unbiased=False)), "adv_abs_max": float(adv.abs().max()),
        "zero_std_ratio": float(result.zero_std_ratio), "turning_points": int(result.turning_mask.sum()),
        "gain_mean": result.gains.mean(0).tolist(),
    }


# ----------------------------------------------------------------------------------- update


def update(run: Any, cfg: Config, iteration: int, scheme: str, options_digest: str, key: str) -> dict[str, Any]:
    """PPO-clip + KL on the stored trajectories with the stored advantages; publish checkpoint `iteration`."""
    from stepgrpo import training

    if not _published(run.stage_manifest(iteration, "checkpoint"), key, f"iteration {iteration} checkpoint"):
        t0 = time.perf_counter()
        pol = policy_at(run, cfg, iteration)
        opt = training.make_optimizer(pol.trainable_parameters(), cfg)
        ema, signal = None, {}
        if iteration > 0:
            prev = run.load_checkpoint(iteration - 1)
            training.load_optimizer_tensors(opt, prev.tensors.get("optimizer", {}))
            ema = prev.tensors.get("ema")
            signal = dict(prev.tensors.get("signal", {}))
        if cfg.optim.ema_decay is not None and ema is None:
            ema = workspace.lora_state(pol)
        data = run.read_rollout(iteration)
        texts, _, _ = _prompt_rows(run)
        advantages = run.advantage_grid(iteration, scheme, options_digest)
        states = torch.from_numpy(data.states).to(pol.device, pol.dtype)
        summary = training.update(
            pol, opt, cfg, states, torch.from_numpy(data.log_probs).to(pol.device), advantages.to(pol.device),
            torch.from_numpy(data.group_ids), _encode(pol, texts, data.prompt_ids), torch.from_numpy(data.sigmas).to(pol.device),
            data.kernel, _noise_of(data.kernel_params, pol.device), generator(cfg.run.seed, "update", iteration),
            ema=ema, initial=workspace.initial_lora(cfg), signal=signal if cfg.optim.diagnostics else None,
        )
        tensors = {"lora": workspace.lora_state(pol), "optimizer": training.optimizer_tensors(opt),
                   "rng": {"torch": training.rng_tensor()}}
        if ema is not None:
            tensors["ema"] = ema
        if signal:
            tensors["signal"] = signal
        state = training.checkpoint_state(iteration, summary)
        state.update(key=key, seconds=time.perf_counter() - t0, nfe=pol.nfe)
        run.save_checkpoint(iteration, tensors, state)
    ckpt_dir = run.stage_path(iteration, "checkpoint")
    state = json.loads((ckpt_dir / "state.json").read_text())
    return {"stage": "update", "iteration": iteration, "digest": run.stage_manifest(iteration, "checkpoint")["digest"],
            "seconds": state.get("seconds", 0.0), **state["update"]}


def _noise_of(params: dict[str, Any], device: torch.device) -> float | torch.Tensor:
    noise = params["noise"]
    return torch.tensor(noise, dtype=torch.float32, device=device) if isinstance(noise, list) else float(noise)


# --------------------------------------------------------------------------------- evaluate


def eval_label(iteration: int | None) -> str:
    return "base" if iteration is None else f"iter_{iteration}"


def evaluate(run: Any, cfg: Config, iteration: int | None, key: str) -> dict[str, Any]:
    """ODE-sample held-out prompts with the policy after `iteration` (None: the base model), score them,
    write `eval/<label>.json` and an image grid `eval/<label>.png`."""
    from stepgrpo.images import grid
    from stepgrpo_core.rollout import rollout as sample
    from storage.publish import write_file_atomic

    label = eval_label(iteration)
    out_json = Path(run.path) / EVAL_DIR / f"{label}.json"
    if out_json.is_file():
        stored = json.loads(out_json.read_text())
        if stored.get("key") == key:
            return stored
    t0 = time.perf_counter()
    pol = workspace.policy(cfg)
    if iteration is None:
        weights = workspace.initial_lora(cfg)
    else:
        ckpt = run.load_checkpoint(iteration)
        weights = ckpt.tensors.get("ema", ckpt.tensors["lora"])
    workspace.set_lora(pol, weights)
    reward = workspace.reward(cfg.reward)
    texts, splits, meta = _prompt_rows(run)
    held = [i for i, s in enumerate(splits) if s == "test"] or [i for i, s in enumerate(splits) if s == "train"]
    ids = np.array(held[: cfg.run.eval_prompts])
    sigmas = pol.sigmas(cfg.sampler.eval_steps)
    scores, stricts, subs, first_images = [], [], {}, None
    nfe0 = pol.nfe
    for s in range(cfg.run.eval_seeds):
        for c0 in range(0, len(ids), cfg.model.max_batch):
            rows = ids[c0 : c0 + cfg.model.max_batch]
            x0 = torch.cat([pol.initial_noise(1, generator(cfg.run.seed, "eval", s, int(p), device=pol.device)) for p in rows])
            out = sample(pol.velocity, x0, sigmas, _encode(pol, texts, rows), kernel="ode")
            images = reward_images(pol.decoder, out.states[:, -1])[1]
            r = reward(images, [texts[int(p)] for p in rows], [meta[int(p)] for p in rows])
            scores.append(r.scores.float().cpu())
            if r.strict is not None:
                stricts.append(r.strict.float().cpu())
            for name, v in r.sub.items():
                subs.setdefault(name, []).append(v.float().cpu())
            if s == 0 and c0 == 0:
                first_images = images[:64].cpu()
    value = torch.cat(scores)
    if not bool(torch.isfinite(value).all()):
        bad = torch.nonzero(~torch.isfinite(value)).reshape(-1).tolist()[:10]
        raise StageError(f"evaluation reward {reward.name!r} returned NaN/inf for held-out rows {bad}")
    result: dict[str, Any] = {
        "stage": "evaluate", "label": label, "iteration": iteration, "key": key,
        "reward_name": reward.name, "reward_version": str(reward.version),
        "prompts": len(ids), "seeds": cfg.run.eval_seeds, "reward_mean": float(value.mean()),
        "reward_std": float(value.std(unbiased=False)), "nfe": pol.nfe - nfe0,
        # one score per (seed, prompt), seed-major: the same noise for every evaluation of a run,
        # so two evaluations compare pair by pair (`report.paired_gain`)
        "scores": value.tolist(),
    }
    if stricts:
        result["reward_strict"] = float(torch.cat(stricts).mean())
        result["strict_scores"] = torch.cat(stricts).tolist()
    for name, v in subs.items():
        cat = torch.cat(v)
        finite = cat[torch.isfinite(cat)]
        if finite.numel():
            result[f"sub_{name}"] = float(finite.mean())
    png = Path(run.path) / EVAL_DIR / f"{label}.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    if first_images is not None:
        img = grid(first_images, ncols=8)
        import io

        buf = io.BytesIO()
        img.save(buf, format="PNG")
        write_file_atomic(png, buf.getvalue())
    result["grid"] = str(png)
    result["seconds"] = time.perf_counter() - t0
    write_file_atomic(out_json, (json.dumps(result, indent=1, sort_keys=True) + "\n").encode())
    return result


def export_lora(run: Any, cfg: Config, iteration: int) -> Path:
    """Write the LoRA after `iteration` (its EMA when enabled) as `<run>/lora/`, in the format
    `StableDiffusion3Pipeline.load_lora_weights` reads."""
    ckpt = run.load_checkpoint(iteration)
    pol = workspace.policy(cfg)
    workspace.set_lora(pol, ckpt.tensors.get("ema", ckpt.tensors["lora"]))
    return pol.save_lora(Path(run.path) / "lora")


# -------------------------------------------------------------------------------- calibrate


def calibrate(run: Any, cfg: Config, key: str) -> dict[str, Any]:
    """DenseGRPO's `psi` calibration with the base policy; writes `calibration/psi.json`."""
    from stepgrpo_core.calibration import initial_psi, update_psi
    from stepgrpo_core.completions import complete as run_completion
    from stepgrpo_core.credit import assign
    from stepgrpo_core.rollout import rollout as sample
    from storage.publish import write_file_atomic

    path = Path(run.path) / CALIBRATION_FILE
    if path.is_file() and json.loads(path.read_text()).get("key") == key:
        return json.loads(path.read_text())
    if cfg.completion.method is None:
        raise StageError("calibration needs step rewards: set completion.method (DenseGRPO uses 'remaining')")
    t0 = time.perf_counter()
    pol = workspace.policy(cfg)
    workspace.set_lora(pol, workspace.initial_lora(cfg))
    reward = workspace.reward(cfg.reward)
    texts, splits, meta = _prompt_rows(run)
    train_ids = np.array([i for i, s in enumerate(splits) if s == "train"])
    c, G, T = cfg.calibration, cfg.run.group_size, cfg.sampler.steps
    sigmas = pol.sigmas(T)
    psi = initial_psi(sigmas.cpu(), c.init_a)
    history = []
    for r in range(c.rounds):
        pick = torch.randperm(len(train_ids), generator=generator(cfg.run.seed, "calibrate-prompts", r))[: c.prompts]
        pids = np.repeat(train_ids[pick.numpy()], G)
        x0 = torch.cat([pol.initial_noise(1, generator(cfg.run.seed, "calibrate-noise", r, g, device=pol.device)).expand(G, -1, -1, -1)
                        for g in range(len(pick))])
        cond = _encode(pol, texts, pids)
        out = sample(pol.velocity, x0, sigmas, cond, kernel="psi", noise=psi.to(pol.device),
                     generator=generator(cfg.run.seed, "calibrate-sde", r, device=pol.device))
        with torch.no_grad():
            done = run_completion(cfg.completion.method, pol.velocity, out.states, sigmas, cond, cfg.model.max_batch)
        B, T1 = done.latents.shape[:2]
        images = reward_images(pol.decoder, done.latents.reshape(B * T1, *done.latents.shape[2:]))[1]
        rep = np.repeat(pids, T1)
        scores = reward(images, [texts[int(p)] for p in rep], [meta[int(p)] for p in rep]).scores.float().reshape(B, T1)
        gains = assign("dense", scores, torch.from_numpy(np.repeat(np.arange(len(pick)), G))).gains
        psi = update_psi(psi, gains.cpu(), c.eps1, c.eps2)
        history.append({"round": r, "reward_mean": float(scores[:, -1].mean()), "psi": psi.tolist()})
    result = {"stage": "calibrate", "key": key, "psi": psi.tolist(), "rounds": history,
              "seconds": time.perf_counter() - t0, "digest": digest_of(psi.tolist())}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomic(path, (json.dumps(result, indent=1) + "\n").encode())
    return result


def finite(x: float) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)
