"""Full screens: the dashboard and the help."""
