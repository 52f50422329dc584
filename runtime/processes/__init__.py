"""Process supervision: starting the actors as processes (or tasks), their entry point, and the
private folders of their sockets."""
