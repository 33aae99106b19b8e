"""Tests of pkgd_kernels: PyTorch references, and Triton kernels under the interpreter."""
