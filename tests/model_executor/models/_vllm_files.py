"""vLLM 0.33.0's own model files, ported the way the README tells a user to: the import root
renamed (`vllm.` -> `minivllm.`), the files' relative imports of their package pointed at
minivllm's `model_executor.models` (as if the file were dropped there).

The files come from the vLLM 0.33.0 source distribution on PyPI (code only, no weights),
fetched once into `$MINIVLLM_CACHE_DIR/vllm-0.33.0` (default `~/.cache/minivllm`) and checked
against PyPI's sha256; `$MINIVLLM_VLLM_SOURCE` may name an unpacked source tree instead.
"""

import hashlib
import importlib.util
import io
import json
import os
import re
import sys
import tarfile
import urllib.request
from pathlib import Path

from minivllm.entrypoints.check_model.build import load_model_file

VERSION = "0.33.0"
_MODELS = "vllm/model_executor/models"
_PYPI_JSON = "https://pypi.org/pypi/vllm/json"


def _cache_dir() -> Path:
    root = Path(os.environ.get("MINIVLLM_CACHE_DIR", Path.home() / ".cache" / "minivllm"))
    return root / f"vllm-{VERSION}"


def _download_models(dest: Path) -> None:
    """The sdist's `vllm/model_executor/models/*.py` into `dest` (written whole, then renamed)."""
    with urllib.request.urlopen(_PYPI_JSON, timeout=60) as resp:
        files = json.load(resp)["releases"][VERSION]
    sdist = next(f for f in files if f["packagetype"] == "sdist")
    url = sdist["url"]
    if not url.startswith("https://"):          # a mirror answering with relative links
        url = "https://files.pythonhosted.org/packages/" + url.rsplit("packages/", 1)[1]
    with urllib.request.urlopen(url, timeout=300) as resp:
        blob = resp.read()
    digest = hashlib.sha256(blob).hexdigest()
    if digest != sdist["digests"]["sha256"]:
        raise RuntimeError(f"vllm-{VERSION} sdist: sha256 {digest} is not PyPI's")
    tmp = dest.with_name(dest.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        for member in tar.getmembers():
            parts = member.name.split("/", 1)
            if (len(parts) == 2 and parts[1].startswith(_MODELS + "/")
                    and member.name.endswith(".py") and member.isfile()):
                target = tmp / parts[1][len(_MODELS) + 1:]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())
    tmp.rename(dest)


def vllm_models_dir() -> Path:
    """The folder holding vLLM 0.33.0's `model_executor/models/*.py`."""
    source = os.environ.get("MINIVLLM_VLLM_SOURCE")
    if source:
        path = Path(source)
        return path / _MODELS if (path / _MODELS).is_dir() else path
    dest = _cache_dir()
    if not dest.is_dir():
        _download_models(dest)
    return dest


def port_source(text: str, sibling_prefix: str = "vllm033_") -> tuple[str, set[str]]:
    """vLLM file text -> minivllm: the root renamed, package-relative imports made absolute.

    `from .X import` points at minivllm's `model_executor.models.X`; where minivllm has no such
    module, at the ported vLLM sibling `<sibling_prefix>X` instead (a user porting vLLM's
    granitemoeshared.py ports the granitemoe.py it builds on too). Returns the text and the
    siblings it needs."""
    text = re.sub(r"\bvllm\b(?=[.\s])", "minivllm", text)
    needed: set[str] = set()

    def relative(match: re.Match) -> str:
        indent, name = match.group(1), match.group(2)
        top = name.split(".")[0]
        if importlib.util.find_spec(f"minivllm.model_executor.models.{top}") is None:
            needed.add(top)
            return f"{indent}from {sibling_prefix}{name} "
        return f"{indent}from minivllm.model_executor.models.{name} "
    text = re.sub(r"^(\s*)from \.(\w+(?:\.\w+)*) ", relative, text, flags=re.M)
    text = re.sub(r"^(\s*)from \. import", r"\1from minivllm.model_executor.models import", text,
                  flags=re.M)
    return text, needed


def _write_ported(name: str, workdir: Path) -> Path:
    """`workdir/vllm033_<name>.py`, and the vLLM siblings it imports, ported once."""
    path = workdir / f"vllm033_{name}.py"
    if not path.exists():
        text, siblings = port_source((vllm_models_dir() / f"{name}.py").read_text())
        for sibling in siblings:
            _write_ported(sibling, workdir)
        path.write_text(text)
    return path


def load_ported_class(name: str, class_name: str, workdir: Path) -> type:
    """vLLM's `<name>.py`, ported and written to `workdir/vllm033_<name>.py`, then imported the
    way `minivllm check-model --model-file` imports a file: its class `class_name`. Ported
    siblings are imported by name, so `workdir` joins `sys.path`."""
    path = _write_ported(name, workdir)
    if str(workdir) not in sys.path:
        sys.path.append(str(workdir))
    return load_model_file(f"{path}:{class_name}")
