"""fuseblock's norms as Hugging Face kernel-hub layers (`fuseblock.hub.layers`), for
`kernels.kernelize` and transformers' `use_kernels=True`; `fuseblock.hub.repository`
writes them out as a local kernel repository (docs/transformers.md)."""
