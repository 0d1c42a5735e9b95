"""The nn.Module layers over the ops, one module per op family: norm.py (Norm, AddNorm),
norm_linear.py (NormLinear), channel_norm.py (BatchNorm, InstanceNorm)."""
