"""The core: no torch, no Textual. Precision names and ranges, strict JSON, text for people, commands, typed records."""
