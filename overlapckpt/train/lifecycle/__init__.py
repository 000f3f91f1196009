"""A snapshot's life on the training side: the hooks (step_hooks, engine), requests and schedules, starting, sending, waiting, restarting."""
