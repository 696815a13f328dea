"""The library: the guarded step, probes, diagnosis, guards, local fp32, devices, script loading
and checkpoints. Imports torch; never Textual or Rich."""
