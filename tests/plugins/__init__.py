"""The strategies' and plugins' tests: one module per strategy (tests/plugins/test_<name>.py)."""
