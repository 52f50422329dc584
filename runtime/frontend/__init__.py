"""The frontend actor, in the API process: requests in, tokens to text, outputs out."""
