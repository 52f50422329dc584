"""The HTTP serving layer (OpenAI-compatible and SGLang-native) and a trio-native client."""
