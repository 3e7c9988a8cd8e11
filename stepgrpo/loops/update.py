"""The update's body: from the previous checkpoint (weights, AdamW state, EMA, the signal check's
sums) to the published checkpoint `iteration`, on the iteration's stored trajectories and
advantages; the loop itself is `stepgrpo.loops.training.update`. In this process (`train`) or over
`scale.update_processes` data-parallel ranks (`launch`; each rank is a `Rank`): processes on this
node (`serve`, `stepgrpo.runtime.parallel.RankPool`), or with `scale.workers: ray` Ray actors that
a placement group puts on the cluster's nodes (`stepgrpo.runtime.workers.RayRanks`).

The ranks live for the run (`kept_ranks`, entered by the train flow): started at the first update
that needs them, each loads the policy once and keeps it, and every later update sends them only
the stage's inputs (the run directory, iteration, scheme and key); each rank applies the previous
checkpoint's LoRA to the policy it holds. A rank that fails stops the others and fails the stage;
the next attempt starts a new group, which computes the same bytes. Outside `kept_ranks` (a
single update called on its own) the ranks last for that update.

Every rank loads the policy and the iteration's stored trajectories, draws the same shuffled
parts, and computes the gradient of its share of each part (`training.DataParallel`); one
all-reduce of the flattened LoRA gradient per optimizer step makes every rank take the same AdamW
step. Rank 0 publishes the checkpoint. The group size and the trajectories per iteration are the
config's whatever the number of processes.

Why a hand-made all-reduce rather than `DistributedDataParallel`: an update step runs one
backward per trained step and micro-batch, a number that differs between ranks when a part does
not split evenly, and DDP reduces on every backward (or needs `no_sync` and equal counts); the
LoRA gradient is a few MB, so one all-reduce per optimizer step costs nothing next to the forward
passes. How the ranks are started, meet and die with their launcher: `stepgrpo.runtime.parallel`.

    python -m stepgrpo.loops.update CONFIG_JSON     # per rank: then one JSON command a line on stdin
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from stepgrpo.config import Config, validate_config
from stepgrpo.errors import StageError
from stepgrpo.loops import sharding, training, workspace
from stepgrpo.loops.sampling import encode, generator, stored_noise
from stepgrpo.prompts import stored_prompts
from stepgrpo.runtime import memory
from stepgrpo.runtime import parallel as ranks
from stepgrpo.runtime.environment import pin_threads
from stepgrpo.runtime.faults import maybe_fail
from stepgrpo.storage.run import Run


def train(
    run: Run,
    cfg: Config,
    iteration: int,
    scheme: str,
    options_digest: str,
    key: str,
    parallel: training.DataParallel | None = None,
) -> None:
    """Update from the previous checkpoint and publish checkpoint `iteration` (rank 0 of a
    data-parallel update publishes; every rank computes the same weights)."""
    t0 = time.perf_counter()
    pol = workspace.policy(cfg)
    sharded = isinstance(parallel, sharding.Sharded)
    if sharded:
        sharding.shard_policy(pol, cfg, parallel.world)
    params = {n: p for n, p in pol.transformer.named_parameters() if p.requires_grad}
    # a sharded update's EMA, companion and initial weights are this rank's shards of them
    cut = functools.partial(sharding.shards, params=params) if sharded else dict
    if sharded:
        workspace.keep_initial_shards(cfg, cut)
    nfe0 = pol.nfe
    opt = training.make_optimizer(pol.trainable_parameters(), cfg, iteration)
    ema, signal, prev = None, {}, None
    group = workspace.companion_group(cfg)
    companion = None
    if iteration == 0:
        workspace.set_lora(pol, workspace.initial_weights(cfg))
    else:  # the previous checkpoint, read and verified once: its weights, AdamW state, EMA and sums
        prev = run.checkpoints.load_checkpoint(iteration - 1)
        workspace.set_lora(pol, prev.tensors[workspace.trained_group(cfg)])
        training.load_optimizer_tensors(opt, prev.tensors.get("optimizer", {}))
        ema = cut(prev.tensors["ema"]) if "ema" in prev.tensors else None
        signal = dict(prev.tensors.get("signal", {}))
        if sharded:  # its running sums as this rank's shards of them
            signal.update(
                {h: sharding.local_vector(signal[h], list(params.values())) for h in ("a", "b") if h in signal}
            )
    if group is not None:  # the objective's second adapter: the previous checkpoint's, the start's at 0
        companion = dict(prev.tensors[group]) if prev is not None else workspace.initial_lora(cfg)
        companion = {n: w.detach().clone() for n, w in cut(companion).items()}
    prev = None  # what the update needs of it is taken: its whole tensors are not kept through the update
    if cfg.optim.ema_decay is not None and ema is None:
        ema = workspace.lora_state(pol)
    if cfg.optim.kl_reference == "ema":
        pol.set_reference(ema)  # the EMA after the previous iteration (the base weights at iteration 0)
    data = run.stages.read_rollout(iteration)
    batch = training.Batch(
        states=torch.from_numpy(data.states).to(pol.device, pol.dtype),
        old_log_probs=torch.from_numpy(data.log_probs).to(pol.device),
        advantages=run.tables.advantage_grid(iteration, scheme, options_digest).to(pol.device),
        group_ids=torch.from_numpy(data.group_ids),
        cond=encode(pol, stored_prompts(run).texts, data.prompt_ids),
        sigmas=torch.from_numpy(data.sigmas).to(pol.device),
        kernel=data.kernel,
        noise=stored_noise(data.kernel_params, pol.device),
    )
    shuffle = generator(cfg.run.seed, "update", iteration)
    summary = training.update(
        pol,
        opt,
        cfg,
        batch,
        shuffle,
        companion,
        ema=ema,
        initial=workspace.initial_weights(cfg),
        signal=signal if cfg.optim.diagnostics else None,
        parallel=parallel,
    )
    backward = int(summary.pop("backward_rows"))
    used = memory.usage(audit=os.environ.get(MEMORY_AUDIT_ENV) == "1")  # before any whole tensor is gathered
    ranks_seen: list[dict | None] = []
    if parallel is not None and not sharded:  # the all-reduce update's other ranks publish nothing
        backward, ranks_seen = _meet(parallel, backward, used)
        if parallel.rank != 0:
            return
    # whole tensors, as an unsharded update holds them (a sharded one gathers its shards: every rank)
    join = functools.partial(sharding.gathered, params=params) if sharded else dict
    tensors = {
        workspace.trained_group(cfg): join(workspace.lora_state(pol)),
        "optimizer": training.optimizer_tensors(opt),
        "rng": {"update": shuffle.get_state()},  # the update's only random source, after it
    }
    if ema is not None:
        tensors["ema"] = join(ema)
    if signal:
        tensors["signal"] = dict(signal)
        if sharded:
            tensors["signal"].update(
                {h: sharding.whole_vector(signal[h], list(params.values())) for h in ("a", "b") if h in signal}
            )
    if group is not None and companion is not None:
        tensors[group] = join(companion)
    if sharded:
        backward, ranks_seen = _meet(parallel, backward, used)
        if parallel.rank != 0:
            return
    if parallel is None:
        maybe_fail("update", iteration)  # tests: killed after the update, before it is published
    # nfe: the update's transformer forwards (rows); backward: rows through a backward pass (a
    # backward costs about two forwards: `stepgrpo.reporting.costs`)
    inputs = {"key": key, "seconds": time.perf_counter() - t0, "nfe": pol.nfe - nfe0, "backward": backward}
    if parallel is None:
        inputs["memory"] = used
    if parallel is not None:
        inputs["processes"] = parallel.world
        if sharded:
            inputs["sharding"] = "fsdp"
        inputs["ranks"] = ranks_seen
    # timings and counters go in the manifest, not the digested files: equal inputs, equal checkpoint bytes
    run.checkpoints.save_checkpoint(iteration, tensors, training.checkpoint_state(iteration, summary), inputs=inputs)


def _meet(parallel: training.DataParallel, backward: int, used: dict) -> tuple[int, list[dict | None]]:
    """Every rank's backward rows summed, and who computed the update: each rank's process, the
    models it has loaded and the memory it used (a collective: every rank calls it)."""
    import torch.distributed as dist

    total = int(parallel.sum(torch.tensor([float(backward)], dtype=torch.float64)))
    seen: list[dict | None] = [None] * parallel.world
    dist.all_gather_object(seen, {**workspace.worker(), "memory": used})
    return total, seen


# set to 1: each update also records the bytes its live tensors hold (`memory.usage`; bench/scale/sharded.py)
MEMORY_AUDIT_ENV = "STEPGRPO_MEMORY_AUDIT"

_kept: dict[str, ranks.RankPool] | None = None  # the run's ranks, by config (`kept_ranks`)


@contextlib.contextmanager
def kept_ranks() -> Iterator[None]:
    """Within it, the ranks of a data-parallel update are started once and kept for every later
    update (the train flow enters it for the run); they are ended when it exits."""
    global _kept
    outer, _kept = _kept, {}
    finished = False
    try:
        yield
        finished = True
    finally:
        pools, _kept = _kept, outer
        for pool in pools.values():
            pool.close(wait=finished)  # on an error or Ctrl-C, no rank finishes an update first


def launch(run: Run, cfg: Config, iteration: int, scheme: str, options_digest: str, key: str) -> None:
    """Run the update of `iteration` over `cfg.scale.update_processes` ranks (processes on this
    node, or Ray actors over the cluster's nodes with `scale.workers: ray`) and wait for rank 0 to
    publish its checkpoint; a rank that fails stops the others."""
    n = cfg.scale.update_processes
    config = cfg.model_dump_json()
    pool = None if _kept is None else _kept.get(config)
    if pool is None or pool.broken:
        pool = _start(config, cfg, Path(run.path))
        if _kept is not None:
            _kept[config] = pool
    command = {"run": str(Path(run.path).resolve()), "iteration": iteration, "scheme": scheme}
    command |= {"options_digest": options_digest, "key": key}
    try:
        pool.run(command)
    finally:
        if _kept is None:
            pool.close()
    if run.stage_manifest(iteration, "checkpoint") is None:
        raise StageError(f"iteration {iteration} update over {n} processes ended without publishing its checkpoint")


HINT = "set scale.update_processes=1 to update in this process"


def _start(config: str, cfg: Config, run_dir: Path) -> ranks.RankPool | Any:
    n = cfg.scale.update_processes
    if cfg.scale.workers == "ray":
        from stepgrpo.runtime.workers import RayRanks

        gpu = cfg.model.device.startswith("cuda")
        s = cfg.scale
        gpus = (1.0 if gpu else 0.0) if s.update_gpus is None else s.update_gpus
        backend = group_backend(gpu, gpus)
        return RayRanks(
            functools.partial(Rank, config, backend=backend),
            n,
            "the update",
            HINT,
            bundle={"CPU": s.update_cpus, "GPU": gpus},
            strategy=s.update_placement,
            shard={"CPU": s.cpus_per_shard, "GPU": s.gpus_per_shard},
            shared_dir=run_dir,
            backend=backend,
        )

    def args(tmp: Path) -> list[str]:
        path = tmp / "config.json"
        path.write_text(config)
        return [sys.executable, "-m", __name__, str(path)]

    return ranks.RankPool(args, n, "the update", HINT, preload=RANK_PRELOAD)


# what a rank imports before its first update, imported once by the warm process its ranks are
# forked from (`RankPool`'s `preload`): this module, the policy's and the rewards' code, and the
# libraries behind them (diffusers' models, transformers' text encoders, peft)
RANK_PRELOAD = (__name__, "stepgrpo.loops.workspace", "stepgrpo.policy", "stepgrpo.rewards", "diffusers.models", "peft")


def group_backend(gpu: bool, gpus_per_rank: float) -> str:
    """NCCL when every rank has a GPU of its own; gloo on CPUs and where ranks share a GPU (NCCL
    refuses two ranks on one device), the sums then going through host memory."""
    return "nccl" if gpu and gpus_per_rank >= 1 else "gloo"


class Rank:
    """One rank of a data-parallel update that serves the run's updates: built once in its
    process (after it joined the group), it loads the policy at its first update and keeps it
    (`workspace`); each call runs one update command and returns when every rank has finished."""

    def __init__(self, config: str, rank: int, world: int, local: int = 0, backend: str | None = None) -> None:
        cfg = validate_config(json.loads(config))
        gpu = cfg.model.device.startswith("cuda")
        if gpu:  # ranks beyond the node's GPUs share them, round robin
            device = f"cuda:{local % torch.cuda.device_count()}"
            torch.cuda.set_device(device)
            cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"device": device})})
        if backend is None:  # the ranks of one node (RankPool)
            backend = group_backend(gpu, torch.cuda.device_count() / world if gpu else 0.0)
        self.cfg, self.rank, self.world, self.pinned, self.backend = cfg, rank, world, False, backend
        if cfg.scale.update_sharding == "fsdp" and gpu and backend != "nccl":
            raise StageError(
                f"scale.update_sharding: fsdp needs a GPU for each of its {world} ranks (NCCL), and this node has "
                f"{torch.cuda.device_count()}: set scale.update_processes to at most the GPUs, or update_sharding: none"
            )
        kind = sharding.Sharded if cfg.scale.update_sharding == "fsdp" else training.DataParallel
        self.parallel = kind(rank, world, cfg.model.device if backend == "nccl" else "cpu")

    def __call__(self, command: dict[str, Any]) -> dict[str, Any]:
        import torch.distributed as dist

        run = Run.open(command["run"])
        if not self.pinned:
            if pin_threads(run) is None:
                workspace.set_threads(self.cfg.scale.threads)
            self.pinned = True
        iteration = int(command["iteration"])
        if self.rank == self.world - 1:
            maybe_fail("update", iteration)  # tests: a rank that dies mid-update
        train(run, self.cfg, iteration, command["scheme"], command["options_digest"], command["key"], self.parallel)
        dist.barrier()
        return {"ok": iteration}


def serve(config: str) -> None:
    """One kept rank process of `RankPool` (the launcher sets RANK, WORLD_SIZE, LOCAL_RANK and the
    rendezvous file): join the group, then run each update command read from stdin, answering on
    its pipe; end when stdin closes."""
    ranks.die_with_parent()
    import torch.distributed as dist

    env = os.environ
    rank = Rank(Path(config).read_text(), int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]))
    answers = ranks.answer_pipe()
    ranks.init_group(rank.backend)
    try:
        for line in sys.stdin:
            try:
                answer = rank(json.loads(line))
            except Exception as err:
                import traceback

                traceback.print_exc()
                answers.write(json.dumps({"error": f"{type(err).__name__}: {err}"}) + "\n")
                answers.flush()
                os._exit(1)  # the group cannot go on without this rank
            answers.write(json.dumps(answer) + "\n")
            answers.flush()
    finally:
        dist.destroy_process_group()


def export_lora(
    run: Run,
    cfg: Config,
    iteration: int,
    evaluations: list[dict[str, Any]] | None = None,
    grid: Path | None = None,
    folder: Path | None = None,
    label_iteration: int | None = None,
) -> Path:
    """Write the weights after `iteration` (their EMA when enabled): the LoRA as `<run>/lora/`, in the
    format `StableDiffusion3Pipeline.load_lora_weights` reads; with full fine-tuning the transformer
    as `<run>/transformer/` (`SD3Transformer2DModel.from_pretrained`, safetensors). Beside them the
    model card (`README.md`, with `evaluations`' held-out gain), `grid` as `samples.png` and the
    run's config (`stepgrpo.reporting.card`); every file readable by whoever may read the run.
    `folder`: a folder of the user's instead (an earlier iteration's export; not sealed by the run)."""
    from stepgrpo.reporting.card import write_card

    if folder is not None:
        if folder.resolve().is_relative_to(Path(run.path).resolve()):
            raise ValueError(f"--out {folder} is inside the run: name a folder of your own")
        folder.mkdir(parents=True, exist_ok=True)
    out = folder or run.inside(Path(run.path) / ("transformer" if cfg.model.finetune == "full" else "lora"))
    pol = workspace.policy_after(run, cfg, iteration)
    if cfg.model.finetune == "full":
        pol.transformer.save_pretrained(str(out), safe_serialization=True)
    else:
        pol.save_lora(out)
    from stepgrpo.reporting.card import protocol_reports

    reports = protocol_reports(run, {"base", f"iter_{iteration}"})
    write_card(out, cfg, run.run_id, evaluations or [], grid, reports, label_iteration)
    if folder is None:
        run.seal_export(out.name)  # `inspect --verify` finds a damaged export
    return out


def export_iteration(run: Any, stored_cfg: Config, iteration: int | None, folder: Path | None) -> Path:
    """The export of a stored run (`stepgrpo export`): its card, samples and config written again
    (`stepgrpo.reporting.card.refresh_export`), its weights rebuilt from the last checkpoint when the export folder was
    deleted, or, with `iteration`, the weights of that kept checkpoint (into `folder` when it is not
    the last), the card carrying the evaluations up to it."""
    from stepgrpo.reporting.card import refresh_export
    from stepgrpo.reporting.report import stored_evaluations

    last = run.checkpoints.latest_checkpoint()
    if last is None:
        raise FileNotFoundError(f"run {run.run_id} has no checkpoint yet: train it first")
    exported = any((Path(run.path) / n).is_dir() for n in run.EXPORTS)
    if iteration is None and folder is None and exported:
        return refresh_export(run, stored_cfg)
    iteration = last if iteration is None else iteration
    if not 0 <= iteration <= last or iteration not in run.iterations("checkpoint"):
        raise ValueError(f"--iteration {iteration}: run {run.run_id} keeps checkpoints {run.iterations('checkpoint')}")
    if iteration != last and folder is None:
        raise ValueError(
            f"--iteration {iteration} is not the run's last ({last}): its export goes to a folder of its own, "
            "give --out DIR (the run's lora/ stays the final one)"
        )
    records = [r for r in stored_evaluations(run) if r["label"] == "base" or int(r["label"][5:]) <= iteration]
    # the samples and the "after training" number are this checkpoint's, or none (not evaluated)
    evaluated = bool(records) and records[-1]["label"] == f"iter_{iteration}"
    grid = Path(run.path) / records[-1]["grid"] if evaluated else None
    return export_lora(run, stored_cfg, iteration, records, grid, folder, iteration)


if __name__ == "__main__":
    from stepgrpo.runtime.environment import end_at_exit

    ended = end_at_exit()  # without the interpreter's teardown: ~1.5 s of CPU a rank
    serve(*sys.argv[1:])
    ended[0] = 0
