"""What runs the steps: the driver protocol, amp-tui's own guarded step (the engine driver) and the
user's own loop seen through hooks (the hook driver)."""
