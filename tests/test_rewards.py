"""Reward registry, JPEG, weighted sums, and the CLIP-based scorers on tiny random-weight models.

The CLIP scorers load a tiny `CLIPModel` + `CLIPProcessor` saved to a temporary directory through
the same `from_pretrained` path that loads the published hub ids; no hub access (HF_HUB_OFFLINE).
"""

import io
import os
import string

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from stepgrpo.images import to_pil  # noqa: E402
from stepgrpo.rewards import REWARDS, WeightedSum, build_reward, parse_weights  # noqa: E402
from stepgrpo.rewards.base import RewardOutput  # noqa: E402
from stepgrpo.rewards.clip_models import AestheticHead  # noqa: E402

PROMPTS = ["a red circle", "two blue squares", "a green triangle"]


def flat_and_noisy() -> torch.Tensor:
    """`[2, 3, 32, 32]`: a flat grey image and uniform noise."""
    gen = torch.Generator().manual_seed(0)
    return torch.stack([torch.full((3, 32, 32), 0.5), torch.rand(3, 32, 32, generator=gen)])


class Constant:
    """A stub reward with fixed scores, to check the combination arithmetic."""

    version = "7"

    def __init__(self, name, scores, strict=None, sub=None):
        self.name, self._out = name, RewardOutput(torch.tensor(scores), strict, sub or {})

    def __call__(self, images, prompts, metadata):
        return self._out


def test_registry_lists_every_scorer():
    expected = {
        "shapes",
        "ocr",
        "jpeg_compressibility",
        "jpeg_incompressibility",
        "pickscore",
        "clipscore",
        "aesthetic",
        "weighted",
    }
    assert expected <= set(REWARDS.names())
    with pytest.raises(ValueError, match="known rewards"):
        build_reward("pickscroe")


def test_jpeg_size_matches_pil_and_signs():
    images = flat_and_noisy()
    inc = build_reward("jpeg_incompressibility")
    com = build_reward("jpeg_compressibility")
    sizes = inc(images, ["x", "y"], [{}, {}]).scores
    # the same measurement by hand: bytes of a quality-95 JPEG / 1000
    buffer = io.BytesIO()
    to_pil(images[1:])[0].save(buffer, format="JPEG", quality=95)
    assert sizes[1].item() == pytest.approx(buffer.tell() / 1000)
    assert sizes[1] > sizes[0]  # noise is harder to compress than a flat image
    assert torch.equal(com(images, ["x", "y"], [{}, {}]).scores, -sizes)
    assert (inc.name, inc.version, com.name) == ("jpeg_incompressibility", "1", "jpeg_compressibility")
    assert build_reward({"name": "jpeg_compressibility", "options": {"quality": 50}}).version == "1+q50"


def test_weighted_sum_arithmetic_strict_and_sub():
    a = Constant("a", [1.0, 0.0], strict=torch.tensor([1.0, 0.0]), sub={"colour": torch.tensor([1.0, 0.5])})
    b = Constant("b", [2.0, 4.0])
    c = Constant("c", [0.0, 1.0], strict=torch.tensor([0.0, 1.0]))
    out = WeightedSum([(a, 1.0), (b, 0.5), (c, 2.0)])(torch.zeros(2, 3, 4, 4), ["p", "q"], [{}, {}])
    # row 0: 1*1 + 0.5*2 + 2*0 = 2; row 1: 0 + 0.5*4 + 2*1 = 4
    assert torch.equal(out.scores, torch.tensor([2.0, 4.0]))
    assert torch.equal(out.strict, torch.tensor([0.0, 0.0]))  # AND over the parts that report it
    assert torch.equal(out.sub["b"], torch.tensor([2.0, 4.0]))
    assert torch.equal(out.sub["a/colour"], torch.tensor([1.0, 0.5]))
    combined = WeightedSum([(a, 1.0), (b, 0.5)])
    assert (combined.name, combined.version) == ("a:1,b:0.5", "a=7,b=7")
    with pytest.raises(ValueError, match="twice"):
        WeightedSum([(a, 1.0), (a, 2.0)])


def test_spec_forms_build_the_same_reward():
    images = flat_and_noisy()
    spec = "jpeg_compressibility:1.0,jpeg_incompressibility:0.25"
    assert parse_weights(spec) == [("jpeg_compressibility", 1.0), ("jpeg_incompressibility", 0.25)]
    from_string = build_reward(spec)
    from_mapping = build_reward(
        {"name": "weighted", "options": {"parts": {"jpeg_compressibility": 1.0, "jpeg_incompressibility": 0.25}}}
    )
    from_list = build_reward(
        {
            "name": "weighted",
            "options": {
                "parts": [{"name": "jpeg_compressibility"}, {"name": "jpeg_incompressibility", "weight": 0.25}]
            },
        }
    )
    scores = [r(images, ["x", "y"], [{}, {}]).scores for r in (from_string, from_mapping, from_list)]
    assert torch.allclose(
        scores[0], -0.75 * build_reward("jpeg_incompressibility")(images, ["x", "y"], [{}, {}]).scores
    )
    assert torch.equal(scores[0], scores[1]) and torch.equal(scores[0], scores[2])
    assert (
        from_string.name == from_mapping.name == from_list.name == "jpeg_compressibility:1,jpeg_incompressibility:0.25"
    )
    with pytest.raises(ValueError, match="not a number"):
        build_reward("jpeg_compressibility:heavy")
    with pytest.raises(ValueError, match="known rewards"):
        build_reward("jpeg_compressibility:1,nope:2")


# ---- CLIP-based scorers on a tiny random CLIP saved to disk ----


def tiny_clip_dir(path, projection_dim=8):
    """Save a random `CLIPModel` (32x32 images, letter vocabulary) and its processor to `path`."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    tokens = ["<|startoftext|>", "<|endoftext|>"] + list(string.ascii_lowercase)
    tokens += [c + "</w>" for c in string.ascii_lowercase]
    tokenizer = CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[], model_max_length=32)
    size = {"shortest_edge": 32}
    processor = CLIPProcessor(
        image_processor=CLIPImageProcessor(size=size, crop_size={"height": 32, "width": 32}), tokenizer=tokenizer
    )
    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(tokens), max_position_embeddings=32, bos_token_id=0, eos_token_id=1, pad_token_id=1, **small
        ),
        vision_config=dict(image_size=32, patch_size=8, **small),
        projection_dim=projection_dim,
    )
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return tiny_clip_dir(tmp_path_factory.mktemp("clip"))


def reference_cosine(clip_dir, images, prompts):
    """The cosine computed the plain way, with the model called directly on full batches."""
    from transformers import CLIPModel, CLIPProcessor

    model, processor = CLIPModel.from_pretrained(clip_dir).eval(), CLIPProcessor.from_pretrained(clip_dir)
    with torch.no_grad():
        out = model(**processor(text=prompts, images=to_pil(images), padding=True, return_tensors="pt"))
    img = out.image_embeds / out.image_embeds.norm(dim=-1, keepdim=True)
    txt = out.text_embeds / out.text_embeds.norm(dim=-1, keepdim=True)
    return (img * txt).sum(-1), model.logit_scale.exp()


def test_pickscore_and_clipscore_match_a_direct_computation(clip_dir):
    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    cos, logit_scale = reference_cosine(clip_dir, images, PROMPTS)
    # batch_size=2 also checks the chunking (3 rows -> chunks of 2 and 1)
    pick = build_reward({"name": "pickscore", "options": {"model": clip_dir, "processor": clip_dir, "batch_size": 2}})
    out = pick(images, PROMPTS, [{}] * 3)
    assert out.scores.shape == (3,) and out.scores.dtype == torch.float32
    assert torch.allclose(out.scores, logit_scale * cos / 26, atol=1e-5)
    assert pick.name == "pickscore" and pick.version.startswith("1+")  # not the published checkpoint
    clip = build_reward({"name": "clipscore", "options": {"model": clip_dir, "batch_size": 2}})
    assert torch.allclose(clip(images, PROMPTS, [{}] * 3).scores, 2.5 * cos.clamp(min=0), atol=1e-5)
    raw = build_reward({"name": "clipscore", "options": {"model": clip_dir, "weight": 1.0, "clip_at_zero": False}})
    assert torch.allclose(raw(images, PROMPTS, [{}] * 3).scores, cos, atol=1e-5)


def test_aesthetic_head_loads_from_a_file(clip_dir, tmp_path):
    torch.manual_seed(2)
    head = AestheticHead(in_dim=8)
    # the published checkpoint is a plain state dict with keys layers.{0,2,4,6,7}.{weight,bias}
    assert sorted(head.state_dict())[:2] == ["layers.0.bias", "layers.0.weight"]
    torch.save(head.state_dict(), tmp_path / "head.pth")
    reward = build_reward({"name": "aesthetic", "options": {"model": clip_dir, "head": str(tmp_path / "head.pth")}})
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    out = reward(images, ["", ""], [{}, {}])
    from transformers import CLIPModel, CLIPProcessor

    model, processor = CLIPModel.from_pretrained(clip_dir).eval(), CLIPProcessor.from_pretrained(clip_dir)
    with torch.no_grad():
        emb = model.get_image_features(**processor(images=to_pil(images), return_tensors="pt"))
        emb = getattr(emb, "pooler_output", emb)
        expected = head.eval()(emb / emb.norm(dim=-1, keepdim=True)).squeeze(-1)
    assert torch.allclose(out.scores, expected, atol=1e-5)


def test_image_and_prompt_count_mismatch_is_an_error(clip_dir):
    reward = build_reward({"name": "clipscore", "options": {"model": clip_dir}})
    with pytest.raises(ValueError, match="2 images but 1 prompts"):
        reward(torch.rand(2, 3, 32, 32), ["one"], [{}])


def test_every_reward_declares_its_identity_without_loading_a_model(monkeypatch):
    from stepgrpo import rewards

    for name in rewards.REWARDS:
        assert rewards.REWARDS.facts(name)["identity"] is not None, name
    # the identities of rewards whose weights are not on this machine come from their options alone
    assert rewards.reward_identity("pickscore") == ("pickscore", "1")
    assert rewards.reward_identity({"name": "pickscore", "options": {"scale": 1.0}}) == ("pickscore", "1+x1")
    assert rewards.reward_identity({"name": "clipscore", "options": {"model": "/m/my-clip"}}) == (
        "clipscore",
        "1+my-clip",
    )
    assert rewards.reward_identity({"name": "geneval", "options": {"threshold": 0.5}})[1].startswith("1+t0.5")
    with pytest.raises(TypeError, match="pickscore"):
        rewards.reward_identity({"name": "pickscore", "options": {"no_such_option": 1}})


@pytest.mark.parametrize(
    "spec",
    [
        "shapes",
        "jpeg_compressibility",
        {"name": "jpeg_incompressibility", "options": {"quality": 80}},
        "ocr",
        "shapes:1.0,jpeg_compressibility:0.1",
        {
            "name": "weighted",
            "options": {
                "parts": [
                    {"name": "shapes"},
                    {"name": "jpeg_compressibility", "weight": 0.2, "options": {"quality": 50}},
                ]
            },
        },
    ],
)
def test_declared_identity_is_the_built_rewards(spec):
    from stepgrpo.rewards import build_reward, reward_identity

    built = build_reward(spec)
    assert reward_identity(spec) == (built.name, built.version)
