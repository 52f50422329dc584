"""The worker actor: the model, the KV cache tensors, the forward pass and sampling."""
