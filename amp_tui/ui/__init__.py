"""The live dashboard (Textual). It reads a `Source` (amp_tui.sources.protocol) on a timer and never touches
the training loop directly: commands go through `source.send()`, figures come from `snapshot()`.

Entry points: `amp_tui.ui.app.create_app` (the factory the CLI and the tests share) and
`amp_tui.ui.app.run_dashboard` (what `amp-tui train` calls in a terminal).
"""
