"""`minivllm check-model`: contract, prefixes, weights, quantization, parallel and numerics
checks of a model file, with a report per section (text or stable JSON, see `report.py`)."""

from .report import SCHEMA_VERSION, Finding, Report, Section
from .runner import CheckOptions, run_checks

__all__ = ["SCHEMA_VERSION", "CheckOptions", "Finding", "Report", "Section", "run_checks"]
