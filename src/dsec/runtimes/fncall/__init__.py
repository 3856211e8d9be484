"""dsec runtimes/fncall."""
