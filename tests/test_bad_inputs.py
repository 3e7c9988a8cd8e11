"""The bad-input catalogue: every input that can be checked early fails before a Prefect server
starts or a directory is made, with exit 1, a message that names the problem, and nothing left
published (docs/RELIABILITY.md). No case here starts a flow."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import prefect  # noqa: F401  (Prefect binds its log handlers at import: not inside CliRunner's streams)
import pytest
from typer.testing import CliRunner

from stepgrpo_cli import app

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "shapes"
runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _model_without(tmp: Path, component: str | None = None, index: bool = True) -> Path:
    model = tmp / "model"
    shutil.copytree(SHIPPED, model, ignore=shutil.ignore_patterns("*.png"))
    if component:
        shutil.rmtree(model / component)
    if not index:
        (model / "model_index.json").unlink()
    return model


def _write(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_text(text)
    return path


SURROGATE_LINE = '{"prompt": "a \\ud800 circle"}'  # valid JSON, a lone surrogate escape
NOT_UTF8 = b"a red circle\n\xff\xfe"


def _bomb(tmp: Path) -> Path:
    """Nine levels of ten aliases each under `reward.options`: 581 bytes that expand to 10^9 values."""
    lines = ["reward:", "  name: shapes", "  options:", "    a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"    a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    return _write(tmp, "bomb.yaml", "\n".join(lines) + "\n")


def _write_bytes(tmp: Path, name: str, data: bytes) -> Path:
    path = tmp / name
    path.write_bytes(data)
    return path


# (name, how to make the case in a temporary directory -> CLI arguments after `train`, what the message says)
TRAIN_CASES = {
    "unknown field": (lambda t: ["--set", "optim.lrr=1"], ["optim.lrr", "unknown field"]),
    "a value of the wrong type": (lambda t: ["--set", "optim.lr=fast"], ["optim.lr"]),
    "an infinite learning rate": (lambda t: ["--set", "optim.lr=.inf"], ["optim.lr", "finite"]),
    "a NaN clip range": (lambda t: ["--set", "optim.clip_range=.nan"], ["optim.clip_range", "finite"]),
    "a --set without =": (lambda t: ["--set", "optim.lr"], ["expected key=value"]),
    "a missing config file": (lambda t: ["--config", str(t / "nope.yaml")], ["nope.yaml", "does not exist"]),
    "malformed YAML": (
        lambda t: ["--config", str(_write(t, "bad.yaml", "optim:\n  lr: [1,\n"))],
        ["bad.yaml", "not valid YAML"],
    ),
    "a config that is its own base": (
        lambda t: ["--config", str(_write(t, "loop.yaml", "base: loop.yaml\n"))],
        ["its own base"],
    ),
    "an unknown reward": (lambda t: ["--set", "reward.name=nope"], ["unknown reward 'nope'"]),
    "an unknown reward option": (
        lambda t: ["--set", "reward.name=jpeg_compressibility", "--set", "reward.options={colour: 1}"],
        ["reward.options", "colour"],
    ),
    "an unknown credit scheme": (lambda t: ["--set", "credit.scheme=vibes"], ["unknown credit scheme"]),
    "an unknown scheme option": (
        lambda t: [
            "--set",
            "credit.scheme=dense",
            "--set",
            "completion.method=remaining",
            "--set",
            "credit.options={x: 1}",
        ],
        ["option(s) ['x']", "dense"],
    ),
    "an unknown kernel": (lambda t: ["--set", "sampler.kernel=brownian"], ["unknown kernel 'brownian'"]),
    "an unknown completion method": (lambda t: ["--set", "completion.method=guess"], ["completion"]),
    "step credit without completions": (
        lambda t: ["--set", "credit.scheme=stepwise", "--set", "completion.method=null"],
        ["needs step rewards"],
    ),
    "an SDE window outside the grid": (lambda t: ["--set", "sampler.sde_window_start=50"], ["sde_window"]),
    "more optimizer steps than trajectories": (
        lambda t: ["--set", "optim.optimizer_steps=100000"],
        ["optimizer_steps"],
    ),
    "a model path that does not exist": (
        lambda t: ["--set", "model.path=no/such/model"],
        ["model.path 'no/such/model'"],
    ),
    "a model without vae/": (
        lambda t: ["--set", f"model.path={_model_without(t, 'vae')}"],
        ["component vae/", "model_index.json"],
    ),
    "a model without text_encoder_2/": (
        lambda t: ["--set", f"model.path={_model_without(t, 'text_encoder_2')}"],
        ["component text_encoder_2/"],
    ),
    "a model without model_index.json": (
        lambda t: ["--set", f"model.path={_model_without(t, index=False)}"],
        ["model_index.json is missing"],
    ),
    "a missing prompts file": (lambda t: ["--set", f"run.prompts={t / 'nope.txt'}"], ["nope.txt", "does not exist"]),
    "an empty prompts file": (lambda t: ["--set", f"run.prompts={_write(t, 'empty.txt', '')}"], ["holds no prompt"]),
    "an empty held-out file": (
        lambda t: [
            "--set",
            f"run.prompts={_write(t, 'p.txt', 'a red circle')}",
            "--set",
            "run.prompts_per_iteration=1",
            "--set",
            f"run.heldout_prompts={_write(t, 'h.txt', chr(10))}",
        ],
        ["run.heldout_prompts", "holds no prompt"],
    ),
    "a .jsonl line that is not JSON": (
        lambda t: ["--set", f"run.prompts={_write(t, 'p.jsonl', '{oops')}"],
        ["p.jsonl:1", "not a JSON object"],
    ),
    "a .jsonl line without a prompt": (
        lambda t: ["--set", f"run.prompts={_write(t, 'q.jsonl', json.dumps({'tag': 'counting'}))}"],
        ["q.jsonl:1", "'prompt'"],
    ),
    "a .jsonl prompt with a lone surrogate": (
        lambda t: ["--set", "run.prompts=" + str(_write(t, "s.jsonl", SURROGATE_LINE))],
        ["s.jsonl:1", "not valid Unicode"],
    ),
    "a prompt file that is not UTF-8": (
        lambda t: ["--set", "run.prompts=" + str(_write_bytes(t, "b.txt", NOT_UTF8))],
        ["b.txt", "not UTF-8"],
    ),
    "a seed beyond 64 bits": (lambda t: ["--set", f"run.seed={2**70}"], ["run.seed"]),
    "more prompts an iteration than the prompt set holds": (
        lambda t: ["--set", f"run.prompts={_write(t, 'two.txt', 'a red circle' + chr(10) + 'a blue square')}"],
        ["run.prompts_per_iteration=4 exceeds the 2 training prompts"],
    ),
    "shards that split a model call": (
        lambda t: ["--set", "model.max_batch=8", "--set", "scale.groups_per_shard=3"],
        ["scale.groups_per_shard=3 would split a model call", "use a multiple of 2"],
    ),
    "unknown workers": (lambda t: ["--set", "scale.workers=slurm"], ["scale.workers", "'process' or 'ray'"]),
    "more update processes than trajectories": (
        lambda t: ["--set", "scale.update_processes=1000"],
        ["scale.update_processes=1000 exceeds the trajectories"],
    ),
    "a run id that climbs out": (lambda t: ["--run-id", "../x"], ["not one name", "--run-dir"]),
    "an absolute run id": (lambda t: ["--run-id", "/tmp/x"], ["not one name"]),
    "a run id with a folder": (lambda t: ["--run-id", "a/b"], ["not one name"]),
    # absolute bounds, before anything is allocated
    "a group size of a billion": (lambda t: ["--set", "run.group_size=1000000000"], ["run.group_size", "4096"]),
    "ten million sampling steps": (lambda t: ["--set", "sampler.steps=10000000"], ["sampler.steps", "1000"]),
    "a learning rate of 1e300": (lambda t: ["--set", "optim.lr=1e300"], ["optim.lr"]),
    "a million trajectories an iteration": (
        lambda t: ["--set", "run.prompts_per_iteration=60000", "--set", "run.group_size=4000"],
        ["trajectories an iteration exceeds"],
    ),
    "a YAML alias bomb": (lambda t: ["--config", str(_bomb(t))], ["aliases expand to more than"]),
    "a YAML alias bomb in --set": (
        lambda t: [
            "--set",
            "reward.options={a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], b: &b ["
            + ", ".join(["*a"] * 10)
            + "], c: &c ["
            + ", ".join(["*b"] * 10)
            + "], d: &d ["
            + ", ".join(["*c"] * 10)
            + "], e: ["
            + ", ".join(["*d"] * 10)
            + "], f: ["
            + ", ".join(["*d"] * 10)
            + "]}",
        ],
        ["--set reward.options", "aliases expand"],
    ),
    "a runs root that is a file": (lambda t: ["--set", f"run.runs_root={_write(t, 'f', '')}"], ["is a file"]),
    "a run directory inside a file": (
        lambda t: ["--run-dir", str(_write(t, "g", "") / "r"), "--run-id", "x"],
        ["is a file", "--run-dir"],
    ),
    "an http reward without its name and version": (
        lambda t: ["--set", "reward.name=http", "--set", "reward.options={url: 'http://127.0.0.1:9'}"],
        ["`name`, `version` missing"],
    ),
    "an http reward with every option wrong": (
        lambda t: ["--set", "reward.name=http", "--set", "reward.options={url: 'ftp://x'}"],
        ["`name`, `version` missing", "url 'ftp://x' must start with http://"],
    ),
    "a prompt of a megabyte": (
        lambda t: ["--set", f"run.prompts={_write(t, 'big.txt', 'a red circle' + chr(10) + 'x' * 1_000_000)}"],
        ["big.txt:2", "1000000 characters"],
    ),
}


@pytest.mark.parametrize("case", sorted(TRAIN_CASES))
def test_train_refuses_bad_input_early(here, case):
    make, says = TRAIN_CASES[case]
    args = make(here)
    if "--run-id" not in args:
        args += ["--run-id", "x"]
    result = invoke("train", "--set", "run.runs_root=runs", *args)
    assert result.exit_code == 1, (case, result.output)
    for text in says:
        assert text in result.output, (case, text, result.output)
    assert not (here / "runs").exists() and not (here.parent / "x").exists()  # nothing was made


def test_calibrate_refuses_a_kernel_with_a_fixed_noise(here):
    result = invoke("calibrate", "--set", "run.runs_root=runs", "--set", "sampler.kernel=flow", "--run-id", "c")
    assert result.exit_code == 1 and "nothing to calibrate" in result.output
    assert not (here / "runs").exists()


@pytest.fixture
def stored_run(here):
    """A run directory with its manifest only (as after a crash before its first stage)."""
    from stepgrpo.config import load_config
    from stepgrpo.storage.run import Run

    cfg = load_config(None, ["run.runs_root=runs"])
    return Run.create(here / "runs", "r", cfg.model_dump(mode="json")).path


def _published(run: Path) -> list[Path]:
    return sorted(p for p in run.rglob("*") if p.name != "manifest.json")


OFFLINE_CASES = {
    "resuming with another config": (
        lambda r: ["train", "--set", "run.runs_root=runs", "--set", "optim.lr=0.5", "--run-id", "r"],
        ["changed: optim.lr"],
    ),
    "a missing run": (lambda r: ["rescore", str(r.parent / "nope"), "--reward", "shapes"], ["no run"]),
    "an unknown reward to re-score with": (lambda r: ["rescore", str(r), "--reward", "nope"], ["known rewards"]),
    "reward options that are not JSON": (
        lambda r: ["rescore", str(r), "--reward", "shapes", "--options", "{x"],
        ["not JSON"],
    ),
    "an unknown reward option": (
        lambda r: ["rescore", str(r), "--reward", "jpeg_compressibility", "--options", '{"colour": 1}'],
        ["--options", "colour"],
    ),
    "an unknown scheme": (lambda r: ["credit", str(r), "--scheme", "nope"], ["known credit schemes"]),
    "an unknown scheme option": (
        lambda r: ["credit", str(r), "--scheme", "dense", "--options", '{"x": 1}'],
        ["has no option(s)", "x"],
    ),
    "an evaluation override of an unknown field": (
        lambda r: ["evaluate", str(r), "--set", "run.eval_promptz=2"],
        ["eval_promptz", "unknown field"],
    ),
    "inspecting a missing run": (lambda r: ["inspect", str(r.parent / "nope")], ["no run"]),
    "a credit-quality check with an odd number of continuations": (
        lambda r: ["credit-quality", str(r), "--continuations", "3"],
        ["--continuations", "even"],
    ),
    "a credit-quality check of a run with no rollout": (
        lambda r: ["credit-quality", str(r)],
        ["no published rollout"],
    ),
    "a credit-quality check of an unknown scheme": (
        lambda r: ["credit-quality", str(r), "--scheme", "nope"],
        ["known credit schemes"],
    ),
}


@pytest.mark.parametrize("case", sorted(OFFLINE_CASES))
def test_commands_on_a_run_refuse_bad_input_early(stored_run, case):
    make, says = OFFLINE_CASES[case]
    result = invoke(*make(stored_run))
    assert result.exit_code == 1, (case, result.output)
    for text in says:
        assert text in result.output, (case, text, result.output)
    assert _published(stored_run) == []  # nothing was written into the run


def test_a_step_reward_scheme_on_a_run_without_step_rewards_is_refused_early(here):
    """The README's old quick start: `credit` with turning_point on an outcome run (final samples only)."""
    from stepgrpo.config import load_config
    from stepgrpo.storage.run import Run

    cfg = load_config(None, ["run.runs_root=runs", "completion.method=null", "credit.scheme=outcome"])
    run = Run.create(here / "runs", "o", cfg.model_dump(mode="json")).path
    result = invoke("credit", str(run), "--scheme", "turning_point")
    assert result.exit_code == 1 and "needs step rewards" in result.output and "outcome" in result.output
    assert "Starting temporary server" not in result.output


def test_a_broken_manifest_is_named(stored_run):
    (stored_run / "manifest.json").write_text("{not json")
    for args in (["rescore", str(stored_run), "--reward", "shapes"], ["inspect", str(stored_run)]):
        result = invoke(*args)
        assert result.exit_code == 1 and "manifest.json is not JSON" in result.output, result.output
    listed = invoke("runs", "--root", str(stored_run.parent))
    assert listed.exit_code == 0 and "unreadable" in listed.output  # the other runs would still be listed


def test_the_catalogue_has_the_cases_the_reliability_doc_promises():
    assert len(TRAIN_CASES) + len(OFFLINE_CASES) + 3 >= 34


HUB_ID = "stepgrpo-tests/no-such-model"


def _hub_error(name: str):
    import httpx
    from huggingface_hub import errors

    response = httpx.Response(401, request=httpx.Request("GET", "https://huggingface.co"))
    made = {
        "gated": lambda: errors.GatedRepoError("gated", response=response),
        "missing": lambda: errors.RepositoryNotFoundError("missing", response=response),
        "unreachable": lambda: httpx.ConnectError("[Errno -3] Temporary failure in name resolution"),
    }
    return made[name]()


@pytest.mark.parametrize(
    "hub, says",
    [
        ("offline", ["HF_HUB_OFFLINE is set", f"hf download {HUB_ID}"]),
        ("gated", ["is gated", "accept its licence", "hf auth login"]),
        ("missing", ["no hub model this login can read", "HF_TOKEN"]),
        ("unreachable", ["cannot be reached", "HF_HUB_OFFLINE=1"]),
    ],
)
def test_a_hub_model_that_cannot_be_read_fails_before_anything_starts(here, monkeypatch, hub, says):
    """A hub id not in the local cache: offline, gated, unknown to this login, or with no network
    fails at once, one line naming the fix, before any server starts or directory is made."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: hub == "offline")

    def auth_check(repo_id, **kwargs):
        raise _hub_error(hub)

    monkeypatch.setattr(huggingface_hub, "auth_check", auth_check)
    result = invoke("train", "--set", "run.runs_root=runs", "--set", f"model.path={HUB_ID}", "--run-id", "x")
    assert result.exit_code == 1, result.output
    assert all(text in result.output for text in says), result.output
    assert "Traceback" not in result.output
    assert not (here / "runs").exists()


def test_a_reward_token_with_a_newline_is_refused_and_never_shown(here, monkeypatch):
    secret = "s3cr3t-value"
    monkeypatch.setenv("STEPGRPO_REWARD_TOKEN", secret + "\n")
    args = ["--set", "reward.name=http", "--set", "reward.options={url: 'http://127.0.0.1:9', name: r, version: '1'}"]
    result = invoke("train", "--set", "run.runs_root=runs", *args, "--run-id", "x")
    assert result.exit_code == 1 and "STEPGRPO_REWARD_TOKEN holds whitespace" in result.output
    assert secret not in result.output and not (here / "runs").exists()


def test_held_out_prompts_that_are_training_prompts_are_named(here):
    p = _write(here, "p.txt", "a red circle\na blue square\n")
    args = ["--set", f"run.prompts={p}", "--set", f"run.heldout_prompts={p}", "--set", "run.prompts_per_iteration=1"]
    args += ["--set", "reward.name=http"]  # then stopped by the reward check that follows: nothing runs
    result = invoke("train", "--set", "run.runs_root=runs", *args, "--run-id", "x")
    assert "every held-out prompt" in result.output and "also a training prompt" in result.output
    assert result.exit_code == 1 and "`url`" in result.output and not (here / "runs").exists()


@pytest.mark.parametrize("reward", ["pickscore", "geneval", "aesthetic", "hpsv2", "imagereward", "clipscore"])
def test_a_reward_whose_weights_are_not_here_is_named_before_anything_starts(here, monkeypatch, reward):
    """Offline, with an empty cache: one line naming the reward's weights and the fix, in seconds
    (not a Prefect retry around transformers' own error minutes later)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(here / "empty-cache"))
    result = invoke("train", "--set", "run.runs_root=runs", "--set", f"reward.name={reward}", "--run-id", "x")
    assert result.exit_code == 1 and f"reward {reward}: " in result.output, result.output
    assert "HF_HUB_OFFLINE is set" in result.output and "hf download" in result.output
    assert not (here / "runs").exists()


@pytest.mark.parametrize(
    "setting, says",
    [
        (["sampler.branch_window=[0,11]"], "must lie in the 10 steps"),
        (["sampler.branch_window=[0,3]", "sampler.shared_x0=false"], "share their initial noise"),
        (["sampler.branch_window=[0,3]", "sampler.kernel=ode"], "needs a stochastic kernel"),
        (["sampler.branch_window=[0,3]", "sampler.sde_window_size=3"], "replaces the SDE window"),
        (["sampler.branch_window=[7,10]"], "reach the final step"),
        (["sampler.branch_tree=[[0,2],[1,3]]"], "must be run.group_size"),
        (["sampler.branch_anchor=[0,10]"], "increasing within the 10 steps"),
        (["sampler.branch_anchor=[0,2,4]"], "must be a multiple of its 3 steps"),
        (["sampler.branch_anchor=[0,2]", "sampler.branch_window=[0,3]"], "set one"),
        (["sampler.branch_anchor=[1,9]"], "reach the final step"),
        (["credit.scheme=local", "completion.method=rollout"], "set sampler.branch_anchor"),
        (["sampler.tree_sde=[0,10]"], "set sampler.branch_tree"),
        (["sampler.branch_tree=[[0,2],[2,2],[4,2]]", "run.group_size=8", "sampler.tree_sde=[0,11]"],
         "must lie in the 10 steps"),
        (["optim.width_pruning=extremes"], "prunes a tree's transitions"),
        (["sampler.branch_tree=[[0,2],[2,2],[4,2]]", "run.group_size=8", "optim.width_pruning=per_branch"],
         "set sampler.tree_sde to reach past step 5"),
        (["update.objective=dgpo", "sampler.kernel=ode", "sampler.shared_x0=false", "optim.micro_batch=2"],
         "would split groups"),
    ],
)  # fmt: skip
def test_a_branch_or_group_setting_that_cannot_work_is_refused_before_anything_starts(here, setting, says):
    """A branched rollout outside the grid, without a shared prefix, without a stochastic step or
    beside an SDE window, and a whole-group objective whose micro-batch splits a group: one line with
    the fix, exit 1, no run directory."""
    sets = [x for s in ["run.runs_root=runs", *setting] for x in ("--set", s)]
    result = invoke("train", *sets, "--run-id", "x")
    assert result.exit_code == 1, result.output
    assert says in result.output and "Traceback" not in result.output
    assert not (here / "runs").exists()


def test_a_noise_out_of_its_kernels_range_is_refused_and_an_overflow_fails_its_stage():
    """`sampler.noise` past its kernel's range (70 typed for 0.7; flow's `a` >= sqrt(2) drops or flips
    the state on the first step) is refused when the config is built. A rollout that still produces
    non-finite values (a calibrated psi table, a model's own overflow) fails the rollout stage before
    it writes, naming the field; a sane rollout passes, and the NaN of a deterministic step (no
    density) is no failure."""
    from types import SimpleNamespace

    from stepgrpo.config import ConfigError, load_config
    from stepgrpo.errors import StageError
    from stepgrpo.loops import workspace
    from stepgrpo.loops.sampling import iteration_plan, sample_iteration
    from stepgrpo.prompts import prompt_source
    from stepgrpo.tasks.rollout import check_finite

    for sets in (["sampler.noise=70"], ["sampler.noise=1.5"], ["sampler.kernel=cps", "sampler.noise=2"]):
        with pytest.raises(ConfigError, match=r"sampler.noise=.*takes its a in \[0, "):
            load_config(None, sets)
    cfg = load_config(None, ["run.prompts_per_iteration=1", "run.group_size=2", "sampler.noise=0.7"])
    pol = workspace.policy(cfg)
    workspace.set_lora(pol, workspace.initial_lora(cfg))
    prompts = prompt_source(cfg)
    (chunk,) = sample_iteration(pol, cfg, prompts.texts, iteration_plan(cfg, prompts.splits, 0), 0, 0.7)
    check_finite(chunk.sde, cfg, 0)
    states = chunk.sde.states.clone()
    states[0, 3] = float("inf")  # what an overflow from step 3 on leaves
    with pytest.raises(StageError, match=r"non-finite values from step 3 on .* lower sampler.noise"):
        check_finite(SimpleNamespace(states=states, stds=chunk.sde.stds, log_probs=chunk.sde.log_probs), cfg, 0)


@pytest.mark.parametrize(
    "setting, says",
    [
        (["run.runs_root=~/runs"], "which only a shell expands"),
        (["sampler.sde_solver=sa_solver", "sampler.noise=0", "update.objective=awm"], "the same sample"),
    ],
)
def test_a_setting_that_would_silently_go_wrong_is_refused(here, setting, says):
    """A runs root spelled with '~' (which would become a directory named '~') and an SA-Solver
    rollout without noise whose group members would all be one sample: refused, one line, exit 1."""
    sets = [x for s in setting for x in ("--set", s)]
    result = invoke("train", *sets, "--run-id", "x")
    assert result.exit_code == 1, result.output
    assert says in result.output and "Traceback" not in result.output
    assert not (here / "~").exists() and not (here / "runs").exists()


def test_a_run_id_naming_a_file_is_refused_in_its_own_words(here):
    (here / "runs").mkdir()
    (here / "runs" / "x").write_text("not a run")
    result = invoke("train", "--set", "run.runs_root=runs", "--run-id", "x")
    assert result.exit_code == 1 and "--run-id x" in result.output and "--run-dir" not in result.output
    assert (here / "runs" / "x").read_text() == "not a run"


def test_a_stray_checkpoint_past_a_gap_is_named_not_read_as_a_longer_run():
    """A 2-iteration run with checkpoints 0 and 7 (a copied folder): the resume names the stray one
    and the fix, instead of asking for more iterations."""
    from stepgrpo.config import load_config
    from stepgrpo.errors import StageError
    from stepgrpo.runs import check_length

    class Stored:
        run_id = "r"

        def iterations(self, stage):
            return [0, 7]

    with pytest.raises(StageError, match=r"checkpoints \[7\] after the missing iteration 1.*move checkpoints/iter_7"):
        check_length(load_config(None, ["run.iterations=2"]), Stored())
