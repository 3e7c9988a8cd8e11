"""ODE completion of every stored state: the clean latents whose rewards are the step rewards `R_k`.

METHODS.md, "Step rewards from ODE completion". For each trajectory and each state `x_k`
(`k = 0..T`) a completion method produces a clean latent; `R_k` is its reward. The completion of
`x_T` is `x_T` itself (0 NFEs): it is the sample. Methods (`method` strings):

- `remaining` (DenseGRPO with n = t, TP-GRPO): Euler on the rest of the same grid,
  `T - k` NFEs for `x_k`, `T (T + 1) / 2` per trajectory.
- `substeps:N` (Stepwise-Flow-GRPO with N = 5, DenseGRPO with N = 1, 2): `N` Euler steps on a fresh
  grid from `sigmas[k]` to 0, `N` NFEs per non-final state, `N T` per trajectory. *Choice*: the
  fresh grid is uniform in sigma (`sigmas[k] (1 - i / N)`); no source fixes its spacing.
- `tweedie` (Stepwise-Flow-GRPO's one-step estimate): `x0_hat = x_k - sigmas[k] v`, 1 NFE each.
- `rollout`: the same estimate with the velocity the rollout took step `k` with
  (`Rollout.velocities`, stored beside the states): 0 NFEs. It is the sampling policy's own
  prediction, CFG included when the rollout used it, and it equals `tweedie` of the same policy
  up to float rounding. Where no velocities are stored (a rollout made before they were kept),
  it recomputes them: `tweedie`'s cost.

Batching: one call completes every state of every trajectory. Rows of all trajectories that sit
at the same noise level are stacked and sent through `velocity` together, in chunks of at most
`max_batch` rows. For `remaining` this is how work is shared: at grid level `j` every state
`x_k` with `k <= j` has been carried down to `sigmas[j]` and all of them (`B (j + 1)` rows) take
their step `j -> j + 1` in the same calls. The arithmetic is exactly the per-state Euler runs;
sharing only fills the batches, so the count is exactly `T (T + 1) / 2` NFEs per trajectory and
never more. (`remaining` does not reuse the rollout's velocity at `x_k`, which would save `T` more per
trajectory: a stored velocity is in the latent dtype, and `remaining` keeps the full precision of
its first step; `rollout` is the method that reuses it.)

States that evolve deterministically (`through`): with an SDE window `[start, end)` every step
from `end` on is `ode`, so the ODE completion of `x_k`, `k >= end`, on the rollout's own grid is
the sample `x_T` itself. `complete(..., through=end)` completes only `x_0 .. x_{end-1}` and copies
`x_T` into the rest: `remaining` then costs `sum_{k < end} (T - k)` NFEs per trajectory,
`substeps:N` costs `N end`, `tweedie` `end` (the minimum for the window). For `remaining` the
copies are exactly what recomputing would give. For a method that is not the rollout's own ODE
(`substeps`, `tweedie`: fact `exact_tail` False), the window's last state `x_end` is completed with
the method too (`completed_through`): the last trained gain `R_end - R_{end-1}` then compares two
completions by the same method (Stepwise-Flow-GRPO completes every state alike), and the switch to
the trajectory's own ODE lands on the untrained step after the window.

NFE = velocity rows evaluated. Shapes: `states [B, T+1, C, H, W]` -> latents `[B, T+1, C, H, W]`
in the dtype of `states`; the Euler steps use `kernels.step_moments("ode", ...)` in fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from .conditioning import row_digests, take, tensor_bytes
from .kernels import step_moments
from .registry import Registry
from .rollout import Velocity, check_sigmas


class Completion(NamedTuple):
    latents: torch.Tensor  # [B, T+1, C, H, W] completed clean latent of every state x_k (x_T as is)
    nfe: int  # velocity rows evaluated by this call


# A completion: (velocity, states, sigmas fp32, cond, max_batch, arg, through) -> Completion, where
# `arg` is the text after ':' in the method name (None when absent) and only states k < through
# are completed (the caller copies x_T into the rest).
CompletionFn = Callable[[Velocity, torch.Tensor, torch.Tensor, Any, int, "str | None", int], Completion]
# Fact `exact_tail`: completing a state after the SDE window gives the sample x_T itself (the method
# runs the rollout's own ODE on its own grid), so those states are copied, not completed.
# Fact `argument`: checks the text after ':' (None when absent), raising ValueError in the method's words.
# Fact `rollout_velocity`: given the rollout's stored velocities, the method needs no model call
# (`from_velocities`); the registered function recomputes what was not stored.
COMPLETIONS: Registry[CompletionFn] = Registry("completion", exact_tail=False, argument=None, rollout_velocity=False)


class Method(NamedTuple):
    """A completion method as a config names it (`"substeps:5"`), parsed once: the registered name
    and the text after ':' (None when absent). `str(method)` gives the config's text back."""

    name: str
    arg: str | None = None

    @classmethod
    def parse(cls, method: str | Method) -> Method:
        """`"substeps:5"` -> `Method("substeps", "5")`; validates the name and its argument."""
        if isinstance(method, Method):
            return method
        if not isinstance(method, str):
            raise TypeError(
                f"completion method must be a string such as 'remaining', 'substeps:5' or 'tweedie'; got {method!r}"
            )
        name, sep, arg = method.partition(":")
        COMPLETIONS.validate(name)
        parsed = cls(name, arg if sep else None)
        check_argument(*parsed)
        return parsed

    @property
    def facts(self) -> Mapping[str, Any]:
        """What the method's registry entry declares (`exact_tail`, `rollout_velocity`, ...)."""
        return COMPLETIONS.facts(self.name)

    def __str__(self) -> str:
        return self.name if self.arg is None else f"{self.name}:{self.arg}"


def parse_method(method: str | Method) -> Method:
    """`Method.parse`: `"substeps:5"` -> `("substeps", "5")`, validated."""
    return Method.parse(method)


def completed_through(method: str | Method, window_end: int, num_steps: int) -> int:
    """How many states `x_0 .. x_{n-1}` a completion by `method` computes for a rollout whose SDE
    window ends at step `window_end` (module doc): `window_end` for an `exact_tail` method, else
    one more (the window's last state), at most `T`."""
    return window_end if Method.parse(method).facts["exact_tail"] else min(window_end + 1, num_steps)


def validate_method(method: str) -> str:
    """Return `method` if it names a completion with a valid argument (for config validation)."""
    Method.parse(method)
    return method


def check_argument(name: str, arg: str | None) -> Any:
    """The completion's `argument` fact applied to `arg` (its parsed value); a method without one
    takes no argument."""
    check = COMPLETIONS.facts(name)["argument"]
    if check is not None:
        return check(arg)
    if arg is not None:
        raise ValueError(f"completion {name!r} takes no ':' argument; use plain {name!r}")
    return None


def _substeps_n(arg: str | None) -> int:
    if arg is None or not arg.isdigit() or int(arg) < 1:
        raise ValueError(f"completion 'substeps' needs a positive step count, e.g. 'substeps:5'; got {arg!r}")
    return int(arg)


def batched_velocity(
    velocity: Velocity, x: torch.Tensor, sigma: torch.Tensor, cond: Any, rows: torch.Tensor, max_batch: int
) -> torch.Tensor:
    """`velocity` on `N` rows in chunks of at most `max_batch`.

    `x [N, C, H, W]`, `sigma [N]`, `rows [N]` (LongTensor: the trajectory of each row, which
    selects its conditioning). Returns `v [N, C, H, W]`; it evaluates exactly `N` rows.
    """
    out = []
    for lo in range(0, x.shape[0], max_batch):
        hi = lo + max_batch
        out.append(velocity(x[lo:hi], sigma[lo:hi], take(cond, rows[lo:hi])))
    return torch.cat(out, dim=0)


def _nonfinal_rows(states: torch.Tensor, sigmas: torch.Tensor, through: int):
    """Flatten the states `x_0..x_{through-1}` of all trajectories to rows (b-major).

    Returns `z [B*through, C, H, W]`, `rows [B*through]` (trajectory of each row), `sigma` (its level).
    """
    batch = states.shape[0]
    z = states[:, :through].reshape(-1, *states.shape[2:])
    rows = torch.arange(batch, device=states.device).repeat_interleave(through)
    return z, rows, sigmas[:through].repeat(batch)


@COMPLETIONS.register("remaining", exact_tail=True, paper='arXiv 2601.20218, "dense reward" (ODE denoising, n = t)')
def remaining(velocity, states, sigmas, cond, max_batch, arg, through) -> Completion:
    """Euler on the rest of the grid, all states at the same grid level in one batch (module doc).
    DenseGRPO's completion (arXiv 2601.20218: the reward of the clean image an intermediate state
    reaches by ODE denoising, `n = t` steps); TP-GRPO's (arXiv 2602.06422) likewise."""
    check_argument("remaining", arg)
    batch, num_states = states.shape[:2]
    num_steps = num_states - 1
    latents = states.clone()  # x_T stays as is; row (b, k) is overwritten as state k runs down
    nfe = 0
    for j in range(num_steps):
        # Running states at level j: k = 0..min(j, through - 1) of every trajectory, k-major rows.
        n = min(j + 1, through)
        if n == 0:
            break
        z = latents[:, :n].transpose(0, 1).reshape(-1, *states.shape[2:])
        rows = torch.arange(batch, device=states.device).repeat(n)
        sigma = sigmas[j].repeat(z.shape[0])
        v = batched_velocity(velocity, z, sigma, cond, rows, max_batch)
        mean, _ = step_moments("ode", z, v, sigmas[j], sigmas[j + 1])
        latents[:, :n] = mean.to(states.dtype).reshape(n, batch, *states.shape[2:]).transpose(0, 1)
        nfe += z.shape[0]
    return Completion(latents, nfe)


@COMPLETIONS.register(
    "substeps", argument=_substeps_n, pattern="substeps:N", paper='arXiv 2601.20218, "dense reward" (its ablation of n)'
)
def substeps(velocity, states, sigmas, cond, max_batch, arg, through) -> Completion:
    """`N` uniform Euler steps from `sigmas[k]` to 0 for every state `k < through`, all in one batch.
    DenseGRPO's ablation of the number of ODE steps (arXiv 2601.20218, `n = 1, 2, t`); the completion
    of Stepwise-Flow-GRPO's recipes here (`substeps:5`)."""
    n = _substeps_n(arg)
    batch = states.shape[0]
    latents = states.clone()
    z, rows, start = _nonfinal_rows(states, sigmas, through)  # start: sigma_k of each row
    nfe = 0
    for i in range(n):
        sigma, sigma_next = start * (1.0 - i / n), start * (1.0 - (i + 1) / n)
        v = batched_velocity(velocity, z, sigma, cond, rows, max_batch)
        z = step_moments("ode", z, v, sigma, sigma_next)[0].to(states.dtype)
        nfe += z.shape[0]
    latents[:, :through] = z.reshape(batch, through, *states.shape[2:])
    return Completion(latents, nfe)


@COMPLETIONS.register("tweedie", paper='arXiv 2603.28718, "Tweedie estimates"')
def tweedie(velocity, states, sigmas, cond, max_batch, arg, through) -> Completion:
    """One-step estimate `x0_hat = x_k - sigmas[k] v(x_k)` for every state `k < through`: Tweedie's
    formula for a rectified flow, Stepwise-Flow-GRPO's intermediate reward estimate (arXiv
    2603.28718, "Tweedie estimates"); DenseGRPO's `n = 1` ablation."""
    check_argument("tweedie", arg)
    batch = states.shape[0]
    latents = states.clone()
    z, rows, sigma = _nonfinal_rows(states, sigmas, through)
    v = batched_velocity(velocity, z, sigma, cond, rows, max_batch)
    # A single Euler step to sigma = 0 is exactly x - sigma v: reuse the ode kernel.
    x0_hat = step_moments("ode", z, v, sigma, torch.zeros_like(sigma))[0]
    latents[:, :through] = x0_hat.to(states.dtype).reshape(batch, through, *states.shape[2:])
    return Completion(latents, z.shape[0])


@COMPLETIONS.register(
    "rollout", rollout_velocity=True, paper="ours: the rollout's own x0 prediction, no NFE (docs/METHODS.md)"
)
def rollout_prediction(velocity, states, sigmas, cond, max_batch, arg, through) -> Completion:
    """The rollout's own clean-latent prediction `x_k - sigmas[k] v_k` (module doc). This function
    runs only where the rollout's velocities were not stored: it recomputes them (`tweedie`)."""
    check_argument("rollout", arg)
    return tweedie(velocity, states, sigmas, cond, max_batch, None, through)


def from_velocities(states: torch.Tensor, velocities: torch.Tensor, sigmas: torch.Tensor, through: int) -> Completion:
    """`x0_hat = x_k - sigmas[k] v_k` for every state `k < through` from stored velocities: 0 NFEs.

    `states [B, T+1, C, H, W]`, `velocities [B, T, C, H, W]` (the velocity step `k` was sampled
    with), `sigmas [T+1]` fp32. Returns latents `[B, T+1, C, H, W]` in the dtype of `states`
    (states from `through` on are left as they are; `complete` copies `x_T` there). The arithmetic
    is `tweedie`'s (one `ode` step to sigma 0, in fp32), so equal velocities give equal bytes."""
    if velocities.shape[:1] + velocities.shape[2:] != states.shape[:1] + states.shape[2:] or (
        velocities.shape[1] != states.shape[1] - 1
    ):
        raise ValueError(
            f"velocities must be [B, T, C, H, W] for states {tuple(states.shape)}; got {tuple(velocities.shape)}"
        )
    batch = states.shape[0]
    latents = states.clone()
    z, _, sigma = _nonfinal_rows(states, sigmas, through)
    v = velocities[:, :through].reshape(-1, *states.shape[2:])
    x0_hat = step_moments("ode", z, v, sigma, torch.zeros_like(sigma))[0]
    latents[:, :through] = x0_hat.to(states.dtype).reshape(batch, through, *states.shape[2:])
    return Completion(latents, 0)


@torch.no_grad()  # completions feed rewards only; no gradient flows through them
def complete(
    method: str | Method,
    velocity: Velocity,
    states: torch.Tensor,
    sigmas: torch.Tensor,
    cond: Any,
    max_batch: int,
    through: int | None = None,
    velocities: torch.Tensor | None = None,
    cond_keys: list[bytes] | None = None,
) -> Completion:
    """Complete every state of every trajectory with `method` (module doc).

    Args:
        method: `remaining`, `substeps:N`, `tweedie` or `rollout`.
        velocity: `velocity(x [N,C,H,W], sigma [N], cond) -> v`; `cond` rows are selected with
            `conditioning.take` for each batch.
        states: `[B, T+1, C, H, W]` stored states `x_0 .. x_T`.
        sigmas: `[T+1]` the grid the states were sampled on.
        cond: conditioning pytree with leading dim `B`.
        max_batch: the most rows per `velocity` call.
        through: complete only `x_0 .. x_{through-1}`; states from `through` on evolve
            deterministically (the end of the SDE window) and get `x_T`. None: `T`, every state.
        velocities: `[B, T, C, H, W]` the rollout's stored velocities; a `rollout_velocity` method
            (`rollout`) then calls no model. None: computed with `velocity`.
        cond_keys: `[B]` bytes equal exactly when two rows' conditioning is (e.g. their prompt ids),
            in place of digesting `cond` (which may then be None with stored velocities).

    Returns `Completion(latents [B, T+1, C, H, W], nfe)`.
    """
    name, arg = Method.parse(method)
    if states.dim() != 5:
        raise ValueError(f"states must be [B, T+1, C, H, W]; got {tuple(states.shape)}")
    s = check_sigmas(sigmas).to(states.device)
    if states.shape[1] != s.shape[0]:
        raise ValueError(f"states hold {states.shape[1]} states but sigmas has {s.shape[0]} levels (T + 1 each)")
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be a positive int; got {max_batch!r}")
    num_steps = s.shape[0] - 1
    through = num_steps if through is None else through
    if not isinstance(through, int) or not 0 <= through <= num_steps:
        raise ValueError(f"through must be an int in [0, T = {num_steps}]; got {through!r}")
    if velocities is not None and COMPLETIONS.facts(name)["rollout_velocity"]:
        out = from_velocities(states, velocities.to(states.device), s, through)
    else:
        out = COMPLETIONS.get(name)(velocity, states, s, cond, max_batch, arg, through)
    out.latents[:, through:] = states[:, -1:]  # deterministic from `through` on: the sample itself
    keys = cond_keys if cond_keys is not None else row_digests(cond, states.shape[0])
    tie_equal_states(states, keys, out.latents, through)
    return out


def tie_equal_states(states: torch.Tensor, conds: list[bytes], latents: torch.Tensor, through: int) -> None:
    """Give states that are bitwise equal (same `x_k` bytes, same conditioning: `conds [B]`, bytes
    equal exactly when two rows' conditioning is) the completion of the first of them, in place.
    A group's members share `x_0`, but their rows sit at other
    positions of a batched model call, and on some CPUs (AVX512, several threads) a GEMM gives a
    row other last bits at another position; equal inputs must give equal clean latents (their
    rewards and decodes are then shared exactly). `states`, `latents`: `[B, T+1, C, H, W]`."""
    import hashlib

    flat = states[:, :through].detach().cpu()
    for k in range(through):
        first: dict[bytes, int] = {}
        for b in range(states.shape[0]):
            key = hashlib.blake2b(tensor_bytes(flat[b, k]) + conds[b], digest_size=16).digest()
            a = first.setdefault(key, b)
            if a != b:
                latents[b, k] = latents[a, k]
