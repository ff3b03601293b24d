"""What every role shares: the config schema and the values derived from it, the records and
wire format that cross process boundaries, the run directory's layout, role start-up (logging,
finding peers, heartbeats), the run token, models and tokenizers, the chat renderer, LoRA's
facts and the packer.

Nothing here imports another package of `rl`; every role package imports from here.
"""
