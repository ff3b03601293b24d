"""The trainer role: the loss over each step's batch under FSDP2, EP and CP, optimiser steps,
checkpoints and publishing each new policy version (`torchrun -m rl.trainer`)."""
