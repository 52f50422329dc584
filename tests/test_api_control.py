"""The control routes (pause and resume, SGLang's shapes and vLLM's aliases) against the fake
engine; tests/test_control_server.py runs them on the real one."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from quart.typing import TestClientProtocol as QuartClient

from api.app import create_app
from api.http.state import ServerSettings
from tests.api_helpers import MODEL
from tests.fake_engine import FakeEngine


@pytest.fixture
async def control(engine: FakeEngine) -> AsyncIterator[QuartClient]:
    settings = ServerSettings(served_model_name=MODEL, enable_control_api=True)
    async with create_app(engine, settings).test_app() as test_app:
        yield test_app.test_client()


async def test_control_routes_are_off_unless_enabled(client: QuartClient) -> None:
    for method, path in [("POST", "/pause_generation"), ("POST", "/pause"), ("GET", "/is_paused")]:
        response = await client.open(path, method=method)
        error = (await response.get_json())["error"]
        assert response.status_code == 404 and error["code"] == "control_api_disabled"
        assert "--enable-control-api" in error["message"]
    paths = (await (await client.get("/openapi.json")).get_json())["paths"]
    assert "/pause_generation" not in paths


async def test_sglang_pause_and_continue(control: QuartClient, engine: FakeEngine) -> None:
    response = await control.post("/pause_generation", json={"mode": "keep"})
    assert response.status_code == 200
    assert await response.get_json() == {
        "message": "Generation paused successfully.",
        "status": "ok",
    }
    assert engine.control.paused == "keep"
    again = await control.post("/pause_generation")  # several trainer ranks may each pause
    assert again.status_code == 200 and engine.control.paused == "keep"
    assert (await again.get_json())["message"] == "Generation is already paused."
    response = await control.post("/continue_generation")
    assert (await response.get_json())["status"] == "ok" and engine.control.paused is None
    response = await control.post("/pause_generation", data=b"")
    assert response.status_code == 200 and engine.control.paused == "abort"


async def test_vllm_pause_resume_and_is_paused(control: QuartClient, engine: FakeEngine) -> None:
    assert await (await control.get("/is_paused")).get_json() == {"is_paused": False}
    response = await control.post("/pause", query_string={"mode": "wait"})
    assert await response.get_json() == {"status": "paused"} and engine.control.paused == "wait"
    assert await (await control.get("/is_paused")).get_json() == {"is_paused": True}
    assert await (await control.post("/resume")).get_json() == {"status": "resumed"}
    assert await (await control.post("/resume")).get_json() == {"status": "resumed"}  # no-op
    assert engine.control.paused is None


@pytest.mark.parametrize(
    ("path", "kwargs", "param"),
    [
        ("/pause_generation", {"json": {"mode": "sleep"}}, "mode"),
        ("/pause_generation", {"data": b"[1]"}, None),
        ("/pause", {"query_string": {"mode": "sleep"}}, "mode"),
    ],
)
async def test_bad_control_requests_are_400s(
    control: QuartClient, engine: FakeEngine, path: str, kwargs: dict, param: str | None
) -> None:
    response = await control.post(path, **kwargs)
    error = (await response.get_json())["error"]
    assert response.status_code == 400 and error["param"] == param
    assert engine.control.paused is None


async def test_control_routes_need_the_api_key(engine: FakeEngine) -> None:
    settings = ServerSettings(served_model_name=MODEL, api_key="k", enable_control_api=True)
    async with create_app(engine, settings).test_app() as test_app:
        client = test_app.test_client()
        assert (await client.post("/pause_generation")).status_code == 401
        assert engine.control.paused is None
        headers = {"Authorization": "Bearer k"}
        assert (await client.post("/pause_generation", headers=headers)).status_code == 200


async def test_openapi_lists_the_control_routes_when_on(control: QuartClient) -> None:
    paths = (await (await control.get("/openapi.json")).get_json())["paths"]
    for path in ("/pause_generation", "/continue_generation", "/pause", "/resume"):
        assert "post" in paths[path]
    assert "get" in paths["/is_paused"]


async def test_flush_cache_and_its_vllm_alias(control: QuartClient, engine: FakeEngine) -> None:
    response = await control.post("/flush_cache")
    assert response.status_code == 200 and (await response.get_json())["success"] is True
    assert (await control.get("/flush_cache")).status_code == 200  # slime polls it by GET
    reset = await control.post("/reset_prefix_cache")
    assert await reset.get_json() == {"success": True} and engine.control.flushes == 3
    engine.open.add("r")  # a request is open: refused, naming why
    response = await control.post("/flush_cache")
    error = (await response.get_json())["error"]
    assert response.status_code == 400 and "requests are open: 1" in error["message"]
    reset = await control.post("/reset_prefix_cache")  # vLLM's: a 200 that says it failed
    assert reset.status_code == 200 and await reset.get_json() == {"success": False}
    forced = await control.post(
        "/reset_prefix_cache", query_string={"reset_running_requests": "true"}
    )
    assert await forced.get_json() == {"success": True} and engine.control.flushes == 4


async def test_abort_request_by_rid_or_all(control: QuartClient, engine: FakeEngine) -> None:
    assert (await control.post("/abort_request", json={"rid": "r7"})).status_code == 200
    assert engine.aborted == ["r7"]
    assert (await control.post("/abort_request", json={"rid": "unknown"})).status_code == 200
    assert (await control.post("/abort_request", json={"abort_all": True})).status_code == 200
    response = await control.post("/abort_request", json={"rid": 7})
    assert response.status_code == 400 and (await response.get_json())["error"]["param"] == "rid"


async def test_get_model_info_is_served_without_the_control_api(client: QuartClient) -> None:
    response = await client.get("/get_model_info")
    assert await response.get_json() == {
        "model_path": "/fake/model",
        "tokenizer_path": "/fake/model",
        "is_generation": True,
        "weight_version": "default",
        "served_model_name": MODEL,
        "max_model_len": 64,
    }


async def test_update_weights_from_disk_shapes(control: QuartClient, engine: FakeEngine) -> None:
    body = {"model_path": "/new", "weight_version": "v2", "abort_all_requests": True}
    response = await control.post("/update_weights_from_disk", json=body)
    assert response.status_code == 200
    assert await response.get_json() == {
        "success": True,
        "message": "Succeeded to update model weights.",
        "num_paused_requests": 0,
    }
    assert engine.control.updates == [
        (
            "/new",
            {
                "weight_version": "v2",
                "flush_cache": True,
                "abort_all_requests": True,
                "keep_pause": False,
            },
        )
    ]
    response = await control.post("/update_weights_from_disk", json={"model_path": "/bad"})
    answer = await response.get_json()
    assert response.status_code == 400 and answer["success"] is False
    assert "/bad" in answer["message"]
    response = await control.post("/update_weights_from_disk", json={})
    assert (await response.get_json())["error"]["param"] == "model_path"


async def test_get_weights_by_name(control: QuartClient) -> None:
    response = await control.post("/get_weights_by_name", json={"name": "w", "truncate_size": 2})
    assert await response.get_json() == [0.5, 0.5]
    response = await control.post("/get_weights_by_name", json={"name": "nope"})
    assert response.status_code == 404
    assert "no parameter 'nope'" in (await response.get_json())["error"]["message"]
    big = await control.post("/get_weights_by_name", json={"name": "w", "truncate_size": 10**9})
    assert big.status_code == 400
    assert (await big.get_json())["error"]["param"] == "truncate_size"


async def test_release_and_resume_memory_and_the_vllm_aliases(
    control: QuartClient, engine: FakeEngine
) -> None:
    response = await control.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
    assert (await response.get_json())["success"] is True and engine.control.released == {
        "kv_cache"
    }
    assert await (await control.get("/is_sleeping")).get_json() == {"is_sleeping": True}
    assert (await control.post("/resume_memory_occupation")).status_code == 200
    assert not engine.control.released
    light = await control.post("/sleep")  # vLLM's level 1: the weights stay
    assert await light.get_json() == {"status": "sleeping", "level": 1}
    assert engine.control.released == {"kv_cache"}
    assert (await control.post("/sleep", query_string={"level": "2"})).status_code == 200
    assert engine.control.released == {"kv_cache", "weights"}
    assert (await control.post("/sleep", query_string={"level": "3"})).status_code == 400
    wake = await control.post("/wake_up", query_string={"tags": "weights"})
    assert wake.status_code == 200 and engine.control.released == {"kv_cache"}
    refused = await control.post("/continue_generation")
    assert (
        refused.status_code == 400
        and "resume_memory_occupation first" in (await refused.get_json())["error"]["message"]
    )
    assert (await control.post("/wake_up", query_string={"tags": "gpu"})).status_code == 400
    bad = await control.post("/release_memory_occupation", json={"tags": ["everything"]})
    assert bad.status_code == 400 and (await bad.get_json())["error"]["param"] == "tags[0]"
    engine.open.add("r")
    busy = await control.post("/release_memory_occupation")
    assert busy.status_code == 400 and "requests run" in (await busy.get_json())["error"]["message"]
