"""vLLM's torch profiler: LLM.start_profile() .. stop_profile() writes one trace per rank into
VLLM_TORCH_PROFILER_DIR (TP=2 workers too), and the server's /start_profile, /stop_profile."""

import gzip
import json

import httpx
import pytest

from minivllm import LLM, SamplingParams
from tests.entrypoints.openai.test_api_server import MODEL, checkpoint, running_server  # noqa: F401

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _traces(folder) -> dict[str, dict]:
    return {p.name: json.loads(gzip.decompress(p.read_bytes()))
            for p in folder.iterdir() if p.name.endswith(".pt.trace.json.gz")}


def _ops(trace: dict) -> set[str]:
    return {e.get("name", "") for e in trace.get("traceEvents", [])}


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_traces_per_rank(checkpoint, tmp_path, monkeypatch, tp):   # noqa: F811
    llm = LLM(model=checkpoint, max_model_len=64, num_gpu_blocks_override=16,
              tensor_parallel_size=tp)
    try:
        with pytest.raises(ValueError, match="VLLM_TORCH_PROFILER_DIR"):
            llm.start_profile()
        monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
        with pytest.raises(ValueError, match="not running"):
            llm.stop_profile()
        llm.start_profile()
        with pytest.raises(ValueError, match="already running"):
            llm.start_profile()
        llm.generate("The quick brown fox", GREEDY, use_tqdm=False)
        llm.stop_profile()
        traces = _traces(tmp_path)
        assert sorted(name.split(".")[0] for name in traces) == [f"rank{r}" for r in range(tp)]
        for trace in traces.values():
            assert "aten::mm" in _ops(trace) or "aten::linear" in _ops(trace)
        assert len(llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()


def test_server_routes(checkpoint, tmp_path, monkeypatch):   # noqa: F811
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    with running_server(checkpoint) as server:
        assert httpx.post(f"{server.url}/stop_profile").status_code == 409
        assert httpx.post(f"{server.url}/start_profile").status_code == 200
        r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                             "max_tokens": 2})
        assert r.status_code == 200
        assert httpx.post(f"{server.url}/stop_profile").status_code == 200
    assert list(_traces(tmp_path)) and "aten::mm" in _ops(next(iter(_traces(tmp_path).values())))
