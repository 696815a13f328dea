"""Where a step broke: the op trace of a failing step, the X-ray of a healthy one, the fix tried on
it and what is kept to replay it."""
