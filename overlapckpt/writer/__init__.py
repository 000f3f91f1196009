"""The writer process: blocking I/O, replay, the writers' group. It never imports the training side."""
