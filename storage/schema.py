"""Every stored array, axis, dtype, chunking, column and the schema version, in one place.

Shape legend: `B` trajectories, `T` steps, `T+1` states `x_0..x_T`, `C, H, W` latent; for
decoded images `K` scored states, `RGB` channels (3), `Y, X` pixels.

Bump `SCHEMA_VERSION` whenever anything declared here changes in a way an older reader would
misread (a renamed array or column, a new required attr, another codec). Runs record the version
they were written with and readers refuse other versions (see `stepgrpo.storage.errors.SchemaVersionError`).

Zarr stores (v3, one directory per stage):

- Arrays marked `per_trajectory` are chunked one trajectory per chunk along `B` (the other axes
  are one chunk), so each writer owns whole chunks: concurrent writers to a shared chunk lose
  updates. The others (`sigmas`, `seeds`, ...) are one chunk, written once when the stage begins.
- Codecs: `bytes` (little endian) then `crc32c`, no compression: latents are noise-like and
  barely compress, and the checksum lets a reader detect a damaged chunk instead of training on
  it. A chunk file is therefore the raw little-endian array bytes followed by 4 bytes of crc32c
  (little endian); `stepgrpo.storage.arrays` reads and writes that encoding directly for speed, and the
  stores stay plain Zarr v3 that `zarr.open_group` reads.
- Chunk keys use the `default` encoding with separator `"."` (`c.3.0.0.0.0`), which keeps a
  store's chunk files in one directory per array (nested directories cost more than the writes).
- Latent dtype: the dtype the latents were sampled in (`model.dtype`), so the stored tensor is
  the one whose log-prob was taken and a bf16 run stores 2 bytes a value, not 4. bfloat16 has no
  NumPy dtype: its 16 bits are stored in a `uint16` Zarr array, the store's `latent_dtype` attr
  says `"bfloat16"`, and readers return float32 (exact: every bf16 value is a float32 value).
  Schema 2 stores of bf16 runs hold float32 (`latent_dtype: float32`) and read the same.

Image stores (`images/<source>`, optional): the uint8 images a reward saw for the clean latents
of one completion (or of `x_T` alone, source `final`), written by the first `score` of an
iteration. Re-scoring reads them and skips the VAE; they are a cache of a deterministic decode,
so deleting them loses nothing. They cost `3 * Y * X` bytes per state (768 KiB at 512 px, six
times a 16x64x64 fp16 latent): `storage.images: false` turns them off.

Parquet tables (long format, append-only; one immutable file per append, read as a dataset):

- prompts: one row per prompt.
- rewards: one row per (iteration, trajectory, state k, reward name, reward version). A reward's
  sub-scores go in the `sub` map column (sub-score name -> value, NaN where not applicable), so a
  reward stays one row per state; `strict` is null where a reward has no strict score.
- advantages: one row per (iteration, trajectory, step k, scheme, options digest). NaN marks a step
  the scheme gives no credit (e.g. outside the SDE window); infinities are refused.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import pyarrow as pa

SCHEMA_VERSION = 6  # 2: rollout.ode_final; 3: bf16 latents stored as bf16 (uint16 bits); 4: rollout.velocities;
# 5: rollout.ode_final optional (`sampler.ode_reference: false`); 6: a branched rollout's states by node
# (`BY_NODE`, the optional rollout.state_rows)
# 3 only adds the bf16 latent dtype, 4 an optional array (older rollouts lack it), 5 makes one optional
# (older rollouts all have it) and 6 adds a layout older rollouts do not use: older runs read unchanged
READABLE_SCHEMA_VERSIONS = (2, 3, 4, 5, 6)
# A rollout whose attrs set BY_NODE true stores each distinct state once (a branched rollout: its
# members' shared prefix, a tree's nodes): `states` is chunked one state per chunk, and `state_rows [B,
# T+1]` names for each trajectory and state the trajectory whose chunk holds it (itself, or an earlier
# trajectory written in the same call whose state there is the same bytes); `velocities` likewise
# with `velocity_rows [B, T]`. Only the chunks a trajectory owns are written; `StageStore.read`
# gives each array whole, as any rollout's.
BY_NODE = "states_by_node"
# Below this many bytes a state, one file a state costs more disk than a shared prefix saves (each
# file fills a 4 KiB filesystem block at least; a 1 KiB latent of the shipped model fills four):
# `storage.branch_nodes: auto` stores a branched rollout by node from here on (a 512 px SD3 latent
# in bf16 is 128 KiB).
BY_NODE_MIN_BYTES = 16 * 1024
NODE_ROWS = {"states": "state_rows", "velocities": "velocity_rows"}  # array stored by node -> its row table

# Latent storage dtype for each compute dtype: the same (bf16 as its bits, `BF16_BITS`).
LATENT_STORAGE_DTYPES: dict[str, str] = {
    "float16": "float16",
    "float32": "float32",
    "bfloat16": "bfloat16",
}
BF16_BITS = "uint16"  # the NumPy dtype that holds bf16 latents

CHUNK_KEY_SEPARATOR = "."
CHECKSUM_BYTES = 4  # crc32c appended to every chunk, little endian
# How a Zarr stage's content digest is computed, fixed per run (the run's and each stage's manifest
# record `digest_format`; none recorded: 1). 1: one sha256 over every chunk's bytes in order
# (sequential). 2: one sha256 over each chunk's own sha256 in order, so the chunks are hashed in
# parallel (the publish was bound by sha256, SCALING.md).
DIGEST_FORMAT = 2
DIGEST_FORMATS = (1, 2)


def known_digest_format(value: object) -> bool:
    """Whether a manifest's `digest_format` is one this version computes (an int, not a JSON `true`)."""
    return type(value) is int and value in DIGEST_FORMATS


PUBLISHED_FILE = "_published.json"
EXPORT_FILE = "_export.json"  # the digest of an exported folder (`lora/`, `transformer/`), beside its files

# Files a run directory may hold: data formats only, never pickle (opening a run must not run code).
# Markdown and PNG: an export's model card and its sample grid (text and an image, read, never run).
ALLOWED_FILE_SUFFIXES = (".json", ".yaml", ".yml", ".parquet", ".safetensors", ".md", ".png")


@dataclass(frozen=True)
class ArraySpec:
    """One Zarr array of a stage store."""

    name: str
    axes: tuple[str, ...]  # axis names from the legend: "B", "T", "T+1", "C", "H", "W"
    dtype: str  # NumPy dtype name, or "latent" for the configured latent storage dtype
    per_trajectory: bool  # True: one chunk per trajectory, written by trajectory writers
    doc: str
    # True: stores made before the array existed lack it (their readers get None, their digest
    # covers what they hold); every store made now has it
    optional: bool = False


@dataclass(frozen=True)
class StoreSpec:
    """The arrays and required attrs of one kind of stage store."""

    kind: str
    arrays: tuple[ArraySpec, ...]
    required_attrs: tuple[str, ...]  # must be present when the stage is published
    dims: tuple[str, ...] = ("B", "T", "C", "H", "W")  # attrs holding the axis sizes

    def array(self, name: str) -> ArraySpec:
        for spec in self.arrays:
            if spec.name == name:
                return spec
        known = ", ".join(a.name for a in self.arrays)
        raise KeyError(f"{self.kind} store has no array {name!r}; known arrays: {known}")


ROLLOUT = StoreSpec(
    kind="rollout",
    arrays=(
        ArraySpec("states", ("B", "T+1", "C", "H", "W"), "latent", True, "states x_0..x_T"),
        ArraySpec(
            "state_rows",
            ("B", "T+1"),
            "int64",
            True,
            "stored by node (`BY_NODE`): the trajectory whose `states` chunk holds state k of this one",
            optional=True,
        ),
        ArraySpec(
            "log_probs",
            ("B", "T"),
            "float32",
            True,
            "log-prob of step k under the sampling kernel; NaN outside the SDE window",
        ),
        ArraySpec("stds", ("B", "T"), "float32", True, "the kernel's std at step k"),
        ArraySpec(
            "ode_final",
            ("B", "C", "H", "W"),
            "latent",
            True,
            "the ODE sample (every step `ode`, same grid) from the trajectory's x_0: the clean "
            "latent of R_0, the same for every member of a group sharing x_0; absent where the run "
            "sampled no ODE reference (`sampler.ode_reference: false`)",
            optional=True,
        ),
        ArraySpec(
            "velocities",
            ("B", "T", "C", "H", "W"),
            "latent",
            True,
            "the velocity step k was sampled with, at x_k (CFG applied): x_k - sigmas[k] v_k is the "
            "rollout's own clean-latent prediction (completion `rollout`, 0 NFEs)",
            optional=True,
        ),
        ArraySpec(
            "velocity_rows",
            ("B", "T"),
            "int64",
            True,
            "stored by node (`BY_NODE`): the trajectory whose `velocities` chunk holds velocity k of this one",
            optional=True,
        ),
        ArraySpec("sigmas", ("T+1",), "float32", False, "the grid, sigmas[0] = 1 > ... > sigmas[T] = 0"),
        ArraySpec("seeds", ("B",), "int64", False, "the seed of each trajectory"),
        ArraySpec("prompt_ids", ("B",), "int64", False, "row of the prompts table"),
        ArraySpec("group_ids", ("B",), "int64", False, "GRPO group of each trajectory"),
    ),
    # kernel: registry name; kernel_params: its options (JSON); dims and dtypes are added by the writer
    required_attrs=("kernel", "kernel_params"),
)

COMPLETION = StoreSpec(
    kind="completion",
    arrays=(
        ArraySpec(
            "latents",
            ("B", "T+1", "C", "H", "W"),
            "latent",
            True,
            "ODE completion of every stored state (completion of x_T is x_T)",
        ),
    ),
    # method: completion registry name; nfe: transformer rows evaluated to produce the store
    required_attrs=("method", "nfe"),
)

IMAGES = StoreSpec(
    kind="images",
    arrays=(
        ArraySpec(
            "images",
            ("B", "K", "RGB", "Y", "X"),
            "uint8",
            True,
            "decoded RGB images of the scored states, as rewards see them",
        ),
        ArraySpec("k", ("K",), "int64", False, "state index (0..T) of each image along K"),
    ),
    # source: the stage the latents came from ("rollout" or "completions/<method>"); source_digest: its digest
    required_attrs=("source", "source_digest"),
    dims=("B", "K", "RGB", "Y", "X"),
)

# Attrs every latent stage store carries (written by storage, not by callers).
DIM_ATTRS = ROLLOUT.dims

PROMPTS_SCHEMA = pa.schema(
    [
        pa.field("prompt_id", pa.int64(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("split", pa.string(), nullable=False),  # e.g. "train", "test"
        pa.field("metadata", pa.string(), nullable=False),  # JSON object (structured prompt facts)
    ]
)

REWARDS_SCHEMA = pa.schema(
    [
        pa.field("iteration", pa.int64(), nullable=False),
        pa.field("traj", pa.int64(), nullable=False),  # trajectory index b in [0, B)
        pa.field("k", pa.int64(), nullable=False),  # state index in [0, T]
        pa.field("reward_name", pa.string(), nullable=False),
        pa.field("reward_version", pa.string(), nullable=False),
        pa.field("value", pa.float64(), nullable=False),  # finite: NaN/inf are refused on append
        pa.field("strict", pa.float64(), nullable=True),  # null where the reward has no strict score
        pa.field("sub", pa.map_(pa.string(), pa.float64()), nullable=False),  # sub-scores, may be empty
    ]
)
REWARDS_KEY = ("iteration", "traj", "k", "reward_name", "reward_version")

ADVANTAGES_SCHEMA = pa.schema(
    [
        pa.field("iteration", pa.int64(), nullable=False),
        pa.field("traj", pa.int64(), nullable=False),  # trajectory index b in [0, B)
        pa.field("k", pa.int64(), nullable=False),  # step index in [0, T)
        pa.field("scheme", pa.string(), nullable=False),
        pa.field("options_digest", pa.string(), nullable=False),  # storage.digests.options_digest
        pa.field("value", pa.float64(), nullable=False),  # NaN = no credit at this step; inf refused
    ]
)
ADVANTAGES_KEY = ("iteration", "traj", "k", "scheme", "options_digest")


def axis_sizes(B: int, T: int, C: int, H: int, W: int) -> dict[str, int]:
    """Sizes of the legend's axes for one latent stage."""
    return {"B": B, "T": T, "T+1": T + 1, "C": C, "H": H, "W": W}


# Bounds on a stored dim, checked before anything is allocated or iterated (a damaged or hostile
# store's metadata must not make a reader allocate terabytes or loop 10^12 times): far above any
# real run, and a run's own config bounds B and T tighter (`stepgrpo.storage.run.Run.dim_limits`).
MAX_DIM = 2**20
MAX_CHUNK_ELEMENTS = 2**28  # one trajectory's chunk: 1 GiB of float32


def store_sizes(
    spec: StoreSpec, attrs: Mapping[str, object], limits: Mapping[str, int] | None = None
) -> dict[str, int]:
    """Axis sizes of a store of `spec` from its dim attrs (plus `T+1` where `T` is a dim), each a
    positive int within `limits` (and `MAX_DIM`); a ValueError naming the dim otherwise."""
    sizes = {}
    for d in spec.dims:
        value, bound = attrs.get(d), min(MAX_DIM, (limits or {}).get(d, MAX_DIM))
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= bound:
            raise ValueError(f"{spec.kind} store: dim {d} = {value!r} is not an int in [1, {bound}]")
        sizes[d] = value
    if "T" in sizes:
        sizes["T+1"] = sizes["T"] + 1
    chunk = max((math.prod(sizes[a] for a in arr.axes[1:]) for arr in spec.arrays if arr.per_trajectory), default=0)
    if chunk > MAX_CHUNK_ELEMENTS:
        raise ValueError(f"{spec.kind} store: a trajectory's chunk of {chunk} elements exceeds {MAX_CHUNK_ELEMENTS}")
    return sizes


def array_shape(spec: ArraySpec, sizes: dict[str, int]) -> tuple[int, ...]:
    """Shape of `spec` for the given axis sizes."""
    return tuple(sizes[a] for a in spec.axes)


def chunk_shape(spec: ArraySpec, shape: tuple[int, ...]) -> tuple[int, ...]:
    """One trajectory per chunk along B for per-trajectory arrays; one chunk otherwise."""
    if spec.per_trajectory:
        return (1, *shape[1:])
    return shape


def storage_dtype(spec: ArraySpec, latent_dtype: str) -> str:
    """The NumPy dtype name `spec` is stored with (`latent_dtype` is already a storage dtype;
    bfloat16 latents are stored as their bits, `BF16_BITS`)."""
    if spec.dtype != "latent":
        return spec.dtype
    return BF16_BITS if latent_dtype == "bfloat16" else latent_dtype


def latent_storage_dtype(dtype: str) -> str:
    """Storage dtype for a compute dtype name ("float16", "float32", "bfloat16")."""
    try:
        return LATENT_STORAGE_DTYPES[dtype]
    except KeyError:
        allowed = ", ".join(LATENT_STORAGE_DTYPES)
        raise ValueError(f"latent dtype {dtype!r} is not storable; use one of: {allowed}") from None


NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # run ids, method names, tensor groups: one path component


def check_name(name: str, what: str) -> str:
    """`name` if it is one safe path component, else a ValueError naming the rule."""
    if not NAME_RE.match(name):
        raise ValueError(f"{what} {name!r} must match {NAME_RE.pattern} (letters, digits, _ . -)")
    return name


def completion_stage(method: object | None) -> str:
    """The stage holding the clean latents of completion `method` (a config's text, or its parsed
    value: `substeps:5` is stored as `completions/substeps-5`); the rollout itself (its `x_T`) when
    there is none. The one name of that stage: what `score` reads, `inspect` lists, retention prunes."""
    return "rollout" if method is None else f"completions/{str(method).replace(':', '-')}"
