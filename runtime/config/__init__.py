"""Configuration and request types: what the engine is told, validated once and passed along
(`engine.EngineConfig`, `sampling.SamplingParams`). No torch here: every process reads them."""
