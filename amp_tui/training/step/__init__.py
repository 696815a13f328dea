"""The guarded step: autocast and the loss scale in force, GradScaler's calibration, the guards and
the update's own guard."""
