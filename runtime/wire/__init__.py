"""Messages between the actors, their codec, and the nng channels that carry them."""
