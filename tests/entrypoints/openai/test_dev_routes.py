"""vLLM's development routes (VLLM_SERVER_DEV_MODE=1): /reset_prefix_cache empties the prefix
cache, /collective_rpc runs a Worker method on every rank, /server_info, sleep mode's /sleep,
/wake_up, /is_sleeping, and /pause, /resume, /is_paused; all absent otherwise."""

import time

import httpx
import pytest

from tests.entrypoints.openai.test_api_server import (MODEL, PROMPT, checkpoint,  # noqa: F401
                                                      metric, running_server, server)


@pytest.fixture(scope="module")
def dev_server(checkpoint):   # noqa: F811
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_SERVER_DEV_MODE", "1")
        with running_server(checkpoint, {"enable_prompt_tokens_details": True}) as dev:
            yield dev


def _cached(url: str, prompt: str) -> int:
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                  "max_tokens": 1}, timeout=60)
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_routes_are_absent_without_dev_mode(server):   # noqa: F811
    for method, path in (("POST", "/reset_prefix_cache"), ("POST", "/collective_rpc"),
                         ("GET", "/server_info"), ("POST", "/sleep"), ("POST", "/pause"),
                         ("GET", "/is_paused")):
        assert httpx.request(method, f"{server.url}{path}", json={}).status_code == 404


def test_reset_prefix_cache(dev_server):
    prompt = " ".join([PROMPT] * 16)
    _cached(dev_server.url, prompt)
    assert _cached(dev_server.url, prompt) >= 32
    assert httpx.post(f"{dev_server.url}/reset_prefix_cache").status_code == 200
    assert _cached(dev_server.url, prompt) == 0


def test_collective_rpc_and_server_info(dev_server):
    url = f"{dev_server.url}/collective_rpc"
    r = httpx.post(url, json={"method": "determine_num_blocks"})
    assert r.status_code == 200 and r.json() == {"results": [256]}
    for body, message in (({"method": "no_such_method"}, "has no method"),
                          ({"method": "list_loras"}, "LoRA is disabled"),
                          ({"method": "_update_states"}, "private"),
                          ({"method": "get_model"}, "not JSON"),
                          ({"method": "determine_num_blocks", "args": [1, 2]}, "argument")):
        r = httpx.post(url, json=body)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    info = httpx.get(f"{dev_server.url}/server_info").json()
    assert "max_model_len=512" in info["vllm_config"] and info["version"]
    assert httpx.post(f"{dev_server.url}/v1/completions", json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_sleep_needs_sleep_mode(dev_server):
    r = httpx.post(f"{dev_server.url}/sleep")
    assert r.status_code == 409 and "enable_sleep_mode" in r.json()["error"]["message"]
    assert httpx.get(f"{dev_server.url}/is_sleeping").json() == {"is_sleeping": False}


def test_sleep_and_wake_up_routes(checkpoint):   # noqa: F811
    """vLLM's /sleep?level=N, /wake_up?tags=..., /is_sleeping: requests sent while asleep get
    a 400 saying so; after waking (level 2: weights first, then the cache) the answers are the
    same as before."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_SERVER_DEV_MODE", "1")
        with running_server(checkpoint, engine_kwargs={"enable_sleep_mode": True}) as srv:
            url = srv.url
            before = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["text"]
            for level, wake in (("1", [None]), ("2", ["weights", "kv_cache"])):
                assert httpx.post(f"{url}/sleep", params={"level": level}).status_code == 200
                assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
                r = httpx.post(f"{url}/v1/completions", json=body)
                assert r.status_code == 400 and "asleep" in r.json()["error"]["message"]
                for tag in wake:
                    params = {} if tag is None else {"tags": tag}
                    assert httpx.post(f"{url}/wake_up", params=params).status_code == 200
                assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
                after = httpx.post(f"{url}/v1/completions", json=body).json()
                assert after["choices"][0]["text"] == before
            r = httpx.post(f"{url}/sleep", params={"level": "3"})
            assert r.status_code == 400 and "level must be 1 or 2" in r.json()["error"]["message"]
            r = httpx.post(f"{url}/wake_up", params={"tags": "everything"})
            assert r.status_code == 400 and "'weights', 'kv_cache'" in r.json()["error"]["message"]


def test_pause_resume_routes(dev_server):
    """/pause aborts what runs (the client gets finish_reason "abort"), holds what comes in
    until /resume; bad flags are a 400."""
    import threading

    url = dev_server.url
    results: dict[str, dict] = {}

    def complete(name: str, max_tokens: int) -> None:
        results[name] = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": False}).json()

    running = threading.Thread(target=complete, args=("running", 450))
    running.start()
    deadline = time.monotonic() + 30
    while metric(url, "vllm:num_requests_running") < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert httpx.post(f"{url}/pause").status_code == 200
    running.join(30)
    assert results["running"]["choices"][0]["finish_reason"] == "abort"
    assert httpx.get(f"{url}/is_paused").json() == {"is_paused": True}
    held = threading.Thread(target=complete, args=("held", 4))
    held.start()
    held.join(0.5)
    assert held.is_alive()
    assert httpx.post(f"{url}/resume").status_code == 200
    held.join(30)
    assert results["held"]["choices"][0]["finish_reason"] == "length"
    assert httpx.get(f"{url}/is_paused").json() == {"is_paused": False}
    r = httpx.post(f"{url}/pause", params={"clear_cache": "maybe"})
    assert r.status_code == 400 and "clear_cache must be true or false" in r.text
