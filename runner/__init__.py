"""lightfleet runner: CLI, schema, compatibility, plan, build, records."""
