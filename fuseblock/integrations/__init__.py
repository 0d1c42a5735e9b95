"""Adapters that put other libraries' models on the fused residual stream.

Each submodule imports its library on import, so `import fuseblock` never needs them:
`from fuseblock.integrations.transformers import fuse` needs transformers.
"""
