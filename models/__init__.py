"""The small GPT built on fuseblock's fused residual stream, its data and its checkpoints."""
