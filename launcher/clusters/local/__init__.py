"""cluster=local: every role of the run started on this machine and supervised to the end."""
