"""A run as it goes on and after: the console and wandb (`tracking`), `rl action=status`
(`status`), and the end-of-run summary and plot (`report`)."""
