"""HTTP plumbing shared by every route family: the server state, errors as OpenAI error objects,
SSE streaming, connections, uploads, metrics and request logs."""
