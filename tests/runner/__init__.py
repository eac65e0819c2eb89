"""The runner's tests, in-process and through the command."""
