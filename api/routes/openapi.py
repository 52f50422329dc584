"""`GET /openapi.json`: the API described from the same pydantic schemas that validate it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from api.routes import control as control_api
from api.routes.embedding_schemas import EmbeddingRequest, EncodeRequest
from api.routes.native_schemas import CloseSessionRequest, GenerateRequest, OpenSessionRequest
from api.routes.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

# route -> (its request body's schema, what it does)
BODIES: dict[str, tuple[type[BaseModel], str]] = {
    "/v1/completions": (CompletionRequest, "OpenAI completions (streamed with stream=true)"),
    "/v1/chat/completions": (ChatCompletionRequest, "OpenAI chat completions"),
    "/generate": (GenerateRequest, "SGLang's native generate"),
    "/v1/embeddings": (EmbeddingRequest, "OpenAI embeddings (pooled prefills; vLLM's fields)"),
    "/encode": (EncodeRequest, "SGLang's native embeddings"),
    "/tokenize": (TokenizeRequest, "Text or a chat to token ids"),
    "/detokenize": (DetokenizeRequest, "Token ids to text"),
    "/open_session": (OpenSessionRequest, "Open a session; answers its id (SGLang)"),
    "/close_session": (CloseSessionRequest, "Close a session, releasing its KV (SGLang)"),
}
GETS = {
    "/v1/models": "The served model",
    "/get_model_info": "The served model and its weight version (SGLang)",
    "/health": "200 once every actor has answered; 503 naming the one that did not",
    "/metrics": "Prometheus metrics",
    "/openapi.json": "This document",
    "/v1/loads": "Load per data-parallel rank, SGLang's shape (smg reads it)",
    "/get_load": "SGLang's legacy load list",
    "/get_server_info": "Settings, internal states and version (SGLang; alias /server_info)",
    "/health_generate": "200 once one token was generated through every actor; else 503",
}
ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def openapi(version: str, *, control: bool = False) -> dict[str, Any]:
    """An OpenAPI 3.1 document: request bodies exactly as validated, errors as answered.
    `control`: the control routes are on."""
    schemas: dict[str, Any] = {"Error": ERROR}
    paths: dict[str, Any] = {}
    bodies = BODIES | (control_api.BODIES if control else {})
    for path, (model, summary) in bodies.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        body = {"$ref": f"#/components/schemas/{model.__name__}"}
        paths[path] = {
            "post": {
                "summary": summary,
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": body}},
                },
                "responses": _responses(),
            }
        }
    for path, summary in (GETS | (control_api.GETS if control else {})).items():
        paths[path] = {"get": {"summary": summary, "responses": _responses()}}
    for path, summary in (control_api.POSTS if control else {}).items():
        paths[path] = {"post": {"summary": summary, "responses": _responses()}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "trio-llm-runtime", "version": version},
        "paths": paths,
        "components": {"schemas": schemas},
    }


def _responses() -> dict[str, Any]:
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return {
        "200": {"description": "OK (JSON, or server-sent events when streamed)"},
        "4XX": {"description": "A bad request, OpenAI-shaped", **error},
        "503": {"description": "Overloaded, draining, or the engine stopped", **error},
    }
