"""Generated bodies at every route: only 2xx or 4xx come back, errors always OpenAI-shaped."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from api.app import create_app
from api.http.state import ServerSettings
from tests.api_helpers import MODEL
from tests.fake_engine import FakeEngine

ROUTES = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/generate"),
    ("POST", "/v1/embeddings"),
    ("POST", "/encode"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
    ("GET", "/get_model_info"),
    # the control routes (on here)
    ("POST", "/pause_generation"),
    ("POST", "/continue_generation"),
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("GET", "/is_paused"),
    ("POST", "/flush_cache"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/abort_request"),
    ("POST", "/update_weights_from_disk"),
    ("POST", "/get_weights_by_name"),
    ("POST", "/release_memory_occupation"),
    ("POST", "/resume_memory_occupation"),
    ("POST", "/sleep"),
    ("POST", "/wake_up"),
    ("GET", "/is_sleeping"),
    ("POST", "/update_weights_from_tensor"),
    ("POST", "/init_weights_update_group"),
    ("POST", "/update_weights_from_distributed"),
    ("POST", "/destroy_weights_update_group"),
    ("POST", "/set_internal_state"),
    ("POST", "/start_profile"),
    ("POST", "/stop_profile"),
    # operators' and sessions' routes (/configure_logging is left out: it makes folders)
    ("GET", "/v1/loads"),
    ("GET", "/get_load"),
    ("GET", "/get_server_info"),
    ("GET", "/health_generate"),
    ("POST", "/open_session"),
    ("POST", "/close_session"),
]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
FIELDS = [
    "mode", "model_path", "weight_version", "flush_cache", "abort_all_requests", "tags", "name",
    "truncate_size", "rid", "abort_all", "master_address", "master_port", "rank_offset",
    "world_size", "group_name", "backend", "names", "dtypes", "shapes", "server_args",
    "output_dir", "num_steps", "activities", "capacity_of_str_len", "session_id", "timeout",
    "session_params",
    "prompt", "messages", "text", "input_ids", "tokens", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "seed", "ignore_eos",
    "stream", "stream_options", "n", "logprobs", "sampling_params", "rid", "add_special_tokens",
    "input", "encoding_format", "dimensions", "normalize", "truncate_prompt_tokens",
    "pooling_type",
]  # fmt: skip
# near-valid bodies reach past the first check: a known model, known fields, any values
near_valid = st.fixed_dictionaries(
    {"model": st.just(MODEL)},
    optional={name: json_values for name in FIELDS}
    | {
        "prompt": st.text(max_size=10) | st.lists(st.integers(-2, 200), max_size=5),
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "tool", "x"])},
                optional={"content": json_values, "name": json_values},
            ),
            max_size=3,
        ),
    },
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(route=("POST", "/destroy_weights_update_group"), body={}, raw=False)  # SGLang's 400
@given(route=st.sampled_from(ROUTES), body=json_values | near_valid, raw=st.booleans())
async def test_no_input_is_a_server_error(route: tuple[str, str], body: Any, raw: bool) -> None:
    method, path = route
    settings = ServerSettings(served_model_name=MODEL, enable_control_api=True)
    app = create_app(FakeEngine(), settings)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        data = json.dumps(body).encode() if not raw else repr(body).encode()  # and non-JSON
        headers = {"Content-Type": "application/json"}
        if method == "GET":
            response = await client.get(path)
        else:
            response = await client.post(path, data=data, headers=headers)
        assert response.status_code < 500, (path, body, await response.get_data())
        answer = await response.get_json()
        if response.status_code >= 400 and "success" in answer:  # SGLang's failed update
            assert answer["success"] is False and answer["message"], (path, answer)
        elif response.status_code >= 400:
            error = answer["error"]
            assert isinstance(error["message"], str) and error["message"]
            assert set(error) == {"message", "type", "param", "code"}
