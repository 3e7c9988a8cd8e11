"""HPSv2 and ImageReward: their published checkpoint layouts, converted and checked against their
authors' own model code on tiny random weights.

open_clip (for HPSv2) and ImageReward's BLIP need torchvision, timm and fairscale, which this
project does not install; their model code does not use them to compute features, so a
subprocess stubs those imports and runs the original modules as the reference
(`make install` puts open-clip-torch and image-reward in the venv without their dependencies).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from stepgrpo.rewards import REWARDS, build_reward, reward_identity

VOCAB = 54  # tiny CLIP vocabulary: 26 letters, 26 word-final letters, <|startoftext|>, <|endoftext|> (last)

# Run before the original modules are imported: transformers first (so it records that
# torchvision is absent), then stand-ins for what the model code imports but does not compute with.
STUBS = """
import sys
import transformers  # noqa: F401
from unittest import mock
for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional",
             "torchvision.ops", "torchvision.ops.misc"):
    sys.modules[name] = mock.MagicMock()
"""

OPEN_CLIP_REFERENCE = (
    STUBS
    + """
import torch
from open_clip.model import CLIP

out = sys.argv[1]
torch.manual_seed(0)
model = CLIP(
    embed_dim=8,
    vision_cfg=dict(image_size=32, layers=2, width=16, head_width=8, patch_size=8),
    text_cfg=dict(context_length=32, vocab_size=int(sys.argv[2]), width=16, heads=2, layers=2),
).eval()
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.3)  # no layer left at its initial ones / zeros
torch.save({"state_dict": {"module." + k: v for k, v in model.state_dict().items()}}, out + "/hps.pt")
pixels, tokens = torch.load(out + "/pixels.pt"), torch.load(out + "/tokens.pt")
with torch.no_grad():
    torch.save({"image": model.encode_image(pixels, normalize=True), "text": model.encode_text(tokens, normalize=True)},
               out + "/reference.pt")
"""
)


def tiny_base(path):
    """A transformers CLIP repo of the tiny open_clip model's architecture: config and processor."""
    import string

    from transformers import CLIPConfig, CLIPImageProcessor, CLIPProcessor, CLIPTokenizer

    tokens = ["<|startoftext|>"] + list(string.ascii_lowercase) + [c + "</w>" for c in string.ascii_lowercase]
    tokens.append("<|endoftext|>")  # the largest id, as in CLIP's vocabulary: open_clip pools at the argmax
    tokenizer = CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[], model_max_length=32)
    processor = CLIPProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=tokenizer,
    )
    layers = dict(hidden_size=16, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, hidden_act="gelu")
    config = CLIPConfig(
        text_config=dict(
            vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0, eos_token_id=VOCAB - 1, **layers
        ),
        vision_config=dict(image_size=32, patch_size=8, **layers),
        projection_dim=8,
    )
    config.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hps(tmp_path_factory):
    """(work dir, base dir): the reference's checkpoint and features for fixed pixels and tokens."""
    work = tmp_path_factory.mktemp("hps")
    g = torch.Generator().manual_seed(3)
    torch.save(torch.randn(3, 3, 32, 32, generator=g), work / "pixels.pt")
    tokens = torch.zeros(3, 32, dtype=torch.long)
    for row, n in enumerate((5, 9, 31)):
        tokens[row, 0] = 0
        tokens[row, 1:n] = torch.randint(1, VOCAB - 1, (n - 1,), generator=g)
        tokens[row, n] = VOCAB - 1  # the end-of-text token
    torch.save(tokens, work / "tokens.pt")
    subprocess.run([sys.executable, "-c", OPEN_CLIP_REFERENCE, str(work), str(VOCAB)], check=True, capture_output=True)
    return work, tiny_base(work / "base")


def test_hpsv2_checkpoint_converts_to_the_features_open_clip_computes(hps):
    from stepgrpo.rewards.preference import load_hps_model

    work, base = hps
    model = load_hps_model(str(work / "hps.pt"), "unused", base, torch.float32)
    reference = torch.load(work / "reference.pt")
    with torch.no_grad():
        image = model.get_image_features(pixel_values=torch.load(work / "pixels.pt")).pooler_output
        text = model.get_text_features(input_ids=torch.load(work / "tokens.pt")).pooler_output
    torch.testing.assert_close(torch.nn.functional.normalize(image, dim=-1), reference["image"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.nn.functional.normalize(text, dim=-1), reference["text"], rtol=1e-4, atol=1e-5)


def test_hpsv2_reward_scores_through_the_published_loading_path(hps):
    from stepgrpo.rewards.preference import load_hps_model

    work, base = hps
    spec = {"name": "hpsv2", "options": {"checkpoint": str(work / "hps.pt"), "base": base}}
    reward = build_reward(spec)
    assert (reward.name, reward.version) == reward_identity(spec) == ("hpsv2", "1+v2.1+hps.pt+base")
    images = torch.rand(2, 3, 48, 40, generator=torch.Generator().manual_seed(0))
    scores = reward(images, ["two red circles", "a blue square"], [{}, {}]).scores
    embedder = reward.embedder  # the cosine of the converted model's features, by hand
    direct = (embedder.images(images) * embedder.texts(["two red circles", "a blue square"])).sum(-1)
    torch.testing.assert_close(scores, direct)
    assert scores.shape == (2,) and bool((scores.abs() <= 1).all())
    assert reward_identity("hpsv2") == ("hpsv2", "1+v2.1") and reward_identity(
        {"name": "hpsv2", "options": {"variant": "v2.0"}}
    ) == ("hpsv2", "1+v2.0")
    with pytest.raises(ValueError, match="variant"):
        reward_identity({"name": "hpsv2", "options": {"variant": "v3"}})
    # a checkpoint in another layout is an error naming the keys, not a model with random weights
    torch.save({"state_dict": {"visual.conv1.weight": torch.zeros(1)}}, work / "bad.pt")
    with pytest.raises(Exception, match="no 'visual.class_embedding'"):
        load_hps_model(str(work / "bad.pt"), "unused", base, torch.float32)


def test_the_preference_rewards_are_registered():
    assert {"hpsv2", "imagereward"} <= set(REWARDS.names())
    assert reward_identity("imagereward") == ("imagereward", "1")


IMAGEREWARD_REFERENCE = r"""
import sys, types
import transformers  # noqa
import torch
from torch import nn
from unittest import mock

# stand-ins for the imports the BLIP model code makes but does not compute with (torchvision, timm, fairscale),
# and the transformers 4 helpers med.py imports from their old places
import transformers.modeling_utils as mu
import transformers.pytorch_utils as pu
mu.apply_chunking_to_forward = pu.apply_chunking_to_forward
mu.prune_linear_layer = pu.prune_linear_layer
mu.find_pruneable_heads_and_indices = lambda *a, **k: None

class PatchEmbed(nn.Module):  # timm's: a strided conv named `proj`
    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=768, **_):
        super().__init__()
        self.num_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_chans, embed_dim, patch_size, patch_size)
    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)

class DropPath(nn.Module):  # identity at eval
    def __init__(self, p=0.0):
        super().__init__()
    def forward(self, x):
        return x

def module(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m
    return m

for name in ("torchvision", "torchvision.transforms"):
    sys.modules[name] = mock.MagicMock()
module("timm"); module("timm.models")
module("timm.models.vision_transformer", _cfg=lambda **k: k, PatchEmbed=PatchEmbed)
module("timm.models.registry", register_model=lambda f: f)
module("timm.models.layers", trunc_normal_=nn.init.trunc_normal_, DropPath=DropPath)
module("timm.models.helpers", named_apply=lambda fn, m, **k: m, adapt_input_conv=lambda *a: a[-1])
module("timm.models.hub", download_cached_file=None)
module("fairscale"); module("fairscale.nn"); module("fairscale.nn.checkpoint")
module("fairscale.nn.checkpoint.checkpoint_activations", checkpoint_wrapper=lambda m, **k: m)

import importlib.util, os, sysconfig
BLIP = os.path.join(sysconfig.get_paths()["purelib"], "ImageReward", "models", "BLIP")
def load(name):  # the module file alone: the package's __init__ imports CLIP and more
    spec = importlib.util.spec_from_file_location("blip_" + name, os.path.join(BLIP, name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
VisionTransformer = load("vit").VisionTransformer
med = load("med")
BertConfig, BertModel = med.BertConfig, med.BertModel
# transformers 4's PreTrainedModel helpers that med.py calls (gone from 5); weights are set below
BertModel.init_weights = lambda self: None
BertModel.invert_attention_mask = lambda self, m: (1.0 - m[:, None, None, :].float()) * torch.finfo(torch.float32).min
BertModel.get_head_mask = lambda self, mask, n: [None] * n
out, vocab = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
vit = VisionTransformer(img_size=32, patch_size=8, embed_dim=16, depth=2, num_heads=2).eval()
config = BertConfig(
    vocab_size=vocab, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
    max_position_embeddings=40, add_cross_attention=True, layer_norm_eps=1e-12,
)
config.encoder_width = 16  # BLIP_Pretrain sets it to the ViT's width
bert = BertModel(config, add_pooling_layer=False).eval()
# ImageReward.py's MLP
mlp = nn.Sequential(nn.Linear(16, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
                    nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1)).eval()
with torch.no_grad():
    for p in [*vit.parameters(), *bert.parameters(), *mlp.parameters()]:
        p.normal_(0, 0.3)
state = {f"blip.visual_encoder.{k}": v for k, v in vit.state_dict().items()}
state |= {f"blip.text_encoder.{k}": v for k, v in bert.state_dict().items()}
state |= {f"mlp.layers.{k}": v for k, v in mlp.state_dict().items()}
state["blip.vision_proj.weight"] = torch.zeros(4, 16)  # BLIP's other heads: in the checkpoint, not in the score
torch.save(state, out + "/ImageReward.pt")
pixels, ids, mask = torch.load(out + "/pixels.pt"), torch.load(out + "/ids.pt"), torch.load(out + "/mask.pt")
with torch.no_grad():  # ImageReward.score_gard
    image_embeds = vit(pixels)
    atts = torch.ones(image_embeds.size()[:-1], dtype=torch.long)
    text = bert(ids, attention_mask=mask, encoder_hidden_states=image_embeds, encoder_attention_mask=atts,
                return_dict=True)
    rewards = mlp(text.last_hidden_state[:, 0, :])
    rewards = (rewards - 0.16717362830052426) / 1.0333394966054072
torch.save(rewards.squeeze(-1), out + "/reference.pt")
"""


def tiny_bert_tokenizer(path) -> str:
    """A BERT tokenizer directory (letters and a few words); BLIP adds its two tokens on load."""
    import string

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "two", "red", "circles", "a", "blue", "square"]
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(words + list(string.ascii_lowercase)) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def imagereward_ref(tmp_path_factory):
    from stepgrpo.rewards.preference import blip_tokenizer

    work = tmp_path_factory.mktemp("imagereward")
    tokenizer_dir = tiny_bert_tokenizer(work / "tokenizer")
    tokenizer = blip_tokenizer(tokenizer_dir)
    text = tokenizer(
        ["two red circles", "a blue square", "a"], padding="max_length", max_length=35, return_tensors="pt"
    )
    torch.save(torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(2)) * 2 - 1, work / "pixels.pt")
    torch.save(text["input_ids"], work / "ids.pt")
    torch.save(text["attention_mask"], work / "mask.pt")
    run = subprocess.run(
        [sys.executable, "-c", IMAGEREWARD_REFERENCE, str(work), str(len(tokenizer))], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return work, tokenizer_dir, len(tokenizer)


TINY_BLIP = {
    "vision": dict(
        hidden_size=16, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8,
    ),
    "text": dict(
        hidden_size=16, encoder_hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=40,
    ),
}  # fmt: skip


def test_imagereward_checkpoint_converts_to_the_scores_blip_computes(imagereward_ref):
    work, tokenizer_dir, _ = imagereward_ref
    spec = {
        "name": "imagereward",
        "options": {"checkpoint": str(work / "ImageReward.pt"), "tokenizer": tokenizer_dir, "architecture": TINY_BLIP},
    }
    reward = build_reward(spec)
    with torch.no_grad():
        ours = reward.model(torch.load(work / "pixels.pt"), torch.load(work / "ids.pt"), torch.load(work / "mask.pt"))
    torch.testing.assert_close(ours, torch.load(work / "reference.pt"), rtol=1e-4, atol=1e-5)
    # the reward itself: 8-bit images, its own preprocessing and tokenization, one score each
    images = torch.rand(2, 3, 40, 48, generator=torch.Generator().manual_seed(0))
    out = reward(images, ["two red circles", "a blue square"], [{}, {}])
    assert out.scores.shape == (2,) and bool(torch.isfinite(out.scores).all())
    assert (reward.name, reward.version) == reward_identity(spec)


def test_an_imagereward_checkpoint_of_another_layout_names_the_keys(imagereward_ref, tmp_path):
    work, tokenizer_dir, _ = imagereward_ref
    state = torch.load(work / "ImageReward.pt")
    state.pop("blip.visual_encoder.norm.weight")
    state["blip.visual_encoder.extra.weight"] = torch.zeros(1)
    torch.save(state, tmp_path / "ImageReward.pt")
    with pytest.raises(
        Exception, match=r"missing \['vision.post_layernorm.weight'\].*unexpected \['vision.extra.weight'\]"
    ):
        build_reward(
            {
                "name": "imagereward",
                "options": {
                    "checkpoint": str(tmp_path / "ImageReward.pt"),
                    "tokenizer": tokenizer_dir,
                    "architecture": TINY_BLIP,
                },
            }
        )
