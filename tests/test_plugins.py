"""Plug-in rewards and credit schemes (`stepgrpo.plugins`): found, validated, identified."""

from __future__ import annotations

import textwrap

import pytest
import torch

from stepgrpo.config import ConfigError, load_config
from stepgrpo.plugins import allow
from stepgrpo.storage.publish import options_digest

PLUGINS = """
import torch
from stepgrpo.plugins import reward, scheme
from stepgrpo.rewards.base import RewardOutput


@reward(version="3")
class Brightness:
    name = "brightness"

    def __init__(self, gamma: float = 1.0):
        self.gamma = gamma

    def __call__(self, images, prompts, metadata):
        return RewardOutput(scores=images.mean(dim=(1, 2, 3)) ** self.gamma)


@reward(version="1", name="darkness")
def darkness_factory():
    return lambda images, prompts, metadata: RewardOutput(scores=1 - images.mean(dim=(1, 2, 3)))


@reward(version="1")
class NoArgs:
    def __call__(self, images):
        return RewardOutput(scores=images.mean())


@scheme(version="2")
def halved_gains(rewards, gains, groups, factor: float = 0.5):
    return gains * factor


@scheme(version="1")
def needs_option(rewards, gains, groups, factor):
    return gains * factor


@scheme(version="1")
def wrong_shape(rewards, gains, groups):
    return gains[:, :1]


def not_marked(rewards, gains, groups):
    return gains
"""


@pytest.fixture
def plugins(tmp_path, monkeypatch) -> str:
    (tmp_path / "my_plugins.py").write_text(textwrap.dedent(PLUGINS))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_plugins"


def test_a_plugin_reward_is_named_by_reference_and_identified_by_its_declared_name_and_version(plugins):
    from stepgrpo.loops import workspace
    from stepgrpo.rewards import build_reward

    cfg = load_config(None, [f"reward.name={plugins}:Brightness", "reward.options={gamma: 2.0}"])
    identity = workspace.reward_identity(cfg.reward)
    assert identity["name"] == "brightness" and identity["declared_version"] == "3"
    assert identity["version"] == "3+" + options_digest({"gamma": 2.0})[:8]  # rows of other options are others
    built = build_reward({"name": cfg.reward.name, "options": {"gamma": 2.0}})
    assert (built.name, built.version) == ("brightness", "3")
    assert built(torch.full((2, 3, 4, 4), 0.5), ["a", "b"], [{}, {}]).scores.tolist() == [0.25, 0.25]
    # a factory function: the built reward gets the declared name and version (named in code: allowed there)
    allow(f"{plugins}:darkness_factory")
    dark = build_reward(f"{plugins}:darkness_factory")
    assert (dark.name, dark.version) == ("darkness", "1")
    # in a weighted sum, by reference, with and without a weight
    mixed = build_reward(f"shapes:1.0,{plugins}:darkness_factory:0.5")
    assert mixed.name == "shapes:1,darkness:0.5"
    from stepgrpo.rewards import reward_identity

    with pytest.raises(TypeError, match="unexpected keyword argument 'gama'"):  # options checked as a built-in's
        reward_identity({"name": f"{plugins}:Brightness", "options": {"gama": 2}})


def test_a_plugin_scheme_credits_like_a_built_in(plugins):
    from stepgrpo_core.credit import SCHEMES, assign, scheme_options

    cfg = load_config(None, [f"credit.scheme={plugins}:halved_gains", "credit.options={factor: 0.25}"])
    assert scheme_options(cfg.credit.scheme) == {"factor": 0.5}
    assert SCHEMES.facts(cfg.credit.scheme)["version"] == "2"
    rewards = torch.tensor([[0.0, 1.0, 3.0], [0.0, 2.0, 2.0]])
    out = assign(cfg.credit.scheme, rewards, torch.tensor([0, 0]), factor=0.25)
    assert out.advantages.tolist() == [[0.25, 0.5], [0.5, 0.0]]
    with pytest.raises(ConfigError, match=r"has no option\(s\) \[.scale.\]"):
        load_config(None, [f"credit.scheme={plugins}:halved_gains", "credit.options={scale: 2}"])
    with pytest.raises(ValueError, match="returned advantages"):
        assign(load_config(None, [f"credit.scheme={plugins}:wrong_shape"]).credit.scheme, rewards, torch.tensor([0, 0]))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("reward.name=no_such_package.rewards:Aesthetic", "module 'no_such_package.rewards' cannot be imported"),
        ("reward.name={p}:Missing", "has no attribute 'Missing'"),
        ("reward.name=os.path:join", "is not a stepgrpo reward: mark it"),
        ("reward.name={p}:NoArgs", r"takes 2 positional argument\(s\); expected __call__\(self, images, prompts"),
        ("credit.scheme={p}:not_marked", "is not a stepgrpo credit scheme"),
        ("credit.scheme={p}:Brightness", "it is marked as a reward"),
        ("credit.scheme={p}:needs_option", r"parameter\(s\) \['factor'\] are not options"),
        ("reward.name=nonexistent_entry_point", "or a plug-in: package.module:attribute, or an entry point"),
    ],
)
def test_bad_plugins_are_config_errors_that_say_what_is_wrong(plugins, override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override.format(p=plugins)])


def test_a_plugin_without_a_version_is_refused_where_it_is_declared():
    from stepgrpo.plugins import PluginError, reward, scheme

    with pytest.raises(PluginError, match=r'needs a version: @reward\(version="1"\)'):
        reward()
    with pytest.raises(PluginError, match="needs a version"):
        scheme(version="")
