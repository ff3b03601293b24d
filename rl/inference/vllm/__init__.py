"""vLLM as Relay's GPU inference engine: its command line from the run's config (`args`, also
read by the planner), the process that serves it with Relay's admin routes (`serve`), and the
front that spans a replica over several processes (`front`)."""
