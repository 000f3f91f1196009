"""The training side's end of the writer process: starting it (fork server or interpreter), talking to it, replacing it."""
