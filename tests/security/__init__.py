"""Security tests: what a sandboxed process must not be able to do."""
