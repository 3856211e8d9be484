"""dsec runtimes/container."""
