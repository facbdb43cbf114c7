"""A model file written for vLLM, loaded as it is: its `vllm` imports become `minivllm` ones.

The README's porting rule (rename the import root) applied in memory, so `--model-file` can
point straight at a file of a vLLM checkout. The file loads inside minivllm's models package
(`build.load_model_file`), so its package-relative imports (`from .utils import ...`) find
minivllm's modules; a relative import of a module minivllm does not have (vLLM's
granitemoeshared.py builds on `.granitemoe`) loads that sibling file from the same folder,
ported the same way.
"""

import importlib.util
import re
from collections.abc import Callable

# `from vllm.x import`, `from vllm import`, `import vllm.envs as envs`
_IMPORTS_VLLM = re.compile(r"^\s*(?:from|import)\s+vllm(?:\.|\s)", re.M)
# The root as a name, not as an attribute (`torch.ops.vllm` stays) nor inside a word.
_ROOT = re.compile(r"(?<![\w.])vllm(?=[.\s])")
_RELATIVE = re.compile(r"^(\s*)from \.(\w+)((?:\.\w+)*) import", re.M)
_MODELS_PACKAGE = "minivllm.model_executor.models"


def imports_vllm(source: str) -> bool:
    return _IMPORTS_VLLM.search(source) is not None


def port_vllm_source(source: str, load_sibling: Callable[[str], str | None]) -> str:
    """The file's text with the import root renamed. `load_sibling(name)` loads the sibling
    `<name>.py` minivllm lacks and returns its module name (None: there is no such file, and the
    import fails naming the missing module)."""
    source = _ROOT.sub("minivllm", source)

    def relative(match: re.Match) -> str:
        indent, name, rest = match.groups()
        if importlib.util.find_spec(f"{_MODELS_PACKAGE}.{name}") is not None:
            return match.group(0)
        sibling = load_sibling(name)
        return match.group(0) if sibling is None else f"{indent}from {sibling}{rest} import"
    return _RELATIVE.sub(relative, source)
