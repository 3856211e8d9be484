"""Desktop image, display API and e2b-desktop tests."""
