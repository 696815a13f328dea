"""What a run records: the recorder and its error policy, the records built in the run's words, the
forecasts and what a full disk does."""
