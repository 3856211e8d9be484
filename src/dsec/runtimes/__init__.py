"""dsec runtimes."""
