"""minikv_gpu: the same steps as ``minikv`` on CUDA kernels (CuPy), or on the CPU simulator.

Module and function names mirror ``minikv`` one for one.
"""
