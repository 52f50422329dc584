"""Schemathesis generates requests from our own /openapi.json: whatever the schema allows, the
app answers without a 5xx, and every error is OpenAI-shaped. (Against the fake engine: the
cases run through quart's test client, since schemathesis' ASGI transport needs asyncio.)"""

from __future__ import annotations

import json
from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.app import create_app
from api.http.state import ServerSettings
from api.routes import control as control_api
from api.routes.openapi import BODIES, openapi
from tests.api_helpers import MODEL
from tests.fake_engine import FakeEngine

SCHEMA = schemathesis.openapi.from_dict(openapi("test", control=True))
# every route with a body; /configure_logging makes the folders it is given, so not here
PATHS = [path for path in BODIES | control_api.BODIES if path != "/configure_logging"]
CASES = st.one_of(*(SCHEMA[path]["POST"].as_strategy() for path in PATHS))


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=CASES, named_model=st.booleans())
async def test_whatever_the_schema_allows_is_answered_without_a_server_error(
    case: Any, named_model: bool
) -> None:
    body = case.body
    if named_model and isinstance(body, dict) and "model" in body:
        body = body | {"model": MODEL}  # past the 404, into the handlers
    settings = ServerSettings(served_model_name=MODEL, enable_control_api=True)
    app = create_app(FakeEngine(), settings)
    async with app.test_app() as test_app:
        response = await test_app.test_client().post(
            case.path, data=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        assert response.status_code < 500, (case.path, body, await response.get_data())
        answer = await response.get_json()
        if response.status_code >= 400 and "success" in answer:  # SGLang's failed update
            assert answer["success"] is False and answer["message"], (case.path, answer)
        elif response.status_code >= 400:
            error = answer["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
