"""The read side of a recording, and its format: no torch, no Textual."""
