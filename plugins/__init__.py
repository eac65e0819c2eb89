"""lightfleet plugins: the components that strategies contribute to a run's plan."""
