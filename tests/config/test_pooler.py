"""PoolerConfig parsing and its resolution order: the user's, sentence-transformers files, the
model's default."""

import json
import os
from types import SimpleNamespace

import pytest

from minivllm.config.pooler import PoolerConfig, resolve_pooler_config, sentence_transformers_pooling


def _write_st(folder: str, flags: dict, normalize: bool) -> None:
    modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(folder, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(folder, "1_Pooling"))
    with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as f:
        json.dump(flags, f)


def test_parse_json_and_errors():
    config = PoolerConfig.parse('{"pooling_type": "mean", "normalize": false}')
    assert (config.seq_pooling_type, config.effective_pooling_type, config.normalize) == ("MEAN", "MEAN", False)
    assert PoolerConfig.parse({"pooling_type": "ALL"}).tok_pooling_type == "ALL"
    with pytest.raises(ValueError, match="valid keys: pooling_type"):
        PoolerConfig.parse({"pool": "MEAN"})
    with pytest.raises(ValueError, match="not valid JSON"):
        PoolerConfig.parse("{pooling_type: MEAN}")
    with pytest.raises(ValueError, match="choose one of LAST, MEAN, CLS"):
        PoolerConfig(seq_pooling_type="ALL")


def test_resolution_order(tmp_path):
    hf = SimpleNamespace()
    assert sentence_transformers_pooling(str(tmp_path)) is None
    default = resolve_pooler_config(None, str(tmp_path), hf)
    assert (default.effective_pooling_type, default.normalize) == ("LAST", True)
    assert resolve_pooler_config(None, "", SimpleNamespace(pooling="avg")).effective_pooling_type == "MEAN"
    _write_st(str(tmp_path), {"pooling_mode_cls_token": True}, normalize=False)
    from_files = resolve_pooler_config(None, str(tmp_path), hf)
    assert (from_files.effective_pooling_type, from_files.normalize) == ("CLS", False)
    user = resolve_pooler_config('{"pooling_type": "MEAN"}', str(tmp_path), hf)
    assert (user.effective_pooling_type, user.normalize) == ("MEAN", False)   # files fill the rest
