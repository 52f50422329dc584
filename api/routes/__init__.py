"""The route families, each with a `register(app, state)`: OpenAI's, SGLang's native ones, the
control routes (steering) and the operator routes (health, loads, server info)."""
