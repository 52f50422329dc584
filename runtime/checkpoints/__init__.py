"""Checkpoints: what a model directory says (`model_info`), the model served when none is
named (`default_model`), GGUF files converted into checkpoint directories (`gguf`), and the
random checkpoints `runtime make-model` writes for tests."""
