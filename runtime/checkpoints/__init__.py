"""Checkpoints: what a model directory says (`model_info`), the model served when none is named,
and the random checkpoints `runtime make-model` writes for tests."""
