"""vLLM 0.33.0's own model files, loaded as they are by `check-model --model-file`'s loader
(`entrypoints/check_model/vllm_file.py`: the import root renamed as the README's porting rule
says, relative imports finding minivllm's models package or the vLLM sibling file).

The files come from the vLLM 0.33.0 source distribution on PyPI (code only, no weights),
fetched once into `$MINIVLLM_CACHE_DIR/vllm-0.33.0` (default `~/.cache/minivllm`) and checked
against PyPI's sha256; `$MINIVLLM_VLLM_SOURCE` may name an unpacked source tree instead.
"""

import hashlib
import io
import json
import os
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

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
        try:
            _download_models(dest)
        except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
            # No route to PyPI here (the files are code from its index, nothing local has them).
            pytest.skip(f"vLLM {VERSION}'s source distribution could not be fetched from PyPI "
                        f"({err}); set MINIVLLM_VLLM_SOURCE to an unpacked vLLM {VERSION} tree")
    return dest


def load_vllm_class(name: str, class_name: str) -> type:
    """The class `class_name` of vLLM's `<name>.py`, loaded the way `minivllm check-model
    --model-file` loads a file (written for vLLM: ported as it loads)."""
    return load_model_file(f"{vllm_models_dir() / name}.py:{class_name}")
