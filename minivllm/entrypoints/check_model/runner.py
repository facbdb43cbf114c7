"""run_checks: build the model the loader's way and run every section in order."""

from dataclasses import dataclass

import torch.nn as nn

from minivllm.model_executor.model_loader.default_loader import initialize_dummy_weights
from minivllm.model_executor.model_loader.utils import process_weights_after_loading

from .build import build_model, make_target
from .contract import check_constructor, contract_section, prefixes_section
from .numerics import numerics_section
from .parallel import parallel_section
from .quant import quantization_section
from .report import SECTION_ORDER, Report
from .weights import load_and_check


@dataclass
class CheckOptions:
    model: str
    model_file: str | None = None
    arch: str | None = None
    load_format: str = "auto"
    quantization: str | None = None
    hf: bool = False                 # run the numerics section against transformers
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    prompt: str | None = None
    max_tokens: int = 8
    seed: int = 0


def run_checks(opts: CheckOptions) -> Report:
    """Every section's findings; a section that cannot run says why (status "skip")."""
    target = make_target(opts.model, model_file=opts.model_file, arch=opts.arch,
                         load_format=opts.load_format, quantization=opts.quantization,
                         seed=opts.seed)
    report = Report(opts.model, target.architecture, target.class_ref)
    contract = report.section("contract")
    model = None
    if check_constructor(contract, target.model_class):
        try:
            model, recorder = build_model(target)
        except Exception as err:     # the report names it; every later section needs a model
            contract.error("build", f"building {target.model_class.__name__} failed: "
                           f"{type(err).__name__}: {err}")
    if model is None:
        for name in SECTION_ORDER[1:]:
            report.section(name).skip("the model could not be built (see contract)")
        return report
    contract_section(contract, target.model_class, model)
    prefixes_section(report.section("prefixes"), model, recorder.duplicates)
    _weights(report, target, model)
    quantization_section(report.section("quantization"), model, target.vllm_config.quant_config)
    parallel_section(report.section("parallel"), target, opts.tensor_parallel_size,
                     opts.pipeline_parallel_size, model=model)
    numerics = report.section("numerics")
    if not opts.hf:
        numerics.skip("pass --hf to compare every layer with transformers")
    elif report.sections["weights"].status == "fail":
        numerics.skip("the weights do not load (see weights)")
    else:
        numerics_section(numerics, target, prompt=opts.prompt, max_tokens=opts.max_tokens)
    return report


def _weights(report: Report, target, model: nn.Module) -> None:
    section = report.section("weights")
    model_config = target.vllm_config.model_config
    if target.vllm_config.load_config.load_format == "dummy":
        initialize_dummy_weights(model, seed=model_config.seed)
        section.skip("--load-format dummy: deterministic random weights "
                     f"(seed {model_config.seed}), no checkpoint to compare")
    else:
        load_and_check(section, target, model)
    try:
        process_weights_after_loading(model, model_config, "cpu")
    except Exception as err:
        section.error("process_weights", "process_weights_after_loading failed: "
                      f"{type(err).__name__}: {err}")
