"""The papers' evaluation protocols at SD3.5-Medium's shape: images per second under each one's
generation settings (docs/PAPERS.md; the protocols are `stepgrpo/prompts/protocols.py`).

    python -m bench.protocols.gpu_protocols [--out bench/out/gpu_protocols]   # on a CUDA machine (~3 min, one H100)
    python -m bench.protocols.gpu_protocols --small --device cpu              # every code path at toy sizes, on a CPU

For each protocol (the shapes one aside: it is the shipped model's), random weights of SD3.5-M's
transformer shape (`bench/gpu/gpu_train.py`, no download) sample `--pairs` (prompt, sample) pairs
by the protocol's seeds rule at its steps, size and guidance, in batches of `--batch` pairs, and
decode them: the wall seconds of the whole protocol's sampling follow from the images per second
and its number of pairs (GenEval 2,212, OCR 1,018, PickScore 2,048, DrawBench 1,000). The scorers
are not timed (their weights are downloads). Each batch's images are sampled twice from the same
seeds, and the report says whether the two are byte-identical on this device (what
`device_dependent` in a protocol's report is about). Output: `results.json` and `report.txt` in
`--out`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench._lib.gpu import device_name, gpu_arguments, prepare, write_report

PAIRS = {"geneval": 2212, "ocr": 1018, "pickscore": 2048, "drawbench": 1000}


def main() -> None:
    p = gpu_arguments(__doc__.split("\n\n")[0], "gpu_protocols")
    p.add_argument("--pairs", type=int, default=16, help="(prompt, sample) pairs timed a protocol")
    p.add_argument("--batch", type=int, default=8, help="pairs a model call")
    args = p.parse_args()
    import torch

    from stepgrpo.policy.sd3 import SD3Policy
    from stepgrpo.prompts.protocols import PROTOCOLS, protocol, sample_seed
    from stepgrpo_core.rollout import rollout

    results: dict[str, Any] = {"device": device_name(args.device)}
    sets = prepare(args, reward=False)
    model, dtype = Path(sets["model.path"]), sets["model.dtype"]
    texts = [f"a photo of a {c} {t}" for t in ("cat", "dog", "car", "tree") for c in ("red", "blue", "green", "black")]
    lines = [f"device: {results['device']}; {args.pairs} pairs a protocol, {args.batch} a call", ""]
    for name in PROTOCOLS.names():
        proto = protocol(name)
        if name == "shapes":
            continue
        steps = 4 if args.small else proto.steps
        resolution = None if args.small else proto.resolution
        pol = SD3Policy.from_pretrained(
            model, dtype, args.device, guidance_scale=proto.guidance, max_batch=2 * args.batch, resolution=resolution,
            negative_prompt=proto.negative_prompt,
        )  # fmt: skip
        sigmas = pol.sigmas(steps)
        pairs = [(texts[i % len(texts)], i // len(texts)) for i in range(args.pairs)]

        def sample(chunk: list[tuple[str, int]]) -> torch.Tensor:
            x0 = torch.cat(
                [pol.initial_noise(1, torch.Generator(pol.device).manual_seed(sample_seed(t, j))) for t, j in chunk]
            )
            out = rollout(pol.velocity, x0, sigmas, pol.encode([t for t, _ in chunk]), kernel="ode")
            return pol.decoder.decode_uint8(out.states[:, -1])

        sample(pairs[: args.batch])  # warm-up (kernels, allocator)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        identical = True
        for c0 in range(0, len(pairs), args.batch):
            chunk = pairs[c0 : c0 + args.batch]
            a = sample(chunk)
            if c0 == 0:
                identical = bool(torch.equal(a, sample(chunk)))
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        rate = len(pairs) / seconds  # the repeat of the first batch is inside the time: a lower bound
        results[name] = {"images_per_second": rate, "steps": steps, "resolution": resolution, "cfg": proto.guidance,
                         "same_bytes_twice": identical, "protocol_minutes": PAIRS[name] / rate / 60}  # fmt: skip
        lines.append(
            f"{name}: {rate:.2f} images/s ({steps} steps, {resolution or 'model'} px, CFG {proto.guidance:g}); "
            f"the whole protocol's {PAIRS[name]} images ~{PAIRS[name] / rate / 60:.1f} min; "
            f"same seeds, same bytes: {'yes' if identical else 'no'}"
        )
    write_report(args.out, results, lines)


if __name__ == "__main__":
    main()
