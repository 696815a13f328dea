"""amp-tui inside the training frameworks: a callback that puts the monitor's step boundary where
the framework has its own, so the run is recorded like `amp_tui.monitor` records a loop of your
own, and the dashboard (`amp-tui run`, `amp-tui attach`) steers it.

- `amp_tui.integrations.transformers.AmpTuiCallback(trainer)`: the Hugging Face Trainer.
- `amp_tui.integrations.lightning.AmpTuiCallback()`: Lightning (`lightning` or `pytorch_lightning`).
- Accelerate needs no callback: `amp_tui.monitor(model, optimizer, scaler=accelerator.scaler)`.

amp-tui never requires a framework: each module here imports its own, and says which package to
install when it is missing. See docs/integrations.md.
"""
