"""A trio-native client for the runtime's OpenAI-compatible API (any such server works).

    async with Client("http://127.0.0.1:8000", api_key=None) as client:
        reply = await client.chat([{"role": "user", "content": "Hi"}], max_tokens=32)
        print(reply.choices[0].message.content)
        async for chunk in client.stream_completions("Once upon", max_tokens=32):
            print(chunk.choices[0].text, end="")

Errors from the server raise `APIStatusError` with its status and message. Cancelling the task
that iterates a stream closes its connection, and the server aborts the request.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import httpx

from api.client.types import (
    ChatChoice,
    ChatCompletion,
    ChatMessage,
    Completion,
    CompletionChoice,
    EmbeddingData,
    Embeddings,
    Model,
    ToolCall,
    Usage,
)

__all__ = [
    "APIStatusError",
    "ChatChoice",
    "ChatCompletion",
    "ChatMessage",
    "Client",
    "Completion",
    "CompletionChoice",
    "EmbeddingData",
    "Embeddings",
    "Model",
    "ToolCall",
    "Usage",
]


class APIStatusError(Exception):
    """The server answered with an error status (or an in-band error while streaming)."""

    def __init__(self, status_code: int, body: dict[str, Any]) -> None:
        error: dict[str, Any] = body["error"] if isinstance(body.get("error"), dict) else {}
        self.status_code = status_code
        self.message: str = error.get("message") or json.dumps(body)
        self.type: str | None = error.get("type")
        self.param: str | None = error.get("param")
        self.code: str | None = error.get("code")
        super().__init__(f"{status_code}: {self.message}")


class Client:
    def __init__(
        self, base_url: str, api_key: str | None = None, *, timeout: float | None = 600.0
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers=headers, timeout=timeout
        )
        self._default_model: str | None = None

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._http.aclose()

    async def models(self) -> list[Model]:
        data = await self._request("GET", "/v1/models")
        return [Model(m["id"], m.get("max_model_len")) for m in data["data"]]

    async def health(self) -> bool:
        """True if the server and its engine answer."""
        try:
            response = await self._http.get("/health")
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def completions(
        self, prompt: str | list[int] | list[str], *, model: str | None = None, **params: Any
    ) -> Completion:
        body = {"model": await self._model(model), "prompt": prompt, **params}
        return Completion.parse(await self._request("POST", "/v1/completions", body))

    async def stream_completions(
        self, prompt: str | list[int] | list[str], *, model: str | None = None, **params: Any
    ) -> AsyncIterator[Completion]:
        body = {"model": await self._model(model), "prompt": prompt, "stream": True, **params}
        async for data in self._stream("/v1/completions", body):
            yield Completion.parse(data)

    async def chat(
        self, messages: list[dict[str, Any]], *, model: str | None = None, **params: Any
    ) -> ChatCompletion:
        body = {"model": await self._model(model), "messages": messages, **params}
        return ChatCompletion.parse(await self._request("POST", "/v1/chat/completions", body))

    async def stream_chat(
        self, messages: list[dict[str, Any]], *, model: str | None = None, **params: Any
    ) -> AsyncIterator[ChatCompletion]:
        body = {"model": await self._model(model), "messages": messages, "stream": True, **params}
        async for data in self._stream("/v1/chat/completions", body):
            yield ChatCompletion.parse(data)

    async def embed(
        self,
        input: str | list[str] | list[int] | list[list[int]],
        *,
        model: str | None = None,
        encoding_format: str = "base64",
        **params: Any,
    ) -> Embeddings:
        """One vector per input (a text or token ids), in input order. `params`: OpenAI's
        `dimensions`, vLLM's `normalize` and `truncate_prompt_tokens`, `pooling_type`
        ("last", "mean", "cls"). The vectors travel as base64 float32 unless asked
        otherwise (as the official client does), and come back as floats either way."""
        body = {"model": await self._model(model), "input": input, **params}
        body["encoding_format"] = encoding_format
        return Embeddings.parse(await self._request("POST", "/v1/embeddings", body))

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: dict[str, Any] | None = None,
        *,
        rid: str | None = None,
        session_params: dict[str, Any] | None = None,
        **options: Any,
    ) -> Any:
        """SGLang's native /generate (text, or token ids): {"text", "output_ids", "meta_info"},
        or a list of them, one per sample, with `n` > 1 in `sampling_params`.
        `session_params` ({"id", "rid"?, "offset"?, ...}) continues a session; `options`
        are the other fields (`return_logprob`, `top_logprobs_num`, `logprob_start_len`,
        `return_text_in_logprobs`)."""
        body: dict[str, Any] = {"text" if isinstance(prompt, str) else "input_ids": prompt}
        body |= {"sampling_params": sampling_params or {}, "rid": rid, **options}
        if session_params is not None:
            body["session_params"] = session_params
        response = await self._http.post("/generate", json=body)
        if response.status_code != 200:
            raise APIStatusError(response.status_code, _json(response.content))
        return json.loads(response.content)

    async def open_session(
        self,
        capacity_of_str_len: int,
        session_id: str | None = None,
        idle_timeout: float | None = None,
    ) -> str:
        """A session whose turns' KV the engine keeps; its id. `idle_timeout` is SGLang's
        `timeout`: idle seconds before the server closes it."""
        body = {"capacity_of_str_len": capacity_of_str_len, "session_id": session_id}
        response = await self._http.post("/open_session", json=body | {"timeout": idle_timeout})
        if response.status_code != 200:
            raise APIStatusError(response.status_code, _json(response.content))
        return str(json.loads(response.content))

    async def close_session(self, session_id: str) -> None:
        await self._request("POST", "/close_session", {"session_id": session_id})

    async def loads(self) -> list[dict[str, Any]]:
        """Each data-parallel rank's load (SGLang's /v1/loads)."""
        return list((await self._request("GET", "/v1/loads"))["loads"])

    async def server_info(self) -> dict[str, Any]:
        return await self._request("GET", "/get_server_info")

    async def health_generate(self) -> bool:
        """True if the server generated a token through every actor in time."""
        return (await self._http.get("/health_generate")).status_code == 200

    # -- steering (the server needs --enable-control-api) --------------------------------

    async def start_profile(self, output_dir: str, **options: Any) -> None:
        """Chrome traces of each actor's steps in `output_dir` (on the server's machine);
        options: `num_steps`, `activities` (["CPU", "GPU"]), `record_shapes`, `with_stack`."""
        await self._request("POST", "/start_profile", {"output_dir": output_dir, **options})

    async def stop_profile(self) -> None:
        await self._request("POST", "/stop_profile", {})

    async def set_internal_state(self, **server_args: Any) -> None:
        """Change settings live: `max_num_seqs`."""
        await self._request("POST", "/set_internal_state", {"server_args": server_args})

    async def pause_generation(self, mode: str = "abort") -> None:
        """Pause: "abort" ends open requests with their output so far, "wait" lets them
        finish, "keep" freezes them for `continue_generation`; new requests wait meanwhile."""
        await self._request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._request("POST", "/continue_generation", {})

    async def is_paused(self) -> bool:
        return bool((await self._request("GET", "/is_paused"))["is_paused"])

    async def flush_cache(self) -> None:
        """Drop the prefix cache (APIStatusError 400 while requests are open)."""
        await self._request("POST", "/flush_cache", {})

    async def abort_request(self, rid: str = "", *, abort_all: bool = False) -> None:
        await self._request("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        """{"success", "message", "num_paused_requests"}; a failed update is returned, not
        raised, as the server answers it (400 with success false)."""
        body = {
            "model_path": model_path,
            "weight_version": weight_version,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        return await self._outcome(self._http.post("/update_weights_from_disk", json=body))

    async def update_weights_from_tensor(
        self, safetensors: bytes, *, weight_version: str | None = None, flush_cache: bool = True
    ) -> dict[str, Any]:
        """Install the tensors of a safetensors file (`safetensors.torch.save(tensors)`), some
        or all of the model's, by checkpoint name: {"success", "message"}."""
        params = {"flush_cache": str(flush_cache).lower()}
        if weight_version is not None:
            params["weight_version"] = weight_version
        headers = {"Content-Type": "application/octet-stream"}
        post = self._http.post(
            "/update_weights_from_tensor", content=safetensors, params=params, headers=headers
        )
        return await self._outcome(post)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str | None = None,
    ) -> dict[str, Any]:
        """Join the trainer's torch.distributed world (the trainer is rank 0); returns once
        joined, so the trainer must be joining meanwhile: {"success", "message"}."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self._outcome(self._http.post("/init_weights_update_group", json=body))

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        """Receive one broadcast per tensor from the trainer, which broadcasts them meanwhile,
        in this order: {"success", "message"}."""
        body = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "weight_version": weight_version,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        return await self._outcome(self._http.post("/update_weights_from_distributed", json=body))

    async def destroy_weights_update_group(
        self, group_name: str = "weight_update_group"
    ) -> dict[str, Any]:
        body = {"group_name": group_name}
        return await self._outcome(self._http.post("/destroy_weights_update_group", json=body))

    async def _outcome(self, post: Awaitable[httpx.Response]) -> dict[str, Any]:
        """SGLang's {"success", ...} answer: a failure is returned, not raised, as the server
        answers it (400 with success false); any other error is raised."""
        response = await post
        data = _json(response.content)
        if "success" not in data:
            raise APIStatusError(response.status_code, data)
        return data

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        body = {"name": name, "truncate_size": truncate_size}
        response = await self._http.post("/get_weights_by_name", json=body)
        if response.status_code != 200:
            raise APIStatusError(response.status_code, _json(response.content))
        return [float(v) for v in json.loads(response.content)]

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free the KV cache and/or the weights (default both); generation waits meanwhile."""
        await self._request("POST", "/release_memory_occupation", {"tags": tags})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._request("POST", "/resume_memory_occupation", {"tags": tags})

    async def is_sleeping(self) -> bool:
        return bool((await self._request("GET", "/is_sleeping"))["is_sleeping"])

    async def get_model_info(self) -> dict[str, Any]:
        return await self._request("GET", "/get_model_info")

    async def _model(self, model: str | None) -> str:
        """The given model, or the first one the server lists (asked once)."""
        if model is not None:
            return model
        if self._default_model is None:
            self._default_model = (await self.models())[0].id
        return self._default_model

    async def _request(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        response = await self._http.request(method, path, json=body)
        data = _json(response.content)
        if response.status_code != 200:
            raise APIStatusError(response.status_code, data)
        return data

    async def _stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        async with self._http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                raise APIStatusError(response.status_code, _json(await response.aread()))
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue  # blank separators and comments
                if line == "data: [DONE]":
                    return
                data = json.loads(line[len("data: ") :])
                if "error" in data:
                    raise APIStatusError(200, data)
                yield data


def _json(content: bytes) -> dict[str, Any]:
    try:
        data = json.loads(content)
    except ValueError:
        return {"error": {"message": content.decode(errors="replace")}}
    return data if isinstance(data, dict) else {"error": {"message": str(data)}}
