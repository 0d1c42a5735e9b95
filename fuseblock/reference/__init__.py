"""The torch path, one module per op family: the math as plain differentiable torch ops."""
