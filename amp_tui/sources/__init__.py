"""What the dashboard reads: one Source protocol, implemented by a live run, a replay and an attached job."""
