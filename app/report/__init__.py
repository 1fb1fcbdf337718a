"""Reports for people: a request's story (explain), the live queue, run-time estimates."""
