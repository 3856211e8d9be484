"""dsec edge."""
