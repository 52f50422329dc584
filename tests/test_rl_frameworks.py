"""The request bodies RL frameworks build for an SGLang or vLLM server, sent as they send them to
a real server, and checked for what each caller reads from the answer.

Each body is written from the framework's public sources, named above it (the snapshots of
/work/scratch/rl_shapes.md: slime@624b824, verl@b178a3c, AReaL@4aef98d; vLLM 0.34's routes).
docs/rl-frameworks.md says how to point each framework at this server.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server_process import ServerProcess

PROMPT_IDS = [5, 17, 300, 42, 7, 99, 123]


@pytest.fixture
def server(control_server: ServerProcess) -> Iterator[ServerProcess]:
    """The shared control server, left as each test found it: unpaused, awake, version
    "default"."""
    yield control_server
    url = control_server.url
    assert httpx.get(url + "/is_paused").json() == {"is_paused": False}
    assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": False}
    body = {"new_version": "default", "abort_all_requests": False}
    assert httpx.post(url + "/update_weight_version", json=body).is_success


def post(server: ServerProcess, path: str, body: object = None, **kwargs: object) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, **kwargs)  # type: ignore[arg-type]


def events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.iter_lines() if line[6:7] == "{"]


# -- slime ------------------------------------------------------------------------------------


def slime_generate_body(max_new_tokens: int = 8) -> dict:
    """slime/rollout/sglang_rollout.py::generate (text-only, no routing replay)."""
    return {
        "sampling_params": {
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": -1,
            "max_new_tokens": max_new_tokens,
            "stop": None,
            "stop_token_ids": None,
            "skip_special_tokens": False,
            "no_stop_trim": True,
            "spaces_between_special_tokens": False,
            "sampling_seed": 1234,
        },
        "return_logprob": True,
        "input_ids": PROMPT_IDS,
    }


def test_slime_polls_health_generate_and_generates_with_logprobs(server: ServerProcess) -> None:
    assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 200
    answer = post(server, "/generate", slime_generate_body()).json()
    meta = answer["meta_info"]  # what Sample.append_response_tokens reads
    logprobs = meta["output_token_logprobs"]
    assert [token for _, token, _ in logprobs] == answer["output_ids"] and len(logprobs) == 8
    assert all(isinstance(lp, float) for lp, _, _ in logprobs)
    assert meta["finish_reason"]["type"] == "length" and isinstance(answer["text"], str)
    assert meta["prompt_tokens"] == len(PROMPT_IDS) and meta["completion_tokens"] == 8
    assert isinstance(meta["cached_tokens"], int) and meta["weight_version"] == "default"


def test_slime_streams_cumulative_chunks(server: ServerProcess) -> None:
    """slime/rollout/sglang_streaming_rollout.py: each chunk covers the whole output so far."""
    body = slime_generate_body() | {"stream": True}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as response:
        chunks = events(response)
    lengths = [len(chunk["meta_info"]["output_token_logprobs"]) for chunk in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 8
    assert [c["meta_info"]["finish_reason"] is not None for c in chunks][-1]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_slime_weight_update_from_disk_round(server: ServerProcess, llama_dir: Path) -> None:
    """slime/ray/actor_group.py::_reload_rollout_weights_from_disk, every answer parsed as
    JSON (sglang_engine.py::_make_request calls response.json())."""
    assert post(server, "/pause_generation", {}).json()["status"] == "ok"
    assert post(server, "/pause_generation", {}).status_code == 200  # a second trainer rank
    flush = httpx.get(server.url + "/flush_cache", timeout=60)  # the retry loop's first try
    assert flush.status_code == 200
    update = {"model_path": str(llama_dir), "load_format": None, "weight_version": "7"}
    answer = post(server, "/update_weights_from_disk", update).json()
    assert answer["success"] is True, answer
    assert httpx.get(server.url + "/get_weight_version").json() == {"weight_version": "7"}
    assert post(server, "/continue_generation", {}).json()["status"] == "ok"
    meta = post(server, "/generate", slime_generate_body(2)).json()["meta_info"]
    assert meta["weight_version"] == "7"


def test_slime_offload_and_onload(server: ServerProcess) -> None:
    """sglang_engine.py: flush_cache, release, then resume weights and the KV (with SGLang's
    cuda_graph tag) one call each, as slime/ray/rollout.py does."""
    assert httpx.get(server.url + "/flush_cache", timeout=60).status_code == 200
    assert post(server, "/release_memory_occupation", {}).json()["success"] is True
    assert post(server, "/resume_memory_occupation", {"tags": ["weights"]}).json() is not None
    onload = post(server, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
    assert onload.status_code == 200 and onload.json()["success"] is True
    assert httpx.get(server.url + "/is_sleeping").json() == {"is_sleeping": False}
    assert post(server, "/generate", slime_generate_body(2)).status_code == 200


def test_slime_abort_until_idle_and_profile(server: ServerProcess, tmp_path: Path) -> None:
    """rollout/server_control.py::abort_server_until_idle, and sglang_engine.start_profile's
    body (its nulls are SGLang's defaults)."""
    assert post(server, "/abort_request", {"abort_all": True}).status_code == 200
    loads = httpx.get(server.url + "/v1/loads", params={"include": "core"}).json()["loads"]
    assert sum(x["num_running_reqs"] + x["num_waiting_reqs"] for x in loads) == 0
    profile = {"output_dir": str(tmp_path), "start_step": None, "num_steps": None,
               "activities": None, "profile_by_stage": False, "with_stack": None,
               "record_shapes": None}  # fmt: skip
    assert post(server, "/start_profile", profile).status_code == 200
    assert post(server, "/stop_profile", {}).status_code == 200
    assert list(tmp_path.glob("*.trace.json"))


def test_slime_group_init_on_a_cpu_server_names_the_backend(server: ServerProcess) -> None:
    """update_weight_from_distributed.py sends backend nccl: a CPU server says what to use."""
    body = {"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1,
            "world_size": 2, "group_name": "slime", "backend": "nccl"}  # fmt: skip
    answer = post(server, "/init_weights_update_group", body)
    assert answer.status_code == 400 and "use gloo on CPU" in answer.json()["message"]


# -- verl's legacy launch path, and its SGLang adapter -------------------------------------


def test_verl_polls_health_generate_then_flush_cache(server: ServerProcess) -> None:
    """verl/workers/rollout/sglang_rollout/http_server_engine.py::launch_server_process."""
    for path in ("/health_generate", "/flush_cache"):
        assert httpx.get(server.url + path, timeout=60).status_code == 200


def test_verl_adapter_calls(server: ServerProcess) -> None:
    """http_server_engine.py::AsyncHttpServerAdapter: generate (None values removed), abort,
    release and resume by tags."""
    body = {"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "return_logprob": False}  # fmt: skip
    assert len(post(server, "/generate", body).json()["output_ids"]) == 3
    assert post(server, "/abort_request", {"rid": "", "abort_all": False}).status_code == 200
    assert post(server, "/release_memory_occupation", {"tags": ["kv_cache", "weights"]}).is_success
    for tags in (["weights"], ["kv_cache"]):
        assert post(server, "/resume_memory_occupation", {"tags": tags}).is_success


# -- AReaL (its SGLang backend) ---------------------------------------------------------------


def areal_generate_body(input_ids: list[int], max_new_tokens: int) -> dict:
    """areal/engine/sglang_remote.py::SGLangBackend.build_generation_request: image_data is
    always there, null for text."""
    return {
        "input_ids": input_ids,
        "image_data": None,
        "sampling_params": {
            "top_p": 1.0,
            "top_k": -1,
            "max_new_tokens": max_new_tokens,
            "temperature": 0.0,
            "stop_token_ids": [2],
            "ignore_eos": True,
            "skip_special_tokens": True,
            "frequency_penalty": 0.0,
        },
        "return_logprob": True,
        "stream": False,
    }


def test_areal_health_check_with_a_body_and_models(server: ServerProcess) -> None:
    """remote_inf_engine.py::check_health sends GET /health with json={}."""
    assert httpx.request("GET", server.url + "/health", json={}, timeout=60).status_code == 200
    models = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer None"})
    assert models.status_code == 200


# long enough that the pause, posted once the stream has begun, lands before the end even on a
# busy 2-core machine (400 tokens of the tiny model once did not, beside other work)
ROLLOUT_TOKENS = 1200


def test_areal_resumes_a_paused_rollout_from_its_partial_tokens(server: ServerProcess) -> None:
    """A pause (abort mode) ends the rollout with finish_reason abort and its tokens so far;
    AReaL re-posts with them appended, once generation continues: the same greedy tokens."""
    whole = post(server, "/generate", areal_generate_body(PROMPT_IDS, ROLLOUT_TOKENS))
    expected = whole.json()["output_ids"]
    started, result = threading.Event(), []

    def rollout() -> None:
        body = areal_generate_body(PROMPT_IDS, ROLLOUT_TOKENS) | {"stream": True}
        with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as response:
            for line in response.iter_lines():
                started.set()
                if line[6:7] == "{":
                    result.append(json.loads(line[6:]))

    reader = threading.Thread(target=rollout)
    reader.start()
    assert started.wait(60)
    post(server, "/pause_generation", {})
    reader.join(60)
    final = result[-1]["meta_info"]
    assert final["finish_reason"]["type"] == "abort" and "message" in final["finish_reason"]
    partial = result[-1]["output_ids"]
    assert partial == expected[: len(partial)] and len(partial) < ROLLOUT_TOKENS
    post(server, "/continue_generation", {})
    again = areal_generate_body(PROMPT_IDS + partial, ROLLOUT_TOKENS - len(partial))
    rest = post(server, "/generate", again).json()
    assert partial + rest["output_ids"] == expected
    assert rest["meta_info"]["finish_reason"]["type"] == "length"


# -- vLLM's routes (VLLM_SERVER_DEV_MODE) ----------------------------------------------------


def test_vllm_pause_resume_sleep_and_cache_routes(server: ServerProcess) -> None:
    assert post(server, "/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    assert httpx.get(server.url + "/is_paused").json() == {"is_paused": True}
    assert post(server, "/resume").json() == {"status": "resumed"}
    assert post(server, "/sleep").json() == {"status": "sleeping", "level": 1}
    assert httpx.get(server.url + "/is_sleeping").json() == {"is_sleeping": True}
    woken = post(server, "/wake_up", params=[("tags", "kv_cache")])
    assert woken.json() == {"status": "awake", "tags": ["kv_cache"]}
    assert post(server, "/reset_prefix_cache").json() == {"success": True}
    version = post(server, "/update_weight_version", {"new_version": "v3"}).json()
    assert version["success"] is True and version["new_version"] == "v3"
    assert httpx.get(server.url + "/weight_info").json() == {"weight_version": "v3"}
    assert post(server, "/abort_requests", {}).json() == {"status": "aborted", "aborted": 0}


def test_vllm_pause_clears_the_prefix_cache_unless_told_not_to(server: ServerProcess) -> None:
    prompt = {"input_ids": list(range(10, 60)), "sampling_params": {"max_new_tokens": 1}}

    def cached() -> int:
        return post(server, "/generate", prompt).json()["meta_info"]["cached_tokens"]

    cached()
    assert cached() > 0  # the prompt's full blocks are reused
    post(server, "/pause", params={"mode": "abort", "clear_cache": "false"})
    post(server, "/resume")
    assert cached() > 0
    post(server, "/pause", params={"mode": "abort"})  # clear_cache defaults to true
    post(server, "/resume")
    assert cached() == 0


# -- SGLang's batch /generate, and request ids ------------------------------------------------


def test_batch_generate_answers_a_list_in_order_and_streams_with_index(
    server: ServerProcess,
) -> None:
    single = [
        post(server, "/generate", {"text": t, "sampling_params": {"max_new_tokens": 4,
                                                                  "temperature": 0}}).json()
        for t in ("The tuple", "A list of")
    ]  # fmt: skip
    batch = {"text": ["The tuple", "A list of"], "sampling_params": {"max_new_tokens": 4,
                                                                    "temperature": 0}}  # fmt: skip
    answers = post(server, "/generate", batch).json()
    assert [a["output_ids"] for a in answers] == [s["output_ids"] for s in single]
    per_item = {"input_ids": [PROMPT_IDS, PROMPT_IDS[:3]],
                "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 5}]}  # fmt: skip
    lengths = [len(a["output_ids"]) for a in post(server, "/generate", per_item).json()]
    assert lengths == [2, 5]
    with httpx.stream("POST", server.url + "/generate", json=batch | {"stream": True},
                      timeout=60) as response:  # fmt: skip
        streamed = events(response)
    last = {e["index"]: e["output_ids"] for e in streamed}
    assert last == {0: single[0]["output_ids"], 1: single[1]["output_ids"]}


def test_a_rid_in_use_is_a_400_before_a_stream_starts(server: ServerProcess) -> None:
    long = {"rid": "busy", "text": "x", "stream": True,
            "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}  # fmt: skip
    with httpx.stream("POST", server.url + "/generate", json=long, timeout=60) as first:
        lines = first.iter_lines()  # kept: a closed iterator would close the stream
        next(lines)  # it runs
        for stream in (True, False):
            again = post(server, "/generate", long | {"stream": stream})
            assert again.status_code == 400 and "already in use" in again.text, again.text[:500]
    duplicate = {"text": ["a", "b"], "rid": ["same", "same"]}
    assert post(server, "/generate", duplicate).status_code == 400


def test_unknown_fields_are_named_in_a_header(server: ServerProcess) -> None:
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}, "pp_rank": 0}
    answer = post(server, "/generate", body)
    assert answer.status_code == 200 and answer.headers["X-Ignored-Fields"] == "pp_rank"


# -- TRL's client, against the routes of `trl vllm-serve` ------------------------------------


def test_trls_client_generates_and_chats(server: ServerProcess) -> None:
    """trl/generation/vllm_client.py: GRPO sends each unique prompt once, as token ids, with
    n samples; it reads the prompt ids, every completion and their log-probabilities."""
    assert httpx.get(server.url + "/health/").json() == {"status": "ok"}
    assert httpx.get(server.url + "/get_world_size/").json() == {"world_size": 1}
    body = {"prompts": [PROMPT_IDS, PROMPT_IDS[:4]], "images": None, "n": 2,
            "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
            "min_p": 0.0, "max_tokens": 3, "logprobs": 1, "structured_outputs_regex": None,
            "generation_kwargs": {}}  # fmt: skip
    answer = post(server, "/generate/", body).json()
    assert answer["prompt_ids"] == [PROMPT_IDS, PROMPT_IDS[:4]]
    assert [len(c) for c in answer["completion_ids"]] == [3, 3, 3, 3]
    for ids, logprobs, tokens in zip(answer["completion_ids"], answer["logprobs"],
                                     answer["logprob_token_ids"], strict=True):  # fmt: skip
        assert [t[0] for t in tokens] == ids and all(1 <= len(lp) <= 2 for lp in logprobs)
    chat = {"messages": [[{"role": "user", "content": "Hi"}]], "max_tokens": 2, "logprobs": 0,
            "chat_template_kwargs": {}}  # fmt: skip
    chatted = post(server, "/chat/", chat).json()
    assert len(chatted["completion_ids"][0]) == 2 and len(chatted["logprobs"][0][0]) == 1
    reset = post(server, "/reset_prefix_cache/").json()["message"]
    assert reset.endswith("status: True")
    refused = post(server, "/init_communicator/", {"host": "0.0.0.0", "port": 51216})
    assert refused.status_code == 400 and "/init_weights_update_group" in refused.text
