"""dturboapp: D-Turbo-VBI in a Flower PyTorch app (a small CNN on Fashion-MNIST)."""
