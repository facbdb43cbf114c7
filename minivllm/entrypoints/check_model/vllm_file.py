"""A model file written for vLLM, loaded as it is: its `vllm` imports become `minivllm` ones.

The README's porting rule (rename the import root) applied in memory, so `--model-file` can
point straight at a file of a vLLM checkout. The file loads inside minivllm's models package
(`build.load_model_file`), so its package-relative imports (`from .utils import ...`) find
minivllm's modules; a relative import of a module minivllm does not have (vLLM's
granitemoeshared.py builds on `.granitemoe`) loads that sibling file from the same folder,
ported the same way.
"""

import importlib
import importlib.util
import re
from collections.abc import Callable

# `from vllm.x import`, `from vllm import`, `import vllm.envs as envs`
_IMPORTS_VLLM = re.compile(r"^\s*(?:from|import)\s+vllm(?:\.|\s)", re.M)
# The root as a name, not as an attribute (`torch.ops.vllm` stays) nor inside a word.
_ROOT = re.compile(r"(?<![\w.])vllm(?=[.\s])")
# `from .x import names` or `from vllm.model_executor.models.x import names` (root renamed).
_MODEL_IMPORT = re.compile(
    r"^(\s*)from (?:\.|minivllm\.model_executor\.models\.)(\w+)((?:\.\w+)*) import "
    r"(\([^)]*\)|[^\n]*)", re.M)
_MODELS_PACKAGE = "minivllm.model_executor.models"
# The contract's own modules: a name minivllm's version lacks is a gap to report, never one to
# fill from vLLM's copy (whose protocol classes minivllm's registry would not recognise).
_CONTRACT_MODULES = ("utils", "interfaces", "interfaces_base", "adapters", "registry")


def imports_vllm(source: str) -> bool:
    return _IMPORTS_VLLM.search(source) is not None


def port_vllm_source(source: str, load_sibling: Callable[[str], str | None]) -> str:
    """The file's text with the import root renamed. An import from a models module that
    minivllm lacks, or whose minivllm version lacks one of the imported names (vLLM's
    glm4_moe_lite.py takes vLLM's own DeepSeek classes), takes the vLLM sibling file instead:
    `load_sibling(name)` loads `<name>.py` and returns its module name (None: there is no such
    file, and the import fails naming what is missing)."""
    source = _ROOT.sub("minivllm", source)

    def rewrite(match: re.Match) -> str:
        indent, name, rest, names = match.groups()
        if name in _CONTRACT_MODULES or _minivllm_has(f"{_MODELS_PACKAGE}.{name}{rest}", names):
            return match.group(0)
        sibling = load_sibling(name)
        if sibling is None:
            return match.group(0)
        return f"{indent}from {sibling}{rest} import {names}"
    return _MODEL_IMPORT.sub(rewrite, source)


def _minivllm_has(module_name: str, names: str) -> bool:
    """Whether minivllm's module exists and defines every name of the import list."""
    try:
        if importlib.util.find_spec(module_name) is None:
            return False
    except ModuleNotFoundError:
        return False
    wanted = [part.split(" as ")[0].strip() for part in names.strip("()").split(",")]
    wanted = [w for w in (line.split("#")[0].strip() for line in wanted) if w]
    module = importlib.import_module(module_name)
    return all(hasattr(module, w) for w in wanted)
