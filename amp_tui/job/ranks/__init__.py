"""Several ranks, one run: what the ranks agree on at each step, how their words travel, and the
launcher."""
