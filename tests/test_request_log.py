"""Request logs and dumps (api/request_log.py) against the fake engine: what each level shows,
the API key never, dump files of the threshold's size, and /configure_logging."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from api.app import create_app
from api.http.request_log import LogConfig
from api.http.state import ServerSettings
from tests.api_helpers import MODEL
from tests.fake_engine import FakeEngine

KEY = "sk-secret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": MODEL, "prompt": "hello there", "max_tokens": 3, "temperature": 0}


def settings(**log: object) -> ServerSettings:
    return ServerSettings(
        served_model_name=MODEL, api_key=KEY, enable_control_api=True, log_config=LogConfig(**log)
    )


def logged(caplog: pytest.LogCaptureFixture) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "runtime.requests"]


@pytest.mark.parametrize("level", [0, 1, 2, 3])
async def test_each_level_shows_more(
    level: int, caplog: pytest.LogCaptureFixture, engine: FakeEngine
) -> None:
    caplog.set_level(logging.INFO, logger="runtime.requests")
    app = create_app(engine, settings(log_requests=True, log_requests_level=level))
    async with app.test_app() as test_app:
        response = await test_app.test_client().post("/v1/completions", json=BODY, headers=AUTH)
        assert response.status_code == 200
    (record,) = logged(caplog)
    assert record["path"] == "/v1/completions" and record["latency_s"] >= 0
    assert record["outputs"][0]["completion_tokens"] == 3
    assert ("params" in record) == (level >= 1)
    assert ("prompt" in record) == (level >= 2)
    assert ("text" in record["outputs"][0]) == (level >= 2)
    if level == 3:
        assert record["prompt"] == {"prompt": "hello there"}
        assert record["outputs"][0]["text"] == "alpha beta gamma "
    assert KEY not in json.dumps(record)


async def test_dumps_are_files_of_the_threshold(tmp_path: Path, engine: FakeEngine) -> None:
    folder = tmp_path / "dumps"
    app = create_app(engine, settings(dump_requests_folder=str(folder), dump_requests_threshold=2))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        for _ in range(5):
            assert (
                await client.post("/v1/completions", json=BODY, headers=AUTH)
            ).status_code == 200
        refused = await client.post("/v1/completions", json=BODY | {"max_tokens": -1}, headers=AUTH)
        assert refused.status_code == 400  # never started: not dumped
    files = sorted(folder.glob("*.jsonl"))  # written by then: the server drains its writer
    assert [len(f.read_text().splitlines()) for f in files] == [2, 2, 1]
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    lines = [json.loads(line) for f in files for line in f.open()]
    assert lines[0]["body"] == BODY and lines[0]["outputs"][0]["text"] == "alpha beta gamma "
    assert KEY not in folder.joinpath(sorted(f.name for f in folder.iterdir())[0]).read_text()


async def test_configure_logging(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, engine: FakeEngine
) -> None:
    caplog.set_level(logging.INFO, logger="runtime.requests")
    async with create_app(engine, settings()).test_app() as test_app:
        client = test_app.test_client()
        await client.post("/v1/completions", json=BODY, headers=AUTH)
        assert logged(caplog) == []
        change = {"log_requests": True, "log_requests_level": 1}
        response = await client.post("/configure_logging", json=change, headers=AUTH)
        assert response.status_code == 200
        await client.post("/v1/completions", json=BODY, headers=AUTH)
        assert len(logged(caplog)) == 1 and "params" in logged(caplog)[0]
        bad = await client.post("/configure_logging", json={"log_requests_level": 7}, headers=AUTH)
        assert bad.status_code == 400
        nobody = await client.post("/configure_logging", json=change)
        assert nobody.status_code == 401
    async with create_app(engine, ServerSettings(served_model_name=MODEL)).test_app() as test_app:
        off = await test_app.test_client().post("/configure_logging", json=change)
        assert off.status_code == 404


async def test_a_dump_that_cannot_be_written_fails_no_request(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, engine: FakeEngine
) -> None:
    folder = tmp_path / "dumps"
    app = create_app(engine, settings(dump_requests_folder=str(folder), dump_requests_threshold=1))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        folder.rmdir()  # found by review: every request then failed, and shutdown too
        assert (await client.post("/v1/completions", json=BODY, headers=AUTH)).status_code == 200
        stop = {"dump_requests_folder": ""}
        response = await client.post("/configure_logging", json=stop, headers=AUTH)
        assert response.status_code == 200
    assert "could not dump a request" in caplog.text  # the writer drained at shutdown


async def test_each_sample_is_an_output(
    caplog: pytest.LogCaptureFixture, engine: FakeEngine
) -> None:
    caplog.set_level(logging.INFO, logger="runtime.requests")
    app = create_app(engine, settings(log_requests=True, log_requests_level=3))
    async with app.test_app() as test_app:
        body = BODY | {"n": 3, "temperature": 1.0, "prompt": ["hello there", "again"]}
        response = await test_app.test_client().post("/v1/completions", json=body, headers=AUTH)
        assert response.status_code == 200
    (record,) = logged(caplog)
    assert [(o.get("prompt_index"), o.get("sample")) for o in record["outputs"]] == [
        (None, None),
        (0, 1),
        (0, 2),
        (None, None),
        (1, 1),
        (1, 2),
    ]  # in the API's choice order
    assert all(o["text"] == "alpha beta gamma " for o in record["outputs"])


async def test_an_embedding_request_is_logged_without_its_vectors(
    caplog: pytest.LogCaptureFixture, engine: FakeEngine
) -> None:
    caplog.set_level(logging.INFO, logger="runtime.requests")
    app = create_app(engine, settings(log_requests=True, log_requests_level=1))
    async with app.test_app() as test_app:
        body = {"model": MODEL, "input": ["ab", "cde"], "dimensions": 2}
        response = await test_app.test_client().post("/v1/embeddings", json=body, headers=AUTH)
        assert response.status_code == 200
    (record,) = logged(caplog)
    assert record["path"] == "/v1/embeddings" and record["params"] == {
        "model": MODEL,
        "dimensions": 2,
    }
    assert [(o["prompt_tokens"], o["finish_reason"]) for o in record["outputs"]] == [
        (2, "stop"),
        (3, "stop"),
    ]
