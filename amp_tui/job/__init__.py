"""A run around the trainer: the loop, its commands, the session it writes and its control socket.
Never Textual or Rich."""
