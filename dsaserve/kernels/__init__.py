"""Hot-op implementations behind one seam (`registry`): the torch reference and Triton kernels."""
