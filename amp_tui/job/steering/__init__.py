"""Steering a run: the command queue and its handlers, the control socket, the autopilot and the
fix it applies."""
