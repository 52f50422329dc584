"""What routers and operators poll (loads, server info, live settings, a generating health
check, vLLM's metric names) against the fake engine; tests/test_operator_server.py and
tests/test_gateway.py run them on real servers."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio
from quart.typing import TestClientProtocol as QuartClient

from api.app import create_app
from api.http.state import ServerSettings
from tests.api_helpers import MODEL
from tests.fake_engine import FakeEngine


@pytest.fixture
async def control(engine: FakeEngine) -> AsyncIterator[QuartClient]:
    settings = ServerSettings(served_model_name=MODEL, api_key="k", enable_control_api=True)
    async with create_app(engine, settings).test_app() as test_app:
        yield test_app.test_client()


AUTH = {"Authorization": "Bearer k"}


async def test_loads_in_sglangs_shape(client: QuartClient, engine: FakeEngine) -> None:
    engine.open.add("a")  # one running request
    body = await (await client.get("/v1/loads", query_string={"include": "core,queues"})).get_json()
    assert set(body) == {"timestamp", "version", "dp_rank_count", "loads"}
    assert body["dp_rank_count"] == 1
    (load,) = body["loads"]
    assert load == {
        "dp_rank": 0,
        "num_running_reqs": 1,
        "num_waiting_reqs": 0,
        "num_waiting_uncached_tokens": 0,
        "num_total_reqs": 1,
        "num_used_tokens": 10 * 16,  # 10 of 100 blocks of 16 tokens held
        "max_total_num_tokens": 100 * 16,
        "token_usage": 0.1,
        "gen_throughput": 0.0,  # the first poll has nothing to compare with
        "cache_hit_rate": round(2 / 7, 4),
        "utilization": round(1 / 8, 4),
        "max_running_requests": 8,
    }
    legacy = await (await client.get("/get_load")).get_json()
    assert legacy[0]["num_reqs"] == 1 and legacy[0]["num_tokens"] == 160
    assert (await client.get("/v1/loads", query_string={"dp_rank": "1"})).status_code == 200
    none = await (await client.get("/v1/loads", query_string={"dp_rank": "1"})).get_json()
    assert none["loads"] == [] and none["dp_rank_count"] == 1
    bad = await client.get("/v1/loads", query_string={"include": "core,gossip"})
    assert bad.status_code == 400 and (await bad.get_json())["error"]["param"] == "include"


async def test_loads_list_every_data_parallel_group(engine: FakeEngine) -> None:
    engine.data_parallel_size = 2
    app = create_app(engine, ServerSettings(served_model_name=MODEL))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        body = await (await client.get("/v1/loads")).get_json()
        one = await (await client.get("/v1/loads", query_string={"dp_rank": "1"})).get_json()
        legacy = await (await client.get("/get_load")).get_json()
        info = await (await client.get("/server_info")).get_json()
    assert body["dp_rank_count"] == 2 and [x["dp_rank"] for x in body["loads"]] == [0, 1]
    assert one["dp_rank_count"] == 2 and [x["dp_rank"] for x in one["loads"]] == [1]
    assert [x["dp_rank"] for x in legacy] == [0, 1]
    assert len(info["internal_states"]) == 2 and info["max_total_num_tokens"] == 2 * 1600


async def test_server_info_never_shows_the_api_key(control: QuartClient) -> None:
    assert (await control.get("/get_server_info")).status_code == 401
    for path in ("/get_server_info", "/server_info"):
        info = await (await control.get(path, headers=AUTH)).get_json()
        assert info["served_model_name"] == MODEL and info["max_num_seqs"] == 8
        assert info["api_key_required"] is True and "k" not in info.values()
        assert info["internal_states"][0]["#running"] == 0
        assert set(info["internal_states"][0]) >= {"last_gen_throughput", "#running"}
        assert info["version"]


async def test_set_internal_state(
    control: QuartClient, client: QuartClient, engine: FakeEngine
) -> None:
    body = {"server_args": {"max_running_requests": 3}}
    response = await control.post("/set_internal_state", json=body, headers=AUTH)
    assert response.status_code == 200 and await response.get_json() == [True]
    assert engine.control.max_num_seqs == 3
    body = {"server_args": {"max_num_seqs": 4, "block_size": 32}}
    refused = await control.post("/set_internal_state", json=body, headers=AUTH)
    error = (await refused.get_json())["error"]
    assert refused.status_code == 400 and "block_size" in error["message"]
    nothing = await control.post("/set_internal_state", json={"server_args": {}}, headers=AUTH)
    assert nothing.status_code == 200 and engine.control.max_num_seqs == 3
    off = await client.post("/set_internal_state", json={"server_args": {"max_num_seqs": 2}})
    assert off.status_code == 404 and engine.control.max_num_seqs == 3
    engine.data_parallel_size = 2
    five = {"server_args": {"max_num_seqs": 5}}
    response = await control.post("/set_internal_state", json=five, headers=AUTH)
    assert await response.get_json() == [True, True]


async def test_health_generate(engine: FakeEngine) -> None:
    settings = ServerSettings(served_model_name=MODEL, health_generate_timeout=0.5)
    async with create_app(engine, settings).test_app() as test_app:
        client = test_app.test_client()
        assert (await client.get("/health_generate")).status_code == 200
        assert engine.requests[-1][1].max_tokens == 1
        engine.control.paused = "keep"
        paused = await client.get("/health_generate")
        assert paused.status_code == 503 and "paused" in (await paused.get_data(as_text=True))
        engine.control.paused = None
        engine.step = trio.Event()  # outputs never come
        assert (await client.get("/health_generate")).status_code == 503


async def test_vllm_metric_names(client: QuartClient) -> None:
    text = await (await client.get("/metrics")).get_data(as_text=True)
    labels = f'{{engine="0",model_name="{MODEL}"}}'
    for line in (
        f"vllm:num_requests_running{labels} 0.0",
        f"vllm:kv_cache_usage_perc{labels} 0.1",
        f"vllm:prefix_cache_queries_total{labels} 7.0",
        f"vllm:prefix_cache_hits_total{labels} 2.0",
    ):
        assert line in text
    assert 'vllm:cache_config_info{block_size="16"' in text


async def test_model_info_alias(client: QuartClient) -> None:
    response = await client.get("/model_info")
    assert (await response.get_json())["served_model_name"] == MODEL


async def test_sessions_open_close_and_continue(client: QuartClient, engine: FakeEngine) -> None:
    opened = await client.post("/open_session", json={"capacity_of_str_len": 100})
    session_id = await opened.get_json()
    assert opened.status_code == 200 and isinstance(session_id, str)
    again = await client.post(
        "/open_session", json={"capacity_of_str_len": 100, "session_id": session_id}
    )
    assert again.status_code == 400 and "already open" in await again.get_data(as_text=True)
    body = {
        "input_ids": [1, 2],
        "sampling_params": {"max_new_tokens": 4},
        "session_params": {"id": session_id, "offset": -1},
    }
    assert (await client.post("/generate", json=body)).status_code == 200
    closed = await client.post("/close_session", json={"session_id": session_id})
    assert closed.status_code == 200
    unknown = await client.post("/generate", json=body)
    assert unknown.status_code == 400 and "no open session" in await unknown.get_data(as_text=True)
    gone = await client.post("/close_session", json={"session_id": session_id})
    assert gone.status_code == 400
    bad = await client.post("/open_session", json={"capacity_of_str_len": 0})
    assert (await bad.get_json())["error"]["param"] == "capacity_of_str_len"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/loads"),
        ("GET", "/get_load"),
        ("GET", "/get_server_info"),
        ("GET", "/server_info"),
        ("GET", "/health_generate"),
        ("GET", "/model_info"),
        ("POST", "/set_internal_state"),
        ("POST", "/open_session"),
        ("POST", "/close_session"),
        ("POST", "/configure_logging"),
        ("POST", "/start_profile"),
        ("POST", "/stop_profile"),
        ("POST", "/update_weights_from_tensor"),
        ("POST", "/init_weights_update_group"),
        ("POST", "/update_weights_from_distributed"),
        ("POST", "/destroy_weights_update_group"),
    ],
)
async def test_every_new_route_needs_the_api_key(
    control: QuartClient, engine: FakeEngine, method: str, path: str
) -> None:
    response = await control.open(path, method=method, data=b"{}")
    assert response.status_code == 401
    assert engine.control.updates == [] and engine.sessions == set() and engine.requests == []
