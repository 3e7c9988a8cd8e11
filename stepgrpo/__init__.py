"""stepgrpo: GRPO for flow-matching text-to-image models with step-level credit assignment.

The Python entry, `stepgrpo.train(...)` and the rest, is `stepgrpo.flows.api`: the functions sit
with the flows they run, below the CLI that calls them. Importing them here imports no flow (each
function imports its flow when called), so every module of stepgrpo can import `stepgrpo.<module>`
cheaply. `stepgrpo._package` runs first: the version, process settings and import names.
"""

from stepgrpo._package import VERSION as __version__
from stepgrpo.flows.api import (
    Interrupted,
    QualityCheck,
    TrainResult,
    calibrate,
    compare,
    credit,
    credit_quality,
    evaluate,
    evaluate_protocol,
    export,
    open_run,
    rescore,
    train,
)

__all__ = [
    "Interrupted",
    "QualityCheck",
    "TrainResult",
    "__version__",
    "calibrate",
    "compare",
    "credit",
    "credit_quality",
    "evaluate",
    "evaluate_protocol",
    "export",
    "open_run",
    "rescore",
    "train",
]
